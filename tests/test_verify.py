"""verify: the pure decision on real plans and GPU figures, then end to end under a private systemd.

The plan is the planner's own output for the seeds' GLM-5 service (8 x 95.6 GiB, TP 8); GPU memory
"now" is given the way `ctxmgr gpus --json` reports it, since this machine has no GPU.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import requests
from click.testing import CliRunner

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.demo import (
    SEED_GPU_COUNT,
    SEED_GPU_GIB,
    free_port,
    make_vllm_wrapper,
    offline_gpu_args,
    standin_unit,
)
from tests.support.sandbox import Sandbox
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState
from vllm_ctxmgr.core.verdict import (
    DEGRADED,
    FAILED,
    OK,
    UnitFacts,
    VerifyFacts,
    decide,
    record,
    service_memory,
)
from vllm_ctxmgr.store import Revision
from vllm_ctxmgr.verify import rollback_target

REPO = Path(__file__).resolve().parent.parent
TOTAL = int(SEED_GPU_GIB * GIB)  # what `--gpu-memory 95.6GiB` gives the planner
SERVICE_PID = 4242
OTHER_PID = 5151
T0 = 1_790_000_000.0


# ---------------------------------------------------------------------------------------------
# The pure decision


@pytest.fixture(scope="module")
def plan_200k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The planner's plan for 200K tokens on the seeds' machine, as set-context stores it."""
    directory = tmp_path_factory.mktemp("plan")
    unit = directory / "vllm-glm5.service"
    unit.write_text(standin_unit(make_vllm_wrapper(directory), port=8000))
    result = CliRunner().invoke(main, ["plan", "200000", "--unit", str(unit), *offline_gpu_args(), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def gpu_state(service_bytes: int | None, others: int = 0, count: int = SEED_GPU_COUNT) -> GpuState:
    gpus = []
    for index in range(count):
        processes = [GpuProcess(SERVICE_PID, "vllm serve", service_bytes)]
        if others:
            processes.append(GpuProcess(OTHER_PID, "python train.py", others))
        used = (service_bytes or 0) + others
        gpus.append(
            GpuInfo(index, "NVIDIA RTX PRO 6000", TOTAL, TOTAL - used, used, processes=tuple(processes))
        )
    return GpuState(tuple(gpus), "test")


VLLM_HOLDS = math.ceil(TOTAL * 0.90) + GIB  # what vLLM at 0.90 holds: the request plus its CUDA context


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
    result = decide(make_facts(plan_200k, gpus=gpu_state(VLLM_HOLDS, others=10 * GIB)))
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
    blocks = {"num_gpu_blocks": "4100", "block_size": "64"}
    facts = make_facts(plan_200k, server_vllm_version="0.34.1", cache_config=blocks)
    result = decide(facts)
    assert result.result == DEGRADED
    assert (
        "the vLLM version changed since the last start ctxmgr watched: 0.33.0 -> 0.34.1" in result.reasons[0]
    )
    assert "memory drifted: vLLM has 4,100 KV cache blocks in this process, 4,670 at" in result.reasons[1]


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


def test_vllms_own_memory_growing_in_the_same_process_is_degraded(plan_200k: dict[str, Any]) -> None:
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


# ---------------------------------------------------------------------------------------------
# End to end: a private systemd, the stand-in, real HTTP and journald


def ctxmgr(sandbox: Sandbox, state: Path, *args: str, timeout: float = 120) -> tuple[int, dict, str]:
    run = run_ctxmgr(sandbox.pid, state, *args, timeout=timeout)
    return run.code, run.data, run.stderr + run.stdout


@pytest.fixture
def workdir() -> Path:
    path = REPO / ".cache" / "it" / f"verify-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def start_service(sandbox: Sandbox, install_unit, workdir: Path, name: str) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    from vllm_ctxmgr.probe import wait_until_serving

    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return unit, port


def wait_serving_again(sandbox: Sandbox, unit: str, port: int, restarts: int) -> None:
    from vllm_ctxmgr.probe import wait_until_serving

    deadline = time.monotonic() + 60
    while int(sandbox.systemd.show(unit, "NRestarts")["NRestarts"]) < restarts:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert wait_until_serving(f"http://127.0.0.1:{port}", deadline)


def gpus_file(path: Path, service_pids: list[int], others: int) -> str:
    """What `ctxmgr gpus --json` prints on the seeds' machine: vLLM on every GPU, maybe a neighbour."""
    state = gpu_state(None, others=others)
    data = state.to_json()
    for gpu in data["gpus"]:
        gpu["processes"] = [{"pid": pid, "name": "vllm", "used_bytes": VLLM_HOLDS // len(service_pids)}
                            for pid in service_pids]  # fmt: skip
        if others:
            gpu["processes"].append({"pid": OTHER_PID, "name": "python train.py", "used_bytes": others})
        gpu["used_bytes"] = VLLM_HOLDS + others
        gpu["free_bytes"] = gpu["total_bytes"] - gpu["used_bytes"]
    path.write_text(json.dumps(data))
    return str(path)


def test_verify_turns_failed_when_the_service_is_stopped_behind_its_back(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    name = "vllm-verify-stop"
    unit, _ = start_service(sandbox, install_unit, workdir, name)
    state, prom = workdir / "state", workdir / f"{name}.prom"
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--textfile", str(prom), "--json")
    assert code == 0, out
    assert data["result"] == "ok" and data["probe_ok"] is True and data["max_model_len"] == 8192
    assert data["kv_cache_tokens"] > 0 and data["vllm_version"] == "0.33.0"
    assert any("first verification" in note for note in data["notes"])

    # a change in progress holds the service's lock: verify stays out of its way
    from vllm_ctxmgr.store import ServiceStore

    with ServiceStore(state, name).lock():
        code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--textfile", str(prom))
    assert code == 4 and "is locked by another ctxmgr run" in out, out

    sandbox.systemd.stop(unit)
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--textfile", str(prom))
    assert code == 2, out
    assert f"{name}: failed" in out and f"failed: {name} is not active: inactive (dead)" in out
    samples = {
        (s.name, s.labels.get("result")): s.value
        for family in text_string_to_metric_families(prom.read_text())
        for s in family.samples
    }
    assert samples[("ctxmgr_verify_success", None)] == 0
    assert samples[("ctxmgr_verify_result", "failed")] == 1 and samples[("ctxmgr_verify_result", "ok")] == 0
    assert ("ctxmgr_verify_probe_latency_seconds", None) not in samples  # no probe ran


def test_verify_turns_degraded_when_the_margin_is_taken_or_systemd_restarted_it(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    name = "vllm-verify-margin"
    unit, port = start_service(sandbox, install_unit, workdir, name)
    state = workdir / "state"
    code, data, out = ctxmgr(sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(),
                             "--yes", "--json")  # fmt: skip
    assert code == 0 and data["result"] == "applied", out
    pids = sandbox.systemd.unit_processes(unit)
    alone = gpus_file(workdir / "gpus-alone.json", pids, others=0)
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--gpus-from", alone, "--json")
    assert code == 0, out
    assert data["result"] == "ok" and data["max_model_len"] == 200_000 and data["revision"] == 1
    assert data["margin_bytes"] > 0 and data["gpus"][0]["used_by_others_source"] == "service excluded"

    # a training job takes 10 GiB of every GPU: vLLM still serves, its next start would not
    crowded = gpus_file(workdir / "gpus-crowded.json", pids, others=10 * GIB)
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--gpus-from", crowded, "--json")
    assert code == 1, out
    assert data["result"] == "degraded" and data["margin_bytes"] < 0
    assert "GPU 0: a restart would fail vLLM's free-memory check" in data["reasons"][0]
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200

    # vLLM dies and systemd brings it back by itself: serving, but degraded once
    sandbox.systemd.systemctl("kill", "--signal=KILL", unit)
    wait_serving_again(sandbox, unit, port, restarts=1)
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--json")
    assert code == 1, out
    assert (
        "systemd restarted vllm-verify-margin since the last verification: NRestarts 0 -> 1"
        in data["reasons"][0]
    )
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--json")
    assert code == 0 and data["result"] == "ok", out


def test_a_failed_verification_restarts_or_rolls_back_to_the_last_revision_that_verified(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    name = "vllm-verify-act"
    unit, port = start_service(sandbox, install_unit, workdir, name)
    state = workdir / "state"
    code, data, out = ctxmgr(sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(),
                             "--yes", "--json")  # fmt: skip
    assert code == 0, out

    sandbox.systemd.stop(unit)
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--on-failure", "restart", "--json")
    assert code == 2, out  # the verification itself failed; the action is reported with it
    assert data["action"]["kind"] == "restart" and data["action"]["result"] == "serving", data["action"]
    assert sandbox.systemd.is_active(unit)
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 200_000

    sandbox.systemd.stop(unit)
    code, data, out = ctxmgr(
        sandbox, state, "verify", "--service", name, "--on-failure", "rollback", "--json"
    )
    assert code == 2, out
    assert data["action"]["kind"] == "rollback" and data["action"]["to"] == 0, data["action"]
    assert data["action"]["result"] == "applied"
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 8192

    # ctxmgr's own restarts are not held against the service
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--json")
    assert code == 0 and data["result"] == "ok", out
    assert data["revision"] == 2  # the rollback's revision: it installs the baseline's unit
