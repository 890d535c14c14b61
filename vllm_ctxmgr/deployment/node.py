"""One node's part of a change to a vLLM deployment that spans machines (coordinator.py coordinates).

Each node keeps its own revision, lock and journal: the coordinator runs these steps there, over ssh,
as `ctxmgr node STEP SERVICE --json`, and holds the whole deployment in step between them (every node
written before any stops, every node stopped before any starts, vLLM's own requirement: a head
restarted alone waits for ever for its old ranks). A node's revision walks the same states as a
one-host change (store.py), entered by these steps:

    prepare:  planned -> recorded -> installed        (the new unit is written; nothing restarted)
    start:    installed -> restarting                 (the head: -> serving -> probed, as one host)
    finish:   restarting|probed -> final              (a headless rank: active, no failure since start)
    restore:  any of recorded .. probed -> rolling-back (the previous unit is written back)
    settle:   rolling-back -> rolled-back | rollback-failed

The revision carries the deployment change's id, so `history` on a node says which change it was part
of, and a node with a revision in progress refuses a second change (the lock across machines).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from vllm_ctxmgr import store as st
from vllm_ctxmgr.change.observing import last_start_of, observation_record
from vllm_ctxmgr.change.planning import PlanRequest, ServicePlan, plan_service
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import Change, ensure_baseline, planned_revision
from vllm_ctxmgr.core.change_policy import flags_to_apply, least_utilization
from vllm_ctxmgr.deployment.wire import (
    MAX_CHANGES_SHOWN,
    CheckAnswer,
    InProgress,
    LastChange,
    Logged,
    PlanAnswer,
    PrepareAnswer,
    ShowAnswer,
    StartAnswer,
    StartStdin,
    StepAnswer,
    StopAnswer,
    VerifyAnswer,
)
from vllm_ctxmgr.errors import CtxmgrError, UnitError, UsageError
from vllm_ctxmgr.masking import mask, mask_json
from vllm_ctxmgr.monitor.verify import VerifyOptions, verify_service
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.report import plan_text
from vllm_ctxmgr.store import FileChange, Revision, State
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.quoting import split_words
from vllm_ctxmgr.systemd.service import ServiceView, read_service
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit_edit import UnitEdit, edit_unit, unified_diff
from vllm_ctxmgr.systemd.unit_file import ServiceUnit
from vllm_ctxmgr.vllm_log.watcher import StartWatcher, last_start, observe_start

LOGGED_LINES = 20000  # of the journal, to find the last start in
LOGGED_KEYS = (
    "max_model_len",
    "available_kv_gib",
    "kv_cache_tokens",
    "model_loading_gib",
    "cuda_graph_gib",
    "ready",
    "failure",
)
# the steps that may still be undone, and the ones a node's `start` may begin from
UNDOABLE = frozenset({State.RECORDED, State.INSTALLED, State.RESTARTING, State.SERVING, State.PROBED})


class NodeStepError(CtxmgrError):
    """A node step that cannot be taken (no revision of that change, a state that does not allow it)."""


def unit_digest(view: ServiceView) -> str:
    """The unit as systemd loads it (every file, path and bytes): what the coordinator planned from, so
    a unit edited on the node between the plan and the write is noticed there, not overwritten."""
    return _files_digest(view.unit)


def _files_digest(unit: ServiceUnit) -> str:
    digest = hashlib.sha256()
    for unit_file in unit.files:
        digest.update(str(unit_file.path).encode() + b"\0" + unit_file.text.encode() + b"\0")
    return digest.hexdigest()


def ray_start_unit(systemd: Systemd, service: str) -> ServiceUnit | None:
    """The unit, where its ExecStart= is Ray's `ray start ...` (a Ray node's, which runs no vLLM of its
    own: the head's vLLM places its workers there)."""
    props = systemd.show(unit_name(service), "FragmentPath", "DropInPaths")
    if not props.get("FragmentPath"):
        return None
    dropins = [p for p in props.get("DropInPaths", "").split() if p.endswith(".conf")]
    unit = ServiceUnit.load(unit_name(service), props["FragmentPath"], dropins, root=systemd.root)
    try:
        words = [w.value for w in split_words(unit.exec_start()[1].value)]
    except UnitError:
        return None
    first = words[0].lstrip("-@:+!") if words else ""
    return unit if len(words) > 1 and Path(first).name == "ray" and words[1] == "start" else None


