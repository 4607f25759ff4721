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
marker). The control plane reports the key generation its copy holds
(:mod:`controlplane.routing.keycopies`), and a revocation returns once every running
control plane's copy holds it, so a loss right after it does not undo it.

A group whose marker is gone is lost, not copied (the copy keeps what it held): all of
them while ``keynames.STATE_MARKER`` is missing; the registry when
``keynames.NODES_SEEDED`` is gone and the copy has it; the keys when
``keynames.APIKEYS_MARKER`` is gone and the copy had it. So is a group whose hash
(``keynames.NODES``, ``keynames.APIKEYS``) is empty while the copy holds entries and its
generation did not move: every write INCRs the generation, so only an eviction (a
``maxmemory-policy`` that evicts keys without a TTL) or a deletion by hand empties it
so; taken for a removal, it would leave every node out for good (the names stay in
``keynames.NODES_SEEDED``, so nothing seeds them again). :attr:`Read.lost` names the
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

Redis back from an older snapshot (an RDB file written minutes before a crash, a lagging
replica promoted) keeps its markers but not the changes made after the snapshot: a node
added, removed or edited, a drain, a key created or revoked. Every write of the registry
and of the keys INCRs its group's generation (``keynames.NODES_GEN``,
``keynames.APIKEYS_GEN``), which never goes back in a healthy Redis, and pushes a token
on the group's write log (:mod:`controlplane.redisdb.genlog`). A generation lower than
the copy's (read in the same round trip, before the group's content, so the copy is
never newer than its generation), or the copy's last token missing from the log (as many
writes as were lost reached the restarted Redis before this read), means that Redis
went back: the copy is then not
refreshed, :attr:`Read.went_back` names the group, and :meth:`StateKeeper.put_back`
makes the group in Redis what the copy holds (entries added, changed and removed since
the snapshot as the copy saw them), with the generation set past the copy's and Redis'. Changes
written to the restarted Redis before this control plane's next read (one poll
interval) are overwritten by the copy, but for the keys': keys are never deleted and a
revocation is for good, so a key created since the restart stays, and so does a
revocation made since. An operator who rolls Redis back on purpose
stops the control planes first (docs/operations.md).

A revocation is for good (a revoked key cannot be edited, and ``keys import`` keeps
revocations): a key the copy holds revoked that Redis holds active again (a record
written by hand, a generation that went back with it) is revoked again at once
(:meth:`StateKeeper.read`, in one ``MULTI`` with the key store's marker, so the edges
read it again), and listed in :attr:`Read.revoked_again`.

One restore per loss (``claim``): the control plane that writes its copy back first takes
``keynames.STATE_RESTORE_CLAIM_PREFIX`` + the new state marker with ``SET NX``; another
that notices the same loss later (one frozen meanwhile, cut off from Redis, or slower)
writes nothing, since what it holds may be older than what the operators changed after
the first restore. A copy read more than :data:`COPY_FRESH_S` before the new state marker
was created is not written back either (it was taken before a freeze or a partition, and
the loss may have come long after it), unless it was read within :data:`COPY_FRESH_S` of
the moment Redis stopped answering this control plane, which tried it every cycle until
it came back: Redis down for an hour and back empty gets the copy, nothing could have
changed the state while it was down (the caller passes no such moment when another
control plane made the new state marker more than :data:`COPY_FRESH_S` and a poll interval
before: Redis answered it, this one alone was cut off). (Nothing but what this control plane could not
see: Redis up for the others while this one alone was cut off from it. A key revoked
meanwhile through another control plane is revoked again by that one, whose copy, refused,
keeps its revocations: :meth:`StateKeeper.drop`; one revoked with the CLI, or a node
added, comes back as this copy holds it.) After a loss the generations are set back to at
least the copy's, so the group written back does not read as gone back. One put-back per
generation pair (``claim``, :data:`BACK_CLAIM_TTL_S`).

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
from controlplane.redisdb import genlog, keynames
from controlplane.routing import registry

#: A copy read longer than this before Redis lost its state (the new state marker's
#: creation) is not written back, seconds.
COPY_FRESH_S = 10.0
#: Why a control plane writes nothing back after a loss another one restored.
CLAIMED_BY_ANOTHER = "another control plane wrote its copy back first"
#: TTL of a restore claim, seconds.
CLAIM_TTL_S = 3600
#: TTL of the claim of a put-back after Redis went back (one per group, generation in
#: Redis and generation of the copy), seconds.
BACK_CLAIM_TTL_S = 60

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


