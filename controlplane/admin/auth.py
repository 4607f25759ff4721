"""Admin authentication: the admin token, the login session, CSRF tokens, throttling.

- The only credential is ``controlplane.admin_token`` (env ``INFERGATE_ADMIN_TOKEN``).
  Comparisons use ``hmac.compare_digest``. With an empty token nobody can log in and
  every API call answers 403 ``admin_token_unset``: admin access is off until a token is set.
- Page: ``POST /login`` with the token starts a signed session cookie (``HttpOnly``,
  ``SameSite=Strict``; ``Secure`` when the page is served over TLS, through a
  ``controlplane.trusted_proxies`` proxy sending ``X-Forwarded-Proto: https``, or with
  ``controlplane.cookie_secure``). The session remembers a fingerprint of the token, so
  changing the token logs every session out, and a random session id that lives
  server-side in Redis (``keynames.ADMIN_SESSION_PREFIX + id``, TTL
  :data:`SESSION_TTL_S`): ``POST /logout`` deletes it, so the cookie of a logged-out
  session no longer works, even replayed. While Redis does not answer, the sessions this
  process started (and did not end) still count.
- Every form carries a CSRF token (``csrf_token`` hidden field, kept in the session),
  checked on every POST of the page.
- API: ``Authorization: Bearer <admin token>``. Read-only API calls (GET) from the
  logged-in page are also accepted with the session cookie, so the nodes page can
  refresh itself from ``/api/v1/nodes`` without the token in the page.
- Throttle: per client address (the peer, or the ``X-Forwarded-For`` client of a trusted
  proxy) a burst of :data:`THROTTLE_BURST` failed logins or wrong Bearer tokens, then
  :data:`THROTTLE_RATE_PER_S` per second. Beyond that every wrong login or Bearer token
  of that address answers 429 with ``Retry-After`` (seconds) until the budget refills.
  Only failures count, and the token is checked (constant time) before the throttle: a
  correct token is always accepted, on the API and the login form, so someone guessing
  from the same address (a shared NAT, a proxy) cannot lock the admin out. The throttle
  bounds the noise and cost of guessing; the strength of the token is what makes
  guessing hopeless (use a long random token: ``openssl rand -hex 32``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import flask
import redis
from flask.sessions import SecureCookieSessionInterface

from controlplane.config import Settings
from controlplane.redisdb import keynames

log = logging.getLogger(__name__)

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


#: Lifetime of a login session, seconds (the server-side id expires then).
SESSION_TTL_S = 12 * 3600
#: Sessions this process remembers for when Redis does not answer.
LOCAL_SESSIONS_MAX = 10000
#: How often a logout made while Redis did not answer is tried again there, seconds.
PENDING_RETRY_S = 1.0


class _LocalSessions:
    """Session ids this process started and has not ended (id -> expiry, monotonic s),
    at most :data:`LOCAL_SESSIONS_MAX`: the fallback while Redis does not answer. Also
    the ids logged out while Redis did not answer (their Redis key could not be deleted):
    refused by this process whatever Redis says, and deleted from Redis by a background
    retry (:meth:`retry_deletes`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: OrderedDict[str, float] = OrderedDict()
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._retrying = False

    def retry_deletes(self, r: redis.Redis, every_s: float = PENDING_RETRY_S) -> None:
        """Delete the pending ids from Redis in the background, every ``every_s`` seconds
        until Redis answers (one thread per process at a time), so that other control
        planes on the same Redis refuse them too without waiting for an admin request
        here."""
        with self._lock:
            if self._retrying:
                return
            self._retrying = True

        def run() -> None:
            while True:
                time.sleep(every_s)
                pending = self.pending()
                if pending:
                    try:
                        r.delete(*(keynames.ADMIN_SESSION_PREFIX + p for p in pending))
                    except redis.RedisError:
                        continue
                    self.deleted(pending)
                with self._lock:
                    if not self._ended:
                        self._retrying = False
                        return

        threading.Thread(target=run, name="admin-logout-retry", daemon=True).start()

    def end(self, sid: str) -> None:
        """``sid`` was logged out but is still in Redis."""
        with self._lock:
            self._ended[sid] = time.monotonic() + SESSION_TTL_S
            while len(self._ended) > LOCAL_SESSIONS_MAX:
                self._ended.popitem(last=False)

    def ended(self, sid: str) -> bool:
        with self._lock:
            exp = self._ended.get(sid)
            return exp is not None and exp > time.monotonic()

    def pending(self) -> list[str]:
        """The ended ids whose Redis key may still exist (expired ones dropped)."""
        now = time.monotonic()
        with self._lock:
            for sid in [k for k, exp in self._ended.items() if exp <= now]:
                del self._ended[sid]
            return list(self._ended)

    def deleted(self, sids: list[str]) -> None:
        """The Redis keys of ``sids`` are gone: Redis refuses them from now on."""
        with self._lock:
            for sid in sids:
                self._ended.pop(sid, None)

    def add(self, sid: str) -> None:
        with self._lock:
            self._live[sid] = time.monotonic() + SESSION_TTL_S
            while len(self._live) > LOCAL_SESSIONS_MAX:
                self._live.popitem(last=False)

    def discard(self, sid: str) -> None:
        with self._lock:
            self._live.pop(sid, None)

    def alive(self, sid: str) -> bool:
        with self._lock:
            exp = self._live.get(sid)
            return exp is not None and exp > time.monotonic()


def _state() -> dict:
    return flask.current_app.extensions["infergate"]


def _redis() -> redis.Redis:
    return _state()["redis"]


def _local_sessions() -> _LocalSessions:
    return _state().setdefault("admin_sessions", _LocalSessions())


def log_in() -> None:
    """Start a session: a new server-side session id (Redis, TTL :data:`SESSION_TTL_S`),
    the token fingerprint and a CSRF token in the cookie. A Redis failure is logged and
    the session is kept by this process only."""
    sid = secrets.token_urlsafe(24)
    try:
        _redis().set(keynames.ADMIN_SESSION_PREFIX + sid, "1", ex=SESSION_TTL_S)
    except redis.RedisError as exc:
        log.warning("admin session kept in this process only (Redis: %s)", exc)
    _local_sessions().add(sid)
    flask.session.clear()
    flask.session["auth"] = _fingerprint()
    flask.session["sid"] = sid
    flask.session[CSRF_FIELD] = secrets.token_urlsafe(32)
    flask.g.pop("admin_logged_in", None)


def log_out() -> None:
    """End the session: delete its server-side id (so the cookie is refused even if it
    is replayed), then clear the cookie. While Redis does not answer, this process
    refuses the id at once and deletes it from Redis as soon as Redis answers again (a
    background retry every :data:`PENDING_RETRY_S`), so a
    restarted Redis that reloads the id cannot bring it back. A control plane restarted
    before Redis answers forgets the pending deletion."""
    sid = flask.session.get("sid")
    if isinstance(sid, str) and sid:
        local = _local_sessions()
        local.discard(sid)
        try:
            _redis().delete(keynames.ADMIN_SESSION_PREFIX + sid)
        except redis.RedisError as exc:
            local.end(sid)
            local.retry_deletes(_redis())
            log.warning("admin session ended; its id is deleted from Redis when Redis "
                        "answers again (Redis: %s)", exc)
    flask.session.clear()
    flask.g.pop("admin_logged_in", None)


def _session_alive(sid: str) -> bool:
    local = _local_sessions()
    if local.ended(sid):
        return False  # logged out while Redis did not answer: its retry deletes it there
    try:
        return bool(_redis().exists(keynames.ADMIN_SESSION_PREFIX + sid))
    except redis.RedisError:
        return local.alive(sid)


def logged_in() -> bool:
    """The cookie carries the current token's fingerprint and a live session id
    (checked once per request)."""
    cached = flask.g.get("admin_logged_in")
    if cached is not None:
        return cached
    fp, sid = flask.session.get("auth"), flask.session.get("sid")
    ok = (bool(admin_token()) and isinstance(fp, str) and hmac.compare_digest(fp, _fingerprint())
          and isinstance(sid, str) and bool(sid) and _session_alive(sid))
    flask.g.admin_logged_in = ok
    return ok


# ---- client address, TLS, the session cookie ------------------------------------------


def _trusted(addr: str | None) -> bool:
    nets = settings().controlplane.trusted_proxies
    if not addr or not nets:
        return False
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(n, strict=False) for n in nets)


