"""The rooms import one way (see `worker/__init__.py`): a newcomer can trust the folder names."""

from __future__ import annotations

import ast
from pathlib import Path

import worker

PACKAGE = Path(worker.__file__).parent
# What each room may import besides the shared modules (worker/*.py); cli may import everything.
ALLOWED = {
    "shared": {"settings", "privacy"},
    # The settings (worker/settings): the sections, their loader, the command-line glue and the writer; of
    # the worker only the shared modules and the kinds of personal data a section names, so every room may
    # use it.
    "settings": {"privacy"},
    "kafka": {"settings", "privacy"},
    "inference": {"settings", "privacy"},
    "pipeline": {"kafka", "settings", "privacy"},
    "replay": {"kafka", "pipeline", "settings", "privacy"},
    "telemetry": {"kafka", "inference", "pipeline", "replay", "settings", "privacy"},
    # The trainers, evaluation, fine-tuning on feedback (read from its topic, rejects dead-lettered with the
    # pipeline's redaction of a value) and the artifact fetch: never the command line or the dev parts.
    "learning": {"inference", "kafka", "pipeline", "settings", "privacy"},
    # Data contracts (Schema Registry formats): what a record's bytes mean; no Kafka client, no model.
    "contracts": {"settings", "privacy"},
    # Personal data (worker/privacy): imports nothing of the worker, so every room may use it.
    "privacy": set(),
    # The assembly point: the running worker built from its settings, so every production room, and the
    # hot-reload thread; never the command line or the dev parts.
    "app": {
        *("kafka", "inference", "pipeline", "replay", "telemetry", "learning", "contracts", "settings"),
        "privacy",
    },
    # The command line: every command, so everything.
    "cli": {
        *(
            "app",
            "kafka",
            "inference",
            "pipeline",
            "replay",
            "telemetry",
            "learning",
            "contracts",
            "settings",
        ),
        *("privacy", "dev"),
    },
    # Development-only parts: the local broker and registry, sample tickets, and the generator of docs/'s
    # reference parts, which reads the settings, the metrics' collectors and the CLI's flags and defaults.
    "dev": {"kafka", "pipeline", "telemetry", "cli", "settings", "privacy"},
}
# The rooms the running worker is made of: none of them may import the command line or the dev parts.
PRODUCTION = set(ALLOWED) - {"cli", "dev"}


