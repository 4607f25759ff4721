"""The stack's semantic-cache embedder: its start, and :class:`EmbedderKeeper`, which
keeps it running and points the edge at it only while it answers."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from controlplane import procs
from controlplane.config import Settings

from .common import LOCAL_HOSTS, START_ATTEMPTS, _say, _write_runtime_config


#: Longest wait for the embedder to load its model and answer ``/healthz``, seconds.
EMBEDDER_START_S = 180.0


#: Seconds a restarted embedder waits for its port to be released by the processes of
#: the one that died (sockets close as they exit) before it moves to a free port.
PORT_RELEASE_S = 2.0


PROBE_EVERY_S = 5.0
"""Seconds between two health checks of a running embedder (:meth:`EmbedderKeeper._probe`)."""
PROBE_FAILS = 3
"""Health checks missed in a row after which a running embedder is killed and restarted."""
PROBE_TIMEOUT_S = 3.0
"""Seconds a health check of a running embedder waits. Any answer with this stack's id
counts, a 503 ``degraded`` included: its ``/healthz`` pings Redis, so a Redis that is down
or frozen makes it late or degraded, not dead (the embedder has nothing to restart for)."""


def _embedder_healthy(url: str) -> bool:
    """``GET url/healthz`` answers 200 with this stack's instance id."""
    import requests

    try:
        res = requests.get(f"{url}/healthz", timeout=1)
    except requests.RequestException:
        return False
    return res.status_code == 200 and res.headers.get(procs.INSTANCE_HEADER) == procs.instance_id()


