"""Where `model train` may write, and how (worker/learning/folders.py; issue #43, items 1 and 2): the shipped
folders refused on every path, a folder with anything model train did not write never loses it, and an
interrupted run (SIGINT, SIGTERM, SIGKILL) leaves the model it was replacing serving, its files unchanged.

Real encoder stage (the shipped bge-small int8); the first stage's trainer, which needs the `train` extra and
minutes, is stood in for (its own tests train it): in the interrupted runs by one that starts writing its
files and then trains "forever", as the real one does for up to 20 minutes."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.cli import main
from worker.errors import UserError
from worker.inference.taxonomy import Taxonomy
from worker.learning import compose, folders
from worker.learning.evaluation import canonical_label
from worker.learning.first_stage import Teacher

BANK_DESK_PATH = REPO / "taxonomies" / "bank-desk.toml"
TINY = REPO / "tests" / "models" / "tiny"
ZERO_SHOT = ["model", "train", "--zero-shot", "--taxonomy", str(BANK_DESK_PATH)]
# A `model train` whose first stage starts writing, says so on stderr, then trains until it is stopped.
STALLING_RUN = """
import sys, time
from worker.cli.cli import main
from worker.learning import compose

def first_stage(labelled, validation, taxonomy, taxonomy_path, teacher, out_dir, **options):
    (out_dir / "genai_config.json").write_text("{}")
    print("first stage: writing", file=sys.stderr, flush=True)
    time.sleep(300)
    raise SystemExit("never stopped")

compose._first_stage_trainer = lambda: (first_stage, None)
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def encoder_stage_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first stage's trainer stood aside: the folder holds the encoder stage (seconds to train)."""
    monkeypatch.setattr(compose, "_first_stage_trainer", lambda: (None, "stood aside in this test"))


