"""Start ``infergate simnode`` processes and drive them from another process: the one
launcher of ``infergate up``, the benchmarks (bench/) and the test fixtures.

Each node runs as ``python -m controlplane.cli simnode ...`` in its own process group
(see :mod:`controlplane.procs`) on a free loopback port, optionally with a second free
port for the control API (``/_sim/*``), which keeps answering while the ``refuse``
fault has closed the main port. Its output goes to ``<log_dir>/<name>.log``.

Typical use::

    nodes = start_nodes([("sim-a", ["--time-scale", "0.05"]), ("sim-b", [])],
                        log_dir=workdir / "logs", into=process_set)
    nodes[0].set_faults(error_rate=1.0)
    nodes[0].state()["requests_total"]
    stop_nodes(nodes)

The nodes of one call start together and are waited for together, each against the
same deadline (no fixed sleep). A node is ready when ``GET /health`` on its main port
gets an HTTP answer (any status: a node started with ``--health-fail`` answers 503 and
is up) and, with a control port, ``GET /_sim/state`` on it answers 200. A node started
with ``--refuse`` is ready on its control port alone. Every HTTP call carries a timeout.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import requests

from controlplane import procs

#: Longest wait for the nodes of one :func:`start_nodes` call to be ready, seconds.
READY_TIMEOUT_S = 30.0
#: Timeout of every HTTP call to a node's control API, seconds.
HTTP_TIMEOUT_S = 5.0
#: Timeout of one readiness probe, seconds.
PROBE_TIMEOUT_S = 1.0


@dataclass
class SimNodeProcess:
    """One running ``infergate simnode`` process.

    ``port`` is the main port (OpenAI API, ``/health``, ``/metrics``, ``/_sim/*``);
    ``control_port`` the extra control-API port, or ``None`` when started without one;
    ``managed`` the process with its log file (``managed.log_path``)."""

    name: str
    host: str
    port: int
    control_port: int | None
    managed: procs.Managed

    @property
    def url(self) -> str:
        """``http://host:port`` of the main port."""
        return f"http://{self.host}:{self.port}"

    @property
    def control_url(self) -> str:
        """``http://host:port`` of the control API: the control port when there is
        one, else the main port."""
        return f"http://{self.host}:{self.control_port or self.port}"

    @property
    def log_path(self) -> Path:
        return self.managed.log_path

    def alive(self) -> bool:
        return self.managed.alive()

    def healthy(self) -> bool:
        """True when ``GET /health`` on the main port answers 200 within
        :data:`PROBE_TIMEOUT_S`; False on any other status or a connection error."""
        try:
            return requests.get(f"{self.url}/health", timeout=PROBE_TIMEOUT_S).status_code == 200
        except requests.RequestException:
            return False

    def set_faults(self, **faults: Any) -> dict:
        """``POST /_sim/faults`` with ``faults`` (any subset: ``error_rate``,
        ``error_status``, ``hang``, ``stall``, ``slowdown``, ``metrics_fail``, ``health_fail``,
        ``refuse``, ``garbage``); returns every fault now in force. Raises
        ``requests.HTTPError`` on a rejected update (e.g. ``refuse`` without a control
        port: 400) and ``requests.RequestException`` when the node does not answer."""
        res = requests.post(f"{self.control_url}/_sim/faults", json=faults,
                            timeout=HTTP_TIMEOUT_S)
        res.raise_for_status()
        return res.json()

    def state(self) -> dict:
        """``GET /_sim/state``: ``running``, ``waiting``, ``requests_total``,
        ``completed_total``, ``cancelled_total``, ``errors_total``, ``by_path``,
        ``listening``, ``faults``, ``prefix_cache``, per-engine numbers (see
        controlplane/simnode/README.md).
        Raises like :meth:`set_faults`."""
        res = requests.get(f"{self.control_url}/_sim/state", timeout=HTTP_TIMEOUT_S)
        res.raise_for_status()
        return res.json()

    def reset(self) -> None:
        """``POST /_sim/reset``: zero the counters and Prometheus metrics and empty the
        prefix caches (faults stay)."""
        requests.post(f"{self.control_url}/_sim/reset", timeout=HTTP_TIMEOUT_S).raise_for_status()

    def ready(self) -> bool:
        """One readiness probe (see the module docstring); never raises."""
        try:
            if self.control_port is not None:
                res = requests.get(f"{self.control_url}/_sim/state", timeout=PROBE_TIMEOUT_S)
                if res.status_code != 200:
                    return False
                if res.json().get("faults", {}).get("refuse"):
                    return True  # the refuse fault keeps the main port closed
            requests.get(f"{self.url}/health", timeout=PROBE_TIMEOUT_S)
            return True
        except (requests.RequestException, ValueError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for :meth:`ready`. Raises :class:`controlplane.procs.StartError` (with
        the log tail) when the process exits first or after ``timeout`` seconds."""
        self.managed.wait_ready(self.ready, timeout)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        self.managed.stop(grace)


NodeT = TypeVar("NodeT", bound=SimNodeProcess)


def option_flags(**opts: Any) -> list[str]:
    """Keyword options as ``infergate simnode`` flags: ``time_scale=0.05`` ->
    ``["--time-scale", "0.05"]``; ``True`` -> the bare flag (``hang=True`` ->
    ``["--hang"]``); ``False`` and ``None`` -> left out."""
    out: list[str] = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def simnode_argv(name: str, port: int, flags: Sequence[str] = (), *, host: str = "127.0.0.1",
                 control_port: int | None = None) -> list[str]:
    """argv of one ``infergate simnode`` with this interpreter: ``--host``, ``--port``,
    ``--control-port`` (when given), ``--name``, then ``flags`` as they are."""
    argv = procs.infergate_argv("simnode", "--host", host, "--port", str(port))
    if control_port is not None:
        argv += ["--control-port", str(control_port)]
    return argv + ["--name", name, *flags]


#: Times a node whose port was taken between the choice and its bind is started again
#: on new ports.
PORT_RETRIES = 3


def _free_port(host: str, taken: set[int]) -> int:
    """A free port of ``host`` not handed out yet by this call (``taken`` grows)."""
    while True:
        port = procs.free_port(host)
        if port not in taken:
            taken.add(port)
            return port


def start_nodes(specs: Iterable[tuple[str, Sequence[str]]], log_dir: Path, *,
                host: str = "127.0.0.1", control: bool = True,
                timeout: float = READY_TIMEOUT_S, into: procs.ProcessSet | None = None,
                cls: type[NodeT] = SimNodeProcess) -> list[NodeT]:  # type: ignore[assignment]
    """Start one node per ``(name, flags)`` of ``specs`` on free ports of ``host``, each
    logging to ``log_dir/<name>.log``, with a control port when ``control``; then wait
    for all of them (``timeout`` seconds in all). ``into``: a process set each node is
    added to as soon as it is started (so whoever owns the set stops it, even when the
    wait is interrupted). ``cls``: the :class:`SimNodeProcess` subclass to return.

    Returns the nodes in the order of ``specs``. A node that exits because its port was
    taken meanwhile ("address already in use": a free port is only free when chosen) is
    started again on new ports, up to :data:`PORT_RETRIES` times. On any other failure (a
    node exits early, is not ready in time, Ctrl-C) every node of this call is stopped
    and the error (:class:`controlplane.procs.StartError` for the first two) propagates."""
    specs = list(specs)  # iterated twice: to start, then to wait
    started: list[NodeT] = []
    taken: set[int] = set()

    def launch(name: str, flags: Sequence[str]) -> NodeT:
        port = _free_port(host, taken)
        cport = _free_port(host, taken) if control else None
        argv = simnode_argv(name, port, flags, host=host, control_port=cport)
        m = procs.Managed(name, argv, log_dir / f"{name}.log").start()
        if into is not None:
            into.add(m)
        return cls(name=name, host=host, port=port, control_port=cport, managed=m)

    try:
        for name, flags in specs:
            started.append(launch(name, flags))
        deadline = time.monotonic() + timeout
        for i, (name, flags) in enumerate(specs):
            for again in range(PORT_RETRIES + 1):
                try:
                    started[i].wait_ready(max(0.1, deadline - time.monotonic()))
                    break
                except procs.StartError:
                    # a free port taken by another process before the node bound it:
                    # new ports (a node that failed otherwise fails the call)
                    if again == PORT_RETRIES or started[i].managed.alive() or \
                            "address already in use" not in started[i].managed.log_tail():
                        raise
                    started[i] = launch(name, flags)
    except BaseException:
        stop_nodes(started)
        raise
    return started


def start_node(name: str, log_dir: Path, *flags: str, host: str = "127.0.0.1",
               control: bool = True, timeout: float = READY_TIMEOUT_S,
               into: procs.ProcessSet | None = None,
               cls: type[NodeT] = SimNodeProcess) -> NodeT:  # type: ignore[assignment]
    """One node: ``start_nodes([(name, flags)], log_dir, ...)[0]``."""
    return start_nodes([(name, flags)], log_dir, host=host, control=control, timeout=timeout,
                       into=into, cls=cls)[0]


def stop_nodes(nodes: Sequence[SimNodeProcess], grace: float = 5.0) -> None:
    """SIGTERM every node first, then wait for each (SIGKILL after ``grace`` seconds):
    the nodes stop together, not one grace period after another."""
    for n in nodes:
        n.managed.signal(signal.SIGTERM)
    for n in reversed(nodes):
        n.managed.stop(grace)

