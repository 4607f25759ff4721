"""The simulated pool, its capacity and the precomputed load (pure logic).

Pool: ``n_fast`` nodes at ``fast_speed`` and ``n_slow`` nodes at ``slow_speed`` (three
times slower by default), all with the same batch size ``max_running`` and step costs,
run by ``infergate simnode`` (performance model in controlplane/simnode/engine.py).

Capacity (requests per *simulated* second) of one node, from that model: with a full
batch of M sequences every step lasts ``step(M) = (decode_base_ms + decode_per_seq_ms x
M) / 1000 / speed`` and gives one token to each of the M sequences, so a request of L
output tokens uses ``L x step(M) / M`` of node time; its prefill adds ``P / prefill_tps /
speed`` (P prompt tokens) to one step during which the whole batch waits. Hence::

    capacity(node) = speed / (E[L] x step1(M) / M + E[P] / prefill_tps)
    step1(M)       = (decode_base_ms + decode_per_seq_ms x M) / 1000

with E[L] and E[P] the means of the actual workload (output lengths drawn below;
prompt tokens = ceil(characters / 4), as the simnode counts them). The pool's
capacity is the sum over nodes, and in wall-clock requests/s it is divided by the
time scale (wall seconds per simulated second). It is the throughput of a pool whose
every batch is always full, so 100 % load is the edge of stability: any queue then
grows without bound.

Load: open loop. Arrival times form a Poisson process (exponential gaps, fixed seed)
over the run; each request has a prompt (drawn without replacement while the prompt
set lasts) and an output length from a log-normal distribution (median
``output_median``, shape ``output_sigma``) rounded and clipped to ``[output_min,
output_max]``, passed to the node as ``sim_output_tokens``. The same seed gives the same
requests for every strategy.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PoolSpec:
    """Simulated nodes. Times in simulated milliseconds; speeds are factors (1 = base)."""

    n_fast: int = 2
    n_slow: int = 2
    fast_speed: float = 1.0
    slow_speed: float = 1.0 / 3.0
    max_running: int = 4
    """Sequences per batch (``--max-running``), the same on every node."""
    decode_base_ms: float = 100.0
    decode_per_seq_ms: float = 5.0
    prefill_tps: float = 4000.0
    kv_capacity_tokens: int = 4096
    """Per node; large enough that the batch size, not the KV cache, limits admission."""

    def nodes(self) -> list[tuple[str, float]]:
        """(name, speed) of every node: ``fast-1``.. then ``slow-1``.."""
        return ([(f"fast-{i + 1}", self.fast_speed) for i in range(self.n_fast)]
                + [(f"slow-{i + 1}", self.slow_speed) for i in range(self.n_slow)])

    def step_s(self, batch: int | None = None) -> float:
        """Simulated seconds of one decode step with ``batch`` sequences at speed 1."""
        b = self.max_running if batch is None else batch
        return (self.decode_base_ms + self.decode_per_seq_ms * b) / 1000.0

    def simnode_flags(self, speed: float, time_scale: float) -> list[str]:
        """``infergate simnode`` flags for one node of this pool."""
        return ["--speed", f"{speed:.6g}", "--time-scale", f"{time_scale:.6g}",
                "--max-running", str(self.max_running),
                "--kv-capacity-tokens", str(self.kv_capacity_tokens),
                "--decode-base-ms", f"{self.decode_base_ms:g}",
                "--decode-per-seq-ms", f"{self.decode_per_seq_ms:g}",
                "--prefill-tps", f"{self.prefill_tps:g}"]


def node_capacity_rps(speed: float, spec: PoolSpec, mean_output_tokens: float,
                      mean_prompt_tokens: float) -> float:
    """Requests per simulated second one node completes with a full batch (formula in
    the module docstring). Raises ``ValueError`` for non-positive inputs."""
    if speed <= 0 or mean_output_tokens <= 0 or mean_prompt_tokens < 0:
        raise ValueError("speed and mean output tokens must be > 0, prompt tokens >= 0")
    per_request = (mean_output_tokens * spec.step_s() / spec.max_running
                   + mean_prompt_tokens / spec.prefill_tps)
    return speed / per_request


def pool_capacity_rps(spec: PoolSpec, mean_output_tokens: float, mean_prompt_tokens: float) -> float:
    """Sum of :func:`node_capacity_rps` over the pool (requests per simulated second)."""
    return sum(node_capacity_rps(speed, spec, mean_output_tokens, mean_prompt_tokens)
               for _, speed in spec.nodes())


def prompt_tokens(text: str) -> int:
    """Prompt tokens as the simnode counts them: ceil(characters / 4), at least 1."""
    return max(1, math.ceil(len(text) / 4))


@dataclass(frozen=True)
class LengthDist:
    """Clipped log-normal output lengths (tokens)."""

    median: float = 16.0
    sigma: float = 0.9
    min_tokens: int = 2
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need median > 0, sigma >= 0 and 1 <= min_tokens <= max_tokens")

    def draw(self, rng: random.Random) -> int:
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(self.max_tokens, max(self.min_tokens, round(x))))


@dataclass(frozen=True)
class Request:
    """One request of the load: when it is sent (wall seconds from the run start),
    what it asks and how many tokens the node will generate."""

    idx: int
    at_s: float
    prompt: str
    output_tokens: int
    model: str | None = None
    """The ``model`` of the body (``None``: none sent)."""


@dataclass(frozen=True)
class Workload:
    """The requests of one run, and the facts used to size it."""

    requests: list[Request]
    rate_rps: float
    """Offered load, wall-clock requests/s."""
    duration_s: float
    """Wall seconds over which requests arrive."""
    seed: int

    @property
    def mean_output_tokens(self) -> float:
        return (sum(r.output_tokens for r in self.requests) / len(self.requests)
                if self.requests else 0.0)

    @property
    def mean_prompt_tokens(self) -> float:
        return (sum(prompt_tokens(r.prompt) for r in self.requests) / len(self.requests)
                if self.requests else 0.0)


@dataclass
class RequestMix:
    """An endless, seeded sequence of (prompt, output length) pairs and unit-rate
    Poisson gaps. Every run takes a prefix of it, so runs at different rates send the
    same requests in the same order, only closer together."""

    prompts: list[str]
    lengths: LengthDist = field(default_factory=LengthDist)
    seed: int = 1
    _pairs: list[tuple[str, int, float]] = field(default_factory=list, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts")
        self._rng = random.Random(self.seed)

    def _extend(self, n: int) -> None:
        while len(self._pairs) < n:
            if not self._order:
                self._order = list(range(len(self.prompts)))
                self._rng.shuffle(self._order)
            prompt = self.prompts[self._order.pop()]
            self._pairs.append((prompt, self.lengths.draw(self._rng), self._rng.expovariate(1.0)))

    def workload(self, rate_rps: float, duration_s: float) -> Workload:
        """Requests arriving at ``rate_rps`` (wall requests/s, Poisson) during
        ``duration_s`` wall seconds. Raises ``ValueError`` for a non-positive rate or
        duration."""
        if rate_rps <= 0 or duration_s <= 0:
            raise ValueError("rate and duration must be > 0")
        out: list[Request] = []
        t = 0.0
        i = 0
        while True:
            self._extend(i + 1)
            prompt, n_out, gap = self._pairs[i]
            t += gap / rate_rps
            if t >= duration_s:
                break
            out.append(Request(idx=i, at_s=t, prompt=prompt, output_tokens=n_out))
            i += 1
        return Workload(requests=out, rate_rps=rate_rps, duration_s=duration_s, seed=self.seed)

    def sample_means(self, n: int = 20000) -> tuple[float, float]:
        """(mean output tokens, mean prompt tokens) over the first ``n`` requests of the
        mix: the E[L] and E[P] of the capacity formula."""
        self._extend(n)
        pairs = self._pairs[:n]
        return (sum(p[1] for p in pairs) / n, sum(prompt_tokens(p[0]) for p in pairs) / n)


def spec_dict(spec: PoolSpec, lengths: LengthDist) -> dict:
    """Both specs as one JSON-ready dict (for the header record)."""
    return {"pool": asdict(spec), "output_tokens": asdict(lengths)}
