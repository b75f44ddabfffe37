"""The loop against the in-memory Kafka (tests/memory_kafka.py): failure paths made deterministic.

Each test drives the real loop (`group_pipeline`) with a classifier that answers at once; the in-memory
consumer and producer follow librdkafka's semantics for queues, rebalance callbacks and transactions. The
real-broker end-to-end and chaos tests cover the same promises under real timing; these pin down exact
interleavings.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import confluent_kafka
import msgspec
import pytest
from doubles import HoldingClassifier, InstantClassifier, RecordingClassifier, Running
from memory_kafka import GroupMetadata, MemoryConsumer, MemoryKafka, as_client_factory
from structlog.testing import capture_logs

from worker.app.doors import TriageParts, group_pipeline
from worker.classification import Classifier, FallbackLabel
from worker.dev.samples import SampleFactory
from worker.kafka import dead_letters
from worker.messages import TriageResult
from worker.pipeline.engine import Engine
from worker.pipeline.triage.cascade import Cascade
from worker.settings import load_settings

FALLBACK = FallbackLabel("unclassified", "Medium")
INPUT, OUTPUT, DEAD = "tickets", "triaged", "dead"


def fill(kafka: MemoryKafka, partition: int, count: int, seed: int) -> None:
    factory = SampleFactory(seed=seed, malformed_ratio=0.2, prefix=f"P{partition}")
    for index in range(count):
        sample = factory.make(index)
        kafka.append(INPUT, partition, sample.value, sample.key, list(sample.headers))


def outputs_by_source(kafka: MemoryKafka) -> dict[tuple[int, int], int]:
    """How many visible results and dead letters each input position has."""
    found: dict[tuple[int, int], int] = {}
    decoder = msgspec.json.Decoder(TriageResult)
    for _, record in kafka.read_committed(OUTPUT):
        assert record.value is not None
        source = decoder.decode(record.value).source
        found[(source.partition, source.offset)] = found.get((source.partition, source.offset), 0) + 1
    for _, record in kafka.read_committed(DEAD):
        headers = dict(record.headers or [])
        partition = headers[dead_letters.SOURCE_PARTITION]
        offset = headers[dead_letters.SOURCE_OFFSET]
        assert partition is not None and offset is not None
        position = (int(partition), int(offset))
        found[position] = found.get(position, 0) + 1
    return found


def assert_exactly_once(kafka: MemoryKafka, group: str) -> None:
    """Every input offset below the group's committed position has exactly one visible output; none above."""
    outputs = outputs_by_source(kafka)
    committed = kafka.committed[group]
    lost = [
        (p, o) for (topic, p), position in committed.items() if topic == INPUT for o in range(position)
        if outputs.get((p, o), 0) == 0
    ]  # fmt: skip
    assert lost == [], f"committed past {len(lost)} inputs with no output: {lost[:10]}"
    duplicated = sorted(position for position, count in outputs.items() if count > 1)
    assert duplicated == [], f"{len(duplicated)} inputs with more than one output: {duplicated[:10]}"
    beyond = sorted((p, o) for (p, o) in outputs if o >= committed.get((INPUT, p), 0))
    assert beyond == [], f"outputs visible for uncommitted inputs: {beyond[:10]}"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def kafka() -> Iterator[MemoryKafka]:
    memory = MemoryKafka(prefetch=2)
    memory.create_topic(INPUT, 4)
    memory.create_topic(OUTPUT, 4)
    memory.create_topic(DEAD, 1)
    yield memory


