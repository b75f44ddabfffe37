"""The cascade end to end: the embedded model (triage-mini) answers first, the shipped encoder stage
(models/triage-encoder) takes the tickets it is unsure of; a real broker, the worker as a process, the
escalation stage as configured by default (`inference.escalation = "auto"`).

`escalate_below = 1.0` makes every classified ticket one the cascade wants to escalate, so each record must
show either the escalation stage's answer or why the gate kept the first one.
"""

from __future__ import annotations

import collections
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tools import REPO
from tools.harness import Audit, Worker, audit, make_topics, publish, wait_until_committed
from worker.messages import TriageResult
from worker.settings import DEFAULT_ESCALATION_DIR

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CASCADE = {"inference.escalate_below": "1.0"}


def _group() -> str:
    return f"triage-cascade-{uuid.uuid4().hex[:8]}"


def _records(report: Audit) -> list[TriageResult]:
    return [record for records in report.results.values() for record in records]


def _run(
    bootstrap: str, topics_factory: Callable[..., str], tmp_path: Path, count: int, rate: float,
    settings: dict[str, str], before_start: bool = False,
) -> tuple[Audit, Worker, float]:  # fmt: skip
    """`count` tickets (10 % malformed) through one cascade worker until committed; with `before_start` they
    are all published before the worker starts (a backlog), else at `rate` once it is assigned."""
    topics = make_topics(topics_factory)
    group = _group()
    if before_start:
        publish(bootstrap, topics, count, malformed_ratio=0.1, seed=23)
    worker = Worker(bootstrap, topics, group, tmp_path, "cascade", {**CASCADE, **settings}, model=None)
    try:
        worker.wait_for("pipeline_started", timeout=180)
        started = time.monotonic()
        if not before_start:
            publish(bootstrap, topics, count, rate=rate, malformed_ratio=0.1, seed=23)
        wait_until_committed(bootstrap, group, topics.input, timeout=420, worker=worker)
        took = time.monotonic() - started
        assert worker.stop() == 0
    finally:
        worker.kill()
    report = audit(bootstrap, topics)
    assert len(report.inputs) == count
    assert report.lost == [] and report.misrouted == [] and report.duplicates == 0
    return report, worker, took


