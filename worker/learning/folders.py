"""Where `model train` and `model import` may write a model folder, and how: built beside it, then swapped in
whole.

Every path of `model train` (both stages, `--encoder`, BANKING77's first stage, learning from feedback)
writes its folder `--out DIR` through `writing(DIR)`, and `model import` through `writing(DIR, MODEL_IMPORT)`
(a `Writer`: the command, and the record file it leaves in the folder; below, `model train`'s):

1. `check_target(DIR)`, before any work and again at the swap: the shipped folders (a checkout's
   models/triage-mini and models/triage-encoder, the copies inside an installed wheel) and anything inside
   them are refused, as are a file and a folder with anything in it that `model train` cannot prove it
   wrote (`_refusal`): a folder it replaces loses nothing but the files of the model it held.
2. The new folder is built in `.DIR.model-train-HOST-PID.partial` beside DIR (the same filesystem: the swap
   is two renames, no copy).
3. Complete, its `training.json` gets `written_by` (`Writer.tool`, `FORMAT`, every file written); the old
   folder is renamed to `.DIR.model-train-HOST-PID.old`, the new one to DIR, and the old one removed.
   SIGINT and SIGTERM are held across the renames, so no stop leaves DIR missing.
4. Any exception or stop before that (Ctrl-C, SIGTERM, a bug, a UserError): the partial folder is removed,
   DIR is as it was (the model in it still serves), and one line says so.

A run killed outright (SIGKILL, power loss) leaves its partial or old folder behind; the next run into the
same DIR on the same host removes them once their process is gone, or renames a lost DIR back from its old
folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worker import shipped
from worker.errors import UserError

TRAINING_FILE = "training.json"
# The version of the rules of a record's `written_by` (the tool, this format, the files): a folder is a
# writer's to replace when its record says so and its files are those the record lists.
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Writer:
    """A command that writes model folders through `writing`: it replaces only folders whose `record` (a
    JSON object it writes into each) says `written_by` it, and its partial and old folders carry `command`'s
    name."""

    command: str
    record: str

    @property
    def tool(self) -> str:
        """The name in the record's `written_by`."""
        return f"triage-worker {self.command}"


MODEL_TRAIN = Writer("model train", TRAINING_FILE)
# `model import` (worker/learning/model_import.py): its record says where the model came from.
MODEL_IMPORT = Writer("model import", "import.json")
# The shipped model folders, in a checkout and in an installed wheel (worker/shipped.py).
SHIPPED_MODELS = ("models/triage-mini", "models/triage-encoder")
# What a `model train --data/--zero-shot` folder of the release before `written_by` could hold: its
# training.json says `kind`, and these are the only files it wrote (the first stage's export, the encoder
# stage, the records). Such a folder is replaced when it holds nothing else.
LEGACY_KINDS = ("zero-shot", "few-shot", "full")
LEGACY_FILES = frozenset(
    {
        "genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "special_tokens_map.json", "added_tokens.json", "taxonomy.toml",
        "trained_labels.json", TRAINING_FILE, "README.md", "VERSION", "encoder/encoder.json",
        "encoder/head.npz", "encoder/tokenizer.json", "encoder/model.onnx", "encoder/taxonomy.toml",
        "encoder/VERSION",
    }
)  # fmt: skip


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during `model train` (`stop_signals_raise`), raised where the run was, so that
    every folder it was writing is cleaned up on the way out. `reported`: a line already said what became of
    the folder."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.reported = False


