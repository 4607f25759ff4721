"""``infergate up``: the whole stack on one machine.

Starts, in order: a local ``redis-server`` when none answers at ``redis.url`` (with
``maxmemory`` and ``allkeys-lru``, as recommended for production); three simulated
nodes of different speeds unless ``--node URL`` names real servers; the control plane
(poller, scorer, admin page and API); nginx with the rendered infergate config. The
edge requires API keys (``auth.mode = "required"``) unless the file sets ``auth.mode``:
a key for the tenant ``demo`` is created at start. The response cache is on unless the
file sets ``cache.enabled``, with the semantic-cache embedder (``infergate embedder``,
model ``cache.embedder_model``) started on ``cache.embedder_url`` before nginx; when the
embedder cannot start (package missing, model not loadable, port taken), the stack runs
on with the exact cache only and says so ("semantic cache off"); when it exits later,
semantic lookups answer BYPASS and the rest keeps running. Prints the URLs, the key and
a curl example; Ctrl-C or SIGTERM stops every process it started, in reverse order.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

import click
import redis as redis_lib

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.routing import registry
from controlplane.config import ConfigError, NodeSettings, Settings, load_settings
from controlplane.redisdb.conn import make_redis

#: (name, speed factor) of the simulated pool: a fast, a medium and a slow GPU.
SIM_NODES: tuple[tuple[str, float], ...] = (("sim-fast", 2.0), ("sim-medium", 1.0), ("sim-slow", 0.5))
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _split_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{what} must be HOST:PORT, got {value!r}")
    return host, int(port)


def _redis_answers(settings: Settings) -> bool:
    try:
        return bool(make_redis(settings.redis).ping())
    except redis_lib.RedisError:
        return False


def _ensure_redis(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Return a description of the Redis in use; start one if needed and possible."""
    if _redis_answers(settings):
        return f"{settings.redis.url} (already running)"
    parts = urlsplit(settings.redis.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if parts.scheme != "redis" or host not in LOCAL_HOSTS or parts.password:
        raise click.ClickException(f"no Redis answers at {settings.redis.url} and it is not a "
                                   "local address infergate could start one on")
    if procs.port_open("127.0.0.1", port):
        raise click.ClickException(f"port {port} is taken by something that is not Redis")
    stack.add(procs.start_redis(workdir / "redis", port))
    return f"{settings.redis.url} (local redis-server started, maxmemory 256mb, allkeys-lru)"


def _sim_nodes(workdir: Path, stack: procs.ProcessSet, time_scale: float) -> list[NodeSettings]:
    nodes = []
    for name, speed in SIM_NODES:
        port = procs.free_port()
        argv = procs.infergate_argv("simnode", "--host", "127.0.0.1", "--port", str(port),
                                    "--name", name, "--speed", str(speed),
                                    "--time-scale", str(time_scale))
        m = stack.add(procs.Managed(name, argv, workdir / "logs" / f"{name}.log").start())
        m.wait_ready(lambda p=port: procs.port_open("127.0.0.1", p), timeout=20)
        nodes.append(NodeSettings(name=name, url=f"http://127.0.0.1:{port}", kind="vllm"))
    return nodes


#: Longest wait for the embedder to load its model and answer ``/healthz``, seconds.
EMBEDDER_START_S = 180.0


def _embedder_healthy(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _start_embedder(settings: Settings, workdir: Path, stack: procs.ProcessSet,
                    timeout: float = EMBEDDER_START_S) -> str:
    """Start the semantic-cache embedder for ``settings.cache`` and return a one-line
    description for the banner. Never starts one for a non-local URL (the operator runs
    it there). A local one is always this run's own, on the configured port or, when that
    is busy (another stack's embedder may use another Redis), on a free port.
    On any failure stops what it started, sets ``cache.semantic = False`` and returns
    ``"off (<reason>)"``: the stack then runs with the exact cache only."""
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
    # the Redis URL (maybe with a password) through the environment, not the command line
    env = {**os.environ, "INFERGATE_REDIS_URL": settings.redis.url}
    m = procs.Managed("embedder", argv, workdir / "logs" / "embedder.log", env=env).start()
    try:
        m.wait_ready(lambda: _embedder_healthy(url), timeout)
    except procs.StartError as exc:
        m.stop()
        c.semantic = False
        last = [ln for ln in str(exc).splitlines() if ln.strip()]
        return f"off (the embedder did not start: {last[-1] if last else exc}; see {m.log_path})"
    stack.add(m)
    return f"{url} (model {c.embedder_model})"


def _real_nodes(urls: tuple[str, ...], kind: str) -> list[NodeSettings]:
    nodes = []
    for i, url in enumerate(urls, 1):
        try:
            nodes.append(NodeSettings(name=f"node-{i}", url=url, kind=kind))  # type: ignore[arg-type]
        except ValueError as exc:
            raise click.BadParameter(f"--node {url}: {exc}") from None
    return nodes


def _write_runtime_config(settings: Settings, path: Path) -> None:
    import tomli_w  # small and only needed here

    data = settings.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    os.chmod(path, 0o600)


@click.command("up")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (defaults apply without one).")
@click.option("--node", "node_urls", multiple=True, metavar="URL",
              help="A real inference server to front (repeatable), e.g. http://10.0.0.5:8000. "
                   "Without it, three simulated nodes are started.")
@click.option("--node-kind", default="vllm", show_default=True,
              type=click.Choice(["vllm", "tgi", "sglang", "json", "openai"]),
              help="Metrics dialect of the --node servers (openai = no metrics endpoint).")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Edge address [default: edge.listen, 127.0.0.1:8080].")
@click.option("--admin-listen", default=None, metavar="HOST:PORT",
              help="Admin page and API address [default: controlplane.listen, 127.0.0.1:8081].")
@click.option("--redis-url", default=None, help="Redis URL [default: redis.url].")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Folder for logs, rendered nginx config and Redis [default: a new temp dir].")
@click.option("--time-scale", default=1.0, show_default=True, type=float,
              help="Time scale of the simulated nodes (0.1 = ten times faster).")
def up_cmd(config_path: str | None, node_urls: tuple[str, ...], node_kind: str,
           listen: str | None, admin_listen: str | None, redis_url: str | None,
           workdir: str | None, time_scale: float) -> None:
    """Run the whole stack locally: Redis, nodes, control plane, nginx edge."""
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if "mode" not in settings.auth.model_fields_set:
        settings.auth.mode = "required"  # the stack runs with API keys unless the file says "off"
    if "enabled" not in settings.cache.model_fields_set:
        settings.cache.enabled = True  # the stack caches answers unless the file sets it
    if listen:
        _split_hostport(listen, "--listen")
        settings.edge.listen = listen
    if admin_listen:
        _split_hostport(admin_listen, "--admin-listen")
        settings.controlplane.listen = admin_listen
    if redis_url:
        settings.redis.url = redis_url
    edge_host, edge_port = _split_hostport(settings.edge.listen, "edge.listen")
    admin_host, admin_port = _split_hostport(settings.controlplane.listen, "controlplane.listen")
    for host, port, what in ((edge_host, edge_port, "edge"), (admin_host, admin_port, "admin")):
        if procs.port_open("127.0.0.1" if host in ("0.0.0.0", "::") else host, port):
            raise click.ClickException(f"{what} address {host}:{port} is already in use "
                                       f"(choose another with --{'listen' if what == 'edge' else 'admin-listen'})")
    generated_token = False
    if not settings.controlplane.admin_token:
        settings.controlplane.admin_token = secrets.token_urlsafe(18)
        generated_token = True

    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="infergate-up-"))
    wd.mkdir(parents=True, exist_ok=True)
    os.chmod(wd, 0o755)  # nginx workers (``nobody`` when started as root) traverse it
    stack = procs.ProcessSet()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        redis_desc = _ensure_redis(settings, wd, stack)
        if node_urls:
            nodes = _real_nodes(node_urls, node_kind)
        elif settings.nodes:
            nodes = settings.nodes
        else:
            nodes = _sim_nodes(wd, stack, time_scale)
        settings.nodes = nodes
        r = make_redis(settings.redis)
        for n in nodes:  # the nodes of this run replace same-named entries of an earlier one
            registry.put_node(r, n)
        demo_key = None
        if settings.auth.mode == "required":
            demo_key, _ = apikeys.create_key(r, "demo", label="infergate up demo key")
        semantic_desc = _start_embedder(settings, wd, stack)
        if semantic_desc.startswith("off ("):
            click.echo(f"semantic cache is off: {semantic_desc[5:-1]}", err=True)
        metrics_desc = "off"
        if settings.edge.metrics_listen:
            m_host, m_port = _split_hostport(settings.edge.metrics_listen, "edge.metrics_listen")
            if procs.port_open("127.0.0.1" if m_host in ("0.0.0.0", "::") else m_host, m_port):
                # an internal port: take a free one rather than fail on another stack's edge
                settings.edge.metrics_listen = f"{m_host}:{procs.free_port(m_host)}"
            metrics_desc = f"http://{settings.edge.metrics_listen}/metrics"
        cfg = wd / "infergate.toml"
        _write_runtime_config(settings, cfg)

        cp = stack.add(procs.Managed("controlplane", procs.infergate_argv("controlplane", "--config", str(cfg)),
                                     wd / "logs" / "controlplane.log").start())
        cp.wait_ready(lambda: procs.port_open(admin_host if admin_host not in ("0.0.0.0", "::") else "127.0.0.1",
                                              admin_port), timeout=30)

        from controlplane.edge.render import render_nginx, start_nginx

        rendered = render_nginx(settings, wd / "nginx", prefix=wd / "nginx")
        stack.add(start_nginx(rendered.nginx_conf, wd / "nginx"))

        base = f"http://{edge_host}:{edge_port}"
        model = "sim-llama" if not node_urls else "<your model>"
        key_line = f"\n  API key (demo)      {demo_key}" if demo_key else ""
        key_header = f" -H 'Authorization: Bearer {demo_key}'" if demo_key else ""
        click.echo(f"""
infergate is up.
  edge (OpenAI API)   {base}/v1
  admin page and API  http://{admin_host}:{admin_port}/   token: {settings.controlplane.admin_token}{' (generated)' if generated_token else ''}
  redis               {redis_desc}
  nodes               {', '.join(f'{n.name}={n.url}' for n in nodes)}
  response cache      {'on' if settings.cache.enabled else 'off'}; semantic cache {semantic_desc}
  edge metrics        {metrics_desc}
  logs and config     {wd}{key_line}

Try:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Ctrl-C stops everything.""", err=False)
        sys.stdout.flush()
        embedder_gone = False
        failed = ""
        while not stop.is_set():
            for m in stack.items:
                if m.name == "embedder" and not m.alive():
                    if not embedder_gone:
                        click.echo(f"embedder exited; semantic lookups answer BYPASS, the rest "
                                   f"runs on. Last lines of {m.log_path}:\n{m.log_tail()}",
                                   err=True)
                        embedder_gone = True
                    continue
                if not m.alive():
                    failed = f"{m.name} exited; stopped everything. Last lines of {m.log_path}:\n{m.log_tail()}"
                    stop.set()
                    break
            stop.wait(1.0)
    except procs.StartError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        click.echo("stopping...", err=True)
        stack.stop_all()
    if failed:
        raise click.ClickException(failed)
