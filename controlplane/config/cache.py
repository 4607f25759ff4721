"""The ``[cache]`` section (response cache, exact and semantic)."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from controlplane.config.base import _Section, key_message
from controlplane.config.routing import check_abs_file, check_api_key_env


#: A cosine similarity, 0-1.
Similarity = Annotated[float, Field(ge=0.0, le=1.0)]
#: The paths a per-route similarity may name.
CACHE_PATHS = ("/v1/chat/completions", "/v1/completions")


def check_languages(where: str, v: list[str]) -> list[str]:
    """``v`` (a list of ISO 639-1 codes or ``"*"``, lower-cased) or ValueError naming
    ``where`` and the unknown code."""
    from controlplane.embedder import language

    out = [c.strip().lower() for c in v]
    for code in out:
        if not language.valid_code(code):
            raise ValueError(f"{where}: unknown language {code!r}; use ISO 639-1 codes "
                             f"({', '.join(language.CANDIDATES)}) or \"*\" for any")
    return out


class SemanticDomain(_Section):
    """Thresholds of one domain of the semantic cache, applied by the embedder (written by
    ``infergate cache calibrate``). A domain matches a lookup when every matcher it sets
    matches: ``route`` (request path), ``model`` (requested model), ``namespace_prefix``
    (leading hex digits of the semantic namespace). The embedder applies the most specific
    matching domain (a namespace prefix counts most, then the model, then the route; a
    longer prefix wins a tie) and it overrides the edge's ``min_similarity`` values."""

    route: str = ""
    model: str = ""
    namespace_prefix: str = Field(default="", pattern=r"^[0-9a-f]{0,64}$")
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Cosine (0-1) a candidate needs; unset = the edge's value or the embedder default."""
    min_verifier_score: float | None = Field(default=None, ge=0.0, le=1.0)
    """Verifier probability (0-1) a hit needs; unset = the verifier's own default."""
    verifier: bool | None = None
    """Use the verifier in this domain (false: cosine and the precision guard only);
    unset = ``cache.verifier``."""
    verifier_file: str = ""
    """This domain's own verifier file (``infergate cache calibrate --train-verifier``);
    empty = ``cache.verifier_file``, else the bundled verifier."""
    languages: list[str] | None = None
    """Languages whose questions may get a semantic hit in this domain (ISO 639-1 codes,
    ``"*"`` = any); unset = ``cache.semantic_languages``. ``infergate cache calibrate``
    writes the languages of the pairs it was run on."""
    pairs: int = Field(default=0, ge=0, le=10**9)
    """Informational, from calibration: labelled pairs the thresholds were chosen on."""
    hit_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    """Informational: share of matching pairs served at these thresholds (0-1)."""
    wrong_hit_upper: float | None = Field(default=None, ge=0.0, le=1.0)
    """Informational: 95 % upper bound of the wrong-hit rate at these thresholds (0-1)."""
    embeddings_url: str = ""
    """An OpenAI-compatible ``POST /v1/embeddings`` of the pool (llama.cpp ``llama-server
    --embeddings``, vLLM, TEI) that embeds this domain's questions instead of the bundled
    model: its root (``http://host:port``), ``.../v1`` or the full ``.../embeddings`` URL.
    Its vectors go to an index of their own (keyed by ``embeddings_model`` and the host),
    never compared with another model's. Empty = the embedder's own model."""
    embeddings_model: str = Field(default="", max_length=256)
    """``model`` sent to ``embeddings_url`` (also names the domain's vector index)."""
    rerank_url: str = ""
    """A rerank endpoint used as this domain's verifier instead of the learned one: the
    full URL (llama.cpp ``/v1/rerank`` with ``--reranking``, vLLM ``/v1/rerank`` or
    ``/rerank``, TEI ``/rerank``, or any Jina/Cohere-shaped service). Empty = none."""
    rerank_model: str = Field(default="", max_length=256)
    """``model`` sent to ``rerank_url``."""
    rerank_format: Literal["jina", "tei"] = "jina"
    """Request and answer shape of ``rerank_url``: ``jina`` = ``{"model", "query",
    "documents", "top_n"}`` -> ``{"results": [{"index", "relevance_score"}]}`` (llama.cpp,
    vLLM, Jina, Cohere); ``tei`` = ``{"query", "texts"}`` -> ``[{"index", "score"}]``."""
    rerank_logits: bool = False
    """The rerank scores are logits (llama.cpp returns the model's raw score): the
    embedder maps them to 0-1 with the logistic function before comparing them with
    ``min_verifier_score``. False: scores are probabilities (vLLM, TEI, Jina, Cohere)."""
    endpoint_timeout_ms: int = Field(default=100, ge=10, le=30000)
    """Time one call of ``embeddings_url`` or ``rerank_url`` may take, milliseconds (never
    more than the embedder's own embedding timeout, 5 s); over it, or on any error, the
    lookup misses (the request goes to a node) and the endpoint is skipped for 3 s. Keep
    it under ``semantic_budget_ms`` (150): the edge gives up on a lookup after that, and a
    lookup may wait for both endpoints. Index jobs use it too (a batch of up to 32 texts)."""
    api_key_env: str = ""
    """Name of an environment variable of the embedder holding the endpoints' API key,
    sent as ``Authorization: Bearer KEY`` (as a node's ``api_key_env``)."""
    api_key_file: str = ""
    """Absolute path of a file holding the endpoints' API key (first line), as a node's."""
    ca_file: str = ""
    """PEM file of the CA of ``https://`` endpoints (else ``controlplane.node_ca_file``,
    else the system bundle)."""

    @field_validator("embeddings_url", "rerank_url")
    @classmethod
    def _endpoint_url(cls, v: str) -> str:
        if not v:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise ValueError("an http:// or https:// URL without a query")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"port: {exc}") from exc
        return v.rstrip("/")

    _key_env = field_validator("api_key_env")(classmethod(
        lambda cls, v: check_api_key_env(v)))
    _abs_file = field_validator("api_key_file", "ca_file")(classmethod(
        lambda cls, v: check_abs_file(v)))
    _languages = field_validator("languages")(classmethod(
        lambda cls, v: None if v is None else check_languages("languages", v)))

    @property
    def remote(self) -> bool:
        """The domain uses an endpoint of the pool (embeddings or rerank)."""
        return bool(self.embeddings_url or self.rerank_url)

    @model_validator(mode="after")
    def _some_threshold(self) -> "SemanticDomain":
        if self.min_similarity is None and self.min_verifier_score is None and not self.remote:
            raise ValueError("a semantic domain needs min_similarity or min_verifier_score "
                             "(or an embeddings_url / rerank_url, whose defaults apply)")
        if self.api_key_env and self.api_key_file:
            raise ValueError("set one of api_key_env and api_key_file, not both")
        return self


