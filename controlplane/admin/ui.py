"""The admin web page (blueprint ``ui``): overview, nodes, node detail, events, cache,
API keys.

Every page needs a login with the admin token (:mod:`.auth`); every POST needs the
form's CSRF token (400 without it). Changes use the same operations as the API
(:mod:`.ops`) and write events with actor ``admin@ADDR (page TAG)``
(:func:`.auth.actor`). Every form that changes something
answers with a redirect (303) to a page and a flash message (post/redirect/get), so a
reload never repeats it; a new API key is handed to the page after the redirect through
a one-time token in the session (the key itself stays in this process's memory for at
most :data:`REVEAL_TTL_S` and is never stored).
"""

from __future__ import annotations

import secrets
import threading
import time
from urllib.parse import urlencode, urlsplit

import flask
import redis

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.routing import registry
from controlplane.admin import auth, ops, svg
from controlplane.admin.nodeview import NodeView, build_view, build_views
from controlplane.config import NodeSettings
from controlplane.routing import series

bp = flask.Blueprint("ui", __name__)
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
    from controlplane.redisdb.conn import describe_error, refused_credentials

    if refused_credentials(exc):
        text = describe_error(exc)
        return render("error.html", 503, title="Redis refuses the password",
                      message=text[:1].upper() + text[1:] + ".")
    return render("error.html", 503, title="Redis unavailable",
                  message=f"Cannot reach Redis: {str(exc).rstrip('. ')}. The page works "
                          "again once Redis answers.")


def _has_control_chars(value: str | None) -> bool:
    """Whether ``value`` holds a control character (CR, LF, NUL, ...)."""
    return bool(value) and any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)  # type: ignore[union-attr]


def _safe_next(target: str | None) -> str:
    """Only local paths are followed after login (no open redirect, no header
    injection: a target with a control character is never followed)."""
    if target and not _has_control_chars(target):
        try:
            parts = urlsplit(target)
        except ValueError:  # "http://[::1": an unbalanced IPv6 bracket
            return flask.url_for("ui.overview")
        if not parts.scheme and not parts.netloc and target.startswith("/") \
                and not target.startswith("//") and "\\" not in target:
            return target
    return flask.url_for("ui.overview")


# ---- login ---------------------------------------------------------------------------


@bp.route("/login", methods=["GET", "POST"])
def login() -> flask.Response:
    """Login form; ``POST`` with ``token`` (the admin token) starts the session.

    400 when ``next`` holds a control character (CR/LF); 429 with ``Retry-After`` when
    this client address made too many failed attempts (:mod:`.auth`)."""
    enabled = bool(auth.admin_token())
    if _has_control_chars(flask.request.values.get("next")):
        return render("error.html", 400, title="Bad request",
                      message="The next parameter must not contain control characters.")
    if flask.request.method == "POST":
        if not enabled:
            return render("login.html", 403, enabled=False)
        nxt = flask.request.form.get("next", "")
        if auth.token_ok(flask.request.form.get("token", "")):
            auth.log_in()  # a correct token is never throttled
            return flask.redirect(_safe_next(nxt), 303)
        wait = auth.throttle_wait()
        if wait:
            resp = render("error.html", 429, title="Too many attempts",
                          message=f"Too many failed logins from your address. Try again in "
                                  f"{wait} s.")
            resp.headers["Retry-After"] = str(wait)
            return resp
        auth.attempt_failed()
        flask.flash("Wrong admin token.", "error")
        return flask.redirect(flask.url_for("ui.login", **({"next": nxt} if nxt else {})), 303)
    if auth.logged_in():
        return flask.redirect(_safe_next(flask.request.args.get("next")))
    return render("login.html", 200 if enabled else 403, enabled=enabled,
                  next=flask.request.args.get("next", ""))


@bp.post("/logout")
def logout() -> flask.Response:
    auth.log_out()
    return flask.redirect(flask.url_for("ui.login"), 303)


# ---- overview ------------------------------------------------------------------------


def _window() -> int:
    """``?window=`` 300 or 3600 seconds (default 300)."""
    try:
        w = int(flask.request.args.get("window", series.WINDOWS_S[0]))
    except ValueError:
        w = series.WINDOWS_S[0]
    return w if w in series.WINDOWS_S else series.WINDOWS_S[0]


