"""``python -m bench.realnode compare``: infergate against nginx ``least_conn`` in front of
real llama-servers of different capacity.

Starts the pool (default: one llama-server with 1 slot and one with 3, 1 thread each),
infergate (Redis + control plane; the nodes given by URL alone) and measures the pool's
capacity with a short closed-loop calibration run. Then, for each load (fractions of
that capacity, steady Poisson arrivals) and for a burst after a quiet spell, it sends
the same seeded streaming requests through each strategy (with ``--freeze`` also a run
in which one node is SIGSTOPped for longer than the deadline: :class:`Freeze`), the
strategies interleaved
(least_conn, infergate, least_conn, infergate, ...) so that a change in the machine's
load hits both alike. nginx is started fresh for every run. Prints the table (means over
the repeats), the noise (spread between repeats of one strategy) and writes
``realnode_compare.json`` (calibration, every run, the noise) and
``realnode_compare.meta.json`` (command, commit, date, load average, settings).

Definitions: bench/realnode/compare_load.py (schedules, cut streams) and
compare_stats.py (metrics, noise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import redis

from bench.common import (RESULTS_DIR, BenchError, Stack, load_prompts, log, machine_info,
                          sigterm_as_interrupt, write_json)
from bench.realnode import compare_stats as cs
from bench.realnode.compare_load import (NodeSamples, burst_workload, sample_nodes, send_real,
                                        send_real_plain)
from bench.realnode.compare_stack import (PoolNode, calibrate, pool_detected, pool_idle,
                                          start_infergate, start_pool)
from bench.scheduler.loadgen import RunOutput, run_load
from bench.scheduler.shapes import PROBE_GAP_S, access_tries, freeze_figures
from bench.scheduler.stack import EdgeRun, InfergateStack
from bench.scheduler.workload import LengthDist, RequestMix, Workload
from controlplane import procs

NAME = "realnode_compare"
STRATEGIES = ("least_conn", "infergate", "round_robin")
#: Load of the freeze run (``--freeze``): the other nodes can carry it alone.
FREEZE_LOAD = 0.5
#: Prompts longer than this (characters) are left out: the load is of short prompts.
MAX_PROMPT_CHARS = 300


def _csv(value: str, cast: type, what: str) -> list:
    try:
        out = [cast(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma-separated list") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return out


def _loads(value: str) -> list[float]:
    out = _csv(value, float, "--loads")
    if any(not 0 < x <= 5 for x in out):
        raise argparse.ArgumentTypeError("--loads: fractions must be within (0, 5]")
    return out


def _slots(value: str) -> list[int]:
    out = _csv(value, int, "--nodes")
    if len(out) < 2 or any(not 1 <= x <= 16 for x in out):
        raise argparse.ArgumentTypeError("--nodes: at least two slot counts within 1-16")
    return out


def _strategies(value: str) -> list[str]:
    out = _csv(value, str, "--strategies")
    bad = [s for s in out if s not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"--strategies: unknown {bad}; choose from {STRATEGIES}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``compare``."""
    p.add_argument("--nodes", type=_slots, default=[1, 3],
                   help="slots (--parallel) of each llama-server, comma list (default 1,3)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per node (default 1)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="arrival window of each run, seconds (default 30)")
    p.add_argument("--loads", type=_loads, default=[0.5, 0.9, 1.2],
                   help="steady loads, fractions of the measured capacity (default 0.5,0.9,1.2)")
    p.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                   help="run the steady loads (default on; --no-steady: the burst and the "
                   "freeze alone)")
    p.add_argument("--burst", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the burst after a quiet spell (default on)")
    p.add_argument("--burst-size", type=float, default=3.0,
                   help="burst = this many seconds of pool capacity, sent within 1 s (default 3)")
    p.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=False,
                   help="also run a node freeze: steady at --freeze-load, the node with the "
                   "most slots SIGSTOPped a quarter into the window (default off)")
    p.add_argument("--freeze-load", type=float, default=FREEZE_LOAD,
                   help=f"load of the freeze run, fraction of the capacity (default {FREEZE_LOAD})")
    p.add_argument("--freeze-s", type=float, default=None,
                   help="how long the node stays frozen, seconds (default: the deadline + 5)")
    p.add_argument("--plain", action="store_true",
                   help="send requests that are not streams (default: streams)")
    p.add_argument("--repeats", type=int, default=2, help="runs per strategy and load (default 2)")
    p.add_argument("--strategies", type=_strategies, default=["least_conn", "infergate"],
                   help="comma list, run in this order (default least_conn,infergate)")
    p.add_argument("--deadline", type=float, default=20.0,
                   help="client deadline per request, seconds (default 20)")
    p.add_argument("--calibrate", type=float, default=15.0,
                   help="seconds of the capacity calibration run (default 15)")
    p.add_argument("--capacity", type=float, default=None,
                   help="pool capacity in requests/s: skip the calibration run")
    p.add_argument("--seed", type=int, default=7, help="seed of the load (default 7)")
    p.add_argument("--prompts", default=None, help="prompt file or folder "
                   "(default ../shared/data/cache-eval)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder for the result files")
    p.add_argument("--note", default="", help="a remark stored in the meta file and printed "
                   "under the table (e.g. that the machine was busy)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (configs, logs)")


