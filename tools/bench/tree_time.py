"""Runs one command and prints, as one JSON line on stdout, the wall seconds and the CPU seconds of its whole
process tree: `python -m tools.bench.tree_time -- COMMAND [ARG ...]`.

This process makes itself the tree's child subreaper, so every descendant is reaped here, orphaned or not, and
lands in this process's children's rusage: a process its parent leaves unreaped (classify leaves its
multiprocessing resource tracker so, a zombie a container's init may never collect) still counts, which a
timer of the command alone misses. The command's own
output streams are passed through; its exit status is this process's.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Linux's prctl(PR_SET_CHILD_SUBREAPER): orphans of the tree are re-parented to this process."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _reap_all(child: subprocess.Popen[bytes]) -> int:
    """Wait for every descendant (the child and the orphans it leaves); the child's exit status."""
    status = 0
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            return status
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(raw)


def main() -> int:
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m tools.bench.tree_time -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    _become_subreaper()
    started = time.monotonic()
    status = _reap_all(subprocess.Popen(command))
    wall = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}))
    return status


if __name__ == "__main__":
    sys.exit(main())
