"""Generate vllm_ctxmgr/core/vllm_flag_list.py: every `vllm serve` flag of each vLLM minor, from its source.

Usage (SRC holds one unpacked wheel per release, SRC/0.33.0/vllm/...; the .py files are enough):
    python benchmarks/vllm_flags_table.py SRC > vllm_ctxmgr/core/vllm_flag_list.py
    python benchmarks/vllm_flags_table.py --one SRC/0.33.0/vllm    # one release's rows, for a look

Every `SRC/X.Y.0` folder is read (a minor release's .0; patch releases are not read). Each release's list is
read the way vLLM builds its parser, without importing vLLM (torch is not needed):
- `make_arg_parser` (of the module entrypoints/cli/serve.py imports it from: entrypoints/openai/cli_args.py
  before 0.29, entrypoints/launchers/cli_args.py in 0.29 - 0.32, entrypoints/common/cli_args.py from
  0.33): the positional model, `--headless`, `--api-server-count`, `--config`, ..., then every field
  of `FrontendArgs` (and of its base `BaseFrontendArgs` where there is one) as `--field-name`;
- `EngineArgs.add_cli_args` / `AsyncEngineArgs.add_cli_args` (engine/arg_utils.py): every `add_argument`
  call, its option strings, and the config field its `**get_kwargs(Cls)["field"]` names; the config
  classes' annotations come from vllm/config/*.py (vllm/config.py in the oldest releases).
A flag's kind follows `_compute_kwargs`'s order of type checks (engine/arg_utils.py): a dataclass or dict
field takes JSON (and the dotted `--flag.key value` form); `bool | str | None` takes an optional value;
`bool` is a BooleanOptionalAction (`--no-flag` exists); a list / tuple / set takes `nargs="+"`; anything
else one value. An explicit `action=` / `nargs=` in the call wins.

The releases are then merged into one row per flag (a flag is the set of option strings that share one
argparse action; a flag renamed with its old name kept as an alias stays one row): the option strings,
dest, config class and kind of the newest release that has it, the minor releases it is in ("0.10-0.33";
a flag may come and go: "0.10-0.12,0.20-0.33"), and its file:line in that newest release.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

Row = tuple[list[str], str, str, str, str]  # option strings, dest, config class, kind, file:line


def _sources(root: Path) -> tuple[list[Path], Path]:
    """(the files whose classes give annotations, the frontend's cli_args.py) of one release's layout."""
    config = [root / "config.py"] if (root / "config.py").is_file() else []
    config += sorted((root / "config").glob("*.py"))
    # the module `vllm serve` imports make_arg_parser from (entrypoints/cli/serve.py): openai/cli_args.py
    # before 0.29, launchers/cli_args.py in 0.29 - 0.32, common/cli_args.py from 0.33
    serve = ast.parse((root / "entrypoints/cli/serve.py").read_text())
    module = next(
        node.module
        for node in ast.walk(serve)
        if isinstance(node, ast.ImportFrom) and any(a.name == "make_arg_parser" for a in node.names)
    )
    cli_args = root.parent / (str(module).replace(".", "/") + ".py")
    return [*config, cli_args, root / "engine/arg_utils.py"], cli_args


def _annotations(
    files: list[Path],
) -> tuple[dict[str, dict[str, tuple[str, int]]], dict[str, list[str]], dict[str, str]]:
    """({class: {field: (annotation, line)}}, {class: base names}, {module-level alias: its source})."""
    classes: dict[str, dict[str, tuple[str, int]]] = {}
    bases: dict[str, list[str]] = {}
    aliases: dict[str, str] = {}
    for path in files:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                fields = classes.setdefault(node.name, {})
                bases[node.name] = [ast.unparse(b) for b in node.bases]
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        annotation = ast.unparse(item.annotation)
                        if not annotation.startswith(("ClassVar", "typing.ClassVar")):
                            fields[item.target.id] = (annotation, item.lineno)
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
            return classes[cls][name][0]
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
    # Optional[X] / Union[X, None] (the oldest releases' spelling) read as X | None
    if "Optional" in words:
        words.add("None")
    # a dataclass, or a subclass of dict (MultiModalDummyOptions): JSON, as is_dict_subclass reads it
    dict_subclass = any(w in classes and "dict" in str(bases.get(w)) for w in words)
    dataclass_like = dict_subclass or any(
        w in classes and (w.endswith("Config") or w.endswith("Args")) for w in words
    )
    outer_dict = any(m.startswith(("dict", "Dict")) for m in _members(text))  # dict[str, list[float]]
    if dataclass_like or outer_dict or ({"dict", "Dict"} & words and not {"Literal", "list"} & words):
        return "json"
    if {"bool", "str", "None"} <= words and not ({"int", "float", "list", "dict", "Literal"} & words):
        return "optional"
    if "bool" in words:
        return "bool"
    if "Literal" in words and not ({"list", "tuple", "set"} & words):
        return "value"
    if {"list", "tuple", "set", "List", "Tuple", "Set"} & words:
        return "list"
    return "value"


def _members(text: str) -> list[str]:
    """The members of a top-level union: 'dict[str, int] | None' -> ['dict[str, int]', 'None'];
    Optional[X] and Union[X, Y] (the oldest releases' spelling) unwrapped."""
    text = text.strip()
    for wrapper in ("Optional[", "Union[", "typing.Optional[", "typing.Union["):
        if text.startswith(wrapper) and text.endswith("]"):
            text = text[len(wrapper) : -1]
            break
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif depth == 0 and ch in "|,":
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)


def _flags_of(
    path: Path, rel: str, func_names: set[str], classes: dict, bases: dict, aliases: dict
) -> list[Row]:
    tree = ast.parse(path.read_text())
    out: list[Row] = []
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
        looped = _loop_names(func)
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            first = node.args[0] if node.args else None
            if not names and isinstance(first, ast.Name) and first.id in looped:
                # 0.11's deprecated `for arg, type in [("--guided-decoding-backend", str), ...]` loop
                for name in looped[first.id]:
                    out.append(([name], name[2:].replace("-", "_"), "", "value", f"{rel}:{node.lineno}"))
                continue
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
            out.append((names, str(field), cls or "", kind, f"{rel}:{node.lineno}"))
    return out


def _loop_names(func: ast.FunctionDef) -> dict[str, list[str]]:
    """{loop variable: the option strings it takes} for `for arg[, type] in [literal list]` loops."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(func):
        if not (isinstance(node, ast.For) and isinstance(node.iter, (ast.List, ast.Tuple))):
            continue
        target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
        items = [e.elts[0] if isinstance(e, ast.Tuple) else e for e in node.iter.elts]
        names = [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if isinstance(target, ast.Name) and names and all(n.startswith("--") for n in names):
            out[target.id] = names
    return out


def release_rows(root: Path) -> list[Row]:
    """Every option of one release's `vllm serve` parser; root is the release's vllm/ folder."""
    files, cli_args = _sources(root)
    classes, bases, aliases = _annotations(files)
    cli_rel = str(cli_args.relative_to(root))
    rows = _flags_of(cli_args, cli_rel, {"make_arg_parser"}, classes, bases, aliases)
    frontend_tree = ast.parse(cli_args.read_text())
    frontend = [n.name for n in frontend_tree.body if isinstance(n, ast.ClassDef) and n.name in classes]
    for cls in [c for c in ("BaseFrontendArgs", "FrontendArgs") if c in frontend]:
        for name, (annotation, line) in classes[cls].items():
            kind = _kind(annotation, classes, aliases, bases)
            if name in ("allowed_origins", "allowed_methods", "allowed_headers", "middleware"):
                kind = "value"  # _customize_cli_kwargs: json.loads / append, nargs removed
            if name == "disable_access_log_for_endpoints":
                kind = "value"
            rows.append(([f"--{name.replace('_', '-')}"], name, cls, kind, f"{cli_rel}:{line}"))
    rows += _flags_of(
        root / "engine/arg_utils.py", "engine/arg_utils.py", {"add_cli_args"}, classes, bases, aliases
    )
    seen: set[str] = set()
    out: list[Row] = []
    for row in rows:
        if row[0][0].startswith("-") and row[0][0] not in seen:
            seen.add(row[0][0])
            out.append(row)
    return out


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def ranges(minors: list[int]) -> str:
    """[10, 11, 12, 20, 21] -> '0.10-0.12,0.20-0.21'."""
    parts: list[str] = []
    start = prev = minors[0]
    for m in [*minors[1:], None]:
        if m is not None and m == prev + 1:
            prev = m
            continue
        parts.append(f"0.{start}" if start == prev else f"0.{start}-0.{prev}")
        if m is not None:
            start = prev = m
    return ",".join(parts)


def merge(releases: dict[str, list[Row]]) -> tuple[list[tuple], dict[str, str]]:
    """One row per flag over every release: (option strings, dest, class, kind, releases, file:line in the
    newest release that has it), newest first; and {option string: releases} for an alias whose releases
    differ from its flag's."""
    order = sorted(releases, key=_minor, reverse=True)
    key_of: dict[str, str] = {}  # option string -> the flag's key (its newest first option string)
    newest: dict[str, Row] = {}
    names_of: dict[str, list[str]] = {}
    minors_of: dict[str, set[int]] = {}
    option_minors: dict[str, set[int]] = {}
    for version in order:
        for row in releases[version]:
            names = row[0]
            key = next((key_of[n] for n in names if n in key_of), names[0])
            if key not in newest:
                newest[key] = row
                names_of[key] = []
            for n in names:
                key_of.setdefault(n, key)
                if n not in names_of[key]:
                    names_of[key].append(n)
                option_minors.setdefault(n, set()).add(_minor(version))
            minors_of.setdefault(key, set()).add(_minor(version))
    rows = []
    alias_releases: dict[str, str] = {}
    for key, (_names, dest, cls, kind, where) in newest.items():
        span = ranges(sorted(minors_of[key]))
        rows.append((tuple(names_of[key]), dest, cls, kind, span, where))
        for n in names_of[key][1:]:
            if option_minors[n] != minors_of[key]:
                alias_releases[n] = ranges(sorted(option_minors[n]))
    return rows, alias_releases


def render(releases: dict[str, list[Row]]) -> str:
    rows, alias_releases = merge(releases)
    versions = sorted(releases, key=_minor)
    newest = versions[-1]
    only_old = sum(1 for r in rows if not r[4].endswith(f"0.{_minor(newest)}"))
    lines = [
        "# ruff: noqa: E501",
        f'"""Every `vllm serve` flag of vLLM {versions[0]} .. {newest}: benchmarks/vllm_flags_table.py read',
        "each release's parser from its source (engine/arg_utils.py add_cli_args; make_arg_parser and",
        "FrontendArgs of the cli_args.py that entrypoints/cli/serve.py imports; config/*.py, or config.py,",
        "for the field types), in the wheels on PyPI of these releases (each minor's .0; patch releases",
        *textwrap.wrap(f"not read): {', '.join(versions)}.", 104),
        "",
        f"{len(rows)} flags in all, {len(rows) - only_old} in {newest}, {only_old} only in older releases.",
        "Each row: (option strings, dest field, config class, kind, minor releases it is in, file:line in",
        "the newest release it is in, under vllm/). kind: json (a dataclass or dict: JSON or the dotted",
        "--flag.key form), bool (BooleanOptionalAction: --no-flag too), switch (store_true), optional (bare",
        "flag or a value), list (nargs '+'), value (one word). Option strings, dest, class and kind are the",
        "newest release's. ALIAS_RELEASES: an alias whose releases are not its flag's.",
        'Do not edit: regenerate."""',
        "",
        "# fmt: off",
        f"RELEASES: tuple[str, ...] = {tuple(versions)!r}",
        "",
        "VLLM_FLAGS: tuple[tuple[tuple[str, ...], str, str, str, str, str], ...] = (",
    ]
    lines += [f"    {row!r}," for row in rows]
    lines += [")", "", "ALIAS_RELEASES: dict[str, str] = {"]
    lines += [f"    {name!r}: {span!r}," for name, span in sorted(alias_releases.items())]
    lines += ["}", "# fmt: on", ""]
    return "\n".join(lines)


def read_releases(src: Path) -> dict[str, list[Row]]:
    """{'0.33.0': rows} for every SRC/X.Y.0/vllm folder."""
    found = [p.name for p in src.iterdir() if re.fullmatch(r"\d+\.\d+\.0", p.name) and (p / "vllm").is_dir()]
    return {v: release_rows(src / v / "vllm") for v in sorted(found, key=_minor)}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        for row in release_rows(Path(argv[1])):
            print(row)
        return
    sys.stdout.write(render(read_releases(Path(argv[0]))))


if __name__ == "__main__":
    main(sys.argv[1:])
