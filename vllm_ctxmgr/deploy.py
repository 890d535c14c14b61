"""The orchestrator: walk one change through explicit states and undo it when any step fails.

    planned -> recorded (in-progress) -> installed -> restarting -> serving -> probed -> final
                                   \\-> rolling back -> rolled-back | rollback-failed

The revision record says "in-progress" before the unit is touched, so a run killed anywhere
leaves enough behind for the next ctxmgr run on the service to finish the rollback (`recover`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_ctxmgr import store as st
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.plan import default_gpu_memory_utilization
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import (
    EXIT_ERROR,
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_ROLLBACK_FAILED,
    CtxmgrError,
    UnitError,
    UsageError,
)
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.planning import PlanRequest, effective_args, observations_from_store, plan_for
from vllm_ctxmgr.probe import cache_config_info, probe, wait_until_serving
from vllm_ctxmgr.service import ServiceView, read_service, unit_name, view_from_unit
from vllm_ctxmgr.store import ServiceStore, atomic_write
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit import (
    ServiceUnit,
    UnitFile,
    edit_unit,
    mask_secrets,
    unified_diff,
)
from vllm_ctxmgr.vllm_log.watcher import StartWatcher, last_start, observe_start

Printer = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Reading the service as systemd sees it


# ---------------------------------------------------------------------------------------------
# Watching a start


def watch_start(
    systemd: Systemd,
    unit: str,
    cursor: str,
    timeout: float,
    on_line: Printer = _quiet,
    state_interval: float = 0.5,
    progress_interval: float = 3.0,
) -> Any:
    """Follow the unit's journal from `cursor` and decide as soon as vLLM's decisive line appears."""

    baseline = systemd.state(unit).n_restarts
    watcher = StartWatcher(timeout_s=timeout, baseline_nrestarts=baseline, await_start=True)
    next_state = 0.0
    last_progress = 0.0
    with systemd.follow(unit, after_cursor=cursor) as follower:
        while True:
            for entry in follower.poll(0.2):
                for event in watcher.feed(entry.message):
                    now = time.monotonic()
                    # progress during a minutes-long start: one line every few seconds is enough
                    if event.kind == "progress" and now - last_progress < progress_interval:
                        continue
                    if event.kind in ("progress", "ready", "failure"):
                        last_progress = now
                        on_line(entry.message)
            now = time.monotonic()
            if now >= next_state:
                state = systemd.show(
                    unit, "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "ExecMainCode"
                )
                watcher.feed_unit_state(state)
                next_state = now + state_interval
            verdict = watcher.poll()
            if verdict is not None:
                return verdict


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class ChangeResult:
    service: str
    action: str  # set-context | rollback | recover
    result: str  # unchanged | applied | dry-run | rolled-back | rollback-failed | infeasible
    changed: bool
    exit_code: int = EXIT_OK
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
    plan: dict[str, Any] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)
    observation: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)  # predicted vs observed KV capacity
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The deployer


@dataclass
class Deployer:
    systemd: Systemd
    store: ServiceStore
    service: str
    on_line: Printer = _quiet  # vLLM's progress lines while a start is watched
    on_step: Printer = _quiet  # ctxmgr's own steps
    start_timeout: float = 1800.0
    probe_timeout: float = 600.0
    listen_timeout: float = 120.0  # from vLLM's ready line to /health answering
    exit_wait: float = 20.0  # how long a failed vLLM may take to exit by itself before the restore
    last_metrics: dict[str, str] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return unit_name(self.service)

    # ---- the common restart path -----------------------------------------------------------

    def _install(self, path: Path, data: bytes) -> None:
        atomic_write(self.systemd.host_path(path), data)

    def restart_and_check(
        self, view: ServiceView, probe_tokens: int | None, long_probe: bool
    ) -> tuple[Any, Any]:
        """daemon-reload, restart, watch the journal, probe. Returns (start verdict, probe result or None)."""
        from dataclasses import replace

        self.systemd.daemon_reload()
        self.systemd.reset_failed(self.unit)
        cursor = self.systemd.journal_cursor()
        self.on_step(f"restarting {self.unit}; following its journal")
        started = time.monotonic()
        self.systemd.restart(self.unit, no_block=True)
        secrets = view.secrets
        verdict = watch_start(
            self.systemd,
            self.unit,
            cursor,
            self.start_timeout,
            lambda line: self.on_line(mask_secrets(line, secrets)),
        )
        if verdict.ok and not wait_until_serving(view.base_url, time.monotonic() + self.listen_timeout):
            # vLLM logs "Starting vLLM server on" up to a second before uvicorn listens; a port that
            # never opens after it is a failed start all the same
            verdict = replace(
                verdict,
                ok=False,
                failure="not_listening",
                reason=f"vLLM logged that it serves, but {view.base_url}/health never answered",
            )
        metrics = cache_config_info(view.base_url, api_key=view.api_key) if verdict.ok else {}
        self.last_metrics = metrics
        self._record_observation(verdict, view, metrics)
        if not verdict.ok:
            return verdict, None
        self.on_step(f"vLLM is serving after {time.monotonic() - started:.0f} s; probing {view.base_url}")
        expected = (
            view.args.max_model_len if view.args.max_model_len and view.args.max_model_len > 0 else None
        )
        result = probe(
            view.base_url,
            api_key=view.api_key,
            expected_max_model_len=expected,
            probe_tokens=probe_tokens,
            long_probe=long_probe,
            timeout=self.probe_timeout,
        )
        return verdict, result

    def _record_observation(self, verdict: Any, view: ServiceView, metrics: dict[str, str]) -> None:
        import socket
        from dataclasses import asdict

        obs = asdict(verdict.observation)
        blocks = metrics.get("num_gpu_blocks", "")
        if blocks.isdigit():
            obs["num_gpu_blocks"] = int(blocks)
        if not obs.get("gpu_name"):
            obs["gpu_name"] = "CPU" if obs.get("platform") == "CPU" else _gpu_name(view.env)
        obs.update(
            host=socket.gethostname(),
            block_size=int(metrics["block_size"]) if metrics.get("block_size", "").isdigit() else None,
            time=time.time(),
            service=self.service,
            configured_max_model_len=view.args.max_model_len,
            configured_gpu_memory_utilization=view.args.gpu_memory_utilization,
            # the explicit budget as vLLM applied it (VLLM_CPU_KVCACHE_SPACE included): such a start says
            # nothing about how memory scales with the utilisation
            configured_kv_cache_memory_bytes=effective_args(view.args).kv_cache_memory_bytes,
            ok=verdict.ok,
        )
        self.store.add_observation(obs)

    # ---- applying a new unit, with automatic rollback --------------------------------------

    def apply(
        self,
        rev: st.Revision,
        old: bytes,
        new: bytes,
        probe_tokens: int | None,
        long_probe: bool,
    ) -> ChangeResult:
        path = Path(rev.unit_path)
        result = ChangeResult(
            self.service,
            rev.action,
            "applied",
            True,
            revision=rev.number,
            max_model_len=rev.max_model_len,
            previous_max_model_len=rev.previous_max_model_len,
            gpu_memory_utilization=rev.gpu_memory_utilization,
            previous_gpu_memory_utilization=rev.previous_gpu_memory_utilization,
            unit_path=str(path),
        )
        t0 = time.monotonic()
        self.on_step(f"installing {path} (revision {rev.number})")
        self._install(path, new)
        view = view_from_unit(self._loaded_unit_with(path, new.decode()), self.systemd.root)
        try:
            verdict, probe_result = self.restart_and_check(view, probe_tokens, long_probe)
        except CtxmgrError as exc:
            verdict, probe_result = None, None
            failure = f"ctxmgr could not watch the start: {exc.message}"
        else:
            failure = None
        result.timings["start_s"] = round(time.monotonic() - t0, 3)
        if verdict is not None:
            result.observation = _plain(verdict.observation)
        if verdict is not None and verdict.ok and probe_result is not None and probe_result.ok:
            rev.state = st.FINAL
            rev.verified = True
            rev.reason = "served and passed the context-sized probe"
            rev.finished = time.time()
            rev.vllm_version = verdict.observation.vllm_version or rev.vllm_version
            rev.capacity = _capacity(verdict.observation)
            self.store.save(rev)
            result.probe = _plain(probe_result)
            result.reason = "vLLM started, reports the new max_model_len and served the context-sized probe"
            result.calibration = calibration(rev.plan, verdict.observation, self.last_metrics)
            if result.calibration:
                rev.capacity.update(result.calibration)
                self.store.save(rev)
            return result
        # something failed: say why, then put the previous unit back
        if verdict is None:
            reason, decisive = failure or "unknown failure", ""
        elif not verdict.ok:
            reason, decisive = verdict.reason, verdict.decisive_line
            estimate = verdict.estimated_max_model_len
            if estimate:
                result.suggestion = (
                    f"vLLM estimates the largest max_model_len that fits is {estimate}: "
                    f"try `ctxmgr set-context {estimate} --service {self.service}`, or free GPU memory / "
                    "raise --gpu-memory-utilization"
                )
        else:
            result.probe = _plain(probe_result) if probe_result is not None else {}
            reason = f"the probe failed: {probe_result.error if probe_result is not None else 'no probe'}"
            decisive = probe_result.error if probe_result is not None else ""
        result.reason, result.decisive_line = reason, decisive
        self.on_step(f"the change failed: {reason}")
        self._let_failed_start_exit()
        self.on_step(f"rolling back to the previous unit of {self.service}")
        rev.reason, rev.decisive_line = reason, decisive
        back_ok, back_reason = self._restore(path, old, rev)
        result.timings["total_s"] = round(time.monotonic() - t0, 3)
        if back_ok:
            rev.state = st.ROLLED_BACK
            result.result, result.exit_code = "rolled-back", EXIT_ERROR
        else:
            rev.state = st.ROLLBACK_FAILED
            rev.reason += f"; and the rollback failed too: {back_reason}"
            result.result, result.exit_code = "rollback-failed", EXIT_ROLLBACK_FAILED
            result.reason = rev.reason
        rev.finished = time.time()
        self.store.save(rev)
        return result

    def _let_failed_start_exit(self) -> None:
        """A vLLM that has logged its fatal error exits by itself within seconds, while a stop sent
        meanwhile can hang until TimeoutStopSec (90 s by default): wait for the exit first."""
        deadline = time.monotonic() + self.exit_wait
        while time.monotonic() < deadline:
            state = self.systemd.show(self.unit, "ActiveState", "SubState")
            if state.get("ActiveState") in ("failed", "inactive") or state.get("SubState") in (
                "auto-restart",
                "dead",
                "failed",
                "exited",
            ):
                return
            time.sleep(0.3)

    def _restore(self, path: Path, old: bytes, rev: st.Revision) -> tuple[bool, str]:
        """Put `old` back byte for byte, restart, and prove it serves again at its own context."""
        self._install(path, old)
        try:
            view = view_from_unit(self._loaded_unit_with(path, old.decode()), self.systemd.root)
            verdict, probe_result = self.restart_and_check(view, None, False)
        except CtxmgrError as exc:
            return False, exc.message
        if not verdict.ok:
            return False, verdict.reason
        if probe_result is None or not probe_result.ok:
            return False, f"the probe failed: {probe_result.error if probe_result else 'no probe'}"
        self.on_step(f"{self.service} is serving again with its previous unit")
        return True, ""

    def _loaded_unit_with(self, path: Path, text: str) -> ServiceUnit:
        current = read_service(self.systemd, self.service).unit
        files = tuple(UnitFile.parse(f.path, text) if f.path == path else f for f in current.files)
        return ServiceUnit(current.name, files)

    # ---- recovery of a run that was killed -------------------------------------------------

    def recover_if_needed(self) -> ChangeResult | None:
        rev = self.store.in_progress()
        if rev is None:
            return None
        self.on_step(f"revision {rev.number} of {self.service} was left in progress by an interrupted run")
        old = self.store.unit_bytes(rev.number, "previous")
        path = Path(rev.unit_path)
        rev.reason = "an earlier ctxmgr run was interrupted before it finished; its change was undone"
        ok, why = self._restore(path, old, rev)
        rev.state = st.ROLLED_BACK if ok else st.ROLLBACK_FAILED
        if not ok:
            rev.reason += f"; the restore failed: {why}"
        rev.finished = time.time()
        self.store.save(rev)
        return ChangeResult(
            self.service,
            "recover",
            "rolled-back" if ok else "rollback-failed",
            True,
            exit_code=EXIT_OK if ok else EXIT_ROLLBACK_FAILED,
            revision=rev.number,
            reason=rev.reason,
            unit_path=str(path),
        )


# ---------------------------------------------------------------------------------------------
# The commands


@dataclass
class SetContextRequest:
    context: int
    gpu_memory_utilization: float | None = None  # the user's choice instead of the planner's
    probe_tokens: int | None = None
    long_probe: bool = False
    dry_run: bool = False
    force: bool = False  # apply even when the plan says it will not fit
    lock_wait: float = 0.0
    # where the GPUs' memory comes from, the vLLM rules to plan by, the utilisation ceiling
    planning: PlanRequest | None = None


def set_context(deployer: Deployer, request: SetContextRequest) -> ChangeResult:
    """Plan, render, record, install, restart, watch, probe; roll back on any failure."""

    store, systemd = deployer.store, deployer.systemd
    with store.lock(request.lock_wait):
        if not request.dry_run:
            deployer.recover_if_needed()
        view = read_service(systemd, deployer.service)
        observations = observations_from_store(store.observations())
        pids = tuple(systemd.unit_processes(view.name))
        planning = replace(
            request.planning or PlanRequest(request.context),
            context=request.context,
            fixed_gpu_memory_utilization=request.gpu_memory_utilization,
        )
        plan = plan_for(view.args, planning, pids, observations)
        result = ChangeResult(
            deployer.service,
            "set-context",
            "planned",
            False,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            max_model_len=plan.max_model_len,
            gpu_memory_utilization=plan.gpu_memory_utilization,
            plan=plan.to_json(),
            unit_path=str(view.unit_path),
        )
        if (
            not plan.feasible
            and view.args.max_model_len == request.context
            and request.gpu_memory_utilization is None
        ):
            result.result = "unchanged"
            result.reason = (
                f"{deployer.service} already has max_model_len {request.context}: nothing changed, nothing "
                "restarted"
            )
            result.suggestion = f"note: the plan says it does not fit with ctxmgr's margin: {plan.reason}"
            return result
        if not plan.feasible and not request.force:
            result.result, result.exit_code = "infeasible", EXIT_INFEASIBLE
            result.reason = plan.reason
            best = next((a for a in plan.alternatives if a.feasible), None)
            result.suggestion = f"largest context that fits: {plan.max_context}"
            if best is not None and (best.max_context != plan.max_context or best.env_changes):
                how = [f"{k} {v}" for k, v in best.flag_changes.items()]
                how += [f"Environment={k}={v}" for k, v in best.env_changes.items()]
                result.suggestion += f"; or {best.description}" + (f" ({' '.join(how)})" if how else "")
            return result
        flag_changes = dict(plan.flag_changes)
        flag_changes["--max-model-len"] = str(request.context)
        already_there = view.args.max_model_len == request.context
        if request.gpu_memory_utilization is None and (
            already_there or _current_utilization_suffices(view.args, plan)
        ):
            # change only what must change: a utilisation that already holds the target stays, and
            # asking for the context the unit already has restarts nothing (the plan's view is a warning)
            if already_there and "--gpu-memory-utilization" in flag_changes:
                result.suggestion = (
                    f"the plan would use gpu_memory_utilization {plan.gpu_memory_utilization} "
                    "for its margin; "
                    "pass --gpu-memory-utilization to change it"
                )
            flag_changes.pop("--gpu-memory-utilization", None)
            result.gpu_memory_utilization = view.args.gpu_memory_utilization
        if request.gpu_memory_utilization is not None:
            flag_changes["--gpu-memory-utilization"] = f"{request.gpu_memory_utilization:g}"
            result.gpu_memory_utilization = request.gpu_memory_utilization
        edit = edit_unit(view.unit, flag_changes, plan.env_changes)
        result.diff = unified_diff(edit.old_text, edit.new_text, str(edit.path), view.secrets)
        if not edit.changed:
            result.result = "unchanged"
            result.reason = (
                f"{deployer.service} already has max_model_len {request.context}"
                + (
                    f" and gpu_memory_utilization {view.args.gpu_memory_utilization:g}"
                    if view.args.gpu_memory_utilization
                    else ""
                )
                + ": nothing to change, nothing restarted"
            )
            return result
        problems = verify_candidate(systemd, store, view, edit.path, edit.new_text)
        if problems:
            raise UnitError(f"the new unit does not pass systemd-analyze verify: {problems[0]}")
        if request.dry_run:
            result.result = "dry-run"
            result.reason = "dry run: nothing was written or restarted"
            return result
        old, new = edit.old_text.encode(), edit.new_text.encode()
        _ensure_baseline(store, view, old)
        rev = store.new_revision(
            st.Revision(
                number=0,
                service=deployer.service,
                state=st.IN_PROGRESS,
                unit_path=str(edit.path),
                created=time.time(),
                max_model_len=request.context,
                gpu_memory_utilization=result.gpu_memory_utilization,
                previous_max_model_len=view.args.max_model_len,
                previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
                vllm_version=view.args.vllm_version,
                plan=result.plan,
            ),
            unit=new,
            previous=old,
        )
        applied = deployer.apply(rev, old, new, request.probe_tokens, request.long_probe)
        applied.plan, applied.diff = result.plan, result.diff
        return applied


def _current_utilization_suffices(args: ServeArgs, plan: Any) -> bool:
    """The unit's utilisation is at least the planned minimum and passes vLLM's free-memory check."""

    if plan.gpu_memory_utilization is None or not plan.feasible or args.kv_cache_memory_bytes:
        return False
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    limit = min((g.max_gpu_memory_utilization for g in plan.gpus), default=1.0)
    return plan.gpu_memory_utilization <= current + 1e-9 and current <= limit + 1e-9


def verify_candidate(
    systemd: Systemd, store: ServiceStore, view: ServiceView, path: Path, text: str
) -> list[str]:
    """`systemd-analyze verify` on the unit as it would load: the fragment plus its drop-ins, one edited."""
    pieces = [text if f.path == path else f.text for f in view.unit.files]
    merged = "\n".join(p if p.endswith("\n") else p + "\n" for p in pieces)
    store.ensure()
    candidate_dir = store.root / "candidate"
    candidate_dir.mkdir(mode=0o700, exist_ok=True)
    candidate = candidate_dir / view.name
    atomic_write(candidate, merged.encode(), mode=0o600)
    try:
        return systemd.analyze_verify(candidate, view.name)
    finally:
        candidate.unlink(missing_ok=True)


def _ensure_baseline(store: ServiceStore, view: ServiceView, current: bytes) -> None:
    """The first change to a service records the unit as found, so `rollback --to 0` can return to it."""
    if store.revisions():
        return
    store.new_revision(
        st.Revision(
            number=0,
            service=store.service,
            state=st.BASELINE,
            unit_path=str(view.unit_path),
            created=time.time(),
            max_model_len=view.args.max_model_len,
            gpu_memory_utilization=view.args.gpu_memory_utilization,
            action="baseline",
            reason="the unit as ctxmgr first found it",
        ),
        unit=current,
        previous=current,
    )


def rollback(
    deployer: Deployer, to: int | None = None, lock_wait: float = 0.0, dry_run: bool = False
) -> ChangeResult:
    """Install an earlier revision's unit through the same restart / watch / probe path."""
    store, systemd = deployer.store, deployer.systemd
    with store.lock(lock_wait):
        if not dry_run:
            deployer.recover_if_needed()
        revisions = store.revisions()
        if not revisions:
            raise UsageError(
                f"{deployer.service}: ctxmgr has no revisions of it yet; nothing to roll back to"
            )
        if to is None:
            current = next((r for r in reversed(revisions) if r.state == st.FINAL), None)
            target = store.last_good(before=current.number) if current else None
            if target is None:
                raise UsageError(
                    f"{deployer.service}: no earlier good revision to roll back to (see `ctxmgr history`)"
                )
        else:
            target = store.get(to)
        view = read_service(systemd, deployer.service)
        path = Path(target.unit_path)
        old = systemd.host_path(path).read_bytes()
        new = store.unit_bytes(target.number, "unit")
        result = ChangeResult(
            deployer.service,
            "rollback",
            "unchanged",
            False,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            max_model_len=target.max_model_len,
            gpu_memory_utilization=target.gpu_memory_utilization,
            unit_path=str(path),
        )
        result.diff = unified_diff(old.decode(), new.decode(), str(path), view.secrets)
        if old == new:
            result.reason = (
                f"{deployer.service} already runs the unit of revision {target.number}: nothing to do"
            )
            return result
        if dry_run:
            result.result, result.reason = "dry-run", "dry run: nothing was written or restarted"
            return result
        rev = store.new_revision(
            st.Revision(
                number=0,
                service=deployer.service,
                state=st.IN_PROGRESS,
                unit_path=str(path),
                created=time.time(),
                max_model_len=target.max_model_len,
                gpu_memory_utilization=target.gpu_memory_utilization,
                previous_max_model_len=view.args.max_model_len,
                previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
                action="rollback",
                rollback_of=target.number,
            ),
            unit=new,
            previous=old,
        )
        applied = deployer.apply(rev, old, new, None, False)
        applied.diff = result.diff
        return applied


