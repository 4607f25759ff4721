"""Unit tests of the simulated node's automatic prefix caching: block hashes, the LRU of
blocks, admission in the engine model, the usage field and the metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.simnode import prefix, wire
from controlplane.simnode.engine import Engine, EngineConfig, Sequence
from controlplane.simnode.metrics import EngineSnapshot, make_exporter, prefix_hit_rate
from controlplane.simnode.prefix import BLOCK_TOKENS, PrefixCache, block_hashes

BLOCK_CHARS = BLOCK_TOKENS * prefix.CHARS_PER_TOKEN  # 64


def text_of(*blocks: str, tail: str = "") -> str:
    """Full blocks made of one repeated character each, then a partial tail."""
    return "".join(c * BLOCK_CHARS for c in blocks) + tail


def chat(*messages: tuple[str, str]) -> wire.InferenceRequest:
    body = {"messages": [{"role": r, "content": c} for r, c in messages]}
    return wire.parse_request("chat", body, "m")


# -- block hashes ---------------------------------------------------------------------

def test_shared_prefix_shares_leading_hashes_only():
    a = block_hashes(text_of("x", "y", "z"))
    b = block_hashes(text_of("x", "y", "w"))
    assert len(a) == len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(len(h) == prefix.DIGEST_BYTES for h in a)
    # chained: the same block after a different prefix hashes differently
    assert block_hashes(text_of("q", "y"))[1] != a[1]
    assert len(set(block_hashes(text_of("x", "x", "x")))) == 3


def test_partial_last_block_is_not_hashed():
    assert block_hashes("x" * (BLOCK_CHARS - 1)) == ()
    full = block_hashes(text_of("x", "y"))
    assert block_hashes(text_of("x", "y", tail="abc")) == full
    assert block_hashes(text_of("x", "y", tail="z" * (BLOCK_CHARS - 1))) == full
    assert block_hashes(text_of("x", "y", "z"), max_blocks=2) == full
    assert block_hashes(text_of("x"), max_blocks=0) == ()


def test_chat_hash_includes_roles_but_prompt_tokens_do_not():
    content = "w" * 200
    user, assistant = chat(("user", content)), chat(("assistant", content))
    assert user.prompt_tokens == assistant.prompt_tokens == 50  # ceil(200 / 4), as before
    assert user.block_hashes and assistant.block_hashes
    assert user.block_hashes[0] != assistant.block_hashes[0]
    assert len(user.block_hashes) <= user.prompt_tokens // BLOCK_TOKENS
    assert chat(("user", content)).block_hashes == user.block_hashes


def test_message_boundaries_matter():
    one = chat(("user", "a" * 100 + "b" * 100))
    two = chat(("user", "a" * 100), ("user", "b" * 100))
    assert one.prompt_tokens == two.prompt_tokens
    assert one.block_hashes[1:] != two.block_hashes[1:]


def test_next_turn_extends_the_previous_one():
    system = ("system", "You are a helpful assistant. " * 20)
    turn1 = chat(system, ("user", "first question " * 10))
    turn2 = chat(system, ("user", "first question " * 10), ("assistant", "an answer " * 10),
                 ("user", "second question"))
    assert len(turn1.block_hashes) >= 3
    assert turn2.block_hashes[:len(turn1.block_hashes)] == turn1.block_hashes


def test_completion_prompt_is_hashed_as_is():
    text = text_of("p", "q", tail="r")
    req = wire.parse_request("completion", {"prompt": text}, "m")
    assert req.block_hashes == block_hashes(text)
    assert wire.parse_request("completion", {"prompt": "short"}, "m").block_hashes == ()


# -- the LRU --------------------------------------------------------------------------

def test_match_counts_contiguous_leading_blocks():
    c = PrefixCache(10)
    a = block_hashes(text_of("a", "b", "c", "d"))
    c.insert(a[:2])
    assert c.match(a) == 2 and c.match(a[:1]) == 1 and c.match(()) == 0
    c.insert(a[3:])  # block 3 alone: not reachable without block 2
    assert c.match(a) == 2 and len(c) == 3
    assert c.match(block_hashes(text_of("z", "b"))) == 0


def test_capacity_is_respected_and_the_tail_goes_first():
    c = PrefixCache(3)
    a = block_hashes(text_of("a", "b", "c", "d", "e"))
    c.insert(a)
    assert len(c) == 3 and c.match(a) == 3  # blocks 0-2 kept, the tail evicted
    b = block_hashes(text_of("x", "y"))
    c.insert(b)
    assert len(c) == 3 and c.match(b) == 2 and c.match(a) == 1
    c.insert(a[:1])  # touched: now the most recently used
    c.insert(block_hashes(text_of("n")))
    assert c.match(a) == 1 and c.match(b) == 1
    c.clear()
    assert len(c) == 0 and c.match(a) == 0


def test_zero_capacity_caches_nothing():
    c = PrefixCache(0)
    a = block_hashes(text_of("a", "b"))
    c.insert(a)
    assert len(c) == 0 and c.match(a) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


# -- the engine -----------------------------------------------------------------------

def seq(i: int, text: str, prompt: int | None = None, out: int = 2) -> Sequence:
    hashes = block_hashes(text)
    n = prompt if prompt is not None else len(hashes) * BLOCK_TOKENS + 8
    return Sequence(seq_id=i, prompt_tokens=n, output_tokens=out, block_hashes=hashes)


def run_one(e: Engine, s: Sequence, now: float = 0.0):
    """Submit ``s``, run it to the end; return its prefill step."""
    e.submit(s, now)
    step = e.plan_step(now)
    t = now + step.duration_s
    e.complete_step(step, t)
    while e.running:
        nxt = e.plan_step(t)
        t += nxt.duration_s
        e.complete_step(nxt, t)
    return step


def test_second_identical_request_prefills_less_and_is_faster():
    e = Engine(EngineConfig(prefill_tps=1000))
    text = text_of("a", "b", "c", "d", tail="tail")  # 4 full blocks, prompt 72 tokens
    first = run_one(e, seq(1, text))
    second_seq = seq(2, text)
    second = run_one(e, second_seq, 10.0)
    assert first.prefill_tokens == 72 and first.admitted[0].cached_tokens == 0
    assert second_seq.cached_tokens == 64 and second.prefill_tokens == 8
    assert second.duration_s < first.duration_s
    assert second.duration_s == pytest.approx(e.config.step_seconds(1, 8))
    assert (e.prefix_queries_tokens, e.prefix_hits_tokens) == (144, 64)
    assert len(e.prefix_cache) == 4


def test_shared_prefix_hits_only_the_common_blocks():
    e = Engine()
    run_one(e, seq(1, text_of("s", "s", "q")))
    other = seq(2, text_of("s", "s", "r", "t"))
    run_one(e, other)
    assert other.cached_tokens == 2 * BLOCK_TOKENS
    assert len(e.prefix_cache) == 5


def test_cached_tokens_stop_one_short_of_the_prompt():
    e = Engine()
    text = text_of("a", "b")
    run_one(e, seq(1, text, prompt=32))
    again = seq(2, text, prompt=32)  # the whole prompt is in full, cached blocks
    step = run_one(e, again)
    assert again.cached_tokens == 31 and step.prefill_tokens == 1
    assert e.prefix_hits_tokens == 31


def test_hits_within_the_same_step():
    e = Engine()
    text = text_of("a", "b", "c")
    a, b = seq(1, text), seq(2, text)
    e.submit(a, 0.0)
    e.submit(b, 0.0)
    step = e.plan_step(0.0)
    assert step.admitted == [a, b]
    assert (a.cached_tokens, b.cached_tokens) == (0, 48)
    assert step.prefill_tokens == 56 + 8


def test_small_cache_evicts_least_recently_used():
    e = Engine(EngineConfig(prefix_cache_blocks=4))
    a, b = text_of("a", "c"), text_of("b", "d", "e")
    run_one(e, seq(1, a))
    run_one(e, seq(2, b))          # 5 blocks for 4 places: a's tail goes
    assert len(e.prefix_cache) == 4
    again = seq(3, a)
    run_one(e, again)
    assert again.cached_tokens == BLOCK_TOKENS
    assert len(e.prefix_cache) <= 4


def test_prefix_caching_off_means_no_hits_and_no_counts():
    e = Engine(EngineConfig(prefix_caching=False))
    text = text_of("a", "b", "c")
    run_one(e, seq(1, text))
    again = seq(2, text)
    step = run_one(e, again)
    assert again.cached_tokens == 0 and step.prefill_tokens == again.prompt_tokens
    assert e.prefix_queries_tokens == e.prefix_hits_tokens == 0 and len(e.prefix_cache) == 0


def test_reset_prefix_cache():
    e = Engine()
    text = text_of("a", "b")
    run_one(e, seq(1, text))
    run_one(e, seq(2, text))
    assert e.prefix_hits_tokens > 0
    e.reset_prefix_cache()
    assert e.prefix_queries_tokens == e.prefix_hits_tokens == len(e.prefix_cache) == 0
    again = seq(3, text)
    run_one(e, again)
    assert again.cached_tokens == 0


def test_config_and_sequence_checks():
    assert EngineConfig().prefix_caching is True
    assert EngineConfig(kv_capacity_tokens=1000).prefix_cache_capacity_blocks == 62
    assert EngineConfig(prefix_cache_blocks=7).prefix_cache_capacity_blocks == 7
    assert Engine(EngineConfig(prefix_cache_blocks=7)).prefix_cache.capacity_blocks == 7
    with pytest.raises(ValueError):
        EngineConfig(prefix_cache_blocks=-1)
    with pytest.raises(ValueError):  # two full blocks need at least 32 prompt tokens
        Sequence(seq_id=1, prompt_tokens=31, output_tokens=1,
                 block_hashes=block_hashes(text_of("a", "b")))


# -- answers and metrics ----------------------------------------------------------------

def test_usage_carries_cached_tokens():
    meta = wire.ResponseMeta.new("chat", "m", "fp")
    full = wire.full_response(meta, "x", "stop", 80, 2, cached_tokens=64)
    assert full["usage"] == {"prompt_tokens": 80, "completion_tokens": 2, "total_tokens": 82,
                             "prompt_tokens_details": {"cached_tokens": 64}}
    last = wire.usage_chunk(meta, 80, 2, 48)
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}


SNAPS = [EngineSnapshot(running=0, waiting=0, kv_used_tokens=0, kv_capacity_tokens=100,
                        prefix_queries_tokens=300, prefix_hits_tokens=120, prefix_cached_blocks=9),
         EngineSnapshot(running=0, waiting=0, kv_used_tokens=0, kv_capacity_tokens=100,
                        prefix_queries_tokens=100, prefix_hits_tokens=0, prefix_cached_blocks=2)]


def families(dialect: str, snaps=SNAPS) -> dict:
    body, _ = make_exporter(dialect, "m", len(snaps)).render(snaps)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def per_engine(fam) -> dict[str, float]:
    return {s.labels["engine"]: s.value for s in fam.samples if s.name.endswith("_total")}


def test_vllm_prefix_counters_per_engine():
    fams = families("vllm")
    q, h = fams["vllm:prefix_cache_queries"], fams["vllm:prefix_cache_hits"]
    assert q.type == h.type == "counter"
    assert {s.name for s in q.samples} == {"vllm:prefix_cache_queries_total"}
    assert per_engine(q) == {"0": 300.0, "1": 100.0}
    assert per_engine(h) == {"0": 120.0, "1": 0.0}
    assert q.samples[0].labels == {"model_name": "m", "engine": "0"}
    assert "vllm:gpu_prefix_cache_queries" not in fams
    zero = families("vllm", [EngineSnapshot(0, 0, 0, 100)])
    assert per_engine(zero["vllm:prefix_cache_hits"]) == {"0": 0.0}


def test_legacy_and_sglang_prefix_metrics():
    legacy = families("vllm-legacy")
    assert per_engine(legacy["vllm:gpu_prefix_cache_hits"]) == {"0": 120.0, "1": 0.0}
    assert "vllm:prefix_cache_hits" not in legacy
    sg = families("sglang")
    (sample,) = sg["sglang:cache_hit_rate"].samples
    assert sample.value == pytest.approx(0.3) and sample.labels == {"model_name": "m"}
    assert prefix_hit_rate([EngineSnapshot(0, 0, 0, 100)]) == 0.0
