"""Multi-turn chat sessions with shared system prompts, and their closed-loop driver.

Workload (pure, seeded: :class:`SessionSpec`, :func:`build_sessions`)
---------------------------------------------------------------------
- ``groups`` groups (an application, a tenant, an agent), each with its own system
  prompt of ``system_tokens`` tokens (uniform integer in the range, per group). The text
  is made of pseudo-words drawn per group, 4 characters a token as the simnode counts
  them (exactly ``4 x tokens`` characters), and starts with a fixed-width tag naming
  the run salt and the group, so two groups differ from their first 16-token block on.
- ``users_per_group`` users per group, each running one session: ``turns`` turns
  (uniform integer), each user turn ``user_tokens`` tokens (uniform integer; text
  starting with a tag naming the group, user and turn), each answer
  ``lengths.draw()`` tokens (the :class:`~bench.scheduler.workload.LengthDist` of the
  other scenarios) passed to the node as ``sim_output_tokens``.
- Turn ``k`` sends ``[system, user_1, assistant_1, ..., user_k]``: the history grows
  with the assistant's actual answer text (the concatenated stream deltas) and the next
  user turn. An answer that failed (timeout, error status, cut stream) leaves no
  assistant message: the session goes on with its next user turn, so every strategy
  sends the same turns.
- Think time before every turn after the first: exponential with mean
  ``think_mean_s`` simulated seconds (drawn with the workload, so the same for every
  strategy; 0 = none), scaled by the time scale like every other duration.
- The order of the sessions is a seeded shuffle of all (group, user) pairs; session
  starts form a Poisson process (unit-rate gaps drawn once, divided by the session
  rate), so runs at different loads start the same sessions in the same order, only
  closer together. A run either starts every session of the population or only those
  starting within a window.

Load (:func:`session_rate`)
---------------------------
Load is a fraction of the pool's capacity **without prefix caching**:
``pool_capacity_rps(spec, E[L], E[P])`` of bench/scheduler/workload.py with E[L] the
mean output tokens and E[P] the mean prompt tokens per request of this workload (every
turn of every session, the history included; answers estimated with the simnode's own
text generator, which gives them the same length statistics as the real ones). The
session start rate is ``fraction x capacity / E[turns]`` so that in steady state the
requests arrive at ``fraction x capacity``. With prefix caching a node prefills only
the uncached tokens, so a pool whose routing keeps the caches warm has headroom at a
load near 1; one whose routing scatters the sessions does not.

Driver (:func:`run_sessions`)
-----------------------------
Closed loop per session: the next turn is sent when the answer to the previous one has
arrived (or failed) and the think time has passed. Requests are streaming chat
completions with ``stream_options.include_usage`` (the usage chunk's
``prompt_tokens_details.cached_tokens`` gives a client-side hit rate) and
``Cache-Control: no-cache``; the client gives up at the deadline as in loadgen.py.
With several edges, turn ``k`` of the ``i``-th session goes to edge ``(i + k) mod
edges``: consecutive turns of a session alternate between edges, as behind an L4 load
balancer. Node states (``/_sim/state``: running, waiting, requests_total) are sampled
every ``sample_interval_s`` wall seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from controlplane.simnode import textgen

from .loadgen import Result, StateSamples, sample_states, stream_request
from .workload import LengthDist, PoolSpec, pool_capacity_rps

#: Characters per token, as the simnode counts prompt tokens.
CHARS_PER_TOKEN = 4
#: Tokens per prefix-cache block of the simnode (vLLM's default block size).
BLOCK_TOKENS = 16

_CONSONANTS = "bcdfghjklmnprstvz"
_VOWELS = "aeiou"


def words_text(rng: random.Random, tag: str, tokens: int) -> str:
    """``tag`` followed by pseudo-words drawn from ``rng``, cut to exactly ``tokens x 4``
    characters (``tokens`` >= 1)."""
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    n_chars = tokens * CHARS_PER_TOKEN
    parts = [tag]
    size = len(tag)
    while size < n_chars:
        syllables = rng.randint(1, 4)
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_chars]


def text_tokens(text: str) -> int:
    """Prompt tokens of ``text`` as the simnode counts them: ceil(characters / 4)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


