"""A HF config.json (+ safetensors) -> ModelFacts, the way vLLM reads it.

Where vLLM reads a value through transformers' config class, a key missing from config.json
gets the class default (hf_defaults.py).

`ModelFacts.dtype` is the dtype `--dtype auto` resolves to on a bfloat16-capable GPU: the
checkpoint's dtype, with float32 (or none declared) downcast to bfloat16, as
vllm/config/model.py `_resolve_auto_dtype` does. KV `auto` uses the same dtype.

Why ~950 lines: each model family's config shape (text_config nesting, layer_types, hybrid state
keys, MLA and DSA keys, KV sharing) is read here, and validated at the same door, so that what `facts`
accepts `plan` can plan; the family readers share the door's helpers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_ctxmgr.core.facts import (
    DTYPE_BYTES,
    MAMBA_DTYPES,
    MAX_HEAD_SIZE,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_ROPE_FACTOR,
    MAX_STATE_DIM,
    LayerFacts,
    LayerKind,
    ModelFacts,
    RopeFacts,
    StateFacts,
    auto_dtype,
)
from vllm_ctxmgr.core.hf_overrides import apply_hf_overrides
from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.model_files.files import MAX_CONFIG_BYTES, read_json_object
from vllm_ctxmgr.model_files.hf_defaults import transformers_defaults
from vllm_ctxmgr.model_files.safetensors import SAFETENSORS_DTYPES, SafetensorsWeights, safetensors_weights

# --- vLLM's own lists (0.33.0) ---

# model_arch_config_convertor.py is_deepseek_mla(): MLA when model_type is listed and
# kv_lora_rank is not None.
MLA_MODEL_TYPES = frozenset(
    {
        "axk1",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "deepseek_v41",
        "dots3_note",
        "deepseek_mtp",
        "k3_dspark",
        "glm5_next",
        "glm5_next_text",
        "glm_moe_dsa",
        "glm4_moe_lite",
        "glm4_moe_lite_mtp",
        "kimi_k2",
        "kimi_linear",
        "longcat_flash",
        "pangu_ultra_moe",
        "pangu_ultra_moe_mtp",
        "bailing_hybrid",
        "bailing_hybrid_mtp",
        "bailing_hybrid_v3_mtp",
        "hy_v4",
        "hy_v4_mtp",
    }
)
# derive_max_model_len_and_key(): keys whose minimum is the model's maximum length
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# transformers_utils/config.py CONFIG_FIELD_ALIASES["total_num_kv_heads"]
KV_HEAD_KEYS = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)
# Models whose vLLM module ignores layer_types: only an all-sliding config slides (via
# cache_config.sliding_window); qwen2.py asserts on a mixed one.
# transformers' configs whose sliding_window is None unless use_sliding_window (Qwen2Config and the
# configs copied from it: configuration_qwen2_vl.py, qwen2_5_vl, qwen2_5_omni, deepseek_ocr2 set
# `self.sliding_window = self.sliding_window if self.use_sliding_window else None`), top-level or as
# the text_config's model type
GLOBAL_SLIDING_ONLY = frozenset(
    {
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "qwen2_vl",
        "qwen2_vl_text",
        "qwen2_5_vl",
        "qwen2_5_vl_text",
        "qwen2_5_omni_text",
        "qwen2_5_omni_thinker",
        "qwen2_5_omni_talker",
        "deepseek_ocr2_text",
    }
)
# of those, the ones whose layers slide from max_window_layers on (Qwen2Config's layer_types)
QWEN2_WINDOW_LAYERS = GLOBAL_SLIDING_ONLY - {"qwen2_moe"}
QWEN2_MIXED_SLIDING_REFUSED = frozenset({"qwen2", "qwen3"})
# The attention layer types vLLM counts (config/model.py _ATTENTION_LAYER_TYPES)
FULL_LAYER_TYPES = frozenset(
    {"full_attention", "attention", "indexed_attention", "deepseek_sparse_attention"}
)
SLIDING_LAYER_TYPES = frozenset({"sliding_attention"})
LINEAR_LAYER_TYPES = frozenset({"linear_attention", "mamba"})
# transformers 5.24 configuration_utils.py ALLOWED_LAYER_TYPES (its validate_layer_type refuses a
# config naming any other), with the names vLLM's own configs use: an unknown entry is refused,
# not read as full attention.
TRANSFORMERS_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe",
    "hybrid", "hybrid_sliding", "reference_sliding_attention", "linear_attention", "sparse", "dense",
)  # fmt: skip
KNOWN_LAYER_TYPES = (
    frozenset(TRANSFORMERS_LAYER_TYPES)
    | {"mlp"}
    | FULL_LAYER_TYPES
    | SLIDING_LAYER_TYPES
    | LINEAR_LAYER_TYPES
)
# Block types that hold no cache in a hybrid's layer list (nemotron_h "mlp" / "moe"), and the
# hybrid_override_pattern characters NemotronHConfig knows (M mamba, * attention, - mlp, E moe).
NO_CACHE_BLOCK_TYPES = frozenset({"mlp", "moe", "dense", "sparse", "-", "E"})
NEMOTRON_H_PATTERN = {"M": "state", "*": "attention", "-": "none", "E": "none"}
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# Gemma-4 text configs (gemma4_text, gemma4_unified_text): each layer has its own head size / KV heads
GEMMA4_MODEL_TYPES = ("gemma4",)
# Gemma-4's video item, the largest it takes: _VIDEO_MAX_FRAMES x (_VIDEO_MAX_SOFT_TOKENS + boi + eoi
# + 6 timestamp tokens) = 32 x (70 + 2 + 6) (vllm/model_executor/models/gemma4_mm.py
# Gemma4ProcessingInfo.get_mm_max_tokens_per_item, gemma4_unified.py likewise @0.26.0)
GEMMA4_VIDEO_ITEM_TOKENS = 32 * (70 + 2 + 6)
# DeepSeek-V4's compressed sparse attention (vLLM 0.33 vllm/models/deepseek_v4, registry.py; per-layer
# compress ratios in transformers_utils/deepseek_v4_utils.py get_compress_ratios): its pages hold one
# state per `ratio` tokens beside a sliding window, which ctxmgr does not model; read as plain MLA it
# would be planned wrong, so it is refused by name.
DEEPSEEK_V4_MODEL_TYPES = frozenset({"deepseek_v4", "deepseek_v41"})
DEEPSEEK_V4_ARCHITECTURES = frozenset(
    {"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration", "DeepseekV41ForCausalLM"}
)
DEEPSEEK_V4_REFUSED = "DeepSeek-V4's compressed sparse attention is not modelled"

# --- one HF (text) config, with provenance ---


class HfConfig:
    """config.json values with vLLM's getattr semantics: attribute_map, then class defaults.

    `get` answers Any, as getattr does: check_config_values has checked the types of the keys the
    readers use, and each reader knows the one it asked for.
    """

    def __init__(self, raw: JSONObject, model_type: str, label: str) -> None:
        self.raw = raw
        self.model_type = model_type
        self.label = label
        self.defaults = transformers_defaults(model_type) if model_type else None
        self.provenance: dict[str, str] = {}

    def lookup(self, key: str) -> tuple[Any, str | None]:
        """(value, where it came from); (None, None) when absent. An explicit null is kept."""
        attribute_map = self.defaults.attribute_map if self.defaults else {}
        for name in dict.fromkeys((key, attribute_map.get(key, key))):
            if name in self.raw:
                return self.raw[name], (self.label if self.raw[name] is not None else None)
        if self.defaults is not None:
            value = self.defaults.values.get(attribute_map.get(key, key))
            if value is not None:
                return value, f"transformers default ({self.defaults.class_name})"
        return None, None

    def get(self, key: str, default: Any = None, *, fact: str | None = None) -> Any:
        value, where = self.lookup(key)
        if where is None:
            return default
        self.provenance.setdefault(fact or key, where)
        return value

    def require(self, key: str, *, fact: str | None = None) -> int:
        """An integer vLLM's model module reads unconditionally; missing is a one-line error."""
        value = self.get(key, fact=fact)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            kind = f"model_type {self.model_type!r}" if self.model_type else "no model_type"
            raise ModelFactsError(f"{self.label} ({kind}) lacks {key}")
        return int(value)

    def first(self, keys: tuple[str, ...], *, fact: str) -> Any:
        for key in keys:
            value = self.get(key, fact=fact)
            if value is not None:
                return value
        return None


