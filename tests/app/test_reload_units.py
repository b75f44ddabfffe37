"""Hot reload without Kafka: the reloader's checks with the two real models in thread pools, request
coalescing, and `POST /reload` with the reload counter (the routing is in tests/inference/test_switch.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from doubles import HealthyBroker
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from tools import REPO
from tools.harness import TINY_MODEL
from worker.app.reload import Reloader
from worker.classification import Classification, ClassifyRequest
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.inference.out_of_scope import OUT_OF_SCOPE_FILE, read_statistics, write_statistics
from worker.inference.pool import open_pool
from worker.inference.switch import SwitchingClassifier
from worker.pipeline.triage.cascade import Cascade
from worker.settings import (
    DEFAULT_ESCALATION_DIR,
    DEFAULT_MODEL_DIR,
    MetricsSettings,
    Settings,
    load_settings,
)
from worker.telemetry.access import ReloadAccess
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import TelemetryServer, new_registry
from worker.telemetry.worker import WorkerTelemetry


def _settings(model: Path, **inference: object) -> Settings:
    overrides = {"inference.model": str(model), "inference.pool": "thread", "inference.pool_size": 1}
    return load_settings(
        env={}, overrides={**overrides, **{f"inference.{k}": v for k, v in inference.items()}}
    )


@pytest.fixture
def tiny_switch() -> Iterator[SwitchingClassifier]:
    inference = _settings(TINY_MODEL).inference
    pool = open_pool(inference, *resolve_taxonomy(inference))
    switch = SwitchingClassifier(pool, closer=lambda pool: pool.close())
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


def test_a_reload_to_an_encoder_stage_that_finds_the_canary_out_of_scope_switches(
    tiny_switch: SwitchingClassifier, tmp_path: Path
) -> None:
    """A team's encoder stage says "none of these" to the canary (a banking ticket): a model that answers."""
    folder = tmp_path / "stage"
    shutil.copytree(DEFAULT_ESCALATION_DIR, folder, symlinks=True)
    stored, vote = read_statistics(folder / OUT_OF_SCOPE_FILE, 384, 77)
    write_statistics(
        folder / OUT_OF_SCOPE_FILE, dataclasses.replace(stored, threshold=-1.0), vote
    )  # all out of scope
    configured = _settings(folder)
    assert _reloader(_settings(TINY_MODEL), configured).reload(tiny_switch)
    answer = _classify(tiny_switch)
    assert answer.model == "stage" and answer.out_of_scope and answer.intent == "unclassified"


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
    named = [e for e in logs if e["event"] == "reload_needs_restart"]
    assert named[0]["settings"] == ["kafka.sasl.password", "pipeline.max_in_flight"]
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert "fallback label other/Medium differs from the running unclassified/Medium" in failed[0]["reason"]
    assert "hunter2" not in repr(logs)
    assert tiny_switch.model_id == "tiny"


def _changed(settings: Settings, **sections: dict[str, object]) -> Settings:
    """`settings` with fields of some sections replaced (`pipeline={"max_in_flight": 8}`)."""
    replaced = {
        name: {**getattr(settings, name), **fields}
        if name == "kafka"
        else msgspec.structs.replace(getattr(settings, name), **fields)
        for name, fields in sections.items()
    }
    return msgspec.structs.replace(settings, **replaced)


class _Heard:
    """What a reloader told the worker: the pending restarts after each reload, and the settings applied."""

    def __init__(self) -> None:
        self.pending: list[list[str]] = []
        self.applied: list[Settings] = []


def _heard_reloader(
    running: Settings, configured: Settings, switch: SwitchingClassifier
) -> tuple[Reloader, _Heard]:
    heard = _Heard()
    fallback = resolve_taxonomy(running.inference)[0].fallback_label
    reloader = Reloader(running, lambda: configured, fallback, on_pending=heard.pending.append)
    reloader.start(switch, None, heard.applied.append)
    return reloader, heard


