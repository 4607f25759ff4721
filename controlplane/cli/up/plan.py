"""The plan of one ``infergate up``: its options and settings checked before anything
starts, and what the run has started so far (:class:`UpRun`)."""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import click
import redis as redis_lib

from controlplane import portholder, procs
from controlplane.admin import SECRET_ENV
from controlplane.config import ConfigError, NodeSettings, Settings, load_settings
from controlplane.redisdb.url import parse_redis_url, redact

from .common import _say, _split_hostport
from .nodes import _real_nodes
from .owner import _lock_workdir, _owner_doc


@dataclass
class UpRun:
    """One ``infergate up``: the options it was given, its settings (changed as parts
    start: ports moved, the Redis URL of its own Redis), and the parts it started."""

    settings: Settings
    config_path: str | None
    node_urls: tuple[str, ...]
    node_kind: str
    node_health_path: str | None
    node_max_concurrency: int | None
    time_scale: float
    take_over: bool
    instance: str
    #: a Redis named on purpose (``--redis-url``, the file, the environment), and by what
    shared_redis: bool
    redis_named_by: str
    edge_host: str
    edge_port: int
    admin_host: str
    admin_port: int
    generated_token: bool
    #: the admin token of an earlier run on the same folder, kept (:func:`_keep_admin_token`)
    token_kept: bool = False
    #: the key the control plane signs admin sessions with (:func:`admin_secret_key`;
    #: None: ``INFERGATE_ADMIN_SECRET_KEY`` of the environment, inherited)
    admin_secret: str | None = None
    wd: Path = field(default_factory=Path)
    wd_lock: object = None  # held (and the folder locked) while up runs
    #: the work folder is a temp dir this run made (no ``--workdir``)
    wd_made: bool = False
    stack: procs.ProcessSet = field(default_factory=procs.ProcessSet)
    stop: threading.Event = field(default_factory=threading.Event)
    hurry: threading.Event = field(default_factory=threading.Event)
    owner_doc: str = ""
    owner_r: redis_lib.Redis | None = None
    cp: procs.Managed | None = None
    cp_watch: procs.HangWatch | None = None
    admin_probe: str = ""
    cfg: Path = field(default_factory=Path)
    redis_desc: str = ""
    #: ``--redis-cluster``: this stack's own loopback Redis Cluster instead of one Redis
    redis_cluster: bool = False
    #: ``--log-max-mb``: cap of each log file, MiB (0: none; controlplane.cli.up.logs)
    log_max_mb: int = 0
    #: the ``--node`` servers (checked with the options), then the stack's nodes
    nodes: list[NodeSettings] = field(default_factory=list)
    #: the nodes are this stack's simulated pool (no ``--node``, no ``[[nodes]]`` in the file)
    simulated: bool = False
    #: every part started and the banner printed
    up: bool = False
    #: every registered node after the seeding, with its state (the banner's list)
    registered: list[tuple[NodeSettings, str]] = field(default_factory=list)
    demo_key: str | None = None
    semantic_desc: str = ""
    metrics_desc: str = "off"
    metrics_moved: bool = False


def _load(config_path: str | None) -> Settings:
    """The file's settings with the stack's defaults: API keys required unless the file
    sets ``auth.mode``, the response cache on unless it sets ``cache.enabled``."""
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if "mode" not in settings.auth.model_fields_set:
        settings.auth.mode = "required"  # the stack runs with API keys unless the file says "off"
    if "enabled" not in settings.cache.model_fields_set:
        settings.cache.enabled = True  # the stack caches answers unless the file sets it
    return settings