def read_json(path: Path) -> JSONObject:
    try:
        return read_json_object(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ModelFactsError(f"no config.json in {path.parent}") from None


# Integer keys vLLM's model modules read, with the values a real config can hold; anything else
# (a string, a list, NaN, 1e30, -1) is refused at the door, naming the key.
_COUNT = (1, MAX_LAYERS)
_HEADS = (1, MAX_HEADS)
_DIM = (1, MAX_STATE_DIM)
_POSITIONS = (0, MAX_POSITIONS)  # 0 may mean "unset"; ModelFacts refuses a 0 that is used
INTEGER_KEYS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": _COUNT,
    "num_attention_heads": _HEADS,
    **dict.fromkeys(KV_HEAD_KEYS, _HEADS),
    "head_dim": (-1, MAX_HEAD_SIZE),  # <= 0: vLLM falls back to hidden_size // heads
    "hidden_size_per_head": (0, MAX_HEAD_SIZE),
    "hidden_size": (1, MAX_HIDDEN_SIZE),
    **dict.fromkeys(POSITION_KEYS, _POSITIONS),
    "original_max_position_embeddings": _POSITIONS,
    "kv_lora_rank": (1, MAX_HEAD_SIZE),
    "qk_rope_head_dim": (1, MAX_HEAD_SIZE),
    "qk_nope_head_dim": (0, MAX_HEAD_SIZE),
    "index_head_dim": (1, MAX_HEAD_SIZE),
    "index_topk_freq": _COUNT,
    "index_skip_topk_offset": (0, MAX_LAYERS),
    "num_nextn_predict_layers": (0, MAX_LAYERS),
    "mtp_num_hidden_layers": (0, MAX_LAYERS),
    "num_kv_shared_layers": (0, MAX_LAYERS),
    "global_head_dim": (1, MAX_HEAD_SIZE),
    "num_global_key_value_heads": _HEADS,
    "sliding_window_pattern": _COUNT,
    "max_window_layers": (0, MAX_LAYERS),
    "full_attention_interval": _COUNT,
    "attn_layer_period": _COUNT,
    "attn_layer_offset": (0, MAX_LAYERS),
    "no_rope_layer_interval": _COUNT,
    "attention_chunk_size": _POSITIONS,
    **dict.fromkeys(
        (
            "linear_conv_kernel_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "mamba_num_heads",
            "mamba_head_dim",
            "ssm_state_size",
            "mamba_n_heads",
            "mamba_expand",
            "mamba_d_conv",
            "mamba_n_groups",
            "mamba_d_state",
            "conv_kernel",
            "n_groups",
        ),
        _DIM,
    ),
}


