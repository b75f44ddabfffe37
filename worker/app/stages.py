"""The parts beside the first model that a worker (and `classify`, offline) starts: the cascade's escalation
stage, the shadow model, the review side topic, and the dispatch window each model's pool is fed through.

Each part starts on what its settings say and logs one `*_started` event; what it opens (a pool, a
producer) the caller closes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import structlog

from worker.app.doors import limits
from worker.inference.escalation import escalation_threshold
from worker.inference.pool import (
    ClassifierPool,
    default_pool_kind,
    default_pool_size,
    measure_turnaround,
    open_pool,
)
from worker.inference.taxonomy import Taxonomy
from worker.kafka.clients import ClientErrorLog, create_producer
from worker.logs import librdkafka_logger
from worker.pipeline.side_topics.review import Review
from worker.pipeline.side_topics.shadow import Shadow
from worker.pipeline.triage.cascade import Cascade
from worker.settings import InferenceSettings, Settings

_log = structlog.get_logger("worker.run")
# Niceness added to the shadow pool's processes (Linux CFS: a nice-10 process gets about a tenth of the CPU
# share of a nice-0 one when both want a core).
SHADOW_NICENESS = 10


def dispatch_window(settings: Settings) -> int:
    """How many tickets the pool holds at once: enough to keep every context busy, no more.

    Tickets beyond it wait in the pipeline, where an expired deadline turns them into `overloaded` records
    without a round trip to the model.
    """
    inference = settings.inference
    kind = default_pool_kind(inference)
    if kind == "batch":
        return 2 * inference.batch_size
    return 2 * default_pool_size(inference, kind)


def open_cascade(
    settings: Settings,
    escalation: InferenceSettings,
    taxonomy: Taxonomy,
    taxonomy_path: Path,
    first_contexts: int,
    echo: Callable[[str], None],
    window: int | None = None,
) -> tuple[ClassifierPool, Cascade]:
    """The escalation stage's pool opened with the first stage's `taxonomy` (from `taxonomy_path`, as
    resolved for it) and the cascade over it started (`start_cascade`); the caller closes the pool (closed
    here if the start fails). Nothing is fetched: `choose_escalation` ran no cascade where the stage's
    encoder is missing (the worker connects to nothing but the broker and the registry); `echo` is kept for
    callers that say what the stage does."""
    pool = open_pool(escalation, taxonomy, taxonomy_path, settings.log, settings.privacy)
    try:
        return pool, start_cascade(settings, escalation, pool, taxonomy, first_contexts, window)
    except BaseException:
        pool.close()
        raise


def start_cascade(
    settings: Settings,
    escalation: InferenceSettings,
    pool: ClassifierPool,
    taxonomy: Taxonomy,
    first_contexts: int,
    window: int | None = None,
) -> Cascade:
    """The cascade over the escalation stage's own pool: at most `window` (default: its dispatch window)
    outstanding, beyond which escalations are shed, with its turnaround on warm-up tickets as the gate's
    first p95."""
    window = window or dispatch_window(msgspec.structs.replace(settings, inference=escalation))
    prior_s = measure_turnaround(pool)
    escalate_below = escalation_threshold(settings.inference)
    _log.info(
        "cascade_started",
        escalation=pool.model_id,
        escalate_below=escalate_below,
        window=window,
        warm_turnaround_ms=round(prior_s * 1000.0, 1),
    )
    return Cascade(pool, escalate_below, window, prior_s, first_contexts, taxonomy.labels)


def open_shadow_pool(
    shadow_settings: InferenceSettings, taxonomy: Taxonomy, taxonomy_path: Path, settings: Settings
) -> ClassifierPool:
    """The shadow's pool, with the shadow model's `taxonomy` (from `taxonomy_path`, as resolved for it): its
    processes run at a lower CPU priority, so that on shared cores the primary's contexts come first."""
    # (A partial of a builtin pickles by reference, so the spawned processes import nothing more.)
    lower_priority = cast("Callable[[], None]", functools.partial(os.nice, SHADOW_NICENESS))
    return open_pool(shadow_settings, taxonomy, taxonomy_path, settings.log, settings.privacy, lower_priority)


def start_shadow(settings: Settings, shadow_settings: InferenceSettings, pool: ClassifierPool) -> Shadow:
    """The shadow: its own pool and its own producer, so neither its model nor its records hold back the
    primary's; at most its own dispatch window outstanding (the drop rule, see
    worker/pipeline/side_topics/shadow.py)."""
    window = dispatch_window(msgspec.structs.replace(settings, inference=shadow_settings))
    producer = create_producer(settings.kafka, ClientErrorLog("shadow-producer"), librdkafka_logger())
    _log.info("shadow_started", model=pool.model_id, topic=settings.topics.shadow, window=window)
    return Shadow(pool, window, producer, settings.topics.shadow, limits(settings).deadline_s)


def start_review(settings: Settings) -> Review:
    """Results to review go through a producer of their own, as the shadow's side records do."""
    producer = create_producer(settings.kafka, ClientErrorLog("review-producer"), librdkafka_logger())
    review = settings.review
    _log.info(
        "review_started", topic=settings.topics.review, threshold=review.threshold, fallbacks=review.fallbacks
    )
    return Review(review, producer, settings.topics.review)
