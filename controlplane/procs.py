"""Starting, watching and stopping the local processes of a stack (redis-server,
simulated nodes, control plane, nginx). Used by ``infergate up`` and by the tests.

Every process runs in its own process group and is stopped with SIGTERM, then SIGKILL
after a grace period. On Linux it also gets SIGTERM from the kernel when the thread that
started it ends (``prctl(PR_SET_PDEATHSIG)``), so a stack whose parent is killed with
SIGKILL, or dies any other way, does not run on without it: start parts from a thread
that lives as long as they should. Readiness is waited for with a deadline, never a fixed
sleep.
:class:`Supervisor` restarts parts that die (with back-off, giving up on a part that keeps
failing); :func:`instance_id` / :data:`INSTANCE_HEADER` let a stack recognise its own
processes in their health answers."""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from controlplane.errors import InfergateError


class StartError(InfergateError, RuntimeError):
    """A process exited early or did not become ready before its deadline."""


#: Lowest port :func:`free_port` picks from (below the kernel's ephemeral range).
FREE_PORT_MIN = 20000
#: Random candidates :func:`free_port` tries before it takes the kernel's choice.
FREE_PORT_TRIES = 64
#: Seconds a port :func:`free_port` returned is not returned again by this process.
FREE_PORT_REUSE_S = 600.0
_EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: ``LOW-HIGH`` (e.g. ``21000-21999``): the only ports :func:`free_port` picks, for a
#: shared host where each stack keeps to its own share.
PORT_RANGE_ENV = "INFERGATE_PORT_RANGE"
_recent_ports: dict[int, float] = {}
_recent_lock = threading.Lock()
_rng = random.SystemRandom()
T = TypeVar("T")


def ephemeral_range(path: str = _EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)`` (ports it gives to outgoing
    connections and to ``bind(port 0)``), from ``ip_local_port_range``; Linux's default
    ``(32768, 60999)`` when the file cannot be read."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_range() -> tuple[int, int] | None:
    """The ports ``INFERGATE_PORT_RANGE`` (``LOW-HIGH``, both included, 1024-65535) allows
    :func:`free_port` to pick, or ``None`` when it is unset or empty. Raises
    :class:`StartError` naming the variable when its value is not such a range."""
    raw = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    lo, sep, hi = (x.strip() for x in raw.partition("-"))
    if sep and lo.isdigit() and hi.isdigit() and 1024 <= int(lo) <= int(hi) <= 65535:
        return int(lo), int(hi)
    raise StartError(f"{PORT_RANGE_ENV}={raw!r} is not a port range LOW-HIGH within "
                     "1024-65535 (e.g. 21000-21999)")


def _bindable(family: int, host: str, port: int, reuse_addr: bool = False) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            if reuse_addr:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            return True
    except OSError:
        return False


def port_bindable(port: int, host: str = "127.0.0.1", reuse_addr: bool = False) -> bool:
    """True when a TCP socket can bind ``host:port`` now: nothing listens there and no
    connection holds it. Without ``reuse_addr`` a port in TIME_WAIT counts as taken;
    with it (``SO_REUSEADDR``, as redis-server and nginx bind) it does not."""
    return _bindable(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port,
                     reuse_addr)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, preferably below the kernel's ephemeral range.

    A port the kernel picks (``bind`` to port 0) lies in the ephemeral range
    (:func:`ephemeral_range`, 32768-60999 by default), which outgoing connections draw
    from too: after a crash such a port can be held by one of them, and the part that
    used it (Redis, the embedder) cannot bind it again. So a random port from
    ``FREE_PORT_MIN`` .. ephemeral low - 1 is taken, checked by binding it (without
    ``SO_REUSEADDR``, so a port still in TIME_WAIT is skipped too); after
    ``FREE_PORT_TRIES`` busy candidates, or when that range is empty, the kernel's
    choice. Concurrent callers: the choice is random over ~12,000 ports, and a port this
    process returned is not returned again for ``FREE_PORT_REUSE_S`` seconds (the caller
    binds it later, so two callers of one process never get the same port). Like every
    "free port" helper, the port may be taken between this call and the caller's bind.

    With ``INFERGATE_PORT_RANGE`` set (:func:`port_range`) only a port of that range is
    taken; :class:`StartError` when none of it is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    allowed = port_range()
    if allowed is not None:
        return _free_port_in(family, host, *allowed)
    low, _ = ephemeral_range()
    top = low - 1
    now = time.monotonic()
    with _recent_lock:
        for p, t in list(_recent_ports.items()):
            if now - t > FREE_PORT_REUSE_S:
                del _recent_ports[p]
        if top > FREE_PORT_MIN:
            for _ in range(FREE_PORT_TRIES):
                port = _rng.randint(FREE_PORT_MIN, top)
                if port not in _recent_ports and _bindable(family, host, port):
                    _recent_ports[port] = now
                    return port
        for _ in range(FREE_PORT_TRIES):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _recent_ports:
                _recent_ports[port] = now
                return port
        return port


