"""Files that a kill cannot tear.

A run's checkpoints, its ``config.yaml`` and its validation reports are read after the run: by a resume, by
``--config``, by a person.  Written in place, a kill midway leaves half a file, and for ``config.yaml`` on a resume that
is the only copy.  :func:`atomic_write` writes ``.<name>.tmp-<pid>`` next to the target, flushes and fsyncs it, then
``os.replace``-s it over the target (atomic on POSIX within one filesystem) and fsyncs the folder.  A reader sees the
previous complete file or the new one.  A temp file a killed writer left is removed by the next write to that target.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_path(path: Path) -> Path:
    """This process's temp file for ``path`` (``.<name>.tmp-<pid>``, in the same folder)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Writes ``path`` atomically: ``write`` fills a temp file in the same folder, then it replaces ``path``.

    Args:
        path: the file to write; its folder is made if missing.
        write: called with the temp file, opened for binary writing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            pid = int(stale.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or not _alive(pid):
            stale.unlink(missing_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)  # make the rename itself durable


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`).

    Args:
        path: the file to write.
        text: its whole content.
    """
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def fsync_dir(folder: Path) -> None:
    """Makes the renames in ``folder`` durable (where the filesystem lets a folder be fsynced).

    Args:
        folder: the folder whose entries changed.
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
