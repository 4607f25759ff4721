"""``python -m bench.scheduler.scenarios [--quick] [--scenarios ...] [--out DIR]``

The pool scenarios of the scheduler benchmark that need a pool or a client of their own,
each run for nginx round-robin, nginx least_conn and infergate on the same arrivals:

- ``multi_edge``: the unequal pool of ``bench.scheduler`` (2 fast + 2 three times
  slower nodes) behind **two** edges sharing it, the load split between them request by
  request. For nginx, two nginx instances, each with its own round-robin or least_conn
  state (as two edges are deployed); for infergate, two nginx edges sharing Redis and
  the control plane.
- ``mixed_sizes``: the same pool, prompts from 50 to 8,000 tokens (log-uniform) and
  heavy-tailed outputs (log-normal, median 16, sigma 1.4, 2-256 tokens); KV cache large
  enough for a full batch of the longest requests.
- ``openai_nodes``: four equal nodes without metrics (``--dialect none``) that run one
  request at a time (``--max-running 1``), registered as kind ``openai`` with
  ``max_concurrency`` left at its default 64.
- ``multi_model``: the unequal pool where ``fast-1`` and ``slow-2`` serve ``model-a``
  and ``fast-2`` and ``slow-1`` serve ``model-b``; each request asks for one of the two
  models (uniform, seeded). A node asked for the other model answers ``404 model_not_found`` (nginx does
  not retry a 404).

- ``shared_prefix`` and ``one_prompt`` (named explicitly, not run by default): multi-turn
  chat sessions sharing per-group system prompts on four equal nodes with prefix
  caching, and one prompt shared by every request; also for ``infergate_noprefix``
  (``edge.prefix_affinity = false``), behind one and two edges. Definitions in
  bench/scheduler/prefix.py and sessions.py; records in ``scheduler_prefix.json``.

Per run the record has the fields of ``bench.scheduler`` (stats.py) plus
``ttft_p90_s`` and, for ``multi_model``, ``by_model`` (requests, ok, timeouts, errors,
404s, goodput per model). Writes ``scheduler_scenarios.json`` and
``scheduler_scenarios.meta.json`` into ``--out`` and prints the table. Load fractions
are of the scenario pool's capacity (bench/scheduler/workload.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
import redis

from controlplane import procs
from controlplane.config import NodeSettings
from controlplane.simnode import launch

from ..common import (RESULTS_DIR, BenchError, Stack, load_prompts, log, machine_info, rounded,
                      sigterm_as_interrupt, write_json)
from . import report
from .prefix import LOADS as PREFIX_LOADS
from .prefix import PREFIX_SCENARIOS, PREFIX_STRATEGIES, noprefix_base, run_prefix
from .loadgen import RunOutput, StateSamples, run_load
from .stack import (STRATEGIES, EdgeRun, InfergateStack, SimNodeProc, clear_faults,
                    infergate_settings, pool_idle, snapshot_all_healthy,
                    start_redis_and_controlplane)
from .stats import summarise
from .workload import LengthDist, PoolSpec, RequestMix, Workload, pool_capacity_rps

SCENARIOS = ("multi_edge", "mixed_sizes", "openai_nodes", "multi_model")
#: Client deadline in simulated seconds, as in bench.scheduler.
DEADLINE_SIM_S = 30.0
MODELS = ("model-a", "model-b")


@dataclass(frozen=True)
class Scenario:
    """How one scenario builds its pool, its load and its infergate node settings."""

    name: str
    spec: PoolSpec
    lengths: LengthDist = field(default_factory=LengthDist)
    dialect: str = "vllm"
    kind: str = "vllm"
    max_concurrency: int | None = None
    """``None``: twice the batch size, as bench.scheduler."""
    edges: int = 1
    models: dict[str, str] = field(default_factory=dict)
    """node -> served model (``multi_model``); empty: every node serves the default."""
    mixed_prompts: bool = False


def scenario(name: str) -> Scenario:
    """The :class:`Scenario` called ``name`` (one of :data:`SCENARIOS`)."""
    base = PoolSpec()
    if name == "multi_edge":
        return Scenario(name, base, edges=2)
    if name == "mixed_sizes":
        return Scenario(name, replace(base, kv_capacity_tokens=65536),
                        lengths=LengthDist(median=16, sigma=1.4, min_tokens=2, max_tokens=256),
                        mixed_prompts=True)
    if name == "openai_nodes":
        return Scenario(name, replace(base, n_fast=4, n_slow=0, max_running=1),
                        dialect="none", kind="openai", max_concurrency=64)
    if name == "multi_model":
        return Scenario(name, base, models={"fast-1": MODELS[0], "slow-2": MODELS[0],
                                            "fast-2": MODELS[1], "slow-1": MODELS[1]})
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def mixed_prompts(n: int, seed: int, lo_tokens: int = 50, hi_tokens: int = 8000) -> list[str]:
    """``n`` distinct prompts whose lengths are log-uniform between ``lo_tokens`` and
    ``hi_tokens`` tokens as the simnode counts them (4 characters a token)."""
    rng = random.Random(seed)
    words = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
    out = []
    for i in range(n):
        tokens = int(math.exp(rng.uniform(math.log(lo_tokens), math.log(hi_tokens))))
        text = f"q{i} " + " ".join(rng.choice(words) for _ in range(tokens))
        out.append(text[:4 * tokens])
    return out


def with_models(wl: Workload, models: tuple[str, ...], seed: int = 1) -> Workload:
    """The workload with each request's model drawn from ``models`` (uniform, seeded:
    the same requests get the same models for every strategy)."""
    rng = random.Random(seed)
    reqs = [replace(r, model=rng.choice(models)) for r in wl.requests]
    return replace(wl, requests=reqs)


def split(wl: Workload, parts: int) -> list[Workload]:
    """``wl`` dealt round-robin into ``parts`` workloads (same arrival times)."""
    return [replace(wl, requests=wl.requests[i::parts], rate_rps=wl.rate_rps / parts)
            for i in range(parts)]


def start_pool(stack: Stack, sc: Scenario, time_scale: float) -> list[SimNodeProc]:
    """The scenario's simulated nodes (free ports, control ports), started together."""
    specs = []
    for name, _speed in sc.spec.nodes():
        flags = ["--log-level", "warning", *sc.spec.simnode_flags(_speed, time_scale),
                 "--dialect", sc.dialect]
        if name in sc.models:
            flags += ["--model", sc.models[name]]
        specs.append((name, flags))
    nodes = launch.start_nodes(specs, stack.dir / "logs", into=stack, cls=SimNodeProc)
    for node, (_, speed) in zip(nodes, sc.spec.nodes(), strict=True):
        node.speed = speed
    return nodes


