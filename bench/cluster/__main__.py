"""``python -m bench.cluster [--duration S] [--rounds R] [--rate N] [--parity-duration S] [--parts P] [--out DIR]``

infergate on a 3-master, 3-replica loopback Redis Cluster
(:mod:`controlplane.redisdb.localcluster`, ``cluster-node-timeout`` 1 s) against one
redis-server, same machine, same run:

- Overhead rows (``wrk --latency``, -c16, one nginx worker each, the static upstream of
  :mod:`bench.edge_overhead`): ``keys_ratelimit`` (API keys required, a per-key and a
  global rate limit that never refuse: the token-bucket script -- on the cluster one call
  per slot group -- runs on every request) and ``exact_hit`` (one prompt answered from
  the exact cache), on ``single`` Redis and on the ``cluster``. ``--rounds`` interleaved
  rounds: in each, every row runs on both back ends back to back (order alternating
  round by round); ``ratio`` = the median over the rounds of cluster req/s over single
  req/s, with its min and max, and the 1-minute load average after each round.
- ``reshard``: ``redis-cli --cluster reshard`` moves half the slots (8192, from two
  masters to the third) while a steady load of ``--rate`` requests/s (valid keys, a mix
  of exact hits and misses) goes through the cluster's edge; then every state key
  written before (API keys, registry, drain states) and every cache entry without
  expiry soon is read back. Figures: failed requests, 401s, lost keys, duration.
- ``master_kill``: the master of the routing/API-key slots SIGKILLed under the same
  load while two control planes (in-process, one thread each, leader TTL 2 s) cycle
  every 0.2 s. Figures:
  failed requests, 401s, and the phases in seconds after the kill
  (:mod:`bench.cluster.phases`): the other nodes flag it PFAIL, then FAIL, its replica
  answers ``ROLE`` as master, every live node reports ``cluster_state:ok``, and the
  first routing snapshot written after the kill (its ``generated_at``: leader takeover);
  the leaders that wrote snapshots afterwards, and the fencing counter.
- ``skew``: keys per master (DBSIZE) before the reshard (slots split evenly, 5000 cache
  entries and the state written), max over mean.
- ``semantic``: an embedder and a semantic-cache edge on the cluster; paraphrases of a
  stored prompt answered from the semantic cache.
- ``parity`` (:mod:`bench.cluster.parity`): per back end two ``infergate controlplane``
  processes and two fair-share edges in front of a simulated pool: served tokens per
  tenant and the shared virtual token counters of a saturated run with two tenants of
  unequal rates, and how many requests a per-minute key lets through both edges.

Writes ``redis_cluster.json`` (the commit and load average). The machine is shared: the
figures of one run compare the two back ends, not machines.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import click
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import Settings, settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.localcluster import LocalCluster, start_local_cluster
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane

from ..common import RESULTS_DIR, Stack, format_table, log, machine_info, sigterm_as_interrupt, write_json
from ..edge_overhead import wrk
from . import parity, phases
from ..edge_overhead.__main__ import STATIC_ANSWER, UPSTREAM_CONF, body
from ..edge_overhead.__main__ import FILTER_ANSWER, LENGTH_ANSWER

PROMPT = "What is the capital of France?"
PARTS = ("overhead", "reshard", "kill", "semantic", "parity")
COLUMNS = [("row", "row"), ("single_rps", "single req/s"), ("cluster_rps", "cluster req/s"),
           ("ratio", "ratio (median)"), ("ratio_min", "min"), ("ratio_max", "max"),
           ("single_p99_ms", "single p99 ms"),
           ("cluster_p99_ms", "cluster p99 ms")]


def _edge(stack: Stack, name: str, redis_url: str, upstream: str, **sections: dict) -> str:
    data: dict = {"redis": {"url": redis_url},
                  "edge": {"workers": 1, "redis_pool_size": 64, "metrics_listen": ""},
                  "controlplane": {"poll_interval_s": 0.5, "leader_ttl_s": 2.0},
                  "nodes": [{"name": "static", "url": upstream, "kind": "openai",
                             "max_concurrency": 100000}]}
    data.update(sections)
    s = settings_from_dict(data, "cluster benchmark")
    port = procs.free_port()
    d = stack.dir / name
    rendered = render_nginx(s, d / "conf", listen=f"127.0.0.1:{port}", prefix=d / "prefix",
                            source="cluster benchmark")
    stack.add(start_nginx(rendered.nginx_conf, rendered.prefix))
    url = f"http://127.0.0.1:{port}"

    def routes() -> bool:
        st = requests.get(f"{url}/infergate/status", timeout=2).json()
        return st["snapshot"]["source"] == "redis" and any(n["eligible"] for n in st["nodes"])

    procs.wait_until(routes, 30, what=f"edge {name} to route")
    return url


def _settings(redis_url: str, upstream: str) -> Settings:
    return settings_from_dict({"redis": {"url": redis_url},
                               "controlplane": {"leader_ttl_s": 2.0, "poll_timeout_s": 0.3},
                               "nodes": [{"name": "static", "url": upstream, "kind": "openai",
                                          "max_concurrency": 100000}]})


class Cycler:
    """Control planes cycling every ``every_s`` seconds, each in its own thread (as
    separate processes would: one waiting out a failover does not hold the other up),
    and an observer recording (time the snapshot was made, version, leader) of every
    snapshot seen."""

    def __init__(self, cps: list[ControlPlane], r, every_s: float = 0.2) -> None:  # type: ignore[no-untyped-def]
        self.cps, self.r, self.every_s = cps, r, every_s
        self.seen: list[tuple[float, int, str]] = []
        self.failed: list[tuple[float, float, str]] = []   # (started, ended, control plane)
        self._stop = threading.Event()
        self._ts = [threading.Thread(target=self._cycle, args=(cp,), daemon=True) for cp in cps]
        self._ts.append(threading.Thread(target=self._observe, daemon=True))
        for t in self._ts:
            t.start()

    def _cycle(self, cp: ControlPlane) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            try:
                cp.run_cycle()
            except Exception:  # noqa: BLE001 - a cycle during a failover may fail
                self.failed.append((t0, time.time(), cp.id))
            self._stop.wait(self.every_s)

    def _observe(self) -> None:
        while not self._stop.is_set():
            try:
                snap = json.loads(self.r.get(keynames.ROUTING))
                if not self.seen or self.seen[-1][1] != snap["version"]:
                    # when the leader made it (its clock is this one's), not when seen here
                    self.seen.append((float(snap.get("generated_at") or time.time()),
                                      snap["version"], snap["leader"]))
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(self.every_s / 4)

    def stop(self) -> None:
        self._stop.set()
        for t in self._ts:
            t.join(5)


def _load(url: str, key: str, rate: float, stop: threading.Event) -> Counter:
    """Requests at ``rate``/s (4 threads, each paced) until ``stop``; counts statuses."""
    out: Counter = Counter()
    lock = threading.Lock()

    def worker(k: int) -> None:
        s = requests.Session()
        i, period = 0, 4.0 / rate
        nxt = time.monotonic()
        while not stop.is_set():
            prompt = PROMPT if i % 2 else f"load {k} {i}"
            try:
                res = s.post(f"{url}/v1/chat/completions", data=body(prompt), timeout=10,
                             headers={"Authorization": f"Bearer {key}",
                                      "Content-Type": "application/json"})
                st = res.status_code
            except requests.RequestException as exc:
                st = f"error:{type(exc).__name__}"
            with lock:
                out[st] += 1
            i += 1
            nxt += period
            stop.wait(max(0.0, nxt - time.monotonic()))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _state(r, n: int = 50) -> dict:  # type: ignore[no-untyped-def]
    """State written before a drill (API keys, nodes, drain states, long-lived cache entries)."""
    keys = [apikeys.create_key(r, f"tenant-{i}")[0] for i in range(n)]
    for i in range(n):
        registry.put_node(r, registry.NodeSettings(name=f"reg-{i}", url=f"http://127.0.0.1:{9 + i}"))
        registry.set_state(r, f"reg-{i}", "draining" if i % 2 else "active", actor="bench")
    for i in range(n * 4):
        r.set(keynames.cache_entry(f"{i:032x}"), "{}", ex=3600)
    return {"keys": keys, "n": n}


def _lost(r, st: dict) -> int:  # type: ignore[no-untyped-def]
    n = st["n"]
    lost = sum(1 for k in st["keys"] if apikeys.lookup(r, k) is None)
    lost += sum(1 for i in range(n) if registry.get_node(r, f"reg-{i}") is None)
    states = registry.get_states(r)
    lost += sum(1 for i in range(n) if f"reg-{i}" not in states)
    lost += sum(1 for i in range(n * 4) if r.get(keynames.cache_entry(f"{i:032x}")) is None)
    for i in range(n):  # the control planes of the next drill would poll them
        registry.remove_node(r, f"reg-{i}")
    return lost


def _failed(c: Counter) -> int:
    return sum(v for k, v in c.items() if k not in (200, 429))


def reshard_drill(cluster: LocalCluster, url: str, key: str, r, rate: float) -> dict:  # type: ignore[no-untyped-def]
    st = _state(r)
    masters = cluster.masters_now()
    src = ",".join(n.node_id for n in masters[:2])
    stop = threading.Event()
    res: dict = {}
    t = threading.Thread(target=lambda: res.setdefault("c", _load(url, key, rate, stop)))
    t.start()
    t0 = time.monotonic()
    argv = ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{masters[0].port}",
            "--cluster-from", src, "--cluster-to", masters[2].node_id, "--cluster-slots", "8192",
            "--cluster-yes", "--cluster-pipeline", "100"]
    if cluster.password:
        argv[1:1] = ["--no-auth-warning", "-a", cluster.password]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    stop.set()
    t.join()
    cluster.wait_ok(10)
    c = res["c"]
    return {"slots_moved": 8192, "reshard_s": round(took, 1), "redis_cli_rc": p.returncode,
            "requests": sum(c.values()), "failed": _failed(c), "status_401": c.get(401, 0),
            "statuses": {str(k): v for k, v in c.items()}, "lost_keys": _lost(r, st)}


def kill_drill(cluster: LocalCluster, url: str, key: str, r, upstream: str,  # type: ignore[no-untyped-def]
               rate: float) -> dict:
    cps = [ControlPlane(_settings(cluster.url, upstream), make_redis(_settings(cluster.url, upstream).redis),
                        ident=f"bench-cp-{i}") for i in range(2)]
    cyc = Cycler(cps, r)
    procs.wait_until(lambda: len(cyc.seen) >= 2, 20, what="snapshots before the kill")
    stop = threading.Event()
    res: dict = {}
    t = threading.Thread(target=lambda: res.setdefault("c", _load(url, key, rate, stop)))
    t.start()
    time.sleep(2.0)  # steady load before the fault
    port = int(r.nodes_manager.get_node_from_slot(r.keyslot(keynames.ROUTING)).port)
    leader_before = cyc.seen[-1][2]
    victim = cluster.node_of_port(port)
    replica = phases.replica_of(cluster, victim)
    killed_at = time.time()
    victim.managed.signal(signal.SIGKILL)
    try:
        ph = phases.watch(cluster, victim, replica, killed_at)
    except BaseException:
        stop.set()
        cyc.stop()
        raise
    recovered = ph["recovered"]
    time.sleep(3.0)  # load and cycles go on after the recovery
    stop.set()
    t.join()
    cyc.stop()
    after = [(ts, v, who) for ts, v, who in cyc.seen if ts > killed_at]
    c = res["c"]
    for cp in cps:
        try:
            cp.elector.release()
        except Exception:  # noqa: BLE001
            pass
    return {"requests": sum(c.values()), "failed": _failed(c), "status_401": c.get(401, 0),
            "statuses": {str(k): v for k, v in c.items()},
            "recovered_s": round(recovered, 2) if recovered is not None else None,
            "snapshot_gap_s": round(after[0][0] - killed_at, 2) if after else None,
            "takeover_after_recovery_s": (round(after[0][0] - killed_at - recovered, 2)
                                          if after and recovered is not None else None),
            "leader_before": leader_before,
            "leaders_after": sorted({who for _, _, who in after}),
            "fence": int(r.get(keynames.LEADER_FENCE) or 0),
            "phases_s": ph,
            "failed_cycles": [(round(a - killed_at, 2), round(b - killed_at, 2), who)
                              for a, b, who in cyc.failed if b > killed_at]}


PARAPHRASES = ["what is the capital of france", "What is the capital of France",
               "Tell me the capital of France?"]


def semantic_check(stack: Stack, cluster: LocalCluster, upstream: str) -> dict:
    """An embedder (local index) and a semantic-cache edge on the cluster: one answer
    stored, then paraphrases looked up. Returns ``{"paraphrases", "hits", "similarities"}``."""
    eport = procs.free_port()
    emb = stack.add(procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", cluster.url,
        "--threads", "2"), stack.dir / "embedder.log").start())
    eurl = f"http://127.0.0.1:{eport}"
    emb.wait_ready(lambda: requests.get(eurl + "/healthz", timeout=1).status_code == 200, 180)
    requests.post(eurl + "/v1/lookup", json={"namespace": "0" * 64, "text": "warm up"}, timeout=60)
    url = _edge(stack, "cluster-semantic", cluster.url, upstream,
                cache={"enabled": True, "semantic": True, "embedder_url": eurl})

    def post(p: str) -> requests.Response:
        return requests.post(f"{url}/v1/chat/completions", timeout=15, json={
            "model": "static", "temperature": 0, "messages": [{"role": "user", "content": p}]})

    post(PROMPT)
    time.sleep(2.0)  # stored, queued, embedded and indexed
    sims = []
    for p in PARAPHRASES:
        res = post(p)
        if res.headers.get("X-Cache-Match") == "semantic":
            sims.append(float(res.headers.get("X-Cache-Similarity", 0)))
    return {"paraphrases": len(PARAPHRASES), "hits": len(sims), "similarities": sims}


def skew(cluster: LocalCluster) -> dict:
    sizes = []
    for n in cluster.masters_now():
        with n.client() as c:
            sizes.append(int(c.dbsize()))
    mean = statistics.mean(sizes) if sizes else 0
    return {"keys_per_master": sizes, "max_over_mean": round(max(sizes) / mean, 2) if mean else None}


def overhead(targets: dict, rounds: int, duration: float, work: Path) -> list[dict]:
    """Interleaved rounds: each round runs, per row, single then cluster back to back
    (the order alternating round by round), so that both runs of a pair see the same
    machine load; the row's ``ratio`` is the median of the rounds' cluster/single ratios,
    ``ratio_min``/``ratio_max`` their spread, and req/s and p99 the medians."""
    runs: dict[str, list[wrk.WrkResult]] = {t: [] for t in targets}
    loads: list[float] = []
    for name, (_, key, prompt) in targets.items():
        (work / f"{name}.lua").write_text(
            wrk.post_script([body(prompt)], {"Authorization": f"Bearer {key}"}))
    for i in range(rounds):
        for row in ("keys_ratelimit", "exact_hit"):
            order = ("single", "cluster") if i % 2 == 0 else ("cluster", "single")
            for back in order:
                name = f"{back}_{row}"
                url = targets[name][0]
                runs[name].append(wrk.run(f"{url}/v1/chat/completions", work / f"{name}.lua",
                                          duration_s=duration, connections=16))
        loads.append(os.getloadavg()[0])
    rows = []
    for row in ("keys_ratelimit", "exact_hit"):
        s, c = runs[f"single_{row}"], runs[f"cluster_{row}"]
        ratios = [b.rps / a.rps for a, b in zip(s, c, strict=True) if a.rps]
        rows.append({"row": row, "single_rps": round(statistics.median(x.rps for x in s)),
                     "cluster_rps": round(statistics.median(x.rps for x in c)),
                     "ratio": round(statistics.median(ratios), 3) if ratios else None,
                     "ratio_min": round(min(ratios), 3) if ratios else None,
                     "ratio_max": round(max(ratios), 3) if ratios else None,
                     "single_p99_ms": round(statistics.median(x.p99_ms for x in s), 2),
                     "cluster_p99_ms": round(statistics.median(x.p99_ms for x in c), 2),
                     "non_2xx": sum(x.non_2xx for x in (*s, *c)),
                     "round_ratios": [round(x, 3) for x in ratios],
                     "loadavg_1m_per_round": [round(x, 2) for x in loads]})
    return rows


def print_report(data: dict) -> None:
    """The tables of a result (also used by ``python -m bench.report``)."""
    if "overhead" in data:
        print(format_table(data["overhead"], COLUMNS))
        loads = data["overhead"][0].get("loadavg_1m_per_round")
        print(f"wrk -c16 -d{data['duration_s']:g}s, {data['rounds']} interleaved rounds (single "
              "and cluster back to back, order alternating), ratio = median of the rounds' "
              "cluster/single (min, max); API keys required, a per-key and a global rate limit "
              "on both rows"
              + (f"; load average (1 min) after the rounds {min(loads)}-{max(loads)}"
                 if loads else ""))
    if "reshard" in data:
        rs = data["reshard"]
        print(f"reshard: {rs['slots_moved']} slots in {rs['reshard_s']} s under {data['rate']} "
              f"req/s: {rs['requests']} requests, {rs['failed']} failed, {rs['status_401']} x 401, "
              f"{rs['lost_keys']} lost keys")
    if "master_kill" in data:
        _print_kill(data["master_kill"])
    if "parity" in data:
        pa = data["parity"]
        print()
        print(format_table(parity.rows(pa), PARITY_COLUMNS))
        print(f"two control planes and two edges per back end; fair share: tenants a and b at "
              f"{pa['rates']['a']} and {pa['rates']['b']} x the pool's capacity "
              f"({pa['capacity_rps']} req/s, 2 nodes x batch 4) for {pa['duration_s']:g} s; "
              f"rate limit: {2 * pa['rpm']} requests one at a time, key limited to "
              f"{pa['rpm']}/min")
    sem = data.get("semantic")
    if sem:
        print(f"semantic: {sem['hits']} of {sem['paraphrases']} paraphrases answered from the "
              f"semantic cache on the cluster (similarities {sem['similarities']})")
    if "skew" in data:
        sk = data["skew"]
        print(f"skew (even slot split, 5000 cache entries + the state): keys per master "
              f"{sk['keys_per_master']}, max/mean {sk['max_over_mean']}")


PARITY_COLUMNS = [("row", "row"), ("single", "single"), ("cluster", "cluster"), ("ratio", "ratio")]


def _print_kill(mk: dict) -> None:
    print(f"master kill: {mk['requests']} requests, {mk['failed']} failed, {mk['status_401']} x "
          f"401, cluster ok after {mk['recovered_s']} s, next snapshot {mk['snapshot_gap_s']} s "
          f"after the kill; leader before {mk['leader_before']}, writing after: "
          f"{', '.join(mk['leaders_after'])}; fencing counter {mk['fence']}")
    ph = mk.get("phases_s")
    if ph:
        print(f"  phases after the SIGKILL (s): PFAIL seen {ph['pfail']}, FAIL {ph['fail']}, "
              f"replica promoted {ph['promoted']}, every node ok {ph['recovered']}, "
              f"first snapshot written {mk['snapshot_gap_s']}")


@click.command()
@click.option("--duration", default=5.0, show_default=True, help="Seconds per wrk run.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--rate", default=200.0, show_default=True, help="Requests/s of the drills' load.")
@click.option("--parity-duration", default=20.0, show_default=True,
              help="Seconds of the fair-share run per back end.")
@click.option("--parts", default=",".join(PARTS), show_default=True,
              help="Comma-separated subset (the docs table needs them all).")
@click.option("--node-timeout-ms", default=1000, show_default=True,
              help="cluster-node-timeout of the loopback cluster (ms).")
@click.option("--out", "out_dir", default=str(RESULTS_DIR), show_default=True)
@click.option("--name", default="redis_cluster", show_default=True,
              help="Result file name (without .json) under --out.")
def main(duration: float, rounds: int, rate: float, parity_duration: float, parts: str,
         node_timeout_ms: int, out_dir: str, name: str) -> None:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with sigterm_as_interrupt(), Stack(prefix="infergate-bench-cluster-") as stack:
        up_port = procs.free_port()
        d = stack.dir / "upstream"
        (d / "logs").mkdir(parents=True)
        (d / "nginx.conf").write_text(UPSTREAM_CONF.format(
            prefix=d, port=up_port, answer=STATIC_ANSWER, length_answer=LENGTH_ANSWER,
            filter_answer=FILTER_ANSWER))
        stack.add(start_nginx(d / "nginx.conf", d))
        upstream = f"http://127.0.0.1:{up_port}"
        rport = procs.free_port()
        stack.add(procs.start_redis(stack.dir / "redis", rport))
        log("starting the loopback cluster")
        cluster = start_local_cluster(stack.dir / "cluster", node_timeout_ms=node_timeout_ms)
        for n in cluster.nodes:
            stack.add(n.managed)
        targets, edges = {}, {}
        for backend, url in (("single", f"redis://127.0.0.1:{rport}/0"), ("cluster", cluster.url)):
            r = make_redis(_settings(url, upstream).redis)
            cp = ControlPlane(_settings(url, upstream), r, ident=f"bench-{backend}")
            cp.run_cycle()
            cp.elector.release()
            key, _ = apikeys.create_key(r, "bench", rpm=10**6, tpm=10**9)
            lim = {"auth": {"mode": "required"}, "limits": {"global_rpm": 10**7}}
            u1 = _edge(stack, f"{backend}-admission", url, upstream, **lim)
            u2 = _edge(stack, f"{backend}-cache", url, upstream, **lim,
                       cache={"enabled": True, "semantic": False})
            requests.post(f"{u2}/v1/chat/completions", data=body(PROMPT), timeout=10,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            time.sleep(0.5)  # stored by the flush timer
            targets[f"{backend}_keys_ratelimit"] = (u1, key, "different prompts are not cached")
            targets[f"{backend}_exact_hit"] = (u2, key, PROMPT)
            edges[backend] = (u2, key, r)
        want = set(parts.split(","))
        data: dict = {"meta": {"command": "python -m bench.cluster", "started": started,
                               "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
                      "rate": rate, "duration_s": duration, "rounds": rounds,
                      "cluster_node_timeout_ms": node_timeout_ms}
        if "overhead" in want:
            log("overhead rows")
            data["overhead"] = overhead(targets, rounds, duration, stack.dir)
        u2, key, rc = edges["cluster"]
        if "reshard" in want:
            for i in range(5000):  # a spread of cache entries before the slots move
                rc.set(keynames.cache_entry(f"{i:032x}ff"), "{}", ex=600)
            data["skew"] = skew(cluster)
            log(f"reshard drill under {rate:g} req/s")
            data["reshard"] = reshard_drill(cluster, u2, key, rc, rate)
        if "kill" in want:
            log(f"master kill drill under {rate:g} req/s")
            data["master_kill"] = kill_drill(cluster, u2, key, rc, upstream, rate)
        if "semantic" in want:
            log("semantic hits on the cluster")
            data["semantic"] = semantic_check(stack, cluster, upstream)
        if "parity" in want:  # last: its control planes route to their own pool
            data["parity"] = parity.run(stack, {"single": f"redis://127.0.0.1:{rport}/0",
                                                "cluster": cluster.url}, parity_duration)
        data["meta"]["machine"] = machine_info()
    path = write_json(Path(out_dir) / f"{name}.json", data)
    print_report(data)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
