"""Deterministic text for the simulated node.

- Prompt tokens are estimated as ``ceil(characters / 4)`` of the prompt text, at
  least 1 (the usual rule of thumb for English with BPE tokenizers). For chat the
  text is the concatenation of the message contents.
- The output is a pseudo-sentence drawn from a fixed word list with a PRNG seeded by
  the SHA-256 of the prompt key, so every node answers the same prompt with the same
  text (a response cache in front of several nodes stays valid). One word = one
  token; the concatenation of the tokens is the full text, so a stream's deltas add
  up to exactly the non-streaming content.
- Without an explicit count, the output length comes from the same hash, uniformly
  in ``[min_tokens, max_tokens]``.
"""

from __future__ import annotations

import hashlib
import math
import random

WORDS: tuple[str, ...] = (
    "the", "model", "routes", "each", "request", "to", "a", "node", "with", "room",
    "cache", "tokens", "flow", "through", "quiet", "river", "of", "light", "and",
    "every", "queue", "grows", "when", "load", "rises", "balance", "keeps", "latency",
    "low", "for", "users", "who", "wait", "on", "answers", "from", "distant", "machines",
    "memory", "holds", "context", "while", "batches", "decode", "in", "steps", "small",
    "fast", "careful", "servers", "share", "work", "under", "pressure", "yet", "remain",
    "calm", "clear", "signals", "guide", "traffic", "toward", "healthy", "paths",
)


def estimate_tokens(text: str) -> int:
    """Prompt token estimate: ``ceil(len(text) / 4)``, at least 1."""
    return max(1, math.ceil(len(text) / 4))


def prompt_seed(key: str) -> int:
    """64-bit seed from the SHA-256 of ``key``."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def output_length(key: str, min_tokens: int, max_tokens: int) -> int:
    """Output length for ``key``, uniform in ``[min_tokens, max_tokens]`` by hash."""
    if min_tokens < 1 or max_tokens < min_tokens:
        raise ValueError("need 1 <= min_tokens <= max_tokens")
    span = max_tokens - min_tokens + 1
    # A different slice of the hash than the text seed, so length and words are independent.
    h = int.from_bytes(hashlib.sha256(b"len:" + key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return min_tokens + h % span


def generate_tokens(key: str, n: int) -> list[str]:
    """``n`` tokens of deterministic text for ``key``.

    Sentences of 6-14 words; the first word of a sentence is capitalised, the last
    one carries the full stop; every token after the first starts with a space."""
    rng = random.Random(prompt_seed(key))
    out: list[str] = []
    left_in_sentence = 0
    for i in range(n):
        word = WORDS[rng.randrange(len(WORDS))]
        if left_in_sentence == 0:
            left_in_sentence = rng.randint(6, 14)
            word = word.capitalize()
        left_in_sentence -= 1
        if left_in_sentence == 0 or i == n - 1:
            word += "."
            left_in_sentence = 0
        out.append(word if i == 0 else " " + word)
    return out
