"""A hang fails the test instead of stalling the run: for the tests of bounded readers (a FIFO, a
YAML bomb, /dev/zero), where the failure being guarded against is exactly a read that never ends."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """Raise TimeoutError in the main thread if the block takes longer than `seconds`."""

    def expired(*_: object) -> None:
        raise TimeoutError(f"{what} did not finish in {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
