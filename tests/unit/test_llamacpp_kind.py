"""llama.cpp nodes: the ``llamacpp`` metrics dialect (names as llama-server's
``server_task_result_metrics::to_metrics`` prints them), ``/props`` parsing, the slot
limit of the snapshot and the kind hints (:mod:`controlplane.routing.nodekind`)."""

from __future__ import annotations

import json

import pytest

from controlplane.config import NodeSettings
from controlplane.routing.nodekind import HINT_PREFIX, Props, PropsPoller, hint_of, parse_props
from controlplane.routing.nodemetrics import parse_metrics, window
from controlplane.routing.poller import NodeStatus

#: The shape llama-server b-11434 prints (HELP/TYPE lines, unlabelled samples).
LLAMACPP_BODY = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {gen}
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 12
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.5
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {deferred}
"""


def body(prompt: int = 10, gen: int = 20, running: int = 2, deferred: int = 1) -> str:
    return LLAMACPP_BODY.format(prompt=prompt, gen=gen, running=running, deferred=deferred)


def test_llamacpp_dialect_reads_slots_queue_and_tokens():
    r = parse_metrics(body(), "text/plain; version=0.0.4")
    assert (r.dialect, r.running, r.queue_depth, r.kv_cache_usage) == ("llamacpp", 2.0, 1.0, None)
    assert r.e2e is None and r.ttft is None and r.engines == 1
    w = window(parse_metrics(body(10, 20)), parse_metrics(body(15, 50)))
    assert (w.prompt_tokens_delta, w.generation_tokens_delta) == (5.0, 30.0)
    assert w.e2e_avg_s is None  # llama.cpp has no finished-request count


PROPS = {"total_slots": 4, "endpoint_metrics": True, "build_info": "b11434-abc",
         "model_alias": "gemma-3-270m"}


def test_parse_props():
    assert parse_props(json.dumps(PROPS)) == Props(4, True, "b11434-abc")
    assert parse_props('{"total_slots": 1}') == Props(1, None, None)
    # the context of one slot (default_generation_settings.n_ctx); anything else: unknown
    ctx = {**PROPS, "default_generation_settings": {"n_ctx": 512}}
    assert parse_props(json.dumps(ctx)).ctx_tokens == 512
    for gen in ({"n_ctx": 0}, {"n_ctx": True}, {"n_ctx": "512"}, [512], None):
        doc = {**PROPS, "default_generation_settings": gen}
        assert parse_props(json.dumps(doc)).ctx_tokens is None, gen
    for bad in ('{"detail": "Not Found"}', '{"total_slots": 0}', '{"total_slots": true}',
                '[1]', '{"total_slots": "4"}'):
        with pytest.raises(ValueError):
            parse_props(bad)
    with pytest.raises(ValueError):
        parse_props("<html>")


class CannedProps(PropsPoller):
    """A PropsPoller whose reads return ``answers[url]`` instead of a GET."""

    def __init__(self, answers: dict):
        super().__init__(refresh_s=60.0, timeout_s=1.0)
        self.answers = answers

    def _read(self, url: str):
        return self.answers[url]


def status(name: str, *, has_metrics: bool = False, reachable: bool = True,
           error: str | None = None) -> NodeStatus:
    return NodeStatus(name=name, ts=0.0, healthy=True, reachable=reachable, dialect=None,
                      queue_depth=None, running=None, kv_cache_usage=None, e2e_avg_s=None,
                      ttft_avg_s=None, prompt_tokens_total=None, generation_tokens_total=None,
                      score=None, saturated=False, consecutive_failures=0,
                      consecutive_successes=1, last_error=error, poll_ms=1.0,
                      has_metrics=has_metrics)


def observed(answers: dict, nodes: list[NodeSettings]) -> CannedProps:
    p = CannedProps(answers)
    for n in nodes:
        assert p.observe(n) is None  # the first read runs in the background
    p.wait_idle()
    for n in nodes:
        p.observe(n)
    return p


def test_slots_lower_the_snapshot_max_concurrency_only():
    llama = NodeSettings(name="l", url="http://127.0.0.1:1")
    small = NodeSettings(name="s", url="http://127.0.0.1:2", max_concurrency=1)
    vllm = NodeSettings(name="v", url="http://127.0.0.1:3")
    p = observed({llama.url + "/props": (Props(4, True), "llama.cpp", False),
                  small.url + "/props": (Props(4, True), "llama.cpp", False),
                  vllm.url + "/props": (None, "HTTP 404", False)}, [llama, small, vllm])
    try:
        eff = {n.name: n.max_concurrency for n in p.effective([llama, small, vllm])}
        assert eff == {"l": 4, "s": 1, "v": 64}
        assert llama.max_concurrency == 64  # the configured node is not changed
    finally:
        p.close()


def test_a_server_that_stops_answering_keeps_its_slots():
    """A llama.cpp server whose /props gets no answer at all (frozen, restarting) keeps
    the slots it reported: forgetting them would send the edge's whole backlog to its
    2 slots the moment it answers again. An answer that says otherwise (not llama.cpp any
    more) does replace them."""
    llama = NodeSettings(name="l", url="http://127.0.0.1:1")
    answers = {llama.url + "/props": (Props(2, True), "llama.cpp", False)}
    p = observed(answers, [llama])
    try:
        assert p.slots([llama]) == {"l": 2}
        for answer in ((None, "timed out", True), (None, "HTTP 404", False)):
            answers[llama.url + "/props"] = answer
            with p._lock:
                p._entries["l"].due = 0.0          # the next read is due now
            p.observe(llama)
            p.wait_idle()
            p.observe(llama)
            expected = {"l": 2} if answer[2] else {}
            assert p.slots([llama]) == expected, answer
    finally:
        p.close()


def test_a_server_loading_its_model_keeps_its_slots():
    """llama-server answers ``/props`` with 503 ``Loading model`` while it loads its model
    after a restart (seen with b-11434): the server cannot say yet, so the slots it
    reported are kept, as for no answer; once it answers, its new figure replaces them.
    Read over real HTTP (PropsPoller._read)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = {"status": 200, "body": json.dumps({**PROPS, "total_slots": 2})}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = answer["body"].encode()
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    node = NodeSettings(name="l", url=f"http://127.0.0.1:{srv.server_address[1]}")
    p = PropsPoller(refresh_s=60.0, timeout_s=2.0)

    def read() -> dict:
        with p._lock:
            if "l" in p._entries:
                p._entries["l"].due = 0.0
        p.observe(node)
        p.wait_idle()
        p.observe(node)
        return p.slots([node])

    try:
        assert read() == {"l": 2}
        answer.update(status=503, body='{"error":{"code":503,"message":"Loading model",'
                                        '"type":"unavailable_error"}}')
        assert read() == {"l": 2}
        answer.update(status=200, body=json.dumps({**PROPS, "total_slots": 1}))
        assert read() == {"l": 1}
        answer.update(status=404, body='{"detail": "Not Found"}')
        assert read() == {}
    finally:
        p.close()
        srv.shutdown()
        srv.server_close()


