"""The semantic index: one vector per cache entry, searched inside a namespace.

Storage (both backends): one Redis hash per entry at
``keynames.cache_vec(model_slug, dim, exact_key)`` = ``infergate:v1:cache:vec:<slug>:<dim>:<key>``
with fields ``namespace`` (hex), ``key`` (hex), ``text`` (the last user message, at most
4000 characters), ``model``, ``tenant``, ``vec`` (``dim`` float32, little endian, L2-normalised)
and a TTL equal to the entry's remaining TTL: the job's ``ttl_s``, lowered to the entry's
own ``PTTL`` when the entry exists, and then set as it is (an entry stored again with a
new TTL takes its vector along: a paraphrase hits as long as the entry lives); when the
entry is not there, applied with ``PEXPIRE ... LT``, so a late job never extends a
vector. Model slug and dimension are part of the key, so two models never mix.

Search backends:

- :class:`RedisSearchIndex` (``redis-search``): ``FT.CREATE`` HNSW cosine index over the hash
  prefix, queried with ``FT.SEARCH idx "(@namespace:{ns})=>[KNN k @vec $v AS dist]"``.
  Needs the Redis search module (``FT._LIST`` answers). Expired hashes leave the index
  with the key.
- :class:`LocalIndex` (``local``): exact search in process, one numpy matrix per
  namespace, loaded from Redis at start (``SCAN`` over the prefix), kept current by the
  embedder's own writes and by the pub/sub channel ``keynames.CACHE_VEC_CHANNEL`` (vectors
  stored by other embedder processes, vectors deleted by a purge:
  :mod:`controlplane.embedder.vecchannel`). Bounded: at most ``max_rows`` rows
  (``cache.semantic_index_max_rows``); rows past their TTL leave it in any namespace, and
  rows whose vector hash left Redis (purged, evicted) within about a minute
  (:mod:`controlplane.embedder.rows`, :class:`LocalIndex`).

Either way the service checks that the cache entry of a candidate still exists before
answering with it (an entry purged or expired is never a hit).

Both take a ``redis.Redis`` built with ``decode_responses=False`` (vectors are bytes) and
raise ``redis.exceptions.RedisError`` when Redis is unreachable.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import redis

from controlplane.embedder import vecchannel
from controlplane.embedder.rows import DEFAULT_MAX_ROWS, RowTable
from controlplane.redisdb import keynames

log = logging.getLogger("infergate.embedder")

MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class IndexItem:
    """One entry to index (a queue job once validated)."""

    key: str
    namespace: str
    text: str
    ttl_s: int
    model: str = ""
    tenant: str = ""
    route: str = ""
    """Request path (selects a semantic domain, whose embeddings endpoint may differ)."""


@dataclass(frozen=True)
class Candidate:
    """A neighbour found in a namespace; ``similarity`` is cosine (-1..1, higher = closer);
    ``vec`` its stored unit vector (float32, for the verifier) when the backend returned it."""

    key: str
    similarity: float
    text: str
    vec: np.ndarray | None = field(default=None, compare=False, repr=False)


class VectorIndex(Protocol):
    backend: str
    """``redis-search`` or ``local``."""

    def add(self, items: list[IndexItem], vecs: np.ndarray) -> list[int]:
        """Store and index; returns each item's applied TTL in ms (0 = entry already gone)."""
        ...

    def search(self, namespace: str, vec: np.ndarray, k: int) -> list[Candidate]:
        """Up to ``k`` nearest entries of ``namespace``, closest first."""
        ...

    def search_many(self, queries: list[tuple[str, np.ndarray]],
                    k: int) -> list[list[Candidate]]:
        """:meth:`search` of each ``(namespace, vector)``, in that order."""
        ...

    def close(self) -> None:
        ...


def search_available(r: redis.Redis) -> bool:
    """True when the server answers ``FT._LIST`` (Redis search module loaded)."""
    try:
        r.execute_command("FT._LIST")
        return True
    except redis.exceptions.ResponseError:
        return False


def _s(v: bytes | str | None) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


#: KEYS[1] = a vector hash, ARGV[1] = TTL (ms), ARGV[2] = "LT" (only lower the TTL; a key
#: without TTL gets it) or "" (set it), ARGV[3..] = field, value pairs. Writes the fields
#: and the TTL; returns the TTL in force (ms).
VEC_WRITE_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if ARGV[2] == 'LT' then
  redis.call('PEXPIRE', KEYS[1], ARGV[1], 'LT')
