"""Every change an operator makes, shared by the API, the page and the CLI: the node
registry (add, edit, remove), drain/undrain, API keys (create, edit, revoke) and the
response-cache purge.

Every change writes an event (``registry.add_event``) naming the actor: ``admin`` for
the web page and API, ``cli:<user>`` for the command line. Event kinds and details:

- ``node_add`` (the node document), ``node_edit`` (``{field: [old, new]}``; none when
  nothing changed), ``node_remove``, ``drain`` / ``undrain`` (``{"from": state}``; none
  when nothing changed);
- ``key_create`` (``{"id", "tenant"}``), ``key_edit`` (``{"id", "tenant"}`` + the new
  value of each changed field; none when nothing changed), ``key_revoke`` (``{"id",
  "tenant"}``; none when the key was already revoked);
- ``cache_purge`` (the scope + ``"purged"``, the entries deleted);
- ``cache_flag`` (``{"id", "namespace"}``: an answer flagged as wrong and dropped; none
  when it was flagged before).

Errors are :class:`AdminError` subclasses carrying an HTTP status, an error type and a
code, so each front end can render them its own way (JSON error, flash message, exit
1). Redis being unreachable raises ``redis.exceptions.RedisError`` unchanged.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis
from pydantic import ValidationError

from controlplane.admin import apikeys
from controlplane.admin.nodeurl import node_url_refusal, resolve_host  # noqa: F401 (re-exported)
from controlplane.cache import store as cache_store
from controlplane.config import NodeSettings, Settings
from controlplane.errors import InfergateError
from controlplane.redisdb import keynames
from controlplane.routing import keycopies, ownaddrs, registry
from controlplane.routing.registry import NodeState

EDITABLE: tuple[str, ...] = ("url", "kind", "weight", "max_concurrency", "metrics_path",
                             "health_path", "models", "poll_models")
"""Fields ``PATCH /nodes/<name>`` may change (the name is the identity and cannot)."""


class AdminError(InfergateError):
    """A request the admin cannot carry out; ``status`` is the HTTP status to answer."""

    status = 400
    type = "invalid_request_error"
    code = "bad_request"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code


class BadInput(AdminError):
    status = 400
    code = "invalid_value"


class NotFound(AdminError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class Conflict(AdminError):
    status = 409
    type = "conflict_error"
    code = "already_exists"


def validation_message(exc: ValidationError) -> str:
    """One line per invalid field: ``field: reason``."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_node(data: object) -> NodeSettings:
    """Validate a node document through :class:`NodeSettings`; raises :class:`BadInput`
    with every invalid field named (bad name, url, unknown kind, weight <= 0, ...)."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with name, url, kind, weight, max_concurrency")
    try:
        return NodeSettings.model_validate(data)
    except ValidationError as exc:
        raise BadInput(validation_message(exc)) from None


def check_node_url(node: NodeSettings, settings: Settings | None,
                   published: list[ownaddrs.OwnAddress] | tuple = ()) -> NodeSettings:
    """``node`` when its URL may be used (:func:`node_url_refusal`), else raises
    :class:`BadInput` (code ``node_url_refused``)."""
    why = node_url_refusal(node.url, settings, published)
    if why:
        raise BadInput(why, "node_url_refused")
    return node


def _no_node(name: str) -> NotFound:
    return NotFound(f"no node named {registry.shorten(name)!r}", "node_not_found")


def _require(r: redis.Redis, name: str) -> NodeSettings:
    node = registry.get_node(r, name)
    if node is None:
        raise _no_node(name)
    return node


def _taken(exc: registry.UrlTaken | registry.NameTaken) -> Conflict:
    """A registry refusal as :class:`Conflict`: ``node_url_taken`` or ``node_exists``."""
    if isinstance(exc, registry.NameTaken):
        return Conflict(str(exc), "node_exists")
    return Conflict(f"{exc} (drain, edit or remove that one)", "node_url_taken")


def _put_unique(r: redis.Redis, node: NodeSettings, only_new: bool = False) -> bool:
    """:func:`registry.put_node_unique`, its refusals as :class:`Conflict`
    (``node_url_taken``, ``node_exists``)."""
    try:
        return registry.put_node_unique(r, node, only_new=only_new)
    except (registry.UrlTaken, registry.NameTaken) as exc:
        raise _taken(exc) from None


def add_node(r: redis.Redis, data: object, actor: str, events_max: int = 10000,
             settings: Settings | None = None) -> NodeSettings:
    """Register a new node. Raises :class:`BadInput` (also for a refused URL, see
    :func:`node_url_refusal`: the running stack's published addresses are refused
    whatever ``settings``; ``settings`` adds its own addresses and the allow list),
    :class:`Conflict` (name taken, also in another case: ``node_exists``; its server
    registered under another name: ``node_url_taken``). The node starts ``active``."""
    node = parse_node(data)
    if node.has_credential() or node.ca_file:
        # a path or variable name given here would be read on the control plane's host
        # and sent to the node: only the TOML file may name them
        raise BadInput("api_key_env, api_key_file and ca_file are set in the TOML file's "
                       "[[nodes]] only", "node_access_refused")
    check_node_url(node, settings, ownaddrs.published(r))
    if not _put_unique(r, node, only_new=True):
        raise Conflict(f"a node named {node.name!r} already exists", "node_exists")
    registry.add_event(r, "node_add", node.name, actor, node.model_dump(), maxlen=events_max)
    return node


class Stale(Conflict):
    """A form's change to a field that someone else changed since the form was shown
    (409 ``changed_meanwhile``): nothing is written."""

    code = "changed_meanwhile"


def _field(base: NodeSettings, field: str, value: object) -> object:
    """``value`` of node ``field`` as stored (validated, normalised: ``"2"`` -> 2.0, a URL
    without its trailing slash), on ``base``'s other fields. Raises :class:`BadInput`."""
    return getattr(parse_node({**base.model_dump(), field: value, "name": base.name}), field)