def history(store: ServiceStore) -> list[dict[str, Any]]:
    rows = []
    for rev in store.revisions():
        rows.append(
            {
                "revision": rev.number,
                "time": rev.created,
                "action": rev.action,
                "state": rev.state,
                "max_model_len": rev.max_model_len,
                "gpu_memory_utilization": rev.gpu_memory_utilization,
                "previous_max_model_len": rev.previous_max_model_len,
                "rollback_of": rev.rollback_of,
                "vllm_version": rev.vllm_version,
                "reason": rev.reason,
                "decisive_line": rev.decisive_line,
                "capacity": rev.capacity,
            }
        )
    return rows


def calibration(plan: dict[str, Any], observation: Any, metrics: dict[str, str]) -> dict[str, Any]:
    """Predicted against observed KV capacity of a start: the planner's calibration error.

    Observed capacity is vLLM's block count (/metrics num_gpu_blocks, exact) or, without metrics,
    the logged KV budget; never the "KV cache size: N tokens" line (concurrency x length, derived).
    """
    lines = plan.get("gpus") or []
    budgets = [g["kv_budget"]["bytes"] for g in lines if g.get("kv_budget", {}).get("bytes") is not None]
    bytes_per_block = (plan.get("layout") or {}).get("bytes_per_block")
    block_size = (plan.get("layout") or {}).get("block_size")
    predicted_budget = min(budgets) if budgets else plan.get("kv_cache_memory_bytes")
    if not predicted_budget or not bytes_per_block:
        return {}
    predicted_blocks = predicted_budget // bytes_per_block
    out: dict[str, Any] = {
        "predicted_kv_budget_bytes": predicted_budget,
        "predicted_num_gpu_blocks": predicted_blocks,
    }
    blocks = metrics.get("num_gpu_blocks", "")
    if blocks.isdigit():
        observed_blocks = int(blocks)
        out["observed_num_gpu_blocks"] = observed_blocks
        out["observed_source"] = "vllm metrics (num_gpu_blocks)"
    elif observation.available_kv_gib is not None:
        observed_blocks = int(observation.available_kv_gib * GIB) // bytes_per_block
        out["observed_num_gpu_blocks"] = observed_blocks
        out["observed_source"] = "vllm log (Available KV cache memory, 0.01 GiB)"
    else:
        return out
    if block_size:
        out["predicted_capacity_tokens"] = predicted_blocks * block_size
        out["observed_capacity_tokens"] = observed_blocks * block_size
    if predicted_blocks:
        out["error_percent"] = round(100.0 * (observed_blocks - predicted_blocks) / predicted_blocks, 3)
    return out


