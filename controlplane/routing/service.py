"""``infergate controlplane``: the poll/score/snapshot loop and the admin app, in one
process.

Every ``controlplane.poll_interval_s`` an APScheduler job runs
:meth:`ControlPlane.run_cycle`:

1. Read the node registry, node states and edge stats from Redis (the registry is
   seeded from the TOML ``[[nodes]]`` at start, and again if Redis comes back empty).
   With Redis unreachable the last known nodes (at first: the TOML nodes) are used.
2. Poll every node concurrently (:mod:`controlplane.routing.poller`). Followers do this
   too, so a standby is warm. The served models of each node are read apart from this,
   rarely and in the background (:mod:`controlplane.routing.models`); a node added at
   run time or healthy again gets a slow start (``ramp_since`` of the snapshot rules).
3. Renew or try to take the leader lock (:mod:`controlplane.routing.leader`), then apply the
   health hysteresis and compute scores.
4. Leader only: set ``drained`` where a drain is over (compare-and-set, so an undrain
   in between wins), write each node's metrics (TTL ``metrics_ttl_s``) and history
   point, INCR the snapshot version and write the routing snapshot -- two pipelined
   round trips -- and append the events (``health``, ``drained``, ``leader``, and
   ``breaker`` with ``{"state": "open" | "closed", "edge": edge id}`` for each breaker
   opening or closing the edges report in ``infergate:v1:edges``).
5. Leader only, every ``series.STEP_S``: one point of the pool's traffic for the admin
   overview (:mod:`controlplane.routing.series`, one more round trip).

A second job, every :data:`VERIFY_INTERVAL_S`, runs the online verification of semantic
cache hits on the leader only (:meth:`ControlPlane.run_verify`,
:mod:`controlplane.cache.verify`): it takes the hits the edges queued, asks a healthy
active node again and moves the namespace's semantic threshold. Being its own job, a slow
node never delays a poll cycle.

A third job, every :data:`controlplane.cache.sweep.SWEEP_INTERVAL_S`, leader only,
sweeps the response cache's index sets (:meth:`ControlPlane.run_sweep`,
:mod:`controlplane.cache.sweep`): members whose entry expired or was evicted leave them, a
bounded part per run.

Redis going away never stops the loop: polling continues, writes resume when it
answers again; "unreachable" and "reachable again" are logged once per outage.

State marker: every cycle ``SET infergate:v1:state_marker ... NX`` (no TTL), then GET.
When this process created it after it had seen one, or finds another value than the one
it saw (another control plane created it anew), Redis lost its state (restarted without
its append-only file, flushed, or replaced): logged at ERROR ("REDIS STATE LOST"),
recorded as a ``state_lost`` event (admin page, ``/api/v1/events``), counted in
``infergate_controlplane_state_lost_total`` with the time in
``infergate_controlplane_state_lost_timestamp_seconds``. Then the copy of the state this
process last read (:mod:`controlplane.routing.statecopy`: API keys with their
revocations, nodes with their weights, nodes added at run time, drain states) is written
back where Redis lacks it (logged at ERROR, "REDIS STATE RESTORED", a ``state_restored``
event ``{"nodes", "states", "apikeys", "revoked", "registry_at", "apikeys_at"}``,
``infergate_controlplane_state_restored_total``), and the configured ``[[nodes]]`` not
in it are seeded. The same restore runs for one group whose own marker went while the
state marker stayed (a Redis Cluster shard, an eviction). A control plane that never read
the state has no copy: it re-seeds the configured nodes only; restore keys with
``infergate keys import``. Until the keys are written again the edges keep honouring the
valid keys they knew (``infergate:v1:apikeys:marker:{infergate:v1:apikeys}``
missing, ``lua/infergate/admission/auth.lua``): logged at ERROR ("API KEYS MISSING"), an
``apikeys_missing`` event (``apikeys_restored`` once the keys are written again), the
gauge ``infergate_controlplane_apikeys_missing``, and on the admin keys page and
``GET /api/v1/keys`` (``store_missing``, ``edges_keeping``).

Own addresses: every ``ownaddrs.PUBLISH_EVERY_S`` the addresses of the stack in the
settings (Redis, admin, embedder, edge metrics and API) are published in Redis
(:mod:`controlplane.routing.ownaddrs`), taken back at the stop: every writer of the node
registry refuses them as node URLs, whatever its own configuration.

Persistence: at the first cycle that reaches Redis, ``CONFIG GET appendonly`` / ``save``
(:mod:`controlplane.redisdb.persistence`); one WARNING line when Redis keeps nothing (or
only snapshots) across a restart, or when the check is refused.

Logs go to stderr, one line per change: leadership, node health, Redis down/up, nodes
added/removed. SIGTERM/SIGINT stop the scheduler, release the leader lock (only if
still ours) and exit 0.
"""

from __future__ import annotations

import errno
import json
import logging
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import click
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from controlplane.cache.sweep import SWEEP_INTERVAL_S, IndexSweeper, SweepReport
from controlplane.redisdb import genlog, keynames
from controlplane.redisdb.migrate import migrate_key_names
from controlplane.routing import keycopies, ownaddrs, registry, statecopy
from controlplane.cli.common import split_listen
from controlplane.config import (ConfigError, NodeSettings, RedisSettings,
                                 Settings, load_settings)
from controlplane.routing.leader import LeaderElector, make_id
from controlplane.routing.models import ModelsPoller
from controlplane.routing.nodekind import PropsPoller
from controlplane.routing.nodeaccess import AccessTable
from controlplane.routing.poller import (
    NodeStatus,
    NodeTracker,
    Poller,
    breakers_open,
    models_refusal,
)
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.persistence import Persistence, check_persistence
from controlplane.redisdb.url import parse_redis_url, redact
from controlplane.routing.registry import NodeState
from controlplane.routing.series import SeriesRecorder
from controlplane.routing.stall import stalled_nodes
from controlplane.routing.snapshot import (
    DRAIN_GRACE_SYNCS, EDGE_FORGET_S, HostResolver, build_snapshot, drain_decisions,
    fresh_inflight, stale_edges,
)
from controlplane.routing.wire import (EDGE_FRESH_FACTOR, EdgeReport, RoutingSnapshot,
                                       edge_fresh_s, fresh_edge_reports)

