"""Whole-or-nothing file writes: a reader, or a process started after a crash, sees the old file or the new one, never
a torn one.

The new content goes to a fresh temporary file in the same folder, created exclusively (``mkstemp``: a symlink or file
planted at a predictable temporary name is never followed or reused), readable by its owner only unless asked
otherwise, flushed to disk, then renamed over the target (atomic on POSIX), and the folder is flushed so the rename
survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PRIVATE = 0o600  # what a file holding users' text or training state gets
PUBLIC = 0o644  # settings and measurements, which other accounts (a service) may read


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], mode: int = PRIVATE) -> None:
    """Write ``path`` whole or not at all: ``write`` fills a binary file that then replaces ``path``, with ``mode``
    (not the umask's). On any error, including in ``write``, ``path`` is as it was and the temporary file is gone."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            os.fchmod(out.fileno(), mode)
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_folder(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = PRIVATE) -> None:
    """:func:`atomic_write` of ``data``."""
    atomic_write(path, lambda out: out.write(data), mode)


def _sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the rename) to disk; a file system that cannot is left as it is."""
    try:
        handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on a folder
            os.fsync(handle)
    finally:
        os.close(handle)