def plan_runs(loads: list[float], burst: bool, repeats: int, strategies: list[str],
              freeze: float | None = None) -> list[tuple[str, float | None, int, str]]:
    """(scenario, load fraction or ``None`` for the burst, repeat, strategy) in run order:
    per load, the strategies interleaved repeat by repeat (A, B, A, B, ...); the freeze
    run (at load ``freeze``, when given) last."""
    steps: list[tuple[str, float | None]] = [("steady", f) for f in loads]
    if burst:
        steps.append(("burst", None))
    if freeze is not None:
        steps.append(("freeze", freeze))
    return [(sc, f, rep, s) for sc, f in steps for rep in range(1, repeats + 1) for s in strategies]


def make_workload(mix: RequestMix, scenario: str, frac: float | None, capacity: float,
                  args: argparse.Namespace) -> Workload:
    """The arrivals of one scenario (steady at ``frac`` x ``capacity``, or the burst)."""
    if scenario in ("steady", "freeze"):
        assert frac is not None
        return mix.workload(frac * capacity, args.duration)
    size = max(1, round(args.burst_size * capacity))
    return burst_workload(mix, capacity, args.duration, quiet_s=args.duration / 2,
                          burst_size=size, seed=args.seed)


async def _send_indexed(session, url: str, req, deadline_s: float,  # type: ignore[no-untyped-def]
                        lag_s: float = 0.0):
    """:func:`send_real` with ``?i=<index>`` on the URL (the edge's access log then ties
    every try to the request)."""
    return await send_real(session, f"{url}?i={req.idx}", req, deadline_s, lag_s)


async def _send_indexed_plain(session, url: str, req, deadline_s: float,  # type: ignore[no-untyped-def]
                              lag_s: float = 0.0):
    """:func:`send_real_plain` with ``?i=<index>`` on the URL."""
    return await send_real_plain(session, f"{url}?i={req.idx}", req, deadline_s, lag_s)


async def one_run(url: str, wl: Workload, deadline_s: float, nodes: list[PoolNode],
                  on_time: list | None = None,
                  plain: bool = False) -> tuple[RunOutput, NodeSamples]:
    """Send ``wl`` to ``url`` (open loop, :func:`send_real`) while sampling the nodes'
    ``/metrics`` every 0.5 s; ``on_time`` as :func:`bench.scheduler.loadgen.run_load`."""
    samples = NodeSamples()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_nodes({n.name: n.url for n in nodes}, 0.5, stop, samples))
    try:
        out = await run_load(url, wl, deadline_s, {}, sample_interval_s=1.0,
                             on_time=on_time,
                             send=_send_indexed_plain if plain else _send_indexed)
    finally:
        stop.set()
        await sampler
    return out, samples


def _settle(nodes: list[PoolNode], rconn: redis.Redis | None, strategy: str,
            slow_start_until: float) -> None:
    procs.wait_until(lambda: pool_idle(nodes), 180, interval=0.2,
                     what="the llama-servers to finish their requests")
    if rconn is not None:
        procs.wait_until(lambda: pool_detected(rconn, nodes), 60, interval=0.2,
                         what="every node healthy with its slots in the snapshot")
    if strategy == "infergate" and time.monotonic() < slow_start_until:
        wait = slow_start_until - time.monotonic()
        log(f"waiting {wait:.0f} s for the control plane's slow start to end")
        time.sleep(wait)


