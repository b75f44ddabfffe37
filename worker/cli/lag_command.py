"""`triage-worker lag-exporter`: the consumer group's lag, read from the broker, for Prometheus.

Each worker exports the lag it sees (`triage_consumer_lag`), which vanishes exactly when every worker is down
and the backlog matters most. This process reads the group's committed offsets and the topic's end offsets
from the broker at each scrape (`GroupLagReader`, the quantity KEDA's Kafka scaler scales on), so the
dashboard and the lag alerts keep working with no worker running. Run one per group, next to Prometheus.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.errors import UserError
from worker.kafka.admin import GroupLagReader
from worker.kafka.clients import ClientErrorLog, producer_config
from worker.logs import configure_logging, librdkafka_logger
from worker.settings import add_config_argument, settings_from_args
from worker.telemetry.server import Probes, TelemetryServer

DEFAULT_PORT = 9401
# How often the client's queued lines and errors are logged (whether or not anyone scrapes).
_SERVE_CLIENT_EVERY_S = 1.0
_log = structlog.get_logger("worker.lag")


class GroupLagCollector(Collector):
    """At each scrape: `triage_group_lag{group,topic,partition}` and whether the read worked."""

    def __init__(self, read: Callable[[], dict[int, int]], group: str, topic: str) -> None:
        self._read = read
        self._group = group
        self._topic = topic
        self._last_problem: str | None = None

    def collect(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "triage_group_lag",
            "End offset minus the group's committed offset, per partition, read from the broker.",
            labels=["group", "topic", "partition"],
        )
        ok = GaugeMetricFamily(
            "triage_group_lag_read_ok",
            "1 when the last scrape read the lag from the broker, 0 when it could not (see the log).",
            labels=["group", "topic"],
        )
        try:
            partitions = self._read()
        except UserError as error:
            if str(error) != self._last_problem:  # once per change, not once per scrape
                _log.warning("lag_read_failed", reason=str(error))
            self._last_problem = str(error)
            ok.add_metric([self._group, self._topic], 0)
        else:
            if self._last_problem is not None:
                _log.info("lag_read_recovered")
            self._last_problem = None
            for partition, value in sorted(partitions.items()):
                lag.add_metric([self._group, self._topic, str(partition)], value)
            ok.add_metric([self._group, self._topic], 1)
        yield lag
        yield ok


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "lag-exporter",
        help="serve the consumer group's lag, read from the broker, on /metrics (works with no worker up)",
        description=(
            "Serve triage_group_lag{group,topic,partition} (end offset minus committed offset, read from the "
            "broker at each scrape, as KEDA's Kafka scaler computes it) until Ctrl-C or SIGTERM."
        ),
    )
    add_config_argument(parser)
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers")
    parser.add_argument("--group", help="consumer group (default: pipeline.group_id)")
    parser.add_argument("--topic", help="topic (default: topics.input)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    parser.add_argument("--host", help="address to bind (default: metrics.host)")
    parser.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, {"kafka.bootstrap.servers": args.bootstrap_servers})
    configure_logging(settings.log, settings.privacy)
    group = args.group or settings.pipeline.group_id
    topic = args.topic or settings.topics.input
    # Its client's lines and errors in the configured format, one per cause and interval.
    reader = GroupLagReader(
        producer_config(settings.kafka), librdkafka_logger(), ClientErrorLog("lag-exporter")
    )
    registry = CollectorRegistry()
    registry.register(GroupLagCollector(lambda: reader.read(group, topic), group, topic))
    metrics = msgspec.structs.replace(
        settings.metrics, port=args.port, host=args.host or settings.metrics.host
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    signal.signal(signal.SIGINT, lambda _signum, _frame: stop.set())
    with TelemetryServer(metrics, registry, Probes()) as server:
        print(
            f"lag of group {group} on {topic}: http://{metrics.host}:{server.port}/metrics",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(_SERVE_CLIENT_EVERY_S):
            reader.serve()
    return 0
