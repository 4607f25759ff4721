"""A Redis Cluster on loopback for tests, benchmarks and ``infergate up --redis-cluster``.

:func:`start_local_cluster` starts ``masters`` x (1 + ``replicas``) ``redis-server``
processes (Redis 7.0, e.g. Debian's package) on free 127.0.0.1 ports, each with
``cluster-enabled yes`` and the durability settings of the single Redis
(:func:`controlplane.procs.start_redis`: ``maxmemory-policy volatile-lru``, append-only
with ``persistent``), joins them with ``CLUSTER MEET``, spreads the 16384 slots evenly
over the masters with ``CLUSTER ADDSLOTSRANGE`` (Redis >= 7.0), makes every other
process a replica (``CLUSTER REPLICATE``), and waits, with a deadline, until every node
reports ``cluster_state:ok`` with all slots assigned and every replica is attached.

With ``persistent``, a folder that holds a cluster formed before (each node's
``nodes-<port>.conf``) is started again on the same ports, from its append-only files,
and waited for until ok: its data, slots and roles are kept (:func:`known_ports`).

No ``redis-cli --cluster create`` is needed: the commands above are what it sends
(redis ``src/redis-cli.c``, ``clusterManagerCommandCreate``), and issuing them here keeps
the ports and readiness under our control. :meth:`LocalCluster.stop` stops every
process; the caller owns the working folder.

Raises :class:`controlplane.procs.StartError` when a process cannot start or the cluster
is not ready before ``timeout`` seconds.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis

from controlplane import procs

#: Number of hash slots of Redis Cluster (``CLUSTER_SLOTS`` in redis ``src/cluster.h``).
SLOTS = 16384
#: A node's cluster bus listens on its port + this (``CLUSTER_PORT_INCR``, redis
#: ``src/cluster.h``, 7.0).
BUS_OFFSET = 10000


@dataclass
class ClusterNode:
    """One ``redis-server`` of a :class:`LocalCluster`: its process, port and node id."""

    managed: procs.Managed
    port: int
    workdir: Path
    node_id: str = ""
    password: str | None = None

    def client(self, **kw: object) -> redis.Redis:
        """A plain (non-cluster) client of this one node (str responses, 2 s timeouts)."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           password=self.password, socket_timeout=2,
                           socket_connect_timeout=2, **kw)  # type: ignore[arg-type]

    def cluster_info(self) -> dict[str, str]:
        """This node's ``CLUSTER INFO`` fields (``cluster_state``, ``cluster_slots_ok``...)."""
        with self.client() as c:
            info = c.execute_command("CLUSTER INFO")
        if isinstance(info, dict):
            return {str(k): str(v) for k, v in info.items()}
        return _parse_info(info.decode() if isinstance(info, bytes) else str(info))


@dataclass
class LocalCluster:
    """A running loopback cluster. ``nodes[:masters]`` started as masters, the rest as
    their replicas (roles change after a failover: ask :meth:`masters_now`)."""

    nodes: list[ClusterNode]
    masters: int
    extra: tuple[str, ...] = ()
    persistent: bool = False
    password: str | None = None
    stopped: bool = field(default=False)

    @property
    def url(self) -> str:
        """``redis+cluster://[:password@]127.0.0.1:p1,127.0.0.1:p2,...`` naming every node."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def client(self) -> redis.RedisCluster:
        """A redis-py cluster client (str responses) started from the first live node."""
        live = [n for n in self.nodes if n.managed.alive()] or self.nodes
        return redis.RedisCluster(host="127.0.0.1", port=live[0].port, decode_responses=True,
                                  password=self.password, socket_timeout=2,
                                  socket_connect_timeout=2)

    def masters_now(self) -> list[ClusterNode]:
        """The live nodes that are masters now (``ROLE``)."""
        out = []
        for n in self.nodes:
            if not n.managed.alive():
                continue
            try:
                with n.client() as c:
                    if c.execute_command("ROLE")[0] == "master":
                        out.append(n)
            except redis.RedisError:
                continue
        return out

    def node_of_port(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` with all slots
        assigned and ok, and agrees on the slot map. Raises ``StartError``."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            ok, last = self._all_ok()
            if ok:
                return
            time.sleep(0.05)
        raise procs.StartError(f"redis cluster not ready after {timeout:g} s: {last}")

    def _all_ok(self) -> tuple[bool, str]:
        for n in self.nodes:
            if not n.managed.alive():
                continue
            try:
                info = n.cluster_info()
            except redis.RedisError as exc:
                return False, f"port {n.port}: {exc}"
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != SLOTS:
                return False, f"port {n.port}: state {info.get('cluster_state')}, " \
                              f"slots ok {info.get('cluster_slots_ok')}"
        return True, "ok"

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a short grace)."""
        self.stopped = True
        for n in self.nodes:  # all at once: each one's shutdown then overlaps the others'
            if n.managed.alive():
                n.managed.signal(signal.SIGTERM)
        for n in self.nodes:
            n.managed.stop(grace=3.0)


