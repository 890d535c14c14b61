"""vLLM's KV-budget arithmetic: what vLLM asks of a GPU, the budget at another utilisation, the margin.

Its own module because two sides need the same rules: the planner (core/plan.py, core/alternatives.py,
core/calibration.py) makes a plan with them, and the readers of a stored plan (core/plan_record.py,
core.verdict, deploy, verify) recheck a running service against it; the readers need no planner, and
plan_record cannot import plan.py, which imports it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.layout import KVCacheLayout
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, VllmVersion, parse_vllm_version, rule
from vllm_ctxmgr.errors import UsageError

MIB = 1 << 20
DEFAULT_MARGIN_FRACTION = 0.02
DEFAULT_MARGIN_MIN_BYTES = 512 * MIB


def default_gpu_memory_utilization(vllm_version: VllmVersion) -> float:
    """CacheConfig's default (rule default_gpu_memory_utilization: 0.9, 0.92 from 0.20.0)."""
    return rule("default_gpu_memory_utilization", vllm_version)


def cuda_graphs_in_budget(vllm_version: VllmVersion, args: ServeArgs) -> bool:
    """Is the CUDA-graph estimate subtracted from the KV budget (rule cudagraph_estimate_in_budget)?

    Never before 0.18; with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 in 0.18-0.19; unless =0 from 0.20.
    """
    when = rule("cudagraph_estimate_in_budget", vllm_version)
    if args.enforce_eager or when == "never":
        return False
    env = args.env.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1" if when == "default" else "0")
    return env not in ("0", "false", "False", "")


def requested_bytes(total_bytes: int, utilization: float) -> int:
    """What vLLM asks of a GPU at `utilization`: ceil(total x u) (gpu_worker.determine_available_memory)."""
    return math.ceil(total_bytes * utilization)


def margin_bytes(
    total_bytes: int,
    fraction: float = DEFAULT_MARGIN_FRACTION,
    min_bytes: int = DEFAULT_MARGIN_MIN_BYTES,
) -> int:
    """The KV budget a plan keeps spare on a GPU beyond one request: max(512 MiB, 2% of its memory).

    One rule for the planner and for `ctxmgr verify`, which checks a running service against the
    margin its plan kept; core/plan.py's docstring says why 2% and 512 MiB.
    """
    return max(min_bytes, int(total_bytes * fraction))


def kv_budget_at_utilization(
    observed_budget: int, observed_requested: int, total_bytes: int, utilization: float
) -> int:
    """The KV budget at another utilisation u: observed budget + ceil(total x u) - requested then.

    vLLM's non-KV memory (weights, activation peak, non-torch, CUDA graphs) does not depend on the
    utilisation, so the budget moves byte for byte with what vLLM asks for. `observed_requested` is
    ceil(total x u_observed) of the start that logged (or planned) `observed_budget`.
    """
    return observed_budget + requested_bytes(total_bytes, utilization) - observed_requested


def kv_needed_bytes(layout: KVCacheLayout, target: int, stage: int, requests: int) -> int:
    """What vLLM's check needs on a worker of `stage`: `requests` x one request (+ the null block, 0.29+)."""
    return layout.check_needed_bytes(target, stage, requests) + layout.null_block_reserve(stage)


CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def explicit_kv_cache_bytes(
    args: ServeArgs, is_cpu: bool, vllm_version: VllmVersion
) -> tuple[int | None, str]:
    """The exact KV budget vLLM applies, and where it comes from; (None, "") where vLLM sizes it itself.

    The one home of this rule (rule cpu_kvcache_space). On a GPU it is --kv-cache-memory-bytes. On the
    CPU build, VLLM_CPU_KVCACHE_SPACE (whole GiB, read with int()):
    - "env_only": the CPU worker's budget is cpu_kvcache_space_bytes, which is the variable and nothing
      else (platforms/cpu.py get_device_total_memory); --kv-cache-memory-bytes is never read there. An
      unset variable is a default this function does not decide (4 GiB, later half of a NUMA node);
    - "env_overrides_flag": set and not empty, it replaces --kv-cache-memory-bytes ("Legacy setting" in
      platforms/cpu.py check_and_update_config); empty or unset, the flag (or the utilisation) decides.
    "0" is 0 bytes in both: vLLM then fails with "No available memory for the cache blocks".
    """
    space = args.env.get(CPU_KVCACHE_SPACE_ENV)
    if is_cpu and space is not None:
        applies = space != "" or rule("cpu_kvcache_space", vllm_version) == "env_only"
        if applies:
            try:
                gib = int(space)
            except ValueError:
                raise UsageError(
                    f"{CPU_KVCACHE_SPACE_ENV}={space!r} is not a whole number of GiB (vLLM reads it with "
                    "int())"
                ) from None
            if gib < 0:
                raise UsageError(f"{CPU_KVCACHE_SPACE_ENV}={space!r} is negative")
            return gib * GIB, CPU_KVCACHE_SPACE_ENV
    if is_cpu and rule("cpu_kvcache_space", vllm_version) == "env_only":
        return None, ""
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    return None, ""


def explicit_budget(args: ServeArgs, platform: Platform, vllm_version: VllmVersion) -> tuple[int | None, str]:
    """explicit_kv_cache_bytes on the platform the plan is for."""
    return explicit_kv_cache_bytes(args, platform.is_cpu, vllm_version)


def is_cpu_deployment(args: ServeArgs) -> bool:
    """The vLLM CPU build: its KV space comes from VLLM_CPU_KVCACHE_SPACE or node memory, not a GPU."""
    return (
        CPU_KVCACHE_SPACE_ENV in args.env
        or args.env.get("CTXMGR_PLATFORM") == "cpu"
        or "cpu" in (args.vllm_version or "")
    )


def effective_args(args: ServeArgs) -> ServeArgs:
    """The unit's arguments with the KV budget vLLM really applies (explicit_kv_cache_bytes: on the CPU
    build VLLM_CPU_KVCACHE_SPACE, by the rules of the unit's own version)."""
    if not is_cpu_deployment(args):
        return args
    version = parse_vllm_version(args.vllm_version) or NEWEST_VLLM
    explicit, _source = explicit_kv_cache_bytes(args, True, version)
    return replace(args, kv_cache_memory_bytes=explicit)
