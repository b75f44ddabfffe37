"""The encoder stage's product with its training rows (the neighbour vote and the out-of-scope distance, one
per escalated ticket) costs the CPU of the product, not of BLAS threads spinning between tickets
(worker/inference/__init__.py), and gives the same values as numpy's defaults do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# One escalated ticket at a time against BANKING77's 9,077 reference rows, a pause the size of the encoder's
# own work between them: what the cascade's escalation process does.
_PRODUCTS = """
import hashlib, json, time{imports}
import numpy as np
rng = np.random.default_rng(7)
reference = rng.standard_normal((9077, 384)).astype(np.float32)
tickets = rng.standard_normal((60, 1, 384)).astype(np.float32)
digest = hashlib.sha256()
started = time.process_time()
for ticket in tickets:
    digest.update((ticket @ reference.T).tobytes())
    time.sleep(0.005)
print(json.dumps({{"cpu_s": time.process_time() - started, "sha256": digest.hexdigest()}}))
"""


def _products(worker: bool, **env: str) -> dict[str, float | str]:
    """The products' CPU seconds and their values' digest in a fresh interpreter: with the worker's inference
    package imported first (`worker`), or numpy alone, under `env` and none of OpenBLAS's own variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "OMP_", "GOTO_"))}
    script = _PRODUCTS.format(imports="\nimport worker.inference" if worker else "")
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=clean | env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, float | str] = json.loads(done.stdout)
    return result


_BLAS = str(np.__config__.CONFIG["Build Dependencies"]["blas"]["name"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenBLAS runs one thread on one core")
@pytest.mark.skipif("openblas" not in _BLAS, reason=f"numpy's BLAS is {_BLAS}, not OpenBLAS")
def test_escalation_sized_products_cost_no_spinning_threads_and_keep_their_values() -> None:
    alone = _products(worker=False)
    served = _products(worker=True)
    one_thread = _products(worker=False, OPENBLAS_NUM_THREADS="1")
    assert served["sha256"] == alone["sha256"]
    # Spinning, the same products took 4-7x the CPU of one thread doing them all (2 cores); asleep, 1.5-2x.
    assert float(served["cpu_s"]) < 3 * float(one_thread["cpu_s"]), (served, one_thread, alone)
