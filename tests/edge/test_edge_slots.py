"""Known slots at the edge (lua/infergate/admission/slots.lua, queue.lua, shed.lua):
with a node's slots in the routing snapshot, the edge never has more requests in flight
there than its slots; the rest wait at the edge, first come first served, and get the
429 only when their deadline cannot be met. Snapshots are written straight into Redis;
the nodes are a tiny upstream and simulated nodes (one at a time like llama-cpp-python,
or batching like vLLM)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from controlplane import procs
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
FINISHED = re.compile(r'"finish_reason":\s*"(stop|length)"')
SIM = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]}


def _edge(redis_server, edge_factory, nodes, *, request_ms: int = 30000, max_wait_ms: int = 100,
          **edge):
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000, **edge)
    s.admission.max_wait_ms = max_wait_ms
    s.deadlines.request_ms = request_ms
    e = edge_factory(s)
    snap = write_snapshot(redis_server.client(), nodes)
    e.wait_snapshot(snap["version"])
    return e


def _waiting(edge) -> int:
    return edge.status()["admission"]["waiting"]


class _Peak:
    """Samples a count while a block runs: its highest value."""

    def __init__(self, read):
        self.read, self.peak, self._stop = read, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(0.005)

    def __enter__(self) -> _Peak:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(5)


def _one_slot_held(tiny_upstreams, redis_server, edge_factory):
    """A tiny node "one" with 1 known slot, held by a stream that waits for ``up.gate``:
    (upstream, edge, the held response)."""
    (up,) = tiny_upstreams(names=["one"])
    up.gate, up.chunks = threading.Event(), 2
    edge = _edge(redis_server, edge_factory, [up.snapshot_node(slots=1, slots_source="server",
                                                               score=None, has_metrics=False)])
    held = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                         stream=True, timeout=30)
    assert held.status_code == 200
    return up, edge, held


def test_requests_beyond_the_slots_wait_at_the_edge_in_arrival_order(
        tiny_upstreams, redis_server, edge_factory) -> None:
    up, edge, held = _one_slot_held(tiny_upstreams, redis_server, edge_factory)
    results: dict[str, int] = {}

    def call(tag: str) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": tag}]}
        results[tag] = requests.post(f"{edge.url}/v1/chat/completions", json=body,
                                     timeout=30).status_code

    threads = []
    with _Peak(lambda: up.inflight) as peak:
        for i, tag in enumerate(["first", "second", "third"]):
            threads.append(threading.Thread(target=call, args=(tag,)))
            threads[-1].start()
            procs.wait_until(lambda n=i + 1: _waiting(edge) == n, 10,
                             what=f"{i + 1} request(s) waiting at the edge")
        assert up.hits == 1 and up.inflight == 1      # the node never sees a second one
        up.gate.set()
        held.close()
        for t in threads:
            t.join(30)
    assert results == {"first": 200, "second": 200, "third": 200}
    assert peak.peak == 1
    order = [b.decode() for b in up.bodies[1:]]
    assert [next(tag for tag in ("first", "second", "third") if tag in b) for b in order] == \
        ["first", "second", "third"]
    st = edge.status()["admission"]
    assert st["shed"] == 0 and st["waiting"] == 0
    assert edge.node_status("one")["inflight"] == 0
    assert edge.node_status("one")["slots"] == 1


def test_a_client_that_leaves_while_waiting_leaves_the_line_at_once(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A waiting request whose client goes away leaves the queue at that moment: the
    "waiting" gauge comes back down and the request behind it takes the next free slot
    at once, not after the ghost's alive mark expires (seconds with the pool idle)."""
    up, edge, held = _one_slot_held(tiny_upstreams, redis_server, edge_factory)
    host, port = edge.url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "ghost"}]}'
    ghosts = []
    for _ in range(3):                       # three clients that will leave, first in line
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        ghosts.append(s)
        procs.wait_until(lambda n=len(ghosts): _waiting(edge) == n, 10, what="ghost waiting")
    result: dict[str, float] = {}

    def call() -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": "behind"}]}
        res = requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=30)
        result["status"], result["at"] = res.status_code, time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    procs.wait_until(lambda: _waiting(edge) == 4, 10, what="the request behind waiting")
    for s in ghosts:
        s.close()
    procs.wait_until(lambda: _waiting(edge) == 1, 5, interval=0.02,
                     what="the ghosts out of the line")
    up.gate.set()
    held.close()
    freed = time.monotonic()
    t.join(30)
    assert result["status"] == 200
    assert result["at"] - freed < 1.5        # the alive mark of a ghost lasts 2 s + 1 s
    assert _waiting(edge) == 0 and up.hits == 2   # the ghosts never reached the node


