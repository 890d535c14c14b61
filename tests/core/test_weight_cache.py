"""A unit whose engine maps a `vllm preload` daemon's weights (--load-format ipc_cache, issue 34 §3).

vLLM 0.33.0's own accounting, read in its wheel: in zero_copy mode (the default) the daemon's weights
are external to the engine (model_loader/weight_cache/ipc_loader.py:L138-L154), and the startup check
asks for ceil(total x utilisation) less them in free memory (v1/worker/utils.py:L716-L772); the daemon's
key (weight_cache/protocol.py:L308-L340) holds the KV dtype, TP/PP/DP, quantization, dtype and rope
parameters, not max_model_len or the utilisation. The planner is pure: GPUs and flags come in as data."""

from __future__ import annotations

from tests.support.paths import REPO
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.weight_cache import key_changes, weight_cache_mode
from vllm_ctxmgr.model_files.load import load_model_facts

MODEL = str(REPO / "examples" / "models" / "llama-3.1-70b")
TOTAL = 80 * GIB
WEIGHTS = 141 * GIB // 4  # bf16 Llama-3.1-70B over TP 4: what the daemon holds per GPU
DAEMON_PID = 4242


def gpus(daemon: bool = True) -> GpuState:
    """Four H100s; where a daemon runs, each holds its rank's weights (another process to NVML)."""
    used = GIB // 2 + (WEIGHTS if daemon else 0)
    procs = (GpuProcess(DAEMON_PID, "python3", WEIGHTS),) if daemon else ()
    return GpuState(
        tuple(
            GpuInfo(
                i,
                "NVIDIA H100 80GB HBM3",
                TOTAL,
                TOTAL - used,
                used,
                compute_capability=(9, 0),
                processes=procs,
            )
            for i in range(4)
        ),
        "nvml",
    )


def plan(*flags: str, target: int = 65_536, daemon: bool = True, concurrency: int = 1) -> Plan:
    args = parse_serve_argv([MODEL, "-tp", "4", "--max-model-len", "8192", *flags])
    options = PlanOptions(target, weights_bytes=141 * GIB, concurrency=concurrency)
    return make_plan(load_model_facts(MODEL), args, gpus(daemon), options)


def test_the_load_format_and_its_mode_are_read_as_vllm_reads_them() -> None:
    assert weight_cache_mode(parse_serve_argv([MODEL, "--load-format", "ipc_cache"])) == "zero_copy"
    copy = [MODEL, "--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "copy"}']
    assert weight_cache_mode(parse_serve_argv(copy)) == "copy"
    assert weight_cache_mode(parse_serve_argv([MODEL, "--load-format", "safetensors"])) is None


def test_the_daemons_weights_are_external_to_the_startup_check_as_vllm_counts_them() -> None:
    mapped = plan("--load-format", "ipc_cache")
    # without the rule the daemon's 35 GiB count as another tenant's and the engine's own weights again:
    # the free-memory check then caps the utilisation near (80 - 35.75) / 80
    disk_beside_daemon = plan()
    assert disk_beside_daemon.gpus[0].max_gpu_memory_utilization < 0.56
    assert mapped.gpus[0].max_gpu_memory_utilization > 0.95  # requested - weights <= free (request_memory)
    assert mapped.feasible and not disk_beside_daemon.feasible
    assert "preload daemon's weights" in mapped.gpus[0].used_by_others.source
    # the KV budget is vLLM's either way: requested less weights and the rest of the non-KV memory
    line = mapped.gpus[0]
    assert line.kv_budget.bytes == (line.requested.bytes or 0) - (line.non_kv.bytes or 0)
    assert any("not in its key" in note for note in mapped.notes)
    # copy mode: the engine clones the weights, nothing is external, the daemon's copy is a tenant's
    copied = plan("--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "copy"}')
    assert copied.gpus[0].max_gpu_memory_utilization < 0.56


def test_an_alternative_that_changes_the_daemons_key_says_the_daemon_must_reload() -> None:
    crowded = plan("--load-format", "ipc_cache", target=131_072, concurrency=8)  # 80 GiB of KV per GPU
    assert not crowded.feasible
    names = {alt.name: alt for alt in crowded.alternatives}
    reload = "the `vllm preload` daemon must be restarted with --kv-cache-dtype first"
    assert reload in names["fp8-kv-cache"].description
    assert "preload" not in names["shorter-context"].description  # max_model_len is not in the key
    before = parse_serve_argv([MODEL, "-tp", "4", "--load-format", "ipc_cache"])
    after = parse_serve_argv([MODEL, "-tp", "8", "--load-format", "ipc_cache", "--max-model-len", "9999"])
    assert key_changes(before, after) == ["--tensor-parallel-size"]
