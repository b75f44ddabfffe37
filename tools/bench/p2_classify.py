"""P2 in absolute figures: the default path, `triage-worker classify --input FILE` with default settings,
timed as a whole command (start-up included) on the first BANKING77 test tickets, from this checkout and
from a pinned older commit in the same run (`--baseline-commit`, built as a git worktree in a temporary
folder), alternating this checkout and the baseline so that a machine's drift moves both.

P2's ratio is the worker against its own raw pool: both can slow down together and leave the ratio where it
was (issue #58: 82 → 66 tickets/s while the ratio stayed 0.86x). These figures say how fast the default path
is, and whether the answers moved: each run's records minus their timing fields are compared with this
checkout's first run (intent, priority, confidence, out of scope).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tools import REPO
from tools.bench.measure import progress
from tools.load import LabelledTickets

ANSWER_FIELDS = ("intent", "priority", "confidence", "out_of_scope")
TIMING_FIELDS = ("latency_ms", "classified_at")
# The model files a checkout does not track (git-ignored, fetched or copied in): a baseline worktree gets this
# checkout's where its own folder lacks them, so that both serve the same models.
UNTRACKED_MODEL_FILES = ("models/triage-encoder/model.onnx",)


def measure(tickets: LabelledTickets, count: int, rounds: int, baseline_commit: str | None) -> dict[str, Any]:
    """`rounds` runs of default `classify` over `count` tickets from this checkout and, when
    `baseline_commit` is given, as many from that commit, in turn."""
    with tempfile.TemporaryDirectory(prefix="triage-bench-classify-") as tmp:
        folder = Path(tmp)
        source = folder / "tickets.jsonl"
        source.write_text(
            "".join(
                json.dumps({"ticket_id": f"bench-{i}", "body": tickets.text(i)}) + "\n" for i in range(count)
            )
        )
        with _baseline_tree(baseline_commit, folder) as baseline:
            trees = {"current": REPO} | ({} if baseline is None else {"baseline": baseline})
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            for round_ in range(rounds):
                for name, tree in trees.items():
                    progress(f"P2 classify: {name} run {round_ + 1} of {rounds} ({count} tickets)")
                    runs[name].append(_run(tree, source, folder / f"{name}-{round_}.jsonl", count))
            reference = _answers(folder / "current-0.jsonl")
            figures = {
                name: _summary(
                    done,
                    [_differing(reference, _answers(folder / f"{name}-{i}.jsonl")) for i in range(rounds)],
                )
                for name, done in runs.items()
            }
    result: dict[str, Any] = {
        "tickets": count,
        "rounds": rounds,
        "baseline_commit": baseline_commit,
        **figures,
    }
    if "baseline" in figures:
        result["rate_ratio"] = round(figures["current"]["rate"] / figures["baseline"]["rate"], 3)
        result["cpu_ratio"] = round(
            figures["current"]["cpu_ms_per_ticket"] / figures["baseline"]["cpu_ms_per_ticket"], 3
        )
    return result


@contextlib.contextmanager
def _baseline_tree(commit: str | None, folder: Path) -> Iterator[Path | None]:
    """A detached git worktree of `commit` under `folder` (removed afterwards), with this checkout's untracked
    model files where it lacks them; None without a commit."""
    if commit is None:
        yield None
        return
    tree = folder / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", "--quiet", str(tree), commit],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    try:
        for name in UNTRACKED_MODEL_FILES:
            if (REPO / name).exists() and (tree / name).parent.is_dir() and not (tree / name).exists():
                shutil.copyfile(REPO / name, tree / name)
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


def _run(tree: Path, source: Path, output: Path, count: int) -> dict[str, Any]:
    """One whole `classify` command of `tree` (its package first on the path, this interpreter), its tree's
    wall and CPU seconds from this checkout's tree_time.py (by its path: an older tree has none)."""
    command = [sys.executable, "-m", "worker", "classify", "--input", str(source), "--output", str(output)]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("tree_time.py")), "--", *command],
        cwd=tree,
        env=os.environ | {"PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"classify in {tree} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    times: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return times | {"tickets": count}


def _answers(path: Path) -> dict[str, dict[str, Any]]:
    """Each ticket's record without its timing fields."""
    records = (json.loads(line) for line in path.read_text().splitlines())
    return {r["ticket_id"]: {k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records}


def _differing(reference: dict[str, dict[str, Any]], answers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How many tickets' answers (ANSWER_FIELDS) and whole records differ from `reference`'s, and the split
    between the stages."""
    stages: dict[str, int] = {}
    for record in answers.values():
        stage = str(record.get("stage"))
        stages[stage] = stages.get(stage, 0) + 1
    return {
        "answers_differing": sum(
            1
            for ticket, record in reference.items()
            if any(record.get(k) != answers.get(ticket, {}).get(k) for k in ANSWER_FIELDS)
        ),
        "records_differing": sum(1 for ticket, record in reference.items() if record != answers.get(ticket)),
        "stages": stages,
    }


def _summary(runs: list[dict[str, Any]], differences: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's rate and CPU per ticket over the whole command, every run kept."""
    count = runs[0]["tickets"]
    rates = [count / run["wall_s"] for run in runs]
    cpus = [1000 * run["cpu_s"] / count for run in runs]
    return {
        "rate": round(statistics.median(rates), 1),
        "cpu_ms_per_ticket": round(statistics.median(cpus), 2),
        "runs": [run | difference for run, difference in zip(runs, differences, strict=True)],
        "answers_differing": max(d["answers_differing"] for d in differences),
        "stages": differences[0]["stages"],
    }
