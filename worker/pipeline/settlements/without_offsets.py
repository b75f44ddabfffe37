"""What a settlement with no offsets to commit does at a consumer group's steps: nothing.

Queue mode settles each record with its acknowledgement and the offline doors with their output; neither has
a commit to start, wait for, or settle on a revoke, nor an assignment to hear of. Their classes take these
steps from here, so that the seam (`seams.Settlement`) stays one contract for every door.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.kafka.commits import TopicPartitionKey


class WithoutOffsets:
    """The group-only steps of `seams.Settlement`, as no-ops."""

    def start(self) -> None:
        pass

    def advance(self) -> None:
        pass

    @property
    def committing(self) -> bool:
        return False

    @property
    def producing(self) -> bool:
        return True

    def settle(self, limit: float) -> None:
        pass

    def commit_now(self, keys: set[TopicPartitionKey], limit: float) -> None:
        pass

    def assigned(self, keys: Sequence[TopicPartitionKey]) -> None:
        pass

    def lost(self, keys: set[TopicPartitionKey]) -> None:
        pass