def client_addr() -> str:
    """The client address: the peer, or, when the peer is a trusted proxy, the
    right-most ``X-Forwarded-For`` entry that is not a trusted proxy."""
    peer = flask.request.remote_addr or ""
    if not _trusted(peer):
        return peer
    hops = [h.strip() for h in flask.request.headers.get("X-Forwarded-For", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop):
            return hop
    return hops[0] if hops else peer


def actor(via: str) -> str:
    """Who made a change, for its event: ``admin@ADDR (page 1a2b3c)`` for the page (the
    client address of :func:`client_addr` and a tag of the login session: six hex digits
    of the SHA-256 of its id, so two browsers of one address are told apart without the
    id itself in the events), ``admin@ADDR (api)`` for the JSON API (``via`` "api")."""
    addr = client_addr() or "?"
    if via != "page":
        return f"admin@{addr} (api)"
    sid = flask.session.get("sid")
    tag = hashlib.sha256(sid.encode()).hexdigest()[:6] if isinstance(sid, str) and sid else "-"
    return f"admin@{addr} (page {tag})"


def request_is_tls() -> bool:
    """The page was requested over TLS: directly, or through a trusted proxy that says
    so with ``X-Forwarded-Proto: https``."""
    if flask.request.is_secure:
        return True
    if not _trusted(flask.request.remote_addr):
        return False
    proto = flask.request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return proto == "https"


class SessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions with the ``Secure`` flag decided per request:
    set when ``controlplane.cookie_secure`` is on or the request came over TLS
    (:func:`request_is_tls`)."""

    def get_cookie_secure(self, app: flask.Flask) -> bool:
        if super().get_cookie_secure(app):
            return True
        try:
            return bool(settings().controlplane.cookie_secure) or request_is_tls()
        except RuntimeError:  # outside a request
            return False


# ---- throttling of login and Bearer attempts -------------------------------------------

#: Failed attempts an address may make at once.
THROTTLE_BURST = 5
#: Failed attempts an address regains per second.
THROTTLE_RATE_PER_S = 2.0
#: Addresses tracked at most (the least recently seen are forgotten first).
THROTTLE_MAX_CLIENTS = 10000


class Throttle:
    """A token bucket per client address: ``burst`` attempts, refilled at ``rate`` per
    second. Thread-safe; memory bounded by ``max_clients``."""

    def __init__(self, burst: int = THROTTLE_BURST, rate: float = THROTTLE_RATE_PER_S,
                 max_clients: int = THROTTLE_MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate, self.max_clients, self.clock = burst, rate, max_clients, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, ts

    def _level(self, client: str, now: float) -> float:
        tokens, ts = self._buckets.get(client, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - ts) * self.rate)

    def retry_after(self, client: str) -> float:
        """0 when ``client`` may try now, else seconds until it may."""
        with self._lock:
            level = self._level(client, self.clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def spend(self, client: str) -> None:
        """Count one failed attempt of ``client``."""
        with self._lock:
            now = self.clock()
            level = self._level(client, now)
            self._buckets[client] = (max(0.0, level - 1.0), now)
            self._buckets.move_to_end(client)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)


def _throttle() -> Throttle:
    return _state().setdefault("admin_throttle", Throttle())


def throttle_wait() -> int:
    """0 when this request's client may attempt a login or a Bearer token, else the
    ``Retry-After`` seconds (an integer, at least 1)."""
    wait = _throttle().retry_after(client_addr())
    return 0 if wait <= 0 else max(1, math.ceil(wait))


def attempt_failed() -> None:
    """Count a failed login or wrong Bearer token against this request's client."""
    _throttle().spend(client_addr())


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
