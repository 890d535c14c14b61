"""Read a model the way vLLM sees it: HF config.json (+ safetensors) or GGUF headers -> ModelFacts.

Only headers are read: config.json, the safetensors index or each shard's 8-byte length + JSON
header, and the GGUF key/value and tensor-info sections. Tensor data is never touched, so a
400 GiB GGUF answers in milliseconds.

Where vLLM reads a value through transformers' config class, a key missing from config.json
gets the class default. Those defaults are read from the class source with `ast` (a
transformers import costs about a second); only when that fails is transformers imported.

`ModelFacts.dtype` is the dtype `--dtype auto` resolves to on a bfloat16-capable GPU: the
checkpoint's dtype, with float32 (or none declared) downcast to bfloat16, as
vllm/config/model.py `_resolve_auto_dtype` does. KV `auto` uses the same dtype.

GGUF: vLLM 0.33.0 has no GGUF loader any more; older releases built the HF config from the GGUF
metadata through transformers, which carries no torch dtype, so `auto` resolved to bfloat16 on
GPUs with bf16 support (on SM >= 10.0 the GGUF backend rejects bfloat16 and needs
`--dtype float16`, which has the same 2-byte size). That is the dtype recorded for GGUF files.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, RopeFacts, StateFacts, auto_dtype
from vllm_ctxmgr.errors import ModelFactsError

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
GLOBAL_SLIDING_ONLY = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
QWEN2_MIXED_SLIDING_REFUSED = frozenset({"qwen2", "qwen3"})
# The attention layer types vLLM counts (config/model.py _ATTENTION_LAYER_TYPES)
FULL_LAYER_TYPES = frozenset(
    {"full_attention", "attention", "indexed_attention", "deepseek_sparse_attention"}
)
SLIDING_LAYER_TYPES = frozenset({"sliding_attention"})
LINEAR_LAYER_TYPES = frozenset({"linear_attention", "mamba"})
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}

HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SPLIT_GGUF = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def load_model_facts(model: str, *, hf_home: str | None = None) -> ModelFacts:
    """Facts for MODEL: a local HF directory, a GGUF file (or split part) or a cached HF repo id.

    Never downloads. Raises ModelFactsError with a one-line message for anything unreadable.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_facts(path, source=model)
    if path.is_file():
        if path.name == "config.json":
            return load_hf_facts(path.parent, source=model)
        return load_gguf_facts(path, source=model)
    if path.exists() or model.startswith((".", "/", "~")) or not HF_REPO_ID.match(model):
        raise ModelFactsError(f"model path not found: {model}")
    return load_hf_facts(hf_cache_snapshot(model, hf_home), source=model)


# --- the local Hugging Face cache ---


def hub_cache_dirs(hf_home: str | None) -> list[Path]:
    """Where huggingface_hub keeps repos, in the order it would look."""
    if hf_home:
        return [Path(hf_home).expanduser() / "hub", Path(hf_home).expanduser()]
    dirs = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HUGGINGFACE_HUB_CACHE")]
    if os.environ.get("HF_HOME"):
        dirs.append(os.path.join(os.environ["HF_HOME"], "hub"))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(os.path.join(xdg, "huggingface", "hub"))
    return [Path(d).expanduser() for d in dirs if d]


def hf_cache_snapshot(repo_id: str, hf_home: str | None = None) -> Path:
    """The snapshot directory `refs/main` points at (offline; never downloads)."""
    folder = "models--" + repo_id.replace("/", "--")
    searched = hub_cache_dirs(hf_home)
    for cache in searched:
        repo = cache / folder
        if not repo.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            snapshot = repo / "snapshots" / ref.read_text().strip()
            if snapshot.is_dir():
                return snapshot
        snapshots = sorted((repo / "snapshots").glob("*/"), key=lambda p: p.stat().st_mtime, reverse=True)
        with_config = [s for s in snapshots if (s / "config.json").is_file()]
        if with_config or snapshots:
            return (with_config or snapshots)[0]
    where = ", ".join(str(c) for c in searched)
    raise ModelFactsError(
        f"{repo_id}: no such local path, and not in the local Hugging Face cache ({where}); "
        "download it first (huggingface-cli download) or pass a local path"
    )


