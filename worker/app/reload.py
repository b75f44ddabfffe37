"""Hot reload: on request (SIGHUP, `POST /reload`), load the configured model and taxonomy into a new pool
and switch new tickets to it, without leaving the consumer group.

The settings are read again the way `run` read them (flags > --set > environment > --config file), so an
edited TOML file or a remounted ConfigMap takes effect. Only the inference settings change a running
worker; any other change is logged as ignored (it needs a restart).

A reload runs on a thread of its own: loading and warming a pool takes seconds, and the consumer loop must
keep polling meanwhile. The cascade's escalation stage is not reloaded: changes to its settings are logged as
ignored (they need a restart). A new taxonomy must keep the label set the running stage was checked against;
where the stage was chosen by "auto" (the default), one that does not is switched to all the same and the
cascade stands aside (every first answer stands) until a reload brings that label set back. Before the
switch the new pool must pass what the running one passed at start: it loads (each context checks at load
that the prompt's shared prefix tokenises the same alone as inside the whole prompt, or prefix reuse would be
wrong), and a canary ticket gets an intent of the new taxonomy without a fallback. A reload that fails logs
`reload_failed` with the reason, closes what it started and leaves the running pool as it was. Reloads run
one at a time: SIGHUPs that arrive while one waits or loads are coalesced into one more reload after it (it
reads the settings again, so the last edit wins); a `POST /reload` meanwhile is refused (409), so a burst of
requests cannot queue reload after reload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import structlog

from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import ClassifierPool, open_pool
from worker.inference.switch import SwitchingClassifier
from worker.pipeline.triage.cascade import Cascade
from worker.settings import ESCALATION_AUTO, InferenceSettings, Settings

_log = structlog.get_logger("worker.reload")

ReloadOutcome = Literal["succeeded", "failed"]
_CANARY_TICKET = "Where is my new card? I ordered it two weeks ago and it has not arrived."
_CANARY_TIMEOUT_S = 60.0
# How often the reload thread looks for requests: a signal handler cannot safely wake it.
_REQUEST_CHECK_S = 0.2
_SECTIONS = ("kafka", "topics", "pipeline", "log", "metrics")
# Inference settings of the cascade's escalation stage, which runs on until a restart.
_ESCALATION_KEYS = (
    "escalation",
    "escalate_below",
    "escalation_pool_size",
    "escalation_llm",
    "escalation_top_k",
)


class ReloadError(UserError):
    """A check the new pool failed; the message is the one-line reason that gets logged."""


class Reloader:
    """Owns the reload thread. `load` gives the settings as configured now; `fallback` is the label the
    pipeline gives its own fallbacks (fixed at start); `on_outcome` hears each result (for metrics), with the
    new pool and its settings on success."""

    def __init__(
        self,
        running: Settings,
        load: Callable[[], Settings],
        fallback: FallbackLabel,
        on_outcome: Callable[[ReloadOutcome, InferenceSettings | None, ClassifierPool | None], None]
        | None = None,
        escalation_labels: tuple[str, ...] | None = None,
    ) -> None:
        """`escalation_labels`: the running taxonomy's labels when a cascade runs (a reload keeps them)."""
        self._running = running
        self._labels = escalation_labels
        self._load = load
        self._fallback = fallback
        self._on_outcome = on_outcome
        self._sources: list[str] = []  # who asked since the last reload began
        # Held while `request_unless_busy` looks and while a reload takes its requests or finishes.
        self._busy_lock = threading.Lock()
        self._reloading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cascade: Cascade | None = None

    def request(self, source: str) -> None:
        """Ask for a reload. Safe in a signal handler: one atomic append, no lock, no logging (a handler
        runs on the main thread between any two bytecodes, maybe while that thread holds a lock)."""
        self._sources.append(source)

    def request_unless_busy(self, source: str) -> bool:
        """Ask for a reload unless one is already waiting or running; False then, and nothing is asked
        (`POST /reload` answers 409). Not for signal handlers: it takes a lock."""
        with self._busy_lock:
            if self._sources or self._reloading:
                return False
            self._sources.append(source)
            return True

    def start(self, switch: SwitchingClassifier, cascade: Cascade | None = None) -> None:
        """Serve requests (including any made before this) by staging new pools on `switch`; `cascade`, the
        running one, stands aside while an "auto" stage does not fit the taxonomy."""
        self._cascade = cascade
        self._thread = threading.Thread(target=self._serve, args=(switch,), name="reloader", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving requests. A reload still loading is abandoned: the switch, closed by then, closes
        its pool when it is staged."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _serve(self, switch: SwitchingClassifier) -> None:
        while not self._stop.wait(_REQUEST_CHECK_S):
            if not self._sources:
                continue
            with self._busy_lock:
                self._reloading = True
                sources = [self._sources.pop() for _ in range(len(self._sources))]
            try:
                self.reload(switch, sources)
            finally:
                with self._busy_lock:
                    self._reloading = False

    def reload(self, switch: SwitchingClassifier, sources: list[str] | None = None) -> bool:
        """One reload, on the calling thread; True when a new pool was staged."""
        started = time.monotonic()
        _log.info("reload_started", requested_by=sorted(set(sources or [])))
        pool: ClassifierPool | None = None
        try:
            settings = self._load()
            self._log_ignored(settings)
            taxonomy, taxonomy_path = resolve_taxonomy(settings.inference)
            if taxonomy.fallback_label != self._fallback:
                raise ReloadError(
                    f"the taxonomy's fallback label {_label(taxonomy.fallback_label)} differs from the "
                    f"running {_label(self._fallback)}, used by the pipeline's own fallbacks: needs a restart"
                )
            stage_fits = self._labels is None or set(taxonomy.labels) == set(self._labels)
            if not stage_fits and self._running.inference.escalation != ESCALATION_AUTO:
                raise ReloadError(
                    f"{taxonomy_path} changes the label set the running escalation stage was checked "
                    'against: needs a restart (or inference.escalation = "auto", which stands aside)'
                )
            pool = open_pool(settings.inference, taxonomy, taxonomy_path, settings.log, settings.privacy)
            answer = _canary(pool)
            # "None of these" is an answer too (an encoder stage's out-of-scope detector): the canary, a
            # banking ticket, fits none of a team's intents.
            if answer.fallback or (answer.intent not in taxonomy.labels and not answer.out_of_scope):
                raise ReloadError(
                    f"canary ticket answered {answer.intent!r} "
                    f"(fallback: {answer.fallback_reason or 'no'}), not an intent of {taxonomy_path}"
                )
        except Exception as error:  # whatever goes wrong, the running pool stays
            if pool is not None:
                pool.close()
            # A UserError's message is written for the operator; anything else also needs its kind.
            reason = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
            _log.error("reload_failed", reason=_one_line(reason), effect="the running model stays")
            if self._on_outcome is not None:
                self._on_outcome("failed", None, None)
            return False
        # The escalation stage's settings stay the running ones (it is not reloaded).
        kept = {key: getattr(self._running.inference, key) for key in _ESCALATION_KEYS}
        self._running = msgspec.structs.replace(
            self._running, inference=msgspec.structs.replace(settings.inference, **kept)
        )
        self._fit_cascade(stage_fits, str(taxonomy_path), switch, pool)
        _log.info(
            "reload_succeeded",
            model=pool.model_id,
            taxonomy=str(taxonomy_path),
            mode=settings.inference.mode,
            contexts=pool.size,
            canary=answer.intent,
            seconds=round(time.monotonic() - started, 2),
        )
        if self._on_outcome is not None:
            self._on_outcome("succeeded", settings.inference, pool)
        return True

    def _fit_cascade(
        self, fits: bool, taxonomy: str, switch: SwitchingClassifier, pool: ClassifierPool
    ) -> None:
        """Stage `pool`, the cascade standing aside before the switch when the stage does not fit its
        taxonomy (no answer of its labels may reach the stage) and resuming after it when it does."""
        cascade = self._cascade
        if cascade is not None and not fits and cascade.fits_first_stage:
            cascade.fits_first_stage = False
            _log.warning(
                "cascade_stands_aside",
                taxonomy=taxonomy,
                reason="the escalation stage was started for another label set; a restart chooses again",
            )
        switch.stage(pool)
        if cascade is not None and fits and not cascade.fits_first_stage:
            cascade.fits_first_stage = True
            _log.info("cascade_resumed", taxonomy=taxonomy)

    def _log_ignored(self, settings: Settings) -> None:
        """Name (never show: they may be secrets) the changed settings a reload does not apply."""
        changed = []
        for section in _SECTIONS:
            before, after = getattr(self._running, section), getattr(settings, section)
            if before == after:
                continue
            old = before if isinstance(before, dict) else msgspec.structs.asdict(before)
            new = after if isinstance(after, dict) else msgspec.structs.asdict(after)
            changed += [
                f"{section}.{key}" for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)
            ]
        changed += [
            f"inference.{key}"
            for key in _ESCALATION_KEYS
            if getattr(self._running.inference, key) != getattr(settings.inference, key)
        ]
        if changed:
            _log.warning("reload_ignored_settings", settings=changed, effect="they need a restart")


def _canary(pool: ClassifierPool) -> Classification:
    """Classify one ticket on a pool nobody else uses yet."""
    deadline = time.monotonic() + _CANARY_TIMEOUT_S
    pool.submit(ClassifyRequest(0, _CANARY_TICKET, deadline))
    while time.monotonic() < deadline:
        for request_id, answer in pool.poll(0.5):
            if request_id == 0:
                return answer
    raise ReloadError(f"canary ticket not answered within {_CANARY_TIMEOUT_S:.0f} s")


def _label(label: FallbackLabel) -> str:
    return f"{label.intent}/{label.priority}"


def _one_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
