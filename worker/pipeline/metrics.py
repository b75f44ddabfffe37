"""Counters and gauges of the pipeline, logged as one `metrics` event at an interval and at shutdown.

They are plain integers updated by the single consumer thread; a log line is the export format (JSON logs
feed any collector, and the end-to-end tests read them, e.g. `in_flight_max` and `rss_bytes`).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Any


def current_rss_bytes() -> int | None:
    """This process's resident set size now (not the peak), or None where /proc is not available."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class PipelineMetrics:
    consumed: int = 0
    # Records re-delivered for an offset already being processed (after a seek back); skipped.
    redelivered: int = 0
    classified: int = 0
    fallback: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_lettered: int = 0
    produced: int = 0
    delivery_failed: int = 0
    # Offsets released by a commit the broker confirmed.
    committed: int = 0
    commit_failed: int = 0
    # Results of partitions revoked or lost while their ticket was at the model: the new owner redoes them.
    discarded_after_revoke: int = 0
    revoked: int = 0
    lost: int = 0
    max_poll_exceeded: int = 0
    in_flight: int = 0
    in_flight_max: int = 0
    paused: bool = False

    def snapshot(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "redelivered": self.redelivered,
            "classified": self.classified,
            "fallback": dict(self.fallback),
            "dead_lettered": self.dead_lettered,
            "produced": self.produced,
            "delivery_failed": self.delivery_failed,
            "committed": self.committed,
            "commit_failed": self.commit_failed,
            "discarded_after_revoke": self.discarded_after_revoke,
            "partitions_revoked": self.revoked,
            "partitions_lost": self.lost,
            "max_poll_exceeded": self.max_poll_exceeded,
            "in_flight": self.in_flight,
            "in_flight_max": self.in_flight_max,
            "paused": self.paused,
            "rss_bytes": current_rss_bytes(),
        }
