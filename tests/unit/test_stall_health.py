"""The control plane's proof-of-life rule (controlplane/routing/stall.py and
NodeTracker.update): a busy poll is good only while no edge reports the node stalled; a
node an edge reports stalled fails its polls (answering health or not), its status says
``stalled`` (metrics document, node view, ``infergate nodes list``), and it is healthy
again once the edges stop reporting it."""

from __future__ import annotations

import json

from controlplane.admin.nodeview import NodeView
from controlplane.cli.nodes import _health
from controlplane.config import NodeSettings, settings_from_dict
from controlplane.routing.poller import NodeTracker, PollResult
from controlplane.routing.stall import stalled_nodes
from controlplane.routing.wire import EdgeReport, NodeMetricsDoc


def settings():
    return settings_from_dict({"nodes": [{"name": "a", "url": "http://127.0.0.1:9"}]})


def _rep(ts: float, **nodes: dict) -> str:
    return json.dumps({"ts": ts, "nodes": nodes})


def test_stalled_nodes_from_fresh_edges_only():
    edges = {"e1": _rep(100.0, a={"inflight": 3, "stalled": True, "silent_s": 2.5},
                        b={"inflight": 1, "stalled": False, "silent_s": 0.1}),
             "e2": _rep(99.0, a={"inflight": 1, "stalled": True, "silent_s": 4.0},
                        c={"inflight": 1, "stalled": True}),
             "old": _rep(10.0, b={"stalled": True, "silent_s": 90.0}),
             "junk": "{not json"}
    assert stalled_nodes(edges, 100.0, max_age_s=20.0) == {"a": 4.0, "c": 0.0}
    rep = EdgeReport.from_dict(json.loads(edges["e1"]))
    assert rep.nodes["a"].stalled is True and rep.nodes["a"].silent_s == 2.5
    assert rep.nodes["b"].stalled is False
    legacy = EdgeReport.from_dict({"ts": 1.0, "nodes": {"a": {"inflight": 1}}})
    assert legacy.nodes["a"].stalled is False and legacy.nodes["a"].silent_s is None


def test_a_stalled_node_is_not_busy_and_comes_back_when_it_sends_again():
    node = NodeSettings(name="a", url="http://127.0.0.1:9")
    t = NodeTracker(node, settings())
    busy = PollResult(good=False, reachable=False, error="health: busy", busy=True)
    for i in range(3):
        st, _ = t.update(busy, float(i), inflight=4.0)
    assert st.healthy and not st.stalled, "in flight and no stall report: busy"
    st, _ = t.update(busy, 3.0, inflight=4.0, stalled_s=2.5)
    assert st.stalled and "stalled" in st.last_error and "2.5 s" in st.last_error
    for i in range(2):
        st, _ = t.update(busy, 4.0 + i, inflight=4.0, stalled_s=3.5 + i)
    assert not st.healthy and st.stalled, "a frozen node with requests in flight is down"
    doc = NodeMetricsDoc.from_dict(st.metrics_doc())
    assert doc.stalled is True and doc.healthy is False
    ok = PollResult(good=True, reachable=True)
    for i in range(3):
        st, _ = t.update(ok, 10.0 + i, inflight=1.0)
    assert st.healthy and not st.stalled


def test_a_stalled_node_fails_its_poll_even_when_health_answers():
    """A hung engine behind a live HTTP server answers /health: the edges' evidence wins."""
    t = NodeTracker(NodeSettings(name="a", url="http://127.0.0.1:9"), settings())
    ok = PollResult(good=True, reachable=True)
    for i in range(3):
        st, _ = t.update(ok, float(i), inflight=2.0, stalled_s=5.0)
    assert not st.healthy and st.stalled


def test_nodes_list_and_node_view_say_stalled():
    base = dict(name="a", url="u", kind="vllm", weight=1.0, max_concurrency=4,
                metrics_path="/metrics", health_path="/health", state="active",
                state_since=0.0, state_actor="x")
    assert _health(NodeView(**base, healthy=True, status="stalled")) == "stalled"
    assert _health(NodeView(**base, healthy=False, status="down")) == "down"
    assert _health(NodeView(**base, healthy=None, status="unknown")) == "?"


BODY = ('vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:num_requests_running{model_name="m"} %d\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
        'vllm:prompt_tokens_total{model_name="m"} 100\n'
        'vllm:generation_tokens_total{model_name="m"} %d\n')


def _poll(running: int, generated: int) -> PollResult:
    from controlplane.routing.nodemetrics import parse_metrics
    return PollResult(good=True, reachable=True, reading=parse_metrics(BODY % (running, generated)),
                      poll_ms=1.0)