def _overview_ctx() -> dict:
    r = _r()
    window = _window()
    ov = series.read(r, window)
    views = {v.name: v for v in build_views(r, auth.settings())}
    names = sorted(set(views) | set(ov["nodes"]),
                   key=lambda n: (failing(views[n]) if n in views else True, n))
    return {"ov": ov, "window": window, "windows": series.WINDOWS_S, "views": views,
            "names": names, "step_s": series.STEP_S, "fv": svg.fmt_value}


@bp.get("/")
def overview() -> flask.Response:
    """The first page: requests/s, cache hit rates, p50/p99, shed, rate-limited and
    error rates of the pool and per node over the last 5 or 60 minutes
    (:mod:`controlplane.routing.series`); refreshes its panel every 5 s."""
    return render("overview.html", **_overview_ctx())


@bp.get("/overview/panel")
def overview_panel() -> flask.Response:
    """The overview's figures and charts alone (HTML fragment for the live refresh)."""
    resp = render("_overview_panel.html", **_overview_ctx())
    resp.headers["Cache-Control"] = "no-store"
    return resp


# ---- nodes ---------------------------------------------------------------------------


def failing(v: NodeView) -> bool:
    """Unhealthy after the last poll or a breaker open at an edge: the node gets no
    traffic, so its score is not shown as a number (and it sorts last)."""
    return v.healthy is False or v.breaker == "open"


@bp.get("/nodes")
def nodes() -> flask.Response:
    """The nodes table, failing nodes last; refreshes itself from
    ``/api/v1/nodes?history=1`` every 2 s (the same order, in JavaScript)."""
    views = sorted(build_views(_r(), auth.settings(), history=True),
                   key=lambda v: (failing(v), v.name))
    return render("nodes.html", views=views, failing=failing,
                  kinds=("vllm", "tgi", "sglang", "json", "openai"))


def _form_node() -> dict:
    """Non-empty text fields of the node form."""
    fields = ("name", "url", "kind", "weight", "max_concurrency", "metrics_path", "health_path")
    return {f: v.strip() for f in fields if (v := flask.request.form.get(f, "")).strip()}


def _back(default: str) -> flask.Response:
    return flask.redirect(default, 303)


@bp.post("/nodes")
def add_node() -> flask.Response:
    try:
        node = ops.add_node(_r(), _form_node(), auth.actor("page"), _events_max(), settings=auth.settings())
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


#: Fields of the node page's edit form; each comes with ``seen_<field>``, the value the
#: page showed.
EDIT_FIELDS: tuple[str, ...] = ("url", "kind", "weight", "max_concurrency", "metrics_path",
                                "health_path")


def _form_edit() -> tuple[dict, dict]:
    """``(changes, seen)`` of the node edit form: each field sent, trimmed, an empty
    optional one as its default (the form says so), and the values the page showed
    (``seen_<field>``). Raises :class:`ops.BadInput` for an empty URL."""
    f = flask.request.form
    changes: dict = {}
    seen: dict = {}
    for k in EDIT_FIELDS:
        if k not in f:
            continue
        v = f.get(k, "").strip()
        if not v:
            if k == "url":
                raise ops.BadInput("url: required, the node's server root such as "
                                   "http://10.0.0.5:8000 (to take the node out, remove it)")
            v = NodeSettings.model_fields[k].default
        changes[k] = v
        if f"seen_{k}" in f:
            seen[k] = f.get(f"seen_{k}", "").strip()
    return changes, seen


def _shown_diff(diff: dict[str, list]) -> str:
    return ", ".join(f"{k} {registry.shorten(str(old), 60)} → {registry.shorten(str(new), 60)}"
                     for k, (old, new) in diff.items())