def test_seeded_slots_hold_until_a_read_says_otherwise():
    """PropsPoller.seed (a control plane taking the lead, from the snapshot it takes
    over): the slots count before the first read finishes, stay while the server does
    not answer, and give way to what a read says; a seed after a finished read changes
    nothing."""
    llama = NodeSettings(name="l", url="http://127.0.0.1:1")
    answers = {llama.url + "/props": (None, "timed out", True)}
    p = CannedProps(answers)
    try:
        p.seed(llama, 2, 1024)
        assert p.slots([llama]) == {"l": 2} and p.contexts([llama]) == {"l": 1024}
        p.observe(llama)
        p.wait_idle()
        p.observe(llama)
        assert p.slots([llama]) == {"l": 2}, "no answer: the seed holds"
        answers[llama.url + "/props"] = (Props(3, True), "llama.cpp", False)
        with p._lock:
            p._entries["l"].due = 0.0
        p.observe(llama)
        p.wait_idle()
        p.observe(llama)
        assert p.slots([llama]) == {"l": 3}
        p.seed(llama, 7)
        assert p.slots([llama]) == {"l": 3}, "a finished read wins"
    finally:
        p.close()


def test_a_server_back_from_down_is_read_again_at_once():
    """refresh(): the control plane calls it when a node turns healthy again (a restart
    may change --parallel); the slots then follow at the next look, not after
    models_refresh_s."""
    llama = NodeSettings(name="l", url="http://127.0.0.1:1")
    answers = {llama.url + "/props": (Props(2, True), "llama.cpp", False)}
    p = observed(answers, [llama])
    try:
        answers[llama.url + "/props"] = (Props(3, True), "llama.cpp", False)
        p.observe(llama)
        p.wait_idle()
        assert p.slots([llama]) == {"l": 2}            # not due for 60 s
        p.refresh("l")
        p.refresh("not-seen")                          # nothing known: nothing to do
        p.observe(llama)
        p.wait_idle()
        p.observe(llama)
        assert p.slots([llama]) == {"l": 3}
    finally:
        p.close()


