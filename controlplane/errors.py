"""The one base class of every exception the ``controlplane`` package raises on purpose.

``except InfergateError`` catches any of them (a bad configuration, a bad Redis URL, an
admin operation refused, an unparseable metrics page, a model that does not load, ...)
and nothing else: programming errors and third-party exceptions (``redis``,
``requests``, ``OSError``) pass through. Each class keeps its other base as well
(``ValueError`` for bad input, ``RuntimeError`` for a missing dependency or a failed
start), so code that catches those keeps working.

This module imports nothing from the package, so every module can import it.
"""

from __future__ import annotations


class InfergateError(Exception):
    """Base of the package's own exceptions; ``str(exc)`` is a message for people."""