def test_the_request_at_the_head_of_the_queue_takes_a_freed_slot_before_its_next_poll(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The slot a request frees wakes the request at the head of the edge queue in the
    same worker (infergate.admission.wake): it is sent at once, not at its next look
    (admission.poll_ms, set to its most here, 1 s). Four rounds, each timed from the
    end of the stream that held the slot to the waiting request's arrival at the node;
    by polling alone each comes at the request's next look, about 1 s later here (the
    stream ends just after the request began its sleep)."""
    (up,) = tiny_upstreams(names=["one"])
    up.chunks = 2
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000)
    s.admission.poll_ms = 1000
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [up.snapshot_node(
        slots=1, slots_source="server", score=None, has_metrics=False)])
    edge.wait_snapshot(snap["version"])
    delays = []
    for i in range(4):
        up.gate = threading.Event()
        held = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                             stream=True, timeout=30)
        assert held.status_code == 200
        hits = up.hits
        status: list[int] = []
        body = {**CHAT, "messages": [{"role": "user", "content": f"waiting {i}"}]}
        t = threading.Thread(target=lambda: status.append(requests.post(
            f"{edge.url}/v1/chat/completions", json=body, timeout=30).status_code))
        t.start()
        procs.wait_until(lambda: _waiting(edge) == 1, 10, what="a request waiting at the edge")
        up.gate.set()
        assert b"[DONE]" in held.content    # the stream that held the slot has ended
        ended = time.monotonic()
        procs.wait_until(lambda: up.hits == hits + 1, 10, interval=0.002,
                         what="the waiting request at the node")
        delays.append(time.monotonic() - ended)
        t.join(30)
        assert status == [200]
    assert max(delays) < 0.5, delays


def test_a_request_whose_deadline_cannot_be_met_gets_429_at_once(
        tiny_upstreams, redis_server, edge_factory) -> None:
    (up,) = tiny_upstreams(names=["one"])
    up.delay_s = 1.5
    edge = _edge(redis_server, edge_factory, [up.snapshot_node(slots=1, slots_source="config",
                                                               score=None, has_metrics=False)],
                 request_ms=2500, max_wait_ms=100)
    assert requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    up.gate, up.chunks, up.delay_s = threading.Event(), 2, 0.0
    held = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                         stream=True, timeout=30)
    try:
        assert held.status_code == 200
        # a 1.5 s wait for the slot and 1.5 s of its own do not fit in 2.5 s
        res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert res.status_code == 429, res.text
        assert res.json()["error"]["code"] == "nodes_saturated"
        assert res.headers["Retry-After"] == "2"
        assert up.hits == 2
        # a stream too: it would start in time but end past its deadline (a stream whose
        # answers alone outrun the deadline need only start: tests/lua/test_fit_lua.py)
        res = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                            timeout=30)
        assert res.status_code == 429, res.text
        assert up.hits == 2
        up.gate.set()                                   # the held stream ends, its slot frees
        assert FINISHED.search(held.text)
    finally:
        up.gate.set()
        held.close()
    edge.wait_idle()
    assert edge.status()["admission"]["waiting"] == 0


def test_a_stream_whose_answers_outrun_the_deadline_waits_to_start(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A deadline shorter than the node's answers cannot be one for a whole stream: such a
    stream need only start in time (its chunks then have the idle timeout), so it waits
    for a slot predicted to free in time instead of a 429."""
    (up,) = tiny_upstreams(names=["one"])
    up.chunks, up.chunk_interval_s = 4, 0.5              # 1.5 s streams, 2 slots
    edge = _edge(redis_server, edge_factory, [up.snapshot_node(slots=2, slots_source="config",
                                                               score=None, has_metrics=False)],
                 request_ms=1200, max_wait_ms=100)
    first = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=30)
    assert first.status_code == 200 and FINISHED.search(first.text)
    up.gate, up.chunks, up.chunk_interval_s = threading.Event(), 2, 0.0
    held = [requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                          stream=True, timeout=30) for _ in range(2)]
    got: list[requests.Response] = []
    try:
        assert [h.status_code for h in held] == [200, 200]
        t = threading.Thread(target=lambda: got.append(requests.post(
            f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)))
        t.start()
        procs.wait_until(lambda: _waiting(edge) == 1 or got, 5, what="the stream to wait")
        assert not got, got[0].text
        up.gate.set()                                   # the held streams end, slots free
        t.join(10)
        assert got and got[0].status_code == 200, got[0].text
        assert FINISHED.search(got[0].text)
    finally:
        up.gate.set()
        for h in held:
            h.close()
    edge.wait_idle()


