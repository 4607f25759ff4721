"""The control plane and the nginx edge of ``infergate up``: the runtime config they
read, their start, the control plane's health watch."""

from __future__ import annotations

import os
import signal

from controlplane import procs
from controlplane.admin import SECRET_ENV
from controlplane.config import HostPort

from .common import START_ATTEMPTS, _say, _split_hostport, _write_runtime_config
from .plan import UpRun

#: Health checks of the control plane (its admin ``/healthz``): every so many seconds,
#: each with this timeout; after so many failures in a row it is killed and restarted.
CP_PROBE_EVERY_S = 5.0
CP_PROBE_TIMEOUT_S = 2.0
CP_PROBE_FAILS = 3
#: Seconds nginx has, when the stack stops, to finish the requests in flight (SIGQUIT,
#: its graceful shutdown) before it is stopped at once (SIGTERM).
NGINX_FINISH_S = 10.0


def choose_metrics_port(run: UpRun) -> None:
    """The edge's metrics address (``edge.metrics_listen``): a free port instead when
    another process holds it (an internal port: another stack's edge must not make this
    one fail). Sets ``run.metrics_desc`` and ``run.metrics_moved``."""
    settings = run.settings
    if not settings.edge.metrics_listen:
        return
    m_host, m_port = _split_hostport(settings.edge.metrics_listen, "edge.metrics_listen")
    if procs.port_open("127.0.0.1" if m_host in ("0.0.0.0", "::") else m_host, m_port):
        # an internal port: take a free one rather than fail on another stack's edge
        m_url_host = HostPort.parse(settings.edge.metrics_listen).url_host
        settings.edge.metrics_listen = f"{m_url_host}:{procs.free_port(m_host)}"
        run.metrics_moved = True
        _say(f"the edge's metrics port {m_port} is taken by another process: its /metrics "
             f"go on {settings.edge.metrics_listen}")
    run.metrics_desc = f"http://{settings.edge.metrics_listen}/metrics"


def _cp_healthz(run: UpRun) -> str:
    return f"http://{run.admin_probe}:{run.admin_port}/healthz"


def start_controlplane(run: UpRun) -> None:
    """Write the runtime config (``wd/infergate.toml``) and start the control plane on
    it, with the folder's admin session key (``INFERGATE_ADMIN_SECRET_KEY``,
    :func:`.plan.admin_secret_key`); ready when its admin ``/healthz`` answers with this stack's id (30 s). Raises
    :class:`controlplane.procs.StartError`."""
    run.cfg = run.wd / "infergate.toml"
    _write_runtime_config(run.settings, run.cfg)
    _say(f"starting the control plane on {run.admin_host}:{run.admin_port}")
    # the session signing key of the folder: logins and forms outlive a restart
    env = None if run.admin_secret is None else {**os.environ, SECRET_ENV: run.admin_secret}
    run.cp = cp = run.stack.add(procs.Managed(
        "controlplane", procs.infergate_argv("controlplane", "--config", str(run.cfg)),
        run.wd / "logs" / "controlplane.log", env=env).start())
    admin_probe = run.admin_host if run.admin_host not in ("0.0.0.0", "::") else "127.0.0.1"
    # ready when the admin port answers with this stack's id (never another's process)
    run.admin_probe = f"[{admin_probe}]" if ":" in admin_probe else admin_probe
    cp.wait_ready(lambda: procs.http_instance(_cp_healthz(run)) == run.instance, timeout=30)


def start_edge(run: UpRun) -> None:
    """Render the nginx config and start nginx (a stop lets the requests in flight
    finish, up to :data:`NGINX_FINISH_S`); rendered again with a new metrics port when
    the free one chosen was taken in between. Raises
    :class:`controlplane.procs.StartError`."""
    from controlplane.edge.render import render_nginx, start_nginx

    settings, wd = run.settings, run.wd
    for attempt in range(START_ATTEMPTS):
        rendered = render_nginx(settings, wd / "nginx", prefix=wd / "nginx")
        _say(f"starting nginx on {run.edge_host}:{run.edge_port} (config {rendered.nginx_conf})")
        try:
            edge = run.stack.add(start_nginx(rendered.nginx_conf, wd / "nginx"))
            # a stop lets the requests in flight (streams too) finish, as
            # `nginx -s quit` does, for up to NGINX_FINISH_S
            edge.finish_signal = signal.SIGQUIT
            edge.finish_grace = NGINX_FINISH_S
            return
        except procs.StartError as exc:
            m_port = settings.edge.metrics_listen.rpartition(":")[2]
            # the metrics port (free when chosen) was taken in between by another process
            lost = f":{m_port} failed" in str(exc) and "in use" in str(exc)
            if not lost or attempt == START_ATTEMPTS - 1:
                raise
            # the free metrics port was taken in between: render with a new one
            m_host = HostPort.parse(settings.edge.metrics_listen)
            settings.edge.metrics_listen = f"{m_host.url_host}:{procs.free_port(m_host.host)}"
            _say(f"the edge's metrics port {m_port} was taken by another process meanwhile; "
                 f"starting nginx again with its metrics on {settings.edge.metrics_listen}")
            run.metrics_desc = f"http://{settings.edge.metrics_listen}/metrics"
            run.metrics_moved = True


def watch_controlplane(run: UpRun) -> None:
    """Start the health watch of the control plane (:class:`controlplane.procs.HangWatch`):
    a control plane that is frozen (never exits) would keep the edges on a stale snapshot
    (drains and registry changes unapplied, health no longer polled)."""
    assert run.cp is not None
    cp_url = _cp_healthz(run)
    run.cp_watch = procs.HangWatch(
        run.cp, lambda: procs.http_instance(cp_url, timeout=CP_PROBE_TIMEOUT_S) == run.instance,
        _say, every_s=CP_PROBE_EVERY_S, fail_after=CP_PROBE_FAILS)
