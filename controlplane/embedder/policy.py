"""Which thresholds a semantic lookup uses: per-domain values from ``[cache]`` of the
configuration (``semantic_domains``, ``verifier``), re-read when the file changes.

:meth:`ThresholdPolicy.resolve` picks the most specific ``[[cache.semantic_domains]]``
entry matching a lookup's ``namespace`` (hex), ``route`` (request path) and ``model``
(requested model): specificity = 4 for a namespace prefix + 2 for a model + 1 for a route;
a longer namespace prefix wins a tie, then the first in the file.

:class:`PolicySource` holds the policy of a configuration file and reloads it when the
file's modification time changes (checked at most every ``check_every_s`` seconds, on the
lookup path: one ``stat``); a file that no longer parses keeps the last good policy and
logs the error once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from controlplane.embedder.language import GUARDED

log = logging.getLogger("infergate.embedder")


#: Fields of a domain that name the pool's endpoints (``remote.PoolModels``).
REMOTE_FIELDS = ("embeddings_url", "embeddings_model", "rerank_url", "rerank_model",
                 "rerank_format", "rerank_logits", "endpoint_timeout_ms", "api_key_env",
                 "api_key_file", "ca_file")


@dataclass(frozen=True)
class Domain:
    """One domain's matchers and thresholds (see ``config.SemanticDomain``)."""

    route: str = ""
    model: str = ""
    namespace_prefix: str = ""
    min_similarity: float | None = None
    min_verifier_score: float | None = None
    verifier: bool | None = None
    verifier_file: str = ""
    embeddings_url: str = ""
    embeddings_model: str = ""
    rerank_url: str = ""
    rerank_model: str = ""
    rerank_format: str = "jina"
    rerank_logits: bool = False
    endpoint_timeout_ms: int = 100
    api_key_env: str = ""
    api_key_file: str = ""
    ca_file: str = ""
    languages: tuple[str, ...] | None = None

    def matches(self, namespace: str, route: str | None, model: str | None) -> bool:
        return ((not self.route or self.route == route)
                and (not self.model or self.model == model)
                and (not self.namespace_prefix or namespace.startswith(self.namespace_prefix)))

    @property
    def specificity(self) -> tuple[int, int]:
        return ((4 if self.namespace_prefix else 0) + (2 if self.model else 0)
                + (1 if self.route else 0), len(self.namespace_prefix))


@dataclass(frozen=True)
class ThresholdPolicy:
    """Per-domain thresholds and whether the verifier is used."""

    domains: tuple[Domain, ...] = ()
    verifier: bool = True
    verifier_file: str = ""
    languages: tuple[str, ...] = GUARDED

    @classmethod
    def from_cache_settings(cls, c) -> "ThresholdPolicy":
        """From a ``config.CacheSettings``."""
        return cls(tuple(Domain(d.route, d.model, d.namespace_prefix, d.min_similarity,
                                d.min_verifier_score, d.verifier,
                                getattr(d, "verifier_file", "") or "",
                                **{f: getattr(d, f) for f in REMOTE_FIELDS},
                                languages=None if d.languages is None else tuple(d.languages))
                         for d in c.semantic_domains or ()),
                   bool(c.verifier), c.verifier_file, tuple(c.semantic_languages))

    def resolve(self, namespace: str, route: str | None = None,
                model: str | None = None) -> Domain | None:
        """The most specific matching domain, or None."""
        best: Domain | None = None
        for d in self.domains:
            if d.matches(namespace, route, model) and (best is None
                                                       or d.specificity > best.specificity):
                best = d
        return best

    def languages_for(self, namespace: str, route: str | None = None,
                      model: str | None = None) -> tuple[str, ...]:
        """The languages whose questions may get a semantic hit in the lookup's domain
        (its own ``languages``, else ``cache.semantic_languages``)."""
        dom = self.resolve(namespace, route, model)
        if dom is not None and dom.languages is not None:
            return dom.languages
        return self.languages


class PolicySource:
    """The :class:`ThresholdPolicy` of a configuration file, reloaded when it changes.

    ``path`` None: a fixed ``policy`` (default: no domains, verifier on)."""

    def __init__(self, path: str | Path | None = None, policy: ThresholdPolicy | None = None,
                 check_every_s: float = 2.0):
        self.path = Path(path) if path else None
        self.check_every_s = check_every_s
        self._policy = policy or ThresholdPolicy()
        self._mtime: float | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._bad_logged = False
        if self.path is not None:
            self._reload(initial=True)

    def _reload(self, initial: bool = False) -> None:
        from controlplane.config import ConfigError, load_settings

        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        try:
            s = load_settings(self.path)
        except ConfigError as exc:
            if initial:
                raise
            if not self._bad_logged:
                log.error("configuration not reloaded, keeping the last thresholds: %s", exc)
                self._bad_logged = True
            return
        self._mtime = mtime
        self._bad_logged = False
        new = ThresholdPolicy.from_cache_settings(s.cache)
        if not initial and new != self._policy:
            log.info("semantic thresholds reloaded from %s (%d domains)", self.path,
                     len(new.domains))
        self._policy = new

    def current(self) -> ThresholdPolicy:
        """The policy in force (re-reads the file when due and changed)."""
        if self.path is not None:
            now = time.monotonic()
            if now - self._checked >= self.check_every_s:
                with self._lock:
                    if now - self._checked >= self.check_every_s:
                        self._checked = now
                        self._reload()
        return self._policy
