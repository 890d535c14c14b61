"""What a model is, as vLLM sees it: plain dataclasses, no I/O.

`model_files/` fills these from a HF config.json or GGUF metadata (ModelFacts checks its own
invariants on construction, `validate`, so no reader can build garbage); `kv.py` turns them into
vLLM's KV-cache specs. Field names follow vLLM / HF words (num_kv_heads, head_size, ...).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import StrEnum

from vllm_ctxmgr.errors import ModelFactsError

# Bounds a real model stays far inside; anything outside is a broken or hostile file, refused
# before it can reach the KV arithmetic (a layer count of 1e30 would never finish, a head count
# of -1 would plan negative KV bytes).
MAX_LAYERS = 10_000
MAX_HEADS = 65_536
MAX_HEAD_SIZE = 65_536
MAX_HIDDEN_SIZE = 1 << 24
MAX_POSITIONS = 1 << 40
MAX_STATE_DIM = 1 << 24
MAX_WEIGHT_BYTES = 1 << 52  # 4 PiB
MAX_ROPE_FACTOR = 1e6


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
    """One RoPE scaling entry (rope_parameters, the legacy rope_scaling dict, or GGUF rope keys).

    vLLM multiplies the derived max_model_len by `factor` unless the type is exempt; LongRoPE serves
    original_max_position_embeddings by default, and 0.11 scaled yarn from it.
    """

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
    # shapes for the non-KV memory model (core/memory.py); None where the config does not say
    vocab_size: int | None = None  # lm_head rows: the sampler's logits are [max_num_seqs, vocab_size]
    intermediate_size: int | None = None  # dense MLP width
    moe_intermediate_size: int | None = None  # one expert's MLP width (intermediate_size where unnamed)
    num_experts: int | None = None  # routed experts (num_local_experts / n_routed_experts)
    num_experts_per_tok: int | None = None  # experts each token is routed to (top-k)
    # a multimodal prefix-LM model's largest item in tokens (Gemma-4: a 32-frame video, 2496): vLLM
    # raises a default max_num_batched_tokens to it, so one item fits a batch; None for other models
    mm_prefix_lm_item_tokens: int | None = None
    provenance: dict[str, str] = field(default_factory=dict)  # fact -> where it came from
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_hidden_layers(self) -> int:
        """vLLM's num_hidden_layers: the decoder layers it builds (MTP excluded), each a piecewise graph."""
        return len(self.layers)

    def count(self, kind: LayerKind) -> int:
        """Layers of one kind: Mamba layers switch vLLM's mamba cache mode and default model runner."""
        return sum(1 for layer in self.layers if layer.kind == kind)

    @property
    def is_mla(self) -> bool:
        """vLLM's use_mla: the latent cache is one head replicated on every TP rank, on MLA backends."""
        return any(layer.kind == LayerKind.MLA for layer in self.layers)

    @property
    def has_indexer(self) -> bool:
        """DeepSeek sparse attention: an indexer K cache per layer, sparse-MLA backends, fp8_ds_mla."""
        return any(layer.indexer_head_dim for layer in self.layers)


def _check_int(
    facts: ModelFacts, name: str, value: object, low: int, high: int, *, optional: bool = False
) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ModelFactsError(f"{facts.source}: {name} is {value!r}, expected an integer in {low}..{high}")


