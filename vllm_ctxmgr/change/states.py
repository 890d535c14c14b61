"""One change and its states: the record written before each step, the operations every walk is made
of, the way back, and what it reports.

    planned -> recorded -> installed -> restarting -> serving -> probed -> final
          any of recorded .. probed -> rolling-back -> rolled-back | rollback-failed

(the store's package docstring says what each state means on disk; store.TRANSITIONS, in
store/transitions.py, is the table of allowed moves.)
`Change.enter` is the only way a revision changes state: it writes record.json, with a step line
(state, ISO time, note), BEFORE the step it names begins. So a run killed anywhere leaves a record
that names the step under way, and recovery.py finishes from there.

The operations live once, on `Change` (certbot's reverter is the model: one primitive every installer
reuses): `ensure_baseline`, `install_checked` (write, daemon-reload, check the ExecStart= systemd will
run), `stop_before_restart`, `settle` (rolled-back | rollback-failed), `hold_back` (the stop left the old
instance on the GPU: files back, nothing started), `finalise`, and `guard_signals`;
undoing the writes is `Restarter.put_back`. The one-service walk (walk.py), recovery (recovery.py) and
each node's step of a deployment (deployment/node.py) are made of them; a deployment's coordinator takes
the same signal guard and settle decision (`guard_signals`, `how_settled`). The backward walk (`roll_back`)
lives here because walk and recovery both take it, and recovery must not import walk (walk runs
recovery first).

SIGTERM, SIGINT and SIGHUP during a change (what Ansible's async timeout, systemd and a terminal send)
fail the change like any other failure: the previous unit is put back and the exit is non-zero. A
second signal while that rollback runs stops at once and leaves the record for `recover`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from vllm_ctxmgr import store as st
from vllm_ctxmgr.change.restart import InstallError, Restarter
from vllm_ctxmgr.core.calibration import CalibrationRecord
from vllm_ctxmgr.core.downtime import DowntimeRecord
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.observations import ObservationFigures
from vllm_ctxmgr.core.records import ProbeRecord
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.store import FileChange, Revision, ServiceStore, State, Step, crash_point
from vllm_ctxmgr.systemd.service import ServiceView

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def planned_revision(restarter: Restarter, **fields: Any) -> Revision:
    """A revision in memory (planned) with who, where and which versions make it: the one way every
    walk builds one (one service's change and each node's step of a deployment)."""
    state = restarter.systemd.state(restarter.unit)
    return Revision(
        number=0,
        service=restarter.service,
        state=State.PLANNED,
        created=time.time(),
        invocation_id=state.invocation_id or None,
        **st.made_by(),
        **fields,
    )


class Result(StrEnum):
    """What a command did to a service: the `result` of its --json object and of the text report."""

    PLANNED = "planned"  # set-context's plan before it is applied (never printed as a final result)
    UNCHANGED = "unchanged"
    APPLIED = "applied"
    DRY_RUN = "dry-run"
    ROLLED_BACK = "rolled-back"
    ROLLBACK_FAILED = "rollback-failed"
    INFEASIBLE = "infeasible"


@dataclass
class ChangeResult:
    """What one command did to a service, in the shape --json prints (the automation contract)
    and the text report reads."""

    service: str
    action: str  # set-context | rollback | recover
    result: Result
    changed: bool
    exit_code: int = ExitCode.OK
    revision: int | None = None
    previous_max_model_len: int | None = None
    max_model_len: int | None = None
    previous_gpu_memory_utilization: float | None = None
    gpu_memory_utilization: float | None = None
    reason: str = ""
    decisive_line: str = ""
    suggestion: str = ""
    diff: str = ""
    unit_path: str = ""
    plan: Mapping[str, object] = field(default_factory=dict)  # the PlanRecord the change followed
    probe: ProbeRecord = field(default_factory=ProbeRecord)
    observation: ObservationFigures = field(default_factory=ObservationFigures)
    calibration: CalibrationRecord = field(default_factory=CalibrationRecord)  # predicted vs observed KV
    timings: dict[str, float] = field(default_factory=dict)
    pending_recovery: int | None = None  # a revision an interrupted run left: a real run recovers it first
    warnings: list[str] = field(default_factory=list)  # verify findings the unit had before the change
    expected_downtime: DowntimeRecord = field(default_factory=DowntimeRecord)  # before the restart

    def settled(self, ok: bool, why: str = "") -> None:
        """How a way back ended (`how_settled`): rolled-back, or rollback-failed with `why`."""
        self.result, self.exit_code, self.reason = how_settled(ok, self.reason, why)

    def stopped_before_restart(self, stopped: StoppedBeforeRestart) -> None:
        """The change ended before any restart: rolled back, nothing changed (exit 1)."""
        self.result, self.exit_code, self.changed = Result.ROLLED_BACK, ExitCode.ERROR, False
        self.reason = stopped.message

    def to_json(self) -> JSONObject:
        """Plain JSON types for --json; cli.finish adds `command` and `dry_run` around them."""
        data = asdict(self)
        data["result"] = str(self.result)
        return data


def result_for(rev: Revision, action: str) -> ChangeResult:
    """The result of walking `rev`, before the walk says how it ended (applied until it fails)."""
    return ChangeResult(
        rev.service,
        action,
        Result.APPLIED,
        True,
        revision=None if rev.state is State.PLANNED else rev.number,  # recording numbers it
        max_model_len=rev.max_model_len,
        previous_max_model_len=rev.previous_max_model_len,
        gpu_memory_utilization=rev.gpu_memory_utilization,
        previous_gpu_memory_utilization=rev.previous_gpu_memory_utilization,
        unit_path=rev.unit_path,
    )


@dataclass
class Change:
    """A revision on its way through the states, with every unit file it changes: the bytes it installs
    and the bytes they replace."""

    store: ServiceStore
    rev: Revision
    files: list[FileChange]  # in the order written; None bytes: the file is (or was) absent
    command: str = ""  # the ctxmgr command walking it: set-context | rollback | recover
    unwritten: list[str] = field(default_factory=list)  # records the way back could not write (ENOSPC)

    def installs(self) -> list[tuple[Path, bytes | None]]:
        """What the forward walk writes, in order."""
        return [(f.path, f.unit) for f in self.files]

    def enter(self, state: State, note: str = "", *, unwritten_too: bool = False) -> None:
        """The one way into a state: check the table, write the record, then (test hook) maybe die. A
        record that cannot be written leaves the revision in its state before (`unwritten_too`: the
        way back goes on in memory all the same, and says so at the end)."""
        if state not in st.TRANSITIONS[self.rev.state]:
            raise RuntimeError(f"revision {self.rev.number}: no transition {self.rev.state} -> {state}")
        now = time.time()
        was, finished = self.rev.state, self.rev.finished
        self.rev.state = state
        self.rev.steps.append(Step(state, now, note))
        if state in st.FINISHED:
            self.rev.finished = now
        try:
            if state is State.RECORDED:
                self.store.new_revision(self.rev, files=self.files)
            else:
                self.store.save(self.rev)
        except st.StoreError:
            if unwritten_too:
                raise
            # not written (a full state directory): the revision is still in the state its record says,
            # so the way back starts from there, and a revision never recorded is still planned: nothing
            # was changed
            self.rev.state, self.rev.finished = was, finished
            self.rev.steps.pop()
            raise
        crash_point(str(state), self.command)

    def enter_or_note(self, state: State, note: str = "") -> None:
        """`enter` on the way back: a record that cannot be written (a full state directory) must not
        stop the previous unit from being put back; what was not written is said at the end."""
        try:
            self.enter(state, note, unwritten_too=True)
        except st.StoreError as exc:
            self.unwritten.append(exc.message)

    def paths(self) -> str:
        return ", ".join(str(f.path) for f in self.files)

    def install_checked(self, restarter: Restarter) -> ServiceView:
        """installed: write every file (install reloads systemd), then ask systemd which ExecStart= it
        will run. Where the record or a file cannot be written, or the unit as loaded would not serve
        the revision's max_model_len (an operator's later drop-in sets ExecStart=: restarting would
        serve its context, and a probe at the unit's own context would call it applied), the writes
        are undone and the change ends before any restart (StoppedBeforeRestart). InstallError: a
        file could not be put back; the caller's way back must restore it. Returns the loaded unit."""
        paths, rev = self.paths(), self.rev
        try:
            self.enter(State.INSTALLED, f"installing {paths}")
        except st.StoreError as exc:  # nothing installed yet: no restart to undo
            reason = f"nothing was installed: the record could not be written: {exc.message}"
            self.stop_before_restart(reason, exc.exit_code)
        try:
            restarter.install(self.installs())
        except InstallError as exc:
            self.stop_before_restart(f"nothing was installed: {exc.message}", exc.exit_code)
        try:
            view = restarter.loaded_view()
            wrong = serves_other(view, rev)
            if wrong:
                them = "them" if len(self.files) > 1 else "it"
                wrong = f"with {paths} as revision {rev.number} has {them}, {wrong}"
        except CtxmgrError as exc:
            wrong = f"with {paths} installed, the unit cannot be read: {exc.message}"
        if wrong:
            try:
                restarter.put_back(self.files)
            except InstallError as exc:
                raise InstallError(f"{paths} could not be put back: {exc.message}") from None
            self.stop_before_restart(f"{wrong}; nothing was restarted", UsageError.exit_code)
        return view

    def stop_before_restart(self, reason: str, exit_code: int) -> NoReturn:
        """Record a change that ends before the restart (rolling-back -> rolled-back): the unit is as it
        was and nothing restarted; StoppedBeforeRestart says why."""
        self.enter_or_note(State.ROLLING_BACK, reason)
        self.rev.reason = reason
        self.enter_or_note(State.ROLLED_BACK, "the previous unit is in place; nothing was restarted")
        raise StoppedBeforeRestart(reason + self.unwritten_note(), exit_code=exit_code)

    def settle(self, ok: bool, why: str, serving: str) -> Result:
        """rolling-back -> rolled-back where the previous unit serves again (`serving` says how it was
        proved), else rollback-failed with `why`, added to the revision's reason (`how_settled`)."""
        result, _, self.rev.reason = how_settled(ok, self.rev.reason, why)
        self.enter_or_note(State(result.value), serving if ok else why)
        return result

    def finalise(self, reason: str, note: str = "") -> None:
        """probed -> final: the change served and passed its probe; `reason` is the record's last word."""
        self.rev.verified = True
        self.rev.reason = reason
        self.enter(State.FINAL, note or reason)

    def guard_signals(
        self, left: Callable[[str], str], first_too: bool = False
    ) -> AbstractContextManager[None]:
        """`guard_signals` over this change's walk, until its record is final."""
        return guard_signals(lambda: self.rev.state in st.FINISHED, left, first_too)

    def unwritten_note(self) -> str:
        """What the result says when the record could not follow the way back."""
        if not self.unwritten:
            return ""
        return (
            f"; the record of revision {self.rev.number} could not be written ({self.unwritten[0]}): once "
            f"the state directory has room, run `ctxmgr recover --service {self.rev.service}`"
        )


