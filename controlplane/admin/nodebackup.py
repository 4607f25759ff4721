"""A backup of the node registry: every node's document and its drain state as JSON
(``infergate nodes export``), written back by ``infergate nodes import``.

Run-time nodes, weights and drains live only in Redis; a Redis that keeps nothing across
a restart, restarted together with the control plane, loses them (the control plane
re-seeds the nodes of its TOML file only). The export is what restores them.

Document (version 1)::

    {"format": "infergate-nodes", "version": 1, "exported": 1733560000.0,
     "nodes": [{"name": "gpu-1", "url": "http://10.0.0.5:8000", "kind": "vllm",
                "weight": 1.0, "max_concurrency": 64, ..., "state": "drained"}, ...]}

A node's fields are those of :class:`controlplane.config.NodeSettings`; ``state`` is
``active``, ``draining`` or ``drained`` (a drained node comes back ``draining``: the
leader turns it ``drained`` once its requests are done)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from controlplane.config import NodeSettings, Settings
from controlplane.routing import registry

from . import ops

FORMAT = "infergate-nodes"
VERSION = 1
STATES = ("active", "draining", "drained")


def export_nodes(r: redis.Redis, now: float | None = None) -> dict:
    """The backup document of every registered node (see the module docstring). Raises
    ``redis.RedisError``."""
    states = registry.get_states(r)
    nodes = []
    for node in registry.list_nodes(r):
        st = states.get(node.name)
        nodes.append({**ops.node_json(node), "state": st.state if st else "active"})
    return {"format": FORMAT, "version": VERSION,
            "exported": round(time.time() if now is None else now, 3), "nodes": nodes}


@dataclass
class ImportResult:
    """Names of the nodes an import added, replaced (``--overwrite``), kept as they were,
    and skipped (``skipped``: name -> why: a URL another node has, or a credential that
    only the TOML file may name)."""

    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def parse_backup(doc: object) -> list[tuple[NodeSettings, str]]:
    """The nodes and states of a backup document, every one checked before any is
    written. Raises :class:`ops.BadInput` naming the first bad entry."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ops.BadInput(f"not an export of infergate nodes (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ops.BadInput(f"unsupported version {doc.get('version')!r} (this infergate reads "
                           f"version {VERSION})")
    entries = doc.get("nodes")
    if not isinstance(entries, list):
        raise ops.BadInput("\"nodes\" must be a list")
    out: list[tuple[NodeSettings, str]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ops.BadInput(f"nodes[{i}]: expected a JSON object")
        data = dict(entry)
        state = data.pop("state", "active")
        if state not in STATES:
            raise ops.BadInput(f"nodes[{i}].state: {state!r} is not one of {', '.join(STATES)}")
        try:
            node = ops.parse_node(data)
        except ops.BadInput as exc:
            raise ops.BadInput(f"nodes[{i}]: {exc}") from None
        if node.name in seen:
            raise ops.BadInput(f"nodes[{i}]: the name {node.name!r} appears twice")
        seen.add(node.name)
        out.append((node, state))
    return out


def import_nodes(r: redis.Redis, doc: object, actor: str, *, overwrite: bool = False,
                 events_max: int = 10000, settings: Settings | None = None) -> ImportResult:
    """Write the nodes of a backup ``doc`` into the registry: a node not registered is
    added (:func:`ops.add_node`, its URL checked as there) and given its state; one
    registered is kept as it is, or with ``overwrite`` has its fields and state replaced
    (:func:`ops.change_node`, :func:`ops.drain` / :func:`ops.undrain`); one that cannot
    be written (its URL refused or another node's) is skipped, with the reason. Nothing
    is written when the document is bad. Raises :class:`ops.BadInput` (a bad document)
    and ``redis.RedisError``."""
    res = ImportResult()
    for node, state in parse_backup(doc):
        data = ops.node_json(node)
        if node.has_credential() or node.ca_file:
            res.skipped[node.name] = "api_key_env, api_key_file and ca_file: TOML file only"
            continue
        if registry.get_node(r, node.name) is None:
            try:
                ops.add_node(r, data, actor, events_max, settings=settings)
            except ops.AdminError as exc:   # its URL refused or taken, or the name
                res.skipped[node.name] = str(exc)
                continue
            res.added.append(node.name)
        elif overwrite:
            changes = {k: v for k, v in data.items() if k in ops.EDITABLE}
            try:
                ops.change_node(r, node.name, changes, actor, events_max, settings=settings)
            except ops.AdminError as exc:
                res.skipped[node.name] = str(exc)
                continue
            res.replaced.append(node.name)
        else:
            res.kept.append(node.name)
            continue
        if state == "active":
            ops.undrain(r, node.name, actor, events_max)
        else:
            ops.drain(r, node.name, actor, events_max)
    return res