def _parse_info(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def cluster_args(port: int, node_timeout_ms: int) -> list[str]:
    """``redis-server`` arguments that make one process a cluster node."""
    return ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            # a replica of a dead master takes over without waiting for data age checks
            "--cluster-replica-validity-factor", "0",
            # a shard without its master answers nothing for its slots; the others go on
            "--cluster-require-full-coverage", "no",
            "--cluster-allow-reads-when-down", "no"]


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The even split of the 16384 slots over ``masters`` (inclusive ranges)."""
    if masters < 1:
        raise ValueError("a cluster needs at least one master")
    per, rest = divmod(SLOTS, masters)
    out, start = [], 0
    for i in range(masters):
        end = start + per + (1 if i < rest else 0) - 1
        out.append((start, end))
        start = end + 1
    return out


def start_local_cluster(workdir: Path, *, masters: int = 3, replicas: int = 1,
                        persistent: bool = False, maxmemory: str = "128mb",
                        node_timeout_ms: int = 2000, timeout: float = 30.0,
                        password: str | None = None) -> LocalCluster:
    """Start, join and wait for a loopback cluster (module docstring). ``node_timeout_ms``
    is ``cluster-node-timeout``: how long a master may be unreachable before its replica
    is promoted (failover takes about 2x that). ``password``: every node requires it
    (``requirepass`` and ``masterauth`` in each node's 0600 ``redis.conf``). Processes
    started before an error are stopped again."""
    nodes: list[ClusterNode] = []
    total = masters * (1 + replicas)
    known = known_ports(workdir, total) if persistent else None
    try:
        for i in range(total):
            d = workdir / f"node{i}"
            _start_node(d, persistent, maxmemory, node_timeout_ms, nodes, password,
                        port=known[i] if known else None)
        cluster = LocalCluster(nodes, masters, persistent=persistent, password=password)
        if known:
            _resume(cluster, masters, replicas, timeout)
        else:
            _form(cluster, masters, replicas, timeout)
        return cluster
    except BaseException:
        for n in nodes:
            n.managed.stop(grace=1.0)
        raise


def known_ports(workdir: Path, total: int) -> list[int] | None:
    """The ports of a persistent cluster formed in ``workdir`` before (each node's
    ``node<i>/nodes-<port>.conf``, written by Redis), or None when there is none yet.
    A cluster restarts on the same ports: every node finds the others at the addresses
    its ``nodes-*.conf`` names. Only a configuration whose masters serve every slot
    counts (the newest, when there are several). Raises :class:`controlplane.procs.StartError` when only
    some nodes have one (the folder holds no cluster that can come back)."""
    ports: list[int | None] = []
    for i in range(total):
        formed = [c for c in (workdir / f"node{i}").glob("nodes-*.conf")
                  if c.stem.removeprefix("nodes-").isdigit() and covered_slots(c) == SLOTS]
        formed.sort(key=lambda c: c.stat().st_mtime)
        ports.append(int(formed[-1].stem.removeprefix("nodes-")) if formed else None)
    if all(p is None for p in ports):
        return None
    if any(p is None for p in ports):
        raise procs.StartError(
            f"redis cluster in {workdir}: only some of its {total} nodes have a cluster "
            "configuration (nodes-<port>.conf); move the folder away to start a new cluster")
    return [p for p in ports if p is not None]


def covered_slots(conf: Path) -> int:
    """How many slots the masters of a ``nodes.conf`` serve (a cluster that was formed:
    all 16384). Lines: ``<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch>
    <link> <slot or lo-hi>...`` (redis ``src/cluster.c``, ``clusterGenNodesDescription``);
    ``[slot->-id]`` migration marks are not counted."""
    n = 0
    try:
        text = conf.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    for line in text.splitlines():
        f = line.split()
        if len(f) < 9 or "master" not in f[2].split(","):
            continue
        for r in f[8:]:
            lo, _, hi = r.partition("-")
            if lo.isdigit() and (not hi or hi.isdigit()):
                n += int(hi or lo) - int(lo) + 1
    return n


def node_port() -> int:
    """A free port for a new node whose cluster bus port (+ BUS_OFFSET) is free too and,
    when the range allows, below the kernel's ephemeral range as well (outgoing
    connections draw from that range and could hold the bus port at a restart; see
    :func:`controlplane.procs.free_port`); else any free port with a free bus port."""
    low, _ = procs.ephemeral_range()
    fallback = None
    for _ in range(64):
        port = procs.free_port()
        bus = port + BUS_OFFSET
        if bus > 65535 or not procs.port_bindable(bus):
            continue
        if bus < low:
            return port
        fallback = fallback or port
    return fallback or procs.free_port()


def _start_node(d: Path, persistent: bool, maxmemory: str, node_timeout_ms: int,
                nodes: list[ClusterNode], password: str | None,
                port: int | None = None) -> None:
    """Start one node on ``port`` (a node coming back: that port or an error), else on a
    free port (chosen again, up to 5 times, when another process took it meanwhile)."""
    if port is not None:
        for p, what in ((port, "port"), (port + BUS_OFFSET, "cluster bus port")):
            if not procs.port_bindable(p, reuse_addr=True):   # as redis-server binds
                raise procs.StartError(
                    f"redis cluster node in {d}: its {what} {p} is in use by another "
                    "process; a cluster comes back on the ports it was formed on")
        m = procs.start_redis(d, port, extra=cluster_args(port, node_timeout_ms),
                              maxmemory=maxmemory, persistent=persistent, password=password)
        nodes.append(ClusterNode(m, port, d, password=password))
        return
    last: procs.StartError | None = None
    for _ in range(5):
        port = node_port()
        try:
            m = procs.start_redis(d, port, extra=cluster_args(port, node_timeout_ms),
                                  maxmemory=maxmemory, persistent=persistent, password=password)
        except procs.StartError as exc:
            last = exc
            continue
        nodes.append(ClusterNode(m, port, d, password=password))
        return
    assert last is not None
    raise last


def _form(cluster: LocalCluster, masters: int, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    nodes = cluster.nodes
    for n in nodes:
        with n.client() as c:
            n.node_id = c.execute_command("CLUSTER MYID")
    with nodes[0].client() as c0:
        for n in nodes[1:]:
            c0.execute_command("CLUSTER MEET", "127.0.0.1", n.port)
    for n, (lo, hi) in zip(nodes[:masters], slot_ranges(masters)):
        with n.client() as c:
            c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
    # a replica can be attached once it knows its master (gossip spreads the MEETs)
    for i, n in enumerate(nodes[masters:]):
        master = nodes[i % masters]
        _retry_until(deadline, lambda n=n, master=master: n.client().execute_command(
            "CLUSTER REPLICATE", master.node_id))
    cluster.wait_ok(max(1.0, deadline - time.monotonic()))
    _wait_replicas(cluster, masters, replicas, deadline)


def _resume(cluster: LocalCluster, masters: int, replicas: int, timeout: float) -> None:
    """A persistent cluster restarted from its files: every node knows its slots and
    peers already; wait until it is ok again and every master has its replicas (which
    node is master may have changed in a failover before the restart)."""
    deadline = time.monotonic() + timeout
    for n in cluster.nodes:
        with n.client() as c:
            n.node_id = c.execute_command("CLUSTER MYID")
    cluster.wait_ok(max(1.0, deadline - time.monotonic()))
    while time.monotonic() < deadline:
        now = cluster.masters_now()
        if len(now) == masters:
            break
        time.sleep(0.05)
    _wait_replicas(cluster, masters, replicas, deadline)


def _retry_until(deadline: float, fn) -> None:  # type: ignore[no-untyped-def]
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            fn()
            return
        except redis.RedisError as exc:
            last = exc
            time.sleep(0.05)
    raise procs.StartError(f"redis cluster: {last}")


def _wait_replicas(cluster: LocalCluster, masters: int, replicas: int, deadline: float) -> None:
    """Every master sees its replicas online (``INFO replication`` ``connected_slaves``),
    so a failover drill starts from replicas that hold the data."""
    want = replicas
    while time.monotonic() < deadline:
        counts = []
        for n in cluster.masters_now()[:masters]:
            with n.client() as c:
                counts.append(int(c.info("replication").get("connected_slaves", 0)))
        if len(counts) == masters and all(x >= want for x in counts):
            return
        time.sleep(0.05)
    raise procs.StartError("redis cluster: replicas did not attach before the deadline")
