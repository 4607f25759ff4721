"""Pure parts of bench/admission: classification of answers and the run summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.admission.loadgen import Result, classify  # noqa: E402
from bench.admission.summary import summarise  # noqa: E402


def test_classify() -> None:
    ok = json.dumps({"choices": [{"message": {"content": "x"}}]}).encode()
    shed = json.dumps({"error": {"type": "server_overloaded", "code": "nodes_saturated"}}).encode()
    limited = json.dumps({"error": {"type": "requests", "code": "rate_limit_exceeded"}}).encode()
    assert classify(200, ok) == ("ok", None)
    assert classify(200, b"{}")[0] == "error"
    assert classify(429, shed) == ("shed", None)
    assert classify(429, limited)[0] == "error"  # a rate limit is not shedding
    assert classify(504, b'{"error": {"code": "deadline_exceeded"}}')[0] == "timeout"
    assert classify(503, b"not json") == ("error", "HTTP 503: not json")


def test_summarise() -> None:
    rs = ([Result(i, "ok", 1.0 + i / 100) for i in range(90)]
          + [Result(100 + i, "shed", 0.5) for i in range(8)]
          + [Result(200, "timeout", 7.5), Result(201, "error", 0.1, 503, error="HTTP 503: x")])
    s = summarise(rs, wall_s=10.0, deadline_s=7.5)
    assert (s["requests"], s["ok"], s["shed"], s["timeouts"], s["errors"]) == (100, 90, 8, 1, 1)
    assert s["admitted"] == 92 and s["timeout_rate"] == 0.01 and s["shed_rate"] == 0.08
    assert s["goodput_rps"] == 9.0 and s["shed_p99_s"] == 0.5
    assert s["max_s"] == 7.5 and s["p99_s"] < 7.5 and s["p99_under_deadline"]
    assert s["error_samples"] == ["HTTP 503: x"]
    empty = summarise([], wall_s=1.0, deadline_s=1.0)
    assert empty["requests"] == 0 and empty["p99_s"] is None and not empty["p99_under_deadline"]
    with pytest.raises(ValueError):
        summarise(rs, wall_s=0, deadline_s=1)
