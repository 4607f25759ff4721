"""HTTP API of the embedder (Flask, served by waitress).

Endpoints (JSON in and out):

- ``POST /v1/lookup`` ``{"namespace": hex, "text": str, "min_similarity"?: 0-1,
  "guard"?: bool, "route"?: str, "model"?: str}`` -> 200 :class:`engine.LookupResult`
  fields ``{"hit", "key", "similarity", "candidate_text", "guard", "model_id",
  "elapsed_ms", "min_similarity", "verifier_score", "min_verifier_score", "decided_by"}``
  (a domain served by endpoints of the pool answers a miss, never an error, while they
  fail: ``remote.py``).
- ``POST /v1/lookups`` ``{"lookups": [<a /v1/lookup body>, ...], "brief"?: bool}`` (1-64
  lookups) -> 200 ``{"results": [...]}`` in the same order, each a ``/v1/lookup`` answer
  (without ``candidate_text`` when ``brief``) or, for a malformed item,
  ``{"error": {...}}`` as a 400 would carry; the texts are embedded in one
  model call (the edge sends the lookups that arrive while its earlier ones are in flight
  as one such call).
- ``POST /v1/index`` ``{"key": hex, "namespace": hex, "text": str, "ttl_s": int, "model"?,
  "tenant"?}`` -> 200 ``{"indexed": bool, "key", "ttl_ms": int, "model_id"}``
  (``indexed`` false when the entry exists with no time left).
- ``POST /v1/embeddings`` OpenAI-compatible (``input`` str or list of str,
  ``encoding_format`` float | base64) -> ``{"object": "list", "data": [...], "model", "usage"}``.
- ``GET /healthz`` -> 200 ``{"status": "ok", "model_id", "dim", "index_backend",
  "default_min_similarity", "verifier": bool, "default_min_verifier_score": 0-1 | null,
  "semantic_domains": int, "pool_models": [{"model_id", "dim", "url"}], "redis": true,
  "instance_id": str}`` (``pool_models``: the embeddings endpoints of the pool that
  semantic domains use, once first used; see ``remote.py``) (and the
  ``X-Infergate-Instance`` header: the stack instance id ``INFERGATE_INSTANCE_ID`` set by
  ``infergate up``, ``""`` otherwise); 503 with ``"status": "degraded"`` and
  ``"redis": false`` while Redis does not answer.
- ``GET /metrics`` -> Prometheus text format (with ``--processes`` > 1, the sum over the
  service's processes: prometheus_client's multiprocess mode).

Errors: 400 ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``
for bad input (also 404/405/413 in the same shape); 503 ``{"error": {..., "type":
"service_unavailable"}}`` when Redis or the model cannot serve. The edge treats any
non-200 as BYPASS.
"""

from __future__ import annotations

import base64
import logging
import os
import time

import numpy as np
import redis
from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from controlplane import procs
from controlplane.embedder.engine import Engine, EngineUnavailable
from controlplane.embedder.wire import (BadRequest, embeddings_request, index_item, lookup_batch,
                                       lookup_request)

log = logging.getLogger("infergate.embedder")

MAX_BODY_BYTES = 4 * 1024 * 1024


def _error(status: int, message: str, etype: str, param: str | None = None,
           code: str | None = None) -> tuple[Response, int]:
    return jsonify({"error": {"message": message, "type": etype, "param": param,
                              "code": code}}), status


def _body() -> object:
    """The request's JSON body; raises :class:`BadRequest` when it is missing, not JSON or
    nested too deeply."""
    try:
        data = request.get_json(silent=True)
    except RecursionError:
        raise BadRequest("body is nested too deeply to be a request") from None
    if data is None:
        raise BadRequest("body must be JSON (Content-Type: application/json)")
    return data


def _require_token(app: Flask, token: str) -> None:
    """When ``token`` is set, every ``/v1/`` request needs ``Authorization: Bearer
    <token>`` (401 ``invalid_embedder_token`` otherwise)."""
    import hmac

    expected = f"Bearer {token}".encode() if token else b""

    @app.before_request
    def _auth():
        if not expected or not request.path.startswith("/v1/"):
            return None
        got = request.headers.get("Authorization", "").encode("latin-1", "replace")
        if hmac.compare_digest(got, expected):
            return None
        return _error(401, "this embedder needs Authorization: Bearer <cache.embedder_token>",
                      "authentication_error", code="invalid_embedder_token")