def _start_embedder(settings: Settings, workdir: Path, stack: procs.ProcessSet,
                    timeout: float = EMBEDDER_START_S, config_path: str | None = None) -> str:
    """Start the semantic-cache embedder for ``settings.cache`` and return a one-line
    description for the banner. Never starts one for a non-local URL (the operator runs
    it there). A local one is always this run's own, on the configured port or, when that
    is busy (another stack's embedder may use another Redis), on a free port.
    On any failure stops what it started, sets ``cache.semantic = False`` and returns
    ``"off (<reason>)"``: the stack then runs with the exact cache only. ``config_path``
    (the operator's infergate.toml) is handed to the embedder, which reads its
    ``[cache]`` section there (``semantic_domains`` written by ``infergate cache
    calibrate``, the verifier, per-route and per-model thresholds)."""
    c = settings.cache
    if not c.enabled:
        return "off (cache.enabled = false)"
    if not c.semantic:
        return "off (cache.semantic = false)"
    url = c.embedder_url
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host not in LOCAL_HOSTS:
        # an embedder the operator runs elsewhere; lookups fail open while it is away
        return f"{url} (remote, not started here)"
    port = parts.port or 80
    if procs.port_open("127.0.0.1", port):
        port = procs.free_port()
        url = c.embedder_url = f"http://127.0.0.1:{port}"
    argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                "--model", c.embedder_model)
    _say(f"starting the embedder on {url} (model {c.embedder_model}; loading it may take "
         "a while)")
    # the Redis URL (maybe with a password) through the environment, not the command line
    env = {**os.environ, "INFERGATE_REDIS_URL": settings.redis.url}
    if c.embedder_token:
        # the operator's file (or none) is what the embedder reads: the token this run
        # uses goes by the environment, which its restarts inherit
        env["INFERGATE_EMBEDDER_TOKEN"] = c.embedder_token
    env.pop("INFERGATE_CONFIG", None)  # up reads no config from the environment
    if config_path:
        env["INFERGATE_CONFIG"] = str(Path(config_path).resolve())
    for attempt in range(START_ATTEMPTS):
        m = procs.Managed("embedder", argv, workdir / "logs" / "embedder.log", env=env).start()
        try:
            # ready on a 200 with this stack's instance id: never another stack's embedder
            m.wait_ready(lambda: _embedder_healthy(url), timeout)
        except procs.StartError as exc:
            m.stop()
            if "in use" in m.log_tail(5).lower() and attempt < START_ATTEMPTS - 1:
                # another process bound the port in between: a new free one
                taken, port = port, procs.free_port()
                url = c.embedder_url = f"http://127.0.0.1:{port}"
                _say(f"the embedder's port {taken} was taken by another process meanwhile: "
                     f"starting it on {url}")
                argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                            "--model", c.embedder_model)
                continue
            c.semantic = False
            last = [ln for ln in str(exc).splitlines() if ln.strip()]
            return f"off (the embedder did not start: {last[-1] if last else exc}; see {m.log_path})"
        stack.add(m)
        return f"{url} (model {c.embedder_model})"
    return "off (the embedder did not start)"  # not reached: the last attempt returns


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """The embedder could bind ``host:port`` now: a bind with ``SO_REUSEADDR`` (as the
    embedder's server does, so connections of the dead one in TIME_WAIT do not count)
    succeeds, i.e. no other process listens there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


class EmbedderKeeper:
    """Supervision of the stack's own embedder (instead of a plain restart on the same
    port): the edge never sends a prompt to an address no embedder of this stack holds.

    When the embedder exits, the edge config is rendered again with the semantic cache
    off and nginx reloads it (SIGHUP to its master: graceful, requests in flight finish),
    so lookups stop at once. After the back-off of ``policy`` the embedder is started
    again on its last port when that is free, else on a free one
    (:func:`controlplane.procs.free_port`); only once its ``/healthz`` answers with this
    stack's instance id is the edge rendered with the semantic cache on and the new
    ``cache.embedder_url``, and nginx reloaded again. When the port changes, the control
    plane is restarted on the runtime config with the new address first
    (:meth:`_repoint_controlplane`), so nothing of the stack calls the old one. An
    embedder that exits or is not ready within ``ready_timeout`` counts as a failure;
    after ``policy.max_failures`` within ``policy.window_s`` it stays off and the rest
    runs on. Call :meth:`tick` from the
    supervision loop; it never waits longer than one health probe (1 s)."""

    def __init__(self, m: procs.Managed, settings: Settings, stack: procs.ProcessSet,
                 workdir: Path, cfg: Path, say=None, policy: procs.RestartPolicy | None = None,
                 ready_timeout: float = 180.0, clock=time.monotonic):
        self.m = m
        self.settings = settings
        self.stack = stack
        self.workdir = workdir
        self.cfg = cfg
        self.say = say or _say
        self.policy = policy or procs.RestartPolicy()
        self.ready_timeout = ready_timeout
        self.clock = clock
        self.url = settings.cache.embedder_url
        self.failures: list[float] = []
        self.restart_at: float | None = None
        self.ready_by: float | None = None  # set while a restarted embedder starts
        self.given_up = False
        self.restarts = 0
        self.reloads = 0
        self.next_probe = clock() + PROBE_EVERY_S
        self.live = procs.Liveness("embedder", PROBE_FAILS, self.say, clock=clock)

    def _nginx(self) -> procs.Managed | None:
        return next((x for x in self.stack.items if x.name == "nginx"), None)

    def _point_edge(self, semantic: bool) -> None:
        """Render the edge config with the semantic cache ``semantic`` (and the current
        embedder URL) and make nginx reload it."""
        from controlplane.edge.render import render_nginx

        c = self.settings.cache
        c.semantic = semantic
        if semantic:
            c.embedder_url = self.url
        render_nginx(self.settings, self.workdir / "nginx", prefix=self.workdir / "nginx")
        _write_runtime_config(self.settings, self.cfg)
        ng = self._nginx()
        if ng is not None and ng.alive() and ng.pid:
            os.kill(ng.pid, signal.SIGHUP)
            self.reloads += 1

    def _repoint_controlplane(self) -> None:
        """Restart the stack's control plane on a runtime config with the embedder's new
        address: it reads ``cache.embedder_url`` at start, so its online verification
        (``POST /v1/embeddings`` with the embedder token and the answers' texts) and its
        node-address checks would go on using the old port, where another process now
        listens. The edges route on their last snapshot meanwhile."""
        c = self.settings.cache
        semantic = c.semantic
        c.semantic, c.embedder_url = True, self.url
        _write_runtime_config(self.settings, self.cfg)
        c.semantic = semantic
        cp = next((x for x in self.stack.items if x.name == "controlplane"), None)
        if cp is None or not cp.alive():
            return  # its next start reads the file written above
        cp.stop(grace=5.0)
        try:
            cp.start()
        except OSError as exc:
            self.say(f"control plane restart for the embedder's new address failed: {exc}")
            return
        self.say(f"control plane restarted for the embedder's new address {self.url} "
                 f"(pid {cp.pid})")

    def _failed(self, now: float, why: str) -> None:
        self.failures = [t for t in self.failures if now - t <= self.policy.window_s] + [now]
        if self.settings.cache.semantic:
            self._point_edge(False)
        if len(self.failures) >= self.policy.max_failures:
            self.given_up = True
            self.say(f"embedder gave up after {len(self.failures)} failures within "
                     f"{self.policy.window_s:.0f} s (log {self.m.log_path}); semantic cache "
                     "off, the rest runs on")
            return
        delay = self.policy.delay(len(self.failures))
        self.say(f"embedder {why} (restarts so far {self.restarts}, log {self.m.log_path}); "
                 f"semantic cache off until it is back; restarting in {delay:.1f} s")
        self.restart_at = now + delay

    def _restart(self, now: float) -> None:
        port = urlsplit(self.url).port or 80
        # what the dead embedder left in its process group (its model worker processes,
        # which share the listening socket) is stopped first, so its own port is free
        # again unless another process took it
        self.m.stop(grace=1.0)
        until = time.monotonic() + PORT_RELEASE_S
        while not _port_free(port) and time.monotonic() < until:
            time.sleep(0.05)
        if not _port_free(port):
            old = port
            try:
                port = procs.free_port()
            except procs.StartError as exc:   # INFERGATE_PORT_RANGE has no free port left
                self._failed(now, f"restart failed: {exc}")
                return
            self.say(f"embedder port {old} is taken by another process; moving the embedder "
                     f"to 127.0.0.1:{port}")
        moved = f"http://127.0.0.1:{port}" != self.url
        self.url = f"http://127.0.0.1:{port}"
        if moved:
            self._repoint_controlplane()
        argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                    "--model", self.settings.cache.embedder_model)
        new = procs.Managed("embedder", argv, self.m.log_path, env=self.m.env)
        try:
            new.start()
        except OSError as exc:
            self._failed(now, f"restart failed: {exc}")
            return
        self.stack.items[self.stack.items.index(self.m)] = new
        self.m = new
        self.restarts += 1
        self.ready_by = now + self.ready_timeout
        self.say(f"embedder restarted on {self.url} (pid {new.pid}, restart {self.restarts})")

    def tick(self) -> None:
        """One supervision round (see the class)."""
        if self.given_up:
            return
        now = self.clock()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self._restart(now)
            return
        if not self.m.alive():
            rc = self.m.proc.returncode if self.m.proc is not None else None
            self.ready_by = None
            self._failed(now, f"exited (code {rc})")
            return
        if self.ready_by is not None:
            if _embedder_healthy(self.url):
                self.ready_by = None
                self._point_edge(True)
                self.say(f"embedder ready on {self.url}; semantic cache on again")
            elif now >= self.ready_by:
                self.ready_by = None
                self.m.stop(grace=1.0)
                self._failed(now, "did not become ready")
            return
        self._probe(now)

    def _probe(self, now: float) -> None:
        """Proof of life of a running embedder: a frozen one (SIGSTOP, a stuck worker)
        never exits, and every lookup would wait out its budget meanwhile. Its
        ``/healthz`` is asked every PROBE_EVERY_S (any answer of this stack's embedder is
        life, see PROBE_TIMEOUT_S); after PROBE_FAILS misses in a row it is killed, and the
        next tick restarts it with the semantic cache off meanwhile."""
        if now < self.next_probe:
            return
        self.next_probe = now + PROBE_EVERY_S
        if procs.http_instance(f"{self.url}/healthz", timeout=PROBE_TIMEOUT_S) == procs.instance_id():
            self.live.answered()
            return
        fails = self.live.fails + 1
        if self.live.missed(self.m.pid):
            self.say(f"embedder (pid {self.m.pid}) did not answer its health check "
                     f"{fails} times in a row, {PROBE_EVERY_S:g} s apart: killing it, "
                     "to be restarted")
            self.m.signal(signal.SIGKILL)