def show(restarter: Restarter) -> ShowAnswer:
    """What the coordinator plans from: the unit's vLLM arguments (keys masked), its digest, the GPUs
    NVML sees here (None without NVML: the coordinator is given them) and any change in progress."""
    gpus = None
    with contextlib.suppress(CtxmgrError):  # no NVML here: the coordinator is given this node's GPUs
        gpus = read_nvml().to_json()
    try:
        view = read_service(restarter.systemd, restarter.service)
    except UnitError:
        ray = ray_start_unit(restarter.systemd, restarter.service)
        if ray is None:
            raise
        state = restarter.systemd.state(restarter.unit)
        return ShowAnswer(
            service=restarter.unit,
            ray_worker=True,
            gpus=gpus,
            active_state=state.active_state,
            unit_digest=_files_digest(ray),
        )
    secrets = view.secrets
    state = restarter.systemd.state(restarter.unit)
    pending = restarter.store.in_progress()
    made = [r for r in restarter.store.revisions() if r.deployment][-MAX_CHANGES_SHOWN:]
    last = made[-1] if made else None
    logged, observation = logged_start(restarter, view)
    return ShowAnswer(
        service=restarter.unit,
        unit_path=str(view.unit_path),
        unit_digest=unit_digest(view),
        argv=tuple(mask(word, secrets) for word in view.vllm_argv),
        environment={k: mask(v, secrets) for k, v in view.args.env.items()},
        vllm_version=view.args.vllm_version,
        active_state=state.active_state,
        gpus=gpus,
        in_progress=None
        if pending is None
        else InProgress(pending.number, str(pending.state), pending.deployment),
        last_change=None if last is None else _change_made(last),
        deployment_changes=tuple(_change_made(r) for r in made),
        logged=logged,
        observation=observation,
    )


def _change_made(rev: Revision) -> LastChange:
    return LastChange(
        rev.deployment, rev.number, str(rev.state), rev.max_model_len, rev.previous_max_model_len
    )


def logged_start(restarter: Restarter, view: ServiceView) -> tuple[Logged, dict[str, object] | None]:
    """What this node's vLLM logged at its last start (every rank logs its own memory lines): `logged`,
    the figures a per-node plan is held against, and `observation`, that start as an observation record
    (None where the journal holds no start), which the head's plan calibrates this node's ranks from."""
    messages = last_start_of(restarter.systemd.journal(restarter.unit, lines=LOGGED_LINES))
    observation = observe_start(messages)
    record = None
    if messages:
        ok = observation.failure is None and restarter.systemd.is_active(restarter.unit)
        made = observation_record(restarter.service, observation, ok, view, {})
        record = {k: v for k, v in made.to_json().items() if v is not None}
    return Logged(**{key: getattr(observation, key) for key in LOGGED_KEYS}), record


@dataclass(frozen=True)
class PrepareRequest:
    """What the coordinator asks one node to write: the same flags on every node (vLLM needs every rank's
    engine arguments equal), under the deployment change's id."""

    change_id: str
    flag_changes: dict[str, str]
    expected_digest: str
    env_changes: dict[str, str]
    max_model_len: int
    gpu_memory_utilization: float | None = None
    dropin: bool = False
    dry_run: bool = False
    undo_change: str | None = None  # a rollback: put back what this node had before that change
    back_to: str | None = None  # a rollback --to: put back the unit that change installed


