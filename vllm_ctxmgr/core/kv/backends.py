"""Which attention backend vLLM picks, the block sizes it takes, the KV dtypes and their bytes.

Mirrors vLLM 0.33.0's `platforms/cuda.py` / `platforms/cpu.py` backend priorities (block sizes only:
no kernel is chosen here), `config/cache.py` cache dtypes, and the per-model rules that rewrite the
cache dtype (DeepSeek-V3.2 and GLM-5 DSA). Everything here decides *bytes per token per layer* or
*tokens per block*; how layers become specs and share a pool is in `specs.py` and `layout.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_ctxmgr.core.facts import LayerFacts, ModelFacts, StateFacts, dtype_bytes
from vllm_ctxmgr.core.hardware import Platform
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, RULES, VllmVersion, rule
from vllm_ctxmgr.errors import UsageError

__all__ = ["NEWEST_VLLM", "VllmVersion"]  # re-exported: report.py and verify.py import them from here

DEFAULT_BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE
CPU_DEFAULT_BLOCK_SIZE = 128  # platforms/cpu.py: preferred size for CPU_ATTN
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64  # v1/attention/backends/gdn_attn.py

# state_content_bytes of the DeepSeek sparse-MLA packed formats (mla_attention.py get_kv_cache_spec)
PACKED_MLA_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
# Triton attention packs one fp32 scale after each head's K and after its V (triton_attn.py
# customize_spec); int4 packs two values per byte, so its head sizes are halved.
PER_TOKEN_HEAD_KV_DTYPES = ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")
PER_TOKEN_HEAD_SCALE_BYTES = 4  # get_dtype_size(torch.float32)
# FlashInfer NVFP4: per head and side, head_size/2 bytes of fp4 + head_size/16 fp8 block scales
# (utils/torch_utils.py nvfp4_kv_cache_full_dim, flashinfer.py customize_spec)
NVFP4_KV_DTYPES = ("nvfp4", "nvfp4_4over6")
KNOWN_KV_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "half",
    "float32",
    *FP8_KV_DTYPES,
    *PACKED_MLA_BYTES,
    *PER_TOKEN_HEAD_KV_DTYPES,
    *NVFP4_KV_DTYPES,
)

_EVER_ACCEPTED = frozenset(name for row in RULES if row.name == "kv_cache_dtypes" for name in row.value)
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """fp8 and nvfp4 caches: they pick the sparse-MLA backend and format, and a plan offers the fp8
    alternative (or fp8 for DCP with DSA) only where the cache is not quantized already.
    """
    return (
        kv_cache_dtype.startswith("fp8")
        or kv_cache_dtype.startswith("nvfp4")
        or kv_cache_dtype in PER_TOKEN_HEAD_KV_DTYPES
    )


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Element bytes of an explicit --kv-cache-dtype: every fp8 variant and packed MLA format stores one
    byte per element (the packed formats' row size is PACKED_MLA_BYTES, not this).
    """
    if (
        kv_dtype in PACKED_MLA_BYTES
        or kv_dtype.startswith("fp8")
        or kv_dtype in PER_TOKEN_HEAD_KV_DTYPES
        or kv_dtype in NVFP4_KV_DTYPES
    ):
        return 1  # uint8 / int8 storage; the scales are in attention_content_bytes
    return dtype_bytes(kv_dtype)


def nvfp4_kv_cache_full_dim(head_size: int) -> int:
    """vllm.utils.torch_utils.nvfp4_kv_cache_full_dim: fp4 data + fp8 block scales of one head side."""
    return head_size // 2 + head_size // 16


def attention_content_bytes(head_size: int, head_size_v: int, kv_dtype: str) -> int | None:
    """Bytes one KV head of one token takes where the backend packs scales with it (customize_spec).

    None for the dense formats, whose content is (head_size + head_size_v) x element bytes. FlashInfer
    gives NVFP4 2 x num_kv_heads slots of one side each; per KV head that is both sides, as here.
    """
    if kv_dtype in PER_TOKEN_HEAD_KV_DTYPES:
        k, v = head_size, head_size_v
        if kv_dtype == "int4_per_token_head":
            k, v = k // 2, v // 2
        return k + v + 2 * PER_TOKEN_HEAD_SCALE_BYTES
    if kv_dtype in NVFP4_KV_DTYPES:
        if nvfp4_kv_cache_full_dim(head_size) != nvfp4_kv_cache_full_dim(head_size_v):
            raise UsageError("vLLM's NVFP4 KV cache does not support different K and V head sizes")
        return 2 * nvfp4_kv_cache_full_dim(head_size)
    return None


