"""Fixtures that start several parts together (simulated nodes, control plane, nginx).

Factories (each tears down everything it started at the end of the test):

- ``simnodes(n, *flags, names=None, node_flags=None, **opts)`` -> list of
  :class:`SimNode` (``infergate simnode`` processes on free ports, with a control
  port, started by :mod:`controlplane.simnode.launch`: ``url``, ``control_url``,
  ``set_faults(...)``, ``state()``);
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

The in-process tiny upstream (``tiny_upstreams``) is in tests/support/tiny_upstream.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from controlplane import paths, procs
from controlplane.redisdb import keynames
from controlplane.config import EdgeSettings, NodeSettings, Settings, settings_from_dict
from controlplane.edge.render import RenderedConfig, default_modules_dir, render_nginx, start_nginx
from controlplane.simnode import launch

#: Error-log lines that fail a test whatever it did.
BAD_LOG_RE = re.compile(
    r"\[(alert|crit|emerg)\]|writing a global Lua variable|runtime error|"
    r"failed to run balancer_by_lua|lua entry thread aborted")
#: Not a fault of the edge: a free port taken for a moment by another process on the
#: host; nginx tries the bind again (five times, 0.5 s apart) and the edge that then
#: served had bound it.
BIND_RETRY_RE = re.compile(r"\[emerg\] .*bind\(\) to \S+ failed \(98: Address already in use\)")


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


def edge_on_snapshot(redis_server: Any, edge_factory: Callable[..., Any], nodes: list[dict], *,
                     request_ms: int = 30000, check_log: bool = True, **edge: Any) -> Any:
    """An edge (``edge_settings(**edge)``, no static nodes, snapshots never stale, the
    deadline ``request_ms``) routing on a snapshot of ``nodes`` written into Redis."""
    s = edge_settings(redis_server.url, [], stale_after_s=3600, **edge)
    s.deadlines.request_ms = request_ms
    e = edge_factory(s, check_log=check_log)
    snap = write_snapshot(redis_server.client(), nodes)
    e.wait_snapshot(snap["version"])
    return e


def edge_settings(redis_url: str, nodes: list[NodeSettings] | list[dict] = (), **edge: Any) -> Settings:
    """Settings for a test edge: one worker, fast sync, short timeouts; ``edge``
    overrides any ``[edge]`` field."""
    e = {"workers": 1, "sync_interval_s": 0.1, "connect_timeout_ms": 1000,
         "read_timeout_ms": 10000, "send_timeout_ms": 10000, "retry_window_s": 30.0,
         "breaker_cooldown_s": 2.0}
    e.update(edge)
    node_dicts = [n.model_dump() if isinstance(n, NodeSettings) else n for n in nodes]
    return settings_from_dict({"redis": {"url": redis_url}, "edge": e, "nodes": node_dicts})


def start_cache_backend(d: Path, ps: procs.ProcessSet) -> tuple[str, int, str, redis.Redis]:
    """redis-server and ``infergate embedder`` (local index) for the semantic-cache tests,
    started into ``ps`` under ``d`` on free ports; waits for the embedder and embeds once
    (a process's first embedding is slow: done before any edge budget applies). Returns
    (redis URL, Redis port, embedder URL, a decoding Redis client)."""
    redis_m, rport = procs.start_redis_free_port(d / "redis")
    ps.add(redis_m)
    url = f"redis://127.0.0.1:{rport}/0"

    def embedder_on(port: int) -> str:
        emb = procs.Managed("embedder", procs.infergate_argv(
            "embedder", "--listen", f"127.0.0.1:{port}", "--redis-url", url, "--index", "local",
            "--threads", "4"), d / "logs" / "embedder.log").start()
        embedder_url = f"http://127.0.0.1:{port}"
        try:
            emb.wait_ready(
                lambda: requests.get(embedder_url + "/healthz", timeout=1).status_code == 200, 120)
        except BaseException:
            emb.stop()
            raise
        ps.add(emb)
        return embedder_url

    embedder_url = procs.on_free_port(embedder_on)
    requests.post(embedder_url + "/v1/lookup", json={"namespace": "0" * 64, "text": "warm up"},
                  timeout=30)
    r = redis.Redis(host="127.0.0.1", port=rport, decode_responses=True, socket_timeout=2)
    return url, rport, embedder_url, r


# --------------------------------------------------------------------------- Lua in nginx

class LuaError(AssertionError):
    """Lua code run by :func:`lua_eval` raised an error."""


def lua_node_helpers(max_concurrency: int = 10, score: float = 0) -> str:
    """Lua for the start of a :func:`lua_eval` body: ``node(name, extra)``, a routing
    snapshot node (active, healthy, weight 1, the given ``max_concurrency`` and
    ``score``, fields of ``extra`` on top), and ``tbl(nodes)``, a fresh snapshot of them.
    Request tables get the deadline they carry (``req.deadline``), else none."""
    return f"""
            local function node(name, extra)
                local n = {{name = name, addr = "127.0.0.1", host = "127.0.0.1", port = 1,
                           state = "active", healthy = true, weight = 1, effective_weight = 1,
                           max_concurrency = {max_concurrency}, score = {score},
                           saturated = false}}
                for k, v in pairs(extra or {{}}) do n[k] = v end
                return n
            end
            local function tbl(nodes)
                return {{source = "redis", generated_at = ngx.now(), nodes = nodes}}
            end
            -- a request table made here has the deadline it carries (req.deadline:
            -- {{at = epoch s, request_ms}}), else none: no nginx request to read its route
            require("infergate.admission.deadline").for_request = function(req)
                return req.deadline or {{request_ms = 0, idle_s = 30}}
            end
"""


def lua_slot_prelude(modules: dict[str, str], *, max_concurrency: int = 64,
                     score: float = 0) -> str:
    """Lua for the start of a :func:`lua_eval` body of the slot and admission tests: the
    edge options (``edge.stale_after_s`` 10), ``local stats`` and ``local NAME =
    require(MODULE)`` for each of ``modules``, the helpers of :func:`lua_node_helpers`
    and ``busy(name, n)``: n attempts open on node ``name``."""
    from controlplane.edge.options import lua_string, option_spec

    requires = "".join(f'            local {name} = require("{module}")\n'
                       for name, module in modules.items())
    return """
            local config = require("infergate.core.config")
            assert(config.init({edge = {stale_after_s = 10}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
""" + requires + lua_node_helpers(max_concurrency=max_concurrency, score=score) + """
            local function busy(name, n)
                for _ = 1, n do stats.open_attempt(name, ngx.now()) end
            end
"""


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

class SimNode(launch.SimNodeProcess):
    """One ``infergate simnode`` process (see :class:`controlplane.simnode.launch.SimNodeProcess`:
    ``url``, ``control_url``, ``set_faults(...)``, ``state()``, ``stop()``), plus its
    node settings and routing-snapshot entry."""

    def node_settings(self, **kw: Any) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, **kw)

    def snapshot_node(self, **kw: Any) -> dict:
        return snapshot_node(self.name, self.host, self.port, **kw)


@pytest.fixture
def simnodes(workdir: Path) -> Iterator[Callable[..., list[SimNode]]]:
    """Factory: ``simnodes(n, "--max-running", "1", names=[...], time_scale=0.05)``.
    Keyword options become ``--key-with-dashes value`` flags (True -> bare flag) for
    every node; ``node_flags={"name": ["--max-running", "1"]}`` adds flags to one node.
    Names default to ``sim-1``, ``sim-2``, ... (counted over the test); every node has
    a control port and logs to ``workdir/logs/<name>.log``. The nodes of one call start
    together and are waited for together (30 s); all stop together at teardown."""
    started: list[SimNode] = []

    def start(n: int = 1, *flags: str, names: list[str] | None = None,
              node_flags: dict[str, list[str]] | None = None, **opts: Any) -> list[SimNode]:
        extra = [*flags, *launch.option_flags(**opts)]
        if names is not None and len(names) < n:
            raise ValueError(f"simnodes({n}): only {len(names)} names given")
        names = names[:n] if names else [f"sim-{len(started) + i + 1}" for i in range(n)]
        specs = [(name, [*extra, *(node_flags or {}).get(name, [])]) for name in names]
        out = launch.start_nodes(specs, workdir / "logs", cls=SimNode)
        started.extend(out)
        return out

    try:
        yield start
    finally:
        launch.stop_nodes(started)


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
        return [line for line in self.error_log().splitlines()
                if any(p.search(line) for p in pats) and not BIND_RETRY_RE.search(line)]

    def wait_snapshot(self, version: int, timeout: float = 10.0) -> dict:
        """Wait until the edge routes on snapshot ``version`` (or newer); return status."""
        out: dict = {}

        def seen() -> bool:
            st = self.status()
            out.update(st)
            return st["snapshot"]["source"] == "redis" and st["snapshot"]["version"] >= version

        procs.wait_until(seen, timeout, what=f"edge to load snapshot version {version}")
        return out

    def workers(self) -> list[int]:
        """The pids of this nginx's worker processes (children of its master)."""
        master = str(int(Path(self.rendered.prefix, "nginx.pid").read_text()))

        def parent(pid: str) -> str | None:
            try:  # a process of another test may end between the listing and the read
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                return None

        return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == master]

    def post_in_background(self, body: dict, out: list, timeout: float = 30) -> threading.Thread:
        """POST ``body`` to /v1/chat/completions on a new connection in a started thread;
        its status code goes to ``out`` (-1 when the connection is lost, as a killed
        worker's clients' are)."""
        def one() -> None:
            try:
                out.append(requests.post(f"{self.url}/v1/chat/completions", json=body,
                                         headers={"Connection": "close"},
                                         timeout=timeout).status_code)
            except requests.RequestException:
                out.append(-1)

        t = threading.Thread(target=one)
        t.start()
        return t

    def kill_workers(self) -> list[int]:
        """SIGKILL every worker (as a crash would end them), wait until they are reaped
        and nginx has started as many new ones; the killed pids."""
        victims = self.workers()
        assert victims
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        procs.wait_until(lambda: not any(Path(f"/proc/{v}").exists() for v in victims), 10,
                         what="the killed workers reaped")
        procs.wait_until(lambda: len(self.workers()) == len(victims), 10,
                         what="nginx's new workers")
        return victims

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
        free_metrics = settings.edge.metrics_listen == EdgeSettings().metrics_listen
        if free_metrics:
            settings = settings.model_copy(deep=True)
        given = listen
        i = len(edges) + 1
        base = workdir / f"edge-{i}"
        for attempt in range(3):
            if free_metrics:
                settings.edge.metrics_listen = f"127.0.0.1:{procs.free_port()}"
            listen = given or f"127.0.0.1:{procs.free_port()}"
            # (without the separate `nginx -t` of tests/conftest.py: starting nginx on
            # the files checks them the same way)
            render = getattr(render_nginx, "unchecked", render_nginx)
            rendered = render(settings, base / "conf", listen=listen, prefix=base / "prefix",
                              **render_opts)
            try:
                m = start_nginx(rendered.nginx_conf, rendered.prefix)
                break
            except procs.StartError as exc:
                # a free port taken in between by another process on the host: new ports
                if "in use" not in str(exc) or attempt == 2:
                    raise
                shutil.rmtree(base, ignore_errors=True)
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
        cfg = workdir / f"controlplane-{i}.toml"

        def on(port: int) -> ControlPlaneProc:
            s.controlplane.listen = f"127.0.0.1:{port}"
            _write_toml(s, cfg)
            # its health answer echoes this id: a process of another stack that bound
            # the port in between is not taken for it
            tag = f"test-controlplane-{os.getpid()}-{port}"
            m = procs.Managed(f"controlplane-{i}",
                              procs.infergate_argv("controlplane", "--config", str(cfg)),
                              workdir / "logs" / f"controlplane-{i}.log",
                              env={**os.environ, procs.INSTANCE_ENV: tag}).start()
            url = f"http://127.0.0.1:{port}"
            try:
                m.wait_ready(lambda: procs.http_instance(url + "/healthz") == tag, timeout)
            except BaseException:
                m.stop()
                raise
            return ControlPlaneProc(m, cfg, url)

        cp = procs.on_free_port(on)
        m = cp.managed
        started.append(cp)
        if wait_snapshot:
            r = redis.Redis.from_url(s.redis.url, socket_timeout=2)
            m.wait_ready(lambda: r.get(keynames.ROUTING) is not None, timeout)
        return cp

    try:
        yield start
    finally:
        for cp in reversed(started):
            cp.stop()
