"""Token-bucket rate limits at the edge (lua/infergate/admission/ratelimit.lua) with real nginx,
Redis and upstreams: per-key request limit with the OpenAI headers while another key
is unaffected, a token limit driven by the real ``usage`` of the answers, one global
limit enforced by two edges sharing Redis, and local buckets when Redis is down."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.redisdb import keynames
from controlplane.config import Settings
from support.stack import edge_settings, write_snapshot

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
RESET_RE = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


def settings(redis_url: str, nodes: list, *, auth: bool = True, **limits: Any) -> Settings:
    s = edge_settings(redis_url, nodes)
    s.auth.mode = "required" if auth else "off"
    s.limits.redis_retry_s = 0.2
    for k, v in limits.items():
        setattr(s.limits, k, v)
    return s


def post(url: str, key: str | None = None, body: dict = CHAT) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=15)


def reset_s(value: str) -> float:
    """Seconds of an OpenAI-style duration ("1s", "6m0s", "12ms", "1h2m3.5s")."""
    assert RESET_RE.match(value), value
    if value.endswith("ms"):
        return int(value[:-2]) / 1000
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", value):
        total += float(num) * {"h": 3600, "m": 60, "s": 1}[unit]
    return total


def test_per_key_request_limit_with_headers(redis_server, tiny_upstreams, edge_factory) -> None:
    r = redis_server.client()
    limited, rec = apikeys.create_key(r, "acme", rpm=3)
    other, _ = apikeys.create_key(r, "beta", rpm=3)
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()]))

    for remaining in (2, 1, 0):
        res = post(edge.url, limited)
        assert res.status_code == 200, res.text
        assert res.headers["x-ratelimit-limit-requests"] == "3"
        assert res.headers["x-ratelimit-remaining-requests"] == str(remaining)
        # full again after (3 - remaining) / (3/60 per s) seconds
        assert abs(reset_s(res.headers["x-ratelimit-reset-requests"]) - (3 - remaining) * 20) < 1.5
        assert "x-ratelimit-limit-tokens" not in res.headers  # the key has no tpm
    hits = up.hits

    res = post(edge.url, limited)
    assert res.status_code == 429, res.text
    assert res.headers["Content-Type"] == "application/json"
    retry = res.headers["Retry-After"]
    assert retry.isdigit() and 1 <= int(retry) <= 20
    assert int(retry) >= 19  # one request refills in 60 / 3 = 20 s
    assert res.headers["x-ratelimit-remaining-requests"] == "0"
    assert res.headers["x-ratelimit-limit-requests"] == "3"
    err = res.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "requests per minute" in err["message"]
    assert up.hits == hits, "a limited request never reaches a node"

    # another key is unaffected
    res = post(edge.url, other)
    assert res.status_code == 200 and res.headers["x-ratelimit-remaining-requests"] == "2"
    assert edge.status()["admission"]["rate_limited"] == 1

    # the buckets live in Redis under the key id, and the script was loaded once
    assert r.exists(keynames.ratelimit_key(rec.id, "rpm"))
    assert r.ttl(keynames.ratelimit_key(rec.id, "rpm")) > 0
    assert edge.status()["admission"]["limits_local"] == 0


def wait_bucket(r, key: str, pred, timeout: float = 5.0) -> float:
    out = {}

    def ok() -> bool:
        v = r.hget(key, "tokens")
        out["v"] = None if v is None else float(v)
        return v is not None and pred(float(v))

    procs.wait_until(ok, timeout, what=f"bucket {key}")
    return out["v"]


def test_token_limit_uses_the_real_usage(redis_server, simnodes, edge_factory) -> None:
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme", tpm=100)
    (node,) = simnodes(1, time_scale=0.02)
    # no output reserved up front (limits.default_max_tokens = 0): the answer's usage
    # settles everything
    edge = edge_factory(settings(redis_server.url, [node.node_settings()], default_max_tokens=0))
    bucket = keynames.ratelimit_key(rec.id, "tpm")
    # 32 characters -> 8 prompt tokens estimated up front; the node also answers 50
    body = {"model": "sim-llama", "sim_output_tokens": 50,
            "messages": [{"role": "user", "content": "a" * 32}]}

    res = post(edge.url, key, body)
    assert res.status_code == 200, res.text
    usage = res.json()["usage"]
    assert usage["completion_tokens"] == 50
    assert res.headers["x-ratelimit-limit-tokens"] == "100"
    assert res.headers["x-ratelimit-remaining-tokens"] == "92"  # only the estimate so far
    # the log phase charges the difference (total - 8) right after the answer
    left = wait_bucket(r, bucket, lambda v: v < 92 - 30)
    assert abs(left - (100 - usage["total_tokens"])) < 2  # + a little refill (100/60 per s)

    res = post(edge.url, key, body)
    assert res.status_code == 200, res.text
    wait_bucket(r, bucket, lambda v: v < 0)  # in debt now: the answers cost more than the estimate

    res = post(edge.url, key, body)
    assert res.status_code == 429, res.text
    err = res.json()["error"]
    assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded"
    assert int(res.headers["Retry-After"]) >= 5
    assert res.headers["x-ratelimit-remaining-tokens"] == "0"
    assert node.state()["requests_total"] == 2


def test_the_up_front_estimate_learns_what_a_keys_prompts_are_billed(
        redis_server, simnodes, edge_factory) -> None:
    """The edge estimates 160 characters at 16 a token (10) where the node bills 4 a
    token (40): after three answers the key's requests are charged the billed figure up
    front, while another key's first request is charged the configured estimate."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme", tpm=600)      # refills 10 tokens a second
    other, _ = apikeys.create_key(r, "beta", tpm=600)
    (node,) = simnodes(1, time_scale=0.02)
    # no leases: the headers then show the bucket itself
    edge = edge_factory(settings(redis_server.url, [node.node_settings()], default_max_tokens=0,
                                 chars_per_token=16, lease_fraction=0))
    bucket = keynames.ratelimit_key(rec.id, "tpm")
    body = {"model": "sim-llama", "sim_output_tokens": 1,
            "messages": [{"role": "user", "content": "a" * 160}]}

    first = post(edge.url, key, body)
    assert first.status_code == 200, first.text
    billed = first.json()["usage"]["prompt_tokens"]
    assert billed >= 40
    assert first.headers["x-ratelimit-remaining-tokens"] == str(600 - 10)
    for _ in range(2):
        assert post(edge.url, key, body).status_code == 200
    # all three answers settled (each costs billed + 1; the bucket refills 10/s), then
    # the bucket is emptied of its history
    wait_bucket(r, bucket, lambda v: v < 600 - 3 * (billed + 1) + 25)
    r.delete(bucket)
    res = post(edge.url, key, body)
    assert res.status_code == 200, res.text
    charged = 600 - int(res.headers["x-ratelimit-remaining-tokens"])
    assert billed - 1 <= charged <= billed + 1, (charged, billed)
    fresh = post(edge.url, other, body)
    assert fresh.headers["x-ratelimit-remaining-tokens"] == str(600 - 10)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream_relay"])
