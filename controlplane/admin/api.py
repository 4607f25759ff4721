"""JSON API under ``/api/v1`` (blueprint ``api``).

Auth: ``Authorization: Bearer <controlplane.admin_token>`` (see :mod:`.auth`; GET also
accepts the page's session cookie). Errors are JSON
``{"error": {"message": str, "type": str, "code": str}}`` with the status:

- 400 ``invalid_request_error`` — bad JSON or value (message names the field)
- 401 ``authentication_error`` — missing (``missing_admin_token``) or wrong
  (``invalid_admin_token``) token
- 403 ``permission_error`` / ``admin_token_unset`` — no admin token configured
- 404 ``not_found_error`` — unknown node, key or endpoint
- 405 ``invalid_request_error`` / ``method_not_allowed``
- 409 ``conflict_error`` / ``node_exists`` — node name already registered; ``node_url_taken``
  — its server (URL) is already registered under another name
- 429 ``rate_limit_error`` / ``admin_auth_throttled`` — too many wrong Bearer tokens from
  this client address (:mod:`.auth`), with ``Retry-After`` (seconds)
- 503 ``unavailable_error`` / ``redis_unavailable`` — Redis unreachable

Every change writes an event with actor ``admin@ADDR (api)`` (:func:`.auth.actor`).
"""

from __future__ import annotations

import json
import time

import flask
import redis
from werkzeug.exceptions import HTTPException

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.admin import auth, ops
from controlplane.admin.nodeview import build_view, build_views
from controlplane.routing.nodeaccess import redact_snapshot
from controlplane.routing.wire import RoutingSnapshot, WireError

bp = flask.Blueprint("api", __name__, url_prefix="/api/v1")


def error(status: int, message: str, type_: str, code: str) -> flask.Response:
    resp = flask.jsonify({"error": {"message": message, "type": type_, "code": code}})
    resp.status_code = status
    return resp


def _r() -> redis.Redis:
    return flask.current_app.extensions["infergate"]["redis"]


def _events_max() -> int:
    return auth.settings().controlplane.events_max


@bp.before_request
def _authenticate() -> flask.Response | None:
    if not auth.admin_token():
        return error(403, auth.DISABLED_MESSAGE, "permission_error", "admin_token_unset")
    sent = auth.bearer()
    if sent is not None:
        if auth.token_ok(sent):
            return None  # a correct token is never throttled
        wait = auth.throttle_wait()
        if wait:
            resp = error(429, f"too many failed admin token attempts from this address; "
                              f"retry in {wait} s", "rate_limit_error", "admin_auth_throttled")
            resp.headers["Retry-After"] = str(wait)
            return resp
        auth.attempt_failed()
        return error(401, "invalid admin token", "authentication_error", "invalid_admin_token")
    if flask.request.method in ("GET", "HEAD") and auth.logged_in():
        return None
    return error(401, "missing admin token: send 'Authorization: Bearer <admin token>'",
                 "authentication_error", "missing_admin_token")


@bp.errorhandler(ops.AdminError)
def _admin_error(exc: ops.AdminError) -> flask.Response:
    return error(exc.status, exc.message, exc.type, exc.code)


@bp.errorhandler(apikeys.ApiKeyError)
@bp.errorhandler(cache_store.CacheStoreError)
def _value_error(exc: ValueError) -> flask.Response:
    return error(400, str(exc), "invalid_request_error", "invalid_value")


@bp.errorhandler(redis.exceptions.RedisError)
def _redis_error(exc: redis.exceptions.RedisError) -> flask.Response:
    return error(503, f"Redis unavailable: {exc}", "unavailable_error", "redis_unavailable")


@bp.errorhandler(HTTPException)
def _http_error(exc: HTTPException) -> flask.Response:
    status = exc.code or 500
    if status == 404:
        return error(404, "unknown API endpoint", "not_found_error", "unknown_endpoint")
    if status == 405:
        return error(405, f"method {flask.request.method} not allowed here",
                     "invalid_request_error", "method_not_allowed")
    if status >= 500:
        return error(status, exc.description or exc.name, "server_error", "internal_error")
    return error(status, exc.description or exc.name, "invalid_request_error", "bad_request")


