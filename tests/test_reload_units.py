"""Hot reload without Kafka: the reloader's checks with the two real models in thread pools, request
coalescing, and `POST /reload` with the reload counter (the routing is in test_switch.py)."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from tools.harness import TINY_MODEL
from worker.classification import Classification, ClassifyRequest
from worker.config import DEFAULT_MODEL_DIR, MetricsSettings, Settings, load_settings
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.inference.switch import SwitchingClassifier
from worker.ops.reload import Reloader
from worker.pipeline.cascade import Cascade
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import Check, TelemetryServer, new_registry
from worker.telemetry.worker import WorkerTelemetry


def _settings(model: Path, **inference: object) -> Settings:
    overrides = {"inference.model": str(model), "inference.pool": "thread", "inference.pool_size": 1}
    return load_settings(
        env={}, overrides={**overrides, **{f"inference.{k}": v for k, v in inference.items()}}
    )


@pytest.fixture
def tiny_switch() -> Iterator[SwitchingClassifier]:
    switch = SwitchingClassifier(open_pool(_settings(TINY_MODEL).inference), closer=lambda pool: pool.close())
    try:
        yield switch
    finally:
        switch.close()


def _reloader(running: Settings, configured: Settings) -> Reloader:
    fallback = resolve_taxonomy(running.inference)[0].fallback_label
    return Reloader(running, lambda: configured, fallback)


def _classify(switch: SwitchingClassifier) -> Classification:
    switch.submit(ClassifyRequest(7, "Where is my card?", time.monotonic() + 30.0))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for request_id, answer in switch.poll(0.1):
            assert request_id == 7
            return answer
    raise AssertionError("no answer")


def test_a_reload_switches_to_the_configured_model(tiny_switch: SwitchingClassifier) -> None:
    running, configured = _settings(TINY_MODEL), _settings(DEFAULT_MODEL_DIR)
    assert tiny_switch.model_id == "tiny"
    with capture_logs() as logs:
        assert _reloader(running, configured).reload(tiny_switch)
    succeeded = [e for e in logs if e["event"] == "reload_succeeded"]
    assert succeeded and succeeded[0]["model"] == "triage-mini"
    assert tiny_switch.model_id == "triage-mini"
    answer = _classify(tiny_switch)
    assert answer.model == "triage-mini" and not answer.fallback


def _cascade_over(switch: SwitchingClassifier) -> Cascade:
    """The running cascade as the pipeline holds it (its stage is not called here)."""
    return Cascade(switch, escalate_below=0.8, window=2, prior_latency_s=0.01, first_contexts=1)


def test_with_the_auto_stage_a_reload_to_other_labels_switches_and_the_cascade_stands_aside(
    tiny_switch: SwitchingClassifier,
) -> None:
    """Running triage-mini (BANKING77) with the default cascade, then the tiny model (8 labels): the new
    model runs, and its unsure answers stand instead of going to a stage that knows other labels; a reload
    back to BANKING77 brings the cascade back."""
    banking77 = resolve_taxonomy(_settings(DEFAULT_MODEL_DIR).inference)[0].labels
    running, tiny = _settings(DEFAULT_MODEL_DIR), _settings(TINY_MODEL)
    reloader = Reloader(running, lambda: tiny, resolve_taxonomy(tiny.inference)[0].fallback_label,
                        escalation_labels=banking77)  # fmt: skip
    cascade = _cascade_over(tiny_switch)
    reloader.start(tiny_switch, cascade)
    try:
        unsure = Classification(
            intent="card_arrival",
            priority="Low",
            confidence=0.3,
            scores={},
            model="tiny",
            latency_ms=1.0,
            truncated=False,
        )
        assert cascade.unsure(unsure)
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
        assert [e["event"] for e in logs if e["event"].startswith("cascade_")] == ["cascade_stands_aside"]
        assert not cascade.unsure(unsure)
        reloader._load = lambda: running  # the configuration edited back (a private seam, for the test)
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
        assert [e["event"] for e in logs if e["event"].startswith("cascade_")] == ["cascade_resumed"]
        assert cascade.unsure(unsure) and tiny_switch.model_id == "triage-mini"
    finally:
        reloader.close()


def test_with_a_named_stage_a_reload_to_other_labels_is_refused(tiny_switch: SwitchingClassifier) -> None:
    banking77 = resolve_taxonomy(_settings(DEFAULT_MODEL_DIR).inference)[0].labels
    running = _settings(DEFAULT_MODEL_DIR, escalation="triage-encoder")
    tiny = _settings(TINY_MODEL, escalation="triage-encoder")
    reloader = Reloader(running, lambda: tiny, resolve_taxonomy(tiny.inference)[0].fallback_label,
                        escalation_labels=banking77)  # fmt: skip
    with capture_logs() as logs:
        assert not reloader.reload(tiny_switch)
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert "changes the label set the running escalation stage was checked against" in failed[0]["reason"]
    assert tiny_switch.model_id == "tiny"


def test_a_broken_model_folder_keeps_the_running_model(
    tiny_switch: SwitchingClassifier, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(TINY_MODEL, broken)
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    with capture_logs() as logs:
        assert not _reloader(_settings(TINY_MODEL), _settings(broken)).reload(tiny_switch)
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert len(failed) == 1 and "cannot load model" in failed[0]["reason"], failed
    assert "\n" not in failed[0]["reason"]
    assert tiny_switch.model_id == "tiny"
    assert _classify(tiny_switch).model == "tiny"


def test_a_reload_names_settings_it_cannot_apply_and_refuses_a_new_fallback_label(
    tiny_switch: SwitchingClassifier, tmp_path: Path
) -> None:
    taxonomy = tmp_path / "taxonomy.toml"
    taxonomy.write_text(
        (TINY_MODEL / "taxonomy.toml")
        .read_text()
        .replace('fallback_intent = "unclassified"', 'fallback_intent = "other"')
    )
    running = _settings(TINY_MODEL)
    configured = msgspec.structs.replace(
        _settings(TINY_MODEL, taxonomy=str(taxonomy)),
        kafka={**running.kafka, "sasl.password": "hunter2-secret"},
        pipeline=msgspec.structs.replace(running.pipeline, max_in_flight=8),
    )
    with capture_logs() as logs:
        assert not _reloader(running, configured).reload(tiny_switch)
    ignored = [e for e in logs if e["event"] == "reload_ignored_settings"]
    assert ignored[0]["settings"] == ["kafka.sasl.password", "pipeline.max_in_flight"]
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert "fallback label other/Medium differs from the running unclassified/Medium" in failed[0]["reason"]
    assert "hunter2" not in repr(logs)
    assert tiny_switch.model_id == "tiny"


def test_requests_during_a_reload_are_coalesced_into_one_more(tiny_switch: SwitchingClassifier) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[float] = []

    def load() -> Settings:
        calls.append(time.monotonic())
        entered.set()
        release.wait(10)
        raise UserError("config error: nothing to load here")

    reloader = Reloader(
        _settings(TINY_MODEL), load, resolve_taxonomy(_settings(TINY_MODEL).inference)[0].fallback_label
    )
    reloader.start(tiny_switch)
    try:
        reloader.request("SIGHUP")
        assert entered.wait(10)
        for _ in range(3):
            reloader.request("SIGHUP")
        release.set()
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(calls) == 2
    finally:
        reloader.close()
    assert tiny_switch.model_id == "tiny"


# -- POST /reload and the counter ------------------------------------------------------------------------


class _Broker:
    state = Check(True, "metadata answered")


def _call(port: int, path: str, method: str) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_post_reload_starts_a_reload_and_the_outcome_is_counted() -> None:
    probes = WorkerProbes(60.0, _Broker(), time.monotonic)  # type: ignore[arg-type]
    info = {"version": "0.1.0", "model": "tiny", "mode": "score", "provider": "cpu", "pool": "process"}
    registry = new_registry()
    registry.register(PipelineCollector(probes, info))
    server = TelemetryServer(MetricsSettings(port=0, host="127.0.0.1"), registry, probes)
    telemetry = WorkerTelemetry(probes, server, None, info)
    try:
        assert _call(server.port, "/reload", "POST")[0] == 404  # not served until the worker wires it
        requested: list[str] = []
        telemetry.serve_reload(lambda: requested.append("http"))
        assert _call(server.port, "/reload", "POST")[0] == 202
        assert requested == ["http"]
        assert _call(server.port, "/reload", "GET")[0] == 405
        assert requested == ["http"]

        settings = _settings(DEFAULT_MODEL_DIR)
        telemetry.reloaded("failed", None, None)
        new_pool = open_pool(settings.inference)
        try:
            telemetry.reloaded("succeeded", settings.inference, new_pool)
        finally:
            new_pool.close()
        families = {
            f.name: f for f in text_string_to_metric_families(_call(server.port, "/metrics", "GET")[1])
        }
        counts = {
            s.labels["outcome"]: s.value
            for s in families["triage_reloads"].samples
            if s.name.endswith("_total")
        }
        assert counts == {"succeeded": 1.0, "failed": 1.0}
        info_labels = families["triage_worker_info"].samples[0].labels
        assert info_labels["model"] == "triage-mini" and info_labels["pool"] == "thread"
        assert families["triage_pool_ready_contexts"].samples[0].value == 1
    finally:
        telemetry.close()


def test_a_reload_refuses_a_taxonomy_the_model_was_not_trained_for(tiny_switch: SwitchingClassifier) -> None:
    foreign = Path(__file__).resolve().parents[1] / "taxonomies" / "default.toml"
    with capture_logs() as logs:
        assert not _reloader(_settings(TINY_MODEL), _settings(TINY_MODEL, taxonomy=str(foreign))).reload(
            tiny_switch
        )
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert "label(s) the model" in failed[0]["reason"] and "account_access" in failed[0]["reason"], failed
    assert tiny_switch.model_id == "tiny" and not _classify(tiny_switch).fallback
