"""The response cache as stored in Redis: entries, their indexes, counters; stats and purge.

Layout (schema v1, see docs/internals.md "Response cache"):

- ``keynames.cache_entry(hex)`` = ``infergate:v1:cache:entry:<exact_key_hex>``: string with a
  Redis TTL, JSON ``{"tenant", "model", "namespace", "created", "ttl", "body"}``
  (``created`` epoch seconds, ``ttl`` seconds, ``body`` the response text; writers may
  add fields). ``exact_key_hex`` is the hex digest the edge computes for a request.
- ``keynames.cache_index(dim, value)`` = ``infergate:v1:cache:idx:<dim>:<value>`` for
  ``dim`` in tenant | model | namespace: set of the ``exact_key_hex`` of entries with
  that value. Members may outlive their entry (the entry expired or was evicted); readers
  treat a member without entry as gone, :func:`purge` removes such members as it meets
  them and the leader control plane's sweep (:mod:`controlplane.cache.sweep`) walks every
  set in turn and removes them.
- ``keynames.CACHE_STATS``: hash of integer counters, incremented by the edge (HINCRBY):
  ``lookups`` (requests that looked in the cache), ``hits_exact``, ``hits_semantic``,
  ``misses`` (looked, found nothing), ``bypass`` (cacheable request that skipped the
  cache: Redis/embedder down or over budget, ``no-cache``; not counted in lookups),
  ``stores`` (entries written).
- ``keynames.cache_vec(model_slug, dim, hex)`` = ``infergate:v1:cache:vec:<slug>:<dim>:<hex>``:
  the embedder's vector hash of an entry (``controlplane.embedder.index``). A purge
  deletes the vectors of the entries it deletes (:func:`purge_counts`) and announces each
  on the vector channel (``controlplane.embedder.vecchannel``), so the embedders' local
  indexes drop their rows at once.
- ``keynames.cache_ns_stats(ns)``: a namespace's figures (see :data:`NS_COUNTERS`);
  ``keynames.cache_ns_sample(ns)``: its sample question, with the TTL of its entry.

Every key of the cache carries a TTL, so Redis (``maxmemory-policy volatile-lru``) may
evict any of them under memory pressure and never a state key (API keys, nodes, drain
states, events: no TTL). Entries have their own TTL; an index set gets the longest TTL
of its entries (``EXPIRE NX`` then ``EXPIRE GT`` on every add); the stats hash
:data:`COUNTERS_TTL_S` and the semantic index queue :data:`INDEX_QUEUE_TTL_S`, renewed
by every write (the edge's ``lua/infergate/cache/capture.lua`` does the same).

Functions take a ``redis.Redis`` built with ``decode_responses=True`` and raise
``redis.exceptions.RedisError`` when Redis is unreachable. Only ``SCAN``/``SSCAN`` are used
to walk keys (never ``KEYS``), in batches, so a large cache does not block Redis.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import redis

from controlplane.embedder import vecchannel
from controlplane.embedder.bounds import wilson_upper
from controlplane.errors import InfergateError
from controlplane.redisdb import keynames

DIMENSIONS: tuple[str, ...] = ("tenant", "model", "namespace")
COUNTERS: tuple[str, ...] = ("lookups", "hits_exact", "hits_semantic", "misses", "bypass", "stores")
HEX_RE = re.compile(r"^[0-9a-f]{16,128}\Z")
MEMORY_SAMPLES = 64
#: TTL (s) of the cache counters hash, renewed by every increment (30 days).
COUNTERS_TTL_S = 30 * 86400
#: TTL (s) of the semantic index queue, renewed by every push (1 day).
INDEX_QUEUE_TTL_S = 86400


class CacheStoreError(InfergateError, ValueError):
    """Bad arguments (no purge scope, unknown counter, bad key)."""


@dataclass
class CacheStats:
    """Response-cache figures for the admin page and ``GET /api/v1/cache/stats``."""

    entries: int
    """Entry keys present now (counted with SCAN)."""
    memory_bytes: int
    """Estimated bytes held by entries: mean ``MEMORY USAGE`` of up to 64 sampled
    entries x ``entries`` (exact when entries <= 64)."""
    redis_used_memory: int | None
    """``used_memory`` of the whole Redis server (``INFO memory``), bytes."""
    lookups: int
    hits_exact: int
    hits_semantic: int
    misses: int
    bypass: int
    stores: int
    hit_rate: float | None
    """(hits_exact + hits_semantic) / lookups, 0-1; ``None`` before the first lookup."""
    hit_rate_exact: float | None
    """hits_exact / lookups, 0-1."""
    hit_rate_semantic: float | None
    """hits_semantic / lookups, 0-1."""

    def to_dict(self) -> dict:
        return asdict(self)


def _batches(it: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(it)
    while batch := list(itertools.islice(it, n)):
        yield batch


def _check_value(dim: str, value: str) -> str:
    """``value`` of dimension ``dim`` (tenant, model, namespace): printable text of at
    most 256 characters (no control, format or surrogate characters, which Redis could
    not be sent). Raises :class:`CacheStoreError`."""
    if dim not in DIMENSIONS:
        raise CacheStoreError(f"unknown cache dimension {dim!r}; expected one of {DIMENSIONS}")
    if not isinstance(value, str) or not value or len(value) > 256 or not value.isprintable():
        raise CacheStoreError(f"{dim}: a non-empty printable text of at most 256 characters")
    return value


def store(r: redis.Redis, exact_key_hex: str, *, tenant: str, model: str, namespace: str,
          body: str, ttl: int, now: float | None = None, **extra: object) -> None:
    """Write one entry (with Redis TTL ``ttl`` s) and its index memberships.

    The edge writes entries in Lua with the same layout; this is the Python writer
    (tests, tools). Raises :class:`CacheStoreError` for a bad key, dimension or ttl."""
    if not HEX_RE.match(exact_key_hex):
        raise CacheStoreError("exact key: 16 to 128 lowercase hex digits")
    if not isinstance(ttl, int) or ttl <= 0:
        raise CacheStoreError("ttl: a positive whole number of seconds")
    dims = {"tenant": tenant, "model": model, "namespace": namespace}
    for d, v in dims.items():
        _check_value(d, v)
    doc = {**extra, **dims, "created": time.time() if now is None else now, "ttl": ttl,
           "body": body}
    pipe = r.pipeline()
    pipe.set(keynames.cache_entry(exact_key_hex), json.dumps(doc), ex=ttl)
    for d, v in dims.items():
        idx = keynames.cache_index(d, v)
        pipe.sadd(idx, exact_key_hex)
        pipe.expire(idx, ttl, nx=True)  # the set lives as long as its longest-lived entry
        pipe.expire(idx, ttl, gt=True)
    pipe.hincrby(keynames.CACHE_STATS, "stores", 1)
    pipe.expire(keynames.CACHE_STATS, COUNTERS_TTL_S)
    pipe.execute()


def count(r: redis.Redis, field: str, n: int = 1) -> int:
    """Add ``n`` to counter ``field`` of ``keynames.CACHE_STATS``; returns the new value."""
    if field not in COUNTERS:
        raise CacheStoreError(f"unknown cache counter {field!r}; expected one of {COUNTERS}")
    pipe = r.pipeline()
    pipe.hincrby(keynames.CACHE_STATS, field, n)
    pipe.expire(keynames.CACHE_STATS, COUNTERS_TTL_S)
    return int(pipe.execute()[0])


def _scan_entries(r: redis.Redis) -> Iterator[str]:
    return r.scan_iter(match=keynames.CACHE_ENTRY_PREFIX + "*", count=1000)


def stats(r: redis.Redis) -> CacheStats:
    """Counters, hit rates (0-1), entry count and memory estimate (see :class:`CacheStats`)."""
    raw = r.hgetall(keynames.CACHE_STATS)
    c = {}
    for f in COUNTERS:
        try:
            c[f] = int(raw.get(f, 0))
        except (TypeError, ValueError):
            c[f] = 0
    entries = 0
    sample: list[str] = []
    for k in _scan_entries(r):
        entries += 1
        if len(sample) < MEMORY_SAMPLES:
            sample.append(k)
    memory = 0
    if sample:
        pipe = r.pipeline()
        for k in sample:
            pipe.memory_usage(k)
        sizes = [s for s in pipe.execute() if isinstance(s, int)]
        if sizes:
            memory = round(sum(sizes) / len(sizes) * entries)
    try:
        used = int(r.info("memory").get("used_memory", 0))
    except redis.exceptions.ResponseError:
        used = None
    lookups = c["lookups"]

    def rate(n: int) -> float | None:
        return round(n / lookups, 4) if lookups > 0 else None

    return CacheStats(entries=entries, memory_bytes=memory, redis_used_memory=used, **c,
                      hit_rate=rate(c["hits_exact"] + c["hits_semantic"]),
                      hit_rate_exact=rate(c["hits_exact"]),
                      hit_rate_semantic=rate(c["hits_semantic"]))


def index_values(r: redis.Redis, dimension: str, limit: int = 200) -> list[tuple[str, int]]:
    """Values seen for ``dimension`` with their member count (an upper bound: expired
    entries still count), sorted by value, at most ``limit``."""
    if dimension not in DIMENSIONS:
        raise CacheStoreError(f"unknown cache dimension {dimension!r}")
    prefix = keynames.cache_index(dimension, "")
    names = sorted(itertools.islice(r.scan_iter(match=prefix + "*", count=1000), limit))
    pipe = r.pipeline()
    for n in names:
        pipe.scard(n)
    return [(n[len(prefix):], int(c)) for n, c in zip(names, pipe.execute()) if c]


def _filters(tenant: str | None, model: str | None, namespace: str | None) -> dict[str, str]:
    given = {"tenant": tenant, "model": model, "namespace": namespace}
    return {d: _check_value(d, v) for d, v in given.items() if v is not None and v != ""}


def estimate(r: redis.Redis, *, tenant: str | None = None, model: str | None = None,
             namespace: str | None = None, all: bool = False) -> int:
    """Upper bound of what :func:`purge` with the same scope would delete (for a
    confirmation step): entry count for ``all``, else the smallest index set size."""
    if all:
        return sum(1 for _ in _scan_entries(r))
    f = _filters(tenant, model, namespace)
    if not f:
        raise CacheStoreError("purge scope: give tenant, model, namespace or all")
    pipe = r.pipeline()
    for d, v in f.items():
        pipe.scard(keynames.cache_index(d, v))
    return min(int(n) for n in pipe.execute())


@dataclass
class PurgeCount:
    """What one purge deleted."""

    entries: int
    """Cache entries (answers) deleted."""
    vectors: int
    """Semantic-index vector hashes deleted (``keynames.cache_vec(slug, dim, hex)``, of
    any embedding model and dimension)."""


def purge(r: redis.Redis, *, tenant: str | None = None, model: str | None = None,
          namespace: str | None = None, all: bool = False, batch: int = 500) -> int:
    """:func:`purge_counts` (entries **and** their vectors); returns the entries deleted."""
    return purge_counts(r, tenant=tenant, model=model, namespace=namespace, all=all,
                        batch=batch).entries


def purge_counts(r: redis.Redis, *, tenant: str | None = None, model: str | None = None,
                 namespace: str | None = None, all: bool = False,
                 batch: int = 500) -> PurgeCount:
    """Delete cache entries, their index memberships and their semantic-index vectors.

    - ``all=True``: every entry, every index set and every vector hash (counters are
      kept).
    - otherwise entries matching **all** given filters (tenant and/or model and/or
      namespace), and the vector hashes of exactly those entries (found with one
      ``SCAN`` over the vector prefix, skipped when no entry was deleted).

    A vector left behind would never be served (the embedder checks that a candidate's
    entry exists), but it would hold memory until its TTL. Raises
    :class:`CacheStoreError` when no scope is given."""
    if all:
        deleted = 0
        for b in _batches(_scan_entries(r), batch):
            deleted += int(r.unlink(*b))
        for b in _batches(r.scan_iter(match=keynames.CACHE_INDEX_PREFIX + "*", count=1000), batch):
            r.unlink(*b)
        for b in _batches(r.scan_iter(match=keynames.CACHE_NS_SAMPLE_PREFIX + "*",
                                      count=1000), batch):
            r.unlink(*b)
        ns_plen = len(keynames.CACHE_NS_STATS_PREFIX)
        _forget_samples(r, (_s(k)[ns_plen:] for k in r.scan_iter(
            match=keynames.CACHE_NS_STATS_PREFIX + "*", count=1000)), batch)
        return PurgeCount(deleted, purge_vectors(r, None, batch=batch))
    spaces: set[str] = {namespace} if namespace else set()
    keys = _purge_scoped(r, _filters(tenant, model, namespace), batch, spaces)
    _forget_samples(r, spaces, batch)
    return PurgeCount(len(keys), purge_vectors(r, keys, batch=batch) if keys else 0)


def _forget_samples(r: redis.Redis, spaces: Iterable[str], batch: int) -> None:
    """Drop the sample question of these namespaces (purged entries' questions are not
    kept; the counters stay), and the ``sample`` field earlier versions kept in the
    namespace's hash."""
    for b in _batches(spaces, batch):
        pipe = r.pipeline(transaction=False)
        for ns in b:
            pipe.delete(keynames.cache_ns_sample(ns))
            pipe.hdel(keynames.cache_ns_stats(ns), "sample")
        pipe.execute()


