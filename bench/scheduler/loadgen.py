"""Open-loop load generator (asyncio + aiohttp) and the node-state sampler.

Each request of a :class:`~bench.scheduler.workload.Workload` is sent at its arrival
time whatever happened to the earlier ones (open loop), as a streaming chat
completion with ``sim_output_tokens``. The client gives up at the deadline (whole
request, from the moment it is sent): the connection is closed, so nginx and the node
drop the request as a real client's timeout would.

Measured per request (wall-clock seconds, monotonic clock): ``e2e_s`` from sending to
``data: [DONE]``; ``ttft_s`` from sending to the first SSE event that carries
generated text (``delta.content`` / ``text`` not empty).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from .workload import Request, Workload

Outcome = Literal["ok", "timeout", "error"]

#: Sent with every request so that a response cache at the edge, if any, stays out of
#: the measurement (the edge counts such requests as ``bypass``).
NO_CACHE_HEADERS = {"Cache-Control": "no-cache"}


@dataclass
class Result:
    """What happened to one request."""

    idx: int
    outcome: Outcome
    status: int | None = None
    """HTTP status, ``None`` when no answer head arrived."""
    e2e_s: float | None = None
    """Send -> ``[DONE]`` (ok only)."""
    ttft_s: float | None = None
    """Send -> first generated text; ``None`` if none arrived."""
    events: int = 0
    """SSE data events received (role, tokens, finish)."""
    node: str | None = None
    """``X-Sim-Node`` of the answer."""
    lag_s: float = 0.0
    """How late the request left against its planned arrival time."""
    error: str | None = None


def _has_text(payload: bytes) -> bool:
    try:
        obj = json.loads(payload)
        choice = obj["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text"))


def request_body(req: Request, model: str | None = None) -> dict:
    """The chat completion body for ``req`` (streaming, fixed output length)."""
    body = {"messages": [{"role": "user", "content": req.prompt}], "stream": True,
            "sim_output_tokens": req.output_tokens}
    if model:
        body["model"] = model
    return body


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict,
                         deadline_s: float, res: Result,
                         on_event: Callable[[bytes, float], None]) -> bool:
    """POST ``body`` to ``url`` and read the SSE stream until ``[DONE]``, the end of the
    answer or ``deadline_s`` wall seconds, filling ``res`` (status, node, outcome,
    e2e_s, events, error); ``on_event(payload, seconds since the request)`` is called
    for every ``data:`` event before ``[DONE]``. Returns True when ``[DONE]`` arrived.
    Never raises for network or HTTP problems: they become an ``error`` outcome."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url, json=body, headers=NO_CACHE_HEADERS) as resp:
                res.status = resp.status
                res.node = resp.headers.get("X-Sim-Node")
                if resp.status != 200:
                    text = (await resp.read())[:300].decode("utf-8", "replace")
                    res.error = f"HTTP {resp.status}: {text}"
                    return False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        res.outcome = "ok"
                        res.e2e_s = loop.time() - start
                        return True
                    res.events += 1
                    on_event(payload, loop.time() - start)
                res.error = "stream ended without [DONE]"
    except TimeoutError:
        res.outcome = "timeout"
        res.error = f"no complete answer within {deadline_s:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        res.outcome = "error"
        res.error = f"{type(exc).__name__}: {exc}"
    return False


async def send_one(session: aiohttp.ClientSession, url: str, req: Request, deadline_s: float,
                   lag_s: float = 0.0) -> Result:
    """Send ``req`` to ``url`` (``.../v1/chat/completions``) and read the stream until
    ``[DONE]``, the end of the answer or the deadline. Never raises for network or
    HTTP problems: they become an ``error`` result."""
    res = Result(idx=req.idx, outcome="error", lag_s=lag_s)

    def on_event(payload: bytes, t: float) -> None:
        if res.ttft_s is None and _has_text(payload):
            res.ttft_s = t

    await stream_request(session, url, request_body(req, req.model), deadline_s, res, on_event)
    return res


