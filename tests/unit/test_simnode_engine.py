"""Unit tests of the simulated node's pure parts: the continuous-batching engine model,
the deterministic text, the OpenAI wire shapes, the metrics dialects and the faults."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.simnode import textgen, wire
from controlplane.simnode.engine import Engine, EngineConfig, RequestTooLarge, Sequence
from controlplane.simnode.faults import Faults, FaultsError, apply_update
from controlplane.simnode.metrics import EngineSnapshot, Finished, make_exporter


# -- engine ---------------------------------------------------------------------------

def seq(i: int, prompt: int = 10, out: int = 5) -> Sequence:
    return Sequence(seq_id=i, prompt_tokens=prompt, output_tokens=out)


def test_step_duration_formula():
    cfg = EngineConfig(decode_base_ms=20, decode_per_seq_ms=1.0, prefill_tps=4000)
    assert cfg.step_seconds(batch=4, prefill_tokens=0) == pytest.approx(0.024)
    assert cfg.step_seconds(batch=1, prefill_tokens=2000) == pytest.approx(0.021 + 0.5)
    fast = EngineConfig(decode_base_ms=20, decode_per_seq_ms=1.0, prefill_tps=4000, speed=2.0)
    assert fast.step_seconds(4, 2000) == pytest.approx(cfg.step_seconds(4, 2000) / 2)


@pytest.mark.parametrize("kwargs", [
    {"max_running": 0}, {"kv_capacity_tokens": 1}, {"prefill_tps": 0}, {"speed": 0},
    {"decode_base_ms": -1}, {"decode_base_ms": 0, "decode_per_seq_ms": 0},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_first_token_after_prefill_step_then_one_token_per_step():
    e = Engine(EngineConfig(decode_base_ms=10, decode_per_seq_ms=0, prefill_tps=1000))
    s = seq(1, prompt=100, out=3)
    e.submit(s, now=0.0)
    step = e.plan_step(0.0)
    assert step is not None and step.admitted == [s] and step.prefill_tokens == 100
    assert step.duration_s == pytest.approx(0.010 + 0.1)
    assert s.state == "running" and s.generated == 0 and e.kv_used == 100
    ev = e.complete_step(step, now=0.11)
    assert [(x.count, x.itl_s, x.finished) for x in ev] == [(1, None, False)]
    assert s.first_token_at == 0.11 and e.kv_used == 101
    step2 = e.plan_step(0.11)
    assert step2.prefill_tokens == 0 and step2.duration_s == pytest.approx(0.010)
    ev = e.complete_step(step2, now=0.12)
    assert ev[0].count == 2 and ev[0].itl_s == pytest.approx(0.01)
    ev = e.complete_step(e.plan_step(0.12), now=0.13)
    assert ev[0].finished and s.state == "finished" and s.generated == 3
    assert e.kv_used == 0 and not e.running and e.plan_step(0.13) is None


def test_fifo_admission_limited_by_slots():
    e = Engine(EngineConfig(max_running=2))
    seqs = [seq(i, out=2) for i in range(5)]
    for s in seqs:
        e.submit(s, 0.0)
    step = e.plan_step(0.0)
    assert step.admitted == seqs[:2] and len(e.waiting) == 3
    e.complete_step(step, 1.0)
    e.complete_step(e.plan_step(1.0), 2.0)  # first two finish
    step = e.plan_step(2.0)
    assert step.admitted == seqs[2:4]


def test_kv_room_blocks_head_of_line():
    e = Engine(EngineConfig(max_running=10, kv_capacity_tokens=100))
    big = seq(1, prompt=50, out=10)      # reserves 60
    big2 = seq(2, prompt=40, out=10)     # 50: does not fit next to big
    small = seq(3, prompt=5, out=5)      # would fit, but FIFO keeps it behind big2
    for s in (big, big2, small):
        e.submit(s, 0.0)
    step = e.plan_step(0.0)
    assert step.admitted == [big]
    assert list(e.waiting) == [big2, small]
    assert e.kv_reserved == 60


def test_request_larger_than_kv_is_refused():
    e = Engine(EngineConfig(kv_capacity_tokens=100))
    with pytest.raises(RequestTooLarge):
        e.submit(seq(1, prompt=90, out=11), 0.0)
    e.submit(seq(2, prompt=90, out=10), 0.0)  # exactly fits


def test_cancel_waiting_and_running_frees_kv_and_slot():
    e = Engine(EngineConfig(max_running=1))
    a, b = seq(1, out=10), seq(2, out=10)
    e.submit(a, 0.0)
    e.submit(b, 0.0)
    step = e.plan_step(0.0)
    assert e.cancel(b, 0.1) and b.state == "cancelled" and not e.waiting
    assert e.cancel(a, 0.1) and a.state == "cancelled"
    assert e.kv_used == 0 and not e.running
    # a was in the step when cancelled: it gets no token
    assert e.complete_step(step, 0.2) == [] and a.generated == 0
    assert not e.cancel(a, 0.3)  # already done
    assert e.plan_step(0.3) is None


def test_random_workload_keeps_invariants():
    """Random arrivals and cancels on a virtual clock: never more than max_running or
    more KV than capacity, FIFO admission, every survivor gets exactly its tokens."""
    rng = random.Random(7)
    cfg = EngineConfig(max_running=4, kv_capacity_tokens=600)
    e = Engine(cfg)
    now = 0.0
    admitted_order: list[int] = []
    submitted: list[Sequence] = []
    tokens: dict[int, int] = {}
    next_id = 0
    for _ in range(400):
        for _ in range(rng.randrange(3)):
            s = seq(next_id, prompt=rng.randint(1, 200), out=rng.randint(1, 60))
            next_id += 1
            e.submit(s, now)
            submitted.append(s)
        if submitted and rng.random() < 0.1:
            e.cancel(rng.choice(submitted), now)
        step = e.plan_step(now)
        if step is None:
            now += 0.01
            continue
        admitted_order += [s.seq_id for s in step.admitted]
        assert len(e.running) <= cfg.max_running
        assert e.kv_reserved <= cfg.kv_capacity_tokens
        now += step.duration_s
        for ev in e.complete_step(step, now):
            tokens[ev.seq.seq_id] = tokens.get(ev.seq.seq_id, 0) + 1
            assert ev.count == tokens[ev.seq.seq_id]
        assert e.kv_used <= cfg.kv_capacity_tokens
    while (step := e.plan_step(now)) is not None:  # drain
        admitted_order += [s.seq_id for s in step.admitted]
        now += step.duration_s
        e.complete_step(step, now)
    assert admitted_order == sorted(admitted_order)
    finished = [s for s in submitted if s.state == "finished"]
    assert finished and all(s.generated == s.output_tokens for s in finished)
    assert all(s.state in ("finished", "cancelled") for s in submitted)
    assert any(s.state == "cancelled" for s in submitted)


# -- text -----------------------------------------------------------------------------

def test_token_estimate():
    assert textgen.estimate_tokens("") == 1
    assert textgen.estimate_tokens("abcd") == 1
    assert textgen.estimate_tokens("abcde") == 2
    assert textgen.estimate_tokens("x" * 4000) == 1000


def test_text_is_deterministic_and_prefix_stable():
    a = textgen.generate_tokens("k", 50)
    assert a == textgen.generate_tokens("k", 50)
    assert a != textgen.generate_tokens("other", 50)
    assert len(a) == 50 and not a[0].startswith(" ") and all(t.startswith(" ") for t in a[1:])
    assert a[-1].endswith(".")
    lengths = {textgen.output_length(f"p{i}", 3, 9) for i in range(300)}
    assert lengths == set(range(3, 10))
    assert textgen.output_length("p", 5, 5) == 5
    with pytest.raises(ValueError):
        textgen.output_length("p", 6, 5)


# -- wire -----------------------------------------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello world"}]}


def test_parse_chat_and_completion():
    r = wire.parse_request("chat", CHAT, "m")
    assert r.kind == "chat" and r.prompt_tokens == 3 and not r.stream and r.max_tokens is None
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]}
    assert wire.parse_request("chat", parts, "m").prompt_key == r.prompt_key  # model optional
    c = wire.parse_request("completion", {"prompt": ["abc"], "max_tokens": 3, "stream": True,
                                          "stream_options": {"include_usage": True}}, "m")
    assert c.prompt_tokens == 1 and c.max_tokens == 3 and c.stream and c.include_usage
    both = wire.parse_request("chat", {**CHAT, "max_tokens": 9, "max_completion_tokens": 4}, "m")
    assert both.max_tokens == 4


@pytest.mark.parametrize("kind,body,status,param", [
    ("chat", {"model": "m"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("completion", {"model": "m"}, 400, "prompt"),
    ("completion", {"prompt": 3}, 400, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("chat", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("chat", {**CHAT, "model": 5}, 400, "model"),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": True}, 400, "max_completion_tokens"),
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {**CHAT, "n": 2}, 400, "n"),
    ("chat", {**CHAT, "sim_output_tokens": 0}, 400, "sim_output_tokens"),
])
def test_parse_rejects_bad_requests(kind, body, status, param):
    with pytest.raises(wire.ApiError) as ei:
        wire.parse_request(kind, body, "m")
    err = ei.value
    assert err.status == status and err.param == param
    b = err.body()["error"]
    assert set(b) == {"message", "type", "param", "code"} and b["type"] == "invalid_request_error"
    if status == 404:
        assert b["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{", b"[1,2]", b"\xff\xfe", b"null"])
def test_parse_body_rejects_non_objects(raw):
    with pytest.raises(wire.ApiError) as ei:
        wire.parse_body(raw)
    assert ei.value.status == 400


def test_plan_output_honours_max_tokens():
    r = wire.parse_request("chat", {**CHAT, "sim_output_tokens": 10}, "m")
    p = wire.plan_output(r, 1, 1)
    assert len(p.tokens) == 10 and p.finish_reason == "stop"
    cut = wire.plan_output(wire.parse_request("chat", {**CHAT, "sim_output_tokens": 10,
                                                        "max_tokens": 4}, "m"), 1, 1)
    assert cut.tokens == p.tokens[:4] and cut.finish_reason == "length"
    exact = wire.plan_output(wire.parse_request("chat", {**CHAT, "sim_output_tokens": 10,
                                                          "max_tokens": 10}, "m"), 1, 1)
    assert exact.finish_reason == "length"
    free = wire.plan_output(wire.parse_request("chat", CHAT, "m"), 5, 8)
    assert 5 <= len(free.tokens) <= 8


def test_response_shapes():
    meta = wire.ResponseMeta.new("chat", "m", "node-a")
    full = wire.full_response(meta, "Hi there.", "stop", 3, 2)
    assert full["id"].startswith("chatcmpl-") and full["object"] == "chat.completion"
    assert full["system_fingerprint"] == "node-a"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "Hi there."}
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    first = wire.chunk(meta, role=True, content="", include_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert wire.usage_chunk(meta, 3, 2)["choices"] == []
    cmeta = wire.ResponseMeta.new("completion", "m", "node-a")
    assert cmeta.id.startswith("cmpl-")
    assert wire.full_response(cmeta, "x", "length", 1, 1)["object"] == "text_completion"
    assert wire.sse({"a": 1}) == b'data: {"a":1}\n\n'


# -- metrics --------------------------------------------------------------------------

SNAPS = [EngineSnapshot(running=3, waiting=2, kv_used_tokens=400, kv_capacity_tokens=1000),
         EngineSnapshot(running=1, waiting=0, kv_used_tokens=100, kv_capacity_tokens=1000)]


def _families(exporter) -> dict:
    body, ctype = exporter.render(SNAPS)
    assert ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _feed(exporter) -> None:
    exporter.first_token(1, 50, 0.2)
    exporter.token(1, None)
    exporter.token(1, 0.03)
    exporter.finished(Finished(rank=1, prompt_tokens=50, completion_tokens=2,
                               finish_reason="length", queue_s=0.1, e2e_s=0.5))


def test_vllm_metrics_per_engine_and_reset():
    ex = make_exporter("vllm", "m", 2)
    _feed(ex)
    fams = _families(ex)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:inter_token_latency_seconds"):
        assert name in fams, name
    assert "vllm:gpu_cache_usage_perc" not in fams
    running = {s.labels["engine"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"0": 3.0, "1": 1.0}
    kv = {s.labels["engine"]: s.value for s in fams["vllm:kv_cache_usage_perc"].samples}
    assert kv == {"0": 0.4, "1": 0.1}
    assert all(s.labels["model_name"] == "m" for s in fams["vllm:num_requests_running"].samples)
    gen = {s.labels["engine"]: s.value for s in fams["vllm:generation_tokens"].samples
           if s.name.endswith("_total")}
    assert gen == {"0": 0.0, "1": 2.0}
    success = {(s.labels["engine"], s.labels["finished_reason"]): s.value
               for s in fams["vllm:request_success"].samples if s.name.endswith("_total")}
    assert success[("1", "length")] == 1.0 and success[("1", "stop")] == 0.0
    ex.reset()
    fams = _families(ex)
    assert all(s.value == 0 for s in fams["vllm:generation_tokens"].samples
               if s.name.endswith("_total"))
    assert all(s.value == 0 for s in fams["vllm:e2e_request_latency_seconds"].samples
               if s.name.endswith("_count"))


def test_other_dialects_names():
    legacy = _families(make_exporter("vllm-legacy", "m", 1))
    assert "vllm:gpu_cache_usage_perc" in legacy and "vllm:kv_cache_usage_perc" not in legacy
    tgi_ex = make_exporter("tgi", "m", 2)
    _feed(tgi_ex)
    tgi = _families(tgi_ex)
    assert tgi["tgi_queue_size"].samples[0].value == 2
    assert tgi["tgi_batch_current_size"].samples[0].value == 4
    assert tgi["tgi_request_duration"].type == "histogram"
    assert [s.value for s in tgi["tgi_request_count"].samples] == [1.0]
    sg_ex = make_exporter("sglang", "m", 2)
    _feed(sg_ex)
    sg = _families(sg_ex)
    assert sg["sglang:num_queue_reqs"].samples[0].value == 2
    assert sg["sglang:num_running_reqs"].samples[0].value == 4
    assert sg["sglang:token_usage"].samples[0].value == pytest.approx(0.25)
    for name in ("sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds"):
        assert sg[name].type == "histogram"
    js = make_exporter("json", "m", 2)
    _feed(js)
    body, ctype = js.render(SNAPS)
    assert ctype == "application/json"
    assert json.loads(body) == {"queue_depth": 2, "avg_latency_seconds": 0.5,
                                "gpu_memory_utilization": 0.25}
    assert make_exporter("none", "m", 1).render(SNAPS) is None
    with pytest.raises(ValueError):
        make_exporter("triton", "m", 1)


# -- faults ---------------------------------------------------------------------------

def test_fault_updates():
    f = apply_update(Faults(), {"error_rate": 0.5, "refuse": True})
    assert f.error_rate == 0.5 and f.refuse and not f.hang
    assert apply_update(f, {"refuse": False}).error_rate == 0.5
    for bad in ({"error_rate": 2}, {"slowdown": 0.5}, {"error_status": 200}, {"nope": 1},
                {"hang": "maybe"}, [1]):
        with pytest.raises(FaultsError):
            apply_update(f, bad)
