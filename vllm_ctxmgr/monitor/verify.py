"""Verifying a vLLM service: the edge that gathers and acts; the verdict itself is core/verdict.py.

    gather (I/O: systemd, the journal, HTTP, NVML, the state store) -> VerifyFacts
    core.verdict.decide (pure)                                      -> Verification
    act_on_failure (--on-failure restart | rollback, through deploy)

Each verification is stored as SERVICE/last-verify.json, the baseline of the next one; its text is
report.verification_text.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import cast

from vllm_ctxmgr.change.planning import PlanRequest, gather_gpus, upgrade_move
from vllm_ctxmgr.change.restart import Restarter, restarter_for_service
from vllm_ctxmgr.change.states import ChangeResult
from vllm_ctxmgr.change.walk import rollback
from vllm_ctxmgr.core.budget import cuda_graphs_in_budget, default_gpu_memory_utilization, is_cpu_deployment
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.kv.backends import NEWEST_VLLM
from vllm_ctxmgr.core.observations import ObservationFigures, StoredObservation
from vllm_ctxmgr.core.records import ProbeRecord
from vllm_ctxmgr.core.upgrade import CapacityMoveRecord
from vllm_ctxmgr.core.verdict import LastVerifyRecord, UnitFacts, Verification, VerifyFacts, decide, record
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.probe import cache_config_info, probe
from vllm_ctxmgr.store import GOOD, Revision, ServiceStore, State
from vllm_ctxmgr.systemd.journal import parse_journal_json
from vllm_ctxmgr.systemd.service import ServiceView, read_service, read_stop_path
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.vllm_log.patterns import classify
from vllm_ctxmgr.vllm_log.watcher import observe_start

LAST_VERIFY = "last-verify.json"


def last_verify(store: ServiceStore) -> LastVerifyRecord | None:
    """What the last verification stored (core.verdict.record), or None: ctxmgr's own root-only file,
    read back as it wrote it."""
    return cast("LastVerifyRecord | None", store.read_json(LAST_VERIFY))


JOURNAL_LINES_LIMIT = 5000  # a start logs a few hundred lines; stop reading the journal after this

Printer = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


def local_clock(when: float) -> str:
    """The reasons' times in the host's own zone, as the journal shows them (the core cannot read TZ)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


# ---------------------------------------------------------------------------------------------
# Gathering (I/O)


@dataclass
class VerifyOptions:
    long_probe: bool = False
    probe_timeout: float = 120.0
    gpus_from: str | None = None  # a `ctxmgr gpus --json` file instead of NVML
    start_timeout: float = 1800.0  # a start without vLLM's ready line is "still starting" this long


def _wall_clock(monotonic_us: int) -> float | None:
    """systemd's CLOCK_MONOTONIC microseconds as Unix time (the same clock here: no time namespace)."""
    if not monotonic_us:
        return None
    return time.time() - (time.clock_gettime(time.CLOCK_MONOTONIC) - monotonic_us / 1e6)


def unit_facts(systemd: Systemd, unit: str) -> UnitFacts:
    state = systemd.state(unit)
    exit_us = systemd.show(unit, "InactiveExitTimestampMonotonic").get("InactiveExitTimestampMonotonic", "")
    return UnitFacts(
        active_state=state.active_state,
        sub_state=state.sub_state,
        result=state.result,
        n_restarts=state.n_restarts,
        invocation_id=state.invocation_id,
        active_enter_monotonic_us=state.active_enter_monotonic_us,
        serving_since=_wall_clock(state.active_enter_monotonic_us),
        started_at=_wall_clock(int(exit_us)) if exit_us.isdigit() else None,
    )


def invocation_messages(systemd: Systemd, invocation_id: str, limit: int = JOURNAL_LINES_LIMIT) -> list[str]:
    """The first log lines of one run of a unit, up to vLLM's ready line (journal match on the invocation)."""

    if not invocation_id:
        return []
    argv = systemd.command(
        "journalctl", "--no-pager", "-o", "json", "--all", f"_SYSTEMD_INVOCATION_ID={invocation_id}"
    )
    env = dict(os.environ, SYSTEMD_PAGER="", SYSTEMD_COLORS="0", PAGER="cat")
    messages: list[str] = []
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
    except FileNotFoundError:
        return []
    try:
        assert process.stdout is not None
        for raw in process.stdout:
            if not raw.strip():
                continue
            entry = parse_journal_json(raw)[0]
            messages.append(entry.message)
            event = classify(entry.message)
            if (event is not None and event.kind == "ready") or len(messages) >= limit:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
    return messages