def test_a_request_the_node_refuses_gives_its_tokens_back(redis_server, simnodes,
                                                         edge_factory, stream) -> None:
    """A 4xx from the node (here vLLM's context-length 400) means no token was read or
    generated: the estimate charged up front is given back, as OpenAI charges nothing for
    a refused request (also a stream, whose refusal the stream relay passes on itself:
    nginx has no $upstream_status then). The request itself still counts against
    requests per minute."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme", tpm=1000, rpm=100)
    (node,) = simnodes(1, time_scale=0.02)
    edge = edge_factory(settings(redis_server.url, [node.node_settings()]))
    bucket = keynames.ratelimit_key(rec.id, "tpm")
    # 80,000 characters: over the node's KV cache (16,384 tokens); estimated at 20,000
    # tokens, charged as the bucket's 1,000
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "a" * 80000}],
            "stream": stream}
    res = post(edge.url, key, body)
    assert res.status_code == 400 and "maximum context length" in res.text, res.text
    assert res.headers["x-ratelimit-remaining-tokens"] == "0"
    wait_bucket(r, bucket, lambda v: v >= 999)  # given back (and a little refill)
    assert res.headers["x-ratelimit-remaining-requests"] == "99"
    assert node.state()["requests_total"] == 1


def _abandon(url: str, key: str, body: dict) -> None:
    """POST ``body`` and leave after 0.5 s, before the answer."""
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{url}/v1/chat/completions", json=body, timeout=0.5,
                      headers={"Authorization": f"Bearer {key}"})


ABANDONED = {**CHAT, "max_tokens": 500}


def test_an_answer_left_at_a_node_keeps_its_reservation(redis_server, tiny_upstreams,
                                                        edge_factory) -> None:
    """A request that is not a stream, left by its client once a node has it: the node
    may write the answer to its end (llama-server does), so the output reserved is not
    given back (it was, and a key could send and abandon answers past its token limit).
    A later request of another key, settled after it in the same worker's queue, shows
    that the correction queue had run."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "leaver", tpm=60)
    other, rec2 = apikeys.create_key(r, "other", tpm=6000)
    (up,) = tiny_upstreams(1)
    up.delay_s = 2.0
    s = settings(redis_server.url, [up.node_settings()], lease_fraction=0)
    s.edge.workers = 1
    edge = edge_factory(s)
    bucket = keynames.ratelimit_key(rec.id, "tpm")
    _abandon(edge.url, key, ABANDONED)        # charged the bucket's 60 up front
    assert float(r.hget(bucket, "tokens")) <= 1
    up.delay_s = 0.0
    assert post(edge.url, other).status_code == 200
    # the other key's correction (its reservation of 256 back, less its usage) landed
    wait_bucket(r, keynames.ratelimit_key(rec2.id, "tpm"), lambda v: v > 6000 - 50)
    assert float(r.hget(bucket, "tokens")) <= 1, "the abandoned reservation went back"


