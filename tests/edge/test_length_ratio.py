"""The service time is of the mean answer length (infergate.routing.speed with
infergate.routing.learned.length_ratio): a run of short answers on a node does not make
it look fast, as the streams' tokens are known, relayed by the edge or proxied by nginx
(edge.stream_relay off). A simulated batching node, one request at a time."""

from __future__ import annotations

import pytest
import requests

from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration


def _one(edge, tokens: int) -> None:
    body = {"model": "sim-llama", "stream": True, "sim_output_tokens": tokens,
            "messages": [{"role": "user", "content": f"answer {tokens}"}]}
    res = requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=30)
    assert res.status_code == 200, res.text
    assert res.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("relay", [True, False], ids=["relayed", "proxied"])
def test_short_answers_after_a_mix_leave_the_service_time_of_the_mean_length(
        simnodes, redis_server, edge_factory, relay) -> None:
    (node,) = simnodes(1, "--max-running", "4", time_scale=0.1, names=["len-a"])
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000)
    s.edge.stream_relay = relay
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [node.snapshot_node(max_concurrency=4,
                                                                     score=0.1)])
    edge.wait_snapshot(snap["version"])
    for i in range(16):                      # a mix: 10 and 200 tokens, the line learned
        _one(edge, 200 if i % 2 else 10)
    mixed = edge.node_status("len-a")["service_s"]
    for _ in range(12):                      # then only short answers
        _one(edge, 10)
    short = edge.node_status("len-a")["service_s"]
    # taken as they come, 12 answers of a twentieth of the long ones' time would have
    # brought the estimate to about a third of the mix's (0.9^12 = 0.28)
    assert short > 0.7 * mixed, (mixed, short)
