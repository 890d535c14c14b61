"""set-context and rollback: the walk of one change through its states, and little else.

`apply` is the forward walk, read top to bottom as the `change.enter(...)` steps it is:

    recorded -> installed -> restarting -> serving -> probed -> final

and any failure on the way (a signal included) takes change.roll_back: rolling-back -> rolled-back |
rollback-failed; a stop that leaves the old instance on the GPU (restart.GpuHeld) takes hold_back,
which puts the files back and starts nothing. states.py owns the states and the record, restart.py
the restart / watch / probe path, recovery.py what an interrupted run left, planning.plan_service the
plan; set_context and rollback tie them together under the service's one lock.

What the operator confirms is what is applied: the `confirm` callback sees the diff under the same lock
that the change is made under, and the unit file is checked to be the one the diff was made from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import cast

from vllm_ctxmgr import store as st
from vllm_ctxmgr.change.observing import calibration, capacity, expected_downtime
from vllm_ctxmgr.change.planning import PlanRequest, ServicePlan, plan_service, weights_at_restart
from vllm_ctxmgr.change.recovery import recover_if_needed
from vllm_ctxmgr.change.restart import GpuHeld, InstallError, Restarter
from vllm_ctxmgr.change.states import (
    Change,
    ChangeResult,
    Interrupted,
    Result,
    StoppedBeforeRestart,
    describe,
    ensure_baseline,
    hold_back,
    planned_revision,
    result_for,
    roll_back,
    serves_other,
)
from vllm_ctxmgr.core.budget import default_gpu_memory_utilization
from vllm_ctxmgr.core.change_policy import flags_to_apply, unknown_refusal
from vllm_ctxmgr.core.downtime import CompileCache
from vllm_ctxmgr.core.observations import ObservationFigures
from vllm_ctxmgr.core.plan import Plan
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.records import ProbeRecord
from vllm_ctxmgr.core.serve_args import AUTO_CONTEXT, ServeArgs, multi_node_flag
from vllm_ctxmgr.core.vllm_versions import OLDEST_VLLM, parse_vllm_version
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UnitError, UsageError
from vllm_ctxmgr.store import FileChange, Revision, ServiceStore, State
from vllm_ctxmgr.systemd.service import ServiceView, read_service
from vllm_ctxmgr.systemd.systemctl import Systemd, new_problems, verify_did_not_run
from vllm_ctxmgr.systemd.unit_edit import UnitEdit, edit_unit, unified_diff

# Shown the change (its diff, plan and reason) before anything is written; False: nothing is changed.
Confirm = Callable[[ChangeResult], bool]


# ---------------------------------------------------------------------------------------------
# The forward walk


def apply(restarter: Restarter, change: Change, probe_tokens: int | None, long_probe: bool) -> ChangeResult:
    """Record, install, restart, watch, probe: each step entered as its state; any failure (a
    signal included) puts the previous unit back. A start whose figures were not kept (more than its
    GPU holds) is one warning of the result."""
    result = _walk(restarter, change, probe_tokens, long_probe)
    result.warnings.extend(restarter.unkept_observations)
    restarter.unkept_observations.clear()
    return result


def _walk(restarter: Restarter, change: Change, probe_tokens: int | None, long_probe: bool) -> ChangeResult:
    """apply's steps, forward and (on any failure) back."""
    rev = change.rev
    result = result_for(rev, rev.action)
    t0 = time.monotonic()

    def left(signal: str) -> str:
        return (
            f"interrupted again by {signal} while rolling back: revision {rev.number} is left "
            f"{rev.state}; run `ctxmgr recover --service {restarter.service}`"
        )

    with change.guard_signals(left):
        interrupted = False
        try:
            failure = _forward(restarter, change, result, probe_tokens, long_probe)
        except StoppedBeforeRestart as stopped:
            result.stopped_before_restart(stopped)
            return result
        except GpuHeld as held:
            restarter.on_step(f"the change stopped: {held.message}")
            hold_back(restarter, change, result, held.message)
            result.timings["total_s"] = round(time.monotonic() - t0, 3)
            return result
        except st.StoreError as exc:
            if rev.state is State.PLANNED:  # the revision itself could not be written
                raise st.StoreError(f"{exc.message}; nothing was changed") from None
            failure = (f"the change's record could not be written: {exc.message}", "")
        except Interrupted as exc:
            interrupted = True
            if rev.state is State.PLANNED:
                raise CtxmgrError(f"interrupted by {exc.name} before anything was changed") from None
            failure = (f"ctxmgr was interrupted by {exc.name} while {rev.state}", "")
        result.timings["start_s"] = round(time.monotonic() - t0, 3)
        if failure is None:
            return result
        result.reason, result.decisive_line = failure
        restarter.on_step(f"the change failed: {result.reason}")
        roll_back(restarter, change, result, note=result.reason, wait_exit=not interrupted)
    result.timings["total_s"] = round(time.monotonic() - t0, 3)
    return result


