"""What one start of a service logged about memory: vLLM's own numbers, read from the journal.

Filled by `vllm_log.observe_start`; the planner prefers these to its estimates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypedDict, cast, get_args, get_type_hints

from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.errors import UsageError


@dataclass(frozen=True)
class Observation:
    """vLLM's own memory figures from one start, kept so the next plan uses them instead of estimates.

    The figures are that start's journal lines (num_gpu_blocks: /metrics); None where it logged none.
    """

    vllm_version: str | None = None
    platform: str | None = None  # "GPU" | "CPU": the first word of the capacity line
    max_model_len: int | None = None  # "Using max model len N" / auto-fit result
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    model_loading_gib: float | None = None  # "Model loading took X GiB"
    available_kv_gib: float | None = None  # "Available KV cache memory: X GiB"
    cuda_graph_gib: float | None = None  # "Estimated CUDA graph memory: X GiB total"
    kv_cache_tokens: int | None = None  # "KV cache size: N tokens" (derived: concurrency x len)
    max_concurrency: float | None = None
    estimated_max_model_len: int | None = None  # from the KV-too-small error
    needed_kv_gib: float | None = None
    ready: bool = False
    failure: str | None = None  # name of the failure pattern that ended the start
    # the device memory vLLM sized against at that start (the CPU build's NUMA node moves on some VMs)
    total_memory_gib: float | None = None
    num_gpu_blocks: int | None = None  # exact, from /metrics vllm:cache_config_info
    gpu_name: str | None = None  # the device it ran on ("NVIDIA H200", "CPU"): observations do not travel
    # when the start was recorded (its record's `time`, set by ObservationRecord.planned): a plan says
    # which start calibrated it and how old that is; stored as the record's `time`, not twice
    started_at: float | None = None
    # what vLLM's compile cache did at that start, from its compile lines: "miss" (a cold boot: torch.compile
    # compiled, as at the first boot at a new max_model_len), "hit" (warm: loaded from the cache); None:
    # no such line (eager, an older log). A cold boot's profiling peak is higher, its KV budget smaller
    # (vLLM #54383, #54122): calibration does not take it as a warm start's
    compile_cache: str | None = None


class ObservationFigures(TypedDict, total=False):
    """An Observation as a dict (dataclasses.asdict): verify's view of the running process; {} where
    the journal held no start. tests/core/test_records.py ties its keys to Observation's fields."""

    vllm_version: str | None
    platform: str | None
    max_model_len: int | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    model_loading_gib: float | None
    available_kv_gib: float | None
    cuda_graph_gib: float | None
    kv_cache_tokens: int | None
    max_concurrency: float | None
    estimated_max_model_len: int | None
    needed_kv_gib: float | None
    ready: bool
    failure: str | None
    total_memory_gib: float | None
    num_gpu_blocks: int | None
    gpu_name: str | None
    started_at: float | None
    compile_cache: str | None


class StoredObservation(ObservationFigures, total=False):
    """One line of observations.jsonl (ObservationRecord.to_json()): Observation's figures (its
    started_at stored as `time`) beside the configuration that made them."""

    service: str | None
    host: str | None
    time: float | None
    block_size: int | None
    configured_max_model_len: int | None
    configured_gpu_memory_utilization: float | None
    configured_kv_cache_memory_bytes: int | None
    ok: bool
    imported_from: str | None


class ObservationError(UsageError):
    """An observation record that is not one a start can log (the message names the source and key)."""