@pytest.mark.parametrize("kind,source,expect", [
    ("openai", "server", 200),     # a llama.cpp server: queues beyond its slots
    ("vllm", "config", 200),       # max_concurrency = --max-num-seqs: vLLM queues too
    ("openai", "config", 429),     # unknown server (llama-cpp-python cuts a running one)
], ids=["llamacpp-slots", "vllm-config", "openai-config"])
def test_a_retry_with_every_other_slot_taken(tiny_upstreams, redis_server, edge_factory,
                                             kind: str, source: str, expect: int) -> None:
    """nginx's proxy path (edge.answer_relay off): the first try fails (a 500) and the
    only other node has every slot taken. A node that queues what is beyond its slots
    gets the retry over its slots, as nginx would send it there; an OpenAI-compatible
    server of unknown kind does not, and the client gets 429 nodes_saturated with
    Retry-After (not 503: every node is healthy). Relayed, the retry waits for a slot:
    test_a_relayed_retry_waits_for_a_slot."""
    a, b = tiny_upstreams(names=["a", "b"])
    b.gate, b.chunks = threading.Event(), 2

    def node(up, **kw):
        return up.snapshot_node(kind=kind, slots=1, slots_source=source, score=None,
                                has_metrics=False, **kw)

    edge = _edge(redis_server, edge_factory, [node(a, healthy=False), node(b)],
                 answer_relay=False)
    held = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                         stream=True, timeout=30)          # b's one slot
    try:
        assert held.status_code == 200 and held.headers["X-Infergate-Node"] == "b"
        snap = write_snapshot(redis_server.client(), [node(a), node(b)])
        edge.wait_snapshot(snap["version"])
        a.mode = "fail"
        res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert a.hits == 1
        assert res.status_code == expect, res.text
        if expect == 200:
            assert res.headers["X-Infergate-Node"] == "b" and b.hits == 2
        else:
            err = res.json()["error"]
            assert (err["code"], err["type"]) == ("nodes_saturated", "server_overloaded")
            assert res.headers["Retry-After"] == "1"        # admission.retry_after_s
            assert b.hits == 1                              # b never saw a second one
    finally:
        b.gate.set()
        held.close()
    edge.wait_idle()
    assert edge.node_status("b")["inflight"] == 0 and edge.node_status("a")["inflight"] == 0