@dataclass(frozen=True)
class SessionSpec:
    """Parameters of the session workload. Token counts are simnode tokens (4
    characters); ranges are inclusive ``(low, high)``; times in simulated seconds."""

    groups: int = 40
    users_per_group: int = 5
    system_tokens: tuple[int, int] = (2000, 6000)
    turns: tuple[int, int] = (3, 8)
    user_tokens: tuple[int, int] = (50, 200)
    think_mean_s: float = 3.0
    """Mean think time before turns 2.. (exponential), simulated seconds; 0 = none."""
    lengths: LengthDist = field(default_factory=LengthDist)

    def __post_init__(self) -> None:
        for name in ("system_tokens", "turns", "user_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= low <= high")
        if self.groups < 1 or self.users_per_group < 1:
            raise ValueError("groups and users_per_group must be >= 1")
        if self.think_mean_s < 0:
            raise ValueError("think_mean_s must be >= 0")

    @property
    def max_request_tokens(self) -> int:
        """An upper bound of prompt + output tokens of any request (the answers in the
        history counted at 2 characters a token more than the longest simnode word)."""
        longest_word = max(len(w) for w in textgen.WORDS) + 2
        answer = math.ceil(self.lengths.max_tokens * longest_word / CHARS_PER_TOKEN)
        t = self.turns[1]
        return (self.system_tokens[1] + t * self.user_tokens[1] + (t - 1) * answer
                + self.lengths.max_tokens)


@dataclass(frozen=True)
class Turn:
    """One turn of a session: the user's text, the answer length and the think time
    before it is sent."""

    user: str
    output_tokens: int
    think_s: float
    """Simulated seconds between the previous answer and this turn (0 for turn 1)."""


@dataclass(frozen=True)
class Session:
    """One user's conversation."""

    idx: int
    """Position in the start order (0 = first to start)."""
    group: int
    user: int
    system: str
    turns: tuple[Turn, ...]
    start_gap: float
    """Unit-rate exponential gap before this session's start (divide by the rate)."""

    def messages(self, k: int, answers: Sequence[str | None]) -> list[dict[str, str]]:
        """The messages of turn ``k`` (0-based) given the answers to turns ``0..k-1``
        (``None``: that answer failed and is left out)."""
        if not 0 <= k < len(self.turns):
            raise IndexError(f"turn {k} of a {len(self.turns)}-turn session")
        if len(answers) < k:
            raise ValueError(f"turn {k} needs {k} answers, got {len(answers)}")
        out = [{"role": "system", "content": self.system}]
        for j in range(k):
            out.append({"role": "user", "content": self.turns[j].user})
            if answers[j] is not None:
                out.append({"role": "assistant", "content": answers[j] or ""})
        out.append({"role": "user", "content": self.turns[k].user})
        return out

    def request_id(self, k: int) -> int:
        """A request index unique over the run: ``idx x 64 + k``."""
        return self.idx * 64 + k


def system_prompt(group: int, tokens: int, seed: int, salt: int = 0) -> str:
    """The system prompt of ``group``: a fixed-width tag with ``salt`` and the group
    number, then the group's own pseudo-words (``tokens x 4`` characters)."""
    rng = random.Random(f"system:{seed}:{group}")
    return words_text(rng, f"[run {salt:04d} group {group:04d} system] You are", tokens)


