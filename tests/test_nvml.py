"""NVML's figures become the totals vLLM itself sees.

No GPU here, so the library is played by a module with nvidia-ml-py's own names (nvmlMemory_v2,
nvmlDeviceGetMemoryInfo(handle, version=...), NVMLError) returning what a real A100-SXM4-80GB's
`nvidia-smi -q` printed (driver 555.42.02, a public report): FB Memory Usage Total 81920 MiB,
Reserved 763 MiB, Used 1 MiB, Free 81158 MiB. The one real-driver check is `ctxmgr gpus` on a lent
GPU machine (see docs).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from vllm_ctxmgr.core.budget import requested_bytes
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.nvml import gpus_from_file, read_nvml
from vllm_ctxmgr.report import gpus_text

MIB = 1 << 20


class _Error(Exception):
    pass


def fake_pynvml(*, v2: bool, unified: bool = False) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = _Error  # type: ignore[attr-defined]
    module.nvmlMemory_v2 = 33554472  # type: ignore[attr-defined]  # nvidia-ml-py's value

    def memory_info(handle: object, version: int | None = None) -> types.SimpleNamespace:
        if unified:
            raise _Error("Not Supported")  # GB10 / Jetson: nvidia-smi's "Memory-Usage: Not Supported"
        if version is not None:
            if not v2:
                raise _Error("Function Not Found")  # a driver older than nvmlMemory_v2
            return types.SimpleNamespace(
                total=81920 * MIB, reserved=763 * MIB, used=1 * MIB, free=81158 * MIB, version=version
            )
        # v1 counts the driver's reserve as used
        return types.SimpleNamespace(total=81920 * MIB, used=764 * MIB, free=81156 * MIB)

    def unsupported(*_: object) -> list[object]:
        raise _Error("Not Supported")

    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: "555.42.02"  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: object()  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory_info  # type: ignore[attr-defined]
    module.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 0)  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: "NVIDIA A100-SXM4-80GB"  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: "GPU-72d87681-01db-370e-567d-41afcf20fad0"  # type: ignore[attr-defined]
    module.nvmlDeviceGetComputeRunningProcesses = unsupported  # type: ignore[attr-defined]
    module.nvmlDeviceGetGraphicsRunningProcesses = unsupported  # type: ignore[attr-defined]
    return module


def test_the_total_is_cudas_the_drivers_reserve_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(v2=True))
    state = read_nvml()
    gpu = state.gpus[0]
    assert gpu.total_bytes == (81920 - 763) * MIB
    assert gpu.reserved_bytes == 763 * MIB
    assert (gpu.free_bytes, gpu.used_bytes) == (81158 * MIB, 1 * MIB)
    assert state.notes == ()
    # what vLLM requests at 0.9 is 0.67 GiB less than nvidia-smi's total would say
    assert requested_bytes(81920 * MIB, 0.9) - requested_bytes(gpu.total_bytes, 0.9) == pytest.approx(
        0.9 * 763 * MIB, abs=1
    )
    text = gpus_text(state)
    assert "total 79.25 GiB" in text and "+0.75 GiB reserved by the driver" in text


def test_an_old_driver_keeps_nvidia_smis_total_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(v2=False))
    state = read_nvml()
    assert state.gpus[0].total_bytes == 81920 * MIB
    assert state.gpus[0].reserved_bytes == 0
    assert len(state.notes) == 1 and "nvmlMemory_v2" in state.notes[0]
    assert "note: this driver's NVML" in gpus_text(state)


def test_the_reserve_travels_in_a_gpus_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(v2=True))
    state = read_nvml()
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(state.to_json()))
    again = gpus_from_file(path)
    assert again.gpus[0] == state.gpus[0]
    # a file written before the field existed still reads, with no reserve
    data = state.to_json()
    del data["gpus"][0]["reserved_bytes"]
    path.write_text(json.dumps(data))
    assert gpus_from_file(path).gpus[0].reserved_bytes == 0


def test_a_unified_memory_gpu_is_planned_with_the_systems_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A DGX Spark's GB10: NVML has no memory figure for it; CUDA (and so vLLM) sees the system's."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(v2=True, unified=True))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       125442260 kB\nMemFree:        98765432 kB\nMemAvailable:   120000000 kB\n"
    )
    state = read_nvml(meminfo)
    gpu = state.gpus[0]
    assert (gpu.total_bytes, gpu.free_bytes) == (125442260 * 1024, 120000000 * 1024)
    assert gpu.used_bytes == gpu.total_bytes - gpu.free_bytes and gpu.reserved_bytes == 0
    assert "unified memory" in state.notes[0] and "119.63 GiB" in state.notes[0]
    meminfo.write_text("garbage\n")
    with pytest.raises(CtxmgrError, match="no memory of its own"):
        read_nvml(meminfo)