def mla_content_bytes(layer: LayerFacts, kv_dtype: str, kv_bytes: int) -> int:
    """One MLA layer's bytes per token, as mla_attention.py get_kv_cache_spec sizes it: the packed
    formats' fixed row (fp8_ds_mla 656 B) or the latent's head_size x element bytes.
    """
    return PACKED_MLA_BYTES.get(kv_dtype, layer.head_size * kv_bytes)


@dataclass(frozen=True)
class AttentionBackend:
    """The block-size facts of one vLLM attention backend (not the kernel: ctxmgr runs none)."""

    name: str
    min_kernel_block: int  # smallest kernel block size it takes (MultipleOf base or fixed)
    preferred_block: int  # get_preferred_block_size(16) for this backend alone
    mla_format: str = "latent"  # "latent" | "fp8_ds_mla" | "standard_fp8"
    user_block: str = "kept"  # rule mla_backend before 0.18: "forced" | "multiple" (of preferred_block)


def _is_glm_dsa(facts: ModelFacts) -> bool:
    return facts.model_type in ("glm_moe_dsa", "glm-dsa") or "GlmMoeDsaForCausalLM" in facts.architectures


def _is_deepseek_v32(facts: ModelFacts) -> bool:
    return facts.model_type == "deepseek_v32" or "DeepseekV32ForCausalLM" in facts.architectures


def resolve_model_dtype(facts: ModelFacts, args: ServeArgs, platform: Platform) -> str:
    """The dtype vLLM runs the model in (ModelConfig.dtype), which the `auto` KV cache dtype follows;
    `--dtype auto` takes the platform's choice, an explicit name must be one dtype_bytes knows.
    """
    requested = _DTYPE_ALIASES.get(args.dtype.lower(), args.dtype.lower())
    if requested == "auto":
        return platform.default_model_dtype(_DTYPE_ALIASES.get(facts.dtype, facts.dtype))
    dtype_bytes(requested)  # validates
    return requested


def resolve_kv_cache_dtype(
    facts: ModelFacts, args: ServeArgs, platform: Platform, vllm_version: VllmVersion, notes: list[str]
) -> str:
    """cache_config.cache_dtype after the model's and the checkpoint's rules (before the backend's)."""
    kv = args.kv_cache_dtype.lower()
    accepted = rule("kv_cache_dtypes", vllm_version)
    if kv in _EVER_ACCEPTED and kv not in accepted:
        raise UsageError(
            f"vLLM {'.'.join(map(str, vllm_version))} has no --kv-cache-dtype {args.kv_cache_dtype} "
            f"(it takes {', '.join(accepted)})"
        )
    if kv not in accepted and kv != "half":  # a typo (fp9) is vLLM's argparse error, not a gap here
        raise UsageError(
            f"vLLM {'.'.join(map(str, vllm_version))} has no such kv-cache dtype: {args.kv_cache_dtype} "
            f"(choices: {', '.join(accepted)})"
        )
    if kv not in KNOWN_KV_DTYPES:
        raise UsageError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: not modelled by ctxmgr (scales packed per page)"
        )
    if kv == "half":
        kv = "float16"
    if kv == "auto" and facts.kv_cache_scheme:
        kv = facts.kv_cache_scheme
        notes.append(f"the checkpoint declares a {kv} KV cache scheme, so 'auto' means {kv}")
    if _is_deepseek_v32(facts):
        if rule("dsv32_auto_kv_dtype", vllm_version) == "fp8_ds_mla" and (
            kv == "auto" or kv.startswith("fp8")
        ):
            notes.append("vLLM 0.11.0 forces DeepSeek-V3.2's KV cache to fp8_ds_mla, 'auto' included")
            return "fp8_ds_mla"
        if kv == "bfloat16":
            kv = "auto"
    if _is_glm_dsa(facts) and kv == "auto" and platform.is_capability_family(100):
        notes.append("GLM-5 (glm_moe_dsa) on SM10x: vLLM turns --kv-cache-dtype auto into fp8_e4m3")
        kv = "fp8_e4m3"
    return kv


