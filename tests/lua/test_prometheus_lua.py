"""The request-duration histogram's bucket choice (infergate.core.prometheus): the binary
search gives the first bucket whose bound holds the duration, as a linear scan would,
at and between every bound; run inside nginx (support.stack.lua_eval)."""

from __future__ import annotations

from support.stack import lua_eval


def test_bucket_of_matches_a_linear_scan(workdir) -> None:
    got = lua_eval(workdir, """
        local p = require("infergate.core.prometheus")
        local B = p.BUCKETS
        local function linear(s)
            for k = 1, #B do
                if s <= B[k] then return k end
            end
            return #B + 1
        end
        local values = {0, 1e-9, 1e6}
        for _, b in ipairs(B) do
            values[#values + 1] = b
            values[#values + 1] = b * 0.999
            values[#values + 1] = b * 1.001
        end
        local bad = {}
        for _, v in ipairs(values) do
            if p._bucket_of(v) ~= linear(v) then
                bad[#bad + 1] = {v, p._bucket_of(v), linear(v)}
            end
        end
        return {bad = bad, n = #values, top = p._bucket_of(1e6), nb = #B}
    """)
    assert got["bad"] in ([], {}), got["bad"]
    assert got["top"] == got["nb"] + 1