def server_version(base_url: str, api_key: str | None, timeout: float) -> str | None:
    """vLLM's GET /version."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(base_url.rstrip("/") + "/version", headers=headers, timeout=timeout)
        if response.status_code == 200:
            version = response.json().get("version")
            return str(version) if version else None
    except (requests.RequestException, ValueError, AttributeError):
        return None
    return None


def _served_max_model_len(base_url: str, api_key: str | None, timeout: float) -> int | None:
    """What /v1/models reports, for a unit that leaves max_model_len to vLLM."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        cards = requests.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout).json()
        value = cards["data"][0].get("max_model_len")
        return int(value) if value else None
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


def is_installed(systemd: Systemd, store: ServiceStore, rev: Revision) -> bool:
    """Every file of the revision is on disk as it recorded it: byte for byte, or absent where it
    recorded none (a package unit's baseline has no drop-in; a drop-in change's baseline is its absence)."""
    try:
        for change in store.file_changes(rev):
            path = systemd.host_path(change.path)
            if (path.read_bytes() if path.exists() else None) != change.unit:
                return False
    except (OSError, CtxmgrError):
        return False
    return True


def installed_revision(systemd: Systemd, store: ServiceStore, revisions: Sequence[Revision]) -> int | None:
    """The newest good revision that is installed now."""
    for rev in reversed(revisions):
        if rev.state in GOOD and is_installed(systemd, store, rev):
            return rev.number
    return None


def gather(
    systemd: Systemd, store: ServiceStore, service: str, options: VerifyOptions, on_step: Printer = _quiet
) -> VerifyFacts:
    """Read the unit, systemd's state, the journal of the running process, GPU memory; probe.
    Long because it gathers each fact of a verification in turn (systemd, the journal, the probe, NVML, the
    store) with its own fallback."""

    now = time.time()
    view = read_service(systemd, service)
    unit = unit_facts(systemd, view.name)
    notes: list[str] = []
    revisions = store.revisions()
    current = installed_revision(systemd, store, revisions)
    stored = store.observations()
    last_start = stored[-1] if stored else None

    active = unit.active_state == "active"
    observation = None
    if unit.active_state in ("active", "activating"):
        messages = invocation_messages(systemd, unit.invocation_id)
        if messages:
            observation = cast(ObservationFigures, asdict(observe_start(messages)))
    quick = min(options.probe_timeout, 10.0)
    server = server_version(view.base_url, view.api_key, quick) if active else None
    cache_config = cache_config_info(view.base_url, api_key=view.api_key, timeout=quick) if active else {}
    version_text = (
        server
        or (observation or {}).get("vllm_version")
        or (last_start or {}).get("vllm_version")
        or next((r.vllm_version for r in reversed(revisions) if r.vllm_version), None)
    )
    vllm_version = parse_vllm_version(version_text) or NEWEST_VLLM
    utilization = view.args.gpu_memory_utilization or default_gpu_memory_utilization(vllm_version)

    probe_json: ProbeRecord | None = None
    if active:
        expected = (
            view.args.max_model_len if view.args.max_model_len and view.args.max_model_len > 0 else None
        )
        if expected is None:
            expected = (observation or {}).get("max_model_len") or _served_max_model_len(
                view.base_url, view.api_key, min(options.probe_timeout, 10.0)
            )
            notes.append(f"the unit leaves max_model_len to vLLM; the probe expects {expected}")
        if expected:
            on_step(f"probing {view.base_url} at max_model_len {expected}")
            outcome = probe(
                view.base_url,
                api_key=view.api_key,
                expected_max_model_len=int(expected),
                long_probe=options.long_probe,
                timeout=options.probe_timeout,
            )
            probe_json = cast(ProbeRecord, asdict(outcome))
        else:
            probe_json = {
                "ok": False,
                "error": "vLLM reports no max_model_len",
                "latency_s": 0.0,
                "steps": [],
            }

    gpu_state, gpu_note = None, None
    if is_cpu_deployment(view.args):
        gpu_note = "the vLLM CPU build: its memory is not GPU memory"
    else:
        try:
            gpu_state, gpu_note = gather_gpus(gpus_from=options.gpus_from)
        except CtxmgrError as exc:
            if options.gpus_from:
                raise
            gpu_note = exc.message
    pids = tuple(systemd.unit_processes(view.name)) if gpu_state is not None else ()
    in_progress = store.in_progress()
    running = server or (observation or {}).get("vllm_version")
    moved, upgrade_note = vllm_upgrade(systemd, store, view, revisions, last_start, running, options)
    if upgrade_note:
        notes.append(upgrade_note)
    drain = read_stop_path(systemd, view).drain_cut()  # the next restart's stop kills vLLM's drain
    if drain:
        notes.append(drain)
    return VerifyFacts(
        service=store.service,
        time=now,
        unit=unit,
        max_model_len=view.args.max_model_len,
        gpu_memory_utilization=utilization,
        configured_gpu_memory_utilization=view.args.gpu_memory_utilization,
        kv_cache_memory_bytes=view.args.kv_cache_memory_bytes,
        graphs_in_budget=cuda_graphs_in_budget(vllm_version, view.args),
        probe=probe_json,
        server_vllm_version=server,
        observation=observation,
        cache_config=cache_config,
        last_start=last_start,
        last_verify=last_verify(store),
        revisions=tuple(r.to_json() for r in revisions),
        current_revision=current,
        in_progress=in_progress.number if in_progress else None,
        gpus=gpu_state,
        gpu_note=gpu_note,
        service_pids=pids,
        notes=tuple(notes),
        start_timeout_s=options.start_timeout,
        vllm_upgrade=moved,
    )