@contextlib.contextmanager
def _retry_behind_a_held_slot(tiny_upstreams, redis_server, edge_factory, request_ms: int,
                              fails: str):
    """Nodes a and b of one slot each, b's held by a stream; a plain request whose try on
    a fails (tiny upstream mode ``fails``) then waits for a slot: yields (a, b, edge, its
    future, the snapshot node maker); b's stream ends on the way out."""
    a, b = tiny_upstreams(names=["a", "b"])
    b.gate, b.chunks = threading.Event(), 2

    def node(up, **kw):
        return up.snapshot_node(kind="openai", slots=1, slots_source="config", score=None,
                                has_metrics=False, **kw)

    edge = _edge(redis_server, edge_factory, [node(a, healthy=False), node(b)],
                 request_ms=request_ms)
    held = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                         stream=True, timeout=30)          # b's one slot
    pool = ThreadPoolExecutor(1)
    try:
        assert held.status_code == 200 and held.headers["X-Infergate-Node"] == "b"
        snap = write_snapshot(redis_server.client(), [node(a), node(b)])
        edge.wait_snapshot(snap["version"])
        a.mode = fails
        fut = pool.submit(requests.post, f"{edge.url}/v1/chat/completions", json=CHAT,
                          timeout=30)
        procs.wait_until(lambda: "on node a ended:" in edge.error_log(), 10,
                         what="the first try on a")
        yield a, b, edge, fut, node
    finally:
        b.gate.set()
        held.close()
        pool.shutdown(wait=True)


def test_a_relayed_retry_waits_for_a_slot(tiny_upstreams, redis_server, edge_factory) -> None:
    """Relayed (edge.answer_relay), a plain request whose first try fails (a 500) while
    the only other node, of unknown kind, has its one slot taken waits at the edge for
    that slot, as a relayed stream's retry does, and is answered by it once it frees,
    within its deadline; the node never holds two."""
    with _retry_behind_a_held_slot(tiny_upstreams, redis_server, edge_factory,
                                   request_ms=30000, fails="fail") as (a, b, edge, fut, _):
        # for a second after it, the retry does not reach b (whose slot is taken)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert not fut.done() and b.hits == 1, (b.hits, fut.done() and fut.result().text)
            time.sleep(0.05)
        b.gate.set()                                        # the stream ends, b's slot frees
        res = fut.result(timeout=20)
    assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "b", res.text
    assert b.hits == 2 and a.hits == 1
    edge.wait_idle()
    assert edge.node_status("b")["inflight"] == 0 and edge.node_status("a")["inflight"] == 0


def test_a_retry_that_waits_out_its_deadline_gets_504(tiny_upstreams, redis_server,
                                                      edge_factory) -> None:
    """A retry that waited for a slot until the request's deadline answers 504
    deadline_exceeded, not 502 for its first node's answer cut short."""
    with _retry_behind_a_held_slot(tiny_upstreams, redis_server, edge_factory,
                                   request_ms=3000, fails="cut") as (_, b, _e, fut, _):
        res = fut.result(timeout=20)
    assert res.status_code == 504, res.text
    assert res.json()["error"]["code"] == "deadline_exceeded" and b.hits == 1


