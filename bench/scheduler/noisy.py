"""``python -m bench.scheduler.noisy [--duration S] [--time-scale X] [--out DIR]``

Scenario ``noisy_tenant`` of the scheduler benchmark: a noisy neighbour on a shared
pool. Two equal simulated nodes (batch 4, every request 16 output tokens and a short
prompt, so every request is worth the same tokens), their slots known (``max_concurrency``
= the batch: a node never queues, the edge does). Four quiet tenants send at a steady
rate r each (evenly spaced, 10 % jitter) and one noisy tenant at 10 r, 14 r = 120 % of
the pool's capacity;
each tenant has its own API key. Runs, on the same arrivals (fixed seed):

- ``baseline``: the quiet tenants alone (infergate, fair share on);
- ``least_conn``: plain nginx ``least_conn`` (the nodes queue what they cannot run);
- ``fair_off`` / ``fair_on``: infergate with ``admission.fair_share`` off (one FIFO
  queue at the edge) and on;
- ``fair_off_2edges`` / ``fair_on_2edges``: two edges sharing Redis, requests split
  between them alternately; each edge then has half of every node's slots
  (``max_concurrency`` = batch / 2, so the two together fill the batch exactly);
- ``critical``: fair share on, quiet tenant ``q1``'s key in class ``critical``, the
  noisy tenant and the other quiet ones ``standard`` (the noisy one floods).

Per run and tenant: sent, ok, 429s, goodput, TTFT p50/p99 (ok requests), served tokens;
per 10 s window Jain's index over served tokens among backlogged tenants, the largest
difference between two of them, and the max-min Jain (bench/scheduler/noisy_stats.py).
Writes ``noisy_tenant.json`` (runs + meta: load average before and after, the machine)
into ``--out`` and prints the table and the targets as ratios within this run.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import click
import redis

from controlplane.admin import apikeys

from ..common import RESULTS_DIR, Stack, format_table, log, machine_info, sigterm_as_interrupt, write_json
from .loadgen import StateSamples, sample_states
from .noisy_stats import Outcome, summarise
from .stack import (EdgeRun, InfergateStack, infergate_settings, snapshot_all_healthy,
                    start_pool, start_redis_and_controlplane)
from .workload import PoolSpec, pool_capacity_rps, prompt_tokens

QUIET = ("q1", "q2", "q3", "q4")
NOISY = "noisy"
NOISY_FACTOR = 10
LOAD = 1.2
OUTPUT_TOKENS = 16
PROMPT = "Tell me about the weather in a few words please."
WINDOW_S = 10.0
SPEC = PoolSpec(n_fast=2, n_slow=0, max_running=4)
RUNS = ("baseline", "least_conn", "fair_off", "fair_on", "fair_off_2edges", "fair_on_2edges",
        "critical")


def arrivals(rate_quiet: float, duration_s: float, with_noisy: bool,
             seed: int = 7) -> list[tuple[float, str]]:
    """(send time s, tenant) of the load, sorted: every tenant at a steady rate (evenly
    spaced sends from a random phase, each moved by up to 10 % of the gap)."""
    rng = random.Random(seed)
    out = []
    rates = {t: rate_quiet for t in QUIET}
    if with_noisy:
        rates[NOISY] = NOISY_FACTOR * rate_quiet
    for tenant, rate in rates.items():
        gap = 1.0 / rate
        t = rng.uniform(0, gap)
        while t < duration_s:
            out.append((max(0.0, t + rng.uniform(-0.1, 0.1) * gap), tenant))
            t += gap
    return sorted(out)


async def _one(session: aiohttp.ClientSession, url: str, key: str | None, tenant: str,
               at: float, t0: float, deadline_s: float) -> Outcome:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + at - loop.time()))
    start = loop.time()
    res = Outcome(tenant=tenant, sent_s=start - t0, status=None, ok=False)
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": OUTPUT_TOKENS, "sim_output_tokens": OUTPUT_TOKENS}
    headers = {"Cache-Control": "no-cache"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url, json=body, headers=headers) as resp:
                res.status = resp.status
                if resp.status != 200:
                    await resp.read()
                    return res
                async for line in resp.content:
                    if res.ttft_s is None and line.startswith(b"data:") and b'"content":"' in line \
                            and b'"content":""' not in line:
                        res.ttft_s = loop.time() - start
                    if line.startswith(b"data: [DONE]"):
                        res.ok = True
                        res.end_s = loop.time() - t0
                        res.tokens = prompt_tokens(PROMPT) + OUTPUT_TOKENS
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    return res


async def _drive(urls: list[str], keys: dict[str, str], load: list[tuple[float, str]],
                 deadline_s: float, control: dict[str, str],
                 duration_s: float) -> tuple[list[Outcome], float | None]:
    """The outcomes, and the nodes' mean batch use (running / batch) while load is sent."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.5
        tasks = [_one(session, urls[i % len(urls)], keys.get(tenant), tenant, at, t0, deadline_s)
                 for i, (at, tenant) in enumerate(load)]
        stop, states = asyncio.Event(), StateSamples()

        async def window() -> None:
            await asyncio.sleep(max(0.0, t0 + WINDOW_S / 2 - loop.time()))  # past the ramp
            sampler = asyncio.create_task(sample_states(session, control, 0.1, stop, states))
            await asyncio.sleep(max(0.0, t0 + duration_s - loop.time()))
            stop.set()
            await sampler

        outs, _ = await asyncio.gather(asyncio.gather(*tasks), window())
        xs = [x for v in states.running.values() for x in v]
        use = sum(xs) / len(xs) / SPEC.max_running if xs else None
        return list(outs), use