def _forward(
    restarter: Restarter, change: Change, result: ChangeResult, probe_tokens: int | None, long_probe: bool
) -> tuple[str, str] | None:
    """The steps towards final; None when it got there, else (reason, decisive line)."""
    rev = change.rev
    if rev.state is State.PLANNED:
        change.enter(State.RECORDED, describe(rev))
    result.revision = rev.number  # recording the revision is what numbers it
    restarter.on_step(f"installing {change.paths()} (revision {rev.number})")
    try:
        view = change.install_checked(restarter)
        _enter_restarting(restarter, change)
    except InstallError as exc:  # a file could not be put back: the way back restores it
        return exc.message, ""
    started = time.monotonic()
    try:
        verdict = restarter.restart_and_watch(view)
    except GpuHeld:
        raise  # the old instance holds the GPU: no start, and no restart of the previous unit either
    except CtxmgrError as exc:
        return f"ctxmgr could not watch the start: {exc.message}", ""
    result.observation = cast(ObservationFigures, asdict(verdict.observation))
    if not verdict.ok:
        estimate = verdict.estimated_max_model_len
        if estimate:
            result.suggestion = estimate_advice(
                restarter.service, estimate, _applied_utilization(rev), _restored_utilization(rev)
            )
        return verdict.reason, verdict.decisive_line
    took = time.monotonic() - started
    restarter.on_step(f"vLLM is serving after {took:.0f} s; probing {view.base_url}")
    change.enter(State.SERVING, f"vLLM serves after {took:.1f} s; probing {view.base_url}")
    probe_result = restarter.probe(view, probe_tokens, long_probe)
    result.probe = cast(ProbeRecord, asdict(probe_result))
    if not probe_result.ok:
        return f"the probe failed: {probe_result.error}", probe_result.error or ""
    wrong = restarter.serves_other_than(rev.max_model_len, probe_result)
    if wrong:
        return wrong, ""
    rev.verified = True
    rev.vllm_version = verdict.observation.vllm_version or rev.vllm_version
    rev.capacity = capacity(verdict.observation)
    result.calibration = calibration(
        rev.plan, verdict.observation, restarter.last_metrics, applied_utilization=_applied_utilization(rev)
    )
    rev.capacity.update(result.calibration)
    change.enter(State.PROBED, "served the context-sized probe")
    result.reason = "vLLM started, reports the new max_model_len and served the context-sized probe"
    change.finalise("served and passed the context-sized probe")
    return None


def estimate_advice(service: str, estimate: int, tried: float | None, runs_again: float | None) -> str:
    """What to try after vLLM refused the KV cache and named the largest max_model_len that fits. Its
    estimate holds at the utilisation the failed start ran with (`tried`); where the rollback puts the
    service back at another one (a change forced with --gpu-memory-utilization), the advice keeps the
    tried one, since the estimate is not the service's as it runs again."""
    if tried is None or runs_again is None or abs(tried - runs_again) < 1e-9:
        return (
            f"vLLM estimates the largest max_model_len that fits is {estimate}: "
            f"try `ctxmgr set-context {estimate} --service {service}`, or free GPU memory / "
            "raise --gpu-memory-utilization"
        )
    return (
        f"vLLM estimates the largest max_model_len that fits at gpu_memory_utilization {tried:g} (the one "
        f"this change tried) is {estimate}: try `ctxmgr set-context {estimate} --gpu-memory-utilization "
        f"{tried:g} --service {service}`; {service} runs at {runs_again:g} again, where that estimate does "
        f"not hold (`ctxmgr plan {estimate} --service {service}` plans it there)"
    )


