"""The GPUs' real memory, through NVML (nvidia-ml-py), or as `ctxmgr gpus --json` wrote it on another host."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_ctxmgr.core.bounds import MAX_WORLD_SIZE
from vllm_ctxmgr.core.hardware import GpuInfo, GpuProcess, GpuState
from vllm_ctxmgr.errors import CtxmgrError, UsageError
from vllm_ctxmgr.files import read_regular

MAX_GPUS_FILE = 1 << 20  # `ctxmgr gpus --json` of 1,024 GPUs with their processes is far below


def gpus_from_file(path: str | Path) -> GpuState:
    """Read what `ctxmgr gpus --json` wrote on the target host: a regular file, read within a bound
    (files.read_regular: /dev/zero, a FIFO or a huge file are refused, never read without end)."""
    try:
        raw = read_regular(path, MAX_GPUS_FILE, what="GPU file")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UsageError(f"{path}: not a `ctxmgr gpus --json` file ({reason})") from None
    return gpus_from_json(data, str(path))


def gpus_from_json(data: object, source: str) -> GpuState:
    """`ctxmgr gpus --json`'s object, from a file or from a node of a multi-node deployment."""
    if not isinstance(data, dict):
        raise UsageError(f"{source}: not a `ctxmgr gpus --json` object")

    def whole(g: dict, key: str) -> int:
        """A byte count as `gpus --json` writes it: a JSON integer, never 80.5, "80" or true."""
        value = g[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} {str(value)[:40]!r} is not a whole number of bytes")
        return value

    listed = data.get("gpus")
    if isinstance(listed, list) and len(listed) > MAX_WORLD_SIZE:  # refused before any entry is read
        raise UsageError(
            f"{source}: lists {len(listed):,} GPUs, more than {MAX_WORLD_SIZE:,} GPUs ctxmgr reads"
        )
    try:
        gpus = tuple(
            GpuInfo(
                index=int(g["index"]),
                name=str(g["name"]),
                total_bytes=whole(g, "total_bytes"),
                free_bytes=whole(g, "free_bytes"),
                used_bytes=whole(g, "used_bytes"),
                uuid=str(g.get("uuid", "")),
                compute_capability=tuple(g["compute_capability"]) if g.get("compute_capability") else None,
                processes=tuple(
                    GpuProcess(int(p["pid"]), str(p.get("name", "")), p.get("used_bytes"))
                    for p in g.get("processes", [])
                ),
                reserved_bytes=whole({"reserved_bytes": 0, **g}, "reserved_bytes"),
            )
            for g in data["gpus"]
        )
    except (ValueError, KeyError, TypeError, OverflowError) as exc:  # 1e400 is JSON's inf
        raise UsageError(f"{source}: not a `ctxmgr gpus --json` object ({exc})") from None
    if not gpus:
        raise UsageError(f"{source}: lists no GPUs")
    return GpuState(gpus, source, data.get("driver_version"))


MEMINFO = Path("/proc/meminfo")


def read_nvml(meminfo: Path = MEMINFO) -> GpuState:
    """Every GPU on this host as NVML reports it now.

    A unified-memory GPU (GB10 in a DGX Spark, Jetson Thor) has no memory of its own: NVML answers
    "Not Supported" for it, and CUDA reports the system's memory instead, so that is what the GPU
    record gets (`meminfo`'s MemTotal and MemAvailable), with a note.
    """
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        raise CtxmgrError("nvidia-ml-py is not installed; use --gpu-memory/--gpu-count") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise CtxmgrError(
            f"NVML is not available on this host ({exc}); plan offline with --gpu-memory SIZE "
            "--gpu-count N or --gpus-from FILE"
        ) from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        notes: list[str] = []
        v1_noted = False
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                total, reserved, free, used = _memory(pynvml, handle)
            except pynvml.NVMLError:
                total, free = _system_memory(meminfo)
                reserved, used = 0, total - free
                notes.append(
                    f"GPU {index} reports no memory of its own (unified memory): planned with the "
                    f"system's {total / (1 << 30):.2f} GiB, as CUDA sees it; other processes' RAM "
                    "counts as used"
                )
            if reserved is None:
                reserved = 0
                if not v1_noted:
                    v1_noted = True
                    notes.append(
                        "this driver's NVML does not report the memory it reserves (nvmlMemory_v2); "
                        "totals are nvidia-smi's, about 0.5-0.8 GiB above what CUDA and vLLM see"
                    )
            try:
                cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except pynvml.NVMLError:
                cc = None
            gpus.append(
                GpuInfo(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_bytes=total - reserved,
                    free_bytes=free,
                    used_bytes=used,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    compute_capability=cc,  # type: ignore[arg-type]
                    processes=_processes(pynvml, handle),
                    reserved_bytes=reserved,
                )
            )
        return GpuState(tuple(gpus), "nvml", driver, tuple(notes))
    finally:
        pynvml.nvmlShutdown()


def _system_memory(meminfo: Path) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes, from /proc/meminfo's kB lines."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        raise CtxmgrError(
            "a GPU reports no memory of its own and the system's could not be read; plan offline with "
            "--gpu-memory SIZE"
        ) from None


def _memory(pynvml, handle) -> tuple[int, int | None, int, int]:  # type: ignore[no-untyped-def]
    """(total, reserved, free, used) in bytes. nvmlMemory_v2 (drivers >= 510) splits the driver's own
    reserve out of `used`; CUDA's total (cudaMemGetInfo, vLLM's `total_memory`) is NVML's total less
    that reserve: on an A100-SXM4-80GB 81920 - 763 = 81157 MiB where two vLLM starts at utilisations
    0.25 and 0.5 imply 81152 (tests/data/public-logs). v1 counts the reserve as used: reserved None.
    """
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return int(mem.total), int(mem.reserved), int(mem.free), int(mem.used)
    except (pynvml.NVMLError, AttributeError, TypeError):
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)  # NVMLError here: the GPU has no memory of its own
        return int(mem.total), None, int(mem.free), int(mem.used)


def _processes(pynvml, handle) -> tuple[GpuProcess, ...]:  # type: ignore[no-untyped-def]
    found: dict[int, GpuProcess] = {}
    for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            procs = getter(handle)
        except pynvml.NVMLError:
            continue
        for p in procs:
            used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None
            found[p.pid] = GpuProcess(p.pid, _process_name(p.pid), used)
    return tuple(found.values())


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
