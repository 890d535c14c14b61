"""The CPU build's KV budget: one rule (core.budget.explicit_kv_cache_bytes), tested per version.

What vLLM does, read in each release's wheel:
- 0.10.1 .. 0.31.0 (rule cpu_kvcache_space = env_only): platforms/cpu.py sets
  cache_config.cpu_kvcache_space_bytes from VLLM_CPU_KVCACHE_SPACE alone, and the CPU worker's
  determine_available_memory returns it: --kv-cache-memory-bytes is never read on the CPU;
- 0.32.0 (the vllm-cpu build) and 0.33.0 (env_overrides_flag): check_and_update_config's "Legacy setting"
  replaces cache_config.kv_cache_memory_bytes with int(VLLM_CPU_KVCACHE_SPACE) GiB when the variable is
  set and not empty; empty or unset, the flag decides.
Before, the planner let the environment win while the observation record let the flag win on 0.32.
"""

from __future__ import annotations

import pytest

from vllm_ctxmgr.core.budget import effective_args, explicit_kv_cache_bytes
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.plan import PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import UsageError

FLAG = 3 * GIB // 2  # --kv-cache-memory-bytes 1.5 GiB
TINY = ModelFacts(
    "tiny", "hf", "llama", ("LlamaForCausalLM",), 16, (LayerFacts(LayerKind.FULL, 4, 64),) * 4, "float32"
)


def cpu_args(version: str, space: str | None, flag: int | None = FLAG) -> ServeArgs:
    env = {} if space is None else {"VLLM_CPU_KVCACHE_SPACE": space}
    return ServeArgs("tiny", dtype="float32", kv_cache_memory_bytes=flag, env=env, vllm_version=version)


@pytest.mark.parametrize(
    ("version", "space", "expected"),
    [
        # env_only: the variable, whatever the flag says; no variable: not decided here (vLLM's default)
        ("0.31.0+cpu", "2", (2 * GIB, "VLLM_CPU_KVCACHE_SPACE")),
        ("0.31.0+cpu", None, (None, "")),
        ("0.10.1+cpu", "1", (1 * GIB, "VLLM_CPU_KVCACHE_SPACE")),
        # env_overrides_flag: the variable when set and not empty, else the flag
        ("0.32.0+cpu", "2", (2 * GIB, "VLLM_CPU_KVCACHE_SPACE")),
        ("0.32.0+cpu", "", (FLAG, "--kv-cache-memory-bytes")),
        ("0.32.0+cpu", None, (FLAG, "--kv-cache-memory-bytes")),
        ("0.33.0+cpu", "2", (2 * GIB, "VLLM_CPU_KVCACHE_SPACE")),
        ("0.33.0+cpu", None, (FLAG, "--kv-cache-memory-bytes")),
        # "0" is 0 bytes in every version: vLLM then fails ("No available memory for the cache blocks")
        ("0.32.0+cpu", "0", (0, "VLLM_CPU_KVCACHE_SPACE")),
    ],
)
def test_the_kv_budget_the_cpu_build_applies_per_version(
    version: str, space: str | None, expected: tuple[int | None, str]
) -> None:
    args = cpu_args(version, space)
    parsed = tuple(int(p) for p in version.split("+")[0].split("."))
    assert explicit_kv_cache_bytes(args, True, parsed) == expected
    # the observation record and the planner read the same rule
    assert effective_args(args).kv_cache_memory_bytes == expected[0]


@pytest.mark.parametrize("version", ["0.31.0+cpu", "0.32.0+cpu", "0.33.0+cpu"])
def test_the_plan_sizes_by_the_same_budget_the_record_keeps(version: str) -> None:
    args = cpu_args(version, "2")
    parsed = tuple(int(p) for p in version.split("+")[0].split("."))
    plan = make_plan(
        TINY, args, None, PlanOptions(4096, derived_max_model_len=4096, cpu=True, vllm_version=parsed)
    )
    assert plan.gpus == () and plan.feasible
    per_block = plan.to_json()["layout"]["bytes_per_block"]
    # the pool is what 2 GiB (the variable) holds, not 1.5 GiB (the flag)
    assert plan.capacity[0].num_gpu_blocks == 2 * GIB // per_block != FLAG // per_block
    assert effective_args(args).kv_cache_memory_bytes == 2 * GIB


def test_a_gpu_ignores_the_cpu_variable() -> None:
    args = cpu_args("0.33.0", "2")
    assert explicit_kv_cache_bytes(args, False, (0, 33, 0)) == (FLAG, "--kv-cache-memory-bytes")


@pytest.mark.parametrize(("space", "match"), [("two", "not a whole number of GiB"), ("-1", "is negative")])
def test_a_value_vllm_cannot_read_is_refused(space: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        explicit_kv_cache_bytes(cpu_args("0.33.0+cpu", space), True, (0, 33, 0))