def _integer(value: object) -> int | None:
    """VALUE as an int if it is one (or an integral finite float, as JSON writers emit 32.0)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return None


def check_config_values(config: JSONObject, label: str) -> None:
    """Types and ranges of the keys the readers use, before any of them is turned into facts."""
    for key, (low, high) in INTEGER_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        number = _integer(value)
        if number is None or not low <= number <= high:
            raise ModelFactsError(f"{label}: {key} is {_shown(value)}, expected an integer in {low}..{high}")
    window = config.get("sliding_window")
    for item in window if isinstance(window, list) else [window]:
        number = _integer(item)
        if item is not None and item is not False and (number is None or not 0 <= number <= MAX_POSITIONS):
            raise ModelFactsError(
                f"{label}: sliding_window is {_shown(item)}, expected an integer in 0..{MAX_POSITIONS}"
            )
    for key in ("model_type",):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ModelFactsError(f"{label}: {key} is {_shown(config[key])}, expected a string")
    architectures = config.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise ModelFactsError(f"{label}: architectures is {_shown(architectures)}, expected a list of names")
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if not isinstance(params, dict):
            continue
        for entry in [v for v in params.values() if isinstance(v, dict)] or [params]:
            factor = entry.get("factor")
            if factor is not None and (
                isinstance(factor, bool)
                or not isinstance(factor, int | float)
                or not math.isfinite(factor)
                or not 0 < factor <= MAX_ROPE_FACTOR
            ):
                raise ModelFactsError(
                    f"{label}: {key} factor is {_shown(factor)}, expected a positive number"
                )
            original = entry.get("original_max_position_embeddings")
            if original is not None and (
                (number := _integer(original)) is None or not 0 <= number <= MAX_POSITIONS
            ):
                raise ModelFactsError(
                    f"{label}: {key} original_max_position_embeddings is {_shown(original)}, "
                    "expected a length in tokens"
                )


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_config(raw: JSONObject) -> tuple[JSONObject, str]:
    """vLLM's hf_text_config: the language model's sub-config of a multimodal checkpoint."""
    for key in TEXT_CONFIG_KEYS:
        sub = raw.get(key)
        if isinstance(sub, dict) and sub:
            return sub, f"config.json {key}"
    return raw, "config.json"


def _text_model_type(raw: JSONObject, text: JSONObject) -> str:
    if text is raw:
        return str(raw.get("model_type") or "")
    if text.get("model_type"):
        return str(text["model_type"])
    parent = str(raw.get("model_type") or "")
    # Gemma3Config's text_config is Gemma3TextConfig (model_type gemma3_text), and so on.
    if parent and transformers_defaults(f"{parent}_text") is not None:
        return f"{parent}_text"
    return parent


def load_hf_facts(
    directory: Path, *, source: str | None = None, hf_overrides: JSONObject | None = None
) -> ModelFacts:
    """Facts from a HF model directory (config.json and safetensors headers), with vLLM's
    `--hf-overrides` applied first (core/hf_overrides.py), as vLLM applies them before it reads the
    config."""
    config_path = directory / "config.json"
    if not config_path.is_file() and any(directory.glob("*.gguf")):
        raise ModelFactsError(f"no config.json in {directory}; for a GGUF model pass the .gguf file itself")
    raw = apply_hf_overrides(read_json(config_path), hf_overrides)
    text, label = text_config(raw)
    check_config_values(raw, str(config_path))
    if text is not raw:
        check_config_values(text, f"{config_path}{label.removeprefix('config.json')}")
    try:
        return _hf_facts(directory, raw, text, label, source)
    except (
        TypeError,
        ValueError,
        OverflowError,
        ZeroDivisionError,
        AttributeError,
        KeyError,
        IndexError,
    ) as error:
        # a value of the wrong shape in a key not checked above (a dict where a list belongs, ...)
        raise ModelFactsError(f"{config_path}: unusable config ({type(error).__name__}: {error})") from None


def _hf_facts(
    directory: Path, raw: JSONObject, text: JSONObject, label: str, source: str | None
) -> ModelFacts:
    config_path = directory / "config.json"
    model_type = _text_model_type(raw, text)
    cfg = HfConfig(text, model_type, label)
    architectures = raw.get("architectures") or text.get("architectures") or ()
    if (
        model_type in DEEPSEEK_V4_MODEL_TYPES
        or DEEPSEEK_V4_ARCHITECTURES.intersection(architectures)
        or any(key in text for key in ("compress_ratios", "compress_rates"))
    ):
        raise ModelFactsError(f"{config_path}: {DEEPSEEK_V4_REFUSED}")
    notes: list[str] = []
    if model_type and cfg.defaults is None:
        notes.append(f"model_type {model_type!r} is unknown to transformers here; read config.json only")

    num_layers = cfg.get("num_hidden_layers", fact="num_hidden_layers")
    num_heads = cfg.get("num_attention_heads", fact="num_attention_heads")
    missing = [
        name
        for name, value in (("num_hidden_layers", num_layers), ("num_attention_heads", num_heads))
        if not value
    ]
    if missing:
        kind = f"model_type {model_type!r}" if model_type else "no model_type"
        raise ModelFactsError(f"{config_path} ({kind}) lacks {', '.join(missing)}")
    num_layers, num_heads = int(num_layers), int(num_heads)

    weights = safetensors_weights(directory)
    dtype, dtype_note = _hf_dtype(raw, text, weights, cfg.provenance, directory)
    if dtype_note:
        notes.append(dtype_note)
    quantization, kv_cache_scheme = quantization_facts(raw, text)

    sliding_window = _model_sliding_window(cfg)
    layers, layer_notes = hf_layers(cfg, num_layers, num_heads, sliding_window)
    notes += layer_notes

    position_limits = tuple(
        (key, int(value))
        for key in POSITION_KEYS
        if (value := cfg.get(key)) is not None and not isinstance(value, bool)
    )
    provenance = cfg.provenance
    if weights.total_bytes is not None:
        provenance["weight_bytes"] = weights.source
    if quantization:
        provenance["quantization"] = "config.json quantization_config"
    is_mla = any(layer.kind == LayerKind.MLA for layer in layers)
    return ModelFacts(
        source=source or str(directory),
        source_format="hf",
        model_type=model_type,
        architectures=tuple(raw.get("architectures") or text.get("architectures") or ()),
        num_attention_heads=num_heads,
        layers=tuple(layers),
        dtype=dtype,
        position_limits=position_limits,
        rope=hf_rope(cfg),
        sliding_window=sliding_window,
        hidden_size=cfg.get("hidden_size", fact="hidden_size"),
        mtp_layers=int(
            cfg.first(("num_nextn_predict_layers", "mtp_num_hidden_layers"), fact="mtp_layers") or 0
        ),
        kv_lora_rank=cfg.get("kv_lora_rank") if is_mla else None,
        qk_rope_head_dim=cfg.get("qk_rope_head_dim") if is_mla else None,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") if is_mla else None,
        weight_bytes=weights.total_bytes,
        quantization=quantization,
        kv_cache_scheme=kv_cache_scheme,
        **_mlp_shapes(cfg),
        mm_prefix_lm_item_tokens=_mm_prefix_lm_item_tokens(model_type, raw, text),
        provenance=provenance,
        notes=tuple(notes),
    )


def _mm_prefix_lm_item_tokens(model_type: str, raw: JSONObject, text: JSONObject) -> int | None:
    """The largest multimodal item of a Gemma-4 prefix-LM model, which vLLM makes one batch hold.

    vLLM's Gemma4ModelArchConfigConvertor.is_mm_prefix_lm (text_config.use_bidirectional_attention ==
    "vision"), on a multimodal checkpoint (a vision_config), makes EngineArgs raise a default
    max_num_batched_tokens to the largest item of get_mm_max_tokens_per_item (engine/arg_utils.py
    _set_default_max_num_seqs_and_batched_tokens_args). Images (vision_config default_output_length or
    num_soft_tokens) and audio (the processor's audio_seq_length, 750) stay under the video's 2496.
    """
    vision = raw.get("vision_config")
    if not model_type.startswith(GEMMA4_MODEL_TYPES) or not isinstance(vision, dict):
        return None
    if text.get("use_bidirectional_attention") != "vision":
        return None
    image = next(
        (v for k in ("num_soft_tokens", "default_output_length") if isinstance(v := vision.get(k), int)), 0
    )
    return max(GEMMA4_VIDEO_ITEM_TOKENS, image if 0 < image <= MAX_POSITIONS else 0)


def _mlp_shapes(cfg: HfConfig) -> dict[str, int | None]:
    """Vocabulary and MLP/MoE widths for core/memory.py; a value that is not a positive int is left None."""

    def number(keys: tuple[str, ...], fact: str) -> int | None:
        value = cfg.first(keys, fact=fact)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        return value

    return {
        "vocab_size": number(("vocab_size", "padded_vocab_size"), "vocab_size"),
        "intermediate_size": number(("intermediate_size", "ffn_hidden_size"), "intermediate_size"),
        "moe_intermediate_size": number(
            ("moe_intermediate_size", "expert_intermediate_size"), "moe_intermediate_size"
        ),
        "num_experts": number(("num_local_experts", "n_routed_experts", "num_experts"), "num_experts"),
        "num_experts_per_tok": number(("num_experts_per_tok", "moe_topk"), "num_experts_per_tok"),
    }


def _hf_dtype(
    raw: JSONObject,
    text: JSONObject,
    weights: SafetensorsWeights,
    provenance: dict[str, str],
    directory: Path,
) -> tuple[str, str | None]:
    """vLLM: config dtype (top level, then text config), else safetensors dtypes, else float32."""
    declared = None
    for config, where in ((raw, "config.json"), (text, "config.json text config")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(value := config.get(key), str):
                declared, origin = value.removeprefix("torch."), f"{where} {key}"
                if declared not in DTYPE_BYTES:
                    raise ModelFactsError(
                        f"{directory / where} {key} is {_shown(declared)}, not a dtype vLLM serves"
                    )
                break
        if declared:
            break
    if declared is None and weights.dtypes:
        found = {SAFETENSORS_DTYPES[d] for d in weights.dtypes if d in SAFETENSORS_DTYPES}
        if found:
            # common_broadcastable_dtype: bf16 + f16 only meet losslessly in f32
            declared = found.pop() if len(found) == 1 else "float32"
            origin = "safetensors headers"
    if declared is None:
        declared, origin = "float32", "vLLM default (no dtype in config.json)"
    resolved = auto_dtype(declared)
    if resolved == declared:
        provenance["dtype"] = origin
        return resolved, None
    provenance["dtype"] = f"{origin} {declared}, vLLM auto -> {resolved}"
    if origin.startswith("vLLM default"):
        return resolved, f"no dtype in config.json: vLLM assumes float32, so --dtype auto uses {resolved}"
    return resolved, f"checkpoint dtype {declared}: vLLM --dtype auto uses {resolved}"


def quantization_facts(raw: JSONObject, text: JSONObject) -> tuple[str | None, str | None]:
    """quant_method as vLLM normalises it, and the KV dtype a declared KV scheme turns `auto` into."""
    quant = None
    for config in (raw, text):
        quant = config.get("quantization_config") or config.get("compression_config")
        if isinstance(quant, dict):
            break
    if not isinstance(quant, dict):
        return None, None
    method = str(quant.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    inner = nested if isinstance(nested := quant.get("quantization"), dict) else quant
    if (quant.get("producer") or {}).get("name") == "modelopt" or "modelopt_quant_config" in inner:
        method = method or "modelopt"
    kv_scheme = None
    if method.startswith("modelopt"):
        # utils/torch_utils.py get_kv_cache_quant_algo_string
        algo = (
            inner.get("kv_cache_scheme")
            or quant.get("kv_cache_scheme")
            or inner.get("kv_cache_quant_algo")
            or quant.get("kv_cache_quant_algo")
        )
        if isinstance(algo, dict):
            if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
                algo = "fp8"
            elif algo.get("num_bits") == 4 and algo.get("type") == "float":
                algo = "nvfp4"
            else:
                algo = None
        if isinstance(algo, str):
            kv_scheme = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}.get(algo.lower())
    elif isinstance(quant.get("kv_cache_scheme"), dict):
        kv_scheme = "fp8"  # attention.py: a declared scheme turns auto into fp8
    return method or None, kv_scheme


def hf_rope(cfg: HfConfig) -> tuple[RopeFacts, ...]:
    """One entry per rope-parameter dict (nested per layer type in transformers 5 configs)."""
    params = cfg.get("rope_parameters", fact="rope")
    if not isinstance(params, dict) or not params:
        params = cfg.get("rope_scaling", fact="rope")
    if not isinstance(params, dict) or not params:
        return ()
    dicts = [v for v in params.values() if isinstance(v, dict) and v] or [params]
    top_original = cfg.get("original_max_position_embeddings")
    rope = []
    for entry in dicts:
        rope_type = entry.get("rope_type") or entry.get("type") or "default"
        original = entry.get("original_max_position_embeddings")
        if rope_type == "longrope" and top_original:
            original = top_original  # vLLM reads the config attribute, not the dict
        factor = entry.get("factor")
        rope.append(
            RopeFacts(
                rope_type=str(rope_type),
                factor=float(factor) if factor is not None else None,
                original_max_position_embeddings=int(original) if original else None,
            )
        )
    return tuple(rope)


def _model_sliding_window(cfg: HfConfig) -> int | None:
    """hf_text_config.sliding_window after transformers and vLLM: Qwen nulls it, 0 is off."""
    window = cfg.get("sliding_window", fact="sliding_window")
    if isinstance(window, list):  # some configs give one window per layer
        window = max((w for w in window if w), default=None)
    if not window:
        return None
    if cfg.model_type in GLOBAL_SLIDING_ONLY and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


def check_head_geometry(label: str, heads: int, kv_heads: int, kv_key: str = "num_key_value_heads") -> None:
    """What vLLM's Attention asserts (num_heads % num_kv_heads == 0) and transformers' GQA repeat needs."""
    if kv_heads > heads:
        raise ModelFactsError(f"{label}: {kv_key} {kv_heads} is more than num_attention_heads {heads}")
    if heads % kv_heads:
        raise ModelFactsError(
            f"{label}: num_attention_heads {heads} is not a multiple of {kv_key} {kv_heads}"
        )


def _kv_heads_and_head_size(cfg: HfConfig, num_heads: int) -> tuple[int, int]:
    kv_heads = cfg.first(KV_HEAD_KEYS, fact="num_kv_heads")
    if kv_heads is None:
        kv_heads = num_heads
        cfg.provenance["num_kv_heads"] = "num_attention_heads (no KV-head key)"
    elif int(kv_heads) >= 1:
        kv_key = next((key for key in KV_HEAD_KEYS if cfg.lookup(key)[1] is not None), "num_key_value_heads")
        check_head_geometry(cfg.label, num_heads, int(kv_heads), kv_key)
    head_dim = cfg.get("head_dim", fact="head_size")
    if not head_dim or head_dim <= 0:
        head_dim = cfg.get("hidden_size_per_head", fact="head_size")
    if not head_dim:
        hidden = cfg.get("hidden_size", fact="head_size")
        if not hidden:
            raise ModelFactsError(
                f"{cfg.label} (model_type {cfg.model_type!r}) lacks head_dim and hidden_size"
            )
        if int(hidden) % num_heads:  # the models derive head_dim = hidden_size // heads, weights disagree
            raise ModelFactsError(
                f"{cfg.label}: hidden_size {hidden} is not a multiple of num_attention_heads {num_heads} "
                "(no head_dim to say otherwise)"
            )
        head_dim = int(hidden) // num_heads
    return int(kv_heads), int(head_dim)


def _layer_types(cfg: HfConfig, num_layers: int) -> list[str] | None:
    """layer_types as transformers derives it for the model types vLLM reads it from."""
    declared = cfg.get("layer_types", fact="layer_types")
    if isinstance(declared, list):
        for entry in declared:
            if not isinstance(entry, str) or entry not in KNOWN_LAYER_TYPES:
                raise ModelFactsError(
                    f"{cfg.label}: layer_types entry {_shown(entry)} is not a layer type transformers knows"
                )
    if isinstance(declared, list) and len(declared) >= num_layers:
        types = [str(t) for t in declared[:num_layers]]
        if cfg.model_type.startswith(GEMMA4_MODEL_TYPES) and types:
            types[-1] = "full_attention"  # Gemma4TextConfig forces the last layer to full attention
        return types
    model_type = cfg.model_type
    window = cfg.get("sliding_window")
    derived: list[str] | None = None
    if model_type in ("gemma3", "gemma3_text", "cohere2"):
        pattern = int(cfg.get("sliding_window_pattern") or (6 if model_type != "cohere2" else 4))
        derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif model_type in ("gemma2", "gpt_oss"):
        derived = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif model_type.startswith(GEMMA4_MODEL_TYPES):
        derived = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    elif model_type in ("gemma3n", "gemma3n_text"):
        derived = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]
    elif model_type in QWEN2_WINDOW_LAYERS:
        sliding = window is not None and cfg.get("use_sliding_window", False)
        max_window_layers = int(cfg.get("max_window_layers") or 0)
        derived = [
            "sliding_attention" if sliding and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    elif model_type == "qwen2_moe":
        sliding = bool(cfg.get("use_sliding_window", False))
        max_window_layers = int(cfg.get("max_window_layers") or 0)
        derived = [
            "sliding_attention" if sliding and (i + 1) % 2 and i < max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    elif model_type.startswith(("qwen3_next", "qwen3_5")):
        interval = int(cfg.raw.get("full_attention_interval") or 4)
        derived = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if derived is not None:
        cfg.provenance["layer_types"] = f"derived as transformers does ({model_type})"
    return derived


def hf_layers(
    cfg: HfConfig, num_layers: int, num_heads: int, sliding_window: int | None
) -> tuple[list[LayerFacts], list[str]]:
    """One LayerFacts per decoder layer with the KV spec vLLM's model module builds."""
    notes: list[str] = []
    model_type = cfg.model_type
    kv_lora_rank = cfg.get("kv_lora_rank")
    if model_type in MLA_MODEL_TYPES and kv_lora_rank is not None:
        return _mla_layers(cfg, num_layers, int(kv_lora_rank)), notes

    hybrid = _hybrid_layers(cfg, num_layers, num_heads)
    if hybrid is not None:
        return hybrid, notes

    kv_heads, head_size = _kv_heads_and_head_size(cfg, num_heads)

    def full() -> LayerFacts:
        return LayerFacts(LayerKind.FULL, num_kv_heads=kv_heads, head_size=head_size, head_size_v=head_size)

    def sliding() -> LayerFacts:
        return LayerFacts(
            LayerKind.SLIDING,
            num_kv_heads=kv_heads,
            head_size=head_size,
            head_size_v=head_size,
            window=sliding_window,
        )

    if model_type.startswith("llama4"):
        chunk = cfg.get("attention_chunk_size", fact="attention_chunk")
        no_rope = cfg.get("no_rope_layers") or [
            int((i + 1) % int(cfg.get("no_rope_layer_interval") or 4) != 0) for i in range(num_layers)
        ]
        layers = [
            LayerFacts(LayerKind.CHUNKED, kv_heads, head_size, head_size, window=int(chunk))
            if chunk and no_rope[i] != 0
            else full()
            for i in range(num_layers)
        ]
        return layers, notes

    if model_type == "gpt_oss":
        # gpt_oss.py: sliding_window on even layers, hard-coded; layer_types is not read
        layers = [sliding() if i % 2 == 0 and sliding_window else full() for i in range(num_layers)]
        return layers, notes

    layer_types = _layer_types(cfg, num_layers)
    all_sliding = layer_types is None or all(t in SLIDING_LAYER_TYPES for t in layer_types)
    if sliding_window is None:
        layers = [full() for _ in range(num_layers)]
    elif all_sliding:
        # engine/arg_utils.py: cache_config.sliding_window applies to every layer
        layers = [sliding() for _ in range(num_layers)]
    elif model_type in GLOBAL_SLIDING_ONLY:
        layers = [full() for _ in range(num_layers)]
        if model_type in QWEN2_MIXED_SLIDING_REFUSED and len(set(layer_types or ())) > 1:
            notes.append(
                "sliding window on only some layers (max_window_layers < num_hidden_layers): "
                "vLLM 0.33 qwen2.py refuses to load this config"
            )
    else:
        assert layer_types is not None
        layers = [sliding() if t in SLIDING_LAYER_TYPES else full() for t in layer_types]
        if cfg.defaults is None:
            notes.append(
                "unknown model type: assumed vLLM slides the layers layer_types marks sliding_attention"
            )

    if model_type.startswith(GEMMA4_MODEL_TYPES) and layer_types is not None:
        layers = _gemma4_layer_geometry(cfg, layers, layer_types, kv_heads, head_size)

    shared = int(cfg.get("num_kv_shared_layers", 0, fact="num_kv_shared_layers") or 0)
    if shared and shared >= num_layers:  # a negative slice start would lengthen the layer list
        raise ModelFactsError(
            f"{cfg.label}: num_kv_shared_layers is {shared}, not fewer than the {num_layers} layers"
        )
    if shared:
        # gemma3n.py: the last num_kv_shared_layers reuse an earlier layer's KV
        layers[num_layers - shared :] = [LayerFacts(LayerKind.NONE)] * shared
    return layers, notes


def _gemma4_layer_geometry(
    cfg: HfConfig, layers: list[LayerFacts], layer_types: list[str], kv_heads: int, head_size: int
) -> list[LayerFacts]:
    """Each Gemma-4 layer's own head size and KV heads, as Gemma4TextConfig builds `per_layer_config`.

    vLLM's gemma4.py sizes every layer's Attention from `config.per_layer_config[i]`: the global
    (full_attention) layers take `global_head_dim` (512 when absent) and, where `attention_k_eq_v`
    is set, `num_global_key_value_heads`; the sliding layers keep head_dim / num_key_value_heads.
    An explicit `per_layer_config` table (index -> overrides) wins, as it does in transformers.
    """
    explicit = cfg.raw.get("per_layer_config")
    overrides: dict[int, JSONObject] = {}
    if isinstance(explicit, dict) and explicit:
        for key, value in explicit.items():
            index = _integer(key) if not isinstance(key, str) else (int(key) if key.isdigit() else None)
            if index is None or not isinstance(value, dict):
                raise ModelFactsError(
                    f"{cfg.label}: per_layer_config entry {_shown(key)} is not a layer table"
                )
            overrides[index] = value
        cfg.provenance["per_layer_geometry"] = f"{cfg.label} per_layer_config"
    else:
        global_head = cfg.raw.get("global_head_dim", 512)
        global_layer: JSONObject = {"head_dim": global_head}
        global_kv = cfg.raw.get("num_global_key_value_heads")
        if cfg.raw.get("attention_k_eq_v", False) and global_kv is not None:
            global_layer["num_key_value_heads"] = global_kv
        overrides = {i: global_layer for i, t in enumerate(layer_types) if t == "full_attention"}
        where = "global_head_dim" if "global_head_dim" in cfg.raw else "global_head_dim default 512"
        cfg.provenance["per_layer_geometry"] = f"{cfg.label} {where} on full_attention layers"
    window_all = cfg.raw.get("use_bidirectional_attention") == "all"
    num_heads = int(cfg.get("num_attention_heads"))
    out = []
    for index, layer in enumerate(layers):
        values = overrides.get(index, {})
        heads = values.get("num_key_value_heads", kv_heads)
        size = values.get("head_dim", head_size)
        for name, value in (("num_key_value_heads", heads), ("head_dim", size)):
            number = _integer(value)
            if number is None or not 1 <= number <= (MAX_HEADS if name != "head_dim" else MAX_HEAD_SIZE):
                raise ModelFactsError(f"{cfg.label}: layer {index} {name} is {_shown(value)}")
        check_head_geometry(f"{cfg.label} layer {index}", num_heads, int(heads))
        window = layer.window
        if window_all and window:
            window = window // 2 + 1  # Gemma4TextConfig: bidirectional "all" halves the window (+1)
        out.append(
            replace(layer, num_kv_heads=int(heads), head_size=int(size), head_size_v=int(size), window=window)
        )
    return out


def _mla_layers(cfg: HfConfig, num_layers: int, kv_lora_rank: int) -> list[LayerFacts]:
    rope_dim = cfg.require("qk_rope_head_dim", fact="head_size")
    cfg.provenance.setdefault("kv_lora_rank", cfg.lookup("kv_lora_rank")[1] or cfg.label)
    head_size = kv_lora_rank + rope_dim
    indexer_dims = [0] * num_layers
    if cfg.get("index_topk", fact="indexer") is not None:
        # deepseek_v2.py / models/deepseek_v32/attention.py: which layers build an indexer
        index_head_dim = cfg.require("index_head_dim", fact="indexer")
        freq = int(cfg.raw.get("index_topk_freq") or 1)
        pattern = cfg.raw.get("index_topk_pattern")
        offset = cfg.raw.get("index_skip_topk_offset")
        offset = 2 if offset is None else int(offset)
        for i in range(num_layers):
            if pattern is None:
                skip = max(i - offset + 1, 0) % freq != 0
            else:
                skip = 0 <= i < len(pattern) and pattern[i] == "S"
            indexer_dims[i] = 0 if skip else index_head_dim
    return [
        LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=head_size, head_size_v=0, indexer_head_dim=dim)
        for dim in indexer_dims
    ]


