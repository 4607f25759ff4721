"""API keys of the edge: tenants and their limits, stored hashed in Redis.

Layout (schema v1, see docs/internals.md "API keys"):

- ``keynames.APIKEYS``: hash, SHA-256 hex of the plaintext key -> JSON :class:`ApiKey`
  without the hash: ``{"id", "tenant", "label", "rpm", "tpm", "weight", "priority",
  "created", "revoked"}`` (``weight`` / ``priority``: the key's fair share, ``None`` =
  the tenant's default, ``[admission]`` in the configuration).
  The edge hashes the ``Authorization: Bearer`` value and does one ``HGET``; the key is
  valid only if the record exists **and** ``revoked`` is ``null``.
- ``keynames.APIKEY_IDS``: hash, key id -> SHA-256 hex, to list and revoke by id. An id
  it lacks (the index evicted or deleted while the records stayed) is looked for among the
  records and written back by the change that needs it (:func:`_update`).
- ``keynames.APIKEYS_MARKER``: set by every write. Without it (Redis came back empty)
  the edges keep honouring the valid keys they knew, never a revoked one, until the keys
  are written again (``infergate keys import``).

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
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import redis

from controlplane.config.routing import DECIMAL_RE
from controlplane.redisdb import genlog, keynames
from controlplane.errors import InfergateError

KEY_PREFIX = "ig-"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
ID_RE = re.compile(r"^[0-9a-f]{8}\Z")
MAX_LIMIT = 10**9
#: Priority classes of a key, highest first (docs/admission.md "Fair share").
PRIORITIES = ("critical", "standard", "sheddable")
MAX_WEIGHT = 1000.0


class ApiKeyError(InfergateError, ValueError):
    """Invalid tenant, label or limit."""


class KeyRevoked(ApiKeyError):
    """The key is revoked: its record no longer changes."""


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
    weight: float | None = None
    """Fair-share weight (0.01-1000; tokens served count / weight); ``None`` = the
    tenant's default."""
    priority: str | None = None
    """Priority class (:data:`PRIORITIES`); ``None`` = the tenant's default."""
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
    except (TypeError, ValueError, OverflowError):
        raise ApiKeyError(f"{name} must be a positive integer or empty (no limit)") from None
    if isinstance(value, float) and value != n:
        raise ApiKeyError(f"{name} must be a whole number")
    if n <= 0 or n > MAX_LIMIT:
        raise ApiKeyError(f"{name} must be between 1 and {MAX_LIMIT} (or empty for no limit)")
    return n


def _check_weight(value: object) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or (isinstance(value, str)
                                   and not DECIMAL_RE.match(value.strip())):
        # text is a plain decimal number: Python's float() also reads "1_000" and "inf"
        raise ApiKeyError("weight must be a number from 0.01 to 1000 or empty (default)")
    try:
        w = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ApiKeyError("weight must be a number from 0.01 to 1000 or empty (default)") from None
    if not 0.01 <= w <= MAX_WEIGHT:
        raise ApiKeyError("weight must be a number from 0.01 to 1000 or empty (default)")
    return w


def _check_priority(value: object) -> str | None:
    if value is None or value == "":
        return None
    if value not in PRIORITIES:
        raise ApiKeyError(f"priority must be one of {', '.join(PRIORITIES)} or empty (default)")
    return str(value)


def _check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ApiKeyError("tenant: letters, digits, '-', '_', '.', 1 to 63 characters")
    return tenant


#: Unicode categories a label may not hold: control characters, format characters
#: (bidirectional overrides, zero-width characters, the BOM), line and paragraph
#: separators (U+2028, U+2029) and surrogates (what a
#: command line that is not UTF-8 turns into; they cannot be written as UTF-8).
_LABEL_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _check_label(label: object) -> str:
    if label is None:
        return ""
    if (not isinstance(label, str) or len(label) > 200
            or any(unicodedata.category(c) in _LABEL_BAD_CATEGORIES for c in label)):
        raise ApiKeyError("label: text of at most 200 printable characters (no control, "
                          "format or surrogate characters)")
    return label


