"""Per-node reads the control plane makes rarely and apart from its health polls (a
node's ``/v1/models``, its ``/props``): the machinery the readers share - a bounded HTTP
client with each node's API key and CAs, a small thread pool, one entry per node guarded
by a lock, and the housekeeping (:meth:`forget`, :meth:`wait_idle`, :meth:`close`).
A reader's entries carry ``running``: the future of a read under way, or ``None``."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from controlplane.routing.nodeaccess import AccessTable
from controlplane.routing.poller import Poller


class BackgroundReader:
    """Base of :class:`controlplane.routing.models.ModelsPoller` and
    :class:`controlplane.routing.nodekind.PropsPoller`. ``refresh_s``: seconds between
    two reads of a node; ``timeout_s``: bound of one read; ``name``: the pool's thread
    name prefix; ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, name: str, refresh_s: float, timeout_s: float, max_workers: int,
                 clock=time.monotonic, access: AccessTable | None = None):
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        # only its bounded get(), with each node's API key and CAs
        self._http = Poller(timeout_s, max_workers=1, access=access)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._entries: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def forget(self, names: set[str]) -> None:
        """Drop what is known of nodes not in ``names`` (removed from the registry)."""
        with self._lock:
            for name in set(self._entries) - names:
                del self._entries[name]

    def refresh(self, name: str) -> None:
        """Read node ``name`` again at the next look instead of after ``refresh_s``: it
        came back from being down, and a restarted server may have other slots or
        models (llama-server restarted with another ``--parallel``). A read under way
        is left to finish."""
        with self._lock:
            e = self._entries.get(name)
            if e is not None:
                e.due = 0.0

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Wait until no read is running (tests)."""
        end = self._clock() + timeout_s
        while self._clock() < end:
            with self._lock:
                busy = any(e.running is not None and not e.running.done()
                           for e in self._entries.values())
            if not busy:
                return
            time.sleep(0.01)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
