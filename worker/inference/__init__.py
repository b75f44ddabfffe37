"""The inference room (its map is in worker/__init__.py).

No model phones home. onnxruntime and onnxruntime-genai (0.15+) send telemetry events to a vendor collector
unless `ORT_DISABLE_TELEMETRY` is set when they start (measured on Linux, 40 s each: onnxruntime-genai 0.18
generating with models/triage-mini made 14 connect() calls to the DNS resolver, plain onnxruntime 1.32 running
the encoder stage 8; with the variable, none; `disable_telemetry_events()` alone left every one of them).
Plain onnxruntime reads it once, when imported. Every module of this room is imported through this package,
so setting the variable here, before any of them imports either library, covers every process that loads a
model (the worker, its pools' processes, the commands, the tools and the trainers), and the processes they
start inherit it. It is set whatever the environment said: the worker's promise is no connection but its
broker's, its Schema Registry's and its metrics port (docs/privacy.md).

The same way, and for the same processes, numpy's OpenBLAS is told to put its threads to sleep as soon as a
product is done (`OPENBLAS_THREAD_TIMEOUT`, read once when numpy loads; kept where the environment sets it).
By default each thread spins for about 2^28 cycles waiting for the next product: the encoder stage makes one
(the ticket against every training row, for the neighbour vote and the out-of-scope distance) per escalated
ticket, so its threads spun between tickets on the cores the first stage needed (measured on 2 cores: 8.9 ms
of CPU per product with the ticket-sized pauses between them, 2.3 ms with 4; the products' values are the same
bits, the threads splitting the work as before).
"""

import os

os.environ["ORT_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
