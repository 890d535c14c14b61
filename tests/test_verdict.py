"""core/verdict.py alone: each rule on one record that trips it and one that does not.

The records are what verify.py gathers, built from real values: vLLM's numbers come from a real
vLLM 0.32 CPU start (tests/data/vllm-logs/ok_auto_gmu_0_5.log, read by ctxmgr's own log watcher), the GPU
from an H100 80GB HBM3 as NVML reports it (81559 MiB), revisions from store.Revision.to_json().
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from vllm_ctxmgr.core.budget import margin_bytes
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.plan_record import StoredPlan
from vllm_ctxmgr.core.verdict import (
    DEGRADED,
    FAILED,
    GOOD_STATES,
    OK,
    GpuMargin,
    UnitFacts,
    VerifyFacts,
    decide,
    kv_drift_reasons,
    margin_reasons,
    own_memory_drift,
    record,
    restart_reasons,
    revision_reasons,
    serving_reasons,
    utc_clock,
    version_reasons,
)
from vllm_ctxmgr.store import GOOD, Revision, State
from vllm_ctxmgr.vllm_log.watcher import observe_start

LOGS = Path(__file__).resolve().parent / "data" / "vllm-logs"  # the shared real logs, kept in the repo
H100_TOTAL = 81559 * 1024 * 1024  # nvidia-smi / NVML memory.total of an H100 80GB HBM3
T0 = 1_790_000_000.0
UNIT = "/etc/systemd/system/vllm-tiny.service"


@pytest.fixture(scope="module")
def observation() -> dict[str, Any]:
    log = LOGS / "ok_auto_gmu_0_5.log"
    seen = asdict(observe_start(log.read_text().splitlines()))
    assert seen["vllm_version"] == "0.32.0" and seen["available_kv_gib"] == 5.62 and seen["ready"]
    return seen


def facts(seen: dict[str, Any], **changes: Any) -> VerifyFacts:
    """A CPU vLLM serving as ctxmgr left it (revision 1 installed), verified 5 minutes ago."""
    revisions = (
        Revision(0, "vllm-tiny", State.BASELINE, UNIT, T0 - 900, 2048, None, action="baseline").to_json(),
        Revision(1, "vllm-tiny", State.FINAL, UNIT, T0 - 600, 1024, 0.5, previous_max_model_len=2048,
                 verified=True, vllm_version="0.32.0").to_json(),
    )  # fmt: skip
    base = VerifyFacts(
        service="vllm-tiny",
        time=T0,
        unit=UnitFacts("active", "running", "success", 0, "inv-1", 5_000_000, T0 - 500, T0 - 560),
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        configured_gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=None,
        graphs_in_budget=True,
        probe={"ok": True, "error": None, "latency_s": 0.08, "max_model_len": 1024, "steps": []},
        server_vllm_version="0.32.0",
        observation=seen,
        cache_config={},
        last_start={
            "vllm_version": "0.32.0",
            "available_kv_gib": 5.62,
            "configured_max_model_len": 1024,
            "configured_gpu_memory_utilization": 0.5,
            "configured_kv_cache_memory_bytes": None,
        },
        last_verify={
            "time": T0 - 300,
            "result": OK,
            "invocation_id": "inv-1",
            "n_restarts": 0,
            "active_state": "active",
            "gpus": [],
        },
        revisions=revisions,
        current_revision=1,
        in_progress=None,
        gpus=None,
        gpu_note="the vLLM CPU build: its memory is not GPU memory",
        service_pids=(),
    )
    return replace(base, **changes)


def h100_margin(**changes: Any) -> GpuMargin:
    """One H100 as planned: 0.9 of it asked at startup, 2 GiB held by others, 20 GiB KV spare."""
    startup = int(H100_TOTAL * 0.9)
    slack = H100_TOTAL - 2 * GIB - startup
    base = GpuMargin(
        index=0, total_bytes=H100_TOTAL, used_by_others_planned=2 * GIB, used_by_others_now=2 * GIB,
        used_by_others_source="service excluded", service_bytes=startup, startup_bytes=startup,
        startup_slack_planned=slack, startup_slack_now=slack,
        kv_budget_bytes=40 * GIB, kv_budget_source="plan", kv_needed_bytes=20 * GIB, kv_spare_bytes=20 * GIB,
        margin_bytes=margin_bytes(H100_TOTAL),
    )  # fmt: skip
    return replace(base, **changes)


def test_the_good_states_are_the_stores() -> None:
    assert set(GOOD_STATES) == GOOD  # the core keeps the store's two names as strings


def test_serving_is_ok_when_active_and_probed_and_failed_when_not_active(observation: dict[str, Any]) -> None:
    assert serving_reasons(facts(observation)) == ([], [])
    down = facts(
        observation, unit=UnitFacts("failed", "failed", "exit-code", 0, "inv-1", 0, None), probe=None
    )
    assert serving_reasons(down) == (["vllm-tiny is not active: failed (failed), result exit-code"], [])
    assert decide(down).result == FAILED and decide(down).exit_code == 2


def test_a_failing_probe_is_failed(observation: dict[str, Any]) -> None:
    probe = {"ok": False, "error": "/v1/models reports max_model_len 2048, not 1024", "latency_s": 0.02}
    assert serving_reasons(facts(observation, probe=probe))[0] == [
        "the probe failed: /v1/models reports max_model_len 2048, not 1024"
    ]


def test_a_start_without_its_ready_line_is_degraded_until_the_start_timeout(
    observation: dict[str, Any],
) -> None:
    loading = {**observation, "ready": False}
    unit = UnitFacts("activating", "start", "success", 0, "inv-2", 0, None, T0 - 600)
    starting = facts(observation, unit=unit, probe=None, observation=loading)
    assert serving_reasons(starting) == (
        [],
        ["vLLM is still starting: 600 s since the start, no ready line yet"],
    )
    failed, degraded = serving_reasons(replace(starting, start_timeout_s=300))
    assert degraded == [] and failed == [
        "vLLM is still starting: 600 s since the start, no ready line yet (a start may take 300 s)"
    ]


def test_a_restart_behind_ctxmgrs_back_is_degraded_and_its_own_is_a_note(observation: dict[str, Any]) -> None:
    assert restart_reasons(facts(observation)) == ([], [])
    restarted = facts(
        observation, unit=UnitFacts("active", "running", "success", 1, "inv-2", 9_000_000, T0 - 60)
    )
    degraded, notes = restart_reasons(restarted)
    assert notes == [] and degraded == [
        f"systemd restarted vllm-tiny since the last verification: NRestarts 0 -> 1, serving again since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(T0 - 60))}"
    ]
    by_ctxmgr = Revision(2, "vllm-tiny", State.FINAL, UNIT, T0 - 120, 1536, 0.5).to_json()
    ours = replace(restarted, revisions=(*restarted.revisions, by_ctxmgr))
    assert restart_reasons(ours) == ([], ["restarted by ctxmgr since the last verification (revision 2)"])


def test_another_vllm_version_than_the_watched_start_is_degraded() -> None:
    last_start = {"vllm_version": "0.32.0"}
    assert version_reasons("vllm-tiny", "v0.32.0", last_start) == []
    (reason,) = version_reasons("vllm-tiny", "0.33.0", last_start)
    assert reason.startswith("the vLLM version changed since the last start ctxmgr watched: 0.32.0 -> 0.33.0")


def test_vllms_kv_budget_moving_under_the_same_flags_is_degraded(observation: dict[str, Any]) -> None:
    no_plan = StoredPlan.from_json(None)  # margin: DEFAULT_MARGIN_MIN_BYTES (0.5 GiB)
    assert kv_drift_reasons(facts(observation), no_plan, None) == []
    # the other real start's budget (ok_autofit_mml.log): 0.97 GiB
    moved = facts(observation, last_start={**facts(observation).last_start, "available_kv_gib": 0.97})
    assert kv_drift_reasons(moved, no_plan, None) == [
        "memory drifted: vLLM's KV budget is 5.62 GiB per GPU in this process, 0.97 GiB at the last start "
        "ctxmgr watched with the same flags"
    ]
    other_flags = replace(moved, configured_gpu_memory_utilization=0.6)
    assert kv_drift_reasons(other_flags, no_plan, None) == []  # another utilisation: another budget


def test_an_interrupted_change_and_an_edit_outside_ctxmgr_are_degraded(observation: dict[str, Any]) -> None:
    assert revision_reasons(facts(observation)) == []
    (interrupted,) = revision_reasons(facts(observation, in_progress=2))
    assert interrupted.endswith("run `ctxmgr recover --service vllm-tiny`")
    (edited,) = revision_reasons(facts(observation, current_revision=None))
    assert edited == (
        "the unit is none of the revisions ctxmgr installed: it was edited outside ctxmgr "
        "(max_model_len 1024; revision 1 has 1024)"
    )


def test_memory_a_restart_would_not_find_is_degraded() -> None:
    assert margin_reasons([h100_margin()]) == []
    crowded = h100_margin(
        used_by_others_now=12 * GIB, startup_slack_now=H100_TOTAL - 12 * GIB - int(H100_TOTAL * 0.9)
    )
    (reason,) = margin_reasons([crowded])
    assert reason.startswith(
        "GPU 0: a restart would fail vLLM's free-memory check: other processes hold 12.00 GiB"
    )
    tight = h100_margin(kv_spare_bytes=GIB)
    (kv,) = margin_reasons([tight])
    assert "keeps less than the plan's margin beyond one request of max_model_len (20.00 GiB)" in kv


def test_vllms_own_memory_growing_in_the_same_process_is_degraded() -> None:
    g = h100_margin()
    last = {
        "invocation_id": "inv-1",
        "gpus": [{"index": 0, "service_bytes": g.service_bytes - 2 * g.margin_bytes}],
    }
    (grew,) = own_memory_drift([g], last, "inv-1")
    assert grew.startswith("GPU 0: vLLM's own memory grew from") and "same process" in grew
    assert own_memory_drift([g], last, "inv-2") == []  # a new process preallocates anew
    same = {"invocation_id": "inv-1", "gpus": [{"index": 0, "service_bytes": g.service_bytes}]}
    assert own_memory_drift([g], same, "inv-1") == []


def test_the_verdict_and_its_record(observation: dict[str, Any]) -> None:
    ok = decide(facts(observation))
    assert ok.result == OK and ok.reasons == [] and ok.kv_cache_tokens == 5888128
    assert "GPU memory not checked: the vLLM CPU build: its memory is not GPU memory" in ok.notes
    assert record(ok, facts(observation))["verified_revisions"] == [1]
    degraded = decide(facts(observation, in_progress=2))
    assert degraded.result == DEGRADED and degraded.exit_code == 1
    failed_facts = facts(observation, probe={"ok": False, "error": "timeout", "latency_s": 120.0})
    assert record(decide(failed_facts), failed_facts)["verified_revisions"] == []  # failed never verifies


def test_the_default_clock_is_utc() -> None:
    for when in (0.0, 951_782_400.0, T0, 4_102_444_799.9):  # the epoch, 2000-02-29, 2026, 2099-12-31
        assert utc_clock(when) == time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(when))