def test_counters_that_stand_still_while_requests_run_mean_stalled():
    s = settings_from_dict({"controlplane": {"stall_counters_s": 5.0, "unhealthy_after": 2}})
    t = NodeTracker(NodeSettings(name="a", url="http://127.0.0.1:9"), s)
    gen = 0
    for i in range(6):                               # generating: busy, healthy
        gen += 50
        st, _ = t.update(_poll(3, gen), float(i))
        assert st.healthy and not st.stalled
    for i in range(6, 11):                           # running, nothing advances: < 5 s
        st, _ = t.update(_poll(3, gen), float(i))
    assert st.healthy and not st.stalled
    st, _ = t.update(PollResult(good=True, reachable=True), 10.5)   # no metrics: the spell
    assert not st.stalled                                           # goes on, 4.5 s
    for i in range(12, 14):                          # 6 s and more without progress
        st, _ = t.update(_poll(3, gen), float(i))
    assert st.stalled and not st.healthy and "no token counter advanced" in st.last_error
    st, _ = t.update(_poll(3, gen + 1), 14.0)       # one token: progress again
    assert not st.stalled
    idle = NodeTracker(NodeSettings(name="b", url="http://127.0.0.1:9"), s)
    for i in range(20):                              # nothing running: never stalled
        st, _ = idle.update(_poll(0, 10), float(i))
    assert st.healthy and not st.stalled
    off = NodeTracker(NodeSettings(name="c", url="http://127.0.0.1:9"),
                      settings_from_dict({"controlplane": {"stall_counters_s": 0}}))
    for i in range(60):
        st, _ = off.update(_poll(3, 10), float(i))
    assert st.healthy and not st.stalled


LLAMACPP_BODY = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing %d
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 500
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 7064
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total %d
"""


def test_a_long_llama_cpp_generation_is_progress_not_a_stall():
    """llama-server counts a request's generated tokens only when it ends
    (``llamacpp:tokens_predicted_total`` stood still for 12 s mid-generation): its decode
    calls (``llamacpp:n_decode_total``) are the progress of an answer under way, so a
    generation longer than ``stall_counters_s`` stays busy; with the decode calls still
    too, it is stalled."""
    from controlplane.routing.nodemetrics import parse_metrics

    s = settings_from_dict({"controlplane": {"stall_counters_s": 5.0, "unhealthy_after": 2}})
    t = NodeTracker(NodeSettings(name="a", url="http://127.0.0.1:9"), s)

    def poll(decodes: int) -> PollResult:
        return PollResult(good=True, reachable=True, poll_ms=1.0,
                          reading=parse_metrics(LLAMACPP_BODY % (2, decodes)))

    for i in range(40):                              # 40 s of one long answer
        st, _ = t.update(poll(100 + 20 * i), float(i))
        assert st.healthy and not st.stalled, i
    for i in range(40, 48):                          # the decode calls stop too: stalled
        st, _ = t.update(poll(100 + 20 * 39), float(i))
    assert st.stalled and not st.healthy


def test_back_at_names_the_poll_that_saw_the_node_come_back():
    """``NodeTracker.back_at`` (the snapshot's ``back_at``, which lets an edge breaker
    opened before then probe at once): set by the poll that turns the node healthy again
    and by one whose metrics show a new process; not by polls that stay healthy or down."""
    from controlplane.routing.nodemetrics import parse_metrics

    def reading(count: int):
        return parse_metrics(
            f'vllm:e2e_request_latency_seconds_count{{model_name="m"}} {count}\n'
            f'vllm:e2e_request_latency_seconds_sum{{model_name="m"}} {count * 2.0}\n')

    t = NodeTracker(NodeSettings(name="a", url="http://127.0.0.1:9"), settings())
    ok = PollResult(good=True, reachable=True, reading=reading(100))
    t.update(ok, 1.0)
    t.update(PollResult(good=True, reachable=True, reading=reading(104)), 2.0)
    assert t.back_at is None, "healthy from the start: never came back"
    down = PollResult(good=False, reachable=False, error="connection refused")
    for i in range(3):
        st, _ = t.update(down, 3.0 + i)
    assert not st.healthy and t.back_at is None
    st, changed = t.update(PollResult(good=True, reachable=True, reading=reading(2)), 6.0)
    assert t.restarted and t.back_at == 6.0, "a new process, seen before health turned"
    st, changed = t.update(PollResult(good=True, reachable=True, reading=reading(3)), 7.0)
    assert changed and st.healthy and t.back_at == 7.0
    t.update(PollResult(good=True, reachable=True, reading=reading(9)), 8.0)
    assert t.back_at == 7.0
    t.update(PollResult(good=True, reachable=True, reading=reading(1)), 9.5)
    assert t.restarted and t.back_at == 9.5, "restarted between two polls, never down"


def test_an_openai_node_back_after_refusing_is_not_held_down_by_open_breakers():
    """An ``openai`` node (no metrics: no restart seen in counters) killed and started
    again: its refused polls turn it unhealthy and open the edges' breakers, which then
    fail its polls (passive health). Answering again after refusing is a new process:
    ``back_at`` is set, and for a breaker cooldown the open breakers, which judged the
    old process, do not fail its polls, so it is healthy again at once and the edges
    probe it (not after the cooldown). Later, open breakers count again."""
    node = NodeSettings(name="o", url="http://127.0.0.1:9", kind="openai")
    t = NodeTracker(node, settings())
    ok = PollResult(good=True, reachable=True)
    refused = PollResult(good=False, reachable=False, error="connection refused")
    t.update(ok, 1.0)
    for i in range(3):
        st, _ = t.update(refused, 2.0 + i, edges_open=True)
    assert not st.healthy and t.back_at is None
    st, _ = t.update(ok, 5.0, edges_open=True)
    assert t.back_at == 5.0 and not st.healthy           # one good poll of two
    st, changed = t.update(ok, 6.0, edges_open=True)
    assert changed and st.healthy and t.back_at == 6.0
    cooldown = t.settings.edge.breaker_cooldown_s
    for i in range(3):
        st, _ = t.update(ok, 6.0 + cooldown + i, edges_open=True)
    assert not st.healthy and "circuit breaker open at every edge" in st.last_error