# What a real start can log, per field: far above any GPU or CPU node of today, far below what makes
# the planner's arithmetic overflow (a stored 1e308 GiB wedged every later plan of the service).
_MAX_GIB = 4096.0  # one device's memory
LIMITS: dict[str, float] = {
    "total_memory_gib": _MAX_GIB,
    "model_loading_gib": _MAX_GIB,
    "available_kv_gib": _MAX_GIB,
    "cuda_graph_gib": _MAX_GIB,
    "needed_kv_gib": _MAX_GIB,
    "max_model_len": 1 << 32,
    "configured_max_model_len": 1 << 32,
    "estimated_max_model_len": 1 << 32,
    "kv_cache_tokens": 1 << 40,
    "num_gpu_blocks": 1 << 32,
    "kv_cache_memory_bytes": 1 << 50,
    "configured_kv_cache_memory_bytes": 1 << 50,
    "max_concurrency": 1 << 32,
    "time": 4102444800.0,  # 2100-01-01
    "started_at": 4102444800.0,
}
_SHARES_THE_GPU = ("model_loading_gib", "available_kv_gib", "cuda_graph_gib")
COMPILE_CACHE = ("hit", "miss")  # Observation.compile_cache: warm, cold
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.@\\-]{1,255}")
_TEXT_FIELDS = ("vllm_version", "platform", "gpu_name", "failure", "imported_from")


@dataclass(frozen=True)
class ObservationRecord:
    """One start as observations.jsonl keeps it: vLLM's figures and the configuration that made them.

    On disk it is one flat JSON object per line (Observation's fields beside these), readable by a
    person and by older ctxmgr versions; `from_json` is the one door back in, for the store's own
    lines and for `observe --import` alike, so a new figure is one field of Observation and nothing
    else to touch.
    """

    observation: Observation
    service: str | None = None
    host: str | None = None
    time: float | None = None
    block_size: int | None = None  # vLLM's block size at that start (/metrics)
    configured_max_model_len: int | None = None  # what the unit said (the start may have auto-fitted)
    configured_gpu_memory_utilization: float | None = None
    # the explicit budget as vLLM applied it (VLLM_CPU_KVCACHE_SPACE included): such a start says
    # nothing about how memory scales with the utilisation
    configured_kv_cache_memory_bytes: int | None = None
    ok: bool = False  # the start served
    imported_from: str | None = None  # the host (or file) an imported record came from

    def to_json(self) -> StoredObservation:
        """The flat line the store writes."""
        data = asdict(self.observation)
        del data["started_at"]  # the record's own `time`
        data.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "observation"})
        return cast(StoredObservation, data)  # its keys are the fields (tests/core/test_records.py)

    @classmethod
    def from_json(cls, data: Mapping[str, object], source: str) -> ObservationRecord:
        """A record checked at the door: each known field of its type (unknown ones, a newer ctxmgr's,
        ignored), every number finite, not negative and within what a start can log, the memory parts
        within the device's total, text printable and short, a block size vLLM has."""
        values: dict[str, Any] = {}
        for name, kind in _FIELD_TYPES.items():
            value = data.get(name)
            values[name] = None if value is None else _typed(name, value, kind, source)
        _check_bounds(values, source)
        observed = {f.name: values[f.name] for f in fields(Observation) if values[f.name] is not None}
        extras = {
            f.name: values[f.name]
            for f in fields(cls)
            if f.name != "observation" and values[f.name] is not None
        }
        return cls(Observation(**observed), **extras)

    def planned(self) -> Observation:
        """The observation as the planner takes it: what the start ran with, where its log did not say."""
        obs = self.observation
        return replace(
            obs,
            started_at=self.time,
            gpu_memory_utilization=(
                obs.gpu_memory_utilization
                if obs.gpu_memory_utilization is not None
                else self.configured_gpu_memory_utilization
            ),
            max_model_len=obs.max_model_len
            if obs.max_model_len is not None
            else self.configured_max_model_len,
            kv_cache_memory_bytes=(
                obs.kv_cache_memory_bytes
                if obs.kv_cache_memory_bytes is not None
                else self.configured_kv_cache_memory_bytes
            ),
        )


