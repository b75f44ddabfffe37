"""What a source outside any consumer or share group answers to the loop's calls about groups: nothing to do.

A file's lines (`lines.py`) and a replay's assigned dead-letter partitions (`worker/replay/source.py`) have
nothing to pause and no member to keep alive while the loop holds back or stops (the lines are read only as
the model has room, a replay reads only when the loop wants records), no rebalance callback in a read, no
record held back for the Schema Registry, and no model process that could give a record back to another
try: a record whose model process died is answered (`model_error`), as any other.
"""

from __future__ import annotations

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.seams import HandBack, Record
from worker.pipeline.work import Work


class WithoutGroup:
    """The `seams.Source` calls that a source outside any group has nothing to do for (see the module
    docstring)."""

    @property
    def rebalances(self) -> bool:
        return False

    def hold_back(self, record: Record) -> bool:
        return False

    def resume(self, key: TopicPartitionKey) -> None:
        pass

    def hand_back(self, work: Work) -> HandBack:
        return HandBack.ANSWER

    def maintain(self, now: float) -> None:
        pass

    def pause_all(self) -> None:
        pass

    def resume_all(self) -> None:
        pass

    def poll_while_stopping(self) -> None:
        pass

    def logged(self) -> dict[str, object]:
        return {}