@bp.post("/nodes/<name>/edit")
def edit_node(name: str) -> flask.Response:
    """The node page's edit form: only the fields the user changed (their value differs
    from ``seen_<field>``, what the page showed) are applied, each on the node as
    stored now; one the user changed that someone else changed since the page was shown
    refuses the whole form (nothing saved, a flash says which). An empty optional field
    resets it to its default; an empty URL is refused. "Nothing changed" when nothing
    did (no event)."""
    try:
        changes, seen = _form_edit()
        if not changes:
            raise ops.BadInput("the form sent no field")
        res = ops.change_node(_r(), name, changes, auth.actor("page"), _events_max(),
                              settings=auth.settings(), seen=seen)
        if res.diff:
            flask.flash(f"Node {name} saved: {_shown_diff(res.diff)}.", "ok")
        else:
            flask.flash(f"Node {name}: nothing changed.", "ok")
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
        ops.remove_node(_r(), name, auth.actor("page"), _events_max())
        flask.flash(f"Node {name} removed.", "ok")
    except ops.AdminError as exc:
        flask.flash(exc.message, "error")
    return _back(flask.url_for("ui.nodes"))


def _state_change(name: str, fn: object, verb: str) -> flask.Response:
    try:
        ch = fn(_r(), name, auth.actor("page"), _events_max())  # type: ignore[operator]
        flask.flash(f"{name}: {verb}, now {ch.state}." if ch.changed
                    else f"{name} is already {ch.state}.", "ok")
        if ch.warning:
            flask.flash(f"Warning: {ch.warning}.", "error")
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
                  values={d: cache_store.index_values(r, d, 50) for d in cache_store.DIMENSIONS},
                  namespaces=cache_store.namespace_stats(r, 50), cache_cfg=auth.settings().cache)


@bp.post("/cache/flag")
def cache_flag() -> flask.Response:
    """The flag form: ``entry`` = the ``X-Cache-Entry`` of a wrong hit
    (:func:`.ops.flag_entry`); back to the cache page with a flash message."""
    entry_id = flask.request.form.get("entry", "").strip()
    try:
        res = ops.flag_entry(_r(), entry_id, auth.actor("page"), _events_max())
    except ops.AdminError as exc:
        flask.flash(f"Nothing flagged: {exc.message}", "error")
        return _back(flask.url_for("ui.cache"))
    if res.dropped:
        flask.flash(f"Entry {res.id} flagged as wrong and dropped.", "ok")
    else:
        flask.flash(f"Entry {res.id} was flagged before; nothing changed.", "ok")
    return _back(flask.url_for("ui.cache"))


def _form_scope() -> dict:
    """The purge scope of the form (POST) or of the confirmation URL (GET)."""
    f = flask.request.form if flask.request.method == "POST" else flask.request.args
    if f.get("scope") == "all" or f.get("all") == "true":
        return ops.purge_scope({"all": True})
    data = {d: f.get(d, "").strip() for d in ("tenant", "model", "namespace")
            if f.get(d, "").strip()}
    return ops.purge_scope(data)


@bp.route("/cache/purge", methods=["GET", "POST"])
def cache_purge() -> flask.Response:
    """First step (changes nothing): ``GET ?tenant=&model=&namespace=`` or
    ``?scope=all`` shows what would be purged and asks for confirmation. A POST of the
    same fields is redirected (303) to that GET."""
    try:
        scope = _form_scope()
    except ops.AdminError as exc:
        flask.flash(f"Nothing purged: {exc.message}", "error")
        return _back(flask.url_for("ui.cache"))
    if flask.request.method == "POST":
        query = {"scope": "all"} if scope.get("all") else scope
        return _back(flask.url_for("ui.cache_purge") + "?" + urlencode(query))
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
    n = ops.purge_cache(_r(), scope, auth.actor("page"), _events_max()).purged
    flask.flash(f"Purged {n} cache entr{'y' if n == 1 else 'ies'}.", "ok")
    return _back(flask.url_for("ui.cache"))


# ---- API keys --------------------------------------------------------------------------


REVEAL_TTL_S = 300.0
"""A new key waits at most this long (in memory) for the page to show it once."""
REVEAL_MAX = 64
_reveal: dict[str, tuple[float, str, str]] = {}
_reveal_lock = threading.Lock()