def _room(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if relative.name == "__main__.py":
        return "cli"  # `python -m worker` is the CLI
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


def test_the_rooms_are_the_folders() -> None:
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders | {"shared"} == set(ALLOWED)


def test_no_production_room_imports_the_command_line_or_the_dev_parts() -> None:
    wrong = [
        f"{path.relative_to(PACKAGE)} ({_room(path)}) imports worker.{imported}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if _room(path) in PRODUCTION
        for imported in _imported_rooms(path) & {"cli", "dev"}
    ]
    assert wrong == []
    assert not {"cli", "dev"} & set().union(*(ALLOWED[room] for room in PRODUCTION))


def test_no_command_module_imports_another() -> None:
    """What two commands share lives in a module that is not a command (a cli helper, `worker.app`, the room
    its meaning belongs to): a command module is only ever imported by `cli.build_parser`."""
    wrong = []
    for path in sorted((PACKAGE / "cli").glob("*_command.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
                if node.module == "worker.cli":  # `from worker.cli import x_command`
                    names += [f"worker.cli.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            wrong += [f"{path.name} imports {name}" for name in names if name.endswith("_command")]
    assert wrong == []


# What runs a model or decides what becomes of its answer: the pool and its engines, the loop, the model stage
# with its cascade. Only the assembly point (worker/app) puts them together for a door.
MODEL_RUNNING_MODULES = {
    "worker.inference.pool",
    "worker.inference.engine",
    "worker.inference.genai",
    "worker.pipeline.engine",
    "worker.pipeline.triage.cascade",
    "worker.pipeline.triage.model_stage",
    "worker.pipeline.triage.stage",
}


def test_no_command_opens_a_model_or_decides_an_escalation_itself() -> None:
    """A command gets its door from `worker.app` (`classify_lines`, `classify_texts`, `offline_stages`, the
    replay's and the worker's assembly), so it cannot grow a submit/poll loop or an escalation rule of its own
    that the worker's promises do not reach."""
    wrong = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            wrong += [f"{path.name} imports {name}" for name in names if name in MODEL_RUNNING_MODULES]
    assert wrong == []


# The assembly point and the rooms above it: where the whole `Settings` is split into what each part uses.
TAKES_WHOLE_SETTINGS = {"app", "cli", "dev", "settings"}


def _names_whole_settings(annotation: ast.expr | None) -> bool:
    """Whether an annotation mentions `Settings` itself (bare, dotted, quoted or inside a union or generic),
    not one of its sections (`PipelineSettings`, ...)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Settings":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Settings":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                quoted = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if _names_whole_settings(quoted):
                return True
    return False


def _whole_settings_annotations(path: Path) -> list[str]:
    """Where `path` annotates a parameter, a return or an attribute with the whole `Settings`."""
    annotated: list[tuple[int, str, ast.expr | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [each for each in (arguments.vararg, arguments.kwarg) if each is not None]
            annotated += [
                (node.lineno, f"{node.name}({argument.arg})", argument.annotation) for argument in every
            ]
            annotated.append((node.lineno, f"{node.name} -> return", node.returns))
        elif isinstance(node, ast.AnnAssign):
            annotated.append((node.lineno, ast.unparse(node.target), node.annotation))
    return [
        f"{path.relative_to(PACKAGE)}:{line} {where}"
        for line, where, annotation in annotated
        if _names_whole_settings(annotation)
    ]


def test_no_part_below_the_assembly_point_takes_the_whole_settings() -> None:
    """A part takes its own section (`PipelineSettings`, ...) or plain values, so that what it depends on is
    in its signature; only the assembly point (`worker.app`), the rooms above it and the settings room itself
    hold the whole `Settings`."""
    wrong = [
        where
        for path in sorted(PACKAGE.rglob("*.py"))
        if _room(path) not in TAKES_WHOLE_SETTINGS
        for where in _whole_settings_annotations(path)
    ]
    assert wrong == []


REPO = PACKAGE.parent
TESTS = {path.stem for path in (REPO / "tests").rglob("*.py")}
# The test folders: one per room of the package (tests/shared for worker/*.py), and tests/project for the
# checkout around it (docs, deploy files, the container, packaging, this file).
# `simulation`: the fault simulator drives every door at once (docs/guarantees.md#simulator).
TEST_ROOMS = set(ALLOWED) | {"project", "simulation"}


def _imports(path: Path) -> set[str]:
    """The top-level names of every module `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


def _touches_sys_path(path: Path) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
    )


def test_worker_tools_and_tests_import_one_way_without_sys_path_edits() -> None:
    """The installed worker needs neither tools/ nor tests/; the tools (`python -m tools.<name>`) need no test
    module; the tests find `tools.harness` through pytest's `pythonpath`, so no file edits `sys.path`."""
    wrong = [
        f"{path.relative_to(REPO)} imports {sorted(_imports(path) & {'tools', 'tests'})}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if _imports(path) & {"tools", "tests"}
    ]
    wrong += [
        f"{path.relative_to(REPO)} imports test modules {sorted(_imports(path) & TESTS)}"
        for path in sorted((REPO / "tools").rglob("*.py"))
        if _imports(path) & TESTS
    ]
    wrong += [
        f"{path.relative_to(REPO)} edits sys.path"
        for folder in ("worker", "tools", "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
        if _touches_sys_path(path)
    ]
    assert wrong == []


def test_each_test_module_sits_in_a_room_folder() -> None:
    """tests/<room>/test_*.py, where <room> is the room whose behaviour it tests (tests/README.md); tests/
    itself keeps only the helpers the rooms share. The folders are not packages, so pytest and mypy know a
    test module by its file name alone: two with the same name in different rooms would shadow each other."""
    modules = sorted((REPO / "tests").rglob("test_*.py"))
    misplaced = [
        str(path.relative_to(REPO))
        for path in modules
        if path.parent.parent != REPO / "tests" or path.parent.name not in TEST_ROOMS
    ]
    assert misplaced == []
    names = [path.name for path in modules]
    assert sorted({name for name in names if names.count(name) > 1}) == []