def _redis_named_by(redis_url: str | None, settings: Settings,
                    config_path: str | None) -> tuple[bool, str]:
    """(whether the Redis was named on purpose and is shared, what names it:
    ``--redis-url``, ``INFERGATE_REDIS_URL``, the file's ``redis.url``)."""
    # Only a Redis named on purpose (--redis-url, the file's redis.url, INFERGATE_REDIS_URL)
    # is shared; otherwise the stack runs its own and never joins another's at 6379.
    shared_redis = bool(redis_url) or "url" in settings.redis.model_fields_set
    if redis_url:
        named_by = "--redis-url"
    elif os.environ.get("INFERGATE_REDIS_URL"):
        named_by = "INFERGATE_REDIS_URL (unset it: the banner's export line sets it)"
    else:
        named_by = f"redis.url in {config_path}" if config_path else "redis.url"
    return shared_redis, named_by


def _by(port: int) -> str:
    """`` by pid N (name)`` of the process listening on ``port``, or ``""``."""
    who = portholder.holder(port)
    return f" by {who}" if who else ""


def _check_addresses_free(edge: tuple[str, int], admin: tuple[str, int]) -> None:
    """Raise ``click.ClickException`` naming every one of the edge and admin addresses
    that is in use."""
    taken = [f"{what} address {host}:{port} is already in use{_by(port)} (choose another "
             f"with --{option})"
             for (host, port), what, option in ((edge, "edge", "listen"),
                                                (admin, "admin", "admin-listen"))
             if procs.port_open("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)]
    if taken:
        raise click.ClickException("; ".join(taken))


def _check_redis_url(settings: Settings) -> None:
    """Raise ``click.ClickException`` when the Redis URL does not parse (an ``http://``
    URL, a bad port), before any folder is made or part started."""
    try:
        parse_redis_url(settings.redis.url)
    except ValueError as exc:
        raise click.ClickException(f"invalid Redis URL {redact(settings.redis.url)}: {exc}") \
            from None


def _make_secrets(settings: Settings) -> bool:
    """An admin token and an embedder token when the settings have none; returns whether
    the admin token was generated."""
    generated_token = False
    if not settings.controlplane.admin_token:
        settings.controlplane.admin_token = secrets.token_urlsafe(18)
        generated_token = True
    if not settings.cache.embedder_token:
        # only this stack's edge and control plane may ask its embedder (another process
        # on the host could read stored prompts, or point a question at another answer)
        settings.cache.embedder_token = secrets.token_urlsafe(24)
    return generated_token


#: ``edge.shutdown_stream_s`` of ``up`` (unless its file sets one): a stream still running
#: when the stack stops ends with an SSE error event within nginx's 10 s to finish
#: (``edge.NGINX_FINISH_S``; the edge tells a shutdown from a reload within 1 s more).
SHUTDOWN_STREAM_S = 7.0


def _defaults_in_port_range(settings: Settings) -> None:
    """With ``INFERGATE_PORT_RANGE`` set (:func:`controlplane.procs.port_range`), the
    embedder's and the edge metrics' default ports (8090, 9145) are replaced by free ports
    of the range, as every port ``up`` picks itself; ports the file names stay. Raises
    :class:`controlplane.procs.StartError` when the variable is malformed or the range
    has no free port."""
    if procs.port_range() is None:
        return
    if "embedder_url" not in settings.cache.model_fields_set:
        settings.cache.embedder_url = f"http://127.0.0.1:{procs.free_port()}"
    if "metrics_listen" not in settings.edge.model_fields_set:
        settings.edge.metrics_listen = f"127.0.0.1:{procs.free_port()}"


def make_plan(config_path: str | None, node_urls: tuple[str, ...], node_kind: str,
              node_health_path: str | None, node_max_concurrency: int | None,
              listen: str | None, admin_listen: str | None, redis_url: str | None,
              time_scale: float, take_over: bool, instance_id: str | None) -> UpRun:
    """Settings and options of ``up``, checked before anything starts: the addresses
    parse and are free, the instance id is exported to every part
    (``INFERGATE_INSTANCE_ID``), tokens exist. Raises ``click.ClickException`` or
    ``click.BadParameter``."""
    settings = _load(config_path)
    try:
        _defaults_in_port_range(settings)
    except procs.StartError as exc:
        raise click.ClickException(str(exc)) from None
    if listen:
        _split_hostport(listen, "--listen")
        settings.edge.listen = listen
    if admin_listen:
        _split_hostport(admin_listen, "--admin-listen")
        settings.controlplane.listen = admin_listen
    if "shutdown_stream_s" not in settings.edge.model_fields_set:
        settings.edge.shutdown_stream_s = SHUTDOWN_STREAM_S
    shared_redis, named_by = _redis_named_by(redis_url, settings, config_path)
    if redis_url:
        settings.redis.url = redis_url
    _check_redis_url(settings)
    given = _real_nodes(node_urls, node_kind, node_health_path, node_max_concurrency)
    instance = instance_id or f"up-{secrets.token_hex(6)}"
    os.environ[procs.INSTANCE_ENV] = instance  # every part inherits it and echoes it
    edge = _split_hostport(settings.edge.listen, "edge.listen")
    admin = _split_hostport(settings.controlplane.listen, "controlplane.listen")
    _check_addresses_free(edge, admin)
    generated_token = _make_secrets(settings)
    return UpRun(settings=settings, config_path=config_path, node_urls=node_urls,
                 node_kind=node_kind, node_health_path=node_health_path,
                 node_max_concurrency=node_max_concurrency, time_scale=time_scale,
                 take_over=take_over, instance=instance, shared_redis=shared_redis,
                 redis_named_by=named_by, edge_host=edge[0], edge_port=edge[1],
                 admin_host=admin[0], admin_port=admin[1], generated_token=generated_token,
                 owner_doc=_owner_doc(instance), nodes=given)


def open_workdir(run: UpRun, workdir: str | None) -> None:
    """The work folder (``workdir`` or a new temp dir), created and locked for this run
    (:func:`_lock_workdir`)."""
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="infergate-up-"))
    wd.mkdir(parents=True, exist_ok=True)
    run.wd_lock = _lock_workdir(wd)
    run.wd = wd
    run.wd_made = not workdir
    _say(f"infergate up: logs and config in {wd}")
    os.chmod(wd, 0o755)  # nginx workers (``nobody`` when started as root) traverse it
    if run.generated_token:
        _keep_admin_token(run, wd / "infergate.toml")
    if not os.environ.get(SECRET_ENV):
        run.admin_secret = admin_secret_key(wd)


