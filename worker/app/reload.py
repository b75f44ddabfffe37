"""Hot reload: on request (SIGHUP, `POST /reload`), load the configured model and taxonomy into a new pool
and switch new tickets to it, without leaving the consumer group.

The settings are read again the way `run` read them (flags > --set > environment > --config file), so an
edited TOML file or a remounted ConfigMap takes effect. What a reload does with each setting is declared in
`worker.settings.reloads.RELOAD`: a `live` one is applied (the inference settings, through a new pool; the
privacy and redaction settings and which results go to review, handed to the running parts by `apply`); a
`restart` one is named in one line (`reload_needs_restart`, values masked where secret), keeps its running
value, and is reported as a pending restart (`on_pending`: readiness and metrics); a `refused` one fails the
reload (`reload_failed`, naming it), which then applies nothing.

A reload runs on a thread of its own: loading and warming a pool takes seconds, and the consumer loop must
keep polling meanwhile. The cascade's escalation stage and the shadow are not reloaded: their settings are
restart-only. A new taxonomy must keep the label set the running stage was checked against;
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

import structlog

from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import ClassifierPool, open_pool
from worker.inference.switch import SwitchingClassifier
from worker.pipeline.triage.cascade import Cascade
from worker.settings import ESCALATION_AUTO, InferenceSettings, Settings
from worker.settings.reloads import changed_settings, declared, masked_setting, with_running

_log = structlog.get_logger("worker.reload")

ReloadOutcome = Literal["succeeded", "failed"]
_CANARY_TICKET = "Where is my new card? I ordered it two weeks ago and it has not arrived."
_CANARY_TIMEOUT_S = 60.0
# How often the reload thread looks for requests: a signal handler cannot safely wake it.
_REQUEST_CHECK_S = 0.2
_REVIEW_KEYS = ("review.threshold", "review.fallbacks")


class ReloadError(UserError):
    """A check the new pool failed; the message is the one-line reason that gets logged."""


class Reloader:
    """Owns the reload thread. `running`: the settings the worker started with, as configured (before any
    option the start fitted to the broker); `load` gives the settings as configured now; `fallback` is the
    label the pipeline gives its own fallbacks (fixed at start); `on_outcome` hears each result (for
    metrics), with the new pool and its settings on success; `on_pending` hears, at each reload that read the
    settings, the ones configured that only a restart applies (none: an empty list)."""

    def __init__(
        self,
        running: Settings,
        load: Callable[[], Settings],
        fallback: FallbackLabel,
        on_outcome: Callable[[ReloadOutcome, InferenceSettings | None, ClassifierPool | None], None]
        | None = None,
        escalation_labels: tuple[str, ...] | None = None,
        on_pending: Callable[[list[str]], None] | None = None,
    ) -> None:
        """`escalation_labels`: the running taxonomy's labels when a cascade runs (a reload keeps them)."""
        self._running = running
        # Whether the review side topic runs: only then can a reload apply `review.*`.
        self._review_runs = running.review.enabled
        self._on_pending = on_pending
        self._apply: Callable[[Settings], None] | None = None
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

    def start(
        self,
        switch: SwitchingClassifier,
        cascade: Cascade | None = None,
        apply: Callable[[Settings], None] | None = None,
    ) -> None:
        """Serve requests (including any made before this) by staging new pools on `switch`; `cascade`, the
        running one, stands aside while an "auto" stage does not fit the taxonomy; `apply` hands the running
        parts the settings of each reload that succeeds (the live ones beside inference: redaction, review),
        just before the new pool is staged."""
        self._cascade = cascade
        self._apply = apply
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
            applied, kept = self._compare(settings)
            # What only a restart applies stays as it runs (the escalation stage, the shadow, the loop, ...).
            running = with_running(settings, self._running, kept)
            taxonomy, taxonomy_path = resolve_taxonomy(running.inference)
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
            pool = open_pool(running.inference, taxonomy, taxonomy_path, running.log, running.privacy)
            answer = _canary(pool)
            # "None of these" is an answer too (an encoder stage's out-of-scope detector): the canary, a
            # banking ticket, fits none of a team's intents.
            if answer.fallback or (answer.intent not in taxonomy.labels and not answer.out_of_scope):
                raise ReloadError(
                    f"canary ticket answered {answer.intent!r} "
                    f"(fallback: {answer.fallback_reason or 'no'}), not an intent of {taxonomy_path}"
                )
            if self._apply is not None:
                self._apply(running)
        except Exception as error:  # whatever goes wrong, the running pool stays
            if pool is not None:
                pool.close()
            # A UserError's message is written for the operator; anything else also needs its kind.
            reason = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
            _log.error(
                "reload_failed", reason=_one_line(reason), effect="the running model and settings stay"
            )
            if self._on_outcome is not None:
                self._on_outcome("failed", None, None)
            return False
        self._running = running
        self._fit_cascade(stage_fits, str(taxonomy_path), switch, pool)
        _log.info(
            "reload_succeeded",
            model=pool.model_id,
            taxonomy=str(taxonomy_path),
            mode=running.inference.mode,
            contexts=pool.size,
            canary=answer.intent,
            applied=applied,
            seconds=round(time.monotonic() - started, 2),
        )
        if self._on_outcome is not None:
            self._on_outcome("succeeded", running.inference, pool)
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

    def _compare(self, settings: Settings) -> tuple[list[str], list[str]]:
        """The settings changed from the running ones: those this reload applies, and those it does not (each
        keeps its running value), after one `reload_needs_restart` line naming them; raises ReloadError
        naming the `refused` ones, which fail the reload. Either way those are reported as pending a
        restart."""
        changed = changed_settings(self._running, settings)
        live, refused, restart = [], [], []
        for key in changed:
            how = declared(key).reload
            if how == "live" and key in _REVIEW_KEYS and not self._review_runs:
                how = "restart"  # review turned on: its producer and topic are set up at start
            if how == "refused":
                refused.append(key)
            elif how == "restart":
                restart.append(key)
            else:
                live.append(key)
        if self._on_pending is not None:
            self._on_pending(sorted(refused + restart))
        if restart:
            _log.warning(
                "reload_needs_restart",
                settings=restart,
                values={key: _shown(key, *changed[key]) for key in restart},
                effect="the running values stay until a restart",
            )
        if refused:
            reasons = "; ".join(f"{key} ({declared(key).why})" for key in refused)
            raise ReloadError(
                f"{', '.join(refused)} changed, which a reload cannot apply: {reasons}; restart the worker "
                "to apply it, or set it back to reload the rest"
            )
        return live, restart


def _shown(key: str, running: object, configured: object) -> dict[str, object]:
    """A changed setting's two values as a log line may show them (secrets masked)."""
    return {"running": masked_setting(key, running), "configured": masked_setting(key, configured)}


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
