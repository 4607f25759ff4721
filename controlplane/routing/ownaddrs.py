"""The addresses a running stack serves on, published in Redis, so that every writer of
the node registry refuses a node URL that points back into the stack (a node at the
edge's own port loops every request it gets back into the edge; one at the admin port
answers HTML 404s), whatever configuration the writer has: ``infergate nodes add`` run
with only ``INFERGATE_REDIS_URL`` (the banner's export line), the admin API of a
control plane with another file.

Every control plane publishes the addresses of its configuration
(:func:`of_settings`: Redis, its admin, the embedder, the edge's metrics and API
``listen``; ``infergate up`` writes the ones it really started on into the file its
control plane reads) every :data:`PUBLISH_EVERY_S`, and takes them back when it stops:
hash ``keynames.STACK_ADDRESSES``, field = the control plane's id, value JSON ``{"ts":
epoch_s, "addresses": [{"what", "host", "port"}, ...]}`` (cache kind: the hash expires
:data:`TTL_S` after the last write). A reader counts the entries newer than
:data:`FRESH_S` (:func:`published`); :func:`controlplane.admin.nodeurl.node_url_refusal`
compares a node URL against them as against its own settings' addresses.

Redis errors are raised (``redis.RedisError``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import redis

from controlplane.config import HostPort, Settings
from controlplane.redisdb import keynames

#: Seconds between two publications of a control plane.
PUBLISH_EVERY_S = 10.0
#: Age (s) past which a publication no longer counts (its control plane stopped or hangs).
FRESH_S = 60.0
#: Seconds the hash lives after the last write.
TTL_S = 600


@dataclass(frozen=True)
class OwnAddress:
    """One address of the stack: ``what`` (``Redis``, ``admin``, ``embedder``, ``edge
    metrics``, ``edge API``), ``host`` (lower case, as configured) and ``port``."""

    what: str
    host: str
    port: int


def of_settings(settings: Settings) -> list[OwnAddress]:
    """The stack's own Redis, admin, embedder, edge-metrics and edge API addresses in
    ``settings``; the ones that do not parse are left out."""
    own: list[OwnAddress] = []
    try:
        from controlplane.redisdb.url import parse_redis_url

        t = parse_redis_url(settings.redis.url)
        if t.host and t.port:
            own.append(OwnAddress("Redis", t.host.lower(), t.port))
    except ValueError:
        pass
    try:
        hp = HostPort.parse(str(settings.controlplane.listen))
        own.append(OwnAddress("admin", hp.host.lower(), hp.port))
    except ValueError:
        pass
    try:
        e = urlsplit(settings.cache.embedder_url)
        if e.hostname and e.port:
            own.append(OwnAddress("embedder", e.hostname.lower(), e.port))
    except ValueError:
        pass
    for what, listen in (("edge metrics", settings.edge.metrics_listen),
                         ("edge API", settings.edge.listen)):
        if not listen:
            continue
        try:
            hp = HostPort.parse(str(listen))
            own.append(OwnAddress(what, hp.host.lower(), hp.port))
        except ValueError:
            pass
    return own


def publish(r: redis.Redis, ident: str, addresses: list[OwnAddress],
            now: float | None = None) -> None:
    """Publish ``addresses`` under ``ident`` (a control plane's id); entries older than
    :data:`FRESH_S` are dropped on the way."""
    now = time.time() if now is None else now
    doc = json.dumps({"ts": round(now, 3), "addresses": [asdict(a) for a in addresses]})
    stale = [k for k, v in r.hgetall(keynames.STACK_ADDRESSES).items()
             if k != ident and _ts(v) < now - FRESH_S]
    pipe = r.pipeline(transaction=False)
    pipe.hset(keynames.STACK_ADDRESSES, ident, doc)
    if stale:
        pipe.hdel(keynames.STACK_ADDRESSES, *stale)
    pipe.expire(keynames.STACK_ADDRESSES, TTL_S)
    pipe.execute()


def withdraw(r: redis.Redis, ident: str) -> None:
    """Take back what ``ident`` published (a control plane that stops)."""
    r.hdel(keynames.STACK_ADDRESSES, ident)


def _ts(raw: str) -> float:
    try:
        return float(json.loads(raw).get("ts") or 0)
    except (ValueError, TypeError, AttributeError):
        return 0.0


def published(r: redis.Redis, now: float | None = None) -> list[OwnAddress]:
    """Every address of the fresh publications (:data:`FRESH_S`), without repeats;
    malformed entries are skipped."""
    now = time.time() if now is None else now
    out: list[OwnAddress] = []
    for raw in r.hgetall(keynames.STACK_ADDRESSES).values():
        if _ts(raw) < now - FRESH_S:
            continue
        try:
            for a in json.loads(raw).get("addresses") or []:
                addr = OwnAddress(str(a["what"]), str(a["host"]).lower(), int(a["port"]))
                if addr not in out:
                    out.append(addr)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out
