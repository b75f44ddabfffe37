"""The rooms import one way (see `worker/__init__.py`): a newcomer can trust the folder names."""

from __future__ import annotations

import ast
from pathlib import Path

import worker

PACKAGE = Path(worker.__file__).parent
# What each room may import besides the shared modules (worker/*.py); ops may import everything.
ALLOWED = {
    "shared": set(),
    "kafka": set(),
    "inference": set(),
    "pipeline": {"kafka"},
    "replay": {"kafka", "pipeline"},
    "ops": {"kafka", "inference", "pipeline", "replay", "ops"},
}


def _room(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if relative.name == "__main__.py":
        return "ops"  # `python -m worker` is the CLI
    return relative.parts[0] if len(relative.parts) > 1 else "shared"


def _imported_rooms(path: Path) -> set[str]:
    rooms = set()
    # Every import, those inside functions too.
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "worker" and len(parts) > 2 and parts[1] in ALLOWED:
                rooms.add(parts[1])
    return rooms


def test_each_room_imports_only_what_it_may() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = _room(path)
        for imported in _imported_rooms(path) - ALLOWED[room] - {room}:
            wrong.append(f"{path.relative_to(PACKAGE)} ({room}) imports worker.{imported}")
    assert wrong == []
