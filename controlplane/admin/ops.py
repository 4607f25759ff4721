"""Node registry changes and drain/undrain, shared by the API, the page and the CLI.

Every change writes an event (``registry.add_event``) naming the actor: ``admin`` for
the web page and API, ``cli:<user>`` for the command line. Errors are
:class:`AdminError` subclasses carrying an HTTP status, an error type and a code, so
each front end can render them its own way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis
from pydantic import ValidationError

from controlplane.routing import registry
from controlplane.config import NodeSettings
from controlplane.routing.registry import NodeState

EDITABLE: tuple[str, ...] = ("url", "kind", "weight", "max_concurrency", "metrics_path",
                             "health_path")
"""Fields ``PATCH /nodes/<name>`` may change (the name is the identity and cannot)."""


class AdminError(Exception):
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


def _require(r: redis.Redis, name: str) -> NodeSettings:
    node = registry.get_node(r, name)
    if node is None:
        raise NotFound(f"no node named {name!r}", "node_not_found")
    return node


def add_node(r: redis.Redis, data: object, actor: str, events_max: int = 10000) -> NodeSettings:
    """Register a new node. Raises :class:`BadInput`, :class:`Conflict` (name taken)."""
    node = parse_node(data)
    if not registry.put_node(r, node, only_new=True):
        raise Conflict(f"a node named {node.name!r} already exists", "node_exists")
    registry.add_event(r, "node_add", node.name, actor, node.model_dump(), maxlen=events_max)
    return node


def edit_node(r: redis.Redis, name: str, changes: object, actor: str,
              events_max: int = 10000) -> NodeSettings:
    """Change some fields of a node (see :data:`EDITABLE`). Raises :class:`NotFound`,
    :class:`BadInput` (unknown or invalid field, or a rename attempt)."""
    current = _require(r, name)
    if not isinstance(changes, dict) or not changes:
        raise BadInput(f"expected a JSON object with some of {', '.join(EDITABLE)}")
    if "name" in changes and changes["name"] != name:
        raise BadInput("name: a node cannot be renamed; remove it and add it again")
    unknown = sorted(set(changes) - set(EDITABLE) - {"name"})
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; editable: {', '.join(EDITABLE)}")
    merged = {**current.model_dump(), **changes, "name": name}
    node = parse_node(merged)
    registry.put_node(r, node)
    diff = {k: [getattr(current, k), getattr(node, k)] for k in EDITABLE
            if getattr(current, k) != getattr(node, k)}
    registry.add_event(r, "node_edit", name, actor, diff, maxlen=events_max)
    return node


def remove_node(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> None:
    """Delete a node with its state, metrics and history. Raises :class:`NotFound`."""
    _require(r, name)
    registry.remove_node(r, name)
    registry.add_event(r, "node_remove", name, actor, maxlen=events_max)


@dataclass
class StateChange:
    """Result of drain/undrain: the state now, and whether this call changed it."""

    name: str
    state: str
    since: float
    actor: str
    changed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _state_change(name: str, st: NodeState, changed: bool) -> StateChange:
    return StateChange(name, st.state, st.since, st.actor, changed)


def drain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``draining`` (the leader turns it ``drained`` later, see
    docs/internals.md "Drain and slow start"). Idempotent: a node already draining or
    drained keeps its state and ``since``. Raises :class:`NotFound`."""
    _require(r, name)
    st = registry.get_state(r, name)
    if st.state in ("draining", "drained"):
        return _state_change(name, st, False)
    st = registry.set_state(r, name, "draining", actor)
    registry.add_event(r, "drain", name, actor, {"from": "active"}, maxlen=events_max)
    return _state_change(name, st, True)


def undrain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``active`` with a new ``since`` (slow start runs from it).
    Idempotent: an active node keeps its ``since``. Raises :class:`NotFound`."""
    _require(r, name)
    st = registry.get_state(r, name)
    if st.state == "active":
        return _state_change(name, st, False)
    prev = st.state
    st = registry.set_state(r, name, "active", actor)
    registry.add_event(r, "undrain", name, actor, {"from": prev}, maxlen=events_max)
    return _state_change(name, st, True)


def node_json(node: NodeSettings) -> dict:
    """The registry document of a node as plain JSON types."""
    return json.loads(node.model_dump_json())
