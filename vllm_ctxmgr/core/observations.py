"""What one start of a service logged about memory: vLLM's own numbers, read from the journal.

Filled by `vllm_log.observe_start`; the planner prefers these to its estimates.
"""

from __future__ import annotations

from dataclasses import dataclass


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
