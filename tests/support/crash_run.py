"""Run ctxmgr so that it dies right after one step of a change is recorded, as kill -9 would.

    python tests/support/crash_run.py STEP ctxmgr-arguments...

STEP is a state (`restarting`) or `COMMAND:STATE` (`rollback:installed`, `node:final`), `revision-staged`,
or `unit-file-written` (after each unit file a change writes, before systemd is reloaded). For a
deployment's coordinator, which records no state of its own (its nodes do), STEP may be
`after-node:STEP:N`: it dies once the Nth answer to a `ctxmgr node STEP` it asked for has come back
(`after-node:prepare:1`: the first node written, the next not asked yet), where a kill -9 between two of
its steps would leave the deployment. Run by path, not as a module, so that `vllm_ctxmgr` is the one
the interpreter's environment installed (the wheel under test), never this checkout. The hook is set
from Python: nothing a user can set does this.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from vllm_ctxmgr import store
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.deployment.remote import Link


def die_at(step: str) -> None:
    def hook(name: str, command: str) -> None:
        if step in (name, f"{command}:{name}") and first_death():
            os._exit(137)

    store.step_hook = hook


def first_death() -> bool:
    """Where CTXMGR_CRASH_ONCE names a file, only the run that makes it dies: a deployment runs a node's
    ctxmgr once per step, and a kill -9 comes once, not at the same point of each later step too."""
    once = os.environ.get("CTXMGR_CRASH_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def die_after_node_step(step: str, count: int) -> None:
    """The coordinator dies after the `count`th answer to `node STEP` (a dry run's not counted)."""
    real = Link.call
    answers = 0
    lock = threading.Lock()

    def call(
        self: Link,
        host: str,
        args: Sequence[str],
        timeout: float,
        stdin: dict[str, Any] | None = None,
        label: str | None = None,
    ) -> dict[str, Any]:
        nonlocal answers
        answer = real(self, host, args, timeout, stdin, label)
        if list(args[:2]) == ["node", step] and "--dry-run" not in args:
            with lock:  # nodes are asked from several threads at once
                answers += 1
                if answers == count:
                    os._exit(137)
        return answer

    Link.call = call  # type: ignore[method-assign]


if __name__ == "__main__":
    kind, _, rest = sys.argv[1].partition(":")
    if kind == "after-node":
        node_step, _, nth = rest.rpartition(":")
        die_after_node_step(node_step, int(nth))
    else:
        die_at(sys.argv[1])
    main(args=sys.argv[2:], prog_name="ctxmgr")
