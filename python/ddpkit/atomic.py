"""One way to write a file that readers see whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Union

PathLike = Union[str, os.PathLike]


def write_atomically(path: PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Calls ``write(handle)`` on a temporary file beside ``path``, fsyncs it and renames it onto ``path``.

    Readers (and a process restarted after a kill) see the old file or the complete new one, never a
    part. If ``write`` raises (a failed download check, say), the temporary file is removed, ``path``
    is left as it was, and the exception propagates. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    return path
