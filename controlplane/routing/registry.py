"""Node registry, node states and the event stream, kept in Redis.

- Registry: hash ``keynames.NODES``, node name -> JSON of :class:`NodeSettings` (names
  unique ignoring case). Seeded from the TOML file at control-plane start, each
  configured node once (:func:`seed_nodes`: run-time edits and removals survive a
  restart); edited at run time by the admin page, API and CLI.
- States: hash ``keynames.NODE_STATES``, name -> ``{"state", "since", "actor"}`` where
  state is ``active`` | ``draining`` | ``drained`` and ``since`` is epoch seconds.
  A node without an entry is ``active``. (``down`` is not a state: it is
  ``healthy == false`` in the metrics, shown as such on the admin page.)
- Events: stream ``keynames.EVENTS``, capped near ``events_max`` entries, fields
  ``ts`` (epoch s), ``kind``, ``node``, ``actor``, ``detail`` (JSON text).

Changes that depend on what is stored (:func:`put_node_unique`, :func:`seed_node`,
:func:`update_node`, :func:`change_state`) check and write in one optimistic transaction
on the three keys above (one hash slot, ``keynames.NODES_TAG``; :func:`_optimistic`), and
:func:`remove_node` deletes a node's entry and state in one ``MULTI``: a change that
checked a node before it was removed never writes it (or its state) back.
Every write of a node or a state also INCRs ``keynames.NODES_GEN`` in its transaction
(:func:`bump`), by which a control plane tells that Redis came back older
(:mod:`controlplane.routing.statecopy`).

All functions take a ``redis.Redis`` built with ``decode_responses=True`` and raise
``redis.exceptions.RedisError`` when Redis is unreachable.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar
from urllib.parse import SplitResult, urlsplit

import redis

from controlplane.redisdb import genlog, keynames
from controlplane.config import NodeSettings
from controlplane.errors import InfergateError

log = logging.getLogger("infergate.controlplane")

State = Literal["active", "draining", "drained"]
STATES: tuple[str, ...] = ("active", "draining", "drained")


@dataclass
class NodeState:
    state: State = "active"
    since: float = 0.0
    """Epoch seconds when the node entered ``state`` (0 = never changed)."""
    actor: str = ""


def parse_nodes(raw: dict[str, str]) -> list[NodeSettings]:
    """The nodes of a ``keynames.NODES`` hash as read (name -> JSON), sorted by name.
    Invalid entries are skipped."""
    out = []
    for _name, value in raw.items():
        try:
            out.append(NodeSettings.model_validate_json(value))
        except ValueError:
            continue
    return sorted(out, key=lambda n: n.name)


def list_nodes(r: redis.Redis) -> list[NodeSettings]:
    """All registered nodes, sorted by name. Invalid entries are skipped."""
    return parse_nodes(r.hgetall(keynames.NODES))


def get_node(r: redis.Redis, name: str) -> NodeSettings | None:
    raw = r.hget(keynames.NODES, name)
    return NodeSettings.model_validate_json(raw) if raw else None


def bump(pipe: redis.Redis | redis.client.Pipeline) -> None:
    """Queue the INCR of the registry's generation (``keynames.NODES_GEN``) that goes
    with every write of a node or a state (:mod:`controlplane.routing.statecopy` tells
    by it that Redis came back older), with the push of a token on its write log
    (:mod:`controlplane.redisdb.genlog`)."""
    genlog.push(pipe, keynames.NODES_GEN, keynames.NODES_GEN_LOG)


def put_node(r: redis.Redis, node: NodeSettings) -> None:
    """Store ``node``, replacing an entry of the same name (no check of its URL: see
    :func:`put_node_unique`)."""
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(keynames.NODES, node.name, node.model_dump_json())
        bump(pipe)
        pipe.execute()


#: Longest piece of a value an error message repeats (characters); a longer value is cut.
ECHO_MAX = 200


def shorten(value: str, limit: int = ECHO_MAX) -> str:
    """``value`` as an error message repeats it: cut to ``limit`` characters, with how
    long it was, so a huge input is not sent back whole."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