def prepare(restarter: Restarter, request: PrepareRequest) -> PrepareAnswer:
    """Render the node's new unit, check it is the unit the plan was made from, record the revision and
    write the unit (installed); nothing restarts. A dry run answers the diff only."""
    store, systemd = restarter.store, restarter.systemd
    with store.read_lock() if request.dry_run else store.lock():
        pending = store.in_progress()
        if pending is not None:
            raise UsageError(
                f"{restarter.service}: revision {pending.number} is still {pending.state} "
                f"({pending.deployment or 'a change on this node'}); finish it first"
            )
        view = read_service(systemd, restarter.service)
        if unit_digest(view) != request.expected_digest:
            raise UsageError(
                f"{restarter.service}: its unit changed since the plan (edited on the node?): nothing was "
                "written; run again to plan from the unit as it is"
            )
        if request.undo_change or request.back_to:
            edit, new = _undo_edit(restarter, request.undo_change, request.back_to)
        else:
            edit = edit_unit(
                view.unit,
                request.flag_changes,
                request.env_changes,
                systemd.unit_dir / f"{view.name}.d",
                dropin_mode=request.dropin,
            )
            new = edit.new_text.encode()
        answer = PrepareAnswer(
            service=restarter.unit,
            unit_path=str(edit.path),
            changed=edit.changed,
            diff=unified_diff(edit.old_text, edit.new_text, str(edit.path), view.secrets),
        )
        if request.dry_run:
            return answer
        old = edit.old_text.encode() if edit.existed else None
        # a node whose unit the change leaves as it is records it all the same (one history): every
        # node restarts with the deployment, and `deployment rollback` finds the change on each of them
        files = [FileChange(Path(edit.path), old, new if edit.changed else old)]
        ensure_baseline(store, view, files)
        undone = request.undo_change or request.back_to
        rev = planned_revision(
            restarter,
            unit_path=str(edit.path),
            max_model_len=request.max_model_len,
            gpu_memory_utilization=request.gpu_memory_utilization or view.args.gpu_memory_utilization,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            vllm_version=view.args.vllm_version,
            deployment=request.change_id,
            action="rollback" if undone else "set-context",
            rollback_of=_revision_of(restarter, undone).number if undone else None,
        )
        change = Change(store, rev, files, "node prepare")
        change.enter(
            State.RECORDED,
            f"deployment change {request.change_id}: max_model_len "
            f"{rev.previous_max_model_len} -> {rev.max_model_len}",
        )
        change.install_checked(restarter)  # as one host's change: nothing restarts on the way
        return replace(answer, revision=rev.number)


def _revision_of(restarter: Restarter, change_id: str) -> Revision:
    rev = next((r for r in reversed(restarter.store.revisions()) if r.deployment == change_id), None)
    if rev is None:
        raise NodeStepError(f"{restarter.service}: no revision of deployment change {change_id} here")
    return rev


def _undo_edit(
    restarter: Restarter, undo: str | None, back_to: str | None = None
) -> tuple[UnitEdit, bytes | None]:
    """The edit that puts back what this node's unit file was before change `undo` (its `previous`;
    None: a drop-in that change created, which goes), or after change `back_to` (what it installed)."""
    change_id = str(undo or back_to)
    rev = _revision_of(restarter, change_id)
    if rev.state is not State.FINAL:
        raise UsageError(
            f"{restarter.service}: revision {rev.number} of {change_id} is {rev.state}, not final"
        )
    files = restarter.store.file_changes(rev)
    if len(files) != 1:
        raise UsageError(f"{restarter.service}: revision {rev.number} changed {len(files)} files, not one")
    path, previous = files[0].path, files[0].previous if undo else files[0].unit
    current = restarter.installed_bytes(path)
    edit = UnitEdit(path, (current or b"").decode(), (previous or b"").decode(), existed=current is not None)
    return edit, previous


def _change_of(restarter: Restarter, change_id: str) -> Change:
    """The revision this deployment change made on this node, with its bytes."""
    store = restarter.store
    rev = _revision_of(restarter, change_id)
    return Change(store, rev, store.file_changes(rev), "node")