def test_a_reload_names_every_restart_only_change_in_one_line_secrets_masked_and_says_a_restart_is_pending(
    tiny_switch: SwitchingClassifier,
) -> None:
    """Before, only kafka, topics, pipeline, log and metrics were compared: a changed shadow, tracing,
    registry, input or output setting went unnamed, and nothing said a restart was pending."""
    running = _settings(TINY_MODEL)
    configured = _changed(
        running,
        kafka={"sasl.password": "hunter2-secret"},
        pipeline={"max_in_flight": 8},
        topics={"output": "tickets.triaged.v2"},
        inference={"shadow_pool_size": 2, "escalation_top_k": 3, "max_ticket_tokens": 128},
        input={"fields": {"body": "description"}},
        output={"format": "avro"},
        schema_registry={"url": "http://user:s3cret@registry:8081", "basic_auth_user_info": "user:s3cret"},
        tracing={"sample_ratio": 0.5},
        log={"level": "debug"},
        metrics={"stall_timeout_ms": 90000},
    )
    restart_only = [
        "inference.escalation_top_k",
        "inference.shadow_pool_size",
        "input.fields",
        "kafka.sasl.password",
        "log.level",
        "metrics.stall_timeout_ms",
        "output.format",
        "pipeline.max_in_flight",
        "schema_registry.basic_auth_user_info",
        "schema_registry.url",
        "topics.output",
        "tracing.sample_ratio",
    ]
    reloader, heard = _heard_reloader(running, configured, tiny_switch)
    try:
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
        named = [e for e in logs if e["event"] == "reload_needs_restart"]
        assert len(named) == 1 and sorted(named[0]["settings"]) == restart_only
        values = named[0]["values"]
        assert values["pipeline.max_in_flight"] == {"running": 64, "configured": 8}
        assert values["kafka.sasl.password"] == {"running": None, "configured": "***"}
        assert values["schema_registry.url"]["configured"] == "http://user:***@registry:8081"
        assert "hunter2" not in repr(logs) and "s3cret" not in repr(logs)
        succeeded = [e for e in logs if e["event"] == "reload_succeeded"]
        assert succeeded[0]["applied"] == ["inference.max_ticket_tokens"]
        assert heard.pending == [restart_only]
        # What runs: the live change applied, every restart-only one at its running value.
        assert heard.applied[0].inference.max_ticket_tokens == 128
        assert heard.applied[0].pipeline == running.pipeline and heard.applied[0].kafka == running.kafka
        assert heard.applied[0].inference.shadow_pool_size == running.inference.shadow_pool_size

        with capture_logs() as logs:  # still configured, still pending: the running values stayed
            assert reloader.reload(tiny_switch)
        assert (
            sorted(next(e for e in logs if e["event"] == "reload_needs_restart")["settings"]) == restart_only
        )
        reloader._load = lambda: running  # the configuration set back (a private seam, for the test)
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
        assert not [e for e in logs if e["event"] == "reload_needs_restart"]
        assert heard.pending[-1] == []
    finally:
        reloader.close()


def test_a_reload_that_changes_a_refused_setting_fails_loudly_and_applies_nothing(
    tiny_switch: SwitchingClassifier,
) -> None:
    """privacy.phone_region decides which phone numbers the logs of processes that are not reloaded find:
    before, a reload switched the model and the new region was silently not applied."""
    running = _settings(TINY_MODEL)
    configured = _changed(_settings(DEFAULT_MODEL_DIR), privacy={"phone_region": "GB", "keep": ["email"]})
    with capture_logs() as logs:
        assert not _reloader(running, configured).reload(tiny_switch)
    assert tiny_switch.model_id == "tiny"  # nothing else applied either
    reloader, heard = _heard_reloader(running, configured, tiny_switch)
    try:
        with capture_logs() as logs:
            assert not reloader.reload(tiny_switch)
    finally:
        reloader.close()
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert len(failed) == 1 and failed[0]["reason"].startswith("privacy.phone_region changed, which a reload")
    assert "restart the worker" in failed[0]["reason"]
    assert heard.applied == [] and heard.pending == [["privacy.phone_region"]]
    assert tiny_switch.model_id == "tiny"


def test_privacy_and_redaction_changes_are_applied_by_a_reload(tiny_switch: SwitchingClassifier) -> None:
    running = _settings(TINY_MODEL, redact_input=False)
    configured = _changed(
        _settings(TINY_MODEL),
        privacy={"detect": ["email", "iban"], "keep": ["iban"], "carry_headers": ["x-request-id"]},
        dead_letter={"redact": True},
    )
    reloader, heard = _heard_reloader(running, configured, tiny_switch)
    try:
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
    finally:
        reloader.close()
    assert not [e for e in logs if e["event"] == "reload_needs_restart"] and heard.pending == [[]]
    applied = heard.applied[0]
    assert (applied.privacy, applied.dead_letter) == (configured.privacy, configured.dead_letter)
    assert applied.inference.redact_input
    succeeded = next(e for e in logs if e["event"] == "reload_succeeded")
    assert sorted(succeeded["applied"]) == [
        "dead_letter.redact",
        "inference.redact_input",
        "privacy.carry_headers",
        "privacy.detect",
        "privacy.keep",
    ]