def test_an_answer_read_on_after_its_client_left_is_charged_its_usage(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """On llama.cpp nodes (slots_source "server") the relay reads an answer whose client
    left to its end, for the node's slot: the key is settled on that answer's usage, as
    if the client had got it (403 tokens on a 60-per-minute bucket: 343 owed)."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "leaver", tpm=60)
    ups = tiny_upstreams(names=["a", "b"])
    for u in ups:
        u.delay_s, u.completion_tokens = 2.0, 400
    s = settings(redis_server.url, [], lease_fraction=0)
    s.edge.workers, s.edge.stale_after_s = 1, 3600
    edge = edge_factory(s)
    snap = write_snapshot(r, [u.snapshot_node(kind="openai", slots=2, slots_source="server",
                                              score=None, has_metrics=False) for u in ups])
    edge.wait_snapshot(snap["version"])
    _abandon(edge.url, key, ABANDONED)
    owed = wait_bucket(r, keynames.ratelimit_key(rec.id, "tpm"), lambda v: v < -300, 10)
    assert owed > -60 - 403, owed


def test_stream_usage_corrects_the_token_bucket(redis_server, simnodes, edge_factory) -> None:
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme", tpm=1000)
    (node,) = simnodes(1, time_scale=0.02)
    edge = edge_factory(settings(redis_server.url, [node.node_settings()], default_max_tokens=0))
    bucket = keynames.ratelimit_key(rec.id, "tpm")
    body = {"model": "sim-llama", "sim_output_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "b" * 40}]}
    with requests.post(f"{edge.url}/v1/chat/completions", json=body, stream=True, timeout=15,
                       headers={"Authorization": f"Bearer {key}"}) as res:
        assert res.status_code == 200
        text = b"".join(res.iter_content(None)).decode()
    assert text.rstrip().endswith("data: [DONE]")
    m = re.findall(r'"total_tokens":\s*(\d+)', text)
    total = int(m[-1])
    left = wait_bucket(r, bucket, lambda v: v < 1000 - 10 - 20)
    assert abs(left - (1000 - total)) < 3


def test_two_edges_share_one_global_limit(redis_server, tiny_upstreams, edge_factory) -> None:
    ups = tiny_upstreams(2)
    s = settings(redis_server.url, [u.node_settings() for u in ups], auth=False, global_rpm=10)
    a, b = edge_factory(s), edge_factory(s)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: (i % 2, post((a, b)[i % 2].url).status_code), range(40)))
    elapsed = time.monotonic() - started
    allowed = [e for e, c in codes if c == 200]
    assert {c for _, c in codes} <= {200, 429}
    # 10 at once, plus what refills (10 per minute) while the requests run
    assert 10 <= len(allowed) <= 10 + 1 + int(elapsed * 10 / 60), (len(allowed), elapsed)
    assert set(allowed) == {0, 1}, "both edges admitted some: the bucket is shared"
    res = post(a.url)
    assert res.status_code == 429
    assert res.json()["error"]["message"].startswith("Rate limit reached for this gateway")
    rejected = a.status()["admission"]["rate_limited"] + b.status()["admission"]["rate_limited"]
    assert rejected == 40 - len(allowed) + 1


def script_calls(r) -> int:
    """EVALSHA + EVAL calls Redis has run so far (INFO commandstats)."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def sequential_posts(url: str, n: int, r) -> tuple[list[int], int]:
    """n requests one after the other on one connection (one worker): their statuses and
    the script calls Redis ran meanwhile."""
    with requests.Session() as http:
        before = script_calls(r)
        codes = [http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=15).status_code
                 for _ in range(n)]
        return codes, script_calls(r) - before


