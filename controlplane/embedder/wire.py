"""Validation of the embedder's request bodies and index-queue items.

Every function takes the decoded JSON value and returns a typed value or raises
:class:`BadRequest` naming the field (``param``) and what is expected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from controlplane.embedder.index import IndexItem
from controlplane.errors import InfergateError

HEX_RE = re.compile(r"^[0-9a-f]{16,128}\Z")
"""Exact keys and namespaces: lowercase hex (the edge sends SHA-256 hex, 64 digits)."""
MAX_TTL_S = 366 * 24 * 3600
MAX_LABEL_CHARS = 256
MAX_EMBED_INPUTS = 256


class BadRequest(InfergateError, ValueError):
    """Invalid request; ``param`` is the offending field (None for the body itself)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _obj(body: Any) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _hex(body: dict, name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not HEX_RE.match(v):
        raise BadRequest(f"{name}: 16 to 128 lowercase hex digits", name)
    return v


def _utf8(v: str) -> bool:
    """Whether ``v`` can be written as UTF-8: JSON's ``"\\ud800"`` decodes to a lone
    surrogate, which cannot."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(body: dict, name: str = "text") -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v.strip():
        raise BadRequest(f"{name}: a non-empty string", name)
    if not _utf8(v):
        raise BadRequest(f"{name}: text with a lone surrogate (\\ud800-\\udfff) is not "
                         "Unicode text", name)
    return v


def _label(body: dict, name: str) -> str:
    v = body.get(name, "")
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > MAX_LABEL_CHARS or not _utf8(v):
        raise BadRequest(f"{name}: a string of at most {MAX_LABEL_CHARS} characters", name)
    return v


@dataclass(frozen=True)
class LookupRequest:
    namespace: str
    text: str
    min_similarity: float | None
    guard: bool
    route: str = ""
    model: str = ""


def lookup_request(body: Any) -> LookupRequest:
    """``{"namespace": hex, "text": str, "min_similarity"?: 0-1, "guard"?: bool,
    "route"?: str, "model"?: str}``.

    ``min_similarity`` absent or null means the default; 0 is a valid threshold. ``route``
    (request path) and ``model`` (requested model), at most 256 characters each, select a
    configured semantic domain."""
    b = _obj(body)
    ms = b.get("min_similarity")
    if ms is not None:
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) \
                or not 0.0 <= ms <= 1.0:
            raise BadRequest("min_similarity: a number from 0 to 1", "min_similarity")
        ms = float(ms)
    g = b.get("guard", True)
    if g is None:
        g = True
    if not isinstance(g, bool):
        raise BadRequest("guard: true or false", "guard")
    return LookupRequest(_hex(b, "namespace"), _text(b), ms, g, _label(b, "route"),
                         _label(b, "model"))


#: Most lookups in one ``POST /v1/lookups`` body.
MAX_LOOKUPS = 64


def lookup_batch(body: Any) -> list[LookupRequest | BadRequest]:
    """``{"lookups": [<lookup_request body>, ...]}`` (1 to :data:`MAX_LOOKUPS` items): each
    item parsed by :func:`lookup_request`, a malformed one given as its
    :class:`BadRequest` in its place (the others are still answered). Raises
    :class:`BadRequest` when ``lookups`` is not such a list."""
    b = _obj(body)
    items = b.get("lookups")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_LOOKUPS:
        raise BadRequest(f"lookups: a list of 1 to {MAX_LOOKUPS} lookups", "lookups")
    out: list[LookupRequest | BadRequest] = []
    for item in items:
        try:
            out.append(lookup_request(item))
        except BadRequest as exc:
            out.append(exc)
    return out


def index_item(body: Any) -> IndexItem:
    """``{"key": hex, "namespace": hex, "text": str, "ttl_s": int > 0, "model"?: str,
    "tenant"?: str, "route"?: str}`` (an index-queue item or a ``POST /v1/index`` body;
    ``route`` and ``model`` select the semantic domain, as in a lookup)."""
    b = _obj(body)
    ttl = b.get("ttl_s")
    if isinstance(ttl, float) and ttl.is_integer():
        ttl = int(ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= MAX_TTL_S:
        raise BadRequest(f"ttl_s: a whole number of seconds from 1 to {MAX_TTL_S}", "ttl_s")
    return IndexItem(key=_hex(b, "key"), namespace=_hex(b, "namespace"), text=_text(b),
                     ttl_s=ttl, model=_label(b, "model"), tenant=_label(b, "tenant"),
                     route=_label(b, "route"))


def embeddings_request(body: Any) -> tuple[list[str], str]:
    """OpenAI ``{"input": str | [str, ...], "encoding_format"?: "float" | "base64"}``."""
    b = _obj(body)
    inp = b.get("input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp or len(inp) > MAX_EMBED_INPUTS \
            or not all(isinstance(x, str) and _utf8(x) for x in inp):
        raise BadRequest(f"input: a string or a list of 1 to {MAX_EMBED_INPUTS} strings "
                         "(token arrays are not supported)", "input")
    fmt = b.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest("encoding_format: float or base64", "encoding_format")
    return inp, fmt
