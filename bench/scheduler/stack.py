"""The processes of the scheduler benchmark: the simulated pool, the two plain-nginx
baselines and the infergate stack (Redis, control plane, nginx with the rendered
edge config).

Time constants: the pool runs ``time_scale`` wall seconds per simulated second, so every
time constant of the balancers is scaled by the same factor (the default value x
``time_scale``): the control plane's poll interval and slow start, the edge's snapshot
sync interval and stale age, breaker cooldown, the outlier floors
``outlier_ttfb_min_s`` and ``outlier_stream_ttfb_min_s``, ``latency_norm_s``, the admission wait
and the edge deadlines (request and stream idle), nginx ``fail_timeout`` and the proxy
read/send timeouts and retry window. Connect timeouts and the poll timeout are network
facts and stay unscaled.

Plain nginx baselines: ``upstream { server ...; }`` with nginx's defaults
(``max_fails=1``, ``fail_timeout`` 10 s scaled, in whole seconds as nginx
wants, at least 1 s) and a ``zone`` (so the counters hold
across workers), ``least_conn;`` for the second, and the same proxy settings as the
infergate template (keepalive to the nodes, streaming without buffering, retries of
POST requests on errors, timeouts, 5xx and 429, 3 tries) so that only the choice of
node differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import EdgeSettings, Settings, settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx
from controlplane.simnode import launch

from ..common import NGINX_HEAD, Stack
from .workload import PoolSpec

STRATEGIES = ("round_robin", "least_conn", "infergate")
MAX_TRIES = 3


@dataclass
class SimNodeProc(launch.SimNodeProcess):
    """One node of the pool (see :class:`controlplane.simnode.launch.SimNodeProcess`:
    ``url``, ``control_url``, ``state()``, ``set_faults(...)``) with its GPU speed
    factor."""

    speed: float = 1.0


def start_pool(stack: Stack, spec: PoolSpec, time_scale: float) -> list[SimNodeProc]:
    """Start every node of ``spec`` (free ports, control port, ``--log-level warning``,
    logs in ``stack.dir/logs``), all together, and wait for them (30 s)."""
    pool = spec.nodes()
    specs = [(name, ["--log-level", "warning", *spec.simnode_flags(speed, time_scale)])
             for name, speed in pool]
    nodes = launch.start_nodes(specs, stack.dir / "logs", into=stack, cls=SimNodeProc)
    for node, (_, speed) in zip(nodes, pool, strict=True):
        node.speed = speed
    return nodes


def pool_idle(nodes: list[SimNodeProc]) -> bool:
    """True when no node has a running or waiting request."""
    for n in nodes:
        st = n.state()
        if st["running"] or st["waiting"]:
            return False
    return True


def clear_faults(nodes: list[SimNodeProc]) -> None:
    for n in nodes:
        n.set_faults(error_rate=0.0, hang=False, slowdown=1.0)


# --------------------------------------------------------------------------- nginx

def _dur(seconds: float) -> str:
    ms = max(1, int(round(seconds * 1000)))
    return f"{ms}ms"


#: nginx round-robin or least_conn in front of the pool (the baselines).
PLAIN_CONF = "# {strategy} baseline of the infergate scheduler benchmark\n" + NGINX_HEAD + """\
    tcp_nodelay on;
    # request bodies in memory, as in the infergate template (a long prompt that nginx
    # spilled to a temp file reached the node about 40 ms later)
    client_max_body_size 8m;
    client_body_buffer_size 8m;
    upstream pool {{
{least_conn}        zone pool 64k;
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            proxy_pass http://pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering on;
            proxy_connect_timeout {connect};
            proxy_send_timeout {rw};
            proxy_read_timeout {rw};
            proxy_next_upstream error timeout invalid_header http_500 http_502 http_503 http_504 http_429 non_idempotent;
            proxy_next_upstream_tries {tries};
            proxy_next_upstream_timeout {retry_window};
        }}
    }}
}}
"""


def render_plain(strategy: str, nodes: list[SimNodeProc], out_dir: Path, port: int,
                 time_scale: float) -> Path:
    """Write the nginx.conf of a plain-nginx baseline (``round_robin`` or
    ``least_conn``) into ``out_dir`` (also its prefix); return its path."""
    if strategy not in ("round_robin", "least_conn"):
        raise ValueError(f"not a plain nginx strategy: {strategy!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    servers = "\n".join(f"        server 127.0.0.1:{n.port} max_fails=1 "
                        f"fail_timeout={max(1, round(10.0 * time_scale))}s;" for n in nodes)
    text = PLAIN_CONF.format(
        strategy=strategy, prefix=out_dir, port=port, servers=servers,
        least_conn="        least_conn;\n" if strategy == "least_conn" else "",
        connect="2s", rw=_dur(60.0 * time_scale), tries=MAX_TRIES,
        retry_window=_dur(60.0 * time_scale))
    conf = out_dir / "nginx.conf"
    conf.write_text(text, encoding="utf-8")
    return conf


def infergate_settings(redis_url: str, nodes: list[SimNodeProc], spec: PoolSpec,
                       time_scale: float, max_concurrency: int | None = None) -> Settings:
    """Settings of the infergate stack: defaults with the time constants scaled (see the
    module docstring; also the admission wait and the edge deadlines when the settings
    have them), one nginx worker, weight 1 on every node (the balancer is not told which
    nodes are fast), ``max_concurrency`` (default: twice the batch size, a queue as long
    as the batch, which even the slow nodes clear well within the deadline), API keys
    not required, the response cache and the edge's Prometheus listener off, and
    ``edge.node_cost = "expected_delay"``."""
    ts = time_scale
    maxc = max_concurrency or 2 * spec.max_running
    data: dict = {
        "redis": {"url": redis_url},
        "edge": {
            "workers": 1, "max_tries": MAX_TRIES,
            "sync_interval_s": max(0.02, 0.5 * ts), "stale_after_s": 10.0 * ts,
            "connect_timeout_ms": 2000, "read_timeout_ms": int(60000 * ts),
            "send_timeout_ms": int(60000 * ts), "retry_window_s": 60.0 * ts,
            "breaker_cooldown_s": 10.0 * ts,
        },
        "controlplane": {
            "poll_interval_s": max(0.05, 1.0 * ts), "poll_timeout_s": 0.8,
            "leader_ttl_s": 5.0, "slow_start_s": 30.0 * ts,
        },
        "scoring": {"latency_norm_s": 30.0 * ts},
        "nodes": [{"name": n.name, "url": n.url, "kind": "vllm", "max_concurrency": maxc}
                  for n in nodes],
    }
    if "metrics_listen" in EdgeSettings.model_fields:
        data["edge"]["metrics_listen"] = ""  # no fixed port: nothing scrapes it here
    if "node_cost" in EdgeSettings.model_fields:
        data["edge"]["node_cost"] = "expected_delay"
    for name in ("outlier_ttfb_min_s", "outlier_stream_ttfb_min_s"):
        if name in EdgeSettings.model_fields:   # the default floors, on the scaled clock
            data["edge"][name] = max(0.1, EdgeSettings.model_fields[name].default * ts)
    fields = Settings.model_fields
    if "auth" in fields:
        data["auth"] = {"mode": "off"}
    if "admission" in fields:
        data["admission"] = {"max_wait_ms": int(500 * ts)}
    if "deadlines" in fields:
        data["deadlines"] = {"request_ms": int(30000 * ts), "stream_idle_ms": int(30000 * ts)}
    if "cache" in fields:
        data["cache"] = {"enabled": False}
    return settings_from_dict(data, "scheduler benchmark")


@dataclass
class InfergateStack:
    """Redis and the control plane, started once; nginx is started per run."""

    settings: Settings
    redis_url: str
    cp_log: Path
    managed: list[procs.Managed] = field(default_factory=list)


def start_redis_and_controlplane(stack: Stack, make_settings: Callable[[str], Settings],
                                 ready: Callable[[redis.Redis], bool],
                                 timeout_s: float = 60) -> InfergateStack:
    """Start redis-server and ``infergate controlplane`` on free ports, with the settings
    ``make_settings(redis_url)`` returns (its admin address set to a free port), and wait
    until ``ready(redis client)`` holds. Raises :class:`controlplane.procs.StartError`."""
    import tomli_w

    rport = procs.free_port()
    r_m = stack.add(procs.start_redis(stack.dir / "redis", rport))
    redis_url = f"redis://127.0.0.1:{rport}/0"
    settings = make_settings(redis_url)
    settings.controlplane.listen = f"127.0.0.1:{procs.free_port()}"
    cfg = stack.dir / "infergate.toml"
    cfg.write_text(tomli_w.dumps(settings.model_dump(mode="json", exclude_none=True)),
                   encoding="utf-8")
    cp_log = stack.dir / "logs" / "controlplane.log"
    cp = stack.add(procs.Managed("controlplane",
                                 procs.infergate_argv("controlplane", "--config", str(cfg)),
                                 cp_log).start())
    r = redis.Redis.from_url(redis_url, socket_timeout=2, decode_responses=True)
    cp.wait_ready(lambda: ready(r), timeout=timeout_s)
    return InfergateStack(settings=settings, redis_url=redis_url, cp_log=cp_log, managed=[r_m, cp])


def start_infergate_base(stack: Stack, nodes: list[SimNodeProc], spec: PoolSpec,
                         time_scale: float, max_concurrency: int | None = None) -> InfergateStack:
    """Start redis-server and ``infergate controlplane`` on free ports and wait for the
    first routing snapshot that has every node healthy."""
    return start_redis_and_controlplane(
        stack, lambda url: infergate_settings(url, nodes, spec, time_scale, max_concurrency),
        lambda r: snapshot_all_healthy(r, len(nodes)))


def snapshot_all_healthy(r: redis.Redis, n: int) -> bool:
    """The routing snapshot in Redis lists ``n`` active, healthy nodes."""
    from controlplane.routing.wire import RoutingSnapshot

    snap = RoutingSnapshot.parse(r.get(keynames.ROUTING))
    if snap is None:
        return False
    return sum(1 for x in snap.nodes if x.healthy and x.state == "active") == n


class EdgeRun:
    """nginx for one run of one strategy; ``url`` of its chat completions endpoint."""

    def __init__(self, stack: Stack, strategy: str, nodes: list[SimNodeProc], time_scale: float,
                 base: InfergateStack | None, run_id: str) -> None:
        self.strategy = strategy
        self.dir = stack.dir / "runs" / run_id
        port = procs.free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        if strategy == "infergate":
            if base is None:
                raise ValueError("infergate needs the Redis + control plane stack")
            rendered = render_nginx(base.settings, self.dir / "conf", listen=f"127.0.0.1:{port}",
                                    prefix=self.dir / "prefix", source="scheduler benchmark")
            self.managed = start_nginx(rendered.nginx_conf, rendered.prefix)
            self.error_log = rendered.error_log
            procs.wait_until(self._routes_on_redis, 20, what="edge to load the routing snapshot")
        else:
            conf = render_plain(strategy, nodes, self.dir, port, time_scale)
            self.managed = start_nginx(conf, self.dir)
            self.error_log = self.dir / "logs" / "error.log"
        self.url = f"{self.base_url}/v1/chat/completions"

    def _routes_on_redis(self) -> bool:
        st = requests.get(f"{self.base_url}/infergate/status", timeout=2).json()
        return st["snapshot"]["source"] == "redis" and all(n["eligible"] for n in st["nodes"])

    def edge_status(self) -> dict | None:
        """``/infergate/status`` of an infergate edge (``None`` for the baselines)."""
        if self.strategy != "infergate":
            return None
        try:
            return requests.get(f"{self.base_url}/infergate/status", timeout=2).json()
        except (requests.RequestException, ValueError):
            return None

    def error_lines(self, limit: int = 5) -> list[str]:
        """The first ``[error]``/``[crit]``/``[alert]`` lines of nginx's error log."""
        try:
            lines = self.error_log.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln for ln in lines if "[error]" in ln or "[crit]" in ln or "[alert]" in ln][:limit]

    def stop(self) -> None:
        self.managed.stop()
