"""Telemetry: one HTTP port per process, Prometheus `/metrics`, liveness `/healthz`, readiness `/readyz`.

Nothing here runs on the consumer thread. The pipeline keeps plain counters and histograms in
`PipelineMetrics` (see worker/pipeline/metrics.py); a custom Collector turns them into Prometheus families
when Prometheus scrapes, on the server's own thread. Broker reachability for `/readyz` is checked by a
background thread with its own admin client, so a probe never waits on the broker, nor the loop on a probe.

- `/healthz` (liveness): 200 unless the consumer loop has not turned for `metrics.stall_timeout_ms`. Before
  the loop starts (model loading) it is 200: restarting a loading worker would only load it again.
- `/readyz` (readiness): 200 once the model pool is warm, the broker answers, and the consumer has joined its
  group; otherwise 503 with the failing checks in the JSON body.
- `POST /reload` (the worker only, for holders of the token in `metrics.reload_token_file`; closed without
  one): starts a hot reload of the model and answers 202 at once, or 409 while one waits or runs; the
  outcome goes to the logs and `triage_reloads_total{outcome}` (see worker/app/reload.py).

Modules: `server` (the HTTP server and the `Probes` contract), `access` (who may `POST /reload`),
`probes` (the worker's liveness and readiness, the background broker check), `collectors` (the Prometheus
families the worker exports), `worker` (the worker's endpoint, assembled as its pieces come up), `replay` (a
replay's progress).
"""