else
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return redis.call('PTTL', KEYS[1])
"""


class VectorStore:
    """Reads and writes the vector hashes of one model (shared by both backends)."""

    def __init__(self, r: redis.Redis, model_slug: str, dim: int):
        self.r = r
        self.model_slug = model_slug
        self.dim = dim
        self.prefix = keynames.cache_vec_prefix(model_slug, dim)

    def hash_key(self, exact_key: str) -> str:
        return keynames.cache_vec(self.model_slug, self.dim, exact_key)

    def write(self, items: list[IndexItem], vecs: np.ndarray) -> list[int]:
        """HSET + PEXPIRE each item; PUBLISH its hash key. Returns the TTLs in force (ms).

        The TTL is ``min(ttl_s, PTTL(entry))`` when the entry exists with a TTL (set as it
        is: it follows an entry stored again); without the entry it only lowers the TTL
        (``LT``); an item whose entry existed with no time left is skipped (0)."""
        if not items:
            return []
        pipe = self.r.pipeline(transaction=False)
        for it in items:
            pipe.pttl(keynames.cache_entry(it.key))
        entry_ttls = pipe.execute()
        applied: list[int] = []
        # one Redis: one MULTI for all; a cluster: one script per vector (one key, any
        # slot). Either way a hash never exists without its TTL.
        cluster = isinstance(self.r, redis.RedisCluster)
        pipe = self.r.pipeline(transaction=not cluster)
        at: list[tuple[int, int]] = []  # (item, position of its PTTL reply)
        written: list[str] = []         # a cluster's hash keys, announced after the writes
        pos = 0
        for n, (it, vec, ettl) in enumerate(zip(items, vecs, entry_ttls)):
            ttl_ms = it.ttl_s * 1000
            follow = isinstance(ettl, int) and ettl > 0
            if follow:
                ttl_ms = min(ttl_ms, ettl)
            elif ettl == 0:
                ttl_ms = 0
            applied.append(ttl_ms)
            if ttl_ms <= 0:
                continue
            hk = self.hash_key(it.key)
            fields = {"namespace": it.namespace, "key": it.key, "text": it.text[:MAX_TEXT_CHARS],
                      "model": it.model, "tenant": it.tenant,
                      "vec": np.asarray(vec, dtype="<f4").tobytes()}
            if cluster:
                # (EVAL by name: redis-py's cluster pipeline has no .eval)
                pipe.execute_command("EVAL", VEC_WRITE_LUA, 1, hk, ttl_ms,
                                     "" if follow else "LT",
                                     *(x for kv in fields.items() for x in kv))
                at.append((n, pos))
                pos += 1
            else:
                pipe.hset(hk, mapping=fields)
                pipe.pexpire(hk, ttl_ms, lt=not follow)
                pipe.pttl(hk)  # what is in force now
                at.append((n, pos + 2))
                pos += 3
            if cluster:
                written.append(hk)
            else:
                publish_vector(pipe, hk)
                pos += 1
        res = pipe.execute()
        if written:
            # A cluster pipeline sends each node its share in turn, so an SPUBLISH queued
            # with the writes can reach a follower before the hash it names exists on
            # another shard: announce only once every write has been answered.
            pub = self.r.pipeline(transaction=False)
            for hk in written:
                publish_vector(pub, hk)
            pub.execute()
        for n, i in at:
            pttl = res[i]
            if isinstance(pttl, int) and pttl > 0:
                applied[n] = pttl
        return applied

    def read(self, hash_keys: list[str]) -> list[tuple[str, str, str, np.ndarray, int] | None]:
        """(key, namespace, text, vec, pttl_ms) per hash key; None when gone or malformed."""
        pipe = self.r.pipeline(transaction=False)
        for hk in hash_keys:
            pipe.hmget(hk, ["key", "namespace", "text", "vec"])
            pipe.pttl(hk)
        raw = pipe.execute()
        out: list[tuple[str, str, str, np.ndarray, int] | None] = []
        for i in range(len(hash_keys)):
            (key, ns, text, blob), pttl = raw[2 * i], raw[2 * i + 1]
            if key is None or ns is None or blob is None or len(blob) != 4 * self.dim:
                out.append(None)
                continue
            out.append((_s(key), _s(ns), _s(text), np.frombuffer(blob, dtype="<f4").copy(),
                        int(pttl)))
        return out

    def scan(self, batch: int = 1000) -> Iterable[list[str]]:
        """Hash keys of this model, in batches (SCAN, never KEYS)."""
        chunk: list[str] = []
        for hk in self.r.scan_iter(match=self.prefix + "*", count=batch):
            chunk.append(_s(hk))
            if len(chunk) >= batch:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


# ---------------------------------------------------------------- Redis search


def _search_rows(res) -> list[tuple[str, dict[str, bytes | str]]]:
    """(doc id, {field: value}) of an ``FT.SEARCH`` reply, RESP2 (flat list) or RESP3 (map
    with ``results: [{"id", "extra_attributes"}]``)."""
    rows: list[tuple[str, dict[str, bytes | str]]] = []
    if isinstance(res, dict):
        results = res.get(b"results", res.get("results")) or []
        for r in results:
            doc = r.get(b"id", r.get("id"))
            attrs = r.get(b"extra_attributes", r.get("extra_attributes")) or {}
            rows.append((_s(doc), {_s(k): v for k, v in attrs.items()}))
        return rows
    for i in range(1, len(res) - 1, 2):
        fields = res[i + 1]
        rows.append((_s(res[i]),
                     {_s(fields[j]): fields[j + 1] for j in range(0, len(fields) - 1, 2)}))
    return rows


class RedisSearchIndex:
    """HNSW cosine index of the Redis search module over the vector hashes."""

    backend = "redis-search"

    def __init__(self, r: redis.Redis, model_slug: str, dim: int):
        self.store = VectorStore(r, model_slug, dim)
        self.r = r
        self.name = keynames.cache_vec_index(model_slug, dim)
        self.ensure_index()

    def ensure_index(self) -> None:
        """Create the index unless it exists (another embedder may create it first)."""
        try:
            self.r.execute_command("FT.INFO", self.name)
            return
        except redis.exceptions.ResponseError:
            pass
        try:
            self.r.execute_command(
                "FT.CREATE", self.name, "ON", "HASH", "PREFIX", "1", self.store.prefix,
                "SCHEMA", "namespace", "TAG", "vec", "VECTOR", "HNSW", "6",
                "TYPE", "FLOAT32", "DIM", str(self.store.dim), "DISTANCE_METRIC", "COSINE")
            log.info("created Redis search index %s", self.name)
        except redis.exceptions.ResponseError as exc:
            if "exists" not in str(exc).lower():
                raise

    def add(self, items: list[IndexItem], vecs: np.ndarray) -> list[int]:
        return self.store.write(items, vecs)

    def search(self, namespace: str, vec: np.ndarray, k: int) -> list[Candidate]:
        blob = np.asarray(vec, dtype="<f4").tobytes()
        query = f"(@namespace:{{{namespace}}})=>[KNN {int(k)} @vec $v AS dist]"
        res = self.r.execute_command(
            "FT.SEARCH", self.name, query, "PARAMS", "2", "v", blob,
            "RETURN", "3", "text", "dist", "vec", "SORTBY", "dist", "LIMIT", "0", str(int(k)),
            "DIALECT", "2")
        out: list[Candidate] = []
        plen = len(self.store.prefix)
        for doc, f in _search_rows(res):
            try:
                dist = float(_s(f.get("dist")))
            except ValueError:
                continue
            raw = f.get("vec")
            v = np.frombuffer(raw, dtype="<f4") if isinstance(raw, bytes) \
                and len(raw) == 4 * self.store.dim else None
            out.append(Candidate(doc[plen:], 1.0 - dist, _s(f.get("text")), v))
        out.sort(key=lambda c: -c.similarity)
        return out

    def search_many(self, queries: list[tuple[str, np.ndarray]],
                    k: int) -> list[list[Candidate]]:
        """One ``FT.SEARCH`` per query (the server's HNSW index answers each in about a
        millisecond)."""
        return [self.search(ns, vec, k) for ns, vec in queries]

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- in process

#: Seconds between two rounds of the local index's upkeep thread.
UPKEEP_EVERY_S = 1.0
#: Heap items a put or a search looks at (expired rows of any namespace dropped).
SWEEP_PER_CALL = 8
#: Heap items the upkeep thread looks at per hold of the lock.
SWEEP_CHUNK = 1000
#: Seconds in which the upkeep thread checks every row's vector hash in Redis once (in
#: batches of ``rows / VERIFY_ROUND_S`` per round, within the bounds below).
VERIFY_ROUND_S = 60.0
VERIFY_BATCH_MIN = 100
VERIFY_BATCH_MAX = 2000
#: Vector channel messages handled together (one Redis round trip for them).
FOLLOW_BATCH = 256


class LocalIndex:
    """Exact cosine search in process (numpy), for Redis servers without search.

    Memory is bounded (:mod:`controlplane.embedder.rows`): ``max_rows`` rows at most,
    expired rows of any namespace are dropped (a few per put and search, and all of them
    every :data:`UPKEEP_EVERY_S` by the upkeep thread), and rows whose vector hash left
    Redis (purged, evicted) are dropped: at once for a purge announced on the vector
    channel, else within about :data:`VERIFY_ROUND_S` (the upkeep thread checks every
    row's hash with pipelined ``EXISTS``, a batch per round, in turn). The upkeep
    thread runs when ``upkeep`` is true (default: when ``subscribe`` is);
    :meth:`upkeep_once` is the same work, for tests."""

    backend = "local"

    def __init__(self, r: redis.Redis, model_slug: str, dim: int, subscribe: bool = True,
                 clock=time.time, max_rows: int = DEFAULT_MAX_ROWS,
                 upkeep: bool | None = None):
        self.store = VectorStore(r, model_slug, dim)
        self.r = r
        self.dim = dim
        self._clock = clock
        self._lock = threading.Lock()
        self._rows = RowTable(dim, max_rows)
        self._verify_next: deque[str] = deque()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._threads: list[threading.Thread] = []
        if subscribe:
            # Subscribe first, then load: a vector published in between is not missed.
            self._start(self._follow, "vec-follow")
            self._subscribed.wait(5.0)
        self.reload()
        if subscribe if upkeep is None else upkeep:
            self._start(self._upkeep, "vec-upkeep")

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=name)
        t.start()
        self._threads.append(t)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

    @property
    def namespaces(self) -> int:
        """Namespaces with at least one row."""
        with self._lock:
            return len(self._rows.blocks)

    @property
    def dropped_over_cap(self) -> int:
        """Rows dropped because ``max_rows`` was reached."""
        return self._rows.dropped_over_cap

    def reload(self) -> int:
        """Read every vector hash of this model from Redis (SCAN); returns rows loaded."""
        n = 0
        for chunk in self.store.scan():
            self._put_read(self.store.read(chunk))
            n += len(chunk)
        log.info("local vector index: %d vectors loaded from Redis", n)
        return n

    def _put_read(self, rows: list[tuple[str, str, str, np.ndarray, int] | None]) -> None:
        now = self._clock()
        for row in rows:
            if row is None:
                continue
            key, ns, text, vec, pttl = row
            if pttl == -2 or pttl == 0:
                continue
            expires = math.inf if pttl < 0 else now + pttl / 1000.0
            self.put(key, ns, text, vec, expires)

    def put(self, key: str, namespace: str, text: str, vec: np.ndarray,
            expires_at: float) -> None:
        """Insert or replace one row (``expires_at`` epoch seconds, ``inf`` = never)."""
        now = self._clock()
        with self._lock:
            self._rows.put(key, namespace, text[:MAX_TEXT_CHARS], vec, expires_at)
            self._rows.sweep(now, SWEEP_PER_CALL)

    def add(self, items: list[IndexItem], vecs: np.ndarray) -> list[int]:
        applied = self.store.write(items, vecs)
        now = self._clock()
        for it, vec, ttl_ms in zip(items, vecs, applied):
            if ttl_ms > 0:
                self.put(it.key, it.namespace, it.text, np.asarray(vec, np.float32),
                         now + ttl_ms / 1000.0)
        return applied

    def search(self, namespace: str, vec: np.ndarray, k: int) -> list[Candidate]:
        return self.search_many([(namespace, vec)], k)[0]

    def search_many(self, queries: list[tuple[str, np.ndarray]],
                    k: int) -> list[list[Candidate]]:
        """The queries of one namespace are scored together: one matrix product of the
        namespace's rows by all their vectors, which reads the rows once (a product per
        query reads them once each: with tens of thousands of rows, most of a lookup)."""
        out: list[list[Candidate]] = [[] for _ in queries]
        by_ns: dict[str, list[int]] = {}
        for i, (ns, _) in enumerate(queries):
            by_ns.setdefault(ns, []).append(i)
        now = self._clock()
        with self._lock:
            self._rows.sweep(now, SWEEP_PER_CALL)
            for ns, idx in by_ns.items():
                self._rows.drop_expired_in(ns, now)
                block = self._rows.blocks.get(ns)
                if block is None or block.n == 0:
                    continue
                q = np.vstack([np.asarray(queries[i][1], dtype=np.float32) for i in idx])
                scores = block.mat[:block.n] @ q.T          # (rows, queries)
                kk = min(k, block.n)
                for col, i in enumerate(idx):
                    sc = scores[:, col]
                    top = np.argpartition(-sc, kk - 1)[:kk] if block.n > kk \
                        else np.arange(block.n)
                    top = top[np.argsort(-sc[top])]
                    out[i] = [Candidate(block.keys[j], float(sc[j]), block.texts[j],
                                        block.mat[j].copy()) for j in top]
        return out

    # -- upkeep: expiry across namespaces, rows whose keys left Redis ------------------

    def sweep(self, budget: int = SWEEP_CHUNK) -> int:
        """Drop expired rows of any namespace, looking at ``budget`` candidates at most;
        returns how many it looked at (0: no expired row is left)."""
        now = self._clock()
        with self._lock:
            return self._rows.sweep(now, budget)

    def drop_gone(self, keys: list[str]) -> int:
        """Check ``keys``' vector hashes in Redis (one pipeline of ``EXISTS``) and drop the
        rows of those that are gone; returns rows dropped. A row replaced while Redis was
        asked is kept. Raises ``RedisError``."""
        with self._lock:
            seen = [(k, e) for k in keys if (e := self._rows.expires_of(k)) is not None]
        if not seen:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for k, _ in seen:
            pipe.exists(self.store.hash_key(k))
        gone = [ke for ke, there in zip(seen, pipe.execute()) if not there]
        dropped = 0
        with self._lock:
            for k, e in gone:
                if self._rows.expires_of(k) == e and self._rows.delete(k):
                    dropped += 1
        return dropped

    def verify_some(self) -> int:
        """One batch of the round-robin check of every row (:meth:`drop_gone`): about
        ``rows / VERIFY_ROUND_S`` keys, within ``VERIFY_BATCH_MIN..MAX``; returns rows
        dropped. Raises ``RedisError``."""
        with self._lock:
            n = len(self._rows)
            if not self._verify_next:
                self._verify_next.extend(self._rows.keys())
        size = max(VERIFY_BATCH_MIN, min(VERIFY_BATCH_MAX,
                                         math.ceil(n * UPKEEP_EVERY_S / VERIFY_ROUND_S)))
        batch = [self._verify_next.popleft()
                 for _ in range(min(size, len(self._verify_next)))]
        return self.drop_gone(batch)

    def upkeep_once(self) -> None:
        """Drop every expired row (in chunks of :data:`SWEEP_CHUNK`, the lock released
        between them), then :meth:`verify_some`. Raises ``RedisError``."""
        while self.sweep(SWEEP_CHUNK):
            pass
        self.verify_some()

    def _upkeep(self) -> None:
        failing = False
        while not self._stop.wait(UPKEEP_EVERY_S):
            try:
                self.upkeep_once()
                failing = False
            except redis.exceptions.RedisError as exc:
                if not failing:
                    log.warning("local vector index: rows not checked in Redis: %s", exc)
                failing = True
            except Exception:  # noqa: BLE001 - the thread must outlive any bug
                log.exception("local vector index upkeep failed")

    # -- the vector channel -------------------------------------------------------------

    def _follow(self) -> None:
        """Apply vectors published by any embedder (and deletions announced by a purge);
        resync after a lost connection."""
        backoff, lost = 0.2, False
        while not self._stop.is_set():
            ps = None
            # a cluster: sharded pub/sub (Redis 7.0 SSUBSCRIBE), served by the channel's
            # shard alone instead of every node forwarding every message
            sharded = isinstance(self.r, redis.RedisCluster)
            try:
                ps = self.r.pubsub()
                if sharded:
                    ps.ssubscribe(keynames.CACHE_VEC_CHANNEL)
                else:
                    ps.subscribe(keynames.CACHE_VEC_CHANNEL)
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline and not self._stop.is_set():
                    msg = _next_message(ps, sharded)
                    if msg and msg.get("type") in SUBSCRIBED:
                        break
                self._subscribed.set()
                if lost:  # messages sent while disconnected are gone: read everything
                    self.reload()
                    lost = False
                backoff = 0.2
                while not self._stop.is_set():
                    self._apply(_next_messages(ps, sharded, FOLLOW_BATCH))
            except redis.exceptions.RedisError as exc:
                if not lost:
                    log.warning("vector channel lost: %s; retrying", exc)
                lost = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if ps is not None:
                    try:
                        ps.close()
                    except Exception:  # noqa: BLE001
                        pass

    def _apply(self, messages: list[dict]) -> None:
        """Read the vectors announced that this index does not hold; check the ones
        announced gone that it holds (:meth:`drop_gone`)."""
        added: list[str] = []
        gone: list[str] = []
        plen = len(self.store.prefix)
        for msg in messages:
            is_gone, hk = vecchannel.parse(msg["data"])
            if not hk.startswith(self.store.prefix):
                continue
            (gone if is_gone else added).append(hk)
        with self._lock:
            added = [hk for hk in added if hk[plen:] not in self._rows]
            gone_keys = [hk[plen:] for hk in gone if hk[plen:] in self._rows]
        if added:
            self._put_read(self.store.read(added))
        if gone_keys:
            self.drop_gone(gone_keys)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=3)


#: Pub/sub message types: subscribed (plain or sharded), a message (plain or sharded).
SUBSCRIBED = ("subscribe", b"subscribe", "ssubscribe", b"ssubscribe")
MESSAGES = ("message", b"message", "smessage", b"smessage")


def _next_message(ps: Any, sharded: bool, timeout: float = 0.5) -> dict | None:
    """The next pub/sub message within ``timeout`` s, or None."""
    if sharded:
        return ps.get_sharded_message(timeout=timeout)
    return ps.get_message(timeout=timeout)


def _next_messages(ps: Any, sharded: bool, most: int) -> list[dict]:
    """The channel messages (not subscription replies) that arrive within 0.5 s, then
    those already waiting, at most ``most``."""
    out: list[dict] = []
    msg = _next_message(ps, sharded)
    while msg is not None:
        if msg.get("type") in MESSAGES:
            out.append(msg)
        if len(out) >= most:
            break
        msg = _next_message(ps, sharded, 0.0)
    return out


def publish_vector(pipe: Any, hash_key: str) -> None:
    """Announce a stored vector on :data:`keynames.CACHE_VEC_CHANNEL`
    (:func:`controlplane.embedder.vecchannel.publish_added`)."""
    vecchannel.publish_added(pipe, hash_key)


def open_index(r: redis.Redis, model_slug: str, dim: int, backend: str = "auto",
               subscribe: bool = True, max_rows: int = DEFAULT_MAX_ROWS) -> VectorIndex:
    """The index for ``backend`` (``auto`` | ``redis-search`` | ``local``); ``max_rows``
    bounds the local index (rows held in process; the Redis search index has no bound of
    its own).

    ``auto`` uses Redis search when ``FT._LIST`` answers, else the local index, and logs
    which; on a Redis Cluster ``auto`` is the local index (a search module's index on one
    node sees only that node's slots; ask for ``redis-search`` explicitly when the
    cluster's module searches across shards). Raises ``ValueError`` for ``redis-search``
    on a server without the module and ``redis.exceptions.RedisError`` when Redis is
    unreachable."""
    if backend not in ("auto", "redis-search", "local"):
        raise ValueError(f"unknown index backend {backend!r}: auto | redis-search | local")
    if backend == "auto" and isinstance(r, redis.RedisCluster):
        log.info("semantic index backend: local (in-process exact search; Redis Cluster)")
        return LocalIndex(r, model_slug, dim, subscribe=subscribe, max_rows=max_rows)
    if backend in ("auto", "redis-search"):
        if search_available(r):
            log.info("semantic index backend: redis-search (FT.* commands available)")
            return RedisSearchIndex(r, model_slug, dim)
        if backend == "redis-search":
            raise ValueError("this Redis server has no search module (FT._LIST failed)")
    log.info("semantic index backend: local (in-process exact search; Redis has no "
             "search module)" if backend == "auto" else
             "semantic index backend: local (in-process exact search)")
    return LocalIndex(r, model_slug, dim, subscribe=subscribe, max_rows=max_rows)