def _gen(raw: object) -> int:
    """A generation as read (None or not a number: 0)."""
    try:
        return int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def _keys_to_put_back(copy: dict[str, str], held: dict[str, str]) -> dict[str, str]:
    """The records of the copy to write over ``held`` (``keynames.APIKEYS`` as Redis
    holds it) after Redis went back: those missing or different, but a record revoked
    in Redis stays revoked (a revocation is for good: one made since the restart). Keys
    are never deleted, so a key Redis holds and the copy does not was created since the
    restart and stays too."""
    return {d: raw for d, raw in copy.items() if held.get(d) != raw
            and not (d in held and _revoked(held[d]) and not _revoked(raw))}


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
    nodes_gen: int = 0
    """``keynames.NODES_GEN`` read with the registry (0: not set)."""
    apikeys_gen: int = 0
    """``keynames.APIKEYS_GEN`` read with the keys (0: not set)."""
    nodes_tok: str | None = None
    """The newest token of ``keynames.NODES_GEN_LOG`` read with the registry (None: none
    there, or Redis lost it since: :mod:`controlplane.redisdb.genlog`)."""
    apikeys_tok: str | None = None
    """The same of ``keynames.APIKEYS_GEN_LOG`` for the keys."""


@dataclass
class PutBack:
    """What :meth:`StateKeeper.put_back` changed in one group: the names (node names,
    key ids) written back (missing or different in Redis), removed again (in Redis, not
    in the copy) and, for the registry, the nodes whose state changed."""

    group: str
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    gen: int = 0
    """The group's generation in Redis before (the copy's was higher)."""
    copy_gen: int = 0

    def to_dict(self) -> dict:
        """``{"group", "written", "removed", "states", "gen", "copy_gen"}``."""
        return asdict(self)

    def describe(self) -> str:
        """One line for the log."""
        what = "node(s)" if self.group == REGISTRY else "API key(s)"
        parts = [f"{self.group} at generation {self.gen} in Redis, {self.copy_gen} in the copy"]
        if self.written:
            parts.append(f"{what} written back: {', '.join(self.written)}")
        if self.removed:
            parts.append(f"{what} removed again: {', '.join(self.removed)}")
        if self.states:
            parts.append(f"state(s) set back: {', '.join(self.states)}")
        return "; ".join(parts)


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
    went_back: dict[str, int] = field(default_factory=dict)
    """Groups (:data:`GROUPS`) whose generation in Redis is lower than the copy's ->
    that generation: Redis came back older; the copy was not refreshed."""


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
        pipe.get(keynames.NODES_GEN)   # before the content: the copy is never newer
        pipe.lindex(keynames.NODES_GEN_LOG, 0)
        pipe.hgetall(keynames.NODES)
        pipe.hgetall(keynames.NODE_STATES)
        pipe.smembers(keynames.NODES_SEEDED)
        pipe.get(keynames.APIKEYS_MARKER)
        pipe.hlen(keynames.APIKEYS)
        pipe.get(keynames.APIKEYS_GEN)
        pipe.lindex(keynames.APIKEYS_GEN_LOG, 0)
        (marker, nodes_gen, nodes_head, nodes, states, seeded, keys_marker, keys_len, keys_gen,
         keys_head) = pipe.execute()
        out = Read(nodes=nodes, states=states)
        if marker is None:
            return out   # lost between the cycle's marker check and now: copy nothing
        c = self.copy
        if c is None:
            c = self.copy = StateCopy()
        now = self._wall()
        nodes_gen, keys_gen = _gen(nodes_gen), _gen(keys_gen)
        if c.seeded and not seeded:
            out.lost.add(REGISTRY)
        elif c.nodes and not nodes and nodes_gen == c.nodes_gen:
            out.lost.add(REGISTRY)   # emptied without a write: evicted (or deleted by hand)
        elif c.registry_at and (nodes_gen < c.nodes_gen or self._log_lost(
                keynames.NODES_GEN_LOG, nodes_head, c.nodes_tok, nodes_gen, c.nodes_gen)):
            out.went_back[REGISTRY] = nodes_gen
        else:
            c.nodes, c.states, c.seeded, c.registry_at = dict(nodes), dict(states), set(seeded), now
            c.nodes_gen, c.nodes_tok = nodes_gen, nodes_head
        if c.apikeys_marker is not None and keys_marker is None:
            out.lost.add(APIKEYS)
        elif c.apikeys and not keys_len and keys_gen == c.apikeys_gen:
            out.lost.add(APIKEYS)    # emptied without a write, its marker left
        elif c.apikeys_at and (keys_gen < c.apikeys_gen or self._log_lost(
                keynames.APIKEYS_GEN_LOG, keys_head, c.apikeys_tok, keys_gen, c.apikeys_gen)):
            out.went_back[APIKEYS] = keys_gen
        elif (keys_marker != c.apikeys_marker or keys_len != len(c.apikeys) or not c.apikeys_at
              or keys_gen != c.apikeys_gen
              or self._clock() - self._keys_read_mono >= KEYS_REFRESH_S):
            out.revoked_again = self._read_keys(c, now)
        return out

    def _log_lost(self, key: str, head: str | None, token: str | None, gen: int,
                  copy_gen: int) -> bool:
        """:func:`genlog.lost` for the write log ``key`` whose newest token is ``head``:
        the whole log is read only when something was written since the copy's token
        (``head`` is another one), not every cycle."""
        if not token or head == token:
            return False
        return genlog.lost(self.r.lrange(key, 0, -1), token, gen, copy_gen)

    def _read_keys(self, c: StateCopy, now: float) -> list[str]:
        """Refresh the copy of the keys; revoke again those the copy held revoked and
        Redis holds active (returns their ids)."""
        # one slot: HGETALL of both hashes and the marker at one moment
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(keynames.APIKEYS)
        pipe.hgetall(keynames.APIKEY_IDS)
        pipe.get(keynames.APIKEYS_MARKER)
        pipe.get(keynames.APIKEYS_GEN)
        pipe.lindex(keynames.APIKEYS_GEN_LOG, 0)
        keys, ids, marker, gen, tok = pipe.execute()
        if c.apikeys_marker is not None and marker is None:
            return []   # lost since the first read of this cycle
        if c.apikeys_at and _gen(gen) < c.apikeys_gen:
            return []   # went back since the first read: the next read tells
        back = {d: c.apikeys[d] for d, raw in keys.items()
                if d in c.apikeys and _revoked(c.apikeys[d]) and not _revoked(raw)}
        if back:
            pipe = self.r.pipeline(transaction=True)
            for digest, raw in back.items():
                pipe.hset(keynames.APIKEYS, digest, raw)
            tok = apikeys.bump(pipe)
            apikeys.mark_written(pipe)
            pipe.execute()
            keys = {**keys, **back}
            marker = self.r.get(keynames.APIKEYS_MARKER)
        c.apikeys, c.apikey_ids, c.apikeys_marker, c.apikeys_at = keys, ids, marker, now
        c.apikeys_gen, c.apikeys_tok = _gen(gen) + (1 if back else 0), tok
        self._keys_read_mono = self._clock()
        return sorted(_key_id(raw) for raw in back.values())

    def claim(self, marker: str | None, created: float | None,
              unreachable_since: float | None = None) -> str | None:
        """Whether this copy may be written back after the loss that made the state marker
        ``marker`` (created at ``created``, epoch s, when known): None when it may (the
        claim for that marker is taken), else why not (no copy, a copy older than
        :data:`COPY_FRESH_S` before the loss, or another control plane restored first).
        ``unreachable_since`` (epoch s): when Redis stopped answering this control plane,
        which tried it every cycle since until it answered again (None: it answered
        throughout, or this control plane was frozen); a copy read within
        :data:`COPY_FRESH_S` of that is fresh however long Redis was away: nothing could
        change the state in a Redis that was down (the first to restore takes the claim,
        and a control plane that kept reaching Redis notices first)."""
        c = self.copy
        if c is None:
            return "no copy"
        read_at = max(c.registry_at, c.apikeys_at)
        lost_at = created
        if unreachable_since is not None and (lost_at is None or unreachable_since < lost_at):
            lost_at = unreachable_since
        if lost_at is not None and read_at and lost_at - read_at > COPY_FRESH_S:
            return (f"this control plane's copy was read {lost_at - read_at:.0f} s before "
                    "the loss (it was frozen or cut off from Redis meanwhile)")
        key = keynames.STATE_RESTORE_CLAIM_PREFIX + (marker or "")
        if not self.r.set(key, "1", nx=True, ex=CLAIM_TTL_S):
            return CLAIMED_BY_ANOTHER
        return None

    def drop(self) -> None:
        """Drop the copy after :meth:`claim` refused it, but for its revoked keys: a
        revocation is for good, so the next read revokes again a key the copy holds
        revoked and Redis holds valid (:meth:`_read_keys`): one written back valid by
        a control plane that was cut off from Redis while the key was revoked (its copy
        counts as fresh, read just before Redis stopped answering it)."""
        c = self.copy
        revoked = {d: raw for d, raw in c.apikeys.items() if _revoked(raw)} if c else {}
        self.copy = StateCopy(apikeys=revoked) if revoked else None

    def claim_back(self, group: str, gen: int) -> bool:
        """Take the claim to put ``group`` back (:meth:`put_back`) while Redis holds it at
        generation ``gen``: False when another control plane took it first."""
        c = self.copy
        copy_gen = (c.nodes_gen if group == REGISTRY else c.apikeys_gen) if c else 0
        key = f"{keynames.STATE_RESTORE_CLAIM_PREFIX}back:{group}:{gen}:{copy_gen}"
        return bool(self.r.set(key, "1", nx=True, ex=BACK_CLAIM_TTL_S))

    def put_back(self, group: str, gen: int, current: Read | None = None) -> PutBack:
        """Make ``group`` (:data:`GROUPS`) in Redis what the copy holds, in one
        ``MULTI`` (one hash slot), with its generation set past the copy's and Redis' (a
        copy of the older Redis then reads as older) and a token on its write log
        (:mod:`controlplane.redisdb.genlog`), after Redis
        went back to generation ``gen`` (:attr:`Read.went_back`; the caller takes the
        claim first, :meth:`claim_back`); the keys are merged (:func:`_keys_to_put_back`:
        none removed, a revocation in Redis kept). ``current``: the read that found it, for the
        registry's names. The key store's marker is set again when the copy had it (the
        edges read the keys again). Returns what changed; nothing without a copy."""
        c = self.copy
        out = PutBack(group, gen=gen)
        if c is None:
            return out
        pipe = self.r.pipeline(transaction=True)
        if group == REGISTRY:
            nodes = current.nodes if current is not None else self.r.hgetall(keynames.NODES)
            states = (current.states if current is not None
                      else self.r.hgetall(keynames.NODE_STATES))
            out.copy_gen = c.nodes_gen
            out.written = sorted(n for n, raw in c.nodes.items() if nodes.get(n) != raw)
            out.removed = sorted(set(nodes) - set(c.nodes))
            keep = {n: raw for n, raw in c.states.items() if n in c.nodes}
            out.states = sorted(n for n in set(keep) | (set(states) & set(c.nodes))
                                if keep.get(n) != states.get(n))
            pipe.delete(keynames.NODES, keynames.NODE_STATES)
            if c.nodes:
                pipe.hset(keynames.NODES, mapping=c.nodes)
            if keep:
                pipe.hset(keynames.NODE_STATES, mapping=keep)
            if c.seeded:
                pipe.sadd(keynames.NODES_SEEDED, *c.seeded)
            tok = genlog.put_back_token(c.nodes_gen)
            pipe.set(keynames.NODES_GEN, max(c.nodes_gen, gen) + 1)
            pipe.lpush(keynames.NODES_GEN_LOG, tok)
            pipe.ltrim(keynames.NODES_GEN_LOG, 0, genlog.LEN - 1)
            pipe.execute()
            c.nodes_gen, c.nodes_tok = max(c.nodes_gen, gen) + 1, tok
            return out
        out.copy_gen = c.apikeys_gen
        tok = genlog.put_back_token(c.apikeys_gen)
        with pipe:
            while True:
                try:
                    pipe.watch(keynames.APIKEYS)   # a revocation meanwhile is kept
                    write = _keys_to_put_back(c.apikeys, pipe.hgetall(keynames.APIKEYS))
                    pipe.multi()
                    if write:
                        pipe.hset(keynames.APIKEYS, mapping=write)
                    if c.apikey_ids:
                        pipe.hset(keynames.APIKEY_IDS, mapping=c.apikey_ids)
                    if c.apikeys_marker is not None:
                        apikeys.mark_written(pipe)
                    pipe.set(keynames.APIKEYS_GEN, max(c.apikeys_gen, gen) + 1)
                    pipe.lpush(keynames.APIKEYS_GEN_LOG, tok)
                    pipe.ltrim(keynames.APIKEYS_GEN_LOG, 0, genlog.LEN - 1)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        out.written = sorted(_key_id(raw) for raw in write.values())
        c.apikeys_gen, c.apikeys_tok = max(c.apikeys_gen, gen) + 1, tok
        return out

    def _gen_at_least(self, key: str, gen: int) -> None:
        """Set the generation ``key`` to ``gen`` unless Redis holds a higher one."""
        if gen and _gen(self.r.get(key)) < gen:
            self.r.set(key, gen)

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
        # Redis lost the groups' write logs with them: the copy's tokens are not there
        if REGISTRY in groups:
            c.nodes_tok = None
        if APIKEYS in groups:
            c.apikeys_tok = None
        if REGISTRY in groups and (c.nodes or c.states or c.seeded):
            out.nodes, out.states, out.skipped = self._restore_nodes(c)
        if REGISTRY in groups:
            self._gen_at_least(keynames.NODES_GEN, c.nodes_gen)
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
            self._gen_at_least(keynames.APIKEYS_GEN, c.apikeys_gen)
            for digest, written in zip(digests, res):
                if written:
                    out.apikeys += 1
                    out.revoked += _revoked(c.apikeys[digest])
        return out
