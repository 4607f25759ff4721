"""The edge's phases (lua/infergate/phases.lua): every step of every phase in order, the
cache's steps only when the options enable the cache; run in nginx's init_by_lua
(support.stack.lua_eval)."""

from __future__ import annotations

import json

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

ACCESS = ["method", "auth", "body_read", "body", "models", "ctxfit", "ratelimit", "cache", "upstream", "eligible",
          "admission", "relay"]


def phase_names(workdir, options: dict):
    return lua_eval(workdir, f"""
        local config = require("infergate.core.config")
        assert(config.init({lua_string(json.dumps(options))},
                           {lua_string(json.dumps(option_spec()))}))
        local phases = require("infergate.phases")
        assert(phases.init())
        return phases.names()
    """)


@pytest.mark.parametrize("enabled", [True, False])
def test_steps_in_order_and_cache_steps_follow_the_option(workdir, enabled: bool) -> None:
    got = phase_names(workdir, {"cache": {"enabled": enabled}})
    cache = ["cache_capture"] if enabled else []
    assert got["access"] == [s for s in ACCESS if enabled or s != "cache"]
    assert got["header_filter"]["proxy"] == ["node", "cors", *cache]
    assert got["header_filter"]["error"] == ["cors", *cache]
    assert got["body_filter"] == ["progress", "node", "usage", *cache, "relay_copy"]
    assert got["log"] == (["cache_store"] if enabled else []) + ["request"]