def _reveal_put(plaintext: str, key_id: str) -> str:
    """Keep a new key for its one display after the redirect; returns the one-time
    token that goes into the (signed) session instead of the key."""
    token = secrets.token_urlsafe(16)
    now = time.monotonic()
    with _reveal_lock:
        for t in [t for t, (exp, _, _) in _reveal.items() if exp < now]:
            del _reveal[t]
        while len(_reveal) >= REVEAL_MAX:
            del _reveal[next(iter(_reveal))]
        _reveal[token] = (now + REVEAL_TTL_S, plaintext, key_id)
    return token


def _reveal_pop(token: object) -> tuple[str, str] | None:
    """``(plaintext, key id)`` once for a token from :func:`_reveal_put`, else None."""
    if not isinstance(token, str):
        return None
    with _reveal_lock:
        item = _reveal.pop(token, None)
    if item is None or item[0] < time.monotonic():
        return None
    return item[1], item[2]


@bp.get("/keys")
def keys_page() -> flask.Response:
    """The key list; right after a create, the new key once (then never again)."""
    keys = apikeys.list_keys(_r())
    new_key = new_rec = None
    shown = _reveal_pop(flask.session.pop("new_key", None))
    if shown is not None:
        new_key = shown[0]
        new_rec = next((k for k in keys if k.id == shown[1]), None)
        if new_rec is None:
            new_key = None
    resp = render("keys.html", keys=keys, new_key=new_key, new_rec=new_rec,
                  store=apikeys.store_status(_r()))
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.post("/keys")
def create_key() -> flask.Response:
    """Create a key, then redirect (303) to the keys page, which shows it once (the page
    is not cached, the key is not stored)."""
    f = flask.request.form
    try:
        plaintext, rec = ops.create_key(_r(), {"tenant": f.get("tenant", "").strip(),
                                               "rpm": f.get("rpm", "").strip() or None,
                                               "tpm": f.get("tpm", "").strip() or None,
                                               "label": f.get("label", "").strip()},
                                        auth.actor("page"), _events_max())
    except ops.AdminError as exc:
        flask.flash(f"No key created: {exc.message}", "error")
        return _back(flask.url_for("ui.keys_page"))
    flask.session["new_key"] = _reveal_put(plaintext, rec.id)
    return _back(flask.url_for("ui.keys_page"))


@bp.post("/keys/<key_id>/revoke")
def revoke_key(key_id: str) -> flask.Response:
    try:
        ch = ops.revoke_key(_r(), key_id, auth.actor("page"), _events_max())
        rec = ch.record
        flask.flash(f"Key {rec.id} ({rec.tenant}) revoked.", "ok")
        if ch.copied is False:
            flask.flash("The control plane has not confirmed that its copy of the state holds "
                        "this revocation: should Redis lose its data before it reads it, the "
                        "key would come back valid. Check the key after a restart of Redis.",
                        "error")
    except ops.NotFound:
        flask.flash(f"No API key with id {registry.shorten(key_id)!r}.", "error")
    return _back(flask.url_for("ui.keys_page"))


@bp.post("/keys/<key_id>/limits")
def key_limits(key_id: str) -> flask.Response:
    """The limits form of a key: ``rpm``, ``tpm`` (empty = no limit) and the values the
    page showed (``seen_rpm``, ``seen_tpm``): only a limit the user changed is applied;
    one that someone else changed since the page was shown refuses the form (nothing
    saved)."""
    f = flask.request.form
    changes = {k: f.get(k, "").strip() or None for k in ("rpm", "tpm") if k in f}
    seen = {k: f.get(f"seen_{k}", "").strip() or None for k in changes if f"seen_{k}" in f}
    try:
        res = ops.change_key(_r(), key_id, changes, auth.actor("page"), _events_max(), seen=seen)
        if res.changed:
            flask.flash(f"Key {res.record.id}: limits saved.", "ok")
        else:
            flask.flash(f"Key {res.record.id}: nothing changed.", "ok")
    except ops.NotFound:
        flask.flash(f"No API key with id {registry.shorten(key_id)!r}.", "error")
    except ops.AdminError as exc:
        flask.flash(f"Limits not changed: {exc.message}", "error")
    return _back(flask.url_for("ui.keys_page"))