def _load(raw: str | None) -> ApiKey | None:
    if not raw:
        return None
    try:
        d = json.loads(raw)
        # a label stored before it was checked as now must not break the pages that list it
        label = str(d.get("label", "")).encode("utf-8", "replace").decode("utf-8")
        return ApiKey(id=str(d["id"]), tenant=str(d["tenant"]), label=label,
                      rpm=d.get("rpm"), tpm=d.get("tpm"), weight=d.get("weight"),
                      priority=d.get("priority"), created=float(d.get("created", 0)),
                      revoked=None if d.get("revoked") is None else float(d["revoked"]))
    except (ValueError, KeyError, TypeError):
        return None


def mark_written(r: redis.Redis | redis.client.Pipeline) -> None:
    """Mark the key store as written (``keynames.APIKEYS_MARKER``, JSON ``{"written":
    epoch_s, "n": 8 random hex}``): the edges tell a lost store from a key that was never
    there by it, and every write gives it a new value (two writes in one millisecond
    too), by which the edges and the control plane know to read the keys again."""
    r.set(keynames.APIKEYS_MARKER, json.dumps({"written": round(time.time(), 3),
                                               "n": secrets.token_hex(4)}))


def store_missing(r: redis.Redis) -> bool:
    """True when the key store's marker is missing: the API keys were lost (Redis came
    back empty) or never written. Raises ``redis.RedisError``."""
    return not r.exists(keynames.APIKEYS_MARKER)


#: An edge report older than this many seconds does not count in :func:`store_status`.
EDGE_REPORT_FRESH_S = 30.0


def store_status(r: redis.Redis, now: float | None = None,
                 edges: dict[str, str] | None = None) -> dict:
    """``{"store_missing": bool, "edges_keeping": [edge id, ...]}``: whether the key
    store's marker is missing (:func:`store_missing`) and which edges (reports fresher
    than :data:`EDGE_REPORT_FRESH_S`) say they keep honouring the keys they knew because
    Redis answers without its keys (admission ``auth_store_missing``). ``edges``: the
    ``keynames.EDGES`` hash when the caller has read it already. Raises
    ``redis.RedisError``."""
    now = time.time() if now is None else now
    keeping = []
    edges = r.hgetall(keynames.EDGES) if edges is None else edges
    for edge_id, raw in sorted(edges.items()):
        try:
            d = json.loads(raw)
            fresh = now - float(d.get("ts") or 0) < EDGE_REPORT_FRESH_S
            if fresh and (d.get("admission") or {}).get("auth_store_missing"):
                keeping.append(str(edge_id))
        except (ValueError, TypeError, AttributeError):
            continue
    return {"store_missing": store_missing(r), "edges_keeping": keeping}


def loss_pending(r: redis.Redis | redis.client.Pipeline) -> bool:
    """True while the key store was lost and not restored: its marker is missing and an
    edge says it keeps honouring the keys it knew (:func:`store_status`). A key created,
    edited or revoked meanwhile does not set the marker again (:func:`mark_changed`), so
    the edges go on merging what Redis holds into the records they keep instead of
    refusing every key not restored; ``keys import`` (or a control plane's copy) sets
    it. Raises ``redis.RedisError``."""
    return store_missing(r) and bool(store_status(r)["edges_keeping"])


def bump(r: redis.Redis | redis.client.Pipeline) -> str:
    """Queue the INCR of the key store's generation (``keynames.APIKEYS_GEN``) that goes
    with every write of a key record (:mod:`controlplane.routing.statecopy` tells by it
    that Redis came back older), with the push of a token on its write log
    (:mod:`controlplane.redisdb.genlog`); returns the token."""
    return genlog.push(r, keynames.APIKEYS_GEN, keynames.APIKEYS_GEN_LOG)


def mark_changed(r: redis.Redis | redis.client.Pipeline, pending: bool) -> None:
    """:func:`mark_written` after a key write, unless a loss is pending (``pending``:
    :func:`loss_pending` as read before the write)."""
    if not pending:
        mark_written(r)


