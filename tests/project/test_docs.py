"""The docs a newcomer reads: a short README whose links resolve, generated tables that match the code, and
the README's five-minute tour, run line by line against a broker it starts itself."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tools import REPO
from worker.cli.cli import build_parser
from worker.cli.defaults import default_of
from worker.cli.flags import flag_settings
from worker.dev import reference
from worker.dev.local_broker import kafka_home

README = REPO / "README.md"
DOCS = REPO / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_every_docs_page_is_linked_from_it() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    linked = {(REPO / target).resolve() for target in _LINK.findall(text)}
    pages = set(DOCS.glob("*.md"))
    assert {page.resolve() for page in pages} <= linked, sorted(map(str, pages - linked))


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda path: path.name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        target, _, anchor = match.group(1).partition("#")
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: broken link {match.group(1)}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path.read_text(encoding="utf-8")), (
                f"{page.name}: no #{anchor} in {path.name}"
            )


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings}


def test_generated_tables_match_the_code() -> None:
    pages = reference.pages()
    assert {page.name for page in pages} >= {"configuration.md", "operations.md"}
    stale = reference.stale(pages)
    assert not stale, f"generated parts are stale in {[p.name for p in stale]}: run `make docs`"
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for key in reference.setting_keys():
        assert f"| `{key}` |" in text
    metrics = (DOCS / "operations.md").read_text(encoding="utf-8")
    for name in ("triage_transactions_total", "triage_model_process_cpu_seconds_total", "triage_group_lag"):
        assert f"| `{name}` |" in metrics


def test_a_stale_generated_table_is_found_and_rewritten(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# x\n\n<!-- generated: run-flags (make docs) -->\n| old |\n<!-- end generated -->\n")
    assert reference.stale([page]) == [page]
    page.write_text(reference.refreshed(page.read_text()))
    assert reference.stale([page]) == []
    assert "| `--max-in-flight` | `pipeline.max_in_flight` | `64` |" in page.read_text()


def test_every_setting_has_a_meaning_and_every_meaning_a_setting() -> None:
    assert set(reference.SETTING_DOCS) == set(reference.setting_keys())


def test_run_help_states_the_defaults_of_settings() -> None:
    run = next(
        parser
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, parser in action.choices.items()
        if name == "run"
    )
    helps = {option: action.help for action in run._actions for option in action.option_strings}
    for flag, key in flag_settings():
        assert helps[flag] is not None and helps[flag].endswith(f"(default: {default_of(key)})"), flag
    assert helps["--max-in-flight"].endswith("(default: 64)")
    assert helps["--model"].endswith("(default: the embedded model, triage-mini)")  # no absolute path


def _tour() -> str:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- tour -->\n```sh\n(.*?)```\n<!-- end tour -->", text, flags=re.DOTALL)
    assert block is not None, "the README's tour block is missing"
    return block.group(1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.kafka
@pytest.mark.slow
def test_the_readme_tour_runs_as_written(tmp_path: Path) -> None:
    """Every line of the tour, in one shell that stops at the first failing command. Two substitutions keep
    it off whatever runs on this machine: the broker gets a free port (the other commands find it through
    KAFKA_BOOTSTRAP_SERVERS) and its state goes under tmp_path (XDG_CACHE_HOME), the jars staying cached."""
    tour = _tour()
    port = _free_port()
    script = tour.replace("source .venv/bin/activate", f"source {shlex.quote(sys.prefix)}/bin/activate", 1)
    script = script.replace("broker start --fresh", f"broker start --fresh --port {port}", 1)
    assert script.count(str(port)) == 1 and sys.prefix in script
    env = {key: value for key, value in os.environ.items() if not key.startswith(("KAFKA_", "TRIAGE_"))}
    env.update(
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        TRIAGE_KAFKA_HOME=str(kafka_home()),
        KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{port}",
    )
    try:
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:  # whatever happened, no broker is left behind
        subprocess.run(
            [sys.executable, "-m", "worker", "broker", "stop"], env=env, capture_output=True, check=False
        )
    log = (tmp_path / "worker.log").read_text(errors="replace") if (tmp_path / "worker.log").exists() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nworker log:\n{log[-3000:]}"
    out = done.stdout
    sent = re.search(r"^sent ticket (t-[0-9a-f]{8}) to tickets\.raw", out, flags=re.MULTILINE)
    assert sent is not None, out
    assert re.search(rf"^  {sent.group(1)}\s+lost_or_stolen_card\s+Critical\s+0\.\d\d", out, re.MULTILINE), (
        out
    )
    assert "DEAD LETTER" in out and "invalid_json: value is not valid JSON: Input data was truncated" in out
    # After the replay, the repaired ticket has a triage record of its own, not a fallback.
    assert re.search(r"^  t-broken\s+\w+\s+(Low|Medium|High|Critical)\s+[01]\.\d\d", out, re.MULTILINE), out
    assert "Would replay (1)" in out and "Committed for group triage-replay.tickets.dlq" in out
    assert "pipeline_stopped" in log, log[-2000:]  # the worker stopped gracefully
