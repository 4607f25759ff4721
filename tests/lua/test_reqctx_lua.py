"""Body facts kept in the request's state (infergate.core.reqctx): the prompt's
characters are counted once per request, from the decoded body, and every module counts
them alike; run in nginx's init_by_lua (support.stack.lua_eval)."""

from __future__ import annotations

from support.stack import lua_eval


def test_prompt_chars_counted_once_from_the_decoded_body(workdir) -> None:
    got = lua_eval(workdir, """
        local reqctx = require("infergate.core.reqctx")
        local body = require("infergate.core.body")
        local req = {}
        local before = reqctx.prompt_chars(req)      -- no body yet: 0, not kept
        local kept_before = req.prompt_chars
        req.body = { messages = { { role = "user", content = "héllo" },
                                  { role = "user", content = { { type = "text", text = "ab" } } } },
                     prompt = "xyz" }
        local first = reqctx.prompt_chars(req)
        req.body.prompt = string.rep("z", 100)       -- not counted again
        return { before = before, kept_before = kept_before or false, first = first,
                 again = reqctx.prompt_chars(req), kept = req.prompt_chars,
                 same_fn = require("infergate.admission.ratelimit").prompt_chars == body.prompt_chars,
                 none = body.prompt_chars("not a table") }
    """)
    assert got == {"before": 0, "kept_before": False, "first": 10, "again": 10, "kept": 10,
                   "same_fn": True, "none": 0}