def create_key(r: redis.Redis, tenant: str, *, rpm: object = None, tpm: object = None,
               label: str | None = None, now: float | None = None, weight: object = None,
               priority: object = None) -> tuple[str, ApiKey]:
    """Create a key for ``tenant``; returns ``(plaintext, record)``.

    The plaintext is shown to the operator once; only its SHA-256 is stored.
    Raises :class:`ApiKeyError` for a bad tenant, label, limit, weight or priority."""
    rec = ApiKey(id="", tenant=_check_tenant(tenant), label=_check_label(label),
                 rpm=_check_limit("rpm", rpm), tpm=_check_limit("tpm", tpm),
                 weight=_check_weight(weight), priority=_check_priority(priority),
                 created=time.time() if now is None else now)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = hash_key(plaintext)
    for _ in range(20):
        rec.id = secrets.token_hex(4)
        if r.hsetnx(keynames.APIKEY_IDS, rec.id, digest):
            break
    else:  # pragma: no cover - 20 collisions in 2^32 ids
        raise ApiKeyError("could not allocate a key id")
    pending = loss_pending(r)
    with r.pipeline(transaction=True) as pipe:   # the keys share one slot (keynames)
        pipe.hset(keynames.APIKEYS, digest, json.dumps(rec.to_dict(), sort_keys=True))
        bump(pipe)
        mark_changed(pipe, pending)
        pipe.execute()
    return plaintext, rec


def lookup(r: redis.Redis, plaintext: str) -> ApiKey | None:
    """The record of a valid (not revoked) key, else ``None``. What the edge does in Lua."""
    rec = _load(r.hget(keynames.APIKEYS, hash_key(plaintext)))
    return rec if rec is not None and rec.active else None


def _digest_of(r: redis.Redis | redis.client.Pipeline, key_id: str) -> tuple[str | None, bool]:
    """``(digest, indexed)``: the digest of the key with id ``key_id`` from the id index,
    else found among the records (``indexed`` False: the index lacks it, lost without
    the records: an eviction, a deletion by hand); ``(None, False)`` when no record has
    that id."""
    digest = r.hget(keynames.APIKEY_IDS, key_id)
    if digest:
        return digest, True
    for d, raw in r.hgetall(keynames.APIKEYS).items():
        rec = _load(raw)
        if rec is not None and rec.id == key_id:
            return d, False
    return None, False


def get_key(r: redis.Redis, key_id: str) -> ApiKey | None:
    """The record with id ``key_id`` (revoked ones included), else ``None``."""
    if not ID_RE.match(key_id or ""):
        return None
    digest, _ = _digest_of(r, key_id)
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
    # transaction=True: WATCH on a cluster needs it (the keys share one slot, keynames)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keynames.APIKEY_IDS, keynames.APIKEYS)
                digest, indexed = _digest_of(pipe, key_id)
                rec = _load(pipe.hget(keynames.APIKEYS, digest)) if digest else None
                if rec is None:
                    pipe.unwatch()
                    return None
                if not change(rec):
                    pipe.unwatch()
                    return rec
                pending = loss_pending(pipe)
                pipe.multi()
                pipe.hset(keynames.APIKEYS, digest, json.dumps(rec.to_dict(), sort_keys=True))
                if not indexed:
                    pipe.hset(keynames.APIKEY_IDS, key_id, digest)
                bump(pipe)
                mark_changed(pipe, pending)
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


