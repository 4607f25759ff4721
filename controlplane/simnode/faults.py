"""Faults of the simulated node, switchable at run time (``POST /_sim/faults``) or at
start (CLI flags)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.errors import InfergateError


class Faults(BaseModel):
    """The current faults. Every field has a harmless default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability (0-1) that an inference request is answered with ``error_status``."""
    error_status: int = Field(default=500, ge=400, le=599)
    """HTTP status of injected errors (OpenAI-style JSON body)."""
    hang: bool = False
    """Accept inference requests and never answer; hold them until the client leaves."""
    stall: bool = False
    """As ``hang``, but a streaming request gets its headers (200, ``text/event-stream``)
    at once and then no chunk: vLLM, SGLang and TGI send a stream's headers before the
    engine has the request, so an engine that hangs behind a live HTTP server looks like
    this."""
    slowdown: float = Field(default=1.0, ge=1.0, le=1000.0)
    """Factor (>= 1) applied to every engine step duration."""
    metrics_fail: bool = False
    """``GET /metrics`` answers 500."""
    health_fail: bool = False
    """``GET /health`` answers 503."""
    refuse: bool = False
    """Stop listening on the main port (connects get ECONNREFUSED) until set false."""
    garbage: bool = False
    """Answer inference requests with bytes that are not HTTP, then close."""
    sse_error: bool = False
    """A stream gets its headers (200) and role chunk, then an in-band error
    (``data: {"error": {...}}`` and ``data: [DONE]``, as vLLM sends when generation fails
    after the stream started) before any content."""
    reset_after_tokens: int = Field(default=0, ge=0, le=1_000_000)
    """A stream's connection is reset (TCP RST) after this many content tokens; 0 = off."""


class FaultsError(InfergateError, ValueError):
    """An invalid fault update; the message lists the bad fields."""


def apply_update(current: Faults, update: Any) -> Faults:
    """``current`` with the fields of ``update`` (a JSON object, any subset) replaced.

    Raises :class:`FaultsError` for a non-object, an unknown field or an out-of-range
    value; ``current`` is never modified."""
    if not isinstance(update, dict):
        raise FaultsError("faults must be a JSON object")
    try:
        return Faults.model_validate({**current.model_dump(), **update})
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ())) or "faults"
            parts.append(f"{loc}: {err.get('msg')}")
        raise FaultsError("; ".join(parts)) from None
