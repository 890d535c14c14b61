"""The vLLM engine arguments that decide KV-cache memory, in vLLM's own names.

`parse_serve_argv` reads them out of a `vllm serve` command line (as found in a unit's ExecStart);
`ServeArgs` is what the planner takes. Unknown flags are kept untouched by the unit editor.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServeArgs:
    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None  # None = vLLM derives it; -1 = "auto" (fit to memory)
    gpu_memory_utilization: float | None = None  # None = vLLM's default for the version
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool | None = None  # None = vLLM's default
    enforce_eager: bool = False
    disable_sliding_window: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    num_speculative_tokens: int = 0
    served_model_name: str | None = None
    host: str | None = None
    port: int = 8000
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # the unit's Environment= (VLLM_*, CUDA_*)
