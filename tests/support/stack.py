"""Fixtures that start several parts together (simulated nodes, control plane, nginx).

Factories (each tears down everything it started at the end of the test):

- ``simnodes(n, *flags, names=None, node_flags=None, **opts)`` -> list of
  :class:`SimNode` (``infergate simnode`` processes on free ports, with a control
  port: ``url``, ``control_url``, ``set_faults(...)``, ``state()``);
- ``tiny_upstreams(n, names=None)`` -> list of :class:`TinyUpstream` (in-process
  OpenAI-compatible HTTP servers with switchable modes, for deterministic edge tests);
- ``edge_factory(settings, **render_opts)`` -> :class:`Edge` (render + start nginx;
  at teardown asserts that in-flight counters are back to zero and that the error log
  has no ``[alert]``/``[crit]``/``[emerg]`` line, no Lua runtime error and no
  "writing a global Lua variable" warning);
- ``controlplane_factory(settings)`` -> :class:`ControlPlaneProc`
  (``infergate controlplane`` with a config file written from ``settings``).

Helpers: :func:`edge_settings` (Settings for a test edge), :func:`snapshot_node` and
:func:`write_snapshot` (a routing snapshot written straight into Redis, as the
control plane would, see docs/internals.md), :func:`lua_eval` (run Lua with the
infergate modules inside nginx's init_by_lua and get its result back as JSON).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from controlplane import paths, procs
from controlplane.redisdb import keynames
from controlplane.config import EdgeSettings, NodeSettings, Settings, settings_from_dict
from controlplane.edge.render import RenderedConfig, default_modules_dir, render_nginx, start_nginx

#: Error-log lines that fail a test whatever it did.
BAD_LOG_RE = re.compile(
    r"\[(alert|crit|emerg)\]|writing a global Lua variable|runtime error|"
    r"failed to run balancer_by_lua|lua entry thread aborted")


# --------------------------------------------------------------------------- snapshots

def snapshot_node(name: str, host: str, port: int, **kw: Any) -> dict:
    """One node of a routing snapshot with every field of docs/internals.md; ``kw``
    overrides (e.g. ``score=0.9``, ``state="draining"``, ``healthy=False``)."""
    node = {
        "name": name, "url": f"http://{host}:{port}", "host": host, "port": port,
        "kind": "vllm", "state": "active", "healthy": True, "weight": 1.0,
        "effective_weight": 1.0, "max_concurrency": 64, "score": 0.0, "saturated": False,
        "queue_depth": 0, "running": 0, "kv_cache_usage": 0.0, "has_metrics": True,
    }
    node.update(kw)
    return node


def write_snapshot(r: redis.Redis, nodes: list[dict], *, version: int | None = None,
                   generated_at: float | None = None, leader: str = "test") -> dict:
    """Write a routing snapshot to ``infergate:v1:routing`` (version: INCR of the
    version key unless given; generated_at: now unless given). Returns it."""
    if version is None:
        version = int(r.incr(keynames.ROUTING_VERSION))
    snap = {"version": version, "generated_at": time.time() if generated_at is None else generated_at,
            "leader": leader, "nodes": nodes}
    r.set(keynames.ROUTING, json.dumps(snap))
    return snap


def edge_settings(redis_url: str, nodes: list[NodeSettings] | list[dict] = (), **edge: Any) -> Settings:
    """Settings for a test edge: one worker, fast sync, short timeouts; ``edge``
    overrides any ``[edge]`` field."""
    e = {"workers": 1, "sync_interval_s": 0.1, "connect_timeout_ms": 1000,
         "read_timeout_ms": 10000, "send_timeout_ms": 10000, "retry_window_s": 30.0,
         "breaker_cooldown_s": 2.0}
    e.update(edge)
    node_dicts = [n.model_dump() if isinstance(n, NodeSettings) else n for n in nodes]
    return settings_from_dict({"redis": {"url": redis_url}, "edge": e, "nodes": node_dicts})


# --------------------------------------------------------------------------- Lua in nginx

class LuaError(AssertionError):
    """Lua code run by :func:`lua_eval` raised an error."""


def lua_eval(workdir: Path, code: str, *, http_extra: str = "", timeout: float = 15.0) -> Any:
    """Run ``code`` (a Lua function body ending in ``return value``) inside nginx's
    ``init_by_lua`` with the infergate Lua path, and return the value decoded from
    JSON. nginx runs without a master process and exits right after. Raises
    :class:`LuaError` with the Lua message when the code raises."""
    import subprocess
    import uuid

    d = workdir / f"lua-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    out = d / "out.json"
    conf = d / "nginx.conf"
    mods = default_modules_dir()
    conf.write_text(f"""