def purge_vectors(r: redis.Redis, exact_keys: set[str] | None, *, batch: int = 500) -> int:
    """Delete the embedder's vector hashes of the entries ``exact_keys`` (hex), of every
    model and dimension, or every vector hash when ``exact_keys`` is ``None``; returns
    how many were deleted. One ``SCAN`` over ``keynames.CACHE_VEC_PREFIX``, ``UNLINK``
    in batches (a Redis search index drops the unlinked hashes by itself), each batch
    then announced on the vector channel (:func:`vecchannel.publish_gone`: the embedders'
    in-process indexes drop those rows)."""
    n = 0
    found = (_s(k) for k in r.scan_iter(match=keynames.CACHE_VEC_PREFIX + "*", count=1000)
             if exact_keys is None or _s(k).rsplit(":", 1)[-1] in exact_keys)
    for b in _batches(found, batch):
        n += int(r.unlink(*b))
        pipe = r.pipeline(transaction=False)
        for hk in b:
            vecchannel.publish_gone(pipe, hk)
        pipe.execute()
    return n


def _mget(r: redis.Redis, keys: list[str]) -> list:
    """``MGET`` of ``keys``; on a cluster split per slot (redis-py's ``mget_nonatomic``)."""
    if isinstance(r, redis.RedisCluster):
        return r.mget_nonatomic(keys)
    return r.mget(keys)


