"""Fixtures that start several parts together (simulated nodes, control plane, nginx)."""
