"""`infergate up` and its embedder's port: an embedder killed with SIGKILL (its model
worker processes left to exit on their own) comes back on its own port; when another
process takes the port, the edge stops sending prompts there at once (semantic cache
off), the embedder comes back on a free port, and only once it answers with this stack's
instance id does the edge look up there again."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import requests

from controlplane import procs
from support.upstack import UpStack, alive, children


def _refuses_without_the_token(base: str) -> bool:
    """The embedder at ``base`` answers its API only with this stack's token (``up`` sets a
    random one): without it, 401 on lookups, index writes and embeddings."""
    for path, body in (("/v1/embeddings", {"input": "hi"}),
                       ("/v1/lookup", {"namespace": "ab" * 32, "text": "hi"}),
                       ("/v1/index", {"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi",
                                      "ttl_s": 5})):
        r = requests.post(base + path, json=body, timeout=10,
                          headers={"Authorization": "Bearer not-this-stacks-token-xx"})
        if r.status_code != 401 or r.json()["error"]["code"] != "invalid_embedder_token":
            return False
    return True


def _squat(port: int, timeout: float = 10.0) -> socket.socket:
    """Bind and listen on 127.0.0.1:port (retried until the dead embedder's port is
    free), never answering: a stranger on the embedder's address."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead one's TIME_WAIT
        try:
            s.bind(("127.0.0.1", port))
            s.listen(64)
            s.setblocking(False)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _prompts_sent(s: socket.socket) -> list[str]:
    """The request lines of what the stranger was sent that carries a prompt (a POST: a
    lookup, an index write, an embedding); a health check of its address carries none."""
    lines = []
    while True:
        try:
            c, _ = s.accept()
        except BlockingIOError:
            return [x for x in lines if x.startswith("POST ")]
        with c:
            c.settimeout(2.0)
            try:
                lines.append(c.recv(4096).split(b"\r\n", 1)[0].decode("latin-1"))
            except OSError:
                pass


def _rendered_at(up: UpStack) -> float:
    """When the edge's configuration was last written (wall clock, s)."""
    return (up.folder / "stack" / "nginx" / "infergate-http.conf").stat().st_mtime


def _settled(up: UpStack, master: int) -> bool:
    """Only the workers of the edge's last configuration run: as many as
    ``worker_processes``, each started after the configuration was last written (a
    reload in progress while it was written would start workers of the one before, but
    they are then replaced by the next generation). Start times come from
    ``/proc/PID/stat`` (clock ticks since boot), compared on the same clock through
    ``/proc/uptime``."""
    folder = up.folder / "stack" / "nginx"
    want = int(re.search(r"worker_processes (\d+);", (folder / "nginx.conf").read_text())[1])
    t = _rendered_at(up)
    since_boot_at_t = float(Path("/proc/uptime").read_text().split()[0]) - (time.time() - t)
    tick = os.sysconf("SC_CLK_TCK")
    starts = []
    for w in children(master):
        if alive(w):
            try:
                ticks = int(Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[19])
            except (OSError, IndexError, ValueError):
                continue
            starts.append(ticks / tick)
    return len(starts) == want and all(s >= since_boot_at_t for s in starts)


