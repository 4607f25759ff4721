"""infergate control plane: node poller, scorer, routing snapshot writer, admin API,
simulated inference node and the `infergate` command line."""

__version__ = "0.1.0"
