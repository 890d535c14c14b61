"""core/verdict.py alone: each rule on one record that trips it and one that does not.

The records are what verify.py gathers, built from real values: vLLM's numbers come from a real
vLLM 0.32 CPU start (tests/data/vllm-logs/ok_auto_gmu_0_5.log, read by ctxmgr's own log watcher), the GPU
from an H100 80GB HBM3 as NVML reports it (81559 MiB), revisions from store.Revision.to_json().
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, replace
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.demo import SEED_GPU_COUNT, make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import DATA
from tests.support.seed_gpus import OTHER_PID, SERVICE_PID, TOTAL, VLLM_HOLDS, gpu_state
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.budget import margin_bytes
from vllm_ctxmgr.core.hardware import GIB, GpuProcess
from vllm_ctxmgr.core.plan_record import StoredPlan
from vllm_ctxmgr.core.verdict import (
    DEGRADED,
    FAILED,
    GOOD_STATES,
    OK,
    GpuMargin,
    UnitFacts,
    Verdict,
    Verification,
    VerifyFacts,
    decide,
    kv_drift_reasons,
    margin_reasons,
    own_memory_drift,
    record,
    restart_reasons,
    revision_reasons,
    service_memory,
    serving_reasons,
    utc_clock,
    version_reasons,
)
from vllm_ctxmgr.errors import VerifyExit
from vllm_ctxmgr.monitor.verify import rollback_target
from vllm_ctxmgr.store import GOOD, Revision, State
from vllm_ctxmgr.vllm_log.watcher import observe_start

LOGS = DATA / "vllm-logs"  # the shared real logs, kept in the repo
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


def test_each_verdict_is_its_word_with_verifys_exit_code() -> None:
    """One table for the word and the exit code: --json writes the word, verify exits with VerifyExit."""
    assert {v: v.exit_code for v in Verdict} == {
        OK: VerifyExit.OK, DEGRADED: VerifyExit.DEGRADED, FAILED: VerifyExit.FAILED
    }  # fmt: skip
    assert json.dumps(list(Verdict)) == '["ok", "degraded", "failed"]'
    assert Verification("vllm", FAILED, 1.0).to_json()["exit_code"] == 2


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


def test_the_planned_context_is_the_newest_good_revisions_not_the_served_one(
    observation: dict[str, Any],
) -> None:
    """What the ContextBelowPlanned alert compares the served context with (docs/monitoring): the
    context ctxmgr last put in place, which a failed change rolled back does not move and an edit
    outside ctxmgr does not either."""
    seen = facts(observation)
    assert decide(seen).planned_max_model_len == 1024
    rolled_back = Revision(2, "vllm-tiny", State.ROLLED_BACK, UNIT, T0 - 100, 4096, 0.5).to_json()
    assert decide(replace(seen, revisions=(*seen.revisions, rolled_back))).planned_max_model_len == 1024
    edited = decide(
        replace(seen, current_revision=None, max_model_len=512, probe={**seen.probe, "max_model_len": 512})
    )
    assert (edited.max_model_len, edited.planned_max_model_len) == (512, 1024)
    # never changed by ctxmgr: the unit's own context is the baseline (issue 35: it was left out)
    assert decide(replace(seen, revisions=())).planned_max_model_len == seen.max_model_len


def test_a_service_ctxmgr_never_changed_has_its_units_context_as_the_planned_one(
    observation: dict[str, Any],
) -> None:
    """Issue 35: ctxmgr_verify_planned_max_model_len ("or the baseline") was never written for a
    service ctxmgr had not changed, so CtxmgrContextBelowPlanned could never fire for one."""
    seen = replace(facts(observation), revisions=(), current_revision=None)
    unit_context = seen.max_model_len
    assert unit_context and decide(seen).planned_max_model_len == unit_context
    served_less = replace(seen, probe={**seen.probe, "max_model_len": unit_context // 2})
    verdict = decide(served_less)
    assert verdict.max_model_len == unit_context // 2 < verdict.planned_max_model_len  # the alert's expr
    for unset in (None, -1):  # no --max-model-len, or auto: vLLM's choice is no plan
        assert decide(replace(seen, max_model_len=unset)).planned_max_model_len is None


def test_the_default_clock_is_utc() -> None:
    for when in (0.0, 951_782_400.0, T0, 4_102_444_799.9):  # the epoch, 2000-02-29, 2026, 2099-12-31
        assert utc_clock(when) == time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(when))


# ---------------------------------------------------------------------------------------------
# The same rules on the seeds' GLM-5 service: the planner's own 200K plan (8 x 95.6 GiB, TP 8)


@pytest.fixture(scope="module")
def plan_200k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The planner's plan for 200K tokens on the seeds' machine, as set-context stores it."""
    directory = tmp_path_factory.mktemp("plan")
    unit = directory / "vllm-glm5.service"
    unit.write_text(standin_unit(make_vllm_wrapper(directory), port=8000))
    result = CliRunner().invoke(main, ["plan", "200000", "--unit", str(unit), *offline_gpu_args(), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def make_facts(plan: dict[str, Any], **changes: Any) -> VerifyFacts:
    revisions = (
        Revision(0, "vllm-glm5", "baseline", "/etc/systemd/system/vllm-glm5.service", T0 - 900, 8192, 0.9,
                 action="baseline").to_json(),
        Revision(1, "vllm-glm5", "final", "/etc/systemd/system/vllm-glm5.service", T0 - 600, 200_000, 0.9,
                 previous_max_model_len=8192, verified=True, vllm_version="0.33.0", plan=plan).to_json(),
    )  # fmt: skip
    base = VerifyFacts(
        service="vllm-glm5",
        time=T0,
        unit=UnitFacts("active", "running", "success", 0, "inv-1", 5_000_000, T0 - 500),
        max_model_len=200_000,
        gpu_memory_utilization=0.90,
        configured_gpu_memory_utilization=0.90,
        kv_cache_memory_bytes=None,
        graphs_in_budget=True,
        probe={"ok": True, "error": None, "latency_s": 0.21, "max_model_len": 200_000, "steps": []},
        server_vllm_version="0.33.0",
        observation={
            "vllm_version": "0.33.0",
            "available_kv_gib": 27.88,
            "kv_cache_tokens": 298_880,
            "ready": True,
        },
        cache_config={"num_gpu_blocks": "4670", "block_size": "64"},
        last_start={
            "vllm_version": "0.33.0",
            "available_kv_gib": 27.88,
            "num_gpu_blocks": 4670,
            "configured_max_model_len": 200_000,
            "configured_gpu_memory_utilization": 0.9,
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
        gpus=gpu_state(VLLM_HOLDS),
        gpu_note=None,
        service_pids=(SERVICE_PID,),
    )
    return replace(base, **changes)


def test_nothing_moved_is_ok_with_the_margin_left(plan_200k: dict[str, Any]) -> None:
    result = decide(make_facts(plan_200k))
    assert result.result == OK and result.exit_code == 0, result.reasons
    assert result.reasons == []
    assert len(result.gpus) == SEED_GPU_COUNT
    line = result.gpus[0]
    # a restart would find total - CUDA context estimate - ceil(total x 0.90) free beyond what vLLM asks
    overhead = plan_200k["gpus"][0]["startup_overhead"]["bytes"]
    assert line["startup_slack_now"] == TOTAL - overhead - math.ceil(TOTAL * 0.90)
    assert line["used_by_others_now"] == 0 and line["service_bytes"] == VLLM_HOLDS
    # the KV budget vLLM logged against one request of 200K tokens (the plan's figure)
    assert line["kv_needed_bytes"] == plan_200k["gpus"][0]["kv_needed"]["bytes"]
    assert line["kv_spare_bytes"] == int(27.88 * GIB) - line["kv_needed_bytes"]
    assert result.margin_bytes == min(line["startup_slack_now"], line["kv_spare_bytes"])
    assert result.kv_cache_tokens == 4670 * 64  # vLLM's num_gpu_blocks x block_size


def test_another_process_taking_the_memory_a_restart_needs_is_degraded(plan_200k: dict[str, Any]) -> None:
    # 10 GiB beside a vLLM that holds 2 GiB less than its whole budget (NVML never reports more used than
    # the GPU has: with the full budget held, such a neighbour could not start)
    result = decide(make_facts(plan_200k, gpus=gpu_state(VLLM_HOLDS - 2 * GIB, others=10 * GIB)))
    assert result.result == DEGRADED and result.exit_code == 1
    assert result.margin_bytes is not None and result.margin_bytes < 0
    assert len(result.reasons) == SEED_GPU_COUNT  # every GPU says so
    assert "GPU 0: a restart would fail vLLM's free-memory check" in result.reasons[0]
    assert "other processes hold 10.00 GiB (0.00 GiB when planned)" in result.reasons[0]


def test_a_margin_eaten_away_is_degraded_before_a_restart_would_fail(plan_200k: dict[str, Any]) -> None:
    margin = plan_200k["gpus"][0]["margin"]["bytes"]
    slack = decide(make_facts(plan_200k)).gpus[0]["startup_slack_now"]
    others = slack - margin // 2  # leaves half the margin
    result = decide(make_facts(plan_200k, gpus=gpu_state(VLLM_HOLDS, others=others)))
    assert result.result == DEGRADED
    assert "the margin is gone" in result.reasons[0]
    assert 0 < result.margin_bytes < margin  # type: ignore[operator]
    # a small neighbour (well inside the margin) is no reason
    small = decide(make_facts(plan_200k, gpus=gpu_state(VLLM_HOLDS, others=margin // 4)))
    assert small.result == OK, small.reasons


def test_a_kv_budget_without_the_margin_is_degraded(plan_200k: dict[str, Any]) -> None:
    needed = plan_200k["gpus"][0]["kv_needed"]["bytes"]
    tight = round((needed + 256 * (1 << 20)) / GIB, 2)  # 256 MiB beyond one request: less than 2%
    observation = {"vllm_version": "0.33.0", "available_kv_gib": tight}
    result = decide(make_facts(plan_200k, observation=observation, cache_config={}, last_start=None))
    assert result.result == DEGRADED
    assert "keeps less than the plan's margin beyond one request of max_model_len" in result.reasons[0]


@pytest.mark.parametrize(
    ("unit", "last_extra", "revision_time", "expected", "words"),
    [
        (UnitFacts("active", "running", "success", 1, "inv-2", 9, T0 - 5), {}, None, DEGRADED,
         "systemd restarted vllm-glm5 since the last verification: NRestarts 0 -> 1"),
        (UnitFacts("active", "running", "success", 0, "inv-2", 9, T0 - 5), {}, None, DEGRADED,
         "was restarted since the last verification, not by ctxmgr"),
        (UnitFacts("active", "running", "success", 0, "inv-2", 9, T0 - 5), {}, T0 - 60, OK,
         "restarted by ctxmgr since the last verification (revision 1)"),
        (UnitFacts("active", "running", "success", 0, "inv-2", 9, T0 - 5), {"active_state": "failed"}, None,
         OK, "started again since the last verification found it failed"),
    ],
)  # fmt: skip
def test_restarts_since_the_last_verification(
    plan_200k: dict[str, Any], unit: UnitFacts, last_extra: dict[str, Any], revision_time: float | None,
    expected: str, words: str,
) -> None:  # fmt: skip
    facts = make_facts(plan_200k, unit=unit)
    last = {**(facts.last_verify or {}), **last_extra}
    revisions = facts.revisions
    if revision_time is not None:
        revisions = (revisions[0], {**revisions[1], "created": revision_time})
    result = decide(replace(facts, last_verify=last, revisions=revisions))
    assert result.result == expected
    assert any(words in text for text in [*result.reasons, *result.notes]), (result.reasons, result.notes)


def test_a_new_vllm_version_and_a_smaller_kv_cache_than_the_last_start_are_degraded(
    plan_200k: dict[str, Any],
) -> None:
    # 770 blocks x 6,409,728 B = 4.60 GiB less than the last start: beyond the plan's 3.99 GiB margin
    blocks = {"num_gpu_blocks": "3900", "block_size": "64"}
    facts = make_facts(plan_200k, server_vllm_version="0.34.1", cache_config=blocks)
    result = decide(facts)
    assert result.result == DEGRADED
    assert (
        "the vLLM version changed since the last start ctxmgr watched: 0.33.0 -> 0.34.1" in result.reasons[0]
    )
    assert "memory drifted: vLLM has 3,900 KV cache blocks in this process, 4,670 at" in result.reasons[1]


def test_not_active_or_a_failed_probe_is_failed(plan_200k: dict[str, Any]) -> None:
    stopped = make_facts(
        plan_200k, unit=UnitFacts("inactive", "dead", "success", 0, "", 0, None), probe=None,
        observation=None, cache_config={}, server_vllm_version=None, gpus=gpu_state(0),
    )  # fmt: skip
    result = decide(stopped)
    assert result.result == FAILED and result.exit_code == 2
    assert result.reasons[0] == "vllm-glm5 is not active: inactive (dead)"
    error = "/v1/models: vLLM reports max_model_len=8192 for glm-5, expected 200000"
    failed_probe = {"ok": False, "error": error, "latency_s": 0.05, "max_model_len": 8192, "steps": []}
    result = decide(make_facts(plan_200k, probe=failed_probe))
    assert result.result == FAILED
    assert result.reasons == [f"the probe failed: {failed_probe['error']}"]
    assert result.max_model_len == 8192  # what vLLM reports, not what the unit says


def test_a_vllm_still_loading_is_degraded_until_the_start_timeout(plan_200k: dict[str, Any]) -> None:
    refused = {
        "ok": False,
        "error": "/health: cannot connect: Connection refused",
        "latency_s": 0.01,
        "steps": [],
    }
    loading = {"vllm_version": "0.33.0", "model_loading_gib": 50.84, "ready": False}
    unit = UnitFacts("active", "running", "success", 0, "inv-2", 9, T0 - 600, started_at=T0 - 600)
    facts = make_facts(plan_200k, unit=unit, probe=refused, observation=loading, cache_config={})
    result = decide(facts)
    assert result.result == DEGRADED  # not failed: --on-failure must not restart a start in progress
    assert "vLLM is still starting: 600 s since the start, no ready line yet" in result.reasons
    late = decide(replace(facts, start_timeout_s=300))
    assert late.result == FAILED
    assert "(a start may take 300 s)" in late.reasons[0]
    # a start that logged its failure is failed at once
    crashed = decide(replace(facts, observation={**loading, "failure": "cuda_oom"}))
    assert crashed.result == FAILED and crashed.reasons[0].startswith("the probe failed: /health")


def test_a_unit_edited_outside_ctxmgr_and_an_interrupted_change_are_degraded(
    plan_200k: dict[str, Any],
) -> None:
    result = decide(make_facts(plan_200k, current_revision=None, in_progress=2))
    assert result.result == DEGRADED
    assert "revision 2 was left in progress by an interrupted ctxmgr run" in result.reasons[0]
    assert "the unit is none of the revisions ctxmgr installed" in result.reasons[1]
    assert any("not checked against a plan" in note for note in result.notes)


def test_vllms_own_memory_growing_on_the_glm5_plan_is_degraded(plan_200k: dict[str, Any]) -> None:
    facts = make_facts(plan_200k)
    grown = plan_200k["gpus"][0]["margin"]["bytes"] + GIB  # more than the plan's margin
    last = {**(facts.last_verify or {}), "gpus": [{"index": 0, "service_bytes": VLLM_HOLDS - grown}]}
    result = decide(replace(facts, last_verify=last))
    assert result.result == DEGRADED
    before, now = (VLLM_HOLDS - grown) / GIB, VLLM_HOLDS / GIB
    assert result.reasons == [
        f"GPU 0: vLLM's own memory grew from {before:.2f} GiB to {now:.2f} GiB since the last verification "
        "of the same process"
    ]


def test_service_memory_tells_the_service_apart_by_pid() -> None:
    info = gpu_state(VLLM_HOLDS, others=3 * GIB).gpus[0]
    assert service_memory(info, [SERVICE_PID], True, 0) == (3 * GIB, VLLM_HOLDS, "service excluded")
    unknown = replace(
        info, processes=(GpuProcess(SERVICE_PID, "vllm", None), GpuProcess(OTHER_PID, "x", GIB))
    )
    assert service_memory(unknown, [SERVICE_PID], True, 0) == (GIB, None, "other processes")
    # a container: none of the service's processes is visible; vLLM holds about what it asked for
    hidden = replace(info, processes=())
    others, own, source = service_memory(hidden, [], True, VLLM_HOLDS)
    assert (others, own) == (3 * GIB, None) and source.startswith("estimate")


def test_record_keeps_the_revisions_that_verified() -> None:
    facts = make_facts({}, last_verify={"verified_revisions": [0]}, current_revision=3)
    ok = decide(replace(facts, gpus=None, gpu_note="no NVML"))
    assert record(ok, facts)["verified_revisions"] == [0, 3]
    failed = decide(replace(facts, probe={"ok": False, "error": "x", "latency_s": 0, "steps": []}, gpus=None))
    assert record(failed, facts)["verified_revisions"] == [0]


def test_rollback_target_is_the_newest_other_revision_that_verified() -> None:
    def rev(number: int, state: str, verified: bool = False) -> Revision:
        return Revision(number, "s", state, "/u", T0, 1000 * (number + 1), verified=verified)

    units = {0: b"a", 1: b"b", 2: b"c", 3: b"b", 4: b"d"}
    revisions = [rev(0, "baseline"), rev(1, "final", True), rev(2, "final"), rev(3, "final", True),
                 rev(4, "rolled-back")]  # fmt: skip

    # revision 2 passed a scheduled verification; 3 installs the same unit as 1 and is current
    def installed(r: Revision) -> bool:
        return units[r.number] == b"b"

    target = rollback_target(revisions, [2], current=3, installed=installed)
    assert target is not None and target.number == 2
    target = rollback_target(revisions, [], current=3, installed=installed)
    assert target is not None and target.number == 0  # the unit as ctxmgr found it
