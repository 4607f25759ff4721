"""The state a control plane last saw in Redis, kept in its memory, and written back when
Redis loses it.

A Redis without persistence (or one that was flushed, replaced, or a Redis Cluster shard
without a replica) comes back without the state the configuration cannot rebuild. Every
control plane keeps a copy of it, as last read:

- the node registry: ``keynames.NODES`` (each node as registered: URL, weight,
  ``max_concurrency``..., nodes added at run time too), ``keynames.NODES_SEEDED`` and
  ``keynames.NODE_STATES`` (drains);
- the API keys: ``keynames.APIKEYS`` (every record, revoked ones included),
  ``keynames.APIKEY_IDS``, and whether ``keynames.APIKEYS_MARKER`` was set.

Reading (:meth:`StateKeeper.read`, every cycle): one pipelined round trip reads the
registry (the cycle needs it anyway), the state marker, the key store's marker and its
``HLEN``; the keys themselves (``HGETALL`` of both hashes and the marker, in one
``MULTI``) only when the marker or the count changed, or every :data:`KEYS_REFRESH_S`. So
the copy is the last state seen in Redis, revocations and deletions included: at most
one poll interval old (:data:`KEYS_REFRESH_S` for a record changed by hand without the
marker).

A group whose marker is gone is lost, not copied (the copy keeps what it held): all of
them while ``keynames.STATE_MARKER`` is missing; the registry when
``keynames.NODES_SEEDED`` is gone and the copy has it; the keys when
``keynames.APIKEYS_MARKER`` is gone and the copy had it. :attr:`Read.lost` names the
groups lost while the state marker stayed (a Cluster shard, an eviction).

Restore (:meth:`StateKeeper.restore`): every entry of the copy that Redis does not hold is
written back (``HSETNX``, ``SADD``: what was written since the loss stays as it is, a key
created or revoked since is not replaced), each group in one ``MULTI`` (one hash slot),
the key store's marker set again when the copy had it (the edges then trust Redis'
answers again). Nothing deleted or revoked before the last read comes back: the copy
holds the revocation, and no longer holds what was deleted. A node of the copy whose
server or name (ignoring case) another node has now (the configuration's nodes, seeded
again by a control plane that had no copy) is not written back, nor its state: one
server never becomes two nodes.

A revocation is for good (a revoked key cannot be edited, and ``keys import`` keeps
revocations): a key the copy holds revoked that Redis holds active again, as when Redis
comes back from an older snapshot (an RDB file, a lagging replica promoted) without
losing its markers, is revoked again at once (:meth:`StateKeeper.read`, in one
``MULTI`` with the key store's marker, so the edges read it again), and listed in
:attr:`Read.revoked_again`.

One restore per loss (``claim``): the control plane that writes its copy back first takes
``keynames.STATE_RESTORE_CLAIM_PREFIX`` + the new state marker with ``SET NX``; another
that notices the same loss later (one frozen meanwhile, cut off from Redis, or slower)
writes nothing, since what it holds may be older than what the operators changed after
the first restore. A copy read more than :data:`COPY_FRESH_S` before the new state marker
was created is not written back either (it was taken before a freeze or a partition, and
the loss may have come long after it).

All methods raise ``redis.RedisError`` when Redis fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import redis

from controlplane.admin import apikeys
from controlplane.config import NodeSettings
from controlplane.redisdb import keynames
from controlplane.routing import registry

#: A copy read longer than this before Redis lost its state (the new state marker's
#: creation) is not written back, seconds.
COPY_FRESH_S = 10.0
#: TTL of a restore claim, seconds.
CLAIM_TTL_S = 3600

#: Seconds after which the API keys are read again even when neither their marker nor
#: their count changed (a record edited by hand, without the marker).
KEYS_REFRESH_S = 60.0

REGISTRY = "registry"
APIKEYS = "apikeys"
GROUPS = (REGISTRY, APIKEYS)


def _revoked(raw: str) -> bool:
    """Whether an API key record (JSON text) is revoked."""
    try:
        return json.loads(raw).get("revoked") is not None
    except (ValueError, AttributeError):
        return False


def _key_id(raw: str) -> str:
    """The id of an API key record (JSON text), ``"?"`` when it has none."""
    try:
        return str(json.loads(raw).get("id") or "?")
    except (ValueError, AttributeError):
        return "?"


@dataclass
class StateCopy:
    """The state last read (raw values, as Redis holds them)."""

    nodes: dict[str, str] = field(default_factory=dict)
    """``keynames.NODES``: node name -> JSON of its settings."""
    seeded: set[str] = field(default_factory=set)
    """``keynames.NODES_SEEDED``."""
    states: dict[str, str] = field(default_factory=dict)
    """``keynames.NODE_STATES``: node name -> JSON ``{"state", "since", "actor"}``."""
    apikeys: dict[str, str] = field(default_factory=dict)
    """``keynames.APIKEYS``: SHA-256 hex -> JSON record."""
    apikey_ids: dict[str, str] = field(default_factory=dict)
    """``keynames.APIKEY_IDS``: key id -> SHA-256 hex."""
    apikeys_marker: str | None = None
    """The key store's marker as read (None: not set)."""
    registry_at: float = 0.0
    """Epoch seconds of the last read of the registry (0: never)."""
    apikeys_at: float = 0.0
    """Epoch seconds of the last read of the keys (0: never)."""


