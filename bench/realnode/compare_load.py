"""The load of ``python -m bench.realnode compare``: arrival schedules, the request sent
to a real llama-server, cut-stream detection and the node-metrics sampler.

Requests come from :class:`bench.scheduler.workload.RequestMix` (seeded prompts and
log-normal output lengths) and are sent by :func:`bench.scheduler.loadgen.run_load`
(open loop) with :func:`send_real` as its sender: a streaming chat completion whose
output length is fixed by ``max_tokens`` with ``ignore_eos`` (the same work for every
strategy, whatever the model would have said).

Schedules (wall seconds from the start of a run):

- ``steady``: Poisson arrivals at a fraction of the measured pool capacity
  (:meth:`RequestMix.workload`).
- ``burst``: a quiet spell (Poisson at ``quiet_fraction`` of the capacity for
  ``quiet_s``), then ``burst_size`` requests spread uniformly over ``burst_s`` seconds,
  then nothing until the window ends (:func:`burst_workload`).

With ``--plain`` the requests are not streams (:func:`send_real_plain`).

A stream is **cut** when the answer began (HTTP 200) and ended before the client's
deadline without a ``finish_reason`` or without ``data: [DONE]`` (:func:`is_cut`).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field, replace

import aiohttp

from bench.realnode.launch import MODEL_ALIAS
from bench.scheduler.loadgen import NO_CACHE_HEADERS, Result, stream_request
from bench.scheduler.workload import Request, RequestMix, Workload


@dataclass
class RealResult(Result):
    """A :class:`~bench.scheduler.loadgen.Result` with what the stream ended on."""

    finish_reason: str | None = None
    """``finish_reason`` of the last choice that carried one (``length``, ``stop``)."""
    cut: bool = False
    """The stream ended early (see :func:`is_cut`); its outcome is then ``error``."""


def request_body(req: Request) -> dict:
    """Streaming chat completion for ``req``: ``max_tokens`` = its output length, EOS
    ignored so that exactly that many tokens are generated."""
    return {"model": MODEL_ALIAS, "messages": [{"role": "user", "content": req.prompt}],
            "stream": True, "max_tokens": req.output_tokens, "ignore_eos": True}


def event_facts(payload: bytes) -> tuple[bool, str | None]:
    """(carries generated text, finish_reason or ``None``) of one SSE ``data:`` payload;
    (False, None) for anything that is not a chat chunk."""
    try:
        choice = json.loads(payload)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, None
    if not isinstance(choice, dict):
        return False, None
    delta = choice.get("delta") or {}
    text = bool((isinstance(delta, dict) and delta.get("content")) or choice.get("text"))
    finish = choice.get("finish_reason")
    return text, finish if isinstance(finish, str) and finish else None


def is_cut(res: Result, finish_reason: str | None) -> bool:
    """True when the answer began (HTTP 200) and ended before the deadline without a
    ``finish_reason`` or without ``[DONE]`` (a timed-out stream is a timeout, not a cut)."""
    if res.status != 200 or res.outcome == "timeout":
        return False
    return res.outcome != "ok" or finish_reason is None


async def send_real(session: aiohttp.ClientSession, url: str, req: Request, deadline_s: float,
                    lag_s: float = 0.0) -> RealResult:
    """Send ``req`` (:func:`request_body`) and read the stream until ``[DONE]``, its end
    or ``deadline_s``; a cut stream becomes an ``error`` with ``cut`` set. Never raises
    for network or HTTP problems."""
    res = RealResult(idx=req.idx, outcome="error", lag_s=lag_s)

    def on_event(payload: bytes, t: float) -> None:
        text, finish = event_facts(payload)
        if text and res.ttft_s is None:
            res.ttft_s = t
        if finish is not None:
            res.finish_reason = finish

    await stream_request(session, url, request_body(req), deadline_s, res, on_event)
    if is_cut(res, res.finish_reason):
        res.cut = True
        res.outcome = "error"
        res.e2e_s = None
        res.error = res.error or "stream ended without finish_reason"
    return res


async def send_real_plain(session: aiohttp.ClientSession, url: str, req: Request,
                          deadline_s: float, lag_s: float = 0.0) -> RealResult:
    """Send ``req`` as a request that is not a stream (:func:`request_body` with
    ``stream`` false) and read its JSON answer within ``deadline_s``; its time to first
    token is its whole answer's. Never raises for network or HTTP problems."""
    res = RealResult(idx=req.idx, outcome="error", lag_s=lag_s)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url, json={**request_body(req), "stream": False},
                                    headers=NO_CACHE_HEADERS) as resp:
                res.status = resp.status
                res.node = resp.headers.get("X-Sim-Node")
                raw = await resp.read()
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {raw[:300].decode('utf-8', 'replace')}"
                    return res
                choice = json.loads(raw)["choices"][0]
                res.finish_reason = choice.get("finish_reason")
                res.e2e_s = res.ttft_s = loop.time() - start
                res.events = 1
                res.outcome = "ok"
    except TimeoutError:
        res.outcome = "timeout"
        res.error = f"no complete answer within {deadline_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        res.outcome = "error"
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def burst_workload(mix: RequestMix, capacity_rps: float, duration_s: float, *,
                   quiet_s: float, burst_size: int, burst_s: float = 1.0,
                   quiet_fraction: float = 0.1, seed: int = 1) -> Workload:
    """A quiet spell then a burst (module docstring), requests taken in order from
    ``mix``. Arrival times are drawn from ``random.Random(seed)``: the same arguments give
    the same schedule. Raises ``ValueError`` when the burst does not end inside
    ``duration_s`` or a size/rate is not positive."""
    if capacity_rps <= 0 or burst_size < 1 or burst_s <= 0 or quiet_s < 0 or quiet_fraction < 0:
        raise ValueError("capacity, burst size and burst length must be > 0; quiet >= 0")
    if quiet_s + burst_s > duration_s:
        raise ValueError("the burst must end inside the window")
    rng = random.Random(seed)
    times: list[float] = []
    rate = quiet_fraction * capacity_rps
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= quiet_s:
            break
        times.append(t)
    times += sorted(quiet_s + rng.uniform(0.0, burst_s) for _ in range(burst_size))
    n = len(times)
    pool: list[Request] = []
    horizon = 2.0 * n + 10.0
    while len(pool) < n:
        pool = mix.workload(1.0, horizon).requests
        horizon *= 2
    reqs = [replace(r, idx=i, at_s=at) for i, (r, at) in enumerate(zip(pool, times))]
    return Workload(requests=reqs, rate_rps=n / duration_s, duration_s=duration_s, seed=seed)


