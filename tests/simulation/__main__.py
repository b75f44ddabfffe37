"""`python -m tests.simulation`: the simulator's command line (see `cli.py`)."""

import sys
from pathlib import Path

# The package imports the in-memory fakes as pytest does (tests/ on the path), and itself as `simulation`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulation.cli import main

sys.exit(main(sys.argv[1:]))