log = logging.getLogger("infergate.controlplane")

#: Connections the admin server holds open at once (waitress ``connection_limit``).
ADMIN_CONNECTION_LIMIT = 1000


def _raise_fd_limit(want: int = 4096) -> None:
    """Raise this process's soft limit of open files to ``want`` (at most the hard
    limit): systemd's default soft limit of 1024 is about ADMIN_CONNECTION_LIMIT, and
    past it the admin port's accept() fails."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
#: Seconds an admin connection may send nothing before it is closed (waitress
#: ``channel_timeout``), checked every ADMIN_CLEANUP_S.
ADMIN_IDLE_TIMEOUT_S = 15
ADMIN_CLEANUP_S = 5

ACTOR = "controlplane"
#: Seconds between two runs of the verification job (leader only).
VERIFY_INTERVAL_S = 1.0
#: Longest one verification run keeps taking items, seconds.
VERIFY_BUDGET_S = 5.0

#: KEYS = node states hash, registry generation, its write log (one slot); ARGV = name,
#: since of the draining state seen, new JSON, token of the write log, its length
#: (controlplane.redisdb.genlog).
#: Sets the new state only if the node is still draining since the same time.
DRAINED_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local ok, d = pcall(cjson.decode, cur)
if not ok or type(d) ~= 'table' or d.state ~= 'draining' then return 0 end
local since = tonumber(d.since) or -1
if math.abs(since - tonumber(ARGV[2])) > 0.001 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('INCR', KEYS[2])
redis.call('LPUSH', KEYS[3], ARGV[4])
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[5]) - 1)
return 1
"""