def build_sessions(spec: SessionSpec, seed: int, salt: int = 0) -> list[Session]:
    """Every session of the population in start order (pure, seeded).

    The same ``seed`` gives the same sessions, lengths, think times and start gaps;
    ``salt`` changes only the tags at the start of the texts (same lengths), so a run
    with another salt finds nothing of an earlier run in the nodes' prefix caches."""
    rng = random.Random(seed)
    sys_tokens = [rng.randint(*spec.system_tokens) for _ in range(spec.groups)]
    systems = [system_prompt(g, sys_tokens[g], seed, salt) for g in range(spec.groups)]
    pairs = [(g, u) for g in range(spec.groups) for u in range(spec.users_per_group)]
    rng.shuffle(pairs)
    out: list[Session] = []
    for i, (g, u) in enumerate(pairs):
        srng = random.Random(f"session:{seed}:{g}:{u}")
        n = srng.randint(*spec.turns)
        turns = []
        for k in range(n):
            user = words_text(srng, f"[run {salt:04d} user {g:04d}-{u:04d} turn {k:02d}]",
                              srng.randint(*spec.user_tokens))
            think = (srng.expovariate(1.0 / spec.think_mean_s)
                     if k and spec.think_mean_s > 0 else 0.0)
            turns.append(Turn(user=user, output_tokens=spec.lengths.draw(srng), think_s=think))
        out.append(Session(idx=i, group=g, user=u, system=systems[g], turns=tuple(turns),
                           start_gap=rng.expovariate(1.0)))
    return out


def estimated_answer(session: Session, k: int) -> str:
    """Text standing in for the answer to turn ``k`` when sizing the load: the simnode's
    generator for ``output_tokens`` tokens (same length statistics as a real answer)."""
    return "".join(textgen.generate_tokens(f"estimate:{session.idx}:{k}",
                                           session.turns[k].output_tokens))


def prompt_tokens_of(messages: Sequence[dict[str, str]]) -> int:
    """Prompt tokens the simnode counts for ``messages``: ceil(sum of the content
    characters / 4)."""
    return text_tokens("".join(m["content"] for m in messages))


@dataclass(frozen=True)
class WorkloadMeans:
    """Per-request means of a session population (tokens) and turns per session."""

    output_tokens: float
    prompt_tokens: float
    turns: float
    requests: int


def workload_means(sessions: Sequence[Session]) -> WorkloadMeans:
    """Means over every turn of ``sessions``, answers in the history estimated with
    :func:`estimated_answer`. Raises ``ValueError`` for no sessions."""
    if not sessions:
        raise ValueError("no sessions")
    outs: list[int] = []
    prompts: list[int] = []
    for s in sessions:
        answers: list[str | None] = []
        chars = len(s.system)
        for k, t in enumerate(s.turns):
            chars += len(t.user)
            prompts.append(max(1, math.ceil(chars / CHARS_PER_TOKEN)))
            outs.append(t.output_tokens)
            answers.append(estimated_answer(s, k))
            chars += len(answers[-1] or "")
    n = len(outs)
    return WorkloadMeans(output_tokens=sum(outs) / n, prompt_tokens=sum(prompts) / n,
                         turns=n / len(sessions), requests=n)


def session_rate(spec: PoolSpec, means: WorkloadMeans, fraction: float) -> float:
    """Session starts per simulated second that offer ``fraction`` of the pool's
    capacity without prefix caching (see the module docstring). Raises ``ValueError``
    for a non-positive fraction."""
    if fraction <= 0:
        raise ValueError("fraction must be > 0")
    cap = pool_capacity_rps(spec, means.output_tokens, means.prompt_tokens)
    return fraction * cap / means.turns


def start_times(sessions: Sequence[Session], rate: float,
                window: float | None = None) -> list[tuple[Session, float]]:
    """(session, start time) for the sessions starting before ``window`` (all when
    ``None``), times in the unit of ``1 / rate``: cumulative ``start_gap / rate``, the
    first session at its first gap. Raises ``ValueError`` for a non-positive rate."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    out: list[tuple[Session, float]] = []
    t = 0.0
    for s in sessions:
        t += s.start_gap / rate
        if window is not None and t >= window:
            break
        out.append((s, t))
    return out


# --------------------------------------------------------------------------- driver

@dataclass
class TurnResult(Result):
    """A :class:`~bench.scheduler.loadgen.Result` with what the session needs."""

    session: int = -1
    turn: int = -1
    edge: int = 0
    answer: str | None = None
    """The concatenated stream deltas of an ok answer (else ``None``)."""
    prompt_tokens: int = 0
    """As the client counts them (ceil(content characters / 4))."""
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` of the answer, when present."""
    usage_prompt_tokens: int | None = None
    """``usage.prompt_tokens`` of the answer, when present."""