def _contents(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links as their target), relative path -> sha256 of its bytes."""
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if ".model-train-" in path.name)


def _answer(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[object, ...]:
    """The folder's encoder stage served: (intent, confidence, model) of one ticket."""
    capsys.readouterr()
    assert main(["classify", "my card was stolen on the train", "--model", str(folder / "encoder")]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    return result["intent"], result["confidence"], result["model"]


# -- the shipped folders, on every path -------------------------------------------------------------------


def test_the_checkouts_shipped_folders_are_never_a_target() -> None:
    for name in ("triage-mini", "triage-encoder"):
        with pytest.raises(UserError, match=f"is the shipped model {name}: never replaced"):
            folders.check_target(REPO / "models" / name)
        with pytest.raises(UserError, match=f"is inside the shipped model {name}"):
            folders.check_target(REPO / "models" / name / "encoder")


def _bank_desk_export(path: Path) -> Path:
    with (REPO / "taxonomies" / "bank-desk.banking77.csv").open(encoding="utf-8") as handle:
        mapping = {row["banking77_intent"]: row["bank_desk_intent"] for row in csv.DictReader(handle)}
    taken: dict[str, int] = {}
    source = REPO / "data" / "banking77" / "train.csv"
    with (
        source.open(encoding="utf-8", newline="") as rows,
        path.open("w", encoding="utf-8", newline="") as handle,
    ):
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for row in csv.DictReader(rows):
            intent = mapping[canonical_label(row["category"])]
            if taken.get(intent, 0) < 3:
                taken[intent] = taken.get(intent, 0) + 1
                writer.writerow([row["text"], intent])
    return path


@pytest.mark.parametrize("shipped", ["triage-mini", "triage-encoder"])
@pytest.mark.parametrize("path", ["zero-shot", "data", "encoder", "first stage", "feedback"])
def test_every_path_refuses_an_installed_wheels_shipped_folders_and_leaves_them_as_they_were(
    shipped: str,
    path: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    encoder_stage_only: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An installed wheel's copies (worker/_shipped/models/...) have a training.json each, as the checkout's
    do: `model train` deleted any folder with one on its --data/--zero-shot paths."""
    wheel = tmp_path / "site-packages" / "worker" / "_shipped"
    shutil.copytree(REPO / "models" / shipped, wheel / "models" / shipped, symlinks=True)
    monkeypatch.setattr("worker.shipped.WHEEL_COPIES", wheel)
    target = wheel / "models" / shipped
    before = _contents(target)
    argv = {
        "zero-shot": ZERO_SHOT,
        "data": ["model", "train", "--data", str(_bank_desk_export(tmp_path / "export.csv")),
                 "--taxonomy", str(BANK_DESK_PATH)],
        "encoder": ["model", "train", "--encoder", "--data", str(_bank_desk_export(tmp_path / "export.csv")),
                    "--taxonomy", str(BANK_DESK_PATH)],
        "first stage": ["model", "train"],
        "feedback": ["model", "train", "--feedback", str(tmp_path / "verdicts.jsonl")],
    }[path]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"triage-worker: error: --out {target} is the shipped model {shipped}: never replaced; choose "
        "another folder"
    )
    assert _contents(target) == before


# -- folders with files model train did not write ---------------------------------------------------------


def test_a_folder_is_replaced_only_when_it_holds_nothing_but_what_model_train_wrote(
    tmp_path: Path, encoder_stage_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    written = json.loads((out / "training.json").read_text())["written_by"]
    assert written["tool"] == "triage-worker model train" and written["format"] == 1
    assert set(written["files"]) == set(_contents(out)) and "encoder/head.npz" in written["files"]
    # Its own folder: replaced whole.
    assert main([*ZERO_SHOT, "--out", str(out), "--seed", "5"]) == 0
    # The same folder with a person's notes and data in it: refused, one line, nothing lost.
    (out / "notes.txt").write_text("keep me")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    before = _contents(out)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"triage-worker: error: --out {out} holds sub/, notes.txt, which `model train` did not write: "
        "refusing to replace it and lose them; move them out, or choose another --out"
    )
    assert _contents(out) == before and not _leftovers(tmp_path)


@pytest.mark.parametrize(
    "record",
    [
        {"epochs": 3, "val_accuracy": 0.9},  # another trainer's record, as the shipped models have
        {"kind": "few-shot", "written_by": {"tool": "someone else", "format": 1, "files": ["a"]}},
    ],
    ids=["another tool's training.json", "another written_by"],
)
def test_a_training_json_that_is_not_model_trains_record_does_not_make_a_folder_replaceable(
    record: dict[str, object], tmp_path: Path, encoder_stage_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "training.json").write_text(json.dumps(record))
    (out / "model.onnx").write_bytes(b"weights")
    before = _contents(out)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"triage-worker: error: --out {out} is not empty and is not a folder `model train` "
    )
    assert err.endswith("refusing to replace it; choose another --out, or empty it yourself")
    assert _contents(out) == before


def test_a_folder_of_the_release_before_written_by_is_replaced_when_it_holds_only_its_files(
    tmp_path: Path, encoder_stage_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    record = json.loads((out / "training.json").read_text())
    del record["written_by"]  # as the release before wrote it: `kind`, no `written_by`
    (out / "training.json").write_text(json.dumps(record))
    (out / "encoder" / "out_of_scope.npz").unlink()  # nor a zero-shot detector (issue #46, since)
    (out / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 2
    assert "holds notes.txt, which `model train` did not write" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    assert "written_by" in json.loads((out / "training.json").read_text())


def test_a_folder_that_gains_other_files_while_training_is_left_as_it_is_and_the_new_model_kept_beside(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    encoder_stage_only: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0

    def first_stage(
        labelled: Sequence[tuple[str, str]],
        validation: Sequence[tuple[str, str]],
        taxonomy: Taxonomy,
        taxonomy_path: Path,
        teacher: Teacher | None,
        out_dir: Path,
        **options: object,
    ) -> None:
        (out / "notes.txt").write_text("written while the model trained")

    monkeypatch.setattr(compose, "_first_stage_trainer", lambda: (first_stage, None))
    before = _contents(out)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    (kept,) = (path for path in tmp_path.iterdir() if path.name.startswith("desk.new-"))
    assert err.endswith(f"(it changed while training); the new model is in {kept}")
    after = _contents(out)
    assert after.pop("notes.txt") and after == before and (kept / "encoder" / "head.npz").is_file()


# -- interrupted runs -------------------------------------------------------------------------------------


def _start_stalling_run(out: Path, cwd: Path) -> subprocess.Popen[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("KAFKA_", "TRIAGE_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, "-c", STALLING_RUN, *ZERO_SHOT, "--out", str(out)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(found: Callable[[], bool], process: subprocess.Popen[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not found():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the first stage never started writing"
        time.sleep(0.05)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_interrupted_retrain_leaves_the_model_it_replaces_serving_and_the_same_command_then_works(
    stop: signal.Signals, tmp_path: Path, encoder_stage_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    before = _contents(out)
    answer = _answer(out, capsys)
    process = _start_stalling_run(out, tmp_path)
    try:
        _wait_for(lambda: any(tmp_path.rglob("genai_config.json")), process, 120)
        process.send_signal(stop)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == (-stop if stop == signal.SIGKILL else 128 + stop)
    # The model it was replacing: its files as they were, and it still answers.
    assert _contents(out) == before
    assert _answer(out, capsys) == answer
    if stop == signal.SIGKILL:  # no clean-up could run: the next run does it
        (partial,) = _leftovers(tmp_path)
        assert partial == f".desk.model-train-{socket.gethostname()}-{process.pid}.partial"
    else:
        assert err.strip().splitlines()[-1] == (
            f"model train stopped by {stop.name}: {out} is as it was (the model in it still serves); the "
            "partial folder was removed"
        )
        assert not _leftovers(tmp_path)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    if stop == signal.SIGKILL:
        assert f"left by an interrupted run (process {process.pid})" in capsys.readouterr().err
    assert not _leftovers(tmp_path) and "written_by" in json.loads((out / "training.json").read_text())


def test_a_model_a_killed_swap_had_moved_aside_is_put_back(
    tmp_path: Path, encoder_stage_only: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kill between the swap's two renames (signals are held there, SIGKILL cannot be) leaves DIR
    missing and the previous model in its old folder: the next run beside it puts it back first."""
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    aside = tmp_path / f".desk.model-train-{socket.gethostname()}-{dead.pid}.old"
    out.rename(aside)
    before = _contents(aside)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(tmp_path / "other")]) == 0  # beside another folder: not touched
    assert _contents(aside) == before
    assert main([*ZERO_SHOT, "--out", str(out), "--seed", "5"]) == 0
    assert f"{out}: put back the model an interrupted run (process {dead.pid}) had moved aside" in (
        capsys.readouterr().err
    )
    assert not _leftovers(tmp_path) and (out / "encoder" / "head.npz").is_file()


def test_a_folder_that_cannot_be_moved_aside_is_left_as_it_is_and_the_new_model_kept_beside(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    encoder_stage_only: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A volume mounted at --out cannot be renamed (EBUSY): the run must not lose its model or the folder."""
    out = tmp_path / "desk"
    assert main([*ZERO_SHOT, "--out", str(out)]) == 0
    before = _contents(out)
    rename = Path.rename

    def mount_point(self: Path, target: str | Path) -> Path:
        if self == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", mount_point)
    capsys.readouterr()
    assert main([*ZERO_SHOT, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    (kept,) = (path for path in tmp_path.iterdir() if path.name.startswith("desk.new-"))
    assert err == (
        f"triage-worker: error: --out {out} cannot be moved aside (Device or resource busy; a mount point?), "
        f"so it is as it was: train into a folder inside it; the new model is in {kept}"
    )
    assert _contents(out) == before and (kept / "training.json").is_file() and not _leftovers(tmp_path)
