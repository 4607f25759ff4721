"""Render the nginx configuration of the infergate edge and run nginx with it.

``infergate render-nginx --config FILE --out DIR`` writes three files from the Jinja2
templates in ``nginx/`` (see :func:`controlplane.paths.nginx_templates_dir`):

- ``infergate-http.conf``: include inside an existing ``http {}`` (Lua path, shared
  dicts, ``init_by_lua`` with the edge options and the static node list, the sync
  timer, the ``infergate_nodes`` upstream with the Lua balancer);
- ``infergate-server.conf``: include inside an existing ``server {}`` (``/v1/...``
  locations, ``/infergate/status``, JSON error pages);
- ``nginx.conf``: a standalone configuration that loads the Lua module (not with
  ``--openresty``, which bundles it), keeps pid, logs and temp files under the prefix
  folder and includes the two files above.

Python API (used by ``infergate up`` and the tests): :func:`render_nginx`,
:func:`nginx_test`, :func:`start_nginx`.

Every ``edge.*`` setting is used: ``listen`` (standalone ``listen``), ``edge_id``,
``sync_interval_s``, ``stale_after_s``, ``redis_timeout_ms``, ``breaker_*`` and
``inflight_cost`` go to the Lua options; ``max_tries`` -> ``proxy_next_upstream_tries``
and the balancer's extra tries; ``*_timeout_ms`` -> ``proxy_*_timeout`` and the
balancer's ``set_timeouts``; ``retry_window_s`` -> ``proxy_next_upstream_timeout``;
``client_max_body_size`` -> ``client_max_body_size``; ``client_body_buffer_size`` -> the same;
``keepalive`` -> upstream ``keepalive``; ``workers`` -> ``worker_processes``;
``metrics_listen`` -> the ``server {}`` of ``GET /metrics`` in the http include (none when
empty); ``client_body_timeout_ms`` -> ``client_body_timeout`` and the Lua body read. The
``[redis]`` TLS and Sentinel options go to the Lua options (``redis_tls_*``,
``redis_sentinel_*``), ``tls_ca_file`` to ``lua_ssl_trusted_certificate``. From
``scoring``, ``latency_norm_s`` normalises the latency term of the balancer cost. The
Lua options are one document, the edge's sections of the TOML file as they are there,
with the spec it is checked against, both from :mod:`controlplane.edge.options`.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import click
import jinja2

from controlplane import filewrite, paths, portholder, procs
from controlplane.config import (
    ConfigError,
    HostPort,
    HostPortError,
    NodeSettings,
    PROXIED_API_PATHS,
    TOKENIZER_PATHS,
    Settings,
    check_settings,
    load_settings,
)
from controlplane.edge.options import OptionError, lua_string
from controlplane.edge.options import render_context as options_render_context
from controlplane.errors import InfergateError
from controlplane.redisdb.url import RedisURLError, parse_redis_url
from controlplane.routing import nodeaccess

#: Files written by :func:`render_nginx`, by template name.
TEMPLATES = {
    "infergate-http.conf.j2": "infergate-http.conf",
    "infergate-server.conf.j2": "infergate-server.conf",
    "nginx.conf.j2": "nginx.conf",
}
#: Statuses nginx may answer itself; each gets an OpenAI-style JSON body.
ERROR_CODES = (400, 403, 404, 405, 408, 413, 414, 429, 494, 500, 501, 502, 503, 504, 505)
#: Where Debian's libnginx-mod-http-lua installs the dynamic modules.
DEFAULT_MODULES_DIRS = ("/usr/lib/nginx/modules", "/usr/share/nginx/modules",
                        "/usr/lib64/nginx/modules")


class RenderError(InfergateError, ValueError):
    """The settings cannot be turned into a valid nginx configuration."""


class NginxError(InfergateError, RuntimeError):
    """``nginx -t`` rejected a configuration (the message holds nginx's output)."""


@dataclass(frozen=True)
class RenderedConfig:
    """Paths and facts of one rendering."""

    out_dir: Path
    http_conf: Path
    server_conf: Path
    nginx_conf: Path
    prefix: Path
    error_log: Path
    access_log: Path
    listen: str
    edge_id: str
    openresty: bool
    warnings: tuple[str, ...] = ()
    lua_dir: Path | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the standalone listener (0.0.0.0/:: -> loopback)."""
        return HostPort.parse(self.listen, "listen address").client_url


def split_listen(value: str, what: str = "listen address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port), through
    :class:`controlplane.config.HostPort`. Raises :class:`RenderError`."""
    try:
        hp = HostPort.parse(value, what)
    except HostPortError as exc:
        raise RenderError(str(exc)) from None
    return hp.host, hp.port


def _ip_literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _resolve(host: str) -> str | None:
    """IPv4 (else IPv6) address of ``host``, or None. ``localhost`` -> 127.0.0.1."""
    lit = _ip_literal(host)
    if lit:
        return lit
    if host == "localhost":
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
    return (v4 or v6 or [None])[0]


def _system_resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    try:
        text = resolv_conf.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and _ip_literal(parts[1].split("%")[0]):
            addr = parts[1].split("%")[0]
            out.append(f"[{addr}]" if ":" in addr else addr)
    return out


def _duration(ms: float) -> str:
    """nginx time value from milliseconds (``0`` stays ``0`` = off)."""
    ms = int(round(ms))
    if ms <= 0:
        return "0"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


#: Debian's CA bundle (package ca-certificates).
DEBIAN_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def system_ca_bundle() -> str:
    """The system's CA bundle, for rediss:// without ``redis.tls_ca_file`` and https nodes
    without a CA of their own: ``$SSL_CERT_FILE`` when set (OpenSSL's own variable for its
    default bundle, which curl and Python follow too), else Debian's. Each API location
    loads it: a bundle of only the CAs in use also makes nginx start faster and smaller
    (docs/operations.md)."""
    return os.environ.get("SSL_CERT_FILE") or DEBIAN_CA_BUNDLE


def _redis_ca_file(settings: Settings) -> str | None:
    """``lua_ssl_trusted_certificate`` for a ``rediss://`` URL: ``redis.tls_ca_file``, else
    the system bundle; ``None`` without verification. Raises :class:`RenderError` when the
    file is missing (nginx would refuse to start)."""
    r = settings.redis
    if not r.tls_verify:
        return None
    path = r.tls_ca_file or system_ca_bundle()
    if not Path(path).is_file():
        raise RenderError(f"redis.tls_ca_file: no such file {path!r} (needed to verify the "
                          "Redis server certificate; or set redis.tls_verify = false)")
    return str(Path(path).resolve())


def default_modules_dir() -> str:
    """First existing folder holding ``ngx_http_lua_module.so`` (Debian layout)."""
    for d in DEFAULT_MODULES_DIRS:
        if Path(d, "ngx_http_lua_module.so").exists():
            return d
    return DEFAULT_MODULES_DIRS[0]


def nginx_binary(openresty: bool = False) -> str:
    """Path of ``nginx`` (``openresty`` with ``openresty=True``: never Debian's nginx,
    which lacks the bundled modules); ``INFERGATE_NGINX`` overrides. Raises
    :class:`procs.StartError` (one line) when it is not installed."""
    env = os.environ.get("INFERGATE_NGINX")
    if env:
        return env
    name = "openresty" if openresty else "nginx"
    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/openresty/bin")
    if exe:
        return exe
    if openresty:
        raise procs.StartError("openresty not found (PATH, /usr/local/openresty/bin): install "
                               "OpenResty, or render without --openresty for Debian's nginx")
    raise procs.StartError("nginx not found: apt-get install nginx libnginx-mod-http-lua "
                           "lua-resty-core lua-cjson (or install OpenResty)")


def static_nodes(settings: Settings) -> tuple[list[dict], list[str]]:
    """The TOML ``[[nodes]]`` as the edge's static list, host names resolved now (the
    balancer phase cannot resolve). A node whose host does not resolve keeps
    ``host: null`` and is never picked from the static list (the control plane's
    snapshot carries resolved addresses). Returns (nodes, warnings)."""
    nodes, warnings = [], []
    for n in settings.nodes:
        parts = urlsplit(n.url)
        host = parts.hostname or ""
        addr = _resolve(host)
        if addr is None:
            warnings.append(f"node {n.name}: cannot resolve {host!r} now; it is left out of the "
                            "static node list until the control plane's snapshot names its address")
        entry = {"name": n.name, "host": addr,
                 "port": parts.port or (443 if parts.scheme == "https" else 80),
                 "weight": n.weight, "max_concurrency": n.max_concurrency, "kind": n.kind}
        _static_access(n, entry, warnings)
        if n.models:
            entry["models"] = list(n.models)  # served model ids (model-aware routing)
        nodes.append(entry)
    return nodes, warnings


def _static_access(n: NodeSettings, entry: dict, warnings: list[str]) -> None:
    """Scheme and certificate host name of an https node, and the API key (``auth``,
    read now from the node's ``api_key_env`` / ``api_key_file``), in its static entry."""
    parts = urlsplit(n.url)
    if parts.scheme == "https":  # plain nodes: http, the entry as before
        entry["scheme"] = "https"
        entry["tls_name"] = parts.hostname
    if n.has_credential():
        auth, err = nodeaccess.resolve_quiet(n)
        if auth:
            entry["auth"] = auth
        else:
            warnings.append(f"node {n.name}: API key not read now ({err}); the static node "
                            "list sends it none until the control plane's snapshot does")


def node_ca_bundle(settings: Settings, out: Path) -> str | None:
    """``proxy_ssl_trusted_certificate`` of the API locations: the CAs the ``https://``
    nodes are verified with. ``controlplane.node_ca_file`` (else the system bundle) alone
    when no node has a ``ca_file``; otherwise ``node-ca.pem`` written into ``out``, those
    and every node's ``ca_file`` one after the other. ``None`` when there is none at all
    (the edge then refuses requests to https nodes added at run time). Raises
    :class:`RenderError` for a CA file that cannot be read, or an https node of the file
    without any CA to verify it with."""
    base = settings.controlplane.node_ca_file
    if base and not Path(base).is_file():
        raise RenderError(f"controlplane.node_ca_file: no such file {base!r}")
    files = nodeaccess.ca_bundle_paths(settings.nodes, base)
    system = system_ca_bundle()
    if not base and Path(system).is_file():
        files.insert(0, system)
    if not files:
        https = [n.name for n in settings.nodes if n.url.startswith("https://")]
        if https:
            raise RenderError(f"node(s) {', '.join(https)}: https:// needs a CA bundle to "
                              f"verify the certificate; {system} is missing: set "
                              "controlplane.node_ca_file or the node's ca_file")
        return None
    if len(files) == 1:
        return str(Path(files[0]).resolve())
    parts = []
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RenderError(f"CA file {f!r} of the nodes cannot be read: {exc}") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise RenderError(f"CA file {f!r} of the nodes holds no PEM certificate")
        parts.append(text if text.endswith("\n") else text + "\n")
    bundle = out / "node-ca.pem"
    bundle.write_text("".join(parts), encoding="utf-8")
    os.chmod(bundle, 0o644)
    return str(bundle.resolve())


def _has_secret(settings: Settings) -> bool:
    """Whether the rendered options carry a password (Redis URL or Sentinel) or a node's
    API key (the static node list)."""
    return ("@" in settings.redis.url or bool(settings.redis.sentinel_password)
            or any(n.has_credential() for n in settings.nodes))


#: Characters of a folder name nginx would not read as part of an unquoted path.
NGINX_PATH_UNSAFE = frozenset(";#$\"'{}\\")


def _check_folders(out: Path, pre: Path, lua_path: Path) -> None:
    """Raise :class:`RenderError` for a folder nginx cannot name unquoted
    (:data:`NGINX_PATH_UNSAFE`, white space)."""
    for what, folder in (("--out", out), ("--prefix", pre), ("--lua-dir", lua_path)):
        bad = sorted({ch for ch in str(folder) if ch.isspace() or ch in NGINX_PATH_UNSAFE})
        if bad:
            raise RenderError(f"{what} {str(folder)!r}: nginx directives would split on "
                              f"{' '.join(repr(ch) for ch in bad)}; choose a folder without "
                              "spaces, quotes, ';', '#', '$', '{' or '}'")


def _redis_hosts(settings: Settings) -> tuple[str, bool, str | None]:
    """(the Redis host names as the config's comment shows them, whether one is a name
    that needs a DNS resolver, the CA file of a TLS Redis). Raises :class:`RenderError`
    for a bad ``redis.url``."""
    try:
        target = parse_redis_url(settings.redis.url)
    except RedisURLError as exc:
        raise RenderError(f"redis.url: {exc}") from None
    if target.kind == "direct":
        redis_hosts = [target.host or ""]
    else:  # a cluster's seeds; the nodes its slot map names are addresses as announced
        redis_hosts = [h for h, _ in (target.sentinels if target.kind == "sentinel" else target.nodes)]
    names = [h for h in redis_hosts if _ip_literal(h) is None and h != "localhost"]
    redis_host = ", ".join(names or redis_hosts)
    needs_resolver = bool(names)
    redis_ca_file = _redis_ca_file(settings) if target.tls else None
    return redis_host, needs_resolver, redis_ca_file


def _metrics_listen(settings: Settings, listen: str) -> str:
    """``edge.metrics_listen`` checked (an address, not the API's); ``""`` for none."""
    metrics_listen = settings.edge.metrics_listen.strip()
    if metrics_listen:
        split_listen(metrics_listen, "edge.metrics_listen")
        if metrics_listen == listen:
            raise RenderError(f"edge.metrics_listen {metrics_listen!r} is the API listen address; "
                              "use another port (or \"\" for no metrics server)")
    return metrics_listen


def _dns_resolver(needs_resolver: bool, resolver: str | None, redis_host: str) -> str | None:
    """The ``resolver`` directive's servers when a Redis host needs one (given, else
    from /etc/resolv.conf), else None. Raises :class:`RenderError` when none is found."""
    if not needs_resolver:
        return None
    if not resolver:
        found = _system_resolvers()
        resolver = " ".join(found) if found else None
        if not resolver:
            raise RenderError(f"redis.url names the host {redis_host!r} but no DNS server was "
                              "found in /etc/resolv.conf; pass --resolver or use an IP address")
    return resolver


#: The user nginx's workers run as when the master is root and the config names none
#: (the rendered standalone config names none): nginx's compiled-in default.
WORKER_USER = "nobody"


def _make_prefix(out: Path, pre: Path, state_default: bool = True) -> None:
    """Create ``out`` and the prefix with its ``logs/`` (mode 0755 when new) and, when
    ``state_default`` (``edge.state_dir`` unset), ``infergate-state/`` (the edge's last
    known good state: mode 0700, owned by the workers' user, :data:`WORKER_USER` when
    rendering as root)."""
    out.mkdir(parents=True, exist_ok=True)
    for d in (pre, pre / "logs"):
        if not d.exists():
            d.mkdir(parents=True)
            os.chmod(d, 0o755)
    state = pre / "infergate-state"
    if state_default and not state.exists():
        state.mkdir()
        os.chmod(state, 0o700)
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam(WORKER_USER)
                os.chown(state, pw.pw_uid, pw.pw_gid)
            except (KeyError, OSError):
                pass   # the edge then says once that it cannot save its state


#: File in the rendered folder holding the edge's hop id (kept across renders).
HOP_ID_FILE = "hop-id"
_HOP_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def hop_id(out: Path) -> str:
    """The edge's hop id, 16 hex digits: every request it proxies carries it in
    ``X-Infergate-Hop`` (after the ids of the edges it came through), and a request that
    comes back with it is a routing loop (508). Random, kept in ``out/hop-id`` so every
    render of a folder (a reload) keeps it; a client cannot guess it, so a header it sets
    itself proves nothing (lua/infergate/access.lua)."""
    path = out / HOP_ID_FILE
    try:
        found = path.read_text(encoding="ascii").strip()
        if _HOP_ID_RE.match(found):
            return found
    except (OSError, UnicodeDecodeError):
        pass
    value = secrets.token_hex(8)
    path.write_text(value + "\n", encoding="ascii")
    return value


def _path_entries(extra: str) -> str:
    """``edge.lua_package_path_extra`` as the head of ``lua_package_path``: ends with one
    ``;`` (empty stays empty)."""
    extra = extra.strip().rstrip(";")
    return extra + ";" if extra else ""


def _template_context(settings: Settings, *, source: str, out: Path, pre: Path,
                      lua_path: Path, files: dict[str, Path], listen: str,
                      metrics_listen: str, redis_host: str, resolver: str | None,
                      redis_ca_file: str | None, openresty: bool, modules_dir: str | None,
                      error_log_level: str, options_ctx: dict) -> dict:
    """The variables of the templates (:data:`TEMPLATES`)."""
    ctx = {
        "source": source,
        "lua_dir": str(lua_path),
        "lua_path_extra": _path_entries(settings.edge.lua_package_path_extra),
        "init_lua_file": lua_string(settings.edge.init_lua_file)
        if settings.edge.init_lua_file else "",
        "init_worker_lua_file": lua_string(settings.edge.init_worker_lua_file)
        if settings.edge.init_worker_lua_file else "",
        "resolver": resolver,
        "redis_host": redis_host,
        "snapshot_dict_size": "4m",
        "stats_dict_size": "4m",
        "keepalive": settings.edge.keepalive,
        "error_codes": ERROR_CODES,
        "api_paths": PROXIED_API_PATHS,
        "tokenizer_paths": TOKENIZER_PATHS,
        "client_max_body_size": settings.edge.client_max_body_size,
        "client_body_buffer_size": settings.edge.client_body_buffer_size,
        "connect_timeout": _duration(settings.edge.connect_timeout_ms),
        "send_timeout": _duration(settings.edge.send_timeout_ms),
        "read_timeout": _duration(settings.edge.read_timeout_ms),
        "retry_window": _duration(settings.edge.retry_window_s * 1000),
        "max_tries": settings.edge.max_tries,
        "openresty": openresty,
        "modules_dir": modules_dir or default_modules_dir(),
        "workers": settings.edge.workers,
        "prefix": str(pre),
        "error_log": str(pre / "logs" / "error.log"),
        "error_log_level": error_log_level,
        "access_log": str(pre / "logs" / "access.log"),
        "listen": listen,
        "metrics_listen": metrics_listen,
        "redis_ca_file": redis_ca_file,
        "client_body_timeout": _duration(settings.edge.client_body_timeout_ms),
        "http_conf": str(files["infergate-http.conf"]),
        "server_conf": str(files["infergate-server.conf"]),
        "nginx_conf": str(files["nginx.conf"]),
        "nginx_bin": "openresty" if openresty else "nginx",
        "rendered_dir_lua": lua_string(str(out)),
        "embedder_token": settings.cache.embedder_token,
        "node_ca_bundle": node_ca_bundle(settings, out),
        "hop_id": hop_id(out),
        **options_ctx,
    }
    return ctx


def _write_templates(settings: Settings, files: dict[str, Path], ctx: dict) -> None:
    """Render every template of :data:`TEMPLATES` with ``ctx`` into ``files``; a file
    holding a secret is not readable by others, not even while it is written.

    All or nothing: every file is written beside its target first (synced), then each
    is renamed over its target, so a failed write (a full disk) leaves the files of the
    last render as they were, never a cut-off include next to a new one, and a reload
    meanwhile reads whole files. A file keeps its owner, and a symbolic link the file it
    names (that file is replaced, not the link)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(paths.nginx_templates_dir())),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=False,
    )
    written: list[tuple[str, Path]] = []
    try:
        for tpl, name in TEMPLATES.items():
            data = env.get_template(tpl).render(**ctx).encode("utf-8")
            # the http include carries the Redis URL, the server include the embedder
            # token: no read access for others when they hold a secret (nginx's master
            # process reads them as root)
            secret = ((name == "infergate-http.conf" and _has_secret(settings))
                      or (name == "infergate-server.conf"
                          and bool(settings.cache.embedder_token)))
            # a symbolic link keeps naming the file it names, now rewritten; a file keeps
            # its owner (an operator's chgrp lets a group read a 0640 include)
            written.append(filewrite.stage(files[name], data, 0o640 if secret else 0o644))
        for tmp, target in written:
            os.replace(tmp, target)
    finally:
        for tmp, _ in written:
            Path(tmp).unlink(missing_ok=True)


def render_nginx(settings: Settings, out_dir: str | Path, *, listen: str | None = None,
                 prefix: str | Path | None = None, openresty: bool = False,
                 modules_dir: str | None = None, lua_dir: str | Path | None = None,
                 resolver: str | None = None, error_log_level: str = "warn",
                 source: str = "infergate settings") -> RenderedConfig:
    """Write ``infergate-http.conf``, ``infergate-server.conf`` and ``nginx.conf`` into
    ``out_dir`` (created) and return their paths.

    ``listen``: ``HOST:PORT`` of the standalone server (default ``edge.listen``).
    ``prefix``: folder for pid, logs (``logs/``) and temp files (default ``out_dir``);
    created with mode 0755 when missing. ``openresty``: no ``load_module`` lines.
    ``modules_dir``: folder of the dynamic modules (default: the Debian one found).
    ``lua_dir``: folder holding ``infergate/*.lua`` (default ``paths.lua_dir()``).
    ``resolver``: DNS server for a Redis host name (default: from /etc/resolv.conf,
    only when ``redis.url`` names a host rather than an IP address).

    Raises :class:`RenderError` for folders nginx cannot name unquoted (a space, ``;``,
    quotes, ...: :data:`NGINX_PATH_UNSAFE`), for settings nginx cannot run with (bad listen
    address, bad size, bad Redis URL, any value the edge's option spec refuses, in the
    edge's words) and ``OSError`` when the folders are not writable. ``settings`` is
    validated again first, so values assigned after loading are checked as well.
    """
    try:
        settings = check_settings(settings, source)
    except ConfigError as exc:
        raise RenderError(str(exc)) from None
    out = Path(out_dir).resolve()
    pre = Path(prefix).resolve() if prefix is not None else out
    lua_path = Path(lua_dir).resolve() if lua_dir else paths.lua_dir()
    _check_folders(out, pre, lua_path)
    listen = listen or settings.edge.listen
    host, port = split_listen(listen)
    edge_id = settings.edge.edge_id or f"{socket.gethostname()}:{port}"

    redis_host, needs_resolver, redis_ca_file = _redis_hosts(settings)
    metrics_listen = _metrics_listen(settings, listen)
    resolver = _dns_resolver(needs_resolver, resolver, redis_host)

    nodes, warnings = static_nodes(settings)
    try:
        options_ctx = options_render_context(settings, edge_id, nodes)
    except OptionError as exc:
        raise RenderError(f"invalid edge options: {exc}") from None

    _make_prefix(out, pre, not settings.edge.state_dir)
    files = {v: out / v for v in TEMPLATES.values()}
    ctx = _template_context(
        settings, source=source, out=out, pre=pre, lua_path=lua_path, files=files,
        listen=listen, metrics_listen=metrics_listen, redis_host=redis_host,
        resolver=resolver, redis_ca_file=redis_ca_file, openresty=openresty,
        modules_dir=modules_dir, error_log_level=error_log_level, options_ctx=options_ctx)
    _write_templates(settings, files, ctx)
    return RenderedConfig(
        out_dir=out, http_conf=files["infergate-http.conf"],
        server_conf=files["infergate-server.conf"], nginx_conf=files["nginx.conf"],
        prefix=pre, error_log=pre / "logs" / "error.log", access_log=pre / "logs" / "access.log",
        listen=listen, edge_id=edge_id, openresty=openresty, warnings=tuple(warnings),
        lua_dir=lua_path,
    )


def nginx_test(conf_path: str | Path, prefix: str | Path, *, nginx_bin: str | None = None,
               timeout: float = 30.0) -> str:
    """Run ``nginx -t -p PREFIX -c CONF``; return its output. Raises :class:`NginxError`
    with nginx's messages when the configuration is rejected. ``nginx -t`` creates the
    pid file (``PREFIX/nginx.pid``, empty) to check it can: one that was not there before
    is removed again, so that no empty pid file is left for a later ``nginx -s``."""
    exe = nginx_bin or nginx_binary()
    pid_file = Path(prefix) / "nginx.pid"
    had_pid = pid_file.exists()
    res = subprocess.run([exe, "-t", "-q", "-p", str(prefix), "-c", str(conf_path)],
                         capture_output=True, text=True, timeout=timeout)
    if not had_pid:
        try:
            if pid_file.stat().st_size == 0:
                pid_file.unlink()
        except OSError:
            pass
    output = (res.stdout + res.stderr).strip()
    if res.returncode != 0:
        raise NginxError(f"nginx -t failed for {conf_path}:\n{output}")
    return output


def listen_of(conf_path: str | Path) -> tuple[str, int]:
    """(host, port) of the first ``listen`` directive of a rendered nginx.conf."""
    text = Path(conf_path).read_text(encoding="utf-8")
    m = re.search(r"^\s*listen\s+([^\s;]+)", text, re.M)
    if not m:
        raise RenderError(f"{conf_path}: no listen directive")
    value = m.group(1)
    if value.isdigit():
        return "127.0.0.1", int(value)
    split_listen(value)
    hp = HostPort.parse(value)
    return hp.client_host, hp.port


def start_nginx(conf_path: str | Path, prefix: str | Path, *, nginx_bin: str | None = None,
                timeout: float = 20.0, log_path: str | Path | None = None) -> procs.Managed:
    """Start nginx in the foreground (``nginx -p PREFIX -c CONF -g 'daemon off;'``) in
    its own process group and wait until a worker answers HTTP on its listen port (then
    every listen address is bound: the master listens on the ports it could bind while
    it retries one it could not, and exits when that fails).

    Returns the :class:`procs.Managed` (``stop()`` ends master and workers). Raises
    :class:`procs.StartError` when nginx exits early or the port does not open within
    ``timeout`` seconds (the message holds the end of nginx's error log)."""
    exe = nginx_bin or nginx_binary()
    host, port = listen_of(conf_path)
    prefix = Path(prefix)
    argv = [exe, "-p", str(prefix), "-c", str(conf_path), "-g", "daemon off;"]
    log = Path(log_path) if log_path else prefix / "logs" / "nginx.out"
    # restarted after its master died: the orphaned workers get SIGQUIT (graceful: they
    # close the listening sockets and finish their requests), not SIGKILL
    m = procs.Managed("nginx", argv, log, orphans_signal=signal.SIGQUIT).start()
    try:
        return m.wait_ready(lambda: procs.http_answers(host, port, "/infergate/status"),
                            timeout)
    except procs.StartError as exc:
        m.stop()
        err_log = prefix / "logs" / "error.log"
        tail = ""
        if err_log.exists():
            tail = "\n".join(err_log.read_text(errors="replace").splitlines()[-20:])
        raise procs.StartError(f"{exc}\n{tail}") from None


def default_prefix() -> Path:
    """Prefix of the standalone config's pid, ``logs/`` and temp folders when
    ``render-nginx`` gets no ``--prefix``: ``/var/lib/infergate/nginx`` for root, else
    ``$XDG_STATE_HOME/infergate/nginx`` (``~/.local/state/infergate/nginx``). Never the
    output folder of the configuration."""
    if os.geteuid() == 0:
        return Path("/var/lib/infergate/nginx")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "infergate" / "nginx"


def _probe_infergate(host: str, port: int, path: str, timeout: float = 1.0) -> str | None:
    """Whether host:port answers like an infergate edge: ``GET /infergate/status`` (the
    status document: ``edge_id``, ``snapshot``, ``nodes``) or ``GET /metrics``
    (``infergate_edge_`` families), ``path`` first. Returns the folder that edge's
    configuration was rendered into (``config_dir`` of the status, the
    ``infergate_edge_info`` sample of the metrics), ``""`` for an infergate edge that
    does not say, None for anything else."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    if ":" in host:
        host = f"[{host}]"
    paths = [path] + [p for p in ("/infergate/status", "/metrics") if p != path]
    for p in paths:
        try:
            res = requests.get(f"http://{host}:{port}{p}", timeout=timeout)
        except requests.RequestException:
            return None
        if res.status_code != 200:
            continue
        if res.headers.get("Content-Type", "").startswith("application/json"):
            try:
                doc = res.json()
            except ValueError:
                continue
            if isinstance(doc, dict) and {"edge_id", "snapshot", "nodes"} <= set(doc):
                found = doc.get("config_dir")
                return found if isinstance(found, str) else ""
            continue
        if "infergate_edge_" not in res.text[:65536]:
            continue
        try:
            for family in text_string_to_metric_families(res.text):
                if family.name == "infergate_edge_info":
                    for sample in family.samples:
                        return sample.labels.get("config_dir", "")
        except ValueError:
            pass
        return ""
    return None


def _ephemeral_port(port: int) -> bool:
    """Whether ``port`` lies in the kernel's range for outgoing connections
    (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux by default)."""
    try:
        low, high = (int(x) for x in
                     Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low <= port <= high


def check_listen(value: str, what: str, probe_path: str,
                 config_dir: str | Path | None = None) -> tuple[str, str] | None:
    """Try to bind ``value`` (``HOST:PORT``, as nginx would, with ``SO_REUSEADDR``) and
    release it at once. Returns None when it binds, ``("note", text)`` when the infergate
    edge that holds it runs the configuration rendered into ``config_dir`` (``GET
    probe_path`` answers like an edge and names that folder: this nginx before a reload),
    ``("error", text)`` when anything else holds it (another infergate edge included: on
    a shared host it is someone else's nginx) or the address cannot be bound here (not a
    local address, a port below 1024 without root). ``what`` names the setting in the
    message."""
    host, port = split_listen(value)
    bind_host = "0.0.0.0" if host in ("", "*") else host
    addr = _resolve(bind_host) or bind_host
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # as nginx binds [::]:port (ipv6only=on)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        sock.listen(1)
        return None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)
            holder = _probe_infergate(probe_host, port, probe_path)
            own = str(Path(config_dir).resolve()) if config_dir is not None else None
            if holder is not None and own is not None and holder == own:
                return ("note", f"{what} {value} is served by the running edge of this "
                                f"configuration ({own}): fine before a reload")
            if holder is not None:
                where = f" rendered into {holder}" if holder else ""
                return ("error", f"{what} {value} is held by another running infergate "
                                 f"edge{where}: nginx would fail to start; choose a free "
                                 "address")
            hint = ""
            if _ephemeral_port(port):
                hint = (f" (port {port} is in this host's ephemeral range, where outgoing "
                        "connections take ports too: prefer a port below it)")
            who = portholder.holder(port)
            by = f" ({who})" if who else ""
            return ("error", f"{what} {value} is already in use by another process{by}: nginx "
                             f"would fail to start; choose a free address{hint}")
        return ("error", f"{what} {value} cannot be bound here: {reason}")
    finally:
        sock.close()


def lua_file_problems(settings: Settings, lua_dir: Path | None) -> list[str]:
    """The Lua files the http include's init blocks load that nginx could not read:
    infergate's own modules under ``lua_dir`` and ``edge.init_lua_file`` /
    ``edge.init_worker_lua_file``. ``nginx -t`` does not run ``init_by_lua``, so it
    passes with any of them missing while nginx then refuses to start (or to reload)."""
    problems = []
    if lua_dir is not None:
        for module in ("infergate/core/config.lua", "infergate/phases.lua"):
            if not (lua_dir / module).is_file():
                problems.append(f"--lua-dir {lua_dir}: no {module} there (the folder holding "
                                "infergate/*.lua); nginx would not start")
    for field in ("init_lua_file", "init_worker_lua_file"):
        name = getattr(settings.edge, field)
        if not name:
            continue
        path = Path(name)
        if not path.is_file():
            why = "is not a file" if path.exists() else "does not exist"
        elif not os.access(path, os.R_OK):
            why = "is not readable"
        else:
            continue
        problems.append(f"edge.{field}: {name} {why}; nginx would not start")
    return problems


def check_rendered(settings: Settings, rendered: RenderedConfig, *,
                   nginx_bin: str | None = None) -> list[str]:
    """What ``render-nginx --check`` does after writing: bind every listen address the
    rendering names (``edge.metrics_listen`` of the http include, the standalone
    ``listen``), look for the Lua files the init blocks load (:func:`lua_file_problems`:
    ``nginx -t`` does not run them), then ``nginx -t`` on the standalone config under its
    prefix (pid, logs and temp folders go there, never into the output folder). Returns notes (addresses
    held by the running edge of this same output folder, i.e. before a reload). Raises :class:`RenderError` naming every address that
    is taken or not bindable, :class:`NginxError` when nginx rejects the config,
    :class:`procs.StartError` when the nginx (or openresty) binary is missing."""
    wanted = []
    metrics = settings.edge.metrics_listen.strip()
    if metrics:
        wanted.append((metrics, "edge.metrics_listen (infergate-http.conf)", "/metrics"))
    wanted.append((rendered.listen, "the standalone listen (nginx.conf; edge.listen or --listen)",
                   "/infergate/status"))
    notes, problems = [], []
    for value, what, path in wanted:
        found = check_listen(value, what, path, rendered.out_dir)
        if found:
            (notes if found[0] == "note" else problems).append(found[1])
    problems += lua_file_problems(settings, rendered.lua_dir)
    if problems:
        raise RenderError("\n".join(problems))
    nginx_test(rendered.nginx_conf, rendered.prefix,
               nginx_bin=nginx_bin or nginx_binary(rendered.openresty))
    return notes


def _files_now(out: Path) -> dict[Path, tuple[bytes, int] | None]:
    """What :func:`render_nginx` would replace in ``out``: each file's bytes and mode, or
    ``None`` when it is not there. Raises :class:`click.ClickException` when one cannot
    be read."""
    now: dict[Path, tuple[bytes, int] | None] = {}
    for name in (*TEMPLATES.values(), HOP_ID_FILE):
        path = out / name
        try:
            now[path] = (path.read_bytes(), path.stat().st_mode & 0o7777)
        except FileNotFoundError:
            now[path] = None
        except OSError as exc:
            raise click.ClickException(f"cannot read {path}: {exc}") from None
    return now


def _put_back(before: dict[Path, tuple[bytes, int] | None]) -> str:
    """Put the files of ``before`` (:func:`_files_now`) back as they were after a failed
    ``--check``, so that a render into the live include folder never leaves a config that
    failed it for the next reload; says what it did (one line)."""
    try:
        for path, was in before.items():
            if was is None:
                path.unlink(missing_ok=True)
            else:
                filewrite.replace_file(path, was[0], was[1])
    except OSError as exc:
        return f"the new files stay in place: putting the previous ones back failed: {exc}"
    if all(was is None for was in before.values()):
        return "nothing was left in the --out folder"
    return "the files in the --out folder were put back as they were before this render"


@click.command("render-nginx")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (defaults apply without one).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write infergate-http.conf, infergate-server.conf and nginx.conf into.")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Address of the standalone server [default: edge.listen].")
@click.option("--prefix", default=None, type=click.Path(file_okay=False),
              help="Folder for pid, logs/ and temp files of the standalone config (and of "
                   "--check); never the --out folder [default: /var/lib/infergate/nginx as "
                   "root, else ~/.local/state/infergate/nginx].")
@click.option("--openresty", is_flag=True, default=False,
              help="Render for OpenResty (modules built in: no load_module lines).")
@click.option("--modules-dir", default=None, metavar="DIR",
              help="Folder of ndk_http_module.so and ngx_http_lua_module.so [default: Debian's].")
@click.option("--lua-dir", default=None, type=click.Path(file_okay=False),
              help="Folder holding infergate/*.lua, read by nginx at each start and reload "
                   "[default: $INFERGATE_HOME/lua; without it, the lua/ folder beside the "
                   "installed package: /opt/infergate/lua after .ci/install-runtime, the "
                   "checkout's own from a clone].")
@click.option("--resolver", default=None, metavar="ADDR",
              help="DNS server for a Redis host name [default: from /etc/resolv.conf].")
@click.option("--check", is_flag=True, default=False,
              help="After writing: bind every listen address the config names (fails on "
                   "one in use), look for the Lua files the init blocks load (nginx -t "
                   "does not), then nginx -t (openresty -t with --openresty) on the "
                   "standalone config; when a check fails, the files of --out are put "
                   "back as they were.")
def render_nginx_cmd(config_path: str | None, out_dir: str, listen: str | None, prefix: str | None,
                     openresty: bool, modules_dir: str | None, lua_dir: str | None,
                     resolver: str | None, check: bool) -> None:
    """Render the nginx configuration of the infergate edge from the TOML settings."""
    pre = Path(prefix) if prefix else default_prefix()
    if pre.resolve() == Path(out_dir).resolve():
        raise click.ClickException("--prefix must not be the --out folder: pid, logs and temp "
                                   "files stay apart from the configuration")
    if check and openresty:
        try:
            nginx_binary(True)  # before writing anything: say so in one line
        except procs.StartError as exc:
            raise click.ClickException(str(exc)) from None
    before = _files_now(Path(out_dir)) if check else {}
    try:
        settings = load_settings(config_path)
        rendered = render_nginx(settings, out_dir, listen=listen, prefix=pre,
                                openresty=openresty, modules_dir=modules_dir, lua_dir=lua_dir,
                                resolver=resolver,
                                source=str(Path(config_path).absolute()) if config_path
                                else "default settings")
    except (ConfigError, RenderError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write the configuration: {exc}") from None
    for w in rendered.warnings:
        click.echo(f"warning: {w}", err=True)
    for p in (rendered.http_conf, rendered.server_conf, rendered.nginx_conf):
        click.echo(str(p))
    if check:
        try:
            notes = check_rendered(settings, rendered)
        except (RenderError, NginxError, procs.StartError) as exc:
            kept = _put_back(before)
            raise click.ClickException(f"{exc}\n{kept}") from None
        for n in notes:
            click.echo(f"note: {n}", err=True)
        click.echo(f"listen addresses free, {'openresty' if openresty else 'nginx'} -t: ok "
                   f"(prefix {rendered.prefix})", err=True)