def vllm_upgrade(
    systemd: Systemd,
    store: ServiceStore,
    view: ServiceView,
    revisions: Sequence[Revision],
    last_start: StoredObservation | None,
    running: str | None,
    options: VerifyOptions,
) -> tuple[CapacityMoveRecord | None, str | None]:
    """(what moved, note) where the vLLM the next start runs (the unit's installed one, else the one
    serving) is not the release the last watched start, else the last plan, was made under: the unit
    re-planned under both releases' rules. (None, None) where nothing changed; a plan that cannot be
    made is a note, never the verification's failure."""
    before = (last_start or {}).get("vllm_version") or next(
        (r.vllm_version for r in reversed(revisions) if r.state in GOOD and r.vllm_version), None
    )
    after = view.args.vllm_version or running
    if not before or not after or parse_vllm_version(before) == parse_vllm_version(after):
        return None, None
    context = view.args.max_model_len
    if not (context and context > 0):
        return None, f"vLLM {before} -> {after}: not re-planned (the unit leaves max_model_len to vLLM)"
    request = PlanRequest(context, gpus_from=options.gpus_from)
    try:
        move = upgrade_move(systemd, store, view.name, before, after, request)
    except CtxmgrError as exc:
        return None, f"vLLM {before} -> {after}: not re-planned under {after}'s rules: {exc.message}"
    return move.to_json(), None


# ---------------------------------------------------------------------------------------------
# Verifying, and acting on a failure


ON_FAILURE = ("none", "restart", "rollback")


def verify_service(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    options: VerifyOptions,
    lock_wait: float = 0.0,
    on_step: Printer = _quiet,
) -> tuple[Verification, VerifyFacts]:
    """Gather and decide under the service's lock (no change runs meanwhile); store the result."""
    started = time.monotonic()
    with store.lock(lock_wait):
        facts = gather(systemd, store, service, options, on_step)
        verification = decide(facts, local_clock)
        verification.duration_s = round(time.monotonic() - started, 3)
        store.write_json(LAST_VERIFY, {**record(verification, facts), "trigger": trigger_of_this_run()})
    return verification, facts


TRIGGER_ENV = "CTXMGR_VERIFY_TRIGGER"  # set to `timer` by the scheduled oneshot (ctxmgr-verify@.service)


def trigger_of_this_run() -> str:
    """`timer` when the scheduled oneshot runs this verification, else `manual`: status marks only the
    former "(timer)"."""
    return "timer" if os.environ.get(TRIGGER_ENV) == "timer" else "manual"


