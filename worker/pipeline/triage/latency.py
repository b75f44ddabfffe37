"""The model time a ticket is expected to need, from the pool's recent answers.

While the pool is busy, `Pipeline._dispatch` answers `overloaded` at once, without model time, a ticket
whose deadline comes before now + this estimate: it would most likely miss anyway, and the model time is
better spent on one that can make it.

The estimate is the median of the last `window` measured latencies. A median, not a mean or an EWMA: one
slow outlier (a long ticket, a restarted pool process) pulls a mean up and would refuse tickets that would
have made it, while the median moves only once most recent tickets are slow. `Classification.latency_ms`
is the time in a context (queueing in the pool excluded), so a refused ticket would miss even if a context
were free now. Answers that ran no model step (the pool's own `overloaded`) are left out; `deadline_exceeded`
ones are kept: their latency is a lower bound of the real one, so a model slower than every deadline still
raises the estimate. With fewer than `min_samples` answers there is no estimate (0: every ticket is tried).
"""

from __future__ import annotations

import collections
import statistics

from worker.classification import Classification


class LatencyEstimate:
    """Median model latency of the last `window` answers, in seconds (`expected_s`)."""

    def __init__(self, window: int = 64, min_samples: int = 8, refresh: int = 16) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._refresh = refresh
        # The median is recomputed every `refresh` answers, not per ticket: the loop asks for it once per
        # dispatched ticket, up to ~50,000 times a second with an instant classifier.
        self._until_refresh = min_samples
        self.expected_s = 0.0

    def observe(self, answer: Classification) -> None:
        if answer.fallback_reason == "overloaded":
            return
        self._samples.append(answer.latency_ms / 1000.0)
        self._until_refresh -= 1
        if self._until_refresh <= 0:
            self.expected_s = statistics.median(self._samples)
            self._until_refresh = self._refresh
