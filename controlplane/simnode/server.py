"""HTTP side of the simulated node (aiohttp).

Main port:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI API, streaming or
  not (see :mod:`.wire`). Streaming answers send their headers and the first chunk
  when the first token is out (after queueing + prefill), then one chunk per token
  at the pace of the engine model.
- ``POST /v1/responses``, ``/v1/rerank``, ``/rerank``, ``/v1/score``, ``/v1/audio/*``,
  ``/tokenize``, ``/detokenize``: a JSON echo of the request (see :mod:`.echo`).
- ``GET /v1/models``; ``GET /health`` (200, empty body; 503 with ``health_fail``);
  ``GET /metrics`` in the node's dialect (see :mod:`.metrics`; 500 with
  ``metrics_fail``; 404 for dialect ``none``); ``GET /version``.
- The control API (also on ``--control-port``, which keeps answering while the main
  port refuses connections):
  ``GET|POST /_sim/faults`` (POST: JSON object, any subset of :class:`Faults`;
  answers the full faults), ``GET /_sim/state``, ``POST /_sim/reset`` (zero the
  counters and the Prometheus metrics, empty the prefix caches; faults stay).

With ``llamacpp`` (``--llamacpp``) the node behaves like llama-cpp-python's
OpenAI-compatible server (``python -m llama_cpp.server``), whose model sits behind a
lock: one request at a time (the others wait for the lock), no ``/health`` and no
``/metrics`` (404), and ``GET /v1/models`` takes the model lock too, so it waits for the
running request; and, as with that server's default ``interrupt_requests=True``, a
stream that sees another request waiting for the lock ends at once with
``data: [DONE]`` and no final chunk (counted in ``interrupted_total``). Its two-lock
scheme is copied: a waiting request holds the outer lock while it waits for the inner
one, and a stream checks the outer lock between tokens.

Every answer carries ``X-Sim-Node: <name>``; the node name is also the
``system_fingerprint`` of completions, never part of the generated text.

Counters in ``/_sim/state``: ``requests_total`` = inference requests received;
``completed_total`` = answered in full; ``cancelled_total`` = the client went away
before the answer was complete (queued, running, streaming or held by ``hang`` or
``stall``) -
the request then leaves the queue/batch at once and its KV is freed;
``errors_total`` = inference requests answered with an error status (bad input,
injected errors) or with garbage; ``interrupted_total`` = streams ended early by a
waiting request (``llamacpp``); ``cancelled_generated`` = tokens the engine had
generated for the last cancelled request when it was cancelled (-1: none); ``by_path`` = requests per path on the main port
(control paths excluded); ``prefix_cache`` = ``{"queries_tokens", "hits_tokens",
"cached_blocks"}`` summed over the engine ranks (prompt tokens looked up in the
prefix caches, tokens found there, blocks held now; per rank in ``engines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from controlplane import __version__, procs
from controlplane.simnode import echo, wire
from controlplane.simnode.engine import EngineConfig, RequestTooLarge
from controlplane.simnode.faults import Faults, FaultsError, apply_update
from controlplane.simnode.metrics import make_exporter
from controlplane.simnode.scheduler import Scheduler, Ticket

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/_sim/"
INFERENCE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
GARBAGE = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1 this is not HTTP \x00\xff\xfe\r\n\r\n"
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class NodeOptions:
    """Everything the CLI configures. Times: see :class:`EngineConfig`."""

    host: str = "127.0.0.1"
    port: int = 9001
    control_port: int | None = None
    name: str = "sim-9001"
    model: str = "sim-llama"
    dialect: str = "vllm"
    engines: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0
    """Wall seconds per simulated second (0.1 = ten times faster)."""
    output_min: int = 16
    output_max: int = 128
    faults: Faults = field(default_factory=Faults)
    llamacpp: bool = False
    """Behave like llama-cpp-python's server (see the module docstring)."""


