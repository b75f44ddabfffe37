"""The shadow model end to end, on the real broker with both real models: the primary's output is what it is
without a shadow, the side topic has one record per classified ticket (less the counted drops), and
`shadow report` counts what the side topic holds."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tools.harness import (
    TINY_MODEL,
    Topics,
    Worker,
    audit,
    make_topics,
    publish,
    read_topic,
    settings_for,
    wait_until_committed,
)
from worker.app.doors import TriageParts, group_pipeline
from worker.app.stages import SHADOW_NICENESS
from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.cli.cli import main
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.kafka.clients import create_producer
from worker.messages import ShadowResult
from worker.pipeline.side_topics.shadow import Shadow
from worker.settings import DEFAULT_MODEL_DIR, InferenceSettings

# The test model in one thread: the pool these tests classify with.
_ONE_THREAD = InferenceSettings(model=str(TINY_MODEL), pool="thread", pool_size=1)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
# Side records are never in the primary's transactions: either guarantee, the same promises.
BOTH_GUARANTEES = pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])


def _group() -> str:
    return f"triage-shadow-{uuid.uuid4().hex[:8]}"


def _primary_answers(bootstrap: str, topics: Topics) -> dict[tuple[int, int], tuple[object, ...]]:
    report = audit(bootstrap, topics)
    assert report.lost == [] and report.duplicates == 0 and report.misrouted == []
    return {
        position: (r.ticket_id, r.intent, r.priority, r.fallback, r.fallback_reason)
        for position, (r,) in report.results.items()
    }


def _side_records(bootstrap: str, topic: str) -> list[ShadowResult]:
    decoder = msgspec.json.Decoder(ShadowResult)
    return [decoder.decode(message.value() or b"") for message in read_topic(bootstrap, topic)]


def _children_niceness(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    # /proc/PID/stat: the fields after the ")" that ends the name start at field 3; nice is field 19.
    return [int(Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[16]) for c in children]


def _settled(worker: Worker, timeout: float) -> None:
    """Until the shadow has answered or dropped every ticket offered and its records are acknowledged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = worker.metrics()
        shadow = metrics[-1]["shadow"] if metrics else None
        if shadow is not None and shadow["outstanding"] == 0:
            settled = shadow["produced"] + shadow["delivery_failed"] + sum(shadow["dropped"].values())
            if settled == shadow["offered"] == metrics[-1]["classified"]:
                return
        time.sleep(0.5)
    raise AssertionError(f"the shadow did not settle in {timeout}s:\n{worker.tail()}")


@BOTH_GUARANTEES
def test_the_shadow_changes_no_primary_result_and_its_side_topic_and_report_add_up(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    guarantee: str,
) -> None:
    topics = make_topics(unique_topic)
    count = 200
    publish(kafka_bootstrap, topics, count, malformed_ratio=0.1, seed=31)
    # Deadlines no loaded machine misses: the runs are compared by their models' answers.
    sets = {"pipeline.deadline_ms": "120000", "pipeline.guarantee": guarantee}
    plain = Topics(topics.input, unique_topic("triaged-plain"), unique_topic("dlq-plain", partitions=1))
    Worker(kafka_bootstrap, plain, _group(), tmp_path, "plain", sets).run_to_completion(timeout=240)

    side = unique_topic("shadow")
    group = _group()
    shadow_sets = {**sets, "inference.shadow_model": str(DEFAULT_MODEL_DIR), "topics.shadow": side}
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, "shadowed", shadow_sets)
    try:
        worker.wait_for("pipeline_started", timeout=120)
        # The shadow's one process runs at a lower CPU priority than the primary's.
        assert _children_niceness(worker.process.pid).count(SHADOW_NICENESS) == 1
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=240, worker=worker)
        _settled(worker, timeout=120)
        assert worker.stop() == 0
    finally:
        worker.kill()

    # 1. The primary output is the same as without the shadow.
    primary = _primary_answers(kafka_bootstrap, topics)
    assert primary == _primary_answers(kafka_bootstrap, plain)
    classified = {position: answer for position, answer in primary.items() if not answer[3]}
    assert len(classified) > 100

    # 2. One side record per classified ticket, less the drops the metrics count.
    final = worker.metrics()[-1]
    assert final["kind"] == "final"
    shadow = final["shadow"]
    records = _side_records(kafka_bootstrap, side)
    positions = [(r.source.partition, r.source.offset) for r in records]
    assert len(set(positions)) == len(positions)  # at most one per ticket
    dropped = sum(shadow["dropped"].values())
    assert shadow["offered"] == final["classified"] == len(classified)
    assert shadow["delivery_failed"] == 0 and shadow["dropped"].get("shutdown", 0) == 0
    assert len(records) == shadow["produced"] == len(classified) - dropped > 0
    for record, position in zip(records, positions, strict=True):
        ticket_id, intent, priority, _, _ = classified[position]  # never a fallback's or a dead letter's
        assert (record.ticket_id, record.primary_intent, record.primary_priority) == (
            ticket_id,
            intent,
            priority,
        )
        assert record.model == "triage-mini" and record.primary_model != record.model
    compared = [r for r in records if not r.fallback]
    agreed = sum(1 for r in compared if r.intent == r.primary_intent)
    assert (shadow["agreed"], shadow["disagreed"]) == (agreed, len(compared) - agreed)

    # 3. The report counts what the side topic holds.
    capsys.readouterr()
    assert main(["shadow", "report", "--bootstrap-servers", kafka_bootstrap, "--topic", side, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["records"], report["tickets"], report["duplicates"]) == (len(records), len(records), 0)
    assert (report["compared"], report["agreed"]) == (len(compared), agreed)
    assert sum(row["compared"] for row in report["intents"]) == len(compared)
    assert sum(pair["count"] for pair in report["disagreements"]) == len(compared) - agreed
    assert sum(report["shadow_fallbacks"].values()) == len(records) - len(compared)
    assert main(["shadow", "report", "--bootstrap-servers", kafka_bootstrap, "--topic", side]) == 0
    text = capsys.readouterr().out
    assert f"agreement: {agreed}/{len(compared)}" in text and "primary intent" in text
    with capsys.disabled():
        print(f"\n[shadow] {len(classified)} classified, dropped {shadow['dropped']}:\n{text}")


class _SilentShadow:
    """A shadow model that never answers."""

    model_id = "silent@test"

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, _request: ClassifyRequest) -> None:
        self.submitted += 1

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        assert timeout == 0.0
        return []


