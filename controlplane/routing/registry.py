"""Node registry, node states and the event stream, kept in Redis.

- Registry: hash ``keynames.NODES``, node name -> JSON of :class:`NodeSettings`. Seeded
  from the TOML file at control-plane start, each configured node once
  (:func:`seed_nodes`: run-time edits and removals survive a restart); edited at run
  time by the admin page, API and CLI.
- States: hash ``keynames.NODE_STATES``, name -> ``{"state", "since", "actor"}`` where
  state is ``active`` | ``draining`` | ``drained`` and ``since`` is epoch seconds.
  A node without an entry is ``active``. (``down`` is not a state: it is
  ``healthy == false`` in the metrics, shown as such on the admin page.)
- Events: stream ``keynames.EVENTS``, capped near ``events_max`` entries, fields
  ``ts`` (epoch s), ``kind``, ``node``, ``actor``, ``detail`` (JSON text).

All functions take a ``redis.Redis`` built with ``decode_responses=True`` and raise
``redis.exceptions.RedisError`` when Redis is unreachable.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from dataclasses import asdict, dataclass
from typing import Literal
from urllib.parse import SplitResult, urlsplit

import redis

from controlplane.redisdb import keynames
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


def list_nodes(r: redis.Redis) -> list[NodeSettings]:
    """All registered nodes, sorted by name. Invalid entries are skipped."""
    out = []
    for name, raw in r.hgetall(keynames.NODES).items():
        try:
            out.append(NodeSettings.model_validate_json(raw))
        except ValueError:
            continue
    return sorted(out, key=lambda n: n.name)


def get_node(r: redis.Redis, name: str) -> NodeSettings | None:
    raw = r.hget(keynames.NODES, name)
    return NodeSettings.model_validate_json(raw) if raw else None


def put_node(r: redis.Redis, node: NodeSettings) -> None:
    """Store ``node``, replacing an entry of the same name (no check of its URL: see
    :func:`put_node_unique`)."""
    r.hset(keynames.NODES, node.name, node.model_dump_json())


class UrlTaken(InfergateError, ValueError):
    """Another registered node has the same server root; ``other`` is its name."""

    def __init__(self, url: str, other: str):
        super().__init__(f"{url} is already registered as node {other!r}")
        self.url = url
        self.other = other


def _host_key(host: str) -> str:
    """A host in one spelling: lower case without a trailing dot; an IP address in its
    canonical form, whatever way it was written (``127.1``, ``0x7f000001``,
    ``127.000.000.001``, ``::ffff:127.0.0.1`` and ``localhost`` are all ``127.0.0.1``).
    Other names are not resolved."""
    h = host.lower().rstrip(".")
    if h == "localhost":
        return "127.0.0.1"   # the loopback name (RFC 6761), as the HTTP clients resolve it
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:
            # the forms the C library (and so the HTTP clients) accept besides dotted quads
            ip = ipaddress.IPv4Address(socket.inet_aton(h)) if h and "." in h or h.startswith("0x") \
                else None
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


def put_node_unique(r: redis.Redis, node: NodeSettings, *, only_new: bool = False) -> bool:
    """:func:`put_node`, refused when another node has the same server root
    (:func:`same_server`): two entries for one server would double its share, and one
    would take traffic while the other is drained. Check and write are one transaction
    (WATCH on the registry, retried when it changed in between), so two writers cannot
    both register one server. True if written (False: ``only_new`` and the name exists).
    Raises :class:`UrlTaken`."""
    with r.pipeline(transaction=True) as pipe:  # WATCH on a cluster needs transaction=True
        while True:
            try:
                pipe.watch(keynames.NODES)
                current = pipe.hgetall(keynames.NODES)
                for name, raw in current.items():
                    if name == node.name:
                        continue
                    try:
                        url = NodeSettings.model_validate_json(raw).url
                    except ValueError:
                        continue
                    if same_server(url, node.url):
                        raise UrlTaken(node.url, name)
                if only_new and node.name in current:
                    return False
                pipe.multi()
                pipe.hset(keynames.NODES, node.name, node.model_dump_json())
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def remove_node(r: redis.Redis, name: str) -> bool:
    """Delete the node, its state and its metrics. True if it existed."""
    pipe = r.pipeline()
    pipe.hdel(keynames.NODES, name)
    pipe.hdel(keynames.NODE_STATES, name)
    pipe.delete(keynames.node_metrics(name))  # one key each: different slots on a cluster
    pipe.delete(keynames.node_history(name))
    return bool(pipe.execute()[0])


def seed_nodes(r: redis.Redis, nodes: list[NodeSettings]) -> int:
    """Add the configured nodes the registry was never seeded with; returns how many were
    added. A node whose server another registered node already has is not added (a
    warning is logged). Each configured name is seeded once (recorded in ``keynames.NODES_SEEDED``):
    an entry already there (a run-time edit) is kept, a node removed at run time is not
    brought back by the next start, and a node new in the file is added. A Redis that
    lost its data lost that record too, so everything in the file is seeded again."""
    added = 0
    for n in nodes:
        if r.sadd(keynames.NODES_SEEDED, n.name):
            try:
                added += put_node_unique(r, n, only_new=True)
            except UrlTaken as exc:
                log.warning("configured node %s not added: %s (one server, one node)",
                            n.name, exc)
    return added


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
                   overrides: dict | None = None) -> RunSeed:
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
    Seeding is recorded in ``keynames.NODES_SEEDED`` (names, and ``url:`` + URL)."""
    current = {n.name: n for n in list_nodes(r)}
    out: list[NodeSettings] = []
    notes: list[str] = []
    for n in nodes:
        mark = ("url:" + n.url) if by_url else n.name
        first = bool(r.sadd(keynames.NODES_SEEDED, mark))
        if by_url:
            same = next((c for c in current.values() if same_server(c.url, n.url)), None)
            if same is not None:
                node = same.model_copy(update=overrides) if overrides else same
                if node != same:
                    put_node(r, node)
                if same.name != n.name:
                    notes.append(f"{n.url} is registered as node {same.name}: kept, with its settings")
                out.append(node)
                continue
            node = n.model_copy(update={"name": _free_name(n.name, set(current))})
            if not first:
                notes.append(f"node {node.name} ({n.url}) was removed at run time: added again, "
                             "as --node names it")
        else:
            old = current.get(n.name)
            if old is None and not first:
                notes.append(f"node {n.name} was removed at run time: not added again")
                continue
            node = n if old is None else old.model_copy(update={"url": n.url})
        try:
            put_node_unique(r, node)
        except UrlTaken as exc:
            notes.append(f"node {node.name} not registered: {exc} (one server, one node)")
            continue
        current[node.name] = node
        out.append(node)
    ours = {n.name for n in out}
    for c in current.values():
        if c.name not in ours:
            notes.append(f"node {c.name} ({c.url}) stays registered from an earlier run or a "
                         f"run-time add: `infergate nodes remove {c.name}` takes it out")
    return RunSeed(out, notes)


def get_states(r: redis.Redis) -> dict[str, NodeState]:
    out: dict[str, NodeState] = {}
    for name, raw in r.hgetall(keynames.NODE_STATES).items():
        try:
            d = json.loads(raw)
            if d.get("state") in STATES:
                out[name] = NodeState(d["state"], float(d.get("since", 0)), str(d.get("actor", "")))
        except (ValueError, TypeError):
            continue
    return out


def get_state(r: redis.Redis, name: str) -> NodeState:
    return get_states(r).get(name, NodeState())


def set_state(r: redis.Redis, name: str, state: State, actor: str = "",
              now: float | None = None) -> NodeState:
    """Set a node's state (``since`` = now) and return it. Raises ``ValueError`` for
    an unknown state."""
    if state not in STATES:
        raise ValueError(f"unknown state {state!r}; expected one of {STATES}")
    st = NodeState(state, time.time() if now is None else now, actor)
    r.hset(keynames.NODE_STATES, name, json.dumps(asdict(st)))
    return st


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