def validate(facts: ModelFacts) -> None:
    """The invariants every ModelFacts holds, whichever reader built it: types, ranges, finite numbers.

    Raises ModelFactsError naming the source and the fact, so no path can hand garbage to the planner.
    """
    check = functools.partial(_check_int, facts)
    if not isinstance(facts.source, str) or not isinstance(facts.model_type, str):
        raise ModelFactsError(f"{facts.source!r}: source and model_type must be strings")
    if not isinstance(facts.architectures, tuple) or not all(isinstance(a, str) for a in facts.architectures):
        raise ModelFactsError(f"{facts.source}: architectures is {facts.architectures!r}, expected names")
    if facts.dtype not in DTYPE_BYTES:
        raise ModelFactsError(f"{facts.source}: dtype {facts.dtype!r} is not one vLLM serves")
    check("num_attention_heads", facts.num_attention_heads, 1, MAX_HEADS)
    if not isinstance(facts.layers, tuple) or not 1 <= len(facts.layers) <= MAX_LAYERS:
        count = len(facts.layers) if isinstance(facts.layers, tuple) else facts.layers
        raise ModelFactsError(f"{facts.source}: num_hidden_layers is {count!r}, expected 1..{MAX_LAYERS}")
    for index, layer in enumerate(facts.layers):
        _check_layer(facts, index, layer)
    if all(layer.kind == LayerKind.NONE for layer in facts.layers):
        raise ModelFactsError(f"{facts.source}: no layer holds a KV cache or state (all share another's)")
    for key, value in facts.position_limits:
        check(key, value, 1, MAX_POSITIONS)
    for rope in facts.rope:
        if rope.factor is not None and (
            not isinstance(rope.factor, float)
            or not math.isfinite(rope.factor)
            or not 0 < rope.factor <= MAX_ROPE_FACTOR
        ):
            raise ModelFactsError(
                f"{facts.source}: rope factor is {rope.factor!r}, expected a positive number"
            )
        check(
            "original_max_position_embeddings",
            rope.original_max_position_embeddings,
            1,
            MAX_POSITIONS,
            optional=True,
        )
    check("sliding_window", facts.sliding_window, 1, MAX_POSITIONS, optional=True)
    check("hidden_size", facts.hidden_size, 1, MAX_HIDDEN_SIZE, optional=True)
    check("mtp_layers", facts.mtp_layers, 0, MAX_LAYERS)
    check("kv_lora_rank", facts.kv_lora_rank, 1, MAX_HEAD_SIZE, optional=True)
    check("qk_rope_head_dim", facts.qk_rope_head_dim, 1, MAX_HEAD_SIZE, optional=True)
    check("qk_nope_head_dim", facts.qk_nope_head_dim, 0, MAX_HEAD_SIZE, optional=True)
    check("weight_bytes", facts.weight_bytes, 0, MAX_WEIGHT_BYTES, optional=True)
    check("vocab_size", facts.vocab_size, 1, MAX_HIDDEN_SIZE, optional=True)
    check("intermediate_size", facts.intermediate_size, 1, MAX_HIDDEN_SIZE, optional=True)
    check("moe_intermediate_size", facts.moe_intermediate_size, 1, MAX_HIDDEN_SIZE, optional=True)
    check("num_experts", facts.num_experts, 1, MAX_HEADS, optional=True)
    check("num_experts_per_tok", facts.num_experts_per_tok, 1, MAX_HEADS, optional=True)
    check("mm_prefix_lm_item_tokens", facts.mm_prefix_lm_item_tokens, 1, MAX_HIDDEN_SIZE, optional=True)


def _check_layer(facts: ModelFacts, index: int, layer: LayerFacts) -> None:
    def check(name: str, value: object, low: int, high: int, *, optional: bool = False) -> None:
        _check_int(facts, f"layer {index} {name}", value, low, high, optional=optional)

    if not isinstance(layer, LayerFacts) or not isinstance(layer.kind, LayerKind):
        raise ModelFactsError(f"{facts.source}: layer {index} is {layer!r}, not a decoder layer")
    if layer.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
        # vLLM's Attention asserts num_heads % num_kv_heads == 0: never more KV heads than heads
        check("num_kv_heads", layer.num_kv_heads, 1, max(1, min(MAX_HEADS, facts.num_attention_heads)))
        check("head_size", layer.head_size, 1, MAX_HEAD_SIZE)
        check("head_size_v", layer.head_size_v, 0, MAX_HEAD_SIZE)
    elif layer.kind == LayerKind.MLA:
        check("num_kv_heads", layer.num_kv_heads, 1, 1)
        check("head_size", layer.head_size, 1, MAX_HEAD_SIZE)
        check("indexer_head_dim", layer.indexer_head_dim, 0, MAX_HEAD_SIZE)
    elif layer.kind == LayerKind.MAMBA:
        if not isinstance(layer.state, StateFacts):
            raise ModelFactsError(f"{facts.source}: layer {index} is a state layer without state dims")
        used = STATE_DIMS_USED.get(layer.state.family)
        if used is None:
            raise ModelFactsError(
                f"{facts.source}: layer {index} state family {layer.state.family!r} is unknown"
            )
        for name in (
            "conv_kernel", "intermediate_size", "n_groups", "state_size", "num_heads", "head_dim",
            "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim",
        ):  # fmt: skip
            # a dimension vLLM's state shapes multiply by is at least 1: a 0 would shrink the pool
            check(f"state {name}", getattr(layer.state, name), 1 if name in used else 0, MAX_STATE_DIM)
        for name in ("conv_dtype", "ssm_dtype"):
            value = getattr(layer.state, name)
            if value is not None and (not isinstance(value, str) or value not in MAMBA_DTYPES):
                raise ModelFactsError(
                    f"{facts.source}: layer {index} state {name} is {value!r:.40}, "
                    f"expected one of {', '.join(MAMBA_DTYPES)}"
                )
    check("window", layer.window, 1, MAX_POSITIONS, optional=True)


