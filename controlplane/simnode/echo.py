"""The simulated node's answer on the API routes beyond completions (responses, rerank,
score, audio, tokenizer): a small JSON echo of what arrived, enough to test that a
proxy sends each request, unchanged, to a node serving its model.

``POST`` on any of :data:`ECHO_PATHS` answers 200 ``{"object": "simnode.echo", "node",
"method", "path", "model", "content_type", "body_bytes"}``: ``model`` from the JSON
body's ``"model"`` or the ``model`` field of a multipart/form-data body (None without
one), ``body_bytes`` the size of the body as received. A model other than the node's
gets 404 ``model_not_found`` (as vLLM answers), a JSON body that is not valid JSON 400.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from controlplane.simnode import wire

#: Paths answered by :func:`echo` (vLLM and llama.cpp serve them).
ECHO_PATHS = ("/v1/responses", "/v1/rerank", "/rerank", "/v1/score",
              "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech",
              "/tokenize", "/detokenize")


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


async def _model_of(request: web.Request) -> tuple[str | None, int, web.Response | None]:
    """The request's model (None without one), the body's size, or an error answer."""
    ctype = request.content_type
    if ctype == "multipart/form-data":
        form = await request.post()
        value = form.get("model")
        return (value if isinstance(value, str) else None), request.content_length or 0, None
    raw = await request.read()
    if "json" in ctype or raw.lstrip().startswith(b"{"):
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            return None, len(raw), _json(wire.error_body(f"invalid JSON: {exc}"), 400)
        model = doc.get("model") if isinstance(doc, dict) else None
        return (model if isinstance(model, str) else None), len(raw), None
    return None, len(raw), None


def add_routes(app: web.Application, name: str, served_model: str) -> None:
    """Register :data:`ECHO_PATHS` on ``app`` for node ``name`` serving ``served_model``."""

    async def echo(request: web.Request) -> web.Response:
        model, size, err = await _model_of(request)
        if err is not None:
            return err
        if model is not None and model != served_model:
            return _json(wire.error_body(f"The model `{model}` does not exist.",
                                         code="model_not_found"), 404)
        return _json({"object": "simnode.echo", "node": name, "method": request.method,
                      "path": request.path, "model": model,
                      "content_type": request.content_type, "body_bytes": size})

    for path in ECHO_PATHS:
        app.router.add_post(path, echo)
