"""Outlier detection on time to first byte at the edge (lua/infergate/routing/outlier.lua)
against tiny upstreams: a node that accepts requests and never answers gets no new
request once one of its requests waited past the threshold, without any health poll or
breaker; it gets requests again when it answers, and when every node is an outlier the
edge still routes."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support.stack import edge_on_snapshot, edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _post(edge, timeout: float = 20) -> requests.Response:
    return requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=timeout)


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


MIN_S, FACTOR = 0.5, 5.0


def _stream(edge, timeout: float = 20) -> tuple[int, str | None, bytes | None]:
    """A streamed chat completion: status, serving node, body (None when cut short)."""
    res = requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                        timeout=timeout, stream=True)
    try:
        body: bytes | None = b"".join(res.iter_content(None))
    except requests.exceptions.ChunkedEncodingError:
        body = None
    return res.status_code, res.headers.get("X-Infergate-Node"), body


def _stream_until_on(edge, a, b, node_is: str | None = None, timeout: float = 20):
    """Sends streams until one is sent to ``a`` (ties between idle nodes are broken at
    random), each answered whole (200, [DONE], its first token once) and, with
    ``node_is``, naming that node; returns (seconds that one took, b's new requests
    meanwhile), or None after 16 streams."""
    for _ in range(16):
        hits, b_hits, t0 = a.hits, b.hits, time.monotonic()
        status, node, body = _stream(edge, timeout=timeout)
        assert status == 200 and body and b"[DONE]" in body and body.count(b"tok0") == 1
        assert node_is is None or node == node_is, node
        if a.hits > hits:
            return time.monotonic() - t0, b.hits - b_hits
    return None


def _threshold(edge, name: str, kind: str = "plain") -> float:
    """The node's outlier threshold (s) as the edge computes it from its TTFB history
    (``kind``: "plain" or "stream"): max(floor, outlier_ttfb_factor x p90), the floor
    MIN_S for both kinds here -- a loaded machine raises p90."""
    p90 = edge.node_status(name)["ttfb_p90_s"][kind] or 0.0
    return max(MIN_S, FACTOR * p90)


def _until_past(threshold: float, since: float) -> None:
    """Waits until an attempt started at ``since`` (monotonic s) has waited past the
    threshold, with a margin; nothing to poll: the edge checks it at its next pick."""
    time.sleep(max(0.0, since + threshold + 0.3 - time.monotonic()))


def _stick_one(pool: ThreadPoolExecutor, edge, a, b, answered: int, send=_post) -> list:
    """With ``a`` hanging or slow: sends requests (``send``, in ``pool``) until one of
    them is held by ``a`` (``answered``: requests both nodes had before); returns their
    futures."""
    stuck: list = []
    while a.inflight < 1:
        stuck.append(pool.submit(send, edge))
        _wait(lambda: a.inflight >= 1 or a.hits + b.hits >= answered + len(stuck), 10)
    return stuck


def _found_then_hung_again(pool: ThreadPoolExecutor, edge, a, b, threshold: float) -> None:
    """With ``a`` hanging (``hang`` or ``frozen``): one request stuck on it until the edge
    finds it an outlier, then released (retried on b), and ``a`` hangs again."""
    stuck = _stick_one(pool, edge, a, b, 10)
    _until_past(threshold, time.monotonic())
    assert _post(edge).headers["X-Infergate-Node"] == "b"   # finds a an outlier
    assert edge.node_status("a")["outlier"] is True
    a.release()                      # the stuck request ends unanswered (retried on b)
    for f in stuck:
        assert f.result(timeout=20).status_code == 200
    _wait(lambda: a.inflight == 0)
    a.hold()


@pytest.fixture
def pair(tiny_upstreams, redis_server, edge_factory):
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=MIN_S, outlier_stream_ttfb_min_s=MIN_S,
                                      outlier_ttfb_factor=FACTOR,
                                      read_timeout_ms=15000))
    return edge, a, b


def test_a_hanging_node_stops_getting_requests_until_it_answers(pair) -> None:
    edge, a, b = pair
    for _ in range(10):                      # some TTFB history for both nodes
        assert _post(edge).status_code == 200
    threshold = _threshold(edge, "a")
    a.mode = "hang"
    pool = ThreadPoolExecutor(8)
    try:
        # requests until one is hanging on a, then no more until all have arrived
        stuck = _stick_one(pool, edge, a, b, 10)
        since = time.monotonic()
        _wait(lambda: all(f.done() for f in stuck[:-1]), 10)   # the others were answered by b
        _until_past(threshold, since)
        before = a.hits
        seen = Counter(_post(edge).headers["X-Infergate-Node"] for _ in range(20))
        assert seen == {"b": 20}
        assert a.hits == before              # not even tried
        assert edge.node_status("a")["outlier"] is True
        assert "is an outlier" in edge.error_log()
        # a answers again (a slow answer, but a first byte): back in the pool
        a.mode = "ok"
        a.delay_s = 0.0
        a.release()
        for f in stuck:
            assert f.result(timeout=20).status_code == 200   # retried on b
        _wait(lambda: "a" in {_post(edge).headers["X-Infergate-Node"] for _ in range(10)})
    finally:
        a.release()
        pool.shutdown(wait=True)


def test_a_node_that_sends_stream_headers_and_then_nothing_is_an_outlier(pair) -> None:
    """vLLM, SGLang and TGI send a stream's headers before the engine has the request: a
    node whose engine hangs behind its live HTTP server answers headers and then no
    chunk. Its first byte is the first chunk, so it is found an outlier all the same."""
    edge, a, b = pair
    a.chunks = b.chunks = 1                  # short streams: all within the flag's life
    for _ in range(10):                      # stream TTFB history for both nodes
        status, _, body = _stream(edge)
        assert status == 200 and body and b"[DONE]" in body
    threshold = _threshold(edge, "a", "stream")
    a.mode = "stall"
    pool = ThreadPoolExecutor(8)
    try:
        stuck = _stick_one(pool, edge, a, b, 10, send=_stream)
        since = time.monotonic()
        _wait(lambda: all(f.done() for f in stuck[:-1]), 10)
        _until_past(threshold, since)
        before = a.hits
        for _ in range(20):
            status, node, body = _stream(edge, timeout=5)
            assert (status, node) == (200, "b") and body and b"[DONE]" in body
        assert a.hits == before              # not even tried
        assert edge.node_status("a")["outlier"] is True
        a.mode = "ok"
        a.release()                          # the stalled stream ends before content:
        body = stuck[-1].result(timeout=20)[2]  # the edge's relay retries it on b
        assert body and b"[DONE]" in body
        _wait(lambda: "a" in {_stream(edge)[1] for _ in range(10)})
    finally:
        a.release()
        pool.shutdown(wait=True)


def test_a_stream_silent_after_its_headers_is_a_failure_of_the_node(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A stream whose node sent the headers and then nothing until the stream idle
    timeout counts against the node (breaker, failure count), as a timeout before the
    headers does; a client that leaves such a stream earlier costs the node nothing."""
    (a,) = tiny_upstreams(names=["solo"])
    s = edge_settings(redis_server.url, [a.node_settings()], read_timeout_ms=15000)
    s.deadlines = s.deadlines.model_validate({"stream_idle_ms": 800})
    edge = edge_factory(s)
    status, _, body = _stream(edge)
    assert status == 200 and body and b"[DONE]" in body
    assert edge.node_status("solo")["failures"] == 0
    a.mode = "stall"
    try:
        # cut by the 0.8 s idle timeout; the edge held the headers (its stream relay,
        # lua/infergate/stream/relay.lua): the client gets a 504
        status, node, body = _stream(edge, timeout=5)
        assert (status, node) == (504, "solo") and body and b"upstream_timeout" in body
        _wait(lambda: edge.node_status("solo")["failures"] == 1)
        # a client that gives up after 0.3 s
        with pytest.raises(requests.exceptions.RequestException):   # read timed out
            _stream(edge, timeout=0.3)
        _wait(lambda: edge.node_status("solo")["inflight"] == 0)
        assert edge.node_status("solo")["failures"] == 1
    finally:
        a.release()