def start_base(stack: Stack, sc: Scenario, nodes: list[SimNodeProc],
               time_scale: float) -> InfergateStack:
    """redis-server and ``infergate controlplane`` for the scenario's node settings; waits
    for a snapshot with every node healthy (and, for ``multi_model``, every node's
    model known)."""
    def make_settings(redis_url: str):
        settings = infergate_settings(redis_url, nodes, sc.spec, time_scale, sc.max_concurrency)
        maxc = sc.max_concurrency or 2 * sc.spec.max_running
        settings.nodes = [NodeSettings(name=n.name, url=n.url, kind=sc.kind, max_concurrency=maxc)
                          for n in nodes]
        return settings

    def ready(r: redis.Redis) -> bool:
        if not snapshot_all_healthy(r, len(nodes)):
            return False
        if not sc.models:
            return True
        from controlplane.routing.wire import RoutingSnapshot
        from controlplane.redisdb import keynames

        snap = RoutingSnapshot.parse(r.get(keynames.ROUTING))
        return snap is not None and all(x.models for x in snap.nodes)

    return start_redis_and_controlplane(stack, make_settings, ready, timeout_s=90)


def _merge(runs: list[RunOutput]) -> RunOutput:
    results = sorted((r for run in runs for r in run.results), key=lambda r: r.idx)
    return RunOutput(results=results, states=runs[0].states if runs else StateSamples(),
                     duration_s=runs[0].duration_s, wall_s=max(r.wall_s for r in runs))


async def run_edges(urls: list[str], wl: Workload, deadline_s: float,
                    control_urls: dict[str, str]) -> RunOutput:
    """The workload dealt over ``urls`` (one part per edge), sent at the same time; node
    states sampled once (by the first part)."""
    parts = split(wl, len(urls))
    runs = await asyncio.gather(*(
        run_load(url, part, deadline_s, control_urls if i == 0 else {}, sample_interval_s=0.1)
        for i, (url, part) in enumerate(zip(urls, parts, strict=True))))
    return _merge(list(runs))


def by_model(results, requests_by_idx: dict[int, str | None], duration_s: float) -> dict:
    """Per model: requests, ok, timeouts, errors, not_found (404), goodput_rps."""
    out: dict[str, Counter] = {}
    for r in results:
        m = requests_by_idx.get(r.idx) or "-"
        c = out.setdefault(m, Counter())
        c["requests"] += 1
        c[r.outcome if r.outcome != "timeout" else "timeouts"] += 1
        if r.status == 404:
            c["not_found"] += 1
    return {m: {"requests": c["requests"], "ok": c["ok"], "timeouts": c["timeouts"],
                "errors": c["error"], "not_found": c["not_found"],
                "goodput_rps": rounded(c["ok"] / duration_s)} for m, c in sorted(out.items())}


