"""``python -m bench.scheduler [--quick] [--prompts PATH] [--out DIR]``

Compares nginx round-robin, nginx least_conn and the infergate balancer on a simulated
pool of four nodes (two fast, two three times slower) under the same open-loop Poisson
load at several fractions of the pool's capacity, then with one fast node turning
faulty mid-run. Writes ``scheduler.json`` (records), ``scheduler.meta.json`` (machine,
parameters) and ``scheduler.png`` into ``--out`` and prints a table. Method and
definitions: bench/README.md, bench/scheduler/workload.py and stats.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import click
import redis

from controlplane import procs

from ..common import (RESULTS_DIR, comma_names, BenchError, Stack, load_prompts, log, machine_info,
                      sigterm_as_interrupt, write_json)
from . import report
from .loadgen import Result, run_load
from .stack import (STRATEGIES, EdgeRun, clear_faults, pool_idle, snapshot_all_healthy,
                    start_infergate_base, start_pool)
from .stats import summarise
from .workload import (LengthDist, PoolSpec, RequestMix, Workload, pool_capacity_rps,
                       spec_dict)

#: Client deadline in simulated seconds (the wall deadline is this x time scale).
DEADLINE_SIM_S = 30.0
#: Node that turns faulty in the fault scenarios, and when (fraction of the window).
FAULTY_NODE = "fast-1"
FAULT_AT = 1 / 3
FAULTS = {"node_errors": {"error_rate": 1.0}, "node_hang": {"hang": True}}


def _floats(value: str) -> list[float]:
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected comma-separated numbers, e.g. 0.5,0.9,1.2") from None
    if not out or any(x <= 0 or x > 5 for x in out):
        raise click.BadParameter("load fractions must be within (0, 5]")
    return out


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run (about a minute): 2 loads, 1 fault "
              "scenario, short windows, time scale 0.1.")
@click.option("--prompts", "prompts_path", type=click.Path(), default=None,
              help="Prompt source: a folder laid out like shared/data/cache-eval, or a text "
              "file with one prompt per line [default: ../shared/data/cache-eval].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True, help="Folder for scheduler.json, scheduler.meta.json and scheduler.png.")
@click.option("--time-scale", type=click.FloatRange(0.02, 2.0), default=None,
              help="Wall seconds per simulated second [default 0.2; --quick 0.1].")
@click.option("--window", "window_sim_s", type=click.FloatRange(5, 3600), default=None,
              help="Arrival window of each run, simulated seconds [default 120; --quick 30].")
@click.option("--loads", default=None, help="Load fractions of the pool capacity for the "
              "steady scenario [default 0.5,0.75,0.9,1.05,1.2; --quick 0.6,1.1].")
@click.option("--fault-load", type=click.FloatRange(0.05, 5), default=0.5, show_default=True,
              help="Load fraction (of the whole pool's capacity) of the fault scenarios; "
              "0.5 is 80 %% of what remains without the faulty fast node.")
@click.option("--scenarios", default=None, help="Comma list of steady,node_errors,node_hang "
              "[default all three; --quick steady,node_hang].")
@click.option("--strategies", default=",".join(STRATEGIES), show_default=True,
              help="Comma list of strategies to run.")
@click.option("--max-concurrency", type=click.IntRange(1, 100000), default=None,
              help="max_concurrency of every node for the infergate balancer and its load "
              "shedding [default: twice the batch size].")
@click.option("--seed", type=int, default=7, show_default=True, help="Seed of the load.")
@click.option("--keep", is_flag=True, help="Keep the scratch folder (configs, logs).")
@click.option("--per-request", is_flag=True, help="Also write requests-<run>.jsonl per run "
              "in --out: one line per request (arrival s, output tokens, outcome, status, "
              "e2e and TTFT s, node), to see which requests failed and where.")
def main(quick: bool, prompts_path: str | None, out_dir: str, time_scale: float | None,
         window_sim_s: float | None, loads: str | None, fault_load: float,
         scenarios: str | None, strategies: str, max_concurrency: int | None, seed: int,
         keep: bool, per_request: bool) -> None:
    """Benchmark the infergate balancer against nginx round-robin and least_conn."""
    ts = time_scale or (0.1 if quick else 0.2)
    window = window_sim_s or (30.0 if quick else 120.0)
    load_list = _floats(loads) if loads else ([0.6, 1.1] if quick else [0.5, 0.75, 0.9, 1.05, 1.2])
    scen = comma_names(scenarios, ("steady", *FAULTS), "scenario") if scenarios else (
        ["steady", "node_hang"] if quick else ["steady", *FAULTS])
    strats = comma_names(strategies, STRATEGIES, "strategy")
    try:
        prompts = load_prompts(prompts_path)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None

    spec = PoolSpec()
    lengths = LengthDist()
    mix = RequestMix(prompts, lengths, seed=seed)
    mean_out, mean_prompt = mix.sample_means()
    cap_sim = pool_capacity_rps(spec, mean_out, mean_prompt)
    cap_wall = cap_sim / ts
    deadline = DEADLINE_SIM_S * ts
    window_wall = window * ts
    plan: list[tuple[str, float, str]] = []
    if "steady" in scen:
        plan += [("steady", f, s) for f in load_list for s in strats]
    plan += [(sc, fault_load, s) for sc in scen if sc != "steady" for s in strats]

    out = Path(out_dir)
    meta = {
        "benchmark": "scheduler",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench.scheduler", *sys.argv[1:]]),
        "machine": machine_info(),
        "time_scale": ts,
        "deadline_s": deadline,
        "deadline_sim_s": DEADLINE_SIM_S,
        "window_s": window_wall,
        "window_sim_s": window,
        "seed": seed,
        "prompts": str(prompts_path or "default cache-eval folder"),
        "prompt_count": len(prompts),
        "mean_output_tokens": round(mean_out, 3),
        "mean_prompt_tokens": round(mean_prompt, 3),
        "capacity_sim_rps": round(cap_sim, 4),
        "capacity_wall_rps": round(cap_wall, 4),
        **spec_dict(spec, lengths),
        "max_concurrency": max_concurrency or 2 * spec.max_running,
        "faulty_node": FAULTY_NODE,
        "fault_at_s": round(window_wall * FAULT_AT, 3),
        "faults": FAULTS,
        "plan": [{"scenario": a, "load_fraction": b, "strategy": c} for a, b, c in plan],
    }
    log(f"pool capacity {cap_sim:.3f} req/s simulated = {cap_wall:.2f} req/s wall "
        f"(E[output] {mean_out:.1f} tokens, E[prompt] {mean_prompt:.1f} tokens, time scale {ts:g}); "
        f"deadline {deadline:g} s wall; {len(plan)} runs of {window_wall:g} s + drain")

    records: list[dict] = []
    t_start = time.monotonic()
    try:
        with sigterm_as_interrupt(), Stack("infergate-bench-sched-", keep=keep) as stack:
            nodes = start_pool(stack, spec, ts)
            base = (start_infergate_base(stack, nodes, spec, ts, max_concurrency)
                    if "infergate" in strats else None)
            rconn = redis.Redis.from_url(base.redis_url, socket_timeout=2) if base else None
            workloads = {}
            for i, (scenario, frac, strategy) in enumerate(plan, 1):
                if frac not in workloads:
                    workloads[frac] = mix.workload(frac * cap_wall, window_wall)
                wl = workloads[frac]
                clear_faults(nodes)
                procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                                 what="the simulated nodes to finish their requests")
                if rconn is not None:
                    procs.wait_until(lambda: snapshot_all_healthy(rconn, len(nodes)), 60,
                                     interval=0.1, what="every node healthy in the snapshot")
                edge = EdgeRun(stack, strategy, nodes, ts, base, f"{i:02d}-{scenario}-{strategy}")
                on_time = []
                faulty: list[str] = []
                if scenario in FAULTS:
                    bad = next(n for n in nodes if n.name == FAULTY_NODE)
                    faulty = [bad.name]
                    fault = FAULTS[scenario]

                    async def inject(bad=bad, fault=fault) -> None:
                        await asyncio.to_thread(bad.set_faults, **fault)
                    on_time.append((window_wall * FAULT_AT, inject))
                try:
                    run = asyncio.run(run_load(edge.url, wl, deadline,
                                               {n.name: n.control_url for n in nodes},
                                               sample_interval_s=0.1, on_time=on_time))
                finally:
                    edge.stop()
                    clear_faults(nodes)
                rec = {"scenario": scenario, "strategy": strategy, "load_fraction": frac,
                       "offered_rps": round(wl.rate_rps, 3), "deadline_s": deadline,
                       "time_scale": ts, "window_s": window_wall,
                       "loadavg_1m": round(os.getloadavg()[0], 2)}
                rec.update(summarise(run.results, deadline_s=deadline, duration_s=window_wall,
                                     states=run.states, max_running=spec.max_running,
                                     faulty=faulty))
                rec["edge_errors"] = edge.error_lines(3)
                if per_request:
                    write_requests(out / f"requests-{i:02d}-{scenario}-{frac:g}-{strategy}.jsonl",
                                   wl, run.results)
                records.append(rec)
                log(f"[{i}/{len(plan)}] {scenario} {frac * 100:.0f}% {strategy}: "
                    f"{rec['requests']} req, p50 {rec['p50_s']} s, p99 {rec['p99_s']} s, "
                    f"TTFT p99 {rec['ttft_p99_s']} s, timeouts {rec['timeout_rate'] * 100:.1f}%, "
                    f"errors {rec['error_rate'] * 100:.1f}%, goodput {rec['goodput_rps']}/s, "
                    f"imbalance {rec['imbalance']}, send lag p99 {rec['send_lag_p99_s']} s")
                write_json(out / "scheduler.json", records)
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        if records:
            write_json(out / "scheduler.json", records)
        sys.exit(130)
    except (procs.StartError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None

    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    write_json(out / "scheduler.json", records)
    write_json(out / "scheduler.meta.json", meta)
    png = report.plot(records, out / "scheduler.png",
                      title=f"{spec.n_fast} fast + {spec.n_slow} slow (x{spec.fast_speed / spec.slow_speed:.0f}) "
                      f"simulated nodes, time scale {ts:g}, deadline {deadline:g} s wall; "
                      f"{meta['machine']['nproc']} CPUs")
    print(report.table(records))
    print(f"\npool capacity {cap_wall:.2f} req/s wall ({cap_sim:.3f}/s simulated); deadline "
          f"{deadline:g} s wall ({DEADLINE_SIM_S:g} s simulated); {meta['elapsed_s']} s elapsed")
    print(f"wrote {out / 'scheduler.json'}, {out / 'scheduler.meta.json'}, {png}")


def write_requests(path: Path, wl: Workload, results: list[Result]) -> None:
    """One JSON object per line for each request of a run: idx, at_s (planned arrival,
    wall s from the run start), output_tokens, outcome ("ok" | "timeout" | "error"),
    status, e2e_s, ttft_s (wall s), node."""
    path.parent.mkdir(parents=True, exist_ok=True)
    by_idx = {r.idx: r for r in wl.requests}
    with path.open("w") as fh:
        for res in results:
            req = by_idx.get(res.idx)
            fh.write(json.dumps({
                "idx": res.idx, "at_s": req and round(req.at_s, 4),
                "output_tokens": req and req.output_tokens, "outcome": res.outcome,
                "status": res.status, "e2e_s": res.e2e_s, "ttft_s": res.ttft_s,
                "node": res.node}) + "\n")


if __name__ == "__main__":
    main()