@contextlib.contextmanager
def stop_signals_raise(held: list[int]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise `Interrupted` (SIGTERM would otherwise end the
    process without any cleanup); `held`: the signals the CLI held while it started, acted on first. The
    handlers before are restored after."""

    def stop(signum: int, _frame: types.FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {
        stop_signal: signal.signal(stop_signal, stop) for stop_signal in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for signum in held:
            raise Interrupted(signum)
        yield
    finally:
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)


def _shipped_folders() -> list[Path]:
    roots = (shipped.SOURCE_ROOT, shipped.WHEEL_COPIES)
    return [root / relative for root in roots for relative in SHIPPED_MODELS]


def check_target(out: Path, writer: Writer = MODEL_TRAIN) -> None:
    """A one-line UserError when `writer` may not replace `out` with a model folder (see the module);
    nothing when it may: `out` is new, an empty folder, or a folder `writer` wrote that holds nothing
    else."""
    refusal = _refusal(out, writer)
    if refusal is not None:
        raise UserError(refusal)


def refuse_shipped(out: Path) -> None:
    """A one-line UserError when `out` is a shipped model folder, inside one, or inside the installed
    package's copies: no command writes there (`model export` included)."""
    refusal = _shipped_refusal(out)
    if refusal is not None:
        raise UserError(refusal)


def _shipped_refusal(out: Path) -> str | None:
    resolved = out.resolve()
    for folder in _shipped_folders():
        if resolved == folder.resolve():
            return f"--out {out} is the shipped model {folder.name}: never replaced; choose another folder"
        if resolved.is_relative_to(folder.resolve()):
            return f"--out {out} is inside the shipped model {folder.name}: choose a folder outside it"
    if resolved.is_relative_to(shipped.WHEEL_COPIES.resolve()):
        return f"--out {out} is inside the installed package's files: choose another folder"
    return None


def _refusal(out: Path, writer: Writer) -> str | None:
    refusal = _shipped_refusal(out)
    if refusal is not None:
        return refusal
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        return f"--out {out} is not a folder: choose a folder ({writer.command} writes one)"
    if not out.exists() or not any(out.iterdir()):
        return None
    listed = _files_written(out, writer)
    if isinstance(listed, str):
        return (
            f"--out {out} is not empty and is not a folder `{writer.command}` wrote ({listed}): refusing to "
            "replace it; choose another --out, or empty it yourself"
        )
    others = _other_entries(out, listed)
    if others:
        named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return (
            f"--out {out} holds {named}, which `{writer.command}` did not write: refusing to replace it and "
            "lose them; move them out, or choose another --out"
        )
    return None


def _files_written(folder: Path, writer: Writer) -> frozenset[str] | str:
    """The files `writer` wrote into `folder`, from its record, or why it cannot be said."""
    try:
        record = json.loads((folder / writer.record).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {writer.record}"
    except (OSError, ValueError):
        return f"its {writer.record} cannot be read"
    if not isinstance(record, dict):
        return f"its {writer.record} is not {writer.command}'s record"
    written_by = record.get("written_by")
    if written_by is None:
        # The release before `written_by`: its `model train --data/--zero-shot` folders said `kind`.
        if writer == MODEL_TRAIN and record.get("kind") in LEGACY_KINDS:
            return LEGACY_FILES
        return f"its {writer.record} does not say `written_by` {writer.tool!r}"
    if not isinstance(written_by, dict) or written_by.get("tool") != writer.tool:
        return f"its {writer.record} is another tool's record"
    if written_by.get("format") != FORMAT:
        return f"written by another release of {writer.command} (record format {written_by.get('format')!r})"
    files = written_by.get("files")
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return f"its {writer.record} does not list the files written"
    return frozenset(files)


def _entries(folder: Path) -> tuple[set[str], set[str]]:
    """(files, folders) under `folder`, relative POSIX paths; a link (to a folder too) counts as a file."""
    files: set[str] = set()
    folders: set[str] = set()
    for root, dirnames, filenames in os.walk(folder):
        base = Path(root).relative_to(folder)
        for name in dirnames:
            (files if (Path(root) / name).is_symlink() else folders).add((base / name).as_posix())
        files.update((base / name).as_posix() for name in filenames)
    return files, folders


def _other_entries(folder: Path, written: frozenset[str]) -> list[str]:
    """What is in `folder` besides the files `written` and the folders holding them, shortest first."""
    files, folders = _entries(folder)
    holding = {parent.as_posix() for name in written for parent in Path(name).parents}
    others = (files - written) | (folders - holding)
    # A folder of others is named once, not with each file in it.
    tops = {name for name in others if not any(name.startswith(other + "/") for other in others)}
    return sorted((f"{name}/" if name in folders else name for name in tops), key=lambda n: (len(n), n))


def _prefix(target: Path, writer: Writer) -> str:
    """The name of this host's partial and old folders beside `target`, up to the process id: a process of
    another host (a pod sharing the volume) is none this one can tell alive or dead."""
    return f".{target.name}.{writer.command.replace(' ', '-')}-{socket.gethostname()}-"


def _temporary(target: Path, role: str, writer: Writer) -> Path:
    """This process's partial or old folder beside `target`."""
    return target.parent / f"{_prefix(target, writer)}{os.getpid()}.{role}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has no folder yet: one of this number is an earlier process's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _clean_stale(target: Path, writer: Writer) -> None:
    """Remove the partial and old folders that runs on this host killed outright left beside `target`, and
    rename a lost `target` back from its old folder (a kill between the swap's two renames)."""
    left = re.compile(re.escape(_prefix(target, writer)) + r"(\d+)\.(partial|old)")
    for entry in sorted(target.parent.iterdir()):
        match = left.fullmatch(entry.name)
        if match is None or _pid_alive(int(match[1])):
            continue
        if match[2] == "old" and not target.exists():
            entry.rename(target)
            _say(f"{target}: put back the model an interrupted run (process {match[1]}) had moved aside")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            _say(f"removed {entry}, left by an interrupted run (process {match[1]})")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held (then acted on) while the block runs: a rename or a clean-up is never cut in
    half. Only the main thread can set handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, _frame: types.FrameType | None) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)
        for signum in received:
            signal.raise_signal(signum)


