"""The hardware a plan is made for: GPUs and their memory, and the platform vLLM runs on.

Plain records only: where they come from (NVML, a file, flags) is the job of `vllm_ctxmgr.nvml`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from vllm_ctxmgr.core.gpu_models import GPU_MODELS, SOURCE
from vllm_ctxmgr.errors import UsageError

GIB = 1 << 30
# The most memory one GPU record may hold. The largest GPUs have under 300 GB (B300: 288 GB HBM3e)
# and a unified-memory one (GH200, GB10, Jetson Thor) reports its system's memory, at most ~1 TiB
# today: 16 TiB leaves more than ten times that, while a figure beyond it can only be a mistake in a
# file or a driver's answer, and would make every plan feasible.
MAX_GPU_BYTES = 16 << 40


def gib(n: float | int | None, digits: int = 2) -> str:
    """Bytes as vLLM's own log lines write them (GiB, two decimals): plans, reasons and texts agree."""
    return "?" if n is None else f"{n / GIB:.{digits}f} GiB"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory (NVML): the plan counts other processes' memory as taken and the
    service's own as freed by its restart.
    """

    pid: int
    name: str
    used_bytes: int | None  # None where the driver does not say (MIG, some containers)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML, a `ctxmgr gpus --json` file or --gpu-memory reports it: the memory a plan
    divides, and the compute capability that picks vLLM's backend (None: guessed from the name).

    `total_bytes` is the total CUDA reports (cudaMemGetInfo, what vLLM multiplies by
    gpu_memory_utilization), not nvidia-smi's: NVML's total also counts `reserved_bytes`, the memory
    the driver keeps for itself (nvidia-smi -q: "Reserved"; 0.5-0.8 GiB on an 80 GB card), which no
    CUDA context can use.
    """

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    uuid: str = ""
    compute_capability: tuple[int, int] | None = None
    processes: tuple[GpuProcess, ...] = ()
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        """The one door every GPU figure passes (NVML, a --gpus-from file, a node's NVML answer, the
        --gpu-memory flags): a total of 0 or less, or above MAX_GPU_BYTES, is no GPU's; taken as is, 1e24
        bytes planned any context as feasible at a utilisation of 0.03, and a negative one planned on."""
        for name in ("total_bytes", "free_bytes", "used_bytes", "reserved_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"GPU {self.index}: {name} {value!r} is not a whole number of bytes")
        if not 0 < self.total_bytes <= MAX_GPU_BYTES:
            raise UsageError(
                f"GPU {self.index} ({self.name[:60]!r}): a total of {self.total_bytes:,} bytes is no GPU's "
                f"(a GPU has more than 0 and at most {MAX_GPU_BYTES >> 40} TiB)"
            )
        for name in ("free_bytes", "used_bytes", "reserved_bytes"):
            if not 0 <= getattr(self, name) <= MAX_GPU_BYTES:
                raise UsageError(
                    f"GPU {self.index}: {name} {getattr(self, name):,} is not between 0 and "
                    f"{MAX_GPU_BYTES >> 40} TiB"
                )


@dataclass(frozen=True)
class GpuState:
    """The GPUs a plan is made for and where their figures came from (NVML, a file, flags), for citing."""

    gpus: tuple[GpuInfo, ...]
    source: str  # "nvml" | "flags" | path of a `ctxmgr gpus --json` file
    driver_version: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def select(self, visible_devices: str | None) -> GpuState:
        """The GPUs a service sees through CUDA_VISIBLE_DEVICES (indices or UUIDs), in its order."""
        if not visible_devices or visible_devices.strip() == "":
            return self
        chosen: list[GpuInfo] = []
        for token in (t.strip() for t in visible_devices.split(",")):
            if not token:
                continue
            match = [g for g in self.gpus if str(g.index) == token or (g.uuid and g.uuid.startswith(token))]
            if not match:
                raise UsageError(f"CUDA_VISIBLE_DEVICES names GPU {token!r}, which this host does not have")
            chosen.append(match[0])
        return GpuState(tuple(chosen), self.source, self.driver_version, self.notes)

    def to_json(self) -> dict:
        """What `ctxmgr gpus --json` prints, so `nvml.gpus_from_file` can plan for this host elsewhere."""
        return {
            "source": self.source,
            "driver_version": self.driver_version,
            "gpus": [asdict(g) for g in self.gpus],
            "notes": list(self.notes),
        }


def uniform_gpus(count: int, total_bytes: int, free_bytes: int | None = None, name: str = "GPU") -> GpuState:
    """Offline planning: N identical, otherwise idle GPUs (`--gpu-memory SIZE --gpu-count N`)."""
    if count < 1:
        raise UsageError("--gpu-count must be at least 1")
    if total_bytes <= 0:
        raise UsageError("--gpu-memory must be positive")
    free = total_bytes if free_bytes is None else free_bytes
    gpus = tuple(GpuInfo(i, name, total_bytes, free, total_bytes - free) for i in range(count))
    return GpuState(gpus, "flags")


# --------------------------------------------------------------------------------------------------
# Platform: the constants that differ between a CUDA GPU and the CPU build
# --------------------------------------------------------------------------------------------------

# vLLM's CUDA build runs on compute capability 7.0 (Volta) and newer: its installation docs' GPU
# requirement ("compute capability 7.0 or higher (e.g., V100, T4, RTX20xx, A100, L4, H100, etc.)") and
# the CUDA arch list its wheels are built for (CMakeLists.txt CUDA_SUPPORTED_ARCHS, from 7.0).
MIN_CUDA_CAPABILITY = (7, 0)
# the words nvidia-smi puts before a model name, and the board words after it (memory size, form
# factor, edition), which do not change the chip: `NVIDIA A100-SXM4-80GB` is the A100
_BRAND_WORDS = frozenset({"nvidia", "geforce", "tesla"})
_BOARD_WORD = re.compile(
    r"(?:\d+gb|pcie|sxm\d?|nvl|hbm\d?e?|server|workstation|edition|max|q|laptop|gpu|oem|ac|mig)"
)
_CAPABILITY_BY_MODEL: dict[str, tuple[int, int]] = {}  # filled below from core/gpu_models.py


def normalised_gpu_name(name: str) -> str:
    """A GPU name as core/gpu_models.py lists it, lower case: the vendor and brand words before the model
    (NVIDIA, GeForce, Tesla) and the board words after it (80GB, PCIe, SXM5, NVL, HBM3, Max-Q,
    Workstation Edition, ...) dropped, so "NVIDIA A100 80GB PCIe" and "NVIDIA A100-SXM4-80GB" are both
    "a100" while "Quadro RTX 5000" and "NVIDIA RTX 5000 Ada Generation" stay two models."""
    words = [w for w in re.split(r"[\s\-_/]+", name.strip().lower()) if w]
    while words and words[0] in _BRAND_WORDS:
        words.pop(0)
    return " ".join(w for w in words if not _BOARD_WORD.fullmatch(w))


_CAPABILITY_BY_MODEL.update((normalised_gpu_name(model), cc) for model, cc in GPU_MODELS)


@dataclass(frozen=True)
class Platform:
    """Where vLLM runs: decides block sizes, backends, in-flight tokens and batch defaults.

    `total_memory_bytes` is one device's memory (vLLM's default max_num_batched_tokens depends
    on it). `cuda_runtime_major` matters only for FlashInfer GDN prefill on SM10x/12x; None means
    unknown and is treated as >= 13 (the choice that costs more KV memory).
    """

    device_type: str  # "cuda" | "cpu"
    compute_capability: tuple[int, int] | None = None
    device_name: str = ""
    total_memory_bytes: int | None = None
    cuda_runtime_major: int | None = None
    # where compute_capability came from: "NVML", "--compute-capability", "its name, NVIDIA's CUDA GPUs
    # list", ...; "" where it is unknown (planned as Hopper, capability_major)
    capability_source: str = ""

    @property
    def is_cpu(self) -> bool:
        """vLLM's CPU build: its own backends and batch defaults, no CUDA context, KV budget from
        VLLM_CPU_KVCACHE_SPACE.
        """
        return self.device_type == "cpu"

    @property
    def is_cuda(self) -> bool:
        """vLLM's current_platform.is_cuda(): only there do compute-capability rules (backends) apply."""
        return self.device_type == "cuda"

    @property
    def capability_major(self) -> int:
        """Unknown GPUs are treated as Hopper, the most common vLLM server GPU."""
        return self.compute_capability[0] if self.compute_capability else 9

    def is_capability_family(self, family: int) -> bool:
        """vLLM's is_device_capability_family(100) means SM10.x, (90) means SM9.x."""
        return self.is_cuda and self.capability_major == family // 10

    def decided_by(self) -> str:
        """Which GPU the backend and the KV dtype were chosen for, and where its compute capability
        came from, so a wrong name match is seen in the plan."""
        name = self.device_name if self.device_name and self.device_name != "GPU" else "no GPU named"
        if self.compute_capability is None:
            return (
                f"{name}, compute capability unknown: planned as Hopper (9.0); --gpu-name or "
                "--compute-capability X.Y plans for yours"
            )
        major, minor = self.compute_capability
        return f"{name}, compute capability {major}.{minor} ({self.capability_source or 'given'})"

    def default_max_num_batched_tokens(self, world_size: int) -> int:
        """EngineArgs.get_batch_defaults for the OpenAI server (arg_utils.py)."""
        if self.is_cpu:
            return 2048 * world_size
        memory = self.total_memory_bytes
        if memory is None:
            return 8192  # assumed H100/H200-class; vLLM reads it from the device
        if memory >= 160 * GIB:
            return 16384
        is_gb10 = self.compute_capability == (12, 1)
        if memory >= 70 * GIB and "a100" not in self.device_name.lower() and not is_gb10:
            return 8192
        return 2048

    def default_model_dtype(self, config_dtype: str) -> str:
        """`--dtype auto`: float32 checkpoints are downcast to the platform's preferred dtype, and a dtype
        the platform cannot run a model in (int8, uint8, fp8 ...) is replaced by it, as
        vllm/config/model.py:2423-2465 (0.33.0, _resolve_auto_dtype) does; the `auto` KV cache follows."""
        preferred = "bfloat16" if self.is_cpu or self.capability_major >= 8 else "float16"
        if config_dtype in ("float32", "float") or config_dtype not in ("bfloat16", "float16", "half"):
            return preferred
        if config_dtype == "bfloat16" and preferred != "bfloat16":
            return preferred
        return config_dtype


def known_gpu_names() -> list[str]:
    """The GPU models vLLM's CUDA build runs on whose compute capability ctxmgr knows by name."""
    return [model for model, cc in GPU_MODELS if cc >= MIN_CUDA_CAPABILITY]


def capability_for_name(name: str) -> tuple[int, int] | None:
    """The compute capability of a GPU model named as nvidia-smi names it ("NVIDIA H200" -> (9, 0)),
    from NVIDIA's list (core/gpu_models.py), matched as a whole model name, never by a substring;
    None: a model the list does not have."""
    return _CAPABILITY_BY_MODEL.get(normalised_gpu_name(name))


def unknown_gpu_name(name: str, flag: str = "--gpu-name") -> str:
    """Why a GPU name decides nothing, and what to give instead."""
    return (
        f"{flag} {name[:80]!r}: not a GPU ctxmgr knows; known: {', '.join(known_gpu_names())} (NVIDIA's "
        f"CUDA GPUs list from Volta on, {SOURCE}); for another GPU give --compute-capability X.Y"
    )


def check_cuda_capability(capability: tuple[int, int], what: str) -> None:
    """Refuse a GPU vLLM's CUDA build does not run on (below 7.0), saying so."""
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        raise UsageError(
            f"{what}: compute capability {capability[0]}.{capability[1]}; vLLM's CUDA build needs "
            f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} or newer (Volta and later)"
        )


def platform_for(gpus: GpuState | None, cpu: bool = False) -> Platform:
    """The platform a service runs on, from the GPUs it sees (first GPU decides): its compute capability
    as reported (NVML, a file, --compute-capability), else from its name; below 7.0 refused."""
    if cpu:
        return Platform("cpu")
    if gpus is None or not gpus.gpus:
        return Platform("cuda")
    first = gpus.gpus[0]
    capability, source = first.compute_capability, ""
    if capability is not None:
        source = {"flags": "--compute-capability", "nvml": "NVML"}.get(
            gpus.source, f"the GPU list {gpus.source}"
        )
    elif (capability := capability_for_name(first.name)) is not None:
        source = "its name, NVIDIA's CUDA GPUs list"
    if capability is not None:
        check_cuda_capability(capability, f"GPU {first.index} ({first.name[:80]})")
    return Platform("cuda", capability, first.name, first.total_bytes, capability_source=source)
