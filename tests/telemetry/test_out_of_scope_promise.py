"""Issue #59: the worker exports its model's out-of-scope promise beside the live counters, and the alert
rule fires when the live share of "none of these" answers stays over twice it (drift or new intents)."""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import yaml
from doubles import HealthyBroker

from tools import REPO
from worker.inference.encoder import MANIFEST, read_manifest
from worker.pipeline.metrics import PipelineMetrics
from worker.settings import DEFAULT_ESCALATION_DIR
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import new_registry
from worker.telemetry.worker import WorkerTelemetry

EXPECTED = "triage_out_of_scope_expected_ratio"


def _worker(model: Path, escalation_stage: Path | None = None) -> tuple[PipelineMetrics, Any]:
    """A worker's telemetry attached as the application attaches it, serving `model` (and the cascade's
    `escalation_stage`); (its pipeline metrics, a function returning a scrape as {name: value})."""
    probes = WorkerProbes(60.0, HealthyBroker(), lambda: 0.0)  # type: ignore[arg-type]
    telemetry = WorkerTelemetry(probes=probes)
    metrics = PipelineMetrics()
    telemetry.attach(metrics, "m", 1, model=model, escalation_stage=escalation_stage)
    registry = new_registry()
    registry.register(PipelineCollector(probes, telemetry.info))

    def scrape() -> dict[str, float]:
        return {sample.name: sample.value for family in registry.collect() for sample in family.samples}

    return metrics, scrape


def _without_detector(tmp_path: Path) -> Path:
    """The shipped encoder stage with its out-of-scope statistics left out (a folder written before)."""
    folder = tmp_path / "no-detector"
    shutil.copytree(DEFAULT_ESCALATION_DIR, folder, ignore=shutil.ignore_patterns("model.onnx", "*.npz"))
    shutil.copyfile(DEFAULT_ESCALATION_DIR / "head.npz", folder / "head.npz")
    manifest = msgspec.structs.replace(read_manifest(folder), out_of_scope=None)
    (folder / MANIFEST).write_bytes(msgspec.json.encode(manifest))
    return folder


def test_a_worker_serving_a_folder_with_a_detector_exports_its_promise(tmp_path: Path) -> None:
    """The shipped stage was fitted for 2 %: served as the model or as the cascade's stage, its worker
    says so; a folder without a detector, or a model with no stage behind it, exports 0."""
    assert _worker(DEFAULT_ESCALATION_DIR)[1]()[EXPECTED] == 0.02
    genai = tmp_path / "genai"  # a first stage that is no encoder stage: the cascade's detector serves
    genai.mkdir()
    (genai / "genai_config.json").write_text("{}")
    assert _worker(genai, escalation_stage=DEFAULT_ESCALATION_DIR)[1]()[EXPECTED] == 0.02
    assert _worker(_without_detector(tmp_path))[1]()[EXPECTED] == 0.0
    assert _worker(genai)[1]()[EXPECTED] == 0.0


def _rule() -> tuple[float, float, str]:
    """TriageOutOfScopeAbovePromise's (multiple of the promise, fewest tickets in the window, window)."""
    document = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    rules = {rule["alert"]: rule for group in document["groups"] for rule in group["rules"]}
    expr = rules["TriageOutOfScopeAbovePromise"]["expr"]
    factor = re.search(rf"> ([0-9.]+) \* max by \(instance\) \({EXPECTED} > 0\)", expr)
    fewest = re.search(r"increase\(triage_classified_total\[(\w+)\]\)\) > ([0-9]+)", expr)
    windows = set(re.findall(r"\[(\w+)\]", expr))
    assert factor and fewest and windows == {"1h"}, expr
    return float(factor.group(1)), float(fewest.group(2)), fewest.group(1)


def _fires(before: dict[str, float], after: dict[str, float]) -> bool:
    """The rule's condition over one window between two scrapes (rate ratios are ratios of increases)."""
    factor, fewest, _ = _rule()
    classified = after["triage_classified_total"] - before["triage_classified_total"]
    flagged = after["triage_out_of_scope_total"] - before["triage_out_of_scope_total"]
    promise = after[EXPECTED]
    return promise > 0 and classified > fewest and flagged / classified > factor * promise


def test_the_alert_fires_when_the_live_share_stays_over_twice_the_promise() -> None:
    """An hour at 3 % "none of these" against a 2 % promise is within it; an hour at 5 % fires; so few
    tickets that a handful decide the share never do."""
    metrics, scrape = _worker(DEFAULT_ESCALATION_DIR)
    hours = [scrape()]
    for classified, flagged in ((1000, 30), (1000, 50), (100, 20)):
        metrics.classified += classified
        metrics.out_of_scope += flagged
        hours.append(scrape())
    assert [_fires(a, b) for a, b in itertools.pairwise(hours)] == [False, True, False]
