"""The embedder's logic, without HTTP: embed (micro-batched), index, look up, count.

:class:`Engine` is shared by the Flask app (``app.py``) and the queue consumer
(``consumer.py``). Redis is reached through a ``redis.Redis`` with ``decode_responses=False``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import redis
from prometheus_client import CollectorRegistry, Counter, Histogram

from controlplane.redisdb import keynames
from controlplane.embedder import decision, language
from controlplane.embedder.activity import LookupActivity
from controlplane.embedder.batcher import MicroBatcher
from controlplane.embedder.index import Candidate, IndexItem, open_index
from controlplane.embedder.models import EmbeddingModel, EmbedError, slug
from controlplane.embedder.policy import Domain, PolicySource
from controlplane.embedder.remote import EndpointError, PoolModels, remote_model_id
from controlplane.embedder.rows import DEFAULT_MAX_ROWS
from controlplane.embedder.verifier import Verifier
from controlplane.embedder.wire import LookupRequest
from controlplane.errors import InfergateError

if TYPE_CHECKING:
    from controlplane.config import RedisSettings

log = logging.getLogger("infergate.embedder")


class EngineUnavailable(InfergateError, RuntimeError):
    """Redis or the embedding model cannot serve now (HTTP 503)."""


#: A lookup decided without comparing a score: what ``LookupResult.decided_by`` names.
_NO_SCORE = {"reject:language": "language", "reject:too_long": "length"}
#: The route whose texts are completion prompts: a continuation follows the prompt's last
#: characters, so its guard compares the spelling too (``guard.check``, ``verbatim``).
COMPLETIONS_ROUTE = "/v1/completions"


@dataclass(frozen=True)
class LookupResult:
    """The ``POST /v1/lookup`` answer.

    ``similarity`` is the cosine (0-1, clipped) of the returned entry on a hit, else of the
    closest entry of the index for the namespace (None when it has none; its answer may
    have gone since: only a would-be hit is checked in Redis);
    ``candidate_text`` is that entry's last user message; ``guard`` is ``pass`` on a hit
    (checks on), ``reject:<reason>`` when every candidate above the threshold was rejected
    (a guard reason such as ``numbers``, or ``verifier`` when only the verifier said no),
    else None. ``verifier_score`` is the verifier's probability (0-1) of the returned entry
    on a hit, else of the best candidate it scored (None without the verifier);
    ``min_similarity`` and ``min_verifier_score`` are the thresholds applied (the latter
    None without the verifier). ``elapsed_ms`` is wall time in the embedder, milliseconds.
    ``decided_by`` names the score the decision compared with its threshold: ``verifier``
    (the learned verifier: ``verifier_score`` against ``min_verifier_score``),
    ``rerank`` (a rerank endpoint of the pool, the same two fields) or ``cosine``
    (``similarity`` against ``min_similarity``), or, when no score was compared,
    ``language`` (``reject:language``: a question outside ``cache.semantic_languages``) or
    ``length`` (``reject:too_long``); ``model_id`` is the embedding model whose
    vectors were searched (``<model>@<host:port>`` for an endpoint of the pool)."""

    hit: bool
    key: str | None
    similarity: float | None
    candidate_text: str | None
    guard: str | None
    model_id: str
    elapsed_ms: float
    min_similarity: float
    verifier_score: float | None = None
    min_verifier_score: float | None = None
    decided_by: str = "cosine"

    def to_dict(self) -> dict:
        return asdict(self)


class Metrics:
    """Prometheus metrics of one engine (own registry, so several engines can coexist)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookups = Counter("infergate_embedder_lookups_total",
                               "Semantic lookups answered (200)", registry=r)
        self.hits = Counter("infergate_embedder_hits_total",
                            "Semantic lookups that returned a hit", registry=r)
        self.guard_rejects = Counter("infergate_embedder_guard_rejects_total",
                                     "Candidates above the threshold rejected by the precision "
                                     "guard", registry=r)
        self.verifier_rejects = Counter("infergate_embedder_verifier_rejects_total",
                                        "Candidates above the cosine floor rejected by the "
                                        "learned verifier", registry=r)
        self.errors = Counter("infergate_embedder_errors_total",
                              "Failures by kind: redis, embed, embed_timeout (Redis or the "
                              "model unavailable: a request gets 503), endpoint (an embeddings "
                              "or rerank endpoint of the pool failed: its lookups miss)",
                              ["kind"], registry=r)
        self.indexed = Counter("infergate_embedder_indexed_total",
                               "Vectors stored in the semantic index", ["source"], registry=r)
        self.invalid_jobs = Counter("infergate_embedder_invalid_jobs_total",
                                    "Index queue items dropped as malformed", registry=r)
        self.index_deferrals = Counter("infergate_embedder_index_deferrals_total",
                                       "Index-queue batches that waited for running lookups",
                                       registry=r)
        self.index_deferred_seconds = Counter(
            "infergate_embedder_index_deferred_seconds_total",
            "Seconds index-queue batches waited for running lookups", registry=r)
        self.batch_size = Histogram("infergate_embedder_embed_batch_size",
                                    "Texts per model call (micro-batch size)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.lookup_seconds = Histogram(
            "infergate_embedder_lookup_seconds", "Lookup latency inside the embedder, seconds",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0),
            registry=r)


