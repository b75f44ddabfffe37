"""`triage-worker broker start|stop|status|transactions|fetch` and `triage-worker topics create`.

The broker commands drive the local development broker (real Apache Kafka from Maven Central jars, see
`worker/dev/local_broker.py`); `topics create` works against any cluster the settings point at.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any

from worker.cache import cache_root
from worker.dev import kafka_tools, local_broker
from worker.errors import UserError
from worker.kafka.admin import create_topics, worker_topics
from worker.settings import add_config_argument, settings_from_args

SASL_USER = "triage"
SASL_CLIENT_FILE = local_broker.SASL_CLIENT_FILE


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    broker = subparsers.add_parser(
        "broker",
        help="run a local Apache Kafka broker (no Docker needed)",
        description=(
            f"Local single-node Kafka (KRaft; {local_broker.KAFKA_VERSION} unless --kafka-version or "
            f"{local_broker.KAFKA_VERSION_ENV} names another release, 3.9.0 or later), from jars Maven "
            f"resolves into {cache_root() / 'kafka' / '<version>'} (override with "
            "TRIAGE_KAFKA_HOME). Needs java and mvn."
        ),
    )
    actions = broker.add_subparsers(title="actions", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start the broker in the background and wait until it is ready")
    start.add_argument(
        "--port", type=int, default=local_broker.DEFAULT_PORT, help="client port (default 9092)"
    )
    start.add_argument(
        "--sasl-ssl-port",
        type=int,
        metavar="PORT",
        help=(
            f"also serve SASL_SSL (SCRAM-SHA-512 user {SASL_USER!r}, a local CA) on PORT; client settings "
            f"go to <state-dir>/{SASL_CLIENT_FILE} (pass it with --config)"
        ),
    )
    start.add_argument(
        "--fresh",
        action="store_true",
        help="wipe topics and messages of earlier runs first (only a state folder the broker made)",
    )
    start.add_argument(
        "--brokers",
        type=int,
        choices=(1, local_broker.CLUSTER_SIZE),
        default=1,
        help=(
            f"1 (default): one combined node; {local_broker.CLUSTER_SIZE}: a local cluster of three combined "
            "broker+controller nodes on ports PORT..PORT+2, replication factor 3 and min.insync.replicas 2 "
            "for internal and new topics"
        ),
    )
    _add_kafka_version(start)
    _add_state_dir(start)
    start.set_defaults(handler=_start)

    stop = actions.add_parser("stop", help="stop the broker (SIGTERM, then SIGKILL after 30 s)")
    _add_state_dir(stop)
    stop.set_defaults(handler=_stop)

    status = actions.add_parser(
        "status", help="say whether the broker runs, where, and its log file (exit code 3 when stopped)"
    )
    _add_state_dir(status)
    status.set_defaults(handler=_status)

    transactions = actions.add_parser(
        "transactions",
        help="list, describe, find hanging and abort transactions with Kafka's own tool (Java + Maven)",
        description=(
            "Runs Kafka's TransactionsCommand (what kafka-transactions.sh runs; org.apache.kafka:kafka-tools "
            "from Maven Central, fetched once, so Java 17+ and mvn are needed) against any cluster: "
            "find-hanging --topic T [--partitions P ...] [--max-transaction-timeout MINUTES], "
            "describe-producers --topic T --partition P, abort --topic T --partition P --start-offset O, "
            "list, describe --transactional-id ID. A worker in exactly-once mode names the partitions "
            "(hanging_transaction_suspected) to give it."
        ),
    )
    transactions.add_argument(
        "--bootstrap-servers",
        metavar="SERVERS",
        help="the cluster (default $KAFKA_BOOTSTRAP_SERVERS, else the local broker or cluster)",
    )
    _add_kafka_version(transactions)
    _add_state_dir(transactions)
    transactions.add_argument("tool_arguments", nargs=argparse.REMAINDER, metavar="ACTION ...")
    transactions.set_defaults(handler=_transactions)

    fetch = actions.add_parser("fetch", help="resolve the broker's jars from Maven Central (once)")
    _add_kafka_version(fetch)
    fetch.set_defaults(handler=_fetch)

    topics = subparsers.add_parser("topics", help="manage the worker's Kafka topics")
    topic_actions = topics.add_subparsers(title="actions", metavar="ACTION", required=True)
    create = topic_actions.add_parser(
        "create",
        help=(
            "create the input, output and dead-letter topics, the shadow's side topic when a shadow is "
            "configured, and the review and feedback topics when review is on (existing ones are left alone)"
        ),
    )
    add_config_argument(create)
    create.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers, host:port")
    create.set_defaults(handler=_create_topics)


def _add_kafka_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kafka-version",
        metavar="VERSION",
        help=(
            f"the Kafka release to run, 3.9.0 or later, resolved from Maven Central (default "
            f"${local_broker.KAFKA_VERSION_ENV}, else {local_broker.KAFKA_VERSION})"
        ),
    )


def _kafka_version(args: argparse.Namespace) -> str:
    if args.kafka_version is None:
        return local_broker.configured_kafka_version()
    return local_broker.parse_kafka_version(args.kafka_version, "--kafka-version")


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"broker data, logs and pid file (default {local_broker.default_state_dir()})",
    )


def _saved_password(client_file: Path) -> str | None:
    """The password a restart on the same data must keep: its SCRAM credential is in the metadata."""
    try:
        with client_file.open("rb") as handle:
            password = tomllib.load(handle).get("kafka", {}).get("sasl.password")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return password if isinstance(password, str) else None


def _write_client_file(path: Path, options: dict[str, str]) -> None:
    # JSON string escapes are valid TOML; the file holds a password, so only its owner may read it.
    lines = ["[kafka]", *(f"{json.dumps(key)} = {json.dumps(value)}" for key, value in options.items())]
    path.touch(mode=0o600)
    path.write_text("\n".join(lines) + "\n")


def _start(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir or local_broker.default_state_dir()
    if args.brokers != 1:
        return _start_cluster(args, state_dir)
    client_file = state_dir / SASL_CLIENT_FILE
    sasl_ssl = None
    if args.sasl_ssl_port is not None:
        password = (None if args.fresh else _saved_password(client_file)) or secrets.token_urlsafe(18)
        sasl_ssl = local_broker.SaslSsl(args.sasl_ssl_port, {SASL_USER: password})
    broker = local_broker.LocalBroker(
        state_dir, args.port, sasl_ssl=sasl_ssl, kafka_version=_kafka_version(args)
    )
    before = broker.status()
    status = broker.start(fresh=args.fresh)
    if before.running:
        print(f"already running (pid {status.pid})")
    print(f"bootstrap: {status.bootstrap}")
    if sasl_ssl is not None and not before.running:
        _write_client_file(client_file, broker.sasl_ssl_client_config(SASL_USER))
        where = f"user {SASL_USER}; client settings: --config {client_file}"
        print(f"SASL_SSL:  {broker.sasl_ssl_bootstrap} ({where})")
    print(f"log file:  {status.log_file}")
    return 0


def _start_cluster(args: argparse.Namespace, state_dir: Path) -> int:
    """`broker start --brokers 3`: the three-node cluster in `state_dir` (no SASL_SSL listener)."""
    if args.sasl_ssl_port is not None:
        raise UserError("--sasl-ssl-port is for the single broker; leave it out with --brokers 3")
    cluster = local_broker.LocalCluster(state_dir, args.port, kafka_version=_kafka_version(args))
    cluster.start(fresh=args.fresh)
    print(f"bootstrap: {cluster.bootstrap}")
    for node in cluster.nodes:
        print(f"node {node.node_id}:    {node.bootstrap}, log file {node.log_file}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir or local_broker.default_state_dir()
    if local_broker.LocalCluster.exists(state_dir):
        print("stopped" if local_broker.LocalCluster(state_dir).stop() else "not running")
        return 0
    broker = local_broker.LocalBroker(args.state_dir)
    print("stopped" if broker.stop() else "not running")
    return 0


def _cluster_status(state_dir: Path) -> int:
    """Each node's state; exit code 3 unless every node runs."""
    cluster = local_broker.LocalCluster(state_dir)
    running = cluster.running()
    print(f"cluster:   {len(running)} of {len(cluster.nodes)} nodes running")
    print(f"bootstrap: {cluster.bootstrap}")
    for node in cluster.nodes:
        status = node.status()
        state = f"running (pid {status.pid})" if status.running else "stopped"
        print(f"node {node.node_id}:    {state}, log file {status.log_file}")
    return 0 if len(running) == len(cluster.nodes) else 3


