"""Calibration against the real vLLM CPU build: learn from one start, predict the next to within 1%.

On the CPU backend `--gpu-memory-utilization` sizes the KV space (a fraction of NUMA node memory minus
the worker's own footprint), so a change of utilisation is a real test of the calibrated plan.
"""

from __future__ import annotations

import time
import uuid
from functools import partial

import pytest

from tests.support import vllm_cpu as cpu
from tests.support.cli import ctxmgr as ctxmgr_run
from tests.support.paths import REPO
from tests.support.standin import free_port
from vllm_ctxmgr.probe import wait_until_serving

pytestmark = pytest.mark.vllm


ctxmgr = partial(ctxmgr_run, timeout=600)  # run_ctxmgr's own default


def test_a_calibrated_plan_predicts_the_next_start_within_one_percent(
    sandbox, install_unit, require_vllm
) -> None:  # type: ignore[no-untyped-def]
    model = cpu.ensure_tiny_model()
    port = free_port()
    name = "vllm-e2e-calib"
    extra = ["--gpu-memory-utilization", "0.25"]
    text = cpu.unit_text(model, port, 1024, kv_space_gib=None, extra_args=extra)
    assert "VLLM_CPU_KVCACHE_SPACE" not in text
    unit = install_unit(f"{name}.service", text)
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + cpu.READY_TIMEOUT_S)
    state = REPO / ".cache" / "e2e-calib" / uuid.uuid4().hex[:8]

    # 1. learn from a start ctxmgr did not make
    code, data, err = ctxmgr(sandbox.pid, state, "observe", "--service", name, "--json")
    assert code == 0, err
    observed = data["observation"]
    assert observed["platform"] == "CPU" and observed["ready"] is True
    assert observed["available_kv_gib"] > 0 and observed["total_memory_gib"] > 0
    assert observed["num_gpu_blocks"] > 0

    # 2. a change of utilisation: the plan is calibrated by that start, the new start is measured
    code, data, err = ctxmgr(
        sandbox.pid, state, "set-context", "2048", "--service", name, "--gpu-memory-utilization", "0.3",
        "--yes", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert data["result"] == "applied"
    gpu_line = data["plan"]["gpus"][0]
    assert "vllm" in gpu_line["kv_budget"]["source"], gpu_line["kv_budget"]
    cal = data["calibration"]
    assert cal["observed_source"].startswith("vllm metrics")
    assert cal["observed_num_gpu_blocks"] > observed["num_gpu_blocks"]  # more utilisation, more blocks
    assert abs(cal["error_percent"]) < 1.0, cal
