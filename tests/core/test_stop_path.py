"""What a stop of the unit could leave holding its GPUs (core/stop_path.py), said before a restart, and
who holds them after it. Pure: the unit's properties as `systemctl show` gives them, NVML's process list."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.seed_gpus import OTHER_PID, SERVICE_PID, gpu_state
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.stop_path import StopPath, gpu_holders, holders_text
from vllm_ctxmgr.systemd.timespan import parse_timespan

UNIT = "vllm-glm5.service"


def path(**changes: object) -> StopPath:
    base = {"unit": UNIT, "kill_mode": "control-group", "timeout_stop_s": 90.0, "has_exec_stop": False}
    return StopPath(**{**base, **changes})  # type: ignore[arg-type]


def test_systemds_default_stop_of_a_venv_vllm_leaves_nothing() -> None:
    assert path().risks() == [] and path(kill_mode="mixed").risks() == []


@pytest.mark.parametrize(("mode", "whom"), [("process", "only the main process"), ("none", "no process")])
def test_killmode_process_or_none_may_leave_engine_core_and_workers(mode: str, whom: str) -> None:
    (risk,) = path(kill_mode=mode).risks()
    assert risk.startswith(f"{UNIT} has KillMode={mode}: a stop signals {whom}, so vLLM's EngineCore")


def test_a_container_client_without_execstop_may_leave_its_container() -> None:
    (risk,) = path(container="docker").risks()
    assert "runs `docker run` without ExecStop=" in risk and "`ExecStop=docker stop NAME`" in risk
    assert path(container="podman", has_exec_stop=True).risks() == []


def test_a_drain_longer_than_timeoutstopsec_is_cut_by_systemd() -> None:
    cut = path(timeout_stop_s=10.0, shutdown_timeout_s=30).drain_cut()
    assert cut is not None and cut.startswith("vLLM's --shutdown-timeout 30 drains requests for up to 30 s")
    assert f"but {UNIT}'s TimeoutStopSec is 10 s: systemd kills the drain" in cut
    assert path(timeout_stop_s=10.0, shutdown_timeout_s=30).risks() == [cut]
    assert path(timeout_stop_s=30.0, shutdown_timeout_s=30).drain_cut() is not None  # no time to exit
    assert path(timeout_stop_s=90.0, shutdown_timeout_s=30).drain_cut() is None
    assert path(timeout_stop_s=None, shutdown_timeout_s=30).drain_cut() is None  # infinity: never killed
    assert path(timeout_stop_s=10.0, shutdown_timeout_s=0).drain_cut() is None  # vLLM's default: no drain


def test_timeoutstopusec_as_systemctl_show_prints_it() -> None:
    assert parse_timespan("1min 30s") == 90 and parse_timespan("10s") == 10 and parse_timespan("500ms") == 0.5


def test_only_the_old_instances_processes_hold_the_gpu_and_each_is_named() -> None:
    gpus = gpu_state(40 * GIB, others=2 * GIB, count=2)
    held = gpu_holders(gpus, {SERVICE_PID})
    assert [(h.gpu, h.pid) for h in held] == [(0, SERVICE_PID), (1, SERVICE_PID)]
    assert held[0].text() == f"PID {SERVICE_PID} (vllm serve) holds 40.00 GiB on GPU 0"
    assert OTHER_PID not in {h.pid for h in held}  # a neighbour's memory is not the old instance's
    assert gpu_holders(gpus, set()) == []
    unknown = gpu_holders(gpu_state(None, count=1), {SERVICE_PID})[0]
    assert unknown.text() == f"PID {SERVICE_PID} (vllm serve) holds memory (NVML says not how much) on GPU 0"


def test_a_holder_on_several_gpus_is_named_once_with_all_it_holds() -> None:
    held = gpu_holders(gpu_state(40 * GIB, count=8), {SERVICE_PID})
    each = f"PID {SERVICE_PID} (vllm serve) holds 40.00 GiB on each of GPUs 0, 1, 2, 3, 4, 5, 6, 7"
    assert holders_text(held) == each
    uneven = [held[0], replace(held[1], used_bytes=20 * GIB)]
    assert holders_text(uneven) == f"PID {SERVICE_PID} (vllm serve) holds 60.00 GiB in all on GPUs 0, 1"
    assert holders_text(held[:1]) == held[0].text()