@dataclass
class NodeEdit:
    """Result of :func:`change_node`: the node as stored now, and ``{field: [old, new]}``
    of what this call changed (empty: nothing changed, nothing written)."""

    node: NodeSettings
    diff: dict[str, list]


def _check_changes(name: str, changes: object) -> dict:
    if not isinstance(changes, dict) or not changes:
        raise BadInput(f"expected a JSON object with some of {', '.join(EDITABLE)}")
    if "name" in changes and changes["name"] != name:
        raise BadInput("name: a node cannot be renamed; remove it and add it again")
    unknown = sorted(set(changes) - set(EDITABLE) - {"name"})
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; editable: {', '.join(EDITABLE)}")
    return {k: v for k, v in changes.items() if k != "name"}


def change_node(r: redis.Redis, name: str, changes: object, actor: str,
                events_max: int = 10000, settings: Settings | None = None,
                seen: dict | None = None) -> NodeEdit:
    """Change some fields of a node (see :data:`EDITABLE`), each on the document as
    stored when it is written: the check that the node exists, the merge and the write
    are one transaction (:func:`registry.update_node`), so a concurrent change of
    another field is kept and a concurrent removal wins (404).

    ``seen`` (a form): the values the form showed, by field. A field whose new value
    equals what the form showed was not changed by the user and is left alone; a field
    the user changed that someone else changed meanwhile to another value (the stored
    value is neither the one shown nor the user's) refuses the whole edit
    (:class:`Stale`). Without ``seen`` (the API,
    the CLI) every field given is applied.

    Writes ``node_edit`` (``{field: [old, new]}``) when something changed, nothing
    otherwise. Raises :class:`NotFound`, :class:`BadInput` (unknown or invalid field, a
    refused URL as in :func:`add_node`, or a rename attempt), :class:`Conflict` (a new
    URL another node has), :class:`Stale`."""
    changes = _check_changes(name, changes)
    current = _require(r, name)
    # validated first, outside the transaction (the URL check may resolve a name)
    probe = parse_node({**current.model_dump(), **changes, "name": name})
    if "url" in changes:
        check_node_url(probe, settings, ownaddrs.published(r))
    shown = {k: _field(current, k, seen[k]) for k in changes if seen is not None and k in seen}

    def apply(now: NodeSettings) -> NodeSettings:
        wanted = {}
        stale = []
        for k, v in changes.items():
            if k in shown:
                mine = _field(now, k, v)
                if mine == shown[k] or mine == getattr(now, k):
                    continue            # as shown (not changed by this user), or as stored
                if getattr(now, k) != shown[k]:
                    stale.append(k)     # changed by someone else since it was shown
                    continue
            wanted[k] = v
        if stale:
            raise Stale(", ".join(f"{k} was changed by someone else since you opened this "
                                  f"page (now {registry.shorten(str(getattr(now, k)))})"
                                  for k in stale)
                        + "; reload the page and make your change again. Nothing was saved.")
        return parse_node({**now.model_dump(), **wanted, "name": name})

    try:
        res = registry.update_node(r, name, apply)
    except (registry.UrlTaken, registry.NameTaken) as exc:
        raise _taken(exc) from None
    if res is None:
        raise _no_node(name)
    diff = {k: [getattr(res.before, k), getattr(res.after, k)] for k in EDITABLE
            if getattr(res.before, k) != getattr(res.after, k)}
    if diff:
        registry.add_event(r, "node_edit", name, actor, diff, maxlen=events_max)
    return NodeEdit(res.after, diff)


