"""Gathering what the planner needs from the outside world: the model, the GPUs, earlier starts.

Everything here does I/O (files, NVML, the revision store); `plan.make_plan` stays pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from typing import Any

from .errors import CtxmgrError, UsageError
from .gpus import GIB, GpuState, gpus_from_file, read_nvml, uniform_gpus
from .observations import Observation
from .serve_args import ServeArgs


def is_cpu_deployment(args: ServeArgs) -> bool:
    """The vLLM CPU build: its KV space comes from VLLM_CPU_KVCACHE_SPACE or node memory, not a GPU."""
    return "VLLM_CPU_KVCACHE_SPACE" in args.env or args.env.get("CTXMGR_PLATFORM") == "cpu"


def effective_args(args: ServeArgs) -> ServeArgs:
    """CPU build: VLLM_CPU_KVCACHE_SPACE (GiB) is the KV budget; it wins over --kv-cache-memory-bytes."""
    space = args.env.get("VLLM_CPU_KVCACHE_SPACE")
    if is_cpu_deployment(args) and space:
        try:
            gib = float(space)
        except ValueError:
            raise UsageError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB") from None
        if gib > 0:
            return replace(args, kv_cache_memory_bytes=int(gib * GIB))
    return args


def gather_gpus(
    gpu_memory: int | None = None,
    gpu_count: int | None = None,
    gpus_from: str | None = None,
    visible_devices: str | None = None,
    required: bool = False,
) -> tuple[GpuState | None, str | None]:
    """(GPU state, note) from flags, a file, or NVML; None with a note when none can be had."""
    if gpus_from:
        return gpus_from_file(gpus_from).select(visible_devices), None
    if gpu_memory is not None or gpu_count is not None:
        if gpu_memory is None:
            raise UsageError("--gpu-count needs --gpu-memory SIZE")
        return uniform_gpus(gpu_count or 1, gpu_memory), None
    try:
        return read_nvml().select(visible_devices), None
    except CtxmgrError as exc:
        if required:
            raise
        return None, exc.message


def observations_from_store(records: Iterable[Mapping[str, Any]]) -> list[Observation]:
    """Stored observation records (newest last) as Observations with the configuration they ran."""
    names = {f.name for f in fields(Observation)}
    out = []
    for record in records:
        data = {k: v for k, v in record.items() if k in names}
        if data.get("gpu_memory_utilization") is None:
            data["gpu_memory_utilization"] = record.get("configured_gpu_memory_utilization")
        if data.get("max_model_len") is None:
            data["max_model_len"] = record.get("configured_max_model_len")
        if data.get("kv_cache_memory_bytes") is None:
            data["kv_cache_memory_bytes"] = record.get("configured_kv_cache_memory_bytes")
        out.append(Observation(**data))
    return out
