"""The first boot at a length this host has not compiled: its KV budget is smaller than a warm boot's.

vLLM keys its torch.compile cache by the config's hash (compilation/backends.py:L1062,
`vllm_config.compute_hash()`), and ModelConfig's hash takes every field it does not list as ignored
(config/model.py:L457-L507, config/utils.py:L376-L394): max_model_len (model.py:L249) is one, so a
new --max-model-len compiles cold. gpu_memory_utilization and kv_cache_memory_bytes are not
(config/cache.py:L405-L408, since vLLM #47356). The cold compile runs inside the profiling window
(v1/worker/gpu_worker.py:L685-L700, `profile_run` under `memory_profiling`): its temporaries are
charged as activation peak and that boot's KV pool is smaller (vLLM #54122, #54383; fixes #54209,
#54479 were not in 0.33.0). The extra peak is learned where this service's journal has a cold and a
warm boot of one configuration, else a per-release estimate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_ctxmgr.core.budget import MIB, kv_budget_at_utilization
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan_record import ColdBootRecord
from vllm_ctxmgr.core.vllm_versions import VllmVersion

# the estimate where the journal has no cold/warm pair: vLLM #54383 measured a first boot's KV cache
# ~5% smaller than the same config's warm boots (#54122 reports more on some GPUs: learned wins)
ESTIMATED_COLD_SHARE = 0.05
# one rule for every release ctxmgr reads (0.10.0 .. 0.33.0): each profiles with the compile inside the
# window (0.33.0: gpu_worker.py:L685-L700; 0.11.0: determine_available_memory's memory_profiling); no
# release has shipped #54209 / #54479 yet, so a newer one is planned by it too (and says so)
ESTIMATE_CITATION = (
    "estimate: vLLM {release} charges a cold torch.compile to the profiling peak "
    "(v1/worker/gpu_worker.py:L685-L700), ~5% of the warm KV budget (vLLM #54383)"
)


@dataclass(frozen=True)
class ColdBoot:
    """The boot that applies a change compiles cold: `extra_bytes` less KV per GPU than a warm one."""

    max_model_len: int
    extra_bytes: int
    source: str  # "learned: ..." from this host's journal, or the estimate with its citation
    estimate: bool

    def note(self) -> str:
        """The line a plan prints: what the first boot at the new length costs, and from where."""
        return (
            f"first boot at {self.max_model_len:,} compiles cold: {self.extra_bytes / GIB:.2f} GiB less KV "
            f"than a warm boot; the plan holds for that boot ({self.source})"
        )

    def to_json(self) -> ColdBootRecord:
        return {
            "max_model_len": self.max_model_len,
            "extra_bytes": self.extra_bytes,
            "source": self.source,
            "estimate": self.estimate,
        }


def compiled_lengths(observations: Sequence[Observation]) -> set[int]:
    """The lengths a start of this service reached vLLM's compile at: each is in the compile cache."""
    return {obs.max_model_len for obs in observations if obs.max_model_len and obs.compile_cache}


def learned_extra(observations: Sequence[Observation]) -> tuple[int, str] | None:
    """The latest cold boot's KV shortfall against a warm boot of the same length, utilisation and
    release (per GPU): the extra peak this host's cold compile costs."""
    for cold in reversed(observations):
        if cold.compile_cache != "miss" or cold.available_kv_gib is None or cold.kv_cache_memory_bytes:
            continue
        for warm in reversed(observations):
            if (
                warm.compile_cache == "hit"
                and warm.available_kv_gib is not None
                and not warm.kv_cache_memory_bytes
                and (warm.max_model_len, warm.gpu_memory_utilization, warm.vllm_version)
                == (cold.max_model_len, cold.gpu_memory_utilization, cold.vllm_version)
            ):
                extra = max(0, round((warm.available_kv_gib - cold.available_kv_gib) * GIB))
                return extra, (
                    f"learned: a cold boot at {cold.max_model_len:,} had {cold.available_kv_gib} GiB, "
                    f"a warm one {warm.available_kv_gib} GiB"
                )
    return None


def cold_boot(
    target: int,
    observations: Sequence[Observation],
    warm_budget: int | None,
    version: VllmVersion,
    compiles: bool,
) -> ColdBoot | None:
    """The cold boot a change to `target` starts with, or None: the length was compiled on this host,
    nothing compiles (--enforce-eager, the CPU build), the journal shows no compile cache in use
    (no hit or miss line: every boot then compiles alike), or the budget is not calibrated."""
    if not compiles or warm_budget is None or target in compiled_lengths(observations):
        return None
    if not any(obs.compile_cache for obs in observations):
        return None
    learned = learned_extra(observations)
    if learned is not None:
        return ColdBoot(target, learned[0], learned[1], estimate=False)
    source = ESTIMATE_CITATION.format(release=".".join(map(str, version)))
    return ColdBoot(target, math.ceil(warm_budget * ESTIMATED_COLD_SHARE), source, estimate=True)


# --------------------------------------------------------------------------------------------------
# Pinning the pool instead: --kv-cache-memory-bytes
# --------------------------------------------------------------------------------------------------

# why a pinned pool is the same on every boot, and what it gives up (vLLM 0.33.0)
PIN_TRADE_OFF = (
    "vLLM then no longer profiles (v1/worker/gpu_worker.py:L656-L681, 'skipped memory profiling'): a "
    "co-tenant that grows, or a heavier activation peak, can make a start fail"
)
PIN_REASON = (
    "kv_cache_memory_bytes is not in the compile hash (config/cache.py:L405-L408, vLLM #47356) and the "
    "compile runs before the pool is set (gpu_worker.py:L656-L662): cold or warm, every boot gets it"
)
UNCALIBRATED_PIN = (
    "pinning the KV pool (--kv-cache-memory-bytes) needs a plan calibrated by a start of this service: "
    "an estimated pool could be more than the GPU holds next to the model, and vLLM no longer checks it "
    "(it skips profiling); start the service once (or `ctxmgr observe`) and plan again"
)


def pinned_pool_bytes(
    available_kv: int, requested_at_start: int, totals: Sequence[int], utilization: float
) -> int:
    """The pool a pinned --kv-cache-memory-bytes gives every boot: the calibrated warm budget at the
    utilisation the unit runs at (the smallest GPU's), in whole MiB, down."""
    budgets = [
        kv_budget_at_utilization(available_kv, requested_at_start, total, utilization) for total in totals
    ]
    smallest = min(budgets) if budgets else available_kv
    return max(0, smallest // MIB * MIB)


def pin_offer(pool: int, max_model_len: int) -> str:
    """The plan line that offers pinning where the first boot compiles cold."""
    return (
        f"or pin the pool: --kv-cache-memory-bytes {pool} (`--pin-kv-cache-memory`) gives every boot at "
        f"{max_model_len:,}, the cold first one too, the warm pool of {pool / GIB:.2f} GiB per GPU "
        f"({PIN_REASON}); {PIN_TRADE_OFF}"
    )
