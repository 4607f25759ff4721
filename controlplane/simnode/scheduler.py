"""Asyncio driver of the engine model: one step loop per engine rank.

Requests are spread over the ranks round-robin (as vLLM's data-parallel front end
does); each rank is an independent :class:`~controlplane.simnode.engine.Engine` with
its own queue, batch, KV cache and prefix cache (``--max-running``,
``--kv-capacity-tokens`` and ``--prefix-cache-blocks`` are per rank, like vLLM's
``--max-num-seqs`` per engine).

Wall time of a step = simulated duration x ``time_scale`` x ``slowdown()``; the
slowdown is read again at every step so a fault takes effect at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

from controlplane.simnode.engine import Engine, EngineConfig, Sequence, TokenEvent
from controlplane.simnode.metrics import EngineSnapshot, Exporter, Finished

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """A submitted request: its sequence, rank and a wake-up for the handler."""

    seq: Sequence
    rank: int
    finish_reason: str = "stop"
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Scheduler:
    """Owns the engines and their step loops. Use from one event loop only."""

    def __init__(self, config: EngineConfig, engines: int, exporter: Exporter,
                 time_scale: float = 1.0, slowdown: Callable[[], float] = lambda: 1.0) -> None:
        if engines < 1:
            raise ValueError("engines must be >= 1")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.config = config
        self.engines = [Engine(config) for _ in range(engines)]
        self.exporter = exporter
        self.time_scale = time_scale
        self.slowdown = slowdown
        self._ids = itertools.count(1)
        self._rr = itertools.count()
        self._tickets: dict[int, Ticket] = {}
        self._wake = [asyncio.Event() for _ in range(engines)]
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Start one step loop per rank (call inside the running loop)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(rank), name=f"engine-{rank}")
                           for rank in range(len(self.engines))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks = []

    # -- requests ------------------------------------------------------------
    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        return self.engines[0].fits(prompt_tokens, output_tokens)

    def submit(self, prompt_tokens: int, output_tokens: int, finish_reason: str,
               block_hashes: Seq[bytes] = ()) -> Ticket:
        """Queue a request on the next rank. ``block_hashes``: chained hashes of its full
        prompt blocks (see :mod:`controlplane.simnode.prefix`). Raises
        ``RequestTooLarge`` (see engine)."""
        rank = next(self._rr) % len(self.engines)
        seq = Sequence(seq_id=next(self._ids), prompt_tokens=prompt_tokens,
                       output_tokens=output_tokens, block_hashes=tuple(block_hashes))
        self.engines[rank].submit(seq, self._now())
        ticket = Ticket(seq=seq, rank=rank, finish_reason=finish_reason)
        self._tickets[seq.seq_id] = ticket
        self._wake[rank].set()
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Drop the request from its queue or batch now; True if it was still active."""
        self._tickets.pop(ticket.seq.seq_id, None)
        return self.engines[ticket.rank].cancel(ticket.seq, self._now())

    def release(self, ticket: Ticket) -> None:
        """Forget a finished ticket."""
        self._tickets.pop(ticket.seq.seq_id, None)

    # -- state ---------------------------------------------------------------
    def snapshots(self) -> list[EngineSnapshot]:
        return [EngineSnapshot(running=len(e.running), waiting=len(e.waiting),
                               kv_used_tokens=e.kv_used,
                               kv_capacity_tokens=e.config.kv_capacity_tokens,
                               prefix_queries_tokens=e.prefix_queries_tokens,
                               prefix_hits_tokens=e.prefix_hits_tokens,
                               prefix_cached_blocks=len(e.prefix_cache))
                for e in self.engines]

    def reset_prefix_caches(self) -> None:
        """Empty every rank's prefix cache and zero its counters."""
        for e in self.engines:
            e.reset_prefix_cache()

    # -- loop ----------------------------------------------------------------
    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def _run(self, rank: int) -> None:
        engine = self.engines[rank]
        wake = self._wake[rank]
        while True:
            step = engine.plan_step(self._now())
            if step is None:
                wake.clear()
                await wake.wait()
                continue
            await asyncio.sleep(step.duration_s * self.time_scale * max(1.0, self.slowdown()))
            events = engine.complete_step(step, self._now())
            for ev in events:
                try:
                    self._deliver(rank, ev)
                except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine
                    log.exception("delivering a token event failed")

    def _deliver(self, rank: int, ev: TokenEvent) -> None:
        seq = ev.seq
        if ev.count == 1:
            self.exporter.first_token(rank, seq.prompt_tokens, (seq.first_token_at or 0) - seq.arrival)
        self.exporter.token(rank, ev.itl_s)
        ticket = self._tickets.get(seq.seq_id)
        if ev.finished:
            reason = ticket.finish_reason if ticket else "stop"
            self.exporter.finished(Finished(
                rank=rank, prompt_tokens=seq.prompt_tokens, completion_tokens=seq.generated,
                finish_reason="length" if reason == "length" else "stop",
                queue_s=(seq.admitted_at or seq.arrival) - seq.arrival,
                e2e_s=(seq.finished_at or 0) - seq.arrival))
        if ticket is not None:
            ticket.changed.set()