@dataclass
class Counters:
    requests_total: int = 0
    completed_total: int = 0
    cancelled_total: int = 0
    errors_total: int = 0
    cancelled_generated: int = -1
    """Tokens the engine had generated for the last request cancelled because its client
    went away (-1: none yet): the work done for a client that left stops there."""
    interrupted_total: int = 0
    by_path: dict[str, int] = field(default_factory=dict)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> web.Response:
    return json_response(wire.error_body(message, type_=type_, param=param, code=code), status)


class SimNode:
    """One simulated node: scheduler, exporter, faults, counters and the two apps."""

    def __init__(self, opts: NodeOptions) -> None:
        if opts.engines < 1:
            raise ValueError("engines must be >= 1")
        if not 1 <= opts.output_min <= opts.output_max:
            raise ValueError("output tokens: need 1 <= MIN <= MAX")
        self.opts = opts
        self.faults = opts.faults
        self.counters = Counters()
        self.exporter = make_exporter(opts.dialect, opts.model, opts.engines)
        self.scheduler = Scheduler(opts.engine, opts.engines, self.exporter,
                                   time_scale=opts.time_scale,
                                   slowdown=lambda: self.faults.slowdown)
        self.created = int(time.time())
        self._rng = random.Random()
        self._main_runner: web.AppRunner | None = None
        self._control_runner: web.AppRunner | None = None
        self._main_site: web.TCPSite | None = None
        self._refuse_lock = asyncio.Lock()
        self._inflight: set[asyncio.Task[Any]] = set()
        # llamacpp: the model lock (llama_cpp.server.app: llama_outer_lock / llama_inner_lock)
        self._outer = asyncio.Lock()
        self._inner = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def _model_lock(self) -> Any:
        """Hold the model (``llamacpp``), as llama-cpp-python's ``get_llama_proxy`` does:
        the outer lock while waiting for the inner one, then the inner one alone. A
        no-op without ``llamacpp``."""
        if not self.opts.llamacpp:
            yield
            return
        await self._outer.acquire()
        outer_held = True
        try:
            await self._inner.acquire()
            try:
                self._outer.release()
                outer_held = False
                yield
            finally:
                self._inner.release()
        finally:
            if outer_held:
                self._outer.release()

    def _interrupted(self) -> bool:
        """A stream should stop: another request waits for the model (``llamacpp``)."""
        return self.opts.llamacpp and self._outer.locked()

    # -- apps ----------------------------------------------------------------
    def _control_routes(self, app: web.Application) -> None:
        app.router.add_get("/_sim/faults", self.get_faults)
        app.router.add_post("/_sim/faults", self.post_faults)
        app.router.add_get("/_sim/state", self.get_state)
        app.router.add_post("/_sim/reset", self.post_reset)

    def main_app(self) -> web.Application:
        app = web.Application(middlewares=[self._main_mw, self._errors_mw],
                              client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        if not self.opts.llamacpp:
            app.router.add_get("/health", self.health)
            app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.version)
        echo.add_routes(app, self.opts.name, self.opts.model)
        self._control_routes(app)
        app.on_response_prepare.append(self._tag)
        return app

    def control_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_mw])
        self._control_routes(app)
        app.on_response_prepare.append(self._tag)
        return app

    async def _tag(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Sim-Node"] = self.opts.name

    @web.middleware
    async def _main_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if not path.startswith(CONTROL_PREFIX):
            if self.faults.refuse:
                # Not listening any more: a request on a connection opened before gets
                # the connection dropped, no HTTP answer.
                if request.transport is not None:
                    request.transport.abort()
                return web.Response(status=503)  # cannot be written: the connection is gone
            by_path = self.counters.by_path
            by_path[path] = by_path.get(path, 0) + 1
        return await handler(request)

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Routing errors (404, 405, 413) as OpenAI-style JSON."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason, type_="invalid_request_error",
                                  code=exc.status)

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """Start the scheduler and listen (main port unless ``refuse``; control port)."""
        self.scheduler.start()
        access = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None
        self._main_runner = web.AppRunner(self.main_app(), handler_cancellation=True,
                                          shutdown_timeout=1.0, access_log=access)
        await self._main_runner.setup()
        if self.opts.control_port is not None:
            self._control_runner = web.AppRunner(self.control_app(), handler_cancellation=True,
                                                 shutdown_timeout=1.0, access_log=access)
            await self._control_runner.setup()
            await web.TCPSite(self._control_runner, self.opts.host, self.opts.control_port).start()
        if not self.faults.refuse:
            await self._listen()

    async def stop(self) -> None:
        """Stop listening, end in-flight inference handlers at once, stop the engines."""
        if self._main_site is not None:
            await self._main_site.stop()
            self._main_site = None
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runner in (self._main_runner, self._control_runner):
            if runner is not None:
                await runner.cleanup()
        await self.scheduler.stop()

    async def _listen(self) -> None:
        assert self._main_runner is not None
        site = web.TCPSite(self._main_runner, self.opts.host, self.opts.port, reuse_address=True)
        await site.start()
        self._main_site = site

    async def _apply_refuse(self) -> None:
        """Bring the main listener in line with ``faults.refuse``."""
        async with self._refuse_lock:
            if self._main_runner is None:
                return
            if self.faults.refuse and self._main_site is not None:
                site, self._main_site = self._main_site, None
                await site.stop()
                server = self._main_runner.server
                if server is not None:
                    for conn in server.connections:
                        conn.close()  # idle keep-alive connections go; in-flight ones finish
            elif not self.faults.refuse and self._main_site is None:
                await self._listen()

    # -- control API ---------------------------------------------------------
    async def get_faults(self, request: web.Request) -> web.Response:
        """``GET /_sim/faults`` -> the current faults."""
        return json_response(self.faults.model_dump())

    async def post_faults(self, request: web.Request) -> web.Response:
        """``POST /_sim/faults`` with any subset of the faults -> the full faults.

        400 for bad JSON, unknown fields or out-of-range values, and for ``refuse`` on a
        node started without ``--control-port`` (nothing changes)."""
        try:
            update = wire.parse_body(await request.read())
            new = apply_update(self.faults, update)
        except wire.ApiError as exc:
            return json_response(exc.body(), exc.status)
        except FaultsError as exc:
            return error_response(400, str(exc), param="faults")
        if new.refuse and self.opts.control_port is None:
            return error_response(400, "refuse needs --control-port: without it nothing could "
                                  "turn it off again", param="refuse")
        self.faults = new
        await self._apply_refuse()
        log.info("faults now %s", new.model_dump())
        return json_response(new.model_dump())

    def state(self) -> dict[str, Any]:
        """The ``/_sim/state`` document."""
        snaps = self.scheduler.snapshots()
        c = self.counters
        return {
            "name": self.opts.name, "model": self.opts.model, "dialect": self.opts.dialect,
            "running": sum(s.running for s in snaps), "waiting": sum(s.waiting for s in snaps),
            "kv_used_tokens": sum(s.kv_used_tokens for s in snaps),
            "kv_capacity_tokens": sum(s.kv_capacity_tokens for s in snaps),
            "requests_total": c.requests_total, "completed_total": c.completed_total,
            "cancelled_total": c.cancelled_total, "errors_total": c.errors_total,
            "interrupted_total": c.interrupted_total, "by_path": dict(c.by_path),
            "cancelled_generated": c.cancelled_generated,
            "prefix_cache": {
                "queries_tokens": sum(s.prefix_queries_tokens for s in snaps),
                "hits_tokens": sum(s.prefix_hits_tokens for s in snaps),
                "cached_blocks": sum(s.prefix_cached_blocks for s in snaps),
            },
            "engines": [{"engine": i, **asdict(s)} for i, s in enumerate(snaps)],
            "listening": self._main_site is not None,
            "faults": self.faults.model_dump(),
        }

    async def get_state(self, request: web.Request) -> web.Response:
        """``GET /_sim/state`` -> see :meth:`state`."""
        return json_response(self.state())

    async def post_reset(self, request: web.Request) -> web.Response:
        """``POST /_sim/reset``: zero the counters and the Prometheus metrics, empty the
        prefix caches (as after a restart) -> state."""
        self.counters = Counters()
        self.scheduler.reset_prefix_caches()
        self.exporter.reset()
        return json_response(self.state())

    # -- plain endpoints -----------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        # the stack instance id set by ``infergate up`` (INFERGATE_INSTANCE_ID), so it
        # never adopts another stack's node
        return web.Response(status=503 if self.faults.health_fail else 200,
                            headers={procs.INSTANCE_HEADER: procs.instance_id()})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": f"infergate-simnode {__version__}"})

    async def models(self, request: web.Request) -> web.Response:
        async with self._model_lock():
            return json_response(wire.models_list(self.opts.model, self.created,
                                                  self.opts.engine.kv_capacity_tokens))

    async def metrics(self, request: web.Request) -> web.Response:
        if self.faults.metrics_fail:
            return error_response(500, "simulated metrics failure", type_="internal_server_error",
                                  code=500)
        out = self.exporter.render(self.scheduler.snapshots())
        if out is None:
            return error_response(404, "Not Found", code=404)
        body, ctype = out
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = ctype
        return resp

    # -- inference -----------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._tracked(request, "completion")

    async def _tracked(self, request: web.Request, kind: wire.Kind) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            async with self._model_lock():
                return await self._inference(request, kind)
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _inference(self, request: web.Request, kind: wire.Kind) -> web.StreamResponse:
        c = self.counters
        c.requests_total += 1
        f = self.faults
        if f.garbage:
            c.errors_total += 1
            return await self._garbage(request)
        if f.hang:
            try:
                await asyncio.Future()  # until the client goes away (handler cancelled)
            finally:
                self.counters.cancelled_total += 1
        if f.error_rate > 0 and self._rng.random() < f.error_rate:
            c.errors_total += 1
            return error_response(f.error_status, "simulated server error",
                                  type_="internal_server_error", code=f.error_status)
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise wire.ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes") from None
            req = wire.parse_request(kind, wire.parse_body(raw), self.opts.model)
            if f.stall:
                return await self._stall(request, req)
            n, _ = wire.plan_length(req, self.opts.output_min, self.opts.output_max)
            if not self.scheduler.fits(req.prompt_tokens, n):
                raise wire.context_error(req, n, self.opts.engine.kv_capacity_tokens)
            plan = wire.plan_output(req, self.opts.output_min, self.opts.output_max)
            try:
                ticket = self.scheduler.submit(req.prompt_tokens, n, plan.finish_reason,
                                               req.block_hashes)
            except RequestTooLarge:
                raise wire.context_error(req, n, self.opts.engine.kv_capacity_tokens) from None
        except wire.ApiError as exc:
            self.counters.errors_total += 1
            return json_response(exc.body(), exc.status)

        meta = wire.ResponseMeta.new(kind, req.model, self.opts.name)
        try:
            if req.stream:
                resp = await self._stream(request, req, plan, ticket, meta)
            else:
                await self._wait_finished(ticket)
                resp = json_response(wire.full_response(meta, "".join(plan.tokens),
                                                        plan.finish_reason, req.prompt_tokens, n,
                                                        ticket.seq.cached_tokens))
                await resp.prepare(request)
                await resp.write_eof()
        except asyncio.CancelledError:
            self._cancelled(ticket)
            raise
        except ConnectionError:
            self._cancelled(ticket)
            return web.Response(status=499)  # never reaches the client: it is gone
        finally:
            self.scheduler.release(ticket)
        self.counters.completed_total += 1
        return resp

    async def _stall(self, request: web.Request, req: wire.InferenceRequest) -> web.StreamResponse:
        """The ``stall`` fault: a stream's headers at once, then nothing until the client
        goes away (the handler is cancelled; counted in ``cancelled_total``)."""
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
        try:
            await asyncio.Future()
        finally:
            self.counters.cancelled_total += 1
        raise AssertionError("unreachable")  # pragma: no cover

    def _cancelled(self, ticket: Ticket) -> None:
        self.scheduler.cancel(ticket)
        self.counters.cancelled_total += 1
        self.counters.cancelled_generated = ticket.seq.generated

    @staticmethod
    async def _wait_finished(ticket: Ticket) -> None:
        while ticket.seq.state != "finished":
            ticket.changed.clear()
            await ticket.changed.wait()

    async def _stream(self, request: web.Request, req: wire.InferenceRequest, plan: wire.Plan,
                      ticket: Ticket, meta: wire.ResponseMeta) -> web.StreamResponse:
        seq = ticket.seq
        iu = req.include_usage
        resp: web.StreamResponse | None = None
        sent = 0
        while True:
            if resp is not None and self._interrupted():
                # llama-cpp-python, interrupt_requests=True: [DONE] at once, no final chunk
                self.scheduler.cancel(ticket)
                self.counters.interrupted_total += 1
                await resp.write(wire.SSE_DONE)
                await resp.write_eof()
                return resp
            if seq.generated == sent and seq.state != "finished":
                ticket.changed.clear()
                await ticket.changed.wait()
                continue
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache"})
                await resp.prepare(request)
                if req.kind == "chat":
                    await resp.write(wire.sse(wire.chunk(meta, role=True, content="",
                                                         include_usage=iu)))
                if self.faults.sse_error:
                    return await self._sse_error(resp, ticket)
            upto = seq.generated
            reset = self.faults.reset_after_tokens
            if reset and upto >= reset:
                upto = reset
            for i in range(sent, upto):
                await resp.write(wire.sse(wire.chunk(meta, content=plan.tokens[i],
                                                     include_usage=iu)))
            sent = upto
            if reset and sent >= reset:
                self._reset(request)
            if seq.state == "finished" and sent >= seq.generated:
                break
        if req.kind == "chat":
            last = wire.chunk(meta, finish_reason=plan.finish_reason, include_usage=iu)
        else:
            last = wire.chunk(meta, content="", finish_reason=plan.finish_reason, include_usage=iu)
        await resp.write(wire.sse(last))
        if iu:
            await resp.write(wire.sse(wire.usage_chunk(meta, req.prompt_tokens, len(plan.tokens),
                                                       seq.cached_tokens)))
        await resp.write(wire.SSE_DONE)
        await resp.write_eof()
        return resp

    async def _sse_error(self, resp: web.StreamResponse, ticket: Ticket) -> web.StreamResponse:
        """The ``sse_error`` fault: an in-band error after the 200, before any content."""
        self.scheduler.cancel(ticket)
        self.counters.errors_total += 1
        await resp.write(wire.sse(wire.error_body("simulated generation failure",
                                                  type_="internal_server_error")))
        await resp.write(wire.SSE_DONE)
        await resp.write_eof()
        return resp

    @staticmethod
    def _reset(request: web.Request) -> None:
        """The ``reset_after_tokens`` fault: the connection is reset (RST, no clean end)."""
        transport = request.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        raise ConnectionResetError("simulated reset")

    async def _garbage(self, request: web.Request) -> web.StreamResponse:
        """Bytes that are not HTTP, then close; the handler ends without an answer."""
        transport = request.transport
        if transport is not None and not transport.is_closing():
            transport.write(GARBAGE)
            transport.close()
        return web.Response(status=502)  # cannot be written: the connection is closing