def test_a_probe_of_a_node_still_hung_is_retried_in_time(tiny_upstreams, redis_server,
                                                          edge_factory) -> None:
    """Once a hung node's flag has expired it gets one probe at a time. With another node
    to retry on, a probe waits 2 x threshold, not until the deadline: the node still
    hangs, so the probe times out and the request is answered by the other node (without
    the shorter wait: 504 at 4 s)."""
    a, b = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                      outlier_ttfb_min_s=MIN_S, outlier_stream_ttfb_min_s=MIN_S,
                      outlier_ttfb_factor=FACTOR, read_timeout_ms=15000)
    s.deadlines = s.deadlines.model_validate({"request_ms": 4000})
    edge = edge_factory(s)
    for _ in range(10):
        assert _post(edge).status_code == 200
    threshold = _threshold(edge, "a")
    assert 2 * threshold < 3.5, "this machine is too slow for the test's deadline"
    a.mode = "hang"
    pool = ThreadPoolExecutor(8)
    try:
        _found_then_hung_again(pool, edge, a, b, threshold)
        probed = a.hits
        until = time.monotonic() + 30
        while a.hits == probed:          # the flag expires, then a probe goes to a
            assert time.monotonic() < until, "no probe reached the hung node"
            res = _post(edge)
            assert res.status_code == 200, res.text
            assert res.headers["X-Infergate-Node"] == "b"
        assert a.hits == probed + 1
    finally:
        a.release()
        pool.shutdown(wait=True)


