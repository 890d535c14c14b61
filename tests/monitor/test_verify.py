"""verify end to end under a private systemd: the stand-in, real HTTP and journald (the pure decision
is tested in test_verdict.py).

GPU memory "now" is given the way `ctxmgr gpus --json` reports it, since this machine has no GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from tests.support.cli import ctxmgr_said as ctxmgr
from tests.support.demo import (
    SEED_GPU_COUNT,
    SEED_WEIGHTS_GIB_PER_GPU,
    make_vllm_wrapper,
    offline_gpu_args,
    standin_unit,
)
from tests.support.sandbox import Sandbox
from tests.support.seed_gpus import OTHER_PID, VLLM_HOLDS, gpu_state
from tests.support.standin import free_port
from vllm_ctxmgr.core.hardware import GIB

T0 = 1_790_000_000.0


# ---------------------------------------------------------------------------------------------
# End to end: a private systemd, the stand-in, real HTTP and journald


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
        # vLLM holds its budget, or what the neighbour left of it: NVML never reports more used than the
        # GPU has (ctxmgr refuses a negative free figure)
        holds = min(VLLM_HOLDS, gpu["total_bytes"] - others)
        gpu["processes"] = [{"pid": pid, "name": "vllm", "used_bytes": holds // len(service_pids)}
                            for pid in service_pids]  # fmt: skip
        if others:
            gpu["processes"].append({"pid": OTHER_PID, "name": "python train.py", "used_bytes": others})
        gpu["used_bytes"] = holds + others
        gpu["free_bytes"] = gpu["total_bytes"] - gpu["used_bytes"]
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.systemd247
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


def test_a_vllm_upgrade_is_answered_by_plan_before_it_and_reported_by_verify_after_it(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 34 section 4: vLLM 0.19 -> 0.33 puts CUDA graphs into the KV budget (0.20), so the unit's
    0.90 of each GPU gets a smaller pool: `plan --vllm-version` says so first, verify after the restart."""
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_ctxmgr.probe import wait_until_serving

    name, port = "vllm-verify-upgrade", free_port()
    wrapper = make_vllm_wrapper(workdir)

    def install(release: str) -> str:
        env = {"CTXMGR_STANDIN_VLLM_VERSION": release}
        return install_unit(f"{name}.service", standin_unit(wrapper, port=port, environment=env))

    unit = install("0.19.0")
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    state = workdir / "state"
    code, data, out = ctxmgr(sandbox, state, "observe", "--service", name, "--json")
    assert code == 0, out
    pids = sandbox.systemd.unit_processes(unit)
    gpus = gpus_file(workdir / "gpus-upgrade.json", pids, others=0)

    # before the upgrade: the same unit under 0.33.0's rules
    weights = ["--weights-bytes", f"{SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT:.2f}GiB"]  # as the log says
    code, data, out = ctxmgr(sandbox, state, "plan", "--service", name, "--vllm-version", "0.33.0",
                             "--gpus-from", gpus, *weights, "--json")  # fmt: skip
    assert code == 0, out
    ahead = data["vllm_upgrade"]
    assert (ahead["from_vllm_version"], ahead["to_vllm_version"]) == ("0.19.0", "0.33.0")
    assert ahead["kv_cache_tokens_after"] < ahead["kv_cache_tokens_before"] and ahead["fits_after"], ahead
    code, _, out = ctxmgr(sandbox, state, "plan", "--service", name, "--vllm-version", "0.33.0",
                          "--gpus-from", gpus, *weights)  # fmt: skip
    assert code == 0 and "upgrade: vLLM 0.19.0 -> 0.33.0: KV cache size " in out, out

    # the upgrade: the unit's vLLM is 0.33.0 from its next start on
    install("0.33.0")
    sandbox.systemd.stop(unit)
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    gpus = gpus_file(workdir / "gpus-upgraded.json", sandbox.systemd.unit_processes(unit), others=0)
    prom = workdir / f"{name}.prom"
    code, data, out = ctxmgr(sandbox, state, "verify", "--service", name, "--gpus-from", gpus,
                             "--textfile", str(prom), "--json")  # fmt: skip
    assert code == 1 and data["result"] == "degraded", out
    moved = data["vllm_upgrade"]
    assert (moved["from_vllm_version"], moved["to_vllm_version"]) == ("0.19.0", "0.33.0")
    assert moved["kv_cache_tokens_after"] < moved["kv_cache_tokens_before"] and moved["fits_after"], moved
    reasons = data["reasons"]
    assert any(r.startswith("vLLM 0.19.0 -> 0.33.0: KV cache size ") for r in reasons), reasons
    samples = {s.name: s.value for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    assert samples["ctxmgr_verify_vllm_upgrade_kv_cache_tokens_ratio"] == moved["kv_cache_tokens_ratio"]
    assert samples["ctxmgr_verify_vllm_upgrade_context_fits"] == 1
    code, _, out = ctxmgr(sandbox, state, "verify", "--service", name, "--gpus-from", gpus)
    assert code == 1 and "degraded: vLLM 0.19.0 -> 0.33.0: KV cache size" in out, out