@contextlib.contextmanager
def _written_change(restarter: Restarter, change_id: str) -> Iterator[Change | None]:
    """The opening of every step that acts on a written change (finish, restore, settle): None where the
    change never wrote this node (nothing to do there, answered "not written", no lock taken), else its
    revision on this node, under the node's lock."""
    if not _written(restarter, change_id):
        yield None
        return
    with restarter.store.lock():
        yield _change_of(restarter, change_id)


def stop(restarter: Restarter, timeout: float) -> StopAnswer:
    """Stop the node's vLLM and wait until it has exited (a headless rank can take ~12 s)."""
    restarter.systemd.stop(restarter.unit, no_block=False, timeout=timeout)
    return StopAnswer(restarter.unit, restarter.systemd.state(restarter.unit).active_state)


def _written(restarter: Restarter, change_id: str) -> bool:
    return any(r.deployment == change_id for r in restarter.store.revisions())


def start(
    restarter: Restarter, change_id: str, head: bool, back: bool = False, probe: StartStdin | None = None
) -> StartAnswer:
    """Start the node's vLLM after every node was stopped. The head is watched until it serves and is
    probed at the revision's context, as `probe` asks (a rank that fails elsewhere fails the head's
    start too); a headless rank is only started here, and judged by `finish` once the head has served."""
    probe = probe or StartStdin()
    with restarter.store.lock():
        if not _written(restarter, change_id):
            # an interrupted change never wrote this node, or a reconciling one had nothing to write
            # here (its unit already at the target): restarted as it is, with the others
            return _start_unit(restarter, head, probe)
        change = _change_of(restarter, change_id)
        rev = change.rev
        if back and rev.state in (State.ROLLED_BACK, State.ROLLBACK_FAILED):
            # put back and settled already (a write undone before anything restarted, or a way back
            # whose restart failed, taken again by recover): its previous unit is in place, and it
            # restarts as it is with the others
            return _start_unit(restarter, head, probe)
        if back:
            if rev.state is not State.ROLLING_BACK:
                raise NodeStepError(
                    f"{restarter.service}: revision {rev.number} is {rev.state}, not rolling back"
                )
        elif rev.state is not State.INSTALLED:
            raise NodeStepError(f"{restarter.service}: revision {rev.number} is {rev.state}, not installed")
        else:
            change.enter(
                State.RESTARTING, f"starting {restarter.unit} with every other node of the deployment"
            )
        answer = _start_unit(restarter, head, probe, rev.number)
        if head and answer.ok and not back:
            change.enter(State.SERVING, "vLLM serves on the head")
            change.enter(State.PROBED, "the head served the context-sized probe")
        return answer


def _start_unit(
    restarter: Restarter, head: bool, probe: StartStdin, revision: int | None = None
) -> StartAnswer:
    """The one start of a node's unit, its revision's or as it is: a headless rank only started (the
    coordinator checks its journal), the head restarted, watched until it serves and probed."""
    systemd = restarter.systemd
    cursor = systemd.journal_cursor()
    if not head:
        systemd.daemon_reload()
        systemd.reset_failed(restarter.unit)
        systemd.start(restarter.unit, no_block=True)
        return StartAnswer(restarter.unit, True, cursor, revision)
    view = read_service(systemd, restarter.service)
    verdict, probe_result = restarter.restart_and_probe(view, probe.probe_tokens, probe.long_probe)
    answer = StartAnswer(
        restarter.unit,
        verdict.ok and probe_result is not None and probe_result.ok,
        cursor,
        revision,
        observation=asdict(verdict.observation),
        probe=asdict(probe_result) if probe_result is not None else None,
    )
    if not verdict.ok:
        return replace(answer, reason=verdict.reason, decisive_line=verdict.decisive_line)
    if not answer.ok:
        said = probe_result.error if probe_result is not None else "no probe"
        return replace(answer, reason=f"the probe failed: {said}")
    return answer


