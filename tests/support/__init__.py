"""Helpers shared by the tests (fixtures, launchers, the tiny upstream)."""
