"""Does static membership (`group.instance.id`) spare the group rebalances when one worker restarts?

Two consumers (A, B) share a 6-partition topic in the pipeline's configuration (cooperative-sticky, manual
commits). B is restarted (closed, then a new consumer with the same settings) and the script counts what A
sees: rebalance callbacks and how long B's partitions had no owner. Then B is stopped for good (a scale-in or
a rolling update that replaces the pod under a new name) to see how long its partitions stay unowned.

    python deploy/experiments/static_membership.py --bootstrap 127.0.0.1:9092 [--static]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

import confluent_kafka
from confluent_kafka.admin import AdminClient, NewTopic

SESSION_TIMEOUT_MS = 10000


class Member(threading.Thread):
    """A consumer that polls in its own thread and records every assignment change with a timestamp."""

    def __init__(self, name: str, bootstrap: str, group: str, topic: str, static: bool) -> None:
        super().__init__(daemon=True)
        config: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.auto.commit": False,
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": 1000,
        }
        if static:
            config["group.instance.id"] = f"{group}-{name}"
        self.name, self.topic = name, topic
        self.consumer = confluent_kafka.Consumer(config)
        self.events: list[tuple[float, str, list[int]]] = []
        self.owned: set[int] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        def on_assign(consumer: Any, partitions: list[Any]) -> None:
            self.owned |= {tp.partition for tp in partitions}
            self.events.append((time.monotonic(), "assign", sorted(tp.partition for tp in partitions)))

        def on_revoke(consumer: Any, partitions: list[Any]) -> None:
            self.owned -= {tp.partition for tp in partitions}
            self.events.append((time.monotonic(), "revoke", sorted(tp.partition for tp in partitions)))

        self.consumer.subscribe([self.topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)
        while not self.stop.is_set():
            self.consumer.poll(0.1)
        self.consumer.close()


def wait_for(predicate: Any, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError
        time.sleep(0.05)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--static", action="store_true")
    args = parser.parse_args()
    topic, group = f"static-exp-{uuid.uuid4().hex[:6]}", f"static-exp-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    admin.create_topics([NewTopic(topic, 6, 1)])[topic].result()
    everything = set(range(6))

    a = Member("a", args.bootstrap, group, topic, args.static)
    b = Member("b", args.bootstrap, group, topic, args.static)
    a.start()
    wait_for(lambda: a.owned == everything, 30)
    b.start()
    wait_for(lambda: a.owned and b.owned and a.owned | b.owned == everything, 60)
    time.sleep(2)
    b_partitions = set(b.owned)
    print(f"static={args.static}: steady, a={sorted(a.owned)} b={sorted(b_partitions)}")

    # 1. Restart B (a container restart in the same pod: same name, same group.instance.id).
    a_events = len(a.events)
    b.stop.set()
    b.join()
    time.sleep(1.0)  # the process restarting
    b2 = Member("b", args.bootstrap, group, topic, args.static)
    b2.start()
    # Settled: B owns partitions again and nothing moved for 3 s, or A owns everything (B got nothing).
    owned_again = wait_for(lambda: b2.owned and a.owned | b2.owned == everything, 60)
    time.sleep(3)
    seen = a.events[a_events:]
    print(
        f"  restart: B owns {sorted(b2.owned)} again {owned_again:.1f}s after the new consumer started; "
        f"A saw {len(seen)} assignment change(s): {[(kind, parts) for _, kind, parts in seen]}"
    )

    # 2. B goes away for good (scale-in, or a rolling update that replaces the pod under a new name).
    b2.stop.set()
    b2.join()
    took = wait_for(lambda: a.owned == everything, SESSION_TIMEOUT_MS / 1000 * 3)
    print(
        f"  scale-in: A owns every partition {took:.1f}s after B stopped "
        f"(session.timeout.ms {SESSION_TIMEOUT_MS})"
    )
    a.stop.set()
    a.join()


if __name__ == "__main__":
    main()
