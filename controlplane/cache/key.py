"""Response-cache keys: the exact key and the semantic namespace of a request.

The edge computes the same keys in Lua (``lua/infergate/cache/key.lua``); tests feed both
many bodies and compare (``tests/parity/test_cache_keys.py``). Both follow this specification.

**Exact key** = SHA-256 hex (64 lowercase digits) of the canonical text of the document
``{"v": 1, "kind": "exact", "tenant": <tenant>, "path": <path>, "body": <body>}`` where
``body`` is the request body (a JSON object) without the fields that do not change the
answer: ``stream``, ``stream_options`` and ``user``. Everything else counts: ``model``,
every message with its role and content parts, sampling parameters (``temperature``,
``top_p``, ``max_tokens``, ``max_completion_tokens``, ``n``, ``seed``, ``stop``, penalties,
``logit_bias``, ``logprobs``, ``top_logprobs``), ``tools``, ``tool_choice``,
``response_format`` and any unknown extra field. A parameter left out and the same
parameter sent with its default value give different keys (a safe miss). A streamed and a
non-streamed request that are otherwise identical share the key (and the entry).

**Semantic namespace** = SHA-256 hex of the same document with ``"kind": "namespace"`` and
the text of the last user message taken out: for ``/v1/chat/completions`` the ``content``
of the last message set to null, only when that last message has role ``user``; for
``/v1/completions`` the ``prompt`` set to null, only when it is a string. The removed text
is what the embedder embeds (``semantic_text``); text parts of a content list are joined
with ``"\\n"``. Requests without such a last user text have no namespace (exact cache only).

**Canonical text** (JSON, but with one fixed spelling, so Lua and Python agree byte for byte):

- objects: members sorted by key (UTF-8 byte order = code point order), ``{"k":v,...}``,
  no spaces;
- arrays: ``[v,...]``; an empty object and an empty array are both written ``[]`` (the
  edge's JSON decoder cannot tell them apart);
- strings (values and keys): first in Unicode normalisation form C (NFC), then ``"`` +
  the text with ``"`` -> ``\\"``, ``\\`` -> ``\\\\`` and the bytes
  0x00-0x1F -> ``\\u00xx`` (lowercase hex) + ``"``; every other character as its raw
  UTF-8 bytes;
- numbers: a whole number with absolute value below 2^53 is written as an integer (``1.0``
  and ``1`` are the same, ``-0`` is ``0``); any other number as C ``%.17g`` of the double.
  A body (outside the excluded fields) holding a number of absolute value 2^53 or more has
  no key at all and is not cached: the edge decodes numbers as doubles, which cannot tell
  ``"seed": 9007199254740993`` from ``9007199254740992``;
- ``true``, ``false``, ``null``.

**Unicode:** every string is NFC-normalised before it is written, so a precomposed ``é``
(U+00E9) and ``e`` + U+0301 give the same keys. Python uses ``unicodedata.normalize``;
the edge calls GLib's ``g_utf8_normalize`` through the FFI (``lua/infergate/core/unicode.lua``;
Debian package ``libglib2.0-0``). Members are sorted by their key as sent, then written
normalised (both sides do the same). Before normalising, both sides bring a string to
its stream-safe form (Unicode UAX #15, section 13: U+034F COMBINING GRAPHEME JOINER
before the 31st non-starter of a run, :func:`stream_safe`), which bounds the cost of
GLib's canonical reordering, quadratic in the length of a run of marks; text without
such runs is unchanged by it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any

from controlplane.errors import InfergateError

#: Request fields that never change the answer; left out of every key.
EXCLUDED_FIELDS: frozenset[str] = frozenset({"stream", "stream_options", "user"})
#: Paths whose answers are cached.
CACHEABLE_PATHS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
SCHEMA = 1
#: A last user text made only of these characters has no namespace.
ASCII_SPACE = " \t\n\r\f\v"
_MAX_SAFE = 2.0 ** 53


def _num(x: int | float) -> str:
    if isinstance(x, int):
        if abs(x) < _MAX_SAFE:
            return str(x)
        try:
            f = float(x)
        except OverflowError:  # beyond a double: the edge's decoder reads +-inf
            f = math.inf if x > 0 else -math.inf
    else:
        f = x
    if math.isfinite(f) and f == math.floor(f) and abs(f) < _MAX_SAFE:
        return str(int(f))
    return format(f, ".17g")


#: Longest run of non-starters (canonical combining class > 0) kept as it is.
MAX_NONSTARTERS = 30
_CGJ = "\u034f"


@functools.lru_cache(maxsize=4096)
def _nonstarters(ch: str) -> tuple[int, int, bool, int]:
    """Leading and trailing non-starters of ``ch``'s canonical decomposition, whether all
    of it is non-starters, and its length (UAX #15's counts; U+0F75 decomposes into two
    marks although it is a starter itself)."""
    d = unicodedata.normalize("NFD", ch)
    lead = next((i for i, c in enumerate(d) if not unicodedata.combining(c)), len(d))
    trail = next((i for i, c in enumerate(reversed(d)) if not unicodedata.combining(c)), len(d))
    return lead, trail, lead == len(d), len(d)


def stream_safe(s: str) -> str:
    """``s`` with U+034F inserted before every character whose leading non-starters would
    make a run of non-starters (counted in the characters' decompositions) longer than
    :data:`MAX_NONSTARTERS` (UAX #15 stream-safe text format); ``s`` itself when no run is
    that long."""
    run, out, last = 0, [], 0
    for i, ch in enumerate(s):
        if ch < "\u00c0":
            run = 0
            continue
        lead, trail, whole, n = _nonstarters(ch)
        if run + lead > MAX_NONSTARTERS:
            out.append(s[last:i])
            out.append(_CGJ)
            last, run = i, 0
        run = run + n if whole else trail
    if not out:
        return s
    out.append(s[last:])
    return "".join(out)


def _str(s: str) -> str:
    if not s.isascii():
        s = unicodedata.normalize("NFC", stream_safe(s))
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def canonical(value: Any) -> str:
    """The canonical text of a decoded JSON value (see the module docstring).

    Raises ``TypeError`` for values JSON cannot hold."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return _num(value)
    if isinstance(value, str):
        return _str(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "[]"
        items = sorted(value.items(), key=lambda kv: kv[0])
        return "{" + ",".join(_str(k) + ":" + canonical(v) for k, v in items) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def sha256_hex(text: str) -> str:
    """SHA-256 of the UTF-8 bytes of ``text``, 64 lowercase hex digits."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _text_of(content: Any) -> str | None:
    """The text of a message content: the string, or the text parts joined with newlines
    (``None`` when there is no text part)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content
                 if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
        return "\n".join(texts) if texts else None
    return None


@dataclass(frozen=True)
class CacheKeys:
    """Keys of one request: ``exact`` (hex), ``namespace`` (hex or ``None``) and
    ``semantic_text`` (the last user text the embedder embeds, or ``None``)."""

    exact: str
    namespace: str | None
    semantic_text: str | None


class UnkeyableBody(InfergateError, ValueError):
    """The body holds a number of absolute value 2^53 or more: the edge decodes numbers
    as doubles, where ``9007199254740993`` and ``9007199254740992`` are the same, so it
    cannot key such a request apart from its neighbours and does not cache it."""


def _inexact(value: Any) -> bool:
    """Whether ``value`` holds a number (bools aside) of absolute value 2^53 or more."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, (int, float)):
            if not abs(v) < _MAX_SAFE:
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return False


def keys_for(path: str, body: dict, tenant: str = "default") -> CacheKeys:
    """The cache keys of a request body (a decoded JSON object) sent to ``path`` by
    ``tenant`` ("default" when auth is off). Raises ``TypeError`` when ``body`` is not a
    dict, :class:`UnkeyableBody` when it holds a number of absolute value 2^53 or more
    (not cached by the edge)."""
    if not isinstance(body, dict):
        raise TypeError("request body must be a JSON object")
    kept = {k: v for k, v in body.items() if k not in EXCLUDED_FIELDS}
    if _inexact(kept):
        raise UnkeyableBody("a number of absolute value 2^53 or more cannot be keyed exactly")
    exact = sha256_hex(canonical({"v": SCHEMA, "kind": "exact", "tenant": tenant,
                                  "path": path, "body": kept}))
    ns_body: dict | None = None
    text: str | None = None
    if path == "/v1/chat/completions":
        msgs = kept.get("messages")
        if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) \
                and msgs[-1].get("role") == "user":
            text = _text_of(msgs[-1].get("content"))
            if text is not None:
                last = {**msgs[-1], "content": None}
                ns_body = {**kept, "messages": [*msgs[:-1], last]}
    elif path == "/v1/completions":
        prompt = kept.get("prompt")
        if isinstance(prompt, str):
            text = prompt
            ns_body = {**kept, "prompt": None}
    if ns_body is None or text is None or not text.strip(ASCII_SPACE):
        return CacheKeys(exact, None, None)
    ns = sha256_hex(canonical({"v": SCHEMA, "kind": "namespace", "tenant": tenant,
                               "path": path, "body": ns_body}))
    return CacheKeys(exact, ns, text)


def keys_for_json(path: str, raw: str | bytes, tenant: str = "default") -> CacheKeys:
    """:func:`keys_for` of a JSON text. Raises ``ValueError`` for invalid JSON or a
    body that is not an object."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return keys_for(path, body, tenant)