def _s(k: str | bytes) -> str:
    return k.decode() if isinstance(k, bytes) else k


def _purge_scoped(r: redis.Redis, f: dict[str, str], batch: int,
                  spaces: set[str] | None = None) -> set[str]:
    """Delete the entries matching every filter in ``f``; returns their exact key hexes
    (and adds their namespaces to ``spaces``)."""
    if not f:
        raise CacheStoreError("purge scope: give tenant, model, namespace or all")
    pipe = r.pipeline()
    for d, v in f.items():
        pipe.scard(keynames.cache_index(d, v))
    sizes = pipe.execute()
    src_dim, src_val = min(zip(f.items(), sizes), key=lambda t: t[1])[0]
    src = keynames.cache_index(src_dim, src_val)
    deleted: set[str] = set()
    for members in _batches(r.sscan_iter(src, count=1000), batch):
        docs = _mget(r, [keynames.cache_entry(m) for m in members])
        pipe = r.pipeline()
        del_at: list[tuple[int, str]] = []  # positions of the DEL replies in the pipeline
        n_ops = 0
        for m, raw in zip(members, docs):
            if raw is None:  # expired: drop the stale memberships we know of
                for d, v in f.items():
                    pipe.srem(keynames.cache_index(d, v), m)
                n_ops += len(f)
                continue
            doc = _parse(raw)
            if doc and any(doc.get(d) != v for d, v in f.items()):
                continue  # in the scanned index but not matching every filter
            del_at.append((n_ops, m))
            if spaces is not None and isinstance(doc.get("namespace"), str) \
                    and doc["namespace"]:
                spaces.add(doc["namespace"])
            pipe.delete(keynames.cache_entry(m))
            n_ops += 1
            for d in DIMENSIONS:
                val = doc.get(d)
                if isinstance(val, str) and val:
                    pipe.srem(keynames.cache_index(d, val), m)
                    n_ops += 1
            pipe.srem(src, m)
            n_ops += 1
        res = pipe.execute()
        deleted.update(m for i, m in del_at if int(res[i]))
    return deleted