@dataclass
class Restored:
    """What :meth:`StateKeeper.restore` wrote back (counts of entries)."""

    nodes: int = 0
    states: int = 0
    apikeys: int = 0
    revoked: int = 0
    """Of ``apikeys``, the revoked ones (written back revoked)."""
    registry_at: float = 0.0
    apikeys_at: float = 0.0
    skipped: list[str] = field(default_factory=list)
    """Nodes of the copy not written back: their server or name is another node's now."""

    def any(self) -> bool:
        return bool(self.nodes or self.states or self.apikeys or self.skipped)

    def to_dict(self) -> dict:
        """``{"nodes", "states", "apikeys", "revoked", "registry_at", "apikeys_at",
        "skipped"}`` (counts; epoch seconds of the copy's reads, 3 decimals; the names of
        the nodes not written back)."""
        d = asdict(self)
        d["registry_at"] = round(self.registry_at, 3)
        d["apikeys_at"] = round(self.apikeys_at, 3)
        return d

    def describe(self) -> str:
        """One line for the log."""
        def at(ts: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "never"
        return (f"{self.apikeys} API key(s) ({self.revoked} of them revoked) as read at "
                f"{at(self.apikeys_at)}, {self.nodes} node(s) and {self.states} node state(s) "
                f"as read at {at(self.registry_at)}"
                + (f"; not written back, their server or name is another node's now: "
                   f"{', '.join(self.skipped)}" if self.skipped else ""))


@dataclass
class Read:
    """What one :meth:`StateKeeper.read` found."""

    nodes: dict[str, str]
    """``keynames.NODES`` as Redis holds it now."""
    states: dict[str, str]
    """``keynames.NODE_STATES`` as Redis holds it now."""
    lost: set[str] = field(default_factory=set)
    """Groups (:data:`GROUPS`) whose marker is gone while the state marker is there."""
    revoked_again: list[str] = field(default_factory=list)
    """Ids of the API keys found active again after the copy saw them revoked, and
    revoked again (see the module docstring)."""


class StateKeeper:
    """Keeps :attr:`copy` (None until the first read) and writes it back."""

    def __init__(self, r: redis.Redis, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.r = r
        self.copy: StateCopy | None = None
        self._clock, self._wall = clock, wall
        self._keys_read_mono = 0.0

    def read(self) -> Read:
        """Read the registry and refresh the copy (see the module docstring). Returns
        the registry as Redis holds it now and the groups found lost."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(keynames.STATE_MARKER)
        pipe.hgetall(keynames.NODES)
        pipe.hgetall(keynames.NODE_STATES)
        pipe.smembers(keynames.NODES_SEEDED)
        pipe.get(keynames.APIKEYS_MARKER)
        pipe.hlen(keynames.APIKEYS)
        marker, nodes, states, seeded, keys_marker, keys_len = pipe.execute()
        out = Read(nodes=nodes, states=states)
        if marker is None:
            return out   # lost between the cycle's marker check and now: copy nothing
        c = self.copy
        if c is None:
            c = self.copy = StateCopy()
        now = self._wall()
        if c.seeded and not seeded:
            out.lost.add(REGISTRY)
        else:
            c.nodes, c.states, c.seeded, c.registry_at = dict(nodes), dict(states), set(seeded), now
        if c.apikeys_marker is not None and keys_marker is None:
            out.lost.add(APIKEYS)
        elif (keys_marker != c.apikeys_marker or keys_len != len(c.apikeys) or not c.apikeys_at
              or self._clock() - self._keys_read_mono >= KEYS_REFRESH_S):
            out.revoked_again = self._read_keys(c, now)
        return out

    def _read_keys(self, c: StateCopy, now: float) -> list[str]:
        """Refresh the copy of the keys; revoke again those the copy held revoked and
        Redis holds active (returns their ids)."""
        # one slot: HGETALL of both hashes and the marker at one moment
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(keynames.APIKEYS)
        pipe.hgetall(keynames.APIKEY_IDS)
        pipe.get(keynames.APIKEYS_MARKER)
        keys, ids, marker = pipe.execute()
        if c.apikeys_marker is not None and marker is None:
            return []   # lost since the first read of this cycle
        back = {d: c.apikeys[d] for d, raw in keys.items()
                if d in c.apikeys and _revoked(c.apikeys[d]) and not _revoked(raw)}
        if back:
            pipe = self.r.pipeline(transaction=True)
            for digest, raw in back.items():
                pipe.hset(keynames.APIKEYS, digest, raw)
            apikeys.mark_written(pipe)
            pipe.execute()
            keys = {**keys, **back}
            marker = self.r.get(keynames.APIKEYS_MARKER)
        c.apikeys, c.apikey_ids, c.apikeys_marker, c.apikeys_at = keys, ids, marker, now
        self._keys_read_mono = self._clock()
        return sorted(_key_id(raw) for raw in back.values())

    def claim(self, marker: str | None, created: float | None) -> str | None:
        """Whether this copy may be written back after the loss that made the state marker
        ``marker`` (created at ``created``, epoch s, when known): None when it may (the
        claim for that marker is taken), else why not (no copy, a copy older than
        :data:`COPY_FRESH_S` before the loss, or another control plane restored first)."""
        c = self.copy
        if c is None:
            return "no copy"
        read_at = max(c.registry_at, c.apikeys_at)
        if created is not None and read_at and created - read_at > COPY_FRESH_S:
            return (f"this control plane's copy was read {created - read_at:.0f} s before "
                    "the loss (it was frozen or cut off from Redis meanwhile)")
        key = keynames.STATE_RESTORE_CLAIM_PREFIX + (marker or "")
        if not self.r.set(key, "1", nx=True, ex=CLAIM_TTL_S):
            return "another control plane wrote its copy back first"
        return None

    def _restore_nodes(self, c: StateCopy) -> tuple[int, int, list[str]]:
        """Nodes of the copy that Redis lacks, each unless its server or name is taken
        (:func:`registry.put_node_unique`), then the states of the nodes registered;
        returns (nodes, states written, names skipped)."""
        written, skipped = 0, []
        current = set(self.r.hkeys(keynames.NODES))
        for name, raw in c.nodes.items():
            if name in current:
                continue
            try:
                node = NodeSettings.model_validate_json(raw)
                if registry.put_node_unique(self.r, node, only_new=True):
                    written += 1
            except (registry.UrlTaken, registry.NameTaken, ValueError):
                skipped.append(name)
        names = set(self.r.hkeys(keynames.NODES))
        pipe = self.r.pipeline(transaction=True)
        states = [(n, raw) for n, raw in c.states.items() if n in names]
        for name, raw in states:
            pipe.hsetnx(keynames.NODE_STATES, name, raw)
        if c.seeded:
            pipe.sadd(keynames.NODES_SEEDED, *c.seeded)
        res = pipe.execute() if (states or c.seeded) else []
        return written, sum(1 for x in res[:len(states)] if x), skipped

    def restore(self, groups: Iterable[str] = GROUPS) -> Restored:
        """Write back every entry of the copy that Redis lacks, for ``groups``
        (:data:`GROUPS`); nothing without a copy. Returns the counts written (the
        caller takes the claim first, :meth:`claim`)."""
        out = Restored()
        c = self.copy
        if c is None:
            return out
        groups = set(groups)
        out.registry_at, out.apikeys_at = c.registry_at, c.apikeys_at
        if REGISTRY in groups and (c.nodes or c.states or c.seeded):
            out.nodes, out.states, out.skipped = self._restore_nodes(c)
        if APIKEYS in groups and (c.apikeys or c.apikeys_marker is not None):
            pipe = self.r.pipeline(transaction=True)
            digests = list(c.apikeys)
            for digest in digests:
                pipe.hsetnx(keynames.APIKEYS, digest, c.apikeys[digest])
            for key_id, digest in c.apikey_ids.items():
                pipe.hsetnx(keynames.APIKEY_IDS, key_id, digest)
            if c.apikeys_marker is not None:
                apikeys.mark_written(pipe)
            res = pipe.execute()
            for digest, written in zip(digests, res):
                if written:
                    out.apikeys += 1
                    out.revoked += _revoked(c.apikeys[digest])
        return out