#: The file of the work folder that holds the key admin sessions are signed with.
ADMIN_SECRET_FILE = "admin-secret.key"


def admin_secret_key(wd: Path) -> str:
    """The key the control plane signs admin sessions with, made once per work folder
    (64 hex digits from :mod:`secrets`) and kept in ``wd/admin-secret.key`` (mode 0600, as
    the admin token and the Redis password), so a control plane restarted by ``up``, or a
    start on the same folder, keeps every login and submitted form valid. A file that
    is not a usable key (empty, cut short) is made anew; one others may read is made
    the owner's only. Raises ``click.ClickException`` when the file cannot be read or
    written."""
    path = wd / ADMIN_SECRET_FILE
    try:
        try:
            key = path.read_text(encoding="ascii").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            key = ""
        if len(key) >= 32 and key.isprintable() and not any(c.isspace() for c in key):
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return key
        key = secrets.token_hex(32)
        tmp = path.with_name(f".{ADMIN_SECRET_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
        return key
    except OSError as exc:
        raise click.ClickException(f"cannot keep the admin session key in {path}: "
                                   f"{exc.strerror or exc}") from None


def _keep_admin_token(run: UpRun, earlier: Path) -> None:
    """On a folder an earlier run left, the admin token it generated stays (a bookmarked
    admin page, a script with the token keep working); a token from the file or the
    environment always wins."""
    try:
        token = load_settings(str(earlier)).controlplane.admin_token if earlier.is_file() else ""
    except (ConfigError, OSError):
        return
    if token:
        run.settings.controlplane.admin_token = token
        run.generated_token = False
        run.token_kept = True