@dataclass
class StateSamples:
    """``running`` counts of each node, sampled from ``GET /_sim/state``."""

    running: dict[str, list[int]] = field(default_factory=dict)
    requests_total: dict[str, tuple[int, int]] = field(default_factory=dict)
    """node -> (requests_total at the first sample, at the last)."""
    failed_polls: int = 0


async def sample_states(session: aiohttp.ClientSession, control_urls: dict[str, str],
                        interval_s: float, stop: asyncio.Event, out: StateSamples,
                        on_state: Callable[[str, dict], None] | None = None) -> None:
    """Poll every node's ``/_sim/state`` every ``interval_s`` until ``stop`` is set;
    ``on_state(node, state)`` also sees every answered poll."""
    async def one(name: str, url: str) -> None:
        try:
            async with session.get(f"{url}/_sim/state",
                                   timeout=aiohttp.ClientTimeout(total=max(1.0, interval_s * 5))) as r:
                st = await r.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            out.failed_polls += 1
            return
        out.running.setdefault(name, []).append(int(st.get("running", 0)))
        total = int(st.get("requests_total", 0))
        first = out.requests_total.get(name, (total, total))[0]
        out.requests_total[name] = (first, total)
        if on_state is not None:
            on_state(name, st)

    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while not stop.is_set():
        await asyncio.gather(*(one(n, u) for n, u in control_urls.items()))
        next_at += interval_s
        delay = next_at - loop.time()
        if delay < 0:
            next_at = loop.time()
            delay = 0
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            pass


@dataclass
class RunOutput:
    results: list[Result]
    states: StateSamples
    duration_s: float
    """Wall seconds of the arrival window (planned)."""
    wall_s: float
    """Wall seconds from the first send to the last answer or give-up."""


async def run_load(url: str, workload: Workload, deadline_s: float, control_urls: dict[str, str],
                   sample_interval_s: float = 0.1,
                   on_time: list[tuple[float, "asyncio.Future | object"]] | None = None,
                   send: Callable[..., Awaitable[Result]] | None = None) -> RunOutput:
    """Send ``workload`` to ``url`` open-loop and sample node states during the arrival
    window. ``on_time``: (seconds from the start, coroutine function) pairs run once at
    that moment (used to inject faults mid-run). ``send``: the coroutine function that
    sends one request, called as ``send(session, url, req, deadline_s, lag_s)``
    (default :func:`send_one`)."""
    send = send or send_one
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    conn_state = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session, \
            aiohttp.ClientSession(connector=conn_state) as state_session:
        stop = asyncio.Event()
        states = StateSamples()
        sampler = asyncio.create_task(sample_states(state_session, control_urls, sample_interval_s,
                                                    stop, states))
        t0 = loop.time()
        wall0 = time.monotonic()
        extra: list[asyncio.Task] = []
        for at, fn in sorted(on_time or [], key=lambda x: x[0]):
            async def fire(at: float = at, fn=fn) -> None:
                await asyncio.sleep(max(0.0, t0 + at - loop.time()))
                await fn()  # type: ignore[operator]
            extra.append(asyncio.create_task(fire()))
        tasks: list[asyncio.Task[Result]] = []
        for req in workload.requests:
            delay = t0 + req.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(0.0, loop.time() - (t0 + req.at_s))
            tasks.append(asyncio.create_task(send(session, url, req, deadline_s, lag)))
        rest = t0 + workload.duration_s - loop.time()
        if rest > 0:
            await asyncio.sleep(rest)
        stop.set()
        await sampler
        results = list(await asyncio.gather(*tasks))
        await asyncio.gather(*extra, return_exceptions=True)
        wall = time.monotonic() - wall0
    return RunOutput(results=results, states=states, duration_s=workload.duration_s, wall_s=wall)
