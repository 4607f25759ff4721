"""The size cap on ``infergate up``'s log files (controlplane/cli/up/logs.py): a file past
its cap keeps its last whole lines in ``<name>.1`` and starts again empty (a running
nginx writing on at the start: tests/e2e/test_up_logs.py)."""

from __future__ import annotations

from pathlib import Path

from controlplane.cli.up.logs import CHECK_EVERY_S, LogCap


def test_a_file_past_its_cap_keeps_its_last_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_bytes(b"".join(b"line %05d\n" % i for i in range(1000)))   # 11,000 bytes
    small = tmp_path / "error.log"
    small.write_bytes(b"quiet\n")
    said: list[str] = []
    cap = LogCap([tmp_path], 4000, said.append)
    assert cap.tick(100.0) == [log]
    assert log.stat().st_size == 0
    kept = (tmp_path / "access.log.1").read_bytes()
    assert kept.endswith(b"line 00999\n") and kept.startswith(b"line ")
    assert 0 < len(kept) <= 1000 and len(kept) % 11 == 0, "whole lines only"
    assert small.read_bytes() == b"quiet\n"
    assert len(said) == 1 and "access.log" in said[0]
    log.write_bytes(b"x" * 5000)
    assert cap.tick(100.0 + CHECK_EVERY_S / 2) == [], "looks again only every few seconds"
    assert cap.tick(100.0 + CHECK_EVERY_S) == [log]
    assert len(said) == 1, "said once per file"
    assert LogCap([tmp_path], 0, said.append).tick(1e9) == [], "0: no cap"


def test_the_stack_s_own_redis_logs_are_capped_too(tmp_path: Path) -> None:
    """The stack's own Redis logs to ``redis/redis-<port>.log`` and its Redis Cluster to
    ``redis-cluster/node<i>/redis-<port>.log``: both are under the cap, as said."""
    from controlplane.cli.up.logs import log_dirs
    for d in ("logs", "nginx/logs", "redis", "redis-cluster/node0", "redis-cluster/node1"):
        (tmp_path / d).mkdir(parents=True)
    big = [tmp_path / "redis" / "redis-6000.log",
           tmp_path / "redis-cluster" / "node1" / "redis-6001.log"]
    for log in big:
        log.write_bytes(b"x\n" * 3000)
    cap = LogCap(log_dirs(tmp_path), 4000, lambda _line: None)
    assert sorted(cap.tick(100.0)) == sorted(big)