class StoppedBeforeRestart(CtxmgrError):
    """The change ended before any restart (Change.install_checked): the unit is as it was, the record
    rolled-back, nothing restarted."""


def ensure_baseline(store: ServiceStore, view: ServiceView, files: list[FileChange]) -> None:
    """The first change to a service records the unit files it changes as found (None: a drop-in that
    does not exist yet), so `rollback --to 0` can return to them."""
    if store.revisions():
        return
    now = time.time()
    reason = "the unit as ctxmgr first found it"
    store.new_revision(
        Revision(
            number=0,
            service=store.service,
            state=State.BASELINE,
            unit_path=str(files[0].path),
            created=now,
            finished=now,
            max_model_len=view.args.max_model_len,
            gpu_memory_utilization=view.args.gpu_memory_utilization,
            vllm_version=view.args.vllm_version,
            action="baseline",
            reason=reason,
            steps=[Step(State.BASELINE, now, reason)],
            **st.made_by(),
        ),
        files=[FileChange(f.path, f.previous, f.previous) for f in files],
    )


def serves_other(view: ServiceView, rev: Revision) -> str:
    """Why the unit as systemd loads it now would not serve the revision's max_model_len (another file's
    ExecStart= wins); "" where it would."""
    if rev.max_model_len is None or view.args.max_model_len == rev.max_model_len:
        return ""
    holder = view.unit.exec_start()[0].path
    return (
        f"the unit would still serve max_model_len {view.args.max_model_len}, not {rev.max_model_len}: "
        f"{holder} sets its ExecStart= (the unit's files: {', '.join(str(f.path) for f in view.unit.files)})"
    )


