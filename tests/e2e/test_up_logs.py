"""``infergate up --log-max-mb``: a flood of refused requests fills nginx's access log past
its cap; the stack keeps its last lines in ``access.log.1`` and nginx, which appends,
writes on at the start of the emptied file (no hole of zero bytes, no restart)."""

from __future__ import annotations

from pathlib import Path

import requests

from controlplane import procs
from support.upstack import NO_CACHE, UpStack, first_answer


def test_a_flood_keeps_the_access_log_under_its_cap(workdir: Path) -> None:
    up = UpStack.start(workdir / "up", NO_CACHE, "--log-max-mb", "1")
    try:
        assert up.proc.poll() is None, up.text()
        first_answer(up)
        log = workdir / "up" / "stack" / "nginx" / "logs" / "access.log"
        old = log.with_name("access.log.1")
        s = requests.Session()
        padding = "x" * 900          # the request line is logged: ~1 KB a request

        def flood() -> bool:
            for _ in range(200):     # no key: 401 each
                res = s.get(f"{up.base}/v1/models?{padding}", timeout=5)
                assert res.status_code == 401, res.text
            return old.exists()

        procs.wait_until(flood, timeout=120, what="access.log cut at its cap")
        procs.wait_until(lambda: log.stat().st_size < 2**20, timeout=30,
                         what="access.log emptied")
        assert 0 < old.stat().st_size <= 2**20 // 4
        assert b"\0" not in old.read_bytes()
        res = up.post_chat("after the cut")
        assert res.status_code == 200, res.text
        procs.wait_until(lambda: b"after the cut" in log.read_bytes()
                         or b"/v1/chat/completions" in log.read_bytes(),
                         timeout=10, what="nginx writing on")
        data = log.read_bytes()
        assert not data.startswith(b"\0"), "appending: no hole where the old content was"
        assert up.proc.poll() is None
        assert "reached" in up.text() and "access.log.1" in up.text()
    finally:
        rc = up.stop()
    assert rc == 0