# The dimensions each state family's shapes multiply by (kv/specs.py mamba_state_shapes, after
# vLLM's mamba_utils.py): each must be at least 1.
STATE_DIMS_USED: dict[str, frozenset[str]] = {
    "mamba2": frozenset(
        {"conv_kernel", "intermediate_size", "n_groups", "state_size", "num_heads", "head_dim"}
    ),
    "mamba1": frozenset({"conv_kernel", "intermediate_size", "state_size"}),
    "gdn": frozenset({"conv_kernel", "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"}),
    "linear": frozenset({"num_heads", "head_dim"}),
}
# vLLM's MambaDType (config/cache.py) less "auto", which StateFacts spells None: what a
# mamba_ssm_cache_dtype / mamba_ssm_dtype in a config may name.
MAMBA_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

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
    """vLLM's get_dtype_size for the dtype names configs and flags use; ValueError on an unknown name,
    so no KV size is ever computed from a guessed width.
    """
    try:
        return DTYPE_BYTES[dtype]
    except (KeyError, TypeError):  # TypeError: a list or dict from a config is unhashable
        raise ValueError(f"unknown dtype {dtype!r:.40}") from None


# --- vLLM's maximum model length (pure; vllm/config/model.py `_get_and_verify_max_len`) ---

# RoPE types whose `factor` vLLM does not multiply into the derived maximum, because the
# checkpoint's max_position_embeddings is already the scaled length (0.33.0 config/model.py).
ROPE_TYPES_WITHOUT_FACTOR: tuple[str, ...] = (
    "su",
    "longrope",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "deepseek_llama_scaling",
)
# 0.11.0 exempted only these and derived yarn as original_max_position_embeddings * factor.
ROPE_TYPES_WITHOUT_FACTOR_0_11: tuple[str, ...] = ("su", "longrope", "llama3")
# First release assumed to use the 0.33.0 rules; 0.11.0 and 0.33.0 were read, the switch in
# between was not pinned to a release.
ROPE_RULES_0_33_SINCE: tuple[int, int, int] = (0, 12, 0)
# vLLM's fallback when the config names no maximum length.
DEFAULT_MAX_MODEL_LEN = 2048
NO_LENGTH_KEY = "default"
# vLLM lets a --max-model-len above the derived maximum through only with this set to 1
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def _key_limit(facts: ModelFacts) -> tuple[float, str]:
    """Min over the keys present, then model_max_length overrides (Command-R rule)."""
    derived = float("inf")
    key = NO_LENGTH_KEY
    for name, value in facts.position_limits:
        if value < derived:
            key = name
        derived = min(derived, value)
    model_max_length = dict(facts.position_limits).get("model_max_length")
    if model_max_length:
        derived, key = model_max_length, "model_max_length"
    return derived, key


