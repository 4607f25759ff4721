"""A size cap on the log files of a running ``infergate up``: nginx's access and error
logs, the control plane's, Redis', the embedder's and the simulated nodes'.

``up`` has no logrotate behind it, and nginx logs every request as it does on any host:
a flood of refused requests (401, 429) writes about 500 bytes each, gigabytes an hour.
Every :data:`CHECK_EVERY_S` a :class:`LogCap` looks at the ``*.log`` files of its
folders; one past its cap keeps its last :data:`KEEP_FRACTION` in ``<name>.1``
(replacing the one before, from the first whole line on) and is truncated to zero. Every
writer of these files opens them for appending (``O_APPEND``: nginx, Redis' ``logfile``,
the children of :mod:`controlplane.procs`), so the next line lands at the start of the
emptied file; the lines written between the copy and the truncation are lost.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds between two looks at the log files' sizes.
CHECK_EVERY_S = 5.0
#: Default cap of one log file, MiB (``infergate up --log-max-mb``).
DEFAULT_MAX_MB = 256
#: Share of the cap kept in ``<name>.1`` when a file is cut.
KEEP_FRACTION = 0.25


def log_dirs(wd: Path) -> list[Path]:
    """The folders of the log files of a stack whose work folder is ``wd``: its parts'
    (``logs``), nginx's, its own Redis' (``redis/redis-<port>.log``) and its own Redis
    Cluster's (``redis-cluster/node<i>``)."""
    return [wd / "logs", wd / "nginx" / "logs", wd / "redis",
            *sorted((wd / "redis-cluster").glob("node*"))]


def cut(path: Path, keep_bytes: int) -> int:
    """Copy the last ``keep_bytes`` of ``path`` (from its first whole line on) to
    ``path`` + ``.1`` and truncate ``path`` to 0. Returns the size it had, bytes.
    Raises ``OSError``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = max(0, size - keep_bytes)
        f.seek(start)
        tail = f.read(keep_bytes)
    if start > 0:
        nl = tail.find(b"\n")
        tail = tail[nl + 1:] if nl >= 0 else b""
    old = path.with_name(path.name + ".1")
    tmp = path.with_name(path.name + ".1.tmp")
    tmp.write_bytes(tail)
    os.replace(tmp, old)
    os.truncate(path, 0)
    return size


@dataclass
class LogCap:
    """Keeps the ``*.log`` files of ``dirs`` under ``max_bytes`` each (0: no cap).
    ``say``: one line the first time each file is cut."""

    dirs: list[Path]
    max_bytes: int
    say: Callable[[str], None]
    next_at: float = 0.0
    told: set[Path] = field(default_factory=set)

    def tick(self, now: float) -> list[Path]:
        """Cut the files over the cap when :data:`CHECK_EVERY_S` have passed since the
        last look (``now``: monotonic seconds). Returns the files cut. A file that
        cannot be read or cut is left as it is."""
        if self.max_bytes <= 0 or now < self.next_at:
            return []
        self.next_at = now + CHECK_EVERY_S
        done = []
        for d in self.dirs:
            for path in sorted(d.glob("*.log")):
                try:
                    if path.stat().st_size <= self.max_bytes:
                        continue
                    size = cut(path, int(self.max_bytes * KEEP_FRACTION))
                except OSError:
                    continue
                done.append(path)
                if path not in self.told:
                    self.told.add(path)
                    self.say(f"{path} reached {size / 2**20:.0f} MiB (cap --log-max-mb "
                             f"{self.max_bytes / 2**20:g}): its last lines are kept in "
                             f"{path.name}.1 and it starts again empty (said once per file)")
        return done
