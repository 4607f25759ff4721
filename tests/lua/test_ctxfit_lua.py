"""infergate.routing.ctxfit: the edge's context check refuses only a prompt far over the
context of every node serving its model; a prompt a node would take passes. Run in
nginx's init_by_lua with the snapshot module's ``current`` replaced (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec


def _table() -> str:
    """A fixed-width report (a SQL client's or `column -t`'s, columns padded with
    spaces): 16,864 characters that a gemma 3 llama-server took as 1,748 prompt tokens
    in a chat request (9.8 characters a token), within a slot of 2,048."""
    rows = [f"{i:<10}{'node-' + str(i % 7):<50}{'ok' if i % 3 else 'failed':<50}"
            f"{i * 37 % 1000:>50}" for i in range(103)]
    sep = "-" * 130
    return "Which rows failed?\n" + sep + "\n" + "\n".join(rows) + "\n" + sep + "\n"


def run(workdir: Path, body: str):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local snapshot = require("infergate.routing.snapshot")
            snapshot.current = function()
                return {nodes = {{name = "cpp", ctx_tokens = 2048}}}
            end
            local ctxfit = require("infergate.routing.ctxfit")
            local cjson = require("cjson.safe")
            local function ask(b)
                local raw = cjson.encode(b)
                local err = ctxfit.step({route = "inference", model = "m", body = b,
                                         body_bytes = #raw})
                return err and err.code or "passed"
            end
            local out = {}
"""
    return lua_eval(workdir, prelude + body,
                    http_extra="lua_shared_dict infergate_snapshot 1m;")


def test_a_padded_table_that_fits_the_slot_is_not_refused(workdir: Path) -> None:
    table = lua_string(_table())
    got = run(workdir, f"""
            local t = {table}
            out.chat = ask({{messages = {{{{role = "user", content = t}}}}}})
            out.parts = ask({{messages = {{{{role = "user",
                                             content = {{{{type = "text", text = t}}}}}}}}}})
            out.prompt = ask({{prompt = t}})
            -- words: still refused at over twice the slot's context
            local far = ask({{messages = {{{{role = "user",
                                             content = string.rep("lorem ipsum ", 2048)}}}}}})
            out.far = far
            out.blank_fits = ask({{messages = {{{{role = "user",
                                                   content = string.rep(" ", 40000)}}}}}})
            out.blank_far = ask({{messages = {{{{role = "user",
                                                  content = string.rep(" ", 400000)}}}}}})
            return out
    """)
    assert got["chat"] == got["parts"] == got["prompt"] == "passed", got
    assert got["far"] == "context_length_exceeded", got
    # a run of whitespace still counts, 8 characters as one: 40,000 spaces (about 1,300
    # tokens on gemma 3) pass; 400,000 (about 13,000) do not
    assert got["blank_fits"] == "passed", got
    assert got["blank_far"] == "context_length_exceeded", got
