"""Live status while a start is watched."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TYPE_CHECKING

from vllm_ctxmgr.cli.output import echo, printable
from vllm_ctxmgr.masking import scrub

if TYPE_CHECKING:
    from vllm_ctxmgr.change.observing import StartProgress


class LiveStatus:
    """While a start is watched: on a terminal, one status line rewritten every second (phase from vLLM's
    lines, elapsed, time left, a bar where vLLM counts); elsewhere (a pipe, the journal, Ansible's log)
    a plain timestamped line every `every` seconds. No colour either way; the terminal line only uses
    carriage return and erase-line, so NO_COLOR has nothing to turn off."""

    def __init__(self, enabled: bool, terminal: bool, every: float = 30.0) -> None:
        self.enabled, self.terminal, self.every = enabled, terminal, every
        self.shown = False
        self.last = time.monotonic()

    def tick(self, progress: StartProgress) -> None:
        if not self.enabled:
            return
        if self.terminal:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stderr.write("\r\x1b[K" + printable(scrub(progress.text()))[:width])
            sys.stderr.flush()
            self.shown = True
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            echo(f"ctxmgr: {time.strftime('%H:%M:%S')} {progress.text()}", err=True)

    def clear(self) -> None:
        """Erase the status line before a line of its own is printed (it is drawn again next tick)."""
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False