def test_a_frozen_node_gets_no_probe_until_it_answers_a_liveness_check(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A frozen process (it accepts connections, answers nothing, GETs included) found an
    outlier gets no client request as a probe: the edge asks it GET /health itself, and
    only once that is answered does a probe go, and the node is back."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=MIN_S, outlier_stream_ttfb_min_s=MIN_S,
                                      outlier_ttfb_factor=FACTOR, read_timeout_ms=15000))
    for _ in range(10):
        assert _post(edge).status_code == 200
    threshold = _threshold(edge, "a")
    a.mode = "frozen"
    pool = ThreadPoolExecutor(8)
    try:
        _found_then_hung_again(pool, edge, a, b, threshold)   # checks hang: no probe
        hits, gets = a.hits, a.gets
        # past the outlier flag's life (3 x threshold, when a probe used to go), with
        # checks asked and unanswered
        until = time.monotonic() + 3 * threshold + 1.0
        while time.monotonic() < until or (a.gets < gets + 2 and time.monotonic() < until + 10):
            res = _post(edge)
            assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "b"
        assert a.hits == hits, "a client request went to the frozen node"
        # it thaws: the next check is answered, a probe goes, the node is back
        a.mode = "ok"
        a.release()
        _wait(lambda: "a" in {_post(edge).headers["X-Infergate-Node"] for _ in range(5)}, 20)
        assert "answers its liveness check" in edge.error_log()
    finally:
        a.release()
        pool.shutdown(wait=True)