def _restored_utilization(rev: Revision) -> float | None:
    """The utilisation the service runs with once the change is rolled back: its unit's before it."""
    if rev.previous_gpu_memory_utilization:
        return rev.previous_gpu_memory_utilization
    version = parse_vllm_version(rev.vllm_version or (rev.plan or {}).get("vllm_version"))
    return default_gpu_memory_utilization(version) if version else None


def _enter_restarting(restarter: Restarter, change: Change) -> None:
    """restarting is recorded before the restart; where that record cannot be written (a full state
    directory), nothing has restarted yet: the files are put back and the change ends there, with no
    restart for nothing. A file that cannot be put back is InstallError: the way
    back restores it."""
    try:
        change.enter(State.RESTARTING, f"daemon-reload; restart {restarter.unit}; following its journal")
    except st.StoreError as exc:
        try:
            restarter.put_back(change.files)
        except InstallError as put_back:
            raise InstallError(f"{exc.message}; and {put_back.message}") from None
        change.stop_before_restart(
            f"nothing was restarted: the record could not be written: {exc.message}", exc.exit_code
        )


def _applied_utilization(rev: Revision) -> float | None:
    """The utilisation the installed unit really runs with (vLLM's default where it sets none)."""
    if rev.gpu_memory_utilization:
        return rev.gpu_memory_utilization
    version = parse_vllm_version(rev.vllm_version or (rev.plan or {}).get("vllm_version"))
    return default_gpu_memory_utilization(version) if version else None


# ---------------------------------------------------------------------------------------------
# set-context


@dataclass
class SetContextRequest:
    """What the user asked of set-context, beyond the service: the CLI fills it, set_context
    carries it through the plan and the change."""

    context: int
    gpu_memory_utilization: float | None = None  # the user's choice instead of the planner's
    probe_tokens: int | None = None
    long_probe: bool = False
    dry_run: bool = False
    force: bool = False  # apply even when the plan says it will not fit, or cannot tell
    lock_wait: float = 0.0
    # where the GPUs' memory comes from, the vLLM rules to plan by, the utilisation ceiling
    planning: PlanRequest | None = None
    confirm: Confirm | None = None  # asked under the lock, before anything is written; None: --yes
    dropin: bool = False  # change a unit under /etc through ctxmgr's drop-in, never its own file


def set_context(restarter: Restarter, request: SetContextRequest) -> ChangeResult:
    """Plan, render, confirm, record, install, restart, watch, probe; roll back on any failure."""

    store = restarter.store
    # a dry run reads: it takes the lock only where the state directory exists and is writable, and
    # writes nothing there (observations stay in memory, the candidate goes to the manager's /run)
    lock = store.read_lock(request.lock_wait) if request.dry_run else store.lock(request.lock_wait)
    read_only = restarter.read_only
    restarter.read_only = read_only or request.dry_run
    try:
        with lock:
            return _set_context_locked(restarter, request)
    finally:
        restarter.read_only = read_only


def _recover_first(
    restarter: Restarter, action: str, dry_run: bool, confirm: Confirm | None
) -> ChangeResult | None:
    """Before a change, what an interrupted run left is finished (after asking, where the operator is
    asked) and killed runs' leftovers go; a dry run only says what a real run would recover."""
    pending = _pending_recovery(restarter, action)
    if dry_run:
        return pending
    if pending is not None and confirm is not None and not confirm(pending):
        raise UsageError("nothing was changed")
    recover_if_needed(restarter)
    return None


