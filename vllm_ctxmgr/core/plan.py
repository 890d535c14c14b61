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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from vllm_ctxmgr.core import facts as facts_module
from vllm_ctxmgr.core.facts import LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, Platform, platform_for
from vllm_ctxmgr.core.kv.backends import is_quantized_kv_cache
from vllm_ctxmgr.core.kv.layout import KVCacheLayout, kv_cache_layout
from vllm_ctxmgr.core.kv.specs import cdiv, round_up
from vllm_ctxmgr.core.memory import NonKvMemory, margin_widening, non_kv_memory
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, VllmVersion, known_version, rule, rules_in_force
from vllm_ctxmgr.errors import CtxmgrError, UsageError

MIB = 1 << 20
DEFAULT_MAX_GPU_MEMORY_UTILIZATION = 0.95
DEFAULT_MARGIN_FRACTION = 0.02
DEFAULT_MARGIN_MIN_BYTES = 512 * MIB
SMALL_BATCH_TOKENS = 2048
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
PLAN_SCHEMA = 1  # PlanRecord["schema"]: bump when a stored plan's keys change meaning


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
    margin its plan kept; see the module docstring for why 2% and 512 MiB.
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


def supports_auto_max_model_len(vllm_version: VllmVersion) -> bool:
    """`--max-model-len auto` / -1 (rule auto_max_model_len: from 0.14.0)."""
    return rule("auto_max_model_len", vllm_version)


def parse_vllm_version(text: str | None) -> VllmVersion | None:
    """'0.32.0+cpu', 'v0.11.0' -> (0, 32, 0)."""
    if not text:
        return None
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        return None
    return tuple(int(part) for part in match.groups(default="0"))


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
    platform: Platform | None = None
    cpu: bool = False
    # size for this many requests of the full context at once: the KV need is N x blocks per request
    concurrency: int = 1


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
class Alternative:
    """Another way to reach (or approach) the target, with its own numbers."""

    name: str
    description: str
    flag_changes: dict[str, str]
    env_changes: dict[str, str]
    feasible: bool
    max_context: int
    gpu_memory_utilization: float | None
    kv_cache_dtype: str
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    verdict: str
    needs_gpus: int = 0  # GPUs it needs beyond those the service sees
    rank: int = 0

    def to_json(self) -> dict:
        """One entry of PlanRecord["alternatives"]: another way to the target, with its flags and figures."""
        return {
            "rank": self.rank,
            "name": self.name,
            "description": self.description,
            "feasible": self.feasible,
            "max_context": self.max_context,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "flag_changes": dict(self.flag_changes),
            "env_changes": dict(self.env_changes),
            "verdict": self.verdict,
            "needs_gpus": self.needs_gpus,
        }


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

    def to_json(self) -> dict[str, Any]:
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
    verdict: str  # the memory verdict: "fits", "does not fit", "weights unknown ...", ...
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
            "feasible": self.feasible,
            "reason": self.reason,
            "verdict": self.verdict,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_context": self.max_context,
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
            },
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "flag_changes": dict(self.flag_changes),
            "env_changes": dict(self.env_changes),
            "alternatives": [alt.to_json() for alt in self.alternatives],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "layout": self.layout.summary(self.max_model_len),
        }


# --------------------------------------------------------------------------------------------------
# The stored plan: its schema and the readers' accessors
# --------------------------------------------------------------------------------------------------


class FigureRecord(TypedDict):
    """A Figure in a stored plan: bytes (None where unknown) and where they came from."""

    bytes: int | None
    source: str


class VllmRuleRecord(TypedDict):
    """One version rule a stored plan followed: its name, the release it holds since, its value."""

    rule: str
    since: str
    value: Any