def _forced_mla_backend(
    facts: ModelFacts, platform: Platform, version: VllmVersion
) -> AttentionBackend | None:
    """Dense MLA before 0.18: platforms/cuda.py forced a backend and its block (rule mla_backend)."""
    forced = rule("mla_backend", version)
    choice = forced.get({9: "sm90", 10: "sm100"}.get(platform.capability_major, ""), "PRIORITIES")
    user_block = forced["user_block"]
    if choice == "FLASHINFER_MLA_IF_QK_NOPE_128":
        choice = "FLASHINFER_MLA" if facts.qk_nope_head_dim == 128 else "CUTLASS_MLA"
    blocks = {"FLASHMLA": 64, "CUTLASS_MLA": 128, "FLASHINFER_MLA": 64}
    if choice in blocks:
        return AttentionBackend(choice, blocks[choice], blocks[choice], user_block=user_block)
    if choice == "TRITON_MLA":
        return AttentionBackend("TRITON_MLA", 16, 16)
    return None


def select_attention_backend(
    facts: ModelFacts,
    kv_cache_dtype: str,
    platform: Platform,
    tp: int,
    dcp: int,
    vllm_version: VllmVersion = NEWEST_VLLM,
) -> AttentionBackend:
    """The first backend vLLM would select (0.33.0's platforms/cuda.py priorities), block sizes only.

    Dense MLA before 0.18 follows the forced choices of rule mla_backend instead.
    """
    quantized = is_quantized_kv_cache(kv_cache_dtype)
    if platform.is_cpu:
        if facts.is_mla:
            return AttentionBackend("CPU_MLA", 16, 16)
        return AttentionBackend("CPU_ATTN", 32, CPU_DEFAULT_BLOCK_SIZE)
    major = platform.capability_major
    if facts.is_mla and facts.has_indexer:  # DeepSeek sparse attention
        if major == 9:
            if not quantized and dcp == 1:
                return AttentionBackend("FLASH_ATTN_MLA_SPARSE", 64, 64)
            return AttentionBackend("FLASHMLA_SPARSE", 64, 64, "fp8_ds_mla" if quantized else "latent")
        if major == 10:
            if quantized and kv_cache_dtype not in PACKED_MLA_BYTES:
                return AttentionBackend("FLASHINFER_MLA_SPARSE", 32, 32, "standard_fp8")
            heads_per_gpu = facts.num_attention_heads // tp
            if not quantized and heads_per_gpu <= 16:
                return AttentionBackend("FLASH_ATTN_MLA_SPARSE_FA4", 64, 64)
            return AttentionBackend("FLASHMLA_SPARSE", 64, 64, "fp8_ds_mla" if quantized else "latent")
        if major == 12:
            fmt = "fp8_ds_mla" if kv_cache_dtype in ("auto", "fp8", "fp8_e4m3") else "latent"
            return AttentionBackend("FLASHINFER_MLA_SPARSE_SM120", 64, 64, fmt)
        raise UsageError(f"vLLM has no sparse-MLA backend for compute capability {major}.x")
    if facts.is_mla:
        forced = _forced_mla_backend(facts, platform, vllm_version)
        if forced is not None:
            return forced
        if major == 9:
            if quantized:
                return AttentionBackend("FLASHMLA", 64, 64)
            return AttentionBackend("FLASH_ATTN_MLA", 16, 16)
        if major == 10:
            if facts.qk_nope_head_dim in (64, 128, 192):
                return AttentionBackend("FLASHINFER_MLA", 32, 32)
            return AttentionBackend("CUTLASS_MLA", 128, 128)
        return AttentionBackend("TRITON_MLA", 16, 16)
    if kv_cache_dtype in PER_TOKEN_HEAD_KV_DTYPES:
        return AttentionBackend("TRITON_ATTN", 16, 16)  # the only backend that lists these dtypes
    if kv_cache_dtype in NVFP4_KV_DTYPES:
        if major != 10:
            raise UsageError(f"--kv-cache-dtype {kv_cache_dtype} needs FlashInfer on SM100 (Blackwell)")
        return AttentionBackend("FLASHINFER", 16, 16)
    if major == 10:
        return AttentionBackend("FLASHINFER", 16, 16)
    return AttentionBackend("FLASH_ATTN", 16, 16)


