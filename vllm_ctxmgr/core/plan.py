"""The planner: the `--max-model-len` and `--gpu-memory-utilization` a service needs, by vLLM's own rules.

Pure: facts + serve args + GPU state + earlier starts in, a `Plan` out. The CLI renders it.

How vLLM (>= 0.21) spends one GPU (gpu_worker.determine_available_memory):

    requested = ceil(total x gpu_memory_utilization)     must fit in the memory free at startup
    KV budget = requested - weights - activation peak - non-torch growth - CUDA graphs
    vLLM starts only if the KV budget holds one request of max_model_len plus the null block.

Before 0.21 CUDA graphs are captured after the KV cache and must fit above `requested`. The memory
free at startup is the total minus what other processes hold minus this process's CUDA context and
NCCL buffers (taken before vLLM's snapshot). With `--kv-cache-memory-bytes` the KV budget is exactly
that number and the utilisation only enters the startup check.

Numbers and where they come from (every figure in the plan carries its source):
- "nvml"/"given": GPU totals and other processes' memory;
- "vllm log": an earlier start of the same service with the same vLLM version: the KV budget it logged
  ("Available KV cache memory"), weights ("Model loading took"), CUDA graphs, or the estimated maximum
  model length of a failed start. The budget at another utilisation u is
  `observed + ceil(total x u) - ceil(total x u_observed)`. The "KV cache size: N tokens" line is never
  used: it is concurrency x max_model_len, not a capacity;
- "gguf"/"safetensors"/"option": weight bytes, split evenly over TP x PP ranks;
- "estimate", used only where nothing better is known: core/memory.py's non-KV model (the profile
  run's forward at max_num_batched_tokens or its dummy sampler pass over max_num_seqs x vocabulary,
  whichever is larger; CUDA graphs from the capture sizes and layers; non-torch growth; the CUDA
  context and NCCL before the snapshot), each term citing the vLLM code it mirrors. The plan's notes
  name the estimated terms, and each GPU's margin grows by their spread (core.memory.margin_widening).

Margin: on top of what one request needs, each GPU keeps `max(512 MiB, 2% of its memory)` of KV budget
spare (`PlanOptions.margin_fraction`, `margin_min_bytes`). It covers the estimates above being off by a
few hundred MiB, the 10 MiB rounding of logged GiB figures, and allocator fragmentation that varies
between starts; 2% is 1.9 GiB on a 96 GiB GPU, about the spread seen between runs of the same service.
With an explicit KV budget (`--kv-cache-memory-bytes`, VLLM_CPU_KVCACHE_SPACE) vLLM's check is exact,
so the margin is kept in the GPU's free memory next to that budget instead.

`max_model_len` is the target exactly: vLLM takes any integer, and the KV cost already rounds up to
whole blocks (up to round_up(target, block_size x DCP) tokens cost the same memory).

A target above the model's derived maximum is refused (`feasible=False`, with the allow-long
alternative) unless `allow_long`; the CLI turns an infeasible plan into exit code 3.

This module is the entry point (make_plan, PlanOptions, Plan) and the per-GPU evaluation. Around it:
core/budget.py (vLLM's KV-budget arithmetic, shared with the readers of stored plans),
core/calibration.py (earlier starts), core/alternatives.py (what would help when the target does not
fit) and core/plan_record.py (the stored plan's schema and reader).

Why one module (core/'s largest, some 1,450 lines): make_plan, the per-GPU evaluation and the
deployment terms (LoRA, experts over DP x TP, offloaded and cast weights, the named flags' margin) all
read the same per-GPU figures in one pass; splitting the evaluation out would pass a dozen of them
around. The arithmetic that other readers share already lives apart (budget, calibration,
alternatives, plan_record).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import cast

from vllm_ctxmgr.core.alternatives import Alternative, Search, Trial, find_alternatives
from vllm_ctxmgr.core.budget import (
    DEFAULT_MARGIN_FRACTION,
    DEFAULT_MARGIN_MIN_BYTES,
    MIB,
    cuda_graphs_in_budget,
    default_gpu_memory_utilization,
    explicit_budget,
    kv_budget_at_utilization,
    kv_needed_bytes,
    margin_bytes,
    requested_bytes,
)
from vllm_ctxmgr.core.calibration import NodeObservation, Observed, node_observed, observed_memory
from vllm_ctxmgr.core.cold_boot import (
    PIN_REASON,
    PIN_TRADE_OFF,
    UNCALIBRATED_PIN,
    ColdBoot,
    cold_boot,
    pin_offer,
    pinned_pool_bytes,
)
from vllm_ctxmgr.core.confidence import Confidence, plan_confidence
from vllm_ctxmgr.core.deployment import (
    NamedFlag,
    gpu_weights,
    named_flags_warning,
    not_modelled_flags,
    scheduler_args,
    vllm_refusals,
    widening_bytes,
)
from vllm_ctxmgr.core.facts import ALLOW_LONG_ENV, NO_LENGTH_KEY, ModelFacts, derived_max_model_len
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, Platform, platform_for
from vllm_ctxmgr.core.json_types import JSONObject, JSONScalar, JSONValue
from vllm_ctxmgr.core.kv.layout import KVCacheLayout, kv_cache_layout
from vllm_ctxmgr.core.kv.specs import round_up
from vllm_ctxmgr.core.memory import NonKvMemory, margin_widening, non_kv_memory, uses_flashinfer_sampler
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan_record import PLAN_SCHEMA, FigureRecord, PlanRecord, PlanResult, VllmRuleRecord
from vllm_ctxmgr.core.serve_args import ServeArgs, multi_node_flag
from vllm_ctxmgr.core.vllm_versions import (
    NEWEST_VLLM,
    NO_GGUF_LOADER_SINCE,
    VllmVersion,
    known_version,
    not_modelled_before_oldest,
    rule,
    rules_in_force,
)
from vllm_ctxmgr.core.weight_cache import (
    PreloadOffer,
    holds_external_weights,
    unchanged_key_note,
    weight_cache_mode,
)
from vllm_ctxmgr.errors import UsageError

DEFAULT_MAX_GPU_MEMORY_UTILIZATION = 0.95


WEIGHTS_UNKNOWN = "weights unknown"


def supports_auto_max_model_len(vllm_version: VllmVersion) -> bool:
    """`--max-model-len auto` / -1 (rule auto_max_model_len: from 0.14.0)."""
    return rule("auto_max_model_len", vllm_version)


# --------------------------------------------------------------------------------------------------
# Plan data
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A byte count and where it came from; bytes None means unknown."""

    bytes: int | None
    source: str

    def to_json(self) -> FigureRecord:
        """A FigureRecord, the form every figure takes in a stored plan (StoredPlan.figure reads it)."""
        return {"bytes": self.bytes, "source": self.source}


