"""Models of the pool as the semantic cache's embedder and verifier, per domain.

A ``[[cache.semantic_domains]]`` entry may name an OpenAI-compatible embeddings endpoint
(``embeddings_url``) and a rerank endpoint (``rerank_url``) of the pool:

- :class:`RemoteEmbeddings` calls ``POST <root>/v1/embeddings`` ``{"model", "input":
  [...]}`` and reads ``{"data": [{"index", "embedding": [float, ...]}]}`` (OpenAI's
  shape; llama.cpp ``llama-server --embeddings`` serves it, checked at build b11434 with
  ``--pooling mean``; vLLM and TEI serve it too). Rows are L2-normalised here.
- :class:`Reranker` is a verifier: ``jina`` shape ``POST rerank_url`` ``{"model",
  "query", "documents": [...], "top_n"}`` -> ``{"results": [{"index",
  "relevance_score"}]}`` (llama.cpp ``/v1/rerank`` with ``--reranking``, vLLM
  ``/v1/rerank`` and ``/rerank``, Jina and Cohere), or ``tei`` shape ``{"query",
  "texts"}`` -> ``[{"index", "score"}]`` (Text Embeddings Inference ``/rerank``). llama.cpp
  answers the model's raw score (a logit): ``rerank_logits`` maps it through the logistic
  function to 0-1.

Both fail open: a call that errs, answers non-200 or takes longer than the domain's
``endpoint_timeout_ms`` raises :class:`EndpointError`, and the endpoint is then skipped
(raising at once) for :data:`COOLDOWN_S`, so a down or slow endpoint costs one timeout
every few seconds, not one per lookup. The engine turns the error into a miss.

:class:`PoolModels` holds one :class:`RemoteEmbeddings` / :class:`Reranker` per endpoint
configuration and the engine that serves each embeddings endpoint (an index of its own,
keyed by the model id ``<embeddings_model>@<host:port>``: vectors of two models are never
compared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np
import requests

from controlplane.embedder.models import EmbedError, FALLBACK_MIN_SIMILARITY, _cut, _normalise
from controlplane.embedder.verifier import FEATURE_VERSION

if TYPE_CHECKING:
    from controlplane.embedder.engine import Engine
    from controlplane.embedder.policy import Domain

log = logging.getLogger("infergate.embedder")

#: Seconds an endpoint is skipped after a failed or slow call.
COOLDOWN_S = 3.0
#: Default verifier threshold of a reranker (probability 0-1) when the domain sets none.
RERANK_MIN_SCORE = 0.9
#: Default cosine floor (0-1) of a domain with a reranker, when it sets no min_similarity.
RERANK_FLOOR = 0.5


class EndpointError(EmbedError):
    """An endpoint of the pool failed, answered out of shape, was slow or is cooling down."""


@dataclass(frozen=True)
class EndpointAccess:
    """How to reach an endpoint: API key source (``api_key_env`` / ``api_key_file``, as a
    node's) and the CA file of ``https://`` (empty: ``default_ca``, else the system)."""

    api_key_env: str = ""
    api_key_file: str = ""
    ca_file: str = ""
    default_ca: str = ""

    def headers(self) -> dict[str, str]:
        """``Authorization`` when a key is configured. Raises :class:`EndpointError` when
        it cannot be read (the message never holds the key)."""
        from controlplane.config import NodeSettings
        from controlplane.routing.nodeaccess import CredentialError, resolve

        if not (self.api_key_env or self.api_key_file):
            return {}
        node = NodeSettings(name="endpoint", url="http://endpoint",
                            api_key_env=self.api_key_env, api_key_file=self.api_key_file)
        try:
            auth = resolve(node)
        except CredentialError as exc:
            raise EndpointError(f"endpoint API key: {exc}") from None
        return {"Authorization": auth} if auth else {}

    @property
    def verify(self) -> str | bool:
        """``verify`` argument of ``requests``."""
        return self.ca_file or self.default_ca or True


class _Endpoint:
    """One URL: a pooled session, a timeout and the cooldown after a failure."""

    def __init__(self, url: str, timeout_s: float, access: EndpointAccess):
        self.url = url
        self.timeout_s = timeout_s
        self.access = access
        self._session = requests.Session()
        self._down_until = 0.0

    def post(self, body: dict) -> object:
        """POST ``body`` as JSON, the decoded answer (``timeout_s``: connect and each read).
        Raises :class:`EndpointError`; an endpoint that did not answer in time, refused
        the connection, answered 5xx or not JSON is skipped for :data:`COOLDOWN_S`, one
        that refused this body (4xx, e.g. a text over its context) is not."""
        now = time.monotonic()
        if now < self._down_until:
            raise EndpointError(f"{self.url} failed less than {COOLDOWN_S:g} s ago")
        try:
            resp = self._session.post(self.url, json=body, headers=self.access.headers(),
                                      timeout=self.timeout_s, verify=self.access.verify)
            if 400 <= resp.status_code < 500:
                raise EndpointError(f"{self.url} refused the request ({resp.status_code}): "
                                    f"{resp.text[:200]}")
            if resp.status_code != 200:
                self._down_until = time.monotonic() + COOLDOWN_S
                raise EndpointError(f"{self.url} answered {resp.status_code}: "
                                    f"{resp.text[:200]}")
            return resp.json()
        except (requests.RequestException, ValueError) as exc:
            self._down_until = time.monotonic() + COOLDOWN_S
            raise EndpointError(f"{self.url}: {type(exc).__name__}: {exc}") from None


def embeddings_endpoint(url: str) -> str:
    """The full ``.../embeddings`` URL of a root, ``.../v1`` or full URL."""
    base = url.rstrip("/")
    if base.endswith("/embeddings"):
        return base
    return base + "/embeddings" if base.endswith("/v1") else base + "/v1/embeddings"


def remote_model_id(url: str, model: str) -> str:
    """``<model>@<host:port>`` (``remote`` without a model name): names the index."""
    p = urlsplit(url)
    return f"{model or 'remote'}@{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}"


class RemoteEmbeddings:
    """An :class:`~controlplane.embedder.models.EmbeddingModel` over an OpenAI-compatible
    embeddings endpoint (see the module). ``dim`` is read from one probe call
    (:meth:`probe`); ``encode`` raises :class:`EndpointError` (an ``EmbedError``)."""

    thread_safe = True

    def __init__(self, url: str, model: str, timeout_s: float, access: EndpointAccess,
                 max_chars: int = 2000, min_similarity: float | None = None):
        self.endpoint = _Endpoint(embeddings_endpoint(url), timeout_s, access)
        self.request_model = model
        self.model_id = remote_model_id(url, model)
        self.max_chars = max_chars
        self.dim = 0
        self.default_min_similarity = min_similarity if min_similarity is not None \
            else FALLBACK_MIN_SIMILARITY

    def probe(self) -> int:
        """Embed one text to learn the dimension. Raises :class:`EndpointError`."""
        self.dim = int(self.encode(["dimension probe"]).shape[1])
        return self.dim

    def encode(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32, rows L2-normalised."""
        doc = self.endpoint.post({"model": self.request_model,
                                  "input": _cut(texts, self.max_chars)})
        try:
            data = sorted(doc["data"], key=lambda d: d["index"])  # type: ignore[index]
            vecs = np.array([d["embedding"] for d in data], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise EndpointError(f"embeddings answer not understood: {exc}") from None
        if vecs.ndim != 2 or vecs.shape[0] != len(texts) or (self.dim and
                                                               vecs.shape[1] != self.dim):
            raise EndpointError(f"embeddings answer of shape {vecs.shape} for {len(texts)} "
                                f"inputs of dimension {self.dim or '?'}")
        if not np.isfinite(vecs).all():
            raise EndpointError("embeddings answer holds a non-finite number")
        return _normalise(vecs)


def parse_rerank(doc: object, n: int, fmt: str = "jina") -> np.ndarray:
    """Scores (float64, in the documents' order) of a rerank answer for ``n`` documents:
    ``jina`` ``{"results": [{"index", "relevance_score"}]}``, ``tei`` ``[{"index",
    "score"}]`` (either shape is read whatever ``fmt``). Raises :class:`EndpointError`
    when a document has no finite score."""
    rows = doc.get("results") if isinstance(doc, dict) else doc
    out = np.full(n, np.nan)
    if isinstance(rows, list):
        for row in rows:
            if not isinstance(row, dict):
                continue
            i, s = row.get("index"), row.get("relevance_score", row.get("score"))
            if isinstance(i, int) and 0 <= i < n and isinstance(s, (int, float)) \
                    and not isinstance(s, bool):
                out[i] = float(s)
    if not np.isfinite(out).all():
        raise EndpointError(f"rerank answer ({fmt}) does not score every document")
    return out


class Reranker:
    """A rerank endpoint as the engine's verifier (duck type of
    :class:`~controlplane.embedder.verifier.Verifier`: ``score``, ``floor``,
    ``min_score``, ``feature_version``, ``training_hashes``). ``score`` posts one request
    per distinct query; scores are probabilities 0-1 (``logits``: mapped by the logistic
    function). Raises :class:`EndpointError`."""

    kind = "rerank"
    feature_version = FEATURE_VERSION

    def __init__(self, url: str, model: str, timeout_s: float, access: EndpointAccess,
                 fmt: str = "jina", logits: bool = False, floor: float = RERANK_FLOOR,
                 min_score: float = RERANK_MIN_SCORE, max_chars: int = 2000):
        self.endpoint = _Endpoint(url, timeout_s, access)
        self.model = model
        self.fmt = fmt
        self.logits = logits
        self.floor = floor
        self.min_score = min_score
        self.max_chars = max_chars
        self.model_id = f"rerank:{remote_model_id(url, model)}"

    def training_hashes(self) -> np.ndarray:
        """No training fingerprint: a reranker of the pool was not trained on these sets."""
        return np.zeros(0, dtype=np.uint64)

    def rank(self, query: str, docs: list[str]) -> np.ndarray:
        """Probabilities (0-1) of ``docs`` for ``query``, one call."""
        q, d = _cut([query], self.max_chars)[0], _cut(docs, self.max_chars)
        body = {"query": q, "texts": d} if self.fmt == "tei" else \
            {"model": self.model, "query": q, "documents": d, "top_n": len(d)}
        s = parse_rerank(self.endpoint.post(body), len(d), self.fmt)
        if self.logits:
            s = 1.0 / (1.0 + np.exp(-np.clip(s, -60.0, 60.0)))
        return np.clip(s, 0.0, 1.0)

    def score(self, queries: Sequence[str], candidates: Sequence[str],
              u: np.ndarray | None = None, v: np.ndarray | None = None) -> np.ndarray:
        """Probability per (query, candidate) pair; ``u`` / ``v`` (vectors) unused."""
        out = np.zeros(len(queries), dtype=np.float64)
        by_query: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            by_query.setdefault(q, []).append(i)
        for q, idx in by_query.items():
            out[idx] = self.rank(q, [candidates[i] for i in idx])
        return out


def _timeout(d: "Domain", cap_s: float) -> float:
    return min(d.endpoint_timeout_ms / 1000.0, cap_s)


class PoolModels:
    """The pool's endpoints of an engine's domains: their reranker and the engine serving
    each embeddings endpoint (built on first use; a failed build is tried again after
    :data:`COOLDOWN_S`)."""

    def __init__(self, parent: "Engine", default_ca: str = ""):
        self.parent = parent
        self.default_ca = default_ca
        self._lock = threading.Lock()
        self._rerankers: dict[tuple, Reranker] = {}
        self._engines: dict[tuple, "Engine"] = {}
        self._failed_at: dict[tuple, float] = {}

    def access(self, d: "Domain") -> EndpointAccess:
        return EndpointAccess(d.api_key_env, d.api_key_file, d.ca_file, self.default_ca)

    def reranker(self, d: "Domain") -> Reranker:
        """The domain's reranker (one per endpoint configuration and thresholds)."""
        key = (d.rerank_url, d.rerank_model, d.rerank_format, d.rerank_logits,
               d.endpoint_timeout_ms, d.api_key_env, d.api_key_file, d.ca_file)
        with self._lock:
            r = self._rerankers.get(key)
            if r is None:
                r = Reranker(d.rerank_url, d.rerank_model,
                             _timeout(d, self.parent.embed_timeout_s), self.access(d),
                             d.rerank_format, d.rerank_logits)
                self._rerankers[key] = r
        return r

    @staticmethod
    def engine_key(d: "Domain") -> tuple:
        return (d.embeddings_url, d.embeddings_model, d.endpoint_timeout_ms, d.api_key_env,
                d.api_key_file, d.ca_file)

    def engine(self, d: "Domain") -> "Engine":
        """The engine of the domain's embeddings endpoint. Raises :class:`EndpointError`
        when it cannot be built now (the endpoint does not answer the dimension probe;
        probed without the lock, so a slow endpoint holds up no other domain)."""
        key = self.engine_key(d)
        eng = self._engines.get(key)
        if eng is not None:
            return eng
        failed = self._failed_at.get(key)
        if failed is not None and time.monotonic() - failed < COOLDOWN_S:
            raise EndpointError(f"{d.embeddings_url} failed less than {COOLDOWN_S:g} s ago")
        model = RemoteEmbeddings(d.embeddings_url, d.embeddings_model,
                                 _timeout(d, self.parent.embed_timeout_s), self.access(d))
        try:
            model.probe()
        except EndpointError:
            self._failed_at[key] = time.monotonic()
            raise
        with self._lock:
            eng = self._engines.get(key)
            if eng is None:
                eng = self.parent.child(model)
                self._engines[key] = eng
                log.info("semantic domain embeddings from %s (model %s, %d dimensions)",
                         model.endpoint.url, model.model_id, model.dim)
        return eng

    def models(self) -> list[dict]:
        """``[{"model_id", "dim", "url"}]`` of the embeddings endpoints in use (built)."""
        with self._lock:
            engines = list(self._engines.values())
        return [{"model_id": e.model.model_id, "dim": e.model.dim,
                 "url": getattr(getattr(e.model, "endpoint", None), "url", "")}
                for e in engines]

    def close(self) -> None:
        with self._lock:
            engines = list(self._engines.values())
            self._engines.clear()
        for e in engines:
            e.close()
