"""Integration tests of ``infergate simnode``: real processes on free loopback ports,
real HTTP (requests, raw sockets and the openai client)."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from controlplane import procs
from controlplane.simnode import launch

pytestmark = pytest.mark.integration

TIME_SCALE = 0.05
# The main node: 4 slots, slow prefill so time to first token is measurable.
MAIN_ARGS = ["--max-running", "4", "--prefill-tps", "400", "--time-scale", str(TIME_SCALE)]


class Node(launch.SimNodeProcess):
    """A node under test (see :class:`controlplane.simnode.launch.SimNodeProcess`)."""

    @property
    def control(self) -> str:
        return self.control_url

    def faults(self, **kw) -> dict:
        r = requests.post(f"{self.control}/_sim/faults", json=kw, timeout=5)
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self, content: str = "hello", **extra) -> requests.Response:
        body = {"model": "sim-llama", "messages": [{"role": "user", "content": content}], **extra}
        return requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=30,
                             stream=bool(extra.get("stream")))

    def metrics(self) -> dict:
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        return {f.name: f for f in text_string_to_metric_families(text)}


def start_nodes(logdir: Path, specs: list[tuple[str, list[str]]]) -> list[Node]:
    """Start several nodes at once, then wait for each (deadline, no fixed sleep); each
    has printed its "listening on" line by then."""
    nodes = launch.start_nodes(specs, logdir, cls=Node)
    try:
        for n in nodes:
            procs.wait_until(lambda n=n: "listening on" in n.managed.log_tail(), 5,
                             what=f"{n.name} to print its listening line")
    except Exception:
        launch.stop_nodes(nodes)
        raise
    return nodes


@pytest.fixture(scope="module")
def logdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="infergate-simnode-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def main_node(logdir) -> Iterator[Node]:
    (node,) = start_nodes(logdir, [("sim-main", MAIN_ARGS)])
    try:
        yield node
    finally:
        node.managed.stop()
        assert not node.managed.alive()


@pytest.fixture
def node(main_node) -> Node:
    """The main node with no faults and zeroed counters."""
    requests.post(f"{main_node.control}/_sim/faults", timeout=5, json={
        "error_rate": 0, "error_status": 500, "hang": False, "stall": False, "slowdown": 1, "metrics_fail": False,
        "health_fail": False, "refuse": False, "garbage": False})
    procs.wait_until(lambda: procs.port_open("127.0.0.1", main_node.port), 5, what="main port")
    procs.wait_until(lambda: main_node.state()["running"] + main_node.state()["waiting"] == 0, 10,
                     what="idle node")
    requests.post(f"{main_node.control}/_sim/reset", timeout=5)
    return main_node


def raw_request(port: int, path: str, body: dict) -> socket.socket:
    """Send one HTTP request on a fresh socket and return the socket unread."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def sse_events(resp: requests.Response) -> list:
    """``data:`` payloads of an SSE response (JSON objects, and the string "[DONE]")."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == b"", line
    return out


# -- OpenAI API -----------------------------------------------------------------------

def test_chat_non_streaming(node):
    r = node.chat("hello there", sim_output_tokens=7)
    assert r.status_code == 200 and r.headers["X-Sim-Node"] == "sim-main"
    b = r.json()
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion"
    assert b["model"] == "sim-llama" and isinstance(b["created"], int)
    assert b["system_fingerprint"] == "sim-main"
    (choice,) = b["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant" and "sim-main" not in choice["message"]["content"]
    assert b["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    again = node.chat("hello there", sim_output_tokens=7).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
    cut = node.chat("hello there", sim_output_tokens=7, max_tokens=3).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 3
    assert choice["message"]["content"].startswith(cut["choices"][0]["message"]["content"])
    st = node.state()
    assert st["requests_total"] == 3 and st["completed_total"] == 3
    assert st["by_path"]["/v1/chat/completions"] == 3


def test_chat_streaming_with_usage(node):
    full = node.chat("stream me", sim_output_tokens=6).json()["choices"][0]["message"]["content"]
    r = node.chat("stream me", sim_output_tokens=6, stream=True,
                  stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["X-Sim-Node"] == "sim-main"
    ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == full
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completions_streaming_and_not(node):
    body = {"model": "sim-llama", "prompt": "Once upon", "sim_output_tokens": 5, "max_tokens": 4}
    r = requests.post(f"{node.url}/v1/completions", json=body, timeout=30)
    b = r.json()
    assert b["id"].startswith("cmpl-") and b["object"] == "text_completion"
    assert b["choices"][0]["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 4
    r = requests.post(f"{node.url}/v1/completions", json={**body, "stream": True}, timeout=30,
                      stream=True)
    ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == b["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client(node):
    from openai import OpenAI

    client = OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["sim-llama"]
    res = client.chat.completions.create(model="sim-llama", max_tokens=5,
                                         messages=[{"role": "user", "content": "hi sdk"}])
    assert res.choices[0].finish_reason in ("length", "stop") and res.usage.completion_tokens <= 5
    assert res.system_fingerprint == "sim-main"
    stream = client.chat.completions.create(
        model="sim-llama", max_tokens=5, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi sdk"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == res.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    comp = client.completions.create(model="sim-llama", prompt="abc", max_tokens=3)
    assert comp.usage.completion_tokens == 3 and comp.choices[0].finish_reason == "length"


def test_models_health_version(node):
    m = requests.get(f"{node.url}/v1/models", timeout=5)
    assert m.headers["X-Sim-Node"] == "sim-main"
    b = m.json()
    assert b["object"] == "list" and b["data"][0]["id"] == "sim-llama"
    assert b["data"][0]["object"] == "model"
    h = requests.get(f"{node.url}/health", timeout=5)
    assert h.status_code == 200 and h.content == b""
    assert "simnode" in requests.get(f"{node.url}/version", timeout=5).json()["version"]


@pytest.mark.parametrize("path,body,status,code", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b'{"model": "sim-llama"}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-x"}',
     404, "model_not_found"),
    ("/v1/completions", b'{"model": "sim-llama"}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "sim_output_tokens": 100000}', 400, None),
])
def test_bad_input(node, path, body, status, code):
    r = requests.post(node.url + path, data=body, timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["code"] == code
    assert node.state()["errors_total"] == 1


def test_unknown_route_and_method(node):
    r = requests.get(f"{node.url}/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()
    assert requests.get(f"{node.url}/v1/chat/completions", timeout=5).status_code == 405


# -- performance model ----------------------------------------------------------------

def test_time_to_first_token_follows_prefill(node):
    """2000 prompt tokens at 400 tokens/s = 5 simulated s of prefill = 0.25 s wall at
    time scale 0.05; nothing (not even headers) arrives before that."""
    prompt = "x" * 8000
    t0 = time.monotonic()
    r = node.chat(prompt, sim_output_tokens=20, stream=True)
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    ttft = time.monotonic() - t0
    for _ in lines:
        pass
    total = time.monotonic() - t0
    assert b'"role":"assistant"' in first
    assert ttft >= 5.0 * TIME_SCALE
    # then 19 more decode steps of at least 21 simulated ms each (counted from the start:
    # a client late to read its first line finds the next ones already there)
    assert total >= (5.0 + 19 * 0.021) * TIME_SCALE


def test_queueing_beyond_max_running(node):
    """8 requests on 4 slots: 4 run, 4 wait (seen in /_sim/state and /metrics)."""
    def call(i: int) -> int:
        return node.chat(f"queue {i}", sim_output_tokens=300).status_code

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(call, i) for i in range(8)]
        procs.wait_until(lambda: node.state()["waiting"] > 0, 20, what="waiting > 0")
        st = node.state()
        assert st["running"] == 4 and st["running"] + st["waiting"] <= 8
        assert st["kv_used_tokens"] > 0

        def gauge_waiting() -> bool:
            fams = node.metrics()
            return fams["vllm:num_requests_waiting"].samples[0].value > 0

        procs.wait_until(gauge_waiting, 20, what="vllm:num_requests_waiting > 0")
        assert [f.result() for f in futs] == [200] * 8
    st = node.state()
    assert st["completed_total"] == 8 and st["running"] == st["waiting"] == 0


def test_metrics_count_requests_and_reset(node):
    node.chat("count me", sim_output_tokens=4)
    node.chat("count me too", sim_output_tokens=4, max_tokens=2)
    fams = node.metrics()

    def total(name: str, **labels) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith(("_total", "_count"))
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert total("vllm:request_success", finished_reason="stop") == 1
    assert total("vllm:request_success", finished_reason="length") == 1
    assert total("vllm:generation_tokens") == 6
    assert total("vllm:prompt_tokens") == 2 + 3
    assert total("vllm:e2e_request_latency_seconds") == 2
    assert total("vllm:time_to_first_token_seconds") == 2
    assert total("vllm:inter_token_latency_seconds") == 4
    assert fams["vllm:kv_cache_usage_perc"].samples[0].labels == {"model_name": "sim-llama",
                                                                   "engine": "0"}
    requests.post(f"{node.url}/_sim/reset", timeout=5).raise_for_status()
    fams = node.metrics()
    assert total("vllm:request_success") == 0 and total("vllm:generation_tokens") == 0
    assert node.state()["requests_total"] == 0


def test_prefix_cache_hits_on_a_repeated_long_chat(node):
    """The second of two identical long chats finds its full prompt blocks in the prefix
    cache: usage reports them, /metrics and /_sim/state count them, reset clears them."""
    system = "You are a terse assistant that answers questions about load balancers. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why?"}]

    def ask(**extra) -> dict:
        r = requests.post(f"{node.url}/v1/chat/completions", timeout=30, json={
            "model": "sim-llama", "messages": messages, "sim_output_tokens": 3, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def counters() -> tuple[float, float]:
        fams = node.metrics()
        return tuple(sum(s.value for s in fams[name].samples if s.name == f"{name}_total")
                     for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))

    first = ask()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert counters() == (first["prompt_tokens"], 0)
    second = ask()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % 16 == 0
    assert counters() == (2 * first["prompt_tokens"], cached)
    st = node.state()["prefix_cache"]
    assert st["queries_tokens"] == 2 * first["prompt_tokens"] and st["hits_tokens"] == cached
    assert st["cached_blocks"] >= cached // 16
    stream = requests.post(f"{node.url}/v1/chat/completions", timeout=30, stream=True, json={
        "model": "sim-llama", "messages": messages, "sim_output_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    usage = sse_events(stream)[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
    requests.post(f"{node.control}/_sim/reset", timeout=5).raise_for_status()
    assert node.state()["prefix_cache"] == {"queries_tokens": 0, "hits_tokens": 0,
                                            "cached_blocks": 0}
    assert counters() == (0, 0)
    assert ask()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


# -- cancellation ---------------------------------------------------------------------

def test_cancel_running_request_on_disconnect(node):
    s = raw_request(node.port, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "long"}], "sim_output_tokens": 20000,
                     "max_tokens": 5000})
    procs.wait_until(lambda: node.state()["running"] == 1, 10, what="running request")
    assert node.state()["kv_used_tokens"] > 0
    s.close()
    procs.wait_until(lambda: node.state()["cancelled_total"] == 1, 10, what="cancelled_total")
    st = node.state()
    assert st["running"] == 0 and st["kv_used_tokens"] == 0 and st["completed_total"] == 0


def test_cancel_streaming_and_queued_requests(node):
    body = {"messages": [{"role": "user", "content": "s"}], "sim_output_tokens": 3000,
            "stream": True}
    socks = [raw_request(node.port, "/v1/chat/completions", body) for _ in range(5)]
    procs.wait_until(lambda: node.state()["waiting"] == 1, 10, what="one queued request")
    assert socks[0].recv(200).startswith(b"HTTP/1.1 200")  # the stream is flowing
    socks[4].close()  # the queued one
    procs.wait_until(lambda: node.state()["cancelled_total"] == 1, 10, what="queued cancel")
    assert node.state()["waiting"] == 0 and node.state()["running"] == 4
    for s in socks[:4]:
        s.close()
    procs.wait_until(lambda: node.state()["cancelled_total"] == 5, 10, what="all cancelled")
    st = node.state()
    assert st["running"] == 0 and st["kv_used_tokens"] == 0


# -- faults ---------------------------------------------------------------------------

def test_fault_error_rate(node):
    node.faults(error_rate=1.0, error_status=503)
    r = node.chat("x")
    assert r.status_code == 503 and r.headers["X-Sim-Node"] == "sim-main"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    node.faults(error_rate=0.0)
    assert node.chat("x", sim_output_tokens=1).status_code == 200
    assert node.state()["errors_total"] == 1


def _silent_until_closed(node, s: socket.socket, cancelled: int) -> None:
    """Nothing (more) arrives on ``s`` for 0.5 s; closing it cancels the request."""
    s.settimeout(0.5)
    with pytest.raises(socket.timeout):
        s.recv(100)
    s.close()
    procs.wait_until(lambda: node.state()["cancelled_total"] == cancelled, 10, what="cancel")
    assert node.state()["completed_total"] == 0


def test_fault_hang_holds_until_client_leaves(node):
    node.faults(hang=True)
    s = raw_request(node.port, "/v1/completions", {"prompt": "x", "sim_output_tokens": 1})
    _silent_until_closed(node, s, 1)


def test_fault_stall_sends_stream_headers_then_nothing(node):
    node.faults(stall=True)
    s = raw_request(node.port, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "stream": True})
    s.settimeout(5)
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1000)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    _silent_until_closed(node, s, 1)          # no chunk
    # a request that does not stream gets nothing at all
    s = raw_request(node.port, "/v1/completions", {"prompt": "x", "sim_output_tokens": 1})
    _silent_until_closed(node, s, 2)


def test_fault_slowdown(node):
    node.faults(slowdown=8)
    t0 = time.monotonic()
    assert node.chat("slow", sim_output_tokens=40).status_code == 200
    # 40 steps of >= 21 simulated ms, x time scale, x 8
    assert time.monotonic() - t0 >= 40 * 0.021 * TIME_SCALE * 8


def test_fault_metrics_and_health(node):
    node.faults(metrics_fail=True, health_fail=True)
    assert requests.get(f"{node.url}/metrics", timeout=5).status_code == 500
    h = requests.get(f"{node.url}/health", timeout=5)
    assert h.status_code == 503 and h.headers["X-Sim-Node"] == "sim-main"
    node.faults(metrics_fail=False, health_fail=False)
    assert requests.get(f"{node.url}/metrics", timeout=5).status_code == 200
    assert requests.get(f"{node.url}/health", timeout=5).status_code == 200


def test_fault_refuse_and_back(node):
    # Set through the main port itself: the answer still arrives.
    r = requests.post(f"{node.url}/_sim/faults", json={"refuse": True}, timeout=5)
    assert r.status_code == 200 and r.json()["refuse"] is True
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", node.port), timeout=2).close()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{node.url}/health", timeout=2)
    st = node.state()  # control port still answers
    assert st["listening"] is False
    node.faults(refuse=False)
    procs.wait_until(lambda: procs.port_open("127.0.0.1", node.port), 5, what="listening again")
    assert node.chat("back", sim_output_tokens=1).status_code == 200


def test_fault_garbage(node):
    node.faults(garbage=True)
    s = raw_request(node.port, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}]})
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    s.close()
    assert data and not data.startswith(b"HTTP/")
    with pytest.raises(requests.ConnectionError):
        node.chat("x")
    assert node.state()["errors_total"] == 2


def test_bad_fault_updates(node):
    for body in (b"{", b'{"error_rate": 3}', b'{"unknown": true}', b"[]"):
        r = requests.post(f"{node.control}/_sim/faults", data=body, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert requests.get(f"{node.control}/_sim/faults", timeout=5).json()["error_rate"] == 0.0


# -- dialects and engines -------------------------------------------------------------

DIALECT_NAMES = {
    "vllm-legacy": {"vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:gpu_cache_usage_perc", "vllm:e2e_request_latency_seconds",
                    "vllm:time_to_first_token_seconds"},
    "tgi": {"tgi_queue_size", "tgi_batch_current_size", "tgi_request_duration"},
    "sglang": {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
               "sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds"},
}


@pytest.fixture(scope="module")
def other_nodes(logdir) -> Iterator[dict[str, Node]]:
    specs = [(d, ["--dialect", d, "--time-scale", str(TIME_SCALE)])
             for d in ("vllm-legacy", "tgi", "sglang", "json", "none")]
    specs.append(("engines2", ["--engines", "2", "--time-scale", str(TIME_SCALE)]))
    specs.append(("faulty", ["--health-fail", "--error-rate", "1", "--error-status", "429"]))
    specs.append(("refusing", ["--refuse"]))
    nodes = start_nodes(logdir, specs)
    try:
        yield {spec[0]: n for spec, n in zip(specs, nodes)}
    finally:
        for n in nodes:
            n.managed.stop()


def test_dialects(other_nodes, main_node):
    vllm = main_node.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success"):
        assert name in vllm, name
    assert "vllm:gpu_cache_usage_perc" not in vllm
    for dialect, names in DIALECT_NAMES.items():
        n = other_nodes[dialect]
        assert n.chat("d", sim_output_tokens=2).status_code == 200
        fams = n.metrics()
        assert names <= set(fams), (dialect, names - set(fams))
    js = requests.get(f"{other_nodes['json'].url}/metrics", timeout=5).json()
    assert set(js) == {"queue_depth", "avg_latency_seconds", "gpu_memory_utilization"}
    assert requests.get(f"{other_nodes['none'].url}/metrics", timeout=5).status_code == 404
    assert requests.get(f"{other_nodes['none'].url}/health", timeout=5).status_code == 200


def test_same_prompt_same_content_across_nodes(other_nodes, main_node):
    a = main_node.chat("cache me", max_tokens=30).json()
    b = other_nodes["tgi"].chat("cache me", max_tokens=30).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert (a["system_fingerprint"], b["system_fingerprint"]) == ("sim-main", "tgi")


def test_engines_split_load(other_nodes):
    n = other_nodes["engines2"]
    for i in range(4):
        assert n.chat(f"e{i}", sim_output_tokens=2).status_code == 200
    fams = n.metrics()
    running = {s.labels["engine"] for s in fams["vllm:num_requests_running"].samples}
    assert running == {"0", "1"}
    per_engine = {s.labels["engine"]: s.value for s in fams["vllm:request_success"].samples
                  if s.name.endswith("_total") and s.labels["finished_reason"] == "stop"}
    assert per_engine == {"0": 2.0, "1": 2.0}
    assert len(n.state()["engines"]) == 2


def test_faults_from_flags(other_nodes):
    faulty = other_nodes["faulty"]
    assert requests.get(f"{faulty.url}/health", timeout=5).status_code == 503
    r = faulty.chat("x")
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    refusing = other_nodes["refusing"]
    assert not procs.port_open("127.0.0.1", refusing.port)
    assert refusing.state()["listening"] is False
    refusing.faults(refuse=False)
    procs.wait_until(lambda: procs.port_open("127.0.0.1", refusing.port), 5, what="listening")
    assert refusing.chat("x", sim_output_tokens=1).status_code == 200


# -- command line (usage errors: tests/unit/test_simnode_cli.py) -----------------------

def test_refuse_needs_a_control_port(logdir):
    # Without --control-port nothing could turn `refuse` off again: the API refuses it.
    node = launch.start_node("sim-noctl", logdir, control=False)
    try:
        assert node.control_url == node.url
        r = requests.post(f"{node.url}/_sim/faults", json={"refuse": True}, timeout=5)
        assert r.status_code == 400 and "control-port" in r.json()["error"]["message"]
        assert requests.get(f"{node.url}/_sim/faults", timeout=5).json()["refuse"] is False
    finally:
        node.stop()
