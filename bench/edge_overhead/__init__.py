"""``python -m bench.edge_overhead``: requests/s and latency that the infergate edge adds
in front of a free upstream, against plain nginx ``proxy_pass`` (wrk). See bench/README.md."""
