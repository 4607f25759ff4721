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
  and ``prefill_tokens`` the prompt tokens of the sequences admitted for it that the
  prefix cache does not hold (see below).
- At the end of a step each sequence in it has one more token. A newly admitted
  sequence gets its first token at the end of its prefill step, so time to first
  token = queueing + one step that includes its prefill.
- A sequence finishes when it has generated ``output_tokens`` tokens; its KV is
  freed at once. A cancelled sequence leaves the queue or the batch at once.

Automatic prefix caching (vLLM V1, on by default there and here; ``prefix_caching``)
------------------------------------------------------------------------------------
Each sequence carries the chained hashes of its full prompt blocks
(:mod:`controlplane.simnode.prefix`). At admission the engine looks them up in its
:class:`~controlplane.simnode.prefix.PrefixCache`: the leading blocks found,
contiguous from block 0, times ``BLOCK_TOKENS`` are the sequence's
``cached_tokens``, at most ``prompt_tokens - 1`` (vLLM always computes the last
prompt token to get logits: ``max_cache_hit_length = request.num_tokens - 1`` in
``vllm/v1/core/kv_cache_manager.py``). Only the other prompt tokens are prefilled.
Then every full block of the sequence is inserted or touched, so a sequence admitted
later in the same step can already hit them. The engine counts, at admission as vLLM
does (``PrefixCacheStats``), the queried prompt tokens and the hit tokens; with
prefix caching off nothing is looked up and nothing is counted. The KV reservation
stays prompt + output (shared blocks are not deducted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from controlplane.errors import InfergateError
from controlplane.simnode.prefix import BLOCK_TOKENS, BlockHash, PrefixCache

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
    prefix_caching: bool = True
    """Automatic prefix caching (vLLM V1 default: on; ``--no-enable-prefix-caching``)."""
    prefix_cache_blocks: int | None = None
    """Capacity of the prefix cache in blocks of ``BLOCK_TOKENS`` tokens; None =
    ``kv_capacity_tokens // BLOCK_TOKENS`` (as many blocks as the KV cache holds)."""

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
        if self.prefix_cache_blocks is not None and self.prefix_cache_blocks < 0:
            raise ValueError("prefix_cache_blocks must be >= 0")

    @property
    def prefix_cache_capacity_blocks(self) -> int:
        """Blocks the prefix cache holds (``prefix_cache_blocks`` or its default)."""
        if self.prefix_cache_blocks is not None:
            return self.prefix_cache_blocks
        return self.kv_capacity_tokens // BLOCK_TOKENS

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
    block_hashes: tuple[BlockHash, ...] = ()
    """Chained hashes of the full prompt blocks (:func:`prefix.block_hashes`); at most
    ``prompt_tokens // BLOCK_TOKENS`` of them."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at admission (not prefilled)."""
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
        if len(self.block_hashes) * BLOCK_TOKENS > self.prompt_tokens:
            raise ValueError("more full blocks than the prompt has tokens")

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the prefill computes: those not found in the prefix cache."""
        return self.prompt_tokens - self.cached_tokens

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
    """Prompt tokens computed in the step: those of the admitted sequences minus
    their ``cached_tokens``."""
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
    prefix_cache: PrefixCache = field(init=False)
    prefix_queries_tokens: int = 0
    """Prompt tokens of the sequences admitted with prefix caching on."""
    prefix_hits_tokens: int = 0
    """Of those, the tokens found in the prefix cache (``cached_tokens``)."""

    def __post_init__(self) -> None:
        self.prefix_cache = PrefixCache(self.config.prefix_cache_capacity_blocks)

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

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache and zero its counters (running sequences keep their
        ``cached_tokens``)."""
        self.prefix_cache.clear()
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

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
            self._lookup_prefix(head)
            head.state = "running"
            head.admitted_at = now
            reserved += head.total_tokens
            self.running.append(head)
            admitted.append(head)
        return admitted

    def _lookup_prefix(self, seq: Sequence) -> None:
        """Set ``seq.cached_tokens`` from the prefix cache, count the query, then
        insert or touch the sequence's blocks (see the module docstring)."""
        if not self.config.prefix_caching:
            seq.cached_tokens = 0
            return
        hit_blocks = self.prefix_cache.match(seq.block_hashes)
        seq.cached_tokens = min(hit_blocks * BLOCK_TOKENS, seq.prompt_tokens - 1)
        self.prefix_queries_tokens += seq.prompt_tokens
        self.prefix_hits_tokens += seq.cached_tokens
        self.prefix_cache.insert(seq.block_hashes)

    def plan_step(self, now: float) -> Step | None:
        """Admit what fits and describe the next step; None when nothing runs."""
        admitted = self.admit(now)
        if not self.running:
            return None
        prefill = sum(s.prefill_tokens for s in admitted)
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