def _set_context_locked(restarter: Restarter, request: SetContextRequest) -> ChangeResult:
    """set-context under the lock, read as its steps in order: recover, plan, refuse or keep, render,
    verify the candidate, confirm, record, apply."""
    systemd = restarter.systemd
    pending = _recover_first(restarter, "set-context", request.dry_run, request.confirm)
    if pending is not None:
        return pending
    service_plan = _plan_set_context(restarter, request)
    view, plan = service_plan.view, service_plan.plan
    _refuse_unchangeable(restarter.service, plan, view.args)
    if service_plan.learned:
        restarter.on_step(service_plan.learned)
    context = plan.max_model_len  # `auto` is resolved by the plan: the unit gets the number
    if request.context == AUTO_CONTEXT:
        restarter.on_step(f"auto: the largest context that fits is {context}")
    result = _planned_result(restarter.service, view, plan)
    not_applied = _kept_or_infeasible(restarter.service, request, plan, view.args, result)
    if not_applied is not None:
        return not_applied
    applied = flags_to_apply(view.args, plan, context, request.gpu_memory_utilization)
    result.gpu_memory_utilization = applied.gpu_memory_utilization
    result.suggestion = applied.suggestion
    edit = edit_unit(view.unit, applied.flag_changes, plan.env_changes, systemd.unit_dir / f"{view.name}.d",
                     dropin_mode=request.dropin)  # fmt: skip
    result.diff = unified_diff(edit.old_text, edit.new_text, str(edit.path), view.secrets)
    result.unit_path = str(edit.path)
    if not edit.changed:
        result.result = Result.UNCHANGED
        result.reason = _already_set(restarter.service, context, view.args)
        return result
    problems, inherited = verify_candidate(systemd, view, edit.path, edit.new_text)
    result.warnings = [*verify_warnings(inherited), *restarter.stop_risks(view)]
    if problems and verify_did_not_run(problems[0]):
        raise UnitError(
            f"systemd-analyze verify could not check the new unit, so it is not installed: {problems[0]}"
        )
    if problems:
        raise UnitError(f"the new unit does not pass systemd-analyze verify: {problems[0]}")
    cache: CompileCache | None = "miss" if context != view.args.max_model_len else None
    weights = weights_at_restart(systemd, view.name, view.args, applied.flag_changes)  # ipc_cache: attach
    restarter.expected = expected_downtime(systemd, restarter.unit, cache, context, weights)
    result.expected_downtime = restarter.expected.to_json() if restarter.expected else {}
    if request.dry_run:
        result.result = Result.DRY_RUN
        result.reason = "dry run: nothing was written or restarted"
        return result
    return _record_and_apply(restarter, request, view, edit, context, result)


def _plan_set_context(restarter: Restarter, request: SetContextRequest) -> ServicePlan:
    """The service planned for the target max_model_len (and the user's gpu_memory_utilization, if
    given), as `plan --service` plans it; the argv was checked when the unit was read."""
    planning = replace(
        request.planning or PlanRequest(request.context),
        context=request.context,
        fixed_gpu_memory_utilization=request.gpu_memory_utilization,
    )
    return plan_service(
        restarter.systemd, restarter.store, restarter.service, planning, restarter.keep_observation,
        restarter.unsaved_observations, argv_check=False,
    )  # fmt: skip


def _refuse_unchangeable(service: str, plan: Plan, args: ServeArgs) -> None:
    """A vLLM older than the oldest release whose rules ctxmgr knows, and one node of a multi-node
    deployment, are planned read-only but never changed by set-context."""
    if tuple(plan.vllm_version) < OLDEST_VLLM:
        # planned by the oldest known release's rules (plan says what they do not model): not applied
        version, oldest = ".".join(map(str, plan.vllm_version)), ".".join(map(str, OLDEST_VLLM))
        raise UsageError(
            f"{service} runs vLLM {version}, older than {oldest}, the oldest release ctxmgr knows "
            f"the rules of: set-context changes a service and refuses it (`ctxmgr plan --service "
            f"{service}` plans it read-only by {oldest}'s rules)"
        )
    node_flag = multi_node_flag(args)
    if node_flag is not None:
        raise UsageError(
            f"{service} is one node of a multi-node vLLM deployment (its unit gives {node_flag}): "
            "changing this node alone would leave the others at the old max_model_len; change every node "
            "as one: `ctxmgr deployment set-context CONTEXT --node HOST:UNIT --node HOST:UNIT ...`"
        )


def _planned_result(service: str, view: ServiceView, plan: Plan) -> ChangeResult:
    """The result as planned, before anything is written: the unit's max_model_len and
    gpu_memory_utilization now and the plan's."""
    return ChangeResult(
        service,
        "set-context",
        Result.PLANNED,
        False,
        previous_max_model_len=view.args.max_model_len,
        previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
        max_model_len=plan.max_model_len,
        gpu_memory_utilization=plan.gpu_memory_utilization,
        plan=plan.to_json(),
        unit_path=str(view.unit_path),
    )