def derived_max_model_len(
    facts: ModelFacts,
    vllm_version: tuple[int, int, int] = (0, 33, 0),
    disable_sliding_window: bool = False,
) -> tuple[int, str]:
    """The ceiling vLLM checks --max-model-len against, and the config key it came from.

    A user value above it fails with "User-specified max_model_len (...) is greater than the
    derived max_model_len (KEY=VALUE ...)" unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. Key
    NO_LENGTH_KEY means the config names no length: vLLM then accepts any user value and
    defaults to 2048 (times a RoPE factor). Raises ValueError where vLLM 0.11 refuses
    --disable-sliding-window together with RoPE scaling.
    """
    derived, key = _key_limit(facts)
    if disable_sliding_window and facts.sliding_window is not None and facts.sliding_window < derived:
        derived, key = facts.sliding_window, "sliding_window"
    if derived == float("inf"):
        derived = DEFAULT_MAX_MODEL_LEN
    # Gemma 3's length is already RoPE-scaled; vLLM tests the substring, so gemma3_text and
    # gemma3n are skipped too.
    if facts.rope and "gemma3" not in facts.model_type:
        if vllm_version >= ROPE_RULES_0_33_SINCE:
            derived *= _rope_factor_0_33(facts.rope)
        else:
            derived = _rope_scaled_0_11(facts.rope, derived, disable_sliding_window)
    return int(derived), key


def _rope_factor_0_33(rope: tuple[RopeFacts, ...]) -> float:
    """0.33.0 keeps the last non-exempt factor seen (one per layer type), not a product."""
    factor = 1.0
    for params in rope:
        if params.rope_type not in ROPE_TYPES_WITHOUT_FACTOR and params.factor is not None:
            factor = params.factor
    return factor


def _rope_scaled_0_11(rope: tuple[RopeFacts, ...], derived: float, disable_sliding_window: bool) -> float:
    """0.11.0 read the single legacy rope_scaling dict; "default" means there was none."""
    scaling = next((params for params in rope if params.rope_type != "default"), None)
    if scaling is None or scaling.rope_type in ROPE_TYPES_WITHOUT_FACTOR_0_11:
        return derived
    if disable_sliding_window:
        raise ValueError(
            "Disabling sliding window is not supported for models with rope_scaling "
            "(vLLM 0.11 raises NotImplementedError)."
        )
    if scaling.rope_type == "yarn" and scaling.original_max_position_embeddings:
        derived = scaling.original_max_position_embeddings
    return derived * (scaling.factor if scaling.factor is not None else 1.0)


def default_max_model_len(
    facts: ModelFacts,
    vllm_version: tuple[int, int, int] = (0, 33, 0),
    disable_sliding_window: bool = False,
) -> int:
    """What vLLM serves when --max-model-len is not given (or is -1 before auto-fit).

    Equal to the derived maximum except for LongRoPE, where vLLM starts from
    original_max_position_embeddings to avoid degrading short sequences.
    """
    derived, _ = derived_max_model_len(facts, vllm_version, disable_sliding_window)
    for params in facts.rope:
        if params.rope_type == "longrope" and params.original_max_position_embeddings:
            return int(params.original_max_position_embeddings)
    return derived


def auto_dtype(config_dtype: str | None, *, bfloat16_supported: bool = True) -> str:
    """The model dtype `--dtype auto` resolves to on a GPU (and thus the `auto` KV dtype).

    float32 checkpoints (or none declared) are downcast to the platform's preferred dtype.
    """
    preferred = "bfloat16" if bfloat16_supported else "float16"
    if config_dtype in (None, "float32", "float"):
        return preferred
    if config_dtype == "bfloat16" and not bfloat16_supported:
        return "float16"
    if config_dtype not in MODEL_FLOAT_DTYPES:
        # vllm/config/model.py:2444-2465 (0.33.0, _resolve_auto_dtype): a config dtype the platform does
        # not list in supported_dtypes (bfloat16, float16, float32 on CUDA: platforms/cuda.py:257) -
        # int8, uint8, fp8 ... - is replaced by the platform's first, its preferred dtype
        return preferred
    return config_dtype


# the dtypes a platform's supported_dtypes can list (vllm/platforms/interface.py:189), with their aliases
MODEL_FLOAT_DTYPES = ("bfloat16", "float16", "half", "float32", "float")
