"""``infergate up``'s plan: settings it sets unless the user's file does (no part started)."""

from __future__ import annotations

from controlplane import procs
from controlplane.cli.up.plan import SHUTDOWN_STREAM_S, make_plan


def _plan(monkeypatch, config: str | None):
    monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    monkeypatch.setenv(procs.INSTANCE_ENV, "test")  # make_plan exports its own; restored after
    return make_plan(config, (), "vllm", None, None, f"127.0.0.1:{procs.free_port()}",
                     f"127.0.0.1:{procs.free_port()}", None, 1.0, False, None)


def test_streams_end_with_an_error_event_within_ups_shutdown(monkeypatch, tmp_path) -> None:
    assert _plan(monkeypatch, None).settings.edge.shutdown_stream_s == SHUTDOWN_STREAM_S
    own = tmp_path / "infergate.toml"
    own.write_text("[edge]\nshutdown_stream_s = 0\n", encoding="utf-8")
    assert _plan(monkeypatch, str(own)).settings.edge.shutdown_stream_s == 0