def _field_types() -> dict[str, type]:
    """Every field of a record (Observation's and the record's own) with its one JSON type."""
    out: dict[str, type] = {}
    for owner in (Observation, ObservationRecord):
        for name, hint in get_type_hints(owner).items():
            if name == "observation":
                continue
            kinds = [k for k in get_args(hint) if k is not type(None)] or [hint]
            out[name] = kinds[0]
    return out


def _typed(key: str, value: object, expected: type, source: str) -> object:
    """The value as its field's type: finite and not negative where it is a number."""
    bad = ObservationError(f"{source}: {key}={str(value)[:40]!r} is not a {expected.__name__}")
    if (expected is bool) != isinstance(value, bool):
        raise bad
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 1 << 64:  # float() of a 400-digit int raises OverflowError
            raise ObservationError(f"{source}: {key} is above any figure a start logs")
        value = float(value)
    if not isinstance(value, expected):
        raise bad
    if isinstance(value, float) and not math.isfinite(value):
        raise bad
    if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
        raise ObservationError(f"{source}: {key}={value!r} is negative")
    return value


def _check_bounds(record: Mapping[str, Any], source: str) -> None:
    for key, limit in LIMITS.items():
        value = record.get(key)
        if value is not None and value > limit:
            raise ObservationError(f"{source}: {key} is above {limit:,.0f}, more than any start logs")
    for key in ("gpu_memory_utilization", "configured_gpu_memory_utilization"):
        value = record.get(key)
        if value is not None and not 0 < value <= 1:
            raise ObservationError(f"{source}: {key} is not in (0, 1]")
    block = record.get("block_size")
    if block is not None and block not in (1, 8) and not (0 < block <= 4096 and block % 16 == 0):
        raise ObservationError(
            f"{source}: block_size is not one of vLLM's block sizes (1, 8, multiples of 16)"
        )
    total = record.get("total_memory_gib")
    for key in _SHARES_THE_GPU:
        value = record.get(key)
        if total is not None and value is not None and value > total:
            raise ObservationError(f"{source}: {key} is more than the GPU's total_memory_gib")
    for key in _TEXT_FIELDS:
        value = record.get(key)
        if value is not None and (len(value) > 256 or not value.isprintable()):
            raise ObservationError(f"{source}: {key} is not printable text of at most 256 characters")
    if record.get("host") is not None and not _HOST_NAME.fullmatch(record["host"]):
        raise ObservationError(f"{source}: host is not a host name")
    if record.get("service") is not None and not _UNIT_NAME.fullmatch(record["service"]):
        raise ObservationError(f"{source}: service is not a unit name")
    if record.get("compile_cache") not in (None, *COMPILE_CACHE):
        raise ObservationError(f"{source}: compile_cache is not one of {', '.join(COMPILE_CACHE)}")
    if record.get("vllm_version") and parse_vllm_version(record["vllm_version"]) is None:
        raise ObservationError(f"{source}: vllm_version is not a vLLM version")


_FIELD_TYPES = _field_types()


def figure_above_the_device(obs: Observation, total_bytes: float) -> tuple[str, float] | None:
    """The first figure of a start that is more than its device's `total_bytes` could hold, as (name,
    GiB): weights, the KV budget and CUDA graphs each, and weights with the KV budget together (vLLM
    carves the budget out of what the weights leave). None where each fits: a start holds no more
    memory than its GPU has, so such a figure is an echo or a tampered record. (The KV a request
    needed, from vLLM's too-small error, may well be more than the GPU: it is what was asked for.)"""
    named = (
        ("model_loading_gib", obs.model_loading_gib),
        ("available_kv_gib", obs.available_kv_gib),
        ("cuda_graph_gib", obs.cuda_graph_gib),
    )
    for name, value in named:
        if value is not None and value * GIB > total_bytes:
            return name, value
    if obs.model_loading_gib is not None and obs.available_kv_gib is not None:
        both = obs.model_loading_gib + obs.available_kv_gib
        if both * GIB > total_bytes:
            return "model_loading_gib + available_kv_gib", both
    return None
