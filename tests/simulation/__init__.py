"""A deterministic fault simulator of the one engine, for every door (issue 55, item 1).

FoundationDB's and TigerBeetle's way, at the scale of this worker: a seed makes a schedule — inputs of
every shape, model answers, errors, slow answers and deaths, broker refusals, the Schema Registry away and
back, rebalances and lost partitions, lock expiries and delivery counts up to the limit, SIGTERM and kill
-9 at any point (`schedule.py`); the real door, as the app assembles it, runs it over the in-memory Kafka
and share group on a virtual clock (`harness.py`, `fakes.py`, `model.py`, `clock.py`), single-threaded, in
milliseconds; then each input is held to the door's promise (`checks.py`). `runner.py` sweeps seeds,
shrinks a failing schedule and prints how to replay it; `PYTHONPATH=tests python -m simulation` is its
command line;
`test_simulation.py` runs thousands of schedules in the fast tier.
"""
