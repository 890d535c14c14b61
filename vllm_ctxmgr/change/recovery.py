"""Finish what an interrupted ctxmgr run left: the one recovery routine.

A run killed at any step leaves a record that names the step under way (states.py). `recover`, run by
itself or first thing by the next set-context or rollback on the service (holding its lock), reads the
newest unfinished record and does only what is left; `recover_if_needed` gives the order.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import Change, ChangeResult, Result, result_for, roll_back
from vllm_ctxmgr.errors import CtxmgrError, ExitCode
from vllm_ctxmgr.store import Revision, State
from vllm_ctxmgr.systemd.service import read_service


def recover_if_needed(restarter: Restarter) -> ChangeResult | None:
    """The one recovery routine (call it holding the lock). In this order:

    1. remove what killed runs leave and nothing else removes: half-written revision directories
       (they must never wedge the numbering), atomic_write's temporaries beside the unit,
       `systemd-analyze verify` staging in /run, the candidate directory;
    2. finish the newest unfinished revision, doing only what is left:
       a. probed, its unit installed and the service active: only the record was left -> final;
       b. the service still runs the process it ran when the change was recorded (same
          InvocationID, active): nothing restarted it, so the previous bytes go back (if they
          are not there already) with a daemon-reload, and no restart -> rolled-back;
       c. otherwise the previous unit goes back through the verified restart path;
    3. prune revisions no rollback or recovery can need.
    Returns None when nothing was left in progress."""
    _remove_leftovers(restarter)
    rev = restarter.store.in_progress()
    result = _recover(restarter, rev) if rev is not None else None
    restarter.store.prune()
    return result


def _remove_leftovers(restarter: Restarter) -> None:
    systemd, store = restarter.systemd, restarter.store
    unit_paths = {Path(str(f["path"])) for rev in store.revisions() for f in rev.files}
    with contextlib.suppress(CtxmgrError):
        view = read_service(systemd, restarter.service)
        unit_paths |= {f.path for f in view.unit.files}
    dirs = sorted({systemd.host_path(p.parent) for p in unit_paths})
    names = sorted({p.name for p in unit_paths})
    removed = store.remove_leftovers(dirs, systemd.host_path(Path("/run")), names)
    for path in removed:
        restarter.on_step(f"removed {path}, left by an interrupted run")


def _recover(restarter: Restarter, rev: Revision) -> ChangeResult:
    service, store = restarter.service, restarter.store
    restarter.on_step(f"revision {rev.number} of {service} was left {rev.state} by an interrupted run")
    change = Change(store, rev, store.file_changes(rev), command="recover")
    result = result_for(rev, "recover")
    installed = [restarter.installed_bytes(f.path) for f in change.files]
    state = restarter.systemd.state(restarter.unit)
    active = state.active_state == "active" and state.sub_state == "running"

    def left(signal: str) -> str:
        return (
            f"recover was interrupted by {signal}: revision {rev.number} is left {rev.state}; "
            f"run `ctxmgr recover --service {service}` again"
        )

    with change.guard_signals(left, first_too=True):
        return _finish(restarter, change, result, installed, active, state.invocation_id)


def _finish(
    restarter: Restarter,
    change: Change,
    result: ChangeResult,
    installed: list[bytes | None],
    active: bool,
    invocation: str,
) -> ChangeResult:
    rev = change.rev
    if rev.state is State.PROBED and installed == [f.unit for f in change.files] and active:
        result.reason = "served and passed the context-sized probe (the record was finished by recover)"
        change.finalise(result.reason, "the interrupted run had probed it; only the record was left")
        return result
    interrupted = f"an interrupted ctxmgr run left this change {rev.state}"
    untouched = active and bool(rev.invocation_id) and invocation == rev.invocation_id
    if untouched:
        note = "the service never restarted: the previous unit goes back without a restart"
        change.enter(State.ROLLING_BACK, note)
        restarter.put_back(change.files)  # every file the run may have written, newest first
        rev.reason = f"{interrupted}; it was undone (nothing had restarted the service)"
        change.enter(State.ROLLED_BACK, "the previous unit is installed and its process still serves")
        result.result, result.reason = Result.ROLLED_BACK, rev.reason
        return result
    result.reason = f"{interrupted}; the previous unit was put back"
    roll_back(restarter, change, result, note=interrupted, wait_exit=False)
    if result.result is Result.ROLLED_BACK:
        result.exit_code = ExitCode.OK  # recovering is what was asked, and it worked
        rev.reason = result.reason
        restarter.store.save(rev)
    return result
