"""The assembly point: the running worker built from its settings, and what it runs besides the pipeline.

`application.WorkerApp(settings, reread).run()` builds the worker (the primary pool behind a switch, the
cascade's escalation stage, the shadow, the review, the `Pipeline`, the telemetry port, the hot reloader),
owns its life cycle (start, run until stopped, drain and close) and returns its exit code; its contract is
in its module's docstring. Each door is assembled on the one loop: `doors` (`run` in group and queue mode),
`offline` (`classify`, `model eval`), `replay` (`triage-worker replay`); `signals` is how a command that runs
until stopped takes SIGTERM and SIGINT. `stages` starts the parts beside the first model (also for
`classify`, offline); `reload` is the hot-reload thread. May import every production room; never
`worker.cli` or `worker.dev`.
"""