class Engine:
    """Embedding model + micro-batcher + vector index + Redis (+ verifier and thresholds).

    ``index_backend``: ``auto`` | ``redis-search`` | ``local`` (see ``index.open_index``).
    ``verifier``: a :class:`verifier.Verifier` for the model, or None (cosine + guard only);
    ``policy``: per-domain thresholds (:class:`policy.PolicySource`; default none, verifier
    used when given). ``embed_cache`` texts keep their vector in an in-process LRU (a miss
    is usually followed by the index job of the same text). ``model_workers`` batches may
    run at once when the model is thread-safe (``model.thread_safe``), else one; a call
    with :data:`OWN_BATCH_MIN` texts or more (a grouped lookup call of the edge) is embedded
    as a batch of its own in its caller's thread, up to :data:`OWN_BATCH_WORKERS` such at
    once beside those (a model that is not thread-safe: one at a time in all). Texts longer
    than ``max_text_chars`` characters take no part in the semantic cache: a lookup misses
    (``guard`` ``reject:too_long``) and an index job stores nothing, without running the
    model (the model reads only a text's beginning, so two long texts that differ further
    on would embed the same; and one such lookup costs up to ~100 ms of a core). Construction
    raises ``redis.exceptions.RedisError`` when Redis is unreachable.

    The pool's endpoints (``[[cache.semantic_domains]]`` with ``embeddings_url`` /
    ``rerank_url``, :mod:`remote`): a lookup or index item of such a domain goes to a
    child engine (:meth:`child`: the endpoint's vectors, an index of their own, this
    engine's Redis, policy, activity and metrics; ``endpoint_ca``: the CA file of
    ``https://`` endpoints without their own); an endpoint that fails makes a miss."""

    def __init__(self, model: EmbeddingModel, r: redis.Redis, index_backend: str = "auto",
                 max_batch: int = 32, max_wait_ms: float = 5.0, top_k: int = 3,
                 embed_timeout_s: float = 5.0, subscribe: bool = True,
                 verifier: Verifier | None = None, policy: PolicySource | None = None,
                 embed_cache: int = 4096, model_workers: int = 1,
                 max_text_chars: int = 1000, activity: LookupActivity | None = None,
                 pool: PoolModels | None = None, endpoint_ca: str = "",
                 metrics: Metrics | None = None, index_max_rows: int = DEFAULT_MAX_ROWS):
        self.model = model
        self.index_backend = index_backend
        #: rows the in-process index holds at most (``cache.semantic_index_max_rows``)
        self.index_max_rows = index_max_rows
        self.subscribe = subscribe
        #: the pool's endpoints (``remote.PoolModels``); a child engine (one endpoint's
        #: vectors) shares its parent's and dispatches nothing itself
        self.is_child = pool is not None
        self.pool = pool if pool is not None else PoolModels(self, endpoint_ca)
        # lookups running in this embedder's processes (the index consumer yields to them)
        self.activity = activity or LookupActivity()
        self.max_text_chars = max_text_chars
        self.verifier = verifier
        self.policy = policy or PolicySource()
        if not self.is_child:
            language.warm()
        self._vec_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._vec_cache_max = embed_cache
        self._vec_cache_lock = threading.Lock()
        self.r = r
        self.model_slug = slug(model.model_id)
        self.top_k = top_k
        self.embed_timeout_s = embed_timeout_s
        self.metrics = metrics or Metrics()
        self.index = open_index(r, self.model_slug, model.dim, index_backend,
                                subscribe=subscribe, max_rows=index_max_rows)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        safe = bool(getattr(model, "thread_safe", False))
        self.batcher: MicroBatcher[str, np.ndarray] = MicroBatcher(
            self._encode_batch, max_batch=max_batch, max_wait_s=max_wait_ms / 1000.0,
            on_batch=self.metrics.batch_size.observe, expected=lambda: self._inflight,
            workers=model_workers if safe else 1,
            own_workers=max(self.OWN_BATCH_WORKERS, model_workers) if safe else None)
        #: namespace hex -> threshold raise of the online verification (0-1), re-read
        #: from ``keynames.CACHE_THRESHOLD_RAISE`` at most every ``RAISES_EVERY_S``
        self._raises: dict[str, float] = {}
        self._raises_at = -float("inf")
        self._raises_lock = threading.Lock()
        #: a domain's own verifier file -> its verifier (None: not readable)
        self._domain_verifiers: dict[str, Verifier | None] = {}
        self._domain_lock = threading.Lock()
        self._domain_policy: object = None

    def child(self, model: EmbeddingModel) -> "Engine":
        """An engine for the vectors of ``model`` (an endpoint of the pool): its own index
        (keyed by the model id), this engine's Redis, policy, activity and pool."""
        return Engine(model, self.r, self.index_backend, top_k=self.top_k,
                      embed_timeout_s=self.embed_timeout_s, subscribe=self.subscribe,
                      policy=self.policy, max_text_chars=self.max_text_chars,
                      activity=self.activity, model_workers=4, pool=self.pool,
                      metrics=self.metrics, index_max_rows=self.index_max_rows)

    @property
    def verifier_active(self) -> bool:
        """The verifier is loaded and the configuration has it on."""
        return self.verifier is not None and self.policy.current().verifier

    @property
    def default_min_similarity(self) -> float:
        """Cosine a candidate needs when nothing else says: the verifier's floor when the
        verifier is on, else the model's own default."""
        if self.verifier_active:
            return float(self.verifier.floor)  # type: ignore[union-attr]
        return float(self.model.default_min_similarity)

    def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return list(self.model.encode(texts))

    def embed(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32: from the LRU, else through the micro-batcher.

        Raises :class:`EngineUnavailable` when the model fails or takes longer than
        ``embed_timeout_s``."""
        if self._vec_cache_max <= 0 or not texts:
            return self._embed(texts)
        out: list[np.ndarray | None] = []
        with self._vec_cache_lock:
            for t in texts:
                v = self._vec_cache.get(t)
                if v is not None:
                    self._vec_cache.move_to_end(t)
                out.append(v)
        todo = [i for i, v in enumerate(out) if v is None]
        if todo:
            fresh = self._embed([texts[i] for i in todo])
            with self._vec_cache_lock:
                for i, v in zip(todo, fresh):
                    out[i] = v
                    self._vec_cache[texts[i]] = v
                while len(self._vec_cache) > self._vec_cache_max:
                    self._vec_cache.popitem(last=False)
        return np.vstack(out).astype(np.float32, copy=False)  # type: ignore[arg-type]

    #: Texts from one caller that are embedded as a batch of their own in the caller's
    #: thread (``MicroBatcher.run``) rather than through the batcher's queue: enough to
    #: fill a good part of a batch, so waiting to merge them with others gains little, and
    #: one future and one thread hand-over per text are saved (a grouped edge call).
    OWN_BATCH_MIN = 8
    #: Such batches embedded at once (a thread-safe model; at least ``model_workers``),
    #: beside the batcher's: the edge sends up to two grouped calls per nginx worker, and
    #: its pooled connections may all lead to one process of several.
    OWN_BATCH_WORKERS = 2

    def _embed(self, texts: list[str]) -> np.ndarray:
        own = len(texts) >= self.OWN_BATCH_MIN
        if not own:
            with self._inflight_lock:
                self._inflight += len(texts)
        try:
            if own:
                rows = self.batcher.run(texts, timeout=self.embed_timeout_s)
            else:
                futs = self.batcher.submit_many(texts)
                deadline = time.monotonic() + self.embed_timeout_s
                rows = [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futs]
        except FutureTimeout:
            self.metrics.errors.labels("embed_timeout").inc()
            raise EngineUnavailable(f"embedding took longer than {self.embed_timeout_s}s") \
                from None
        except EmbedError as exc:
            self.metrics.errors.labels("embed").inc()
            raise EngineUnavailable(str(exc)) from exc
        finally:
            if not own:
                with self._inflight_lock:
                    self._inflight -= len(texts)
        if not rows:
            return np.zeros((0, self.model.dim), dtype=np.float32)
        return np.vstack(rows).astype(np.float32, copy=False)

    def index_items(self, items: list[IndexItem], source: str = "api") -> list[int]:
        """Embed and store ``items``; returns applied TTLs in ms (0 = entry already gone, or
        its text longer than ``max_text_chars``, or its domain's embeddings endpoint
        failing: not stored). Each stored item's namespace hash
        (``keynames.cache_ns_stats``) is given its ``model``, ``tenant``, ``route`` and the
        ``embedding_model`` of its vectors, and its sample question
        (``keynames.cache_ns_sample``) is set with the entry's TTL (the admin page).

        Raises :class:`EngineUnavailable` (model) or ``redis.exceptions.RedisError``."""
        if not items:
            return []
        applied = [0] * len(items)
        used = [""] * len(items)
        for dom, idx in self._by_endpoint([(it.namespace, it.route, it.model)
                                           for it in items]).values():
            part = [items[i] for i in idx]
            if dom is None:
                eng = self
            else:
                try:
                    eng = self.pool.engine(dom)
                except EndpointError as exc:
                    self._endpoint_failed("indexing", exc)
                    continue
            try:
                done = eng._index_local(part, source)
            except EngineUnavailable as exc:
                if dom is None:
                    raise
                self._endpoint_failed("indexing", exc)
                continue
            for i, t in zip(idx, done):
                applied[i], used[i] = t, eng.model.model_id
        if not self.is_child:
            self._note_namespaces(items, applied, used)
        return applied

    #: Characters of the sample question kept per namespace (admin page).
    SAMPLE_CHARS = 200

    def _note_namespaces(self, items: list[IndexItem], applied: list[int],
                         used: list[str]) -> None:
        """What the admin page shows of each namespace stored to (one pipeline; a Redis
        error is logged, the entries are indexed all the same)."""
        from controlplane.cache.store import COUNTERS_TTL_S

        seen: dict[str, tuple[dict[str, str], str, int]] = {}
        for it, t, mid in zip(items, applied, used):
            if t > 0 and it.namespace not in seen:
                seen[it.namespace] = ({"model": it.model, "tenant": it.tenant,
                                       "route": it.route, "embedding_model": mid},
                                      it.text[:self.SAMPLE_CHARS], t)
        if not seen:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for ns, (fields, sample, ttl_ms) in seen.items():
                key = keynames.cache_ns_stats(ns)
                pipe.hset(key, mapping=fields)
                pipe.hdel(key, "sample")  # where earlier versions kept it (30 days)
                pipe.expire(key, COUNTERS_TTL_S)
                # the question lives no longer than its answer
                pipe.set(keynames.cache_ns_sample(ns), sample, px=ttl_ms)
            pipe.execute()
        except redis.exceptions.RedisError as exc:
            log.warning("namespace details not written: %s", exc)

    def _index_local(self, items: list[IndexItem], source: str) -> list[int]:
        """:meth:`index_items` with this engine's model and index."""
        keep = [i for i, it in enumerate(items) if len(it.text) <= self.max_text_chars]
        applied = [0] * len(items)
        if not keep:
            return applied
        vecs = self.embed([items[i].text for i in keep])
        for i, t in zip(keep, self.index.add([items[i] for i in keep], vecs)):
            applied[i] = t
        self.metrics.indexed.labels(source).inc(sum(1 for t in applied if t > 0))
        return applied

    def _live(self, cand: Candidate) -> bool:
        """The candidate's cache entry still exists (not expired, evicted or purged).
        Asked only of a candidate about to be a hit: a miss costs no Redis call."""
        return bool(self.r.exists(keynames.cache_entry(cand.key)))

    #: Seconds between two reads of the threshold raises (one HGETALL on the lookup path).
    RAISES_EVERY_S = 1.0

    def threshold_raise(self, namespace: str) -> float:
        """How much the online verification raised ``namespace``'s threshold (0-1;
        ``keynames.CACHE_THRESHOLD_RAISE``, written by the control plane), re-read at
        most every :data:`RAISES_EVERY_S`; the last values read while Redis fails."""
        if not namespace:
            return 0.0
        now = time.monotonic()
        if now - self._raises_at >= self.RAISES_EVERY_S:
            with self._raises_lock:
                if now - self._raises_at >= self.RAISES_EVERY_S:
                    self._raises_at = now
                    try:
                        raw = self.r.hgetall(keynames.CACHE_THRESHOLD_RAISE)
                    except redis.exceptions.RedisError:
                        raw = None
                    if raw is not None:
                        out: dict[str, float] = {}
                        for k, v in raw.items():
                            try:
                                out[k.decode() if isinstance(k, bytes) else str(k)] = \
                                    max(0.0, min(1.0, float(v)))
                            except (TypeError, ValueError):
                                continue
                        self._raises = out
        return self._raises.get(namespace, 0.0)

    def thresholds(self, namespace: str, min_similarity: float | None = None,
                   route: str | None = None, model: str | None = None,
                   ) -> tuple[float, float | None]:
        """``(min_similarity, min_verifier_score)`` of a lookup: the most specific
        configured domain's values, else the request's ``min_similarity``, else the
        defaults (the floor and ``min_score`` of the domain's verifier when the verifier
        is on, else the model's threshold); ``min_verifier_score`` is None without the
        verifier. The namespace's raise (:meth:`threshold_raise`) is added to the
        threshold that decides a hit: the verifier's when it is on, else the cosine (at
        most 1)."""
        sim, vs, _ = self.limits(namespace, min_similarity, route, model)
        return sim, vs

    def limits(self, namespace: str, min_similarity: float | None = None,
               route: str | None = None, model: str | None = None,
               ) -> tuple[float, float | None, Verifier | None]:
        """:meth:`thresholds` and the verifier that applies (None: without the verifier;
        a domain's own ``verifier_file``, else the engine's)."""
        sim, vs, ver = self._base_thresholds(namespace, min_similarity, route, model)
        up = self.threshold_raise(namespace)
        if up > 0:
            if vs is None:
                sim = min(1.0, sim + up)
            else:
                vs = min(1.0, vs + up)
        return sim, vs, ver

    def _domain_verifier(self, path: str, pol: object) -> tuple[Verifier | None, bool]:
        """``(verifier, ok)`` of a domain's own file, read once per path and policy ``pol``
        (a reloaded configuration, e.g. after ``cache calibrate --train-verifier``
        rewrote the file, reads it again). A file that cannot be read is logged once and
        gives ``(engine's verifier, False)``: the caller then serves only texts equal up to
        case and punctuation (score 1)."""
        with self._domain_lock:
            if pol is not self._domain_policy:
                self._domain_verifiers.clear()
                self._domain_policy = pol
            if path not in self._domain_verifiers:
                from controlplane.embedder.verifier import VerifierError, load_for

                try:
                    self._domain_verifiers[path] = load_for(self.model.model_id,
                                                            self.model.dim, path)
                except VerifierError as exc:
                    log.error("verifier of a semantic domain not loaded (%s): only texts "
                              "equal up to case and punctuation hit there", exc)
                    self._domain_verifiers[path] = None
            v = self._domain_verifiers[path]
        return (v, True) if v is not None else (self.verifier, False)

    def _base_thresholds(self, namespace: str, min_similarity: float | None,
                         route: str | None, model: str | None,
                         ) -> tuple[float, float | None, Verifier | None]:
        """:meth:`limits` before the namespace's raise."""
        pol = self.policy.current()
        dom = pol.resolve(namespace, route, model)
        if dom is not None and dom.verifier is not None:
            on = dom.verifier
        else:  # a rerank endpoint is named to be used
            on = pol.verifier or (dom is not None and bool(dom.rerank_url))
        ver, ok = self.verifier, True
        if on and dom is not None and dom.rerank_url:
            ver = self.pool.reranker(dom)  # type: ignore[assignment]
        elif on and dom is not None and dom.verifier_file:
            ver, ok = self._domain_verifier(dom.verifier_file, pol)
        ver = ver if on else None
        if self.is_child:
            min_similarity = None  # the edge's value is the bundled model's
        if not ok and ver is None:  # the domain's verifier is unreadable, none to fall back on
            return 1.0, None, None
        if dom is not None and dom.min_similarity is not None:
            sim = dom.min_similarity
        elif min_similarity is not None:
            sim = min_similarity
        else:
            sim = ver.floor if ver is not None else float(self.model.default_min_similarity)
        if ver is None:
            return float(sim), None, None
        vs = dom.min_verifier_score if dom is not None and dom.min_verifier_score is not None \
            else ver.min_score
        return float(sim), float(vs) if ok else 1.0, ver

    def lookup(self, namespace: str, text: str, min_similarity: float | None = None,
               use_guard: bool = True, started: float | None = None,
               route: str | None = None, model: str | None = None) -> LookupResult:
        """Closest live entry of ``namespace`` with similarity >= the threshold that passes
        the precision checks (when ``use_guard``): the precision guard, then, when the
        verifier is on, the verifier's probability >= its threshold. Thresholds:
        :meth:`thresholds` (``route``/``model`` of the request select a domain).

        Raises :class:`EngineUnavailable` (model) or ``redis.exceptions.RedisError``."""
        req = LookupRequest(namespace, text, min_similarity, use_guard, route or "", model or "")
        return self.lookup_many([req], started=started)[0]

    def lookup_many(self, reqs: list[LookupRequest],
                    started: float | None = None) -> list[LookupResult]:
        """:meth:`lookup` of each request, together: the texts embedded in one model call,
        searched together (``search_many``: one matrix product per namespace in process),
        and whether each would-be hit's entry still exists asked in one Redis pipeline
        (a candidate found gone is skipped and the next one tried, as a single lookup
        does). Results in the order of ``reqs``; ``elapsed_ms`` is the whole call's.

        Raises :class:`EngineUnavailable` (model) or ``redis.exceptions.RedisError``: the
        whole call fails."""
        t0 = time.perf_counter() if started is None else started
        with self.activity.lookup():
            groups = self._by_endpoint([(q.namespace, q.route, q.model) for q in reqs])
            if len(groups) == 1 and None in groups:
                return self._lookup_many(reqs, t0)
            out: list[LookupResult | None] = [None] * len(reqs)
            for dom, idx in groups.values():
                part = [reqs[i] for i in idx]
                res = self._lookup_many(part, t0) if dom is None \
                    else self._endpoint_lookups(dom, part, t0)
                for i, r in zip(idx, res):
                    out[i] = r
            return out  # type: ignore[return-value]

    def _by_endpoint(self, keys: list[tuple[str, str, str]],
                     ) -> dict[tuple | None, tuple[Domain | None, list[int]]]:
        """Positions of ``keys`` (namespace, route, model) grouped by the embeddings
        endpoint of their domain (None: this engine's model)."""
        out: dict[tuple | None, tuple[Domain | None, list[int]]] = {}
        pol = None if self.is_child else self.policy.current()
        for i, (ns, route, model) in enumerate(keys):
            dom = pol.resolve(ns, route or None, model or None) if pol is not None else None
            if dom is None or not dom.embeddings_url:
                dom = None
            k = None if dom is None else PoolModels.engine_key(dom)
            out.setdefault(k, (dom, []))[1].append(i)
        return out

    #: Seconds between two log lines about an endpoint of the pool that fails.
    ENDPOINT_LOG_EVERY_S = 10.0
    _endpoint_logged = -float("inf")

    def _endpoint_failed(self, what: str, exc: Exception) -> None:
        self.metrics.errors.labels("endpoint").inc()
        now = time.monotonic()
        if now - self._endpoint_logged >= self.ENDPOINT_LOG_EVERY_S:
            self._endpoint_logged = now
            log.warning("semantic %s through an endpoint of the pool failed (lookups there "
                        "miss, the requests go to a node): %s", what, exc)

    def _endpoint_lookups(self, dom: Domain, reqs: list[LookupRequest],
                          t0: float) -> list[LookupResult]:
        """The lookups of a domain whose vectors come from an endpoint of the pool: its
        engine's answers, or misses (``guard`` ``reject:embeddings_unavailable``) while
        the endpoint fails or is slow."""
        try:
            return self.pool.engine(dom)._lookup_many(reqs, t0)
        except (EngineUnavailable, EndpointError) as exc:
            self._endpoint_failed("lookup", exc)
        ms = round((time.perf_counter() - t0) * 1000, 3)
        out = []
        for q in reqs:
            self.metrics.lookups.inc()
            sim = dom.min_similarity if dom.min_similarity is not None else 1.0
            out.append(LookupResult(hit=False, key=None, similarity=None, candidate_text=None,
                                    guard="reject:embeddings_unavailable",
                                    model_id=remote_model_id(dom.embeddings_url,
                                                             dom.embeddings_model),
                                    elapsed_ms=ms, min_similarity=sim))
        return out

    def _lookup_many(self, reqs: list[LookupRequest], t0: float) -> list[LookupResult]:
        limits = [self.limits(q.namespace, q.min_similarity, q.route or None,
                              q.model or None) for q in reqs]
        pol = self.policy.current()
        langs = [pol.languages_for(q.namespace, q.route or None, q.model or None)
                 for q in reqs]
        embed_at = [i for i, q in enumerate(reqs) if len(q.text) <= self.max_text_chars]
        vecs: list[np.ndarray | None] = [None] * len(reqs)
        if embed_at:
            for i, v in zip(embed_at, self.embed([reqs[i].text for i in embed_at])):
                vecs[i] = v
        cands: list[list[Candidate]] = [[] for _ in reqs]
        if embed_at:
            found = self.index.search_many([(reqs[i].namespace, vecs[i]) for i in embed_at],
                                           self.top_k)
            for i, c in zip(embed_at, found):
                cands[i] = c
        # first pass as if every entry were live, then one pipeline for the chosen ones
        verbatim = [q.route == COMPLETIONS_ROUTE for q in reqs]
        picks = [self._choose(q.text, vecs[i], cands[i], limits[i][0], limits[i][1], q.guard,
                              None, limits[i][2], langs[i], verbatim[i])
                 for i, q in enumerate(reqs)]
        chosen = [i for i, p in enumerate(picks) if p[0] is not None]
        if chosen:
            if len(chosen) == 1:  # one round trip either way; a pipeline costs more Python
                lives = [self._live(picks[chosen[0]][0])]  # type: ignore[arg-type]
            else:
                pipe = self.r.pipeline(transaction=False)
                for i in chosen:
                    pipe.exists(keynames.cache_entry(picks[i][0].key))  # type: ignore[union-attr]
                lives = pipe.execute()
            for i, alive in zip(chosen, lives):
                if not alive:  # gone since it was indexed: the others, one by one
                    rest = [c for c in cands[i] if c is not picks[i][0]]
                    picks[i] = self._choose(reqs[i].text, vecs[i], rest, limits[i][0],
                                            limits[i][1], reqs[i].guard, self._live,
                                            limits[i][2], langs[i], verbatim[i])
        elapsed = time.perf_counter() - t0
        out = []
        for i, q in enumerate(reqs):
            hit, verdict, best_score = picks[i]
            if vecs[i] is None:
                verdict = "reject:too_long"  # nothing embedded, nothing searched
            shown = hit or (cands[i][0] if cands[i] else None)
            self.metrics.lookups.inc()
            self.metrics.lookup_seconds.observe(elapsed)
            if hit is not None:
                self.metrics.hits.inc()
            threshold, min_score = limits[i][0], limits[i][1]
            ver = limits[i][2] or self.verifier
            by = "cosine" if min_score is None else \
                "rerank" if getattr(ver, "kind", "") == "rerank" else "verifier"
            by = _NO_SCORE.get(verdict or "", by)
            out.append(LookupResult(
                hit=hit is not None, key=hit.key if hit else None,
                similarity=None if shown is None else round(min(1.0, max(0.0, shown.similarity)),
                                                            6),
                candidate_text=shown.text if shown else None,
                guard=verdict, model_id=self.model.model_id,
                elapsed_ms=round(elapsed * 1000, 3), min_similarity=threshold,
                verifier_score=None if best_score is None else round(float(best_score), 6),
                min_verifier_score=min_score, decided_by=by))
        return out

    def _choose(self, text: str, vec: np.ndarray | None, cands: list[Candidate],
                threshold: float, min_score: float | None, use_guard: bool,
                live: Callable[[Candidate], bool] | None,
                verifier: Verifier | None = None,
                languages: Sequence[str] | None = language.GUARDED,
                verbatim: bool = False,
                ) -> tuple[Candidate | None, str | None, float | None]:
        """``(hit, verdict, best verifier score)`` among ``cands`` (best first) for the
        query ``text``: :func:`decision.choose` with this engine's model (characters it
        does not know), verifier (``verifier``: a domain's own, else the engine's),
        languages (the domain's, :meth:`policy.ThresholdPolicy.languages_for`),
        embedding and counters; ``verbatim`` for a ``/v1/completions`` prompt."""
        try:
            return decision.choose(
                text, vec, cands, threshold, min_score, use_guard, verifier or self.verifier,
                live, unknown=getattr(self.model, "unknown_chars", None), embed=self.embed,
                on_reject=self._count_reject, languages=languages, verbatim=verbatim)
        except EndpointError as exc:  # a rerank endpoint failed or is slow: a miss
            self._endpoint_failed("verification", exc)
            return None, "reject:verifier_unavailable", None

    def _count_reject(self, kind: str) -> None:
        if kind == "guard":
            self.metrics.guard_rejects.inc()
        else:
            self.metrics.verifier_rejects.inc()

    def _verify(self, text: str, vec: np.ndarray, cands: list[Candidate]) -> list[float]:
        """Verifier probabilities of ``cands`` for the query ``text`` (vector ``vec``); a
        candidate without a stored vector is embedded again (LRU first)."""
        assert self.verifier is not None
        return decision.verify(self.verifier, text, vec, cands, self.embed)

    def close(self) -> None:
        """Stop the batcher and the index (and, of a parent, its endpoints' engines)."""
        if not self.is_child:
            self.pool.close()
        self.batcher.close()
        self.index.close()


def connect(url: str, timeout_s: float = 0.5, blocking: bool = False,
            redis_settings: "RedisSettings | None" = None) -> redis.Redis:
    """A binary (``decode_responses=False``) Redis client for the embedder.

    Fails fast: one immediate retry (a pooled connection may be stale after a Redis
    restart) instead of redis-py 8's default of 10 retries with backoff (about 4.5 s
    against a refused port), so lookups answer 503 within ~2 x ``timeout_s``.
    ``blocking`` clients (BLPOP) get 5 s more read timeout than the block time. ``url``
    may be any form of :mod:`controlplane.redisdb.url` (``rediss://``, ``redis+sentinel://``;
    TLS and Sentinel options from ``redis_settings``)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from controlplane.config import RedisSettings
    from controlplane.redisdb.conn import make_redis

    return make_redis(
        redis_settings or RedisSettings(url=url), url=url,
        socket_timeout_s=timeout_s + (5.0 if blocking else 0.0), connect_timeout_s=timeout_s,
        decode_responses=False, retry=Retry(NoBackoff(), 1),
        health_check_interval=0 if blocking else 10)