def _parse(raw: str) -> dict:
    """An entry document; ``{}`` for a corrupt one (purged when met in the scanned index)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


# ---- per-namespace figures, dropping one entry --------------------------------------

#: Integer fields of a namespace's hash ``keynames.cache_ns_stats(ns)``: hits counted by
#: the edge, ``flagged`` by operators (:func:`controlplane.admin.ops.flag_entry`),
#: ``verify_queued`` by the edge, ``verified`` / ``wrong`` / ``verify_errors`` and the
#: current evidence window ``win_verified`` / ``win_wrong`` by the online verification
#: (:mod:`controlplane.cache.verify`).
NS_COUNTERS: tuple[str, ...] = ("hits_exact", "hits_semantic", "flagged", "verify_queued",
                                "verified", "wrong", "verify_errors", "win_verified",
                                "win_wrong")
#: Namespace hashes read at most by :func:`namespace_stats` (SCAN), per call.
NS_SCAN_MAX = 10000
#: Text fields of a namespace's figures, written by the embedder when it indexes an entry
#: of the namespace (``Engine.index_items``): the requested ``model``, ``tenant``,
#: ``route``, the ``embedding_model`` whose vectors its index holds (in its hash) and a
#: ``sample`` question (its own key ``keynames.cache_ns_sample``, with the entry's TTL).
NS_DETAILS: tuple[str, ...] = ("model", "tenant", "route", "embedding_model", "sample")


@dataclass
class NamespaceStats:
    """The figures of one semantic namespace (counts since the hash was created; it
    expires :data:`COUNTERS_TTL_S` after its last write)."""

    namespace: str
    hits_exact: int
    hits_semantic: int
    flagged: int
    verify_queued: int
    verified: int
    wrong: int
    verify_errors: int
    win_verified: int
    win_wrong: int
    wrong_rate: float | None
    """wrong / verified (0-1); ``None`` before the first verdict."""
    wrong_rate_upper: float | None
    """95 % one-sided Wilson upper bound of the wrong-hit rate (0-1); ``None`` before the
    first verdict."""
    threshold_raise: float
    """How much the namespace's semantic threshold is raised above the configured one
    (0-1; ``keynames.CACHE_THRESHOLD_RAISE``)."""
    model: str = ""
    tenant: str = ""
    route: str = ""
    embedding_model: str = ""
    sample: str = ""
    """A question stored in the namespace (its first 200 characters); empty before the
    embedder indexed one."""
    wrong_hits_estimate: float | None = None
    """Semantic hits times the verified wrong-hit rate: how many of its semantic hits were
    probably wrong (None before the first verdict)."""
    wrong_hits_upper: float | None = None
    """The same with the rate's 95 % upper bound."""

    def to_dict(self) -> dict:
        return asdict(self)


