"""Files a user names that should be small (a settings file, a taxonomy), read with a bound.

Each is a few kilobytes; the whole file is decoded at once. Read without a bound, naming the wrong file by
mistake (`--taxonomy /dev/zero`, a model's weights, a log) took the memory until the machine gave out:
8.1 GB before anything was said. A file over the bound is an OSError (EFBIG) like any other file that
cannot be read, which the caller words in its one line as it does those.
"""

from __future__ import annotations

import errno
from pathlib import Path

# The largest shipped file of the kind (taxonomies/banking77.toml) is 12 KiB.
MAX_SMALL_FILE_BYTES = 1 << 20


def read_small_file(path: Path, what: str) -> bytes:
    """The bytes of `path`; OSError when it cannot be read or is over the bound (its `strerror` names
    `what` the file should have been)."""
    with path.open("rb") as handle:
        data = handle.read(MAX_SMALL_FILE_BYTES + 1)
    if len(data) > MAX_SMALL_FILE_BYTES:
        too_large = f"over {MAX_SMALL_FILE_BYTES >> 20} MiB, too large for {what}: is it the right file?"
        raise OSError(errno.EFBIG, too_large, str(path))
    return data