def _status(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir or local_broker.default_state_dir()
    if local_broker.LocalCluster.exists(state_dir):
        return _cluster_status(state_dir)
    status = local_broker.LocalBroker(args.state_dir).status()
    if status.running:
        print(f"running (pid {status.pid})")
        print(f"bootstrap: {status.bootstrap}")
    if status.kafka_version is not None:
        print(f"kafka:     {status.kafka_version}")
    else:
        print("not running")
    print(f"log file:  {status.log_file}")
    return 0 if status.running else 3


def _transactions(args: argparse.Namespace) -> int:
    """`broker transactions ACTION ...`: Kafka's TransactionsCommand against the named or local cluster."""
    bootstrap = args.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or _local_bootstrap(args)
    return kafka_tools.run_transactions(bootstrap, args.tool_arguments, _kafka_version(args))


def _local_bootstrap(args: argparse.Namespace) -> str:
    state_dir: Path = args.state_dir or local_broker.default_state_dir()
    if local_broker.LocalCluster.exists(state_dir):
        return local_broker.LocalCluster(state_dir).bootstrap
    status = local_broker.LocalBroker(state_dir).status()
    if status.bootstrap is None:
        raise UserError("no local broker runs; name the cluster with --bootstrap-servers")
    return status.bootstrap


def _fetch(args: argparse.Namespace) -> int:
    version = _kafka_version(args)
    print(f"Kafka {version} jars: {local_broker.fetch_jars(version=version)}")
    return 0


def _create_topics(args: argparse.Namespace) -> int:
    # Imported here: the assembly point loads ONNX Runtime GenAI (the inference room), which creating topics
    # does not need.
    from worker.app.application import with_zero_shot_review

    settings = with_zero_shot_review(
        settings_from_args(args, {"kafka.bootstrap.servers": args.bootstrap_servers})
    )
    specs = worker_topics(
        settings.topics,
        shadow=settings.inference.shadow_settings() is not None,
        review=settings.review.enabled,
    )
    outcomes = create_topics(settings.kafka, specs)
    for spec in specs:
        if outcomes[spec.name] == "created":
            layout = f"partitions={spec.partitions}, replication_factor={spec.replication_factor}"
            print(f"{spec.name}: created ({layout})")
        else:
            print(f"{spec.name}: already exists (left unchanged)")
    return 0