def _body() -> dict:
    """The JSON object body; raises :class:`ops.BadInput` when missing, not UTF-8 (RFC
    8259 section 8.1), not JSON or not an object."""
    try:
        raw = flask.request.get_data(cache=True).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ops.BadInput(f"body is not UTF-8 text (byte {exc.start})", "invalid_json") from None
    if not raw.strip():
        raise ops.BadInput("expected a JSON object body", "invalid_json")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ops.BadInput("body is not valid JSON: nested too deeply", "invalid_json") from None
    except ValueError as exc:
        # the decoder's own words, without the hint to Python settings of its int limit
        why = str(exc).split(";")[0] if "int_max_str_digits" in str(exc) else str(exc)
        raise ops.BadInput(f"body is not valid JSON: {why}", "invalid_json") from None
    if not isinstance(data, dict):
        raise ops.BadInput("expected a JSON object body", "invalid_json")
    return data


def _int_arg(name: str, default: int, lo: int, hi: int) -> int:
    raw = flask.request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ops.BadInput(f"{name} must be an integer between {lo} and {hi}") from None
    if not lo <= v <= hi:
        raise ops.BadInput(f"{name} must be an integer between {lo} and {hi}")
    return v


def _flag(name: str) -> bool:
    return flask.request.args.get(name, "").lower() in ("1", "true", "yes", "on")


# ---- nodes ---------------------------------------------------------------------------


@bp.get("/nodes")
def list_nodes() -> flask.Response:
    """``{"ts": epoch_s, "nodes": [NodeView...]}`` — see :class:`.nodeview.NodeView` for
    fields and units. ``?history=1`` adds each node's last 5 minutes of history."""
    views = build_views(_r(), auth.settings(), history=_flag("history"))
    return flask.jsonify({"ts": time.time(), "nodes": [v.to_dict() for v in views]})


@bp.get("/nodes/<name>")
def get_node(name: str) -> flask.Response:
    """One NodeView with ``history`` and its 20 most recent ``events``; 404 if unknown."""
    v = build_view(_r(), auth.settings(), name)
    if v is None:
        raise ops.NotFound(f"no node named {name!r}", "node_not_found")
    d = v.to_dict()
    d["events"] = registry.recent_events(_r(), 20, node=name)
    return flask.jsonify(d)


@bp.post("/nodes")
def add_node() -> tuple[flask.Response, int]:
    """Add a node: body ``{"name", "url", "kind"?, "weight"?, "max_concurrency"?,
    "metrics_path"?, "health_path"?}`` validated by ``NodeSettings``. 201 with the node
    document; 400 invalid; 409 name taken."""
    node = ops.add_node(_r(), _body(), auth.actor("api"), _events_max(), settings=auth.settings())
    return flask.jsonify(ops.node_json(node)), 201


@bp.patch("/nodes/<name>")
def edit_node(name: str) -> flask.Response:
    """Change fields of a node (``url``, ``kind``, ``weight``, ``max_concurrency``,
    ``metrics_path``, ``health_path``). 200 with the node document; 400; 404."""
    node = ops.edit_node(_r(), name, _body(), auth.actor("api"), _events_max(), settings=auth.settings())
    return flask.jsonify(ops.node_json(node))


@bp.delete("/nodes/<name>")
def delete_node(name: str) -> flask.Response:
    """Remove a node with its state, metrics and history. ``{"deleted": name}``; 404."""
    ops.remove_node(_r(), name, auth.actor("api"), _events_max())
    return flask.jsonify({"deleted": name})


@bp.post("/nodes/<name>/drain")
def drain(name: str) -> flask.Response:
    """Start draining: ``{"name", "state", "since", "actor", "changed", "warning"}``.
    Idempotent (200 with ``changed: false`` when already draining/drained); 404 unknown
    node. Never refused for leaving a model without an active node (maintenance), but
    ``warning`` then says which models (their requests get 503 ``no_healthy_upstream``);
    ``""`` otherwise."""
    return flask.jsonify(ops.drain(_r(), name, auth.actor("api"), _events_max()).to_dict())


@bp.post("/nodes/<name>/undrain")
def undrain(name: str) -> flask.Response:
    """Back to ``active`` (slow start from ``since``); same shape as drain (``warning``
    empty); 404."""
    return flask.jsonify(ops.undrain(_r(), name, auth.actor("api"), _events_max()).to_dict())


