"""The one path by which ctxmgr puts a unit file in place and restarts, watches and probes a service.

set-context, rollback, recovery and verify's --on-failure restart all go through `Restarter`, so each
restart is followed in the journal the same way, ends in the same verdict, records the same
observation and is probed at the same context. What to install and when is the callers' business
(deploy walks the states, recovery finishes them); this module knows no states.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_ctxmgr.core.observations import ObservationRecord
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.observing import Printer, StartProgress, observation_record, quiet, watch_start
from vllm_ctxmgr.probe import ProbeResult, cache_config_info, probe, wait_until_serving
from vllm_ctxmgr.service import ServiceView, read_service, view_from_unit
from vllm_ctxmgr.store import ServiceStore, atomic_write
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.vllm_log.watcher import StartVerdict


class InstallError(CtxmgrError):
    """A unit file could not be written or removed; the file is as it was before."""


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

    def install(self, path: Path, data: bytes | None) -> None:
        """Write the unit file, or remove it (None: a drop-in ctxmgr created goes). Creating or removing
        a file changes the unit's DropInPaths: systemd is reloaded so that what it reports is current.

        A unit directory that cannot be written (read-only /etc, a full disk) is InstallError naming the
        path, and leaves the file as it was (atomic_write renames a whole temporary or nothing) and no
        empty drop-in directory behind."""
        host = self.systemd.host_path(path)
        existed = host.exists()
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
        if existed != (data is not None):
            self.systemd.daemon_reload()

    def restart_and_watch(self, view: ServiceView) -> StartVerdict:
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
            on_tick=self.on_tick,
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
        self.keep_observation(
            observation_record(self.service, verdict.observation, verdict.ok, view, metrics)
        )
        return verdict

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

    def restore(self, path: Path, old: bytes | None) -> tuple[bool, str]:
        """Put `old` back byte for byte (or remove a drop-in that did not exist), restart, and prove it
        serves again at its own context: (it does, or why not)."""
        try:
            self.install(path, old)
            view = view_from_unit(self.loaded_unit_with(path, old), self.systemd.root)
            verdict, probe_result = self.restart_and_probe(view)
        except CtxmgrError as exc:
            return False, exc.message
        if not verdict.ok:
            return False, verdict.reason
        if probe_result is None or not probe_result.ok:
            return False, f"the probe failed: {probe_result.error if probe_result else 'no probe'}"
        self.on_step(f"{self.service} is serving again with its previous unit")
        return True, ""

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

    def loaded_unit_with(self, path: Path, data: bytes | None) -> ServiceUnit:
        """The unit as systemd will load it with `path` holding `data` (None: without that file)."""
        current = read_service(self.systemd, self.service).unit
        files = [f for f in current.files if f.path != path or data is not None]
        files = [
            UnitFile.parse(f.path, data.decode()) if data is not None and f.path == path else f for f in files
        ]
        if data is not None and all(f.path != path for f in files):
            files.append(UnitFile.parse(path, data.decode()))
        return ServiceUnit(current.name, tuple(files))

    def installed_bytes(self, path: Path) -> bytes | None:
        """The unit file's bytes now; None where it does not exist."""
        try:
            return self.systemd.host_path(path).read_bytes()
        except FileNotFoundError:
            return None
