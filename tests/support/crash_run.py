"""Run ctxmgr so that it dies right after one step of a change is recorded, as kill -9 would.

    python tests/support/crash_run.py STEP ctxmgr-arguments...

STEP is a state (`restarting`) or `COMMAND:STATE` (`rollback:installed`), `revision-staged`, or
`unit-file-written` (after each unit file a change writes, before systemd is reloaded). Run by
path, not as a module, so that `vllm_ctxmgr` is the one the interpreter's environment installed (the
wheel under test), never this checkout. The hook is set from Python: nothing a user can set does this.
"""

from __future__ import annotations

import os
import sys

from vllm_ctxmgr import store
from vllm_ctxmgr.cli.main import main


def die_at(step: str) -> None:
    def hook(name: str, command: str) -> None:
        if step in (name, f"{command}:{name}"):
            os._exit(137)

    store.step_hook = hook


if __name__ == "__main__":
    die_at(sys.argv[1])
    main(args=sys.argv[2:], prog_name="ctxmgr")
