"""set-context keeps no figure its GPU could not hold (issue 29 item 1, after `observe`:
tests/change/test_observe_gpu_total.py). The start a change watches was stored as it was logged, so a start
logging more weights than NVML says its GPU has went into observations.jsonl; now it is checked as
`observe` checks it, not stored, and the result says so in one warning.

A real private systemd, its journal and the stand-in vLLM; only NVML is played (no GPU here): the
stand-in logs 50.84 GiB of weights per GPU, and NVML answers 40 GiB (or 95.6 GiB, the stand-in's own)."""

from __future__ import annotations

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
from tests.support.standin import free_port
from vllm_ctxmgr.change import observing
from vllm_ctxmgr.change.planning import PlanRequest
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import Result
from vllm_ctxmgr.change.walk import SetContextRequest, set_context
from vllm_ctxmgr.core.hardware import GIB, uniform_gpus
from vllm_ctxmgr.probe import wait_until_serving
from vllm_ctxmgr.store import ServiceStore


@pytest.mark.parametrize(("nvml_gib", "kept"), [(40.0, False), (SEED_GPU_GIB, True)])
def test_a_watched_start_above_its_gpu_is_not_stored_and_the_result_says_so(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch: pytest.MonkeyPatch, nvml_gib: float, kept: bool
) -> None:
    name = f"vllm-gputotal-{int(nvml_gib)}"
    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    monkeypatch.setattr(observing, "read_nvml", lambda: uniform_gpus(SEED_GPU_COUNT, int(nvml_gib * GIB)))
    store = ServiceStore(Path(workdir) / "state", name)
    planning = PlanRequest(
        16384,
        gpu_memory=int(SEED_GPU_GIB * GIB),
        gpu_count=SEED_GPU_COUNT,
        weights_bytes=int(SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT * GIB),
    )
    result = set_context(
        Restarter(sandbox.systemd, store, name, start_timeout=120, probe_timeout=60),
        SetContextRequest(16384, planning=planning, force=True),
    )
    assert result.result is Result.APPLIED, result.reason
    assert result.observation["model_loading_gib"] == SEED_WEIGHTS_GIB_PER_GPU  # the start, as logged
    stored = store.observations()
    said = [w for w in result.warnings if "more than the" in w]
    if kept:  # the running instance's start (the plan learned it) and the start the change watched
        assert [r["model_loading_gib"] for r in stored] == [SEED_WEIGHTS_GIB_PER_GPU] * 2 and said == []
    else:  # neither: the plan refused to learn the first, the walk the second
        assert stored == []
        assert said == [
            f"{name}.service: its last start logged model_loading_gib {SEED_WEIGHTS_GIB_PER_GPU:,.2f} GiB, "
            "more than the 40.00 GiB of its GPU (NVML): not stored"
        ]