# --- transformers' config-class defaults, read without importing transformers ---


@dataclass(frozen=True)
class ClassDefaults:
    """Class-level defaults and attribute_map of one transformers config class."""

    class_name: str
    values: dict[str, Any]
    attribute_map: dict[str, str]


@functools.cache
def transformers_defaults(model_type: str) -> ClassDefaults | None:
    """Defaults of the transformers config class for MODEL_TYPE, or None when unknown."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    try:
        if model_type not in _known_model_types(models):
            return None
        found = _static_defaults(models, model_type)
    except (OSError, SyntaxError, ValueError):
        found = None
    return found if found is not None else _imported_defaults(model_type)


@functools.cache
def _auto_mapping_text(models: Path) -> str:
    parts = []
    for file in (models / "auto" / "auto_mappings.py", models / "auto" / "configuration_auto.py"):
        if file.is_file():
            parts.append(file.read_text(encoding="utf-8"))
    return "\n".join(parts)


def _known_model_types(models: Path) -> set[str]:
    """Keys of transformers' CONFIG_MAPPING_NAMES: ("gemma3_text", "Gemma3TextConfig"), ..."""
    text = _auto_mapping_text(models)
    pairs = re.findall(r'\(\s*"([^"]+)"\s*,\s*"(\w+Config)"\s*\)', text)
    pairs += re.findall(r'"([^"]+)"\s*:\s*"(\w+Config)"', text)
    return {model_type for model_type, _ in pairs}


def _special_module_names(models: Path) -> dict[str, str]:
    """transformers' SPECIAL_MODEL_TYPE_TO_MODULE_NAME (gemma3_text -> gemma3, ...)."""
    names: dict[str, str] = {}
    text = _auto_mapping_text(models)
    for block in re.finditer(
        r"SPECIAL_MODEL_TYPE_TO_MODULE_NAME(?:\.update)?\s*[=(]\s*(?:OrderedDict\()?", text
    ):
        body = text[block.end() : text.find("\n)", block.end())]
        names.update(re.findall(r'\(\s*"([^"]+)"\s*,\s*"([^"]+)"\s*\)', body))
        names.update(re.findall(r'"([^"]+)"\s*:\s*"([^"]+)"', body))
    return names