@dataclass
class InflightSamples:
    """In flight (running + waiting) per node, sampled from ``/_sim/state``."""

    inflight: dict[str, list[int]] = field(default_factory=dict)


def _parse_event(payload: bytes) -> dict | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


async def send_turn(session: aiohttp.ClientSession, url: str, sess: Session, k: int,
                    answers: Sequence[str | None], deadline_s: float, edge: int = 0,
                    lag_s: float = 0.0) -> TurnResult:
    """Send turn ``k`` of ``sess`` to ``url`` and read its stream until ``[DONE]``, the
    end of the answer or ``deadline_s`` wall seconds. Never raises for network or HTTP
    problems: they become an ``error`` result."""
    messages = sess.messages(k, answers)
    res = TurnResult(idx=sess.request_id(k), outcome="error", lag_s=lag_s, session=sess.idx,
                     turn=k, edge=edge, prompt_tokens=prompt_tokens_of(messages))
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "sim_output_tokens": sess.turns[k].output_tokens}
    text: list[str] = []

    def on_event(payload: bytes, t: float) -> None:
        obj = _parse_event(payload)
        if obj is None:
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            res.usage_prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        choices = obj.get("choices") or []
        if choices and isinstance(choices[0], dict):
            piece = (choices[0].get("delta") or {}).get("content")
            if piece:
                if res.ttft_s is None:
                    res.ttft_s = t
                text.append(piece)

    if await stream_request(session, url, body, deadline_s, res, on_event):
        res.answer = "".join(text)
    return res


async def _drive(session: aiohttp.ClientSession, urls: Sequence[str], sess: Session,
                 start_s: float, t0: float, time_scale: float, deadline_s: float,
                 out: list[TurnResult]) -> None:
    loop = asyncio.get_running_loop()
    delay = t0 + start_s - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    lag = max(0.0, loop.time() - (t0 + start_s))
    answers: list[str | None] = []
    for k, turn in enumerate(sess.turns):
        if k and turn.think_s > 0:
            await asyncio.sleep(turn.think_s * time_scale)
        edge = (sess.idx + k) % len(urls)
        res = await send_turn(session, urls[edge], sess, k, answers, deadline_s, edge,
                              lag if k == 0 else 0.0)
        out.append(res)
        answers.append(res.answer if res.outcome == "ok" else None)


async def _sample(session: aiohttp.ClientSession, control_urls: dict[str, str],
                  interval_s: float, stop: asyncio.Event, states: StateSamples,
                  inflight: InflightSamples) -> None:
    """:func:`~bench.scheduler.loadgen.sample_states`, also keeping running + waiting."""
    def keep(name: str, st: dict) -> None:
        inflight.inflight.setdefault(name, []).append(int(st.get("running", 0))
                                                      + int(st.get("waiting", 0)))

    await sample_states(session, control_urls, interval_s, stop, states, on_state=keep)


@dataclass
class SessionRun:
    """What one closed-loop run produced."""

    results: list[TurnResult]
    states: StateSamples
    inflight: InflightSamples
    window_s: float
    """Wall seconds over which sessions started (planned)."""
    wall_s: float
    """Wall seconds from the start to the end of the last session."""