def _free_port_in(family: int, host: str, lo: int, hi: int) -> int:
    """A bindable port of ``lo``..``hi`` not returned in the last ``FREE_PORT_REUSE_S``:
    random candidates first, then every port of the range from a random start."""
    now = time.monotonic()
    with _recent_lock:
        for p, t in list(_recent_ports.items()):
            if now - t > FREE_PORT_REUSE_S:
                del _recent_ports[p]
        n = hi - lo + 1
        start = _rng.randint(lo, hi)
        tries = (_rng.randint(lo, hi) for _ in range(min(FREE_PORT_TRIES, n)))
        sweep = (lo + (start - lo + i) % n for i in range(n))
        for port in itertools.chain(tries, sweep):
            if port not in _recent_ports and _bindable(family, host, port):
                _recent_ports[port] = now
                return port
        taken = sum(1 for p in _recent_ports if lo <= p <= hi)
    raise StartError(f"no free port on {host} in {PORT_RANGE_ENV}={lo}-{hi} "
                     f"({n} port(s), {taken} of them given to this run's other parts; "
                     "`infergate up` needs one each for Redis, every simulated node, the "
                     "embedder and the edge's metrics: give it a wider range)")


#: What a process that could not bind its port says (lower case): the kernel's EADDRINUSE
#: text (Python, Redis, nginx) and llama.cpp's server (tools/server/server.cpp:
#: "couldn't bind HTTP server socket, hostname: ..., port: ...").
PORT_TAKEN_MARKERS = ("address already in use", "couldn't bind")