def test_review_settings_apply_where_review_runs_and_turning_it_on_needs_a_restart(
    tiny_switch: SwitchingClassifier,
) -> None:
    off = _settings(TINY_MODEL)
    on = _changed(off, review={"threshold": 0.5})
    reloader, heard = _heard_reloader(off, on, tiny_switch)
    try:
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
    finally:
        reloader.close()
    assert next(e for e in logs if e["event"] == "reload_needs_restart")["settings"] == ["review.threshold"]
    assert heard.applied[0].review == off.review and heard.pending == [["review.threshold"]]

    stricter = _changed(on, review={"threshold": 0.9, "fallbacks": True})
    reloader, heard = _heard_reloader(on, stricter, tiny_switch)
    try:
        with capture_logs() as logs:
            assert reloader.reload(tiny_switch)
    finally:
        reloader.close()
    assert not [e for e in logs if e["event"] == "reload_needs_restart"]
    assert heard.applied[0].review == stricter.review and heard.pending == [[]]


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


TOKEN = "0123456789abcdef-unit-test-token"


def _call(port: int, path: str, method: str, token: str | None = None) -> tuple[int, str]:
    """`token`: sent as `Authorization: Bearer`."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None
    )
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _telemetry(access: ReloadAccess) -> WorkerTelemetry:
    probes = WorkerProbes(60.0, HealthyBroker(), time.monotonic)  # type: ignore[arg-type]
    info = {"version": "0.1.0", "model": "tiny", "mode": "score", "provider": "cpu", "pool": "process"}
    registry = new_registry()
    registry.register(PipelineCollector(probes, info))
    server = TelemetryServer(MetricsSettings(port=0, host="127.0.0.1"), registry, probes)
    return WorkerTelemetry(probes, server, None, info, reload_access=access)


def _taken(requested: list[str]) -> Callable[[], bool]:
    """A reloader that is never busy, remembering each request."""

    def request() -> bool:
        requested.append("http")
        return True

    return request


def test_post_reload_starts_a_reload_and_the_outcome_is_counted() -> None:
    telemetry = _telemetry(ReloadAccess(TOKEN.encode()))
    assert telemetry.server is not None
    server = telemetry.server
    try:
        assert _call(server.port, "/reload", "POST", TOKEN)[0] == 404  # not served until the worker wires it
        requested: list[str] = []
        telemetry.serve_reload(_taken(requested))
        assert _call(server.port, "/reload", "POST", TOKEN)[0] == 202
        assert requested == ["http"]
        assert _call(server.port, "/reload", "GET", TOKEN)[0] == 405
        assert requested == ["http"]

        settings = _settings(DEFAULT_MODEL_DIR)
        telemetry.reloaded("failed", None, None)
        new_pool = open_pool(settings.inference, *resolve_taxonomy(settings.inference))
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
    foreign = REPO / "taxonomies" / "default.toml"
    with capture_logs() as logs:
        assert not _reloader(_settings(TINY_MODEL), _settings(TINY_MODEL, taxonomy=str(foreign))).reload(
            tiny_switch
        )
    failed = [e for e in logs if e["event"] == "reload_failed"]
    assert "label(s) the model" in failed[0]["reason"] and "account_access" in failed[0]["reason"], failed
    assert tiny_switch.model_id == "tiny" and not _classify(tiny_switch).fallback


def _refusal_of(port: int, authorization: str | None) -> tuple[int, dict[str, str], str | None]:
    """Status, JSON body and `WWW-Authenticate` of a `POST /reload` with that `Authorization` header."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reload", method="POST", data=b"")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read()), None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers.get("WWW-Authenticate")


def test_post_reload_needs_the_token_while_metrics_and_probes_stay_open() -> None:
    telemetry = _telemetry(ReloadAccess(TOKEN.encode()))
    assert telemetry.server is not None
    port = telemetry.server.port
    requested: list[str] = []
    telemetry.serve_reload(_taken(requested))
    try:
        with capture_logs() as logs:
            status, body, challenge = _refusal_of(port, None)
            assert (status, body["status"], challenge) == (401, "refused", 'Bearer realm="reload"')
            assert "Authorization: Bearer" in body["reason"]
            assert _refusal_of(port, f"Basic {TOKEN}")[0] == 401  # not bearer credentials
            assert _refusal_of(port, "Bearer ")[0] == 401
            status, body, challenge = _refusal_of(port, f"Bearer {TOKEN}x")
            assert (status, body["reason"], challenge) == (403, "POST /reload refused: wrong token", None)
            assert _refusal_of(port, f"Bearer {TOKEN[:-1]}")[0] == 403
            assert requested == []
            assert _refusal_of(port, f"bearer  {TOKEN} ")[0] == 202  # the scheme is case-insensitive
            assert requested == ["http"]
            for path in ("/metrics", "/healthz", "/readyz"):  # scraping needs no token
                assert _call(port, path, "GET")[0] in (200, 503), path
        refused = [(log["status"], log["client"]) for log in logs if log["event"] == "reload_refused"]
        # One line per reason and interval: the later 401s and the second 403 are counted, not logged.
        assert refused == [("401 Unauthorized", "127.0.0.1"), ("403 Forbidden", "127.0.0.1")]
        assert TOKEN[:-1] not in str(logs)
    finally:
        telemetry.close()


