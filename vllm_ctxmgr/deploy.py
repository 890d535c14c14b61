"""The orchestrator: walk one change through explicit states and undo it when any step fails.

    planned -> recorded -> installed -> restarting -> serving -> probed -> final
          any of recorded .. probed -> rolling-back -> rolled-back | rollback-failed

(store.py says what each state means on disk; store.TRANSITIONS is the table of allowed moves.)
`Change.enter` is the only way a revision changes state: it writes record.json, with a step line
(state, ISO time, note), BEFORE the step it names begins. So a run killed anywhere leaves a record
that names the step under way, and `recover` (run by itself, or first thing by the next set-context
or rollback on the service) finishes from there; see `Deployer.recover_if_needed` for its order.

SIGTERM, SIGINT and SIGHUP during a change (what Ansible's async timeout, systemd and a terminal send)
fail the change like any other failure: the previous unit is put back and the exit is non-zero. A
second signal while that rollback runs stops at once and leaves the record for `recover`.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

from vllm_ctxmgr import store as st
from vllm_ctxmgr.core.budget import default_gpu_memory_utilization, kv_budget_at_utilization
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.errors import (
    EXIT_ERROR,
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_ROLLBACK_FAILED,
    CtxmgrError,
    UnitError,
    UsageError,
)
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.planning import PlanRequest, effective_args, observations_from_store, plan_for
from vllm_ctxmgr.probe import cache_config_info, probe, wait_until_serving
from vllm_ctxmgr.service import ServiceView, read_service, view_from_unit
from vllm_ctxmgr.store import Revision, ServiceStore, State, Step, atomic_write, crash_point
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.systemctl import Systemd, new_problems
from vllm_ctxmgr.systemd.unit import (
    ServiceUnit,
    UnitFile,
    edit_unit,
    unified_diff,
)
from vllm_ctxmgr.vllm_log.watcher import StartWatcher, last_start, observe_start

Printer = Callable[[str], None]
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _quiet(_: str) -> None:
    return None


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
    """What one command did to a service, in the shape --json prints (the automation contract)
    and the text report reads."""

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
    pending_recovery: int | None = None  # a revision an interrupted run left: a real run recovers it first
    warnings: list[str] = field(default_factory=list)  # verify findings the unit had before the change

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types for --json; cli.common adds `command` and `dry_run` around them."""
        return asdict(self)


def _result_for(rev: Revision, action: str) -> ChangeResult:
    return ChangeResult(
        rev.service,
        action,
        "applied",
        True,
        revision=rev.number,
        max_model_len=rev.max_model_len,
        previous_max_model_len=rev.previous_max_model_len,
        gpu_memory_utilization=rev.gpu_memory_utilization,
        previous_gpu_memory_utilization=rev.previous_gpu_memory_utilization,
        unit_path=rev.unit_path,
    )


# ---------------------------------------------------------------------------------------------
# One change and its states


