"""Run ctxmgr so that its state directory's filesystem fills up right after one step of a change is
recorded, as a disk filling under a running change would.

    python tests/support/fill_run.py STEP FILLER ctxmgr-arguments...

STEP as in crash_run.py (`-` fills nothing); FILLER a file on the state directory's filesystem (a
small tmpfs the caller mounted in its own mount namespace) that is written until ENOSPC. Run by path,
like crash_run.py; the hook is set from Python: nothing a user can set does this.
"""

from __future__ import annotations

import contextlib
import sys

from vllm_ctxmgr import store
from vllm_ctxmgr.cli.main import main


def fill(filler: str) -> None:
    with contextlib.suppress(OSError), open(filler, "ab") as handle:
        while True:
            handle.write(b"\0" * 4096)
            handle.flush()


def fill_at(step: str, filler: str) -> None:
    def hook(name: str, command: str) -> None:
        if step in (name, f"{command}:{name}"):
            fill(filler)

    store.step_hook = hook


if __name__ == "__main__":
    fill_at(sys.argv[1], sys.argv[2])
    main(args=sys.argv[3:], prog_name="ctxmgr")
