"""The forms of ``redis.url`` infergate understands, parsed without any I/O.

- ``redis://[[user]:password@]host[:port][/db]`` -- plain TCP (port 6379, db 0 by default).
- ``rediss://...`` -- the same over TLS. Verification and client certificates come from
  ``[redis] tls_*`` (:class:`controlplane.config.RedisSettings`).
- ``redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2]...]/<service>[/db]``
  -- Redis Sentinel: the listed sentinels (port 26379 by default) are asked
  ``SENTINEL get-master-addr-by-name <service>`` and every command goes to the master they
  name. The password (and user) in the URL are those of the Redis servers; a password of
  the sentinels themselves is ``redis.sentinel_password``. TLS together with Sentinel is
  not supported (``rediss+sentinel://`` is refused).
- ``redis+cluster://[[user]:password@]host1[:port1][,host2[:port2]...][/0]`` -- Redis
  Cluster: the listed nodes (port 6379 by default; any few of them, masters or replicas)
  are seeds from which the slot map is learnt (``CLUSTER SLOTS`` / ``CLUSTER SHARDS``);
  each command then goes to the master of its key's slot. The password (and user) are
  those of every node. A cluster has only database 0: a path other than ``/`` or ``/0``
  is refused. ``rediss+cluster://...`` is the same over TLS (``[redis] tls_*``).

Credentials are percent-decoded (``p%40ss`` -> ``p@ss``). A query string is allowed and
ignored here (redis-py reads some of its parameters on the Python side of plain URLs).
The edge's Lua client (``lua/infergate/redis/client.lua``) accepts exactly the same forms.

Errors: :func:`parse_redis_url` raises :class:`RedisURLError` (a ``ValueError``) whose
message names what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

from controlplane.errors import InfergateError

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
SCHEMES = ("redis", "rediss", "redis+sentinel", "redis+cluster", "rediss+cluster")
_SERVICE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}\Z")
_HOSTPORT_RE = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]/]+))(?::(?P<port>\d*))?\Z")


class RedisURLError(InfergateError, ValueError):
    """``redis.url`` is not one of the forms in :mod:`controlplane.redisdb.url`."""


@dataclass(frozen=True)
class RedisTarget:
    """What a ``redis.url`` names.

    ``kind`` ``"direct"``: one server at ``host``:``port``. ``"sentinel"``: the master of
    ``service`` as named by ``sentinels`` (``(host, port)`` pairs). ``"cluster"``: a Redis
    Cluster found from the seed nodes ``nodes`` (``(host, port)`` pairs). ``tls``: the
    connections (direct or cluster) use TLS. ``db``: database number (``SELECT``; always 0
    on a cluster)."""

    kind: Literal["direct", "sentinel", "cluster"]
    tls: bool = False
    host: str | None = None
    port: int | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    nodes: tuple[tuple[str, int], ...] = ()
    db: int = 0
    username: str | None = None
    password: str | None = None

    def describe(self) -> str:
        """The target without credentials, for logs (``redis+sentinel://a:26379/mymaster/0``)."""
        if self.kind == "sentinel":
            hosts = ",".join(_fmt_host(h, p) for h, p in self.sentinels)
            return f"redis+sentinel://{hosts}/{self.service}/{self.db}"
        if self.kind == "cluster":
            hosts = ",".join(_fmt_host(h, p) for h, p in self.nodes)
            return f"{'rediss' if self.tls else 'redis'}+cluster://{hosts}"
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{_fmt_host(self.host or '', self.port or DEFAULT_PORT)}/{self.db}"


def _fmt_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hostport(text: str, default_port: int, url: str) -> tuple[str, int]:
    m = _HOSTPORT_RE.match(text)
    if not m:
        raise RedisURLError(f"redis url: bad host[:port] {text!r} in {redact(url)}")
    host = m.group("v6") or m.group("host") or ""
    if not host:
        raise RedisURLError(f"redis url has no host: {redact(url)}")
    port_text = m.group("port")
    port = int(port_text) if port_text else default_port
    if not 0 < port < 65536:
        raise RedisURLError(f"redis url port out of range: {redact(url)}")
    return host, port


def _split_userinfo(url: str) -> tuple[str, str, str, str] | None:
    """``(scheme, userinfo, hosts, tail)`` of a URL whose authority has user info
    (``scheme://userinfo@hosts`` + ``tail``, the path, query or fragment); else None."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, hosts = rest[:cut].rpartition("@")
    if not at or not userinfo:
        return None
    return scheme, userinfo, hosts, rest[cut:]


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs): the part
    after the user's ``:``, or the whole user info without one (``redis://secret@host``
    is a password, as in :func:`parse_redis_url`). Other text is returned as is."""
    parts = _split_userinfo(url)
    if parts is None:
        return url
    scheme, userinfo, hosts, tail = parts
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon else "***"
    return f"{scheme}://{shown}@{hosts}{tail}"


def without_userinfo(url: str) -> str:
    """``url`` with the user info of its authority (``user:password@``) taken out."""
    parts = _split_userinfo(url)
    if parts is None:
        return url
    scheme, _, hosts, tail = parts
    return f"{scheme}://{hosts}{tail}"


def parse_redis_url(url: str) -> RedisTarget:
    """Parse ``url`` (forms in the module docstring). Raises :class:`RedisURLError`."""
    if not isinstance(url, str) or not url:
        raise RedisURLError("redis url must be a non-empty string")
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", url, re.S)
    if not m:
        raise RedisURLError("redis url must look like redis://[:password@]host:port/db")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "rediss+sentinel":
        raise RedisURLError("rediss+sentinel:// is not supported: Sentinel works over plain "
                            "TCP only (no TLS); use redis+sentinel://, or rediss:// to one "
                            "server")
    if scheme not in SCHEMES:
        raise RedisURLError(f"unsupported redis url scheme {scheme!r}: use redis://, rediss://, "
                            "redis+sentinel:// or redis+cluster://")
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not at:
        hosts, userinfo = authority, ""
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        if colon:
            username, password = unquote(user) or None, unquote(pw) or None
        else:
            password = unquote(user) or None
    if not hosts:
        raise RedisURLError(f"redis url has no host: {redact(url)}")
    parts = [p for p in path.split("/")] if path else []
    if scheme == "redis+sentinel":
        sentinels = tuple(_hostport(h, DEFAULT_SENTINEL_PORT, url) for h in hosts.split(","))
        if not parts or not parts[0]:
            raise RedisURLError("redis+sentinel:// url needs the service (master) name: "
                                "redis+sentinel://host1:26379,host2:26379/mymaster[/db]")
        service = unquote(parts[0])
        if not _SERVICE_RE.match(service):
            raise RedisURLError(f"redis+sentinel:// service name {service!r}: letters, digits, "
                                "'_', '.', '-'")
        db_parts = [p for p in parts[1:] if p != ""]
        if len(db_parts) > 1:
            raise RedisURLError(f"redis+sentinel:// path must be /<service>[/<db>]: {redact(url)}")
        db = _db(db_parts[0] if db_parts else "", url)
        return RedisTarget("sentinel", sentinels=sentinels, service=service, db=db,
                           username=username, password=password)
    if scheme.endswith("+cluster"):
        nodes = tuple(_hostport(h, DEFAULT_PORT, url) for h in hosts.split(","))
        if [p for p in parts if p != ""] not in ([], ["0"]):
            raise RedisURLError(f"a Redis Cluster has only database 0: {redact(url)}")
        return RedisTarget("cluster", tls=scheme == "rediss+cluster", nodes=nodes,
                           username=username, password=password)
    if "," in hosts:
        raise RedisURLError(f"several hosts need redis+sentinel:// or redis+cluster://: "
                            f"{redact(url)}")
    host, port = _hostport(hosts, DEFAULT_PORT, url)
    db_parts = [p for p in parts if p != ""]
    if len(db_parts) > 1:
        raise RedisURLError(f"redis url path must be /<db number>: {redact(url)}")
    return RedisTarget("direct", tls=scheme == "rediss", host=host, port=port,
                       db=_db(db_parts[0] if db_parts else "", url),
                       username=username, password=password)


def _db(text: str, url: str) -> int:
    if text == "":
        return 0
    if not text.isdigit() or len(text) > 5:
        raise RedisURLError(f"redis url path must be /<db number>: {redact(url)}")
    return int(text)
