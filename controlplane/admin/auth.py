"""Admin authentication: the admin token, the login session, CSRF tokens.

- The only credential is ``controlplane.admin_token`` (env ``INFERGATE_ADMIN_TOKEN``).
  Comparisons use ``hmac.compare_digest``. With an empty token nobody can log in and
  every API call answers 403 ``admin_token_unset``: admin access is off until a token is set.
- Page: ``POST /login`` with the token starts a signed session cookie (``HttpOnly``,
  ``SameSite=Strict``). The session remembers a fingerprint of the token, so changing
  the token logs every session out.
- Every form carries a CSRF token (``csrf_token`` hidden field, kept in the session),
  checked on every POST of the page.
- API: ``Authorization: Bearer <admin token>``. Read-only API calls (GET) from the
  logged-in page are also accepted with the session cookie, so the nodes page can
  refresh itself from ``/api/v1/nodes`` without the token in the page.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import flask

from controlplane.config import Settings

CSRF_FIELD = "csrf_token"
DISABLED_MESSAGE = ("admin access is disabled: no admin token is configured "
                    "(set controlplane.admin_token in the config file or INFERGATE_ADMIN_TOKEN)")


def settings() -> Settings:
    return flask.current_app.extensions["infergate"]["settings"]


def admin_token() -> str:
    return settings().controlplane.admin_token


def token_ok(candidate: str | None) -> bool:
    """Constant-time check of ``candidate`` against the admin token (never true when
    no token is configured)."""
    token = admin_token()
    if not token or not candidate:
        return False
    return hmac.compare_digest(candidate.encode("utf-8"), token.encode("utf-8"))


def _fingerprint() -> str:
    key = flask.current_app.secret_key
    key_b = key.encode() if isinstance(key, str) else bytes(key or b"")
    return hmac.new(key_b, admin_token().encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def log_in() -> None:
    flask.session.clear()
    flask.session["auth"] = _fingerprint()
    flask.session[CSRF_FIELD] = secrets.token_urlsafe(32)


def log_out() -> None:
    flask.session.clear()


def logged_in() -> bool:
    fp = flask.session.get("auth")
    return bool(admin_token()) and isinstance(fp, str) and hmac.compare_digest(fp, _fingerprint())


def csrf_token() -> str:
    """The session's CSRF token (created on first use); put it in every form."""
    tok = flask.session.get(CSRF_FIELD)
    if not isinstance(tok, str) or not tok:
        tok = secrets.token_urlsafe(32)
        flask.session[CSRF_FIELD] = tok
    return tok


def csrf_ok() -> bool:
    sent = flask.request.form.get(CSRF_FIELD, "")
    tok = flask.session.get(CSRF_FIELD)
    return isinstance(tok, str) and bool(tok) and bool(sent) and hmac.compare_digest(
        sent.encode("utf-8"), tok.encode("utf-8"))


def bearer() -> str | None:
    """The token of an ``Authorization: Bearer`` header, else ``None``."""
    h = flask.request.headers.get("Authorization", "")
    scheme, _, value = h.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