def _kept_or_infeasible(
    service: str, request: SetContextRequest, plan: Plan, args: ServeArgs, result: ChangeResult
) -> ChangeResult | None:
    """A plan that does not fit, or cannot tell: unchanged where the unit already has that max_model_len
    (nothing to restart), else not applied (infeasible with the largest context that fits and the best
    alternative; unknown with what would make it known, exit 6), unless --force applies it anyway
    (None: go on)."""
    if plan.result is PlanResult.FEASIBLE:  # the one verdict set-context acts on unforced
        return None
    context = plan.max_model_len
    unknown = plan.result is PlanResult.UNKNOWN
    if args.max_model_len == context and request.gpu_memory_utilization is None:
        result.result = Result.UNCHANGED
        result.reason = f"{service} already has max_model_len {context}: nothing changed, nothing restarted"
        result.suggestion = (
            f"note: {unknown_refusal(plan).removesuffix('; --force applies it anyway')}"
            if unknown
            else f"note: the plan says it does not fit with ctxmgr's margin: {plan.reason}"
        )
        return result
    if request.force:
        return None
    if unknown:
        result.result, result.exit_code = Result.INFEASIBLE, ExitCode.UNKNOWN
        result.reason = unknown_refusal(plan)
        return result
    result.result, result.exit_code = Result.INFEASIBLE, ExitCode.INFEASIBLE
    result.reason = plan.reason
    best = next((a for a in plan.alternatives if a.feasible), None)
    result.suggestion = f"largest context that fits: {plan.max_context}"
    if best is not None and (best.max_context != plan.max_context or best.env_changes):
        how = [f"{k} {v}" for k, v in best.flag_changes.items()]
        how += [f"Environment={k}={v}" for k, v in best.env_changes.items()]
        result.suggestion += f"; or {best.description}" + (f" ({' '.join(how)})" if how else "")
    return result


def _already_set(service: str, context: int, args: ServeArgs) -> str:
    """Why a unit the edit leaves byte-identical is not restarted."""
    utilization = args.gpu_memory_utilization
    also = f" and gpu_memory_utilization {utilization:g}" if utilization else ""
    return f"{service} already has max_model_len {context}{also}: nothing to change, nothing restarted"


def _record_and_apply(
    restarter: Restarter,
    request: SetContextRequest,
    view: ServiceView,
    edit: UnitEdit,
    context: int,
    result: ChangeResult,
) -> ChangeResult:
    """Confirm the diff, keep the baseline, record the planned revision, then the forward walk; the
    result carries the plan, the diff and the candidate's warnings."""
    store = restarter.store
    old = edit.old_text.encode() if edit.existed else None
    files = [FileChange(Path(edit.path), old, edit.new_text.encode())]
    _confirm(restarter, request.confirm, result, files)
    ensure_baseline(store, view, files)
    rev = planned_revision(
        restarter,
        unit_path=str(edit.path),
        max_model_len=context,
        gpu_memory_utilization=result.gpu_memory_utilization,
        previous_max_model_len=view.args.max_model_len,
        previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
        vllm_version=view.args.vllm_version,
        plan=result.plan,
    )
    done = apply(
        restarter, Change(store, rev, files, "set-context"), request.probe_tokens, request.long_probe
    )
    done.plan, done.diff, done.warnings = result.plan, result.diff, [*result.warnings, *done.warnings]
    done.expected_downtime = result.expected_downtime
    store.prune()
    return done


def _confirm(
    restarter: Restarter, confirm: Confirm | None, result: ChangeResult, files: list[FileChange]
) -> None:
    """Ask (where asked to) with the diff that will be applied, then make sure every file is still the one
    the diff was made from: an edit in between would be overwritten by a diff nobody saw."""
    if confirm is None:
        return
    if not confirm(result):
        raise UsageError("nothing was changed")
    for f in files:
        if restarter.installed_bytes(f.path) != f.previous:
            raise UsageError(
                f"{f.path} changed while the diff was shown: nothing was changed; run again to see the new "
                "diff"
            )


