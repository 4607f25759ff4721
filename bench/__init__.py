"""Benchmarks of infergate: the balancer against nginx round-robin and least_conn
(``python -m bench.scheduler``) and the cost of the edge (``python -m bench.edge_overhead``).
See bench/README.md."""
