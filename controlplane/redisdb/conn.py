"""Redis clients built from the ``[redis]`` settings: ``redis://``, ``rediss://`` (TLS,
verification and client certificate from ``redis.tls_*``), a password, a database
number, and Redis Sentinel (``redis+sentinel://``; forms in :mod:`controlplane.redisdb.url`).

- :func:`make_redis` -- the client every part uses (short timeouts; str responses unless
  asked otherwise).
- :func:`connection_kwargs` -- the ``redis.Redis`` keyword arguments of the TLS options.

With ``redis+cluster://`` the client is a ``redis.RedisCluster`` (redis-py,
``redis.cluster``) started from the URL's seed nodes: it learns the slot map, sends each
command to the master of its key's slot, follows ``MOVED``/``ASK`` and re-reads the map
after a failover. Its command methods are those of ``redis.Redis``; commands that touch
several keys need them in one slot (infergate's key names carry hash tags for that,
:mod:`controlplane.redisdb.keynames`).

With Sentinel the client comes from ``redis.sentinel.Sentinel(...).master_for(service)``
(redis-py, ``redis.sentinel`` module): every new connection asks the sentinels for the
current master, and a connection to a master that was demoted (``READONLY``) or went away
is dropped, so after a failover the next command (or its one retry) reaches the new
master. A master that is still up and still believes it is the master (a failover forced
with ``SENTINEL FAILOVER``, a network partition) gives neither error until the sentinels
reconfigure it, up to 10 s later; so the pool also asks the sentinels every
``redis.sentinel_refresh_s`` and drops its idle connections when the answer changed.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from controlplane.config import RedisSettings
from controlplane.redisdb.url import RedisTarget, parse_redis_url, without_userinfo


class RefreshingSentinelPool(SentinelConnectionPool):
    """A master pool that asks the sentinels for the master at most every ``refresh_s``
    seconds before handing out a connection (redis-py's pool asks only when it opens a
    connection). Sentinels that do not answer leave the pool as it is."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        self.refresh_s = float(kwargs.pop("refresh_s", 5.0))
        self._checked = time.monotonic()
        super().__init__(service_name, sentinel_manager, **kwargs)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self._checked >= self.refresh_s:
            self._checked = now
            try:
                self.get_master_address()  # drops idle connections when the master moved
            except (redis.ConnectionError, redis.TimeoutError):
                pass
        return super().get_connection(*args, **kwargs)


