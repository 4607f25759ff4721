"""``python -m bench.scheduler.shapes [--shapes ...] [--strategies ...] [--out DIR]``

Traffic shapes that test the learned parts of the infergate scheduler (learned
concurrency, answer-time tail, stall detection, prefix affinity), each run for nginx
``least_conn`` and infergate (and ``round_robin`` when named) on the same requests, one
strategy after the other for each load (interleaved), a fresh edge per run:

- ``quiet_then_burst`` (pool of bench.scheduler: 2 fast + 2 three times slower nodes,
  batch 4): :data:`QUIET` requests sent one at a time (each after the previous answer),
  then :data:`BURST` at once. ``rejected_free`` counts the 429s answered while some
  node had a free batch slot (``running < max_running`` in the node samples just before
  and just after the 429).
- ``node_freeze``: the same pool at :data:`FREEZE_LOAD` of its capacity; ``fast-1`` (the
  node every balancer prefers) is SIGSTOPped at a quarter of the window for
  :data:`FREEZE_SIM_S` simulated seconds (longer than the deadline), then SIGCONTed.
  From the edge's access log (each request carries ``?i=<index>``; ``ua`` lists every
  try's node): ``to_frozen_at_s`` = the send times (s after the freeze) of the requests
  sent during the freeze whose tries include the frozen node; ``to_frozen_after_s`` =
  the last of the first of them (sends less than :data:`PROBE_GAP_S` apart: routing
  before the freeze is found), ``to_frozen_last_s`` = the last of all (later ones are
  the half-open probes of stall detection, one at a time, backing off); for infergate
  ``found_after_s`` = when the edge's ``/infergate/status`` first showed the node
  stalled or a TTFB outlier (polled every 50 ms from the freeze); ``lost_no_byte``
  = requests that failed (timeout, error) without any byte of an answer having reached
  the client, of them ``lost_no_byte_frozen`` had tried the frozen node.
- ``speed_shift``: the same pool at :data:`SHIFT_LOAD`; ``fast-1`` becomes 3 times slower
  at a third of the window and recovers at two thirds (``slowdown`` fault of the simnode).
- ``pool_slowdown``: the same pool at :data:`POOL_SLOW_LOAD`; every node becomes
  :data:`SHIFT_FACTOR` times slower at a third of the window and recovers at two thirds
  (the offered load is then about twice what the pool can serve): what is not served
  should get a quick 429, not a timeout.
- ``zero_reuse``: the four equal prefix-caching nodes of bench/scheduler/prefix.py
  (:data:`~bench.scheduler.prefix.POOL`), every prompt 2,000-6,000 tokens long and
  unique from its first character (nothing to reuse), the prefix term of infergate on.
- ``shared_prefix_open``: the same pool, open-loop (Poisson) single-turn requests, each a
  system message of one of 40 groups (2,000-6,000 tokens) and a user message of
  50-200 tokens, at :data:`OPEN_LOADS` of the pool's capacity *without* prefix caching,
  so that only prefix reuse can raise goodput.
- ``two_lengths``: four equal nodes (:data:`TWO_POOL`, the fast node of bench.scheduler,
  batch 4) at :data:`TWO_LENGTHS_LOADS`, the answers in two modes: :data:`LONG_SHARE` of
  the requests (the same ones at every load) ask :data:`LONG_TOKENS` tokens (uniform),
  the others the usual log-normal lengths. Answers in flight are then mostly long ones,
  and the answer times at a level of in-flight requests vary by a factor of ten: what a
  node runs at once, and its service time, are hard to learn from them.

Loads are fractions of the pool's capacity (bench/scheduler/workload.py; the prefix pool's
without prefix caching). Time constants of the infergate edge are scaled as in
bench/scheduler/stack.py, and here also the stall-detection ones (``stall_min_s``,
``stall_first_byte_s``), which that module leaves at their defaults.

Per run: the fields of stats.py (``summarise``), ``failures`` = timeouts + errors (429
included), the shape's own fields above, ``prefix_hit_rate`` for the prefix pool.
Writes ``scheduler_shapes.json`` and ``scheduler_shapes.meta.json`` into ``--out`` and
prints the table and the infergate / least_conn ratios of the same load.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import click
import redis

from controlplane import procs

from ..common import (RESULTS_DIR, comma_names, BenchError, Stack, format_table, load_prompts, log,
                      machine_info, rounded, sigterm_as_interrupt, write_json)
from . import report
from .loadgen import Result, StateSamples, _has_text, run_load, sample_states, stream_request
from .prefix import LENGTHS as BASE_LENGTHS
from .prefix import POOL as PREFIX_POOL
from .prefix import node_counters
from .prefix import start_pool as start_prefix_pool
from .sessions import hit_rate, system_prompt, words_text
from .stack import (EdgeRun, InfergateStack, SimNodeProc, clear_faults, infergate_settings,
                    pool_idle, snapshot_all_healthy, start_pool,
                    start_redis_and_controlplane)
from .stats import summarise
from .workload import PoolSpec, Request, RequestMix, Workload, pool_capacity_rps

SHAPES = ("quiet_then_burst", "node_freeze", "speed_shift", "pool_slowdown", "zero_reuse",
          "shared_prefix_open", "two_lengths")
STRATEGIES = ("round_robin", "least_conn", "infergate")
DEADLINE_SIM_S = 30.0
TIME_SCALE = 0.2
QUIET, BURST = 30, 200
FREEZE_LOAD, FREEZE_SIM_S, FREEZE_NODE = 0.5, 40.0, "fast-1"
SHIFT_LOAD, SHIFT_FACTOR = 0.7, 3.0
POOL_SLOW_LOAD = 0.6
ZERO_LOADS = (0.8,)
OPEN_LOADS = (1.5, 2.0)
GROUPS = 40
TWO_LENGTHS_LOADS = (0.5, 0.8)
LONG_SHARE, LONG_TOKENS = 0.2, (100, 200)
WINDOW_SIM_S = {"node_freeze": 100.0, "speed_shift": 120.0, "pool_slowdown": 120.0,
                "zero_reuse": 90.0,
                "shared_prefix_open": 90.0, "two_lengths": 150.0}
BASE = PoolSpec()
TWO_POOL = PoolSpec(n_fast=4, n_slow=0)


@dataclass
class Plan:
    """One shape: its pool, its requests per load and what happens during a run."""

    name: str
    spec: PoolSpec
    loads: tuple[float, ...]
    messages: dict[int, list[dict]] = field(default_factory=dict)
    """request index -> chat messages (empty: one user message, the request's prompt)."""


def two_lengths(wl: Workload, seed: int) -> Workload:
    """``wl`` with :data:`LONG_SHARE` of its requests (drawn per request index, so the same
    at every load) made :data:`LONG_TOKENS` tokens long."""
    out = []
    for r in wl.requests:
        rng = random.Random(f"{seed}-{r.idx}")
        if rng.random() < LONG_SHARE:
            r = replace(r, output_tokens=rng.randint(*LONG_TOKENS))
        out.append(r)
    return replace(wl, requests=out)


def two_lengths_mean(mean_short: float) -> float:
    """Mean output tokens of :func:`two_lengths` given the mean of the usual lengths."""
    return (1 - LONG_SHARE) * mean_short + LONG_SHARE * sum(LONG_TOKENS) / 2


def prefix_requests(n: int, seed: int, shared: bool) -> tuple[list[tuple[list[dict], int]], float]:
    """``n`` (messages, output tokens) of the prefix pool, and the mean prompt tokens:
    shared: a group's system prompt (40 groups, 2,000-6,000 tokens) + a user turn of
    50-200 tokens; not shared: one user message of 2,000-6,000 tokens unique from its
    first character."""
    rng = random.Random(seed)
    sizes = [rng.randint(2000, 6000) for _ in range(GROUPS)]
    systems = [system_prompt(g, sizes[g], seed, salt=seed) for g in range(GROUPS)] if shared else []
    # unique from the first block on: the nodes' block hashes are chained, so one body of
    # pseudo-words behind a distinct tag shares no block (and no affinity key)
    body = words_text(rng, "", 6000)
    out, tokens = [], 0
    for i in range(n):
        n_out = BASE_LENGTHS.draw(rng)
        if shared:
            g = rng.randrange(GROUPS)
            user = words_text(rng, f"[q {i:06d}]", rng.randint(50, 200))
            msgs = [{"role": "system", "content": systems[g]}, {"role": "user", "content": user}]
        else:
            n_chars = 4 * rng.randint(2000, 6000)
            tag = f"[{seed:04d} unique {i:06d} {rng.random():.12f}] "
            msgs = [{"role": "user", "content": (tag + body)[:n_chars]}]
        tokens += sum(len(m["content"]) for m in msgs) // 4
        out.append((msgs, n_out))
    return out, tokens / max(1, n)


async def send_indexed(session: aiohttp.ClientSession, url: str, req: Request,
                       deadline_s: float, lag_s: float = 0.0,
                       messages: dict[int, list[dict]] | None = None, salt: str = "") -> Result:
    """Like loadgen.send_one, with ``?i=<index>`` on the URL (the access logs name it)
    and the request's own messages when ``messages`` has them, the first one starting
    with ``salt`` (each run its own: nothing an earlier run left in the nodes' prefix
    caches is hit)."""
    res = Result(idx=req.idx, outcome="error", lag_s=lag_s)
    msgs = (messages or {}).get(req.idx) or [{"role": "user", "content": req.prompt}]
    if salt:
        msgs = [{**msgs[0], "content": salt + msgs[0]["content"]}, *msgs[1:]]
    body = {"messages": msgs, "stream": True, "sim_output_tokens": req.output_tokens}

    def on_event(payload: bytes, t: float) -> None:
        if res.ttft_s is None and _has_text(payload):
            res.ttft_s = t

    await stream_request(session, f"{url}?i={req.idx}", body, deadline_s, res, on_event)
    return res


# --------------------------------------------------------------------------- analysis

def access_tries(text: str) -> dict[int, list[str]]:
    """request index (``?i=``) -> the upstream addresses its tries went to (``ua``)."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.search(r'\?i=(\d+)[ "].*?ua="([^"]*)"', line)
        if m:
            out[int(m.group(1))] = re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", m.group(2))
    return out


#: Sends to the frozen node more than this apart (wall s) after the first ones are the
#: half-open probes of stall detection (one at a time, backing off), not routing.
PROBE_GAP_S = 0.5


def freeze_figures(wl: Workload, results: Sequence[Result], tries: dict[int, list[str]],
                   addr: str, t_freeze: float, t_thaw: float) -> dict:
    """``to_frozen_after_s``, ``to_frozen_last_s``, ``to_frozen_at_s``, ``lost_no_byte``,
    ``lost_no_byte_frozen`` (module docstring); times in wall s from the run start."""
    at = {r.idx: r.at_s for r in wl.requests}
    late = sorted(at[i] - t_freeze for i, t in tries.items()
                  if addr in t and t_freeze <= at.get(i, -1) < t_thaw)
    until = late[0] if late else 0.0
    for x in late:        # the first cluster: sends less than PROBE_GAP_S apart
        if x - until > PROBE_GAP_S:
            break
        until = x
    lost = [r for r in results if r.outcome != "ok" and r.events == 0 and r.status != 429]
    return {"to_frozen_after_s": rounded(until, 3),
            "to_frozen_last_s": rounded(late[-1], 3) if late else 0.0,
            "to_frozen_at_s": [rounded(x, 2) for x in late],
            "lost_no_byte": len(lost),
            "lost_no_byte_frozen": sum(1 for r in lost if addr in tries.get(r.idx, []))}


def rejected_with_free_slot(ends: dict[int, float], results: Sequence[Result],
                            samples: list[tuple[float, str, int]], max_running: int) -> int:
    """429s answered while a node had a free batch slot in both the last sample before
    and the first after (``samples``: (time, node, running), ``ends``: idx -> time)."""
    n = 0
    for r in results:
        if r.status != 429 or r.idx not in ends:
            continue
        t = ends[r.idx]
        nodes = {s[1] for s in samples}
        for node in nodes:
            mine = [s for s in samples if s[1] == node]
            before = [s[2] for s in mine if s[0] <= t]
            after = [s[2] for s in mine if s[0] > t]
            if before and after and before[-1] < max_running and after[0] < max_running:
                n += 1
                break
    return n


RATIO_KEYS = ("goodput_rps", "failures", "p50_s", "p99_s", "ttft_p90_s")


def ratios(records: Sequence[dict], base: str = "least_conn") -> list[dict]:
    """Per (scenario, load): infergate's figure / ``base``'s for :data:`RATIO_KEYS`
    (``None`` where the base is 0 or missing), and both failure counts."""
    out = []
    for r in records:
        if r["strategy"] != "infergate":
            continue
        b = next((x for x in records if x["strategy"] == base and x["scenario"] == r["scenario"]
                  and x["load_fraction"] == r["load_fraction"]), None)
        if b is None:
            continue
        row = {"scenario": r["scenario"], "load_pct": int(round(r["load_fraction"] * 100)),
               "failures_ig": r["failures"], "failures_base": b["failures"]}
        for k in RATIO_KEYS:
            row[k] = (rounded(r[k] / b[k], 3) if r.get(k) is not None and b.get(k) else None)
        for k in ("rejected_free", "to_frozen_after_s", "lost_no_byte", "prefix_hit_rate"):
            if k in r:
                row[k] = r[k]
        out.append(row)
    return out


RATIO_COLUMNS = [("scenario", "scenario"), ("load_pct", "load %"),
                 ("goodput_rps", "goodput ×"), ("failures_ig", "failures ig"),
                 ("failures_base", "failures lc"), ("p50_s", "p50 ×"), ("p99_s", "p99 ×"),
                 ("ttft_p90_s", "TTFT p90 ×"), ("rejected_free", "429 w/ free slot"),
                 ("to_frozen_after_s", "to frozen after s"), ("lost_no_byte", "lost no byte"),
                 ("prefix_hit_rate", "prefix hits")]
EXTRA_COLUMNS = [("scenario", "scenario"), ("load_pct", "load %"), ("strategy", "strategy"),
                 ("requests", "requests"), ("failures", "failures"), ("rejected", "429"),
                 ("rejected_free", "429 w/ free slot"), ("to_frozen_after_s", "to frozen after s"),
                 ("to_frozen_last_s", "last probe s"), ("found_after_s", "found stalled s"),
                 ("lost_no_byte", "lost no byte"), ("prefix_hit_rate", "prefix hits"),
                 ("loadavg_before", "load avg")]


def table(records: Sequence[dict]) -> str:
    """The figures of every run, the shape-specific ones, then the ratios to least_conn."""
    rows = report.table_rows(records)
    return "\n\n".join([report.table(records), format_table(rows, EXTRA_COLUMNS),
                        "infergate / least_conn (same load, same run):",
                        format_table(ratios(records), RATIO_COLUMNS)])


# --------------------------------------------------------------------------- runs

def settings_for(redis_url: str, nodes: list[SimNodeProc], spec: PoolSpec, ts: float):
    """infergate_settings with the stall-detection time constants scaled too."""
    s = infergate_settings(redis_url, nodes, spec, ts)
    s.edge.stall_min_s = max(0.2, s.edge.stall_min_s * ts)
    s.edge.stall_first_byte_s = s.edge.stall_first_byte_s * ts
    return s


async def quiet_then_burst(url: str, reqs: list[Request], deadline: float,
                           controls: dict[str, str], send) -> tuple[list[Result], dict[int, float],
                                                                   list[tuple[float, str, int]]]:
    """:data:`QUIET` requests one at a time, then the rest at once; returns the burst's
    results, their end times and the node samples (time, node, running)."""
    loop = asyncio.get_running_loop()
    samples: list[tuple[float, str, int]] = []
    t0 = loop.time()
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    ends: dict[int, float] = {}
    async with aiohttp.ClientSession(connector=conn) as s, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as ss:
        def on_state(node: str, st: dict) -> None:
            samples.append((loop.time() - t0, node, int(st.get("running", 0))))
        sampler = asyncio.create_task(sample_states(ss, controls, 0.05, stop, StateSamples(),
                                                    on_state))
        for req in reqs[:QUIET]:
            await send(s, url, req, deadline)

        async def one(req: Request) -> Result:
            res = await send(s, url, req, deadline)
            ends[req.idx] = loop.time() - t0
            return res
        results = list(await asyncio.gather(*(one(r) for r in reqs[QUIET:])))
        stop.set()
        await sampler
    return results, ends, samples


def run_one(plan: Plan, strategy: str, frac: float, wl: Workload, *, stack: Stack,
            nodes: list[SimNodeProc], base: InfergateStack | None, ts: float, tag: str,
            per_request: Path | None) -> dict:
    """One run of one strategy; returns its record."""
    deadline = DEADLINE_SIM_S * ts
    controls = {n.name: n.control_url for n in nodes}

    salt = f"[{tag}] "

    async def send(s, url, req, dl, lag=0.0):
        return await send_indexed(s, url, req, dl, lag, plan.messages, salt)
    before = {n.name: node_counters(n) for n in nodes} if plan.spec is PREFIX_POOL else None
    edge = EdgeRun(stack, strategy, nodes, ts, base, tag)
    extra: dict = {}
    ends: dict[int, float] = {}
    tries: dict[int, list[str]] = {}
    frozen: list[SimNodeProc] = []
    try:
        if plan.name == "quiet_then_burst":
            t_start = time.monotonic()
            results, ends, samples = asyncio.run(quiet_then_burst(
                edge.url, wl.requests, deadline, controls, send))
            duration = deadline
            extra["rejected_free"] = rejected_with_free_slot(ends, results, samples,
                                                             plan.spec.max_running)
            extra["burst_wall_s"] = rounded(time.monotonic() - t_start, 2)
            states = None
        else:
            on_time = []
            if plan.name == "node_freeze":
                bad = next(n for n in nodes if n.name == FREEZE_NODE)
                t_f, t_t = wl.duration_s / 4, wl.duration_s / 4 + FREEZE_SIM_S * ts

                async def freeze() -> None:
                    frozen.append(bad)
                    bad.managed.signal(signal.SIGSTOP)

                async def thaw() -> None:
                    bad.managed.signal(signal.SIGCONT)
                    frozen.clear()

                async def watch() -> None:   # when the edge finds the node stalled/outlier
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < t_t - t_f:
                        st = await asyncio.to_thread(edge.edge_status)
                        node = next((x for x in (st or {}).get("nodes", [])
                                     if x.get("name") == FREEZE_NODE), {})
                        if node.get("stalled") or node.get("outlier"):
                            extra["found_after_s"] = rounded(time.monotonic() - t0, 2)
                            return
                        await asyncio.sleep(0.05)
                on_time = [(t_f, freeze), (t_f, watch), (t_t, thaw)]
            elif plan.name in ("speed_shift", "pool_slowdown"):
                slowed = [n for n in nodes
                          if plan.name == "pool_slowdown" or n.name == FREEZE_NODE]

                async def slow() -> None:
                    for n in slowed:
                        await asyncio.to_thread(n.set_faults, slowdown=SHIFT_FACTOR)

                async def back() -> None:
                    for n in slowed:
                        await asyncio.to_thread(n.set_faults, slowdown=1.0)
                on_time = [(wl.duration_s / 3, slow), (2 * wl.duration_s / 3, back)]
            run = asyncio.run(run_load(edge.url, wl, deadline, controls, 0.1, on_time, send))
            results, states, duration = run.results, run.states, wl.duration_s
            if plan.name == "node_freeze":
                tries = access_tries((edge.error_log.parent / "access.log").read_text(
                    errors="replace"))
                extra.update(freeze_figures(wl, results, tries, f"127.0.0.1:{bad.port}",
                                            t_f, t_t))
    finally:
        for n in frozen:
            n.managed.signal(signal.SIGCONT)
        edge.stop()
        clear_faults(nodes)
    rec = {"scenario": plan.name, "strategy": strategy, "load_fraction": frac,
           "offered_rps": round(wl.rate_rps, 3), "deadline_s": deadline, "time_scale": ts,
           "window_s": rounded(duration, 3), "loadavg_1m": round(os.getloadavg()[0], 2)}
    rec.update(summarise(results, deadline_s=deadline, duration_s=duration, states=states,
                         max_running=plan.spec.max_running,
                         faulty=[FREEZE_NODE] if plan.name in ("node_freeze", "speed_shift")
                         else ()))
    rec["failures"] = rec["timeouts"] + rec["errors"]
    rec.update(extra)
    if before is not None:
        after = {n.name: node_counters(n) for n in nodes}
        rate, _, _ = hit_rate({k: v[1] for k, v in before.items() if v[1]},
                              {k: v[1] for k, v in after.items() if v[1]})
        rec["prefix_hit_rate"] = rounded(rate, 3)
    rec["edge_errors"] = edge.error_lines(2)
    if per_request is not None:
        per_request.mkdir(parents=True, exist_ok=True)
        at = {r.idx: r for r in wl.requests}
        with (per_request / f"{tag}.jsonl").open("w") as fh:
            for r in results:
                fh.write(json.dumps({"idx": r.idx, "at_s": rounded(at[r.idx].at_s, 4),
                                     "output_tokens": at[r.idx].output_tokens,
                                     "outcome": r.outcome, "status": r.status, "e2e_s": r.e2e_s,
                                     "ttft_s": r.ttft_s, "node": r.node, "error": r.error,
                                     "tries": tries.get(r.idx), "end_s": rounded(ends.get(r.idx), 3)})
                         + "\n")
    return rec


def build(name: str, prompts: list[str], seed: int, ts: float,
          loads: tuple[float, ...] | None) -> tuple[Plan, dict[float, Workload], dict]:
    """The shape's plan, its workload per load and its facts (capacity, means)."""
    if name in ("zero_reuse", "shared_prefix_open"):
        reqs, mean_prompt = prefix_requests(1500, seed, shared=name == "shared_prefix_open")
        mean_out = sum(n for _, n in reqs) / len(reqs)
        spec = PREFIX_POOL
        cap = pool_capacity_rps(spec, mean_out, mean_prompt) / ts
        plan = Plan(name, spec, loads or (ZERO_LOADS if name == "zero_reuse" else OPEN_LOADS),
                    messages={i: m for i, (m, _) in enumerate(reqs)})
        rng = random.Random(seed)
        wls = {}
        for frac in plan.loads:
            t, out = 0.0, []
            window = WINDOW_SIM_S[name] * ts
            while True:
                t += rng.expovariate(frac * cap)
                if t >= window or len(out) >= len(reqs):
                    break
                out.append(Request(idx=len(out), at_s=t, prompt="", output_tokens=reqs[len(out)][1]))
            wls[frac] = Workload(out, frac * cap, window, seed)
    else:
        mix = RequestMix(prompts, seed=seed)
        mean_out, mean_prompt = mix.sample_means()
        if name == "two_lengths":
            mean_out = two_lengths_mean(mean_out)
        spec = TWO_POOL if name == "two_lengths" else BASE
        cap = pool_capacity_rps(spec, mean_out, mean_prompt) / ts
        if name == "quiet_then_burst":
            plan = Plan(name, spec, (0.0,))
            wl = mix.workload(1000.0, (QUIET + BURST + 1) / 1000.0)
            wls = {0.0: replace(wl, requests=wl.requests[:QUIET + BURST])}
        else:
            load = {"node_freeze": (FREEZE_LOAD,), "pool_slowdown": (POOL_SLOW_LOAD,),
                    "two_lengths": TWO_LENGTHS_LOADS}.get(name, (SHIFT_LOAD,))
            plan = Plan(name, spec, loads or load)
            wls = {f: mix.workload(f * cap, WINDOW_SIM_S[name] * ts) for f in plan.loads}
            if name == "two_lengths":
                wls = {f: two_lengths(w, seed) for f, w in wls.items()}
    facts = {"scenario": name, "capacity_wall_rps": round(cap, 3),
             "mean_output_tokens": round(mean_out, 2), "mean_prompt_tokens": round(mean_prompt, 1),
             "nodes": [n for n, _ in spec.nodes()], "max_running": spec.max_running}
    return plan, wls, facts


def run_shape(name: str, *, prompts: list[str], strategies: list[str], seed: int, ts: float,
              loads: tuple[float, ...] | None, keep: bool, records: list[dict], out: Path,
              per_request: Path | None) -> dict:
    """Every (load, strategy) run of one shape; rewrites ``scheduler_shapes.json`` after
    each run. Returns the shape's facts."""
    plan, wls, facts = build(name, prompts, seed, ts, loads)
    log(f"{name}: capacity {facts['capacity_wall_rps']} req/s wall; loads {list(wls)}; "
        f"load average {os.getloadavg()[0]:.2f}")
    with Stack(f"infergate-bench-{name}-", keep=keep) as stack:
        nodes = (start_prefix_pool(stack, ts) if plan.spec is PREFIX_POOL
                 else start_pool(stack, plan.spec, ts))
        base = None
        if "infergate" in strategies:
            base = start_redis_and_controlplane(
                stack, lambda url: settings_for(url, nodes, plan.spec, ts),
                lambda r: snapshot_all_healthy(r, len(nodes)))
        rconn = redis.Redis.from_url(base.redis_url, socket_timeout=2) if base else None
        for frac, wl in wls.items():
            for strategy in strategies:
                procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                                 what="the simulated nodes to finish their requests")
                if rconn is not None:
                    procs.wait_until(lambda: snapshot_all_healthy(rconn, len(nodes)), 60,
                                     interval=0.1, what="every node healthy in the snapshot")
                load1 = os.getloadavg()[0]
                rec = run_one(plan, strategy, frac, wl, stack=stack, nodes=nodes, base=base,
                              ts=ts, tag=f"{name}-{int(frac * 100)}-{strategy}",
                              per_request=per_request)
                rec["loadavg_before"] = round(load1, 2)
                records.append(rec)
                log(f"{name} {frac * 100:.0f}% {strategy}: {rec['requests']} req, goodput "
                    f"{rec['goodput_rps']}/s, failures {rec['failures']} (429 {rec['rejected']}), "
                    f"p50 {rec['p50_s']} p99 {rec['p99_s']} TTFT p90 {rec['ttft_p90_s']} s; "
                    + ", ".join(f"{k} {rec[k]}" for k in ("rejected_free", "to_frozen_after_s",
                                                          "lost_no_byte", "prefix_hit_rate")
                                if k in rec) + f"; load {load1:.2f}")
                write_json(out / "scheduler_shapes.json", records)
    return facts


