"""``python -m bench.scheduler``: nginx round-robin, nginx least_conn and the infergate
balancer driven with the same open-loop Poisson load over a simulated pool of unequal
nodes. See bench/README.md."""