def run_plan(stack: Stack, nodes: list[PoolNode], base: InfergateStack | None,
             mix: RequestMix, capacity: float, args: argparse.Namespace,
             slow_start_until: float, save) -> list[dict]:
    """Every run of :func:`plan_runs`; ``save(runs)`` after each."""
    plan = plan_runs(args.loads if args.steady else [], args.burst, args.repeats, args.strategies,
                     args.freeze_load if args.freeze else None)
    rconn = redis.Redis.from_url(base.redis_url, socket_timeout=2,
                                 decode_responses=True) if base else None
    slots = {n.name: n.slots for n in nodes}
    workloads: dict[tuple, Workload] = {}
    runs: list[dict] = []
    for i, (scenario, frac, rep, strategy) in enumerate(plan, 1):
        if (scenario, frac) not in workloads:
            workloads[(scenario, frac)] = make_workload(mix, scenario, frac, capacity, args)
        wl = workloads[(scenario, frac)]
        _settle(nodes, rconn, strategy, slow_start_until)
        edge = EdgeRun(stack, strategy, nodes, 1.0, base, f"{i:02d}-{scenario}-{strategy}")  # type: ignore[arg-type]
        freeze = Freeze(edge, nodes, args) if scenario == "freeze" else None
        try:
            out, samples = asyncio.run(one_run(edge.url, wl, args.deadline, nodes,
                                               freeze.on_time() if freeze else None,
                                               plain=args.plain))
            extra = freeze.figures(wl, out.results) if freeze else {}
        finally:
            if freeze:
                freeze.thaw_now()
            edge.stop()
        head = {"scenario": scenario, "strategy": strategy, "repeat": rep,
                "load_fraction": round(frac if frac is not None else wl.rate_rps / capacity, 3),
                "offered_rps": round(wl.rate_rps, 3), "deadline_s": args.deadline,
                "window_s": args.duration, "loadavg_1m": round(os.getloadavg()[0], 2)}
        rec = cs.run_record(out.results, head=head, deadline_s=args.deadline,
                            window_s=args.duration, samples=samples, slots=slots)
        rec.update(extra)
        rec["edge_errors"] = edge.error_lines(3)
        runs.append(rec)
        save(runs)
        log(f"[{i}/{len(plan)}] {scenario} {rec['load_fraction'] * 100:.0f}% #{rep} {strategy}: "
            f"{rec['requests']} req, goodput {rec['goodput_rps']}/s, p50 {rec['p50_s']} s, "
            f"p99 {rec['p99_s']} s, TTFT p90 {rec['ttft_p90_s']} s, timeouts {rec['timeouts']}, "
            f"429 {rec['rejected']}, cut {rec['cut']}, tokens "
            + "/".join(f"{v['token_share']}" for v in rec["nodes"].values())
            + f", load {rec['loadavg_1m']}")
    return runs


def first_cluster_end(times: list[float]) -> float:
    """The last of the first run of ``times`` (sorted) less than PROBE_GAP_S apart; 0.0
    when empty (as bench.scheduler.shapes.freeze_figures' ``to_frozen_after_s``)."""
    until = times[0] if times else 0.0
    for x in times:
        if x - until > PROBE_GAP_S:
            break
        until = x
    return until


class Freeze:
    """The freeze of one run: the node with the most slots SIGSTOPped at a quarter of the
    window for ``--freeze-s`` (default the deadline + 5 s), then SIGCONTed; the edge's
    ``/infergate/status`` polled every 50 ms for when it shows the node stalled or a TTFB
    outlier, and for the rises of the node's in-flight count (infergate's tries to it:
    its requests may wait at the edge, so the client's send time is not the try's).
    Figures as :func:`bench.scheduler.shapes.freeze_figures` (times from the freeze; for
    infergate the tries from the status, ``sends_from``), plus ``found_after_s`` and
    ``freeze_s``."""

    def __init__(self, edge: EdgeRun, nodes: list[PoolNode], args: argparse.Namespace) -> None:
        self.edge = edge
        self.victim = max(nodes, key=lambda n: n.slots)
        self.t_f = args.duration / 4
        self.t_t = self.t_f + (args.freeze_s if args.freeze_s else args.deadline + 5.0)
        self.frozen = False
        self.found: float | None = None
        self.rises: list[float] = []

    def _signal(self, sig: int) -> None:
        managed = self.victim.node.managed
        if managed is not None:
            managed.signal(sig)

    def on_time(self) -> list:
        """(s from the start, coroutine function) pairs for ``run_load``."""
        async def freeze() -> None:
            self.frozen = True
            self._signal(signal.SIGSTOP)

        async def thaw() -> None:
            self.thaw_now()

        async def watch() -> None:
            if self.edge.strategy != "infergate":
                return                # no status to read
            t0 = time.monotonic()
            last = None
            while time.monotonic() - t0 < self.t_t - self.t_f:
                st = await asyncio.to_thread(self.edge.edge_status) or {}
                now = round(time.monotonic() - t0, 2)
                node = next((x for x in st.get("nodes", [])
                             if x.get("name") == self.victim.name), {})
                if self.found is None and (node.get("stalled") or node.get("outlier")):
                    self.found = now
                inflight = node.get("inflight")
                if isinstance(inflight, (int, float)):
                    if last is not None and inflight > last:
                        self.rises += [now] * int(inflight - last)
                    last = inflight
                await asyncio.sleep(0.05)
        return [(self.t_f, freeze), (self.t_f, watch), (self.t_t, thaw)]

    def thaw_now(self) -> None:
        """SIGCONT the node if it is frozen."""
        if self.frozen:
            self._signal(signal.SIGCONT)
            self.frozen = False

    def figures(self, wl: Workload, results: list) -> dict:
        """The freeze figures of the run (class docstring)."""
        tries = access_tries((self.edge.error_log.parent / "access.log").read_text(
            errors="replace"))
        out = freeze_figures(wl, results, tries, f"127.0.0.1:{self.victim.port}",
                             self.t_f, self.t_t)
        out["frozen_node"] = self.victim.name
        out["freeze_s"] = round(self.t_t - self.t_f, 2)
        if self.edge.strategy == "infergate":
            # requests can wait at infergate's edge for a slot, so a client's send time is
            # not when its try went out: the tries are the rises of the node's in-flight
            # count in /infergate/status (polled every 50 ms) during the freeze
            out["found_after_s"] = self.found
            out["to_frozen_at_s"] = self.rises
            out["to_frozen_after_s"] = first_cluster_end(self.rises)
            out["to_frozen_last_s"] = self.rises[-1] if self.rises else 0.0
            out["sends_from"] = "edge status"
        else:
            out["sends_from"] = "access log"
        return out