def run_scenario(sc: Scenario, *, prompts: list[str], loads: list[float], strategies: list[str],
                 time_scale: float, window_sim_s: float, seed: int, keep: bool,
                 records: list[dict], out: Path) -> dict:
    """Every (load, strategy) run of one scenario; appends to ``records`` (and rewrites
    ``out/scheduler_scenarios.json`` after each run). Returns the scenario's facts."""
    ts = time_scale
    mix_prompts = mixed_prompts(2000, seed) if sc.mixed_prompts else prompts
    mix = RequestMix(mix_prompts, sc.lengths, seed=seed)
    mean_out, mean_prompt = mix.sample_means()
    cap_wall = pool_capacity_rps(sc.spec, mean_out, mean_prompt) / ts
    deadline = DEADLINE_SIM_S * ts
    window = window_sim_s * ts
    facts = {"scenario": sc.name, "capacity_wall_rps": round(cap_wall, 4),
             "mean_output_tokens": round(mean_out, 2), "mean_prompt_tokens": round(mean_prompt, 2),
             "pool": {"nodes": [n for n, _ in sc.spec.nodes()], "max_running": sc.spec.max_running,
                      "dialect": sc.dialect, "kind": sc.kind, "models": sc.models,
                      "edges": sc.edges}}
    log(f"{sc.name}: capacity {cap_wall:.2f} req/s wall, deadline {deadline:g} s, "
        f"{len(loads) * len(strategies)} runs of {window:g} s")
    with Stack(f"infergate-bench-{sc.name}-", keep=keep) as stack:
        nodes = start_pool(stack, sc, ts)
        base = (start_base(stack, sc, nodes, ts)
                if any(x.startswith("infergate") for x in strategies) else None)
        bases = {"infergate": base,
                 "infergate_noprefix": noprefix_base(base) if base else None}
        rconn = redis.Redis.from_url(base.redis_url, socket_timeout=2) if base else None
        for frac in loads:
            wl = mix.workload(frac * cap_wall, window)
            if sc.models:
                wl = with_models(wl, MODELS, seed)
            for strategy in strategies:
                clear_faults(nodes)
                procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                                 what="the simulated nodes to finish their requests")
                if rconn is not None:
                    procs.wait_until(lambda: snapshot_all_healthy(rconn, len(nodes)), 60,
                                     interval=0.1, what="every node healthy in the snapshot")
                kind = "infergate" if strategy in bases else strategy
                edges = [EdgeRun(stack, kind, nodes, ts, bases.get(strategy),
                                 f"{sc.name}-{int(frac * 100)}-{strategy}-{i}")
                         for i in range(sc.edges)]
                try:
                    run = asyncio.run(run_edges([e.url for e in edges], wl, deadline,
                                                {n.name: n.control_url for n in nodes}))
                finally:
                    for e in edges:
                        e.stop()
                rec = {"scenario": sc.name, "strategy": strategy, "load_fraction": frac,
                       "offered_rps": round(wl.rate_rps, 3), "deadline_s": deadline,
                       "time_scale": ts, "window_s": window, "edges": sc.edges,
                       "loadavg_1m": round(os.getloadavg()[0], 2)}
                rec.update(summarise(run.results, deadline_s=deadline, duration_s=window,
                                     states=run.states, max_running=sc.spec.max_running))
                rec["failures"] = rec["timeouts"] + rec["errors"]
                if sc.models:
                    rec["by_model"] = by_model(run.results, {r.idx: r.model for r in wl.requests},
                                               window)
                rec["edge_errors"] = [ln for e in edges for ln in e.error_lines(2)]
                records.append(rec)
                log(f"{sc.name} {frac * 100:.0f}% {strategy}: {rec['requests']} req, goodput "
                    f"{rec['goodput_rps']}/s, failures {rec['failures']} (timeouts "
                    f"{rec['timeouts']}, 429 {rec['rejected']}), TTFT p90 {rec['ttft_p90_s']} s "
                    f"p99 {rec['ttft_p99_s']} s")
                write_json(out / "scheduler_scenarios.json", records)
    return facts


def _floats(value: str) -> list[float]:
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated numbers, e.g. 0.9,1.05") from None
    if not out or any(x <= 0 or x > 5 for x in out):
        raise click.BadParameter("load fractions must be within (0, 5]")
    return out


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: one load (0.9), short windows, "
              "time scale 0.1.")
@click.option("--scenarios", "names", default=",".join(SCENARIOS), show_default=True,
              help="Comma list of scenarios.")
@click.option("--strategies", default=None,
              help=f"Comma list of strategies [default {','.join(STRATEGIES)}; the prefix "
              f"scenarios also infergate_noprefix, which any scenario can be given].")
