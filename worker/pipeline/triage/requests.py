"""The tickets at the model and at the cascade's escalation stage, each under a request id.

The model answers by request id (`Classifier.submit`/`poll`); this maps an answer back to its ticket. A
ticket at the escalation stage (`cascade.py`) keeps the first stage's answer, which stands if the escalation
stage gives none. Tickets of a partition given up become orphans (`settlements/orphans.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

from worker.classification import Classification
from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.settlements.orphans import Orphans
from worker.pipeline.work import Work


class ModelRequests:
    """Tickets submitted to the model or the escalation stage and not answered yet."""

    def __init__(self) -> None:
        self._at_model: dict[int, Work] = {}
        self._escalated: dict[int, Work] = {}
        self._ids = itertools.count()
        self._orphans = Orphans()

    @property
    def at_model(self) -> int:
        return len(self._at_model)

    @property
    def at_escalation(self) -> int:
        return len(self._escalated)

    @property
    def orphans(self) -> int:
        return self._orphans.count

    def to_model(self, work: Work) -> int:
        """Record that `work` was submitted to the model; returns its request id."""
        request_id = next(self._ids)
        self._at_model[request_id] = work
        return request_id

    def answered(self, request_id: int) -> Work | None:
        """The ticket a model answer belongs to (None for an unknown id); an orphan leaves the count."""
        return self._orphans.back(self._at_model.pop(request_id, None))

    def to_escalation(self, work: Work, first: Classification) -> int:
        """Record that `work`, answered `first` by the first stage, went to the escalation stage; returns
        its request id there."""
        request_id = next(self._ids)
        work.first = first
        self._escalated[request_id] = work
        return request_id

    def escalation_answered(self, request_id: int) -> Work | None:
        """The ticket an escalation answer belongs to (None for an unknown id); an orphan leaves the count."""
        return self._orphans.back(self._escalated.pop(request_id, None))

    def take_out(self, works: Collection[Work]) -> tuple[list[Work], list[Work]]:
        """Take `works` out (those of them at the model, and those at the escalation stage, orphans left
        alone): their answers, when they come, belong to no ticket and are discarded."""
        taken: tuple[list[Work], list[Work]] = ([], [])
        for out, found in ((self._at_model, taken[0]), (self._escalated, taken[1])):
            for request_id, work in list(out.items()):
                if work in works and not work.orphan:
                    del out[request_id]
                    found.append(work)
        return taken

    def pending(self, keys: Collection[TopicPartitionKey]) -> int:
        """Tickets of `keys` not answered yet (orphans excluded)."""
        out = [*self._at_model.values(), *self._escalated.values()]
        return sum(1 for work in out if not work.orphan and work.partition_key in keys)

    def give_up(self, keys: Collection[TopicPartitionKey]) -> None:
        """This worker no longer owns `keys`: their tickets out become orphans."""
        self._orphans.adopt([*self._at_model.values(), *self._escalated.values()], keys)

    def __len__(self) -> int:
        return len(self._at_model) + len(self._escalated)
