"""`make bench`'s P2 in absolute figures (tools/bench/p2_classify.py): default `classify` timed as a whole
command, its whole process tree's CPU counted (tools/bench/tree_time.py), beside a pinned commit's in the
same run, in bench.md's table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tools import REPO
from tools.bench import p2_classify, report
from tools.load import LabelledTickets

# A child that leaves a grandchild burning CPU after it exits: nobody but a subreaper reaps the grandchild.
_ORPHAN = textwrap.dedent(
    """
    import subprocess, sys
    burn = "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"
    subprocess.Popen([sys.executable, "-c", burn])
    """
)


def test_tree_time_counts_the_cpu_of_a_process_its_parent_left_behind() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools/bench/tree_time.py"), "--", sys.executable, "-c", _ORPHAN],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    times = json.loads(done.stdout.splitlines()[-1])
    assert times["cpu_s"] >= 0.4
    assert times["wall_s"] >= 0.4  # it waited for the orphan, not only for its parent


@pytest.mark.slow
def test_the_default_path_is_measured_against_a_pinned_commit_and_reported_absolutely() -> None:
    classify = p2_classify.measure(LabelledTickets(), count=12, rounds=1, baseline_commit="HEAD")
    for side in ("current", "baseline"):
        assert classify[side]["rate"] > 0 and classify[side]["cpu_ms_per_ticket"] > 0
        assert sum(classify[side]["stages"].values()) == 12
    assert classify["baseline"]["answers_differing"] == 0  # the same code answers the same
    table = "\n".join(" | ".join(row) for row in report._classify_rows({"classify": classify}))
    assert f"{classify['current']['rate']:,.1f} tickets/s" in table
    assert f"{classify['current']['cpu_ms_per_ticket']:.2f} ms" in table
    assert "vs HEAD" in table
