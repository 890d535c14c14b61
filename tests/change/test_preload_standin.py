"""A deployment that maps a `vllm preload` daemon's weights (issue 34 §3), in a real private systemd.

Two units of the stand-in vLLM: `vllm preload` (the daemon, entrypoints/cli/preload.py) and the engine
with `--load-format ipc_cache`, which Requires= the daemon's unit; the engine prints what vLLM 0.33.0
prints when it maps the daemon's weights (weight_cache/ipc_loader.py:L321-L325) and reads no shard. Only
NVML is played (no GPU here): the daemon's process holds the weights on each GPU, as it would.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from tests.support.demo import (
    GLM5_CONFIG_DIR,
    SEED_GPU_COUNT,
    SEED_WEIGHTS_GIB_PER_GPU,
    make_vllm_wrapper,
    quote_exec_word,
    standin_unit,
)
from tests.support.paths import REPO
from tests.support.seed_gpus import TOTAL
from tests.support.standin import free_port
from vllm_ctxmgr.change import observing, planning
from vllm_ctxmgr.change.planning import PlanRequest
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import Result
from vllm_ctxmgr.change.walk import SetContextRequest, set_context
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState
from vllm_ctxmgr.probe import wait_until_serving
from vllm_ctxmgr.store import ServiceStore

WEIGHTS = int(SEED_WEIGHTS_GIB_PER_GPU * GIB)


def _daemon_unit(wrapper: Path) -> str:
    env = f"Environment=PYTHONPATH={REPO}\nEnvironment=PYTHONUNBUFFERED=1\n"
    return (
        "[Unit]\nDescription=vLLM weight cache (stand-in)\n\n[Service]\nType=simple\n"
        f"{env}Environment=CTXMGR_STANDIN_TIME_SCALE=0.2\n"
        f"ExecStart={quote_exec_word(str(wrapper))} preload --model {quote_exec_word(str(GLM5_CONFIG_DIR))} "
        "--tensor-parallel-size 8\n"
    )


def test_a_preload_deployment_is_planned_with_the_daemons_memory_and_its_short_restart(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = make_vllm_wrapper(workdir)
    daemon = install_unit("vllm-preload.service", _daemon_unit(wrapper))
    port = free_port()
    text = standin_unit(wrapper, port=port).replace(
        "--trust-remote-code", "--trust-remote-code --load-format ipc_cache"
    )
    text = text.replace("[Unit]\n", f"[Unit]\nRequires={daemon}\nAfter={daemon}\n", 1)
    engine = install_unit("vllm-mapped.service", text)

    def played_nvml() -> GpuState:
        """The daemon's process holds its rank's weights on each GPU (zero_copy: the engine maps them)."""
        pid = int(sandbox.systemd.show(daemon, "MainPID")["MainPID"])
        gpus = tuple(
            GpuInfo(
                i,
                "NVIDIA H200",
                TOTAL,
                TOTAL - WEIGHTS,
                WEIGHTS,
                processes=(GpuProcess(pid, "vllm", WEIGHTS),),
            )
            for i in range(SEED_GPU_COUNT)
        )
        return GpuState(gpus, "nvml")

    try:
        sandbox.systemd.start(engine)  # Requires= starts the daemon first
        assert sandbox.systemd.is_active(daemon)
        assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
        monkeypatch.setattr(planning, "read_nvml", played_nvml)
        monkeypatch.setattr(observing, "read_nvml", played_nvml)
        store = ServiceStore(Path(workdir) / "state", "vllm-mapped")
        request = PlanRequest(16384, weights_bytes=WEIGHTS * SEED_GPU_COUNT)

        def restarter() -> Restarter:
            return Restarter(sandbox.systemd, store, "vllm-mapped", start_timeout=120, probe_timeout=60)

        dry = set_context(restarter(), SetContextRequest(16384, planning=request, dry_run=True))
        assert dry.result is Result.DRY_RUN, dry.reason
        notes = dry.plan["notes"]
        said = (
            f"weight-cache daemon: {daemon} runs `vllm preload` for {GLM5_CONFIG_DIR} on GPUs 0,1,2,3,4,5,6,7"
        )
        assert any(note.startswith(said) for note in notes), notes  # type: ignore[union-attr]
        gpu = dry.plan["gpus"][0]  # type: ignore[index]
        assert "the preload daemon's weights among them" in gpu["used_by_others"]["source"]
        # vLLM's "Model loading took 0.01 GiB" of the mapped start does not count the daemon's weights: the
        # plan keeps their size, which the daemon holds and vLLM's check takes off the request
        assert gpu["weights"]["bytes"] > 40 * GIB, gpu["weights"]
        expected = dry.expected_downtime
        loading = next(p for p in expected["phases"] if p["phase"] == "loading weights")
        assert loading["seconds"] < 0.5 and "mapped the daemon's weights" in loading["source"], loading
        assert any("not a cold load" in note for note in expected["notes"]), expected["notes"]

        done = set_context(restarter(), SetContextRequest(16384, planning=request))
        assert done.result is Result.APPLIED, done.reason
        assert sandbox.systemd.is_active(daemon)  # the engine's restart leaves the daemon's weights
    finally:
        for unit in (engine, daemon):
            with contextlib.suppress(Exception):
                sandbox.systemd.stop(unit)