class CacheSettings(_Section):
    """Response cache at the edge: exact (Redis) and semantic (embedder).

    Off unless ``enabled``: serving a stored answer to another request changes what a
    sampled (temperature > 0) request returns, so an operator opts in. ``infergate up``
    turns it on (and starts the embedder) unless the file sets ``enabled`` itself."""

    enabled: bool = False
    ttl_s: int = Field(default=3600, ge=1, le=366 * 24 * 3600)
    """Lifetime of a stored answer, seconds (absolute: hits never extend it)."""
    max_entry_bytes: int = Field(default=262144, ge=1024, le=64 * 1024 * 1024)
    """Largest answer captured for the cache (bytes as sent by the node, JSON or SSE);
    a larger answer is passed on and not stored."""
    max_request_bytes: int = Field(default=1048576, ge=1024, le=64 * 1024 * 1024)
    """Largest request body that takes part in the cache, bytes; a larger one bypasses it
    (``X-Cache-Status: BYPASS``, neither read nor stored), so working out its key (a
    canonical encoding of the whole body) stays cheap."""
    max_request_members: int = Field(default=5000, ge=1, le=10_000_000)
    """Most JSON members (object fields and array elements, at any depth, of the decoded
    body) a request may have to take part in the cache; one with more bypasses it
    (``X-Cache-Status: BYPASS``, neither read nor stored; a warning in the error log at
    most once a minute). Working out the key costs about 1.5-8 us per member on one core
    (sorting and encoding every field); at 5,000 that is at most ~40 ms of a worker,
    while chat requests, even long conversations with tool schemas, have a few hundred
    to a few thousand. The input guard's ``edge.max_json_members`` is far higher."""
    max_temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Requests with a higher ``temperature`` bypass the cache. A request without
    ``temperature`` counts as the API default 1.0, so it is cached with this default."""
    stream_usage: bool = True
    """A stream whose answer is stored and that did not ask for
    ``stream_options.include_usage`` is sent to the node with ``"stream_options":
    {"include_usage": true}`` (the usage-only last chunk is taken out of what the client
    receives), so every stored entry carries usage and answers streaming and
    non-streaming requests alike; false = the body goes to the node as sent (for nodes
    that refuse ``stream_options``), and such an entry answers only streams without usage."""
    semantic: bool = True
    """Look up paraphrases through the embedder when the exact key misses."""
    embedder_url: str = "http://127.0.0.1:8090"
    """Root of the embedder service (``infergate embedder``), ``http://host:port``."""
    semantic_budget_ms: int = Field(default=150, ge=1, le=10000)
    """Time budget of one semantic lookup (connect, send and read timeouts of the
    subrequest); over it the request goes on to a node with ``X-Cache-Status: BYPASS``."""
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Cosine similarity (0-1) a semantic hit needs; unset = the embedder's default: the
    verifier's floor (0.5) when the verifier is on, else the model's threshold (0.98 for
    all-MiniLM-L6-v2 and use-multilingual-v3, chosen on the cache-eval dev sets, see
    docs/performance.md). 0 is a value."""
    min_similarity_routes: dict[str, Similarity] = Field(
        default={}, json_schema_extra={"keys": {"enum": list(CACHE_PATHS), "name": "path"}})
    """Per path (``/v1/chat/completions``, ``/v1/completions``), overrides ``min_similarity``."""
    min_similarity_models: dict[str, Similarity] = {}
    """Per requested ``model``, overrides the route and global values."""
    coalesce: bool = True
    """Identical requests that miss at the same time: one goes to a node, the others wait
    for its answer (per edge, shared by the nginx workers)."""
    coalesce_wait_s: float = Field(default=10.0, ge=0.0, le=600.0)
    """Longest wait for the first request's answer; then a waiter goes to a node itself."""
    coalesce_stream_wait_s: float = Field(default=1.0, ge=0.0, le=600.0)
    """Longest wait of a streamed request for an identical one's answer, seconds: its
    client sees nothing while it waits, so an answer longer than this costs its first
    token that long, and then it goes to a node itself (plain nginx: no wait). 0 =
    streams never wait."""
    coalesce_poll_ms: int = Field(default=50, ge=5, le=5000)
    """How often a waiting request looks for the answer in Redis, milliseconds."""
    embedder_token: str = Field(default="", pattern=r"^([A-Za-z0-9._~+/=-]{16,256})?$")
    """Shared secret (16-256 characters of ``A-Za-z0-9._~+/=-``; "" = none) the edge and
    the control plane send the embedder as ``Authorization: Bearer``; with one set the
    embedder refuses lookups, index writes and embeddings without it (401), so another
    process on the host can neither read stored prompts nor point a question at another
    answer. ``infergate up`` sets a random one. Also ``INFERGATE_EMBEDDER_TOKEN``."""
    local_ttl_ms: int = Field(default=0, ge=0, le=60000)
    """How long each nginx worker keeps an entry it read from Redis and answers repeats of
    it from memory, milliseconds (0 = off: every hit reads Redis). Hits of hot entries
    then cost no Redis round trip, but a purged or flagged entry may still answer from a
    worker's copy for that long (never past the entry's own TTL); at most 1000 entries
    and 16 MB per worker."""
    verifier: bool = True
    """The embedder checks every candidate with its learned verifier (a logistic regression
    over both vectors and the precision guard's signals) and retrieves from the verifier's
    cosine floor instead of the model's ``min_similarity`` default."""
    verifier_file: str = ""
    """Verifier JSON file (``infergate cache calibrate --train-verifier``); empty = the one
    shipped for the embedder's model, if any."""
    semantic_languages: list[str] = ["en", "zh"]
    """Languages (ISO 639-1 codes, ``"*"`` = any) whose questions may get a semantic hit;
    both questions must be in the same one. A question in another language gets exact
    hits only: the precision guard's word lists and the verifier's training pairs are
    English and Chinese, and in other languages a negation or another number passes the
    guard unseen (docs/cache.md#languages). Add a language after calibrating a domain on
    pairs of it (its ``languages``). The embedder detects the language (script, then
    py3langid)."""
    semantic_domains: list[SemanticDomain] | None = None
    """Per-domain thresholds applied by the embedder (``[[cache.semantic_domains]]``);
    unset = none (None rather than ``[]``: the edge's options document drops nulls, and it
    cannot tell an empty array from an empty table)."""
    semantic_index_max_rows: int = Field(default=100_000, ge=1000, le=100_000_000)
    """Most vectors the embedder's in-process index holds (``local`` backend: Redis
    without the search module), per embedding model and per embedder process; over it the
    vectors expiring soonest leave the index (their entries still answer exact hits;
    logged once). About 2 KB each at 512 dimensions plus the question's text."""
    embedder_model: str = "use-multilingual-v3"
    """Model ``infergate up`` starts the embedder with: use-multilingual-v3 (numpy, no
    torch, 16 languages) or, with the ``semantic`` extra, all-MiniLM-L6-v2 or any
    sentence-transformers name or path."""
    explain: bool = False
    """A request with the header ``X-Cache-Explain: 1`` gets, on a semantic hit or miss,
    the header ``X-Cache-Explain`` with what the embedder decided on: the closest
    candidate's cosine, the verifier's score, both thresholds, the precision guard's
    verdict, the score that decided and the embedding model. Off by default: the figures
    tell a client how close its question came to another one stored."""
    verify_fraction: float = Field(default=0.02, ge=0.0, le=1.0)
    """Share (0-1) of semantic hits the edge also queues for online verification (the
    hit is served all the same); 0 = off. The control plane's leader sends each queued
    request (non-streaming) to a healthy node and compares the fresh answer with the
    cached one (``controlplane.cache.verify``)."""
    verify_answer_similarity: float = Field(default=0.9, ge=0.0, le=1.0)
    """Cosine (0-1) of the two answers' embeddings (from the embedder) at or above which a
    verified hit counts as right; equal texts (up to case and spaces) always do."""
    verify_max_wrong: float = Field(default=0.01, gt=0.0, le=1.0)
    """Target wrong-hit rate of a namespace (0-1, as ``infergate cache calibrate
    --max-wrong``): when the 95 % (Wilson) upper bound of its measured wrong rate is above
    it, the namespace's semantic threshold goes up by ``verify_threshold_step``; under
    half of it, back down by a step (never below the configured threshold)."""
    verify_threshold_step: float = Field(default=0.01, gt=0.0, le=1.0)
    """Step of one threshold change of a namespace (added to the verifier score threshold,
    or the cosine threshold without the verifier)."""
    verify_max_raise: float = Field(default=0.05, ge=0.0, le=1.0)
    """Largest raise of a namespace's threshold above the configured one (0-1)."""
    verify_queue_max: int = Field(default=1000, ge=1, le=1000000)
    """Longest the verification queue grows (items; the edge trims the oldest)."""
    verify_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0)
    """Time a verification request to a node may take, seconds."""

    @field_validator("embedder_url")
    @classmethod
    def _embedder_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError("cache.embedder_url must be http://host:port")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError("cache.embedder_url is the embedder root, without a path")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"cache.embedder_url port: {exc}") from exc
        return v.rstrip("/")

    @field_validator("semantic_languages")
    @classmethod
    def _languages(cls, v: list[str]) -> list[str]:
        return check_languages("cache.semantic_languages", v)

    @field_validator("min_similarity_routes")
    @classmethod
    def _routes(cls, v: dict[str, float]) -> dict[str, float]:
        for path in v:
            if path not in CACHE_PATHS:
                raise ValueError(key_message("cache.min_similarity_routes", path, CACHE_PATHS,
                                             "path"))
        return v
