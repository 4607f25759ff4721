"""The benchmark's stream reader (bench.scheduler.loadgen.stream_request, used by
send_one and the session driver) against an in-process aiohttp server: events, [DONE],
a stream cut short, an error status and the deadline."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from bench.scheduler.loadgen import Result, stream_request


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions"


def _sse(*events: bytes, done: bool = True, delay: float = 0.0):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Sim-Node": "n1"})
        await resp.prepare(request)
        for e in events:
            await asyncio.sleep(delay)
            await resp.write(b"data: " + e + b"\n\n")
        if done:
            await resp.write(b"data: [DONE]\n\n")
        return resp
    return handler


async def _run(handler, deadline_s: float = 5.0) -> tuple[bool, Result, list[bytes]]:
    runner, url = await _serve(handler)
    seen: list[bytes] = []
    res = Result(idx=0, outcome="error")
    try:
        async with aiohttp.ClientSession() as s:
            done = await stream_request(s, url, {"messages": []}, deadline_s, res,
                                        lambda p, t: seen.append(p))
    finally:
        await runner.cleanup()
    return done, res, seen


def test_events_and_done() -> None:
    done, res, seen = asyncio.run(_run(_sse(b'{"a":1}', b'{"b":2}')))
    assert done and res.outcome == "ok" and res.status == 200 and res.node == "n1"
    assert seen == [b'{"a":1}', b'{"b":2}'] and res.events == 2 and res.e2e_s is not None


def test_cut_stream_error_status_and_deadline() -> None:
    done, res, _ = asyncio.run(_run(_sse(b'{"a":1}', done=False)))
    assert not done and res.outcome == "error" and "without [DONE]" in res.error

    async def teapot(request: web.Request) -> web.Response:
        return web.Response(status=418, text="short and stout")
    done, res, _ = asyncio.run(_run(teapot))
    assert not done and res.status == 418 and "HTTP 418" in res.error

    done, res, seen = asyncio.run(_run(_sse(b"x", b"y", delay=0.5), deadline_s=0.3))
    assert not done and res.outcome == "timeout" and seen == []