def _static_defaults(models: Path, model_type: str) -> ClassDefaults | None:
    module = _special_module_names(models).get(model_type, model_type.replace("-", "_"))
    candidates = [module, module.removesuffix("_text")]
    for name in dict.fromkeys(candidates):
        source = models / name / f"configuration_{name}.py"
        if source.is_file():
            tree = ast.parse(source.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and _class_model_type(node) == model_type:
                    values, attribute_map = _class_values(node, tree, models, depth=0)
                    return ClassDefaults(node.name, values, attribute_map)
    return None


def _class_model_type(node: ast.ClassDef) -> str | None:
    for statement in node.body:
        if (
            isinstance(statement, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "model_type" for t in statement.targets)
            and isinstance(statement.value, ast.Constant)
        ):
            return str(statement.value.value)
    return None


def _literal(node: ast.AST | None) -> tuple[bool, Any]:
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False, None


def _class_values(
    node: ast.ClassDef, tree: ast.Module, models: Path, depth: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """Dataclass-style fields (transformers 5) and __init__ keyword defaults (4.x), bases first."""
    values: dict[str, Any] = {}
    attribute_map: dict[str, str] = {}
    for base in node.bases:
        base_node, base_tree = _find_base(base, tree, models) if depth < 4 else (None, None)
        if base_node is not None and base_tree is not None:
            base_values, base_map = _class_values(base_node, base_tree, models, depth + 1)
            values.update(base_values)
            attribute_map.update(base_map)
    for statement in node.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "attribute_map" for t in statement.targets
        ):
            ok, mapping = _literal(statement.value)
            if ok and isinstance(mapping, dict):
                attribute_map.update(mapping)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            ok, value = _literal(statement.value)
            if ok:
                values[statement.target.id] = value
        elif isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            arguments = statement.args
            positional = arguments.args[len(arguments.args) - len(arguments.defaults) :]
            pairs = list(zip(positional, arguments.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d]
            for argument, default in pairs:
                ok, value = _literal(default)
                if ok:
                    values[argument.arg] = value
    # a field named by an alias stores into its target (DeepseekV3 num_mtp_layers)
    return {attribute_map.get(k, k): v for k, v in values.items()}, attribute_map


def _find_base(
    base: ast.expr, tree: ast.Module, models: Path
) -> tuple[ast.ClassDef | None, ast.Module | None]:
    if not isinstance(base, ast.Name) or base.id in ("PreTrainedConfig", "PretrainedConfig"):
        return None, None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == base.id:
            return node, tree
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 2
            and node.module
            and any(alias.name == base.id for alias in node.names)
        ):
            source = (models / Path(*node.module.split("."))).with_suffix(".py")
            if source.is_file():
                base_tree = ast.parse(source.read_text(encoding="utf-8"))
                for base_node in base_tree.body:
                    if isinstance(base_node, ast.ClassDef) and base_node.name == base.id:
                        return base_node, base_tree
    return None, None


def _imported_defaults(model_type: str) -> ClassDefaults | None:
    """Slow path: instantiate the class with no arguments and read what it holds."""
    try:
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[model_type]()
    except Exception:  # unknown type, or a class that needs arguments
        return None
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    return ClassDefaults(type(config).__name__, values, dict(getattr(config, "attribute_map", {})))


# --- one HF (text) config, with provenance ---

_MISSING = object()


class HfConfig:
    """config.json values with vLLM's getattr semantics: attribute_map, then class defaults."""

    def __init__(self, raw: dict[str, Any], model_type: str, label: str) -> None:
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


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelFactsError(f"no config.json in {path.parent}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelFactsError(
            f"{path}: malformed JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None
    if not isinstance(data, dict):
        raise ModelFactsError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """vLLM's hf_text_config: the language model's sub-config of a multimodal checkpoint."""
    for key in TEXT_CONFIG_KEYS:
        sub = raw.get(key)
        if isinstance(sub, dict) and sub:
            return sub, f"config.json {key}"
    return raw, "config.json"


def _text_model_type(raw: dict[str, Any], text: dict[str, Any]) -> str:
    if text is raw:
        return str(raw.get("model_type") or "")
    if text.get("model_type"):
        return str(text["model_type"])
    parent = str(raw.get("model_type") or "")
    # Gemma3Config's text_config is Gemma3TextConfig (model_type gemma3_text), and so on.
    if parent and transformers_defaults(f"{parent}_text") is not None:
        return f"{parent}_text"
    return parent


def load_hf_facts(directory: Path, *, source: str | None = None) -> ModelFacts:
    """Facts from a HF model directory (config.json and safetensors headers)."""
    config_path = directory / "config.json"
    if not config_path.is_file() and any(directory.glob("*.gguf")):
        raise ModelFactsError(f"no config.json in {directory}; for a GGUF model pass the .gguf file itself")
    raw = read_json(config_path)
    text, label = text_config(raw)
    model_type = _text_model_type(raw, text)
    cfg = HfConfig(text, model_type, label)
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
    dtype, dtype_note = _hf_dtype(raw, text, weights, cfg.provenance)
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
        provenance=provenance,
        notes=tuple(notes),
    )


def _hf_dtype(
    raw: dict[str, Any], text: dict[str, Any], weights: SafetensorsWeights, provenance: dict[str, str]
) -> tuple[str, str | None]:
    """vLLM: config dtype (top level, then text config), else safetensors dtypes, else float32."""
    declared = None
    for config, where in ((raw, "config.json"), (text, "config.json text config")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(config.get(key), str):
                declared, origin = config[key].removeprefix("torch."), f"{where} {key}"
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


def quantization_facts(raw: dict[str, Any], text: dict[str, Any]) -> tuple[str | None, str | None]:
    """quant_method as vLLM normalises it, and the KV dtype a declared KV scheme turns `auto` into."""
    quant = None
    for config in (raw, text):
        quant = config.get("quantization_config") or config.get("compression_config")
        if isinstance(quant, dict):
            break
    if not isinstance(quant, dict):
        return None, None
    method = str(quant.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
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


def _kv_heads_and_head_size(cfg: HfConfig, num_heads: int) -> tuple[int, int]:
    kv_heads = cfg.first(KV_HEAD_KEYS, fact="num_kv_heads")
    if kv_heads is None:
        kv_heads = num_heads
        cfg.provenance["num_kv_heads"] = "num_attention_heads (no KV-head key)"
    head_dim = cfg.get("head_dim", fact="head_size")
    if not head_dim or head_dim <= 0:
        head_dim = cfg.get("hidden_size_per_head", fact="head_size")
    if not head_dim:
        hidden = cfg.get("hidden_size", fact="head_size")
        if not hidden:
            raise ModelFactsError(
                f"{cfg.label} (model_type {cfg.model_type!r}) lacks head_dim and hidden_size"
            )
        head_dim = int(hidden) // num_heads
    return int(kv_heads), int(head_dim)


def _layer_types(cfg: HfConfig, num_layers: int) -> list[str] | None:
    """layer_types as transformers derives it for the model types vLLM reads it from."""
    declared = cfg.get("layer_types", fact="layer_types")
    if isinstance(declared, list) and len(declared) >= num_layers:
        return [str(t) for t in declared[:num_layers]]
    model_type = cfg.model_type
    window = cfg.get("sliding_window")
    derived: list[str] | None = None
    if model_type in ("gemma3", "gemma3_text", "cohere2"):
        pattern = int(cfg.get("sliding_window_pattern") or (6 if model_type != "cohere2" else 4))
        derived = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif model_type in ("gemma2", "gpt_oss"):
        derived = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif model_type in ("gemma3n", "gemma3n_text"):
        derived = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)]
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
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

    shared = int(cfg.get("num_kv_shared_layers", 0, fact="num_kv_shared_layers") or 0)
    if shared:
        # gemma3n.py: the last num_kv_shared_layers reuse an earlier layer's KV
        layers[num_layers - shared :] = [LayerFacts(LayerKind.NONE)] * shared
    return layers, notes


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
    """Mamba / gated-delta-net / linear-attention hybrids, or None for plain attention models."""
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
            ssm_dtype=cfg.get("mamba_ssm_dtype") if model_type.startswith("qwen3_5") else None,
        )
    elif model_type == "nemotron_h":
        pattern = raw.get("hybrid_override_pattern")
        if isinstance(pattern, str):
            kinds = [{"M": "state", "*": "attention"}.get(c, "none") for c in pattern]
        else:
            types = cfg.first(("layers_block_type", "layer_types"), fact="layer_types") or []
            kinds = [_block_kind(t) for t in types]
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
            ssm_dtype=str(cfg.get("mamba_ssm_cache_dtype") or "float32"),  # models/config.py NemotronH
        )
    elif model_type == "granitemoehybrid":
        types = cfg.first(("layer_types", "layers_block_type"), fact="layer_types") or ["mamba"] * num_layers
        kinds = [_block_kind(t) for t in types]
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
    elif isinstance(raw.get("attn_type_list"), list):
        # MiniMax-Text-01: 1 = softmax attention, 0 = lightning (linear) attention
        kinds = ["attention" if t == 1 else "state" for t in raw["attn_type_list"]]
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


