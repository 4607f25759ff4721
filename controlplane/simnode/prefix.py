"""Block hashes and the prefix cache of the simulated engine (vLLM V1 automatic prefix
caching, reduced to what a performance model needs).

Pure logic, no I/O.

Blocks
------
vLLM splits a request's token ids into KV blocks of ``block_size`` tokens (16 by
default on CUDA, ``--block-size``) and gives every *full* block a chained hash: the
hash of block ``i`` covers the hash of block ``i-1`` and the tokens of block ``i``
(``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``). Two requests therefore
share block ``i`` only when they agree on every token up to the end of block ``i``;
the last, partial block is never hashed (so never shared).

The simulator has no tokenizer: a token is 4 characters of prompt text (see
:func:`controlplane.simnode.textgen.estimate_tokens`), so a block is
``BLOCK_TOKENS * CHARS_PER_TOKEN`` = 64 characters of the text that is hashed, and
``h_i = blake2b(h_{i-1} || utf8(block_i), digest_size=16)`` with ``h_{-1} = b""``.

For chat requests the hashed text is the conversation rendered as a chat template
would render it (:func:`chat_template`: ChatML, roles included, with the generation
prompt), so a ``user`` and an ``assistant`` message with the same content differ, and
turn ``n`` of a conversation starts with the rendering of turn ``n-1`` plus its answer.

The cache
---------
:class:`PrefixCache` is an LRU of block hashes with a fixed capacity in blocks. This
simplifies vLLM, where the cache is the KV pool itself: blocks held by running
requests are shared and cannot be evicted, and a freed block keeps its hash (and can
still be hit) until the allocator hands it to another request, the least recently
freed first. Here the cache is a separate LRU whose size does not depend on what
the running batch holds. As vLLM frees a request's blocks tail first (so a prefix
is evicted from its end), :meth:`PrefixCache.insert` touches the blocks from the last
to the first: block 0 ends as the most recently used one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: Tokens per KV block (vLLM's default ``--block-size`` on CUDA).
BLOCK_TOKENS = 16
#: Characters of prompt text per token (as ``textgen.estimate_tokens``).
CHARS_PER_TOKEN = 4
#: Size of one block hash, bytes.
DIGEST_BYTES = 16

BlockHash = bytes


def chat_template(messages: Iterable[tuple[str, str]]) -> str:
    """The text of a conversation as a ChatML template renders it: for every
    ``(role, content)`` in order, ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then
    the generation prompt ``<|im_start|>assistant\\n``."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def block_hashes(text: str, max_blocks: int | None = None, *,
                 block_tokens: int = BLOCK_TOKENS) -> tuple[BlockHash, ...]:
    """Chained hashes of the full blocks of ``text`` (``block_tokens`` x
    :data:`CHARS_PER_TOKEN` characters each), at most ``max_blocks`` of them.

    ``h_i = blake2b(h_{i-1} + block_i.encode("utf-8"), digest_size=16)``, ``h_{-1} =
    b""``. A trailing partial block gets no hash."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    chars = block_tokens * CHARS_PER_TOKEN
    n = len(text) // chars
    if max_blocks is not None:
        n = min(n, max(0, max_blocks))
    out: list[BlockHash] = []
    prev = b""
    for i in range(n):
        block = text[i * chars:(i + 1) * chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return tuple(out)


class PrefixCache:
    """LRU of block hashes holding at most ``capacity_blocks`` of them (0 = caches
    nothing). See the module docstring for how it differs from vLLM's."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        """Oldest first."""

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of ``hashes`` in the cache, contiguous from block 0
        (the first miss ends the prefix). Changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Add or touch every block of ``hashes``, the last one first (block 0 ends
        as the most recently used), then evict the least recently used beyond the
        capacity."""
        lru = self._lru
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def clear(self) -> None:
        """Drop every block."""
        self._lru.clear()
