"""Redis clients built from ``redis.url`` (``redis://``, ``rediss://``, password, db)."""

from __future__ import annotations

import redis

from .config import RedisSettings


def make_redis(settings: RedisSettings) -> redis.Redis:
    """A ``redis.Redis`` with short timeouts (``socket_timeout_s``) and str responses.

    Never raises at creation; commands raise ``redis.exceptions.ConnectionError`` /
    ``TimeoutError`` while the server is unreachable."""
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_timeout_s,
        decode_responses=True,
        health_check_interval=10,
    )
