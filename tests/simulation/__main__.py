"""`PYTHONPATH=tests python -m simulation`: the simulator's command line (see `cli.py`). tests/ goes on
the path as pytest puts it there, so that the package imports the in-memory fakes (`memory_kafka`)
as the tests do."""

import sys

from simulation.cli import main

sys.exit(main(sys.argv[1:]))
