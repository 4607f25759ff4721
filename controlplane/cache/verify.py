"""Online verification of semantic hits, and the per-namespace threshold it moves.

The edge queues a share ``cache.verify_fraction`` of its semantic hits on
``keynames.CACHE_VERIFY_QUEUE`` (list, capped at ``cache.verify_queue_max``, TTL
:data:`QUEUE_TTL_S`), one JSON item per hit::

    {"key": "<exact key hex of the entry served>", "namespace": "<hex>",
     "path": "/v1/chat/completions" | "/v1/completions", "model": str, "tenant": str,
     "body": "<the request body as received>", "ts": epoch_s}

The leader control plane (:class:`OnlineVerifier`, a job of
:class:`controlplane.routing.service.ControlPlane`) takes the items, sends each request
again, non-streaming, to a healthy active node serving its model and compares the fresh
answer with the cached one (:func:`verdict`): right when the texts are equal up to case
and spaces, or when the cosine of their embeddings (the embedder's ``POST
/v1/embeddings``) is at least ``cache.verify_answer_similarity``; else wrong. Counted on
the namespace's hash ``keynames.cache_ns_stats(ns)``: ``verified``, ``wrong`` (totals)
and ``win_verified``, ``win_wrong`` (the evidence since the namespace's threshold last
moved); an item that cannot be judged (entry gone, no node, node or embedder failing)
counts ``verify_errors`` (entry gone: nothing). A wrong verdict also drops the entry
with its vectors (:func:`controlplane.cache.store.drop_entry`).

Threshold rule (:func:`next_raise`, on the window): when the window holds a wrong
verdict and the 95 % Wilson upper bound of its wrong rate is above
``cache.verify_max_wrong``, the namespace's raise goes up by
``cache.verify_threshold_step`` (at most ``cache.verify_max_raise``); when the bound is
under half the target, it goes back down by a step (never below 0: the configured
threshold). Each move starts a new window. The raise lives in
``keynames.CACHE_THRESHOLD_RAISE`` (hash namespace -> float text, TTL
:data:`RAISE_TTL_S` renewed by every move); the embedder adds it to the threshold that
decides a hit (``controlplane.embedder.engine.Engine.thresholds``). Moves are
``cache_threshold`` events (``{"namespace", "from", "to", "verified", "wrong"}``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import redis
import requests

from controlplane.cache import store
from controlplane.config import CACHE_PATHS, NodeSettings, Settings
from controlplane.embedder.bounds import wilson_upper
from controlplane.redisdb import keynames
from controlplane.routing import registry

log = logging.getLogger("infergate.controlplane")

#: TTL (s) of the verification queue, renewed by every push (the edge's
#: ``lookup.VERIFY_QUEUE_TTL_S``).
QUEUE_TTL_S = 86400
#: TTL (s) of the threshold raises hash, renewed by every move.
RAISE_TTL_S = store.COUNTERS_TTL_S
#: Seconds an embedding call of a verification may take.
EMBED_TIMEOUT_S = 5.0
ACTOR = "controlplane"

_SPACES = re.compile(r"\s+")


# ---------------------------------------------------------------- pure logic

def normalise(text: str) -> str:
    """``text`` case-folded with runs of white space as one space, stripped."""
    return _SPACES.sub(" ", text).strip().casefold()


def same_text(a: str, b: str) -> bool:
    """Equal up to case and white space."""
    return normalise(a) == normalise(b)


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    """Cosine of two vectors of the same length (0 when either is zero). Raises
    ``ValueError`` for different lengths."""
    if len(u) != len(v):
        raise ValueError(f"vectors of different lengths: {len(u)} and {len(v)}")
    dot = sum(a * b for a, b in zip(u, v))
    nu = math.sqrt(sum(a * a for a in u))
    nv = math.sqrt(sum(b * b for b in v))
    if nu == 0 or nv == 0:
        return 0.0
    return dot / (nu * nv)


def verdict(cached: str, fresh: str, similarity: float | None, min_similarity: float) -> bool:
    """True (the cached answer is right) when both texts are equal up to case and white
    space, or ``similarity`` (cosine of their embeddings, 0-1; None = not measured) is at
    least ``min_similarity``."""
    if same_text(cached, fresh):
        return True
    return similarity is not None and similarity >= min_similarity


@dataclass(frozen=True)
class ThresholdRule:
    """The knobs of :func:`next_raise` (``cache.verify_*``): target wrong rate (0-1),
    step and largest raise (threshold units, 0-1)."""

    max_wrong: float = 0.01
    step: float = 0.01
    max_raise: float = 0.05

    @classmethod
    def from_settings(cls, s: Settings) -> "ThresholdRule":
        c = s.cache
        return cls(c.verify_max_wrong, c.verify_threshold_step, c.verify_max_raise)


def next_raise(current: float, verified: int, wrong: int, rule: ThresholdRule) -> float:
    """The namespace's raise (0-``rule.max_raise``) after its window of ``verified``
    verdicts, ``wrong`` of them wrong: up a step when the window has a wrong verdict
    and the 95 % Wilson upper bound of ``wrong / verified`` is above ``rule.max_wrong``;
    down a step (not below 0) when the bound is under half of it; else unchanged."""
    current = max(0.0, current)
    if verified <= 0:
        return current
    wrong = max(0, min(wrong, verified))
    upper = wilson_upper(wrong, verified)
    if wrong > 0 and upper > rule.max_wrong:
        return round(min(rule.max_raise, current + rule.step), 6) if current < rule.max_raise \
            else current
    if current > 0 and upper < rule.max_wrong / 2:
        return round(max(0.0, current - rule.step), 6)
    return current


def answer_text(doc: object) -> str | None:
    """The text of the first choice of an OpenAI completion (chat ``message.content``,
    else its tool calls as JSON; ``text`` for a text completion), or None when ``doc``
    is no completion."""
    if not isinstance(doc, dict):
        return None
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    msg = c.get("message")
    if isinstance(msg, dict):
        if isinstance(msg.get("content"), str):
            return msg["content"]
        if msg.get("tool_calls"):
            return json.dumps([t.get("function") for t in msg["tool_calls"]
                               if isinstance(t, dict)], sort_keys=True)
        return ""
    if isinstance(c.get("text"), str):
        return c["text"]
    return None


@dataclass(frozen=True)
class VerifyItem:
    """One queued semantic hit (see the module docstring)."""

    key: str
    namespace: str
    path: str
    model: str
    tenant: str
    body: str


def parse_item(raw: str | bytes) -> VerifyItem | None:
    """The item of a queued JSON text, or None when it is malformed."""
    try:
        d = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    key, ns, path, body = d.get("key"), d.get("namespace"), d.get("path"), d.get("body")
    if not (isinstance(key, str) and store.HEX_RE.match(key) and isinstance(ns, str)
            and store.HEX_RE.match(ns) and path in CACHE_PATHS and isinstance(body, str)):
        return None
    model = d.get("model") if isinstance(d.get("model"), str) else ""
    tenant = d.get("tenant") if isinstance(d.get("tenant"), str) else ""
    return VerifyItem(key, ns, path, model, tenant, body)


def fresh_request(body: str) -> dict | None:
    """The request to send again: the JSON object of ``body`` made non-streaming
    (``stream`` false, no ``stream_options``), or None when it is not a JSON object."""
    try:
        d = json.loads(body)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    d["stream"] = False
    d.pop("stream_options", None)
    return d


# ---------------------------------------------------------------- the worker

@dataclass
class Outcome:
    """What :meth:`OnlineVerifier.verify` did with one item: ``result`` = ``right`` |
    ``wrong`` | ``gone`` (entry expired or dropped: not judged) | ``error`` (``detail``
    says why); ``similarity`` the answers' cosine when measured; ``raise_to`` the
    namespace's raise after the verdict."""

    key: str
    namespace: str
    result: str
    similarity: float | None = None
    node: str | None = None
    detail: str = ""
    raise_to: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


