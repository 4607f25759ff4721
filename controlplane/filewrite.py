"""Files rewritten whole, never seen half-written: the new text goes into a file beside
the target (synced), which is then renamed over it. The target keeps what it was: its
owner and group (an operator's ``chgrp`` that lets a group read a 0640 file holding a
secret), and a symbolic link keeps naming the file it names, which is the one replaced.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def new_file_mode() -> int:
    """The mode ``open`` gives a new file under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def stage(path: str | Path, data: bytes, mode: int | None = None) -> tuple[str, Path]:
    """Write ``data`` into a new file beside the file ``path`` names (through a symbolic
    link), synced, with ``mode`` (``None``: the file's own mode, or the umask's for a new
    file) and the file's owner and group when they are not the writer's (kept only as
    root; otherwise the file becomes the writer's). Returns ``(staged path, target)`` for
    :func:`os.replace`; the caller removes the staged file if it does not rename it.
    Raises :class:`OSError` (a folder this process cannot create files in, a full disk)."""
    target = Path(os.path.realpath(path))
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if mode is None:
        mode = (st.st_mode & 0o7777) if st is not None else new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)
                except PermissionError:
                    pass  # not root: the file becomes the writer's, with its mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp, target


def replace_file(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Rewrite the file ``path`` names with ``data`` at once (:func:`stage`, then a
    rename). Raises :class:`OSError`."""
    tmp, target = stage(path, data, mode)
    try:
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