def _hybrid_layers(cfg: HfConfig, num_layers: int, num_heads: int) -> list[LayerFacts] | None:
    """Mamba / gated-delta-net / linear-attention hybrids, or None for plain attention models.
    Long because each hybrid family (nemotron_h, qwen3_next, jamba, falcon_h1, ...) names its layer pattern
    and state keys its own way."""
    model_type = cfg.model_type
    raw = cfg.raw
    kinds: list[str] | None = None  # per layer: "attention" | "state" | "none"
    if model_type.startswith(("qwen3_next", "qwen3_5")) and "linear_num_value_heads" in raw | (
        cfg.defaults.values if cfg.defaults else {}
    ):
        types = _layer_types(cfg, num_layers) or []
        kinds = ["state" if t in LINEAR_LAYER_TYPES else "attention" for t in types]
        state = StateFacts(
            family="gdn",
            conv_kernel=cfg.require("linear_conv_kernel_dim", fact="state"),
            num_k_heads=cfg.require("linear_num_key_heads", fact="state"),
            num_v_heads=cfg.require("linear_num_value_heads", fact="state"),
            k_head_dim=cfg.require("linear_key_head_dim", fact="state"),
            v_head_dim=cfg.require("linear_value_head_dim", fact="state"),
            ssm_dtype=_state_dtype(cfg, "mamba_ssm_dtype", None)
            if model_type.startswith("qwen3_5")
            else None,
        )
    elif model_type == "nemotron_h":
        pattern = raw.get("hybrid_override_pattern")
        if isinstance(pattern, str):
            unknown = sorted(set(pattern) - NEMOTRON_H_PATTERN.keys())
            if unknown:
                raise ModelFactsError(
                    f"{cfg.label}: hybrid_override_pattern has {_shown(''.join(unknown))}, "
                    "expected only M, *, - and E"
                )
            kinds = [NEMOTRON_H_PATTERN[c] for c in pattern]
        else:
            types = cfg.first(("layers_block_type", "layer_types"), fact="layer_types") or []
            kinds = [_block_kind(t, cfg.label) for t in types]
        heads, head_dim = (
            cfg.require("mamba_num_heads", fact="state"),
            cfg.require("mamba_head_dim", fact="state"),
        )
        state = StateFacts(
            family="mamba2",
            conv_kernel=int(cfg.get("conv_kernel") or raw.get("mamba_d_conv") or 4),
            intermediate_size=heads * head_dim,
            n_groups=int(cfg.get("n_groups") or raw.get("mamba_n_groups") or 1),
            state_size=cfg.require("ssm_state_size", fact="state"),
            num_heads=heads,
            head_dim=head_dim,
            ssm_dtype=_state_dtype(cfg, "mamba_ssm_cache_dtype", "float32"),  # models/config.py NemotronH
        )
    elif model_type == "granitemoehybrid":
        types = cfg.first(("layer_types", "layers_block_type"), fact="layer_types") or ["mamba"] * num_layers
        kinds = [_block_kind(t, cfg.label) for t in types]
        heads = cfg.require("mamba_n_heads", fact="state")
        intermediate = cfg.require("mamba_expand", fact="state") * cfg.require("hidden_size")
        head_dim = cfg.get("mamba_d_head")
        state = StateFacts(
            family="mamba2",
            conv_kernel=cfg.require("mamba_d_conv", fact="state"),
            intermediate_size=intermediate,
            n_groups=cfg.require("mamba_n_groups", fact="state"),
            state_size=cfg.require("mamba_d_state", fact="state"),
            num_heads=heads,
            head_dim=intermediate // heads if head_dim in (None, "auto") else int(head_dim),
        )
    elif model_type == "jamba":
        period, offset = int(cfg.get("attn_layer_period") or 8), int(cfg.get("attn_layer_offset") or 4)
        kinds = ["attention" if i % period == offset else "state" for i in range(num_layers)]
        state = StateFacts(
            family="mamba1",
            conv_kernel=cfg.require("mamba_d_conv", fact="state"),
            intermediate_size=cfg.require("mamba_expand", fact="state") * cfg.require("hidden_size"),
            state_size=cfg.require("mamba_d_state", fact="state"),
        )
    elif isinstance(attn_types := raw.get("attn_type_list"), list):
        # MiniMax-Text-01: 1 = softmax attention, 0 = lightning (linear) attention
        kinds = ["attention" if t == 1 else "state" for t in attn_types]
        _, head_size = _kv_heads_and_head_size(cfg, num_heads)
        state = StateFacts(family="linear", num_heads=num_heads, head_dim=head_size)
    if kinds is None:
        return None
    if len(kinds) < num_layers:
        raise ModelFactsError(
            f"{cfg.label}: the layer pattern has {len(kinds)} entries for {num_layers} layers"
        )
    kv_heads, head_size = _kv_heads_and_head_size(cfg, num_heads)
    by_kind = {
        "attention": LayerFacts(
            LayerKind.FULL, num_kv_heads=kv_heads, head_size=head_size, head_size_v=head_size
        ),
        "state": LayerFacts(LayerKind.MAMBA, state=state),
        "none": LayerFacts(LayerKind.NONE),
    }
    return [by_kind[kind] for kind in kinds[:num_layers]]