def test_a_restarted_server_is_read_again_within_the_cycle():
    """reread(): the control plane calls it for a node seen back or restarted; the new
    slots count as soon as the read answers (within the wait), so the snapshot of that
    cycle has them; a read slower than the wait settles at a later look."""
    import threading

    llama = NodeSettings(name="l", url="http://127.0.0.1:1")
    answers = {llama.url + "/props": (Props(2, True), "llama.cpp", False)}
    p = observed(answers, [llama])
    try:
        answers[llama.url + "/props"] = (Props(1, True), "llama.cpp", False)
        p.reread(llama, wait_s=2.0)
        assert p.slots([llama]) == {"l": 1}, "no observe() needed"
        gate = threading.Event()
        slow = CannedProps({})
        slow._read = lambda url: (gate.wait(5), (Props(3, True), "llama.cpp", False))[1]
        slow.reread(llama, wait_s=0.05)
        assert slow.slots([llama]) == {}
        gate.set()
        slow.wait_idle()
        slow.observe(llama)
        assert slow.slots([llama]) == {"l": 3}
        slow.close()
    finally:
        p.close()


def test_hints():
    nometrics = NodeSettings(name="a", url="http://127.0.0.1:1")
    unknown = NodeSettings(name="b", url="http://127.0.0.1:2")
    p = observed({nometrics.url + "/props": (Props(2, False), "llama.cpp", False),
                  unknown.url + "/props": (None, "HTTP 404", False)}, [nometrics, unknown])
    try:
        h = p.hint(nometrics, status("a", error="metrics: HTTP 501"))
        assert h.startswith(HINT_PREFIX) and "--metrics" in h
        st = status("b", reachable=True, error="health: HTTP 404; metrics: HTTP 404")
        p.annotate(unknown, st)
        assert st.last_error.startswith("health: HTTP 404; metrics: HTTP 404; " + HINT_PREFIX)
        line = hint_of(st.last_error)
        assert "GET /props HTTP 404" in line and "kind" in line and "openai" in line
        # known metrics, an unreachable node, a timeout, an openai node: no hint
        assert p.hint(unknown, status("b", has_metrics=True)) is None
        assert p.hint(unknown, status("b", reachable=False, error="health: refused")) is None
        assert p.hint(unknown, status("b", error="metrics: timeout after 1 s")) is None
        openai = NodeSettings(name="b", url=unknown.url, kind="openai")
        assert p.hint(openai, status("b", error="metrics: HTTP 404")) is None
    finally:
        p.close()
    assert hint_of(None) is None and hint_of("health: HTTP 503") is None
