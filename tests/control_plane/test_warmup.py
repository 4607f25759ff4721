"""``infergate warmup``: prompt-file parsing, and a real run through nginx + Redis + a
simulated node (answers stored, second run skips everything, no node request)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.cache.key import keys_for
from controlplane.cache.warmup import CHAT, COMPLETIONS, PromptError, parse_line, warmup_cmd
from support.stack import edge_settings


def test_parse_plain_and_jsonl_lines() -> None:
    assert parse_line("  \n", 1, "m") is None
    p = parse_line("What is Redis?\n", 2, "m")
    assert p.path == CHAT and p.body == {"model": "m", "messages": [
        {"role": "user", "content": "What is Redis?"}]}
    j = parse_line(json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 0}),
                   3, "m")
    assert j.path == CHAT and j.body["model"] == "m" and j.body["temperature"] == 0
    c = parse_line(json.dumps({"model": "other", "prompt": "Once"}), 4, None)
    assert c.path == COMPLETIONS and c.body["model"] == "other"
    brace = parse_line("{not json at all", 5, "m")
    assert brace.body["messages"][0]["content"] == "{not json at all"


@pytest.mark.parametrize("line, msg", [
    ("plain", "needs --model"),
    ('{"messages": []}', "non-empty"),
    ('{"messages": "not a list"}', "non-empty"),
    ('{"prompt": "p"}', "no \"model\""),
    # a JSON object cut short is no prompt: its answer would be stored under the broken text
    ('{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"trunc"}]',
     "line 7: not valid JSON"),
    (' { "messages": [1,]}', "not valid JSON"),
])
def test_bad_lines_are_named(line, msg) -> None:
    with pytest.raises(PromptError, match=msg):
        parse_line(line, 7, None if "model" in msg or "plain" == line else "m")


@pytest.mark.integration
def test_warmup_stores_answers_and_skips_them_next_time(redis_server, simnodes, edge_factory,
                                                        workdir) -> None:
    node = simnodes(1, time_scale=0.05, output_tokens="8:16")[0]
    s = edge_settings(redis_server.url, [node.node_settings()])
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    edge = edge_factory(s)
    lines = ["What is a load balancer?", "Why cache LLM answers?",
             json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Define latency."}],
                         "temperature": 0}),
             json.dumps({"prompt": "The sea is", "max_tokens": 64, "temperature": 0}),
             "What is a load balancer?",  # duplicate: sent once
             "",
             # finish_reason "length": the whole answer for this max_tokens, stored too
             json.dumps({"messages": [{"role": "user", "content": "Count to fifty."}],
                         "max_tokens": 2})]
    f = workdir / "prompts.txt"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["--file", str(f), "--edge", edge.url, "--redis-url", redis_server.url,
            "--concurrency", "3"]
    res = CliRunner().invoke(warmup_cmd, args)  # model from the edge's /v1/models
    assert res.exit_code == 0, res.output
    assert "sent 5, skipped 1, stored 5, failed 0" in res.output
    # not a terminal: progress lines as it goes, the last one at the last prompt
    assert "warmup: 6/6 done (sent 5, skipped 1, failed 0)" in res.output
    r = redis_server.client()
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "Why cache LLM answers?"}]}
    assert r.exists(keynames.cache_entry(keys_for(CHAT, body).exact))
    before = node.state()["requests_total"]

    again = CliRunner().invoke(warmup_cmd, args + ["--model", "sim-llama"])
    assert again.exit_code == 0, again.output
    assert "sent 0, skipped 6, stored 0, failed 0" in again.output
    assert node.state()["requests_total"] == before  # every prompt came from the cache


@pytest.mark.integration
def test_warmup_reports_failures(redis_server, tiny_upstreams, workdir) -> None:
    f = workdir / "prompts.txt"
    # the third has no cache key (a seed of 2^53 or more): sent all the same
    f.write_text("one\ntwo\n" + json.dumps({"messages": [{"role": "user", "content": "x"}],
                                              "seed": 2**63}) + "\n", encoding="utf-8")
    # an edge that answers /v1/models and fails every prompt (500)
    (failing,) = tiny_upstreams(1)
    failing.mode = "fail"
    res = CliRunner().invoke(warmup_cmd, ["--file", str(f), "--edge", failing.url, "--model", "m",
                                          "--redis-url", redis_server.url, "--timeout", "2"])
    assert res.exit_code == 1
    assert "sent 0, skipped 0, stored 0, failed 3" in res.output
    assert failing.hits == 3


@pytest.mark.integration
def test_warmup_refuses_what_is_not_an_edge_and_warns_when_nothing_is_stored(
        redis_server, tiny_upstreams, workdir) -> None:
    f = workdir / "prompts.txt"
    f.write_text("one\n", encoding="utf-8")
    # an HTML page where the edge should be (the admin page's port, a web server)
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Html(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = b"<html>admin</html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", procs.free_port()), Html)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        res = CliRunner().invoke(warmup_cmd, ["--file", str(f), "--edge", url, "--model", "m",
                                              "--redis-url", redis_server.url])
        assert res.exit_code == 1
        assert "answered GET /v1/models with 404 text/html: not an infergate edge?" in res.output
        assert "<html>" not in res.output
    finally:
        srv.shutdown()
        srv.server_close()
    # a bare node: answered, nothing stored
    (node,) = tiny_upstreams(1)
    res = CliRunner().invoke(warmup_cmd, ["--file", str(f), "--edge", node.url,
                                          "--redis-url", redis_server.url])
    assert res.exit_code == 0, res.output
    assert "sent 1" in res.output and "none of the 1 answers sent was stored" in res.output


@pytest.mark.integration
def test_warmup_names_an_edge_that_is_not_there(redis_server, workdir) -> None:
    f = workdir / "prompts.txt"
    f.write_text("one\n", encoding="utf-8")
    dead = f"http://127.0.0.1:{procs.free_port()}"
    for extra in ([], ["--model", "m"]):
        res = CliRunner().invoke(warmup_cmd, ["--file", str(f), "--edge", dead,
                                              "--redis-url", redis_server.url, *extra])
        assert res.exit_code == 1
        assert f"cannot reach the edge at {dead}" in res.output, res.output
        assert "--config WORKDIR/infergate.toml" in res.output


@pytest.mark.integration
def test_warmup_without_a_key_stops_at_the_first_401(redis_server, simnodes, edge_factory,
                                                     workdir) -> None:
    """Keys required, none given: one clear line and exit 1, with the model taken from
    /v1/models or given: the edge's 401 to /v1/models, asked first either way, stops the
    run before any prompt is sent."""
    node = simnodes(1, time_scale=0.05, output_tokens="4:8")[0]
    s = edge_settings(redis_server.url, [node.node_settings()])
    s.auth.mode = "required"
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    edge = edge_factory(s)
    f = workdir / "prompts.txt"
    f.write_text("".join(f"question {i}?\n" for i in range(20)), encoding="utf-8")
    base = ["--file", str(f), "--edge", edge.url, "--redis-url", redis_server.url,
            "--concurrency", "1"]

    res = CliRunner(env={"INFERGATE_API_KEY": None}).invoke(warmup_cmd, base)
    assert res.exit_code == 1, res.output
    assert "answered 401" in res.output and "pass --api-key or set INFERGATE_API_KEY" in res.output
    assert "needs --model" not in res.output

    res = CliRunner(env={"INFERGATE_API_KEY": None}).invoke(warmup_cmd, base + ["--model", "sim-llama"])
    assert res.exit_code == 1, res.output
    assert "pass --api-key or set INFERGATE_API_KEY" in res.output
    # no 401 body per prompt (the edge's port may hold the digits 401 too)
    assert res.output.count("answered 401") == 1, res.output
    assert res.output.count("didn't provide an API key") == 1, res.output
    posts = [ln for ln in edge.rendered.access_log.read_text().splitlines()
             if "POST /v1/chat/completions" in ln]
    assert posts == [], posts  # stopped before the first one
    assert node.state()["requests_total"] == 0