def _add_error_handlers(app: Flask, engine: Engine) -> None:
    """Errors as OpenAI-style JSON: 400 bad input, 503 Redis or model away, 500 else."""
    @app.errorhandler(BadRequest)
    def _bad(exc: BadRequest):
        return _error(400, str(exc), "invalid_request_error", exc.param)

    @app.errorhandler(EngineUnavailable)
    def _unavailable(exc: EngineUnavailable):
        return _error(503, f"embedding unavailable: {exc}", "service_unavailable",
                      code="model_unavailable")

    @app.errorhandler(redis.exceptions.RedisError)
    def _redis_down(exc: redis.exceptions.RedisError):
        engine.metrics.errors.labels("redis").inc()
        return _error(503, f"redis unavailable: {exc}", "service_unavailable",
                      code="redis_unavailable")

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        return _error(exc.code or 500, exc.description or exc.name, "invalid_request_error")

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")


def _add_cache_routes(app: Flask, engine: Engine) -> None:
    """``POST /v1/lookup``, ``/v1/lookups`` and ``/v1/index`` (see the module)."""
    @app.post("/v1/lookup")
    def lookup():
        t0 = time.perf_counter()
        req = lookup_request(_body())
        res = engine.lookup(req.namespace, req.text, req.min_similarity, req.guard, started=t0,
                            route=req.route or None, model=req.model or None)
        return jsonify(res.to_dict())

    @app.post("/v1/lookups")
    def lookups():
        t0 = time.perf_counter()
        data = _body()
        items = lookup_batch(data)
        brief = isinstance(data, dict) and data.get("brief") is True
        good = [it for it in items if not isinstance(it, BadRequest)]
        found = iter(engine.lookup_many(good, started=t0) if good else [])
        results = []
        for it in items:
            if isinstance(it, BadRequest):
                results.append({"error": {"message": str(it), "type": "invalid_request_error",
                                          "param": it.param, "code": None}})
            else:
                res = next(found).to_dict()
                if brief:
                    del res["candidate_text"]
                results.append(res)
        return jsonify({"results": results})

    @app.post("/v1/index")
    def index():
        item = index_item(_body())
        ttl_ms = engine.index_items([item], source="api")[0]
        return jsonify({"indexed": ttl_ms > 0, "key": item.key, "ttl_ms": ttl_ms,
                        "model_id": engine.model.model_id})


def _add_embeddings_route(app: Flask, engine: Engine) -> None:
    """``POST /v1/embeddings``, OpenAI-compatible."""
    @app.post("/v1/embeddings")
    def embeddings():
        texts, fmt = embeddings_request(_body())
        vecs = engine.embed(texts)
        data = []
        for i, v in enumerate(vecs):
            emb: object = (base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
                           if fmt == "base64" else [float(x) for x in v])
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return jsonify({"object": "list", "data": data, "model": engine.model.model_id,
                        "usage": {"prompt_tokens": 0, "total_tokens": 0}})


def _add_service_routes(app: Flask, engine: Engine) -> None:
    """``GET /healthz`` and ``GET /metrics`` (open without the token)."""
    @app.get("/healthz")
    def healthz():
        try:
            engine.r.ping()
            ok = True
        except redis.exceptions.RedisError:
            ok = False
        doc = {"status": "ok" if ok else "degraded", "model_id": engine.model.model_id,
               "dim": engine.model.dim, "index_backend": engine.index.backend,
               "default_min_similarity": engine.default_min_similarity,
               "verifier": engine.verifier_active,
               "default_min_verifier_score": engine.thresholds("")[1],
               "semantic_domains": len(engine.policy.current().domains),
               "pool_models": engine.pool.models(), "redis": ok,
               "instance_id": procs.instance_id()}
        return jsonify(doc), 200 if ok else 503, {procs.INSTANCE_HEADER: procs.instance_id()}

    @app.get("/metrics")
    def metrics():
        registry = engine.metrics.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import CollectorRegistry, multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


def create_app(engine: Engine, token: str = "") -> Flask:
    """The Flask app serving ``engine``. ``token`` (``cache.embedder_token``): when set,
    every ``/v1/`` endpoint needs ``Authorization: Bearer <token>`` (401
    ``invalid_embedder_token`` otherwise); ``/healthz`` and ``/metrics`` stay open."""
    app = Flask("infergate.embedder")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    _require_token(app, token)
    _add_error_handlers(app, engine)
    _add_cache_routes(app, engine)
    _add_embeddings_route(app, engine)
    _add_service_routes(app, engine)
    return app
