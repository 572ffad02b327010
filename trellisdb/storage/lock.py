"""The writer lock: one committing writer at a time, across threads and processes.

``fcntl.flock`` on ``<db>/LOCK``. The kernel releases it when the holder dies, so
a SIGKILLed writer never wedges the database. Readers never take it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class WriterLock:
    def __init__(self, path: str) -> None:
        self.path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the duration of the block (re-entrant in one thread)."""
        with self._thread_lock:
            if self._depth == 0:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                    self._fd = None
