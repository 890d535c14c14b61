"""transformers' config-class defaults, read from the class source without importing transformers.

Where vLLM reads a value through transformers' config class, a key missing from config.json gets
the class default. A transformers import costs about a second, so the defaults are read from the
class source with `ast`; only when that fails is transformers imported (`_imported_defaults`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr.core.json_types import JSONValue


@dataclass(frozen=True)
class ClassDefaults:
    """Class-level defaults and attribute_map of one transformers config class."""

    class_name: str
    values: dict[str, JSONValue]  # the literal defaults of the class source
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


def _literal(node: ast.AST | None) -> tuple[bool, JSONValue]:
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False, None


def _class_values(
    node: ast.ClassDef, tree: ast.Module, models: Path, depth: int
) -> tuple[dict[str, JSONValue], dict[str, str]]:
    """Dataclass-style fields (transformers 5) and __init__ keyword defaults (4.x), bases first."""
    values: dict[str, JSONValue] = {}
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
