"""Which process listens on a TCP port of this host, from Linux's ``/proc``: named in the
"already in use" messages, so that an operator on a shared host knows whose it is.

``/proc/net/tcp`` and ``/proc/net/tcp6`` list the sockets of this network namespace (state
``0A`` is LISTEN, ``local_address`` is ``HEXADDR:HEXPORT``, ``inode`` the socket's); a
process's ``/proc/<pid>/fd/*`` links read ``socket:[<inode>]``. Without the rights to
read another user's ``fd`` folder (not root) its sockets stay unnamed."""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"


def _listen_inodes(port: int, proc: Path) -> set[str]:
    """Socket inodes in LISTEN state on ``port`` (any local address)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != _LISTEN:
                continue
            try:
                if int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f[9])
            except (IndexError, ValueError):
                continue
    return inodes


def holder(port: int, proc: Path = Path("/proc")) -> str | None:
    """``"pid 123 (redis-server)"`` for the process that listens on ``port`` (the first
    found when several share it), or ``None`` when none is found or readable."""
    inodes = _listen_inodes(port, proc)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return f"pid {entry.name} ({_name(entry)})"
            except OSError:
                continue
    return None


def _name(entry: Path) -> str:
    try:
        return (entry / "comm").read_text().strip() or "?"
    except OSError:
        return "?"