@click.command()
@click.option("--shapes", "names", default=",".join(SHAPES), show_default=True)
@click.option("--strategies", default="least_conn,infergate", show_default=True)
@click.option("--loads", default=None, help="Comma list of load fractions for every shape "
              "but quiet_then_burst [default: each shape's own].")
@click.option("--time-scale", type=click.FloatRange(0.05, 2.0), default=TIME_SCALE,
              show_default=True, help="Wall seconds per simulated second.")
@click.option("--prompts", "prompts_path", type=click.Path(), default=None,
              help="Prompt source as for bench.scheduler [default: ../shared/data/cache-eval].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the scratch folders.")
@click.option("--per-request", type=click.Path(file_okay=False), default=None,
              help="Folder for one JSONL file per run, a line per request.")
def main(names: str, strategies: str, loads: str | None, time_scale: float,
         prompts_path: str | None, out_dir: str, seed: int, keep: bool,
         per_request: str | None) -> None:
    """Run the traffic shapes of the scheduler benchmark."""
    chosen = comma_names(names, SHAPES, "shape")
    strats = comma_names(strategies, STRATEGIES, "strategy")
    try:
        load_list = tuple(float(x) for x in loads.split(",")) if loads else None
    except ValueError:
        raise click.BadParameter("--loads: expected e.g. 0.8,1.2") from None
    if load_list and any(not 0 < x <= 5 for x in load_list):
        raise click.BadParameter("--loads: fractions within (0, 5]")
    try:
        prompts = load_prompts(prompts_path)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    out = Path(out_dir)
    meta = {"benchmark": "scheduler_shapes", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.scheduler.shapes", *sys.argv[1:]]),
            "machine": machine_info(), "loadavg_before": round(os.getloadavg()[0], 2),
            "time_scale": time_scale, "deadline_sim_s": DEADLINE_SIM_S, "seed": seed,
            "shapes": []}
    records: list[dict] = []
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt():
            for name in chosen:
                meta["shapes"].append(run_shape(
                    name, prompts=prompts, strategies=strats, seed=seed, ts=time_scale,
                    loads=load_list, keep=keep, records=records, out=out,
                    per_request=Path(per_request) if per_request else None))
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        if records:
            write_json(out / "scheduler_shapes.json", records)
        sys.exit(130)
    except (procs.StartError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    meta["loadavg_after"] = round(os.getloadavg()[0], 2)
    write_json(out / "scheduler_shapes.json", records)
    write_json(out / "scheduler_shapes.meta.json", meta)
    print(table(records))
    print(f"{meta['elapsed_s']} s elapsed; wrote {out / 'scheduler_shapes.json'}")


if __name__ == "__main__":
    main()
