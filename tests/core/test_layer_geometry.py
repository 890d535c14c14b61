"""Per-layer geometry and the planner inputs that decide pages: Gemma-4's global layers, the KV dtypes
that pack scales, the CUDA runtime that picks the GDN backend, and DeepSeek-V4 refused by name."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.change.planning import PlanRequest, plan_for
from vllm_ctxmgr.core.facts import LayerKind
from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.kv.layout import kv_cache_layout
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import ModelFactsError, UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.systemd.service import installed_cuda_version, view_from_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit

MODELS = REPO / "examples" / "models"
GEMMA4_12B = MODELS / "gemma-4-12b"
LLAMA_70B = MODELS / "llama-3.1-70b"
QWEN3_NEXT = MODELS / "qwen3-next-80b-a3b"

H200 = Platform("cuda", (9, 0), "NVIDIA H200", 140 * GIB)
B200 = Platform("cuda", (10, 0), "NVIDIA B200", 179 * GIB)


# --- Gemma-4: each layer its own head size and KV heads -------------------------------------------


def test_gemma4_global_layers_have_their_own_head_size_and_kv_heads() -> None:
    """google/gemma-4-12B: 48 layers, every 6th full_attention. Sliding layers: num_key_value_heads 8 x
    head_dim 256, window 1024; global layers: attention_k_eq_v, so num_global_key_value_heads 1 x
    global_head_dim 512 (transformers Gemma4UnifiedTextConfig.__post_init__ -> per_layer_config, which
    vLLM's gemma4.py reads per layer)."""
    facts = load_model_facts(str(GEMMA4_12B))
    geometry = Counter(
        (layer.kind, layer.num_kv_heads, layer.head_size, layer.window) for layer in facts.layers
    )
    assert geometry == {
        (LayerKind.SLIDING, 8, 256, 1024): 40,
        (LayerKind.FULL, 1, 512, None): 8,
    }
    assert [i for i, layer in enumerate(facts.layers) if layer.kind == LayerKind.FULL] == list(
        range(5, 48, 6)
    )
    assert "global_head_dim" in facts.provenance["per_layer_geometry"]


def test_gemma4_planned_bytes_per_token_and_blocks() -> None:
    """Worked by hand, H200, bf16, TP 1, --max-model-len 32768, block 16 (FLASH_ATTN):

    sliding page = 8 heads x 16 tokens x (256 + 256) x 2 B = 131072 B
    global page  = 1 head  x 16 tokens x (512 + 512) x 2 B =  32768 B, a quarter of it, so vLLM's
                   unify_kv_cache_spec_page_size scales the global block to 16 x 4 = 64 tokens (131072 B)
    groups: 40 sliding + 8 global layers of one page size -> group size 8: 5 sliding groups + 1 full
    one pool block = 8 layers x 131072 B = 1 MiB; 20 GiB hold 20480 blocks
    per request: sliding cdiv(min(1024 - 1 + 16384 in flight, 32768), 16) + 1 = 1088 + 1 = 1089 per
                 group; full cdiv(32768, 64) = 512 -> 5 x 1089 + 512 = 5957 blocks
    bytes per context token: 1 MiB / 64 tokens = 16384 B (= 8 global layers x 1 x 1024 x 2 B).
    With one head_dim / num_key_value_heads for all layers the global layers were 8 x 256 (block 16,
    2048 blocks per request, 65536 B per token: four times too much).
    """
    facts = load_model_facts(str(GEMMA4_12B))
    layout = kv_cache_layout(facts, ServeArgs(str(GEMMA4_12B), max_model_len=32768), H200)
    assert [group.kind for group in layout.groups] == ["sliding"] * 5 + ["full"]
    assert [group.block_size for group in layout.groups] == [16] * 5 + [64]
    assert {group.page_size_bytes for group in layout.groups} == {131072}
    assert layout.bytes_per_block == 8 * 131072
    assert layout.num_gpu_blocks(20 * GIB) == 20480
    assert layout.group_blocks(32768) == (1089,) * 5 + (512,)
    assert layout.blocks_needed(32768) == 5957
    assert layout.bytes_per_token() == 16384


def test_gemma4_explicit_per_layer_config_wins(tmp_path: Path) -> None:
    """A config that spells `per_layer_config` (index -> overrides) is read as transformers reads it."""
    raw = json.loads((GEMMA4_12B / "config.json").read_text())
    raw["text_config"]["per_layer_config"] = {"5": {"head_dim": 384, "num_key_value_heads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    facts = load_model_facts(str(tmp_path))
    assert (facts.layers[5].num_kv_heads, facts.layers[5].head_size) == (2, 384)
    assert (facts.layers[11].num_kv_heads, facts.layers[11].head_size) == (8, 256)  # no override


# --- KV dtypes that pack scales with each head ----------------------------------------------------


@pytest.mark.parametrize(
    ("kv_cache_dtype", "platform", "backend", "page_size_bytes"),
    [
        # Llama-3.1-70B at TP 8: 1 KV head of 128 per GPU, block 16
        ("auto", H200, "FLASH_ATTN", 16 * (128 + 128) * 2),  # 8192
        ("fp8", H200, "FLASH_ATTN", 16 * (128 + 128) * 1),  # 4096
        # triton_attn.py customize_spec: data + one fp32 scale for K and one for V per head and token
        ("fp8_per_token_head", H200, "TRITON_ATTN", 16 * (128 + 128 + 2 * 4)),  # 4224
        ("int8_per_token_head", H200, "TRITON_ATTN", 16 * (128 + 128 + 2 * 4)),  # 4224
        ("int4_per_token_head", H200, "TRITON_ATTN", 16 * (64 + 64 + 2 * 4)),  # 2176: two values a byte
        # flashinfer.py customize_spec: 2 slots per KV head of nvfp4_kv_cache_full_dim(128) = 64 + 8 B
        ("nvfp4", B200, "FLASHINFER", 16 * 2 * (128 // 2 + 128 // 16)),  # 2304
        ("nvfp4_4over6", B200, "FLASHINFER", 16 * 2 * (128 // 2 + 128 // 16)),
    ],
)
def test_kv_dtype_page_bytes(
    kv_cache_dtype: str, platform: Platform, backend: str, page_size_bytes: int
) -> None:
    facts = load_model_facts(str(LLAMA_70B))
    args = ServeArgs(
        str(LLAMA_70B), tensor_parallel_size=8, max_model_len=8192, kv_cache_dtype=kv_cache_dtype
    )
    layout = kv_cache_layout(facts, args, platform)
    summary = layout.summary(8192)
    assert summary["attention_backend"] == backend
    assert layout.page_size_bytes == page_size_bytes
    assert layout.bytes_per_block == 80 * page_size_bytes  # 80 layers in one group


def test_kv_dtypes_follow_the_version_rules_and_refuse_what_is_not_modelled() -> None:
    facts = load_model_facts(str(LLAMA_70B))
    older = ServeArgs(str(LLAMA_70B), tensor_parallel_size=8, kv_cache_dtype="int4_per_token_head")
    with pytest.raises(UsageError, match=r"vLLM 0\.20\.0 has no --kv-cache-dtype int4_per_token_head"):
        kv_cache_layout(facts, older, H200, (0, 20, 0))  # int4 arrived in 0.25.0 (rule kv_cache_dtypes)
    with pytest.raises(UsageError, match="needs FlashInfer on SM100"):
        kv_cache_layout(
            facts, ServeArgs(str(LLAMA_70B), tensor_parallel_size=8, kv_cache_dtype="nvfp4"), H200
        )
    with pytest.raises(UsageError, match="turboquant_k8v4: not modelled"):
        kv_cache_layout(
            facts, ServeArgs(str(LLAMA_70B), tensor_parallel_size=8, kv_cache_dtype="turboquant_k8v4"), H200
        )


# --- the CUDA runtime picks the GDN prefill backend -----------------------------------------------


def _qwen3_next_block_size(cuda_version: str) -> tuple[int, str]:
    request = PlanRequest(
        context=32768,
        gpu_memory=96 * GIB,
        gpu_count=2,
        gpu_name="NVIDIA RTX PRO 6000 Blackwell",  # SM 12.0
        cuda_version=cuda_version,
    )
    plan = plan_for(ServeArgs(str(QWEN3_NEXT), tensor_parallel_size=2), request)
    return plan.layout.block_size, plan.layout.mamba_cache_mode


def test_cuda_version_decides_the_hybrid_block_layout_on_sm12() -> None:
    """Qwen3-Next (12 full + 36 gated-delta-net layers) on SM 12.x: FlashInfer GDN prefill only with
    CUDA >= 13 (gdn_attn.py _resolve_gdn_prefill_backend). With it the block is aligned to 64 tokens
    (FLASHINFER_GDN_CHECKPOINT_ALIGNMENT) and a prefill checkpoint page is kept: 576 tokens; with
    CUDA 12.8 the Triton path keeps the attention-page block, 544 tokens."""
    assert _qwen3_next_block_size("12.8") == (544, "align")
    assert _qwen3_next_block_size("13.0") == (576, "align")


def test_cuda_version_must_be_x_y() -> None:
    with pytest.raises(UsageError, match=r"expected X\.Y"):
        _qwen3_next_block_size("thirteen")


def test_cuda_version_read_from_the_units_venv_torch(tmp_path: Path) -> None:
    """torch/version.py as the cu128 wheels write it, read as text (torch is never imported)."""
    site = tmp_path / "opt/vllm/lib/python3.12/site-packages/torch"
    site.mkdir(parents=True)
    (site / "version.py").write_text(
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'xpu']\n"
        "__version__ = '2.8.0+cu128'\n"
        "debug = False\n"
        "cuda: Optional[str] = '12.8'\n"
        "git_version = 'a1cb3cc05d46d198467bebbb6e8fba50a325d4e7'\n"
        "hip: Optional[str] = None\n"
        "xpu: Optional[str] = None\n"
    )
    assert installed_cuda_version("/opt/vllm/bin/vllm", tmp_path) == "12.8"
    assert installed_cuda_version("vllm", tmp_path) is None  # not a venv path
    (site / "version.py").write_text("cuda: Optional[str] = None\n")  # a CPU build of torch
    assert installed_cuda_version("/opt/vllm/bin/python3", tmp_path) is None


def test_a_unit_is_planned_with_its_own_venvs_cuda_runtime(tmp_path: Path) -> None:
    """The unit's venv says CUDA 12.8: the plan takes it without --cuda-version (the flag still wins)."""
    site = tmp_path / "opt/vllm/lib/python3.12/site-packages/torch"
    site.mkdir(parents=True)
    (site / "version.py").write_text("cuda: Optional[str] = '12.8'\n")
    unit_file = tmp_path / "vllm-qwen3-next.service"
    model = QWEN3_NEXT
    unit_file.write_text(f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {model} -tp 2\n")
    view = view_from_unit(ServiceUnit.load_with_dropins(unit_file), tmp_path)
    assert view.args.cuda_version == "12.8"
    request = PlanRequest(
        32768, gpu_memory=int(95.6 * GIB), gpu_count=2, gpu_name="NVIDIA RTX PRO 6000 Blackwell"
    )
    from_venv = plan_for(view.args, request)
    flag = plan_for(view.args, replace(request, cuda_version="13.0"))
    assert from_venv.layout.block_size != flag.layout.block_size  # 12.8 and 13.0 lay blocks out apart


# --- DeepSeek-V4: refused by name, not read as plain MLA -------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        # vLLM 0.33 registry.py: DeepseekV4ForCausalLM -> vllm.models.deepseek_v4; the MLA model types in
        # model_arch_config_convertor.py list deepseek_v4 / deepseek_v41
        {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"},
        {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"},
        # transformers_utils/deepseek_v4_utils.py get_compress_ratios reads compress_ratios
        {"architectures": ["SomeForkForCausalLM"], "model_type": "fork", "compress_ratios": [0, 4, 128]},
    ],
)
def test_deepseek_v4_compressed_sparse_attention_is_refused(tmp_path: Path, keys: dict) -> None:
    config = {
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "hidden_size": 4096,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "vocab_size": 129280,
        "torch_dtype": "bfloat16",
        **keys,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFactsError, match="DeepSeek-V4's compressed sparse attention is not modelled"):
        load_model_facts(str(tmp_path))