def observe_last_start(deployer: Deployer) -> dict[str, Any]:
    """Read the last start of a unit from its journal (made by ctxmgr or not) and keep vLLM's facts."""
    from dataclasses import asdict

    systemd = deployer.systemd
    view = read_service(systemd, deployer.service)
    entries = systemd.journal(deployer.unit, lines=20000)
    messages = last_start([entry.message for entry in entries])
    if not messages:
        raise CtxmgrError(f"{deployer.unit}: the journal holds no start of vLLM")
    observation = observe_start(messages)
    metrics = (
        cache_config_info(view.base_url, api_key=view.api_key) if systemd.is_active(deployer.unit) else {}
    )
    verdict = _ObservedStart(observation.ready, observation)
    deployer._record_observation(verdict, view, metrics)
    data = asdict(observation)
    if metrics.get("num_gpu_blocks", "").isdigit():
        data["num_gpu_blocks"] = int(metrics["num_gpu_blocks"])
    return {"service": deployer.service, "observation": data, "lines": len(messages)}


@dataclass(frozen=True)
class _ObservedStart:
    ok: bool
    observation: Any


def _gpu_name(env: dict[str, str]) -> str | None:
    """The model of the first GPU the service sees, so observations are not carried to other GPUs."""

    try:
        state = read_nvml().select(env.get("CUDA_VISIBLE_DEVICES"))
    except CtxmgrError:
        return None
    return state.gpus[0].name if state.gpus else None


def _plain(obj: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    if obj is None:
        return {}
    if hasattr(obj, "to_json"):
        return obj.to_json()
    if is_dataclass(obj):
        return asdict(obj)  # type: ignore[arg-type]
    return dict(obj)


def _capacity(observation: Any) -> dict[str, Any]:
    keys = ("available_kv_gib", "kv_cache_tokens", "max_concurrency", "model_loading_gib", "cuda_graph_gib")
    return {k: getattr(observation, k) for k in keys if getattr(observation, k, None) is not None}