class KeyChanged(ApiKeyError):
    """A form's change to a field of a key that someone else changed since the form was
    shown: nothing is written. ``fields``: those fields."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


_CHECKS: dict[str, Callable[[object], object]] = {
    "rpm": lambda v: _check_limit("rpm", v),
    "tpm": lambda v: _check_limit("tpm", v),
    "label": _check_label,
    "weight": _check_weight,
    "priority": _check_priority,
}
#: Fields :func:`change_key` may change.
EDITABLE: tuple[str, ...] = tuple(_CHECKS)


def change_key(r: redis.Redis, key_id: str, changes: dict[str, object],
               seen: dict[str, object] | None = None) -> tuple[ApiKey, list[str]] | None:
    """Change some of :data:`EDITABLE` of a key in one transaction (:func:`_update`):
    ``rpm`` / ``tpm`` (``None`` or empty = no limit), ``weight`` / ``priority`` (``None``
    or empty = the tenant's default), ``label``. Returns ``(record, the fields whose
    value changed)`` (none changed: nothing written), ``None`` if no key has that id.

    ``seen`` (a form): the values the form showed, by field. A field whose new value
    equals the one shown was not changed by the user and is left alone; a field the
    user changed that someone else changed meanwhile to another value refuses the whole
    change (:class:`KeyChanged`). Raises :class:`ApiKeyError` for an unknown field or a bad
    value, :class:`KeyRevoked` for a revoked key (nothing is written: a limit on a key
    that no edge accepts would only mislead whoever reads the list)."""
    unknown = sorted(set(changes) - set(EDITABLE))
    if unknown:
        raise ApiKeyError(f"unknown field(s): {', '.join(unknown)}")
    wanted = {k: _CHECKS[k](v) for k, v in changes.items()}
    shown = {k: _CHECKS[k](seen[k]) for k in wanted if seen is not None and k in seen}
    changed: list[str] = []

    def apply(rec: ApiKey) -> bool:
        if rec.revoked:
            raise KeyRevoked(f"API key {key_id} is revoked; create a new key instead")
        changed.clear()
        stale = []
        for name, value in wanted.items():
            if name in shown:
                if value == shown[name] or value == getattr(rec, name):
                    continue                    # as shown (not changed here), or as stored
                if getattr(rec, name) != shown[name]:
                    stale.append(name)          # changed by someone else since shown
                    continue
            if getattr(rec, name) != value:
                changed.append(name)
        if stale:
            raise KeyChanged(", ".join(f"{n} was changed by someone else since you opened "
                                       f"this page (now {_shown(getattr(rec, n))})"
                                       for n in stale)
                             + "; reload the page and make your change again. Nothing was "
                               "saved.", stale)
        for name in changed:
            setattr(rec, name, wanted[name])
        return bool(changed)

    rec = _update(r, key_id, apply)
    return None if rec is None else (rec, list(changed))


def _shown(value: object) -> str:
    return "no limit" if value is None else str(value)[:200]


def set_limits(r: redis.Redis, key_id: str, *, rpm: object = ..., tpm: object = ...,
               label: object = ..., weight: object = ...,
               priority: object = ...) -> ApiKey | None:
    """Change the limits (``None`` or empty = no limit), the fair share (``weight``,
    ``priority``; ``None`` or empty = the tenant's default) and/or the label of a key
    (:func:`change_key`). Arguments left out keep their value. Returns the updated
    record, ``None`` if no key has that id; raises :class:`ApiKeyError` for a bad value
    and :class:`KeyRevoked` for a revoked key."""
    given = {"rpm": rpm, "tpm": tpm, "label": label, "weight": weight, "priority": priority}
    res = change_key(r, key_id, {k: v for k, v in given.items() if v is not ...})
    return None if res is None else res[0]


#: ``format`` of an export document (:func:`export_keys`).
EXPORT_FORMAT = "infergate-apikeys"
EXPORT_VERSION = 1
HASH_RE = re.compile(r"^[0-9a-f]{64}\Z")


@dataclass
class ImportResult:
    """What :func:`import_keys` did: ids written, ids already present (same hash,
    unchanged unless ``overwrite``), ids refused because the id belongs to another key
    here, and ids revoked here that the file has valid (``overwrite``: written with the
    revocation kept -- an import never un-revokes a key)."""

    added: list[str]
    kept: list[str]
    conflicts: list[str]
    kept_revoked: list[str] = field(default_factory=list)


def export_keys(r: redis.Redis, now: float | None = None) -> dict:
    """Every key record with its hash, for a backup: ``{"format": "infergate-apikeys",
    "version": 1, "exported": epoch_s, "keys": [{"hash", "id", "tenant", "label", "rpm",
    "tpm", "created", "revoked"}, ...]}`` (oldest first). Holds SHA-256 hashes, never a
    plaintext key: a client key works again after :func:`import_keys`, but the file
    cannot be used to call the edge. Records that are not valid JSON are left out."""
    keys = []
    for digest, raw in r.hgetall(keynames.APIKEYS).items():
        rec = _load(raw)
        if rec is not None and HASH_RE.match(digest):
            keys.append({"hash": digest, **rec.to_dict()})
    keys.sort(key=lambda k: (k["created"], k["id"]))
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
            "exported": time.time() if now is None else now, "keys": keys}


def _import_record(d: object, where: str) -> tuple[str, ApiKey]:
    if not isinstance(d, dict):
        raise ApiKeyError(f"{where}: must be an object")
    digest = d.get("hash")
    if not isinstance(digest, str) or not HASH_RE.match(digest):
        raise ApiKeyError(f"{where}.hash: 64 lowercase hex digits (SHA-256 of the key)")
    key_id = d.get("id")
    if not isinstance(key_id, str) or not ID_RE.match(key_id):
        raise ApiKeyError(f"{where}.id: 8 lowercase hex digits")
    try:
        created = float(d.get("created", 0))
        revoked = None if d.get("revoked") is None else float(d["revoked"])
    except (TypeError, ValueError):
        raise ApiKeyError(f"{where}: created and revoked are epoch seconds") from None
    try:
        rec = ApiKey(id=key_id, tenant=_check_tenant(d.get("tenant")),
                     label=_check_label(d.get("label")), rpm=_check_limit("rpm", d.get("rpm")),
                     tpm=_check_limit("tpm", d.get("tpm")), weight=_check_weight(d.get("weight")),
                     priority=_check_priority(d.get("priority")), created=created,
                     revoked=revoked)
    except ApiKeyError as exc:
        raise ApiKeyError(f"{where}: {exc}") from None
    return digest, rec


def import_keys(r: redis.Redis, doc: object, *, overwrite: bool = False) -> ImportResult:
    """Write the records of an :func:`export_keys` document back (a restore).

    Every record is checked before anything is written (:class:`ApiKeyError` names the
    first bad one). A record whose hash is already stored is kept as it is, unless
    ``overwrite`` (then the file's record wins: tenant, label, limits, fair share) -- but a key
    revoked here stays revoked, with its revocation time, whatever the file says (an old
    backup must not bring a revoked key back; listed in ``kept_revoked``); a record whose
    id is taken by another key is refused (listed in ``conflicts``). Each record is
    checked and written with its id index in one transaction (``WATCH``), so a
    revocation made during the import is kept too."""
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ApiKeyError(f'not an API key export (expected "format": "{EXPORT_FORMAT}")')
    if doc.get("version") != EXPORT_VERSION:
        raise ApiKeyError(f"unsupported export version {doc.get('version')!r} "
                          f"(this version reads {EXPORT_VERSION})")
    items = doc.get("keys")
    if not isinstance(items, list):
        raise ApiKeyError('"keys" must be a list')
    recs = [_import_record(d, f"keys[{i}]") for i, d in enumerate(items)]
    out = ImportResult([], [], [])
    for digest, rec in recs:
        _import_one(r, digest, rec, overwrite, out)
    mark_written(r)  # restored: the edges trust Redis' answers again
    return out


def _import_one(r: redis.Redis, digest: str, rec: ApiKey, overwrite: bool,
                out: ImportResult) -> None:
    """One record of :func:`import_keys`, checked and written under ``WATCH``."""
    with r.pipeline(transaction=True) as pipe:  # the keys share one slot (keynames)
        while True:
            try:
                pipe.watch(keynames.APIKEYS, keynames.APIKEY_IDS)
                have_digest = pipe.hget(keynames.APIKEY_IDS, rec.id)
                if have_digest is not None and have_digest != digest:
                    out.conflicts.append(rec.id)
                    return
                raw = pipe.hget(keynames.APIKEYS, digest)
                exists = raw is not None
                if exists and not overwrite:
                    if have_digest is None:  # the record survived, its id index did not
                        pipe.multi()
                        pipe.hset(keynames.APIKEY_IDS, rec.id, digest)
                        bump(pipe)
                        pipe.execute()
                    out.kept.append(rec.id)
                    return
                write = rec
                here = _load(raw) if exists else None
                if here is not None and here.revoked is not None and rec.revoked is None:
                    write = ApiKey(**{**rec.to_dict(), "revoked": here.revoked})
                pipe.multi()
                pipe.hset(keynames.APIKEYS, digest, json.dumps(write.to_dict(), sort_keys=True))
                pipe.hset(keynames.APIKEY_IDS, rec.id, digest)
                bump(pipe)
                pipe.execute()
                (out.kept if exists else out.added).append(rec.id)
                if write is not rec:
                    out.kept_revoked.append(rec.id)
                return
            except redis.WatchError:
                continue
