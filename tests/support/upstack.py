"""Run ``infergate up`` as a child process for the e2e tests and read what it printed.

Typical use::

    up = UpStack.start(workdir / "a", '[cache]\\nenabled = false\\n')
    up.post_chat("Hello!")          # through its edge, with its demo key
    up.stop()                        # SIGTERM, waits; returns the exit code
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames

#: Longest wait for the banner of ``infergate up``, seconds.
BANNER_TIMEOUT_S = 90.0

#: A stack without the semantic cache and without a metrics listener.
NO_CACHE = '[edge]\nmetrics_listen = ""\n[cache]\nenabled = false\n'


def registry(url: str) -> dict[str, str]:
    """The node registry in the Redis at ``url``: node name -> its URL."""
    r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    try:
        return {name: json.loads(doc)["url"] for name, doc in r.hgetall(keynames.NODES).items()}
    finally:
        r.close()


def children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (``up`` starts each part in a new session)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.add(int(d.name))
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces (``""`` when gone)."""
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                .decode(errors="replace"))
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


#: Times :meth:`UpStack.start` starts ``up`` on new ports when it lost one chosen free.
PORT_ATTEMPTS = 3


@dataclass
class UpStack:
    """One running ``infergate up`` (``proc``) with its output in ``log_path``."""

    folder: Path
    proc: subprocess.Popen
    log_path: Path
    edge: int
    admin: int
    _log: IO[str] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, folder: Path, config: str, *args: str, redis_url: str | None = None,
              wait: bool = True) -> "UpStack":
        """``infergate up --config <config> --listen/--admin-listen <free ports>
        --workdir folder/stack --time-scale 0.05 [--redis-url URL] *args``; waits for the
        banner (or the exit) when ``wait``."""
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)
        cfg = folder / "up.toml"
        cfg.write_text(config)
        for attempt in range(PORT_ATTEMPTS):
            edge, admin = procs.free_port(), procs.free_port()
            argv = procs.infergate_argv("up", "--config", str(cfg),
                                        "--listen", f"127.0.0.1:{edge}",
                                        "--admin-listen", f"127.0.0.1:{admin}",
                                        "--workdir", str(folder / "stack"), "--time-scale", "0.05")
            if redis_url:
                argv += ["--redis-url", redis_url]
            argv += list(args)
            log_path = folder / "up.log"
            log = open(log_path, "w")
            env = {k: v for k, v in os.environ.items() if k != "INFERGATE_REDIS_URL"}
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env)
            up = cls(folder, p, log_path, edge, admin, log)
            if not wait:
                return up
            try:
                procs.wait_until(lambda: "infergate is up." in up.text() or p.poll() is not None,
                                 timeout=BANNER_TIMEOUT_S, what="infergate up banner")
            except procs.StartError:
                up.kill()
                raise
            if p.poll() is None or attempt == PORT_ATTEMPTS - 1 or not up._lost_a_port():
                return up
            up.kill()   # a port chosen free was taken in between by another process: new ones
        raise AssertionError("unreachable")  # pragma: no cover

    def _lost_a_port(self) -> bool:
        """The output says the edge or admin address this stack was given is in use."""
        return any("already in use" in line and
                   (f":{self.edge}" in line or f":{self.admin}" in line)
                   for line in self.text().splitlines())

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def key(self) -> str:
        m = re.search(r"API key \(demo\)\s+(\S+)", self.text())
        assert m, f"no demo key in the output of infergate up:\n{self.text()}"
        return m.group(1)

    @property
    def redis_url(self) -> str:
        return re.search(r"^\s+redis\s+(\S+)", self.text(), re.M).group(1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.edge}"

    def post_chat(self, content: str, timeout: float = 10) -> requests.Response:
        return requests.post(f"{self.base}/v1/chat/completions", timeout=timeout,
                             headers={"Authorization": f"Bearer {self.key}"},
                             json={"model": "sim-llama",
                                   "messages": [{"role": "user", "content": content}]})

    def part_pid(self, needle: str) -> int | None:
        """Pid of the child of ``up`` whose command line contains ``needle``."""
        for pid in children(self.proc.pid):
            if needle in cmdline(pid) and alive(pid):
                return pid
        return None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM ``up`` and wait; SIGKILL its group if it hangs. Returns the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL ``up`` and the process group of every part it still has (each part
        runs in its own session, so killing ``up`` alone would leave them running)."""
        if self.proc.poll() is None:
            for pid in children(self.proc.pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None


def first_answer(up: UpStack) -> None:
    """Wait (30 s at most) for the first 200 through the stack's edge."""
    procs.wait_until(lambda: up.post_chat("warm up").status_code == 200, timeout=30,
                     what="first answer through the edge")