def _pending_recovery(restarter: Restarter, action: str) -> ChangeResult | None:
    """An interrupted change waiting for recovery, as what a run would do first (never "unchanged")."""
    rev = restarter.store.in_progress()
    if rev is None:
        return None
    files = restarter.store.file_changes(rev)
    installed = [restarter.installed_bytes(f.path) for f in files]
    moved = any(now != f.previous for now, f in zip(installed, files, strict=True))
    result = ChangeResult(
        restarter.service,
        action,
        Result.DRY_RUN,
        False,
        revision=rev.number,
        pending_recovery=rev.number,
        max_model_len=rev.previous_max_model_len,
        previous_max_model_len=rev.max_model_len if moved else rev.previous_max_model_len,
        gpu_memory_utilization=rev.previous_gpu_memory_utilization,
        previous_gpu_memory_utilization=rev.gpu_memory_utilization,
        unit_path=rev.unit_path,
        diff="".join(
            unified_diff(_text(now), _text(f.previous), str(f.path))
            for now, f in zip(installed, files, strict=True)
        ),
    )
    result.reason = (
        f"dry run: revision {rev.number} ({describe(rev)}) was left {rev.state} by an interrupted run; "
        f"a real run (or `ctxmgr recover --service {restarter.service}`) first puts its previous unit back, "
        "then plans again. Nothing was written or restarted"
    )
    return result


def _text(data: bytes | None) -> str:
    return "" if data is None else data.decode()


def verify_warnings(inherited: list[str]) -> list[str]:
    """What the operator is told of verify problems the unit already had. A verify that could not check
    the unit at all fails alike for the current unit and the candidate: that is said as such, never as
    a finding the unit had (on systemd < 250 every candidate would pass so, unchecked)."""
    return [
        f"systemd-analyze verify could not check the new unit on this systemd: {p}"
        if verify_did_not_run(p)
        else f"systemd-analyze verify (the unit had it before): {p}"
        for p in inherited
    ]


def verify_candidate(
    systemd: Systemd, view: ServiceView, path: Path, text: str
) -> tuple[list[str], list[str]]:
    """`systemd-analyze verify` on the unit as it would load (the fragment plus its drop-ins, one edited
    or added) and, where it finds anything, on the unit as it loads now: (what the change adds, what
    the unit had already). A harmless finding the unit already had (a deprecated MemoryLimit=, an
    ExecStartPre= binary missing on this host) must not block every change."""

    def merged(pieces: list[str]) -> bytes:
        return "\n".join(p if p.endswith("\n") else p + "\n" for p in pieces).encode()

    # a new drop-in masks a package's drop-in of the same name (masking_copy): that one is not read
    files = [
        f
        for f in view.unit.files
        if f.path == path or f.path.name != path.name or not f.path.parent.name.endswith(".d")
    ]
    pieces = [text if f.path == path else f.text for f in files]
    if all(f.path != path for f in files):
        pieces.append(text)  # a new drop-in: after the others (its ExecStart= is the last one)
    found = systemd.analyze_verify_text(merged(pieces), view.name)
    if not found:
        return [], []
    unchecked = [p for p in found if verify_did_not_run(p)]
    if unchecked:
        # verify did not check the candidate at all (a capability it lacks, a crash): that it failed the
        # same way for the current unit proves nothing about the new one, so it is never "inherited" and
        # a warning, which would let every change go on unchecked: it refuses
        return unchecked, []
    current = systemd.analyze_verify_text(merged([f.text for f in view.unit.files]), view.name)
    added = new_problems(found, current)
    return added, [p for p in found if p not in added]


# ---------------------------------------------------------------------------------------------
# rollback