#: Writes the snapshot only while this control plane still holds the leader lock with
#: the fencing token it took it with, so a leader that stalled past its lease (and was
#: replaced), or whose lease was lost in a failover, cannot overwrite its successor.
#: KEYS = leader, routing, fencing counter (one slot); ARGV = id, snapshot, token.
SNAPSHOT_IF_LEADER_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(redis.call('GET', KEYS[3]) or '0') ~= tonumber(ARGV[3]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


def breaker_changes(seen: dict[tuple[str, str], str], reports: list[EdgeReport]
                    ) -> tuple[dict[tuple[str, str], str], list[tuple[str, dict]]]:
    """Breaker openings and closings between the states in ``seen`` ((edge id, node) ->
    ``open`` | ``half_open`` | ``closed``, as last reported) and the fresh edge
    ``reports``. Returns the new ``seen`` (only pairs still reported) and the events, as
    ``(node, {"state": "open" | "closed", "edge": edge id})``: ``open`` when a breaker
    is open and was not open before (also when first seen open), ``closed`` when one
    that was open or half-open is closed again. Half-open alone is no event."""
    now_seen: dict[tuple[str, str], str] = {}
    events: list[tuple[str, dict]] = []
    for rep in reports:
        for node, st in rep.nodes.items():
            if st.breaker is None:
                continue
            key = (rep.edge_id, node)
            before = seen.get(key)
            if st.breaker == "open" and before != "open":
                events.append((node, {"state": "open", "edge": rep.edge_id}))
            elif st.breaker == "closed" and before in ("open", "half_open"):
                events.append((node, {"state": "closed", "edge": rep.edge_id}))
            now_seen[key] = st.breaker
    return now_seen, events


@dataclass
class CycleReport:
    """What one cycle did (for tests and the log)."""

    ts: float
    leader: bool
    redis_ok: bool
    wrote: bool = False
    version: int | None = None
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    health_changes: list[tuple[str, bool]] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    models: dict[str, list[str] | None] = field(default_factory=dict)
    """Served model ids per node (``None`` = unknown; :mod:`controlplane.routing.models`)."""
    models_any: set[str] = field(default_factory=set)
    """Nodes that take any model (single-model llama.cpp servers)."""


#: Longest wait (s) of a cycle for the ``/props`` of a node seen back or restarted, so
#: that its new slots reach the snapshot written in that cycle (a local llama-server
#: answers in milliseconds; a read that takes longer settles at a later cycle).
REREAD_WAIT_S = 0.5


class ControlPlane:
    """Poller + scorer + leader + snapshot writer. :meth:`run_cycle` is the whole
    periodic job and can be called directly (tests drive cycles this way)."""

    def __init__(self, settings: Settings, r: redis.Redis, ident: str | None = None):
        cp = settings.controlplane
        self.settings = settings
        self.r = r
        self._migrated = False
        self.id = ident or make_id()
        self.elector = LeaderElector(r, self.id, cp.leader_ttl_s)
        #: API key and CA bundle of every node (controlplane.routing.nodeaccess), used by
        #: every request to a node and put into the snapshot for the edges
        self.access = AccessTable(cp.node_ca_file)
        self._key_errors: dict[str, str | None] = {}
        self.poller = Poller(cp.poll_timeout_s, max_metrics_bytes=cp.max_metrics_bytes,
                             access=self.access)
        #: served models per node, read rarely and apart from the health polls
        self.models = ModelsPoller(cp.models_refresh_s, cp.models_timeout_s,
                                   access=self.access)
        #: llama.cpp slots and kind hints per node (/props, read like /v1/models)
        self.props = PropsPoller(cp.models_refresh_s, cp.models_timeout_s,
                                 access=self.access)
        #: node -> epoch s its slow start began (added at run time, healthy again)
        self.ramps: dict[str, float] = {}
        self._registry_read = False
        self.resolver = HostResolver()
        self.trackers: dict[str, NodeTracker] = {}
        self.nodes: list[NodeSettings] = list(settings.nodes)
        self.states: dict[str, NodeState] = {}
        self.edges: dict[str, str] = {}
        #: (edge id, node) -> breaker state last reported (see :func:`breaker_changes`).
        self.breakers: dict[tuple[str, str], str] = {}
        self.redis_ok: bool | None = None
        #: epoch s of the first failed call since Redis last answered (None: it answers)
        self.redis_unreachable_since: float | None = None
        #: epoch s of the last failed call (0: none yet)
        self._redis_failed_at = 0.0
        self.last_snapshot: RoutingSnapshot | None = None
        self.last_report: CycleReport | None = None
        #: The overview time series (leader only; see controlplane.routing.series).
        self.series = SeriesRecorder(EDGE_FRESH_FACTOR * settings.edge.stale_after_s)
        self._seeded = False
        self._pending: deque[tuple[str, str, dict]] = deque(maxlen=256)
        self._lock = threading.Lock()
        self._scheduler: Any = None
        #: Last error message of each scheduled job (None: its last run went well).
        self._job_errors: dict[str, str | None] = {}
        #: Called with every finished cycle's report (e.g. the Prometheus exporter).
        self.cycle_listeners: list[Callable[[CycleReport], None]] = []
        #: Redis failures seen so far (one per failed step of a cycle).
        self.redis_errors = 0
        #: Times this process found Redis' state gone (see the module docstring), and
        #: when it last did (epoch s, or None).
        self.state_losses = 0
        self.state_lost_at: float | None = None
        #: The state marker's value as last read (None: not read yet).
        self._marker_value: str | None = None
        self._restore_refused: str | None = None  # why the last loss was not written back
        #: The copy of the state last read, written back after a loss
        #: (controlplane.routing.statecopy), and how often something was written back.
        self.keeper = statecopy.StateKeeper(r)
        self.state_restores = 0
        #: Whether Redis keeps its data across a restart, as checked once it first
        #: answered (None: not yet; controlplane.redisdb.persistence).
        self.persistence: Persistence | None = None
        #: When the stack's addresses are published next (monotonic s; ownaddrs).
        self._addresses_due = 0.0
        #: The key generation last reported as held by the copy, and when the report is
        #: due again (monotonic s; controlplane.routing.keycopies).
        self._copy_reported: int | None = None
        self._copy_report_due = 0.0
        #: True while Redis holds no API keys after losing its state (see _check_apikeys).
        self.apikeys_missing = False
        from controlplane.cache.verify import OnlineVerifier

        #: Online verification of semantic cache hits (leader only, :meth:`run_verify`).
        self.verifier = OnlineVerifier(settings, r, self.verify_nodes)
        #: The sweep of the cache's index sets (leader only, :meth:`run_sweep`).
        self.sweeper = IndexSweeper(r)
        if cp.leader_ttl_s < 2 * cp.poll_interval_s:
            log.warning("controlplane.leader_ttl_s (%g s) is under twice poll_interval_s "
                        "(%g s): the leader lock may expire between renewals",
                        cp.leader_ttl_s, cp.poll_interval_s)

    # -- Redis bookkeeping ---------------------------------------------------------

    def _tries_broken(self, now: float) -> bool:
        """Whether this process went longer than :data:`statecopy.COPY_FRESH_S` and a
        cycle (its interval, Redis' timeouts twice with their retry, a node's) without
        trying Redis since its last failed call (it was frozen or stalled: Redis may
        have answered the others meanwhile)."""
        cp = self.settings.controlplane
        cycle = (cp.poll_interval_s + 4 * self.settings.redis.socket_timeout_s
                 + cp.poll_timeout_s + cp.models_timeout_s)
        return now - self._redis_failed_at > statecopy.COPY_FRESH_S + cycle

    def _redis_failed(self, exc: Exception) -> None:
        self.redis_errors += 1
        now = time.time()
        if self.redis_ok is False and self._tries_broken(now):
            self.redis_unreachable_since = None   # not tried throughout: no longer known
        self._redis_failed_at = now
        if self.redis_ok is not False:
            self.redis_unreachable_since = now
            # an error reply (out of memory with noeviction, a read-only replica) is
            # Redis answering and refusing, not Redis away
            what = ("redis refuses the control plane's commands"
                    if isinstance(exc, redis.ResponseError) else "redis unreachable")
            log.warning("%s (%s: %s); polling continues on the last known "
                        "%d nodes, writes resume when it answers",
                        what, type(exc).__name__, exc, len(self.nodes))
        self.redis_ok = False

    def _redis_answered(self) -> None:
        if self.redis_ok is False:
            log.info("redis reachable again")
        self.redis_ok = True
        self.redis_unreachable_since = None

    def _read_registry(self) -> bool:
        """Refresh nodes, states and edge stats from Redis (and the copy of the state,
        :mod:`controlplane.routing.statecopy`); after a loss, write the copy back first.
        False if Redis failed."""
        added = 0
        try:
            if not self._migrated:  # before any read: the registry may be under old names
                migrate_key_names(self.r)
                self._migrated = True
            lost = self._check_state_marker()
            if lost:
                self._copy_reported = None   # the reports went with the rest: report again
            restored = self._restore_after_loss() if lost else None
            if not self._seeded or lost or (self.redis_ok is False and not self.r.exists(keynames.NODES)):
                added = registry.seed_nodes(self.r, self.settings.nodes)
                if not self._seeded:  # at start: the file's settings the registry overrides
                    for line in registry.file_drift(self.settings.nodes,
                                                    registry.list_nodes(self.r)):
                        log.warning("%s", line)
                self._seeded = True
            if lost:
                self._record_state_lost(restored)  # after the re-seed the event announces
            read = self.keeper.read()
            if read.revoked_again:
                log.error("REDIS STATE WENT BACK: API key(s) %s, revoked when last read, were "
                          "active again in %s (an older snapshot or replica?); revoked again",
                          ", ".join(read.revoked_again), redact(self.settings.redis.url))
                self._pending.append(("keys_revoked_again", "",
                                      {"ids": read.revoked_again}))
            if read.went_back:
                self._put_back(read)
                read = self.keeper.read()
            if read.lost:  # a group gone while the state marker stayed (a shard, an eviction)
                log.error("REDIS STATE LOST in part: %s gone from %s while its state marker "
                          "stayed", " and ".join(sorted(read.lost)),
                          redact(self.settings.redis.url))
                self._restore(read.lost)
                read = self.keeper.read()
            self._report_copy()
            nodes = registry.parse_nodes(read.nodes)
            states = registry.parse_states(read.states)
            edges = self.r.hgetall(keynames.EDGES)
            self._check_apikeys(edges)
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return False
        self._redis_answered()
        if added:
            log.info("registry: seeded %d node(s) from the configuration", added)
        before, after = {n.name for n in self.nodes}, {n.name for n in nodes}
        if before != after:
            log.info("nodes: %s", " ".join([f"+{n}" for n in sorted(after - before)]
                                           + [f"-{n}" for n in sorted(before - after)]))
            if self._registry_read:  # added at run time: slow start (not at process start)
                now = time.time()
                for name in after - before:
                    self.ramps[name] = now
        self._registry_read = True
        self.nodes, self.states, self.edges = nodes, states, edges
        if self.persistence is None:
            self._check_persistence()
        self._publish_addresses()
        return True

    def _report_copy(self) -> None:
        """Report the key generation this control plane's copy holds
        (:mod:`controlplane.routing.keycopies`): when it moved, and every
        :data:`keycopies.REPORT_EVERY_S`. Raises ``redis.RedisError``."""
        c = self.keeper.copy
        if c is None or not c.apikeys_at:
            return
        now = time.monotonic()
        if c.apikeys_gen == self._copy_reported and now < self._copy_report_due:
            return
        keycopies.report(self.r, self.id, c.apikeys_gen, self.settings.controlplane.poll_interval_s)
        self._copy_reported, self._copy_report_due = c.apikeys_gen, now + keycopies.REPORT_EVERY_S

    def _publish_addresses(self) -> None:
        """Every :data:`ownaddrs.PUBLISH_EVERY_S`: publish the stack's addresses of this
        control plane's settings (:mod:`controlplane.routing.ownaddrs`), so that no
        writer of the registry takes one for a node. A Redis error waits for the next
        cycle."""
        now = time.monotonic()
        if now < self._addresses_due:
            return
        try:
            ownaddrs.publish(self.r, self.id, ownaddrs.of_settings(self.settings))
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return
        self._addresses_due = now + ownaddrs.PUBLISH_EVERY_S

    def _check_persistence(self) -> None:
        """Once, at the first cycle that reaches Redis: whether Redis keeps its data
        across a restart (:mod:`controlplane.redisdb.persistence`), one WARNING line when
        it does not or cannot be checked. Sets :attr:`persistence`."""
        try:
            self.persistence = check_persistence(self.r)
        except redis.RedisError:
            return   # asked again at the next cycle
        line = self.persistence.warning(self.settings.redis.url)
        if line:
            log.warning("%s", line)

    def _check_state_marker(self) -> bool:
        """True when Redis came back without its state (see the module docstring): this
        process created the state marker after it had seen one, or finds another value
        than the one it saw (another control plane created it anew). Raises
        ``redis.RedisError``."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keynames.STATE_MARKER,
                 json.dumps({"created": round(now, 3), "by": self.id}), nx=True)
        pipe.get(keynames.STATE_MARKER)
        _created, value = pipe.execute()
        seen, self._marker_value = self._marker_value, value
        if seen is None or value == seen:
            return False
        self.state_losses += 1
        self.state_lost_at = now
        copy = self.keeper.copy
        log.error("REDIS STATE LOST: %s came back without %s (restarted without its "
                  "append-only file, flushed or replaced). %s Run Redis with "
                  "appendonly yes and maxmemory-policy volatile-lru (docs/operations.md).",
                  redact(self.settings.redis.url), keynames.STATE_MARKER,
                  "Writing back the API keys, nodes, weights and drain states this control "
                  "plane last read." if copy is not None else
                  "This control plane has no copy of the state (it never read it): "
                  "re-seeding the nodes of the configuration; restore API keys with "
                  "`infergate keys import`.")
        return True

    def _restore_after_loss(self) -> statecopy.Restored | None:
        """After a loss of the whole state: write the copy back when this control plane
        may (:meth:`statecopy.StateKeeper.claim`: one restore per loss, from a fresh
        copy), else log why not. Raises ``redis.RedisError``."""
        created = None
        try:
            created = float(json.loads(self._marker_value or "")["created"])
        except (ValueError, TypeError, KeyError):
            pass
        since = self.redis_unreachable_since if self.redis_ok is False else None
        now = time.time()
        if since is not None and (self._tries_broken(now) or (
                created is not None and now - created
                > statecopy.COPY_FRESH_S + self.settings.controlplane.poll_interval_s)):
            # this process stopped trying Redis (frozen) since its last failed call, or
            # Redis answered the control plane that made the marker long before it
            # answered this one (not down, this one alone was cut off from it): the
            # others may have changed the state meanwhile
            since = None
        why = self.keeper.claim(self._marker_value, created, since)
        self._restore_refused = why
        if why is not None:
            if self.keeper.copy is not None:
                log.error("REDIS STATE LOST: not writing this control plane's copy back: %s",
                          why)
            # the copy is not written back later either (its generations read as gone
            # back, its key store's marker as lost): the next read copies Redis anew,
            # revoking again the keys the copy holds revoked
            self.keeper.drop()
            return None
        return self._restore(statecopy.GROUPS)

    def _restore(self, groups: Iterable[str]) -> statecopy.Restored:
        """Write the copy back for ``groups`` (:meth:`statecopy.StateKeeper.restore`);
        log it at ERROR and queue a ``state_restored`` event when something was written.
        Raises ``redis.RedisError``."""
        restored = self.keeper.restore(groups)
        if restored.any():
            self.state_restores += 1
            log.error("REDIS STATE RESTORED: wrote back %s, from this control plane's copy; "
                      "changes made in Redis after those reads are not in it",
                      restored.describe())
            self._pending.append(("state_restored", "", restored.to_dict()))
        return restored

    def _put_back(self, read: statecopy.Read) -> None:
        """Redis went back (:attr:`statecopy.Read.went_back`): put each group back as the
        copy holds it (:meth:`statecopy.StateKeeper.put_back`, once per claim), log it at
        ERROR and queue a ``state_went_back`` event ``PutBack.to_dict()``. Raises
        ``redis.RedisError``."""
        for group, gen in sorted(read.went_back.items()):
            if not self.keeper.claim_back(group, gen):
                log.warning("redis state went back (%s at generation %d): another control "
                            "plane is writing its copy back", group, gen)
                continue
            done = self.keeper.put_back(group, gen, read)
            self.state_restores += 1
            log.error("REDIS STATE WENT BACK: %s holds an older %s than this control plane "
                      "last read (an older snapshot or a lagging replica?); wrote its copy "
                      "back: %s", redact(self.settings.redis.url), group, done.describe())
            self._pending.append(("state_went_back", "", done.to_dict()))

    def _check_apikeys(self, edges: dict[str, str]) -> None:
        """Set :attr:`apikeys_missing` (the key store's marker is missing after this
        process saw Redis lose its state, or while an edge reports it keeps known keys);
        log and record each change as an event. Raises ``redis.RedisError``."""
        from controlplane.admin import apikeys

        st = apikeys.store_status(self.r, edges=edges)
        if (st["store_missing"] and self.r.exists(keynames.APIKEYS) and self.state_losses == 0
                and not st["edges_keeping"]):
            apikeys.mark_written(self.r)  # keys written before the marker existed
            st["store_missing"] = False
        missing = st["store_missing"] and (self.state_losses > 0 or bool(st["edges_keeping"]))
        if missing == self.apikeys_missing:
            return
        self.apikeys_missing = missing
        if missing:
            log.error("API KEYS MISSING: Redis holds no API keys (%s absent); the edges keep "
                      "honouring the valid keys they knew (edges: %s), revoked and unknown "
                      "keys are refused; restore them with `infergate keys import`",
                      keynames.APIKEYS_MARKER, ", ".join(st["edges_keeping"]) or "none yet")
        else:
            log.info("API keys restored: the edges check keys against Redis again")
        self._pending.append(("apikeys_missing" if missing else "apikeys_restored", "",
                              {"edges_keeping": st["edges_keeping"]}))

    def _record_state_lost(self, restored: statecopy.Restored | None) -> None:
        """The ``state_lost`` event (written once the copy is written back and the nodes
        are seeded again): ``{"message", "by": this control plane's id, "restored":
        Restored.to_dict() | None}``."""
        if restored is not None and restored.any():
            message = ("Redis came back without its state; the API keys, nodes, weights and "
                       "drain states this control plane last read were written back "
                       "(state_restored event)")
        elif self._restore_refused == statecopy.CLAIMED_BY_ANOTHER:
            message = ("Redis came back without its state; another control plane wrote its "
                       "copy back (its state_lost and state_restored events)")
        else:
            message = ("Redis came back without its state; nodes re-seeded from the "
                       "configuration, API keys must be restored (infergate keys import); "
                       "until then the edges keep the valid keys they knew")
        try:
            registry.add_event(self.r, "state_lost", "", actor=ACTOR,
                               detail={"message": message, "by": self.id,
                                       "restored": restored.to_dict() if restored else None},
                               maxlen=self.settings.controlplane.events_max)
        except redis.RedisError as exc:
            log.warning("state_lost event not written: %s", exc)

    def _leader_tick(self) -> bool:
        was = self.elector.is_leader
        try:
            is_leader, gained = self.elector.tick()
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return False
        if gained:
            log.info("leadership acquired (id %s)", self.id)
            self._pending.append(("leader", "", {"id": self.id}))
            self._seed_slots()
        elif was and not is_leader:
            try:
                holder = self.elector.holder()
            except redis.RedisError:
                holder = None
            log.warning("leadership lost (now held by %s)", holder or "nobody")
        return True

    def _seed_slots(self) -> None:
        """The llama.cpp slots of the routing snapshot this leader takes over, for the
        nodes whose ``/props`` it has not read yet (:meth:`PropsPoller.seed`): its first
        snapshots keep the edges' hard limit while its own reads are under way."""
        try:
            raw = self.r.get(keynames.ROUTING)
        except redis.RedisError as exc:
            log.debug("previous routing snapshot not read: %s", exc)
            return
        prev = RoutingSnapshot.parse(raw)
        if prev is None:
            return
        for n in self.nodes:
            old = prev.node(n.name)
            if old is not None and old.url == n.url and old.slots_source == "server" \
                    and old.slots:
                self.props.seed(n, old.slots, old.ctx_tokens)

    # -- the cycle -------------------------------------------------------------------

    def _tracker(self, node: NodeSettings) -> NodeTracker:
        t = self.trackers.get(node.name)
        if t is None or not t.same_target(node):
            t = NodeTracker(node, self.settings)
            self.trackers[node.name] = t
        else:
            t.node = node  # weight / max_concurrency edits apply at once
        return t

    def run_cycle(self) -> CycleReport:
        """One poll cycle (steps in the module docstring). Never raises for Redis or
        node failures; returns what it did."""
        with self._lock:
            t0 = time.monotonic()
            redis_ok = self._read_registry()
            nodes = list(self.nodes)
            self._read_keys(nodes)
            for n in nodes:  # start due /v1/models reads now: most land during the poll
                self.models.served(n)
                self.props.observe(n)
            results = self.poller.poll_all(nodes)
            # The lease is renewed after polling, right before the writes it guards.
            if redis_ok:
                redis_ok = self._leader_tick()
            now = time.time()
            report = CycleReport(ts=now, leader=self.elector.is_leader, redis_ok=redis_ok)
            names = {n.name for n in nodes}
            for name in set(self.trackers) - names:
                del self.trackers[name]
            self.models.forget(names)
            self.props.forget(names)
            report.models = {n.name: self.models.served(n) for n in nodes}
            report.models_any = {n.name for n in nodes if self.models.takes_any_model(n)}
            slow_s = self.settings.controlplane.slow_start_s
            self.ramps = {k: v for k, v in self.ramps.items()
                          if k in names and now - v < slow_s}
            # a node the edges have requests on is busy, not down, when its health is slow;
            # an openai node whose breaker is open at every edge is down (passive health)
            fresh_s = EDGE_FRESH_FACTOR * self.settings.edge.stale_after_s
            inflight = fresh_inflight(self.edges, now, fresh_s)
            tripped = breakers_open(self.edges, now, fresh_s)
            stalled = stalled_nodes(self.edges, now, fresh_s)  # busy needs progress
            for n in nodes:
                result = models_refusal(results[n.name], self.models.error(n.name))
                tracker = self._tracker(n)
                status, changed = tracker.update(result, now, inflight.get(n.name, 0.0),
                                                 n.name in tripped, stalled.get(n.name))
                self.props.annotate(n, status)
                report.statuses[n.name] = status
                if changed:
                    self._health_changed(status)
                    report.health_changes.append((n.name, status.healthy))
                    if status.healthy:  # back from unhealthy: slow start
                        self.ramps[n.name] = now
                restarted = tracker.restarted   # its counters began again since the last
                if restarted:
                    log.info("node %s restarted (its metrics' counters began again): "
                             "reading its slots and models again", n.name)
                if (changed and status.healthy) or restarted:
                    # a restarted server may have other slots (llama-server's --parallel)
                    # or models
                    self.props.reread(n, REREAD_WAIT_S)
                    self.models.refresh(n.name)
            if redis_ok:  # breaker openings/closings the edges reported since the last cycle
                self.breakers, changes = breaker_changes(self.breakers, fresh_edge_reports(
                    self.edges, now, edge_fresh_s(self.settings.edge.stale_after_s)))
                for node, detail in changes:
                    log.info("breaker %s for node %s at edge %s", detail["state"], node,
                             detail["edge"])
                    self._pending.append(("breaker", node, detail))
            if not self.elector.is_leader:
                self._pending.clear()
                self.series.reset()
            elif redis_ok:
                self._write(report, nodes, now)
                if report.wrote:
                    self._record_series(now)
            report.duration_ms = (time.monotonic() - t0) * 1000
            self.last_report = report
            for listener in self.cycle_listeners:
                try:
                    listener(report)
                except Exception:  # noqa: BLE001 - a listener never stops the loop
                    log.exception("cycle listener failed")
            return report

    def _tracked(self, nodes: list[NodeSettings], attr: str) -> dict[str, float]:
        """Per node, a time its tracker holds (``restarted_after``, ``back_at``: epoch
        s), for the nodes that have one."""
        out: dict[str, float] = {}
        for n in nodes:
            t = self.trackers.get(n.name)
            v = getattr(t, attr) if t else None
            if v:
                out[n.name] = v
        return out

    def _read_keys(self, nodes: list[NodeSettings]) -> None:
        """Read every node's API key (env or file) into :attr:`access`; a key that cannot
        be read is logged when that changes (never the key itself)."""
        errors = self.access.update(nodes)
        for name, err in sorted(errors.items()):
            if err != self._key_errors.get(name):
                if err:
                    log.warning("node %s: API key not read: %s (polled without it)", name, err)
                elif self._key_errors.get(name):
                    log.info("node %s: API key read again", name)
        self._key_errors = errors

    def _record_series(self, now: float) -> None:
        """Leader: the overview point of this interval from the edge stats read at the
        start of the cycle (at most one per ``series.STEP_S``)."""
        try:
            self.series.maybe_record(self.r, self.edges, now)
        except redis.RedisError as exc:
            self._redis_failed(exc)

    def _health_changed(self, st: NodeStatus) -> None:
        cp = self.settings.controlplane
        if st.healthy:
            log.info("node %s healthy again after %d good polls", st.name, cp.healthy_after)
            detail: dict = {"healthy": True}
        else:
            log.warning("node %s unhealthy after %d failed polls: %s", st.name,
                        cp.unhealthy_after, st.last_error or "?")
            detail = {"healthy": False, "error": st.last_error}
        self._pending.append(("health", st.name, detail))

    def _write(self, report: CycleReport, nodes: list[NodeSettings], now: float) -> None:
        """Leader writes: drained transitions, metrics, history, version, snapshot, events."""
        cp, edge = self.settings.controlplane, self.settings.edge
        inflight = fresh_inflight(self.edges, now, edge_fresh_s(edge.stale_after_s))
        running = {name: st.running for name, st in report.statuses.items()}
        decisions = drain_decisions(
            {n.name: self.states[n.name] for n in nodes if n.name in self.states},
            running, inflight, now, drain_timeout_s=cp.drain_timeout_s,
            grace_s=DRAIN_GRACE_SYNCS * edge.sync_interval_s)
        drained_json = json.dumps(asdict(NodeState("drained", now, ACTOR)))
        ttl_ms = max(int(cp.metrics_ttl_s * 1000), 1)
        history_ttl_s = max(3600, int(2 * cp.history_points * cp.poll_interval_s))
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.incr(keynames.ROUTING_VERSION)
            gone = stale_edges(self.edges, now, EDGE_FORGET_S)
            if gone:  # edges that stopped long ago (restarted containers get new ids)
                pipe.hdel(keynames.EDGES, *gone)
            for d in decisions:
                # EVAL by name: redis-py's cluster pipeline has no .eval
                pipe.execute_command("EVAL", DRAINED_LUA, 3, keynames.NODE_STATES,
                                     keynames.NODES_GEN, keynames.NODES_GEN_LOG, d.name,
                                     repr(d.since), drained_json, secrets.token_hex(6),
                                     genlog.LEN)
            for st in report.statuses.values():
                pipe.set(keynames.node_metrics(st.name), json.dumps(st.metrics_doc()), px=ttl_ms)
                pipe.lpush(keynames.node_history(st.name), json.dumps(st.history_point()))
                pipe.ltrim(keynames.node_history(st.name), 0, max(cp.history_points, 1) - 1)
                # cache kind: evictable, gone an hour (or two history spans) after the node
                pipe.expire(keynames.node_history(st.name), history_ttl_s)
            events = list(self._pending)
            for kind, node, detail in events:
                registry.add_event(pipe, kind, node, actor=ACTOR, detail=detail,
                                   maxlen=cp.events_max)
            res = pipe.execute(raise_on_error=False)
            if gone:
                res.pop(1)
            self._pending.clear()
            errors = [x for x in res if isinstance(x, Exception)]
            if errors:
                log.error("redis refused %d write(s), first: %s", len(errors), errors[0])
            version = res[0] if isinstance(res[0], int) else int(time.time() * 1000)
            states = dict(self.states)
            for i, d in enumerate(decisions):
                if res[1 + i] == 1:
                    states[d.name] = NodeState("drained", now, ACTOR)
                    report.drained.append(d.name)
                    log.info("node %s drained (%s)", d.name, d.reason)
            self.states = states
            hosts = {n.name: self.resolver.resolve_url(n.url, now) for n in nodes}
            snap = build_snapshot(
                version=version, now=now, leader=self.id, nodes=self.props.effective(nodes),
                states=states,
                statuses={k: v.metrics() for k, v in report.statuses.items()},
                hosts=hosts, slow_start_s=cp.slow_start_s, models=report.models,
                models_any=report.models_any,
                ramps=self.ramps, auths={n.name: self.access.for_url(n.url).auth for n in nodes},
                slots=self.props.slots(nodes), contexts=self.props.contexts(nodes),
                restarts=self._tracked(nodes, "restarted_after"),
                backs=self._tracked(nodes, "back_at"))
            pipe = self.r.pipeline(transaction=False)
            pipe.execute_command("EVAL", SNAPSHOT_IF_LEADER_LUA, 3, keynames.LEADER,
                                 keynames.ROUTING, keynames.LEADER_FENCE, self.id,
                                 snap.to_json(), self.elector.fence)
            for d in decisions:
                if d.name in report.drained:
                    registry.add_event(pipe, "drained", d.name, actor=ACTOR,
                                       detail={"reason": d.reason}, maxlen=cp.events_max)
            written = pipe.execute()[0]
        except redis.RedisError as exc:
            self._redis_failed(exc)
            report.redis_ok = False
            return
        if written != 1:
            log.warning("leadership lost during the cycle: snapshot %s not written", version)
            return
        self.last_snapshot = snap
        report.wrote = True
        report.version = version

    # -- online cache verification ----------------------------------------------------

    def verify_nodes(self) -> list[tuple[NodeSettings, list[str] | None, bool, bool]]:
        """Every node with its served models (None = unknown), whether it takes any model,
        and whether a verification may use it: healthy at the last cycle and ``active``
        (the others' lists still say which names some node serves)."""
        rep = self.last_report
        if rep is None:
            return []
        out: list[tuple[NodeSettings, list[str] | None, bool, bool]] = []
        for n in self.nodes:
            st = rep.statuses.get(n.name)
            state = self.states.get(n.name)
            usable = not (st is None or not st.healthy
                          or (state is not None and state.state != "active"))
            out.append((n, rep.models.get(n.name), n.name in rep.models_any, usable))
        return out

    def run_verify(self) -> list:
        """Leader only: one run of the online verification
        (:meth:`controlplane.cache.verify.OnlineVerifier.run_once`); returns its outcomes
        (empty on a follower or when Redis fails)."""
        if not self.elector.is_leader:
            return []
        try:
            return self.verifier.run_once(budget_s=VERIFY_BUDGET_S)
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return []

    def run_sweep(self) -> SweepReport | None:
        """Leader only: one run of the index sets' sweep
        (:meth:`controlplane.cache.sweep.IndexSweeper.run_once`); returns its report (None
        on a follower or when Redis fails)."""
        if not self.elector.is_leader:
            return None
        try:
            rep = self.sweeper.run_once()
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return None
        if rep.removed or rep.legacy_samples:
            log.info("cache index sweep: %d of %d members checked had no entry (removed)%s",
                     rep.removed, rep.checked,
                     f"; {rep.legacy_samples} old sample field(s) deleted"
                     if rep.legacy_samples else "")
        return rep

    def _sweep_job(self) -> None:
        self._guarded("sweep", self.run_sweep, "cache index sweep")

    def _guarded(self, name: str, fn: Callable[[], object], what: str) -> None:
        """Run a scheduled job's work; an exception is logged once per distinct message
        (kept in ``self._job_errors[name]``) and the job runs again at its next time."""
        try:
            fn()
            self._job_errors[name] = None
        except Exception as exc:  # noqa: BLE001 - a scheduled job must survive anything
            msg = f"{type(exc).__name__}: {exc}"
            if msg != self._job_errors.get(name):
                log.exception("%s failed: %s", what, msg)
            self._job_errors[name] = msg

    def _verify_job(self) -> None:
        self._guarded("verify", self.run_verify, "cache verification")

    # -- scheduling ------------------------------------------------------------------

    def _job(self) -> None:
        self._guarded("poll", self.run_cycle, "poll cycle")

    def start(self) -> None:
        """Run :meth:`run_cycle` now and then every ``poll_interval_s`` in the background."""
        from apscheduler.schedulers.background import BackgroundScheduler

        logging.getLogger("apscheduler").setLevel(logging.ERROR)
        sched = BackgroundScheduler(daemon=True, timezone=timezone.utc)
        interval = self.settings.controlplane.poll_interval_s
        sched.add_job(self._job, "interval", seconds=interval, id="poll", max_instances=1,
                      coalesce=True, misfire_grace_time=max(int(interval * 2), 1),
                      next_run_time=datetime.now(timezone.utc))
        sched.add_job(self._verify_job, "interval", seconds=VERIFY_INTERVAL_S, id="verify",
                      max_instances=1, coalesce=True, misfire_grace_time=5)
        sched.add_job(self._sweep_job, "interval", seconds=SWEEP_INTERVAL_S, id="sweep",
                      max_instances=1, coalesce=True, misfire_grace_time=30)
        sched.start()
        self._scheduler = sched

    def shutdown(self) -> None:
        """Stop the scheduler (waiting for a running cycle), release the leader lock if
        it is still ours, stop the poll threads. Safe to call twice."""
        if self._scheduler is not None:
            try:
                self._scheduler.shutdown(wait=True)
            except Exception:  # noqa: BLE001 - already stopped
                pass
            self._scheduler = None
        with self._lock:
            try:
                if self.elector.release():
                    log.info("leadership released")
                if self._addresses_due:
                    ownaddrs.withdraw(self.r, self.id)
                if self._copy_reported is not None:
                    keycopies.withdraw(self.r, self.id)
            except redis.RedisError:
                pass
            self.poller.close()
            self.models.close()
            self.props.close()


# -- command line ----------------------------------------------------------------------


def make_client(url: str, timeout_s: float,
                redis_settings: RedisSettings | None = None) -> redis.Redis:
    """Redis client for the control plane: short timeouts and a single immediate retry,
    so a cycle with Redis down costs milliseconds, not seconds of backoff. ``url`` may be
    any form of :mod:`controlplane.redisdb.url` (TLS and Sentinel options from
    ``redis_settings``)."""
    return make_redis(redis_settings or RedisSettings(url=url), url=url,
                      socket_timeout_s=timeout_s, retry=Retry(NoBackoff(), 1))


@click.command("controlplane")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file [default: built-in defaults].")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Admin page and API address [default: controlplane.listen].")
@click.option("--redis-url", default=None, help="Redis URL [default: redis.url].")
def controlplane_cmd(config_path: str | None, listen: str | None, redis_url: str | None) -> None:
    """Poll the nodes, score them, write the routing snapshot (when leader) and serve
    the admin page and API."""
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if listen:
        settings.controlplane.listen = listen
    if redis_url:
        settings.redis.url = redis_url
    host, port = split_listen(settings.controlplane.listen)

    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import waitress

    from controlplane.admin import create_app

    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    from controlplane.routing.exporter import ControlPlaneMetrics

    from controlplane.logthrottle import throttle

    throttle("waitress.queue")   # one "Task queue depth" line per 30 s under a flood
    r = make_client(settings.redis.url, settings.redis.socket_timeout_s, settings.redis)
    cp = ControlPlane(settings, r)
    # GET /metrics: Prometheus text format (controlplane/routing/exporter.py), no login
    app = DispatcherMiddleware(create_app(settings, r),
                               {"/metrics": ControlPlaneMetrics(cp).wsgi_app()})
    try:
        # connection_limit / channel_timeout: waitress's defaults (100 connections, idle
        # ones kept 120 s) let ~100 idle connections, with no request on them, lock
        # everyone out of the admin API, `up`'s health checks included
        _raise_fd_limit()
        # asyncore_use_poll: waitress's select() loop fails ("filedescriptor out of range
        # in select()") once a descriptor passes 1023, which a flood of connections reaches
        server = waitress.create_server(app, host=host, port=port, threads=8, ident="infergate",
                                        asyncore_use_poll=True,
                                        connection_limit=ADMIN_CONNECTION_LIMIT,
                                        channel_timeout=ADMIN_IDLE_TIMEOUT_S,
                                        cleanup_interval=ADMIN_CLEANUP_S)
    except OSError as exc:
        hint = (" (another process has it? choose the address with controlplane.listen, or "
                "--listen; `infergate up` takes --admin-listen)") \
            if exc.errno == errno.EADDRINUSE else ""
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None

    def stop(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.info("signal %s: stopping", signal.Signals(signum).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("control plane %s: %d configured node(s), poll every %g s, redis %s, "
             "admin on http://%s:%d/", cp.id, len(settings.nodes),
             settings.controlplane.poll_interval_s,
             parse_redis_url(settings.redis.url).describe(), host, port)
    try:
        cp.start()
        server.run()
    except SystemExit:
        pass
    finally:
        try:
            server.close()
        except Exception:  # noqa: BLE001
            pass
        cp.shutdown()
        log.info("stopped")