def _stamp(folder: Path, writer: Writer) -> None:
    """Add `written_by` to the folder's record: the tool, the format, and every file in the folder."""
    path = folder / writer.record
    record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    files, _ = _entries(folder)
    record["written_by"] = {"tool": writer.tool, "format": FORMAT, "files": sorted(files | {writer.record})}
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


@contextlib.contextmanager
def writing(out: Path, writer: Writer = MODEL_TRAIN) -> Iterator[Path]:
    """A new empty folder beside `out` to build the model folder in (it must write `writer`'s record);
    swapped in as `out` when the block completes, removed when it does not (see the module)."""
    check_target(out, writer)
    target = Path(os.path.abspath(out))  # `--out .` has a name and a parent to put the partial folder in
    partial = _temporary(target, "partial", writer)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(target, writer)
        partial.mkdir()
    except OSError as error:
        raise UserError(f"--out {out}: cannot write beside it: {error.strerror or error}") from None
    swapped = False
    try:
        yield partial
        _stamp(partial, writer)
        with _stop_signals_held():
            _swap(partial, out, target, writer)
            swapped = True
    except BaseException as error:
        stop = error.args[0] if isinstance(error, Interrupted) else "SIGINT"
        if isinstance(error, Interrupted):
            error.reported = True
        if swapped:  # a stop held while the new folder was swapped in, acted on once it was
            _say(f"{writer.command} stopped by {stop}: {out} holds the new model (it was being swapped in)")
            raise
        with _stop_signals_held():
            shutil.rmtree(partial, ignore_errors=True)
        if not target.exists():
            kept = f"{out} was not made"
        elif (target / writer.record).is_file():
            kept = f"{out} is as it was (the model in it still serves)"
        else:
            kept = f"{out} is as it was"
        if isinstance(error, KeyboardInterrupt):
            _say(f"{writer.command} stopped by {stop}: {kept}; the partial folder was removed")
        elif not isinstance(error, _NotReplaced):
            _say(f"{writer.command} failed: {kept}; the partial folder was removed")
        raise


class _NotReplaced(UserError):
    """`out` could not be replaced after all (it changed while training, or cannot be renamed); the new
    model was kept beside it under another name, which the message gives."""


def _keep_aside(partial: Path, target: Path, why: str) -> _NotReplaced:
    kept = target.parent / f"{target.name}.new-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    partial.rename(kept)
    return _NotReplaced(f"{why}; the new model is in {kept}")


def _swap(partial: Path, out: Path, target: Path, writer: Writer) -> None:
    refusal = _refusal(out, writer)  # checked again: the folder may have changed in the minutes training took
    if refusal is not None:
        raise _keep_aside(partial, target, f"{refusal} (it changed while training)")
    if not target.is_dir():
        partial.rename(target)
        return
    old = _temporary(target, "old", writer)
    try:
        target.rename(old)
    except OSError as error:  # a mount point (a volume mounted at --out) cannot be renamed
        raise _keep_aside(
            partial,
            target,
            f"--out {out} cannot be moved aside ({error.strerror}; a mount point?), so it "
            "is as it was: train into a folder inside it",
        ) from None
    try:
        partial.rename(target)
    except OSError:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)