def pipeline(
    kafka: MemoryKafka,
    guarantee: str,
    classifier: Classifier | None = None,
    clock: Callable[[], float] = time.monotonic,
    cascade: Cascade | None = None,
    settings: Mapping[str, object] | None = None,
) -> Engine:
    """A pipeline in group "memory-group"; by default it commits only when its in-flight bound is half full,
    on revoke and at shutdown (a commit interval of an hour), so that a test decides what is uncommitted."""
    group = "memory-group"
    config = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "topics.input": INPUT,
            "topics.output": OUTPUT,
            "topics.dead_letter": DEAD,
            "pipeline.group_id": group,
            "pipeline.guarantee": guarantee,
            "pipeline.commit_interval_ms": 3_600_000,
            **(settings or {}),
        },
    )
    clients = as_client_factory(kafka.clients(group, "memory-tid" if guarantee == "exactly_once" else None))
    parts = TriageParts(classifier or InstantClassifier(), FALLBACK, 64, cascade=cascade)
    return group_pipeline(config, parts, clients=clients, clock=clock)


def _events_in_one_poll(
    kafka: MemoryKafka, events: str, fired: threading.Event
) -> Callable[[MemoryConsumer], None]:
    """A consumer hook: once partition 0 has records fetched (queued) beyond offset 10 and partitions 1 and
    2 are read to their end, the group's `events` arrive together, followed by new records of partition 3
    that fill the poll's batch up (so librdkafka's barrier after a seek in a callback is not reached)."""

    def hook(consumer: MemoryConsumer) -> None:
        queued = [item for item in consumer.queue if item[0] == "record" and item[1][0] == (INPUT, 0)]
        read_elsewhere = all(consumer.app_at.get((INPUT, p)) == 5 for p in (1, 2))
        if fired.is_set() or not read_elsewhere or len(queued) < 2 or consumer.app_at[(INPUT, 0)] < 10:
            return
        if events == "lost 1, revoked 2":
            kafka.lose(consumer, [(INPUT, 1)])
            kafka.revoke(consumer, [(INPUT, 2)])
        else:
            kafka.lose(consumer, [(INPUT, 0)])
            kafka.assign(consumer, [(INPUT, 0)])
        fill(kafka, 3, 10, seed=4)
        fired.set()

    return hook


@pytest.mark.parametrize("events", ["lost 1, revoked 2", "lost 0, assigned 0 again"])
def test_records_fetched_before_a_rebalance_callback_never_start_a_partition_over(
    kafka: MemoryKafka, events: str
) -> None:
    """The chaos run's loss (issue #25), step by step. Two rebalance events arrive in one poll while records
    of partition 0 fetched before them are already in the poll's batch:
    - partition 1 lost and 2 revoked: the revoke commits the open transaction, which must abort (it holds
      the lost partition's outputs), so every owned partition is redone from its last commit; partition 0
      is sought back inside the callback;
    - partition 0 lost and assigned again: a fresh offset state, fetching from the committed offset.
    Either way a record fetched before the event must not start the partition's new state, or the records
    between its start and that record, fetched again, are skipped and the next commit passes them without
    an output."""
    fill(kafka, 0, 30, seed=1)
    fill(kafka, 1, 5, seed=2)
    fill(kafka, 2, 5, seed=3)
    worker = pipeline(
        kafka, "exactly_once", settings={"pipeline.poll_batch_size": 4, "pipeline.max_in_flight": 1000}
    )
    fired = threading.Event()
    kafka.hooks.consumer_call = _events_in_one_poll(kafka, events, fired)
    running = Running(worker)
    wait_until(fired.is_set, "the rebalance events")
    consumer = kafka.members[0]
    ends = kafka.end_offsets(INPUT)
    wait_until(lambda: all(consumer.app_at[(INPUT, p)] == ends[p] for p in (0, 3)), "partitions 0 and 3 read")
    assert running.stop() == 0
    assert {p: kafka.committed["memory-group"].get((INPUT, p)) for p in (0, 3)} == {0: ends[0], 3: ends[3]}
    assert_exactly_once(kafka, "memory-group")
    assert worker.metrics.transactions_aborted >= 1
    assert worker.metrics.redelivered == 0


def fill_texts(kafka: MemoryKafka, partition: int, bodies: list[str]) -> None:
    for index, body in enumerate(bodies):
        value = msgspec.json.encode({"ticket_id": f"T{partition}-{index}", "body": body})
        kafka.append(INPUT, partition, value, f"customer-{index}".encode())


BOTH_GUARANTEES = pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])