# ---- events, snapshot ------------------------------------------------------------------


@bp.get("/events")
def events() -> flask.Response:
    """Newest first: ``{"events": [{"id", "ts", "kind", "node", "actor", "detail"}]}``.
    ``?limit=`` 1-1000 (default 100), ``?node=`` only that node's events."""
    limit = _int_arg("limit", 100, 1, 1000)
    node = flask.request.args.get("node") or None
    return flask.jsonify({"events": registry.recent_events(_r(), limit, node=node)})


@bp.get("/snapshot")
def snapshot() -> flask.Response:
    """The routing snapshot as the edge reads it (``infergate:v1:routing``, see
    :class:`controlplane.routing.wire.RoutingSnapshot`), each node's API key (``auth``)
    replaced by ``"[redacted]"`` (the stored bytes when no node has one); 404
    ``no_snapshot`` before the first control-plane cycle; 500 ``bad_snapshot`` when the
    stored value is not a JSON object."""
    raw = _r().get(keynames.ROUTING)
    if not raw:
        raise ops.NotFound("no routing snapshot yet (is the control plane running?)",
                           "no_snapshot")
    try:
        RoutingSnapshot.from_json(raw)
    except WireError as exc:
        return error(500, f"routing snapshot in Redis is unreadable: {exc}", "server_error",
                     "bad_snapshot")
    return flask.Response(redact_snapshot(raw) if '"auth":"' in raw else raw,
                          mimetype="application/json")


# ---- overview ------------------------------------------------------------------------


@bp.get("/overview")
def overview() -> flask.Response:
    """The pool's traffic over ``?window=`` 300 (default) or 3600 seconds, from the
    control plane's time series (:mod:`controlplane.routing.series`, one point per 5 s).

    ``{"ts": epoch_s, "window_s": int, "slot_s": float, "points": int,
    "series": {"ts": [slot end epoch_s], "rps": [req/s], "hit_rate": [0-1],
    "hit_rate_exact", "hit_rate_semantic", "p50_ms": [ms], "p99_ms", "shed_rps",
    "rate_limited_rps", "error_rate": [0-1], "errors_rps"}, "totals": {the same figures
    over the whole window plus the counts: "requests", "lookups", "hits_exact",
    "hits_semantic", "misses", "bypass", "shed", "rate_limited", "deadline_exceeded",
    "auth_rejected", "proxied", "failures", "shed_share", "rate_limited_share",
    "seconds"}, "nodes": {name: {"series": {"ts", "rps", "error_rate", "latency_ms",
    "inflight"}, "totals": {"requests", "failures", "rps", "error_rate", "latency_ms",
    "inflight", "seconds"}}}}``. Values are ``null`` where a slot has no point or no
    denominator. 400 for another window."""
    from controlplane.routing import series

    window = _int_arg("window", series.WINDOWS_S[0], 1, int(series.KEEP_S))
    if window not in series.WINDOWS_S:
        raise ops.BadInput("window must be 300 or 3600 (seconds)")
    return flask.jsonify(series.read(_r(), window))


# ---- cache ---------------------------------------------------------------------------


@bp.get("/cache/stats")
def cache_stats() -> flask.Response:
    """:class:`controlplane.cache.store.CacheStats` as JSON (hit rates 0-1, bytes)."""
    return flask.jsonify(cache_store.stats(_r()).to_dict())


@bp.get("/cache")
def cache_overview() -> flask.Response:
    """The cache's figures with its namespaces: ``{"stats": CacheStats, "namespaces":
    [NamespaceStats...], "verify": {"fraction", "answer_similarity", "max_wrong",
    "threshold_step", "max_raise"}}``. Per namespace (most hits first, at most
    ``?limit=`` 1-1000, default 50): ``hits_exact``, ``hits_semantic``, ``flagged``,
    ``verify_queued``, ``verified``, ``wrong``, ``verify_errors``, ``wrong_rate`` (0-1,
    null before a verdict), ``wrong_rate_upper`` (95 % Wilson upper bound, 0-1) and
    ``threshold_raise`` (0-1 above the configured threshold); see
    :class:`controlplane.cache.store.NamespaceStats`."""
    r = _r()
    c = auth.settings().cache
    limit = _int_arg("limit", 50, 1, 1000)
    return flask.jsonify({
        "stats": cache_store.stats(r).to_dict(),
        "namespaces": [n.to_dict() for n in cache_store.namespace_stats(r, limit)],
        "verify": {"fraction": c.verify_fraction, "answer_similarity": c.verify_answer_similarity,
                   "max_wrong": c.verify_max_wrong, "threshold_step": c.verify_threshold_step,
                   "max_raise": c.verify_max_raise},
    })


