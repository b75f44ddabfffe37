"""The package as users get it: a wheel built from a copy of this checkout, installed into a clean venv
outside it and used from another folder; and each ONNX Runtime GenAI extra resolving to exactly one build
(pip's own resolver, `--dry-run --report`, against PyPI)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import worker
from tools import REPO
from tools.harness import Topics, audit, make_topics
from worker.inference.genai import MISSING_RUNTIME

ENCODER = "models/triage-encoder/model.onnx"
# Every distribution that installs the `onnxruntime_genai` package, and every one that installs `onnxruntime`.
GENAI_BUILDS = {"onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml"}
ORT_BUILDS = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-directml"}
# pip takes a --platform tag literally (no older manylinux tags implied): a glibc 2.28 machine also installs
# manylinux_2_17 wheels (tokenizers publishes only those).
LINUX = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]
WINDOWS = ["--platform", "win_amd64"]
# PyPI and a wheel build: minutes on a busy 2-core machine, not seconds.
PIP_TIMEOUT_S = 900


def _pip(python: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def _committed_files(source: Path) -> Path:
    """The files git would commit, copied to `source`: nothing ignored (venv, build/) gets in."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # a file deleted but not yet committed is still listed
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    return source


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel` of a copy of the committed files (the checkout gets no build/ folder), plus the one ignored
    file a build needs: the cascade's encoder, which `make setup` copies into its stage folder."""
    source = _committed_files(tmp_path_factory.mktemp("source"))
    shutil.copy2(REPO / ENCODER, source / ENCODER)
    dist = tmp_path_factory.mktemp("dist")
    _pip(sys.executable, "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(source))
    (built,) = dist.glob("triage_worker-*.whl")
    return built


@pytest.mark.release
def test_a_wheel_without_the_cascades_encoder_is_refused_saying_how_to_get_it(tmp_path: Path) -> None:
    """A fresh clone before `make setup`: the build stops instead of shipping a worker without its cascade."""
    source = _committed_files(tmp_path / "source")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and not list(tmp_path.glob("*.whl"))
    assert (
        f"{ENCODER} is missing (the cascade's encoder, not kept in git): run `make setup`"
        in done.stdout + (done.stderr)
    )


def _resolved(wheel: Path, extra: str, platform: list[str], target: Path) -> set[str]:
    """Names of every distribution pip would install for `wheel[extra]` on `platform` (Python 3.11)."""
    report = target / "report.json"
    requirement = f"{wheel}[{extra}]" if extra else str(wheel)
    _pip(
        sys.executable,
        *("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)),
        *("--only-binary=:all:", "--python-version", "3.11", *platform, "--target", str(target / "t")),
        requirement,
    )
    return {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}


@pytest.mark.release
@pytest.mark.parametrize(
    ("extra", "platform", "genai", "runtime"),
    [
        ("", LINUX, set(), set()),
        ("cpu", LINUX, {"onnxruntime-genai"}, {"onnxruntime"}),
        ("cpu", WINDOWS, {"onnxruntime-genai"}, {"onnxruntime"}),
        ("cuda", LINUX, {"onnxruntime-genai-cuda"}, {"onnxruntime-gpu"}),
        ("cuda", WINDOWS, {"onnxruntime-genai-cuda"}, {"onnxruntime-gpu"}),
        ("directml", WINDOWS, {"onnxruntime-genai-directml"}, {"onnxruntime-directml"}),
    ],
    ids=["bare", "cpu-linux", "cpu-windows", "cuda-linux", "cuda-windows", "directml-windows"],
)
def test_each_extra_installs_exactly_one_onnxruntime_build(
    wheel: Path, extra: str, platform: list[str], genai: set[str], runtime: set[str], tmp_path: Path
) -> None:
    names = _resolved(wheel, extra, platform, tmp_path)
    assert names & GENAI_BUILDS == genai
    assert names & ORT_BUILDS == runtime
    assert "triage-worker" in names and "confluent-kafka" in names


@dataclass
class Installed:
    """A clean venv (no access to this checkout) with the wheel installed, commands run from `workdir`."""

    bin: Path
    workdir: Path
    bare: dict[str, subprocess.CompletedProcess[str]]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # Nothing of this checkout or session leaks in: no PYTHONPATH, no KAFKA_*/TRIAGE_* settings, and an
        # empty user cache (what the wheel needs, it carries).
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_", "PYTHON"))}
        cache = str(self.workdir / "cache")
        isolated = {"PATH": f"{self.bin}:{keep.get('PATH', '')}", "XDG_CACHE_HOME": cache}
        return {**keep, **isolated, **(extra or {})}

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / "triage-worker"), *args],
            cwd=self.workdir,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """First the bare wheel (its answers kept in `bare`), then the same with the `cpu` extra."""
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    workdir = root / "elsewhere"
    workdir.mkdir()
    python = venv / "bin" / "python"
    _pip(python, "install", "--quiet", str(wheel))
    bare = Installed(venv / "bin", workdir, {})
    bare.bare = {
        "classify": bare.cli("classify", "my card was stolen"),
        "config": bare.cli("config", "show"),
    }
    _pip(python, "install", "--quiet", f"{wheel}[cpu]")
    return bare


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.release
def test_the_bare_install_names_the_extras_and_still_shows_its_config(installed: Installed) -> None:
    line = _one_line_error(installed.bare["classify"])
    assert line == f"triage-worker: error: {MISSING_RUNTIME}"
    assert "triage-worker[cpu]" in line and "[cuda]" in line and "[directml]" in line
    assert installed.bare["config"].returncode == 0
    assert '"bootstrap.servers" = "127.0.0.1:9092"' in installed.bare["config"].stdout


@pytest.mark.release
def test_the_installed_wheel_classifies_with_its_embedded_model_from_any_folder(installed: Installed) -> None:
    done = installed.cli("classify", "my card was stolen yesterday, please block it")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == "triage-mini" and not result["fallback"]
    assert result["intent"] == "lost_or_stolen_card" and result["priority"] == "Critical"

    shown = installed.cli("config", "show")
    assert shown.returncode == 0, shown.stderr
    model = next(line for line in shown.stdout.splitlines() if line.startswith("model = "))
    # The package's own copy, not this checkout's.
    assert "site-packages/worker/_shipped/models/triage-mini" in model and str(REPO) not in model

    assert installed.cli("schemas", "--check").returncode == 0
    written = installed.workdir / "contracts"
    assert installed.cli("schemas", "--write", "--dir", str(written)).returncode == 0
    assert (written / "triage_result.schema.json").is_file()
    assert "pass --dir" in _one_line_error(installed.cli("schemas", "--write"))


@pytest.mark.release
def test_checkout_only_commands_say_so_in_one_line(installed: Installed) -> None:
    broker = _one_line_error(installed.cli("broker", "start"))
    assert "runs only from a source checkout" in broker and "--bootstrap-servers" in broker
    # `model train` alone: the way to a model of one's own tickets, in one line.
    bare = _one_line_error(installed.cli("model", "train"))
    assert "model train --data FILE --taxonomy T --out DIR" in bare and "your-taxonomy.md" in bare
    # The embedded model (not a folder `model train` wrote, though it has a training.json of its own recipe)
    # fine-tunes beside BANKING77, which only a checkout has.
    feedback = _one_line_error(installed.cli("model", "train", "--feedback", "f.jsonl", "--out", "tuned"))
    assert "runs only from a source checkout" in feedback and "give --data DIR" in feedback
    # The package's own model folders are never a `model train` target (#43: --zero-shot deleted them).
    shown = installed.cli("config", "show").stdout
    mini = Path(next(line for line in shown.splitlines() if line.startswith("model = ")).split('"')[1])
    for folder in (mini, mini.parent / "triage-encoder"):
        files = sorted(path.name for path in folder.iterdir())
        argv = ["--zero-shot", "--taxonomy", str(mini / "taxonomy.toml"), "--out", str(folder)]
        refused = _one_line_error(installed.cli("model", "train", *argv))
        assert f"is the shipped model {folder.name}: never replaced" in refused
        assert sorted(path.name for path in folder.iterdir()) == files
    # Without the `eval` extra (the cpu extra only), before any work; then without a checkout's data.
    assert "pip install 'triage-worker[eval]'" in _one_line_error(installed.cli("model", "eval"))
    evaluate = _one_line_error(installed.cli("model", "eval", "--no-baselines", "--no-teacher"))
    assert "give --data DIR" in evaluate and "site-packages" not in evaluate


@pytest.mark.kafka
@pytest.mark.release
def test_the_installed_wheel_runs_and_replays_against_a_real_broker(
    installed: Installed, kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    """topics create, produce-samples, run and replay from the installed scripts, each told the broker with
    --bootstrap-servers (no KAFKA_* in their environment)."""
    topics = make_topics(unique_topic)
    bootstrap = ["--bootstrap-servers", kafka_bootstrap]
    names = _topic_flags(topics)
    created = installed.cli("topics", "create", *bootstrap, *names)
    assert created.returncode == 0 and "already exists" in created.stdout, created.stderr

    log = installed.workdir / f"worker-{uuid.uuid4().hex[:6]}.log"
    with log.open("wb") as sink:
        worker = subprocess.Popen(
            [
                str(installed.bin / "triage-worker"),
                "run",
                *bootstrap,
                *_run_flags(topics),
                "--log-format=json",
            ],
            cwd=installed.workdir,
            env=installed.env(),
            stdout=sink,
            stderr=sink,
        )
    try:
        produced = installed.cli(
            "produce-samples", *bootstrap, *names, "--count", "30", "--rate", "0", "--malformed-ratio", "0.2"
        )
        assert produced.returncode == 0, produced.stderr
        result = _wait_for_audit(kafka_bootstrap, topics, 30, worker, log)
        assert result.lost == [] and result.dead_lettered > 0
        replayed = installed.cli(
            "replay", *bootstrap, f"--dlq={topics.dead_letter}", "--from-beginning", "--json"
        )
        assert replayed.returncode == 0, replayed.stderr
        assert json.loads(replayed.stdout)["counts"]["replayed"] == result.dead_lettered
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(120)
    lines = log.read_text(errors="replace").splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    assert code == 0, log.read_text(errors="replace")[-3000:]
    # The cascade is on by default with the embedded model: its escalation stage came from the wheel.
    assert any(e["event"] == "cascade_started" for e in events), [e["event"] for e in events]


def _topic_flags(topics: Topics) -> list[str]:
    return [
        *("--set", f"topics.input={topics.input}"),
        *("--set", f"topics.output={topics.output}"),
        *("--set", f"topics.dead_letter={topics.dead_letter}"),
    ]


def _run_flags(topics: Topics) -> list[str]:
    return [
        *("--input-topic", topics.input, "--output-topic", topics.output),
        *("--dead-letter-topic", topics.dead_letter, "--group-id", f"installed-{uuid.uuid4().hex[:8]}"),
    ]


@dataclass
class _Outcome:
    lost: list[tuple[int, int]]
    dead_lettered: int


def _wait_for_audit(
    bootstrap: str, topics: Topics, count: int, worker: subprocess.Popen[bytes], log: Path
) -> _Outcome:
    deadline = time.monotonic() + 240
    while True:
        found = audit(bootstrap, topics)
        if len(found.inputs) == count and not found.lost:
            return _Outcome(found.lost, sum(map(len, found.dead.values())))
        assert worker.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{len(found.lost)} tickets without an answer"
        time.sleep(2)


@pytest.mark.release
def test_the_installed_wheel_carries_the_escalation_stage_with_its_encoder(installed: Installed) -> None:
    """The cascade's stage ships like the embedded model, its 34 MB encoder included: nothing to fetch into
    the (empty) user cache."""
    done = installed.cli("model", "fetch")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("triage-encoder: encoder at ")
    assert "/site-packages/worker/_shipped/models/triage-encoder/model.onnx" in done.stdout


_PRINT_METADATA_VERSION = "import importlib.metadata as m; print(m.version('triage-worker'))"


@pytest.mark.release
def test_the_wheel_its_metadata_and_its_cli_carry_the_packages_one_version(
    wheel: Path, installed: Installed
) -> None:
    """pyproject.toml reads the version from worker/__init__.py: the wheel's name, its installed metadata and
    `triage-worker --version` all say `worker.__version__`."""
    assert wheel.name.startswith(f"triage_worker-{worker.__version__}-"), wheel.name
    done = installed.cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"triage-worker {worker.__version__}"
    metadata = subprocess.run(
        [str(installed.bin / "python"), "-c", _PRINT_METADATA_VERSION],
        env=installed.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert metadata.stdout.strip() == worker.__version__