@BOTH_GUARANTEES
def test_answers_that_come_after_the_revoke_timeout_are_discarded_not_written(
    kafka: MemoryKafka, guarantee: str
) -> None:
    """A ticket still at the model when revoke_timeout_ms runs out is left to the partition's new owner: the
    commit stops before it, and its late answer is discarded (writing it too would be a duplicate)."""
    fill_texts(kafka, 1, ["where is my card"] * 3 + ["hold: card stolen"] + ["where is my card"] * 3)
    classifier = HoldingClassifier()
    worker = pipeline(kafka, guarantee, classifier=classifier, settings={"pipeline.revoke_timeout_ms": 200})
    running = Running(worker)
    wait_until(lambda: len(classifier.held) == 1 and worker.metrics.consumed == 7, "the held ticket")
    consumer = kafka.members[0]
    kafka.revoke(consumer, [(INPUT, 1)])
    wait_until(lambda: (INPUT, 1) not in consumer.assigned, "the revoke")
    assert kafka.committed["memory-group"].get((INPUT, 1)) == 3
    classifier.release()
    wait_until(lambda: worker.metrics.discarded_after_revoke == 1, "the late answer")
    assert running.stop() == 0
    outputs = outputs_by_source(kafka)
    assert (1, 3) not in outputs  # the new owner writes it
    if guarantee == "exactly_once":  # the records after it were in the transaction: never visible
        assert sorted(outputs) == [(1, 0), (1, 1), (1, 2)]


@BOTH_GUARANTEES
def test_a_lost_partition_is_never_committed_and_exactly_once_never_shows_its_outputs(
    kafka: MemoryKafka, guarantee: str
) -> None:
    """Lost partitions (the group moved on without this worker) are not committed; under exactly-once the
    open transaction holding their outputs is aborted, and the other partitions are redone."""
    fill_texts(kafka, 0, ["where is my card"] * 8)
    fill_texts(kafka, 1, ["where is my card"] * 8)
    worker = pipeline(kafka, guarantee)
    running = Running(worker)
    consumer = kafka.members[0]
    wait_until(lambda: worker.metrics.produced == 16, "every ticket answered")
    kafka.lose(consumer, [(INPUT, 1)])
    wait_until(lambda: (INPUT, 1) not in consumer.assigned, "the loss")
    redone = 8 if guarantee == "exactly_once" else 0
    wait_until(lambda: worker.metrics.produced == 16 + redone, "partition 0 redone (exactly-once)")
    assert running.stop() == 0
    committed = kafka.committed["memory-group"]
    assert (INPUT, 1) not in committed and committed[(INPUT, 0)] == 8
    assert_exactly_once(kafka, "memory-group") if guarantee == "exactly_once" else None
    outputs = outputs_by_source(kafka)
    if guarantee == "exactly_once":
        assert worker.metrics.transactions_aborted == 1
        assert sorted(outputs) == [(0, offset) for offset in range(8)]
    else:  # at-least-once: written before the loss; the new owner writes them again (the duplicate bound)
        assert sorted(outputs) == sorted([(p, o) for p in (0, 1) for o in range(8)])


@BOTH_GUARANTEES
def test_a_worker_left_out_of_its_group_while_the_broker_answers_ends_its_run_to_be_restarted(
    kafka: MemoryKafka, guarantee: str
) -> None:
    """After a broker outage longer than the session timeout, librdkafka 2.16 may never rejoin the group (its
    coordinator lookup waits for an answer that never comes): no member id, no JoinGroup, the loop turning
    and liveness holding. Nothing is counted while the broker is away; once it answers, the worker stays out
    of the group for four session timeouts (at least 2 minutes), then logs group_rejoin_forced and exits 1
    for its supervisor to restart it. Nothing is assigned then, so nothing is lost: the tickets read are
    committed."""
    fill_texts(kafka, 0, ["where is my card"] * 8)
    worker = pipeline(kafka, guarantee, clock=fast_clock(), settings={"pipeline.commit_interval_ms": 1000})
    running = Running(worker)
    consumer = kafka.members[0]
    wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 8, "every ticket committed")
    kafka.answering = False
    consumer.member = ""  # the session timed out (librdkafka clears the member id), and no rejoin follows
    kafka.lose(consumer, sorted(consumer.assigned))
    time.sleep(3.0)  # 300 s on the pipeline's clock: over four session timeouts (45 s) with the broker away
    assert running.code is None, "the run ended while the broker was away"
    with capture_logs() as logged:
        kafka.answering = True
        running.join(timeout=10.0)
    assert running.code == 1
    forced = [event for event in logged if event["event"] == "group_rejoin_forced"]
    assert len(forced) == 1 and forced[0]["out_of_group_s"] >= 4 * 45, forced
    assert kafka.committed["memory-group"][(INPUT, 0)] == 8