def test_embedder_port_taken_after_a_crash(workdir: Path) -> None:
    port = procs.free_port()
    up = UpStack.start(workdir, '[edge]\nmetrics_listen = ""\n[cache]\nenabled = true\n'
                       f'embedder_url = "http://127.0.0.1:{port}"\n')
    squatter = None
    try:
        text = up.text()
        assert up.proc.poll() is None, text
        assert f"semantic cache http://127.0.0.1:{port}" in text, text
        first = up.post_chat("What is the tallest mountain in Europe?", timeout=30)
        assert first.status_code == 200 and first.headers["X-Cache-Status"] == "MISS"
        assert _refuses_without_the_token(f"http://127.0.0.1:{port}")
        # the edge's own lookups carry the token: a variant of the stored question is a
        # semantic hit once the entry is indexed
        tries = [0]

        def semantic_hit() -> bool:
            # trailing spaces: a new exact key each try, the same question to the embedder
            tries[0] += 1
            r = up.post_chat("what is the tallest mountain in europe" + " " * tries[0], timeout=30)
            return r.headers.get("X-Cache-Match") == "semantic"

        procs.wait_until(semantic_hit, 30, interval=0.5, what="a semantic hit through up's embedder")
        # killed, nobody else on its port: back on the same port (what the dead one left
        # in its process group is stopped first, not taken for a stranger)
        pid = up.part_pid("embedder --listen")
        assert pid
        os.kill(pid, signal.SIGKILL)
        procs.wait_until(lambda: "semantic cache on again" in up.text(), 180,
                         what="embedder back on its port")
        text = up.text()
        assert f"embedder ready on http://127.0.0.1:{port};" in text, text
        assert "is taken by another process" not in text, text
        # killed again, and a stranger takes the port
        pid = up.part_pid("embedder --listen")
        cp_pid = up.part_pid("controlplane --config")
        master = up.part_pid("nginx: master")
        assert pid and cp_pid and master
        # the reload that turned the semantic cache on again is over
        procs.wait_until(lambda: _settled(up, master), 30,
                         what="the workers of the configuration with the embedder")
        os.kill(pid, signal.SIGKILL)
        squatter = _squat(port)
        procs.wait_until(lambda: up.text().count("semantic cache off until it is back") == 2,
                         15, what="embedder exit noticed")
        # nginx reloads (SIGHUP): workers started after the new configuration was written
        # take over, the older ones exit
        procs.wait_until(lambda: _settled(up, master), 30,
                         what="the workers of the configuration without the embedder")
        # no embedder of ours: no prompt goes to the stranger (a lookup sent there would
        # wait out the budget and answer BYPASS; a health check of the address may)
        res = up.post_chat("Name a river that flows through Vienna.", timeout=30)
        assert res.status_code == 200 and res.headers["X-Cache-Status"] == "MISS", res.headers
        assert _prompts_sent(squatter) == []
        procs.wait_until(lambda: up.text().count("semantic cache on again") == 2, 180,
                         what="embedder back on a new port")
        text = up.text()
        assert f"embedder port {port} is taken by another process" in text, text
        new_port = int(re.findall(r"embedder ready on http://127\.0\.0\.1:(\d+)", text)[-1])
        assert new_port != port
        instance = procs.http_instance(f"http://127.0.0.1:{up.admin}/healthz")
        assert instance and procs.http_instance(
            f"http://127.0.0.1:{new_port}/healthz") == instance
        assert _refuses_without_the_token(f"http://127.0.0.1:{new_port}")  # restarts too
        conf = "\n".join(p.read_text(errors="replace")
                         for p in (up.folder / "stack" / "nginx").rglob("*.conf"))
        assert f"127.0.0.1:{new_port}" in conf and f"127.0.0.1:{port}" not in conf
        # the control plane runs on the new address too (online verification, node checks)
        assert f"control plane restarted for the embedder's new address " \
               f"http://127.0.0.1:{new_port}" in text, text
        assert up.part_pid("controlplane --config") not in (None, cp_pid)
        runtime = (up.folder / "stack" / "infergate.toml").read_text()
        assert f"http://127.0.0.1:{new_port}" in runtime and f":{port}\"" not in runtime
        procs.wait_until(lambda: _settled(up, master), 30,
                         what="the workers of the configuration with the new embedder")
        # lookups go to the new embedder: a paraphrase-free new prompt is a plain MISS,
        # and the stranger still saw nothing
        res = up.post_chat("Which ocean lies west of Portugal?", timeout=30)
        assert res.status_code == 200 and res.headers["X-Cache-Status"] == "MISS", res.headers
        assert _prompts_sent(squatter) == []
        assert up.proc.poll() is None
    finally:
        if squatter is not None:
            squatter.close()
        up.stop()


_HEALTHZ = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)   # degraded: its Redis does not answer
        self.send_header("X-Infergate-Instance", os.environ["INFERGATE_INSTANCE_ID"])
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_frozen_embedder_is_killed_after_three_missed_health_checks(workdir: Path,
                                                                     monkeypatch) -> None:
    """EmbedderKeeper's proof of life, on a real process that answers /healthz as the
    embedder does while its Redis is down (503 degraded, with this stack's id): answering,
    it is left alone (nothing to restart for); frozen (SIGSTOP: it never exits, so the
    supervisor alone would never see it), it is killed after PROBE_FAILS checks missed in
    a row, PROBE_EVERY_S apart (an explicit clock here), with one line saying why."""
    import sys

    from controlplane.cli.up import embedder as up_embedder
    from controlplane.cli.up.embedder import PROBE_EVERY_S, PROBE_FAILS, EmbedderKeeper
    from controlplane.config import settings_from_dict

    monkeypatch.setattr(up_embedder, "PROBE_TIMEOUT_S", 0.5)

    monkeypatch.setenv(procs.INSTANCE_ENV, "stack-under-test")
    port = procs.free_port()
    m = procs.Managed("embedder", [sys.executable, "-c", _HEALTHZ, str(port)],
                      workdir / "emb.log", env=dict(os.environ)).start()
    said: list[str] = []
    now = [1000.0]
    settings = settings_from_dict({"cache": {"enabled": True,
                                             "embedder_url": f"http://127.0.0.1:{port}"}})
    keeper = EmbedderKeeper(m, settings, procs.ProcessSet(), workdir, workdir / "cfg.toml",
                            say=said.append, clock=lambda: now[0])
    try:
        procs.wait_until(lambda: procs.http_instance(f"http://127.0.0.1:{port}/healthz")
                         == "stack-under-test", 10, what="the stand-in answers")
        for _ in range(PROBE_FAILS + 1):
            now[0] += PROBE_EVERY_S
            keeper.tick()
        assert m.alive() and said == [] and keeper.live.fails == 0
        m.signal(signal.SIGSTOP)
        for _ in range(PROBE_FAILS):
            now[0] += PROBE_EVERY_S
            keeper.tick()
        procs.wait_until(lambda: not m.alive(), 5, what="the frozen stand-in killed")
        assert len(said) == 1 and "did not answer its health check 3 times" in said[0], said
    finally:
        m.signal(signal.SIGKILL)
        m.stop(grace=1.0)