def backend_kv_cache_dtype(
    facts: ModelFacts,
    kv_dtype: str,
    backend: AttentionBackend,
    dcp: int,
    platform: Platform,
    notes: list[str],
) -> str:
    """The cache dtype after the backend's own rules: DeepSeek sparse-MLA backends pack fp8 as fp8_ds_mla."""
    if facts.is_mla and facts.has_indexer:
        if backend.mla_format == "fp8_ds_mla" and kv_dtype not in PACKED_MLA_BYTES:
            notes.append(
                f"{backend.name} serves a quantized KV cache as fp8_ds_mla (656 B per token per layer)"
            )
            kv_dtype = "fp8_ds_mla"
        elif backend.mla_format == "standard_fp8":
            notes.append(f"{backend.name} uses standard fp8 (576 B per token per layer), not fp8_ds_mla")
        if dcp > 1 and backend.name == "FLASHMLA_SPARSE" and kv_dtype != "fp8_ds_mla":
            raise UsageError(
                "decode context parallel with sparse MLA needs the FlashMLA-sparse fp8_ds_mla cache "
                "(--kv-cache-dtype fp8)"
            )
    if kv_dtype == "nvfp4_ds_mla" and not platform.is_capability_family(100):
        raise UsageError("nvfp4_ds_mla needs SM100 (Blackwell)")
    if kv_dtype in PACKED_MLA_BYTES and not facts.is_mla:
        raise UsageError(f"--kv-cache-dtype {kv_dtype} exists only for MLA models")
    if facts.is_mla and (kv_dtype in PER_TOKEN_HEAD_KV_DTYPES or kv_dtype in NVFP4_KV_DTYPES):
        raise UsageError(f"--kv-cache-dtype {kv_dtype}: not modelled by ctxmgr for MLA models")
    return kv_dtype


def backend_block_size(
    facts: ModelFacts,
    args: ServeArgs,
    platform: Platform,
    backend: AttentionBackend,
    has_attention: bool,
    notes: list[str],
) -> int:
    """Phase 1 of the block size (platforms/interface.py): the user's value wins, else the backend's.

    The DSA indexer takes 64-token blocks on CUDA, and the CPU MLA backend only 16.
    """
    block_size = args.block_size or backend.preferred_block
    if args.block_size is not None and (
        backend.user_block == "forced"
        or (backend.user_block == "multiple" and args.block_size % backend.preferred_block)
    ):
        notes.append(
            f"vLLM forces block size {backend.preferred_block} for {backend.name} (was {args.block_size})"
        )
        block_size = backend.preferred_block
    if facts.has_indexer and not platform.is_cpu and args.block_size is None:
        block_size = math.lcm(block_size, 64)
    if platform.is_cpu and facts.is_mla:
        block_size = 16
    platform_default = CPU_DEFAULT_BLOCK_SIZE if platform.is_cpu else DEFAULT_BLOCK_SIZE
    if args.block_size is None and block_size != platform_default and has_attention:
        notes.append(f"Setting kv cache block size to {block_size} for {backend.name} backend(s).")
    return block_size


def flashinfer_gdn_prefill(platform: Platform, state: StateFacts) -> bool:
    """_resolve_gdn_prefill_backend('auto'): FlashInfer on SM90, or SM10x/12x with CUDA 13 and k dim 128."""
    if not platform.is_cuda:
        return False
    if platform.compute_capability is None or platform.compute_capability == (9, 0):
        return True
    if platform.capability_major in (10, 12) and state.k_head_dim == 128:
        return platform.cuda_runtime_major is None or platform.cuda_runtime_major >= 13
    return False
