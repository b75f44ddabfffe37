"""Regenerate worker/librdkafka.py: the configuration property names of the installed librdkafka.

    .venv/bin/python -m tools.librdkafka_properties [--write]

librdkafka prints its own property table (the one in its CONFIGURATION.md) with
`rd_kafka_conf_properties_show(FILE *)`; confluent-kafka's wheels bundle the library, which is called here
through ctypes (Linux: the bundled `confluent_kafka.libs/librdkafka-*.so*`, else a system librdkafka).
Without --write it prints the differences from worker/librdkafka.py and exits 1 if there are any;
tests/settings/test_kafka_env.py runs the same comparison.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import re
import sys
import tempfile
from pathlib import Path

import confluent_kafka

from tools import REPO
from worker.librdkafka import LIBRDKAFKA_VERSION, PROPERTIES

MODULE = REPO / "worker" / "librdkafka.py"
# A row of the table: `name | C/P | range | default | importance | description`.
_ROW = re.compile(r"^([A-Za-z0-9._]+)\s+\|")


def library_path() -> str | None:
    """The librdkafka that confluent_kafka loads: its bundled copy, else the system's; None if not found."""
    bundled = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    for candidate in sorted(bundled.glob("librdkafka*.so*")):
        return str(candidate)
    return ctypes.util.find_library("rdkafka")


def installed_properties(library: str) -> set[str]:
    """Every property name in the library's own table (global and topic properties, aliases included)."""
    rdkafka = ctypes.CDLL(library)
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    rdkafka.rd_kafka_conf_properties_show.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(mode="r", suffix=".md") as table:
        handle = libc.fopen(table.name.encode(), b"w")
        if not handle:
            raise OSError(f"cannot open {table.name}")
        rdkafka.rd_kafka_conf_properties_show(handle)
        libc.fclose(handle)
        rows = table.read().splitlines()
    return {match.group(1) for row in rows if (match := _ROW.match(row)) and match.group(1) != "Property"}


def render(properties: set[str], version: str) -> str:
    header = [
        '"""The configuration property names librdkafka knows; settings check `[kafka]` keys against them.',
        "",
        f"Generated from librdkafka {version}'s table by `python -m tools.librdkafka_properties --write`.",
        "tests/settings/test_kafka_env.py fails when the installed librdkafka's table differs.",
        '"""',
        "",
        f'LIBRDKAFKA_VERSION = "{version}"',
        "",
        "PROPERTIES = frozenset(",
        "    {",
    ]
    names = [f'        "{name}",' for name in sorted(properties)]
    return "\n".join([*header, *names, "    }", ")", ""])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help=f"rewrite {MODULE.relative_to(REPO)}")
    options = parser.parse_args()
    library = library_path()
    if library is None:
        print("librdkafka not found next to confluent_kafka nor on the system", file=sys.stderr)
        return 2
    properties = installed_properties(library)
    version = confluent_kafka.libversion()[0]
    if options.write:
        MODULE.write_text(render(properties, version), encoding="utf-8")
        print(f"wrote {MODULE.relative_to(REPO)}: {len(properties)} properties of librdkafka {version}")
        return 0
    added, removed = sorted(properties - PROPERTIES), sorted(PROPERTIES - properties)
    if added or removed:
        print(f"librdkafka {version} (listed: {LIBRDKAFKA_VERSION}): new {added}, gone {removed}")
        return 1
    print(f"worker/librdkafka.py matches librdkafka {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