class UrlTaken(InfergateError, ValueError):
    """Another registered node has the same server root; ``other`` is its name."""

    def __init__(self, url: str, other: str):
        super().__init__(f"{shorten(url)} is already registered as node {other!r}")
        self.url = url
        self.other = other


def _host_key(host: str) -> str:
    """A host in one spelling: lower case without a trailing dot; an IP address in its
    canonical form, whatever way it was written (``127.1``, ``0x7f000001``,
    ``2130706433``, ``127.000.000.001``, ``::ffff:127.0.0.1`` and ``localhost`` are all
    ``127.0.0.1``).
    Other names are not resolved."""
    h = host.lower().rstrip(".")
    if h == "localhost":
        return "127.0.0.1"   # the loopback name (RFC 6761), as the HTTP clients resolve it
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:
            # the forms the C library (and so the HTTP clients) accept besides dotted quads:
            # 127.1, 0x7f000001, 017700000001 and the plain number 2130706433
            ip = ipaddress.IPv4Address(socket.inet_aton(h)) if h[:1].isdigit() else None
        except OSError:
            ip = None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) if ip is not None else h


def same_server(a: str, b: str) -> bool:
    """Whether two node URLs name the same server root (case of scheme and host, the
    spelling of an IP address, a default port and a trailing slash aside)."""
    pa, pb = urlsplit(a), urlsplit(b)

    def port(p: SplitResult) -> int | None:
        try:
            return p.port or {"http": 80, "https": 443}.get(p.scheme.lower())
        except ValueError:
            return None

    return (pa.scheme.lower() == pb.scheme.lower()
            and _host_key(pa.hostname or "") == _host_key(pb.hostname or "")
            and port(pa) == port(pb) and pa.path.rstrip("/") == pb.path.rstrip("/"))


class NameTaken(InfergateError, ValueError):
    """Another registered node has the same name in another case (``SIM-FAST`` and
    ``sim-fast``): names differing only in case would read as one node on the page, in
    the logs and in the metrics. ``other`` is its name."""

    def __init__(self, name: str, other: str):
        super().__init__(f"a node named {other!r} already exists (node names that differ "
                         "only in case are one name)")
        self.name = name
        self.other = other


T = TypeVar("T")
Writes = Callable[[redis.client.Pipeline], object]


def _optimistic(r: redis.Redis, step: Callable[[redis.client.Pipeline], tuple[T, Writes | None]]
                ) -> T:
    """Run ``step`` on the registry group as one optimistic transaction: ``WATCH`` on
    :data:`keynames.NODES`, :data:`keynames.NODE_STATES` and :data:`keynames.NODES_SEEDED`
    (one hash slot, ``keynames.NODES_TAG``, so this holds on Redis Cluster too), ``step``
    reads through the pipeline and returns ``(result, writes)``; ``writes`` (None = write
    nothing) queues the writes, which ``EXEC`` applies only if no watched key changed
    since the reads -- else the whole step runs again on the new values. So a check
    (the node exists, the URL is free) and the write that depends on it are one step:
    a removal in between makes the step see the node gone."""
    # transaction=True: WATCH on a cluster needs it
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keynames.NODES, keynames.NODE_STATES, keynames.NODES_SEEDED)
                result, writes = step(pipe)
                if writes is None:
                    return result
                pipe.multi()
                writes(pipe)
                bump(pipe)
                pipe.execute()
                return result
            except redis.WatchError:
                continue


def _check_unique(current: dict[str, str], node: NodeSettings) -> None:
    """Raise :class:`NameTaken` when ``node`` is new and another name equals its name
    ignoring case, :class:`UrlTaken` when another node has its server."""
    if node.name not in current:
        folded = node.name.casefold()
        other = next((n for n in current if n.casefold() == folded), None)
        if other is not None:
            raise NameTaken(node.name, other)
    for name, raw in current.items():
        if name == node.name:
            continue
        try:
            url = NodeSettings.model_validate_json(raw).url
        except ValueError:
            continue
        if same_server(url, node.url):
            raise UrlTaken(node.url, name)


