"""The models each node serves, for model-aware routing (``models`` of a snapshot node).

Where a node's served models come from, first match wins:

1. its configured ``models = [...]`` (``[[nodes]]``, the admin API, the CLI);
2. its ``GET /v1/models`` (OpenAI list: ``{"data": [{"id": ...}, ...]}``), read when the
   node is first seen (added at run time, or at start) and then every
   ``controlplane.models_refresh_s`` (60 s), each request bounded by
   ``controlplane.models_timeout_s`` for connect and the whole body. Only for nodes with
   :meth:`~controlplane.config.NodeSettings.polls_models` (not kind ``openai`` unless
   ``poll_models = true``: llama-cpp-python's ``/v1/models`` waits for the model lock and
   can end the stream holding it). These requests run on their own small thread pool,
   apart from the health and metrics polls, and the poll cycle never waits for them: it
   uses the last answer it has;
3. otherwise unknown (``None``): the edge may send the node any model.

A node whose list says it is a single-model llama.cpp server (one entry, ``owned_by``
``"llamacpp"``, without the ``status`` that its router mode gives each model: llama.cpp
tools/server, ``/v1/models``) answers whatever ``model`` a request names, with its one
model, as a client talking to it directly sees (the OpenAI SDKs need some name, and
"gpt-3.5-turbo" or "local" are common). Such a node **takes any model**
(:meth:`ModelsPoller.takes_any_model`, ``models_any`` in the snapshot): the edge sends
it a model no node lists, instead of answering 404, and still sends the models other
nodes list only to them.

A failed or unparseable answer keeps the last known list (a node that never answered
stays unknown) and is tried again after ``RETRY_S`` (at most ``models_refresh_s``).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from controlplane.config import NodeSettings
from controlplane.routing.background import BackgroundReader
from controlplane.routing.nodeaccess import AccessTable

__all__ = ["MAX_MODELS", "ModelsPoller", "RETRY_S", "parse_models", "takes_any_model"]

#: Seconds before a failed ``/v1/models`` read is tried again (capped at the refresh).
RETRY_S = 10.0
#: Most model ids kept per node (the rest of a longer list is ignored).
MAX_MODELS = 256


def parse_models(body: str) -> list[str]:
    """Model ids of an OpenAI ``GET /v1/models`` answer, in order, without duplicates
    (at most :data:`MAX_MODELS`). Raises ``ValueError`` when the body is not such a
    list (not JSON, no ``data`` array, an entry without a string ``id``)."""
    doc = json.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no \"data\" array")
    out: list[str] = []
    for item in data:
        mid = item.get("id") if isinstance(item, dict) else None
        if not isinstance(mid, str) or not mid:
            raise ValueError("a model entry without a string \"id\"")
        if mid not in out and len(out) < MAX_MODELS:
            out.append(mid)
    return out


def takes_any_model(body: str) -> bool:
    """Whether an OpenAI ``GET /v1/models`` answer comes from a single-model llama.cpp
    server, which serves any ``model`` a request names (see the module docstring): one
    entry, ``"owned_by": "llamacpp"``, no ``status`` (llama.cpp's router mode lists each
    model with a ``status`` and routes by name). ``False`` for anything else, also a body
    that is not such a list."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
        return False
    return data[0].get("owned_by") == "llamacpp" and "status" not in data[0]


@dataclass
class _Entry:
    target: str
    """URL of the node's models endpoint (a new URL starts afresh)."""
    due: float = 0.0
    """monotonic time of the next read."""
    models: list[str] | None = None
    """Last list read; ``None`` = never read successfully."""
    any_model: bool = False
    """The last list read says the node takes any model (:func:`takes_any_model`)."""
    error: str | None = None
    read_at: float | None = None
    """Epoch s of the last successful read."""
    running: Future | None = field(default=None, repr=False)


class ModelsPoller(BackgroundReader):
    """Served models per node (rules in the module docstring). :meth:`served` is called
    by the poll cycle and never blocks on a node; thread-safe."""

    def __init__(self, refresh_s: float, timeout_s: float, max_workers: int = 4,
                 clock=time.monotonic, access: AccessTable | None = None):
        super().__init__("models", refresh_s, timeout_s, max_workers, clock, access)

    def _read(self, url: str) -> tuple[tuple[list[str], bool] | None, str | None]:
        res = self._http.get(url)
        if not res.ok or res.body is None:
            return None, res.error or f"HTTP {res.status}"
        try:
            return (parse_models(res.body), takes_any_model(res.body)), None
        except ValueError as exc:
            return None, f"not an OpenAI model list: {str(exc)[:120]}"

    def served(self, node: NodeSettings) -> list[str] | None:
        """The node's served model ids, ``None`` when unknown. Starts a background read
        of ``/v1/models`` when one is due (the result shows from a later call)."""
        if node.models:
            return list(node.models)
        if not node.polls_models():
            with self._lock:
                self._entries.pop(node.name, None)
            return None
        url = node.url + "/v1/models"
        now = self._clock()
        with self._lock:
            e = self._entries.get(node.name)
            if e is None or e.target != url:
                e = self._entries[node.name] = _Entry(target=url)
            if e.running is not None and e.running.done():
                try:
                    read, err = e.running.result()
                except Exception as exc:  # noqa: BLE001 - a read never breaks the cycle
                    read, err = None, f"{type(exc).__name__}: {exc}"
                e.running = None
                if read is not None:
                    e.models, e.any_model = read
                    e.error, e.read_at = None, time.time()
                    e.due = now + self.refresh_s
                else:
                    e.error = err
                    e.due = now + min(RETRY_S, self.refresh_s)
            if e.running is None and now >= e.due:
                e.running = self._pool.submit(self._read, url)
            return None if e.models is None else list(e.models)

    def takes_any_model(self, node: NodeSettings) -> bool:
        """Whether the node takes any model (:func:`takes_any_model` of its last
        ``/v1/models`` read); never for a node with configured ``models``, whose list is
        what it may be sent."""
        if node.models:
            return False
        with self._lock:
            e = self._entries.get(node.name)
            return bool(e and e.models is not None and e.any_model)

    def error(self, name: str) -> str | None:
        """Why the last read of node ``name`` failed (``None``: it did not, or none yet)."""
        with self._lock:
            e = self._entries.get(name)
            return e.error if e else None

