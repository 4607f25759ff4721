"""A logging filter that passes at most one record of a logger per interval.

waitress logs "Task queue depth is N" (logger ``waitress.queue``) on every request that
waits for a thread: a flood of the admin port wrote 58,000 such lines in 36 s. One line
an interval tells the operator the same."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class OncePer(logging.Filter):
    """Passes a record when ``every_s`` seconds passed since the last one passed, and
    counts the ones it dropped into the next (``" (N more like it)"``)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self._dropped += 1
            return False
        if self._dropped:
            record.msg = f"{record.getMessage()} ({self._dropped} more like it since)"
            record.args = None
        self._last, self._dropped = now, 0
        return True


def throttle(logger_name: str, every_s: float = 30.0) -> None:
    """Let logger ``logger_name`` pass at most one record per ``every_s`` seconds."""
    logging.getLogger(logger_name).addFilter(OncePer(every_s))