def on_free_port(start: Callable[[int], T], attempts: int = 3) -> T:
    """``start(port)`` on a :func:`free_port`, called again on a new port (up to
    ``attempts`` times in all) when it raises a :class:`StartError` whose message says
    the port was taken (:data:`PORT_TAKEN_MARKERS`): a free port is only free when
    chosen, and another process on the host may bind it before ``start``'s process
    does. ``start`` must leave nothing running when it raises. Returns what ``start``
    returns; raises its last error, or any other error at once."""
    for attempt in range(max(1, attempts)):
        try:
            return start(free_port())
        except StartError as exc:
            text = str(exc).lower()
            if not any(m in text for m in PORT_TAKEN_MARKERS) or attempt >= attempts - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when a TCP connect to host:port succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_answers(host: str, port: int, path: str = "/", timeout: float = 1.0) -> bool:
    """True when host:port answers ``GET path`` with an HTTP status line within
    ``timeout`` seconds (any status). Stronger than :func:`port_open` for nginx: its
    master listens on every port it could bind while it retries one it could not (then
    exits), and only a running worker answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            return sock.recv(5) == b"HTTP/"
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


#: prctl option: the signal a process gets when the thread that created it ends (Linux,
#: prctl(2)).
PR_SET_PDEATHSIG = 1
_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel for SIGTERM when the creating thread ends,
    and ends the child at once when its parent already died before the request was made.
    None where prctl is not available (the child then outlives a killed parent)."""
    if _prctl is None:
        return None
    prctl = _prctl

    def pre() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return pre


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time in clock ticks since boot) of ``pid`` from
    ``/proc/<pid>/stat``; None when it is gone (or there is no /proc)."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(rest[2]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _group_members(pgid: int) -> dict[int, int] | None:
    """pid -> start time of every process in the process group ``pgid`` (a pid and its
    start time name one process: a pid number used again has a later start time); None
    without /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    members = {}
    for name in names:
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None and st[0] == pgid:
                members[int(name)] = st[1]
    return members


@dataclass
class Managed:
    """One child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    orphans_signal: int | None = None
    """Signal for what a dead leader left in its process group when the part is
    restarted (nginx: SIGQUIT, so the orphaned workers close their listening sockets and
    finish the requests they serve); None: the group is killed (SIGKILL) first."""
    orphan_groups: list[int] = field(default_factory=list)
    """Process groups left to finish that way; what is left of them is killed when the
    part is stopped for good."""
    orphan_members: dict[int, dict[int, int]] = field(default_factory=dict)
    """Per group of :attr:`orphan_groups`: pid -> start time of each process it held when
    it was left (:func:`_group_members`). Only these are killed at the stop: by then the
    group's number may lead another process's group (pid numbers wrap)."""
    finish_signal: int | None = None
    """Signal that asks the part to finish what it serves before :meth:`stop` falls back
    to SIGTERM (nginx: SIGQUIT, its graceful shutdown, as ``nginx -s quit`` and Debian's
    nginx.service send); None: SIGTERM at once."""
    finish_grace: float = 10.0
    """Seconds the part has to finish after :attr:`finish_signal`."""

    def start(self) -> "Managed":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=self.env, cwd=self.cwd,
            preexec_fn=_die_with_parent(os.getpid()),
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

    def release_group(self) -> bool:
        """Before a restart of a part whose leader exited: send :attr:`orphans_signal` to
        what it left in its process group and remember the group (see
        :attr:`orphan_groups`). False (nothing done) without an ``orphans_signal``."""
        if self.proc is None or self.orphans_signal is None:
            return False
        pgid = self.proc.pid
        try:
            os.killpg(pgid, self.orphans_signal)
        except (ProcessLookupError, PermissionError):
            return True  # nothing left in it
        self.orphan_groups.append(pgid)
        members = _group_members(pgid)
        if members is not None:
            self.orphan_members[pgid] = members
        return True

    def _kill_orphans(self, pgid: int) -> None:
        """SIGKILL what is left of the orphaned group ``pgid``: the processes recorded in
        :attr:`orphan_members` that still run in it (same pid, group and start time);
        the whole group only where that could not be recorded (no /proc)."""
        members = self.orphan_members.pop(pgid, None)
        if members is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        for pid, started in members.items():
            if _proc_stat(pid) == (pgid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, grace: float = 5.0, hurry: threading.Event | None = None) -> None:
        """Stop the part: with a :attr:`finish_signal`, send it and wait up to
        :attr:`finish_grace` seconds (less once ``hurry`` is set) for the leader to exit;
        then SIGTERM the process group, SIGKILL it after ``grace`` seconds; SIGKILL what
        is left of the groups earlier leaders left to finish (:meth:`release_group`)."""
        for pgid in self.orphan_groups:
            self._kill_orphans(pgid)
        self.orphan_groups.clear()
        if self.proc is None:
            return
        if self.finish_signal is not None and self.proc.poll() is None:
            self.signal(self.finish_signal)
            until = time.monotonic() + self.finish_grace
            while self.proc.poll() is None and time.monotonic() < until:
                if hurry is not None and hurry.is_set():
                    break
                try:
                    self.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
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

    def stop_all(self, hurry: threading.Event | None = None) -> None:
        """Stop every part, last started first (see :meth:`Managed.stop` for ``hurry``)."""
        for m in reversed(self.items):
            m.stop(hurry=hurry)
        self.items.clear()


#: Environment variable through which ``infergate up`` hands its instance id to every
#: part it starts; the parts echo it in their health answers.
INSTANCE_ENV = "INFERGATE_INSTANCE_ID"
#: Response header carrying the instance id on health answers (simnode ``/health``,
#: embedder ``/healthz``, admin ``/healthz``); the JSON ones also have ``instance_id``.
INSTANCE_HEADER = "X-Infergate-Instance"