@dataclass(frozen=True)
class PlanOptions:
    """What the caller decides beyond model, flags and GPUs: the target, the caps and margins, overrides.

    Filled by planning.plan_for from the CLI's flags; the defaults are the planner's policy.
    """

    target_context: int
    derived_max_model_len: int | None = None  # None: ask facts.derived_max_model_len
    derived_max_model_len_key: str | None = None
    allow_long: bool = False
    vllm_version: VllmVersion = NEWEST_VLLM
    max_gpu_memory_utilization: float = DEFAULT_MAX_GPU_MEMORY_UTILIZATION
    margin_fraction: float = DEFAULT_MARGIN_FRACTION
    margin_min_bytes: int = DEFAULT_MARGIN_MIN_BYTES
    weights_bytes: int | None = None  # all ranks together; overrides the model files' size
    service_pids: tuple[int, ...] = ()  # this service's processes: their memory is freed by the restart
    # the operator's own --gpu-memory-utilization: check it (vLLM's checks, no margin) instead of choosing
    fixed_gpu_memory_utilization: float | None = None
    # whose the fixed utilisation is, in the verdict: "chosen" (the operator's), "the unit's" (kept)
    fixed_gpu_memory_utilization_is: str = "the chosen"
    platform: Platform | None = None
    cpu: bool = False
    # size for this many requests of the full context at once: the KV need is N x blocks per request
    concurrency: int = 1
    # the routed experts' bytes (all ranks), where the shard headers say: with DP > 1 vLLM splits
    # them over DP x TP (fused_moe/config.py flatten_tp_across_dp_and_pcp)
    expert_weight_bytes: int | None = None
    # the GPUs given are every node's of a multi-node deployment, in rank order (the coordinator): the
    # plan is the whole deployment's, not one node's
    whole_deployment: bool = False
    # plan a change to a length this host has not compiled for its cold first boot (core/cold_boot.py);
    # off only to measure what the rule changes (benchmarks/cold_boot_rule.py)
    cold_boot_rule: bool = True
    # pin the pool: --kv-cache-memory-bytes at the calibrated warm budget, the same on every boot (cold
    # or warm); refused on a plan no start calibrated
    pin_kv_cache_memory: bool = False


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory at the planned utilisation, every figure with its source."""

    index: int
    name: str
    pipeline_stage: int
    total: Figure
    used_by_others: Figure
    startup_overhead: Figure  # CUDA context, cuBLAS, NCCL: before vLLM's snapshot
    free_at_start: Figure
    weights: Figure
    activation_peak: Figure
    non_torch: Figure
    cuda_graphs: Figure  # counted in non_kv only when vLLM subtracts them (>= 0.21, not eager)
    non_kv: Figure
    requested: Figure  # ceil(total x utilisation), or the explicit KV budget's footprint
    kv_budget: Figure
    kv_needed: Figure  # `concurrency` requests of max_model_len + the null block, as vLLM's check counts
    margin: Figure
    headroom: Figure  # kv_budget - kv_needed - margin
    max_gpu_memory_utilization: float  # the most vLLM's startup free-memory check allows here

    def to_json(self) -> dict:
        """One GPU line of PlanRecord["gpus"], every figure a FigureRecord, so verify can recheck margins."""
        data: dict = {"index": self.index, "name": self.name, "pipeline_stage": self.pipeline_stage}
        for name in (
            "total",
            "used_by_others",
            "startup_overhead",
            "free_at_start",
            "weights",
            "activation_peak",
            "non_torch",
            "cuda_graphs",
            "non_kv",
            "requested",
            "kv_budget",
            "kv_needed",
            "margin",
            "headroom",
        ):
            data[name] = getattr(self, name).to_json()
        data["max_gpu_memory_utilization"] = self.max_gpu_memory_utilization
        return data


@dataclass(frozen=True)
class KVCapacity:
    """What one engine (a TP x PP group of GPUs, one per data-parallel rank) will log at start.

    vLLM's `_report_kv_cache_config`: "GPU KV cache size: N tokens" and "Maximum concurrency for
    max_model_len tokens per request: X.XXx", from the pool's blocks (the minimum over the engine's
    workers, null block included) and the blocks one request takes, summed over the groups.
    """

    gpus: tuple[int, ...]  # GPU indices; empty when planned without GPU state (an explicit budget)
    num_gpu_blocks: int
    kv_cache_tokens: int  # int(concurrency x max_model_len), from the unrounded concurrency
    max_concurrency: float  # rounded to two decimals, as vLLM's %.2f prints it

    def to_json(self) -> JSONObject:
        """One entry of PlanRecord["capacity"], to compare with the "GPU KV cache size" a start logs."""
        return {
            "gpus": list(self.gpus),
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": self.max_concurrency,
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer: flags and environment to set (or why not), every figure with its source.

    Made by make_plan; `to_json` is what `ctxmgr plan --json` prints and each revision stores.
    """

    feasible: bool
    reason: str  # one line: why it is (in)feasible
    verdict: str  # the memory evaluation alone: "fits", "does not fit ...", "weights unknown ...", ...
    max_model_len: int
    gpu_memory_utilization: float | None
    max_context: int  # the largest context that fits at the cap (bounded by the derived maximum)
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_memory_bytes: int | None
    derived_max_model_len: int | None
    derived_max_model_len_key: str | None
    vllm_version: VllmVersion
    platform: Platform
    layout: KVCacheLayout
    gpus: tuple[GpuMemory, ...] = ()
    flag_changes: dict[str, str] = field(default_factory=dict)
    env_changes: dict[str, str] = field(default_factory=dict)
    alternatives: tuple[Alternative, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    concurrency: int = 1  # requests of max_model_len the KV need was sized for
    capacity: tuple[KVCapacity, ...] = ()  # per engine; empty where the KV budget is not known
    not_modelled: tuple[NamedFlag, ...] = ()  # the unit's flags that change GPU memory, not counted
    # the least utilisation that holds the target with the margin (None: none does, or not searched);
    # gpu_memory_utilization is the one the plan runs at, the unit's own where set-context keeps it
    least_gpu_memory_utilization: float | None = None
    # what sets max_context: "model" (the derived maximum), "target" (no maximum known), "memory"
    max_context_limit: str = "memory"
    confidence: Confidence | None = None  # calibrated from a start, or estimated, with its error band
    # the boot that applies the change compiles cold: the figures above hold for it (core/cold_boot.py)
    cold_boot: ColdBoot | None = None
    # a unit that loads from disk at each restart, which a `vllm preload` daemon would serve
    # (core/weight_cache.py; set by change/planning.py, which reads the journal)
    preload_offer: PreloadOffer | None = None

    @property
    def result(self) -> PlanResult:
        """The one word the headline, --json's `result`, `feasible` and `verdict`, and the exit code all
        follow. A plan without any memory figure decides nothing, and one that fits only if the weights
        (unknown) are small enough does not know either: a script that gates on it must not read either
        as "fits"."""
        if not self.gpus and self.kv_cache_memory_bytes is None:
            return PlanResult.UNKNOWN
        if not self.feasible:
            return PlanResult.INFEASIBLE
        return PlanResult.UNKNOWN if self.verdict.startswith(WEIGHTS_UNKNOWN) else PlanResult.FEASIBLE

    @property
    def kv_cache_tokens(self) -> int | None:
        """vLLM's "KV cache size" of the engine with the smallest pool."""
        return min((c.kv_cache_tokens for c in self.capacity), default=None)

    @property
    def max_concurrency(self) -> float | None:
        """vLLM's "Maximum concurrency for max_model_len tokens per request" of the smallest pool."""
        return min((c.max_concurrency for c in self.capacity), default=None)

    def vllm_rules(self) -> list[VllmRuleRecord]:
        """The version rules this plan followed (core/vllm_versions.py), informational ones left out."""
        return [
            {"rule": row.name, "since": ".".join(map(str, row.since)), "value": _json_value(row.value)}
            for row in rules_in_force(self.vllm_version)
            if not row.informational
        ]

    def to_json(self) -> PlanRecord:
        """The PlanRecord each revision stores, read back long after through StoredPlan."""
        return {
            "schema": PLAN_SCHEMA,
            "result": self.result,
            "feasible": None if self.result is PlanResult.UNKNOWN else self.feasible,
            "reason": self.reason,
            "verdict": self.result,
            "memory": self.verdict,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "least_gpu_memory_utilization": self.least_gpu_memory_utilization,
            "max_context": self.max_context,
            "max_context_limit": self.max_context_limit,
            "confidence": self.confidence.to_json() if self.confidence else None,
            "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "null_block_bytes": self.layout.bytes_per_block,
            "concurrency": self.concurrency,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": self.max_concurrency,
            "capacity": [c.to_json() for c in self.capacity],
            "derived_max_model_len": self.derived_max_model_len,
            "derived_max_model_len_key": self.derived_max_model_len_key,
            "vllm_version": ".".join(map(str, self.vllm_version)),
            "vllm_rules": self.vllm_rules(),
            "platform": {
                "device_type": self.platform.device_type,
                "compute_capability": self.platform.compute_capability,
                "device_name": self.platform.device_name,
                "capability_source": self.platform.capability_source or None,
                "decides": {
                    "attention_backend": self.layout.attention_backend,
                    "kv_cache_dtype": self.layout.kv_cache_dtype,
                },
            },
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "flag_changes": dict(self.flag_changes),
            "env_changes": dict(self.env_changes),
            "alternatives": [alt.to_json() for alt in self.alternatives],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "layout": self.layout.summary(self.max_model_len),
            "not_modelled_flags": [named.to_json() for named in self.not_modelled],
            "cold_boot": self.cold_boot.to_json() if self.cold_boot else None,
            "preload_offer": self.preload_offer.to_json() if self.preload_offer else None,
        }


def _json_value(value: object) -> JSONValue:
    """A rule value as plain JSON (tuples become lists); a rule's values are JSON scalars, tuples of
    them or dicts of them (core/vllm_rules), never anything else."""
    if isinstance(value, tuple):
        return cast(JSONValue, list(value))
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    return cast(JSONScalar, value)


# --------------------------------------------------------------------------------------------------
# One GPU
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gpu:
    info: GpuInfo
    stage: int
    total_source: str
    others: Figure
    overhead: int
    weights: Figure
    activation: Figure
    non_torch: Figure
    cuda_graphs: Figure
    graphs_in_budget: bool
    observed: Observed | None
    margin: int
    cold_extra: int = 0  # the first boot compiles cold: its activation peak is this much higher
    # a `vllm preload` daemon's weights (zero_copy): in `others` as NVML sees them, external to vLLM's
    # free-memory check (core/weight_cache.py)
    external_weights: int = 0

    @property
    def total(self) -> int:
        return self.info.total_bytes

    @property
    def free_at_start(self) -> int:
        return self.total - (self.others.bytes or 0) - self.overhead

    @property
    def free_for_requested(self) -> int:
        """What vLLM's startup check holds the requested memory against: the free memory, plus the weights
        a preload daemon holds, which request_memory takes off the request (v1/worker/utils.py:L716-L772)."""
        return self.free_at_start + self.external_weights

    @property
    def has_observed_budget(self) -> bool:
        return self.observed is not None and self.observed.available_kv is not None

    def requested(self, utilization: float) -> int:
        return requested_bytes(self.total, utilization)

    def non_kv(self) -> int:
        if self.has_observed_budget:
            assert self.observed is not None and self.observed.utilization is not None
            requested = self.observed.requested_at_start or self.requested(self.observed.utilization)
            return requested - (self.observed.available_kv or 0) + self.cold_extra
        graphs = (self.cuda_graphs.bytes or 0) if self.graphs_in_budget else 0
        weights, peak = self.weights.bytes or 0, (self.activation.bytes or 0) + self.cold_extra
        return weights + peak + (self.non_torch.bytes or 0) + graphs

    def budget(self, utilization: float) -> int:
        """The KV budget vLLM would find on this GPU at `utilization`."""
        if self.has_observed_budget:
            assert self.observed is not None and self.observed.utilization is not None
            observed_requested = self.observed.requested_at_start or self.requested(self.observed.utilization)
            warm = kv_budget_at_utilization(
                self.observed.available_kv or 0, observed_requested, self.total, utilization
            )
            return warm - self.cold_extra
        return self.requested(utilization) - self.non_kv()

    def max_utilization(self) -> float:
        """The largest utilisation (0.01 steps) vLLM's startup free-memory check accepts here."""
        room = self.free_for_requested
        if not self.graphs_in_budget:
            room -= self.cuda_graphs.bytes or 0  # graphs are captured in the memory above `requested`
        best = 0.0
        for k in range(1, 101):
            if self.requested(k / 100) <= room:
                best = k / 100
        return best

    def weights_known(self) -> bool:
        return self.has_observed_budget or self.weights.bytes is not None


def _weights(
    facts: ModelFacts,
    options: PlanOptions,
    observed: Observed | None,
    ranks: int,
    args: ServeArgs,
    model_dtype: str,
) -> Figure:
    """Per-GPU weights: as vLLM logged them, else the option, else the model files split over the ranks;
    the files' bytes as the deployment's flags leave them on a GPU (core/deployment.py gpu_weights)."""
    # a start that mapped a `vllm preload` daemon's weights logs next to nothing for them ("Model loading
    # took" is torch's max_memory_allocated growth, platforms/cuda.py:L369-L374; the mapped tensors are not
    # the allocator's): the weights' size, which the daemon holds, comes from the files
    if observed is not None and observed.weights is not None and not holds_external_weights(args):
        return Figure(observed.weights, observed.source)
    if options.weights_bytes is not None:
        total, source = options.weights_bytes, "option"
    elif facts.weight_bytes is not None:
        total = facts.weight_bytes
        source = facts.provenance.get("weight_bytes") or (
            "gguf" if facts.source_format == "gguf" else "safetensors"
        )
    else:
        return Figure(None, "unknown")
    per_gpu = total // ranks
    dp = args.data_parallel_size
    if facts.num_experts and dp > 1 and options.expert_weight_bytes is not None:
        experts = min(options.expert_weight_bytes, total)
        per_gpu = (total - experts) // ranks + experts // (ranks * dp)
        source += f" (routed experts split over DP {dp} x {ranks} ranks)"
    held = gpu_weights(per_gpu, facts, args, model_dtype, ranks)
    return Figure(held.bytes, source + (" (" + "; ".join(held.notes) + ")" if held.notes else ""))


def _used_by_others(gpu: GpuInfo, service_pids: tuple[int, ...], source: str, warnings: list[str]) -> Figure:
    mine = [p for p in gpu.processes if p.pid in service_pids]
    if not mine:
        if service_pids and gpu.used_bytes > GIB:
            warnings.append(
                f"GPU {gpu.index}: no process of this service is visible there; all "
                f"{gpu.used_bytes / GIB:.2f} GiB in use is counted as used by others"
            )
        return Figure(gpu.used_bytes, source)
    if all(p.used_bytes is not None for p in mine):
        return Figure(
            max(0, gpu.used_bytes - sum(p.used_bytes or 0 for p in mine)), f"{source} (service excluded)"
        )
    others = sum(p.used_bytes or 0 for p in gpu.processes if p.pid not in service_pids)
    warnings.append(
        f"GPU {gpu.index}: the driver does not say how much the service uses; counting other processes"
    )
    return Figure(others, f"{source} (other processes)")


def _gpu_models(
    facts: ModelFacts,
    args: ServeArgs,
    gpus: GpuState,
    options: PlanOptions,
    layout: KVCacheLayout,
    observed: Observed | None,
    warnings: list[str],
    by_rank: dict[int, Observed] | None = None,
    cold_extra: int = 0,
) -> list[_Gpu]:
    """Each GPU's figures; a rank whose own node logged a start (`by_rank`, a multi-node deployment's
    headless nodes) takes that node's, every other rank the service's own (`observed`). `cold_extra`:
    the first boot compiles cold, each GPU's peak that much higher (core/cold_boot.py)."""
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    ranks = tp * pp
    if len(gpus.gpus) < ranks:
        raise UsageError(
            f"the service needs {ranks} GPUs (tensor parallel {tp} x pipeline parallel {pp}); "
            f"{len(gpus.gpus)} given"
        )
    world = ranks * dp if len(gpus.gpus) >= ranks * dp else ranks
    source = "nvml" if gpus.source == "nvml" else "given"
    graphs_counted = cuda_graphs_in_budget(options.vllm_version, args)
    by_rank = by_rank or {}
    named = not_modelled_flags(args, facts, options.vllm_version, options.expert_weight_bytes is not None)
    cpu = options.cpu or (options.platform is not None and options.platform.is_cpu)
    head_observed = observed
    models = []
    for rank, info in enumerate(gpus.gpus[:world]):
        stage = (rank % ranks) // tp
        observed = by_rank.get(rank, head_observed)
        weights = _weights(facts, options, observed, ranks, args, layout.model_dtype)
        memory = _non_kv_estimate(facts, args, options, layout, info, world, cpu, stage == pp - 1)
        graphs = Figure(memory.cuda_graphs.bytes, memory.cuda_graphs.source)
        if observed is not None and observed.cuda_graphs is not None:
            graphs = Figure(observed.cuda_graphs, observed.source)
        margin = margin_bytes(info.total_bytes, options.margin_fraction, options.margin_min_bytes)
        calibrated = observed is not None and observed.available_kv is not None
        margin += widening_bytes(named, info.total_bytes, calibrated)  # flags that change memory, not counted
        if observed is None or observed.available_kv is None:
            margin += margin_widening(memory, graphs_counted and not graphs.source.startswith("vllm log"))
        peak = memory.activation_peak
        others = _used_by_others(info, options.service_pids, source, warnings)
        external = min(weights.bytes or 0, others.bytes or 0) if holds_external_weights(args) else 0
        if external:
            others = Figure(others.bytes, f"{others.source} (the preload daemon's weights among them)")
        models.append(
            _Gpu(
                info=info,
                stage=stage,
                total_source=source,
                others=others,
                overhead=memory.startup_overhead.bytes,
                weights=weights,
                activation=Figure(peak.bytes, peak.source),
                non_torch=Figure(memory.non_torch.bytes, memory.non_torch.source),
                cuda_graphs=graphs,
                graphs_in_budget=graphs_counted,
                observed=observed,
                margin=margin,
                cold_extra=cold_extra,
                external_weights=external,
            )
        )
    return models


def _non_kv_estimate(
    facts: ModelFacts,
    args: ServeArgs,
    options: PlanOptions,
    layout: KVCacheLayout,
    info: GpuInfo,
    world: int,
    cpu: bool,
    last_stage: bool,
) -> NonKvMemory:
    """core/memory.py's terms for one GPU (its platform: default max_num_seqs, capture sizes)."""
    platform = options.platform or platform_for(GpuState((info,), "given", None), cpu)
    return non_kv_memory(
        facts,
        version=options.vllm_version,
        platform=platform,
        max_num_batched_tokens=layout.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        world_size=world,
        enforce_eager=args.enforce_eager,
        last_pipeline_stage=last_stage,
        flashinfer_sampler=uses_flashinfer_sampler(
            options.vllm_version, platform, args.env, args.flashinfer_installed
        ),
    )


# --------------------------------------------------------------------------------------------------
# Evaluating one configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    feasible: bool
    verdict: str
    utilization: float | None
    max_context: int
    lines: tuple[GpuMemory, ...]
    kv_cache_memory_bytes: int | None  # the explicit KV budget the plan sets (or keeps)
    budget: int | None = None  # the KV budget when there are no GPU lines (explicit or logged)
    least: float | None = None  # the least utilisation that holds the target with the margin


def _stage_min(gpus: list[_Gpu], layout: KVCacheLayout, value: Callable[[_Gpu], int]) -> list[int]:
    """Per pipeline stage, the smallest of `value(gpu)` over that stage's GPUs."""
    return [
        min((value(g) for g in gpus if g.stage == s), default=0) for s in range(layout.pipeline_parallel_size)
    ]


def _line(
    gpu: _Gpu,
    layout: KVCacheLayout,
    target: int,
    requested: int,
    budget: int,
    budget_source: str,
    margin: int,
    requests: int,
) -> GpuMemory:
    kv_needed = kv_needed_bytes(layout, target, gpu.stage, requests)
    if gpu.has_observed_budget:
        assert gpu.observed is not None
        logged = gpu.observed.source
        non_kv = Figure(gpu.non_kv(), logged)
        weights = gpu.weights
        graphs_counted = (gpu.cuda_graphs.bytes or 0) if gpu.graphs_in_budget else 0
        rest = max(0, gpu.non_kv() - (weights.bytes or 0) - graphs_counted)
        cold = " + the cold compile's peak" if gpu.cold_extra else ""
        activation = Figure(rest, f"{logged} (activation + non-torch{cold})")
        non_torch = Figure(0, f"{logged} (in activation peak)")
    else:
        known = gpu.weights.bytes is not None
        non_kv = Figure(gpu.non_kv() if known else None, "estimate" if known else "unknown (weights unknown)")
        weights, activation, non_torch = gpu.weights, gpu.activation, gpu.non_torch
        if gpu.cold_extra and activation.bytes is not None:
            activation = Figure(
                activation.bytes + gpu.cold_extra, f"{activation.source} + the cold compile's"
            )
    headroom = budget - kv_needed - margin
    return GpuMemory(
        index=gpu.info.index,
        name=gpu.info.name,
        pipeline_stage=gpu.stage,
        total=Figure(gpu.total, gpu.total_source),
        used_by_others=gpu.others,
        startup_overhead=Figure(gpu.overhead, "estimate"),
        free_at_start=Figure(gpu.free_at_start, "estimate"),
        weights=weights,
        activation_peak=activation,
        non_torch=non_torch,
        cuda_graphs=gpu.cuda_graphs,
        non_kv=non_kv,
        requested=Figure(requested, "ceil(total x utilisation)"),
        kv_budget=Figure(budget, budget_source),
        kv_needed=Figure(kv_needed, "vllm accounting"),
        margin=Figure(margin, "margin" if margin else "none (explicit KV budget)"),
        headroom=Figure(headroom, budget_source),
        max_gpu_memory_utilization=gpu.max_utilization(),
    )


def _evaluate(
    layout: KVCacheLayout,
    args: ServeArgs,
    gpus: list[_Gpu] | None,
    options: PlanOptions,
    platform: Platform,
    observed: Observed | None,
    target: int,
    upper: int,
    same_config: bool,
) -> _Outcome:
    """Does `target` fit on these GPUs, at which utilisation, and what is the most that fits? Without GPU
    state, by the explicit or logged KV budget alone; with an explicit --kv-cache-memory-bytes, by that
    budget; else by gpu_memory_utilization: unknown weights, a fixed utilisation or the searched one,
    which share the same per-GPU figures (_UtilizationFit)."""
    current_u = args.gpu_memory_utilization or default_gpu_memory_utilization(options.vllm_version)
    explicit, explicit_source = explicit_budget(args, platform, options.vllm_version)
    requests = options.concurrency
    need_by_stage = [
        kv_needed_bytes(layout, target, s, requests) for s in range(layout.pipeline_parallel_size)
    ]
    if not gpus:
        return _evaluate_without_gpus(
            layout, args, observed, explicit, explicit_source, current_u, target, upper, requests
        )
    if explicit is not None:
        return _evaluate_explicit(
            layout, args, gpus, options, target, upper, explicit, explicit_source, current_u
        )
    fit = _UtilizationFit.of(layout, gpus, options, observed, target, upper, same_config, need_by_stage)
    if not all(g.weights_known() for g in gpus):
        unit_or_default = "the unit's" if args.gpu_memory_utilization else "vLLM's default"
        return _evaluate_weights_unknown(fit, options, current_u, unit_or_default)
    if options.fixed_gpu_memory_utilization is not None:
        return _evaluate_fixed_utilization(fit, options)
    return _evaluate_searched_utilization(fit, options.max_gpu_memory_utilization)


def _evaluate_without_gpus(
    layout: KVCacheLayout,
    args: ServeArgs,
    observed: Observed | None,
    explicit: int | None,
    explicit_source: str,
    current_u: float,
    target: int,
    upper: int,
    requests: int,
) -> _Outcome:
    """No GPU state: the explicit --kv-cache-memory-bytes, else the KV budget an earlier start logged,
    is all there is to plan by; with neither the plan cannot say whether it fits."""
    budget: int | None = explicit
    source = explicit_source
    if budget is None and observed is not None and observed.available_kv is not None:
        budget, source = observed.available_kv, observed.budget_source
    if budget is None:
        return _Outcome(True, "no memory information (no GPU state)", current_u, upper, (), None)
    max_context = layout.max_model_len_for(budget, upper, requests)
    fits = layout.fits(target, budget, requests)
    verdict = f"fits in the {source} KV budget" if fits else f"does not fit in the {source} KV budget"
    return _Outcome(fits, verdict, current_u, max_context, (), args.kv_cache_memory_bytes, budget)


@dataclass(frozen=True)
class _UtilizationFit:
    """What every gpu_memory_utilization branch shares: the KV cache each GPU needs (its stage's blocks
    plus its margin), the highest utilisation the GPUs and the cap allow (u_limit), the smallest that
    holds the target on every GPU (u_needed, None where none does) and the longest context at u_limit."""

    layout: KVCacheLayout
    gpus: list[_Gpu]
    target: int
    requests: int
    need_by_stage: list[int]
    u_limit: float
    u_needed: float | None
    max_context: int

    @classmethod
    def of(
        cls,
        layout: KVCacheLayout,
        gpus: list[_Gpu],
        options: PlanOptions,
        observed: Observed | None,
        target: int,
        upper: int,
        same_config: bool,
        need_by_stage: list[int],
    ) -> _UtilizationFit:
        requests = options.concurrency
        u_limit = min([options.max_gpu_memory_utilization] + [g.max_utilization() for g in gpus])
        u_needed: float | None = 0.0
        for g in gpus:
            need = need_by_stage[g.stage] + g.margin
            smallest = next((k / 100 for k in range(1, 101) if g.budget(k / 100) >= need), None)
            u_needed = None if smallest is None or u_needed is None else max(u_needed, smallest)
        max_context = 0
        if u_limit >= 0.01:
            max_context = layout.max_model_len_for(
                _stage_min(gpus, layout, lambda g: g.budget(u_limit) - g.margin), upper, requests
            )
        if (  # the same unit started before: its logged estimate of the longest context bounds ours
            same_config
            and observed is not None
            and observed.estimated_max_model_len
            and observed.utilization is not None
            and u_limit <= observed.utilization
        ):
            max_context = min(max_context, observed.estimated_max_model_len)
        return cls(layout, gpus, target, requests, need_by_stage, u_limit, u_needed, max_context)

    def need(self, g: _Gpu) -> int:
        """The KV cache `g` must hold for the target, with its margin."""
        return self.need_by_stage[g.stage] + g.margin

    def lines(self, u: float, source: str | None = None) -> tuple[GpuMemory, ...]:
        """Every GPU's line at utilisation `u`; the budget's source is each GPU's own unless given (a
        headless node's ranks: that node's journal)."""
        layout, target, requests = self.layout, self.target, self.requests
        return tuple(
            _line(
                g,
                layout,
                target,
                g.requested(u),
                g.budget(u),
                source or _budget_source(g),
                g.margin,
                requests,
            )
            for g in self.gpus
        )


def _budget_source(g: _Gpu) -> str:
    """Where a GPU's KV budget comes from: the start its own node logged, else the estimate."""
    return g.observed.budget_source if g.observed is not None and g.has_observed_budget else "estimate"


def _evaluate_weights_unknown(
    fit: _UtilizationFit, options: PlanOptions, current_u: float, current_is: str
) -> _Outcome:
    """Weights unknown: no utilisation can be chosen (the least that fits depends on them), so the plan
    is at the one the unit would run with (the caller's, else the unit's, else vLLM's default) and says
    how large the weights may be there; no least utilisation is given (one offered here, 0.95, had
    set-context keep 0.9 while its flags said 0.95)."""
    fixed = options.fixed_gpu_memory_utilization
    u = current_u if fixed is None else fixed
    whose = options.fixed_gpu_memory_utilization_is if fixed is not None else current_is
    if fixed is None and u > fit.u_limit + 1e-9:
        # the unit's (or vLLM's default) would fail vLLM's free-memory check: the most the GPUs allow,
        # which is then the utilisation set-context writes
        u, whose = fit.u_limit, "the most the free memory allows,"
    if u > min(g.max_utilization() for g in fit.gpus) + 1e-9:
        allowed = f"{fit.u_limit:.2f}, not {u:.2f}"
        verdict = f"does not fit: the free memory allows gpu_memory_utilization {allowed}"
        return _Outcome(False, verdict, u, fit.max_context, fit.lines(u, "estimate without weights"), None)
    allowance = min(g.budget(u) - fit.need(g) for g in fit.gpus) if u >= 0.01 else -1
    feasible = allowance >= 0
    if feasible:
        verdict = (
            f"{WEIGHTS_UNKNOWN}: fits at {whose} gpu_memory_utilization {u:.2f} if the weights take at most "
            f"{allowance / GIB:.2f} GiB per GPU"
        )
    else:
        verdict = f"does not fit at {whose} gpu_memory_utilization {u:.2f} even without weights"
    return _Outcome(feasible, verdict, u, fit.max_context, fit.lines(u, "estimate without weights"), None)


def _evaluate_fixed_utilization(fit: _UtilizationFit, options: PlanOptions) -> _Outcome:
    """A gpu_memory_utilization the caller or the unit fixes: does the target fit at exactly that one,
    and is that one within what the GPUs' free memory allows?"""
    fixed = options.fixed_gpu_memory_utilization
    assert fixed is not None
    fits_kv = all(g.budget(fixed) >= fit.need_by_stage[g.stage] for g in fit.gpus)
    fits_memory = fixed <= min(g.max_utilization() for g in fit.gpus) + 1e-9
    whose = options.fixed_gpu_memory_utilization_is
    if fits_kv and fits_memory:
        verdict = f"fits at {whose} gpu_memory_utilization {fixed:.2f}"
    elif not fits_memory:
        verdict = (
            f"does not fit: the free memory allows gpu_memory_utilization {fit.u_limit:.2f}, not {fixed:.2f}"
        )
    else:
        verdict = f"does not fit: the KV budget at {whose} gpu_memory_utilization {fixed:.2f} is too small"
    u_needed = fit.u_needed
    least = u_needed if u_needed is not None and u_needed <= fit.u_limit + 1e-9 else None
    return _Outcome(
        fits_kv and fits_memory, verdict, fixed, fit.max_context, fit.lines(fixed), None, least=least
    )


def _evaluate_searched_utilization(fit: _UtilizationFit, cap: float) -> _Outcome:
    """The least gpu_memory_utilization that holds the target on every GPU, if the free memory and the
    cap allow it; else why not (the free memory, the cap, or no utilisation at all)."""
    u_needed, u_limit = fit.u_needed, fit.u_limit
    feasible = u_needed is not None and u_needed <= u_limit + 1e-9
    u = u_needed if feasible else u_limit
    assert u is not None
    if feasible:
        verdict = "fits"
    elif u_needed is not None and u_needed <= cap + 1e-9:
        verdict = (
            f"does not fit: needs gpu_memory_utilization {u_needed:.2f}, "
            f"the GPUs' free memory allows {u_limit:.2f}"
        )
    elif u_needed is not None:
        verdict = f"does not fit: needs gpu_memory_utilization {u_needed:.2f}, above the cap {cap:.2f}"
    else:
        verdict = _too_small(fit.gpus, fit.need)
    return _Outcome(feasible, verdict, u, fit.max_context, fit.lines(u), None, least=u if feasible else None)


def _too_small(gpus: list[_Gpu], need: Callable[[_Gpu], int]) -> str:
    """Why no utilisation holds the target, naming the term that does not fit: the weights alone where
    they exceed the memory free at start, else the sum of the terms on the tightest GPU."""
    heavy = max(gpus, key=lambda g: (g.weights.bytes or 0) - g.free_at_start)
    weights = heavy.weights.bytes or 0
    if weights > heavy.free_at_start:
        return (
            f"does not fit: the weights alone take {weights / GIB:.2f} GiB per GPU, more than the "
            f"{heavy.free_at_start / GIB:.2f} GiB free on GPU {heavy.info.index} "
            f"({heavy.total / GIB:.2f} GiB total)"
        )
    tight = max(gpus, key=lambda g: g.non_kv() + need(g) - g.total)
    other = tight.non_kv() - (tight.weights.bytes or 0)
    return (
        f"does not fit: even the whole GPU is too small: weights {(tight.weights.bytes or 0) / GIB:.2f} GiB "
        f"+ other non-KV {other / GIB:.2f} GiB + KV needed with margin {need(tight) / GIB:.2f} GiB is "
        f"more than GPU {tight.info.index}'s {tight.total / GIB:.2f} GiB"
    )


def _evaluate_explicit(
    layout: KVCacheLayout,
    args: ServeArgs,
    gpus: list[_Gpu],
    options: PlanOptions,
    target: int,
    upper: int,
    explicit: int,
    source: str,
    current_u: float,
) -> _Outcome:
    """--kv-cache-memory-bytes: the budget is exact; the GPU must hold weights + non-KV + that budget.

    As in vLLM the explicit budget wins over free memory: the longest context is the one that budget
    holds (what vLLM's estimate would say), whatever the GPUs could hold instead.
    """
    requests = options.concurrency
    needed = max(kv_needed_bytes(layout, target, s, requests) for s in range(layout.pipeline_parallel_size))
    kv_bytes = explicit if layout.fits(target, explicit, requests) else round_up(needed, MIB)
    room = [g.free_for_requested - g.non_kv() - g.margin for g in gpus]
    fits_physically = all(kv_bytes <= r for r in room)
    u_max = min(g.max_utilization() for g in gpus)
    u = min(current_u, u_max)
    feasible = fits_physically and u >= 0.01
    weights_known = all(g.weights_known() for g in gpus)
    if not feasible:
        verdict = f"the GPUs cannot hold a {kv_bytes / GIB:.2f} GiB KV cache next to the model"
    elif not weights_known:
        allowance = (min(room) - kv_bytes) / GIB
        verdict = f"{WEIGHTS_UNKNOWN}: fits if the weights take at most {allowance:.2f} GiB per GPU"
    else:
        verdict = "fits"
    max_context = layout.max_model_len_for(explicit, upper, requests)
    lines = tuple(
        _line(g, layout, target, g.non_kv() + kv_bytes, kv_bytes, source, 0, requests) for g in gpus
    )
    return _Outcome(feasible, verdict, u, max_context, lines, kv_bytes)


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------


def _derived(facts: ModelFacts, args: ServeArgs, options: PlanOptions) -> tuple[int | None, str | None]:
    """The derived maximum from the options, else from facts.derived_max_model_len; None: no ceiling."""
    if options.derived_max_model_len is not None:
        return options.derived_max_model_len, options.derived_max_model_len_key
    try:
        value, key = derived_max_model_len(facts, options.vllm_version, args.disable_sliding_window)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if key == NO_LENGTH_KEY:
        return None, None  # the config names no length: vLLM accepts any user value
    return value, key


@dataclass(frozen=True)
class _Context:
    """What stays the same across the base plan and its alternatives."""

    facts: ModelFacts
    args: ServeArgs
    gpus: GpuState | None
    options: PlanOptions
    platform: Platform
    observed: Observed | None
    derived: int | None
    target: int
    # a multi-node deployment's ranks whose own node logged a start: that node's figures (global rank)
    by_rank: dict[int, Observed] = field(default_factory=dict)
    observations: tuple[Observation, ...] = ()  # this service's starts: which lengths it compiled

    def cold_boot(self, args: ServeArgs, target: int) -> ColdBoot | None:
        """The cold first boot at `target` on these flags, where the plan is calibrated by a warm start
        (a budget a cold boot logged is already that boot's)."""
        observed = self.observed
        if not self.options.cold_boot_rule or observed is None or observed.available_kv is None:
            return None
        if args.kv_cache_memory_bytes is not None:
            return None  # a pinned pool: the compile runs before it is set, every boot gets it
        if observed.start is not None and observed.start.compile_cache == "miss":
            return None
        compiles = not args.enforce_eager and not self.platform.is_cpu
        return cold_boot(
            target, self.observations, observed.available_kv, self.options.vllm_version, compiles
        )


def _upper(target: int, derived: int | None, allow_long: bool) -> int:
    """The longest context worth reporting: the derived maximum (the target when unknown or allowed long)."""
    if derived is None:
        return target
    return max(target, derived) if allow_long else derived


def _run(
    ctx: _Context,
    args: ServeArgs,
    target: int,
    allow_long: bool,
    same_config: bool,
    gpus: GpuState | None = None,
) -> tuple[KVCacheLayout, _Outcome, list[str]]:
    """Lay out the KV cache for `args` and evaluate `target` on the GPUs."""
    warnings: list[str] = []
    args = _scheduled(ctx.facts, args, ctx.platform, ctx.options.vllm_version, target)
    layout = kv_cache_layout(ctx.facts, args, ctx.platform, ctx.options.vllm_version)
    # logged non-KV memory still holds when only the KV layout changes, not when the ranks change
    same_ranks = (args.tensor_parallel_size, args.pipeline_parallel_size) == (
        ctx.args.tensor_parallel_size,
        ctx.args.pipeline_parallel_size,
    )
    observed = ctx.observed if same_ranks else None
    gpu_state = gpus if gpus is not None else ctx.gpus
    # a node's figures hold for its ranks only on the same GPUs, in the same places
    by_rank = ctx.by_rank if same_ranks and gpu_state is ctx.gpus else {}
    models = None
    cold = ctx.cold_boot(args, target) if observed is not None else None
    # on the CPU build the "device" is a NUMA node: --gpu-memory-utilization is a fraction of its memory
    if gpu_state is not None and (not ctx.platform.is_cpu or gpu_state.source == "numa"):
        models = _gpu_models(
            ctx.facts, args, gpu_state, ctx.options, layout, observed, warnings, by_rank,
            cold.extra_bytes if cold else 0,
        )  # fmt: skip
    upper = _upper(target, ctx.derived, allow_long)
    outcome = _evaluate(layout, args, models, ctx.options, ctx.platform, observed, target, upper, same_config)
    return layout, outcome, warnings


def _scheduled(
    facts: ModelFacts, args: ServeArgs, platform: Platform, version: VllmVersion, target: int
) -> ServeArgs:
    """max_num_batched_tokens as vLLM derives it for `target` (chunked prefill off, throughput mode)."""
    if args.max_num_batched_tokens is not None or (
        args.enable_chunked_prefill is not False and args.performance_mode != "throughput"
    ):
        return args  # vLLM's default stands: the layout derives it
    default = kv_cache_layout(facts, args, platform, version).max_num_batched_tokens
    return scheduler_args(args, target, default)


def _flag_changes(args: ServeArgs, outcome: _Outcome, target: int, options: PlanOptions) -> dict[str, str]:
    changes: dict[str, str] = {}
    if args.max_model_len != target:
        changes["--max-model-len"] = str(target)
    current_u = args.gpu_memory_utilization or default_gpu_memory_utilization(options.vllm_version)
    if outcome.utilization is not None and outcome.lines and abs(outcome.utilization - current_u) > 1e-9:
        changes["--gpu-memory-utilization"] = f"{outcome.utilization:.2f}"
    if (
        outcome.kv_cache_memory_bytes is not None
        and outcome.kv_cache_memory_bytes != args.kv_cache_memory_bytes
    ):
        changes["--kv-cache-memory-bytes"] = str(outcome.kv_cache_memory_bytes)
    return changes


def _trial(ctx: _Context, args: ServeArgs, target: int, allow_long: bool, gpus: GpuState | None) -> Trial:
    """core/alternatives.py's evaluation of a candidate: `args` at `target`, not the plan's own flags."""
    layout, outcome, _ = _run(ctx, args, target, allow_long, same_config=False, gpus=gpus)
    return Trial(
        layout=layout,
        feasible=outcome.feasible,
        verdict=outcome.verdict,
        utilization=outcome.utilization,
        max_context=outcome.max_context,
        flag_changes=_flag_changes(args, outcome, target, ctx.options),
    )


def make_plan(
    facts: ModelFacts,
    args: ServeArgs,
    gpus: GpuState | None,
    options: PlanOptions,
    observations: Sequence[Observation] = (),
    node_observations: Sequence[NodeObservation] = (),
) -> Plan:
    """Plan `options.target_context` for a service: flags, memory per GPU, alternatives if it does not fit.

    `observations` are earlier starts of this service, oldest first; `node_observations` the last start
    each other node of a multi-node deployment logged in its own journal, which its ranks' GPU lines
    use instead (vLLM then sizes the KV cache by the smallest worker's budget, as these lines do).
    Raises UsageError for a target below 1 or a configuration vLLM itself would reject (TP not
    dividing the heads, DCP with sliding windows, ...). An infeasible target is not an error: the plan says
    `feasible=False` with the reason, `max_context` and ranked alternatives.
    The planner's one pass, in order: facts and refusals, the observed budgets, the layout and its
    evaluation, the verdict, the deployment terms and the named flags, the alternatives."""
    _check_plan_options(options)
    target, version = options.target_context, options.vllm_version
    platform = options.platform or platform_for(gpus, options.cpu)
    if args.env.get(ALLOW_LONG_ENV, "0").strip().lower() in ("1", "true"):
        options = replace(options, allow_long=True)  # envs.py: the unit already allows a long context
    _refuse_what_vllm_refuses(facts, args, target, platform, version)
    derived, derived_key = _derived(facts, args, options)
    warnings = _version_warnings(version)
    notes: list[str] = list(args.notes)  # how the unit's arguments were read (a --config YAML)
    gguf_warnings, gguf_notes = _gguf_said(facts, version)
    warnings.extend(gguf_warnings)
    notes.extend(gguf_notes)
    base_layout = kv_cache_layout(
        facts, _scheduled(facts, args, platform, version, target), platform, version
    )
    observed, by_rank, observed_notes = _observed_budgets(
        base_layout, gpus, platform, version, observations, node_observations
    )
    notes.extend(observed_notes)
    ctx = _Context(
        facts, args, gpus, options, platform, observed, derived, target, by_rank, tuple(observations)
    )

    if weight_cache_mode(args):
        notes.append(unchanged_key_note(args))
    run_args = _pinned(args, gpus, observed, options) if options.pin_kv_cache_memory else args
    if run_args is not args:
        notes.append(f"the pool is pinned at the calibrated warm budget ({PIN_REASON}); {PIN_TRADE_OFF}")
    layout, outcome, run_warnings = _run(ctx, run_args, target, options.allow_long, same_config=True)
    cold = ctx.cold_boot(run_args, target) if outcome.lines else None
    if cold is not None:
        notes.append(cold.note())
        if observed is not None and observed.available_kv is not None:
            notes.append(pin_offer(_pinned(args, gpus, observed, options).kv_cache_memory_bytes or 0, target))
    warnings.extend(run_warnings)
    feasibility = _Feasibility.of(ctx, outcome, derived_key)
    warnings.extend(feasibility.warnings)
    warnings.extend(_unit_warnings(ctx, layout))
    notes.extend(_estimated_terms_notes(outcome.lines))
    named = not_modelled_flags(args, facts, version, options.expert_weight_bytes is not None)
    named_warning = named_flags_warning(
        named,
        min((line.total.bytes or 0 for line in outcome.lines), default=None),
        observed is not None and observed.available_kv is not None,
    )
    if named_warning:
        warnings.append(named_warning)
    notes.extend(_blocks_notes(layout, outcome, target))
    alternatives: tuple[Alternative, ...] = ()
    if not feasibility.feasible:
        search = Search(
            facts, args, gpus, platform, derived, target, options.allow_long, options.concurrency,
            partial(_trial, ctx), options.vllm_version,
        )  # fmt: skip
        alternatives = find_alternatives(search, layout, outcome.max_context, feasibility.refused)
    said = _Said(tuple(warnings), tuple(notes), tuple(named))
    return replace(
        _assembled_plan(ctx, layout, outcome, feasibility, derived_key, alternatives, said), cold_boot=cold
    )


def _pinned(
    args: ServeArgs, gpus: GpuState | None, observed: Observed | None, options: PlanOptions
) -> ServeArgs:
    """The unit's flags with the pool pinned at the calibrated warm budget (core/cold_boot.py), at the
    utilisation the unit runs at; a pool the unit already pins stays. UsageError on a plan no start
    calibrated."""
    if args.kv_cache_memory_bytes is not None:
        return args
    if observed is None or observed.available_kv is None or observed.utilization is None:
        raise UsageError(UNCALIBRATED_PIN)
    totals = [info.total_bytes for info in gpus.gpus] if gpus is not None else []
    at_start = observed.requested_at_start or requested_bytes(max(totals or [0]), observed.utilization)
    u = options.fixed_gpu_memory_utilization or args.gpu_memory_utilization or observed.utilization
    pool = pinned_pool_bytes(observed.available_kv, at_start, totals, u)
    return replace(args, kv_cache_memory_bytes=pool)


def _check_plan_options(options: PlanOptions) -> None:
    """The caller's own numbers (target, utilisation cap, concurrency) before any of vLLM's rules."""
    target = options.target_context
    if not isinstance(target, int) or target < 1:
        raise UsageError(f"the target context must be a positive number of tokens, not {target!r}")
    if not 0 < options.max_gpu_memory_utilization <= 1:
        raise UsageError("the gpu_memory_utilization cap must be in (0, 1]")
    if not isinstance(options.concurrency, int) or options.concurrency < 1:
        raise UsageError(
            f"the concurrency must be a positive number of requests, not {options.concurrency!r}"
        )


def _refuse_what_vllm_refuses(
    facts: ModelFacts, args: ServeArgs, target: int, platform: Platform, version: VllmVersion
) -> None:
    """What vLLM's parser refuses, then what its configs refuse (core/deployment.py vllm_refusals),
    before any layout is planned from it: a plan for a unit vLLM would not start is no plan."""
    if args.refusals:
        raise UsageError(f"vLLM refuses this configuration: {args.refusals[0]}")
    default_mnbt = kv_cache_layout(facts, args, platform, version).max_num_batched_tokens
    refusals = vllm_refusals(args, target, facts, version, default_mnbt, gpu=not platform.is_cpu)
    if refusals:
        raise UsageError(f"vLLM refuses this configuration: {refusals[0]}")


def _gguf_said(facts: ModelFacts, version: VllmVersion) -> tuple[list[str], list[str]]:
    """(warnings, notes) of a GGUF plan: every GGUF result carries a note (docs/vllm-accounting.md 8),
    and a vLLM without a GGUF loader is warned of, so the verdict is not read as "vLLM loads it"."""
    if facts.source_format != "gguf":
        return [], []
    note = "GGUF: the facts follow the GGUF path of vLLM's releases before 0.33 (transformers' GGUF config)"
    if tuple(version) < NO_GGUF_LOADER_SINCE:
        return [], [note]
    release = ".".join(map(str, version))
    return [
        f"vLLM {release} has no GGUF loader (GGUF moved to an out-of-tree plugin): it loads this model "
        "only where that plugin is installed; the verdict assumes it is (plan with --vllm-version of the "
        "vLLM that serves it)"
    ], [note]


def _version_warnings(version: VllmVersion) -> list[str]:
    """A vLLM version ctxmgr has no row for (its rules are the nearest release's), and the terms older
    releases had that the plan does not model."""
    warnings: list[str] = []
    _, unknown_version = known_version(version)  # rule() itself answers with the nearest release's row
    if unknown_version:
        warnings.append(unknown_version)
    warnings.extend(
        f"not modelled for vLLM {'.'.join(map(str, version))}: {term}"
        for term in not_modelled_before_oldest(version)
    )
    return warnings


def _observed_budgets(
    base_layout: KVCacheLayout,
    gpus: GpuState | None,
    platform: Platform,
    version: VllmVersion,
    observations: Sequence[Observation],
    node_observations: Sequence[NodeObservation],
) -> tuple[Observed | None, dict[int, Observed], list[str]]:
    """What earlier starts measured: this service's own (the calibration) and, per global rank, each other
    node's last start in a multi-node deployment; and the notes on how they were read."""
    by_rank: dict[int, Observed] = {}
    node_notes: list[str] = []
    if node_observations and gpus is not None:
        names = [info.name for info in gpus.gpus]
        by_rank, node_notes = node_observed(node_observations, names, base_layout, version, platform)
    observed, observation_notes = observed_memory(
        observations, base_layout, version, platform, own_budget=bool(by_rank)
    )
    return observed, by_rank, observation_notes + node_notes


@dataclass(frozen=True)
class _Feasibility:
    """Whether the target fits and the reason the plan prints: above the model's derived max_model_len
    vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set (then the env change and vLLM's own
    warning); else the evaluation's verdict, with the KV cache per GPU where it fits."""

    feasible: bool
    reason: str
    refused: bool  # above the derived maximum and not allowed long: vLLM refuses the target itself
    env_changes: dict[str, str]
    warnings: tuple[str, ...]

    @classmethod
    def of(cls, ctx: _Context, outcome: _Outcome, derived_key: str | None) -> _Feasibility:
        target, derived, options, args = ctx.target, ctx.derived, ctx.options, ctx.args
        above_derived = derived is not None and target > derived
        key_text = f"{derived_key}={derived}" if derived_key else f"{derived}"
        if above_derived and not options.allow_long:
            reason = (
                f"{target} tokens is above the model's derived maximum ({key_text}); vLLM refuses it "
                f"unless {ALLOW_LONG_ENV}=1"
            )
            return cls(False, reason, True, {}, ())
        env_changes: dict[str, str] = {}
        warnings: list[str] = []
        reason = outcome.verdict
        if (
            outcome.feasible
            and outcome.lines
            and outcome.utilization is not None
            and not outcome.verdict.startswith(WEIGHTS_UNKNOWN)
        ):
            needed = max(line.kv_needed.bytes or 0 for line in outcome.lines)
            requests = (
                "one request" if options.concurrency == 1 else f"{options.concurrency} requests at once"
            )
            reason = (
                f"fits at gpu_memory_utilization {outcome.utilization:.2f}: {needed / GIB:.2f} GiB "
                f"of KV cache per GPU for {requests} of {target} tokens"
            )
        if above_derived:
            if args.env.get(ALLOW_LONG_ENV) not in ("1", "true", "True"):
                env_changes[ALLOW_LONG_ENV] = "1"
            warnings.append(
                f"{target} tokens is above the derived maximum ({key_text}): positions past it were never "
                "trained; with RoPE they can produce garbage or NaN (vLLM's own warning)"
            )
        return cls(outcome.feasible, reason, False, env_changes, tuple(warnings))


def _unit_warnings(ctx: _Context, layout: KVCacheLayout) -> list[str]:
    """What the plan warns about the unit beyond the fit: an unknown derived max_model_len, one node of a
    multi-node deployment planned alone, --max-model-len auto on a vLLM without it, and a startup check
    that counts less than the blocks take."""
    args, target, version = ctx.args, ctx.target, ctx.options.vllm_version
    warnings: list[str] = []
    if ctx.derived is None:
        warnings.append("the model's maximum length is unknown: max_context is bounded by the target")
    node_flag = multi_node_flag(args)
    if node_flag is not None and not ctx.options.whole_deployment:
        warnings.append(
            f"{node_flag}: this unit is one node of a multi-node deployment; the plan is this node's GPUs "
            "only: `ctxmgr deployment plan CONTEXT --node HOST:UNIT ...` plans every node's"
        )
    if args.max_model_len == -1 and not supports_auto_max_model_len(version):
        warnings.append("this vLLM version has no --max-model-len auto")
    if layout.check_undercounts(target):
        warnings.append(
            f"vLLM {'.'.join(map(str, version))}'s startup check counts "
            f"{layout.check_needed_bytes(target):,} B for one request of {target} tokens, less than the "
            f"{layout.bytes_needed(target):,} B its blocks take: it may start and still not hold that request"
        )
    return warnings


def _blocks_notes(layout: KVCacheLayout, outcome: _Outcome, target: int) -> list[str]:
    """How many KV-cache blocks one request of the target takes, where the plan has a utilisation."""
    if not (outcome.lines and outcome.utilization is not None and outcome.utilization > 0):
        return []
    null_block = " (+1 null block)" if layout.null_block_reserve() else ""
    return [
        f"blocks: {layout.blocks_needed(target)} per request of {target} tokens, "
        f"{layout.bytes_per_block} B each{null_block}"
    ]


@dataclass(frozen=True)
class _Said:
    """What the plan tells besides its figures, in the order found (repeats dropped when assembled)."""

    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    not_modelled: tuple[NamedFlag, ...]


def _assembled_plan(
    ctx: _Context,
    layout: KVCacheLayout,
    outcome: _Outcome,
    feasibility: _Feasibility,
    derived_key: str | None,
    alternatives: tuple[Alternative, ...],
    said: _Said,
) -> Plan:
    """The Plan from the pass's results: the flags to write only where the target fits, the env change
    only then too, and no least utilisation for a target vLLM refuses."""
    target, options, feasible = ctx.target, ctx.options, feasibility.feasible
    return Plan(
        concurrency=options.concurrency,
        capacity=_capacity(layout, outcome, target),
        feasible=feasible,
        reason=feasibility.reason,
        verdict=outcome.verdict,
        max_model_len=target,
        gpu_memory_utilization=outcome.utilization,
        max_context=outcome.max_context,
        kv_bytes_per_gpu=layout.bytes_needed(target),
        kv_bytes_per_token_per_gpu=layout.bytes_per_token(),
        kv_cache_memory_bytes=outcome.kv_cache_memory_bytes,
        derived_max_model_len=ctx.derived,
        derived_max_model_len_key=derived_key,
        vllm_version=options.vllm_version,
        platform=ctx.platform,
        layout=layout,
        gpus=outcome.lines,
        flag_changes=_flag_changes(ctx.args, outcome, target, options) if feasible else {},
        env_changes=feasibility.env_changes if feasible else {},
        alternatives=alternatives,
        warnings=tuple(dict.fromkeys(said.warnings)),
        notes=tuple(dict.fromkeys(said.notes + tuple(layout.notes))),
        not_modelled=said.not_modelled,
        least_gpu_memory_utilization=outcome.least if not feasibility.refused else None,
        max_context_limit=_context_limit(outcome.max_context, ctx.derived, target, options.allow_long),
        confidence=_confidence(outcome, ctx.observed),
    )


def _confidence(outcome: _Outcome, observed: Observed | None) -> Confidence:
    """calibrated / estimated / exact, from the budgets the plan used (core/confidence.py)."""
    if not outcome.lines and outcome.budget is None:
        return Confidence("unknown", "no memory information")
    explicit = outcome.kv_cache_memory_bytes is not None
    return plan_confidence([line.kv_budget.source for line in outcome.lines], observed, explicit)


def _context_limit(max_context: int, derived: int | None, target: int, allow_long: bool) -> str:
    """What sets the largest context that fits: the model's derived maximum, the target (no maximum is
    known, or a long context is allowed: nothing above the target is searched), or the memory."""
    if derived is not None and not allow_long and max_context >= derived:
        return "model"
    if (derived is None or allow_long) and max_context >= max(target, derived or 0):
        return "target"
    return "memory"


_ESTIMATED_FIGURES = ("activation_peak", "non_torch", "cuda_graphs", "startup_overhead")


def _estimated_terms_notes(lines: Sequence[GpuMemory]) -> list[str]:
    """One note naming the non-KV terms that are core/memory.py's guesses, not vLLM's logged figures."""
    if not lines:
        return []
    first = lines[0]
    names = [
        name
        for name in _ESTIMATED_FIGURES
        if getattr(first, name).source.startswith("estimate") and getattr(first, name).bytes
    ]
    if not names:
        return []
    return [f"estimated terms: {', '.join(names)} (core/memory.py; the margin is widened by their spread)"]


def _capacity(layout: KVCacheLayout, outcome: _Outcome, target: int) -> tuple[KVCapacity, ...]:
    """vLLM's capacity line per engine at the planned budget (none where that budget is a guess)."""
    if layout.blocks_needed(target) == 0:
        return ()  # attention-free: vLLM's concurrency has no denominator

    def capacity(gpus: tuple[int, ...], budgets: int | list[int]) -> KVCapacity:
        concurrency = layout.max_concurrency(budgets, target)
        return KVCapacity(
            gpus=gpus,
            num_gpu_blocks=layout.num_gpu_blocks(budgets),
            kv_cache_tokens=layout.capacity_tokens(budgets, target),
            max_concurrency=float(f"{concurrency:.2f}"),
        )

    if not outcome.lines:
        return () if outcome.budget is None else (capacity((), outcome.budget),)
    if any(
        line.kv_budget.bytes is None or "without weights" in line.kv_budget.source for line in outcome.lines
    ):
        return ()
    ranks = layout.tensor_parallel_size * layout.pipeline_parallel_size
    engines = []
    for first in range(0, len(outcome.lines), ranks):
        lines = outcome.lines[first : first + ranks]
        budgets = [
            min(line.kv_budget.bytes or 0 for line in lines if line.pipeline_stage == s)
            for s in range(layout.pipeline_parallel_size)
        ]
        engines.append(capacity(tuple(line.index for line in lines), budgets))
    return tuple(engines)
