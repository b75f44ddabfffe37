"""`model eval` refuses in one line, before any work, what would only fail after minutes of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import REPO
from worker import shipped
from worker.cli.cli import main

# A short evaluation, should a check not stop it: the embedded model on 5 tickets, nothing written.
SHORT = ["--modes", "score", "--limit", "5", "--no-cascade", "--out", ""]


def test_without_the_eval_extra_model_eval_says_what_to_install_before_any_work() -> None:
    """It used to measure the model (10 s and more) and only then find scikit-learn missing."""
    hide_sklearn = "import sys; sys.modules['sklearn'] = None; from worker.cli.cli import main; "
    done = subprocess.run(
        [sys.executable, "-c", hide_sklearn + f"sys.exit(main({['model', 'eval', *SHORT]!r}))"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "triage-worker: error: model eval needs scikit-learn for the baselines and the teacher: "
        "pip install 'triage-worker[eval]' (or pass --no-baselines --no-teacher)\n"
    )


def test_without_a_checkout_model_eval_says_to_pass_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed package has no data/banking77: the line named a path inside site-packages."""
    monkeypatch.setattr(shipped, "SOURCE_ROOT", tmp_path / "site-packages")
    assert main(["model", "eval", *SHORT, "--no-baselines", "--no-teacher"]) == 2
    assert capsys.readouterr().err == (
        "triage-worker: error: model eval without --data runs only from a source checkout of triage-worker "
        "(data/banking77 is not part of the installed package); instead, give --data DIR, a folder with "
        "BANKING77's train.csv and test.csv\n"
    )


@pytest.mark.slow  # a minute: both stages on 160 test tickets and 80 strangers
def test_model_eval_reports_the_escalation_stages_out_of_scope_figures(tmp_path: Path) -> None:
    """Issue #46: beside accuracy, `model eval` says how the served detector does on tickets that fit no
    intent (the checkout's 80 out-of-domain tickets by default): recall, precision, the in-scope share it
    flags, in-scope accuracy at that operating point, and AUROC."""
    out = tmp_path / "results"
    argv = ["model", "eval", "--modes", "score", "--limit", "160", "--thresholds", "0.8", "--no-baselines"]
    assert main([*argv, "--no-teacher", "--out", str(out)]) == 0
    scope = json.loads((out / "eval.json").read_text())["cascade"]["out_of_scope"]
    assert scope["tickets"] == 80 and scope["source"].endswith("data/out-of-domain/tickets.txt")
    # The shipped stage flags most tickets of other domains and few banking ones (docs/your-taxonomy.md).
    assert scope["out_of_scope_recall"] > 0.7 and scope["in_scope_flagged"] < 0.1
    assert 0.9 < scope["auroc"] <= 1.0 and scope["in_scope_accuracy"] > 0.8
    assert "out-of-scope recall **" in (out / "eval.md").read_text()


def test_an_out_of_scope_file_without_tickets_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "strangers.txt"
    empty.write_text("\n\n")
    argv = ["model", "eval", "--modes", "score", "--limit", "5", "--thresholds", "0.8", "--no-baselines"]
    assert main([*argv, "--no-teacher", "--out", "", "--out-of-scope", str(empty)]) == 2
    assert capsys.readouterr().err.endswith(f"--out-of-scope: {empty} has no ticket (one per line)\n")