class Interrupted(BaseException):
    """A signal during a change: it fails the change like any failure (BaseException, so no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name


class Abandoned(BaseException):
    """A second signal while the first one's rollback runs: stop now, leave the record for `recover`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def guard_signals(
    finished: Callable[[], bool], left: Callable[[str], str], first_too: bool = False
) -> Iterator[None]:
    """The one signal guard of every walk (one service's change, its recovery, a deployment's change).
    While `finished()` says the record is not final, the first SIGTERM, SIGINT or SIGHUP raises
    Interrupted, so the change fails and rolls back like any failure; the signal that must stop the run
    at once (the next; with `first_too`, any) ends it as a CtxmgrError, exit 5, whose message
    `left(signal name)` says what is left for `recover`. Once final, a signal is ignored (the run is
    about to exit by itself). Only the main thread can take signals."""
    received: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        if finished():
            return
        received.append(signum)
        raise Interrupted(signum) if len(received) == 1 else Abandoned(signum)

    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, handler) for sig in SIGNALS} if main else {}
    try:
        try:
            yield
        finally:
            for sig, old in before.items():
                signal.signal(sig, old)
    except Abandoned as exc:
        raise CtxmgrError(left(exc.name), exit_code=ExitCode.ROLLBACK_FAILED) from None
    except Interrupted as exc:
        if not first_too:
            raise
        raise CtxmgrError(left(exc.name), exit_code=ExitCode.ROLLBACK_FAILED) from None