@BOTH_GUARANTEES
def test_a_shadow_that_never_answers_holds_back_no_result_and_no_commit(
    kafka_bootstrap: str, unique_topic: Callable[..., str], guarantee: str
) -> None:
    topics = make_topics(unique_topic)
    count = 120
    publish(kafka_bootstrap, topics, count, malformed_ratio=0.0, seed=32)
    group = _group()
    side = unique_topic("shadow")
    settings = settings_for(
        kafka_bootstrap,
        topics,
        **{"pipeline.group_id": group, "topics.shadow": side, "pipeline.guarantee": guarantee},
    )
    silent = _SilentShadow()
    shadow = Shadow(silent, 2, create_producer(settings.kafka), side, budget_s=2.0)
    outcome: dict[str, Any] = {}
    with open_pool(_ONE_THREAD, *resolve_taxonomy(_ONE_THREAD)) as pool:
        parts = TriageParts(pool, FallbackLabel("unclassified", "Medium"), 2, shadow=shadow)
        pipeline = group_pipeline(settings, parts)
        thread = threading.Thread(target=lambda: outcome.update(code=pipeline.run()), daemon=True)
        thread.start()
        try:
            wait_until_committed(kafka_bootstrap, group, topics.input, timeout=120)
        finally:
            pipeline.request_stop()
            thread.join(60)
    assert outcome == {"code": 0}
    report = audit(kafka_bootstrap, topics)
    assert len(report.inputs) == count and report.lost == [] and report.duplicates == 0
    classified = pipeline.metrics.classified
    assert shadow.metrics.offered == classified > 0 and silent.submitted == 2
    assert shadow.metrics.dropped == {"full": classified - 2, "shutdown": 2}
    assert _side_records(kafka_bootstrap, side) == []


def test_a_missing_side_topic_is_one_line_for_run_and_report(
    kafka_bootstrap: str, unique_topic: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    topics = make_topics(unique_topic)
    missing = f"test.no-such-side-topic.{uuid.uuid4().hex[:8]}"
    common = ["--bootstrap-servers", kafka_bootstrap]
    run = ["run", *common, "--input-topic", topics.input, "--output-topic", topics.output]
    run += [
        "--dead-letter-topic",
        topics.dead_letter,
        "--shadow-model",
        str(TINY_MODEL),
        "--shadow-topic",
        missing,
    ]
    assert main(run) == 2
    assert f"topic(s) {missing} do not exist" in capsys.readouterr().err
    assert main(["shadow", "report", *common, "--topic", missing]) == 2
    assert f"side topic {missing!r} does not exist" in capsys.readouterr().err
