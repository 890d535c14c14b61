"""A stored plan: PlanRecord (the schema `Plan.to_json()` writes) and StoredPlan (its typed reader).

Its own module because a stored plan is read back (verify, deploy's calibration, core.verdict) long
after the planner that wrote it: the readers need the keys and their meaning, not the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NotRequired, TypedDict

from vllm_ctxmgr.core.budget import kv_budget_at_utilization
from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.core.weight_cache import PreloadOfferRecord
from vllm_ctxmgr.errors import CtxmgrError, ExitCode

PLAN_SCHEMA = 2  # PlanRecord["schema"]: bump when a stored plan's keys change meaning
# 2: `verdict` is the one word of `result` (feasible | infeasible | unknown); the memory evaluation's
#    own text moved to `memory`; `feasible` is null where the result is unknown


class PlanResult(StrEnum):
    """A plan's one word: its `result` (and `verdict`) in every record, answer and report, and the exit
    code `plan` and a deployment's plan return (a StrEnum: JSON writes the word itself)."""

    FEASIBLE = "feasible"
    INFEASIBLE = "infeasible"
    UNKNOWN = "unknown"  # no memory information, or it fits only if unknown weights are small enough

    @property
    def exit_code(self) -> ExitCode:
        return _PLAN_EXIT[self]


_PLAN_EXIT = {
    PlanResult.FEASIBLE: ExitCode.OK,
    PlanResult.INFEASIBLE: ExitCode.INFEASIBLE,
    PlanResult.UNKNOWN: ExitCode.UNKNOWN,
}


class FigureRecord(TypedDict):
    """A Figure in a stored plan: bytes (None where unknown) and where they came from."""

    bytes: int | None
    source: str


class VllmRuleRecord(TypedDict):
    """One version rule a stored plan followed: its name, the release it holds since, its value."""

    rule: str
    since: str
    value: JSONValue


class ErrorBandRecord(TypedDict):
    """core.confidence.ErrorBand.to_json(): how far such plans were from what vLLM logged."""

    figure: str
    starts: int
    median_percent: float
    worst_percent: float
    measured_by: str


class ConfidenceRecord(TypedDict):
    """core.confidence.Confidence.to_json(): how much the plan's KV budget is vLLM's own figure."""

    level: str
    basis: str
    started_at: float | None
    vllm_version: str | None
    error_band: ErrorBandRecord | None


class NotModelledFlagRecord(TypedDict):
    """core.deployment.NamedFlag.to_json(): a flag of the unit that changes GPU memory and was not
    counted, with the share of the margin it is given and why."""

    flag: str
    family: str
    detail: str
    margin_share: float
    why: str


class ColdBootRecord(TypedDict):
    """`ColdBoot.to_json()`: the boot that applies the plan compiles cold (core/cold_boot.py)."""

    max_model_len: int
    extra_bytes: int  # per GPU: how much less KV that boot gets than a warm one
    source: str
    estimate: bool


class PlatformRecord(TypedDict):
    """The platform a stored plan was made for: Platform without its batch-default inputs."""

    device_type: str
    compute_capability: tuple[int, int] | list[int] | None
    device_name: str | None
    # where the capability came from (NVML, --compute-capability, the name); a plan stored by an
    # older ctxmgr lacks these two
    capability_source: NotRequired[str | None]
    decides: NotRequired[PlatformDecides]


class PlatformDecides(TypedDict):
    """What the GPU's compute capability chose for the plan."""

    attention_backend: str
    kv_cache_dtype: str


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
    result: str  # a PlanResult: feasible | infeasible | unknown
    feasible: bool | None  # None: unknown
    reason: str
    verdict: str  # = result (schema 1: the memory evaluation's text, now `memory`)
    memory: str
    max_model_len: int
    gpu_memory_utilization: float | None
    least_gpu_memory_utilization: float | None  # the least that holds the target with the margin
    max_context: int
    max_context_limit: str  # model | target | memory: what sets max_context
    confidence: ConfidenceRecord | None
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_memory_bytes: int | None
    null_block_bytes: int
    concurrency: int
    kv_cache_tokens: int | None
    max_concurrency: float | None
    capacity: list[JSONObject]
    derived_max_model_len: int | None
    derived_max_model_len_key: str | None
    vllm_version: str
    vllm_rules: list[VllmRuleRecord]
    platform: PlatformRecord
    gpus: list[JSONObject]
    flag_changes: dict[str, str]
    env_changes: dict[str, str]
    alternatives: list[JSONObject]
    warnings: list[str]
    notes: list[str]
    layout: JSONObject
    # the unit's flags that change GPU memory and were not counted (core/deployment.py NamedFlag);
    # absent from plans stored before it existed
    not_modelled_flags: NotRequired[list[NotModelledFlagRecord]]
    # None: the boot that applies it is warm (or not known to compile); absent from older plans
    cold_boot: NotRequired[ColdBootRecord | None]
    # a `vllm preload` daemon would serve the unit (core/weight_cache.py); absent from older plans
    preload_offer: NotRequired[PreloadOfferRecord | None]


def _record_bytes(entry: Mapping[str, object], name: str) -> int | None:
    figure = entry.get(name)
    if isinstance(figure, Mapping):
        value = figure.get("bytes")
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    return None


def _record_int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class StoredPlan:
    """A PlanRecord read back from a revision, with typed accessors for what its readers need.

    Tolerant of a missing or partial record (a revision written without a plan answers None), not
    of a record from a newer ctxmgr whose keys may mean something else.
    """

    record: Mapping[str, object]  # a PlanRecord, or what an older ctxmgr stored

    @classmethod
    def from_json(cls, data: Mapping[str, object] | None) -> StoredPlan:
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
        schema = self.record.get("schema", 1)
        return schema if isinstance(schema, int) else 1  # from_json let only an int through

    @property
    def gpus(self) -> list[Mapping[str, object]]:
        """The plan's GPU lines (GpuMemory.to_json()), in rank order."""
        lines = self.record.get("gpus")
        return [line for line in lines if isinstance(line, Mapping)] if isinstance(lines, list) else []

    @staticmethod
    def figure(line: Mapping[str, object], name: str) -> int | None:
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
    def layout(self) -> Mapping[str, object]:
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