def test_a_key_flooding_past_its_limit_costs_redis_one_call_per_worker_and_second(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A request bucket that refused cannot refill before its wait: the worker refuses
    that key's next requests itself for up to REFUSED_MAX_S (1 s), with the same 429 and
    a Retry-After that counts down, then asks Redis again. Another key is unaffected."""
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "flood", rpm=2)
    other, _ = apikeys.create_key(r, "calm", rpm=100)
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], lease_fraction=0))
    headers = {"Authorization": f"Bearer {key}"}
    with requests.Session() as http:
        def send() -> requests.Response:
            return http.post(f"{edge.url}/v1/chat/completions", json=CHAT, headers=headers,
                             timeout=15)

        assert [send().status_code for _ in range(2)] == [200, 200]
        first = send()
        assert first.status_code == 429
        before, started = script_calls(r), time.monotonic()
        refused = [send() for _ in range(40)]
        calls, elapsed = script_calls(r) - before, time.monotonic() - started
    assert {x.status_code for x in refused} == {429}
    assert all(x.json()["error"]["code"] == "rate_limit_exceeded" for x in refused)
    retries = [int(x.headers["Retry-After"]) for x in refused]
    assert max(retries) <= int(first.headers["Retry-After"]) and min(retries) >= 1
    # one call per worker at most each second (the bucket is asked again after 1 s)
    workers = edge.settings.edge.workers
    assert calls <= workers * (1 + int(elapsed)), (calls, elapsed)
    assert up.hits == 2
    assert post(edge.url, other).status_code == 200
    assert edge.status()["admission"]["rate_limited"] == 41


def test_leases_spare_round_trips_and_never_exceed_the_limit(redis_server, tiny_upstreams,
                                                             edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    r = redis_server.client()
    # 3000 per minute: leases of up to 30 requests (lease_fraction 0.01)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False,
                                 global_rpm=3000))
    started = time.monotonic()
    codes, calls = sequential_posts(edge.url, 120, r)
    elapsed = time.monotonic() - started
    assert codes == [200] * 120
    assert calls <= 40, f"{calls} script calls for 120 requests: leases did not cover them"
    # the bucket is charged ahead, never behind: Redis holds at most what is left after
    # the 120 requests, plus the refill meanwhile (50 per second)
    tokens = float(r.hget(keynames.ratelimit_global("rpm"), "tokens"))
    assert tokens <= 3000 - 120 + 50 * (elapsed + 0.5), (tokens, elapsed)

    # a small bucket with leases under load: never more than the limit. The same global
    # bucket, so first the first edge's unspent lease goes back (its capacity is 3000),
    # then the bucket starts afresh
    idle = script_calls(r)
    procs.wait_until(lambda: script_calls(r) > idle, 10, interval=0.05,
                     what="the first edge's unspent lease to go back to Redis")
    r.delete(keynames.ratelimit_global("rpm"))
    small = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False,
                                  global_rpm=200))
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: post(small.url).status_code, range(260)))
    elapsed = time.monotonic() - started
    assert set(got) <= {200, 429}
    allowed = got.count(200)
    assert allowed <= 200 + 1 + int(elapsed * 200 / 60), (allowed, elapsed)
    assert allowed >= 190, allowed  # early refusals: at most the leases held (2 each)


def test_a_key_running_dry_does_not_hoard_the_global_bucket(redis_server, tiny_upstreams,
                                                             edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    r = redis_server.client()
    s = settings(redis_server.url, [up.node_settings()], global_rpm=900)
    s.edge.workers = 2
    edge = edge_factory(s)
    keys = [apikeys.create_key(r, t, rpm=rpm)[0] for t, rpm in
            (("t1", 600), ("t2", 600), ("t3", 150))]
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda i: post(edge.url, keys[i % 3]).status_code, range(1100)))
    elapsed = time.monotonic() - started
    assert set(got) <= {200, 429}
    allowed = got.count(200)
    # the global bucket binds (the keys allow 1350): all of it is used, give or take what
    # the two workers' leases hold (9 each), and never more than it plus its refill
    assert 900 - 2 * 9 - 2 <= allowed <= 900 + 1 + int(elapsed * 900 / 60), (allowed, elapsed)


def test_expired_lease_goes_back_and_lease_fraction_zero_is_exact(redis_server, tiny_upstreams,
                                                                 edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    r = redis_server.client()
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False,
                                 global_rpm=6000))
    codes, _ = sequential_posts(edge.url, 60, r)
    assert codes == [200] * 60
    idle = script_calls(r)
    # no request now: the worker's flush timer gives the unspent lease back (one script
    # call in mode "adjust") once it is LEASE_TTL_S old
    procs.wait_until(lambda: script_calls(r) > idle, 10, interval=0.05,
                     what="the unspent lease to go back to Redis")

    exact = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False,
                                  global_rpm=6000, lease_fraction=0))
    codes, calls = sequential_posts(exact.url, 30, r)
    assert codes == [200] * 30 and calls == 30


def test_redis_down_falls_back_to_local_buckets(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False, global_rpm=4))
    redis_server.stop()
    codes = [post(edge.url).status_code for _ in range(7)]
    assert codes == [200] * 4 + [429] * 3, codes
    res = post(edge.url)
    assert res.status_code == 429 and res.json()["error"]["code"] == "rate_limit_exceeded"
    assert res.headers["x-ratelimit-limit-requests"] == "4"
    st = edge.status()["admission"]
    # charged in the local buckets: the 4 admitted and the first refusal; the next
    # refusals come within that refusal's wait, which the worker remembers
    assert st["limits_local"] == 5 and st["rate_limited"] == 4
    # the outage is logged once, not per request
    assert edge.error_log().count("Redis unreachable for API keys and rate limits") == 1


def test_local_buckets_go_on_from_the_level_redis_last_reported(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A key that used up its minute in Redis does not get its burst again from the
    local buckets when Redis goes away: they start from the level Redis last reported."""
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "spent", rpm=3)
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], lease_fraction=0))
    assert [post(edge.url, key).status_code for _ in range(3)] == [200, 200, 200]
    redis_server.stop()
    res = post(edge.url, key)
    assert res.status_code == 429, res.text
    assert int(res.headers["Retry-After"]) >= 15          # one request refills in 20 s
    assert edge.status()["admission"]["limits_local"] >= 1