def how_settled(ok: bool, reason: str, why: str = "") -> tuple[Result, ExitCode, str]:
    """The one settle decision of every way back (one service's, a node's, a deployment's): rolled-back
    where the previous unit serves again (the change failed: exit 1), else rollback-failed (exit 5) with
    `why` added to the reason."""
    if ok:
        return Result.ROLLED_BACK, ExitCode.ERROR, reason
    return (
        Result.ROLLBACK_FAILED,
        ExitCode.ROLLBACK_FAILED,
        f"{reason}; and the rollback failed too: {why}" if why else reason,
    )


def roll_back(
    restarter: Restarter, change: Change, result: ChangeResult, note: str, wait_exit: bool = True
) -> None:
    """rolling-back -> rolled-back | rollback-failed; the result says which."""
    rev = change.rev
    if wait_exit:
        restarter.let_failed_start_exit()
    restarter.on_step(f"rolling back to the previous unit of {restarter.service}")
    rev.reason = result.reason = result.reason or note
    rev.decisive_line = result.decisive_line or rev.decisive_line
    change.enter_or_note(State.ROLLING_BACK, f"putting the previous unit back: {note}")
    back_ok, back_reason = restarter.restore(change.files, rev.previous_max_model_len)
    change.settle(back_ok, back_reason, "the previous unit serves again and passed its probe")
    result.settled(back_ok, back_reason)
    result.reason += change.unwritten_note()


def hold_back(restarter: Restarter, change: Change, result: ChangeResult, held: str) -> None:
    """The stop left a process of the old instance on the service's GPUs (restart.GpuHeld): the previous
    unit's files go back, but nothing is started, neither the new unit nor the previous one, since
    either start would meet the same occupied GPU and fail as if its configuration were at fault.
    rolling-back -> rollback-failed (exit 5): the service is stopped until the holder is gone."""
    rev = change.rev
    rev.reason = result.reason = held
    change.enter_or_note(State.ROLLING_BACK, f"putting the previous unit back without starting it: {held}")
    try:
        restarter.put_back(change.files)
        why = (
            f"the previous unit is back in place but was not started into the occupied GPU: once that "
            f"process is gone, `systemctl start {restarter.unit}`"
        )
    except InstallError as exc:
        why = f"the previous unit could not be put back ({exc.message}) and nothing was started"
    change.settle(False, why, "")
    result.settled(False, why)
    result.reason += change.unwritten_note()


def describe(rev: Revision) -> str:
    """One line for the record's first step and for the notes that name a revision."""
    if rev.action == "rollback":
        return (
            f"rollback to revision {rev.rollback_of}: max_model_len {rev.previous_max_model_len} -> "
            f"{rev.max_model_len}"
        )
    return f"{rev.action}: max_model_len {rev.previous_max_model_len} -> {rev.max_model_len}"
