"""The house rules of the package, checked on its real files and on the wheel a user installs.

- no import circle (imports inside functions counted);
- the pure core imports only core/, errors and a short list of pure standard modules;
- nothing imports the CLI, and no edge imports the orchestrator;
- the built wheel holds every module and the templates, and none of the test harness;
- where CTXMGR_BIN names an installed ctxmgr (make test and CI set it), that ctxmgr runs from the
  wheel's own site-packages, not from this checkout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.paths import REPO

PACKAGE = REPO / "vllm_ctxmgr"

# pure standard modules the core may use: no files, processes, sockets, clocks or environment
PURE_STDLIB = {"__future__", "collections", "dataclasses", "difflib", "enum", "fractions", "functools",
               "itertools", "json", "math", "re", "typing"}  # fmt: skip
# the edges: one concern each; none may reach up into the orchestrator or the CLI
EDGES = ("model_files", "systemd", "vllm_log", "probe", "nvml", "store", "files")
# the rooms above the edges: one service's change, a deployment over nodes, monitoring. Each is a package
# whose modules have a row of their own in the table below
LAYERS = ("change", "deployment", "monitor")
# what a layer may never reach: the change is used by the other two and uses neither; monitoring may act
# through the change but knows nothing of deployments (the deployment's node steps use both)
NEVER = {"change": ("deployment", "monitor"), "monitor": ("deployment",)}


def module_name(path: Path) -> str:
    return ".".join(path.with_suffix("").relative_to(REPO).parts).removesuffix(".__init__")


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth, with `from pkg import submodule` resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project imports absolutely)"
            assert node.module is not None
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_file = REPO / (candidate.replace(".", "/") + ".py")
                as_package = REPO / candidate.replace(".", "/") / "__init__.py"
                found.add(candidate if as_file.exists() or as_package.exists() else node.module)
    return found


def package_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        graph[name] = {m for m in imports_of(path) if m.startswith("vllm_ctxmgr") and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_counting_imports_inside_functions() -> None:
    graph = package_graph()
    assert len(graph) > 20
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_nothing_that_does_io() -> None:
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for imported in imports_of(path):
            top = imported.split(".")[0]
            if top == "vllm_ctxmgr":
                assert imported.startswith(("vllm_ctxmgr.core", "vllm_ctxmgr.errors")), (path, imported)
            else:
                assert top in PURE_STDLIB, f"{path.relative_to(REPO)} imports {imported}"


def test_nothing_imports_the_cli_and_no_edge_imports_the_orchestrator() -> None:
    for name, deps in package_graph().items():
        if not name.startswith("vllm_ctxmgr.cli") and name != "vllm_ctxmgr.__main__":
            assert not any(d.startswith("vllm_ctxmgr.cli") for d in deps), name
        if name.split(".")[1:2] and name.split(".")[1] in EDGES:
            for room in LAYERS:
                assert not any(d.startswith(f"vllm_ctxmgr.{room}") for d in deps), name


def test_no_layer_reaches_a_layer_it_must_not() -> None:
    for name, deps in package_graph().items():
        layer = name.split(".")[1] if name.count(".") else ""
        for forbidden in NEVER.get(layer, ()):
            assert not [d for d in deps if d.startswith(f"vllm_ctxmgr.{forbidden}")], name


def build_wheel(tmp_path: Path) -> Path:
    given = os.environ.get("CTXMGR_WHEEL")
    if given:
        return Path(given)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("vllm_ctxmgr-*.whl")
    return wheel


def test_the_wheel_holds_every_module_and_the_templates_and_no_harness(tmp_path: Path) -> None:
    names = set(zipfile.ZipFile(build_wheel(tmp_path)).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert modules - names == set()
    templates = {f"vllm_ctxmgr/templates/{p.name}" for p in (REPO / "templates").glob("*.j2")}
    assert "vllm_ctxmgr/templates/unit.j2" in templates
    assert templates - names == set()
    assert not [n for n in names if n.startswith("tests/") or "standin" in n or "sandbox" in n]


def test_the_installed_ctxmgr_runs_from_its_wheel_not_from_this_checkout() -> None:
    binary = os.environ.get("CTXMGR_BIN")
    if not binary:
        if os.environ.get("CTXMGR_REQUIRE_WHEEL") == "1":
            pytest.fail("CTXMGR_REQUIRE_WHEEL=1 but CTXMGR_BIN names no installed ctxmgr")
        pytest.skip("CTXMGR_BIN is not set (make test sets it to the wheel's ctxmgr)")
    python = Path(binary).parent / "python"
    code = (
        "import vllm_ctxmgr; from vllm_ctxmgr.systemd.render import template_dir; "
        "print(vllm_ctxmgr.__file__); print(template_dir())"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, cwd="/")
    package_file, templates = (Path(line) for line in out.stdout.split())
    assert PACKAGE not in package_file.parents and "site-packages" in package_file.parts
    assert (templates / "unit.j2").is_file() and templates != REPO / "templates"
    assert "site-packages" in templates.parts
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True, cwd="/")
    assert "version" in version.stdout


# What each room may import besides `errors`: the table of docs/architecture.md, which must say the same.
ALLOWED = {
    "errors": set(),
    "core": set(),
    "masking": set(),
    "files": set(),
    "model_files": {"core", "files"},
    "systemd": {"core", "files", "masking"},
    "vllm_log": {"core"},
    "probe": {"masking"},
    "nvml": {"core", "files"},
    "store": {"core", "masking"},
    "change.observing": {"core", "nvml", "probe", "store", "systemd", "vllm_log"},
    "change.planning": {"change.observing", "core", "model_files", "nvml", "store", "systemd"},
    "change.restart": {
        "change.observing",
        "core",
        "files",
        "masking",
        "probe",
        "store",
        "systemd",
        "vllm_log",
    },
    "change.states": {"change.restart", "core", "store", "systemd"},
    "change.recovery": {"change.restart", "change.states", "store", "systemd"},
    "change.walk": {
        "change.observing",
        "change.planning",
        "change.recovery",
        "change.restart",
        "change.states",
        "core",
        "store",
        "systemd",
    },
    "monitor.verify": {
        "change.planning",
        "change.restart",
        "change.states",
        "change.walk",
        "core",
        "probe",
        "store",
        "systemd",
        "vllm_log",
    },
    "monitor.schedule": {"monitor.metrics", "store", "systemd"},
    "monitor.status": {"monitor.schedule", "monitor.verify", "report", "store", "systemd"},
    "monitor.metrics": {"core", "store"},
    "report": {"core"},
    "deployment.wire": {"core"},
    "deployment.remote": {"deployment.wire"},
    "deployment.node": {
        "change.observing",
        "change.planning",
        "change.restart",
        "change.states",
        "core",
        "deployment.wire",
        "masking",
        "monitor.verify",
        "nvml",
        "report",
        "store",
        "systemd",
        "vllm_log",
    },
    "deployment.nodes": {"core", "deployment.remote", "deployment.wire"},
    "deployment.file": {"core", "files", "store"},
    "deployment.report": {"deployment.coordinator", "deployment.walk"},
    "deployment.walk": {
        "change.states",
        "core",
        "deployment.nodes",
        "deployment.remote",
        "deployment.wire",
        "store",
    },
    "deployment.coordinator": {
        "change.states",
        "core",
        "deployment.nodes",
        "deployment.remote",
        "deployment.walk",
        "deployment.wire",
        "nvml",
        "store",
    },
}


def room_of(module: str) -> str:
    """An edge is one room; in a layer's package each module is a room (`change.walk`)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in LAYERS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else "vllm_ctxmgr"


