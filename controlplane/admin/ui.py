"""The admin web page (blueprint ``ui``): nodes, node detail, events, cache, API keys.

Every page needs a login with the admin token (:mod:`.auth`); every POST needs the
form's CSRF token (400 without it). Changes use the same operations as the API
(:mod:`.ops`) and write events with actor ``admin``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import flask
import redis

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.routing import registry
from controlplane.admin import auth, ops
from controlplane.admin.api import purge_scope
from controlplane.admin.nodeview import build_view, build_views

bp = flask.Blueprint("ui", __name__)
ACTOR = "admin"
OPEN_ENDPOINTS = {"ui.login"}


def _r() -> redis.Redis:
    return flask.current_app.extensions["infergate"]["redis"]


def _events_max() -> int:
    return auth.settings().controlplane.events_max


def render(template: str, status: int = 200, **ctx: object) -> flask.Response:
    resp = flask.make_response(flask.render_template(f"admin/{template}", **ctx), status)
    return resp


@bp.before_request
def _guard() -> flask.Response | None:
    if flask.request.endpoint not in OPEN_ENDPOINTS and not auth.logged_in():
        if flask.request.method == "GET":
            target = flask.request.full_path if flask.request.query_string else flask.request.path
            return flask.redirect(flask.url_for("ui.login", next=target))
        return render("error.html", 401, title="Not logged in",
                      message="Your session has ended. Log in again.")
    if flask.request.method == "POST" and not auth.csrf_ok():
        return render("error.html", 400, title="Form expired",
                      message="The form's CSRF token is missing or invalid. "
                              "Reload the page and try again.")
    return None


@bp.errorhandler(redis.exceptions.RedisError)
def _redis_down(exc: redis.exceptions.RedisError) -> flask.Response:
    return render("error.html", 503, title="Redis unavailable",
                  message=f"Cannot reach Redis: {exc}. The page works again once Redis answers.")


def _safe_next(target: str | None) -> str:
    """Only local paths are followed after login (no open redirect)."""
    if target:
        parts = urlsplit(target)
        if not parts.scheme and not parts.netloc and target.startswith("/") \
                and not target.startswith("//") and "\\" not in target:
            return target
    return flask.url_for("ui.nodes")


# ---- login ---------------------------------------------------------------------------


@bp.route("/login", methods=["GET", "POST"])
def login() -> flask.Response:
    """Login form; ``POST`` with ``token`` (the admin token) starts the session."""
    enabled = bool(auth.admin_token())
    if flask.request.method == "POST":
        if not enabled:
            return render("login.html", 403, enabled=False)
        if auth.token_ok(flask.request.form.get("token", "")):
            auth.log_in()
            return flask.redirect(_safe_next(flask.request.form.get("next")), 303)
        return render("login.html", 401, enabled=True, failed=True,
                      next=flask.request.form.get("next", ""))
    if auth.logged_in():
        return flask.redirect(_safe_next(flask.request.args.get("next")))
    return render("login.html", 200 if enabled else 403, enabled=enabled,
                  next=flask.request.args.get("next", ""))


@bp.post("/logout")
def logout() -> flask.Response:
    auth.log_out()
    return flask.redirect(flask.url_for("ui.login"), 303)


@bp.get("/")
def index() -> flask.Response:
    return flask.redirect(flask.url_for("ui.nodes"))


# ---- nodes ---------------------------------------------------------------------------


@bp.get("/nodes")
def nodes() -> flask.Response:
    """The nodes table; refreshes itself from ``/api/v1/nodes?history=1`` every 2 s."""
    views = build_views(_r(), auth.settings(), history=True)
    return render("nodes.html", views=views, kinds=("vllm", "tgi", "sglang", "json", "openai"))


def _form_node() -> dict:
    """Non-empty text fields of the node form."""
    fields = ("name", "url", "kind", "weight", "max_concurrency", "metrics_path", "health_path")
    return {f: v.strip() for f in fields if (v := flask.request.form.get(f, "")).strip()}


def _back(default: str) -> flask.Response:
    return flask.redirect(default, 303)


@bp.post("/nodes")
def add_node() -> flask.Response:
    try:
        node = ops.add_node(_r(), _form_node(), ACTOR, _events_max())
        flask.flash(f"Node {node.name} added.", "ok")
    except ops.AdminError as exc:
        flask.flash(f"Not added: {exc.message}", "error")
    return _back(flask.url_for("ui.nodes"))


@bp.get("/nodes/<name>")
def node(name: str) -> flask.Response:
    """Node detail: its config, state, metrics over time, recent events."""
    v = build_view(_r(), auth.settings(), name, history=True,
                   history_window_s=max(300.0, auth.settings().controlplane.history_points
                                        * auth.settings().controlplane.poll_interval_s))
    if v is None:
        return render("error.html", 404, title="No such node",
                      message=f"No node named {name!r} is registered.")
    events = registry.recent_events(_r(), 50, node=name)
    return render("node.html", v=v, events=events,
                  kinds=("vllm", "tgi", "sglang", "json", "openai"))


@bp.post("/nodes/<name>/edit")
def edit_node(name: str) -> flask.Response:
    changes = _form_node()
    changes.pop("name", None)
    try:
        ops.edit_node(_r(), name, changes, ACTOR, _events_max())
        flask.flash(f"Node {name} saved.", "ok")
    except ops.NotFound as exc:
        flask.flash(exc.message, "error")
        return _back(flask.url_for("ui.nodes"))
    except ops.AdminError as exc:
        flask.flash(f"Not saved: {exc.message}", "error")
    return _back(flask.url_for("ui.node", name=name))


@bp.post("/nodes/<name>/remove")
def remove_node(name: str) -> flask.Response:
    if flask.request.form.get("sure") != "yes":
        flask.flash(f"Not removed: tick the box to confirm removing {name}.", "error")
        return _back(flask.url_for("ui.node", name=name))
    try:
        ops.remove_node(_r(), name, ACTOR, _events_max())
        flask.flash(f"Node {name} removed.", "ok")
    except ops.AdminError as exc:
        flask.flash(exc.message, "error")
    return _back(flask.url_for("ui.nodes"))


def _state_change(name: str, fn: object, verb: str) -> flask.Response:
    try:
        ch = fn(_r(), name, ACTOR, _events_max())  # type: ignore[operator]
        flask.flash(f"{name}: {verb}, now {ch.state}." if ch.changed
                    else f"{name} is already {ch.state}.", "ok")
    except ops.AdminError as exc:
        flask.flash(exc.message, "error")
    back = flask.request.form.get("back", "")
    return _back(_safe_next(back) if back else flask.url_for("ui.nodes"))


@bp.post("/nodes/<name>/drain")
def drain(name: str) -> flask.Response:
    return _state_change(name, ops.drain, "drain started")


@bp.post("/nodes/<name>/undrain")
def undrain(name: str) -> flask.Response:
    return _state_change(name, ops.undrain, "undrained")


# ---- events --------------------------------------------------------------------------


@bp.get("/events")
def events() -> flask.Response:
    node = flask.request.args.get("node") or None
    try:
        limit = min(max(int(flask.request.args.get("limit", "200")), 1), 1000)
    except ValueError:
        limit = 200
    return render("events.html", events=registry.recent_events(_r(), limit, node=node),
                  node=node or "", limit=limit)


# ---- cache ---------------------------------------------------------------------------


@bp.get("/cache")
def cache() -> flask.Response:
    r = _r()
    return render("cache.html", stats=cache_store.stats(r),
                  values={d: cache_store.index_values(r, d, 50) for d in cache_store.DIMENSIONS})


def _form_scope() -> dict:
    f = flask.request.form
    if f.get("scope") == "all" or f.get("all") == "true":
        return purge_scope({"all": True})
    data = {d: f.get(d, "").strip() for d in ("tenant", "model", "namespace")
            if f.get(d, "").strip()}
    return purge_scope(data)


@bp.post("/cache/purge")
def cache_purge() -> flask.Response:
    """First step: show what would be purged and ask for confirmation."""
    try:
        scope = _form_scope()
    except ops.AdminError as exc:
        flask.flash(f"Nothing purged: {exc.message}", "error")
        return _back(flask.url_for("ui.cache"))
    return render("cache_confirm.html", scope=scope, estimate=cache_store.estimate(_r(), **scope))


@bp.post("/cache/purge/confirm")
def cache_purge_confirm() -> flask.Response:
    if flask.request.form.get("confirm") != "yes":
        flask.flash("Purge cancelled.", "ok")
        return _back(flask.url_for("ui.cache"))
    try:
        scope = _form_scope()
    except ops.AdminError as exc:
        flask.flash(f"Nothing purged: {exc.message}", "error")
        return _back(flask.url_for("ui.cache"))
    n = cache_store.purge(_r(), **scope)
    registry.add_event(_r(), "cache_purge", "", ACTOR, {**scope, "purged": n},
                       maxlen=_events_max())
    flask.flash(f"Purged {n} cache entr{'y' if n == 1 else 'ies'}.", "ok")
    return _back(flask.url_for("ui.cache"))


# ---- API keys --------------------------------------------------------------------------


def _keys_page(status: int = 200, new_key: str | None = None,
               new_rec: apikeys.ApiKey | None = None) -> flask.Response:
    resp = render("keys.html", status, keys=apikeys.list_keys(_r()), new_key=new_key,
                  new_rec=new_rec)
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.get("/keys")
def keys_page() -> flask.Response:
    return _keys_page()


@bp.post("/keys")
def create_key() -> flask.Response:
    """Create a key and show it once (the page is not cached, the key is not stored)."""
    f = flask.request.form
    try:
        plaintext, rec = apikeys.create_key(_r(), f.get("tenant", "").strip(),
                                            rpm=f.get("rpm", "").strip() or None,
                                            tpm=f.get("tpm", "").strip() or None,
                                            label=f.get("label", "").strip())
    except apikeys.ApiKeyError as exc:
        flask.flash(f"No key created: {exc}", "error")
        return _back(flask.url_for("ui.keys_page"))
    registry.add_event(_r(), "key_create", "", ACTOR, {"id": rec.id, "tenant": rec.tenant},
                       maxlen=_events_max())
    return _keys_page(201, plaintext, rec)


@bp.post("/keys/<key_id>/revoke")
def revoke_key(key_id: str) -> flask.Response:
    rec = apikeys.revoke_key(_r(), key_id)
    if rec is None:
        flask.flash(f"No API key with id {key_id!r}.", "error")
    else:
        registry.add_event(_r(), "key_revoke", "", ACTOR, {"id": rec.id, "tenant": rec.tenant},
                           maxlen=_events_max())
        flask.flash(f"Key {rec.id} ({rec.tenant}) revoked.", "ok")
    return _back(flask.url_for("ui.keys_page"))


@bp.post("/keys/<key_id>/limits")
def key_limits(key_id: str) -> flask.Response:
    f = flask.request.form
    changes = {"rpm": f.get("rpm", "").strip() or None, "tpm": f.get("tpm", "").strip() or None}
    try:
        rec = apikeys.set_limits(_r(), key_id, **changes)
    except apikeys.ApiKeyError as exc:
        flask.flash(f"Limits not changed: {exc}", "error")
        return _back(flask.url_for("ui.keys_page"))
    if rec is None:
        flask.flash(f"No API key with id {key_id!r}.", "error")
    else:
        registry.add_event(_r(), "key_edit", "", ACTOR, {"id": rec.id, "rpm": rec.rpm,
                                                         "tpm": rec.tpm}, maxlen=_events_max())
        flask.flash(f"Key {rec.id}: limits saved.", "ok")
    return _back(flask.url_for("ui.keys_page"))
