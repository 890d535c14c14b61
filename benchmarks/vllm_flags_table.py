"""Generate vllm_ctxmgr/core/vllm_flag_list.py: every `vllm serve` flag of one vLLM release, from its source.

Usage (VLLM is an unpacked wheel's vllm/ folder):
    python benchmarks/vllm_flags_table.py VLLM 0.33.0 > vllm_ctxmgr/core/vllm_flag_list.py

The list is read the way vLLM builds its parser, without importing vLLM (torch is not needed):
- `make_arg_parser` (entrypoints/common/cli_args.py): the positional model, `--headless`,
  `--api-server-count`,
  `--config`, `--grpc`, then every field of `FrontendArgs` (and its base) as `--field-name`;
- `EngineArgs.add_cli_args` / `AsyncEngineArgs.add_cli_args` (engine/arg_utils.py): every
  `add_argument` call, its option strings, and the config field its `**get_kwargs(Cls)["field"]` names.
A flag's kind follows `_compute_kwargs`'s order of type checks (engine/arg_utils.py): a dataclass or dict
field takes JSON (and the dotted `--flag.key value` form); `bool | str | None` takes an optional value;
`bool` is a BooleanOptionalAction (`--no-flag` exists); a list / tuple / set takes `nargs="+"`; anything
else one value. An explicit `action=` / `nargs=` in the call wins.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _annotations(root: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[str]], dict[str, str]]:
    """({class: {field: annotation}}, {class: base names}, {module-level alias: its source})."""
    classes: dict[str, dict[str, str]] = {}
    bases: dict[str, list[str]] = {}
    aliases: dict[str, str] = {}
    files = [*sorted((root / "config").glob("*.py")), root / "entrypoints/common/cli_args.py"]
    files.append(root / "engine/arg_utils.py")
    for path in files:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                fields = classes.setdefault(node.name, {})
                bases[node.name] = [ast.unparse(b) for b in node.bases]
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        fields[item.target.id] = ast.unparse(item.annotation)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    aliases.setdefault(target.id, ast.unparse(node.value))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                aliases.setdefault(node.target.id, ast.unparse(node.value))
    return classes, bases, aliases


def _field(classes: dict, bases: dict, cls: str, name: str) -> str | None:
    while cls in classes:
        if name in classes[cls]:
            return classes[cls][name]
        parents = [b for b in bases.get(cls, []) if b in classes]
        if not parents:
            return None
        cls = parents[0]
    return None


def _kind(annotation: str | None, classes: dict, aliases: dict, bases: dict | None = None) -> str:
    """json | optional | bool | list | value, in _compute_kwargs's order."""
    bases = bases or {}
    if annotation is None:
        return "value"
    text = annotation
    for _ in range(3):  # resolve module-level aliases a few levels deep
        words = [w for w in _words(text) if w in aliases and w not in classes]
        if not words:
            break
        for w in words:
            text = text.replace(w, f"({aliases[w]})")
    words = set(_words(text))
    # a dataclass, or a subclass of dict (MultiModalDummyOptions): JSON, as is_dict_subclass reads it
    dict_subclass = any(w in classes and "dict" in str(bases.get(w)) for w in words)
    dataclass_like = dict_subclass or any(
        w in classes and (w.endswith("Config") or w.endswith("Args")) for w in words
    )
    if dataclass_like or ("dict" in words and "Literal" not in words and "list" not in words):
        return "json"
    if {"bool", "str", "None"} <= words and not ({"int", "float", "list", "dict", "Literal"} & words):
        return "optional"
    if "bool" in words:
        return "bool"
    if "Literal" in words and not ({"list", "tuple", "set"} & words):
        return "value"
    if {"list", "tuple", "set"} & words:
        return "list"
    return "value"


def _words(text: str) -> list[str]:
    import re

    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)


