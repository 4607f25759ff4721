"""The prefix-cache scenarios of ``python -m bench.scheduler.scenarios``: ``shared_prefix``
and ``one_prompt``, run for nginx round-robin, nginx least_conn, infergate and
``infergate_noprefix`` (infergate with ``edge.prefix_affinity = false``), each behind one
edge and behind two (two nginx for the nginx strategies, two infergate edges sharing
Redis and the control plane; turns of a session alternate between the edges).

Pool (:data:`POOL`): four equal nodes (``node-1``..``node-4``, speed 1), a batch of 8
sequences, decode steps of 50 ms + 2.5 ms per sequence (70 ms with a full batch),
prefill 4000 tokens/s, all simulated. Prefill dominates: a 4,000-token system prompt
costs 1.0 s of node time, decoding 16 tokens in a full batch 16 x 70 ms / 8 = 0.14 s; with
the mean request of ``shared_prefix`` (about 4,500 prompt tokens, 21.6 output tokens)
prefill is about 85 % of a request's cost without prefix caching. KV capacity
76,800 tokens per node = a full batch of mean requests (8 x 4,600) + room for the
system prompts of about 30 % of the groups (12 x 4,000 mean); as the simnode's prefix
cache is an LRU of its own (controlplane/simnode/prefix.py), it is given that room,
``--prefix-cache-blocks`` 3,000 (48,000 tokens), not the whole KV capacity. A node
that serves a quarter of the groups keeps most of their prompts and its sessions'
histories cached; one that sees all 40 groups (160,000 tokens of system prompts)
keeps evicting them. The largest request
(6,000 + 8 x 200 + 7 answers of 64 tokens + 64 output: under 8,800 tokens) fits, and a
full batch of them (under 70,400) too, so the KV reservation never stops admission
before the batch size does.

Workload and load (bench/scheduler/sessions.py): ``shared_prefix`` runs the whole
population (40 groups x 5 users = 200 sessions of 3-8 turns, system prompts of
2,000-6,000 tokens, user turns of 50-200 tokens, think time exponential with mean 30 s
simulated, so that most sessions, and with them all 40 groups, are open at once) at 60, 80 and 95 % of the pool's capacity without prefix caching;
``one_prompt`` sends single-turn sessions (Poisson requests) that all share one
4,000-token system prompt with a distinct user turn of 50-200 tokens, at 80 % for
120 simulated seconds, to show whether prefix affinity piles one prompt onto one node.

Every run uses its own salt in the prompt tags (same lengths), so nothing an earlier run
left in the prefix caches is hit; the nodes are idle before each run.

Per run (``bench/results/scheduler_prefix.json``): the fields of stats.py
(``summarise``; goodput over the wall seconds from the first session start to the end
of the last session), ``failures`` = timeouts + errors (429 included),
``prefix_hit_rate`` = Δhits / Δqueries (tokens) summed over the nodes, read from
``/_sim/state`` ``prefix_cache`` (or the ``vllm:prefix_cache_*_total`` counters of
``/metrics``) before and after the run, ``client_cached_rate`` (Σ ``cached_tokens`` /
Σ ``prompt_tokens`` of the answers' usage), ``share`` per node (Δ``requests_total``),
``inflight`` per node (peak and mean of running + waiting, sampled every 0.1 s wall) and
``max_share_ratio`` = the largest share x the number of nodes (1 = even).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import redis
import requests

from controlplane import procs
from controlplane.config import EdgeSettings
from controlplane.simnode import launch

from ..common import (BenchError, Stack, format_table, log, machine_info, rounded,
                      sigterm_as_interrupt, write_json)
from .sessions import (SessionRun, SessionSpec, WorkloadMeans, build_sessions,
                       client_cached_rate, hit_rate, inflight_stats, parse_prefix_counters,
                       request_shares, run_sessions, session_rate, start_times,
                       state_prefix_counters, workload_means)
from .stack import (STRATEGIES, EdgeRun, InfergateStack, SimNodeProc, clear_faults, pool_idle,
                    snapshot_all_healthy, start_infergate_base)
from .stats import summarise
from .workload import LengthDist, PoolSpec, pool_capacity_rps

PREFIX_SCENARIOS = ("shared_prefix", "one_prompt")
PREFIX_STRATEGIES = (*STRATEGIES, "infergate_noprefix")
#: Client deadline in simulated seconds, as in bench.scheduler.
DEADLINE_SIM_S = 30.0
#: Default time scale (wall seconds per simulated second).
TIME_SCALE = 0.1
#: Default loads of ``shared_prefix`` and the load of ``one_prompt``.
LOADS = (0.6, 0.8, 0.95)
ONE_PROMPT_LOAD = 0.8
#: Simulated seconds of session starts of ``one_prompt`` (``shared_prefix``: all sessions).
ONE_PROMPT_WINDOW_S = 120.0
#: ``--quick``: simulated seconds of session starts of each scenario.
QUICK_WINDOW_S = {"shared_prefix": 60.0, "one_prompt": 40.0}
#: Edge counts run for every strategy.
EDGE_COUNTS = (1, 2)

#: Mean think time of ``shared_prefix`` users between an answer and their next turn,
#: simulated seconds: long enough that most of the 200 sessions are open at once (their
#: groups' system prompts are the working set), as with people reading answers.
THINK_MEAN_S = 30.0
#: Prefix-cache room per node, blocks of 16 tokens (see the module docstring).
PREFIX_CACHE_BLOCKS = 3000

POOL = PoolSpec(n_fast=4, n_slow=0, fast_speed=1.0, max_running=8, decode_base_ms=50.0,
                decode_per_seq_ms=2.5, prefill_tps=4000.0, kv_capacity_tokens=76_800)
LENGTHS = LengthDist()
SPECS = {
    "shared_prefix": SessionSpec(think_mean_s=THINK_MEAN_S, lengths=LENGTHS),
    "one_prompt": SessionSpec(groups=1, users_per_group=2000, system_tokens=(4000, 4000),
                              turns=(1, 1), think_mean_s=0.0, lengths=LENGTHS),
}


def node_names(spec: PoolSpec = POOL) -> list[str]:
    """``node-1``.. for the nodes of ``spec`` (all the same speed here)."""
    return [f"node-{i + 1}" for i in range(len(spec.nodes()))]


def start_pool(stack: Stack, time_scale: float, spec: PoolSpec = POOL) -> list[SimNodeProc]:
    """The equal nodes of ``spec``, prefix caching on (the simnode default)."""
    specs = [(name, ["--log-level", "warning", *spec.simnode_flags(speed, time_scale),
                     "--prefix-cache-blocks", str(PREFIX_CACHE_BLOCKS)])
             for name, (_, speed) in zip(node_names(spec), spec.nodes(), strict=True)]
    nodes = launch.start_nodes(specs, stack.dir / "logs", into=stack, cls=SimNodeProc)
    for node, (_, speed) in zip(nodes, spec.nodes(), strict=True):
        node.speed = speed
    return nodes


def noprefix_base(base: InfergateStack) -> InfergateStack:
    """``base`` with ``edge.prefix_affinity = false`` in the settings the edge is
    rendered from (Redis and the control plane are shared). Raises ``BenchError`` when
    the settings have no such field."""
    if "prefix_affinity" not in EdgeSettings.model_fields:
        raise BenchError("edge.prefix_affinity is not a setting of this checkout: "
                         "infergate_noprefix cannot run")
    settings = base.settings.model_copy(deep=True)
    settings.edge.prefix_affinity = False
    return replace(base, settings=settings)


def node_counters(node: SimNodeProc) -> tuple[int, tuple[float, float] | None]:
    """(requests_total, (prefix queries, hits) in tokens or ``None``) of one node."""
    st = node.state()
    pc = state_prefix_counters(st)
    if pc is None:
        try:
            res = requests.get(f"{node.url}/metrics", timeout=5)
            pc = parse_prefix_counters(res.text) if res.status_code == 200 else None
        except requests.RequestException:
            pc = None
    return int(st.get("requests_total", 0)), pc


def build_record(run: SessionRun, *, scenario: str, strategy: str, edges: int, frac: float,
                 rate_sim: float, ts: float, deadline: float, sessions: int,
                 before: dict[str, tuple[int, tuple[float, float] | None]],
                 after: dict[str, tuple[int, tuple[float, float] | None]]) -> dict:
    """The published record of one run (fields in the module docstring)."""
    duration = max(run.wall_s, 1e-9)
    rec = {"scenario": scenario, "strategy": strategy, "edges": edges, "load_fraction": frac,
           "sessions": sessions, "session_rate_sim": rounded(rate_sim),
           "time_scale": ts, "deadline_s": deadline, "window_s": rounded(run.window_s, 3),
           "duration_s": rounded(run.wall_s, 3), "loadavg_1m": round(os.getloadavg()[0], 2)}
    rec.update(summarise(run.results, deadline_s=deadline, duration_s=duration,
                         states=run.states, max_running=POOL.max_running))
    rec["failures"] = rec["timeouts"] + rec["errors"]
    pc_before = {k: v[1] for k, v in before.items() if v[1] is not None}
    pc_after = {k: v[1] for k, v in after.items() if v[1] is not None}
    rate, dq, dh = hit_rate(pc_before, pc_after)
    rec["prefix_hit_rate"] = rounded(rate)
    rec["prefix_queries_tokens"] = int(dq)
    rec["prefix_hits_tokens"] = int(dh)
    rec["client_cached_rate"] = rounded(client_cached_rate(run.results))
    share = request_shares({k: v[0] for k, v in before.items()},
                           {k: v[0] for k, v in after.items()})
    rec["share"] = {k: rounded(v, 3) for k, v in share.items()}
    rec["max_share_ratio"] = rounded(max(share.values()) * len(share), 3) if share else None
    rec["inflight"] = {k: {"peak": v["peak"], "mean": rounded(v["mean"], 3)}
                       for k, v in inflight_stats(run.inflight.inflight).items()}
    rec["prompt_tokens_mean"] = rounded(sum(r.prompt_tokens for r in run.results)
                                        / len(run.results) if run.results else None, 1)
    return rec


COLUMNS = [
    ("scenario", "scenario"), ("edges", "edges"), ("load_pct", "load %"),
    ("strategy", "strategy"), ("requests", "requests"), ("goodput_rps", "goodput/s"),
    ("failures", "failures"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"),
    ("ttft_p99_s", "TTFT p99 s"), ("hit_pct", "hit %"), ("shares", "share % per node"),
    ("peaks", "peak in-flight"), ("max_share_ratio", "max share x n"),
]


def table(records: list[dict]) -> str:
    """The records as a Markdown table (shares in %, in-flight peaks per node)."""
    rows = []
    for r in records:
        row = dict(r)
        row["load_pct"] = int(round(r["load_fraction"] * 100))
        hr = r.get("prefix_hit_rate")
        row["hit_pct"] = None if hr is None else round(hr * 100, 1)
        row["shares"] = "/".join(f"{v * 100:.0f}" for v in (r.get("share") or {}).values()) or None
        row["peaks"] = "/".join(f"{v['peak']:.0f}" for v in (r.get("inflight") or {}).values()) or None
        rows.append(row)
    return format_table(rows, COLUMNS)


def plan_runs(names: list[str], strategies: list[str], loads: list[float],
              edge_counts: list[int]) -> list[tuple[str, float, int, str]]:
    """(scenario, load, edges, strategy) of every run, in order."""
    out: list[tuple[str, float, int, str]] = []
    for name in names:
        fracs = loads if name == "shared_prefix" else [ONE_PROMPT_LOAD]
        out += [(name, f, e, s) for f in fracs for e in edge_counts for s in strategies]
    return out


def window_for(name: str, quick: bool, window_sim_s: float | None) -> float | None:
    """Simulated seconds of session starts of ``name`` (``None``: every session)."""
    if window_sim_s is not None:
        return window_sim_s
    if quick:
        return QUICK_WINDOW_S[name]
    return None if name == "shared_prefix" else ONE_PROMPT_WINDOW_S


def run_prefix(names: list[str], *, strategies: list[str], loads: list[float],
               edge_counts: list[int], time_scale: float | None, window_sim_s: float | None,
               quick: bool, seed: int, keep: bool, out: Path) -> list[dict]:
    """Every run of the prefix scenarios ``names``; writes ``scheduler_prefix.json``
    after each run and ``scheduler_prefix.meta.json`` at the end; returns the records."""
    ts = time_scale or TIME_SCALE
    deadline = DEADLINE_SIM_S * ts
    plan = plan_runs(names, strategies, loads, edge_counts)
    facts: dict[str, dict] = {}
    all_means: dict[str, WorkloadMeans] = {}
    for name in names:
        sessions = build_sessions(SPECS[name], seed)
        means = all_means[name] = workload_means(sessions)
        cap = pool_capacity_rps(POOL, means.output_tokens, means.prompt_tokens)
        facts[name] = {"spec": {k: v for k, v in SPECS[name].__dict__.items() if k != "lengths"},
                       "population_sessions": len(sessions),
                       "mean_output_tokens": round(means.output_tokens, 2),
                       "mean_prompt_tokens": round(means.prompt_tokens, 1),
                       "mean_turns": round(means.turns, 3),
                       "capacity_sim_rps": round(cap, 4), "capacity_wall_rps": round(cap / ts, 3),
                       "window_sim_s": window_for(name, quick, window_sim_s)}
        log(f"{name}: capacity without prefix caching {cap:.3f} req/s simulated "
            f"({cap / ts:.2f} wall), E[prompt] {means.prompt_tokens:.0f} tokens, E[output] "
            f"{means.output_tokens:.1f}, E[turns] {means.turns:.2f}")
    meta = {"benchmark": "scheduler_prefix", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.scheduler.scenarios", *sys.argv[1:]]),
            "machine": machine_info(), "time_scale": ts, "deadline_sim_s": DEADLINE_SIM_S,
            "seed": seed, "pool": POOL.__dict__, "nodes": node_names(),
            "output_tokens": LENGTHS.__dict__, "scenarios": facts,
            "plan": [{"scenario": a, "load_fraction": b, "edges": c, "strategy": d}
                     for a, b, c, d in plan]}
    records: list[dict] = []
    t0 = time.monotonic()
    log(f"prefix scenarios: {len(plan)} runs, time scale {ts:g}, deadline {deadline:g} s wall")
    try:
        with sigterm_as_interrupt(), Stack("infergate-bench-prefix-", keep=keep) as stack:
            nodes = start_pool(stack, ts)
            need_ig = any(s.startswith("infergate") for s in strategies)
            base = start_infergate_base(stack, nodes, POOL, ts) if need_ig else None
            bases = {"infergate": base,
                     "infergate_noprefix": (noprefix_base(base)
                                            if base and "infergate_noprefix" in strategies
                                            else None)}
            rconn = redis.Redis.from_url(base.redis_url, socket_timeout=2) if base else None
            for i, (name, frac, n_edges, strategy) in enumerate(plan, 1):
                sessions = build_sessions(SPECS[name], seed, salt=i)
                rate = session_rate(POOL, all_means[name], frac)
                window = facts[name]["window_sim_s"]
                starts = start_times(sessions, rate, window)
                wall_plan = [(s, at * ts) for s, at in starts]
                clear_faults(nodes)
                procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                                 what="the simulated nodes to finish their requests")
                if rconn is not None:
                    procs.wait_until(lambda: snapshot_all_healthy(rconn, len(nodes)), 60,
                                     interval=0.1, what="every node healthy in the snapshot")
                before = {n.name: node_counters(n) for n in nodes}
                ig = strategy.startswith("infergate")
                edges = [EdgeRun(stack, "infergate" if ig else strategy, nodes, ts,
                                 bases.get(strategy), f"{i:02d}-{name}-{strategy}-{e}")
                         for e in range(n_edges)]
                try:
                    run = asyncio.run(run_sessions(
                        [e.url for e in edges], wall_plan, ts, deadline,
                        {n.name: n.control_url for n in nodes}, sample_interval_s=0.1))
                finally:
                    for e in edges:
                        e.stop()
                after = {n.name: node_counters(n) for n in nodes}
                rec = build_record(run, scenario=name, strategy=strategy, edges=n_edges,
                                   frac=frac, rate_sim=rate, ts=ts, deadline=deadline,
                                   sessions=len(wall_plan), before=before, after=after)
                rec["edge_errors"] = [ln for e in edges for ln in e.error_lines(2)]
                records.append(rec)
                log(f"[{i}/{len(plan)}] {name} {frac * 100:.0f}% x{n_edges} {strategy}: "
                    f"{rec['requests']} req, goodput {rec['goodput_rps']}/s, failures "
                    f"{rec['failures']}, TTFT p50 {rec['ttft_p50_s']} p99 {rec['ttft_p99_s']} s, "
                    f"hit rate {rec['prefix_hit_rate']}, shares {rec['share']}, "
                    f"{rec['duration_s']} s")
                write_json(out / "scheduler_prefix.json", records)
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        if records:
            write_json(out / "scheduler_prefix.json", records)
        sys.exit(130)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "scheduler_prefix.json", records)
    write_json(out / "scheduler_prefix.meta.json", meta)
    print(table(records))
    print(f"{meta['elapsed_s']} s elapsed; wrote {out / 'scheduler_prefix.json'}")
    return records

