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
            -- words: still refused at over twice the slot's context (8,192 words)
            local far = ask({{messages = {{{{role = "user",
                                             content = string.rep("lorem ipsum ", 4096)}}}}}})
            out.far = far
            out.blank_fits = ask({{messages = {{{{role = "user",
                                                   content = string.rep(" ", 40000)}}}}}})
            out.blank_far = ask({{messages = {{{{role = "user",
                                                  content = string.rep(" ", 400000)}}}}}})
            return out
    """)
    assert got["chat"] == got["parts"] == got["prompt"] == "passed", got
    assert got["far"] == "context_length_exceeded", got
    # a run of whitespace still counts, a token per 16 pairs: 40,000 spaces (about 1,300
    # tokens on gemma 3) pass; 400,000 (about 13,000) do not
    assert got["blank_fits"] == "passed", got
    assert got["blank_far"] == "context_length_exceeded", got


def mixed(workdir: Path, nodes: str, body: str):
    """Run ``body`` with the snapshot's nodes replaced by ``nodes`` (a Lua list)."""
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local snapshot = require("infergate.routing.snapshot")
            local nodes = """ + nodes + """
            snapshot.current = function() return {nodes = nodes} end
            local ctxfit = require("infergate.routing.ctxfit")
            local cjson = require("cjson.safe")
            -- the edge's 400 code, or the names of the nodes left out ("," between)
            local function tried(b)
                local req = {route = "inference", model = "m", body = b,
                             body_bytes = #cjson.encode(b), tried = {}}
                local err = ctxfit.step(req)
                local names = {}
                for name in pairs(req.tried) do names[#names + 1] = name end
                table.sort(names)
                return err and err.code or table.concat(names, ",")
            end
            local function left_out(words)
                return tried({messages = {{role = "user",
                                           content = string.rep("lorem ipsum ", words)}}})
            end
            local out = {}
"""
    return lua_eval(workdir, prelude + body,
                    http_extra="lua_shared_dict infergate_snapshot 1m;")


UP = 'addr = "127.0.0.1:1", healthy = true, state = "active"'


def test_a_prompt_over_a_small_context_leaves_those_nodes_out(workdir: Path) -> None:
    """Nodes of 512 and 4,096 tokens: a prompt of about 900 (by the estimate) leaves the
    small one out; a short one leaves none; one over the large context keeps the large
    one (the best chance), one over twice it is refused; a node whose context is not
    known may hold it; the small node stays when no node that holds it is up."""
    got = mixed(workdir, f"""{{
                {{name = "small", ctx_tokens = 512, {UP}}},
                {{name = "big", ctx_tokens = 4096, {UP}}},
                {{name = "other", ctx_tokens = 4096, {UP}, models = {{set = {{x = true}}}}}}}}""", """
            out.short = left_out(100)          -- 200 tokens by the estimate
            out.between = left_out(300)        -- 600
            out.over_big = left_out(2500)      -- 5,000: over 4,096, under twice it
            out.far = left_out(6000)           -- 12,000
            return out
    """)
    assert got == {"short": "", "between": "small", "over_big": "small",
                   "far": "context_length_exceeded"}, got
    got = mixed(workdir, f"""{{
                {{name = "small", ctx_tokens = 512, {UP}}},
                {{name = "vllm", {UP}}}}}""", """
            out.between = left_out(300)
            out.far = left_out(6000)           -- vllm's context is not known: no 400
            return out
    """)
    assert got == {"between": "small", "far": "small"}, got
    got = mixed(workdir, f"""{{
                {{name = "small", ctx_tokens = 512, {UP}}},
                {{name = "big", ctx_tokens = 4096, addr = "127.0.0.1:1", healthy = false,
                  state = "active"}}}}""", """
            out.between = left_out(300)        -- big is down: small answers for itself
            return out
    """)
    assert got == {"between": ""}, got


def test_nodes_that_would_refuse_the_request_are_left_out_while_another_can_take_it(
        workdir: Path) -> None:
    """A prompt over a node's slot context, or an ``n`` over a llama.cpp server's slots,
    marks that node tried for the request (the balancer, the admission's pick and the
    upstream group then leave it out), only while a usable node of the model would take
    the request; a node that does not report the figure is taken to hold it."""
    got = mixed(workdir, """{
                {name = "big", addr = "127.0.0.1", healthy = true, state = "active",
                 ctx_tokens = 4096, slots = 1, slots_source = "server"},
                {name = "small", addr = "127.0.0.1", healthy = true, state = "active",
                 ctx_tokens = 1024, slots = 2, slots_source = "server"},
            }""", """
            local words = function(n) return string.rep("word ", n) end
            out.short = tried({messages = {{role = "user", content = words(100)}}})
            out.mid = tried({messages = {{role = "user", content = words(1200)}}})
            out.mid_prompt = tried({prompt = words(1200)})
            out.n2 = tried({n = 2, messages = {{role = "user", content = "hi"}}})
            out.n3 = tried({n = 3, messages = {{role = "user", content = "hi"}}})
            out.n2_mid = tried({n = 2, messages = {{role = "user", content = words(1200)}}})
            out.over_all = tried({messages = {{role = "user", content = words(5000)}}})
            out.far = tried({messages = {{role = "user", content = words(14000)}}})
            nodes[1].healthy = false
            out.mid_big_down = tried({messages = {{role = "user", content = words(1200)}}})
            nodes[1].healthy = true
            nodes[1].ctx_tokens = nil   -- not reported: may hold anything
            out.mid_unknown = tried({messages = {{role = "user", content = words(1200)}}})
            out.far_unknown = tried({messages = {{role = "user", content = words(14000)}}})
            return out
    """)
    assert got["short"] == "", got
    assert got["mid"] == got["mid_prompt"] == "small", got       # 1,200 tokens > 1,024
    assert got["n2"] == "big", got                               # one slot: refuses n = 2
    assert got["n3"] == "", got                                  # nobody takes it: both answer
    # no node takes both: big left out for n, small, the only one left, answers itself
    assert got["n2_mid"] == "big", got
    assert got["over_all"] == "small", got                       # 5,000: the largest stays
    assert got["far"] == "context_length_exceeded", got          # over twice the largest
    assert got["mid_big_down"] == "", got                        # the node that fits is down
    assert got["mid_unknown"] == "small", got
    assert got["far_unknown"] == "small", got                    # no refusal: a context unknown


def test_a_chinese_prompt_counts_its_characters_as_tokens(workdir: Path) -> None:
    """1,880 Chinese characters (1,431 tokens on gemma 3) are estimated at 0.6 tokens
    each, over a 1,024-token slot: that node is left out (at 4 characters a token they
    read as 470 and went to it, which answered 400); 600 stay under it."""
    got = mixed(workdir, f"""{{
                {{name = "small", ctx_tokens = 1024, {UP}}},
                {{name = "big", ctx_tokens = 4096, {UP}}}}}""", """
            local function ask(chars)
                return tried({messages = {{role = "user",
                                           content = string.rep("请介绍一下这个城市的历史", chars / 12)}}})
            end
            out.long = ask(1884)
            out.short = ask(600)
            out.far = ask(14400)           -- 8,640 tokens: over twice 4,096
            return out
    """)
    assert got == {"long": "small", "short": "", "far": "context_length_exceeded"}, got


def test_a_spanish_prompt_a_node_holds_is_not_refused(workdir: Path) -> None:
    """8,330 characters of Spanish that a gemma 3 llama-server took as 919 prompt tokens
    in a chat request, within its slot of 1,024: estimated at 2,083 by characters / 4
    (2.3x over), it was refused at the edge with 400 context_length_exceeded while the
    node served it, and a node of 1,024 tokens was left out for it; by its words, digits
    and punctuation it is 910: no refusal, no node left out."""
    es = lua_string("La organización internacional presentó recomendaciones fundamentales "
                    "sobre la implementación de políticas ambientales. ")
    got = run(workdir, f"""
            snapshot.current = function()
                return {{nodes = {{{{name = "cpp", ctx_tokens = 1024}}}}}}
            end
            out.es = ask({{messages = {{{{role = "user", content = string.rep({es}, 70)}}}}}})
            return out
    """)
    assert got["es"] == "passed", got
    got = mixed(workdir, f"""{{
                {{name = "small", ctx_tokens = 1024, {UP}}},
                {{name = "big", ctx_tokens = 2048, {UP}}}}}""", f"""
            out.es = tried({{messages = {{{{role = "user", content = string.rep({es}, 70)}}}}}})
            return out
    """)
    assert got == {"es": ""}, got


def test_a_long_chinese_prompt_is_estimated_in_linear_time(workdir: Path) -> None:
    """The CJK count checks the text as UTF-8 once, not again at each character it
    matches: 96 KB of Chinese took about 5 s of the nginx worker (1 MB: minutes)."""
    got = run(workdir, """
            local s = string.rep("中文字", 10923)
            ngx.update_time()
            local t0 = ngx.now()
            out.est = ctxfit._estimate(s)
            ngx.update_time()
            out.s = ngx.now() - t0
            -- text that is not UTF-8 is not counted as CJK (and raises nothing)
            out.bad = ctxfit._estimate("\\228\\184" .. string.rep("中", 10) .. "\\255")
            return out
    """)
    assert got["s"] < 1.0, got
    assert abs(got["est"] - 10923 * 3 * 0.6) < 1, got
    assert got["bad"] >= 1, got


def test_a_prompt_of_one_long_word_far_over_the_context_is_refused(workdir: Path) -> None:
    """A word counts a token per 64 bytes at least (gemma 3 took 8 bytes a token of
    "aaa...", 4 of emoji, 48 of "………", its densest): 600,000 letters without a space
    (about 75,000 tokens on gemma 3) were estimated at one token and sent to the node,
    which holds a slot while it tokenizes the whole of it."""
    got = run(workdir, """
            out.letters = ask({messages = {{role = "user", content = string.rep("a", 600000)}}})
            out.emoji = ask({prompt = string.rep("\\240\\159\\152\\128", 150000)})
            -- under the floor's reach: a long word still passes (20,000 letters: 2,500
            -- tokens on gemma 3; the node answers for itself)
            out.word = ask({prompt = string.rep("a", 20000)})
            out.est = ctxfit._estimate(string.rep("a", 20000))
            return out
    """)
    assert got["letters"] == got["emoji"] == "context_length_exceeded", got
    assert got["word"] == "passed" and got["est"] == 20000 // 64, got


def test_marks_in_a_row_that_a_node_holds_are_not_refused(workdir: Path) -> None:
    """ASCII punctuation marks in a row count a token a pair (gemma 3 has "</", "></",
    "!?", "[]", "},{" in one token): a 4,096-token llama-server served these prompts at
    3,529 and 2,529 prompt tokens, which the edge refused, estimated at 10,004 each."""
    got = mixed(workdir, '{{name = "cpp", ctx_tokens = 4096}}', """
            local function ask(text)
                return tried({messages = {{role = "user", content = text}}})
            end
            out.tags = ask("Fix this HTML:\\n" .. string.rep("</div></span></p></li></ul>", 500))
            out.marks = ask("Count the marks: " .. string.rep("!?", 5000))
            -- still refused at over twice the context: the same marks four times over
            out.far = ask("Count the marks: " .. string.rep("!?", 20000))
            return out
    """)
    assert got["tags"] == got["marks"] == "", got
    assert got["far"] == "context_length_exceeded", got