def _base(stack: Stack, nodes, ts: float, slots: int, keys_out: dict[str, str],
          critical: bool = False) -> InfergateStack:
    def make(url: str):
        s = infergate_settings(url, nodes, SPEC, ts, max_concurrency=slots)
        s.auth.mode = "required"
        s.admission.tenant_queue_max = 256
        return s

    base = start_redis_and_controlplane(stack, make, lambda r: snapshot_all_healthy(r, len(nodes)))
    r = redis.Redis.from_url(base.redis_url, decode_responses=True)
    for t in (*QUIET, NOISY):
        keys_out[t], _ = apikeys.create_key(r, t)
    keys_out["q1-critical"], _ = apikeys.create_key(r, "q1", priority="critical")
    return base


def _run(name: str, urls: list[str], keys: dict[str, str], load, ts: float,
         duration_s: float, nodes) -> dict:
    log(f"noisy_tenant: {name} ({len(load)} requests over {duration_s:g} s)")
    before = os.getloadavg()[0]
    outs, use = asyncio.run(_drive(urls, keys, load, 30.0 * ts + 5,
                                   {n.name: n.control_url for n in nodes}, duration_s))
    rec = summarise(outs, duration_s, WINDOW_S,
                    {t: prompt_tokens(PROMPT) + OUTPUT_TOKENS for t in (*QUIET, NOISY)})
    rec.update(run=name, load_average_1m=[round(before, 2), round(os.getloadavg()[0], 2)],
               batch_use=round(use, 3) if use is not None else None)
    return rec


def _edges(stack: Stack, base: InfergateStack, nodes, ts: float, n: int, fair: bool,
           tag: str) -> list[EdgeRun]:
    s = base.settings.model_copy(deep=True)
    s.admission.fair_share = fair
    b = replace(base, settings=s)
    return [EdgeRun(stack, "infergate", nodes, ts, b, f"{tag}-{i}") for i in range(n)]


