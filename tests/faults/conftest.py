"""Fault drills: a small, steady load through real edges while something breaks.

The stack fixtures (redis_server, simnodes, tiny_upstreams, edge_factory,
controlplane_factory, workdir, output_dir) come from tests/conftest.py and
tests/support/. This file adds :class:`LoadLoop`: one thread sending requests
at a fixed rate (bounded: one request at a time, never more than ``rate_per_s``),
recording every answer with the phase it was sent in, and :class:`LoadReport`, the
printed and saved summary every drill asserts its bound on.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests


@dataclass
class Result:
    """One request of the load: ``status`` is the HTTP status, or ``"error:<Type>"``."""

    t: float
    phase: str
    edge: str
    status: int | str
    cache: str | None = None
    node: str | None = None


@dataclass
class LoadReport:
    """What a load loop saw, overall and per phase."""

    name: str
    results: list[Result] = field(default_factory=list)

    def by_status(self, phase: str | None = None) -> Counter:
        return Counter(str(r.status) for r in self.results if phase is None or r.phase == phase)

    @property
    def sent(self) -> int:
        return len(self.results)

    def ok_ratio(self, phase: str | None = None) -> float:
        rs = [r for r in self.results if phase is None or r.phase == phase]
        return sum(1 for r in rs if r.status == 200) / len(rs) if rs else 0.0

    def summary(self) -> dict:
        phases = list(dict.fromkeys(r.phase for r in self.results))
        return {
            "drill": self.name,
            "sent": self.sent,
            "answered_200": sum(1 for r in self.results if r.status == 200),
            "by_status": dict(self.by_status()),
            "phases": {p: {"sent": sum(1 for r in self.results if r.phase == p),
                           "by_status": dict(self.by_status(p))} for p in phases},
        }

    def report(self, out_dir: Path | None = None, **extra: Any) -> dict:
        """Print the summary plus ``extra`` figures (and write them to
        ``out_dir/drill.json``); return it."""
        s = {**self.summary(), **extra}
        print(f"\n[drill] {s['drill']}: sent {s['sent']}, answered 200: {s['answered_200']}, "
              f"by status {s['by_status']}")
        for p, v in s["phases"].items():
            print(f"[drill]   {p}: sent {v['sent']}, by status {v['by_status']}")
        for k, v in extra.items():
            print(f"[drill]   {k}: {v}")
        if out_dir is not None:
            (out_dir / "drill.json").write_text(json.dumps(s, indent=2))
        return s


class LoadLoop:
    """Sends ``body_fn(i)`` as JSON to ``/v1/chat/completions`` of the edges in turn, at
    most ``rate_per_s`` requests per second, one at a time, until :meth:`stop`.
    :meth:`phase` labels the requests sent from now on. ``headers`` go with every
    request (e.g. ``{"Authorization": "Bearer ig-..."}``)."""

    def __init__(self, name: str, edges: list[Any], rate_per_s: float = 8.0,
                 body_fn: Callable[[int], dict] | None = None, timeout_s: float = 10.0,
                 headers: dict[str, str] | None = None) -> None:
        self.edges = edges
        self.headers = dict(headers or {})
        self.interval = 1.0 / rate_per_s
        self.body_fn = body_fn or (lambda i: {
            "model": "sim-llama", "sim_output_tokens": 4,
            "messages": [{"role": "user", "content": f"drill request {i}"}]})
        self.timeout_s = timeout_s
        self.report = LoadReport(name)
        self._phase = "before"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name

    def count(self, phase: str) -> int:
        with self._lock:
            return sum(1 for r in self.report.results if r.phase == phase)

    def wait_sent(self, n: int, phase: str | None = None, timeout: float = 30.0) -> None:
        """Block until ``n`` requests of ``phase`` (default: the current one) were answered."""
        phase = phase or self._phase
        deadline = time.monotonic() + timeout
        while self.count(phase) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"load loop sent fewer than {n} requests in phase {phase}")
            time.sleep(0.02)

    def _run(self) -> None:
        sessions = {id(e): requests.Session() for e in self.edges}
        edges = itertools.cycle(self.edges)
        next_at = time.monotonic()
        for i in itertools.count():
            if self._stop.is_set():
                break
            edge = next(edges)
            with self._lock:
                phase = self._phase
            t = time.monotonic()
            try:
                res = sessions[id(edge)].post(edge.url + "/v1/chat/completions", json=self.body_fn(i),
                                              headers=self.headers, timeout=self.timeout_s)
                r = Result(t, phase, edge.url, res.status_code, res.headers.get("X-Cache-Status"),
                           res.headers.get("X-Infergate-Node"))
            except requests.RequestException as exc:
                sessions[id(edge)] = requests.Session()
                r = Result(t, phase, edge.url, f"error:{type(exc).__name__}")
            with self._lock:
                self.report.results.append(r)
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_at = time.monotonic()

    def start(self) -> "LoadLoop":
        self._thread = threading.Thread(target=self._run, name="drill-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> LoadReport:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
        return self.report


@pytest.fixture
def load_loop() -> Iterator[Callable[..., LoadLoop]]:
    """Factory: ``load_loop(name, [edge, ...], rate_per_s=8, body_fn=None, headers=None)`` -> a started
    :class:`LoadLoop`; every loop is stopped at teardown."""
    loops: list[LoadLoop] = []

    def make(name: str, edges: list[Any], **kw: Any) -> LoadLoop:
        loop = LoadLoop(name, edges, **kw).start()
        loops.append(loop)
        return loop

    try:
        yield make
    finally:
        for loop in loops:
            loop.stop()
