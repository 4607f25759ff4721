"""Several embedder processes on one listening socket (``infergate embedder --processes N``).

The parent binds the address (:func:`bind_listener`), forks N children before anything
heavy is imported (no model, numpy or thread exists yet, so nothing is copied half-made)
and supervises them (:func:`supervise`): each child loads its own model and serves the
inherited socket with its own waitress; the kernel hands each new connection to one of
the processes waiting in ``accept``. The socket is never opened with ``SO_REUSEPORT``, so
no other process (another stack's embedder) can join it.

Supervision, as gunicorn's arbiter does it: a child that exits after it started serving is
replaced (at most :data:`MAX_RESTARTS` in :data:`RESTART_WINDOW_S`, then the service stops
with status 1); a child that exits before it served (Redis unreachable, model not
loadable) stops the others and the command exits with that child's status, as the single
process would. SIGTERM or SIGINT to the parent is passed to the children, which finish
their requests (at most :data:`STOP_GRACE_S`, then SIGKILL; at once on a second signal,
after which the parent still reaps them and removes its metrics folder). A child whose
parent died notices within a second, removes the parent's metrics folder and stops itself
as on SIGTERM (a few seconds in all).

Prometheus counters are shared through ``prometheus_client``'s multiprocess mode: the
parent sets ``PROMETHEUS_MULTIPROC_DIR`` to a directory of its own (removed at exit; named
with its pid, so that the next embedder to start removes it when the parent was killed
with its children) before the children import the library, and ``/metrics`` of any
process sums all of them.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import click

from controlplane.errors import InfergateError

#: Children replaced at most this many times within :data:`RESTART_WINDOW_S`.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: Seconds the children have to finish after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
#: Environment variable of prometheus_client's multiprocess mode.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


#: Name prefix of a parent's metrics folder in the temp directory, followed by its pid.
METRICS_PREFIX = "infergate-embedder-metrics-"


def remove_stale_metrics_dirs(tmp: str | None = None) -> list[str]:
    """Remove the metrics folders (``<tmp>/infergate-embedder-metrics-<pid>-*``) of this
    user whose embedder parent is gone, e.g. killed with its whole process group so that
    neither it nor its children could; returns the paths removed. A folder whose pid is
    alive, belongs to another user or has no pid in its name is left alone."""
    base = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(METRICS_PREFIX):
            continue
        pid_text = name[len(METRICS_PREFIX):].split("-", 1)[0]
        path = os.path.join(base, name)
        try:
            pid = int(pid_text)
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(pid, 0)
            continue  # its parent is alive
        except ValueError:
            continue
        except ProcessLookupError:
            pass
        except OSError:  # PermissionError: a live process of another user
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def bind_listener(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 literal or name; a name's
    IPv4 address first, e.g. ``localhost`` -> 127.0.0.1), with ``SO_REUSEADDR`` only.
    Raises ``OSError`` (e.g. ``EADDRINUSE``, ``socket.gaierror`` for an unknown name)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Stop(InfergateError):
    """Raised in the supervisor by SIGTERM/SIGINT: stop the children."""


def _watch_parent(parent: int, metrics_dir: str = "") -> None:
    """In a child: SIGTERM itself once its parent is gone (re-parented), after removing
    the parent's metrics folder ``metrics_dir`` (a killed parent cannot)."""
    def run() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                if metrics_dir:
                    shutil.rmtree(metrics_dir, ignore_errors=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def _child(serve: Callable[[Callable[[], None], int], None], ready_w: int, parent: int,
           metrics_dir: str = "", slot: int = 0) -> None:
    """Body of a forked child; never returns (``os._exit`` with the serve status)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    code = 1
    try:
        _watch_parent(parent, metrics_dir)
        serve(lambda: os.write(ready_w, struct.pack("=i", os.getpid())), slot)
        code = 0
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported, then the child's status says it
        logging.getLogger("infergate.embedder").exception("embedder process failed")
    finally:
        os._exit(code)


def supervise(n: int, serve: Callable[[Callable[[], None], int], None],
              log: logging.Logger, reset_slot: Callable[[int], None] | None = None) -> int:
    """Fork ``n`` children running ``serve(ready, slot)`` (``ready()`` once they answer;
    ``slot`` 0 .. n - 1, the child's place, which a replacement takes over) and keep them
    running until SIGTERM/SIGINT; returns the exit status (0 after a stop, the failing
    child's status when one could not start, 1 when children keep dying).
    ``reset_slot(slot)`` runs in this process before a child is started in ``slot``."""
    remove_stale_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    ready_r, ready_w = os.pipe()
    os.set_blocking(ready_r, False)
    parent = os.getpid()
    children: dict[int, bool] = {}  # pid -> has served
    slots: dict[int, int] = {}  # pid -> slot
    restarts: list[float] = []

    def spawn(slot: int) -> None:
        if reset_slot is not None:
            reset_slot(slot)
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _child(serve, ready_w, parent, metrics_dir, slot)
        children[pid] = False
        slots[pid] = slot

    def on_signal(signum, frame):  # noqa: ARG001
        raise _Stop()

    status = 0
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for slot in range(n):
            spawn(slot)
        log.info("embedder: %d processes started (pids %s)", n,
                 " ".join(str(p) for p in children))
        while True:
            select.select([ready_r], [], [], 0.5)
            _read_ready(ready_r, children)
            while children:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                served = children.pop(pid, None)
                slot = slots.pop(pid, 0)
                if served is None:
                    continue
                code = os.waitstatus_to_exitcode(wstatus)
                # it may have said so since the read above, just before it died
                if not served and pid not in _read_ready(ready_r, children):
                    log.error("embedder process %d exited with status %d before it "
                              "served; stopping", pid, code)
                    return code if code > 0 else 1
                now = time.monotonic()
                restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S]
                if len(restarts) >= MAX_RESTARTS:
                    log.error("embedder processes exited %d times in %.0f s; stopping",
                              len(restarts) + 1, RESTART_WINDOW_S)
                    return 1
                restarts.append(now)
                log.warning("embedder process %d exited with status %d; starting another",
                            pid, code)
                spawn(slot)
    except _Stop:
        status = 0
    finally:
        _shut_down(children, old, metrics_dir)
        os.close(ready_r)
        os.close(ready_w)
    return status


def _read_ready(fd: int, children: dict[int, bool]) -> set[int]:
    """Reads the pids the children wrote to the ready pipe ``fd`` (non-blocking), marks
    those still in ``children`` as serving, and returns every pid read."""
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        data = b""
    pids = {pid for (pid,) in struct.iter_unpack("=i", data[: len(data) // 4 * 4])}
    for pid in pids & children.keys():
        children[pid] = True
    return pids


def _shut_down(children: dict[int, bool], old_handlers: dict, metrics_dir: str) -> None:
    """Stop the children (:func:`_stop_children`), remove the metrics folder, then put
    back ``old_handlers``. A signal meanwhile (a second Ctrl-C; the SIGTERM that a
    multi-threaded parent's PR_SET_PDEATHSIG sends once per thread when it is killed)
    cuts the children's grace short instead of ending this process before it has reaped
    them and removed its folder."""
    hurry = threading.Event()
    for s in old_handlers:
        signal.signal(s, lambda signum, frame: hurry.set())
    try:
        _stop_children(children, hurry)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _stop_children(children: dict[int, bool], hurry: threading.Event | None = None) -> None:
    """SIGTERM every child, SIGKILL what is left after :data:`STOP_GRACE_S` (at once when
    ``hurry`` is set meanwhile), reap all."""
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    while children and time.monotonic() < deadline and not (hurry and hurry.is_set()):
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        children.pop(pid, None)
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        children.pop(pid, None)
