"""What a model is, as vLLM sees it: plain dataclasses, no I/O.

`sources.py` fills these from a HF config.json or GGUF metadata; `kv.py` turns them into
vLLM's KV-cache specs. Field names follow vLLM / HF words (num_kv_heads, head_size, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class LayerKind(StrEnum):
    """The KV-cache spec vLLM gives one decoder layer (vllm/v1/kv_cache_interface.py)."""

    FULL = "full"  # FullAttentionSpec: MHA / GQA / MQA
    SLIDING = "sliding"  # SlidingWindowSpec
    CHUNKED = "chunked"  # ChunkedLocalAttentionSpec (Llama 4 attention_chunk_size)
    MLA = "mla"  # MLAAttentionSpec: one latent per token, replicated on every TP rank
    MAMBA = "mamba"  # MambaSpec: constant state per request (mamba2, gated delta net, linear attention)
    NONE = "none"  # shares another layer's KV (kv_sharing_target_layer_name): no memory


@dataclass(frozen=True)
class StateFacts:
    """Recurrent state dims of a mamba / linear-attention layer; TP sharding is applied in kv.py."""

    family: str  # "mamba2" | "gdn" (gated delta net) | "linear" (MiniMax lightning)
    conv_kernel: int = 0
    # mamba2
    intermediate_size: int = 0
    n_groups: int = 0
    state_size: int = 0
    num_heads: int = 0
    head_dim: int = 0
    # gated delta net
    num_k_heads: int = 0
    num_v_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    # None = vLLM's "auto": conv follows the model dtype, ssm follows the conv dtype
    conv_dtype: str | None = None
    ssm_dtype: str | None = None


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer's attention as vLLM builds its KV spec."""

    kind: LayerKind
    num_kv_heads: int = 0  # total over all ranks (full/sliding/chunked); 1 for MLA
    head_size: int = 0  # K width; MLA: kv_lora_rank + qk_rope_head_dim
    head_size_v: int = 0  # V width; 0 for MLA (K and V share the latent)
    window: int | None = None  # sliding window or attention chunk size, in tokens
    indexer_head_dim: int = 0  # DSA indexer K cache on this layer when > 0
    state: StateFacts | None = None  # MAMBA layers only


@dataclass(frozen=True)
class RopeFacts:
    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelFacts:
    """Everything the planner needs to know about a model, with where each fact came from."""

    source: str  # path or repo id the user named
    source_format: str  # "hf" | "gguf"
    model_type: str  # HF model_type or GGUF general.architecture
    architectures: tuple[str, ...]
    num_attention_heads: int
    layers: tuple[LayerFacts, ...]  # decoder layers vLLM builds, MTP layers excluded
    dtype: str  # torch dtype name of the weights: "bfloat16", "float16", "float32"
    # max-length keys found in the (text) config, in vLLM's lookup order: (key, value)
    position_limits: tuple[tuple[str, int], ...] = ()
    rope: tuple[RopeFacts, ...] = ()
    sliding_window: int | None = None  # model-level window (for --disable-sliding-window)
    hidden_size: int | None = None
    mtp_layers: int = 0  # num_nextn_predict_layers
    # MLA parameters kept for display and for VLLM_MLA_DISABLE
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    weight_bytes: int | None = None  # on-disk tensor bytes, all shards / GGUF parts
    quantization: str | None = None  # quantization_config.quant_method or GGUF file type
    kv_cache_scheme: str | None = None  # KV dtype a checkpoint's quantization_config declares
    provenance: dict[str, str] = field(default_factory=dict)  # fact -> where it came from
    notes: tuple[str, ...] = ()

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)

    def count(self, kind: LayerKind) -> int:
        return sum(1 for layer in self.layers if layer.kind == kind)

    @property
    def is_mla(self) -> bool:
        return any(layer.kind == LayerKind.MLA for layer in self.layers)

    @property
    def has_indexer(self) -> bool:
        return any(layer.indexer_head_dim for layer in self.layers)


DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "uint8": 1,
    "int8": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
