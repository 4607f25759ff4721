"""Streams that survive their node: the drill and the TTFT cost of holding the first
byte (``python -m bench.stream_survival``, see :mod:`.run`)."""