def test_a_worker_fenced_by_another_with_its_transactional_id_stops_and_its_open_transaction_is_aborted(
    kafka: MemoryKafka,
) -> None:
    fill_texts(kafka, 0, ["where is my card"] * 3 + ["hold: stolen"] + ["where is my card"] * 3)
    classifier = HoldingClassifier()
    worker = pipeline(kafka, "exactly_once", classifier=classifier)
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 3 and len(classifier.held) == 1, "work in the transaction")
    newer = kafka.clients("memory-group", "memory-tid").producer(lambda _error: None)
    newer.init_transactions()  # another live worker took the transactional id over
    classifier.release()
    running.join()
    assert running.code == 1
    assert kafka.read_committed(OUTPUT) == [] and (INPUT, 0) not in kafka.committed["memory-group"]


class StuckFirstCommit:
    """A commit hook: the first transaction commit hangs until `release` (librdkafka after a restart)."""

    def __init__(self) -> None:
        self.stuck, self.release = threading.Event(), threading.Event()

    def __call__(self, _producer: object) -> None:
        if not self.stuck.is_set():
            self.stuck.set()
            self.release.wait(30)


def fast_clock() -> Callable[[], float]:
    """The pipeline's clock at 100x, so that the 30 s stuck-commit limit passes quickly."""
    start = time.monotonic()
    return lambda: start + (time.monotonic() - start) * 100


def test_a_stuck_commit_is_settled_by_a_new_producer_and_the_work_redone_once(kafka: MemoryKafka) -> None:
    """A transaction commit that never returns (librdkafka after a broker restart, see the pipeline's
    `ExactlyOnce._replace_producer`) is fenced by a new producer with the same transactional id; the work is
    redone from the group's committed offsets."""
    fill_texts(kafka, 0, ["where is my card"] * 20)
    kafka.hooks.commit = stuck = StuckFirstCommit()
    worker = pipeline(
        kafka, "exactly_once", clock=fast_clock(), settings={"pipeline.commit_interval_ms": 1000}
    )
    running = Running(worker)
    try:
        wait_until(stuck.stuck.is_set, "the first commit")
        wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 20, "the redone work committed")
        assert worker.metrics.transactions_aborted >= 1
    finally:
        stuck.release.set()
    assert running.stop() == 0
    assert_exactly_once(kafka, "memory-group")


def test_a_new_producer_whose_coordinator_does_not_answer_yet_tries_again_and_the_worker_stays(
    kafka: MemoryKafka,
) -> None:
    """After a stuck commit, the new producer's init_transactions fails while the transaction coordinator is
    not available (seen for a minute after a broker restart): the worker keeps polling and tries again at
    the next turns instead of stopping, then redoes the work once."""
    fill_texts(kafka, 0, ["where is my card"] * 20)
    stuck = StuckFirstCommit()
    refusals: list[int] = []

    def coordinator_away_for_a_while(_producer: object) -> None:
        if stuck.stuck.is_set() and len(refusals) < 5:
            refusals.append(1)
            error = confluent_kafka.KafkaError(confluent_kafka.KafkaError.NOT_COORDINATOR, "Not coordinator")
            raise confluent_kafka.KafkaException(error)

    kafka.hooks.commit, kafka.hooks.init = stuck, coordinator_away_for_a_while
    worker = pipeline(
        kafka, "exactly_once", clock=fast_clock(), settings={"pipeline.commit_interval_ms": 1000}
    )
    running = Running(worker)
    try:
        wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 20, "the redone work committed")
    finally:
        stuck.release.set()
    assert len(refusals) == 5
    assert running.stop() == 0
    assert_exactly_once(kafka, "memory-group")