def test_unsure_tickets_are_answered_by_the_encoder_stage_and_every_record_says_which_stage(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    report, worker, took = _run(kafka_bootstrap, unique_topic, tmp_path, 300, 25.0, {})
    records = _records(report)
    escalated = [r for r in records if r.stage == "escalation"]
    kept = [r for r in records if r.stage == "first" and not r.fallback]
    print(f"\n[cascade] {len(records)} records in {took:.0f} s: {len(escalated)} escalated, "
          f"skipped {collections.Counter(r.escalation_skipped for r in kept)}")  # fmt: skip
    assert escalated, "nothing was escalated"
    for record in escalated:
        assert record.model.startswith("triage-encoder")
        assert record.first_intent is not None and record.first_confidence is not None
        assert record.first_confidence < 1.0 and not record.fallback
    # Every first answer was under the threshold: each one that stood says why.
    assert all(r.escalation_skipped in ("deadline", "overloaded", "error") for r in kept)
    assert all(r.stage in ("first", "escalation") for r in records if not r.fallback)
    final = worker.metrics()[-1]
    outcomes = final["escalation"]["escalated"]
    assert outcomes["changed"] + outcomes["confirmed"] == len(escalated)
    assert outcomes["failed"] + sum(final["escalation"]["skipped"].values()) == len(kept)
    start = worker.events("cascade_started")[0]
    assert start["escalation"].startswith("triage-encoder") and start["window"] == 2


def test_with_an_escalation_llm_unsure_tickets_are_decided_among_the_encoders_top_candidates(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """`inference.escalation_llm`: the worker's escalated records are the LLM's choice among the encoder
    stage's top k (the embedded model as the LLM), or, when it had no time or the encoder found the ticket out
    of scope, the encoder stage's own answer; `model` says which."""
    llm = {
        "inference.escalation_llm": str(REPO / "models" / "triage-mini"),
        "inference.escalation_top_k": "3",
    }
    report, worker, _ = _run(kafka_bootstrap, unique_topic, tmp_path, 120, 20.0, llm)
    escalated = [r for r in _records(report) if r.stage == "escalation"]
    decided = [r for r in escalated if r.model == "triage-mini"]
    assert decided, "the LLM decided nothing"
    for record in decided:
        # Its scores: the 3 candidates and the encoder's other top intents, probabilities over the taxonomy.
        assert record.first_intent is not None and len(record.scores) >= 3
        assert record.intent == next(iter(record.scores))
        assert record.confidence == record.scores[record.intent]
        assert 0.0 < record.confidence <= 1.0 and sum(record.scores.values()) <= 1.0 + 1e-6
    assert all(r.model.startswith("triage-encoder") for r in escalated if r not in decided)
    assert worker.events("cascade_started")[0]["escalation"] == "triage-mini"


def test_under_a_1_ms_deadline_nothing_is_escalated_and_every_ticket_still_gets_one_record(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    report, worker, _ = _run(kafka_bootstrap, unique_topic, tmp_path, 200, 0.0, {"pipeline.deadline_ms": "1"})
    records = _records(report)
    assert len(records) == sum(1 for kind in report.inputs.values() if kind == "ticket")
    assert not [r for r in records if r.stage == "escalation"]
    assert all(r.escalation_skipped in (None, "deadline") for r in records)
    final = worker.metrics()[-1]["escalation"]
    assert final["escalated"] == {"changed": 0, "confirmed": 0, "failed": 0}
    assert final["skipped"]["overloaded"] == 0


def test_under_overload_escalations_are_shed_before_the_first_stage_misses_a_deadline(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """A backlog of 1,500 tickets taken at once (max_in_flight 2,000) with 1.5 s each: more than the first
    stage can answer in time, so it must shed some (`overloaded` fallbacks). The cascade sheds its
    escalations first: the first `escalation_skipped: overloaded` record comes before the first record the
    first stage could not answer in time."""
    settings = {"pipeline.max_in_flight": "2000", "pipeline.deadline_ms": "1500"}
    report, _, _ = _run(kafka_bootstrap, unique_topic, tmp_path, 1500, 0.0, settings, before_start=True)
    records = _records(report)
    missed = sorted(r.classified_at for r in records if r.fallback)
    shed = sorted(r.classified_at for r in records if r.escalation_skipped == "overloaded")
    escalated = sum(r.stage == "escalation" for r in records)
    print(f"\n[cascade overload] {len(records)} records: {len(missed)} first-stage misses, "
          f"{len(shed)} escalations shed, {escalated} escalated")  # fmt: skip
    assert missed, "the first stage kept up: no overload to test"
    assert shed and shed[0] < missed[0]


def test_a_stage_whose_encoder_was_never_fetched_runs_no_cascade_says_why_and_starts_no_maven(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Issue 55: with the stage's encoder neither in its folder nor in the user cache, `run` started Maven (a
    connection besides the broker and the registry). It runs the first stage alone and logs why."""
    stage = tmp_path / "triage-encoder"
    shutil.copytree(DEFAULT_ESCALATION_DIR, stage, ignore=shutil.ignore_patterns("model.onnx"))
    maven_log = tmp_path / "mvn.log"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mvn").write_text(f'#!/bin/sh\necho "$@" >> {maven_log}\nexit 1\n')
    (tmp_path / "bin" / "mvn").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": str(tmp_path)}
    topics = make_topics(unique_topic)
    group = _group()
    publish(kafka_bootstrap, topics, 20, seed=5)
    settings = {**CASCADE, "inference.escalation": str(stage)}
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, "no-encoder", settings, model=None, env=env)
    try:
        worker.wait_for("pipeline_started", timeout=180)
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=180, worker=worker)
        assert worker.stop() == 0
    finally:
        worker.kill()
    assert not maven_log.exists(), f"Maven was started: {maven_log.read_text()}"
    (off,) = worker.events("cascade_off")
    assert off["reason"].startswith(f"{stage}: its encoder model.onnx is not downloaded yet: run ")
    assert "`triage-worker model fetch`" in off["reason"]
    assert not any(record.stage == "escalation" for record in _records(audit(kafka_bootstrap, topics)))
