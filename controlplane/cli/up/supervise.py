"""Supervision of a running stack: restarts with back-off, the embedder's keeper, the
stack-owner key kept alive."""

from __future__ import annotations

import threading
import time

import redis as redis_lib

from controlplane import procs

from .common import _say
from .embedder import EmbedderKeeper
from .logs import LogCap
from .owner import OWNER_REFRESH_S, refresh_owner


#: Seconds between two supervision rounds of :func:`_supervise`.
SUPERVISE_EVERY_S = 0.25


def _supervise(stack: procs.ProcessSet, stop: threading.Event, owner_r: redis_lib.Redis,
               owner_doc: str, policy: procs.RestartPolicy | None = None,
               embedder: EmbedderKeeper | None = None, logs: LogCap | None = None) -> str:
    """Keep the parts of ``stack`` running until ``stop`` is set (Ctrl-C, SIGTERM) and
    keep the stack-owner key alive. A part that dies is restarted with back-off
    (:class:`controlplane.procs.Supervisor`, one line per exit and per restart); the
    embedder is optional (the edge answers BYPASS while it is away, and when it keeps
    failing it stays off); nginx is required, and every other part that keeps failing is
    restarted on every 10 s while the edge serves without it. Returns ``""`` on a
    requested stop, else why everything must stop: nginx keeps failing. When another
    stack takes the registry over (``--take-over``) this one says so once and stops renewing the owner key, but keeps
    its parts running: its Redis may be the one the new owner uses. ``embedder``: the
    embedder is kept by it (:class:`EmbedderKeeper`: new port when its own is taken, edge
    re-pointed) instead of by the plain supervisor. ``logs``: the log files kept under
    their cap (:class:`LogCap`)."""
    sup = procs.Supervisor(_say, policy)
    for m in stack.items:
        if embedder is not None and m is embedder.m:
            continue
        # only the edge itself is required: it serves on its last snapshot without the
        # control plane, without Redis (cache bypass) and without a node that is down
        sup.watch(m, optional=m.name == "embedder",
                  keep_trying=m.name not in ("embedder", "nginx"))
    next_refresh = 0.0
    owned = True
    while not stop.is_set():
        failed = sup.tick()
        if failed:
            return f"{failed}\nstopped everything"
        if embedder is not None:
            try:
                embedder.tick()
            except Exception as exc:  # noqa: BLE001 - the optional part never stops the stack
                _say(f"embedder supervision: {exc}")
        now = time.monotonic()
        if logs is not None:
            logs.tick(now)
        if owned and now >= next_refresh:
            next_refresh = now + OWNER_REFRESH_S
            try:
                other = refresh_owner(owner_r, owner_doc)
            except redis_lib.RedisError:
                other = None  # Redis restarting: the key is renewed once it answers
            if other:
                owned = False
                _say(f"the node registry was taken over by {other}; this stack no longer "
                     "owns it (its parts keep running)")
        stop.wait(SUPERVISE_EVERY_S)
    return ""