def test_without_a_token_file_post_reload_is_closed_and_says_to_use_sighup() -> None:
    access = ReloadAccess.configured(MetricsSettings(port=0))
    assert access.closed
    telemetry = _telemetry(access)
    assert telemetry.server is not None
    requested: list[str] = []
    telemetry.serve_reload(_taken(requested))
    try:
        for authorization in (None, f"Bearer {TOKEN}", "Bearer "):
            status, body, challenge = _refusal_of(telemetry.server.port, authorization)
            assert (status, body["status"], challenge) == (403, "refused", None)
            assert "closed" in body["reason"] and "SIGHUP" in body["reason"]
        assert requested == []
    finally:
        telemetry.close()


def test_reloads_go_one_at_a_time_and_post_reload_is_refused_meanwhile(
    tiny_switch: SwitchingClassifier,
) -> None:
    """Before: each request while one loaded was queued, and 30 parallel POSTs started 6 reloads."""
    entered, release = threading.Event(), threading.Event()
    calls: list[float] = []

    def load() -> Settings:
        calls.append(time.monotonic())
        entered.set()
        release.wait(10)
        raise UserError("config error: nothing to load here")

    running = _settings(TINY_MODEL)
    reloader = Reloader(running, load, resolve_taxonomy(running.inference)[0].fallback_label)
    telemetry = _telemetry(ReloadAccess(TOKEN.encode()))
    assert telemetry.server is not None
    port = telemetry.server.port
    telemetry.serve_reload(lambda: reloader.request_unless_busy("POST /reload"))
    reloader.start(tiny_switch)
    try:
        assert _call(port, "/reload", "POST", TOKEN)[0] == 202
        assert entered.wait(10)
        barrier = threading.Barrier(30)
        answers: list[tuple[int, str]] = []

        def knock() -> None:
            barrier.wait(10)
            answers.append(_call(port, "/reload", "POST", TOKEN))

        knockers = [threading.Thread(target=knock) for _ in range(30)]
        for knocker in knockers:
            knocker.start()
        for knocker in knockers:
            knocker.join(30)
        assert [status for status, _ in answers] == [409] * 30
        assert json.loads(answers[0][1])["status"] == "busy"
        reloader.request("SIGHUP")  # a signal is still taken, and coalesced into one more reload
        reloader.request("SIGHUP")
        release.set()
        deadline = time.monotonic() + 10
        while _call(port, "/reload", "POST", TOKEN)[0] == 409 and time.monotonic() < deadline:
            time.sleep(0.05)  # "ask again after it"
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert len(calls) == 3  # the first POST, the two SIGHUPs as one, the POST after them
    finally:
        reloader.close()
        telemetry.close()
    assert tiny_switch.model_id == "tiny"


def test_readiness_and_metrics_say_a_restart_is_pending_without_failing_readiness() -> None:
    telemetry = _telemetry(ReloadAccess(None))
    assert telemetry.server is not None and telemetry.probes is not None
    port = telemetry.server.port
    try:
        status, body = _call(port, "/readyz", "GET")
        assert json.loads(body)["restart_pending"] == []
        families = {f.name: f for f in text_string_to_metric_families(_call(port, "/metrics", "GET")[1])}
        assert families["triage_restart_pending"].samples[0].value == 0
        assert families["triage_config_restart_pending"].samples == []

        telemetry.restart_pending(["kafka.sasl.password", "pipeline.max_in_flight"])
        pending_status, pending_body = _call(port, "/readyz", "GET")
        answer = json.loads(pending_body)
        assert answer["restart_pending"] == ["kafka.sasl.password", "pipeline.max_in_flight"]
        # Not a check: readiness is what it was (the worker serves with the settings it started with).
        assert pending_status == status and answer["checks"] == json.loads(body)["checks"]
        families = {f.name: f for f in text_string_to_metric_families(_call(port, "/metrics", "GET")[1])}
        assert families["triage_restart_pending"].samples[0].value == 2
        per_setting = {
            s.labels["setting"]: s.value for s in families["triage_config_restart_pending"].samples
        }
        assert per_setting == {"kafka.sasl.password": 1.0, "pipeline.max_in_flight": 1.0}

        telemetry.restart_pending([])
        assert json.loads(_call(port, "/readyz", "GET")[1])["restart_pending"] == []
    finally:
        telemetry.close()
