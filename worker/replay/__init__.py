"""Dead-letter replay: republish what the worker dead-lettered, once the cause is fixed.

Home-made replays are where messages get duplicated, looped forever or lost, so this one is built around
three guarantees:

* **Bounded loops.** Every republished record carries ``triage.replay_count`` = previous + 1. The worker keeps
  that header when it dead-letters the record again, so a record that keeps failing reaches ``max_replays``
  and is then skipped and reported instead of circling between the topics.
* **At-least-once, few duplicates.** Progress is committed under the replay's own consumer group, and only up
  to the last offset whose republished record (and every one before it) the broker confirmed (idempotent
  producer, ``acks=all``). A killed replay resumes there: it re-sends at most what was in flight.
* **Exactly once, when asked.** With ``pipeline.guarantee = "exactly_once"`` the republished records and
  the progress past them are committed in one Kafka transaction (a transactional producer of its own, see
  `selection.replay_transactional_id`), so readers with ``isolation.level=read_committed`` see each selected
  dead letter once, even across a ``kill -9`` and a rerun.
* **A finite run.** The end offsets are captured at start; dead letters that arrive meanwhile (perhaps
  replayed records failing again) wait for the next run instead of being chased.

A replay is a door of the worker's one loop (`worker.pipeline.engine.Engine`, assembled in
`worker/app/replay.py`): `source` reads the planned dead-letter ranges, `stage` selects, repairs
(`transforms`: `--transform` in a process of its own) and republishes each record, and both modes are the
pipeline's own delivery guarantees (`worker/pipeline/settlements/guarantees.py`) with `reports` as their
observer: the replay differs from the worker only in what it reads and writes. `selection` holds the
options and what they pick, `outcomes` what a run reports.

Everything the group passes over counts as done *for that group*: records skipped by a filter or by the
max-replay bound are behind its committed position. A replay with a different selection therefore needs its
own ``--group``, or the group put back with `selection.reset_group` (docs/operations.md shows the workflow).
Two rules keep a mistake from costing records: the filters are checked before anything is read
(`selection.check_error_types`, `selection.check_source`), and a run whose selection matched no record
commits nothing.

The time window (``--since``/``--until``) applies to when a record was dead-lettered, i.e. the dead-letter
record's Kafka timestamp: ``--since`` seeks with the broker's time index and ``--until`` ends each partition
at its first later record, which is then left for a later run rather than committed past.
"""