@bp.post("/cache/entries/<entry_id>/flag")
def cache_flag(entry_id: str) -> flask.Response:
    """Flag a served answer as wrong (``entry_id`` = the ``X-Cache-Entry`` header of the
    hit): drops the entry and its semantic vectors and counts a flag for its namespace
    (:func:`.ops.flag_entry`). ``{"id", "namespace", "dropped", "flagged"}``;
    idempotent (``dropped: false`` when flagged before); 404 ``entry_not_found`` for an
    unknown or expired id."""
    return flask.jsonify(ops.flag_entry(_r(), entry_id, auth.actor("api"), _events_max()).to_dict())


@bp.post("/cache/purge")
def cache_purge() -> flask.Response:
    """Body ``{"tenant"|"model"|"namespace": str, ...}`` (AND) or ``{"all": true}``
    (:func:`.ops.purge_scope`). Deletes the entries and their semantic-index vectors;
    ``{"purged": n, "scope": {...}}`` (``n`` entries); writes a ``cache_purge`` event."""
    res = ops.purge_cache(_r(), _body(), auth.actor("api"), _events_max())
    return flask.jsonify({"purged": res.purged, "scope": res.scope})


# ---- API keys --------------------------------------------------------------------------


@bp.get("/keys")
def list_keys() -> flask.Response:
    """``{"keys": [{"id", "tenant", "label", "rpm", "tpm", "created", "revoked"}],
    "store_missing": bool, "edges_keeping": [edge id]}``, newest first (never the key
    itself). ``store_missing``: Redis holds no key store (it came back empty, or no key
    was ever written); ``edges_keeping``: the edges that keep honouring the keys they
    knew until the keys are restored (``infergate keys import``), see
    :func:`.apikeys.store_status`."""
    return flask.jsonify({"keys": [k.to_dict() for k in apikeys.list_keys(_r())],
                          **apikeys.store_status(_r())})


@bp.post("/keys")
def create_key() -> tuple[flask.Response, int]:
    """Body ``{"tenant", "rpm"?, "tpm"?, "label"?}`` (limits per minute, null = none).
    201 ``{"key": "ig-...", "id", "tenant", ...}``: the only time the key is shown."""
    plaintext, rec = ops.create_key(_r(), _body(), auth.actor("api"), _events_max())
    return flask.jsonify({"key": plaintext, **rec.to_dict()}), 201


@bp.patch("/keys/<key_id>")
def edit_key(key_id: str) -> flask.Response:
    """Change ``rpm``, ``tpm`` (null = no limit) or ``label``; 200 record; 400; 404; 409
    ``key_revoked`` for a revoked key."""
    rec = ops.edit_key(_r(), key_id, _body(), auth.actor("api"), _events_max())
    return flask.jsonify(rec.to_dict())


@bp.delete("/keys/<key_id>")
def revoke_key(key_id: str) -> flask.Response:
    """Revoke (idempotent: the first ``revoked`` time is kept, one ``key_revoke``
    event); 200 with the record (``revoked`` set) once the control planes' copies of the
    state hold the revocation (at most ``keycopies.WAIT_MAX_S``), header
    ``X-Infergate-State-Copied``: ``yes``, ``no`` (not confirmed in time: a Redis that
    loses its data before they read it would have the key written back valid) or
    ``none`` (no control plane keeps a copy, or it was revoked before); 404 unknown id."""
    ch = ops.revoke_key(_r(), key_id, auth.actor("api"), _events_max())
    resp = flask.jsonify(ch.record.to_dict())
    resp.headers["X-Infergate-State-Copied"] = {True: "yes", False: "no", None: "none"}[ch.copied]
    return resp