def test_every_import_is_an_arrow_of_the_documented_table() -> None:
    for module, deps in package_graph().items():
        room = room_of(module)
        if room in ("cli", "__main__", "vllm_ctxmgr"):
            continue
        if room in LAYERS:  # a layer's __init__ only says what the package is
            assert deps == set(), module
            continue
        assert room in ALLOWED, f"{module}: a room docs/architecture.md does not name"
        for dep in deps:
            target = room_of(dep)
            if target not in (room, "errors"):
                assert target in ALLOWED[room], f"{module} imports {dep}: not in docs/architecture.md's table"


def test_the_documented_table_is_the_one_the_test_enforces() -> None:
    rows = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0] != "`cli`":
            allowed = cells[2].replace("(besides `errors`)", "")
            rows[cells[0].strip("`")] = (
                set() if allowed == "nothing" else {a.strip() for a in allowed.split(",")}
            )
    assert rows == ALLOWED


# What `ctxmgr --help`, a command's --help and a completion TAB may load: click, the group, the light
# the light shared modules of cli/ and what they need to print (errors, masking); no command's module,
# nothing heavy.
HEAVY_THIRD_PARTY = ("transformers", "gguf", "jinja2", "requests", "prometheus_client", "pynvml", "numpy")
# core.bounds: the size flags' bounds the CLI's option types are built from (constants and one function)
LIGHT_MODULES = {
    "vllm_ctxmgr", "vllm_ctxmgr.errors", "vllm_ctxmgr.masking", "vllm_ctxmgr.cli", "vllm_ctxmgr.core",
    "vllm_ctxmgr.core.bounds",
}  # fmt: skip


def modules_loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running code (as a console script would)."""
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(out.stdout.split("\n")[-2].split())


def test_importing_the_cli_loads_no_command_and_nothing_heavy() -> None:
    from vllm_ctxmgr.cli.main import COMMANDS

    loaded = modules_loaded("import vllm_ctxmgr.cli.main")
    assert "vllm_ctxmgr.cli.main" in loaded
    assert [m for m in HEAVY_THIRD_PARTY if m in loaded or any(n.startswith(f"{m}.") for n in loaded)] == []
    ours = {m for m in loaded if m.startswith("vllm_ctxmgr")}
    commands = {entry.module for entry in COMMANDS.values()}
    assert ours & commands == set()
    assert {m for m in ours - LIGHT_MODULES if not m.startswith("vllm_ctxmgr.cli.")} == set()
