"""A huge or slow /metrics page marks only its own node: the page is capped at
``controlplane.max_metrics_bytes`` and parsed in the node's own poll worker within the
poll's deadline, so another node's poll result is ready at its usual time and the poll
cycle does not wait for the parse (real HTTP servers on free loopback ports)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controlplane.config import NodeSettings, Settings
from controlplane.routing.poller import Poller

SMALL_PAGE = ('vllm:num_requests_running{model_name="m"} 1\n'
              'vllm:num_requests_waiting{model_name="m"} 0\n'
              'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n').encode()


def huge_page(series: int) -> bytes:
    """``series`` valid series of one gauge (~51 bytes each), then the usual three."""
    lines = [f'vllm:num_requests_running{{model_name="m",replica="r{i:06d}"}} 1\n'
             for i in range(series)]
    return "".join(lines).encode() + SMALL_PAGE


class MetricsServer:
    """``/health`` 200 and ``/metrics`` answering ``page``."""

    def __init__(self, page: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = page if self.path == "/metrics" else b"ok"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def node(self, name: str) -> NodeSettings:
        return NodeSettings(name=name, url=f"http://127.0.0.1:{self.server.server_address[1]}",
                            kind="vllm")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[MetricsServer, MetricsServer]]:
    big = MetricsServer(huge_page(120_000))
    small = MetricsServer(SMALL_PAGE)
    try:
        yield big, small
    finally:
        big.stop()
        small.stop()


def test_a_6mb_metrics_page_marks_only_its_node(servers) -> None:
    big, small = servers
    assert len(huge_page(120_000)) > 6_000_000
    p = Poller(timeout_s=0.8)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            res = p.poll_all([big.node("big"), small.node("small")])
            cycle_s = time.monotonic() - t0
            assert res["small"].good and res["small"].reading is not None
            assert res["small"].reading.running == 1.0
            assert res["small"].poll_ms < 500, res["small"]
            assert not res["big"].good and "larger than 1048576 bytes" in res["big"].error
            # the page is cut at the cap and never parsed: the cycle is not held (a guard;
            # parsing the whole page took seconds)
            assert cycle_s < 1.5, cycle_s
    finally:
        p.close()


def test_parsing_a_page_under_the_cap_is_time_boxed(servers) -> None:
    """With a cap that lets the 6 MB page in, its parse is given up at the poll's
    deadline in its own worker; the other node's result is unaffected."""
    big, small = servers
    p = Poller(timeout_s=0.3, max_metrics_bytes=8 * 1024 * 1024)
    try:
        t0 = time.monotonic()
        res = p.poll_all([big.node("big"), small.node("small")])
        cycle_s = time.monotonic() - t0
        assert res["small"].good and res["small"].reading is not None
        assert res["small"].poll_ms < 250, res["small"]
        assert not res["big"].good and "time box" in res["big"].error, res["big"].error
        assert cycle_s < 2 * 0.3 + 0.5 + 0.5, cycle_s  # the poller's own wait bound, a guard
    finally:
        p.close()


def test_max_metrics_bytes_has_bounds() -> None:
    assert Settings().controlplane.max_metrics_bytes == 1024 * 1024
    with pytest.raises(ValueError):
        Settings.model_validate({"controlplane": {"max_metrics_bytes": 100}})
    with pytest.raises(ValueError):
        Settings.model_validate({"controlplane": {"max_metrics_bytes": 64 * 1024 * 1024}})