def test_a_stream_on_a_node_that_froze_moves_on_once_found_and_waits_for_a_slot(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """Known slots, one each. A stream sent to a node that answers nothing, GETs
    included (frozen), is retried once the edge found the node silent and its liveness
    check got no answer, not after its 10 s first-byte read; the other node, slow to
    its first byte (an outlier too, but it answers the check), keeps its request, and
    the retry waits at the edge for its only slot instead of failing; all within a 15 s
    deadline. A plain request that comes while the retry waits leaves it the slot (an
    answer under way goes first), then gets it. Later requests wait for that slot too,
    not for the frozen node's free one."""
    a, b = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000,
                      outlier_ttfb_min_s=MIN_S, outlier_stream_ttfb_min_s=MIN_S,
                      outlier_ttfb_factor=FACTOR)
    s.deadlines.request_ms = 15000
    s.admission.max_wait_ms = 5000
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(kind="openai", models=["tiny"], max_concurrency=1, slots=1,
                        slots_source="config", score=0.1) for u in (a, b)])
    edge.wait_snapshot(snap["version"])
    a.mode = "frozen"
    b.delay_s = 4.0                        # b's one slot is busy until 4 s (a is found
    #                                        frozen at its second failed 1 s check, ~3 s)
    pool = ThreadPoolExecutor(3)
    try:
        t0 = time.monotonic()
        futs = [pool.submit(_stream, edge) for _ in range(2)]   # one slot each
        _wait(lambda: b.hits == 1)
        b.delay_s = 0.3                    # what b answers next is quick
        # the finding's own check (1 s, after a failed early one of 1 s)
        _wait(lambda: "node a silent and no answer to its liveness check" in edge.error_log(), 10)
        plain = pool.submit(_post, edge)   # comes while the retry waits for b's slot
        got = [f.result(timeout=30) for f in futs]
        took = time.monotonic() - t0
        answer = plain.result(timeout=30)
        assert answer.status_code == 200, answer.text
        # a is still frozen, its slot free: two more streams both wait for b's slot
        b.delay_s = 1.0
        later = [f.result(timeout=30) for f in [pool.submit(_stream, edge) for _ in range(2)]]
    finally:
        a.release()
        pool.shutdown(wait=True)
    assert [(st, node) for st, node, _ in got] == [(200, "b"), (200, "b")], got
    assert all(body and b"[DONE]" in body for _, _, body in got)
    assert [(st, node) for st, node, _ in later] == [(200, "b"), (200, "b")], later
    assert a.hits == 1 and b.hits == 5
    streamed = [b'"stream": true' in body for body in b.bodies]
    assert streamed[:3] == [True, True, False], streamed   # the retry, then the plain one
    assert took < 15.0
    log = edge.error_log()
    assert "node a is an outlier" in log and "node b is an outlier" in log
    # within 1 s right after a failed early check, else the finding's own 3 s
    assert re.search(r"node a silent and no answer to its liveness check within [13] s", log)
    assert "node b silent and no answer" not in log


def test_a_slow_answer_clears_the_outlier_at_once(pair) -> None:
    edge, a, b = pair
    for _ in range(10):
        assert _post(edge).status_code == 200
    threshold = _threshold(edge, "a")
    slow_s = threshold + 1.5                 # answers well after it is found an outlier
    a.delay_s = slow_s
    pool = ThreadPoolExecutor(4)
    try:
        slow = _stick_one(pool, edge, a, b, 10)
        since = time.monotonic()
        _wait(lambda: all(f.done() for f in slow[:-1]), 10)
        _until_past(threshold, since)
        assert {_post(edge).headers["X-Infergate-Node"] for _ in range(10)} == {"b"}
        assert edge.node_status("a")["outlier"] is True
        a.delay_s = 0.0
        for f in slow:
            assert f.result(timeout=20).status_code == 200
        # the first byte came: no wait for the flag to expire
        st = edge.node_status("a")
        assert st["outlier"] is False
        assert st["ttfb_p90_s"]["plain"] >= slow_s - 0.1   # the slow answer is in its history
        assert edge.node_status("b")["outlier"] is False
    finally:
        pool.shutdown(wait=True)


def test_every_node_an_outlier_still_routes(tiny_upstreams, redis_server, edge_factory) -> None:
    (a,) = tiny_upstreams(names=["solo"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()],
                                      outlier_ttfb_min_s=0.3, read_timeout_ms=15000))
    a.delay_s = 1.0
    pool = ThreadPoolExecutor(2)
    try:
        first = pool.submit(_post, edge)
        _wait(lambda: a.inflight >= 1)
        time.sleep(0.5)
        second = pool.submit(_post, edge)    # the only node: still sent there
        assert first.result(timeout=20).status_code == 200
        assert second.result(timeout=20).status_code == 200
    finally:
        pool.shutdown(wait=True)


