"""Performance model of one continuous-batching engine (one GPU / one vLLM engine rank).

Pure logic, no I/O and no clock of its own: every method that needs the time takes
``now`` (seconds, any monotonic origin), so the model can be driven step by step in
unit tests and by the asyncio loop in :mod:`controlplane.simnode.scheduler`.

The model
---------
- Requests wait in a FIFO queue. The head is admitted only when a running slot is
  free (``max_running``) *and* the KV cache has room for the whole sequence
  (prompt + the tokens it will generate). Admission is strictly FIFO: a head that
  does not fit blocks the ones behind it, as in vLLM's FCFS scheduler.
- Reserving the full length at admission means the cache can never overflow, so
  the model needs no preemption. The *reported* KV usage is what the running
  sequences hold now: prompt + tokens generated so far.
- One engine step serves every running sequence. Its duration (simulated seconds)
  is ``(decode_base_ms + decode_per_seq_ms * batch) / 1000 + prefill_tokens /
  prefill_tps``, divided by ``speed``; ``batch`` counts the sequences in the step
  and ``prefill_tokens`` the prompt tokens of the sequences admitted for it.
- At the end of a step each sequence in it has one more token. A newly admitted
  sequence gets its first token at the end of its prefill step, so time to first
  token = queueing + one step that includes its prefill.
- A sequence finishes when it has generated ``output_tokens`` tokens; its KV is
  freed at once. A cancelled sequence leaves the queue or the batch at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from controlplane.errors import InfergateError

SeqState = Literal["waiting", "running", "finished", "cancelled"]


class RequestTooLarge(InfergateError, ValueError):
    """prompt + output tokens exceed the KV capacity: the request could never run."""


@dataclass(frozen=True)
class EngineConfig:
    """Parameters of one engine. Times in milliseconds, speeds in tokens/s."""

    max_running: int = 16
    """Most sequences in the running batch (vLLM ``--max-num-seqs``)."""
    kv_capacity_tokens: int = 16384
    """KV-cache size in tokens."""
    prefill_tps: float = 4000.0
    """Prompt tokens processed per simulated second."""
    decode_base_ms: float = 20.0
    """Fixed cost of one decode step (ms, simulated)."""
    decode_per_seq_ms: float = 1.0
    """Extra cost per sequence in the batch (ms, simulated)."""
    speed: float = 1.0
    """GPU speed factor: 2.0 halves every duration."""

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.kv_capacity_tokens < 2:
            raise ValueError("kv_capacity_tokens must be >= 2")
        if self.prefill_tps <= 0:
            raise ValueError("prefill_tps must be > 0")
        if self.decode_base_ms < 0 or self.decode_per_seq_ms < 0:
            raise ValueError("decode times must be >= 0")
        if self.decode_base_ms + self.decode_per_seq_ms <= 0:
            raise ValueError("a decode step must take some time (decode_base_ms + decode_per_seq_ms > 0)")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")

    def step_seconds(self, batch: int, prefill_tokens: int) -> float:
        """Simulated duration (s) of a step with ``batch`` sequences that prefills
        ``prefill_tokens`` prompt tokens."""
        ms = self.decode_base_ms + self.decode_per_seq_ms * batch
        return (ms / 1000.0 + prefill_tokens / self.prefill_tps) / self.speed


@dataclass(eq=False)
class Sequence:
    """One request inside an engine. Times are ``now`` values given to the engine."""

    seq_id: int
    prompt_tokens: int
    output_tokens: int
    """Tokens this request will generate (already capped by max_tokens), >= 1."""
    state: SeqState = "waiting"
    generated: int = 0
    arrival: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")

    @property
    def total_tokens(self) -> int:
        """prompt + output: the KV room reserved at admission."""
        return self.prompt_tokens + self.output_tokens

    @property
    def kv_tokens(self) -> int:
        """Tokens held in the KV cache now (0 unless running)."""
        return self.prompt_tokens + self.generated if self.state == "running" else 0

    @property
    def done(self) -> bool:
        return self.state in ("finished", "cancelled")


@dataclass
class Step:
    """One planned engine step (see :meth:`Engine.plan_step`)."""

    batch: list[Sequence]
    admitted: list[Sequence]
    prefill_tokens: int
    duration_s: float
    """Simulated seconds, already divided by ``speed``."""


@dataclass
class TokenEvent:
    """A sequence got a token at the end of a step."""

    seq: Sequence
    count: int
    """Tokens generated so far (1 = first token)."""
    itl_s: float | None
    """Time since the previous token (None for the first token)."""
    finished: bool


@dataclass
class Engine:
    """Queue, running batch and KV cache of one engine. Not thread-safe."""

    config: EngineConfig = field(default_factory=EngineConfig)
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)

    # -- state -------------------------------------------------------------
    @property
    def kv_used(self) -> int:
        """Tokens held by running sequences (prompt + generated so far)."""
        return sum(s.kv_tokens for s in self.running)

    @property
    def kv_reserved(self) -> int:
        """Tokens reserved by running sequences (prompt + full output)."""
        return sum(s.total_tokens for s in self.running)

    @property
    def kv_usage(self) -> float:
        """KV-cache usage 0-1 (``kv_used / kv_capacity_tokens``)."""
        return self.kv_used / self.config.kv_capacity_tokens

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether such a request could ever be admitted."""
        return prompt_tokens + output_tokens <= self.config.kv_capacity_tokens

    # -- requests ----------------------------------------------------------
    def submit(self, seq: Sequence, now: float) -> None:
        """Append ``seq`` to the waiting queue.

        Raises :class:`RequestTooLarge` when it could never fit the KV cache and
        ``ValueError`` when it is not a fresh waiting sequence."""
        if seq.state != "waiting" or seq.generated:
            raise ValueError("only a fresh sequence can be submitted")
        if not self.fits(seq.prompt_tokens, seq.output_tokens):
            raise RequestTooLarge(
                f"{seq.total_tokens} tokens requested, KV capacity is "
                f"{self.config.kv_capacity_tokens}")
        seq.arrival = now
        self.waiting.append(seq)

    def cancel(self, seq: Sequence, now: float) -> bool:
        """Remove ``seq`` from the queue or the batch, freeing its KV at once.

        Returns True if it was waiting or running, False if already done."""
        if seq.state == "waiting":
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.state == "running":
            self.running.remove(seq)
        else:
            return False
        seq.state = "cancelled"
        seq.finished_at = now
        return True

    # -- stepping ----------------------------------------------------------
    def admit(self, now: float) -> list[Sequence]:
        """Move sequences from the head of the queue into the batch while a slot and
        KV room exist (strict FIFO). Returns the admitted ones."""
        admitted: list[Sequence] = []
        reserved = self.kv_reserved
        cap = self.config.kv_capacity_tokens
        while self.waiting and len(self.running) < self.config.max_running:
            head = self.waiting[0]
            if reserved + head.total_tokens > cap:
                break
            self.waiting.popleft()
            head.state = "running"
            head.admitted_at = now
            reserved += head.total_tokens
            self.running.append(head)
            admitted.append(head)
        return admitted

    def plan_step(self, now: float) -> Step | None:
        """Admit what fits and describe the next step; None when nothing runs."""
        admitted = self.admit(now)
        if not self.running:
            return None
        prefill = sum(s.prompt_tokens for s in admitted)
        return Step(batch=list(self.running), admitted=admitted, prefill_tokens=prefill,
                    duration_s=self.config.step_seconds(len(self.running), prefill))

    def complete_step(self, step: Step, now: float) -> list[TokenEvent]:
        """End ``step`` at ``now``: one token for every sequence of the step that is
        still running; finished ones leave the batch and free their KV."""
        events: list[TokenEvent] = []
        for seq in step.batch:
            if seq.state != "running":
                continue  # cancelled during the step
            prev = seq.last_token_at
            seq.generated += 1
            seq.last_token_at = now
            if seq.generated == 1:
                seq.first_token_at = now
            finished = seq.generated >= seq.output_tokens
            if finished:
                seq.state = "finished"
                seq.finished_at = now
                self.running.remove(seq)
            events.append(TokenEvent(seq=seq, count=seq.generated,
                                     itl_s=None if prev is None else now - prev,
                                     finished=finished))
        return events
