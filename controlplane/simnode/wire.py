"""OpenAI wire shapes of the simulated node: request validation and response bodies.

Pure functions. Request parsing raises :class:`ApiError` (status + OpenAI-style error
body ``{"error": {"message", "type", "param", "code"}}``) for anything a real
OpenAI-compatible server would refuse.

Shapes follow the OpenAI API reference for ``/v1/chat/completions`` and
``/v1/completions`` (objects ``chat.completion``, ``chat.completion.chunk``,
``text_completion``); streaming uses server-sent events ``data: {json}\\n\\n`` ending
with ``data: [DONE]\\n\\n``, and ``stream_options.include_usage`` adds a last chunk
with ``choices: []`` and the usage (other chunks then carry ``"usage": null``).

Usage carries ``prompt_tokens_details: {"cached_tokens": n}``, the prompt tokens the
engine found in its prefix cache, in non-streaming bodies and in the usage chunk, as
vLLM does with ``--enable-prompt-tokens-details`` (``PromptTokenUsageInfo``) and as
the OpenAI API always does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from controlplane.simnode import prefix, textgen
from controlplane.errors import InfergateError

Kind = Literal["chat", "completion"]
FinishReason = Literal["stop", "length"]

#: Upper bound of the extra body field ``sim_output_tokens``.
MAX_SIM_OUTPUT_TOKENS = 1_000_000


class ApiError(InfergateError):
    """An HTTP error answer with an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class InferenceRequest:
    """A validated inference request."""

    kind: Kind
    model: str
    prompt_key: str
    """Canonical text the output is derived from (same prompt -> same key)."""
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    sim_output_tokens: int | None
    block_hashes: tuple[bytes, ...] = ()
    continued: str = ""
    """Text of a final assistant message this request continues (chat with
    ``continue_final_message: true``, vLLM's and SGLang's contract): the answer is the rest
    of the text the node produces for the messages before it."""
    """Chained hashes of the full prompt blocks (:func:`prefix.block_hashes` of the
    templated chat text or of the prompt, at most ``prompt_tokens // BLOCK_TOKENS``)."""


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _opt_positive_int(body: dict[str, Any], name: str, upper: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (upper is not None and v > upper):
        bound = f" and <= {upper}" if upper is not None else ""
        raise _bad(f"'{name}' must be an integer >= 1{bound}", name)
    return v


def _content_text(content: Any, index: int) -> str:
    """Text of one message's ``content``: a string, null, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _bad(f"messages[{index}].content: each part must be an object with a 'type'",
                           "messages")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{index}].content: a text part needs a string 'text'",
                               "messages")
                parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{index}].content must be a string, a list of parts or null", "messages")


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object from a request body; :class:`ApiError` 400 otherwise."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object")
    return body


def parse_request(kind: Kind, body: dict[str, Any], served_model: str) -> InferenceRequest:
    """Validate a chat or completions request body.

    Errors (:class:`ApiError`): 400 for a missing or malformed ``messages`` /
    ``prompt``, bad ``max_tokens`` / ``max_completion_tokens`` / ``stream`` /
    ``stream_options`` / ``n`` / ``sim_output_tokens``; 404 ``model_not_found`` when
    ``model`` is given and is not ``served_model``. A missing ``model`` means the
    served one (as vLLM does)."""
    model = body.get("model")
    if model is None:
        model = served_model
    elif not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    elif model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")

    if kind == "chat":
        messages = body.get("messages")
        if messages is None:
            raise _bad("'messages' is a required property", "messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty array", "messages")
        canon: list[list[str]] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
            canon.append([m["role"], _content_text(m.get("content"), i)])
        continued = ""
        if body.get("continue_final_message") is True and len(canon) > 1 \
                and canon[-1][0] == "assistant":
            continued = canon.pop()[1]
        text = "".join(c[1] for c in canon)
        hashed = prefix.chat_template((role, content) for role, content in canon)
        key = "chat:" + json.dumps(canon, ensure_ascii=False, separators=(",", ":"))
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise _bad("'prompt' is a required property", "prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise _bad("'prompt' must be a string or a list of exactly one string", "prompt")
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string", "prompt")
        text = hashed = prompt
        key = "completion:" + prompt

    mct = _opt_positive_int(body, "max_completion_tokens")
    mt = _opt_positive_int(body, "max_tokens")
    max_tokens = mct if mct is not None else mt
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = iu
    sim_n = _opt_positive_int(body, "sim_output_tokens", MAX_SIM_OUTPUT_TOKENS)
    prompt_tokens = textgen.estimate_tokens(text)
    hashes = prefix.block_hashes(hashed, prompt_tokens // prefix.BLOCK_TOKENS)
    return InferenceRequest(kind=kind, model=model, prompt_key=key,
                            prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                            stream=stream, include_usage=include_usage, sim_output_tokens=sim_n,
                            block_hashes=hashes,
                            continued=continued if kind == "chat" else "")


@dataclass(frozen=True)
class Plan:
    """What the node will generate for a request."""

    tokens: list[str]
    """The tokens that will be sent (already cut at max_tokens)."""
    finish_reason: FinishReason


def continued_tokens(req: InferenceRequest, tokens: list[str]) -> int:
    """How many of ``tokens`` (the full answer) the continued text already holds: the
    longest run of leading tokens whose text is a prefix of it."""
    if not req.continued:
        return 0
    n, text = 0, ""
    for tok in tokens:
        if not req.continued.startswith(text + tok):
            break
        text += tok
        n += 1
    return n


def plan_length(req: InferenceRequest, min_tokens: int, max_tokens: int) -> tuple[int, FinishReason]:
    """Number of tokens that will be sent and the finish reason for ``req``.

    The natural length is ``sim_output_tokens`` or the prompt-hash length in
    ``[min_tokens, max_tokens]``; ``finish_reason`` is ``length`` when ``max_tokens``
    of the request cuts it (natural length >= max_tokens), else ``stop``."""
    natural = req.sim_output_tokens or textgen.output_length(req.prompt_key, min_tokens, max_tokens)
    if req.continued:
        natural -= continued_tokens(req, textgen.generate_tokens(req.prompt_key, natural))
    if req.max_tokens is not None and natural >= req.max_tokens:
        return req.max_tokens, "length"
    return max(natural, 1), "stop"


def plan_output(req: InferenceRequest, min_tokens: int, max_tokens: int) -> Plan:
    """Tokens and finish reason for ``req`` (see :func:`plan_length`). The tokens are
    the first ones of the natural-length text, so a cut answer is a prefix of the
    full one."""
    n, reason = plan_length(req, min_tokens, max_tokens)
    natural = req.sim_output_tokens or textgen.output_length(req.prompt_key, min_tokens, max_tokens)
    full = textgen.generate_tokens(req.prompt_key, natural)
    skip = continued_tokens(req, full)
    return Plan(tokens=full[skip:skip + n], finish_reason=reason)


def context_error(req: InferenceRequest, completion_tokens: int, capacity: int) -> ApiError:
    """400 for a request longer than the KV cache (vLLM's context-length error)."""
    return _bad(
        f"This model's maximum context length is {capacity} tokens. However, you requested "
        f"{req.prompt_tokens + completion_tokens} tokens ({req.prompt_tokens} in the input, "
        f"{completion_tokens} in the completion). Please reduce the length of the input or "
        "the completion.", "messages" if req.kind == "chat" else "prompt")


# -- responses -------------------------------------------------------------------------

def new_id(kind: Kind) -> str:
    """``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI ``usage``; ``cached_tokens`` = prompt tokens served by the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class ResponseMeta:
    """Fields shared by every body/chunk of one answer."""

    kind: Kind
    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, kind: Kind, model: str, fingerprint: str) -> "ResponseMeta":
        return cls(kind=kind, id=new_id(kind), created=int(time.time()), model=model,
                   system_fingerprint=fingerprint)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def full_response(meta: ResponseMeta, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Non-streaming body (``chat.completion`` or ``text_completion``)."""
    if meta.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
        body = meta._head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = meta._head("text_completion")
    body["choices"] = [choice]
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return body


def chunk(meta: ResponseMeta, *, content: str | None = None, role: bool = False,
          finish_reason: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One streaming chunk with a single choice.

    Chat: ``delta`` holds ``role`` (first chunk) and/or ``content``; the last chunk has
    an empty delta and the finish reason. Completions: ``text`` (empty in the last)."""
    if meta.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        body = meta._head("chat.completion.chunk")
    else:
        choice = {"index": 0, "text": content or "", "logprobs": None,
                  "finish_reason": finish_reason}
        body = meta._head("text_completion")
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(meta: ResponseMeta, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict[str, Any]:
    """The final ``stream_options.include_usage`` chunk: empty choices, usage set."""
    body = meta._head("chat.completion.chunk" if meta.kind == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    return body


def sse(obj: dict[str, Any]) -> bytes:
    """``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models`` body (OpenAI list shape, vLLM's extra fields)."""
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "vllm",
        "root": model, "parent": None, "max_model_len": max_model_len}]}
