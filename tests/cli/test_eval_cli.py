"""`model eval` refuses in one line, before any work, what would only fail after minutes of it."""

from __future__ import annotations

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