#: ``(nodes, served models per node)``: healthy, active nodes (None = models unknown).
NodesFn = Callable[[], list[tuple[NodeSettings, list[str] | None, bool, bool]]]
"""Every node: (node, its served models or ``None`` when unknown, whether it takes a
model no node lists: :mod:`controlplane.routing.models`, whether a verification may ask
it now: healthy and active)."""


class OnlineVerifier:
    """Takes queued items and judges them (module docstring). ``nodes`` gives the
    healthy active nodes of the moment; ``embed`` (texts -> vectors) defaults to the
    embedder at ``cache.embedder_url``. Every Redis call may raise
    ``redis.exceptions.RedisError`` (the caller logs it; the item is lost)."""

    def __init__(self, settings: Settings, r: redis.Redis, nodes: NodesFn,
                 embed: Callable[[list[str]], list[list[float]]] | None = None,
                 session: requests.Session | None = None,
                 events_max: int | None = None) -> None:
        self.settings = settings
        self.r = r
        self.nodes = nodes
        self.session = session or requests.Session()
        self.embed = embed or self._embed
        self.rule = ThresholdRule.from_settings(settings)
        self.events_max = events_max or settings.controlplane.events_max

    def _embed(self, texts: list[str]) -> list[list[float]]:
        url = self.settings.cache.embedder_url + "/v1/embeddings"
        token = self.settings.cache.embedder_token
        headers = {"Authorization": f"Bearer {token}"} if token else None
        res = self.session.post(url, json={"input": texts}, timeout=EMBED_TIMEOUT_S,
                                headers=headers)
        res.raise_for_status()
        data = sorted(res.json()["data"], key=lambda d: d["index"])
        return [list(map(float, d["embedding"])) for d in data]

    def run_once(self, max_items: int = 16, budget_s: float = 5.0) -> list[Outcome]:
        """Take up to ``max_items`` items (LPOP, oldest first) and judge them, stopping
        early once ``budget_s`` seconds are spent (items taken are always judged)."""
        t0 = time.monotonic()
        out: list[Outcome] = []
        while len(out) < max_items and time.monotonic() - t0 < budget_s:
            raws = self.r.lpop(keynames.CACHE_VERIFY_QUEUE, min(4, max_items - len(out)))
            if not raws:
                break
            for raw in raws:
                item = parse_item(raw)
                if item is None:
                    log.warning("verification item dropped: malformed")
                    continue
                out.append(self.verify(item))
        return out

    def _pick(self, model: str) -> NodeSettings | None:
        nodes = self.nodes()
        cands = [n for n, models, _, ok in nodes
                 if ok and (models is None or not model or model in models)]
        if not cands and model and all(models is not None and model not in models
                                       for _, models, _, _ in nodes):
            # a name no node lists, every list known: the nodes that take any model (the
            # edge's rule, infergate.routing.models)
            cands = [n for n, _, takes_any, ok in nodes if ok and takes_any]
        return random.choice(cands) if cands else None

    def verify(self, item: VerifyItem) -> Outcome:
        """Judge one item and count the verdict (module docstring)."""
        entry = store.get_entry(self.r, item.key)
        if entry is None:
            return Outcome(item.key, item.namespace, "gone")
        kind = "chat" if item.path == "/v1/chat/completions" else "text"
        try:
            cached = answer_text(json.loads(entry.get("body") or ""))
        except (TypeError, ValueError):
            cached = None
        req = fresh_request(item.body)
        if cached is None or req is None:
            return self._error(item, f"unreadable {'entry' if cached is None else 'request'}")
        node = self._pick(item.model)
        if node is None:
            return self._error(item, "no healthy node serves the model")
        try:
            res = self.session.post(node.url.rstrip("/") + item.path, json=req,
                                    timeout=self.settings.cache.verify_timeout_s)
            fresh = answer_text(res.json()) if res.status_code == 200 else None
        except (requests.RequestException, ValueError) as exc:
            return self._error(item, f"node {node.name}: {exc}", node.name)
        if fresh is None:
            return self._error(item, f"node {node.name} answered {res.status_code}", node.name)
        sim: float | None = None
        if not same_text(cached, fresh):
            try:
                u, v = self.embed([cached or " ", fresh or " "])
                sim = round(cosine(u, v), 6)
            except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
                return self._error(item, f"embedder: {exc}", node.name)
        ok = verdict(cached, fresh, sim, self.settings.cache.verify_answer_similarity)
        if not ok:
            store.drop_entry(self.r, item.key)  # first: a wrong answer is served no more
        up = self._count(item.namespace, ok)
        log.info("verified %s hit of namespace %.12s: %s (similarity %s, node %s)", kind,
                 item.namespace, "right" if ok else "wrong", sim, node.name)
        return Outcome(item.key, item.namespace, "right" if ok else "wrong", sim, node.name,
                       raise_to=up)

    def _error(self, item: VerifyItem, why: str, node: str | None = None) -> Outcome:
        store.count_namespace(self.r, item.namespace, "verify_errors")
        log.warning("verification of namespace %.12s skipped: %s", item.namespace, why)
        return Outcome(item.key, item.namespace, "error", node=node, detail=why)

    def _count(self, namespace: str, right: bool) -> float:
        """Count a verdict, apply :func:`next_raise`; returns the namespace's raise."""
        h = keynames.cache_ns_stats(namespace)
        pipe = self.r.pipeline()
        pipe.hincrby(h, "verified", 1)
        pipe.hincrby(h, "win_verified", 1)
        if not right:
            pipe.hincrby(h, "wrong", 1)
            pipe.hincrby(h, "win_wrong", 1)
        pipe.expire(h, store.COUNTERS_TTL_S)
        pipe.hget(h, "win_wrong")
        pipe.hget(keynames.CACHE_THRESHOLD_RAISE, namespace)
        res = pipe.execute()
        win_v = int(res[1])
        win_w = int(res[-2] or 0)
        try:
            cur = max(0.0, float(res[-1] or 0.0))
        except (TypeError, ValueError):
            cur = 0.0
        new = next_raise(cur, win_v, win_w, self.rule)
        if new == cur:
            return cur
        pipe = self.r.pipeline()
        if new > 0:
            pipe.hset(keynames.CACHE_THRESHOLD_RAISE, namespace, repr(new))
            pipe.expire(keynames.CACHE_THRESHOLD_RAISE, RAISE_TTL_S)
        else:
            pipe.hdel(keynames.CACHE_THRESHOLD_RAISE, namespace)
        pipe.hset(h, mapping={"win_verified": 0, "win_wrong": 0})
        pipe.execute()
        registry.add_event(self.r, "cache_threshold", "", ACTOR,
                           {"namespace": namespace, "from": cur, "to": new,
                            "verified": win_v, "wrong": win_w}, maxlen=self.events_max)
        log.info("semantic threshold of namespace %.12s %s to +%g (window: %d verified, "
                 "%d wrong)", namespace, "raised" if new > cur else "lowered", new, win_v,
                 win_w)
        return new

