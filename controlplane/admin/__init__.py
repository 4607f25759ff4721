"""The admin web page and JSON API (Flask), served by the control plane under waitress.

``create_app(settings, r)`` builds the app; the control plane serves it on
``controlplane.listen``.

- ``GET /healthz`` -> ``{"ok": true, "instance_id": str}``: liveness of the web server,
  no auth (``instance_id``: see :func:`controlplane.procs.instance_id`).
- ``/login``, ``/`` (the overview), ``/nodes``, ``/nodes/<name>``, ``/events``, ``/cache``,
  ``/keys``: the page (:mod:`.ui`), behind a login with the admin token.
- ``/api/v1/...``: the JSON API (:mod:`.api`), ``Authorization: Bearer <admin token>``.

The admin token is ``controlplane.admin_token`` (env ``INFERGATE_ADMIN_TOKEN``). With no
token configured, admin access is off: logins and API calls are refused (403) with a
message saying how to set one.

Sessions are signed with ``secret_key`` (argument or env ``INFERGATE_ADMIN_SECRET_KEY``,
which ``infergate up`` sets from its work folder's ``admin-secret.key``), else a random
key made at start, so a restart logs everyone out. The session cookie is
``HttpOnly`` and ``SameSite=Strict`` (``Secure`` over TLS, see :mod:`.auth`), and
logging out revokes the session server-side; every response carries a strict
Content-Security-Policy (inline script and style only with the per-response nonce) and
``X-Frame-Options: DENY``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from datetime import datetime

import flask
import redis
from werkzeug.exceptions import HTTPException

from controlplane import procs
from controlplane.config import Settings
from controlplane.paths import web_templates_dir
from controlplane.admin import auth

SECRET_ENV = "INFERGATE_ADMIN_SECRET_KEY"


def _fmt_ts(ts: float | None) -> str:
    if not ts:
        return "–"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_ago(ts: float | None) -> str:
    if not ts:
        return "–"
    return _fmt_age(time.time() - ts)


def _fmt_age(s: float | None) -> str:
    if s is None:
        return "–"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _fmt_secs(s: float | None) -> str:
    """Seconds as ms below 1 s, else s with 2 decimals."""
    if s is None:
        return "–"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_pct(x: float | None) -> str:
    """A 0-1 fraction as a percentage."""
    if x is None:
        return "–"
    return f"{x * 100:.1f} %" if x < 0.1 else f"{x * 100:.0f} %"


def _fmt_num(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"


#: Prefix of the admin session cookie's name (:func:`session_cookie_name`).
COOKIE_PREFIX = "infergate_admin_"


def session_cookie_name(settings: Settings) -> str:
    """The admin session cookie's name: ``infergate_admin_<8 hex>``, the hex from the
    SHA-256 of the deployment's Redis URL without its user info (sessions live there).

    Browsers and curl scope cookies by host, not port (RFC 6265, section 8.5): with one
    name for every deployment, logging in to one stack's admin page on a host would log
    the user out of another's on the same host. Control planes of one deployment share
    the Redis URL, so they share the name."""
    from controlplane.redisdb.url import without_userinfo

    digest = hashlib.sha256(without_userinfo(settings.redis.url).encode()).hexdigest()
    return COOKIE_PREFIX + digest[:8]


def create_app(settings: Settings, r: redis.Redis, *, secret_key: str | None = None) -> flask.Flask:
    """Build the admin Flask app bound to ``settings`` and the Redis client ``r``
    (built with ``decode_responses=True``). Never touches Redis while building."""
    from controlplane.admin import api, svg, ui

    app = flask.Flask(__name__, template_folder=str(web_templates_dir()), static_folder=None)
    app.secret_key = secret_key or os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    app.session_interface = auth.SessionInterface()  # Secure cookie over TLS (see auth)
    app.config.update(
        SESSION_COOKIE_NAME=session_cookie_name(settings),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        MAX_CONTENT_LENGTH=1 << 20,
    )
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["infergate"] = {"settings": settings, "redis": r}
    app.jinja_env.filters.update(ts=_fmt_ts, ago=_fmt_ago, age=_fmt_age, secs=_fmt_secs,
                                 pct=_fmt_pct, num=_fmt_num, bytes=_fmt_bytes)
    app.jinja_env.globals.update(csrf_token=auth.csrf_token, sparkline=svg.sparkline,
                                 chart=svg.chart, csrf_field=auth.CSRF_FIELD)

    @app.before_request
    def _nonce() -> None:
        flask.g.csp_nonce = secrets.token_urlsafe(16)

    @app.context_processor
    def _ctx() -> dict:
        return {"csp_nonce": flask.g.get("csp_nonce", ""), "logged_in": auth.logged_in()}

    @app.after_request
    def _headers(resp: flask.Response) -> flask.Response:
        nonce = flask.g.get("csp_nonce", "")
        resp.headers.setdefault(
            "Content-Security-Policy",
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'")
        resp.headers.setdefault("X-Frame-Options", "DENY")
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        return resp

    @app.get("/healthz")
    def healthz() -> flask.Response:
        """``{"ok": true, "instance_id": str}`` and the ``X-Infergate-Instance`` header
        (the stack instance id ``INFERGATE_INSTANCE_ID`` set by ``infergate up``, ``""``
        otherwise); no auth, no Redis."""
        resp = flask.jsonify({"ok": True, "instance_id": procs.instance_id()})
        resp.headers[procs.INSTANCE_HEADER] = procs.instance_id()
        return resp

    @app.get("/favicon.ico")
    def favicon() -> flask.Response:
        return flask.Response(status=204)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> flask.Response:
        # Unmatched URLs and methods never reach a blueprint's handlers.
        if flask.request.path.startswith(api.bp.url_prefix or "/api/"):
            return api._http_error(exc)
        resp = flask.make_response(flask.render_template(
            "admin/error.html", title=f"{exc.code} {exc.name}",
            message=exc.description or ""), exc.code or 500)
        return resp

    app.register_blueprint(api.bp)
    app.register_blueprint(ui.bp)
    return app