def test_a_frozen_node_is_found_by_an_early_liveness_check_before_its_threshold(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """With the 5 s TTFB floor, a node that froze (it accepts connections and answers
    nothing, GETs included) while a request of the edge waits on it is asked GET /health
    after 1 s of quiet (edge.liveness_suspect_s), and stops getting requests once that
    check goes unanswered for its 1 s, well before the threshold; the edge logs why. A
    node that is merely slow to its first byte answers the check and keeps its requests."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=5.0, outlier_stream_ttfb_min_s=5.0,
                                      outlier_ttfb_factor=FACTOR, read_timeout_ms=15000))
    for _ in range(10):
        assert _post(edge).status_code == 200
    pool = ThreadPoolExecutor(24)
    futs: list = []
    try:
        # slow, alive: the checks are answered, the node keeps getting requests
        b.delay_s = 2.5
        gets = b.gets
        futs += _stick_one(pool, edge, b, a, 10)
        end = time.monotonic() + 10
        while b.gets == gets:                     # picks ask; after 1 s quiet, a check
            assert time.monotonic() < end, "no liveness check of the slow node"
            futs.append(pool.submit(_post, edge))
            time.sleep(0.1)
        assert not edge.node_status("b")["outlier"]
        _wait(lambda: b.inflight == 0, 10)
        b.delay_s = 0.0
        # frozen: found by the check, not by the 5 s threshold
        a.mode = "frozen"
        answered = a.hits + b.hits
        t0 = time.monotonic()
        futs += _stick_one(pool, edge, a, b, answered)
        last_hit, hits = t0, a.hits
        while time.monotonic() < t0 + 4.5:
            futs.append(pool.submit(_post, edge))
            time.sleep(0.05)
            if a.hits != hits:
                last_hit, hits = time.monotonic(), a.hits
        assert last_hit - t0 < 4.0, f"requests reached the frozen node until {last_hit - t0:.2f} s"
        assert edge.node_status("a")["outlier"] is True
        log = edge.error_log()
        assert "node a quiet for" in log and "no answer to a liveness check" in log
        assert "node b quiet for" not in log
    finally:
        a.mode = "ok"
        a.release()
        b.delay_s = 0.0
        statuses = [f.result(timeout=30).status_code for f in futs]
        pool.shutdown(wait=True)
    assert statuses and set(statuses) == {200}


def test_a_stream_paused_mid_answer_on_a_live_node_is_not_cut(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A stream whose node pauses mid-answer longer than twice the stall threshold (a long
    prefill of another request holds llama.cpp's batch for seconds) goes on when the node
    answers its liveness check: with no other node to continue on, leaving it would cut
    the answer (stream_interrupted) where nginx would deliver it."""
    import threading

    (a,) = tiny_upstreams(names=["a"])
    a.chunks, a.chunk_interval_s = 6, 0.05
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()],
                                      stall_min_s=0.5, read_timeout_ms=15000))
    assert _stream(edge)[0] == 200
    a.gate = threading.Event()            # the next stream pauses before its last chunk
    got: list = []
    t = threading.Thread(target=lambda: got.append(_stream(edge)))
    t.start()
    _wait(lambda: a.inflight == 1)
    time.sleep(3.0)                       # the pause: past 2 x 0.5 s and the check's wait
    a.gate.set()
    t.join(20)
    status, node, body = got[0]
    assert status == 200 and node == "a" and body is not None
    assert b"[DONE]" in body and b"stream_interrupted" not in body, body[-300:]
    assert a.hits == 2 and a.gets >= 1   # asked GET /health, not a second POST


