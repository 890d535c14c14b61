"""A stop that leaves something holding the GPU (issue 34, section 2): the change stops before the start
and names the holder, instead of starting into a full GPU and rolling back into the same wall.

A real private systemd, its journal and the stand-in vLLM, whose EngineCore is a real child process that
outlives the API server (CTXMGR_STANDIN_ENGINE_SURVIVES, as vLLM #55510's does); the unit has
KillMode=process, so systemd's stop signals only the main process. Only NVML is played (no GPU here):
as the driver would, it lists every live process that ran in the unit's cgroup on each GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.demo import (
    SEED_GPU_COUNT,
    SEED_GPU_GIB,
    SEED_WEIGHTS_GIB_PER_GPU,
    make_vllm_wrapper,
    standin_unit,
)
from tests.support.sandbox import Sandbox
from tests.support.seed_gpus import TOTAL, VLLM_HOLDS
from tests.support.standin import free_port
from vllm_ctxmgr.change import observing
from vllm_ctxmgr.change.planning import PlanRequest
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import Result
from vllm_ctxmgr.change.walk import SetContextRequest, set_context
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState, gib
from vllm_ctxmgr.errors import ExitCode
from vllm_ctxmgr.probe import wait_until_serving
from vllm_ctxmgr.store import ServiceStore, State


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent: a zombie holds no GPU memory."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


class PlayedNvml:
    """What NVML would list with vLLM on every GPU: its EngineCore, for as long as that process lives, as
    the one that holds vLLM's memory there (in vLLM V1 the engine process, not the API server, creates
    the CUDA context; a context lives as long as its process)."""

    def __init__(self, sandbox: Sandbox, unit: str) -> None:
        self.sandbox, self.unit = sandbox, unit
        self.seen: set[int] = set()

    def __call__(self) -> GpuState:
        self.seen |= set(self.sandbox.systemd.unit_processes(self.unit))
        holders = [pid for pid in sorted(self.seen) if alive(pid) and cmdline(pid).startswith("VLLM::")]
        gpus = []
        for index in range(SEED_GPU_COUNT):
            processes = tuple(GpuProcess(pid, cmdline(pid), VLLM_HOLDS) for pid in holders)
            used = VLLM_HOLDS * len(holders)
            gpus.append(GpuInfo(index, "NVIDIA H200", TOTAL, TOTAL - used, used, processes=processes))
        return GpuState(tuple(gpus), "nvml")

    def kill_leftovers(self) -> None:
        for pid in self.seen:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


PLANNING = PlanRequest(
    16384,
    gpu_memory=int(SEED_GPU_GIB * GIB),
    gpu_count=SEED_GPU_COUNT,
    weights_bytes=int(SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT * GIB),
)


def test_a_process_surviving_the_stop_on_the_gpu_stops_the_change_before_the_start_with_its_pid(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, port = "vllm-gpu-held", free_port()
    env = {"CTXMGR_STANDIN_ENGINE_SURVIVES": "1"}
    text = standin_unit(make_vllm_wrapper(workdir), port=port, environment=env) + "KillMode=process\n"
    unit = install_unit(f"{name}.service", text)
    nvml = PlayedNvml(sandbox, unit)
    try:
        sandbox.systemd.start(unit)
        assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
        monkeypatch.setattr(observing, "read_nvml", nvml)
        nvml()  # the instance as it serves: the API server and its EngineCore, in the unit's cgroup
        engine = [pid for pid in nvml.seen if cmdline(pid).startswith("VLLM::EngineCore")]
        assert len(engine) == 1, [cmdline(pid) for pid in nvml.seen]
        store = ServiceStore(Path(workdir) / "state", name)

        def restarter() -> Restarter:
            return Restarter(sandbox.systemd, store, name, start_timeout=120, probe_timeout=60,
                             gpu_release_timeout=2)  # fmt: skip

        # before: the dry run says what a stop of this unit could leave
        dry = set_context(restarter(), SetContextRequest(16384, planning=PLANNING, force=True, dry_run=True))
        assert dry.result is Result.DRY_RUN
        assert any("has KillMode=process: a stop signals only the main process" in w for w in dry.warnings)

        invocation = sandbox.systemd.state(unit).invocation_id
        result = set_context(restarter(), SetContextRequest(16384, planning=PLANNING, force=True))
        assert result.result is Result.ROLLBACK_FAILED and result.exit_code == ExitCode.ROLLBACK_FAILED
        gpus = ", ".join(map(str, range(SEED_GPU_COUNT)))
        holder = f"PID {engine[0]} (VLLM::EngineCore 3600) holds {gib(VLLM_HOLDS)} on each of GPUs {gpus}"
        assert f"2 s after the stop of {unit}, {holder}: not started" in result.reason, result.reason
        assert "not started into an occupied GPU" in result.reason
        assert "the previous unit is back in place but was not started" in result.reason
        # nothing was started after the stop: neither the new unit nor the previous one
        state = sandbox.systemd.state(unit)
        assert state.active_state == "inactive" and state.invocation_id == invocation
        assert "--max-model-len 8192" in (sandbox.systemd.host_unit_dir / f"{name}.service").read_text()
        rev = store.revisions()[-1]
        assert rev.state is State.ROLLBACK_FAILED and [s.state for s in rev.steps][-3:] == [
            State.RESTARTING, State.ROLLING_BACK, State.ROLLBACK_FAILED,
        ]  # fmt: skip

        # once the holder is gone the same change goes through the stop, the wait and the start
        os.kill(engine[0], signal.SIGKILL)
        done = set_context(restarter(), SetContextRequest(16384, planning=PLANNING, force=True))
        assert done.result is Result.APPLIED, done.reason
    finally:
        with contextlib.suppress(Exception):
            sandbox.systemd.stop(unit)
        nvml.kill_leftovers()


def test_plan_and_verify_say_when_timeoutstopsec_would_kill_vllms_drain(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Section 2's third bullet: vLLM drains for --shutdown-timeout after SIGTERM; the stand-in's unit
    has TimeoutStopSec=10, so systemd would SIGKILL a 30 s drain. Read from systemd's own properties."""
    from tests.ctxmgr_cli import run_ctxmgr
    from tests.support.demo import offline_gpu_args

    name, port = "vllm-drain-cut", free_port()
    text = standin_unit(make_vllm_wrapper(workdir), port=port)
    unit = install_unit(
        f"{name}.service", text.replace("--trust-remote-code", "--trust-remote-code --shutdown-timeout 30")
    )
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    said = (
        f"vLLM's --shutdown-timeout 30 drains requests for up to 30 s after SIGTERM, but {unit}'s "
        "TimeoutStopSec is 10 s"
    )
    state = workdir / "state"
    plan = run_ctxmgr(sandbox.pid, state, "plan", "--service", name, *offline_gpu_args(), "--json")
    assert plan.code == 0, plan.stderr
    assert any(w.startswith(said) for w in plan.data["warnings"]), plan.data["warnings"]
    verify = run_ctxmgr(sandbox.pid, state, "verify", "--service", name, "--json")
    assert any(n.startswith(said) for n in verify.data["notes"]), verify.data["notes"]