@dataclass
class Change:
    """A revision on its way through the states, with the bytes it installs and the bytes it replaced."""

    store: ServiceStore
    rev: Revision
    old: bytes | None  # the unit as it was (the revision's `previous`); None: the file did not exist
    new: bytes | None  # the unit this revision installs; None: the file is removed (a drop-in ctxmgr made)
    command: str = ""  # the ctxmgr command walking it: set-context | rollback | recover

    def enter(self, state: State, note: str = "") -> None:
        """The one way into a state: check the table, write the record, then (test hook) maybe die."""
        if state not in st.TRANSITIONS[self.rev.state]:
            raise RuntimeError(f"revision {self.rev.number}: no transition {self.rev.state} -> {state}")
        now = time.time()
        self.rev.state = state
        self.rev.steps.append(Step(state, now, note))
        if state in st.FINISHED:
            self.rev.finished = now
        if state is State.RECORDED:
            self.store.new_revision(self.rev, unit=self.new, previous=self.old)
        else:
            self.store.save(self.rev)
        crash_point(str(state), self.command)


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
def signals_fail(change: Change) -> Iterator[None]:
    """While a change is unfinished, the first signal raises Interrupted and the next Abandoned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if change.rev.state in st.FINISHED:
            return  # the record is final already; the run is about to exit by itself
        received.append(signum)
        raise Interrupted(signum) if len(received) == 1 else Abandoned(signum)

    before = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------------------------------------
# The deployer


@dataclass
class Deployer:
    """One service's systemd, store, timeouts and printers, shared by set-context, rollback,
    recover and verify so each restarts, watches and probes the same way."""

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
    read_only: bool = False  # a dry run: observations stay in memory (unsaved_observations)
    unsaved_observations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def unit(self) -> str:
        """The canonical `NAME.service` that systemctl and the journal are asked about."""
        return unit_name(self.service)

    # ---- the common restart path -----------------------------------------------------------

    def _install(self, path: Path, data: bytes | None) -> None:
        """Write the unit file, or remove it (None: a drop-in ctxmgr created goes). Creating or removing
        a file changes the unit's DropInPaths: systemd is reloaded so that what it reports is current."""
        host = self.systemd.host_path(path)
        existed = host.exists()
        if data is None:
            host.unlink(missing_ok=True)
            if host.parent.name.endswith(".d"):
                with contextlib.suppress(OSError):
                    host.parent.rmdir()  # only when empty: the directory ctxmgr made for it
        else:
            if not host.parent.exists():
                host.parent.mkdir(mode=0o755, parents=True)
            atomic_write(host, data)
        if existed != (data is not None):
            self.systemd.daemon_reload()

    def restart_and_watch(self, view: ServiceView) -> Any:
        """daemon-reload, restart, watch the journal until vLLM serves (and /health answers) or fails."""
        self.systemd.daemon_reload()
        self.systemd.reset_failed(self.unit)
        cursor = self.systemd.journal_cursor()
        self.on_step(f"restarting {self.unit}; following its journal")
        self.systemd.restart(self.unit, no_block=True)
        secrets = view.secrets
        verdict = watch_start(
            self.systemd,
            self.unit,
            cursor,
            self.start_timeout,
            lambda line: self.on_line(mask(line, secrets)),
        )
        # vLLM's decisive line may quote a key: masked once here, for the result, the record and history
        verdict = replace(
            verdict, reason=mask(verdict.reason, secrets), decisive_line=mask(verdict.decisive_line, secrets)
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
        return verdict

    def probe_view(self, view: ServiceView, probe_tokens: int | None, long_probe: bool) -> Any:
        """Probe at the max_model_len the unit sets, so a vLLM serving another context fails; with
        none (or -1, "auto") only the context vLLM reports is exercised."""
        expected = (
            view.args.max_model_len if view.args.max_model_len and view.args.max_model_len > 0 else None
        )
        return probe(
            view.base_url,
            api_key=view.api_key,
            expected_max_model_len=expected,
            probe_tokens=probe_tokens,
            long_probe=long_probe,
            timeout=self.probe_timeout,
        )

    def restart_and_check(
        self, view: ServiceView, probe_tokens: int | None, long_probe: bool
    ) -> tuple[Any, Any]:
        """daemon-reload, restart, watch the journal, probe. Returns (start verdict, probe result or None)."""
        started = time.monotonic()
        verdict = self.restart_and_watch(view)
        if not verdict.ok:
            return verdict, None
        self.on_step(f"vLLM is serving after {time.monotonic() - started:.0f} s; probing {view.base_url}")
        return verdict, self.probe_view(view, probe_tokens, long_probe)

    def _record_observation(self, verdict: Any, view: ServiceView, metrics: dict[str, str]) -> None:
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
        if self.read_only:
            self.unsaved_observations.append(obs)
        else:
            self.store.add_observation(obs)

    # ---- applying a new unit, with automatic rollback --------------------------------------

    def apply(self, change: Change, probe_tokens: int | None, long_probe: bool) -> ChangeResult:
        """Record, install, restart, watch, probe: each step entered as its state; any failure (a
        signal included) puts the previous unit back."""
        rev = change.rev
        result = _result_for(rev, rev.action)
        t0 = time.monotonic()
        try:
            with signals_fail(change):
                interrupted = False
                try:
                    failure = self._forward(change, result, probe_tokens, long_probe)
                except Interrupted as exc:
                    interrupted = True
                    if rev.state is State.PLANNED:
                        raise CtxmgrError(f"interrupted by {exc.name} before anything was changed") from None
                    failure = (f"ctxmgr was interrupted by {exc.name} while {rev.state}", "")
                result.timings["start_s"] = round(time.monotonic() - t0, 3)
                if failure is None:
                    return result
                result.reason, result.decisive_line = failure
                self.on_step(f"the change failed: {result.reason}")
                self._roll_back(change, result, note=result.reason, wait_exit=not interrupted)
        except Abandoned as exc:
            raise CtxmgrError(
                f"interrupted again by {exc.name} while rolling back: revision {rev.number} is left "
                f"{rev.state}; run `ctxmgr recover --service {self.service}`",
                exit_code=EXIT_ROLLBACK_FAILED,
            ) from None
        result.timings["total_s"] = round(time.monotonic() - t0, 3)
        return result

    def _forward(
        self, change: Change, result: ChangeResult, probe_tokens: int | None, long_probe: bool
    ) -> tuple[str, str] | None:
        """The steps towards final; None when it got there, else (reason, decisive line)."""
        rev = change.rev
        path = Path(rev.unit_path)
        if rev.state is State.PLANNED:
            change.enter(State.RECORDED, _describe(rev))
        result.revision = rev.number  # recording the revision is what numbers it
        self.on_step(f"installing {path} (revision {rev.number})")
        change.enter(State.INSTALLED, f"installing {path}")
        self._install(path, change.new)
        view = view_from_unit(self._loaded_unit_with(path, change.new), self.systemd.root)
        change.enter(State.RESTARTING, f"daemon-reload; restart {self.unit}; following its journal")
        started = time.monotonic()
        try:
            verdict = self.restart_and_watch(view)
        except CtxmgrError as exc:
            return f"ctxmgr could not watch the start: {exc.message}", ""
        result.observation = _plain(verdict.observation)
        if not verdict.ok:
            estimate = verdict.estimated_max_model_len
            if estimate:
                result.suggestion = (
                    f"vLLM estimates the largest max_model_len that fits is {estimate}: "
                    f"try `ctxmgr set-context {estimate} --service {self.service}`, or free GPU memory / "
                    "raise --gpu-memory-utilization"
                )
            return verdict.reason, verdict.decisive_line
        took = time.monotonic() - started
        self.on_step(f"vLLM is serving after {took:.0f} s; probing {view.base_url}")
        change.enter(State.SERVING, f"vLLM serves after {took:.1f} s; probing {view.base_url}")
        probe_result = self.probe_view(view, probe_tokens, long_probe)
        result.probe = _plain(probe_result)
        if not probe_result.ok:
            return f"the probe failed: {probe_result.error}", probe_result.error or ""
        rev.verified = True
        rev.vllm_version = verdict.observation.vllm_version or rev.vllm_version
        rev.capacity = _capacity(verdict.observation)
        result.calibration = calibration(
            rev.plan, verdict.observation, self.last_metrics, applied_utilization=_applied_utilization(rev)
        )
        rev.capacity.update(result.calibration)
        change.enter(State.PROBED, "served the context-sized probe")
        rev.reason = "served and passed the context-sized probe"
        result.reason = "vLLM started, reports the new max_model_len and served the context-sized probe"
        change.enter(State.FINAL, rev.reason)
        return None

    def _roll_back(self, change: Change, result: ChangeResult, note: str, wait_exit: bool = True) -> None:
        """rolling-back -> rolled-back | rollback-failed; the result says which."""
        rev = change.rev
        if wait_exit:
            self._let_failed_start_exit()
        self.on_step(f"rolling back to the previous unit of {self.service}")
        rev.reason, rev.decisive_line = result.reason or note, result.decisive_line or rev.decisive_line
        change.enter(State.ROLLING_BACK, f"putting the previous unit back: {note}")
        back_ok, back_reason = self._restore(Path(rev.unit_path), change.old)
        if back_ok:
            change.enter(State.ROLLED_BACK, "the previous unit serves again and passed its probe")
            result.result, result.exit_code = "rolled-back", EXIT_ERROR
        else:
            rev.reason += f"; and the rollback failed too: {back_reason}"
            change.enter(State.ROLLBACK_FAILED, back_reason)
            result.result, result.exit_code = "rollback-failed", EXIT_ROLLBACK_FAILED
            result.reason = rev.reason

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

    def _restore(self, path: Path, old: bytes | None) -> tuple[bool, str]:
        """Put `old` back byte for byte (or remove a drop-in that did not exist), restart, and prove it
        serves again at its own context."""
        self._install(path, old)
        try:
            view = view_from_unit(self._loaded_unit_with(path, old), self.systemd.root)
            verdict, probe_result = self.restart_and_check(view, None, False)
        except CtxmgrError as exc:
            return False, exc.message
        if not verdict.ok:
            return False, verdict.reason
        if probe_result is None or not probe_result.ok:
            return False, f"the probe failed: {probe_result.error if probe_result else 'no probe'}"
        self.on_step(f"{self.service} is serving again with its previous unit")
        return True, ""

    def _loaded_unit_with(self, path: Path, data: bytes | None) -> ServiceUnit:
        """The unit as systemd will load it with `path` holding `data` (None: without that file)."""
        current = read_service(self.systemd, self.service).unit
        files = [f for f in current.files if f.path != path or data is not None]
        files = [
            UnitFile.parse(f.path, data.decode()) if data is not None and f.path == path else f for f in files
        ]
        if data is not None and all(f.path != path for f in files):
            files.append(UnitFile.parse(path, data.decode()))
        return ServiceUnit(current.name, tuple(files))

    # ---- recovery of a run that was killed -------------------------------------------------

    def recover_if_needed(self) -> ChangeResult | None:
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
        self._remove_leftovers()
        rev = self.store.in_progress()
        result = self._recover(rev) if rev is not None else None
        self.store.prune()
        return result

    def _remove_leftovers(self) -> None:
        unit_paths = {Path(rev.unit_path) for rev in self.store.revisions()}
        with contextlib.suppress(CtxmgrError):
            view = read_service(self.systemd, self.service)
            unit_paths |= {f.path for f in view.unit.files}
        dirs = sorted({self.systemd.host_path(p.parent) for p in unit_paths})
        names = sorted({p.name for p in unit_paths})
        removed = self.store.remove_leftovers(dirs, self.systemd.host_path(Path("/run")), names)
        for path in removed:
            self.on_step(f"removed {path}, left by an interrupted run")

    def _recover(self, rev: Revision) -> ChangeResult:
        self.on_step(f"revision {rev.number} of {self.service} was left {rev.state} by an interrupted run")
        change = Change(
            self.store,
            rev,
            old=self.store.file_bytes(rev.number, "previous"),
            new=self.store.file_bytes(rev.number, "unit"),
            command="recover",
        )
        result = _result_for(rev, "recover")
        path = Path(rev.unit_path)
        installed = _read_installed(self.systemd, path)
        state = self.systemd.state(self.unit)
        active = state.active_state == "active" and state.sub_state == "running"
        with signals_fail(change):
            try:
                return self._finish(change, result, installed, active, state.invocation_id)
            except (Interrupted, Abandoned) as exc:
                raise CtxmgrError(
                    f"recover was interrupted by {exc.name}: revision {rev.number} is left {rev.state}; "
                    f"run `ctxmgr recover --service {self.service}` again",
                    exit_code=EXIT_ROLLBACK_FAILED,
                ) from None

    def _finish(
        self, change: Change, result: ChangeResult, installed: bytes, active: bool, invocation: str
    ) -> ChangeResult:
        rev = change.rev
        if rev.state is State.PROBED and installed == change.new and active:
            rev.reason = "served and passed the context-sized probe (the record was finished by recover)"
            change.enter(State.FINAL, "the interrupted run had probed it; only the record was left")
            result.reason = rev.reason
            return result
        interrupted = f"an interrupted ctxmgr run left this change {rev.state}"
        untouched = active and bool(rev.invocation_id) and invocation == rev.invocation_id
        if untouched:
            note = "the service never restarted: the previous unit goes back without a restart"
            change.enter(State.ROLLING_BACK, note)
            if installed != change.old:
                self._install(Path(rev.unit_path), change.old)
                self.systemd.daemon_reload()  # (again, where _install reloaded already: harmless)
            rev.reason = f"{interrupted}; it was undone (nothing had restarted the service)"
            change.enter(State.ROLLED_BACK, "the previous unit is installed and its process still serves")
            result.result, result.reason = "rolled-back", rev.reason
            return result
        result.reason = f"{interrupted}; the previous unit was put back"
        self._roll_back(change, result, note=interrupted, wait_exit=False)
        if result.result == "rolled-back":
            result.exit_code = EXIT_OK  # recovering is what was asked, and it worked
            rev.reason = result.reason
            self.store.save(rev)
        return result


def _read_installed(systemd: Systemd, path: Path) -> bytes | None:
    """The unit file's bytes now; None where it does not exist."""
    try:
        return systemd.host_path(path).read_bytes()
    except FileNotFoundError:
        return None


def _text(data: bytes | None) -> str:
    return "" if data is None else data.decode()


def _describe(rev: Revision) -> str:
    if rev.action == "rollback":
        return (
            f"rollback to revision {rev.rollback_of}: max_model_len {rev.previous_max_model_len} -> "
            f"{rev.max_model_len}"
        )
    return f"{rev.action}: max_model_len {rev.previous_max_model_len} -> {rev.max_model_len}"


def _applied_utilization(rev: Revision) -> float | None:
    """The utilisation the installed unit really runs with (vLLM's default where it sets none)."""
    if rev.gpu_memory_utilization:
        return rev.gpu_memory_utilization
    version = parse_vllm_version(rev.vllm_version or (rev.plan or {}).get("vllm_version"))
    return default_gpu_memory_utilization(version) if version else None


# ---------------------------------------------------------------------------------------------
# The commands


@dataclass
class SetContextRequest:
    """What the user asked of set-context, beyond the service: the CLI fills it, set_context
    carries it through the plan and the change."""

    context: int
    gpu_memory_utilization: float | None = None  # the user's choice instead of the planner's
    probe_tokens: int | None = None
    long_probe: bool = False
    dry_run: bool = False
    force: bool = False  # apply even when the plan says it will not fit
    lock_wait: float = 0.0
    # where the GPUs' memory comes from, the vLLM rules to plan by, the utilisation ceiling
    planning: PlanRequest | None = None


def _pending_dry_run(deployer: Deployer, action: str) -> ChangeResult | None:
    """A dry run while an interrupted change waits for recovery: say so, never "unchanged"."""
    rev = deployer.store.in_progress()
    if rev is None:
        return None
    path = Path(rev.unit_path)
    installed = _read_installed(deployer.systemd, path)
    previous = deployer.store.file_bytes(rev.number, "previous")
    result = ChangeResult(
        deployer.service,
        action,
        "dry-run",
        False,
        revision=rev.number,
        pending_recovery=rev.number,
        max_model_len=rev.previous_max_model_len,
        previous_max_model_len=rev.max_model_len if installed != previous else rev.previous_max_model_len,
        gpu_memory_utilization=rev.previous_gpu_memory_utilization,
        previous_gpu_memory_utilization=rev.gpu_memory_utilization,
        unit_path=str(path),
        diff=unified_diff(_text(installed), _text(previous), str(path)),
    )
    result.reason = (
        f"dry run: revision {rev.number} ({_describe(rev)}) was left {rev.state} by an interrupted run; "
        f"a real run (or `ctxmgr recover --service {deployer.service}`) first puts its previous unit back, "
        "then plans again. Nothing was written or restarted"
    )
    return result


def set_context(deployer: Deployer, request: SetContextRequest) -> ChangeResult:
    """Plan, render, record, install, restart, watch, probe; roll back on any failure."""

    store = deployer.store
    # a dry run reads: it takes the lock only where the state directory exists and is writable, and
    # writes nothing there (observations stay in memory, the candidate goes to the manager's /run)
    lock = store.read_lock(request.lock_wait) if request.dry_run else store.lock(request.lock_wait)
    read_only = deployer.read_only
    deployer.read_only = read_only or request.dry_run
    try:
        with lock:
            return _set_context_locked(deployer, request)
    finally:
        deployer.read_only = read_only


def _set_context_locked(deployer: Deployer, request: SetContextRequest) -> ChangeResult:
    store, systemd = deployer.store, deployer.systemd
    if request.dry_run:
        pending = _pending_dry_run(deployer, "set-context")
        if pending is not None:
            return pending
    else:
        deployer.recover_if_needed()
    view = read_service(systemd, deployer.service)
    learned = learn_from_running_instance(deployer, view)
    observations = observations_from_store(store.observations() + deployer.unsaved_observations)
    pids = tuple(systemd.unit_processes(view.name))
    planning = replace(
        request.planning or PlanRequest(request.context),
        context=request.context,
        fixed_gpu_memory_utilization=request.gpu_memory_utilization,
    )
    plan = plan_for(view.args, planning, pids, observations)
    if learned:
        plan = replace(plan, notes=(learned, *plan.notes))
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
    edit = edit_unit(view.unit, flag_changes, plan.env_changes, systemd.unit_dir / f"{view.name}.d")
    result.diff = unified_diff(edit.old_text, edit.new_text, str(edit.path), view.secrets)
    result.unit_path = str(edit.path)
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
    problems, inherited = verify_candidate(systemd, view, edit.path, edit.new_text)
    result.warnings = [f"systemd-analyze verify (the unit had it before): {p}" for p in inherited]
    if problems:
        raise UnitError(f"the new unit does not pass systemd-analyze verify: {problems[0]}")
    if request.dry_run:
        result.result = "dry-run"
        result.reason = "dry run: nothing was written or restarted"
        return result
    old = edit.old_text.encode() if edit.existed else None
    new = edit.new_text.encode()
    _ensure_baseline(store, view, edit.path, old)
    rev = _planned(
        deployer,
        unit_path=str(edit.path),
        max_model_len=request.context,
        gpu_memory_utilization=result.gpu_memory_utilization,
        previous_max_model_len=view.args.max_model_len,
        previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
        vllm_version=view.args.vllm_version,
        plan=result.plan,
    )
    applied = deployer.apply(
        Change(store, rev, old, new, "set-context"), request.probe_tokens, request.long_probe
    )
    applied.plan, applied.diff, applied.warnings = result.plan, result.diff, result.warnings
    store.prune()
    return applied


def _planned(deployer: Deployer, **fields: Any) -> Revision:
    """A revision in memory (planned) with who, where and which versions make it."""
    state = deployer.systemd.state(deployer.unit)
    return Revision(
        number=0,
        service=deployer.service,
        state=State.PLANNED,
        created=time.time(),
        invocation_id=state.invocation_id or None,
        **st.made_by(),
        **fields,
    )


def _current_utilization_suffices(args: ServeArgs, plan: Any) -> bool:
    """The unit's utilisation is at least the planned minimum and passes vLLM's free-memory check."""

    if plan.gpu_memory_utilization is None or not plan.feasible or args.kv_cache_memory_bytes:
        return False
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    limit = min((g.max_gpu_memory_utilization for g in plan.gpus), default=1.0)
    return plan.gpu_memory_utilization <= current + 1e-9 and current <= limit + 1e-9


def verify_candidate(
    systemd: Systemd, view: ServiceView, path: Path, text: str
) -> tuple[list[str], list[str]]:
    """`systemd-analyze verify` on the unit as it would load (the fragment plus its drop-ins, one edited
    or added) and, where it finds anything, on the unit as it loads now: (what the change adds, what
    the unit had already). A harmless finding the unit already had (a deprecated MemoryLimit=, an
    ExecStartPre= binary missing on this host) must not block every change."""

    def merged(pieces: list[str]) -> bytes:
        return "\n".join(p if p.endswith("\n") else p + "\n" for p in pieces).encode()

    pieces = [text if f.path == path else f.text for f in view.unit.files]
    if all(f.path != path for f in view.unit.files):
        pieces.append(text)  # a new drop-in: after the others (its ExecStart= is the last one)
    found = systemd.analyze_verify_text(merged(pieces), view.name)
    if not found:
        return [], []
    current = systemd.analyze_verify_text(merged([f.text for f in view.unit.files]), view.name)
    added = new_problems(found, current)
    return added, [p for p in found if p not in added]


def _ensure_baseline(store: ServiceStore, view: ServiceView, path: Path, current: bytes | None) -> None:
    """The first change to a service records the unit file it changes as found (None: a drop-in that
    does not exist yet), so `rollback --to 0` can return to it."""
    if store.revisions():
        return
    now = time.time()
    reason = "the unit as ctxmgr first found it"
    store.new_revision(
        Revision(
            number=0,
            service=store.service,
            state=State.BASELINE,
            unit_path=str(path),
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
        unit=current,
        previous=current,
    )


def rollback(
    deployer: Deployer, to: int | None = None, lock_wait: float = 0.0, dry_run: bool = False
) -> ChangeResult:
    """Install an earlier revision's unit through the same restart / watch / probe path."""
    store, systemd = deployer.store, deployer.systemd
    with store.read_lock(lock_wait) if dry_run else store.lock(lock_wait):
        if dry_run:
            pending = _pending_dry_run(deployer, "rollback")
            if pending is not None:
                return pending
        else:
            deployer.recover_if_needed()
        revisions = store.revisions()
        if not revisions:
            raise UsageError(
                f"{deployer.service}: ctxmgr has no revisions of it yet; nothing to roll back to"
            )
        if to is None:
            current = next((r for r in reversed(revisions) if r.state == State.FINAL), None)
            target = store.last_good(before=current.number) if current else None
            if target is None:
                raise UsageError(
                    f"{deployer.service}: no earlier good revision to roll back to (see `ctxmgr history`)"
                )
        else:
            target = store.get(to)
        view = read_service(systemd, deployer.service)
        path = Path(target.unit_path)
        old = _read_installed(systemd, path)
        new = store.file_bytes(target.number, "unit")
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
        result.diff = unified_diff(_text(old), _text(new), str(path), view.secrets)
        if old == new:
            result.reason = (
                f"{deployer.service} already runs the unit of revision {target.number}: nothing to do"
            )
            return result
        if dry_run:
            result.result, result.reason = "dry-run", "dry run: nothing was written or restarted"
            return result
        rev = _planned(
            deployer,
            unit_path=str(path),
            max_model_len=target.max_model_len,
            gpu_memory_utilization=target.gpu_memory_utilization,
            previous_max_model_len=view.args.max_model_len,
            previous_gpu_memory_utilization=view.args.gpu_memory_utilization,
            vllm_version=view.args.vllm_version,
            action="rollback",
            rollback_of=target.number,
        )
        applied = deployer.apply(Change(store, rev, old, new, "rollback"), None, False)
        applied.diff = result.diff
        store.prune()
        return applied


def history(store: ServiceStore) -> list[dict[str, Any]]:
    """Every revision as plain rows for `ctxmgr history` (text and --json), for a person auditing
    changes; plans and unit bytes stay in the store."""
    rows = []
    for rev in store.revisions():
        rows.append(
            {
                "revision": rev.number,
                "time": rev.created,
                "finished": rev.finished,
                "action": rev.action,
                "state": str(rev.state),
                "max_model_len": rev.max_model_len,
                "gpu_memory_utilization": rev.gpu_memory_utilization,
                "previous_max_model_len": rev.previous_max_model_len,
                "rollback_of": rev.rollback_of,
                "vllm_version": rev.vllm_version,
                "user": rev.user,
                "host": rev.host,
                "ctxmgr_version": rev.ctxmgr_version,
                "reason": rev.reason,
                "decisive_line": rev.decisive_line,
                "capacity": rev.capacity,
                "steps": [step.record() for step in rev.steps],
            }
        )
    return rows


def calibration(
    plan: dict[str, Any],
    observation: Any,
    metrics: dict[str, str],
    applied_utilization: float | None = None,
) -> dict[str, Any]:
    """Predicted against observed KV capacity of a start: the planner's calibration error.

    The prediction is re-derived at the utilisation the unit really runs with: a change that keeps
    the unit's utilisation (higher than the plan's minimum) must not be compared with a budget
    planned at a utilisation that was never applied (that read +92% .. +373% on correct changes).
    Observed capacity is vLLM's block count (/metrics num_gpu_blocks, exact) or, without metrics,
    the logged KV budget; never the "KV cache size: N tokens" line (concurrency x length, derived).
    """
    lines = plan.get("gpus") or []
    planned_u = plan.get("gpu_memory_utilization")
    explicit = plan.get("kv_cache_memory_bytes")
    budgets = []
    for line in lines:
        budget = (line.get("kv_budget") or {}).get("bytes")
        if budget is None:
            continue
        total = (line.get("total") or {}).get("bytes")
        requested = (line.get("requested") or {}).get("bytes")
        if (
            not explicit
            and applied_utilization is not None
            and planned_u is not None
            and abs(applied_utilization - planned_u) > 1e-9
            and total
            and requested
        ):
            budget = kv_budget_at_utilization(budget, requested, total, applied_utilization)
        budgets.append(budget)
    bytes_per_block = (plan.get("layout") or {}).get("bytes_per_block")
    block_size = (plan.get("layout") or {}).get("block_size")
    predicted_budget = min(budgets) if budgets else explicit
    if not predicted_budget or not bytes_per_block:
        return {}
    predicted_blocks = predicted_budget // bytes_per_block
    out: dict[str, Any] = {
        "predicted_kv_budget_bytes": predicted_budget,
        "predicted_num_gpu_blocks": predicted_blocks,
        "predicted_at_gpu_memory_utilization": (
            applied_utilization if applied_utilization is not None else planned_u
        ),
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


def learn_from_running_instance(deployer: Deployer, view: ServiceView) -> str | None:
    """Before the first plan of a running service, keep what its last start logged; say so, or why not.

    A service ctxmgr did not start has vLLM's own figures in its journal ("Model loading took",
    "Available KV cache memory", the CUDA-graph estimate): planning from them makes the first restart
    the right one. Only when no observation of this unit at this vLLM version is stored yet.
    """
    if not deployer.systemd.is_active(deployer.unit):
        return None
    version = view.args.vllm_version
    for record in deployer.store.observations():
        same_version = version is None or record.get("vllm_version") in (version, None)
        if record.get("service") == deployer.service and same_version:
            return None
    try:
        data = observe_last_start(deployer)
    except CtxmgrError:
        return (
            f"the journal no longer holds the start of the running {deployer.unit} (rotated?): "
            "planned from estimates"
        )
    except PermissionError as exc:
        return f"could not keep what the running instance logged ({exc.filename}: permission denied)"
    obs = data["observation"]
    figures = ", ".join(
        f"{name} {obs[key]}"
        for key, name in (
            ("model_loading_gib", "weights GiB"),
            ("available_kv_gib", "KV GiB"),
            ("cuda_graph_gib", "CUDA graphs GiB"),
            ("kv_cache_tokens", "KV tokens"),
        )
        if obs.get(key) is not None
    )
    lines = data["lines"]
    return f"learned from the running instance's last start ({lines} journal lines: {figures or 'none'})"


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