def edit_node(r: redis.Redis, name: str, changes: object, actor: str,
              events_max: int = 10000, settings: Settings | None = None) -> NodeSettings:
    """:func:`change_node` without ``seen`` (field-level merge, as ``PATCH``); returns
    the node as stored now."""
    return change_node(r, name, changes, actor, events_max, settings).node


def remove_node(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> None:
    """Delete a node with its state, metrics and history (entry and state in one
    transaction, :func:`registry.remove_node`). Raises :class:`NotFound`, also to the
    second of two removals at once."""
    if not registry.remove_node(r, name):
        raise _no_node(name)
    registry.add_event(r, "node_remove", name, actor, maxlen=events_max)


@dataclass
class StateChange:
    """Result of drain/undrain: the state now, whether this call changed it, and a
    ``warning`` for the operator (empty when none: see :func:`drain_warning`)."""

    name: str
    state: str
    since: float
    actor: str
    changed: bool
    warning: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _state_change(name: str, st: NodeState, changed: bool) -> StateChange:
    return StateChange(name, st.state, st.since, st.actor, changed)


def _served(node: NodeSettings, routed: dict[str, list[str] | None]) -> list[str] | None:
    """The models ``node`` serves: configured, else as the routing snapshot lists them
    (read from its ``/v1/models``); None = unknown (the edge may send it any model)."""
    return node.models or routed.get(node.name) or None


def _routed_models(r: redis.Redis) -> dict[str, list[str] | None]:
    """Node name -> its models in the routing snapshot (missing or unreadable: none)."""
    try:
        snap = json.loads(r.get(keynames.ROUTING) or "{}")
        return {str(n["name"]): (n.get("models") or None) for n in snap.get("nodes") or ()
                if isinstance(n, dict) and "name" in n}
    except (ValueError, TypeError, AttributeError):
        return {}


def drain_warning(r: redis.Redis, name: str) -> str:
    """What a drain of ``name`` leaves without an active node, in words for the operator
    (empty when nothing): no active node at all, or the models ``name`` serves (configured
    or listed in the routing snapshot) that no other active node serves -- requests for
    them get 503 ``no_healthy_upstream`` until a node is undrained or added. A node whose
    models are unknown counts as serving every model."""
    nodes = registry.list_nodes(r)
    me = next((n for n in nodes if n.name == name), None)
    if me is None:
        return ""
    states = registry.get_states(r)
    active = [n for n in nodes
              if n.name != name and states.get(n.name, NodeState()).state == "active"]
    if not active:
        return ("no active node is left: every request will get 503 no_healthy_upstream "
                "until a node is undrained or added")
    routed = _routed_models(r)
    mine = _served(me, routed)
    others = [_served(n, routed) for n in active]
    if mine is None or any(o is None for o in others):
        return ""
    left = {m for o in others for m in (o or ())}
    alone = [m for m in mine if m not in left]
    if not alone:
        return ""
    return (f"no active node is left for model(s) {', '.join(alone)}: requests for "
            f"{'it' if len(alone) == 1 else 'them'} will get 503 no_healthy_upstream until "
            "a node serving it is undrained or added")


def _set_state(r: redis.Redis, name: str, state: registry.State, keep: tuple[str, ...], kind: str,
               actor: str, events_max: int) -> StateChange:
    """Node ``name`` to ``state`` (with a new ``since``) unless its state is one of
    ``keep``, in one transaction (:func:`registry.change_state`); writes the event
    ``kind`` (``{"from": state}``) when it changed. Raises :class:`NotFound` (a node
    removed meanwhile included)."""
    res = registry.change_state(r, name, lambda st: None if st.state in keep
                                else NodeState(state, time.time(), actor))
    if res is None:
        raise _no_node(name)
    before, st = res
    changed = before != st
    if changed:
        registry.add_event(r, kind, name, actor, {"from": before.state}, maxlen=events_max)
    return _state_change(name, st, changed)


def drain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``draining`` (the leader turns it ``drained`` later, see
    docs/internals.md "Drain and slow start"). Idempotent: a node already draining or
    drained keeps its state and ``since``. Checked and written in one transaction
    (:func:`registry.change_state`): a node removed meanwhile is 404, never given a state
    back. Never refused for leaving a model without an active node (maintenance), but
    ``warning`` says so (:func:`drain_warning`). Raises :class:`NotFound`."""
    out = _set_state(r, name, "draining", ("draining", "drained"), "drain", actor, events_max)
    out.warning = drain_warning(r, name)
    return out


def undrain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``active`` with a new ``since`` (slow start runs from it).
    Idempotent: an active node keeps its ``since``. One transaction, as :func:`drain`.
    Raises :class:`NotFound`."""
    return _set_state(r, name, "active", ("active",), "undrain", actor, events_max)


def node_json(node: NodeSettings) -> dict:
    """The registry document of a node as plain JSON types."""
    return json.loads(node.model_dump_json())


# ---- API keys --------------------------------------------------------------------------

KEY_FIELDS: tuple[str, ...] = ("tenant", "rpm", "tpm", "label", "weight", "priority")
"""Fields of a new key: ``tenant`` (required), ``rpm`` / ``tpm`` (per minute, ``None`` =
no limit), ``label``, ``weight`` / ``priority`` (the fair share, ``None`` = the tenant's
default)."""
KEY_EDITABLE: tuple[str, ...] = ("rpm", "tpm", "label", "weight", "priority")
"""Fields ``edit_key`` may change (the tenant is fixed at creation)."""


def _key_event(r: redis.Redis, kind: str, rec: apikeys.ApiKey, actor: str, events_max: int,
               **extra: object) -> None:
    registry.add_event(r, kind, "", actor, {"id": rec.id, "tenant": rec.tenant, **extra},
                       maxlen=events_max)


def create_key(r: redis.Redis, data: object, actor: str,
               events_max: int = 10000) -> tuple[str, apikeys.ApiKey]:
    """Create a key from ``{"tenant", "rpm"?, "tpm"?, "label"?, "weight"?, "priority"?}``;
    returns ``(plaintext,
    record)`` -- the plaintext is shown once and never stored. Writes ``key_create``.
    Raises :class:`BadInput` (unknown field, bad tenant, limit or label)."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with tenant, rpm, tpm, label")
    unknown = sorted(set(data) - set(KEY_FIELDS))
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; expected {', '.join(KEY_FIELDS)}")
    try:
        plaintext, rec = apikeys.create_key(r, data.get("tenant"), rpm=data.get("rpm"),
                                            tpm=data.get("tpm"), label=data.get("label"),
                                            weight=data.get("weight"),
                                            priority=data.get("priority"))
    except apikeys.ApiKeyError as exc:
        raise BadInput(str(exc)) from None
    _key_event(r, "key_create", rec, actor, events_max)
    return plaintext, rec


@dataclass
class KeyEdit:
    """Result of :func:`change_key`: the record as stored now and the fields this call
    changed (empty: nothing changed, nothing written)."""

    record: apikeys.ApiKey
    changed: list[str]


def change_key(r: redis.Redis, key_id: str, changes: object, actor: str,
               events_max: int = 10000, seen: dict | None = None) -> KeyEdit:
    """Change some of ``rpm``, ``tpm`` (``None`` or empty = no limit), ``weight``,
    ``priority`` (``None`` = the tenant's default) and ``label`` of a key, in one
    transaction (:func:`.apikeys.change_key`; ``seen``: the values a form showed, see
    there). Writes ``key_edit`` with the new value of each changed field, nothing when
    nothing changed. Raises :class:`BadInput` (nothing to change, unknown field, bad
    value), :class:`NotFound`, :class:`Conflict` (409, ``key_revoked``: a revoked key
    does not change), :class:`Stale` (409 ``changed_meanwhile``: a field the form's user
    changed was changed by someone else since the form was shown)."""
    if not isinstance(changes, dict) or not changes or set(changes) - set(KEY_EDITABLE):
        raise BadInput(f"expected some of {', '.join(KEY_EDITABLE)}")
    try:
        res = apikeys.change_key(r, key_id, changes, seen)
    except apikeys.KeyRevoked as exc:
        raise Conflict(str(exc), "key_revoked") from None
    except apikeys.KeyChanged as exc:
        raise Stale(str(exc)) from None
    except apikeys.ApiKeyError as exc:
        raise BadInput(str(exc)) from None
    if res is None:
        raise NotFound(f"no API key with id {registry.shorten(str(key_id))!r}", "key_not_found")
    rec, changed = res
    if changed:
        _key_event(r, "key_edit", rec, actor, events_max, **{k: getattr(rec, k) for k in changed})
    return KeyEdit(rec, changed)


def edit_key(r: redis.Redis, key_id: str, changes: object, actor: str,
             events_max: int = 10000) -> apikeys.ApiKey:
    """:func:`change_key` without ``seen`` (as ``PATCH``); returns the record."""
    return change_key(r, key_id, changes, actor, events_max).record


@dataclass
class KeyRevocation:
    """Result of :func:`revoke_key`: the record (``revoked`` set, epoch s), whether this
    call revoked it (``False``: it was revoked before, at ``record.revoked``), and whether
    every running control plane's copy of the state holds the revocation
    (:func:`controlplane.routing.keycopies.wait_copied`: True; False when one did not
    within its wait, or Redis failed meanwhile; None when no control plane keeps a copy,
    or the key was revoked before)."""

    record: apikeys.ApiKey
    changed: bool
    copied: bool | None = None


def revoke_key(r: redis.Redis, key_id: str, actor: str, events_max: int = 10000,
               now: float | None = None) -> KeyRevocation:
    """Revoke a key (the edges refuse it at most ``auth.cache_ttl_s`` later). Idempotent:
    the first revocation time is kept and only the first call writes ``key_revoke``.
    Returns once the control planes' copies of the state hold the revocation (at most
    ``keycopies.WAIT_MAX_S``; ``copied`` says whether they do), so that a Redis that
    loses its data just after cannot have the key written back valid. Raises
    :class:`NotFound`."""
    when = time.time() if now is None else now
    rec = apikeys.revoke_key(r, key_id, now=when)
    if rec is None:
        raise NotFound(f"no API key with id {registry.shorten(str(key_id))!r}", "key_not_found")
    changed = rec.revoked == when
    copied = None
    if changed:
        _key_event(r, "key_revoke", rec, actor, events_max)
        try:
            copied = keycopies.wait_copied(r, keycopies.current_gen(r))
        except redis.RedisError:
            copied = False   # revoked; whether a copy holds it is unknown
    return KeyRevocation(rec, changed, copied)


# ---- response cache --------------------------------------------------------------------

PURGE_FIELDS: tuple[str, ...] = ("tenant", "model", "namespace", "all")


def purge_scope(data: object) -> dict:
    """Validate a purge scope: ``{"all": true}`` or some of tenant/model/namespace
    (non-empty printable texts of at most 256 characters, as the cache stores them,
    combined with AND); returns the scope
    with only those keys. Raises :class:`BadInput`."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with tenant, model, namespace or all")
    unknown = sorted(set(data) - set(PURGE_FIELDS))
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; expected tenant, model, "
                       "namespace or all")
    if "all" in data:
        if data["all"] is not True:
            raise BadInput("all: must be true (or left out)")
        if len(data) > 1:
            raise BadInput("all: cannot be combined with tenant, model or namespace")
        return {"all": True}
    scope = {}
    for f in ("tenant", "model", "namespace"):
        if f in data:
            v = data[f]
            if not isinstance(v, str) or not v or len(v) > 256 or not v.isprintable():
                raise BadInput(f"{f}: a non-empty printable text of at most 256 characters")
            scope[f] = v
    if not scope:
        raise BadInput("purge scope: give tenant, model, namespace or all: true")
    return scope