async def run_sessions(urls: Sequence[str], plan: Sequence[tuple[Session, float]],
                       time_scale: float, deadline_s: float, control_urls: dict[str, str],
                       sample_interval_s: float = 0.1) -> SessionRun:
    """Run every session of ``plan`` ((session, start in wall seconds from now)) against
    the chat completions ``urls`` (one per edge), closed loop per session, sampling the
    nodes during the run. ``time_scale`` scales the think times to wall seconds."""
    if not urls:
        raise ValueError("no edge url")
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    conn_state = aiohttp.TCPConnector(limit=0)
    results: list[TurnResult] = []
    async with aiohttp.ClientSession(connector=conn) as session, \
            aiohttp.ClientSession(connector=conn_state) as state_session:
        stop = asyncio.Event()
        states = StateSamples()
        inflight = InflightSamples()
        sampler = asyncio.create_task(_sample(state_session, control_urls, sample_interval_s,
                                              stop, states, inflight))
        wall0 = time.monotonic()
        t0 = loop.time()
        await asyncio.gather(*(_drive(session, urls, s, at, t0, time_scale, deadline_s, results)
                               for s, at in plan))
        wall = time.monotonic() - wall0
        stop.set()
        await sampler
    results.sort(key=lambda r: r.idx)
    window = plan[-1][1] if plan else 0.0
    return SessionRun(results=results, states=states, inflight=inflight, window_s=window,
                      wall_s=wall)


# --------------------------------------------------------------------------- statistics

def parse_prefix_counters(metrics_text: str) -> tuple[float, float] | None:
    """(queries, hits) in tokens: the sums over every label set of
    ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (or their
    ``vllm:gpu_`` spellings of older vLLM) in a Prometheus text page; ``None`` when
    neither is there."""
    q = h = 0.0
    seen = False
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].replace("vllm:gpu_", "vllm:")
        if name not in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        seen = True
        if name.endswith("queries_total"):
            q += value
        else:
            h += value
    return (q, h) if seen else None


def state_prefix_counters(state: dict) -> tuple[float, float] | None:
    """(queries, hits) in tokens from a ``/_sim/state`` document's ``prefix_cache``
    (``queries_tokens``, ``hits_tokens``); ``None`` when it has none."""
    pc = state.get("prefix_cache")
    if not isinstance(pc, dict) or "queries_tokens" not in pc:
        return None
    return float(pc.get("queries_tokens") or 0), float(pc.get("hits_tokens") or 0)


def hit_rate(before: dict[str, tuple[float, float]],
             after: dict[str, tuple[float, float]]) -> tuple[float | None, float, float]:
    """(Δhits / Δqueries summed over the nodes, Δqueries, Δhits) between two readings of
    node -> (queries, hits); the rate is ``None`` when nothing was queried."""
    dq = dh = 0.0
    for name, (q1, h1) in after.items():
        q0, h0 = before.get(name, (0.0, 0.0))
        dq += max(0.0, q1 - q0)
        dh += max(0.0, h1 - h0)
    return (dh / dq if dq > 0 else None), dq, dh


def request_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """node -> fraction (0-1) of the inference requests the nodes received between two
    readings of ``requests_total`` (retries included)."""
    deltas = {k: max(0, after[k] - before.get(k, 0)) for k in after}
    total = sum(deltas.values())
    return {k: (v / total if total else 0.0) for k, v in sorted(deltas.items())}


def inflight_stats(samples: dict[str, Sequence[int]]) -> dict[str, dict[str, float]]:
    """node -> ``{"peak": max, "mean": mean}`` of its in-flight samples."""
    return {k: {"peak": float(max(v)), "mean": sum(v) / len(v)}
            for k, v in sorted(samples.items()) if v}


def client_cached_rate(results: Sequence[TurnResult]) -> float | None:
    """Σ cached_tokens / Σ usage prompt tokens over the ok answers that reported both."""
    num = den = 0
    for r in results:
        if r.outcome == "ok" and r.cached_tokens is not None and r.usage_prompt_tokens:
            num += r.cached_tokens
            den += r.usage_prompt_tokens
    return num / den if den else None