def _block_kind(layer_type: JSONValue, label: str) -> str:
    if not isinstance(layer_type, str):
        raise ModelFactsError(f"{label}: layer type {_shown(layer_type)} is not a name")
    if layer_type in FULL_LAYER_TYPES:
        return "attention"
    if layer_type in LINEAR_LAYER_TYPES or layer_type == "M":
        return "state"
    if layer_type in NO_CACHE_BLOCK_TYPES:
        return "none"  # mlp / moe blocks hold no cache
    raise ModelFactsError(f"{label}: layer type {_shown(layer_type)} is not one transformers or vLLM knows")


def _state_dtype(cfg: HfConfig, key: str, default: str | None) -> str | None:
    """A hybrid's SSM-state dtype as vLLM's MambaDType takes it; "auto" (None) follows the conv dtype.

    Read at the door so that what `facts` accepts `plan` can size (a "int3" or a list here used to
    pass facts and end plan in an unknown-dtype error).
    """
    value = cfg.get(key)
    if value is None:
        return default
    if value == "auto":
        return None
    if not isinstance(value, str) or value not in MAMBA_DTYPES:
        raise ModelFactsError(
            f"{cfg.label}: {key} is {_shown(value)}, expected one of auto, {', '.join(MAMBA_DTYPES)}"
        )
    return value
