"""The scheduler benchmark's PNG report (matplotlib, which may run fc-list on its first
import: not a unit test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scheduler import report, stack  # noqa: E402


def test_report_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    recs = [{"offered_rps": 10.0, "sent_rps": 10.2, "p50_s": 1.0, "p99_s": 3.0,
             "ttft_p99_s": 0.5, "timeout_rate": 0.015, "error_rate": 0.0,
             "goodput_rps": 9.9 - f, "imbalance": 0.1, "scenario": sc, "strategy": s,
             "load_fraction": f}
            for sc, f in (("steady", 0.5), ("steady", 1.2), ("node_hang", 0.8))
            for s in stack.STRATEGIES]
    png = report.plot(recs, tmp_path / "s.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 1000
