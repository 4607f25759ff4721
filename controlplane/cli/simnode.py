"""``infergate simnode``: run one simulated inference node until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

from controlplane.simnode.engine import EngineConfig
from controlplane.simnode.faults import Faults
from controlplane.simnode.metrics import DIALECTS
from controlplane.simnode.server import NodeOptions, SimNode


def _output_range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        lo_s, hi_s = value.split(":", 1)
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise click.BadParameter("expected MIN:MAX, e.g. 16:128") from None
    if not 1 <= lo <= hi:
        raise click.BadParameter("need 1 <= MIN <= MAX")
    return lo, hi


@click.command("simnode")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=9001, show_default=True,
              help="Main port (OpenAI API, /health, /metrics, /_sim/*).")
@click.option("--control-port", type=click.IntRange(1, 65535), default=None,
              help="Extra port serving only /_sim/* (keeps working while 'refuse' is on).")
@click.option("--name", default=None, help="Node name (X-Sim-Node, system_fingerprint). "
              "Default: sim-<port>.")
@click.option("--model", default="sim-llama", show_default=True, help="Served model name.")
@click.option("--dialect", type=click.Choice(DIALECTS), default="vllm", show_default=True,
              help="Metrics dialect of GET /metrics.")
@click.option("--engines", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Engine ranks (vLLM data parallel); requests are spread round-robin.")
@click.option("--max-running", type=click.IntRange(1, 100000), default=16, show_default=True,
              help="Running sequences per engine.")
@click.option("--kv-capacity-tokens", type=click.IntRange(2, 10**9), default=16384,
              show_default=True, help="KV cache per engine, in tokens.")
@click.option("--prefill-tps", type=click.FloatRange(min=0, min_open=True), default=4000.0,
              show_default=True, help="Prefill speed, prompt tokens per simulated second.")
@click.option("--decode-base-ms", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Fixed cost of one decode step (simulated ms).")
@click.option("--decode-per-seq-ms", type=click.FloatRange(min=0), default=1.0,
              show_default=True, help="Extra decode-step cost per running sequence (simulated ms).")
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="GPU speed factor (2.0 = twice as fast).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Automatic prefix caching of full 16-token prompt blocks, per engine "
                   "(vLLM V1 default: on).")
@click.option("--prefix-cache-blocks", type=click.IntRange(0, 10**9), default=None,
              help="Prefix-cache capacity per engine, in 16-token blocks (LRU). "
                   "Default: kv-capacity-tokens // 16.")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Wall seconds per simulated second (0.1 = 10x faster).")
@click.option("--output-tokens", "output_tokens", default="16:128", show_default=True,
              callback=_output_range, help="MIN:MAX output length chosen by prompt hash.")
@click.option("--error-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Fault: probability of an injected error answer.")
@click.option("--error-status", type=click.IntRange(400, 599), default=500, show_default=True,
              help="Fault: HTTP status of injected errors.")
@click.option("--hang", is_flag=True, help="Fault: accept inference requests, never answer.")
@click.option("--stall", is_flag=True,
              help="Fault: as --hang, but streams get their headers at once (an engine hung "
                   "behind a live HTTP server).")
@click.option("--slowdown", type=click.FloatRange(1, 1000), default=1.0, show_default=True,
              help="Fault: factor on every step duration.")
@click.option("--metrics-fail", is_flag=True, help="Fault: /metrics answers 500.")
@click.option("--health-fail", is_flag=True, help="Fault: /health answers 503.")
@click.option("--refuse", is_flag=True, help="Fault: do not listen on the main port.")
@click.option("--garbage", is_flag=True, help="Fault: answer inference with non-HTTP bytes.")
@click.option("--llamacpp", is_flag=True,
              help="Behave like llama-cpp-python's server: one request at a time behind a "
                   "model lock, no /health or /metrics, GET /v1/models waits for the lock "
                   "and interrupts the running stream (interrupt_requests=True).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def simnode_cmd(host: str, port: int, control_port: int | None, name: str | None, model: str,
                dialect: str, engines: int, max_running: int, kv_capacity_tokens: int,
                prefill_tps: float, decode_base_ms: float, decode_per_seq_ms: float,
                speed: float, prefix_caching: bool, prefix_cache_blocks: int | None,
                time_scale: float, output_tokens: tuple[int, int],
                error_rate: float, error_status: int, hang: bool, stall: bool, slowdown: float,
                metrics_fail: bool, health_fail: bool, refuse: bool, garbage: bool,
                llamacpp: bool, log_level: str) -> None:
    """A simulated OpenAI-compatible inference node (fake vLLM/TGI/SGLang) with a
    continuous-batching performance model and switchable faults.

    Latency metrics are exported in wall-clock seconds. Prompt tokens are estimated
    as ceil(characters / 4); prompts sharing leading 16-token blocks hit the prefix
    cache and skip their prefill."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if refuse and control_port is None:
        raise click.UsageError("--refuse needs --control-port (or nothing could turn it off)")
    if control_port is not None and control_port == port:
        raise click.UsageError("--control-port must differ from --port")
    try:
        engine = EngineConfig(max_running=max_running, kv_capacity_tokens=kv_capacity_tokens,
                              prefill_tps=prefill_tps, decode_base_ms=decode_base_ms,
                              decode_per_seq_ms=decode_per_seq_ms, speed=speed,
                              prefix_caching=prefix_caching,
                              prefix_cache_blocks=prefix_cache_blocks)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    faults = Faults(error_rate=error_rate, error_status=error_status, hang=hang, stall=stall,
                    slowdown=slowdown, metrics_fail=metrics_fail, health_fail=health_fail,
                    refuse=refuse, garbage=garbage)
    opts = NodeOptions(host=host, port=port, control_port=control_port,
                       name=name or f"sim-{port}", model=model, dialect=dialect,
                       engines=engines, engine=engine, time_scale=time_scale,
                       output_min=output_tokens[0], output_max=output_tokens[1], faults=faults,
                       llamacpp=llamacpp)
    try:
        asyncio.run(_serve(opts))
    except OSError as exc:
        raise click.ClickException(f"cannot listen: {exc}") from None


async def _serve(opts: NodeOptions) -> None:
    node = SimNode(opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
        where = f"{opts.host}:{opts.port}"
        extra = f", control {opts.host}:{opts.control_port}" if opts.control_port else ""
        state = ", refusing connections" if opts.faults.refuse else ""
        print(f"simnode {opts.name} listening on {where} (dialect {opts.dialect}{extra}{state})",
              flush=True)
        await stop.wait()
    finally:
        await node.stop()