load_module {mods}/ndk_http_module.so;
load_module {mods}/ngx_http_lua_module.so;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
daemon off;
master_process off;
events {{}}
http {{
    lua_package_path "{paths.lua_dir()}/?.lua;;";
    {http_extra}
    init_by_lua_block {{
        local cjson = require("cjson.safe")
        local ok, res = pcall(function()
{code}
        end)
        local f = io.open("{out}", "w")
        local text = cjson.encode({{ ok = ok, result = res }})
        if not text then
            text = cjson.encode({{ ok = false, result = "result is not JSON-encodable" }})
        end
        f:write(text)
        f:close()
        os.exit(0)
    }}
}}
""")
    res = subprocess.run(["nginx", "-p", str(d), "-c", str(conf)], capture_output=True,
                         text=True, timeout=timeout)
    if not out.exists():
        err_log = d / "error.log"
        tail = err_log.read_text(errors="replace") if err_log.exists() else ""
        raise LuaError(f"nginx did not run the Lua code (rc {res.returncode}):\n{res.stderr}\n{tail}")
    data = json.loads(out.read_text())
    if not data["ok"]:
        raise LuaError(str(data["result"]))
    return data.get("result")


# --------------------------------------------------------------------------- simnodes

def _stop_together(managed: list[procs.Managed]) -> None:
    """SIGTERM every process first, then wait for each (SIGKILL after the grace)."""
    import signal

    for m in managed:
        m.signal(signal.SIGTERM)
    for m in reversed(managed):
        m.stop()


@dataclass
class SimNode:
    """One ``infergate simnode`` process."""

    name: str
    host: str
    port: int
    control_port: int
    managed: procs.Managed

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.control_port}"

    def set_faults(self, **faults: Any) -> dict:
        """``POST /_sim/faults`` on the control port; returns the faults now in force."""
        res = requests.post(f"{self.control_url}/_sim/faults", json=faults, timeout=5)
        res.raise_for_status()
        return res.json()

    def state(self) -> dict:
        """``GET /_sim/state``: running, waiting, requests_total, completed_total, ..."""
        res = requests.get(f"{self.control_url}/_sim/state", timeout=5)
        res.raise_for_status()
        return res.json()

    def node_settings(self, **kw: Any) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, **kw)

    def snapshot_node(self, **kw: Any) -> dict:
        return snapshot_node(self.name, self.host, self.port, **kw)

    def stop(self) -> None:
        self.managed.stop()


@pytest.fixture
def simnodes(workdir: Path) -> Iterator[Callable[..., list[SimNode]]]:
    """Factory: ``simnodes(n, "--max-running", "1", names=[...], time_scale=0.05)``.
    Keyword options become ``--key-with-dashes value`` flags (True -> bare flag) for
    every node; ``node_flags={"name": ["--max-running", "1"]}`` adds flags to one node.
    The nodes start together and are waited for together."""
    started: list[SimNode] = []

    def start(n: int = 1, *flags: str, names: list[str] | None = None,
              node_flags: dict[str, list[str]] | None = None, **opts: Any) -> list[SimNode]:
        extra = list(flags)
        for k, v in opts.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                extra.append(flag)
            elif v not in (False, None):
                extra += [flag, str(v)]
        out = []
        for i in range(n):
            name = names[i] if names else f"sim-{len(started) + 1}"
            port, cport = procs.free_port(), procs.free_port()
            own = (node_flags or {}).get(name, [])
            argv = procs.infergate_argv("simnode", "--host", "127.0.0.1", "--port", str(port),
                                        "--control-port", str(cport), "--name", name, *extra, *own)
            m = procs.Managed(name, argv, workdir / "logs" / f"{name}.log").start()
            node = SimNode(name, "127.0.0.1", port, cport, m)
            started.append(node)
            out.append(node)
        for node in out:  # started together, waited for together
            node.managed.wait_ready(lambda p=node.control_port: procs.port_open("127.0.0.1", p),
                                    timeout=30)
        return out

    try:
        yield start
    finally:
        _stop_together([node.managed for node in started])


# --------------------------------------------------------------------------- tiny upstreams

class TinyUpstream:
    """An in-process OpenAI-compatible HTTP server on a free port.

    ``mode``: ``ok`` (answer), ``fail`` (500 JSON), ``busy`` (429), ``hang`` (never
    answer until released or stopped), ``garbage`` (non-HTTP bytes, then close).
    ``delay_s`` delays every answer; a ``"stream": true`` request gets ``chunks`` SSE
    chunks ``chunk_interval_s`` apart. ``gate``: when set (a threading.Event), streams
    wait for it before their last chunk. ``hits`` counts inference requests,
    ``inflight`` the ones being answered. Answers carry ``X-Sim-Node`` and
    ``system_fingerprint`` = name. ``stop()`` closes the port (connections refused)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.delay_s = 0.0
        self.chunks = 5
        self.chunk_interval_s = 0.05
        self.gate: threading.Event | None = None
        self.hits = 0
        self.inflight = 0
        self.bodies: list[bytes] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._conns: set[socket.socket] = set()
        self.port = procs.free_port()
        self.host = "127.0.0.1"
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def node_settings(self, **kw: Any) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, **kw)

    def snapshot_node(self, **kw: Any) -> dict:
        return snapshot_node(self.name, self.host, self.port, **kw)

    def start(self) -> None:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with upstream._lock:
                    upstream._conns.add(self.connection)

            def finish(self) -> None:
                with upstream._lock:
                    upstream._conns.discard(self.connection)
                super().finish()

            def _send(self, status: int, obj: Any, headers: dict | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Sim-Node", upstream.name)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": "tiny", "object": "model", "created": 0, "owned_by": upstream.name}]})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                               "param": None, "code": None}})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                with upstream._lock:
                    upstream.hits += 1
                    upstream.inflight += 1
                    upstream.bodies.append(raw)
                try:
                    self._answer(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with upstream._lock:
                        upstream.inflight -= 1

            def _answer(self, raw: bytes) -> None:
                mode = upstream.mode
                if upstream.delay_s:
                    time.sleep(upstream.delay_s)
                if mode == "hang":
                    upstream._released.wait(60)
                    self.close_connection = True
                    return
                if mode == "garbage":
                    self.wfile.write(b"\x00\x01 this is not HTTP \xff\r\n\r\n")
                    self.close_connection = True
                    return
                if mode == "fail":
                    self._send(500, {"error": {"message": "simulated failure", "type": "server_error",
                                               "param": None, "code": 500}})
                    return
                if mode == "busy":
                    self._send(429, {"error": {"message": "busy", "type": "rate_limit_error",
                                               "param": None, "code": 429}})
                    return
                if self.path.split("?")[0] not in ("/v1/chat/completions", "/v1/completions",
                                                   "/v1/embeddings"):
                    self._send(404, {"error": {"message": f"no route {self.path}",
                                               "type": "invalid_request_error",
                                               "param": None, "code": "not_found"}})
                    return
                try:
                    req = json.loads(raw or b"{}")
                except ValueError:
                    req = {}
                model = req.get("model", "tiny") if isinstance(req, dict) else "tiny"
                if self.path == "/v1/embeddings":
                    self._send(200, {"object": "list", "model": model, "data": [
                        {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                        "usage": {"prompt_tokens": 1, "total_tokens": 1}})
                    return
                if isinstance(req, dict) and req.get("stream"):
                    self._stream(model)
                    return
                self._send(200, {
                    "id": "chatcmpl-tiny", "object": "chat.completion", "created": int(time.time()),
                    "model": model, "system_fingerprint": upstream.name,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": f"hello from {upstream.name}"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _stream(self, model: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("X-Sim-Node", upstream.name)
                self.end_headers()
                for i in range(upstream.chunks):
                    if i == upstream.chunks - 1 and upstream.gate is not None:
                        upstream.gate.wait(30)
                    elif i:
                        time.sleep(upstream.chunk_interval_s)
                    ev = {"id": "chatcmpl-tiny", "object": "chat.completion.chunk",
                          "created": int(time.time()), "model": model,
                          "system_fingerprint": upstream.name,
                          "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                       "finish_reason": None}]}
                    self._chunk(f"data: {json.dumps(ev)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

        self._released.clear()
        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"tiny-{self.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Let hanging requests end (they close without an answer)."""
        self._released.set()

    def stop(self) -> None:
        """Close the listening port and every open connection (kept-alive ones too),
        ending hanging requests: afterwards connects are refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._released.set()
        if self.gate is not None:
            self.gate.set()


@pytest.fixture
def tiny_upstreams() -> Iterator[Callable[..., list[TinyUpstream]]]:
    """Factory: ``tiny_upstreams(3)`` or ``tiny_upstreams(names=["a", "b"])``."""
    started: list[TinyUpstream] = []

    def start(n: int = 1, names: list[str] | None = None) -> list[TinyUpstream]:
        names = names or [f"tiny-{len(started) + i + 1}" for i in range(n)]
        out = [TinyUpstream(name) for name in names]
        started.extend(out)
        return out

    try:
        yield start
    finally:
        for u in started:
            u.stop()


# --------------------------------------------------------------------------- edge

@dataclass
class Edge:
    """A running nginx with the rendered infergate config."""

    rendered: RenderedConfig
    managed: procs.Managed
    settings: Settings
    check_log: bool = True
    extra_bad_patterns: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.rendered.url

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of the edge's Prometheus server ("" when off)."""
        listen = self.settings.edge.metrics_listen
        return f"http://{listen}/metrics" if listen else ""

    def status(self) -> dict:
        """``GET /infergate/status`` (see lua/infergate/routing/status.lua)."""
        res = requests.get(f"{self.url}/infergate/status", timeout=5)
        res.raise_for_status()
        return res.json()

    def node_status(self, name: str) -> dict:
        for n in self.status()["nodes"]:
            if n["name"] == name:
                return n
        raise KeyError(name)

    def error_log(self) -> str:
        try:
            return self.rendered.error_log.read_text(errors="replace")
        except OSError:
            return ""

    def access_log(self) -> str:
        try:
            return self.rendered.access_log.read_text(errors="replace")
        except OSError:
            return ""

    def bad_log_lines(self) -> list[str]:
        pats = [BAD_LOG_RE] + [re.compile(p) for p in self.extra_bad_patterns]
        return [line for line in self.error_log().splitlines() if any(p.search(line) for p in pats)]

    def wait_snapshot(self, version: int, timeout: float = 10.0) -> dict:
        """Wait until the edge routes on snapshot ``version`` (or newer); return status."""
        out: dict = {}

        def seen() -> bool:
            st = self.status()
            out.update(st)
            return st["snapshot"]["source"] == "redis" and st["snapshot"]["version"] >= version

        procs.wait_until(seen, timeout, what=f"edge to load snapshot version {version}")
        return out

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Wait until every node's in-flight counter is back to zero."""
        procs.wait_until(lambda: self.status()["inflight_total"] == 0 and
                         all(n["inflight"] == 0 for n in self.status()["nodes"]),
                         timeout, what="edge in-flight counters back to zero")

    def stop(self) -> None:
        self.managed.stop()


@pytest.fixture
def edge_factory(workdir: Path) -> Iterator[Callable[..., Edge]]:
    """Factory: ``edge_factory(settings, openresty=False, listen=None, check_log=True)``.

    At teardown, for each edge: in-flight counters must come back to zero and the
    error log must be clean (see :data:`BAD_LOG_RE`); then nginx is stopped. While
    ``edge.metrics_listen`` has its default value, the metrics server listens on a free
    loopback port instead (``Edge.metrics_url``), never on the fixed default port."""
    edges: list[Edge] = []

    def start(settings: Settings, *, listen: str | None = None, check_log: bool = True,
              **render_opts: Any) -> Edge:
        if settings.edge.metrics_listen == EdgeSettings().metrics_listen:
            settings = settings.model_copy(deep=True)
            settings.edge.metrics_listen = f"127.0.0.1:{procs.free_port()}"
        i = len(edges) + 1
        listen = listen or f"127.0.0.1:{procs.free_port()}"
        base = workdir / f"edge-{i}"
        rendered = render_nginx(settings, base / "conf", listen=listen, prefix=base / "prefix",
                                **render_opts)
        m = start_nginx(rendered.nginx_conf, rendered.prefix)
        edge = Edge(rendered, m, settings, check_log=check_log)
        edges.append(edge)
        procs.wait_until(lambda: edge.status() is not None, 10, what="edge status endpoint")
        return edge

    failures: list[str] = []
    try:
        yield start
    finally:
        for edge in edges:
            try:
                if edge.managed.alive():
                    try:
                        edge.wait_idle(timeout=15)
                    except procs.StartError as exc:
                        failures.append(f"{edge.url}: {exc}: {edge.status()}")
                if edge.check_log:
                    bad = edge.bad_log_lines()
                    if bad:
                        failures.append(f"{edge.url}: bad lines in {edge.rendered.error_log}:\n"
                                        + "\n".join(bad[:20]))
            finally:
                edge.stop()
    if failures:
        pytest.fail("edge teardown checks failed:\n" + "\n".join(failures))


# --------------------------------------------------------------------------- control plane

@dataclass
class ControlPlaneProc:
    """An ``infergate controlplane`` process."""

    managed: procs.Managed
    config_path: Path
    admin_url: str

    def stop(self) -> None:
        self.managed.stop()


def _write_toml(settings: Settings, path: Path) -> None:
    try:
        import tomli_w
    except ImportError:  # pragma: no cover - tomli_w comes with the package
        raise RuntimeError("tomli_w is needed to write a config file") from None
    data = settings.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(data), encoding="utf-8")


@pytest.fixture
def controlplane_factory(workdir: Path) -> Iterator[Callable[..., ControlPlaneProc]]:
    """Factory: ``controlplane_factory(settings, wait_snapshot=True)``. Writes the
    settings to a TOML file (admin listen on a free port), starts the control plane,
    waits for its admin port and, by default, for a first routing snapshot in Redis."""
    started: list[ControlPlaneProc] = []

    def start(settings: Settings, *, wait_snapshot: bool = True, timeout: float = 30.0) -> ControlPlaneProc:
        i = len(started) + 1
        s = settings.model_copy(deep=True)
        port = procs.free_port()
        s.controlplane.listen = f"127.0.0.1:{port}"
        cfg = workdir / f"controlplane-{i}.toml"
        _write_toml(s, cfg)
        m = procs.Managed(f"controlplane-{i}", procs.infergate_argv("controlplane", "--config", str(cfg)),
                          workdir / "logs" / f"controlplane-{i}.log").start()
        cp = ControlPlaneProc(m, cfg, f"http://127.0.0.1:{port}")
        started.append(cp)
        m.wait_ready(lambda: procs.port_open("127.0.0.1", port), timeout)
        if wait_snapshot:
            r = redis.Redis.from_url(s.redis.url, socket_timeout=2)
            m.wait_ready(lambda: r.get(keynames.ROUTING) is not None, timeout)
        return cp

    try:
        yield start
    finally:
        for cp in reversed(started):
            cp.stop()
