"""The nodes of the stack: the simulated pool, or the real servers named by ``--node``."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import ValidationError

from controlplane import procs
from controlplane.admin.ops import validation_message
from controlplane.config import NodeSettings
from controlplane.simnode import launch
from controlplane.simnode.engine import EngineConfig

from .common import START_ATTEMPTS


#: (name, speed factor) of the simulated pool: a fast, a medium and a slow GPU.
SIM_NODES: tuple[tuple[str, float], ...] = (("sim-fast", 2.0), ("sim-medium", 1.0), ("sim-slow", 0.5))

#: The simulated nodes' batch slots (their ``--max-running``, vLLM's ``--max-num-seqs``),
#: given to the edge as ``max_concurrency`` as an operator gives a vLLM node's: the slots
#: are then known, so requests beyond them wait at the edge and the fair share applies.
SIM_SLOTS: int = EngineConfig().max_running


def _sim_nodes(workdir: Path, stack: procs.ProcessSet, time_scale: float,
               skip: frozenset[str] = frozenset()) -> list[NodeSettings]:
    """Start the :data:`SIM_NODES` (but those named in ``skip``: removed at run time by an
    earlier run on the folder) on free loopback ports (no control port, logs in
    ``workdir/logs``), added to ``stack``, each with :data:`SIM_SLOTS` batch slots and
    the same ``max_concurrency``; wait for them (20 s). Raises
    :class:`controlplane.procs.StartError` when one does not come up."""
    specs = [(name, ["--speed", str(speed), "--time-scale", str(time_scale),
                      "--max-running", str(SIM_SLOTS)])
             for name, speed in SIM_NODES if name not in skip]
    if not specs:
        return []
    instance = procs.instance_id()
    last: procs.StartError | None = None
    for _ in range(START_ATTEMPTS):  # new free ports when another process took one first
        n0 = len(stack.items)
        try:
            sims = launch.start_nodes(specs, workdir / "logs", control=False, timeout=20,
                                      into=stack)
        except procs.StartError as exc:
            del stack.items[n0:]  # stopped by start_nodes
            last = exc
            continue
        # a port another process bound in between answers with its id (or none)
        strangers = [s for s in sims
                     if procs.http_instance(f"{s.url}/health") != instance or not s.alive()]
        if not strangers:
            return [NodeSettings(name=s.name, url=s.url, kind="vllm", max_concurrency=SIM_SLOTS)
                    for s in sims]
        launch.stop_nodes(sims)
        del stack.items[n0:]
        last = procs.StartError(f"{strangers[0].name}: port {strangers[0].port} is held by "
                                "another process")
    assert last is not None
    raise last


def _real_nodes(urls: tuple[str, ...], kind: str, health_path: str | None = None,
                max_concurrency: int | None = None) -> list[NodeSettings]:
    extra: dict = {}
    if health_path is not None:
        extra["health_path"] = health_path
    if max_concurrency is not None:
        extra["max_concurrency"] = max_concurrency
    nodes = []
    for i, url in enumerate(urls, 1):
        try:
            nodes.append(NodeSettings(name=f"node-{i}", url=url, kind=kind, **extra))  # type: ignore[arg-type]
        except ValidationError as exc:
            raise click.BadParameter(f"--node {url}: {validation_message(exc)}") from None
    return nodes


def _first_model(nodes: list[NodeSettings], timeout: float = 2.0) -> str | None:
    """A model the nodes serve, for the banner's example: the first configured ``models``
    entry, else the first id a node lists on its OpenAI-style ``GET /v1/models``
    (read as the control plane reads it: :func:`controlplane.routing.models.parse_models`),
    asked only of nodes whose models the control plane polls too
    (:meth:`NodeSettings.polls_models`: never llama-cpp-python's, which can end a running
    stream); None when none says."""
    import requests

    from controlplane.routing.models import parse_models

    for n in nodes:
        if n.models:
            return n.models[0]
    for n in nodes:
        if not n.polls_models():
            continue
        try:
            res = requests.get(n.url.rstrip("/") + "/v1/models", timeout=timeout)
            ids = parse_models(res.text) if res.status_code == 200 else []
        except (requests.RequestException, ValueError):
            continue
        if ids:
            return ids[0]
    return None
