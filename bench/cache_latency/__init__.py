"""Semantic-cache latency benchmark (see run.py)."""