def _int(v: object) -> int:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def threshold_raises(r: redis.Redis) -> dict[str, float]:
    """Namespace hex -> threshold raise (0-1) of every namespace whose threshold moved."""
    out: dict[str, float] = {}
    for ns, v in r.hgetall(keynames.CACHE_THRESHOLD_RAISE).items():
        try:
            out[_s(ns)] = max(0.0, min(1.0, float(v)))
        except (TypeError, ValueError):
            continue
    return out


def namespace_figures(namespace: str, raw: dict, raise_: float = 0.0) -> NamespaceStats:
    """:class:`NamespaceStats` from a namespace hash as read (``HGETALL``)."""
    c = {f: _int(raw.get(f, 0)) for f in NS_COUNTERS}
    n, k = c["verified"], min(c["wrong"], c["verified"])
    rate = k / n if n else None
    upper = wilson_upper(k, n) if n else None
    hits = c["hits_semantic"]
    return NamespaceStats(namespace=namespace, **c,
                          wrong_rate=round(rate, 6) if rate is not None else None,
                          wrong_rate_upper=round(upper, 6) if upper is not None else None,
                          threshold_raise=round(raise_, 6),
                          **{f: _s(raw.get(f) or "") for f in NS_DETAILS},
                          wrong_hits_estimate=round(hits * rate, 2) if rate is not None
                          else None,
                          wrong_hits_upper=round(hits * upper, 2) if upper is not None
                          else None)


