"""Starting, watching and stopping the local processes of a stack (redis-server,
simulated nodes, control plane, nginx). Used by ``infergate up`` and by the tests.

Every process runs in its own process group and is stopped with SIGTERM, then SIGKILL
after a grace period. Readiness is waited for with a deadline, never a fixed sleep."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class StartError(RuntimeError):
    """A process exited early or did not become ready before its deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel just reported free on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when a TCP connect to host:port succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05,
               what: str = "condition") -> None:
    """Poll ``pred`` until it returns true; raise :class:`StartError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - a probe that raises is "not yet"
            pass
        if time.monotonic() >= deadline:
            raise StartError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Managed:
    """One child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None

    def start(self) -> "Managed":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=self.env, cwd=self.cwd,
        )
        log.close()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self, pred: Callable[[], bool], timeout: float = 20.0) -> "Managed":
        """Wait for ``pred``; fail fast (with the log tail) if the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise StartError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if pred():
                    return self
            except Exception:  # noqa: BLE001
                pass
            if time.monotonic() >= deadline:
                raise StartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
        # Whatever the leader left behind in its group (e.g. nginx workers).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class ProcessSet:
    """Processes stopped together, last started first."""

    items: list[Managed] = field(default_factory=list)

    def add(self, m: Managed) -> Managed:
        self.items.append(m)
        return m

    def stop_all(self) -> None:
        for m in reversed(self.items):
            m.stop()
        self.items.clear()


def infergate_argv(*args: str) -> list[str]:
    """argv that runs an ``infergate`` subcommand with this interpreter."""
    return [sys.executable, "-m", "controlplane.cli", *args]


def find_redis_server() -> str:
    """Path of ``redis-server`` (``INFERGATE_REDIS_SERVER`` overrides)."""
    exe = os.environ.get("INFERGATE_REDIS_SERVER") or shutil.which("redis-server")
    if not exe:
        raise StartError("redis-server not found: apt-get install redis-server")
    return exe


def start_redis(workdir: Path, port: int, extra: Sequence[str] = (),
                maxmemory: str = "256mb", timeout: float = 15.0) -> Managed:
    """Start a throwaway ``redis-server`` on 127.0.0.1:port (no persistence, LRU)."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", str(workdir),
        "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
        "--protected-mode", "no", *extra,
    ]
    m = Managed("redis", argv, workdir / f"redis-{port}.log").start()

    def ping() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    try:
        return m.wait_ready(ping, timeout)
    except StartError:
        m.stop()
        raise