def test_a_stream_whose_node_freezes_mid_answer_is_continued_at_its_first_silent_read(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A stream silent mid-answer on a node that failed a liveness check of that silence
    (frozen: its /health hangs) is continued on the other node at its first silent read,
    twice the stall threshold (2 s here), however long ago the check failed; not after a
    second read bound spent waiting for a check to be asked again (the client's 7 s read
    timeout catches that: 8 s). The freeze, once the node resumes, is not one of its
    gaps: its threshold stays at the floor."""
    import threading

    a, b = tiny_upstreams(names=["a", "b"])
    for u in (a, b):
        u.chunks, u.chunk_interval_s = 6, 0.05
    edge = edge_on_snapshot(redis_server, edge_factory, [
        a.snapshot_node(score=None), b.snapshot_node(score=None, effective_weight=1e-6)],
        stall_min_s=2.0, read_timeout_ms=20000)
    a.gate = threading.Event()                  # pauses before its last chunk
    got: list = []

    def stream() -> None:
        with requests.post(f"{edge.url}/v1/chat/completions", json={**CHAT, "stream": True},
                           stream=True, timeout=(2, 7)) as res:
            got.append((res.status_code, b"".join(res.iter_content(None))))

    t = threading.Thread(target=stream)
    t.start()
    _wait(lambda: a.stream_chunks_sent == 5 or not t.is_alive())
    a.mode = "frozen"                           # its /health hangs too
    t.join(20)
    a.mode = "ok"
    a.gate.set()
    assert got, "the client's 7 s read timeout: the stream waited on the frozen node"
    status, body = got[0]
    assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-300:]
    writers = [json.loads(e[len(b"data: "):]).get("system_fingerprint")
               for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert writers[0] == "a" and writers[-1] == "b", writers
    assert "no answer to its liveness check" in edge.error_log()
    assert edge.node_status("a")["stall_threshold_s"] == pytest.approx(2.0)


def test_a_frozen_node_with_every_slot_taken_is_reported_stalled(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A node whose only slot holds a request when it freezes is in no pick, so no pick
    asks about it; the liveness timer does (requests in flight, no byte for 1 s): once
    two checks of its silence got no answer the edge reports the node stalled (to the
    control plane, through its stats), well before the request's deadline, and for as
    long as it stays frozen (checked again). Once it answers, it is not. (nginx's proxy
    path: a relayed request, edge.answer_relay, would be retried on b instead.)"""
    a, b = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=20000,
                      outlier_ttfb_min_s=5.0, outlier_stream_ttfb_min_s=5.0,
                      answer_relay=False)
    s.deadlines.request_ms = 20000
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [
        u.snapshot_node(kind="openai", models=["tiny"], max_concurrency=1, slots=1,
                        slots_source="config", score=0.1, effective_weight=w)
        for u, w in ((a, 1.0), (b, 1e-6))])
    edge.wait_snapshot(snap["version"])
    assert _post(edge, 30).headers["X-Infergate-Node"] == "a"   # bytes before it freezes
    a.mode = "frozen"
    pool = ThreadPoolExecutor(2)
    try:
        fut = pool.submit(_post, edge, 30)
        _wait(lambda: a.inflight == 1)
        t0 = time.monotonic()
        _wait(lambda: "node a quiet for" in edge.error_log(), 5)
        assert edge.node_status("a")["stalled"] is False   # one missed check: not yet
        # checked again a few seconds later: two missed checks of one silence report it
        _wait(lambda: edge.node_status("a")["stalled"] is True, 10)
        assert time.monotonic() - t0 < 10.0
        assert edge.error_log().count("node a quiet for") >= 2
        # still frozen: checked again every few seconds, and still reported stalled
        # (before, the finding lapsed after 30 s and the node came back as busy)
        _wait(lambda: edge.error_log().count("node a quiet for") >= 3, 10)
        assert edge.node_status("a")["stalled"] is True
    finally:
        a.mode = "ok"
        a.release()
        fut.result(timeout=30)
        pool.shutdown(wait=True)
    _wait(lambda: edge.node_status("a")["stalled"] is False, 10)