@dataclass
class PurgeResult:
    """Result of :func:`purge_cache`."""

    scope: dict
    """The validated scope: ``{"all": True}`` or some of tenant/model/namespace."""
    purged: int
    """Cache entries (answers) deleted."""
    vectors: int
    """Semantic-index vector hashes deleted with them."""


def purge_cache(r: redis.Redis, data: object, actor: str,
                events_max: int = 10000) -> PurgeResult:
    """Delete the cache entries of a scope (see :func:`purge_scope`) **and** their
    semantic-index vectors (:func:`controlplane.cache.store.purge_counts`); counters are
    kept. Writes ``cache_purge`` with the scope and ``purged``. Raises :class:`BadInput`."""
    scope = purge_scope(data)
    try:
        n = cache_store.purge_counts(r, **scope)
    except cache_store.CacheStoreError as exc:
        raise BadInput(str(exc)) from None
    registry.add_event(r, "cache_purge", "", actor, {**scope, "purged": n.entries},
                       maxlen=events_max)
    return PurgeResult(scope, n.entries, n.vectors)


@dataclass
class FlagResult:
    """Result of :func:`flag_entry`."""

    id: str
    """The entry id (its exact key hex, as in ``X-Cache-Entry``)."""
    namespace: str
    """The entry's semantic namespace hex (``""`` when it had none)."""
    dropped: bool
    """This call dropped the entry (False: it was flagged or dropped before)."""
    flagged: int
    """Flags counted for the namespace so far."""

    def to_dict(self) -> dict:
        return asdict(self)


