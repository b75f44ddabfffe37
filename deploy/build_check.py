"""Runs the Dockerfile's steps without a Docker engine: what can be checked here, is.

    python deploy/build_check.py [--bootstrap HOST:PORT] [--keep]

1. Parses the Dockerfile (stages, ENV, WORKDIR, COPY, RUN, USER, HEALTHCHECK, ENTRYPOINT, CMD) and the
   .dockerignore, and builds the build context the same way Docker would (ignored files left out).
2. Replays the stages into one scratch directory standing in for the image's filesystem (absolute paths of
   the image, such as /opt/venv and /app, are mapped under it): every COPY source must exist in the context;
   every RUN is run with bash and the stage's ENV, except user and package administration (groupadd, useradd,
   apt-get), which needs root inside an image and is only reported.
3. Starts the result as the image would: ENTRYPOINT with `config show` and `classify` (the embedded model from
   its copied location, the installed package, no repository around it); with --bootstrap also `topics create`
   and ENTRYPOINT + CMD (`run`), waits until the HEALTHCHECK command passes, stops it with SIGTERM (exit 0).

Not checked: the base image itself (Debian slim's shared libraries, its Python version: the local Python runs
the steps), file ownership and the USER switch, the HEALTHCHECK timing; `make image-check` covers those with
the built image where an engine exists. PIP_NO_CACHE_DIR is dropped so that reruns use the local pip cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# RUN commands that administer the image's OS; they need root inside a container, not in a venv.
_SYSTEM_COMMANDS = {"groupadd", "useradd", "apt-get", "apk", "chown", "adduser", "addgroup"}


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Image:
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path = Path("/")
    user: str | None = None
    healthcheck: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = number
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, args = whole.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    return instructions


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    index = 0
    while index < len(pattern):
        if pattern.startswith("**", index):
            out += ".*"
            index += 2
            if pattern.startswith("/", index):
                out += "/?"
                index += 1
            continue
        char = pattern[index]
        out += "[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char)
        index += 1
    return re.compile(out)


class DockerIgnore:
    """.dockerignore semantics: the last pattern matching a path or one of its parents decides."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str], str]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = line.lstrip("!").strip().strip("/")
            self.rules.append((include, _pattern_regex(pattern), pattern))

    def excluded(self, path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for include, regex, _ in self.rules:
            if any(regex.fullmatch(prefix) for prefix in prefixes):
                result = not include
        return result

    def may_include_under(self, directory: str) -> bool:
        """Whether an exception pattern could bring back something below an excluded directory."""
        return any(
            include and (pattern.startswith(directory + "/") or pattern.startswith("**"))
            for include, _, pattern in self.rules
        )


def build_context(repo: Path, ignore: DockerIgnore, into: Path) -> None:
    for current, dirs, files in os.walk(repo):
        relative_dir = Path(current).relative_to(repo).as_posix()
        for name in list(dirs):
            rel = name if relative_dir == "." else f"{relative_dir}/{name}"
            if name == ".git" or (ignore.excluded(rel) and not ignore.may_include_under(rel)):
                dirs.remove(name)
        for name in files:
            rel = name if relative_dir == "." else f"{relative_dir}/{name}"
            if not ignore.excluded(rel):
                target = into / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(current) / name, target)


def _image_dirs(instructions: list[Instruction]) -> set[str]:
    """Top-level directories the Dockerfile creates (WORKDIR, COPY targets): the paths mapped under root."""
    dirs: set[str] = set()
    for item in instructions:
        if item.keyword == "WORKDIR":
            dirs.add(item.args.strip("/").split("/")[0])
        elif item.keyword == "COPY":
            target = shlex.split(item.args)[-1]
            if target.startswith("/"):
                dirs.add(target.strip("/").split("/")[0])
    return dirs


def _mapper(root: Path, dirs: set[str]) -> Callable[[str], str]:
    """Maps the image's absolute paths (in a PATH-like list too) under `root`; other values pass through."""

    def remap(value: str) -> str:
        segments = []
        for segment in value.split(":"):
            first = segment.strip("/").split("/")[0] if segment.startswith("/") else None
            segments.append(f"{root}{segment}" if first in dirs else segment)
        return ":".join(segments)

    return remap


def _env_pairs(args: str) -> list[tuple[str, str]]:
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:  # legacy `ENV KEY value`
        return [(tokens[0], " ".join(tokens[1:]))]
    return [(key, value) for key, _, value in (token.partition("=") for token in tokens)]