@BOTH_GUARANTEES
def test_a_partition_whose_committed_offset_an_open_transaction_holds_starts_there_once_it_ends(
    kafka: MemoryKafka, guarantee: str
) -> None:
    """Issue #30 (exactly-once chaos, seed 29: 8,478 duplicates). A worker killed between sending its offsets
    to a transaction and committing it leaves the group's committed offsets of its partitions unstable until
    the broker aborts that transaction. librdkafka's own lookup of a new partition's start waits meanwhile,
    but starts it at the beginning when the assignment changes first. The worker looks the offsets up
    itself: the partitions wait, paused, and start at their committed offsets once the transaction ends."""
    for partition in (0, 1):
        fill_texts(kafka, partition, ["where is my card"] * 20)
        kafka.committed["memory-group"][(INPUT, partition)] = 10  # done by an earlier worker
    dead = kafka.clients("memory-group", "dead-worker").producer(lambda _error: None)
    dead.init_transactions()
    dead.begin_transaction()
    held = [confluent_kafka.TopicPartition(INPUT, p, 15) for p in (0, 1)]
    dead.send_offsets_to_transaction(held, GroupMetadata("memory-group", kafka.generation, "dead"))
    worker = pipeline(kafka, guarantee, settings={"pipeline.commit_interval_ms": 100})
    running = Running(worker)
    wait_until(lambda: bool(kafka.members and kafka.members[0].assigned), "the assignment")
    consumer = kafka.members[0]
    kafka.revoke(consumer, [(INPUT, 1)])  # the assignment changes while the offsets are unstable
    wait_until(lambda: (INPUT, 1) not in consumer.assigned, "the revoke")
    time.sleep(0.3)
    assert worker.metrics.consumed == 0  # nothing is read before the start is known
    dead.abort_transaction()  # the broker aborts the dead worker's transaction at its timeout
    wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 20, "partition 0 read to its end")
    assert running.stop() == 0
    assert sorted(outputs_by_source(kafka)) == [(0, offset) for offset in range(10, 20)]
    assert worker.metrics.consumed == 10


@BOTH_GUARANTEES
def test_a_ticket_whose_deadline_had_passed_on_arrival_is_answered_expired_on_arrival_not_overloaded(
    kafka: MemoryKafka, guarantee: str
) -> None:
    """Issue #31: on an idle worker a ticket whose producer deadline (`metadata.deadline_at`) had already
    passed was answered `overloaded`, which operators read as a capacity problem. It has its own reason now,
    and costs no model time; a ticket due later is classified as usual."""
    past = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)).isoformat()
    later = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)).isoformat()
    for index, due in enumerate([past, later]):
        ticket = {"ticket_id": f"T-{index}", "body": "my card is blocked", "metadata": {"deadline_at": due}}
        kafka.append(INPUT, 0, msgspec.json.encode(ticket), f"customer-{index}".encode())
    classifier = InstantClassifier()
    worker = pipeline(kafka, guarantee, classifier=classifier, settings={"pipeline.commit_interval_ms": 100})
    running = Running(worker)
    wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 2, "both tickets committed")
    assert running.stop() == 0
    decoder = msgspec.json.Decoder(TriageResult)
    results = {
        r.ticket_id: r for r in (decoder.decode(rec.value or b"") for _, rec in kafka.read_committed(OUTPUT))
    }
    assert results["T-0"].fallback and results["T-0"].fallback_reason == "expired_on_arrival"
    assert not results["T-1"].fallback
    assert worker.metrics.fallback == {"expired_on_arrival": 1}