def flag_entry(r: redis.Redis, entry_id: str, actor: str,
               events_max: int = 10000) -> FlagResult:
    """Flag a served answer as wrong: drop the entry ``entry_id`` (the ``X-Cache-Entry``
    of a hit: its exact key hex), its index memberships and its semantic vectors, and
    count a ``flagged`` for its namespace (``keynames.cache_ns_stats``). Idempotent:
    flagging an entry already dropped (its mark lives as long as the entry would have)
    changes nothing and counts nothing. Writes ``cache_flag``. Raises :class:`NotFound`
    (``entry_not_found``) for an id that is not an entry's, or whose entry expired."""
    eid = entry_id.strip().lower() if isinstance(entry_id, str) else ""
    if not cache_store.HEX_RE.match(eid):
        raise NotFound(f"no cache entry with id {entry_id!r} (ids are the X-Cache-Entry "
                       "header of a hit: 16 to 128 hex digits)", "entry_not_found")
    doc = cache_store.drop_entry(r, eid)
    if doc is None:
        ns = cache_store.dropped_namespace(r, eid)
        if ns is None:
            raise NotFound(f"no cache entry with id {eid!r} (expired, purged or never "
                           "stored)", "entry_not_found")
        flagged = _ns_counter(r, ns, "flagged")
        return FlagResult(eid, ns, False, flagged)
    ns = doc.get("namespace") if isinstance(doc.get("namespace"), str) else ""
    flagged = cache_store.count_namespace(r, ns, "flagged") if cache_store.HEX_RE.match(ns) \
        else 0
    registry.add_event(r, "cache_flag", "", actor, {"id": eid, "namespace": ns},
                       maxlen=events_max)
    return FlagResult(eid, ns, True, flagged)


def _ns_counter(r: redis.Redis, namespace: str, field: str) -> int:
    if not namespace:
        return 0
    v = r.hget(keynames.cache_ns_stats(namespace), field)
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError):
        return 0
