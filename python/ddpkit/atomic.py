"""One way to write a file that readers see whole or not at all."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PathLike = str | os.PathLike


def write_atomically(path: PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Calls ``write(handle)`` on a temporary file beside ``path``, fsyncs it and renames it onto ``path``.

    Readers (and a process restarted after a kill) see the old file or the complete new one, never a
    part. If ``write`` raises (a failed download check, say), the temporary file is removed, ``path``
    is left as it was, and the exception propagates. Returns ``path``.

    The file gets the permissions ``open(path, "wb")`` would have given it: those of the file it
    replaces, or for a new file 0o666 less the process's umask (0o644 under the usual 022), not the
    0o600 of the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fchmod(handle.fileno(), _mode_for(path))
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    return path


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # /proc says it without changing it; os.umask can only read it by setting it, which another
    # thread creating a file at that moment would see.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
