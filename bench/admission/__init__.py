"""``python -m bench.admission``: the same open-loop load at about twice the capacity of
a simulated pool, through the infergate edge with load shedding on and then off; timeout
rate and latency of the admitted requests side by side."""