def _block_kind(layer_type: str) -> str:
    if layer_type in FULL_LAYER_TYPES:
        return "attention"
    if layer_type in LINEAR_LAYER_TYPES or layer_type == "M":
        return "state"
    return "none"  # mlp / moe blocks hold no cache


# --- safetensors headers ---


@dataclass(frozen=True)
class SafetensorsWeights:
    total_bytes: int | None = None
    source: str = ""
    dtypes: frozenset[str] = frozenset()


def safetensors_weights(directory: Path) -> SafetensorsWeights:
    """Total tensor bytes from the index, else from each shard's header (never the data)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        total = (read_json_any(index).get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > 0:
            return SafetensorsWeights(int(total), "safetensors index")
    shards = sorted(directory.glob("*.safetensors"))
    if any(s.name != "consolidated.safetensors" for s in shards):
        shards = [s for s in shards if s.name != "consolidated.safetensors"]  # Mistral-format duplicate
    if not shards:
        return SafetensorsWeights()
    total = 0
    dtypes: set[str] = set()
    for shard in shards:
        nbytes, shard_dtypes = safetensors_header_bytes(shard)
        total += nbytes
        dtypes |= shard_dtypes
    return SafetensorsWeights(total, "safetensors headers", frozenset(dtypes))


def read_json_any(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFactsError(f"{path}: unreadable JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def safetensors_header_bytes(path: Path) -> tuple[int, set[str]]:
    """Sum of the tensors' byte ranges declared in one shard's header, and their dtypes."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFactsError(f"{path}: truncated safetensors file (no header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > 100_000_000:
                raise ModelFactsError(f"{path}: not a safetensors file (header length {length})")
            header_bytes = handle.read(length)
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None
    if len(header_bytes) < length:
        raise ModelFactsError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(header_bytes)
        tensors = [v for k, v in header.items() if k != "__metadata__"]
        total = sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0]) for t in tensors)
        dtypes = {str(t["dtype"]) for t in tensors}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ModelFactsError(f"{path}: malformed safetensors header ({error})") from None
    return total, dtypes