def test_a_stream_whose_node_answered_then_froze_is_not_waited_on_to_its_bound(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """The liveness answer that keeps a silent stream waiting must be recent: a node that
    answered its check and then froze (GETs hang too) is found again within a few
    seconds, not after the stream's whole read bound (20 s here); with no other node to
    continue on, the answer ends with an error event."""
    import threading

    (a,) = tiny_upstreams(names=["a"])
    a.chunks, a.chunk_interval_s = 6, 0.05
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings()],
                                      stall_min_s=0.5, read_timeout_ms=20000))
    assert _stream(edge)[0] == 200
    a.gate = threading.Event()
    got: list = []
    t = threading.Thread(target=lambda: got.append((_stream(edge, timeout=40), time.monotonic())))
    t.start()
    _wait(lambda: a.inflight == 1)
    gets = a.gets
    _wait(lambda: a.gets > gets, 10)      # the paused stream's node answered a check
    a.mode = "frozen"
    frozen_at = time.monotonic()
    t.join(40)
    a.mode = "ok"
    a.release()
    a.gate.set()
    (status, _, body), ended = got[0]
    assert status == 200 and body is not None and b"stream_interrupted" in body, body[-300:]
    assert ended - frozen_at < 12.0, ended - frozen_at


def test_a_stream_on_a_node_that_froze_while_idle_moves_on_after_the_early_check(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """Both nodes idle, then one is frozen (it accepts connections, answers nothing, GETs
    included): a stream sent to it is retried on the other node once the early liveness
    check (after 1 s of quiet) got no answer in its 1 s, without waiting for a second,
    regular check (3 s at least) or the 5 s TTFB floor."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=5.0, outlier_stream_ttfb_min_s=5.0,
                                      read_timeout_ms=15000))
    for _ in range(4):
        assert _stream(edge)[0] == 200
    a.mode = "frozen"
    try:
        landed = _stream_until_on(edge, a, b, node_is="b")
        assert landed is not None, "no stream was sent to the frozen node"
        took = landed[0]
        # quiet 1 s, the early check's 1 s, the relay's next look (WATCH_S); a second
        # check would add its 3 s
        assert took < 4.0, f"the stream waited {took:.1f} s on the frozen node"
        assert "no answer to a liveness check" in edge.error_log()
    finally:
        a.mode = "ok"
        a.release()


def test_a_stream_whose_node_froze_after_its_headers_moves_on_after_the_early_check(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """llama-server sends a stream's 200 and headers before its prefill: a node frozen
    then (GETs hang too) has the stream continued on the other node once the early
    liveness check got no answer, not after the leg's read bound before content (twice
    the 5 s TTFB floor here); no content came, so the client gets the other node's whole
    answer in one stream."""
    a, b = tiny_upstreams(names=["a", "b"])
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                                      outlier_ttfb_min_s=5.0, outlier_stream_ttfb_min_s=5.0,
                                      read_timeout_ms=15000))
    for _ in range(4):
        assert _stream(edge)[0] == 200
    a.mode = "stall_frozen"
    try:
        landed = _stream_until_on(edge, a, b)
        assert landed is not None, "no stream was sent to the frozen node"
        took, on_b = landed
        assert on_b == 1                   # continued on b
        # quiet 1 s after the headers, the early check's 1 s, the relay's next look
        assert took < 4.0, f"the stream waited {took:.1f} s on the frozen node"
    finally:
        a.mode = "ok"
        a.release()


def test_a_long_prefill_after_the_head_is_waited_on_while_the_node_answers_its_checks(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """A stream whose node sent its head and then prefills for longer than the leg's
    bound before content (twice the first-byte bound, 2 s here) is not redone on the other
    node while the node answers its liveness checks: it is answered by its own node, as
    through nginx, and the other node gets nothing."""
    a, b = tiny_upstreams(names=["a", "b"])
    s = edge_settings(redis_server.url, [a.node_settings(), b.node_settings()],
                      outlier_ttfb_min_s=0.5, outlier_stream_ttfb_min_s=0.5, stall_min_s=0.5,
                      read_timeout_ms=15000)
    s.edge.stall_first_byte_s = 2.0
    edge = edge_factory(s)
    for _ in range(4):
        assert _stream(edge)[0] == 200
    a.head_first_s = 5.0
    landed = _stream_until_on(edge, a, b, timeout=30)
    assert landed is not None, "no stream was sent to a"
    took, on_b = landed
    assert on_b == 0, "redone on b while a prefilled"
    assert took >= 5.0 and a.gets > 0, (took, a.gets)   # a's own answer, after checks
