"""The pure parts of bench/scheduler/scenarios.py: the scenario definitions, the mixed
prompt sizes, the per-request models and the split of one load over several edges."""

from __future__ import annotations

from bench.scheduler.scenarios import (MODELS, SCENARIOS, by_model, mixed_prompts, scenario,
                                       split, with_models)
from bench.scheduler.loadgen import Result
from bench.scheduler.workload import RequestMix, pool_capacity_rps, prompt_tokens

import pytest


def test_every_scenario_is_defined() -> None:
    for name in SCENARIOS:
        sc = scenario(name)
        assert sc.name == name and sc.spec.nodes()
    assert scenario("multi_edge").edges == 2
    o = scenario("openai_nodes")
    assert o.kind == "openai" and o.dialect == "none" and o.max_concurrency == 64
    assert o.spec.max_running == 1
    m = scenario("multi_model")
    assert sorted(set(m.models.values())) == list(MODELS)
    assert set(m.models) == {n for n, _ in m.spec.nodes()}
    with pytest.raises(ValueError):
        scenario("nope")


def test_mixed_prompts_span_50_to_8000_tokens() -> None:
    ps = mixed_prompts(2000, seed=3)
    sizes = sorted(prompt_tokens(p) for p in ps)
    assert len(set(ps)) == 2000
    assert 50 <= sizes[0] < 100 and 4000 < sizes[-1] <= 8000
    sc = scenario("mixed_sizes")
    # a full batch of the longest requests fits the KV cache
    assert sc.spec.kv_capacity_tokens >= sc.spec.max_running * (8000 + sc.lengths.max_tokens)
    mean_out, mean_prompt = RequestMix(ps, sc.lengths, seed=1).sample_means()
    assert pool_capacity_rps(sc.spec, mean_out, mean_prompt) > 0


def test_models_alternate_and_the_load_splits_over_edges() -> None:
    wl = RequestMix(["a", "b", "c"], seed=1).workload(20.0, 5.0)
    wm = with_models(wl, MODELS, seed=5)
    assert {r.model for r in wm.requests} == set(MODELS)
    assert [r.model for r in wm.requests] == [r.model for r in with_models(wl, MODELS, 5).requests]
    parts = split(wm, 2)
    assert sum(len(p.requests) for p in parts) == len(wm.requests)
    assert {r.idx for r in parts[0].requests}.isdisjoint({r.idx for r in parts[1].requests})
    assert parts[0].rate_rps == pytest.approx(10.0)
    res = [Result(idx=0, outcome="ok", status=200), Result(idx=1, outcome="error", status=404),
           Result(idx=2, outcome="timeout")]
    got = by_model(res, {0: "model-a", 1: "model-b", 2: "model-a"}, duration_s=2.0)
    assert got["model-a"] == {"requests": 2, "ok": 1, "timeouts": 1, "errors": 0,
                              "not_found": 0, "goodput_rps": 0.5}
    assert got["model-b"]["not_found"] == 1 and got["model-b"]["errors"] == 1


def test_per_request_lines_name_what_happened_to_each_request(tmp_path) -> None:
    import json

    from bench.scheduler.__main__ import write_requests
    from bench.scheduler.workload import Request, Workload

    wl = Workload([Request(0, 0.1, "a", 12), Request(1, 0.5, "b", 64)], rate_rps=2.0,
                  duration_s=1.0, seed=1)
    results = [Result(0, "ok", status=200, e2e_s=0.8, ttft_s=0.2, node="fast-1"),
               Result(1, "timeout", status=200, ttft_s=4.5, node="slow-2")]
    path = tmp_path / "r.jsonl"
    write_requests(path, wl, results)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {"idx": 1, "at_s": 0.5, "output_tokens": 64, "outcome": "timeout",
                       "status": 200, "e2e_s": None, "ttft_s": 4.5, "node": "slow-2"}
    assert rows[0]["node"] == "fast-1" and rows[0]["e2e_s"] == 0.8