def instance_id() -> str:
    """This process's stack instance id (``INFERGATE_INSTANCE_ID``), ``""`` when unset."""
    return os.environ.get(INSTANCE_ENV, "")


def http_instance(url: str, timeout: float = 1.0) -> str | None:
    """``GET url`` and return its :data:`INSTANCE_HEADER` (``""`` when the answer has
    none), or ``None`` when nothing answers within ``timeout`` seconds. Any status
    counts as an answer: a node whose health fails is still someone's process."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as res:  # noqa: S310 - http only
            # the (small) body is read too: a server still writing it when the connection
            # closes logs each probe as a client that went away (waitress)
            res.read(65536)
            return res.headers.get(INSTANCE_HEADER, "")
    except urllib.error.HTTPError as exc:
        return exc.headers.get(INSTANCE_HEADER, "") if exc.headers else ""
    except (OSError, ValueError):
        return None


def cpu_state(pid: int | None) -> tuple[float, str] | None:
    """CPU time (user + system, seconds, all threads) and state letter (``R``, ``S``,
    ``T`` stopped, ...) of process ``pid`` from ``/proc/<pid>/stat`` (proc(5)), or None
    when it cannot be read."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        fields = raw[raw.rindex(")") + 2:].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks, fields[0]
    except (OSError, ValueError, IndexError):
        return None


#: A process that misses its health checks but used at least this share of one CPU
#: meanwhile is working (a flood of its port, a long burst of work), not frozen: a
#: stopped process uses none, a deadlocked one no more than its idle background work.
BUSY_CPU_SHARE = 0.25
#: How long such a busy process may miss its health checks before it is killed all the
#: same (s): an interpreter stuck in a loop is busy too, unless it holds FLOOD_SOCKETS
#: sockets or more (a flood of connections, which a restart would not end).
BUSY_MAX_S = 120.0
FLOOD_SOCKETS = 200


def socket_count(pid: int | None) -> int:
    """Open sockets of process ``pid`` (its ``/proc/<pid>/fd`` links to ``socket:``);
    0 when they cannot be read."""
    if not pid:
        return 0
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    n += 1
            except OSError:
                continue
    except OSError:
        return 0
    return n