def check(restarter: Restarter, cursor: str | None, expected_max_model_len: int | None) -> CheckAnswer:
    """A headless rank since `cursor` (None: since its last start): still active, no failure in its
    journal, and (where it logged one) the max_model_len every rank must share."""
    systemd = restarter.systemd
    watcher = StartWatcher()
    if cursor is None:
        messages = last_start([e.message for e in systemd.journal(restarter.unit, lines=LOGGED_LINES)])
    else:
        messages = [entry.message for entry in systemd.journal(restarter.unit, after_cursor=cursor)]
    for message in messages:
        watcher.feed(message)
    state = systemd.show(restarter.unit, "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus")
    watcher.feed_unit_state(state)
    verdict = watcher.poll()
    observation = watcher.observation
    answer = CheckAnswer(
        restarter.unit, True, active_state=state.get("ActiveState"), max_model_len=observation.max_model_len
    )
    if verdict is not None and not verdict.ok:
        answer = replace(answer, ok=False, reason=verdict.reason, decisive_line=verdict.decisive_line)
    elif state.get("ActiveState") != "active":
        why = f"{restarter.unit} is {state.get('ActiveState')}, not active"
        answer = replace(answer, ok=False, reason=why)
    if not answer.ok and state.get("ActiveState") == "failed":
        cause = _failed_command(restarter)
        if cause:  # the unit's own cause first: vLLM never ran, whatever its journal says
            answer = replace(answer, reason=f"{cause}; {answer.reason}")
    elif expected_max_model_len and observation.max_model_len not in (None, expected_max_model_len):
        answer = replace(
            answer,
            ok=False,
            reason=f"{restarter.unit} runs max_model_len {observation.max_model_len}, "
            f"not {expected_max_model_len}",
        )
    return answer


_EXEC_STATUS = re.compile(
    r"\{ path=[^;]* ; argv\[\]=(?P<argv>[^;]*) ;[^}]*?code=(?P<code>\w+) ; status=(?P<status>\d+)"
)


def _failed_command(restarter: Restarter) -> str:
    """Which of the unit's ExecStartPre= commands failed, and in which file it is set (a drop-in the
    operator may not remember), as systemd reports it; "" where none did."""
    systemd = restarter.systemd
    props = systemd.show(restarter.unit, "ExecStartPre", "FragmentPath", "DropInPaths")
    for found in _EXEC_STATUS.finditer(props.get("ExecStartPre", "")):
        if found["code"] == "exited" and found["status"] == "0":
            continue
        argv = found["argv"].strip()
        program = (argv.split() or [""])[0]
        where = ""
        with contextlib.suppress(CtxmgrError, OSError):
            dropins = [p for p in props.get("DropInPaths", "").split() if p.endswith(".conf")]
            unit = ServiceUnit.load(restarter.unit, props["FragmentPath"], dropins, root=systemd.root)
            where = next(
                (
                    f" in {Path(f.path).name}"
                    for f in reversed(unit.files)
                    if any(
                        line.startswith("ExecStartPre=") and program in line for line in f.text.splitlines()
                    )
                ),
                "",
            )
        how = f"exited {found['status']}" if found["code"] == "exited" else f"was {found['code']}"
        return f"ExecStartPre={argv}{where} {how}"
    return ""


def finish(restarter: Restarter, change_id: str) -> StepAnswer:
    """The deployment served, the head passed its probe and every headless rank was checked (`check`):
    this node's revision is final (a node the change did not write has nothing to finish)."""
    with _written_change(restarter, change_id) as change:
        if change is None:
            return StepAnswer(restarter.unit, True, None, "not written")
        rev = change.rev
        if rev.state is State.RESTARTING:  # a headless rank: the coordinator checked its journal
            change.enter(State.SERVING, "active, no failure in its journal since its start")
        if rev.state is State.SERVING:  # ... or a finish killed on the way, taken again by recover
            change.enter(State.PROBED, "the head served the context-sized probe")
        if rev.state is not State.PROBED:
            raise NodeStepError(f"{restarter.service}: revision {rev.number} is {rev.state}, not probed")
        change.finalise("the deployment served and passed the context-sized probe")
        return StepAnswer(restarter.unit, True, rev.number, str(rev.state))