def _json_value(value: Any) -> Any:
    """A rule value as plain JSON (tuples become lists)."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    return value


class PlatformRecord(TypedDict):
    """The platform a stored plan was made for: Platform without its batch-default inputs."""

    device_type: str
    compute_capability: tuple[int, int] | list[int] | None
    device_name: str | None


class PlanRecord(TypedDict):
    """`Plan.to_json()`: what `ctxmgr plan --json` prints and each revision stores as its plan.

    Stored plans are read back (verify, deploy's calibration) long after the planner that wrote
    them, so the keys are declared here once and read through `StoredPlan`, not by string at each
    reader. `schema` is PLAN_SCHEMA; plans stored before the field existed have schema 1's keys.
    `gpus` holds `GpuMemory.to_json()` entries (every figure a FigureRecord), `layout` is
    `KVCacheLayout.summary(max_model_len)`, `alternatives` `Alternative.to_json()` entries,
    `capacity` `KVCapacity.to_json()` entries (kv_cache_tokens / max_concurrency: their minimum).
    `kv_bytes_per_gpu` is one request; the GPU lines' kv_needed is `concurrency` requests.
    """

    schema: int
    feasible: bool
    reason: str
    verdict: str
    max_model_len: int
    gpu_memory_utilization: float | None
    max_context: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_memory_bytes: int | None
    null_block_bytes: int
    concurrency: int
    kv_cache_tokens: int | None
    max_concurrency: float | None
    capacity: list[dict[str, Any]]
    derived_max_model_len: int | None
    derived_max_model_len_key: str | None
    vllm_version: str
    vllm_rules: list[VllmRuleRecord]
    platform: PlatformRecord
    gpus: list[dict[str, Any]]
    flag_changes: dict[str, str]
    env_changes: dict[str, str]
    alternatives: list[dict[str, Any]]
    warnings: list[str]
    notes: list[str]
    layout: dict[str, Any]


def _record_bytes(entry: Mapping[str, Any], name: str) -> int | None:
    figure = entry.get(name)
    if isinstance(figure, Mapping):
        value = figure.get("bytes")
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    return None


def _record_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class StoredPlan:
    """A PlanRecord read back from a revision, with typed accessors for what its readers need.

    Tolerant of a missing or partial record (a revision written without a plan answers None), not
    of a record from a newer ctxmgr whose keys may mean something else.
    """

    record: Mapping[str, Any]

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> StoredPlan:
        """Refuses a newer ctxmgr's record (its keys may mean other things); none or an old one: schema 1."""
        data = data or {}
        schema = data.get("schema", 1)
        if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
            raise CtxmgrError(f"the stored plan has no valid schema ({schema!r})")
        if schema > PLAN_SCHEMA:
            raise CtxmgrError(
                f"the stored plan has schema {schema}; this ctxmgr reads up to {PLAN_SCHEMA}: upgrade ctxmgr"
            )
        return cls(data)

    @property
    def schema(self) -> int:
        """PLAN_SCHEMA of the ctxmgr that stored the plan; 1 for plans stored before the key existed."""
        return int(self.record.get("schema", 1))

    @property
    def gpus(self) -> list[Mapping[str, Any]]:
        """The plan's GPU lines (GpuMemory.to_json()), in rank order."""
        lines = self.record.get("gpus") or []
        return [line for line in lines if isinstance(line, Mapping)]

    @staticmethod
    def figure(line: Mapping[str, Any], name: str) -> int | None:
        """One GPU line's figure in bytes ("kv_budget", "margin", ...), None where unknown."""
        return _record_bytes(line, name)

    @property
    def max_model_len(self) -> int | None:
        """The --max-model-len planned: the plan's margins hold only while the unit still runs it."""
        return _record_int(self.record.get("max_model_len"))

    @property
    def gpu_memory_utilization(self) -> float | None:
        """The utilisation planned: a unit that runs another has its KV budgets moved from this one."""
        value = self.record.get("gpu_memory_utilization")
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """The explicit KV budget planned (--kv-cache-memory-bytes): it does not move with utilisation."""
        return _record_int(self.record.get("kv_cache_memory_bytes"))

    @property
    def kv_bytes_per_token_per_gpu(self) -> int | None:
        """Marginal KV bytes per token: turns a logged KV budget into tokens where vLLM logged none."""
        return _record_int(self.record.get("kv_bytes_per_token_per_gpu"))

    @property
    def layout(self) -> Mapping[str, Any]:
        """The plan's KVCacheLayout.summary; {} for a plan stored without one."""
        layout = self.record.get("layout")
        return layout if isinstance(layout, Mapping) else {}

    @property
    def bytes_per_block(self) -> int | None:
        """One pool block (= the null block) on the GPU that needs the most."""
        return _record_int(self.record.get("null_block_bytes")) or _record_int(
            self.layout.get("bytes_per_block")
        )

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block the plan assumed (the attention backend's); None without a layout."""
        return _record_int(self.layout.get("block_size"))

    @property
    def margins(self) -> list[int]:
        """The margin the plan kept on each GPU (0s of an explicit budget left out)."""
        return [m for m in (_record_bytes(line, "margin") for line in self.gpus) if m]

    def min_kv_budget_bytes(self, at_utilization: float | None = None) -> int | None:
        """The smallest planned KV budget over the GPUs (the binding one: vLLM takes the min over workers).

        `at_utilization` moves each GPU's budget to the utilisation the unit really runs with (not
        for an explicit --kv-cache-memory-bytes budget, which does not move). Without GPU lines:
        the explicit budget, if the plan set one.
        """
        explicit = self.kv_cache_memory_bytes
        planned_u = self.gpu_memory_utilization
        budgets = []
        for line in self.gpus:
            budget = _record_bytes(line, "kv_budget")
            if budget is None:
                continue
            total, requested = _record_bytes(line, "total"), _record_bytes(line, "requested")
            if (
                at_utilization is not None
                and not explicit
                and planned_u is not None
                and abs(at_utilization - planned_u) > 1e-9
                and total
                and requested
            ):
                budget = kv_budget_at_utilization(budget, requested, total, at_utilization)
            budgets.append(budget)
        return min(budgets) if budgets else explicit


# --------------------------------------------------------------------------------------------------
# Observations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Observed:
    """What an earlier start of the same service tells about non-KV memory."""

    available_kv: int | None  # the KV budget it had, at `utilization`
    utilization: float | None
    budget_source: str
    weights: int | None
    cuda_graphs: int | None
    estimated_max_model_len: int | None
    requested_at_start: int | None = None  # ceil(total x u) at that start, where its total is known


def _applicable(obs: Observation, version: VllmVersion, platform: Platform) -> bool:
    observed_version = parse_vllm_version(obs.vllm_version)
    if observed_version is not None and observed_version[:3] != tuple(version[:3]):
        return False
    if obs.gpu_name and platform.device_name and not platform.is_cpu and obs.gpu_name != platform.device_name:
        return False  # another GPU model: its memory figures say nothing about this one
    return obs.platform is None or (obs.platform.upper() == "CPU") == platform.is_cpu


def _observed(
    observations: Sequence[Observation], layout: KVCacheLayout, version: VllmVersion, platform: Platform
) -> tuple[_Observed | None, list[str]]:
    notes: list[str] = []
    usable = [obs for obs in observations if _applicable(obs, version, platform)]
    if len(usable) < len(observations):
        notes.append(
            f"ignored {len(observations) - len(usable)} earlier start(s) of another vLLM version or device"
        )
    if not usable:
        return None, notes
    with_budget = [
        obs
        for obs in usable
        if obs.kv_cache_memory_bytes is None
        and (obs.available_kv_gib is not None or obs.estimated_max_model_len or obs.num_gpu_blocks)
    ]
    latest = with_budget[-1] if with_budget else usable[-1]
    u_obs = latest.gpu_memory_utilization or default_gpu_memory_utilization(version)
    available: int | None = None
    source = ""
    estimated = None
    if latest in with_budget:
        if latest.estimated_max_model_len:
            # the failed check: needed(est) <= available - one block < needed(est + 1)
            estimated = latest.estimated_max_model_len
            available = layout.check_needed_bytes(estimated) + layout.null_block_reserve()
            source = f"vllm log (estimated maximum model length {estimated})"
        elif latest.num_gpu_blocks is not None:
            # exact to one block: vLLM made floor(budget / bytes_per_block) blocks
            available = latest.num_gpu_blocks * layout.bytes_per_block + layout.bytes_per_block // 2
            source = "vllm metrics (num_gpu_blocks)"
        elif latest.available_kv_gib is not None:
            available = int(latest.available_kv_gib * GIB)
            source = "vllm log"
        notes.append(f"KV budget from an earlier start at gpu_memory_utilization {u_obs:.2f}: {source}")
    weights = next(
        (int(o.model_loading_gib * GIB) for o in reversed(usable) if o.model_loading_gib is not None), None
    )
    graphs = next(
        (int(o.cuda_graph_gib * GIB) for o in reversed(usable) if o.cuda_graph_gib is not None), None
    )
    if available is None and weights is None and graphs is None:
        return None, notes
    requested_at_start = (
        math.ceil(latest.total_memory_gib * GIB * u_obs)
        if available is not None and latest.total_memory_gib is not None
        else None
    )
    return _Observed(
        available,
        u_obs if available is not None else None,
        source,
        weights,
        graphs,
        estimated,
        requested_at_start,
    ), notes


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
    observed: _Observed | None
    margin: int

    @property
    def total(self) -> int:
        return self.info.total_bytes

    @property
    def free_at_start(self) -> int:
        return self.total - (self.others.bytes or 0) - self.overhead

    @property
    def has_observed_budget(self) -> bool:
        return self.observed is not None and self.observed.available_kv is not None

    def requested(self, utilization: float) -> int:
        return requested_bytes(self.total, utilization)

    def non_kv(self) -> int:
        if self.has_observed_budget:
            assert self.observed is not None and self.observed.utilization is not None
            requested = self.observed.requested_at_start or self.requested(self.observed.utilization)
            return requested - (self.observed.available_kv or 0)
        graphs = (self.cuda_graphs.bytes or 0) if self.graphs_in_budget else 0
        return (self.weights.bytes or 0) + (self.activation.bytes or 0) + (self.non_torch.bytes or 0) + graphs

    def budget(self, utilization: float) -> int:
        """The KV budget vLLM would find on this GPU at `utilization`."""
        if self.has_observed_budget:
            assert self.observed is not None and self.observed.utilization is not None
            observed_requested = self.observed.requested_at_start or self.requested(self.observed.utilization)
            return kv_budget_at_utilization(
                self.observed.available_kv or 0, observed_requested, self.total, utilization
            )
        return self.requested(utilization) - self.non_kv()

    def max_utilization(self) -> float:
        """The largest utilisation (0.01 steps) vLLM's startup free-memory check accepts here."""
        room = self.free_at_start
        if not self.graphs_in_budget:
            room -= self.cuda_graphs.bytes or 0  # graphs are captured in the memory above `requested`
        best = 0.0
        for k in range(1, 101):
            if self.requested(k / 100) <= room:
                best = k / 100
        return best

    def weights_known(self) -> bool:
        return self.has_observed_budget or self.weights.bytes is not None


def _weights(facts: ModelFacts, options: PlanOptions, observed: _Observed | None, ranks: int) -> Figure:
    """Per-GPU weights: as vLLM logged them, else the option, else the model files split over the ranks."""
    if observed is not None and observed.weights is not None:
        return Figure(observed.weights, "vllm log")
    if options.weights_bytes is not None:
        return Figure(options.weights_bytes // ranks, "option")
    if facts.weight_bytes is not None:
        source = facts.provenance.get("weight_bytes") or (
            "gguf" if facts.source_format == "gguf" else "safetensors"
        )
        return Figure(facts.weight_bytes // ranks, source)
    return Figure(None, "unknown")


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
    observed: _Observed | None,
    warnings: list[str],
) -> list[_Gpu]:
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
    weights = _weights(facts, options, observed, ranks)
    cpu = options.cpu or (options.platform is not None and options.platform.is_cpu)
    models = []
    for rank, info in enumerate(gpus.gpus[:world]):
        stage = (rank % ranks) // tp
        memory = _non_kv_estimate(facts, args, options, layout, info, world, cpu, stage == pp - 1)
        graphs = Figure(memory.cuda_graphs.bytes, memory.cuda_graphs.source)
        if observed is not None and observed.cuda_graphs is not None:
            graphs = Figure(observed.cuda_graphs, "vllm log")
        margin = margin_bytes(info.total_bytes, options.margin_fraction, options.margin_min_bytes)
        if observed is None or observed.available_kv is None:
            margin += margin_widening(memory, graphs_counted and graphs.source != "vllm log")
        peak = memory.activation_peak
        models.append(
            _Gpu(
                info=info,
                stage=stage,
                total_source=source,
                others=_used_by_others(info, options.service_pids, source, warnings),
                overhead=memory.startup_overhead.bytes,
                weights=weights,
                activation=Figure(peak.bytes, peak.source),
                non_torch=Figure(memory.non_torch.bytes, memory.non_torch.source),
                cuda_graphs=graphs,
                graphs_in_budget=graphs_counted,
                observed=observed,
                margin=margin,
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


def _kv_needed(layout: KVCacheLayout, target: int, stage: int, requests: int) -> int:
    """What vLLM's check needs on a worker of `stage`: `requests` x one request (+ the null block, 0.29+)."""
    return layout.check_needed_bytes(target, stage, requests) + layout.null_block_reserve(stage)


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
    kv_needed = _kv_needed(layout, target, gpu.stage, requests)
    if gpu.has_observed_budget:
        assert gpu.observed is not None
        non_kv = Figure(gpu.non_kv(), "vllm log")
        weights = gpu.weights
        graphs_counted = (gpu.cuda_graphs.bytes or 0) if gpu.graphs_in_budget else 0
        rest = max(0, gpu.non_kv() - (weights.bytes or 0) - graphs_counted)
        activation = Figure(rest, "vllm log (activation + non-torch)")
        non_torch = Figure(0, "vllm log (in activation peak)")
    else:
        known = gpu.weights.bytes is not None
        non_kv = Figure(gpu.non_kv() if known else None, "estimate" if known else "unknown (weights unknown)")
        weights, activation, non_torch = gpu.weights, gpu.activation, gpu.non_torch
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


def _explicit_budget(args: ServeArgs, platform: Platform) -> tuple[int | None, str]:
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


def _evaluate(
    layout: KVCacheLayout,
    args: ServeArgs,
    gpus: list[_Gpu] | None,
    options: PlanOptions,
    platform: Platform,
    observed: _Observed | None,
    target: int,
    upper: int,
    same_config: bool,
) -> _Outcome:
    """Does `target` fit on these GPUs, at which utilisation, and what is the most that fits?"""
    current_u = args.gpu_memory_utilization or default_gpu_memory_utilization(options.vllm_version)
    explicit, explicit_source = _explicit_budget(args, platform)
    requests = options.concurrency
    need_by_stage = [_kv_needed(layout, target, s, requests) for s in range(layout.pipeline_parallel_size)]

    if not gpus:
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

    if explicit is not None:
        return _evaluate_explicit(
            layout, args, gpus, options, target, upper, explicit, explicit_source, current_u
        )

    cap = options.max_gpu_memory_utilization
    u_limit = min([cap] + [g.max_utilization() for g in gpus])
    weights_known = all(g.weights_known() for g in gpus)

    def need(g: _Gpu) -> int:
        return need_by_stage[g.stage] + g.margin

    u_needed: float | None = 0.0
    for g in gpus:
        smallest = next((k / 100 for k in range(1, 101) if g.budget(k / 100) >= need(g)), None)
        u_needed = None if smallest is None or u_needed is None else max(u_needed, smallest)

    max_context = 0
    if u_limit >= 0.01:
        max_context = layout.max_model_len_for(
            _stage_min(gpus, layout, lambda g: g.budget(u_limit) - g.margin), upper, requests
        )
    if (
        same_config
        and observed is not None
        and observed.estimated_max_model_len
        and observed.utilization is not None
        and u_limit <= observed.utilization
    ):
        max_context = min(max_context, observed.estimated_max_model_len)

    budget_source = observed.budget_source if observed and observed.available_kv is not None else "estimate"
    if not weights_known:
        # Plan at the most vLLM will take and say how large the weights may be.
        u = u_limit
        allowance = min(g.budget(u) - need(g) for g in gpus) if u >= 0.01 else -1
        feasible = allowance >= 0
        if feasible:
            verdict = f"weights unknown: fits if the weights take at most {allowance / GIB:.2f} GiB per GPU"
        else:
            verdict = "does not fit even without weights"
        lines = tuple(
            _line(
                g, layout, target, g.requested(u), g.budget(u), "estimate without weights", g.margin, requests
            )
            for g in gpus
        )
        return _Outcome(feasible, verdict, u, max_context, lines, None)

    fixed = options.fixed_gpu_memory_utilization
    if fixed is not None:
        fits_kv = all(g.budget(fixed) >= need_by_stage[g.stage] for g in gpus)
        fits_memory = fixed <= min(g.max_utilization() for g in gpus) + 1e-9
        if fits_kv and fits_memory:
            verdict = f"fits at the chosen gpu_memory_utilization {fixed:.2f}"
        elif not fits_memory:
            verdict = (
                f"does not fit: the free memory allows gpu_memory_utilization {u_limit:.2f}, not {fixed:.2f}"
            )
        else:
            verdict = f"does not fit: the KV budget at gpu_memory_utilization {fixed:.2f} is too small"
        lines = tuple(
            _line(g, layout, target, g.requested(fixed), g.budget(fixed), budget_source, g.margin, requests)
            for g in gpus
        )
        return _Outcome(fits_kv and fits_memory, verdict, fixed, max_context, lines, None)

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
        verdict = "does not fit: even the whole GPU is too small"
    lines = tuple(
        _line(g, layout, target, g.requested(u), g.budget(u), budget_source, g.margin, requests) for g in gpus
    )
    return _Outcome(feasible, verdict, u, max_context, lines, None)


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
    needed = max(_kv_needed(layout, target, s, requests) for s in range(layout.pipeline_parallel_size))
    kv_bytes = explicit if layout.fits(target, explicit, requests) else round_up(needed, MIB)
    room = [g.free_at_start - g.non_kv() - g.margin for g in gpus]
    fits_physically = all(kv_bytes <= r for r in room)
    u_max = min(g.max_utilization() for g in gpus)
    u = min(current_u, u_max)
    feasible = fits_physically and u >= 0.01
    weights_known = all(g.weights_known() for g in gpus)
    if not feasible:
        verdict = f"the GPUs cannot hold a {kv_bytes / GIB:.2f} GiB KV cache next to the model"
    elif not weights_known:
        allowance = (min(room) - kv_bytes) / GIB
        verdict = f"weights unknown: fits if the weights take at most {allowance:.2f} GiB per GPU"
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
    derive = getattr(facts_module, "derived_max_model_len", None)
    if derive is None:
        return None, None
    try:
        value, key = derive(facts, options.vllm_version, args.disable_sliding_window)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if key == getattr(facts_module, "NO_LENGTH_KEY", None):
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
    observed: _Observed | None
    derived: int | None
    target: int


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
    layout = kv_cache_layout(ctx.facts, args, ctx.platform, ctx.options.vllm_version)
    # logged non-KV memory still holds when only the KV layout changes, not when the ranks change
    same_ranks = (args.tensor_parallel_size, args.pipeline_parallel_size) == (
        ctx.args.tensor_parallel_size,
        ctx.args.pipeline_parallel_size,
    )
    observed = ctx.observed if same_ranks else None
    gpu_state = gpus if gpus is not None else ctx.gpus
    models = None
    # on the CPU build the "device" is a NUMA node: --gpu-memory-utilization is a fraction of its memory
    if gpu_state is not None and (not ctx.platform.is_cpu or gpu_state.source == "numa"):
        models = _gpu_models(ctx.facts, args, gpu_state, ctx.options, layout, observed, warnings)
    upper = _upper(target, ctx.derived, allow_long)
    outcome = _evaluate(layout, args, models, ctx.options, ctx.platform, observed, target, upper, same_config)
    return layout, outcome, warnings


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


def make_plan(
    facts: ModelFacts,
    args: ServeArgs,
    gpus: GpuState | None,
    options: PlanOptions,
    observations: Sequence[Observation] = (),
) -> Plan:
    """Plan `options.target_context` for a service: flags, memory per GPU, alternatives if it does not fit.

    `observations` are earlier starts of this service, oldest first. Raises UsageError for a
    target below 1 or a configuration vLLM itself would reject (TP not dividing the heads, DCP
    with sliding windows, ...). An infeasible target is not an error: the plan says
    `feasible=False` with the reason, `max_context` and ranked alternatives.
    """
    target = options.target_context
    if not isinstance(target, int) or target < 1:
        raise UsageError(f"the target context must be a positive number of tokens, not {target!r}")
    if not 0 < options.max_gpu_memory_utilization <= 1:
        raise UsageError("the gpu_memory_utilization cap must be in (0, 1]")
    if not isinstance(options.concurrency, int) or options.concurrency < 1:
        raise UsageError(
            f"the concurrency must be a positive number of requests, not {options.concurrency!r}"
        )
    version = options.vllm_version
    platform = options.platform or platform_for(gpus, options.cpu)
    derived, derived_key = _derived(facts, args, options)
    warnings: list[str] = []
    notes: list[str] = list(args.notes)  # how the unit's arguments were read (a --config YAML)
    _, unknown_version = known_version(version)  # rule() itself answers with the nearest release's row
    if unknown_version:
        warnings.append(unknown_version)

    base_layout = kv_cache_layout(facts, args, platform, version)
    observed, observation_notes = _observed(observations, base_layout, version, platform)
    notes.extend(observation_notes)
    ctx = _Context(facts, args, gpus, options, platform, observed, derived, target)

    above_derived = derived is not None and target > derived
    refused = above_derived and not options.allow_long
    layout, outcome, run_warnings = _run(ctx, args, target, options.allow_long, same_config=True)
    warnings.extend(run_warnings)

    env_changes: dict[str, str] = {}
    key_text = f"{derived_key}={derived}" if derived_key else f"{derived}"
    if refused:
        feasible = False
        reason = (
            f"{target} tokens is above the model's derived maximum ({key_text}); vLLM refuses it unless "
            f"{ALLOW_LONG_ENV}=1"
        )
    else:
        feasible = outcome.feasible
        reason = outcome.verdict
        if feasible and outcome.lines and outcome.utilization is not None:
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
    if derived is None:
        warnings.append("the model's maximum length is unknown: max_context is bounded by the target")
    if outcome.verdict.startswith("weights unknown"):
        warnings.append(outcome.verdict)
    if args.max_model_len == -1 and not supports_auto_max_model_len(version):
        warnings.append("this vLLM version has no --max-model-len auto")
    if layout.check_undercounts(target):
        warnings.append(
            f"vLLM {'.'.join(map(str, version))}'s startup check counts "
            f"{layout.check_needed_bytes(target):,} B for one request of {target} tokens, less than the "
            f"{layout.bytes_needed(target):,} B its blocks take: it may start and still not hold that request"
        )
    notes.extend(_estimated_terms_notes(outcome.lines))
    if outcome.lines and outcome.utilization is not None and outcome.utilization > 0:
        null_block = " (+1 null block)" if layout.null_block_reserve() else ""
        notes.append(
            f"blocks: {layout.blocks_needed(target)} per request of {target} tokens, "
            f"{layout.bytes_per_block} B each{null_block}"
        )

    plan_flags = _flag_changes(args, outcome, target, options) if feasible else {}
    alternatives: tuple[Alternative, ...] = ()
    if not feasible:
        alternatives = _alternatives(ctx, layout, outcome, refused)
    return Plan(
        concurrency=options.concurrency,
        capacity=_capacity(layout, outcome, target),
        feasible=feasible,
        reason=reason,
        verdict=outcome.verdict,
        max_model_len=target,
        gpu_memory_utilization=outcome.utilization,
        max_context=outcome.max_context,
        kv_bytes_per_gpu=layout.bytes_needed(target),
        kv_bytes_per_token_per_gpu=layout.bytes_per_token(),
        kv_cache_memory_bytes=outcome.kv_cache_memory_bytes,
        derived_max_model_len=derived,
        derived_max_model_len_key=derived_key,
        vllm_version=version,
        platform=platform,
        layout=layout,
        gpus=outcome.lines,
        flag_changes=plan_flags,
        env_changes=env_changes if feasible else {},
        alternatives=alternatives,
        warnings=tuple(dict.fromkeys(warnings)),
        notes=tuple(dict.fromkeys(notes + list(layout.notes))),
    )


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


# --------------------------------------------------------------------------------------------------
# Alternatives
# --------------------------------------------------------------------------------------------------

_PREFERENCE = {
    "max-num-batched-tokens": 1,
    "kv-cache-memory-bytes": 2,
    "fp8-kv-cache": 3,
    "decode-context-parallel": 4,
    "tensor-parallel": 5,
    "shorter-context": 9,
    "allow-long": 10,  # last: positions past the trained length are a quality risk
}


def _alternative(
    ctx: _Context,
    name: str,
    description: str,
    args: ServeArgs,
    extra_flags: dict[str, str],
    target: int | None = None,
    allow_long: bool | None = None,
    gpus: GpuState | None = None,
    extra_env: dict[str, str] | None = None,
    needs_gpus: int = 0,
) -> Alternative | None:
    target = target or ctx.target
    allow = ctx.options.allow_long if allow_long is None else allow_long
    try:
        layout, outcome, _ = _run(ctx, args, target, allow, same_config=False, gpus=gpus)
    except UsageError:
        return None  # vLLM would reject this configuration for this model
    refused = ctx.derived is not None and target > ctx.derived and not allow
    env: dict[str, str] = dict(extra_env or {})
    if ctx.derived is not None and target > ctx.derived and allow:
        env[ALLOW_LONG_ENV] = "1"
    flags = {**extra_flags, **_flag_changes(args, outcome, target, ctx.options)}
    return Alternative(
        name=name,
        description=description,
        flag_changes=flags,
        env_changes=env,
        feasible=outcome.feasible and not refused,
        max_context=outcome.max_context,
        gpu_memory_utilization=outcome.utilization,
        kv_cache_dtype=layout.kv_cache_dtype,
        kv_bytes_per_gpu=layout.bytes_needed(target),
        kv_bytes_per_token_per_gpu=layout.bytes_per_token(),
        verdict=outcome.verdict,
        needs_gpus=needs_gpus,
    )


def _more_gpus(gpus: GpuState | None, count: int) -> GpuState | None:
    """The service's GPUs, repeated when the host shows fewer than `count` (same model, same tenants)."""
    if gpus is None or not gpus.gpus:
        return gpus
    chosen = list(gpus.gpus[:count])
    while len(chosen) < count:
        template = gpus.gpus[len(chosen) % len(gpus.gpus)]
        chosen.append(replace(template, index=len(chosen), processes=()))
    return GpuState(tuple(chosen), gpus.source, gpus.driver_version)


def _alternatives(
    ctx: _Context, layout: KVCacheLayout, outcome: _Outcome, refused: bool
) -> tuple[Alternative, ...]:
    args, facts = ctx.args, ctx.facts
    found: list[Alternative | None] = []
    tp = args.tensor_parallel_size

    if refused:
        allow_long = _alternative(
            ctx,
            "allow-long",
            f"serve past the derived maximum with {ALLOW_LONG_ENV}=1 (RoPE positions beyond training)",
            args,
            {},
            allow_long=True,
        )
        shorter = min(outcome.max_context, ctx.derived or outcome.max_context)
        if shorter > 0:
            found.append(
                _alternative(
                    ctx, "shorter-context", f"the derived maximum: {shorter} tokens", args, {}, shorter
                )
            )
        if allow_long is not None and allow_long.feasible:
            return _ranked([*found, allow_long])
        found.append(allow_long)
        ctx = replace(
            ctx, options=replace(ctx.options, allow_long=True)
        )  # memory alternatives past the limit

    explicit, source = _explicit_budget(args, ctx.platform)
    if explicit is not None and (ctx.gpus is None or ctx.platform.is_cpu):
        needed = max(
            _kv_needed(layout, ctx.target, s, ctx.options.concurrency)
            for s in range(layout.pipeline_parallel_size)
        )
        if source == "VLLM_CPU_KVCACHE_SPACE":
            space = str(cdiv(needed, GIB))
            raised = replace(args, env={**args.env, "VLLM_CPU_KVCACHE_SPACE": space})
            found.append(
                _alternative(
                    ctx,
                    "kv-cache-memory-bytes",
                    f"a {space} GiB KV cache (host memory not checked)",
                    raised,
                    {},
                    extra_env={"VLLM_CPU_KVCACHE_SPACE": space},
                )
            )
        else:
            raised = replace(args, kv_cache_memory_bytes=round_up(needed, MIB))
            found.append(
                _alternative(
                    ctx,
                    "kv-cache-memory-bytes",
                    "a larger explicit KV budget (memory not checked)",
                    raised,
                    {},
                )
            )

    bounded = any(
        not group.grows_with_context and group.kind in ("sliding", "chunked") for group in layout.groups
    )
    if bounded and layout.max_num_batched_tokens > SMALL_BATCH_TOKENS:
        small = replace(
            args,
            max_num_batched_tokens=SMALL_BATCH_TOKENS,
            max_num_seqs=min(args.max_num_seqs, SMALL_BATCH_TOKENS) if args.max_num_seqs else None,
        )
        flags = {"--max-num-batched-tokens": str(SMALL_BATCH_TOKENS)}
        if small.max_num_seqs != args.max_num_seqs:
            flags["--max-num-seqs"] = str(small.max_num_seqs)
        found.append(
            _alternative(
                ctx,
                "max-num-batched-tokens",
                "smaller prefill batches: sliding-window layers hold the window plus the tokens in flight",
                small,
                flags,
            )
        )

    if ctx.gpus is not None and args.kv_cache_memory_bytes is None and not ctx.platform.is_cpu:
        needed = max(
            _kv_needed(layout, ctx.target, s, ctx.options.concurrency)
            for s in range(layout.pipeline_parallel_size)
        )
        exact = replace(args, kv_cache_memory_bytes=round_up(needed, MIB))
        alt = _alternative(
            ctx,
            "kv-cache-memory-bytes",
            "give the KV cache an exact budget instead of a utilisation fraction (skips the cap)",
            exact,
            {},
        )
        if alt is not None and alt.feasible:
            found.append(alt)

    has_attention = any(g.grows_with_context or g.kind in ("sliding", "chunked") for g in layout.groups)
    if has_attention and not is_quantized_kv_cache(layout.kv_cache_dtype):
        found.append(
            _alternative(
                ctx,
                "fp8-kv-cache",
                "fp8 KV cache: half the bytes of bf16 (fp8_ds_mla for DeepSeek sparse attention)",
                replace(args, kv_cache_dtype="fp8"),
                {"--kv-cache-dtype": "fp8"},
            )
        )

    if tp > 1 and args.decode_context_parallel_size == 1:
        dcp_args: ServeArgs | None = None
        if facts.is_mla:
            dcp_args = replace(args, decode_context_parallel_size=tp)
            if facts.has_indexer and not is_quantized_kv_cache(layout.kv_cache_dtype):
                dcp_args = replace(dcp_args, kv_cache_dtype="fp8")
        else:
            kv_heads = next((lf.num_kv_heads for lf in facts.layers if lf.kind == LayerKind.FULL), 0)
            if kv_heads and tp // kv_heads >= 2:
                dcp_args = replace(args, decode_context_parallel_size=tp // kv_heads)
        if dcp_args is not None:
            flags = {"--decode-context-parallel-size": str(dcp_args.decode_context_parallel_size)}
            if dcp_args.kv_cache_dtype != args.kv_cache_dtype:
                flags["--kv-cache-dtype"] = dcp_args.kv_cache_dtype
            found.append(
                _alternative(
                    ctx,
                    "decode-context-parallel",
                    "decode context parallel: each rank keeps 1/DCP of the tokens instead of a full replica",
                    dcp_args,
                    flags,
                )
            )

    more_tp = replace(args, tensor_parallel_size=tp * 2)
    ranks_needed = more_tp.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    have = len(ctx.gpus.gpus) if ctx.gpus is not None else 0
    description = f"tensor parallel {tp * 2}: weights and KV heads spread over twice the GPUs"
    if ctx.gpus is not None and have < ranks_needed:
        description += f" (needs {ranks_needed} GPUs; this service sees {have})"
    found.append(
        _alternative(
            ctx,
            "tensor-parallel",
            description,
            more_tp,
            {"--tensor-parallel-size": str(tp * 2)},
            gpus=_more_gpus(ctx.gpus, ranks_needed),
            needs_gpus=max(0, ranks_needed - have) if ctx.gpus is not None else 0,
        )
    )

    if outcome.max_context > 0 and not refused:
        shorter = outcome.max_context
        found.append(
            _alternative(
                ctx,
                "shorter-context",
                f"the longest context that fits: {shorter} tokens",
                args,
                {},
                target=shorter,
            )
        )
    return _ranked(found)


def _ranked(found: Sequence[Alternative | None]) -> tuple[Alternative, ...]:
    """Feasible on the GPUs the service has first, then by how little they change, then by context."""
    ranked = sorted(
        (alt for alt in found if alt is not None),
        key=lambda alt: (
            not alt.feasible,
            alt.needs_gpus > 0,
            _PREFERENCE.get(alt.name, 8),
            -alt.max_context,
        ),
    )
    return tuple(replace(alt, rank=i + 1) for i, alt in enumerate(ranked))
