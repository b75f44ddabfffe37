"""What soak and chaos share: a run against a real local broker that checks promises, prints progress lines
to stderr, and writes results/<name>.json and .md (every promise with its figure and bound) and exits 1 when
one is broken."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools import REPO


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def quiet_clients(name: str) -> Path:
    """Sends what librdkafka writes to fd 2 (hundreds of "Connection refused" lines per broker outage, from
    this process's producer and offset watcher) to a file, keeping progress and tracebacks on the terminal."""
    path = Path(tempfile.gettempdir()) / f"triage-{name}-clients-{os.getpid()}.log"
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(sink, 2)
    os.close(sink)
    sys.stderr = terminal
    return path


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    system = f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    return f"{os.cpu_count()} CPUs ({model}), {system}"


def header(name: str, args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "name": name,
        "command": f"python -m tools.{name} " + shlex.join(sys.argv[1:]),
        "quick": args.quick,
        "commit": commit or "unknown",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def write(out: Path, name: str, figures: dict[str, Any], table: list[tuple[str, str]]) -> bool:
    """results/<name>.json and .md; True when every promise holds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    promises: dict[str, dict[str, Any]] = figures["promises"]
    lines = [
        f"# {name}{' (--quick)' if figures['quick'] else ''}",
        "",
        f"`{figures['command']}` at {figures['commit']}, {figures['when']}, on {figures['machine']} "
        f"(load average at start {figures['load_average_at_start']}).",
        "",
        "| promise | figure | bound | holds |",
        "|---|---|---|---|",
        *(
            f"| {k} | {v['figure']} | {v['bound']} | {'yes' if v['ok'] else '**NO**'} |"
            for k, v in promises.items()
        ),
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in table),
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(lines), encoding="utf-8")
    ok = all(p["ok"] for p in promises.values())
    progress(f"{name}: {'all promises hold' if ok else 'PROMISE BROKEN'}; {out / name}.md")
    return ok


def promise(figure: object, bound: str, ok: bool) -> dict[str, Any]:
    return {"figure": figure, "bound": bound, "ok": bool(ok)}


def arguments(description: str | None) -> argparse.ArgumentParser:
    """The options every run takes: --quick, --out and --seed."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 2-3 minute version")
    parser.add_argument("--out", type=Path, default=REPO / "results")
    parser.add_argument("--seed", type=int, default=5)
    return parser


def main(name: str, run: Callable[[argparse.Namespace], bool], args: argparse.Namespace) -> int:
    """Runs `run` with this process's Kafka client logs in a file; 0 when every promise holds."""
    progress(f"{name}: Kafka client logs of this process go to {quiet_clients(name)}")
    return 0 if run(args) else 1