def test_script_sha_matches_redis(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()], auth=False, global_rpm=100))
    assert post(edge.url).status_code == 200
    script = (Path(__file__).resolve().parents[2] / "lua" / "infergate" / "admission" / "bucketscript.lua").read_text()
    body = re.search(r"_M\.SCRIPT = \[\[\n(.*?)\]\]", script, re.S).group(1)
    sha = hashlib.sha1(body.encode()).hexdigest()
    r = redis_server.client()
    assert r.script_exists(sha) == [True]  # loaded by the EVAL fallback: EVALSHA works next
    assert post(edge.url).status_code == 200


def test_openai_client_sees_rate_limit_and_auth_errors(redis_server, tiny_upstreams, edge_factory) -> None:
    import openai

    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme", rpm=1)
    (up,) = tiny_upstreams(1)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()]))
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0, timeout=10)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT["messages"])
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.parse().choices[0].message.content == f"hello from {up.name}"
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="tiny", messages=CHAT["messages"])
    exc = limited.value
    assert exc.status_code == 429 and exc.code == "rate_limit_exceeded" and exc.type == "requests"
    assert int(exc.response.headers["retry-after"]) >= 1
    bad = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="ig-wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_a_script_redis_refuses_on_every_request_is_logged_once(redis_server, tiny_upstreams,
                                                                edge_factory) -> None:
    """Redis out of memory with ``noeviction`` refuses the rate-limit script (an error
    reply, not an outage): every request is still answered, decided on the edge's local
    buckets, and the error log gets one line for the burst, not one per request."""
    (up,) = tiny_upstreams(1)
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme", rpm=100000)
    edge = edge_factory(settings(redis_server.url, [up.node_settings()]), check_log=False)
    assert post(edge.url, key).status_code == 200
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        codes = [post(edge.url, key).status_code for _ in range(20)]
    finally:
        r.config_set("maxmemory", "0")
    assert codes == [200] * 20
    lines = [ln for ln in edge.error_log().splitlines() if "rate-limit script failed" in ln]
    assert len(lines) == 1, lines
    assert "OOM" in lines[0] and "failure(s) since the last such line" in lines[0]
