"""The one path by which ctxmgr puts a unit file in place and restarts, watches and probes a service.

set-context, rollback, recovery and verify's --on-failure restart all go through `Restarter`, so each
restart is followed in the journal the same way, ends in the same verdict, records the same
observation and is probed at the same context. What to install and when is the callers' business
(deploy walks the states, recovery finishes them); this module knows no states.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.change.observing import (
    Printer,
    StartProgress,
    expected_downtime,
    observation_record,
    quiet,
    visible_gpus,
    watch_start,
    within_the_gpu,
)
from vllm_ctxmgr.core.downtime import DowntimeEstimate
from vllm_ctxmgr.core.observations import ObservationError, ObservationRecord
from vllm_ctxmgr.core.stop_path import gpu_holders, holders_text
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.probe import ProbeResult, cache_config_info, probe, wait_until_serving
from vllm_ctxmgr.store import FileChange, ServiceStore, StoreError, atomic_write, atomic_write_at, crash_point
from vllm_ctxmgr.systemd.names import canonical_unit, unit_name
from vllm_ctxmgr.systemd.service import ServiceView, read_service, read_stop_path
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit_file import UNIT_FILE_MAX_BYTES
from vllm_ctxmgr.vllm_log.watcher import StartVerdict


class InstallError(CtxmgrError):
    """A unit file could not be written or removed; the file is as it was before."""


class GpuHeld(CtxmgrError):
    """After the stop, a process of the old instance still holds memory on the service's GPUs: no start
    is made into them (it would fail vLLM's free-memory check and read as the new unit's fault)."""


@dataclass
class Restarter:
    """One service's systemd, store, timeouts and printers: install a unit file, restart, watch, probe."""

    systemd: Systemd
    store: ServiceStore
    service: str
    on_line: Printer = quiet  # vLLM's progress lines while a start is watched
    on_step: Printer = quiet  # ctxmgr's own steps
    on_tick: Callable[[StartProgress], None] | None = None  # about every second while a start is watched
    start_timeout: float = 1800.0
    probe_timeout: float = 600.0
    listen_timeout: float = 120.0  # from vLLM's ready line to /health answering
    exit_wait: float = 20.0  # how long a failed vLLM may take to exit by itself before the restore
    last_metrics: dict[str, str] = field(default_factory=dict)
    read_only: bool = False  # a dry run: observations stay in memory (unsaved_observations)
    unsaved_observations: list[ObservationRecord] = field(default_factory=list)
    # why a watched start's figures were not kept (one line each, for the result's warnings)
    unkept_observations: list[str] = field(default_factory=list)
    expected: DowntimeEstimate | None = None  # the next start's expected phases, for the time left
    # after the stop, how long the old instance's processes may take to leave the service's GPUs
    gpu_release_timeout: float = 30.0
    start_into_held_gpu: bool = False  # start even where they did not (--start-into-held-gpu)

    @property
    def unit(self) -> str:
        """The canonical `NAME.service` that systemctl and the journal are asked about."""
        return unit_name(self.service)

    def keep_observation(self, record: ObservationRecord) -> None:
        """Store an observation, or hold it in memory during a dry run (which writes nothing)."""
        if self.read_only:
            self.unsaved_observations.append(record)
        else:
            self.store.add_observation(record.to_json())

    def install(self, writes: Sequence[tuple[Path, bytes | None]]) -> None:
        """Write each unit file, or remove it (None: a drop-in ctxmgr created goes), in order, each one
        atomically; then daemon-reload, so that what systemd reports (DropInPaths, ExecStart=) is the
        unit with these files.

        A unit directory that cannot be written (read-only /etc, a full disk) is InstallError naming the
        path; the files written before it are put back (in the reverse order), so the unit is as it was,
        with no empty drop-in directory behind."""
        done: list[tuple[Path, bytes | None]] = []
        try:
            for path, data in writes:
                before = self.installed_bytes(path)
                self._install_file(path, data)
                done.append((path, before))
                crash_point("unit-file-written")
        except InstallError:
            for path, before in reversed(done):
                with contextlib.suppress(InstallError):
                    self._install_file(path, before)
            raise
        finally:
            if done:
                self.systemd.daemon_reload()

    def put_back(self, files: Sequence[FileChange]) -> None:
        """Undo the writes: every file a change wrote gets its previous bytes back (a drop-in it created
        goes), newest write first, skipping the files that hold them already; systemd is reloaded in
        every case, so what it loads is the files as they now are. The one way a change's writes are
        undone (the walk, its rollback, recovery, a node's restore)."""
        writes = [(f.path, f.previous) for f in reversed(files) if self.installed_bytes(f.path) != f.previous]
        self.install(writes)
        if not writes:
            self.systemd.daemon_reload()

    def _install_file(self, path: Path, data: bytes | None) -> None:
        """One file, atomically (atomic_write renames a whole temporary or nothing)."""
        host = self.systemd.host_path(path)
        if files.split_root(host) is not None:
            self._install_in_root(path, host, data)
            return
        made_dir = False
        try:
            if data is None:
                host.unlink(missing_ok=True)
                if host.parent.name.endswith(".d"):
                    with contextlib.suppress(OSError):
                        host.parent.rmdir()  # only when empty: the directory ctxmgr made for it
            else:
                if not host.parent.exists():
                    host.parent.mkdir(mode=0o755, parents=True)
                    made_dir = True
                atomic_write(host, data)
        except OSError as exc:
            if made_dir:
                with contextlib.suppress(OSError):
                    host.parent.rmdir()
            raise InstallError(f"cannot write {path}: {exc.strerror or exc}") from None

    def _install_in_root(self, path: Path, host: Path, data: bytes | None) -> None:
        """_install_file for a manager in another root: every directory is opened as the container
        sees it (files.open_path), so a drop-in directory linked to "/etc/..." is the container's /etc,
        never the host's; the file itself is written and removed at that directory's descriptor."""
        directory = host.parent
        try:
            if data is None:
                with contextlib.suppress(FileNotFoundError), files.directory_fd(directory) as parent_fd:
                    os.unlink(host.name, dir_fd=parent_fd)
                if directory.name.endswith(".d"):
                    with contextlib.suppress(OSError), files.directory_fd(directory.parent) as grand_fd:
                        os.rmdir(directory.name, dir_fd=grand_fd)  # only when empty: the one ctxmgr made
                return
            with files.directory_fd(directory, create=True) as parent_fd:
                mode = 0o644
                with contextlib.suppress(FileNotFoundError):
                    mode = os.stat(host.name, dir_fd=parent_fd, follow_symlinks=False).st_mode & 0o7777
                atomic_write_at(parent_fd, host.name, data, mode)
        except OSError as exc:
            raise InstallError(f"cannot write {path}: {exc.strerror or exc}") from None

    def restart_and_watch(self, view: ServiceView) -> StartVerdict:
        """daemon-reload, stop, wait for the GPUs to be free, start, watch the journal until vLLM serves
        (and /health answers) or fails. Without NVML (the CPU build, no GPU) systemd's own restart."""
        self.systemd.daemon_reload()
        self.systemd.reset_failed(self.unit)
        stopped = self.stop_and_wait_for_gpus(view)  # GpuHeld: nothing is started
        cursor = self.systemd.journal_cursor()
        if stopped:
            self.on_step(f"starting {self.unit}; following its journal")
            self.systemd.start(self.unit, no_block=True)
        else:
            self.on_step(f"restarting {self.unit}; following its journal")
            self.systemd.restart(self.unit, no_block=True)
        secrets = view.secrets
        verdict = watch_start(
            self.systemd,
            self.unit,
            cursor,
            self.start_timeout,
            lambda line: self.on_line(mask(line, secrets)),
            on_tick=self.on_tick,
            expected=self.expected,
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
        record = observation_record(self.service, verdict.observation, verdict.ok, view, metrics)
        try:
            # as `observe` keeps a start: no figure above the GPU it was measured on
            self.keep_observation(within_the_gpu(record, visible_gpus(view.env), self.unit))
        except (ObservationError, StoreError) as exc:  # a full state directory must not fail a start
            self.unkept_observations.append(exc.message)
            self.on_step(exc.message)
        return verdict

    def stop_and_wait_for_gpus(self, view: ServiceView) -> bool:
        """Stop the unit, then wait (up to gpu_release_timeout) until no process of the old instance (its
        cgroup's PIDs before the stop, and any left in it after) holds memory on the service's GPUs, as
        NVML lists them. True: stopped and free; False: no NVML here, nothing stopped (the caller
        restarts). GpuHeld names each holder, unless start_into_held_gpu."""
        if visible_gpus(view.env) is None:
            return False
        old = set(self.systemd.unit_processes(self.unit))
        self.on_step(f"stopping {self.unit}; then waiting until its processes leave its GPUs")
        self.systemd.stop(self.unit)
        deadline = time.monotonic() + self.gpu_release_timeout
        while True:
            gpus = visible_gpus(view.env)
            held = gpu_holders(gpus, old | set(self.systemd.unit_processes(self.unit))) if gpus else []
            if not held:
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        said = holders_text(held)
        if self.start_into_held_gpu:
            self.on_step(f"after the stop, {said}: starting anyway (--start-into-held-gpu)")
            return True
        why = "".join(f"; {risk}" for risk in self.stop_risks(view))
        raise GpuHeld(
            f"{self.gpu_release_timeout:g} s after the stop of {self.unit}, {said}: not started into an "
            f"occupied GPU (end that process, or give --start-into-held-gpu){why}"
        )

    def stop_risks(self, view: ServiceView) -> list[str]:
        """What a stop of this unit could leave holding its GPUs (core.stop_path), before a restart."""
        try:
            return read_stop_path(self.systemd, view).risks()
        except CtxmgrError:
            return []

    def probe(self, view: ServiceView, probe_tokens: int | None, long_probe: bool) -> ProbeResult:
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

    def restart_and_probe(
        self, view: ServiceView, probe_tokens: int | None = None, long_probe: bool = False
    ) -> tuple[StartVerdict, ProbeResult | None]:
        """Restart, watch, probe: (start verdict, probe result; None where the start failed)."""
        started = time.monotonic()
        verdict = self.restart_and_watch(view)
        if not verdict.ok:
            return verdict, None
        self.on_step(f"vLLM is serving after {time.monotonic() - started:.0f} s; probing {view.base_url}")
        return verdict, self.probe(view, probe_tokens, long_probe)

    def restore(self, files: Sequence[FileChange], max_model_len: int | None) -> tuple[bool, str]:
        """Put every file's previous bytes back (or remove a drop-in that did not exist), in the reverse
        order of their writing, restart, and prove the service serves again at its own context: the
        previous `max_model_len` where it set one. (it does, or why not)"""
        try:
            self.put_back(files)
            self.expect_warm_start()
            view = self.loaded_view()
            verdict, probe_result = self.restart_and_probe(view)
        except CtxmgrError as exc:
            return False, exc.message
        if not verdict.ok:
            return False, verdict.reason
        if probe_result is None or not probe_result.ok:
            return False, f"the probe failed: {probe_result.error if probe_result else 'no probe'}"
        wrong = self.serves_other_than(max_model_len, probe_result)
        if wrong:
            return False, wrong
        self.on_step(f"{self.service} is serving again with its previous unit")
        return True, ""

    def expect_warm_start(self) -> None:
        """The time left while the previous unit starts again: its context served before, so vLLM's
        compile cache hits (the forward change's estimate counted a cold compile). An estimate the
        journal cannot give leaves none: it never stands in the way of putting a service back."""
        try:
            self.expected = expected_downtime(self.systemd, self.unit, "hit")
        except CtxmgrError:
            self.expected = None

    def loaded_view(self) -> ServiceView:
        """The service as systemd loads it now (its FragmentPath and DropInPaths, after install's
        daemon-reload): which file's ExecStart= wins is systemd's answer, not ctxmgr's guess."""
        return read_service(self.systemd, self.service)

    def serves_other_than(self, max_model_len: int | None, probe_result: ProbeResult) -> str:
        """After a restart: what is wrong where the unit systemd loaded or the context vLLM reports is
        not `max_model_len` (None: the revision left it to vLLM, nothing to compare); "" where both are."""
        if max_model_len is None or max_model_len <= 0:
            return ""
        loaded = self.loaded_view()
        if loaded.args.max_model_len != max_model_len:
            holder = loaded.unit.exec_start()[0].path
            return (
                f"after the restart, the unit systemd loaded sets max_model_len {loaded.args.max_model_len}, "
                f"not {max_model_len}: {holder} sets its ExecStart="
            )
        if probe_result.max_model_len is not None and probe_result.max_model_len != max_model_len:
            return f"vLLM serves max_model_len {probe_result.max_model_len}, not {max_model_len}"
        return ""

    def let_failed_start_exit(self) -> None:
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

    def installed_bytes(self, path: Path) -> bytes | None:
        """The unit file's bytes now; None where it does not exist."""
        try:
            return files.read_regular(
                self.systemd.host_path(path), UNIT_FILE_MAX_BYTES, what="unit file", error=InstallError
            )
        except FileNotFoundError:
            return None


def restarter_for_service(
    systemd: Systemd,
    state_dir: Path | str,
    service: str,
    *,
    start_timeout: float = 1800.0,
    on_step: Printer = quiet,
    on_line: Printer = quiet,
    on_tick: Callable[[StartProgress], None] | None = None,
) -> Restarter:
    """The restart path for a service systemd knows, under its canonical name (an alias shares the real
    unit's lock, journal and history); an unknown service stops here, before anything is written. The one
    construction the CLI, monitoring's --on-failure and a library caller share."""
    unit = canonical_unit(systemd, service)
    store = ServiceStore(state_dir, unit)
    return Restarter(
        systemd, store, unit, on_line=on_line, on_step=on_step, on_tick=on_tick, start_timeout=start_timeout
    )
