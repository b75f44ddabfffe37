"""The Grafana dashboard and the Prometheus alert rules: they parse, and every metric they query is one the
worker exports (a renamed metric must break this test, not a dashboard in production). With Go installed,
Prometheus' own rule loader and PromQL parser check them too (deploy/promcheck, as `promtool check rules`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools import REPO
from worker.cli.lag_command import GroupLagCollector
from worker.pipeline.metrics import LATENCY_BUCKETS_S, PartitionGauges, PipelineMetrics
from worker.telemetry.collectors import ModelProcessCollector, PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import Check, new_registry

DEPLOY = REPO / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "triage-worker.json"
# Grafana's variables, replaced by what they stand for so the queries are plain PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$job": "triage-worker", "$instance": ".*"}
METRIC = re.compile(r"\b((?:triage|process)_[a-z_]+|up)\b(?!\s*\()")


class _Broker:
    state = Check(True, "metadata answered")


def exported_names() -> set[str]:
    """Every sample name a busy worker and the lag exporter export (with _total, _bucket, _count, _sum,
    _info suffixes)."""
    metrics = PipelineMetrics(consumed=1, loop_turned_at=0.0)
    metrics.fallback["overloaded"] += 1
    metrics.dead_letter("invalid_json")
    metrics.partitions = PartitionGauges(
        assigned=(("t", 0),), blocked=(("t", 0),), lag=((("t", 0), 1),), member=True
    )
    probes = WorkerProbes(60.0, _Broker(), lambda: 1.0)  # type: ignore[arg-type]
    probes.metrics, probes.pool_contexts, probes.warm_contexts = metrics, 1, 1
    registry = new_registry()
    registry.register(PipelineCollector(probes, {"version": "0", "model": "m"}))
    model_processes = ModelProcessCollector()
    model_processes.pools["primary"] = lambda: [os.getpid()]
    registry.register(model_processes)
    registry.register(GroupLagCollector(lambda: {0: 5}, "g", "t"))
    return {sample.name for family in registry.collect() for sample in family.samples} | {"up"}


def _alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append(expr)
    return queries


def _metrics_in(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(METRIC.findall(without_strings))


def test_alert_rules_are_complete_and_query_exported_metrics() -> None:
    rules = _alert_rules()
    assert len(rules) >= 8
    names = exported_names()
    for rule in rules:
        assert rule["alert"].startswith("Triage"), rule
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        used = _metrics_in(rule["expr"])
        assert used, rule["alert"]
        assert used <= names, f"{rule['alert']} queries metrics the worker does not export: {used - names}"
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_latency_thresholds_sit_on_bucket_bounds() -> None:
    """`histogram_quantile(...) > N` interpolates inside a bucket: with N between two bounds the alert fires
    on a guess. Every latency threshold must be a bound of the exported buckets."""
    thresholds = [
        float(match)
        for rule in _alert_rules()
        if "histogram_quantile" in rule["expr"]
        for match in re.findall(r"\)\s*>\s*([0-9.]+)\s*$", rule["expr"].strip())
    ]
    assert thresholds, "no latency alert found"
    assert all(threshold in LATENCY_BUCKETS_S for threshold in thresholds), thresholds


def test_lag_comes_from_the_broker_not_from_the_workers() -> None:
    """The dashboard's lag and the lag alerts read `triage_group_lag` (lag-exporter, from the broker): a
    worker's own `triage_consumer_lag` vanishes exactly when every worker is down."""
    queries = _dashboard_queries() + [rule["expr"] for rule in _alert_rules()]
    lag_queries = [query for query in queries if "_lag" in query]
    assert lag_queries and all("triage_group_lag" in query for query in lag_queries), lag_queries
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["triage-lag"]["static_configs"][0]["targets"] == ["lag-exporter:9401"]


def test_dashboard_is_well_formed_and_queries_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "triage-worker"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    names = exported_names()
    queries = _dashboard_queries()
    used = set().union(*map(_metrics_in, queries))
    assert used <= names, f"the dashboard queries metrics the worker does not export: {used - names}"
    # The panels the issue asks for: throughput, latency percentiles, fallbacks, lag, in flight.
    titles = " | ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for wanted in ("records per second", "end to end", "fallbacks by reason", "consumer lag", "in flight"):
        assert wanted in titles
    assert any("histogram_quantile(0.99" in query for query in queries)


def test_grafana_provisioning_and_compose_mounts_point_at_the_dashboard() -> None:
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/triage-worker.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/triage-worker.json:{path}/triage-worker.json:ro" in mounts
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_latency_panels_show_exemplars_that_open_the_ticket_s_trace() -> None:
    """The latency panels ask for the exemplars the worker's histograms carry (a sampled ticket's
    `trace_id`), Grafana's Prometheus data source links that label to the provisioned trace data source, and
    Compose's Prometheus keeps exemplars (it drops them without the feature flag)."""
    dashboard = json.loads(DASHBOARD.read_text())
    latency_panels = [
        panel
        for panel in dashboard["panels"]
        if panel["type"] == "timeseries"
        and any("_seconds_bucket" in target["expr"] for target in panel["targets"])
    ]
    with_exemplars = {
        panel["title"]: [target["legendFormat"] for target in panel["targets"] if target.get("exemplar")]
        for panel in latency_panels
    }
    assert with_exemplars == {
        "End to end (poll → acknowledged)": ["p99"],
        "Model": ["p99"],
        "Queue wait (poll → model)": ["p99"],
    }
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    sources = {source["uid"]: source for source in provisioned["datasources"]}
    [link] = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id"
    assert sources[link["datasourceUid"]]["type"] in {"jaeger", "tempo"}
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]


@pytest.fixture(scope="module")
def promcheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: Prometheus' parser (deploy/promcheck) cannot be built")
    binary = tmp_path_factory.mktemp("promcheck") / "promcheck"
    built = subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=DEPLOY / "promcheck",
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if built.returncode != 0 and "dial tcp" in built.stderr:
        pytest.skip(
            f"deploy/promcheck needs its Go modules and the proxy is unreachable: {built.stderr[-300:]}"
        )
    assert built.returncode == 0, built.stderr
    return binary


def test_prometheus_accepts_the_rules_and_the_dashboard_queries(promcheck: Path) -> None:
    rules = subprocess.run([promcheck, "rules", ALERTS], capture_output=True, text=True, check=False)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    queries = subprocess.run(
        [promcheck, "exprs"],
        input="\n".join(_dashboard_queries()),
        capture_output=True,
        text=True,
        check=False,
    )
    assert queries.returncode == 0, queries.stdout + queries.stderr