class Liveness:
    """Counts the health checks a part missed and says when to kill it: after
    ``fail_after`` misses in a row, unless the process is busy rather than frozen (it
    used BUSY_CPU_SHARE of a CPU since the first miss and is not stopped), for at most
    BUSY_MAX_S, or for as long as it holds FLOOD_SOCKETS sockets or more (a flood);
    ``say`` gets one line when the kill is held back so. Clock: monotonic s."""

    def __init__(self, name: str, fail_after: int, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.fail_after = fail_after
        self.say = say
        self.clock = clock
        self.fails = 0
        self._first: tuple[float, float] | None = None   # (time, CPU s) at the first miss
        self._told = False

    def answered(self) -> None:
        """The part answered its check."""
        self.fails = 0
        self._first = None
        self._told = False

    def missed(self, pid: int | None) -> bool:
        """The part missed a check: whether to kill it now."""
        self.fails += 1
        now = self.clock()
        st = cpu_state(pid)
        if self._first is None:
            self._first = (now, st[0] if st else 0.0)
        if self.fails < self.fail_after:
            return False
        t0, cpu0 = self._first
        span = now - t0
        busy = st is not None and st[1] not in "Tt" and st[0] - cpu0 >= BUSY_CPU_SHARE * span > 0
        flood = busy and socket_count(pid) >= FLOOD_SOCKETS
        if busy and (span < BUSY_MAX_S or flood):
            if not self._told:
                self.say(f"{self.name} (pid {pid}) did not answer its health check {self.fails} "
                         f"times in a row but is working ({st[0] - cpu0:.1f} s of CPU in "
                         f"{span:.0f} s: a flood of its port?): not killed unless it stays so "
                         f"for {BUSY_MAX_S:g} s with fewer than {FLOOD_SOCKETS} connections")
                self._told = True
            return False
        self.answered()
        return True


@dataclass
class RestartPolicy:
    """How :class:`Supervisor` restarts a part that died: after ``initial_s`` seconds,
    doubling per failure up to ``max_s``; when ``max_failures`` exits fall within
    ``window_s`` seconds the part is given up on."""

    initial_s: float = 0.5
    max_s: float = 10.0
    max_failures: int = 5
    window_s: float = 60.0

    def delay(self, failures: int) -> float:
        """Back-off before restart number ``failures`` (1-based), seconds."""
        return min(self.max_s, self.initial_s * (2 ** max(0, failures - 1)))


@dataclass
class _Watched:
    m: Managed
    optional: bool
    on_restart: Callable[[Managed], None] | None
    failures: list[float] = field(default_factory=list)
    restarts: int = 0
    restart_at: float | None = None
    given_up: bool = False
    keep_trying: bool = False
    degraded: bool = False


class HangWatch:
    """Kills a part that lives but no longer answers, so that the :class:`Supervisor`
    restarts it: a process that is frozen (SIGSTOP, a stuck interpreter) never exits, and
    exits are all the supervisor sees.

    A daemon thread calls ``probe()`` (True: the part answered) every ``every_s``
    seconds while the part's process lives; after ``fail_after`` failures in a row (so
    ``every_s * fail_after`` seconds without an answer, at least) it says so and sends
    SIGKILL to the part's process group, unless the part is busy, not frozen
    (:class:`Liveness`: a flood of its port, which a restart would not end and which
    would cost the part's state). ``stop()`` ends the thread."""

    def __init__(self, m: Managed, probe: Callable[[], bool], say: Callable[[str], None],
                 every_s: float = 5.0, fail_after: int = 3) -> None:
        self.m = m
        self.probe = probe
        self.say = say
        self.every_s = every_s
        self.fail_after = fail_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hang-watch-{m.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        live = Liveness(self.m.name, self.fail_after, self.say)
        while not self._stop.wait(self.every_s):
            if not self.m.alive():
                live.answered()  # exited: the supervisor restarts it; a new one starts afresh
                continue
            try:
                ok = bool(self.probe())
            except Exception:  # noqa: BLE001 - a probe that fails is a failed probe
                ok = False
            if ok:
                live.answered()
                continue
            fails = live.fails + 1
            if live.missed(self.m.pid) and not self._stop.is_set():
                self.say(f"{self.m.name} (pid {self.m.pid}) did not answer its health check "
                         f"{fails} times in a row, {self.every_s:g} s apart: killing it, to be "
                         "restarted")
                self.m.signal(signal.SIGKILL)

    def stop(self) -> None:
        self._stop.set()


class Supervisor:
    """Keeps the parts of a :class:`ProcessSet` running: call :meth:`tick` about once a
    second. A part found dead is reported through ``say`` (one line: part, exit code,
    restart count, log file) and started again with the same argv after the
    :class:`RestartPolicy` back-off (its process group is cleaned first: killed, or, for
    a part with an :attr:`Managed.orphans_signal`, asked to finish what it serves: the
    workers of a killed nginx master complete their requests, see
    :meth:`Managed.release_group`). A part that fails ``max_failures`` times within
    ``window_s`` is given up on: an ``optional`` one (the embedder) is left stopped, one
    watched with ``keep_trying`` is reported once and restarted on at the longest
    back-off (the rest serves without it meanwhile), for any other :meth:`tick` returns
    the message naming it, and the owner stops everything. Never blocks: readiness is
    not waited for after a restart (a part that cannot come up dies again and counts as
    a failure)."""

    def __init__(self, say: Callable[[str], None], policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.say = say
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self._parts: list[_Watched] = []

    def watch(self, m: Managed, *, optional: bool = False, keep_trying: bool = False,
              on_restart: Callable[[Managed], None] | None = None) -> Managed:
        """Supervise ``m`` (already started). ``on_restart(m)`` runs after each restart
        (e.g. to report it); its exceptions are logged through ``say`` and ignored.
        ``optional``: left stopped once it keeps failing; ``keep_trying``: never given
        up on (see the class)."""
        self._parts.append(_Watched(m, optional, on_restart, keep_trying=keep_trying))
        return m

    def restarts(self, name: str) -> int:
        """How often the part named ``name`` was restarted so far."""
        return sum(w.restarts for w in self._parts if w.m.name == name)

    def tick(self) -> str | None:
        """One supervision round. Returns ``None``, or the failure message of a required
        part that keeps failing (then nothing more is restarted)."""
        now = self.clock()
        pol = self.policy
        for w in self._parts:
            if w.given_up:
                continue
            if w.restart_at is not None:
                if now >= w.restart_at:
                    w.restart_at = None
                    # whatever is left in its process group: asked to finish what it
                    # serves (nginx workers), or killed
                    if not w.m.release_group():
                        w.m.stop(grace=1.0)
                    try:
                        w.m.start()
                    except OSError as exc:
                        self.say(f"{w.m.name}: restart failed: {exc}")
                        w.failures.append(now)
                        w.restart_at = now + pol.delay(len(w.failures))
                        continue
                    w.restarts += 1
                    self.say(f"{w.m.name} restarted (pid {w.m.pid}, restart {w.restarts})")
                    if w.on_restart is not None:
                        try:
                            w.on_restart(w.m)
                        except Exception as exc:  # noqa: BLE001 - a report never stops supervision
                            self.say(f"{w.m.name}: after restart: {exc}")
                continue
            if w.m.alive():
                continue
            rc = w.m.proc.returncode if w.m.proc is not None else None
            why = _exit_reason(w.m, rc)
            w.failures = [t for t in w.failures if now - t <= pol.window_s] + [now]
            if len(w.failures) < pol.max_failures:
                w.degraded = False
            elif w.keep_trying:
                if not w.degraded:
                    w.degraded = True
                    self.say(f"{w.m.name} exited (code {rc}) {len(w.failures)} times within "
                             f"{pol.window_s:.0f} s (log {w.m.log_path}); the rest runs on "
                             f"without it, restarting it every {pol.max_s:.0f} s{why}")
            else:
                w.given_up = True
                msg = (f"{w.m.name} exited (code {rc}) {len(w.failures)} times within "
                       f"{pol.window_s:.0f} s; see {w.m.log_path}. Last lines:\n{w.m.log_tail()}")
                if w.optional:
                    self.say(f"{w.m.name} gave up after {len(w.failures)} exits within "
                             f"{pol.window_s:.0f} s (log {w.m.log_path}); the rest runs on")
                    continue
                return msg
            delay = pol.max_s if w.degraded else pol.delay(len(w.failures))
            self.say(f"{w.m.name} exited (code {rc}, restarts so far {w.restarts}, log "
                     f"{w.m.log_path}); restarting in {delay:.1f} s{why}")
            w.restart_at = now + delay
        return None


#: Longest last log line :func:`_exit_reason` repeats.
EXIT_REASON_MAX = 300


def _exit_reason(m: Managed, rc: int | None) -> str:
    """``": <its log's last line>"`` for a part that ended itself with an error (exit
    code above 0: a configuration it refuses, a port it cannot bind, ...), so the one line
    ``up`` prints says why; ``""`` for a part killed by a signal (its last line is then
    unrelated) or with an empty log."""
    if rc is None or rc <= 0:
        return ""
    last = next((ln.strip() for ln in reversed(m.log_tail(5).splitlines()) if ln.strip()), "")
    if not last:
        return ""
    if len(last) > EXIT_REASON_MAX:
        last = last[:EXIT_REASON_MAX - 1] + "…"
    return f": {last}"


def infergate_argv(*args: str) -> list[str]:
    """argv that runs an ``infergate`` subcommand with this interpreter."""
    return [sys.executable, "-m", "controlplane.cli", *args]


def find_redis_server() -> str:
    """Path of ``redis-server`` (``INFERGATE_REDIS_SERVER`` overrides)."""
    exe = os.environ.get("INFERGATE_REDIS_SERVER") or shutil.which("redis-server")
    if not exe:
        raise StartError("redis-server not found: apt-get install redis-server")
    return exe


#: Redis settings for the infergate state (API keys, nodes, drain states, events): kept
#: in an append-only file, fsynced every second, and never evicted - only keys with a
#: TTL (the cache) are (``volatile-lru``).
PERSISTENT_REDIS_ARGS: tuple[str, ...] = (
    "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
)


def start_redis(workdir: Path, port: int, extra: Sequence[str] = (),
                maxmemory: str = "256mb", timeout: float = 15.0,
                persistent: bool = False, password: str | None = None) -> Managed:
    """Start a ``redis-server`` on 127.0.0.1:port with its files in ``workdir``, at most
    ``maxmemory``, evicting only keys with a TTL (``maxmemory-policy volatile-lru``:
    every cache key has one, state keys never do).

    ``persistent``: with an append-only file in ``workdir`` (``appendonly yes``,
    ``appendfsync everysec``), so a restart from the same folder finds the state again
    (at most about a second of writes lost); otherwise nothing is written to disk.

    ``password``: clients must AUTH with it (``requirepass``, written to
    ``workdir/redis.conf`` with mode 0600, never on the command line that ``ps`` shows
    every user); ``workdir`` is then made 0700, so the append-only file, which holds
    stored prompts and answers, is the owner's alone."""
    workdir.mkdir(parents=True, exist_ok=True)
    conf: tuple[str, ...] = ()
    if password is not None:
        if not password or any(c.isspace() or c in "\"'" for c in password):
            raise ValueError("the Redis password must be non-empty, without spaces or quotes")
        os.chmod(workdir, 0o700)
        path = workdir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # masterauth: a replica (Redis Cluster, controlplane.redisdb.localcluster)
            # authenticates to its master with the same password
            f.write(f"requirepass {password}\nmasterauth {password}\n")
        os.chmod(path, 0o600)  # a file left by an earlier run keeps its mode otherwise
        conf = (str(path),)
    persistence = PERSISTENT_REDIS_ARGS if persistent else ("--save", "", "--appendonly", "no")
    # the process title names the folder (Redis 7 proc-title-template), so `ps` on a
    # shared host tells whose redis-server this is
    title = () if "{" in str(workdir) else (
        "--proc-title-template", "{title} {listen-addr} {server-mode} " + str(workdir.resolve()))
    argv = [
        find_redis_server(), *conf, "--port", str(port), "--bind", "127.0.0.1",
        *persistence, "--dir", str(workdir),
        "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru",
        "--protected-mode", "no", *title, *extra,
    ]
    m = Managed("redis", argv, workdir / f"redis-{port}.log").start()

    def ping() -> bool:
        # ready when the Redis on the port is this process (``INFO server`` names its
        # pid): never another Redis that holds the port while this one fails to bind;
        # and when it has loaded its files (PING answers -LOADING until then)
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            auth = f"AUTH {password}\r\n".encode() if password else b""
            s.sendall(auth + b"INFO server\r\nPING\r\n")
            buf = b""
            while not (buf.endswith(b"+PONG\r\n") or b"\r\n-" in buf) and len(buf) < 65536:
                chunk = s.recv(8192)
                if not chunk:
                    break
                buf += chunk
            if not buf.endswith(b"+PONG\r\n"):
                return False  # still loading the append-only file, or not a Redis
            for line in buf.decode("ascii", "replace").splitlines():
                if line.startswith("process_id:"):
                    return line.split(":", 1)[1].strip() == str(m.pid)
            return False

    try:
        return m.wait_ready(ping, timeout)
    except StartError:
        m.stop()
        raise


def start_redis_free_port(workdir: Path, attempts: int = 5, **kwargs: object) -> tuple[Managed, int]:
    """:func:`start_redis` on a :func:`free_port`, chosen again (up to ``attempts`` times,
    :func:`on_free_port`) when ``redis-server`` could not bind it because another process
    bound it in between. ``kwargs`` go to :func:`start_redis`. Returns the process and
    its port; raises the last :class:`StartError` (at once for any other failure)."""
    def start(port: int) -> tuple[Managed, int]:
        return start_redis(workdir, port, **kwargs), port  # type: ignore[arg-type]

    return on_free_port(start, attempts)
