"""``infergate up`` and the embedder: a failing embedder leaves the semantic cache off
without stopping anything, and leaves no process behind."""

from __future__ import annotations

import pytest

from controlplane import procs
from controlplane.config import settings_from_dict
from controlplane.cli.up import _start_embedder

pytestmark = pytest.mark.integration


def test_embedder_that_cannot_load_its_model_turns_semantic_off(redis_server, workdir) -> None:
    s = settings_from_dict({"redis": {"url": redis_server.url},
                            "cache": {"enabled": True, "embedder_model": str(workdir / "no-model"),
                                      "embedder_url": f"http://127.0.0.1:{procs.free_port()}"}})
    stack = procs.ProcessSet()
    desc = _start_embedder(s, workdir, stack, timeout=120)
    assert desc.startswith("off (the embedder did not start")
    assert s.cache.semantic is False and s.cache.enabled is True
    assert stack.items == []  # nothing left running


def test_no_embedder_when_the_cache_is_off(workdir) -> None:
    stack = procs.ProcessSet()
    assert _start_embedder(settings_from_dict({}), workdir, stack) == "off (cache.enabled = false)"
    s = settings_from_dict({"cache": {"enabled": True, "semantic": False}})
    assert _start_embedder(s, workdir, stack) == "off (cache.semantic = false)"
    remote = settings_from_dict({"cache": {"enabled": True,
                                           "embedder_url": "http://192.0.2.1:8090"}})
    # a remote embedder is the operator's: not probed, not started, kept on
    assert _start_embedder(remote, workdir, stack) == "http://192.0.2.1:8090 (remote, not started here)"
    assert remote.cache.semantic is True
    assert stack.items == []