def _meta(args: argparse.Namespace, argv: list[str], prompts: int) -> dict:
    return {"benchmark": NAME, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": "python -m bench.realnode compare " + shlex.join(argv),
            "machine": machine_info(), "note": args.note,
            "nodes_slots": args.nodes, "threads": args.threads, "window_s": args.duration,
            "loads": args.loads, "burst": args.burst, "burst_size_s": args.burst_size,
            "freeze": args.freeze, "freeze_load": args.freeze_load, "freeze_s": args.freeze_s,
            "plain": args.plain,
            "repeats": args.repeats, "strategies": args.strategies, "deadline_s": args.deadline,
            "seed": args.seed, "prompt_count": prompts, "max_prompt_chars": MAX_PROMPT_CHARS,
            "output_tokens": asdict(LengthDist())}


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The whole benchmark (module docstring); returns the exit status."""
    try:
        prompts = [p for p in load_prompts(args.prompts) if len(p) <= MAX_PROMPT_CHARS]
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    meta = _meta(args, argv, len(prompts))
    mix = RequestMix(prompts, LengthDist(), seed=args.seed)
    data: dict = {"calibration": None, "runs": []}
    t0 = time.monotonic()

    def save(runs: list[dict]) -> None:
        data["runs"] = runs
        write_json(out / f"{NAME}.json", data)

    try:
        with sigterm_as_interrupt(), Stack("infergate-bench-realnode-", keep=args.keep) as stack:
            nodes = start_pool(stack, args.nodes, args.threads)
            base = start_infergate(stack, nodes) if "infergate" in args.strategies else None
            slow_until = time.monotonic() + (base.settings.controlplane.slow_start_s if base else 0)
            if args.capacity:
                data["calibration"] = {"capacity_rps": args.capacity, "source": "--capacity",
                                       "nodes": {n.name: {"slots": n.slots, "rps": None}
                                                 for n in nodes}}
            else:
                cal_mix = RequestMix(prompts, LengthDist(), seed=args.seed + 1)
                data["calibration"] = asyncio.run(calibrate(nodes, cal_mix, args.calibrate,
                                                            args.deadline))
            capacity = data["calibration"]["capacity_rps"]
            log(f"pool capacity {capacity} req/s: {data['calibration']['nodes']}")
            if not capacity:
                raise BenchError("the calibration run completed no request")
            run_plan(stack, nodes, base, mix, capacity, args, slow_until, save)
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        return 130
    except (procs.StartError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data["noise"] = {"groups": cs.noise(data["runs"]),
                     "summary": cs.noise_summary(cs.noise(data["runs"]))}
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    meta["loadavg_after"] = round(os.getloadavg()[0], 2)
    write_json(out / f"{NAME}.json", data)
    write_json(out / f"{NAME}.meta.json", meta)
    print(cs.report_text(data, meta))
    print(f"wrote {out / (NAME + '.json')}, {out / (NAME + '.meta.json')} "
          f"({meta['elapsed_s']} s)")
    return 0
