"""API keys of the edge: tenants and their limits, stored hashed in Redis.

Layout (schema v1, see docs/internals.md "API keys"):

- ``keynames.APIKEYS``: hash, SHA-256 hex of the plaintext key -> JSON :class:`ApiKey`
  without the hash: ``{"id", "tenant", "label", "rpm", "tpm", "created", "revoked"}``.
  The edge hashes the ``Authorization: Bearer`` value and does one ``HGET``; the key is
  valid only if the record exists **and** ``revoked`` is ``null``.
- ``keynames.APIKEY_IDS``: hash, key id -> SHA-256 hex, to list and revoke by id.

Keys are ``ig-`` followed by 43 URL-safe characters (256 random bits from
:mod:`secrets`); the plaintext is returned once by :func:`create_key` and never stored.
Key ids are 8 hex characters, random and unrelated to the key (safe to show and log).

All functions take a ``redis.Redis`` built with ``decode_responses=True`` and raise
``redis.exceptions.RedisError`` when Redis is unreachable; invalid input raises
:class:`ApiKeyError` (a ``ValueError``).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis

from controlplane.redisdb import keynames

KEY_PREFIX = "ig-"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ID_RE = re.compile(r"^[0-9a-f]{8}$")
MAX_LIMIT = 10**9


class ApiKeyError(ValueError):
    """Invalid tenant, label or limit."""


@dataclass
class ApiKey:
    """One API key record (never holds the plaintext key)."""

    id: str
    tenant: str
    label: str = ""
    rpm: int | None = None
    """Requests per minute allowed for this key; ``None`` = no limit."""
    tpm: int | None = None
    """Tokens (prompt + completion) per minute; ``None`` = no limit."""
    created: float = 0.0
    """Epoch seconds."""
    revoked: float | None = None
    """Epoch seconds of revocation; ``None`` while the key is valid."""

    @property
    def active(self) -> bool:
        return self.revoked is None

    def to_dict(self) -> dict:
        return asdict(self)


def hash_key(plaintext: str) -> str:
    """SHA-256 hex digest of the key as sent by the client (UTF-8)."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def _check_limit(name: str, value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ApiKeyError(f"{name} must be a positive integer or empty (no limit)")
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ApiKeyError(f"{name} must be a positive integer or empty (no limit)") from None
    if isinstance(value, float) and value != n:
        raise ApiKeyError(f"{name} must be a whole number")
    if n <= 0 or n > MAX_LIMIT:
        raise ApiKeyError(f"{name} must be between 1 and {MAX_LIMIT} (or empty for no limit)")
    return n


def _check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ApiKeyError("tenant: letters, digits, '-', '_', '.', 1 to 63 characters")
    return tenant


def _check_label(label: object) -> str:
    if label is None:
        return ""
    if not isinstance(label, str) or len(label) > 200 or any(ord(c) < 32 for c in label):
        raise ApiKeyError("label: text of at most 200 printable characters")
    return label


def _load(raw: str | None) -> ApiKey | None:
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return ApiKey(id=str(d["id"]), tenant=str(d["tenant"]), label=str(d.get("label", "")),
                      rpm=d.get("rpm"), tpm=d.get("tpm"), created=float(d.get("created", 0)),
                      revoked=None if d.get("revoked") is None else float(d["revoked"]))
    except (ValueError, KeyError, TypeError):
        return None


def create_key(r: redis.Redis, tenant: str, *, rpm: object = None, tpm: object = None,
               label: str | None = None, now: float | None = None) -> tuple[str, ApiKey]:
    """Create a key for ``tenant``; returns ``(plaintext, record)``.

    The plaintext is shown to the operator once; only its SHA-256 is stored.
    Raises :class:`ApiKeyError` for a bad tenant, label or limit."""
    rec = ApiKey(id="", tenant=_check_tenant(tenant), label=_check_label(label),
                 rpm=_check_limit("rpm", rpm), tpm=_check_limit("tpm", tpm),
                 created=time.time() if now is None else now)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = hash_key(plaintext)
    for _ in range(20):
        rec.id = secrets.token_hex(4)
        if r.hsetnx(keynames.APIKEY_IDS, rec.id, digest):
            break
    else:  # pragma: no cover - 20 collisions in 2^32 ids
        raise ApiKeyError("could not allocate a key id")
    r.hset(keynames.APIKEYS, digest, json.dumps(rec.to_dict(), sort_keys=True))
    return plaintext, rec


def lookup(r: redis.Redis, plaintext: str) -> ApiKey | None:
    """The record of a valid (not revoked) key, else ``None``. What the edge does in Lua."""
    rec = _load(r.hget(keynames.APIKEYS, hash_key(plaintext)))
    return rec if rec is not None and rec.active else None


def get_key(r: redis.Redis, key_id: str) -> ApiKey | None:
    """The record with id ``key_id`` (revoked ones included), else ``None``."""
    if not ID_RE.match(key_id or ""):
        return None
    digest = r.hget(keynames.APIKEY_IDS, key_id)
    return _load(r.hget(keynames.APIKEYS, digest)) if digest else None


def list_keys(r: redis.Redis, include_revoked: bool = True) -> list[ApiKey]:
    """All key records, newest first."""
    out = [k for raw in r.hvals(keynames.APIKEYS) if (k := _load(raw)) is not None]
    if not include_revoked:
        out = [k for k in out if k.active]
    return sorted(out, key=lambda k: (-k.created, k.id))


def _update(r: redis.Redis, key_id: str, change: Callable[[ApiKey], bool]) -> ApiKey | None:
    """Read-modify-write of one record under ``WATCH``, retried when another writer got
    in between, so two concurrent changes (a revocation and a limit edit) never undo each
    other. ``change`` edits the record and returns whether to write it. Returns the
    record, or ``None`` if no key has that id."""
    if not ID_RE.match(key_id or ""):
        return None
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keynames.APIKEY_IDS, keynames.APIKEYS)
                digest = pipe.hget(keynames.APIKEY_IDS, key_id)
                rec = _load(pipe.hget(keynames.APIKEYS, digest)) if digest else None
                if rec is None:
                    pipe.unwatch()
                    return None
                if not change(rec):
                    pipe.unwatch()
                    return rec
                pipe.multi()
                pipe.hset(keynames.APIKEYS, digest, json.dumps(rec.to_dict(), sort_keys=True))
                pipe.execute()
                return rec
            except redis.WatchError:
                continue


def revoke_key(r: redis.Redis, key_id: str, now: float | None = None) -> ApiKey | None:
    """Mark the key revoked (idempotent: the first revocation time is kept).

    Returns the updated record, or ``None`` if no key has that id."""
    when = time.time() if now is None else now

    def revoke(rec: ApiKey) -> bool:
        if rec.revoked is not None:
            return False
        rec.revoked = when
        return True

    return _update(r, key_id, revoke)


def set_limits(r: redis.Redis, key_id: str, *, rpm: object = ..., tpm: object = ...,
               label: object = ...) -> ApiKey | None:
    """Change the limits (``None`` or empty = no limit) and/or the label of a key.

    Arguments left out keep their value. Returns the updated record, ``None`` if no key
    has that id; raises :class:`ApiKeyError` for a bad value."""
    changes: dict[str, object] = {}
    if rpm is not ...:
        changes["rpm"] = _check_limit("rpm", rpm)
    if tpm is not ...:
        changes["tpm"] = _check_limit("tpm", tpm)
    if label is not ...:
        changes["label"] = _check_label(label)

    def apply(rec: ApiKey) -> bool:
        for name, value in changes.items():
            setattr(rec, name, value)
        return True

    return _update(r, key_id, apply)