def replay(instructions: list[Instruction], context: Path, root: Path, python: str) -> Image:
    dirs = _image_dirs(instructions)
    remap = _mapper(root, dirs)
    image = Image(root)
    args: dict[str, str] = {}
    shims = root / ".shims"
    shims.mkdir(parents=True)
    (shims / "python").symlink_to(python)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("TRIAGE_", "KAFKA_", "VIRTUAL_ENV"))}
    base_env["PATH"] = f"{shims}:{base_env.get('PATH', '')}"
    for item in instructions:
        where = f"Dockerfile:{item.line}"
        if item.keyword == "ARG":
            name, _, default = item.args.partition("=")
            args[name] = default
        elif item.keyword == "FROM":
            image.env = dict(base_env)
            image.workdir = Path("/")
        elif item.keyword == "ENV":
            for key, value in _env_pairs(item.args):
                # Map the image's paths first, then expand $VARS (this machine's PATH must stay as it is).
                image.env[key] = re.sub(
                    r"\$\{?(\w+)\}?", lambda m: image.env.get(m.group(1), ""), remap(value)
                )
        elif item.keyword == "WORKDIR":
            image.workdir = Path(item.args)
            (root / item.args.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif item.keyword == "COPY":
            tokens = shlex.split(item.args)
            flags = [t for t in tokens if t.startswith("--")]
            *sources, target = [t for t in tokens if not t.startswith("--")]
            from_stage = any(flag.startswith("--from=") for flag in flags)
            dest = Path(target) if target.startswith("/") else image.workdir / target
            for source in sources:
                origin = root / source.lstrip("/") if from_stage else context / source
                if not origin.exists():
                    raise SystemExit(
                        f"{where}: COPY source {source} is missing (or excluded by .dockerignore)"
                    )
                into = root / dest.as_posix().lstrip("/")
                if origin.is_dir():
                    if origin.resolve() != into.resolve():
                        shutil.copytree(origin, into, dirs_exist_ok=True)
                else:
                    into = into / origin.name if target.endswith("/") else into
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, into)
        elif item.keyword == "RUN":
            # Flags such as --mount=type=secret are the engine's; a secret is simply absent here.
            script = re.sub(r"^(--\S+\s+)+", "", item.args)
            words = set(re.findall(r"(?:^|&&|;|\|\|)\s*([\w-]+)", script))
            if words & _SYSTEM_COMMANDS:
                image.skipped.append(f"{where}: RUN {script[:70]}... (OS administration: image only)")
                continue
            env = {k: v for k, v in image.env.items() if k != "PIP_NO_CACHE_DIR"}
            print(f"{where}: RUN {script}", flush=True)
            cwd = root / image.workdir.as_posix().lstrip("/")
            subprocess.run(["bash", "-ec", script], cwd=cwd, env=env, check=True)
        elif item.keyword == "USER":
            image.user = item.args
        elif item.keyword == "HEALTHCHECK":
            image.healthcheck = json.loads(item.args.split("CMD", 1)[1].strip())
        elif item.keyword == "ENTRYPOINT":
            image.entrypoint = json.loads(item.args)
        elif item.keyword == "CMD":
            image.cmd = json.loads(item.args)
    return image


def _exe(image: Image, argv: list[str]) -> list[str]:
    """argv as the image's PATH would resolve it (the venv's scripts, not this machine's)."""
    found = shutil.which(argv[0], path=image.env["PATH"])
    assert found, f"{argv[0]} not on the image's PATH"
    return [found, *argv[1:]]


def smoke(image: Image, bootstrap: str | None) -> None:
    cwd = image.root / image.workdir.as_posix().lstrip("/")
    env = dict(image.env)
    shown = subprocess.run(
        _exe(image, [*image.entrypoint, "config", "show"]), cwd=cwd, env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert f'model = "{image.root}/app/models/triage-mini"' in shown.stdout, shown.stdout
    answer = subprocess.run(
        _exe(image, [*image.entrypoint, "classify", "my card was stolen yesterday"]),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert answer.returncode == 0, answer.stderr
    result = json.loads(answer.stdout)
    assert result["intent"] and not result["fallback"], result
    print(f"image: classify → {result['intent']} / {result['priority']} ({result['model']})")
    if bootstrap is None:
        return
    env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    env["TRIAGE_METRICS__PORT"] = str(_free_port())
    suffix = os.urandom(3).hex()
    for section_key in ("INPUT", "OUTPUT", "DEAD_LETTER"):
        env[f"TRIAGE_TOPICS__{section_key}"] = f"build-check.{section_key.lower()}.{suffix}"
    env["TRIAGE_PIPELINE__GROUP_ID"] = f"build-check-{suffix}"
    created = subprocess.run(
        _exe(image, [*image.entrypoint, "topics", "create"]), cwd=cwd, env=env, capture_output=True, text=True
    )
    assert created.returncode == 0, created.stderr
    worker = subprocess.Popen(
        _exe(image, [*image.entrypoint, *image.cmd]),
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            check = subprocess.run(_exe(image, image.healthcheck), cwd=cwd, env=env, capture_output=True)
            if check.returncode == 0:
                break
            assert worker.poll() is None, f"worker exited {worker.returncode}"
            assert time.monotonic() < deadline, "HEALTHCHECK never passed"
            time.sleep(0.5)
        print("image: `run` is up and its HEALTHCHECK passes")
        # Ready (model warm, group joined) before the SIGTERM: the graceful path starts with the loop.
        ready_url = f"http://127.0.0.1:{env['TRIAGE_METRICS__PORT']}/readyz"
        while not _answers(ready_url):
            assert worker.poll() is None and time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(60)
        assert code == 0, f"worker exited {code} on SIGTERM"
    finally:
        if worker.poll() is None:
            worker.kill()
        _, errors = worker.communicate()
        if worker.returncode not in (0, None) and errors:
            print(errors[-3000:], file=sys.stderr)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:  # refused, or an HTTP error status (503: not ready)
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bootstrap", help="a Kafka broker: also create topics, start `run`, pass HEALTHCHECK"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (printed)")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter standing in for the base image's"
    )
    options = parser.parse_args()
    instructions = parse_dockerfile((REPO / "Dockerfile").read_text())
    ignore = DockerIgnore((REPO / ".dockerignore").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="triage-build-check-"))
    try:
        context, root = scratch / "context", scratch / "root"
        build_context(REPO, ignore, context)
        image = replay(instructions, context, root, options.python)
        assert image.user and image.user.split(":")[0] != "0", "the image must not run as root"
        assert image.entrypoint and image.healthcheck, "ENTRYPOINT and HEALTHCHECK are required"
        for note in image.skipped:
            print(f"not run here: {note}")
        smoke(image, options.bootstrap)
        print("build check passed")
        return 0
    finally:
        if options.keep:
            print(f"scratch: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
