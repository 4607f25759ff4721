"""``python -m bench.admission [--quick] [--load 2.0] [--time-scale 0.25] [--window S]``

Admission control under overload. A simulated pool (two ``infergate simnode`` nodes,
batch of ``max_running`` sequences, time-scaled) behind Redis, the control plane and
one infergate edge receives the same open-loop Poisson load of non-streaming requests
at ``--load`` times the pool's capacity (capacity formula: bench/scheduler/workload.py),
twice: with load shedding on (``[admission] shed = true``) and off. Everything else is
the same: each node takes ``max_concurrency = max_running + --queue`` requests from the
edge, the control plane marks a node saturated at ``--queue`` waiting requests
(``[scoring] saturation_queue``), the edge's deadline is 30 simulated seconds
(``[deadlines] request_ms``) and the client gives up 2 s after it.

Reported per run (definitions in bench/admission/summary.py): timeout rate (504 at the
deadline or no answer; target with shedding: under 1 %), shed rate (429
``server_overloaded``), p50/p99 latency of the admitted (not shed) requests (target with
shedding: p99 under the deadline), goodput, how fast a 429 came, node-side cancels.
Writes ``admission.json`` (meta + both records + the checks) into ``--out`` and prints a
table. Exit status 1 when the shedding run misses a target.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import click
import redis
import requests
import tomli_w

from controlplane import procs
from controlplane.config import Settings, settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx

from ..common import (RESULTS_DIR, BenchError, Stack, format_table, load_prompts, log,
                      machine_info, sigterm_as_interrupt, write_json)
from ..scheduler.stack import SimNodeProc, pool_idle, snapshot_all_healthy, start_pool
from ..scheduler.workload import LengthDist, PoolSpec, RequestMix, pool_capacity_rps, spec_dict
from .loadgen import run_load
from .summary import summarise

#: Edge deadline in simulated seconds (wall = this x time scale).
DEADLINE_SIM_S = 30.0
#: The client waits this much longer than the edge's deadline (wall seconds).
CLIENT_MARGIN_S = 2.0
#: Prompts when the shared data folder is missing.
SYNTHETIC_PROMPTS = [f"Question {i}: " + "explain how load balancing works " * (1 + i % 6)
                     for i in range(200)]


def bench_settings(redis_url: str, nodes: list[SimNodeProc], spec: PoolSpec, ts: float,
                   queue: int, shed: bool) -> Settings:
    """Settings of the stack: time constants scaled by ``ts`` (as in bench.scheduler),
    auth and rate limits off, the response cache off, shedding ``shed``."""
    data: dict = {
        "redis": {"url": redis_url},
        "edge": {
            "metrics_listen": "",  # no fixed port: nothing scrapes it here
            "workers": 1, "sync_interval_s": max(0.02, 0.5 * ts), "stale_after_s": 10.0 * ts,
            "connect_timeout_ms": 2000, "read_timeout_ms": int(60000 * ts),
            "send_timeout_ms": int(60000 * ts), "retry_window_s": 60.0 * ts,
            "breaker_cooldown_s": 10.0 * ts,
        },
        "controlplane": {"poll_interval_s": max(0.05, 1.0 * ts), "poll_timeout_s": 0.8,
                         "leader_ttl_s": 5.0, "slow_start_s": 30.0 * ts},
        "scoring": {"latency_norm_s": 30.0 * ts, "saturation_queue": float(queue)},
        "auth": {"mode": "off"},
        "limits": {"enabled": False},
        "admission": {"shed": shed},
        "deadlines": {"request_ms": int(DEADLINE_SIM_S * ts * 1000)},
        "nodes": [{"name": n.name, "url": n.url, "kind": "vllm",
                   "max_concurrency": spec.max_running + queue} for n in nodes],
    }
    if "cache" in Settings.model_fields:
        data["cache"] = {"enabled": False}
    return settings_from_dict(data, "admission benchmark")


def start_base(stack: Stack, nodes: list[SimNodeProc], spec: PoolSpec, ts: float,
               queue: int) -> tuple[str, redis.Redis]:
    """redis-server and ``infergate controlplane``; waits for a snapshot with every node
    healthy. Returns the Redis URL and a client."""
    rport = procs.free_port()
    stack.add(procs.start_redis(stack.dir / "redis", rport))
    url = f"redis://127.0.0.1:{rport}/0"
    s = bench_settings(url, nodes, spec, ts, queue, shed=True)
    cport = procs.free_port()
    s.controlplane.listen = f"127.0.0.1:{cport}"
    cfg = stack.dir / "infergate.toml"
    cfg.write_text(tomli_w.dumps(s.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
    cp = stack.add(procs.Managed("controlplane", procs.infergate_argv("controlplane", "--config", str(cfg)),
                                 stack.dir / "logs" / "controlplane.log").start())
    r = redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)
    cp.wait_ready(lambda: snapshot_all_healthy(r, len(nodes)), timeout=60)
    return url, r


def edge_status(base_url: str) -> dict:
    res = requests.get(f"{base_url}/infergate/status", timeout=5)
    res.raise_for_status()
    return res.json()


def run_scenario(stack: Stack, settings: Settings, nodes: list[SimNodeProc], workload,
                 deadline_s: float, name: str) -> dict:
    """One nginx edge with ``settings``, the load, the record."""
    port = procs.free_port()
    base_url = f"http://127.0.0.1:{port}"
    d = stack.dir / "runs" / name
    rendered = render_nginx(settings, d / "conf", listen=f"127.0.0.1:{port}", prefix=d / "prefix",
                            source="admission benchmark")
    edge = start_nginx(rendered.nginx_conf, rendered.prefix)
    try:
        procs.wait_until(lambda: edge_status(base_url)["snapshot"]["source"] == "redis"
                         and all(n["eligible"] for n in edge_status(base_url)["nodes"]),
                         30, what="edge to route on the snapshot")
        cancelled0 = sum(n.state()["cancelled_total"] for n in nodes)
        results, wall = asyncio.run(run_load(f"{base_url}/v1/chat/completions", workload,
                                             deadline_s + CLIENT_MARGIN_S))
        counters = edge_status(base_url)["admission"]
        procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                         what="the simulated nodes to finish")
        cancelled = sum(n.state()["cancelled_total"] for n in nodes) - cancelled0
    finally:
        edge.stop()
    errors = [ln for ln in rendered.error_log.read_text(errors="replace").splitlines()
              if "[alert]" in ln or "[crit]" in ln or "[emerg]" in ln][:3]
    rec = summarise(results, wall, deadline_s)
    rec.update({"edge_shed": counters["shed"], "edge_deadline_exceeded": counters["deadline_exceeded"],
                "node_cancels": cancelled, "wall_s": round(wall, 1), "edge_alerts": errors,
                "loadavg_1m": round(os.getloadavg()[0], 2)})
    return rec


COLUMNS = [("shedding", "shedding"), ("offered_rps", "offered/s"), ("requests", "requests"),
           ("ok", "ok"), ("shed_pct", "shed %"), ("timeout_pct", "timeouts %"),
           ("error_pct", "errors %"), ("p50_s", "p50 s"), ("p99_s", "p99 s (admitted)"),
           ("goodput_rps", "goodput/s"), ("shed_p99_s", "429 p99 s"), ("node_cancels", "node cancels")]


@click.command()
@click.option("--quick", is_flag=True, help="Short windows (about a minute in all).")
@click.option("--load", "load", type=click.FloatRange(0.1, 10), default=2.0, show_default=True,
              help="Offered load as a multiple of the pool's capacity.")
@click.option("--time-scale", type=click.FloatRange(0.05, 2.0), default=0.25, show_default=True,
              help="Wall seconds per simulated second.")
@click.option("--window", "window_s", type=click.FloatRange(3, 3600), default=None,
              help="Arrival window of each run, wall seconds [default 40; --quick 12].")
@click.option("--queue", type=click.IntRange(0, 1000), default=4, show_default=True,
              help="Requests each node may queue beyond its batch before it counts as full.")
@click.option("--prompts", "prompts_path", type=click.Path(), default=None,
              help="Prompt source (folder like shared/data/cache-eval or a text file) "
              "[default: ../shared/data/cache-eval, else built-in prompts].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True, help="Folder for admission.json.")
@click.option("--seed", type=int, default=11, show_default=True, help="Seed of the load.")
@click.option("--keep", is_flag=True, help="Keep the scratch folder (configs, logs).")
def main(quick: bool, load: float, time_scale: float, window_s: float | None, queue: int,
         prompts_path: str | None, out_dir: str, seed: int, keep: bool) -> None:
    """Load shedding on vs off at about twice the capacity of a simulated pool."""
    ts = time_scale
    window = window_s or (12.0 if quick else 40.0)
    try:
        prompts = load_prompts(prompts_path)
        prompt_source = str(prompts_path or "default cache-eval folder")
    except BenchError as exc:
        if prompts_path is not None:
            raise click.ClickException(str(exc)) from None
        log(f"{exc}; using built-in prompts")
        prompts, prompt_source = SYNTHETIC_PROMPTS, "built-in"
    spec = PoolSpec(n_fast=2, n_slow=0)
    lengths = LengthDist()
    mix = RequestMix(prompts, lengths, seed=seed)
    mean_out, mean_prompt = mix.sample_means()
    cap_wall = pool_capacity_rps(spec, mean_out, mean_prompt) / ts
    deadline = DEADLINE_SIM_S * ts
    workload = mix.workload(load * cap_wall, window)
    meta = {
        "benchmark": "admission",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench.admission", *sys.argv[1:]]),
        "machine": machine_info(),
        "time_scale": ts, "load_factor": load, "window_s": window,
        "deadline_s": deadline, "deadline_sim_s": DEADLINE_SIM_S,
        "client_timeout_s": deadline + CLIENT_MARGIN_S,
        "capacity_wall_rps": round(cap_wall, 3), "offered_rps": round(load * cap_wall, 3),
        "requests": len(workload.requests), "queue_per_node": queue,
        "max_concurrency": spec.max_running + queue, "seed": seed,
        "prompts": prompt_source, "mean_output_tokens": round(mean_out, 2),
        "mean_prompt_tokens": round(mean_prompt, 2), **spec_dict(spec, lengths),
    }
    log(f"pool capacity {cap_wall:.2f} req/s wall; offering {load:g}x = {load * cap_wall:.2f} req/s "
        f"for {window:g} s ({len(workload.requests)} requests); deadline {deadline:g} s wall")
    records: list[dict] = []
    out = Path(out_dir)
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt(), Stack("infergate-bench-adm-", keep=keep) as stack:
            nodes = start_pool(stack, spec, ts)
            redis_url, r = start_base(stack, nodes, spec, ts, queue)
            for shed in (True, False):
                procs.wait_until(lambda: pool_idle(nodes), 120, interval=0.1,
                                 what="the simulated nodes to be idle")
                procs.wait_until(lambda: snapshot_all_healthy(r, len(nodes)), 60, interval=0.1,
                                 what="every node healthy in the snapshot")
                s = bench_settings(redis_url, nodes, spec, ts, queue, shed)
                rec = {"shedding": "on" if shed else "off", "offered_rps": round(workload.rate_rps, 3),
                       "deadline_s": deadline}
                rec.update(run_scenario(stack, s, nodes, workload, deadline,
                                        "shed-on" if shed else "shed-off"))
                records.append(rec)
                log(f"shedding {rec['shedding']}: {rec['requests']} requests, ok {rec['ok']}, "
                    f"shed {rec['shed_rate'] * 100:.1f}%, timeouts {rec['timeout_rate'] * 100:.1f}%, "
                    f"errors {rec['error_rate'] * 100:.1f}%, p99 admitted {rec['p99_s']} s")
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        sys.exit(130)
    except (procs.StartError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None

    on = records[0]
    checks = {"timeout_rate_under_1pct": on["timeout_rate"] < 0.01,
              "p99_admitted_under_deadline": bool(on["p99_under_deadline"])}
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = write_json(out / "admission.json", {"meta": meta, "runs": records, "checks": checks})
    rows = [{**rec, "shed_pct": rec["shed_rate"] * 100, "timeout_pct": rec["timeout_rate"] * 100,
             "error_pct": rec["error_rate"] * 100} for rec in records]
    print(format_table(rows, COLUMNS))
    print(f"\ncapacity {cap_wall:.2f} req/s wall, offered {load:g}x; deadline {deadline:g} s wall; "
          f"time scale {ts:g}; {meta['elapsed_s']} s elapsed")
    print("with shedding: timeout rate < 1 %: " + ("yes" if checks["timeout_rate_under_1pct"] else "NO")
          + f"; p99 of admitted requests < {deadline:g} s: "
          + ("yes" if checks["p99_admitted_under_deadline"] else "NO"))
    print(f"wrote {path}")
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