def _write_node(pipe: redis.client.Pipeline, node: NodeSettings, new: bool,
                seed_mark: str | None) -> None:
    pipe.hset(keynames.NODES, node.name, node.model_dump_json())
    if new:  # a new node starts active, whatever an old entry of its name left behind
        pipe.hdel(keynames.NODE_STATES, node.name)
    if seed_mark is not None:
        pipe.sadd(keynames.NODES_SEEDED, seed_mark)


def put_node_unique(r: redis.Redis, node: NodeSettings, *, only_new: bool = False,
                    seed_mark: str | None = None) -> bool:
    """:func:`put_node`, refused when another node has the same server root
    (:func:`same_server`): two entries for one server would double its share, and one
    would take traffic while the other is drained; and, for a new name, when another
    node has the same name ignoring case. Check and write are one transaction
    (:func:`_optimistic`), so two writers cannot both register one server. A new name
    starts ``active`` (a state left under its name is dropped). ``seed_mark``: added to
    ``keynames.NODES_SEEDED`` in the same transaction when the node is written or its
    name is registered already. True if written (False: ``only_new`` and the name
    exists). Raises :class:`UrlTaken`, :class:`NameTaken`."""

    def step(pipe: redis.client.Pipeline) -> tuple[bool, Writes | None]:
        current = pipe.hgetall(keynames.NODES)
        exists = node.name in current
        if only_new and exists:
            return False, (None if seed_mark is None
                           else lambda p: p.sadd(keynames.NODES_SEEDED, seed_mark))
        _check_unique(current, node)
        return True, lambda p: _write_node(p, node, not exists, seed_mark)

    return _optimistic(r, step)


SeedOutcome = Literal["added", "registered", "seeded_before"]


def seed_node(r: redis.Redis, node: NodeSettings, mark: str) -> SeedOutcome:
    """Register a configured ``node`` unless ``mark`` says an earlier start registered
    it (``keynames.NODES_SEEDED``), in one transaction: ``added`` (written, and marked),
    ``registered`` (its name is registered already: marked, nothing else written),
    ``seeded_before`` (nothing written: registered by an earlier start, so a node
    missing now was removed at run time). The mark is set only once the name is
    registered: a node refused because its server or name is taken (:class:`UrlTaken`,
    :class:`NameTaken`, raised) is tried again at the next start."""

    def step(pipe: redis.client.Pipeline) -> tuple[SeedOutcome, Writes | None]:
        if pipe.sismember(keynames.NODES_SEEDED, mark):
            return "seeded_before", None
        current = pipe.hgetall(keynames.NODES)
        if node.name in current:
            return "registered", lambda p: p.sadd(keynames.NODES_SEEDED, mark)
        _check_unique(current, node)
        return "added", lambda p: _write_node(p, node, True, mark)

    return _optimistic(r, step)


@dataclass
class NodeUpdate:
    """What :func:`update_node` did: the stored document ``before`` and ``after``."""

    before: NodeSettings
    after: NodeSettings

    @property
    def changed(self) -> bool:
        return self.before != self.after


def update_node(r: redis.Redis, name: str,
                change: Callable[[NodeSettings], NodeSettings]) -> NodeUpdate | None:
    """Change the stored document of node ``name`` in one transaction
    (:func:`_optimistic`): ``change`` gets the document as stored now and returns the new
    one (it may raise to refuse; it runs again if another writer got in between, so it
    must not have side effects). A new URL is refused as in :func:`put_node_unique`.
    Nothing is written when the document does not change. None when no node has that
    name (removed meanwhile included). Raises :class:`UrlTaken` and what ``change``
    raises."""

    def step(pipe: redis.client.Pipeline) -> tuple[NodeUpdate | None, Writes | None]:
        current = pipe.hgetall(keynames.NODES)
        raw = current.get(name)
        if raw is None:
            return None, None
        before = NodeSettings.model_validate_json(raw)
        after = change(before)
        if after == before:
            return NodeUpdate(before, after), None
        if after.name != name:
            raise ValueError(f"update_node: {name!r} cannot become {after.name!r}")
        if after.url != before.url:
            _check_unique(current, after)
        return NodeUpdate(before, after), lambda p: p.hset(keynames.NODES, name,
                                                            after.model_dump_json())

    return _optimistic(r, step)