def connection_kwargs(settings: RedisSettings, target: RedisTarget | None = None) -> dict[str, Any]:
    """TLS keyword arguments of ``redis.Redis.from_url`` for a ``rediss://`` target (else
    ``{}``; the scheme itself selects redis-py's ``SSLConnection``).

    ``ssl_cert_reqs`` is ``"required"`` with ``tls_verify`` (plus host-name checking),
    ``"none"`` without; ``ssl_ca_certs`` is ``tls_ca_file`` (``None`` = the system store);
    ``ssl_certfile``/``ssl_keyfile`` the client certificate, when configured."""
    target = target or parse_redis_url(settings.url)
    if not target.tls:
        return {}
    kw: dict[str, Any] = {
        "ssl_cert_reqs": "required" if settings.tls_verify else "none",
        "ssl_check_hostname": bool(settings.tls_verify),
    }
    if settings.tls_ca_file:
        kw["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        kw["ssl_certfile"] = settings.tls_cert_file
        kw["ssl_keyfile"] = settings.tls_key_file
    return kw


def make_redis(settings: RedisSettings, *, url: str | None = None,
               decode_responses: bool = True, socket_timeout_s: float | None = None,
               connect_timeout_s: float | None = None, retry: Any = None,
               health_check_interval: int = 10) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (default ``settings.url``) with the TLS and Sentinel
    options of ``settings``.

    Timeouts default to ``settings.socket_timeout_s`` (seconds); ``retry`` is a
    ``redis.retry.Retry`` (``None`` = one immediate retry: redis-py 6+'s own default
    backs off over several seconds, which would stall a command line or a poll cycle
    while Redis is down). Never does I/O here: commands
    raise ``redis.exceptions.ConnectionError``/``TimeoutError`` while the server (or, with
    Sentinel, every sentinel) is unreachable, and ``redis.sentinel.MasterNotFoundError``
    (a ``ConnectionError``) when no sentinel names a master. Raises
    :class:`controlplane.redisdb.url.RedisURLError` for a URL of no known form."""
    url = url or settings.url
    target = parse_redis_url(url)
    timeout = settings.socket_timeout_s if socket_timeout_s is None else socket_timeout_s
    ctimeout = timeout if connect_timeout_s is None else connect_timeout_s
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": ctimeout,
        "decode_responses": decode_responses,
        "health_check_interval": health_check_interval,
    }
    common["retry"] = retry if retry is not None else Retry(NoBackoff(), 1)
    if target.kind == "cluster":
        return _make_cluster(settings, target, common, retry)  # type: ignore[return-value]
    if target.kind == "direct":
        # the credentials as parse_redis_url reads them (redis://PASSWORD@host is a
        # password, as for the edge), not as redis-py's own URL parser, which would read a
        # user name there and let the URL's user info override these arguments
        return redis.Redis.from_url(without_userinfo(url), username=target.username,
                                    password=target.password, **common,
                                    **connection_kwargs(settings, target))
    # a sentinel that does not answer is skipped for the next one at once (redis-py's
    # default retries with backoff would spend seconds on each one that is down)
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": ctimeout,
                                       "retry": Retry(NoBackoff(), 0)}
    if settings.sentinel_password:
        sentinel_kwargs["password"] = settings.sentinel_password
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(target.service, redis_class=redis.Redis,
                               connection_pool_class=RefreshingSentinelPool,
                               refresh_s=settings.sentinel_refresh_s, db=target.db,
                               username=target.username, password=target.password, **common)


def _make_cluster(settings: RedisSettings, target: RedisTarget,
                  common: dict[str, Any], retry: Any) -> RedisCluster:
    """A ``redis.RedisCluster`` from the seed nodes of ``target`` (no I/O until the first
    command: the slot map is read then, from the first seed that answers). A command that
    meets a failover (``ConnectionError``, ``CLUSTERDOWN``, ``TRYAGAIN``) is retried on a
    fresh slot map with a short back-off, about 3.2 s in all (redis-py's
    ``ExponentialBackoff``: 0.1 s per retry, 32 retries): longer than a promotion
    (``cluster-node-timeout`` + 0.7 to 1.8 s measured, see docs/operations.md), so that
    a command in flight when a master dies rides the failover out instead of failing
    its caller's cycle, and in short steps, so that it reaches the promoted replica at
    most 0.1 s after it took over; unless ``retry`` says otherwise."""
    kw = dict(common)
    kw.pop("health_check_interval", None)
    kw["retry"] = retry if retry is not None else Retry(ExponentialBackoff(cap=0.1, base=0.05), 32)
    if target.tls:
        kw.update(connection_kwargs(settings, target))
        kw["ssl"] = True
    nodes = [ClusterNode(h, p) for h, p in target.nodes]
    return RedisCluster(startup_nodes=nodes, username=target.username,
                        password=target.password, require_full_coverage=False, **kw)


#: Words of Redis's refusals of a connection's credentials: WRONGPASS / NOAUTH replies,
#: redis-py's AuthenticationError ("invalid username-password pair ..."), and the reply
#: to HELLO without AUTH when the server requires a password ("HELLO must be called with
#: the client already authenticated ..."; Redis 6+, src/networking.c).
_AUTH_WORDS = ("wrongpass", "noauth", "invalid username-password", "authentication required",
               "hello must be called with the client already authenticated",
               "invalid password", "user is disabled")


def refused_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing the URL's user or password (it answers, but not
    to these credentials), rather than Redis not answering."""
    import redis as redis_lib

    if isinstance(exc, redis_lib.AuthenticationError):
        return True
    text = str(exc).lower()
    return isinstance(exc, redis_lib.RedisError) and any(w in text for w in _AUTH_WORDS)


def describe_error(exc: BaseException) -> str:
    """One sentence on a Redis error for an operator: a refused password names the fix
    (the ``[redis] url`` password, then the parts that read it restarted); anything else
    is "cannot reach Redis" with redis-py's text."""
    text = str(exc).rstrip(". ")
    if refused_credentials(exc):
        return (f"Redis answers but refuses this deployment's user or password ({text}): "
                "set the password Redis now requires (requirepass, or its ACL user) in "
                "[redis] url, then restart the control plane and the embedder and render "
                "nginx's config again (docs/operations.md, \"Fault behaviour\")")
    return f"cannot reach Redis: {text}"