def restore(restarter: Restarter, change_id: str, reason: str) -> StepAnswer:
    """Write the node's previous unit back (rolling-back); the coordinator restarts every node after."""
    with _written_change(restarter, change_id) as change:
        if change is None:
            return StepAnswer(restarter.unit, True, None, "not written")
        rev = change.rev
        if rev.state in st.FINISHED:
            return StepAnswer(restarter.unit, True, rev.number, str(rev.state))
        if rev.state is not State.ROLLING_BACK:
            rev.reason = reason
            change.enter(State.ROLLING_BACK, f"putting the previous unit back: {reason}")
        elif reason and reason != rev.reason:
            # a second restore (`deployment recover` after the coordinator died on the way back): its
            # word is added to why the change failed, never replaces it (recover's may already hold it)
            rev.reason = reason if reason.startswith(rev.reason) else f"{rev.reason}; {reason}"
            try:
                restarter.store.save(rev)
            except st.StoreError as exc:  # the previous unit goes back all the same
                change.unwritten.append(exc.message)
        restarter.put_back(change.files)
        return StepAnswer(restarter.unit, True, rev.number, str(rev.state))


def settle(restarter: Restarter, change_id: str, ok: bool, reason: str) -> StepAnswer:
    """The end of a rollback: rolled-back when the old deployment serves again, else rollback-failed."""
    with _written_change(restarter, change_id) as change:
        if change is None:
            return StepAnswer(restarter.unit, True, None, "not written")
        rev = change.rev
        if rev.state is State.ROLLING_BACK:
            change.settle(ok, reason, "the previous deployment serves again")
            if change.unwritten:
                raise st.StoreError(change.unwritten[0])
        return StepAnswer(restarter.unit, True, rev.number, str(rev.state))


def plan(restarter: Restarter, request: PlanRequest, gpu_memory_utilization: float | None) -> PlanAnswer:
    """The head plans the whole deployment (its model files are here, not on the coordinator) with
    every node's GPUs in rank order (`request.world_gpus`), and says which flags every node gets."""

    def planned(utilization: float | None) -> ServicePlan:
        return plan_service(
            restarter.systemd,
            restarter.store,
            restarter.service,
            replace(request, fixed_gpu_memory_utilization=utilization),
            restarter.keep_observation,
            restarter.unsaved_observations,
            argv_check=False,
        )

    # plan_service plans at what each node will run: the unit's utilisation where it holds the target
    # and stays, the least that fits one more figure
    service_plan = planned(gpu_memory_utilization)
    view, shown = service_plan.view, service_plan.plan
    applied = flags_to_apply(view.args, shown, shown.max_model_len, gpu_memory_utilization)
    return PlanAnswer(
        service=restarter.unit,
        plan=mask_json(shown.to_json(), view.secrets),
        text=mask(plan_text(shown, applied.text(shown)), view.secrets),
        result=shown.result,
        max_model_len=shown.max_model_len,
        flag_changes=applied.flag_changes,
        env_changes=dict(shown.env_changes),
        gpu_memory_utilization=applied.gpu_memory_utilization,
        least_gpu_memory_utilization=least_utilization(shown),
        applies=applied.text(shown),
        learned=service_plan.learned,
    )


def verify(restarter: Restarter, options: VerifyOptions) -> VerifyAnswer:
    """The head's verify (the same checks as `ctxmgr verify`), answered as a step: the coordinator
    decides the deployment's verdict from every node's; the node's whole report goes with it."""
    verification, _facts = verify_service(restarter.systemd, restarter.store, restarter.service, options)
    return VerifyAnswer(
        service=restarter.unit,
        result=verification.result,
        reasons=tuple(verification.reasons),
        max_model_len=verification.max_model_len,
        probe_ok=verification.probe_ok,
        report={"service": restarter.unit, **verification.to_json()},
    )
