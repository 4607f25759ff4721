"""Semantic-cache quality benchmark (see run.py)."""