def rollback(
    restarter: Restarter,
    to: int | None = None,
    lock_wait: float = 0.0,
    dry_run: bool = False,
    confirm: Confirm | None = None,
) -> ChangeResult:
    """Install an earlier revision's unit through the same restart / watch / probe path."""
    store, systemd = restarter.store, restarter.systemd
    with store.read_lock(lock_wait) if dry_run else store.lock(lock_wait):
        pending = _recover_first(restarter, "rollback", dry_run, confirm)
        if pending is not None:
            return pending
        target = _rollback_target(store, restarter.service, to)
        view = read_service(systemd, restarter.service)
        files, notes = _rollback_files(restarter, target)
        result = ChangeResult(
            restarter.service,
            "rollback",
            Result.UNCHANGED,
            False,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            max_model_len=target.max_model_len,
            gpu_memory_utilization=target.gpu_memory_utilization,
            unit_path=str(files[0].path if files else target.unit_path),
            warnings=[*notes, *restarter.stop_risks(view)],
        )
        result.diff = "".join(
            unified_diff(_text(f.previous), _text(f.unit), str(f.path), view.secrets) for f in files
        )
        if not files:
            wrong = serves_other(view, target)
            if wrong:
                result.exit_code = ExitCode.ERROR
                result.reason = f"the unit files of revision {target.number} are in place, but {wrong}"
                return result
            result.reason = (
                f"{restarter.service} already runs the unit of revision {target.number}: nothing to do"
            )
            return result
        restarter.expect_warm_start()  # the target's context served before: vLLM compiled it then
        result.expected_downtime = restarter.expected.to_json() if restarter.expected else {}
        if dry_run:
            result.result, result.reason = Result.DRY_RUN, "dry run: nothing was written or restarted"
            return result
        _confirm(restarter, confirm, result, files)
        rev = planned_revision(
            restarter,
            unit_path=str(files[0].path),
            max_model_len=target.max_model_len,
            gpu_memory_utilization=target.gpu_memory_utilization,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            vllm_version=view.args.vllm_version,
            action="rollback",
            rollback_of=target.number,
        )
        done = apply(restarter, Change(store, rev, files, "rollback"), None, False)
        done.diff, done.warnings = result.diff, [*result.warnings, *done.warnings]
        done.expected_downtime = result.expected_downtime
        store.prune()
        return done


def _rollback_files(restarter: Restarter, target: Revision) -> tuple[list[FileChange], list[str]]:
    """Every unit file a revision since `target` changed, with what it holds now and what it held at
    `target`: the target's own copy where the target wrote it, else the bytes the first later revision
    to change it found there. Only the files that differ, newest revision's first (undone newest first,
    the target's own last); and a note for each file someone else changed after ctxmgr last wrote it
    (an operator's edit or removal is theirs: it is left as it is, and the check before the restart
    says whether the unit then serves the target's context)."""
    store = restarter.store
    wanted: dict[Path, tuple[int, bytes | None]] = {
        f.path: (target.number, f.unit) for f in store.file_changes(target)
    }
    left_by: dict[Path, tuple[int, bytes | None]] = {}  # what ctxmgr's last revision left in each file
    for rev in store.revisions():
        if rev.number > target.number:
            for f in store.file_changes(rev):
                wanted.setdefault(f.path, (rev.number, f.previous))
                if rev.state is State.FINAL or f.path not in left_by:
                    left_by[f.path] = (rev.number, f.unit if rev.state is State.FINAL else f.previous)
                else:  # a change that did not stay put the file back as it found it
                    left_by[f.path] = (left_by[f.path][0], f.previous)
    files: list[tuple[int, FileChange]] = []
    notes: list[str] = []
    for path, (number, data) in wanted.items():
        now = restarter.installed_bytes(path)
        if number != target.number and path in left_by and left_by[path][1] != now:
            notes.append(f"{path} changed after revision {left_by[path][0]} left it: left as it is")
        elif now != data:
            files.append((number, FileChange(path, now, data)))
    return [f for _, f in sorted(files, key=lambda t: -t[0])], notes


def _rollback_target(store: ServiceStore, service: str, to: int | None) -> Revision:
    """The revision asked for, or the last good one before the current final one."""
    revisions = store.revisions()
    if not revisions:
        raise UsageError(f"{service}: ctxmgr has no revisions of it yet; nothing to roll back to")
    if to is not None:
        return store.get(to)
    current = next((r for r in reversed(revisions) if r.state == State.FINAL), None)
    target = store.last_good(before=current.number) if current else None
    if target is None:
        raise UsageError(f"{service}: no earlier good revision to roll back to (see `ctxmgr history`)")
    return target
