"""GPU memory on the seeds' machine (8 x 95.6 GiB) as NVML would report it, for verify's tests: vLLM's
service on every GPU, maybe a neighbour taking memory."""

from __future__ import annotations

import math

from tests.support.demo import SEED_GPU_COUNT, SEED_GPU_GIB
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState

TOTAL = int(SEED_GPU_GIB * GIB)  # what `--gpu-memory 95.6GiB` gives the planner
SERVICE_PID = 4242
OTHER_PID = 5151


def gpu_state(service_bytes: int | None, others: int = 0, count: int = SEED_GPU_COUNT) -> GpuState:
    gpus = []
    for index in range(count):
        processes = [GpuProcess(SERVICE_PID, "vllm serve", service_bytes)]
        if others:
            processes.append(GpuProcess(OTHER_PID, "python train.py", others))
        used = (service_bytes or 0) + others
        gpus.append(
            GpuInfo(index, "NVIDIA RTX PRO 6000", TOTAL, TOTAL - used, used, processes=tuple(processes))
        )
    return GpuState(tuple(gpus), "test")


VLLM_HOLDS = math.ceil(TOTAL * 0.90) + GIB  # what vLLM at 0.90 holds: the request plus its CUDA context