# --------------------------------------------------------------------------- node metrics

#: The llama-server gauges and counters the sampler keeps (``llamacpp:`` prefix dropped).
METRICS = ("requests_processing", "requests_deferred", "tokens_predicted_total")


def parse_metrics(text: str) -> dict[str, float]:
    """``llamacpp:NAME value`` lines of a Prometheus text page -> {NAME: value} (other
    lines, comments and unparsable values are skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("llamacpp:"):
            continue
        parts = line[len("llamacpp:"):].split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = float(parts[1])
        except ValueError:
            continue
    return out


@dataclass
class NodeSamples:
    """Per node: ``processing`` and ``deferred`` request counts at each sample, and
    ``tokens`` = (tokens_predicted_total at the first sample, at the last)."""

    processing: dict[str, list[float]] = field(default_factory=dict)
    deferred: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)
    failed_polls: int = 0

    def add(self, node: str, metrics: dict[str, float]) -> None:
        """Record one answered poll of ``node``."""
        self.processing.setdefault(node, []).append(metrics.get("requests_processing", 0.0))
        self.deferred.setdefault(node, []).append(metrics.get("requests_deferred", 0.0))
        total = metrics.get("tokens_predicted_total", 0.0)
        first = self.tokens.get(node, (total, total))[0]
        self.tokens[node] = (first, total)


async def poll_nodes(session: aiohttp.ClientSession, urls: dict[str, str],
                     out: NodeSamples) -> None:
    """One ``GET /metrics`` of every node (``urls``: name -> base URL) into ``out``."""
    async def one(name: str, url: str) -> None:
        try:
            async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                text = await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            out.failed_polls += 1
            return
        out.add(name, parse_metrics(text))

    await asyncio.gather(*(one(n, u) for n, u in urls.items()))


async def sample_nodes(urls: dict[str, str], interval_s: float, stop: asyncio.Event,
                       out: NodeSamples) -> None:
    """Poll every node each ``interval_s`` seconds until ``stop`` is set, then once more
    (so the token counters cover the whole run)."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            await poll_nodes(session, urls, out)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
        await poll_nodes(session, urls, out)
