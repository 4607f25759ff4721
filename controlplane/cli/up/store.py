"""The stack's Redis: its own ``redis-server`` on a free port, or the one named on
purpose (started there when nothing answers at a local address)."""

from __future__ import annotations

import secrets
import tomllib
from pathlib import Path
from urllib.parse import unquote, urlsplit

import click
import redis as redis_lib

from controlplane import procs
from controlplane.config import Settings
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.localcluster import start_local_cluster
from controlplane.redisdb.url import redact

from .common import LOCAL_HOSTS, _say


def _redis_answers(settings: Settings) -> bool:
    """Whether a Redis answers at ``settings.redis.url``. Raises
    :class:`click.ClickException` when one answers but refuses this stack (a wrong or
    missing password, an ACL user without the rights) or is still loading its data: a
    Redis is there, so none is started in its place."""
    shown = redact(settings.redis.url)
    try:
        return bool(make_redis(settings.redis).ping())
    except (redis_lib.AuthenticationError, redis_lib.ResponseError) as exc:
        raise click.ClickException(
            f"the Redis at {shown} refuses this stack: {exc} (check the user and password "
            "in the URL: redis://:PASSWORD@host:port/db)") from None
    except redis_lib.BusyLoadingError:
        raise click.ClickException(f"the Redis at {shown} is still loading its data; "
                                   "start again when it answers") from None
    except redis_lib.RedisError:
        return False


def _earlier_own_redis(workdir: Path) -> tuple[int, str] | None:
    """The port and password of the Redis an earlier run on ``workdir`` started for
    itself: the URL its ``infergate.toml`` names, when that is 127.0.0.1 with the
    password of ``workdir/redis/redis.conf`` (a Redis named on purpose is not this
    folder's own). None otherwise."""
    try:
        with open(workdir / "infergate.toml", "rb") as f:
            url = tomllib.load(f).get("redis", {}).get("url")
        conf = (workdir / "redis" / "redis.conf").read_text(encoding="utf-8")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(url, str):
        return None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    password = unquote(parts.password) if parts.password else None
    if parts.scheme != "redis" or parts.hostname != "127.0.0.1" or not port or not password:
        return None
    if f"requirepass {password}\n" not in conf:
        return None
    return port, password


def _own_redis(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Start this stack's own ``redis-server`` (append-only file in ``workdir/redis``) on
    a free loopback port, chosen again when another process takes it first, with a new
    random password (``requirepass``: on a shared host another user's process could
    otherwise read the stored prompts and answers, or write API keys and nodes); point
    ``settings.redis.url`` at it, password included, and return the banner description.
    A start on a folder an earlier run left takes that run's port and password again
    while the port is free, so a URL exported from its banner stays good.
    Never joins a Redis that already runs (e.g. another stack's at 6379). Raises
    :class:`controlplane.procs.StartError`."""
    _say("starting redis-server (this stack's own, on a free port, with a password)")
    m = None
    earlier = _earlier_own_redis(workdir)
    if earlier is not None and not procs.port_open("127.0.0.1", earlier[0]):
        port, password = earlier
        try:
            m = procs.start_redis(workdir / "redis", port, persistent=True, password=password)
        except procs.StartError:
            m = None    # taken meanwhile: a free port
    if m is None:
        password = secrets.token_urlsafe(24)
        m, port = procs.start_redis_free_port(workdir / "redis", persistent=True,
                                              password=password)
    stack.add(m)
    settings.redis.url = f"redis://default:{password}@127.0.0.1:{port}/0"
    return (f"{settings.redis.url} (this stack's own redis-server, password required, "
            f"maxmemory 256mb, volatile-lru, append-only file in {workdir / 'redis'})")


def _own_cluster(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Start this stack's own Redis Cluster (``--redis-cluster``, a demo of the cluster
    support): 3 masters + 3 replicas of ``redis-server`` on free loopback ports, with a
    new random password, append-only files under ``workdir/redis-cluster``
    (:func:`controlplane.redisdb.localcluster.start_local_cluster`); point
    ``settings.redis.url`` at it and return the banner description. A node that dies is
    restarted like the stack's other parts, on its port and from its files (it comes
    back before ``cluster-node-timeout`` runs out, so its replica is not promoted); a
    node that hangs is failed over by its replica. Raises
    :class:`controlplane.procs.StartError`."""
    _say("starting a Redis Cluster (3 masters + 3 replicas, this stack's own, with a password)")
    cluster = start_local_cluster(workdir / "redis-cluster", persistent=True,
                                  password=secrets.token_urlsafe(24))
    for n in cluster.nodes:
        stack.add(n.managed)
    settings.redis.url = cluster.url
    ports = ",".join(str(p) for p in cluster.ports)
    return (f"Redis Cluster on 127.0.0.1 ports {ports} (this stack's own, password required, "
            f"3 masters + 3 replicas, volatile-lru, append-only files in "
            f"{workdir / 'redis-cluster'})")


def _ensure_redis(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Return a description of the Redis at ``settings.redis.url`` (named explicitly);
    start one there if nothing answers and it is a local address, with the URL's password
    (``redis://:PASSWORD@127.0.0.1:PORT/0``) when it has one. Raises
    :class:`click.ClickException` when it cannot start one (not local, an ACL user, the
    port taken)."""
    if _redis_answers(settings):
        return f"{settings.redis.url} (already running)"
    parts = urlsplit(settings.redis.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    shown = redact(settings.redis.url)
    if parts.scheme != "redis" or host not in LOCAL_HOSTS:
        raise click.ClickException(f"no Redis answers at {shown} and it is not a local "
                                   "redis:// address infergate could start one on")
    user, pw = parts.username, parts.password
    if pw is None and user:
        user, pw = None, user    # redis://PASSWORD@host: a password, as redis-py reads it
    password = unquote(pw) if pw else None
    if user and unquote(user) != "default":
        raise click.ClickException(
            f"no Redis answers at {shown}; infergate starts a local Redis only for the "
            "default user (redis://:PASSWORD@host:port/db), not for the ACL user "
            f"{unquote(user)!r}")
    if procs.port_open("127.0.0.1", port):
        raise click.ClickException(f"port {port} is taken by something that is not Redis")
    _say(f"starting redis-server on 127.0.0.1:{port} (no Redis answers at {shown})")
    try:
        stack.add(procs.start_redis(workdir / "redis", port, persistent=True, password=password))
    except ValueError as exc:  # a password redis.conf cannot hold
        raise click.ClickException(f"no Redis answers at {shown}; cannot start one: {exc}") from None
    if password is None:
        _say(f"warning: this redis-server on port {port} has no password: any local user can "
             "read the cached prompts and answers and write API keys; put one in the URL "
             "(redis://:PASSWORD@127.0.0.1:PORT/0) to require it")
        access = "no password"
    else:
        access = "password from the URL required"
    return (f"{shown} (local redis-server started, {access}, maxmemory 256mb, volatile-lru, "
            f"append-only file in {workdir / 'redis'})")