def namespace_stats(r: redis.Redis, limit: int = 50) -> list[NamespaceStats]:
    """The namespaces with figures, most hits first (then most verdicts), at most
    ``limit``; at most :data:`NS_SCAN_MAX` hashes are read (SCAN)."""
    names = list(itertools.islice(
        r.scan_iter(match=keynames.CACHE_NS_STATS_PREFIX + "*", count=1000), NS_SCAN_MAX))
    raises = threshold_raises(r)
    out: list[NamespaceStats] = []
    plen = len(keynames.CACHE_NS_STATS_PREFIX)
    for b in _batches((_s(n) for n in names), 500):
        pipe = r.pipeline(transaction=False)
        for n in b:
            pipe.hgetall(n)
            pipe.get(keynames.cache_ns_sample(n[plen:]))
        res = pipe.execute()
        for i, n in enumerate(b):
            ns = n[plen:]
            raw = {_s(k): v for k, v in (res[2 * i] or {}).items()}
            raw["sample"] = res[2 * i + 1] or ""  # its own key (not a stale hash field)
            out.append(namespace_figures(ns, raw, raises.get(ns, 0.0)))
    out.sort(key=lambda s: (-(s.hits_exact + s.hits_semantic), -s.verified, s.namespace))
    return out[:limit]


def count_namespace(r: redis.Redis, namespace: str, field: str, n: int = 1) -> int:
    """Add ``n`` to ``field`` (one of :data:`NS_COUNTERS`) of the namespace's hash
    (TTL :data:`COUNTERS_TTL_S`, renewed); returns the new value. Raises
    :class:`CacheStoreError` for an unknown field or a bad namespace."""
    if field not in NS_COUNTERS:
        raise CacheStoreError(f"unknown namespace counter {field!r}; expected one of {NS_COUNTERS}")
    if not HEX_RE.match(namespace):
        raise CacheStoreError("namespace: 16 to 128 lowercase hex digits")
    key = keynames.cache_ns_stats(namespace)
    pipe = r.pipeline()
    pipe.hincrby(key, field, n)
    pipe.expire(key, COUNTERS_TTL_S)
    return int(pipe.execute()[0])


def get_entry(r: redis.Redis, exact_key_hex: str) -> dict | None:
    """The entry document of ``exact_key_hex`` (``{}`` when corrupt), or None when it is
    gone (expired, purged) or the id is not an exact key hex."""
    if not isinstance(exact_key_hex, str) or not HEX_RE.match(exact_key_hex):
        return None
    raw = r.get(keynames.cache_entry(exact_key_hex))
    if raw is None:
        return None
    return _parse(_s(raw))


def drop_entry(r: redis.Redis, exact_key_hex: str) -> dict | None:
    """Delete one entry, its index memberships and its semantic vectors (of every
    model: one ``SCAN`` over the vector prefix, see :func:`purge_vectors`), and leave the
    mark ``keynames.cache_dropped(hex)`` (its namespace, for the entry's remaining
    lifetime) so a second drop is known as one. Returns the document deleted, or None
    when the entry was already gone or this is not an exact key hex."""
    if not isinstance(exact_key_hex, str) or not HEX_RE.match(exact_key_hex):
        return None
    key = keynames.cache_entry(exact_key_hex)
    pipe = r.pipeline()
    pipe.get(key)
    pipe.pttl(key)
    raw, pttl = pipe.execute()
    if raw is None:
        purge_vectors(r, {exact_key_hex})
        return None
    doc = _parse(_s(raw))
    ns = doc.get("namespace") if isinstance(doc.get("namespace"), str) else ""
    pipe = r.pipeline()
    pipe.delete(key)
    for d in DIMENSIONS:
        val = doc.get(d)
        if isinstance(val, str) and val:
            pipe.srem(keynames.cache_index(d, val), exact_key_hex)
    pipe.set(keynames.cache_dropped(exact_key_hex), ns or "-",
             px=int(pttl) if isinstance(pttl, int) and pttl > 0 else INDEX_QUEUE_TTL_S * 1000)
    deleted = int(pipe.execute()[0])
    purge_vectors(r, {exact_key_hex})
    return doc if deleted else None


def dropped_namespace(r: redis.Redis, exact_key_hex: str) -> str | None:
    """The namespace of an entry :func:`drop_entry` dropped (``""`` when it had none), or
    None when no mark is left."""
    if not isinstance(exact_key_hex, str) or not HEX_RE.match(exact_key_hex):
        return None
    v = r.get(keynames.cache_dropped(exact_key_hex))
    if v is None:
        return None
    v = _s(v)
    return "" if v == "-" else v