def remove_node(r: redis.Redis, name: str) -> bool:
    """Delete the node, its state and its metrics. True if it existed. The entry and its
    state go in one transaction (``MULTI``), so a change of state checked against the
    entry (:func:`change_state`) either happens before or sees the node gone; metrics
    and history, cache kind in other slots, are deleted after."""
    with r.pipeline(transaction=True) as pipe:
        pipe.hdel(keynames.NODES, name)
        pipe.hdel(keynames.NODE_STATES, name)
        bump(pipe)
        existed = bool(pipe.execute()[0])
    pipe = r.pipeline(transaction=False)
    pipe.delete(keynames.node_metrics(name))  # one key each: different slots on a cluster
    pipe.delete(keynames.node_history(name))
    pipe.execute()
    return existed


def seed_nodes(r: redis.Redis, nodes: list[NodeSettings]) -> int:
    """Add the configured nodes the registry was never seeded with; returns how many were
    added. Each configured name is seeded once (:func:`seed_node`, recorded in
    ``keynames.NODES_SEEDED`` once registered): an entry already there (a run-time edit)
    is kept, a node removed at run time is not brought back by the next start, and a
    node new in the file is added. A node whose server (or name, in another case)
    another registered node has is not added and not marked: a warning is logged, and
    the next start tries it again. A Redis that lost its data lost that record too, so
    everything in the file is seeded again."""
    added = 0
    for n in nodes:
        try:
            added += seed_node(r, n, n.name) == "added"
        except (UrlTaken, NameTaken) as exc:
            log.warning("configured node %s not added: %s (one server, one node; tried "
                        "again at the next start)", n.name, exc)
    return added


#: Fields of a configured node compared with the registry by :func:`file_drift` (the
#: ones the admin page, API and CLI edit).
DRIFT_FIELDS: tuple[str, ...] = ("url", "kind", "weight", "max_concurrency", "metrics_path",
                                 "health_path", "models", "poll_models")


