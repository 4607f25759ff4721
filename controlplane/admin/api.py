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
- 409 ``conflict_error`` / ``node_exists`` — node name already registered
- 503 ``unavailable_error`` / ``redis_unavailable`` — Redis unreachable

Every change writes an event with actor ``admin``.
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

bp = flask.Blueprint("api", __name__, url_prefix="/api/v1")
ACTOR = "admin"


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
            return None
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
    return error(status, exc.description or exc.name, "invalid_request_error", "bad_request")


def _body() -> dict:
    """The JSON object body; raises :class:`ops.BadInput` when missing or not an object."""
    raw = flask.request.get_data(cache=True, as_text=True)
    if not raw.strip():
        raise ops.BadInput("expected a JSON object body", "invalid_json")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ops.BadInput(f"body is not valid JSON: {exc}", "invalid_json") from None
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
    node = ops.add_node(_r(), _body(), ACTOR, _events_max())
    return flask.jsonify(ops.node_json(node)), 201


@bp.patch("/nodes/<name>")
def edit_node(name: str) -> flask.Response:
    """Change fields of a node (``url``, ``kind``, ``weight``, ``max_concurrency``,
    ``metrics_path``, ``health_path``). 200 with the node document; 400; 404."""
    node = ops.edit_node(_r(), name, _body(), ACTOR, _events_max())
    return flask.jsonify(ops.node_json(node))


@bp.delete("/nodes/<name>")
def delete_node(name: str) -> flask.Response:
    """Remove a node with its state, metrics and history. ``{"deleted": name}``; 404."""
    ops.remove_node(_r(), name, ACTOR, _events_max())
    return flask.jsonify({"deleted": name})


@bp.post("/nodes/<name>/drain")
def drain(name: str) -> flask.Response:
    """Start draining: ``{"name", "state", "since", "actor", "changed"}``. Idempotent
    (200 with ``changed: false`` when already draining/drained); 404 unknown node."""
    return flask.jsonify(ops.drain(_r(), name, ACTOR, _events_max()).to_dict())


@bp.post("/nodes/<name>/undrain")
def undrain(name: str) -> flask.Response:
    """Back to ``active`` (slow start from ``since``); same shape as drain; 404."""
    return flask.jsonify(ops.undrain(_r(), name, ACTOR, _events_max()).to_dict())


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
    """The routing snapshot exactly as the edge reads it (``infergate:v1:routing``), plus
    nothing; 404 ``no_snapshot`` before the first control-plane cycle."""
    raw = _r().get(keynames.ROUTING)
    if not raw:
        raise ops.NotFound("no routing snapshot yet (is the control plane running?)",
                           "no_snapshot")
    try:
        doc = json.loads(raw)
    except ValueError:
        return error(500, "routing snapshot in Redis is not valid JSON", "server_error",
                     "bad_snapshot")
    return flask.jsonify(doc)


# ---- cache ---------------------------------------------------------------------------


@bp.get("/cache/stats")
def cache_stats() -> flask.Response:
    """:class:`controlplane.cache.store.CacheStats` as JSON (hit rates 0-1, bytes)."""
    return flask.jsonify(cache_store.stats(_r()).to_dict())


PURGE_FIELDS = ("tenant", "model", "namespace", "all")


def purge_scope(data: dict) -> dict:
    """Validate a purge scope: ``{"all": true}`` or some of tenant/model/namespace
    (non-empty strings, combined with AND). Raises :class:`ops.BadInput`."""
    unknown = sorted(set(data) - set(PURGE_FIELDS))
    if unknown:
        raise ops.BadInput(f"unknown field(s): {', '.join(unknown)}; expected tenant, model, "
                           "namespace or all")
    if "all" in data:
        if data["all"] is not True:
            raise ops.BadInput("all: must be true (or left out)")
        if len(data) > 1:
            raise ops.BadInput("all: cannot be combined with tenant, model or namespace")
        return {"all": True}
    scope = {}
    for f in ("tenant", "model", "namespace"):
        if f in data:
            v = data[f]
            if not isinstance(v, str) or not v or len(v) > 256:
                raise ops.BadInput(f"{f}: a non-empty string of at most 256 characters")
            scope[f] = v
    if not scope:
        raise ops.BadInput("purge scope: give tenant, model, namespace or all: true")
    return scope


@bp.post("/cache/purge")
def cache_purge() -> flask.Response:
    """Body ``{"tenant"|"model"|"namespace": str, ...}`` (AND) or ``{"all": true}``.
    ``{"purged": n, "scope": {...}}``; writes a ``cache_purge`` event."""
    scope = purge_scope(_body())
    n = cache_store.purge(_r(), **scope)
    registry.add_event(_r(), "cache_purge", "", ACTOR, {**scope, "purged": n},
                       maxlen=_events_max())
    return flask.jsonify({"purged": n, "scope": scope})


# ---- API keys --------------------------------------------------------------------------


@bp.get("/keys")
def list_keys() -> flask.Response:
    """``{"keys": [{"id", "tenant", "label", "rpm", "tpm", "created", "revoked"}]}``,
    newest first (never the key itself)."""
    return flask.jsonify({"keys": [k.to_dict() for k in apikeys.list_keys(_r())]})


@bp.post("/keys")
def create_key() -> tuple[flask.Response, int]:
    """Body ``{"tenant", "rpm"?, "tpm"?, "label"?}`` (limits per minute, null = none).
    201 ``{"key": "ig-...", "id", "tenant", ...}``: the only time the key is shown."""
    data = _body()
    unknown = sorted(set(data) - {"tenant", "rpm", "tpm", "label"})
    if unknown:
        raise ops.BadInput(f"unknown field(s): {', '.join(unknown)}")
    plaintext, rec = apikeys.create_key(_r(), data.get("tenant"), rpm=data.get("rpm"),
                                        tpm=data.get("tpm"), label=data.get("label"))
    registry.add_event(_r(), "key_create", "", ACTOR, {"id": rec.id, "tenant": rec.tenant},
                       maxlen=_events_max())
    return flask.jsonify({"key": plaintext, **rec.to_dict()}), 201


@bp.patch("/keys/<key_id>")
def edit_key(key_id: str) -> flask.Response:
    """Change ``rpm``, ``tpm`` (null = no limit) or ``label``; 200 record; 400; 404."""
    data = _body()
    unknown = sorted(set(data) - {"rpm", "tpm", "label"})
    if unknown or not data:
        raise ops.BadInput("expected some of rpm, tpm, label")
    rec = apikeys.set_limits(_r(), key_id, **data)
    if rec is None:
        raise ops.NotFound(f"no API key with id {key_id!r}", "key_not_found")
    registry.add_event(_r(), "key_edit", "", ACTOR, {"id": rec.id, **data},
                       maxlen=_events_max())
    return flask.jsonify(rec.to_dict())


@bp.delete("/keys/<key_id>")
def revoke_key(key_id: str) -> flask.Response:
    """Revoke (idempotent); 200 with the record (``revoked`` set); 404 unknown id."""
    rec = apikeys.revoke_key(_r(), key_id)
    if rec is None:
        raise ops.NotFound(f"no API key with id {key_id!r}", "key_not_found")
    registry.add_event(_r(), "key_revoke", "", ACTOR, {"id": rec.id, "tenant": rec.tenant},
                       maxlen=_events_max())
    return flask.jsonify(rec.to_dict())
