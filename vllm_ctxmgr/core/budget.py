"""vLLM's KV-budget arithmetic: what vLLM asks of a GPU, the budget at another utilisation, the margin.

Its own module because two sides need the same rules: the planner (core/plan.py, core/alternatives.py,
core/calibration.py) makes a plan with them, and the readers of a stored plan (core/plan_record.py,
core.verdict, deploy, verify) recheck a running service against it; the readers need no planner, and
plan_record cannot import plan.py, which imports it.
"""

from __future__ import annotations

import math

from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.layout import KVCacheLayout
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import VllmVersion, rule
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


def explicit_budget(args: ServeArgs, platform: Platform) -> tuple[int | None, str]:
    """An exact KV budget: on the CPU build VLLM_CPU_KVCACHE_SPACE (GiB) overrides the flag."""
    space = args.env.get("VLLM_CPU_KVCACHE_SPACE")
    if platform.is_cpu and space:
        try:
            return int(space) * GIB, "VLLM_CPU_KVCACHE_SPACE"
        except ValueError:
            raise UsageError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a whole number of GiB") from None
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    return None, ""