def _shown(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def file_drift(file_nodes: list[NodeSettings], registered: list[NodeSettings],
               skip: tuple[str, ...] = ()) -> list[str]:
    """One line for each configured node whose settings in the file differ from its
    registry entry (the registry wins: a file's node is seeded once, see
    :func:`seed_nodes`), naming the fields (:data:`DRIFT_FIELDS` but ``skip``) and both
    values, e.g. ``node file-b: the file says weight 2.0, the registry keeps 1.0
    (changed at run time or seeded before); edit it with `infergate nodes edit` or the
    admin page``. Nodes not registered are left out."""
    reg = {n.name: n for n in registered}
    out = []
    for f in file_nodes:
        have = reg.get(f.name)
        if have is None:
            continue
        fields = [k for k in DRIFT_FIELDS if k not in skip and getattr(f, k) != getattr(have, k)]
        if not fields:
            continue
        if len(fields) == 1:
            k = fields[0]
            says = f"{k} {_shown(getattr(f, k))}, the registry keeps {_shown(getattr(have, k))}"
        else:
            says = (", ".join(f"{k} {_shown(getattr(f, k))}" for k in fields)
                    + "; the registry keeps "
                    + ", ".join(f"{k} {_shown(getattr(have, k))}" for k in fields))
        out.append(f"node {f.name}: the file says {says} (changed at run time or seeded "
                   "before); edit it with `infergate nodes edit` or the admin page")
    return out


def removed_at_run_time(r: redis.Redis, names: list[str]) -> set[str]:
    """The ``names`` seeded by an earlier start (``keynames.NODES_SEEDED``) and no longer
    registered: removed at run time."""
    if not names:
        return set()
    pipe = r.pipeline()
    for n in names:
        pipe.sismember(keynames.NODES_SEEDED, n)
    pipe.hkeys(keynames.NODES)
    *seeded, registered = pipe.execute()
    return {n for n, was in zip(names, seeded) if was and n not in set(registered)}


@dataclass
class RunSeed:
    """What :func:`seed_run_nodes` did: ``nodes`` the run's nodes as registered (their
    names and settings in the registry), ``notes`` one line each for the operator."""

    nodes: list[NodeSettings]
    notes: list[str]


def _free_name(name: str, taken: set[str]) -> str:
    base = name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name
    i = 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    return name


def seed_run_nodes(r: redis.Redis, nodes: list[NodeSettings], *, by_url: bool,
                   overrides: dict | None = None, from_file: bool = False) -> RunSeed:
    """Register the nodes of a start of ``infergate up`` on a registry that may hold an
    earlier run's, keeping what was changed at run time (the docs promise that edits and
    removals survive a restart on the same folder).

    ``by_url`` False (the simulated pool, a file's nodes: a node is its name, its address
    may change between starts): a name registered before keeps its settings with this
    run's URL; a name seeded by an earlier start and gone since was removed at run time
    and is not added again (a note says how); a new name is added. ``by_url`` True
    (``--node URL``: a node is its server): a server registered under any name stays as
    it is, with ``overrides`` (the options given on the command line, such as
    ``max_concurrency``) applied; a new server is added under the run's name, or the next
    free one. Registered nodes that are not of this run stay registered, with a note.
    ``from_file``: the nodes are the file's ``[[nodes]]``; a note names each whose file
    settings differ from the registry's (:func:`file_drift`, the URL aside: the run's
    URL is applied). Seeding is recorded in ``keynames.NODES_SEEDED`` (names, and
    ``url:`` + URL) once the node is registered: one refused because its server is
    registered under another name is tried again at the next start."""
    current = {n.name: n for n in list_nodes(r)}
    out: list[NodeSettings] = []
    notes: list[str] = []
    if from_file:
        notes += file_drift(nodes, list(current.values()), skip=("url",))
    for n in nodes:
        try:
            node = _seed_run_node(r, n, current, by_url, overrides, notes)
        except (UrlTaken, NameTaken) as exc:
            notes.append(f"node {n.name} not registered: {exc} (one server, one node; tried "
                         "again at the next start)")
            continue
        if node is not None:
            current[node.name] = node
            out.append(node)
    ours = {n.name for n in out}
    for c in current.values():
        if c.name not in ours:
            notes.append(f"node {c.name} ({c.url}) stays registered from an earlier run or a "
                         f"run-time add: `infergate nodes remove {c.name}` takes it out")
    return RunSeed(out, notes)


def _seed_run_node(r: redis.Redis, n: NodeSettings, current: dict[str, NodeSettings],
                   by_url: bool, overrides: dict | None, notes: list[str]
                   ) -> NodeSettings | None:
    """One node of :func:`seed_run_nodes`: the node as registered, or None (left out,
    with a note). Raises :class:`UrlTaken`, :class:`NameTaken`."""
    if by_url:
        mark = "url:" + n.url
        same = next((c for c in current.values() if same_server(c.url, n.url)), None)
        if same is not None:
            node = same.model_copy(update=overrides) if overrides else same
            if node != same:
                put_node(r, node)
            r.sadd(keynames.NODES_SEEDED, mark)
            if same.name != n.name:
                notes.append(f"{n.url} is registered as node {same.name}: kept, with its settings")
            return node
        before = bool(r.sismember(keynames.NODES_SEEDED, mark))
        node = n.model_copy(update={"name": _free_name(n.name, set(current))})
        put_node_unique(r, node, seed_mark=mark)
        if before:
            notes.append(f"node {node.name} ({n.url}) was removed at run time: added again, "
                         "as --node names it")
        return node
    old = current.get(n.name)
    if old is None:
        outcome = seed_node(r, n, n.name)
        if outcome == "seeded_before":
            notes.append(f"node {n.name} was removed at run time: not added again")
            return None
        if outcome == "added":
            return n
        old = get_node(r, n.name) or n   # registered meanwhile: as an earlier entry
    r.sadd(keynames.NODES_SEEDED, n.name)   # its name is registered: a removal sticks
    node = old.model_copy(update={"url": n.url})
    put_node_unique(r, node)
    return node


def _parse_state(raw: str | None) -> NodeState | None:
    if not raw:
        return None
    try:
        d = json.loads(raw)
        if d.get("state") in STATES:
            return NodeState(d["state"], float(d.get("since", 0)), str(d.get("actor", "")))
    except (ValueError, TypeError, AttributeError):
        pass
    return None


def parse_states(raw: dict[str, str]) -> dict[str, NodeState]:
    """The states of a ``keynames.NODE_STATES`` hash as read (name -> JSON). Invalid
    entries are skipped."""
    out: dict[str, NodeState] = {}
    for name, value in raw.items():
        st = _parse_state(value)
        if st is not None:
            out[name] = st
    return out


def get_states(r: redis.Redis) -> dict[str, NodeState]:
    """Every node's state entry (a node without one is ``active``)."""
    return parse_states(r.hgetall(keynames.NODE_STATES))


def get_state(r: redis.Redis, name: str) -> NodeState:
    return _parse_state(r.hget(keynames.NODE_STATES, name)) or NodeState()


def set_state(r: redis.Redis, name: str, state: State, actor: str = "",
              now: float | None = None) -> NodeState:
    """Set a node's state (``since`` = now) and return it, whether or not the node is
    registered (:func:`change_state` checks that). Raises ``ValueError`` for an unknown
    state."""
    if state not in STATES:
        raise ValueError(f"unknown state {state!r}; expected one of {STATES}")
    st = NodeState(state, time.time() if now is None else now, actor)
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(keynames.NODE_STATES, name, json.dumps(asdict(st)))
        bump(pipe)
        pipe.execute()
    return st


def change_state(r: redis.Redis, name: str, decide: Callable[[NodeState], NodeState | None]
                 ) -> tuple[NodeState, NodeState] | None:
    """Change the state of a registered node in one transaction (:func:`_optimistic`):
    ``decide`` gets the state now and returns the new one, or None to keep it (it may
    run again if another writer got in between). Returns ``(before, after)``; None when
    no node has that name, so a removal never races a state back in (the node's entry
    and state are removed together, :func:`remove_node`)."""

    def step(pipe: redis.client.Pipeline
             ) -> tuple[tuple[NodeState, NodeState] | None, Writes | None]:
        if not pipe.hexists(keynames.NODES, name):
            return None, None
        before = _parse_state(pipe.hget(keynames.NODE_STATES, name)) or NodeState()
        after = decide(before)
        if after is None:
            return (before, before), None
        if after.state not in STATES:
            raise ValueError(f"unknown state {after.state!r}; expected one of {STATES}")
        return (before, after), lambda p: p.hset(keynames.NODE_STATES, name,
                                                  json.dumps(asdict(after)))

    return _optimistic(r, step)


def add_event(r: redis.Redis, kind: str, node: str = "", actor: str = "system",
              detail: dict | None = None, maxlen: int = 10000) -> str:
    """Append an event to the capped stream; returns its stream id."""
    return r.xadd(
        keynames.EVENTS,
        {"ts": f"{time.time():.3f}", "kind": kind, "node": node, "actor": actor,
         "detail": json.dumps(detail or {}, sort_keys=True)},
        maxlen=maxlen, approximate=True,
    )


def recent_events(r: redis.Redis, count: int = 100, node: str | None = None) -> list[dict]:
    """Newest first: ``[{"id", "ts", "kind", "node", "actor", "detail": {...}}]``."""
    out = []
    for eid, fields in r.xrevrange(keynames.EVENTS, count=count if node is None else count * 10):
        if node is not None and fields.get("node") != node:
            continue
        try:
            detail = json.loads(fields.get("detail") or "{}")
        except ValueError:
            detail = {}
        out.append({"id": eid, "ts": float(fields.get("ts", 0)), "kind": fields.get("kind", ""),
                    "node": fields.get("node", ""), "actor": fields.get("actor", ""),
                    "detail": detail})
        if len(out) >= count:
            break
    return out
