"""Which generation of the API keys each control plane's copy of the state holds, so that a
revocation can wait until no copy would bring the key back.

Every control plane keeps a copy of the key store as it last read it
(:mod:`controlplane.routing.statecopy`) and writes it back when Redis comes back without
its state. The copy is at most one poll interval old: a key revoked less than that before
Redis lost its data was active in every copy, and the write-back made it valid again,
for good. So each control plane reports the generation (``keynames.APIKEYS_GEN``) its
copy holds in ``keynames.APIKEYS_COPIES`` (:func:`report`, after each read; rewritten
when it moves and every :data:`REPORT_EVERY_S`), and a revocation waits until every
fresh report (written within :data:`FRESH_S`) is at the revocation's generation or past
it (:func:`wait_copied`): then every copy that could be written back holds it.

Without a control plane (a bare Redis, or none reporting for :data:`FRESH_S`) nothing
keeps a copy and nothing waits. All functions raise ``redis.RedisError`` when Redis
fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis

from controlplane.redisdb import keynames

#: A report older than this (s) is of a control plane that stopped: not waited for.
FRESH_S = 30.0
#: A control plane rewrites its report at least this often (s), moved or not.
REPORT_EVERY_S = 10.0
#: TTL of the reports' hash (s): gone when no control plane has written for this long.
TTL_S = 120
#: The longest a revocation waits for the copies (s).
WAIT_MAX_S = 10.0


def report(r: redis.Redis, ident: str, gen: int, every_s: float,
           now: float | None = None) -> None:
    """Record that control plane ``ident``'s copy holds the keys at generation ``gen``
    (it polls every ``every_s`` seconds)."""
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    pipe.hset(keynames.APIKEYS_COPIES, ident,
              json.dumps({"gen": int(gen), "at": round(now, 3), "every": float(every_s)}))
    pipe.expire(keynames.APIKEYS_COPIES, TTL_S)
    pipe.execute()


def withdraw(r: redis.Redis, ident: str) -> None:
    """Remove control plane ``ident``'s report (it stops: nothing waits for it)."""
    r.hdel(keynames.APIKEYS_COPIES, ident)


def fresh_reports(r: redis.Redis, now: float | None = None) -> dict[str, dict]:
    """The reports written within :data:`FRESH_S` of ``now``: control plane id ->
    ``{"gen", "at", "every"}`` (malformed ones left out)."""
    now = time.time() if now is None else now
    out = {}
    for ident, raw in r.hgetall(keynames.APIKEYS_COPIES).items():
        try:
            rep = json.loads(raw)
            gen, at, every = int(rep["gen"]), float(rep["at"]), float(rep["every"])
        except (ValueError, TypeError, KeyError):
            continue
        if now - at <= FRESH_S:
            out[ident if isinstance(ident, str) else ident.decode()] = {
                "gen": gen, "at": at, "every": every}
    return out


def current_gen(r: redis.Redis) -> int:
    """The key store's generation now (0 when never written)."""
    try:
        return int(r.get(keynames.APIKEYS_GEN) or 0)
    except (TypeError, ValueError):
        return 0


def wait_copied(r: redis.Redis, gen: int, *, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep,
                wall: Callable[[], float] = time.time) -> bool | None:
    """Wait until every fresh report holds generation ``gen`` or later: True then; None
    at once when no control plane reports a copy; False after two poll intervals and a
    second of the slowest reporter (at most :data:`WAIT_MAX_S`) without it."""
    reps = fresh_reports(r, wall())
    if not reps:
        return None
    limit = clock() + min(WAIT_MAX_S, 2 * max(rep["every"] for rep in reps.values()) + 1.0)
    while True:
        if all(rep["gen"] >= gen for rep in reps.values()):
            return True
        if clock() >= limit:
            return False
        sleep(0.05)
        reps = fresh_reports(r, wall())
        if not reps:
            return None