@pytest.mark.parametrize(
    "spelling",
    ["%Y-%m-%dt%H:%M:%Sz", "%Y-%m-%dT%H:%M:%Sz", "%Y-%m-%dt%H:%M:%S.250Z", "%Y-%m-%dt%H:%M:%S+00:00"],
)
def test_a_lower_case_deadline_at_that_had_passed_is_answered_expired_on_arrival(
    kafka: MemoryKafka, spelling: str
) -> None:
    """Issue 55: `2024-05-01t12:30:00z` (RFC 3339 allows lower-case t and z) was accepted by the decoder and
    ignored by the deadline, so a ticket past its deadline was classified; one not a timestamp is a dead
    letter."""
    past = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)).strftime(spelling)
    for index, due in enumerate([past, "5 minutes from now"]):
        ticket = {"ticket_id": f"T-{index}", "body": "my card is blocked", "metadata": {"deadline_at": due}}
        kafka.append(INPUT, 0, msgspec.json.encode(ticket), f"customer-{index}".encode())
    classifier = RecordingClassifier()
    worker = pipeline(kafka, "at_least_once", classifier, settings={"pipeline.commit_interval_ms": 100})
    running = Running(worker)
    wait_until(lambda: kafka.committed["memory-group"].get((INPUT, 0)) == 2, "both tickets committed")
    assert running.stop() == 0
    ((_, record),) = kafka.read_committed(OUTPUT)
    result = msgspec.json.decode(record.value or b"", type=TriageResult)
    assert (result.ticket_id, result.fallback_reason) == ("T-0", "expired_on_arrival")
    assert classifier.texts == []  # no model time for either
    ((_, letter),) = kafka.read_committed(DEAD)
    assert dict(letter.headers or [])[dead_letters.ERROR_TYPE] == b"invalid_timestamp"


@pytest.mark.parametrize("redact", [True, False])
def test_redact_input_and_dead_letter_redact_decide_what_the_model_and_the_dead_letter_get(
    kafka: MemoryKafka, redact: bool
) -> None:
    """Issue #33: with `inference.redact_input` the model gets the ticket redacted, without it as sent; with
    `dead_letter.redact` a dead letter's value is redacted, without it kept as taken. Either way every
    result lists the kinds found and a dead letter's message holds no identifier."""
    card = "4111 1111 1111 1111"
    fill_texts(kafka, 0, [f"card {card} lost", "no personal data here"])
    # Its dead letter's message quotes the bad value ("`created_at` must be ..., got ...").
    poison = f'{{"ticket_id": "P", "body": "card {card}", "created_at": "{card}"}}'.encode()
    kafka.append(INPUT, 0, poison, b"poison")
    classifier = RecordingClassifier()
    settings = {"inference.redact_input": redact, "dead_letter.redact": redact}
    running = Running(pipeline(kafka, "at_least_once", classifier, settings=settings))
    wait_until(lambda: len(kafka.read_committed(OUTPUT)) + len(kafka.read_committed(DEAD)) == 3, "3 outputs")
    assert running.stop() == 0
    sent = "card [card ••••1111] lost" if redact else f"card {card} lost"
    assert classifier.texts == [sent, "no personal data here"]
    results = [
        msgspec.json.decode(r.value or b"", type=TriageResult) for _, r in kafka.read_committed(OUTPUT)
    ]
    assert sorted((r.ticket_id, tuple(r.pii)) for r in results) == [("T0-0", ("card_number",)), ("T0-1", ())]
    ((_, letter),) = kafka.read_committed(DEAD)
    masked = "[card ••••1111]"
    expected = {"ticket_id": "P", "body": f"card {masked}", "created_at": masked}
    if redact:
        assert msgspec.json.decode(letter.value or b"") == expected
    else:
        assert letter.value == poison
    message = dict(letter.headers or [])[dead_letters.ERROR_MESSAGE]
    assert (
        message
        == f'`created_at` must be an RFC 3339 timestamp like 2024-05-01T12:30:00Z, got "{masked}"'.encode()
    )