@click.option("--prefix-edges", default="1,2", show_default=True,
              help="Edge counts each strategy of the prefix scenarios runs with.")
@click.option("--loads", default=None,
              help="Load fractions of the pool capacity [default 0.5,0.9,1.05,1.2; --quick 0.9; "
              "shared_prefix 0.6,0.8,0.95, --quick 0.8].")
@click.option("--time-scale", type=click.FloatRange(0.02, 2.0), default=None,
              help="Wall seconds per simulated second [default 0.2; --quick and the prefix "
              "scenarios 0.1].")
@click.option("--window", "window_sim_s", type=click.FloatRange(5, 3600), default=None,
              help="Arrival window per run, simulated seconds [default 120; --quick 20; "
              "shared_prefix: every session, one_prompt 120; --quick 60 and 40].")
@click.option("--prompts", "prompts_path", type=click.Path(), default=None,
              help="Prompt source as for bench.scheduler [default: ../shared/data/cache-eval].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the scratch folders.")
def main(quick: bool, names: str, strategies: str | None, prefix_edges: str, loads: str | None,
         time_scale: float | None, window_sim_s: float | None, prompts_path: str | None,
         out_dir: str, seed: int, keep: bool) -> None:
    """Run the multi_edge, mixed_sizes, openai_nodes and multi_model scenarios (and, when
    named, the prefix-cache scenarios shared_prefix and one_prompt of prefix.py)."""
    chosen = [x.strip() for x in names.split(",") if x.strip()]
    prefix_chosen = [x for x in chosen if x in PREFIX_SCENARIOS]
    chosen = [x for x in chosen if x not in PREFIX_SCENARIOS]
    allowed = PREFIX_STRATEGIES
    strats = ([x.strip() for x in strategies.split(",") if x.strip()] if strategies
              else list(PREFIX_STRATEGIES if prefix_chosen else STRATEGIES))
    bad = [x for x in chosen if x not in SCENARIOS] + [x for x in strats if x not in allowed]
    if bad or not (chosen or prefix_chosen) or not strats:
        raise click.BadParameter(f"unknown scenario or strategy: {bad}")
    if prefix_chosen:
        try:
            edge_counts = [int(x) for x in prefix_edges.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter("--prefix-edges: expected e.g. 1,2") from None
        if not edge_counts or any(e < 1 or e > 4 for e in edge_counts):
            raise click.BadParameter("--prefix-edges: edge counts within 1-4")
        try:
            run_prefix(prefix_chosen, strategies=strats,
                       loads=_floats(loads) if loads else ([0.8] if quick else list(PREFIX_LOADS)),
                       edge_counts=edge_counts, time_scale=time_scale, window_sim_s=window_sim_s,
                       quick=quick, seed=seed, keep=keep, out=Path(out_dir))
        except (procs.StartError, BenchError) as exc:
            raise click.ClickException(str(exc)) from None
        if not strategies:
            strats = list(STRATEGIES)
        if not chosen or not strats:
            return
    ts = time_scale or (0.1 if quick else 0.2)
    window = window_sim_s or (20.0 if quick else 120.0)
    load_list = _floats(loads) if loads else ([0.9] if quick else [0.5, 0.9, 1.05, 1.2])
    try:
        prompts = load_prompts(prompts_path)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    out = Path(out_dir)
    meta = {"benchmark": "scheduler_scenarios", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.scheduler.scenarios", *sys.argv[1:]]),
            "machine": machine_info(), "time_scale": ts, "window_sim_s": window,
            "deadline_sim_s": DEADLINE_SIM_S, "seed": seed, "loads": load_list, "scenarios": []}
    records: list[dict] = []
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt():
            for name in chosen:
                meta["scenarios"].append(run_scenario(
                    scenario(name), prompts=prompts, loads=load_list, strategies=strats,
                    time_scale=ts, window_sim_s=window, seed=seed, keep=keep,
                    records=records, out=out))
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        if records:
            write_json(out / "scheduler_scenarios.json", records)
        sys.exit(130)
    except (procs.StartError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "scheduler_scenarios.json", records)
    write_json(out / "scheduler_scenarios.meta.json", meta)
    print(report.table(records))
    for r in records:
        if "by_model" in r:
            print(f"{r['scenario']} {r['load_fraction'] * 100:.0f}% {r['strategy']}: "
                  + "; ".join(f"{m}: ok {v['ok']}, 404 {v['not_found']}, timeouts "
                              f"{v['timeouts']}" for m, v in r["by_model"].items()))
    print(f"{meta['elapsed_s']} s elapsed; wrote {out / 'scheduler_scenarios.json'}")


if __name__ == "__main__":
    main()
