"""Open-loop load of non-streaming chat completions and the classification of answers.

Each request of a :class:`~bench.scheduler.workload.Workload` leaves at its arrival time
whatever happened to the earlier ones (open loop, no client retries), asks for
``sim_output_tokens`` tokens and waits at most ``client_timeout_s`` (the edge deadline
plus a margin: the edge itself answers 504 at its deadline).

Outcomes (:data:`Outcome`):

- ``ok``: 200 with a complete JSON answer;
- ``shed``: 429 whose error type is ``server_overloaded`` (the edge's load shedding);
- ``timeout``: 504 from the edge, or no answer within ``client_timeout_s``;
- ``error``: anything else (other status, connection error, invalid answer).

Latency: wall seconds from sending to the end of the answer (monotonic clock).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

from ..scheduler.workload import Request, Workload

Outcome = Literal["ok", "shed", "timeout", "error"]

#: Keeps a response cache at the edge, if any, out of the measurement.
NO_CACHE_HEADERS = {"Cache-Control": "no-cache"}


@dataclass
class Result:
    """What happened to one request."""

    idx: int
    outcome: Outcome
    latency_s: float
    status: int | None = None
    """HTTP status; ``None`` when no answer head arrived."""
    retry_after: str | None = None
    error: str | None = None
    lag_s: float = 0.0
    """How late the request left against its planned arrival time."""


def request_body(req: Request) -> dict:
    """Non-streaming chat completion with a fixed output length."""
    return {"model": "sim-llama", "messages": [{"role": "user", "content": req.prompt}],
            "sim_output_tokens": req.output_tokens}


def classify(status: int, body: bytes) -> tuple[Outcome, str | None]:
    """Outcome of a complete HTTP answer (see the module docstring) and an error text."""
    err_type = None
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err_type = obj["error"].get("type")
    if status == 200:
        if isinstance(obj, dict) and obj.get("choices"):
            return "ok", None
        return "error", "200 without choices"
    if status == 429 and err_type == "server_overloaded":
        return "shed", None
    if status == 504:
        return "timeout", body[:200].decode("utf-8", "replace")
    return "error", f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"


async def send_one(session: aiohttp.ClientSession, url: str, req: Request,
                   client_timeout_s: float, lag_s: float = 0.0) -> Result:
    """Send ``req``; never raises for network or HTTP problems."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(client_timeout_s):
            async with session.post(url, json=request_body(req), headers=NO_CACHE_HEADERS) as resp:
                body = await resp.read()
                outcome, err = classify(resp.status, body)
                return Result(req.idx, outcome, loop.time() - start, resp.status,
                              resp.headers.get("Retry-After"), err, lag_s)
    except TimeoutError:
        return Result(req.idx, "timeout", loop.time() - start, None, None,
                      f"no answer within {client_timeout_s:g} s", lag_s)
    except (aiohttp.ClientError, OSError) as exc:
        return Result(req.idx, "error", loop.time() - start, None, None,
                      f"{type(exc).__name__}: {exc}", lag_s)


async def run_load(url: str, workload: Workload, client_timeout_s: float) -> tuple[list[Result], float]:
    """Send ``workload`` open-loop to ``url``; returns the results and the wall seconds
    from the first send to the last answer."""
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = loop.time()
        wall0 = time.monotonic()
        tasks: list[asyncio.Task[Result]] = []
        for req in workload.requests:
            delay = t0 + req.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(0.0, loop.time() - (t0 + req.at_s))
            tasks.append(asyncio.create_task(send_one(session, url, req, client_timeout_s, lag)))
        results = list(await asyncio.gather(*tasks))
    return results, time.monotonic() - wall0