def _flags_of(path: Path, func_names: set[str], classes: dict, bases: dict, aliases: dict) -> list[tuple]:
    tree = ast.parse(path.read_text())
    out = []
    for func in ast.walk(tree):
        if not (isinstance(func, ast.FunctionDef) and func.name in func_names):
            continue
        kw_sources: dict[str, tuple[str, str | None]] = {}  # variable -> (class, field or None)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                value = node.value
                field = None
                if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
                    field = value.slice.value
                    value = value.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "get_kwargs":
                    kw_sources[node.targets[0].id] = (ast.unparse(value.args[0]), field)
                elif isinstance(value, ast.Name) and value.id in kw_sources and field:
                    kw_sources[node.targets[0].id] = (kw_sources[value.id][0], field)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if not names:
                continue
            cls = field = None
            explicit: dict[str, str] = {}
            for kw in node.keywords:
                if kw.arg is None:
                    inner = kw.value
                    if isinstance(inner, ast.Dict):  # **{**X["field"], "default": None}
                        inner = next(
                            (v for k, v in zip(inner.keys, inner.values, strict=True) if k is None), inner
                        )
                    if isinstance(inner, ast.Subscript) and isinstance(inner.slice, ast.Constant):
                        cls = kw_sources.get(ast.unparse(inner.value), (None, None))[0]
                        field = inner.slice.value
                    elif isinstance(inner, ast.Name) and inner.id in kw_sources:
                        cls, field = kw_sources[inner.id]
                else:
                    explicit[kw.arg] = ast.unparse(kw.value)
            if cls is None and field is None:
                field = explicit.get("dest", "").strip("'\"") or names[0].lstrip("-").replace("-", "_")
            annotation = _field(classes, bases, cls, field) if cls else None
            kind = _kind(annotation, classes, aliases, bases)
            action = explicit.get("action", "")
            if "store_true" in action:
                kind = "switch"
            elif "BooleanOptionalAction" in action:
                kind = "bool"
            elif explicit.get("nargs") in ("'+'", "'*'"):
                kind = "list"
            elif explicit.get("nargs") == "'?'":
                kind = "optional"
            elif (cls is None and not explicit.get("action")) or "choices" in explicit:
                kind = "value"
            out.append((names, field, cls or "", kind, node.lineno, path.name))
    return out


def main(root_arg: str, version: str) -> None:
    root = Path(root_arg)
    classes, bases, aliases = _annotations(root)
    rows = []
    cli_args = root / "entrypoints/common/cli_args.py"
    rows += _flags_of(cli_args, {"make_arg_parser"}, classes, bases, aliases)
    for cls in ("BaseFrontendArgs", "FrontendArgs"):
        for name, annotation in classes[cls].items():
            kind = _kind(annotation, classes, aliases, bases)
            if name in ("allowed_origins", "allowed_methods", "allowed_headers", "middleware"):
                kind = "value"  # _customize_cli_kwargs: json.loads / append, nargs removed
            if name == "disable_access_log_for_endpoints":
                kind = "value"
            rows.append(([f"--{name.replace('_', '-')}"], name, cls, kind, 0, "cli_args.py"))
    rows += _flags_of(root / "engine/arg_utils.py", {"add_cli_args"}, classes, bases, aliases)
    seen: set[str] = set()
    print("# ruff: noqa: E501")
    print('"""Every `vllm serve` flag of vLLM ' + version + ", generated by benchmarks/vllm_flags_table.py")
    print("from the release's source (engine/arg_utils.py add_cli_args, entrypoints/common/cli_args.py).")
    print()
    print("Each row: (option strings, dest field, config class, kind, source file:line). kind: json (a")
    print(
        "dataclass or dict: JSON or the dotted --flag.key form), bool (BooleanOptionalAction: --no-flag too),"
    )
    print("switch (store_true), optional (bare flag or a value), list (nargs '+'), value (one word).")
    print('Do not edit: regenerate."""')
    print()
    print("# fmt: off")
    print(
        f"VLLM_{version.replace('.', '_')}_FLAGS: tuple[tuple[tuple[str, ...], str, str, str, str], ...] = ("
    )
    for names, field, cls, kind, line, file in rows:
        if names[0] in seen or not names[0].startswith("-"):
            continue
        seen.add(names[0])
        where = f"{file}:{line}" if line else f"{file}:{cls}"
        print(f"    ({tuple(names)!r}, {field!r}, {cls!r}, {kind!r}, {where!r}),")
    print(")")
    print("# fmt: on")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0.33.0")