# --- GGUF headers ---


@functools.cache
def gguf_constants() -> ModuleType:
    """gguf-py's constants module; loaded on its own when gguf is not imported yet.

    `import gguf` pulls in numpy and the whole package (~0.2 s); constants.py needs neither.
    """
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    spec = importlib.util.find_spec("gguf")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
        module_spec = importlib.util.spec_from_file_location("_vllm_ctxmgr_gguf_constants", path)
        if module_spec is not None and module_spec.loader is not None:
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    import gguf.constants

    return gguf.constants


@dataclass(frozen=True)
class SkippedArray:
    """A large string array (tokenizer vocabulary, merges) left undecoded."""

    count: int


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    data_start: int
    file_size: int
    type_names: dict[int, str] = field(default_factory=dict)


class _Cursor:
    """struct reads over an mmap, turning every overrun into a truncated-file error."""

    def __init__(self, buffer: mmap.mmap, path: Path, endian: str) -> None:
        self.buffer = buffer
        self.path = path
        self.endian = endian
        self.offset = 0
        self.size = len(buffer)

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(self.endian + fmt, self.buffer, self.offset)
        except struct.error:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})") from None
        self.offset += struct.calcsize(self.endian + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.offset + length
        if end > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        text = self.buffer[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_strings(self, count: int) -> None:
        """Step over COUNT strings (a 150k-token vocabulary) without decoding them."""
        unpack = struct.Struct(self.endian + "Q").unpack_from
        buffer, offset = self.buffer, self.offset
        try:
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
        except struct.error:
            offset = self.size + 1
        if offset > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        self.offset = offset


_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_STRING_ARRAYS_UP_TO = 4096


def _read_value(cursor: _Cursor, value_type: int) -> Any:
    if value_type in _SCALAR_FORMATS:
        return cursor.unpack(_SCALAR_FORMATS[value_type])[0]
    if value_type == _STRING:
        return cursor.string()
    if value_type == _ARRAY:
        item_type, count = cursor.unpack("IQ")
        if item_type in _SCALAR_FORMATS:
            return list(cursor.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
        if item_type == _STRING:
            if count > _KEEP_STRING_ARRAYS_UP_TO:
                cursor.skip_strings(count)
                return SkippedArray(count)
            return [cursor.string() for _ in range(count)]
        return [_read_value(cursor, item_type) for _ in range(count)]
    raise ModelFactsError(f"{cursor.path}: unknown GGUF value type {value_type} at byte {cursor.offset}")


def read_gguf_header(path: Path) -> GgufHeader:
    """Metadata and tensor infos of one GGUF file; the tensor data region is only size-checked."""
    constants = gguf_constants()
    try:
        with path.open("rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            if file_size < 24:
                magic = handle.read(4)
                if magic != b"GGUF":
                    raise ModelFactsError(f"{path}: not a GGUF file (magic {magic!r})")
                raise ModelFactsError(f"{path}: truncated GGUF header ({file_size} bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse_gguf(buffer, path, file_size, constants)
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None


def _parse_gguf(buffer: mmap.mmap, path: Path, file_size: int, constants: ModuleType) -> GgufHeader:
    if buffer[:4] != b"GGUF":
        raise ModelFactsError(f"{path}: not a GGUF file (magic {bytes(buffer[:4])!r})")
    (version,) = struct.unpack_from("<I", buffer, 4)
    endian = "<"
    if version & 0xFFFF == 0:
        endian = ">"
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in (2, 3):
        raise ModelFactsError(f"{path}: unsupported GGUF version {version}")
    cursor = _Cursor(buffer, path, endian)
    cursor.offset = 8
    tensor_count, kv_count = cursor.unpack("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        (value_type,) = cursor.unpack("I")
        metadata[key] = _read_value(cursor, value_type)
    sizes = {int(t): size for t, size in constants.GGML_QUANT_SIZES.items()}
    type_names = {int(t): t.name for t in constants.GGMLQuantizationType}
    tensors = []
    for _ in range(tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("I")
        shape = cursor.unpack(f"{n_dims}Q")
        ggml_type, offset = cursor.unpack("IQ")
        if ggml_type not in sizes:
            raise ModelFactsError(f"{path}: tensor {name} has unknown ggml type {ggml_type}")
        block_size, type_size = sizes[ggml_type]
        tensors.append(
            GgufTensor(name, tuple(shape), ggml_type, offset, math.prod(shape) // block_size * type_size)
        )
    alignment = int(metadata.get("general.alignment") or 32)
    data_start = -(-cursor.offset // alignment) * alignment
    data_end = data_start + max((t.offset + t.nbytes for t in tensors), default=0)
    if data_end > file_size:
        raise ModelFactsError(
            f"{path}: truncated GGUF file (tensor data ends at byte {data_end}, file has {file_size})"
        )
    return GgufHeader(path, version, metadata, tensors, data_start, file_size, type_names)


def gguf_parts(path: Path) -> list[Path]:
    """All parts of a split GGUF (from any part), or [path]."""
    match = SPLIT_GGUF.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for part in parts:
        if not part.is_file():
            raise ModelFactsError(f"split GGUF part missing: {part}")
    return parts


def load_gguf_facts(path: Path, *, source: str | None = None) -> ModelFacts:
    """Facts from a GGUF file or split GGUF (metadata from part 1, tensor bytes summed over all)."""
    parts = gguf_parts(path)
    headers = [read_gguf_header(part) for part in parts]
    first = headers[0]
    meta = first.metadata
    split_count = meta.get("split.count")
    if split_count and int(split_count) != len(parts):
        raise ModelFactsError(f"{parts[0]}: split.count is {split_count} but {len(parts)} parts are named")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFactsError(f"{parts[0]}: no general.architecture in the GGUF metadata")
    tensors = [t for header in headers for t in header.tensors]
    return gguf_facts(meta, tensors, first.type_names, source=source or str(path), parts=len(parts))


def gguf_facts(
    meta: dict[str, Any],
    tensors: list[GgufTensor],
    type_names: dict[int, str],
    *,
    source: str,
    parts: int = 1,
) -> ModelFacts:
    """Facts from GGUF metadata and tensor infos, following llama.cpp's converter conventions."""
    arch = str(meta["general.architecture"])
    provenance: dict[str, str] = {}
    notes = [
        "vLLM 0.33.0 has no GGUF loader; these facts follow the GGUF path of earlier vLLM releases",
    ]

    def get(key: str, fact: str | None = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is not None and fact:
            provenance.setdefault(fact, f"gguf {arch}.{key}")
        return value

    block_count = get("block_count", "num_hidden_layers")
    heads = get("attention.head_count", "num_attention_heads")
    missing = [k for k, v in (("block_count", block_count), ("attention.head_count", heads)) if v is None]
    if missing:
        raise ModelFactsError(
            f"GGUF {source} (arch {arch!r}) lacks {', '.join(f'{arch}.{k}' for k in missing)}"
        )
    num_heads = int(max(heads) if isinstance(heads, list) else heads)
    nextn = int(get("nextn_predict_layers", "mtp_layers") or 0)
    num_layers = int(block_count) - nextn
    if nextn:
        tail = {int(m[1]) for t in tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t.name))}
        seen = (
            "its nextn tensors confirm it"
            if tail and min(tail) >= num_layers
            else "not confirmed by tensor names"
        )
        notes.append(
            f"block_count {block_count} includes {nextn} nextn (MTP) layer(s), llama.cpp's convention; "
            f"counted {num_layers} decoder layers ({seen})"
        )
    hidden = get("embedding_length", "hidden_size")
    kv_heads = get("attention.head_count_kv", "num_kv_heads")
    kv_per_layer = kv_heads if isinstance(kv_heads, list) else None
    if kv_heads is None:
        kv_heads = num_heads
        provenance["num_kv_heads"] = "gguf attention.head_count (no head_count_kv)"
    key_length = get("attention.key_length", "head_size")
    if key_length is None:
        if not hidden:
            raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.attention.key_length")
        key_length = int(hidden) // num_heads
    value_length = get("attention.value_length") or key_length
    rope_dim = get("rope.dimension_count")
    kv_lora_rank = get("attention.kv_lora_rank", "kv_lora_rank")
    index_head_dim = int(get("attention.indexer.key_length", "indexer") or 0)
    window = get("attention.sliding_window", "sliding_window")
    window = int(window) if window else None

    def kv_at(i: int) -> int:
        return int(kv_per_layer[i]) if kv_per_layer is not None else int(kv_heads)

    tensor_names = {t.name for t in tensors}
    layers: list[LayerFacts] = []
    qk_nope = rope_dims = None
    if kv_lora_rank:
        # llama.cpp writes MLA as MQA (key_length = latent + rope); older deepseek2 files carry
        # MHA dims, so the latent width comes from kv_lora_rank + the rope dims either way.
        latent = int(kv_lora_rank)
        if rope_dim is not None:
            rope_dims = int(rope_dim)
        elif int(key_length) > latent:  # MQA layout: key_length = latent + rope
            rope_dims = int(key_length) - latent
        else:
            raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.rope.dimension_count")
        head_size = latent + rope_dims
        key_length_mla = get("attention.key_length_mla")
        if key_length_mla:
            qk_nope = int(key_length_mla) - rope_dims
        else:
            qk_nope = int(key_length) - rope_dims if int(key_length) != head_size else None
            notes.append(
                "GGUF without key_length_mla (older converter, MHA dims): MLA detected from kv_lora_rank"
            )
        layers = [
            LayerFacts(
                LayerKind.MLA,
                num_kv_heads=1,
                head_size=head_size,
                head_size_v=0,
                indexer_head_dim=index_head_dim,
            )
            for _ in range(num_layers)
        ]
        provenance["head_size"] = f"gguf {arch}.attention.kv_lora_rank + rope.dimension_count"
    else:
        pattern = _gguf_sliding_pattern(arch, meta, num_layers, window)
        state = _gguf_state(arch, meta)
        interval = get("full_attention_interval")
        for i in range(num_layers):
            prefix = f"blk.{i}."
            if state is not None and interval:
                is_state = (i + 1) % int(interval) != 0
            else:
                is_state = state is not None and any(n.startswith(prefix + "ssm_") for n in tensor_names)
            if is_state:
                layers.append(LayerFacts(LayerKind.MAMBA, state=state))
            elif kv_at(i) == 0:
                layers.append(LayerFacts(LayerKind.NONE))
            elif pattern[i]:
                layers.append(
                    LayerFacts(LayerKind.SLIDING, kv_at(i), int(key_length), int(value_length), window=window)
                )
            else:
                layers.append(LayerFacts(LayerKind.FULL, kv_at(i), int(key_length), int(value_length)))
        shared = int(get("attention.shared_kv_layers") or 0)
        if shared:
            layers[num_layers - shared :] = [LayerFacts(LayerKind.NONE)] * shared

    context_length = get("context_length", "max_position_embeddings")
    rope_type = get("rope.scaling.type")
    rope: tuple[RopeFacts, ...] = ()
    if rope_type and rope_type != "none":
        factor = get("rope.scaling.factor")
        original = get("rope.scaling.original_context_length")
        rope = (
            RopeFacts(str(rope_type), float(factor) if factor else None, int(original) if original else None),
        )
        provenance["rope"] = f"gguf {arch}.rope.scaling.*"
    file_type = meta.get("general.file_type")
    quantization = _gguf_quantization(file_type, tensors, type_names)
    provenance["quantization"] = "gguf general.file_type" if file_type is not None else "gguf tensor types"
    provenance["weight_bytes"] = "gguf tensor infos" + (f" ({parts} parts)" if parts > 1 else "")
    provenance["dtype"] = "vLLM auto for GGUF (no torch dtype in GGUF metadata) -> bfloat16"
    return ModelFacts(
        source=source,
        source_format="gguf",
        model_type=arch,
        architectures=(),
        num_attention_heads=num_heads,
        layers=tuple(layers),
        dtype="bfloat16",
        position_limits=(("max_position_embeddings", int(context_length)),) if context_length else (),
        rope=rope,
        sliding_window=window,
        hidden_size=int(hidden) if hidden else None,
        mtp_layers=nextn,
        kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
        qk_rope_head_dim=rope_dims if kv_lora_rank else None,
        qk_nope_head_dim=qk_nope,
        weight_bytes=sum(t.nbytes for t in tensors),
        quantization=quantization,
        provenance=provenance,
        notes=tuple(notes),
    )


def _gguf_sliding_pattern(arch: str, meta: dict[str, Any], num_layers: int, window: int | None) -> list[bool]:
    """Per layer: sliding? From sliding_window_pattern (int period or bool per layer) or arch."""
    if not window:
        return [False] * num_layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(p) for p in pattern[:num_layers]] + [False] * (num_layers - len(pattern))
    period = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gemma3n": 5}.get(arch)
    if isinstance(pattern, int) and pattern > 0:
        period = pattern
    if arch == "gpt-oss":
        return [i % 2 == 0 for i in range(num_layers)]
    if period:
        return [(i + 1) % period != 0 for i in range(num_layers)]
    return [True] * num_layers  # one model-level window: every layer slides


def _gguf_state(arch: str, meta: dict[str, Any]) -> StateFacts | None:
    """Recurrent state dims from {arch}.ssm.* (llama.cpp's qwen3next / mamba2 conventions)."""

    def ssm(key: str) -> int:
        return int(meta.get(f"{arch}.ssm.{key}") or 0)

    if not ssm("conv_kernel"):
        return None
    if arch.startswith(("qwen3next", "qwen35")):
        v_heads = ssm("time_step_rank")
        return StateFacts(
            family="gdn",
            conv_kernel=ssm("conv_kernel"),
            num_k_heads=ssm("group_count"),
            num_v_heads=v_heads,
            k_head_dim=ssm("state_size"),
            v_head_dim=ssm("inner_size") // v_heads if v_heads else 0,
        )
    heads = ssm("time_step_rank")
    if ssm("group_count"):
        return StateFacts(
            family="mamba2",
            conv_kernel=ssm("conv_kernel"),
            intermediate_size=ssm("inner_size"),
            n_groups=ssm("group_count"),
            state_size=ssm("state_size"),
            num_heads=heads,
            head_dim=ssm("inner_size") // heads if heads else 0,
        )
    return StateFacts(
        family="mamba1",
        conv_kernel=ssm("conv_kernel"),
        intermediate_size=ssm("inner_size"),
        state_size=ssm("state_size"),
    )


def _gguf_quantization(file_type: Any, tensors: list[GgufTensor], type_names: dict[int, str]) -> str | None:
    if file_type is not None:
        constants = gguf_constants()
        try:
            return str(constants.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_"))
        except ValueError:
            return f"file_type {file_type}"
    by_type: dict[int, int] = {}
    for tensor in tensors:
        by_type[tensor.ggml_type] = by_type.get(tensor.ggml_type, 0) + tensor.nbytes
    if not by_type:
        return None
    return type_names.get(max(by_type, key=by_type.__getitem__))


__all__ = [
    "HfConfig",
    "ModelFactsError",
    "gguf_facts",
    "hf_cache_snapshot",
    "load_gguf_facts",
    "load_hf_facts",
    "load_model_facts",
    "read_gguf_header",
    "transformers_defaults",
]