def test_a_retry_waiting_for_a_slot_takes_its_first_node_once_it_is_back(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The node that failed the request's first try and that the control plane then saw
    come back (restarted: the snapshot's back_at) may take the retry that waits for a
    slot, as a new request may; before, the retry waited for the other node's slot until
    its deadline."""
    with _retry_behind_a_held_slot(tiny_upstreams, redis_server, edge_factory,
                                   request_ms=20000, fails="cut") as (a, b, edge, fut, node):
        assert not fut.done() and a.hits == 1     # the retry waits for b's slot
        a.mode = "ok"
        snap = write_snapshot(redis_server.client(), [node(a, back_at=time.time()), node(b)])
        edge.wait_snapshot(snap["version"])
        res = fut.result(timeout=10)
    assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "a", res.text
    assert a.hits == 2 and b.hits == 1


def test_a_one_at_a_time_server_never_sees_a_second_request(simnodes, redis_server,
                                                           edge_factory) -> None:
    nodes = simnodes(2, "--llamacpp", "--output-tokens", "6:6", time_scale=0.05,
                     names=["cpp-a", "cpp-b"])
    edge = _edge(redis_server, edge_factory,
                 [n.snapshot_node(kind="openai", slots=1, slots_source="config",
                                  max_concurrency=1, score=None, has_metrics=False)
                  for n in nodes], workers=2)

    def stream(_: int) -> tuple[int, bool]:
        with requests.post(f"{edge.url}/v1/chat/completions", json={**SIM, "stream": True},
                           stream=True, timeout=60) as res:
            text = res.text
        return res.status_code, FINISHED.search(text) is not None

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(stream, range(16)))
    assert Counter(s for s, _ in got) == {200: 16}
    assert all(done for _, done in got), got             # every stream ran to its end
    for n in nodes:
        st = n.state()
        assert st["interrupted_total"] == 0, st
        assert st["completed_total"] >= 1, st
    assert edge.status()["admission"]["shed"] == 0


def _burst(edge, n: int) -> Counter:
    def one(_: int) -> int:
        return requests.post(f"{edge.url}/v1/chat/completions", json=SIM,
                             timeout=60).status_code

    with ThreadPoolExecutor(n) as pool:
        return Counter(pool.map(one, range(n)))


def test_after_one_at_a_time_traffic_a_burst_is_not_shed_while_slots_are_free(
        simnodes, redis_server, edge_factory) -> None:
    nodes = simnodes(2, "--max-running", "8", "--output-tokens", "40:40", time_scale=0.3,
                     names=["batch-a", "batch-b"])
    edge = _edge(redis_server, edge_factory,
                 [n.snapshot_node(max_concurrency=8, score=0.1) for n in nodes],
                 request_ms=1500)
    for _ in range(20):                                   # a quiet spell: one at a time
        assert _burst(edge, 1) == {200: 1}
    serial = []
    for n in nodes:
        st = edge.node_status(n.name)
        if st["learned_concurrency"] is not None:
            assert st["learned_concurrency"] < 2, st
            serial.append(st["service_s"])
    # taken as serial, the 8th request on a node would be predicted to take 8 answers
    assert serial and 8 * min(serial) > 1.5, serial
    # 16 at once: every node has 8 free batch slots, so none of them is shed
    got = _burst(edge, 16)
    assert got == {200: 16}, got
    assert edge.status()["admission"]["shed"] == 0


def test_a_burst_within_known_slots_is_admitted_and_the_slots_hold(
        simnodes, redis_server, edge_factory) -> None:
    nodes = simnodes(2, "--max-running", "4", "--output-tokens", "10:10", time_scale=0.02,
                     names=["slot-a", "slot-b"])
    edge = _edge(redis_server, edge_factory,         # two workers share the slots
                 [n.snapshot_node(max_concurrency=4, slots=4, slots_source="config", score=0.1)
                  for n in nodes], workers=2)
    for _ in range(10):
        assert _burst(edge, 1) == {200: 1}

    def most_at_a_node() -> int:
        return max(st["running"] + st["waiting"] for st in (n.state() for n in nodes))

    with _Peak(most_at_a_node) as peak:
        got = _burst(edge, 24)                            # 3 x the slots: 16 wait at the edge
    assert got == {200: 24}, got
    assert 1 <= peak.peak <= 4                            # never more at a node than its slots
    assert edge.status()["admission"]["shed"] == 0


def test_under_overload_the_queue_admits_only_what_meets_the_deadline(
        simnodes, redis_server, edge_factory) -> None:
    (node,) = simnodes(1, "--max-running", "2", "--output-tokens", "40:40", time_scale=0.3,
                       names=["over"])
    edge = _edge(redis_server, edge_factory,
                 [node.snapshot_node(max_concurrency=2, slots=2, slots_source="config",
                                     score=0.1)], request_ms=3000)
    for _ in range(5):                                    # answer-time history
        assert _burst(edge, 1) == {200: 1}
    got = _burst(edge, 40)                                # far more than 3 s of work
    assert got[504] == 0 and sum(got.values()) == 40, got
    assert got[200] >= 2 and got[429] >= 1, got
    assert edge.status()["admission"]["deadline_exceeded"] == 0