def run_all(duration_s: float, ts: float, only: tuple[str, ...]) -> dict:
    """Every run of :data:`RUNS` named in ``only`` (all when empty); the records."""
    cap = pool_capacity_rps(SPEC, OUTPUT_TOKENS, prompt_tokens(PROMPT)) / ts
    rate = LOAD * cap / (len(QUIET) + NOISY_FACTOR)
    full = arrivals(rate, duration_s, True)
    quiet_only = arrivals(rate, duration_s, False)
    want = set(only or RUNS)
    runs: dict[str, dict] = {}
    with sigterm_as_interrupt(), Stack(prefix="infergate-noisy-") as stack:
        nodes = start_pool(stack, SPEC, ts)
        keys: dict[str, str] = {}
        base = _base(stack, nodes, ts, SPEC.max_running, keys)
        if "least_conn" in want:
            e = EdgeRun(stack, "least_conn", nodes, ts, None, "least_conn")
            runs["least_conn"] = _run("least_conn", [e.url], {}, full, ts, duration_s, nodes)
            e.stop()
        for name, fair, load, k in (("baseline", True, quiet_only, keys),
                                    ("fair_off", False, full, keys),
                                    ("fair_on", True, full, keys),
                                    ("critical", True, full, {**keys, "q1": keys["q1-critical"]})):
            if name in want:
                (e,) = _edges(stack, base, nodes, ts, 1, fair, name)
                runs[name] = _run(name, [e.url], k, load, ts, duration_s, nodes)
                e.stop()
        if want & {"fair_off_2edges", "fair_on_2edges"}:
            for m in base.managed:
                m.stop()
            keys2: dict[str, str] = {}
            base2 = _base(stack, nodes, ts, SPEC.max_running // 2, keys2)
            for name, fair in (("fair_off_2edges", False), ("fair_on_2edges", True)):
                if name in want:
                    es = _edges(stack, base2, nodes, ts, 2, fair, name)
                    runs[name] = _run(name, [e.url for e in es], keys2, full, ts, duration_s, nodes)
                    for e in es:
                        e.stop()
    return {"capacity_rps": round(cap, 3), "rate_quiet_rps": round(rate, 3),
            "runs": [runs[n] for n in RUNS if n in runs]}


COLUMNS = [("run", "run"), ("tenant", "tenant"), ("sent", "sent"), ("ok", "ok"),
           ("r429", "429"), ("goodput_rps", "goodput/s"), ("ttft_p50_s", "TTFT p50 s"),
           ("ttft_p99_s", "TTFT p99 s"), ("served_tokens", "served tok")]
RUN_COLUMNS = [("run", "run"), ("goodput_rps", "goodput/s"), ("batch_use", "batch use"),
               ("r429", "429"),
               ("quiet_ttft_p99_s", "quiet TTFT p99 s"), ("jain_min", "Jain (worst 10 s)"),
               ("max_backlogged_diff", "max diff tok"), ("maxmin_jain_min", "max-min Jain"),
               ("load", "load avg")]


def quiet_p99(rec: dict, tenants: tuple[str, ...] = QUIET) -> float | None:
    """The highest TTFT p99 among ``tenants`` in a run."""
    xs = [rec["tenants"][t]["ttft_p99_s"] for t in tenants
          if t in rec["tenants"] and rec["tenants"][t]["ttft_p99_s"] is not None]
    return max(xs) if xs else None


def table_text(data: dict) -> str:
    """The tables and the targets (ratios within the run) as printed."""
    runs = data["runs"]
    rows = [{"run": r["run"], "tenant": t, **v} for r in runs for t, v in r["tenants"].items()]
    summary = [{**r, "quiet_ttft_p99_s": quiet_p99(r),
                "load": "-".join(str(x) for x in r["load_average_1m"])} for r in runs]
    by = {r["run"]: r for r in runs}
    lines = [format_table(summary, RUN_COLUMNS), "", format_table(rows, COLUMNS), ""]
    lines += targets(by)
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def targets(by: dict[str, dict]) -> list[str]:
    """The targets of the scenario, as measured ratios."""
    out = []
    base = quiet_p99(by["baseline"]) if "baseline" in by else None
    for name in ("fair_on", "fair_on_2edges", "fair_off", "least_conn"):
        if name in by:
            out.append(f"{name}: quiet TTFT p99 / baseline = {_ratio(quiet_p99(by[name]), base)} "
                       f"(target <= 1.5 with fair share on)")
    for on, off in (("fair_on", "fair_off"), ("fair_on_2edges", "fair_off_2edges")):
        if on in by and off in by:
            out.append(f"{on}: goodput / {off} = "
                       f"{_ratio(by[on]['goodput_rps'], by[off]['goodput_rps'])} (target >= 0.95)")
    if "fair_on" in by and "fair_on_2edges" in by:
        out.append("two edges / one edge: goodput "
                   f"{_ratio(by['fair_on_2edges']['goodput_rps'], by['fair_on']['goodput_rps'])}, "
                   f"quiet TTFT p99 {_ratio(quiet_p99(by['fair_on_2edges']), quiet_p99(by['fair_on']))}"
                   " (target within 10 %)")
    if "critical" in by and base:
        out.append(f"critical: q1 (critical) TTFT p99 / baseline quiet = "
                   f"{_ratio(quiet_p99(by['critical'], ('q1',)), base)} (target <= 1.1)")
    return out


@click.command()
@click.option("--duration", "duration_s", default=40.0, show_default=True,
              help="Wall seconds of load per run.")
@click.option("--time-scale", "ts", default=0.2, show_default=True,
              help="Wall seconds per simulated second of the nodes.")
@click.option("--runs", "only", default="", help=f"Comma-separated subset of {', '.join(RUNS)}.")
@click.option("--out", "out_dir", default=str(RESULTS_DIR), show_default=True)
def main(duration_s: float, ts: float, only: str, out_dir: str) -> None:
    """Run the noisy_tenant scenario and write noisy_tenant.json."""
    started = time.time()
    before = os.getloadavg()
    data = run_all(duration_s, ts, tuple(x for x in only.split(",") if x))
    data["meta"] = {"command": "python -m bench.scheduler.noisy", "generated_at": started,
                    "duration_s": duration_s, "time_scale": ts, "window_s": WINDOW_S,
                    "loadavg_before": [round(x, 2) for x in before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "machine": machine_info(), "pool": {"nodes": 2, "batch": SPEC.max_running,
                                                        "output_tokens": OUTPUT_TOKENS}}
    p = write_json(Path(out_dir) / "noisy_tenant.json", data)
    print(table_text(data))
    log(f"wrote {p}")


if __name__ == "__main__":
    main()