def rollback_target(
    revisions: Sequence[Revision], verified: Sequence[int], current: int | None,
    installed: Callable[[Revision], bool],
) -> Revision | None:  # fmt: skip
    """The newest good revision other than the installed one that passed a verification (its apply's
    probe or a scheduled one), or the unit as ctxmgr found it."""
    verified_set = set(verified)
    for rev in reversed(revisions):
        if rev.state not in GOOD or rev.number == current:
            continue
        if not (rev.verified or rev.number in verified_set or rev.state == State.BASELINE):
            continue
        if installed(rev):
            continue
        return rev
    return None


def act_on_failure(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    how: str,
    facts: VerifyFacts,
    timeout: float = 1800.0,
    lock_wait: float = 0.0,
    on_step: Printer = _quiet,
) -> JSONObject:
    """--on-failure restart|rollback after a failed verification; returns what was done (an action that
    could not run says why instead of raising, so the verification's result is still reported)."""
    try:
        return _act(systemd, store, service, how, facts, timeout, lock_wait, on_step)
    except CtxmgrError as exc:
        on_step(f"--on-failure {how} could not run: {exc.message}")
        return {"kind": how, "result": "error", "reason": exc.message}


def _act(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    how: str,
    facts: VerifyFacts,
    timeout: float,
    lock_wait: float,
    on_step: Printer,
) -> JSONObject:

    state_dir = store.root.parent
    restarter = restarter_for_service(systemd, state_dir, service, start_timeout=timeout, on_step=on_step)
    if how == "rollback":
        revisions = store.revisions()
        verified = last.get("verified_revisions", []) if (last := last_verify(store)) else []
        target = rollback_target(
            revisions, verified, facts.current_revision, lambda rev: is_installed(systemd, store, rev)
        )
        if target is not None:
            on_step(f"rolling {service} back to revision {target.number}, the last one that verified")
            change = rollback(restarter, target.number, lock_wait)
            action = {"kind": "rollback", "to": target.number, **_change_summary(change)}
            _note_restart_by_ctxmgr(systemd, store, restarter.unit, action)
            return action
        on_step("no other revision has passed a verification: restarting instead")
    change = restart_as_is(restarter, lock_wait)
    action = {"kind": "restart", **change}
    if how == "rollback":
        action["note"] = "no other revision has passed a verification"
    _note_restart_by_ctxmgr(systemd, store, restarter.unit, action)
    return action


def _change_summary(change: ChangeResult) -> JSONObject:
    return {
        "result": str(change.result),
        "revision": change.revision,
        "reason": change.reason,
        "exit_code": change.exit_code,
        "max_model_len": change.max_model_len,
    }


def restart_as_is(restarter: Restarter, lock_wait: float = 0.0) -> JSONObject:
    """Restart the unit as it is (no change to its files) through the one restart path: watch the
    start, record vLLM's numbers, probe at the unit's max_model_len."""

    with restarter.store.lock(lock_wait):
        view = read_service(restarter.systemd, restarter.service)
        if not (view.args.max_model_len and view.args.max_model_len > 0):
            restarter.systemd.reset_failed(restarter.unit)
            restarter.systemd.restart(restarter.unit, no_block=False)
            return {"result": "restarted", "reason": "restarted (the unit sets no max_model_len to probe)"}
        verdict, outcome = restarter.restart_and_probe(view)
    if not verdict.ok:
        return {"result": "failed", "reason": verdict.reason, "decisive_line": verdict.decisive_line}
    if outcome is None or not outcome.ok:
        return {"result": "failed", "reason": f"the probe failed: {outcome.error if outcome else 'no probe'}"}
    return {"result": "serving", "reason": "vLLM started again and served the context-sized probe"}


def _note_restart_by_ctxmgr(systemd: Systemd, store: ServiceStore, unit: str, action: JSONObject) -> None:
    """The next verification must not count ctxmgr's own restart as one behind its back."""
    last = store.read_json(LAST_VERIFY) or {}
    state = systemd.state(unit)
    last.update(
        invocation_id=state.invocation_id,
        n_restarts=state.n_restarts,
        active_enter_monotonic_us=state.active_enter_monotonic_us,
        action=action,
    )
    store.write_json(LAST_VERIFY, last)
