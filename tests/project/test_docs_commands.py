"""The README's and docs' commands run as written, and the figures they quote are what ctxmgr prints
(issue 28 item 6).

Every fenced block of README.md and docs/*.md is one of:
- commands (no language, `sh`, `console`): each command is run in the checkout's root with bash, the
  checkout's ctxmgr first on PATH (CTXMGR_BIN where set, as tests/ctxmgr_cli.py runs it, else
  `python -m vllm_ctxmgr`). A block whose commands start with `$ ` is a transcript: the lines after a
  command are its output, compared line by line (spaces collapsed; `...` alone skips lines, a line ending
  in ` ...` is a prefix), and `$ echo $?` followed by a number is its exit code. A command shown without
  its exit code must give an answer (0; a plan's 3 or 6), never an error. A ctxmgr line with placeholders
  (`SERVICE`, `[--json]`, `a|b`) is a synopsis: the command must exist and have every option it names.
- a command that cannot run here (a live service, root, ssh to a fleet, minutes of setup) is in
  NOT_RUN below, with why and the test that runs it instead; its options are still checked as a
  synopsis's are;
- configuration (`toml`, `yaml`, `ini`): read by what reads it (the deployment file reader, the
  collection's role variables);
- anything else (`text`, `mermaid`) is in NOT_COMMANDS with the test that keeps it true.
A block or command in none of these fails, so a new command in the docs cannot go stale unnoticed.
Figures quoted in prose beside a command are in PROSE: the doc's words, and the command they come from.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support.paths import REPO

DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
COMMAND_LANGS = ("", "sh", "console", "bash", "shell")
CONFIG_LANGS = ("toml", "yaml", "ini")

# Commands shown that cannot run offline: the command (a ctxmgr command exactly as written, spaces
# collapsed; another program by how it starts) -> why, and the test (or file) that runs it instead.
NOT_RUN: dict[str, tuple[str, str]] = {
    "ctxmgr set-context 200000 vllm-glm5": (
        "changes a running vLLM service (root, systemd)",
        "tests/change/test_deploy_standin.py",
    ),
    "ctxmgr status": (
        "reads the host's systemd and every vLLM service on it",
        "tests/monitor/test_status.py",
    ),
    "ctxmgr plan 200000 --service vllm-glm5": (
        "plans a service systemd runs",
        "tests/cli/test_plan_as_run.py",
    ),
    "ctxmgr deployment plan 200000 --node gpu-a:vllm-glm5 --node gpu-b:vllm-glm5": (
        "reads both nodes over ssh",
        "tests/deployment/test_multinode.py",
    ),
    "ctxmgr deployment verify --file glm5.toml": (
        "every node over ssh",
        "tests/deployment/test_multinode.py",
    ),
    "ctxmgr deployment rollback --file glm5.toml": (
        "every node over ssh",
        "tests/deployment/test_multinode.py",
    ),
    "pipx install": ("installs on the host, from a wheel or an index", "tests/project/test_package_rules.py"),
    "scp -r .cache/wheelhouse": ("copies the wheelhouse to a GPU host", "tests/project/test_wheelhouse.py"),
    "apt-get install": ("the host's packages (root)", "ansible_collections/vllm/ctxmgr/roles/install"),
    "dnf install": ("the host's packages (root)", "ansible_collections/vllm/ctxmgr/roles/install"),
    "python3 -m venv /opt/ctxmgr": ("installs under /opt (root)", "tests/project/test_package_rules.py"),
    "python3.11 -m venv /opt/ctxmgr": ("installs under /opt (root)", "tests/project/test_package_rules.py"),
    "uv python install": ("downloads a Python", "ansible_collections/vllm/ctxmgr/roles/install"),
    "ansible-galaxy collection": (
        "builds and installs the collection",
        "tests/project/test_collection_docs.py",
    ),
    "ansible-playbook": ("a fleet of hosts", "tests/fleet/test_fleet.py"),
    "make ": ("setup and whole tiers: minutes, root (each target is checked to exist)", "Makefile"),
    "for v in": ("downloads every vLLM wheel from PyPI", "tests/core/test_vllm_flags.py"),
    "python benchmarks/vllm_flags_table.py src": (
        "needs every vLLM wheel unpacked",
        "tests/core/test_vllm_flags.py",
    ),
}

# Blocks that are not commands: (doc, the block's first line) -> what it is, and the test keeping it true.
NOT_COMMANDS: dict[tuple[str, str], tuple[str, str]] = {
    ("docs/architecture.md", "unit (+ drop-ins, EnvironmentFile)  ─► systemd.service ─► serve args ─┐"): (
        "a drawing of the flow",
        "tests/project/test_package_rules.py",
    ),
    ("docs/architecture.md", "graph TD"): ("the import graph", "tests/project/test_package_rules.py"),
    ("docs/testing.md", "== 2. roll-out of max_model_len 200000 under 20 req/s"): (
        "make fleet-demo's output",
        "tests/fleet/test_fleet.py",
    ),
}

PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_:]*$")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    lines: tuple[str, ...]


@dataclass
class Command:
    doc: str
    line: int
    text: str  # continuations joined
    output: list[str] = field(default_factory=list)  # a transcript's lines after it
    exit_code: int | None = None  # a transcript's `$ echo $?`
    transcript: bool = False

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def key(self) -> str:
        return " ".join(_strip_comment(self.text).split())


def blocks(doc: str) -> list[Block]:
    found: list[Block] = []
    lines = (REPO / doc).read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(```+|~~~+)\s*([\w-]*)", lines[i])
        if opening:
            fence, start = opening.group(1), i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith(fence):
                body.append(lines[i])
                i += 1
            found.append(Block(doc, start + 1, opening.group(2), tuple(body)))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks(doc)]


def _strip_comment(text: str) -> str:
    """The command without a shell comment after it (`  # ...`, outside quotes)."""
    quote = ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text


def commands(block: Block) -> list[Command]:
    transcript = any(line.startswith("$ ") for line in block.lines)
    found: list[Command] = []
    pending: Command | None = None  # a command whose line ends in a backslash
    exit_next = False  # the line after `$ echo $?` is the exit code of the command before it
    for offset, line in enumerate(block.lines, start=1):
        number = block.line + offset
        if pending is not None:
            pending.text += " " + line.strip().removesuffix("\\").strip()
            if not line.rstrip().endswith("\\"):
                pending = None
            continue
        if transcript and not line.startswith("$ "):
            if exit_next:
                found[-1].exit_code, exit_next = int(line.strip()), False
            elif found:
                found[-1].output.append(line)
            continue
        text = line.removeprefix("$ ") if transcript else line
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if not transcript and line[:1].isspace() and found:  # a synopsis continued on an indented line
            found[-1].text += " " + line.strip()
            continue
        if transcript and text.strip() == "echo $?":
            exit_next = True
            continue
        command = Command(block.doc, number, text.strip().removesuffix("\\").strip(), transcript=transcript)
        found.append(command)
        if text.rstrip().endswith("\\"):
            pending = command
    return found


def is_synopsis(command: Command) -> bool:
    words = command.key.split()
    return any("[" in w or "|" in w or w == "..." or PLACEHOLDER.match(w) for w in words[1:])


def not_run(command: Command) -> tuple[str, str] | None:
    if command.key in NOT_RUN:
        return NOT_RUN[command.key]
    if command.key.startswith("ctxmgr "):
        return None  # a ctxmgr command is named whole, never by how it starts
    return next((why for start, why in NOT_RUN.items() if command.key.startswith(start)), None)


RUNNABLE = (
    re.compile(r"^ctxmgr( |$)"),
    re.compile(r"^(\.venv/bin/)?python benchmarks/\w+\.py$"),
    re.compile(r'^eval "\$\(_CTXMGR_COMPLETE=\w+ ctxmgr\)"$'),
)


def classify(command: Command) -> str:
    if command.key.startswith("ctxmgr ") and is_synopsis(command):
        return "synopsis"
    if not_run(command) is not None:
        return "not run"
    if any(pattern.match(command.key) for pattern in RUNNABLE):
        return "run"
    return "unknown"


def doc_commands() -> list[Command]:
    return [c for block in all_blocks() if block.lang in COMMAND_LANGS for c in commands(block)]


# --- running a command as written -----------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    code: int
    out: str  # stdout, then stderr


@functools.cache
def _bin_dir() -> Path:
    """`ctxmgr` and `python` as the docs call them: the checkout's (or the installed wheel's) ctxmgr."""
    folder = Path(tempfile.mkdtemp(prefix="docs-bin-", dir=REPO / ".cache"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    binary = os.environ.get("CTXMGR_BIN")
    ctxmgr = f'exec "{binary}" "$@"' if binary else f'exec "{sys.executable}" -m vllm_ctxmgr "$@"'
    for name, body in (("ctxmgr", ctxmgr), ("python", f'exec "{sys.executable}" "$@"')):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    (folder / "state").mkdir(mode=0o700)
    return folder


@functools.cache
def run(text: str) -> Result:
    folder = _bin_dir()
    env = {
        **os.environ,
        "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}",
        "CTXMGR_STATE_DIR": str(folder / "state"),  # never the host's /var/lib/ctxmgr
        "COLUMNS": "200",
    }
    proc = subprocess.run(
        ["bash", "-c", text], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return Result(proc.returncode, proc.stdout + proc.stderr)


def _squeeze(line: str) -> str:
    return " ".join(line.split())


def unmatched(expected: list[str], printed: str) -> str | None:
    """The first expected line the output lacks in that place, or None: in order, from the first line
    printed; `...` skips lines; a line ending in ` ...` is a prefix; otherwise each line follows the one
    before it."""
    got = [_squeeze(line) for line in printed.splitlines()]
    position, gap = 0, False
    for want in expected:
        want = _squeeze(want)
        if want == "...":
            gap = True
            continue
        prefix = want.endswith(" ...")
        want = want.removesuffix(" ...")

        def fits(line: str, want: str = want, prefix: bool = prefix) -> bool:
            return line.startswith(want) if prefix else line == want

        candidates = range(position, len(got)) if gap else range(position, min(position + 1, len(got)))
        hit = next((i for i in candidates if fits(got[i])), None)
        if hit is None:
            return want
        position, gap = hit + 1, False
    return None


PLAN_ANSWERS = (0, 3, 6)  # feasible, infeasible, unknown: a plan's answers (README's exit codes), not errors


def answers(key: str) -> tuple[int, ...]:
    """The exit codes a command shown without its own may give."""
    return PLAN_ANSWERS if key.startswith(("ctxmgr plan ", "ctxmgr deployment plan ")) else (0,)


# --- the tests -----------------------------------------------------------------------------------


def test_every_block_is_run_checked_or_named() -> None:
    problems = []
    seen_not_commands = set()
    for block in all_blocks():
        where = f"{block.doc}:{block.line}"
        if block.lang in CONFIG_LANGS:
            continue  # test_configuration_blocks_are_read_by_what_reads_them
        if block.lang not in COMMAND_LANGS:
            key = (block.doc, block.lines[0] if block.lines else "")
            if key not in NOT_COMMANDS:
                problems.append(f"{where}: a {block.lang!r} block in neither the commands nor NOT_COMMANDS")
            seen_not_commands.add(key)
            continue
        for command in commands(block):
            if classify(command) == "unknown":
                problems.append(f"{command.id}: {command.key!r} is neither run here nor in NOT_RUN")
    assert not problems, "\n".join(problems)
    assert seen_not_commands == set(NOT_COMMANDS), "NOT_COMMANDS names blocks the docs no longer have"


def test_not_run_entries_are_used_and_name_a_test_that_exists() -> None:
    keys = {c.key for c in doc_commands()}
    for start, (why, covered_by) in NOT_RUN.items():
        assert why and (REPO / covered_by).exists(), f"{start!r}: {covered_by} does not exist"
        used = start in keys if start.startswith("ctxmgr ") else any(k.startswith(start) for k in keys)
        assert used, f"NOT_RUN names {start!r}, which no doc shows any more"


RUN = [c for c in doc_commands() if classify(c) == "run"]


@pytest.mark.parametrize("command", RUN, ids=[c.id for c in RUN])
def test_the_command_runs_as_written_and_prints_what_the_doc_quotes(command: Command) -> None:
    result = run(command.text)
    if command.exit_code is not None:
        assert result.code == command.exit_code, f"{command.key}: exit {result.code}\n{result.out}"
    else:
        assert result.code in answers(command.key), (
            f"{command.key}: exit {result.code}, not shown in the doc\n{result.out}"
        )
    missing = unmatched(command.output, result.out)
    assert missing is None, f"{command.id}: the doc quotes {missing!r}; {command.key} printed:\n{result.out}"


def _help_names(words: list[str]) -> list[list[str]]:
    """The command (and its alternatives, `plan|set-context`) a synopsis names after `ctxmgr`."""
    paths: list[list[str]] = [[]]
    for word in words[1:]:
        if not re.match(r"^[a-z][a-z|-]*$", word):
            break
        paths = [[*path, alternative] for path in paths for alternative in word.split("|")]
    return paths


@functools.cache
def help_text(path: tuple[str, ...]) -> Result:
    """`ctxmgr PATH --help`, in-process (click's runner): what a synopsis is checked against."""
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    result = CliRunner().invoke(main, [*path, "--help"], prog_name="ctxmgr", terminal_width=200)
    return Result(result.exit_code, result.output)


SYNOPSES = [c for c in doc_commands() if c.key.startswith("ctxmgr ") and classify(c) != "run"]


@pytest.mark.parametrize("command", SYNOPSES, ids=[c.id for c in SYNOPSES])
def test_a_command_not_run_here_exists_with_every_option_it_names(command: Command) -> None:
    words = command.key.split()
    paths = _help_names(words)
    assert paths != [[]], f"{command.id}: names no ctxmgr command"
    helps = []
    for path in paths:
        result = help_text(tuple(path))
        assert result.code == 0, f"{command.id}: `ctxmgr {' '.join(path)}` is not a command:\n{result.out}"
        helps.append(result.out)
    for option in OPTION.findall(command.key):
        assert any(option in text for text in helps), f"{command.id}: {option} is not an option of {paths}"


# --- configuration blocks ---------------------------------------------------------------------------


def _role_variables() -> set[str]:
    roles = REPO / "ansible_collections" / "vllm" / "ctxmgr" / "roles"
    names: set[str] = set()
    for defaults in roles.glob("*/defaults/main.yml"):
        names |= set(yaml.safe_load(defaults.read_text()) or {})
    for specs in roles.glob("*/meta/argument_specs.yml"):
        for entry in (yaml.safe_load(specs.read_text()).get("argument_specs") or {}).values():
            names |= set(entry.get("options") or {})
    return names


CONFIGS = [b for b in all_blocks() if b.lang in CONFIG_LANGS]


@pytest.mark.parametrize("block", CONFIGS, ids=[f"{b.doc}:{b.line}" for b in CONFIGS])
def test_configuration_blocks_are_read_by_what_reads_them(block: Block, tmp_path: Path) -> None:
    text = "\n".join(block.lines) + "\n"
    if block.lang == "toml":  # a deployment file: ctxmgr's own reader
        from vllm_ctxmgr.cli.deployment import _read_deployment_file

        path = tmp_path / "glm5.toml"
        path.write_text(text)
        data = _read_deployment_file(path)
        assert data.nodes, f"{block.doc}:{block.line}: a deployment file without nodes"
        return
    if block.lang == "yaml":
        names = set(yaml.safe_load(text))
    else:  # an Ansible inventory: the variables set on its hosts and groups
        names = set(re.findall(r"(?:^|\s)([a-z][a-z0-9_]*)=", text, flags=re.M))
    assert names, f"{block.doc}:{block.line}: no variables found"
    unknown = {n for n in names if n.startswith(("rolling_context_", "install_"))} - _role_variables()
    assert not unknown, (
        f"{block.doc}:{block.line}: not variables of the collection's roles: {sorted(unknown)}"
    )
    assert names <= _role_variables() | {"ansible_host"}, f"{block.doc}:{block.line}: {sorted(names)}"


# --- figures quoted in prose -------------------------------------------------------------------------

GLM5_PLAN = (
    "ctxmgr plan 200000 --model examples/models/glm-5 -tp 8 --gpu-memory 95.6GiB --gpu-count 8 "
    "--weights-bytes 406.7GiB"
)
SEEDS_GPU_PLAN = f"{GLM5_PLAN} --gpu-name 'NVIDIA RTX PRO 6000 Blackwell Server Edition'"
CALIBRATION = ".venv/bin/python benchmarks/calibration_logs.py"
DEPLOYMENT_FLAGS = ".venv/bin/python benchmarks/deployment_flags.py"


def _calibration_rows(out: str) -> tuple[str, ...]:
    table = out.split("\n\n", 1)[0].splitlines()[1:]  # the rows between the header and the first blank
    return (str(len(table)),)


def _flag_counts(_out: str) -> tuple[str, ...]:
    from vllm_ctxmgr.core.vllm_flag_list import VLLM_FLAGS

    newest = sum(1 for row in VLLM_FLAGS if row[4].endswith("0.33"))
    return (str(len(VLLM_FLAGS)), str(newest), str(len(VLLM_FLAGS) - newest))


def _from(pattern: str) -> Callable[[str], tuple[str, ...]]:
    def figures(out: str) -> tuple[str, ...]:
        found = re.search(pattern, out)
        assert found, f"the command no longer prints {pattern!r}:\n{out}"
        return found.groups()

    return figures


@dataclass(frozen=True)
class Quote:
    doc: str
    words: str  # a pattern of the doc's sentence; its groups are the quoted figures
    command: str | None  # the command the figures come from (run as the commands above are); None: data
    figures: Callable[[str], tuple[str, ...]]  # the same figures from what it printed

    @property
    def id(self) -> str:
        return f"{self.doc}: {self.words[:40]}"


KV_LINE = r"KV cache: ([\d,]+) B/token/GPU \(marginal\), ([\d.]+) GiB"
UNCALIBRATED = r"uncalibrated budget error over (\d+) starts: median ([+-][\d.]+%), worst ([+-][\d.]+%)"
PROSE = [
    Quote(
        "README.md", r"vLLM really allocates ([\d,]+) B/token/GPU \(([\d.]+) GiB\)", GLM5_PLAN, _from(KV_LINE)
    ),
    Quote(
        "README.md",
        r"GLM-5 on a B200 defaults to an fp8 cache, ([\d,]+) B/token/GPU",
        "ctxmgr plan 200000 --model examples/models/glm-5 -tp 8 --gpu-memory 180GiB --gpu-count 8 "
        "--gpu-name 'NVIDIA B200'",
        _from(
            r"KV cache: ([\d,]+) B/token/GPU \(marginal\), [\d.]+ GiB for one request of [\d,]+ tokens \[fp8"
        ),
    ),
    # issue 35: the headline's figures are Hopper's (no GPU named); the seeds' own GPU gives others
    Quote(
        "README.md",
        r"That figure is for Hopper \(H100/H200, compute capability ([\d.]+): a bf16 latent cache,\s+"
        r"([A-Z_]+)\)",
        GLM5_PLAN,
        _from(
            r"GPU: no GPU named, compute capability unknown: planned as Hopper \(([\d.]+)\); .* "
            r"decides the backend ([A-Z_]+) and the KV dtype auto"
        ),
    ),
    Quote(
        "README.md",
        r"on the seeds' own RTX PRO 6000 Blackwell \(([\d.]+)\) vLLM picks\s+([A-Z0-9_]+), which stores the "
        r"cache as (\w+), ([\d,]+) B/token/GPU",
        SEEDS_GPU_PLAN,
        lambda out: (
            *_from(
                r"compute capability ([\d.]+) \(its name, NVIDIA's CUDA GPUs list\): decides the backend "
                r"([A-Z0-9_]+) and the KV dtype (\w+)"
            )(out),
            *_from(r"KV cache: ([\d,]+) B/token/GPU")(out),
        ),
    ),
    Quote(
        "README.md",
        r"and the same 200,000 tokens fit at utilisation ([\d.]+)",
        SEEDS_GPU_PLAN,
        _from(r"FEASIBLE: fits at gpu_memory_utilization ([\d.]+)"),
    ),
    Quote("README.md", r"It plans (\d+) real starts", CALIBRATION, _calibration_rows),
    Quote(
        "README.md",
        r"within 5% of vLLM's on all (\d+) counted starts \(median ([+-][\d.]+%), worst ([+-][\d.]+%)",
        CALIBRATION,
        _from(UNCALIBRATED),
    ),
    Quote(
        "README.md",
        r"\(estimated: KV budget median ([+-][\d.]+%), worst ([+-][\d.]+%) over (\d+) starts",
        CALIBRATION,
        lambda out: (*_from(UNCALIBRATED)(out)[1:], _from(UNCALIBRATED)(out)[0]),
    ),
    Quote(
        "docs/deployment-flags.md",
        r"\((\d+) flags: (\d+) in 0\.33, (\d+) only in older releases\)",
        None,
        _flag_counts,
    ),
    Quote(
        "docs/deployment-flags.md",
        r"The result: (\d+) modelled, (\d+) named, (\d+) with no GPU-memory effect, (\d+) refused"
        r"[^.]*, and (\d+) silent",
        DEPLOYMENT_FLAGS,
        _from(r"all 0\.33 flags\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)"),
    ),
    Quote(
        "docs/deployment-flags.md",
        r"The (?:\d+) flags only older\s+releases have, planned the same way for a unit whose vLLM is "
        r"unknown: "
        r"(\d+) modelled \([^)]*\), (\d+) named, (\d+) with no GPU-memory effect, (\d+) silent",
        DEPLOYMENT_FLAGS,
        _from(r"flags only older releases have\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)"),
    ),
]


@pytest.mark.parametrize("quote", PROSE, ids=[q.id for q in PROSE])
def test_figures_quoted_in_prose_are_what_the_command_prints(quote: Quote) -> None:
    text = " ".join((REPO / quote.doc).read_text(encoding="utf-8").split())
    said = re.search(quote.words, text)
    assert said, f"{quote.doc} no longer says {quote.words!r}: update PROSE with the new words"
    out = ""
    if quote.command is not None:
        result = run(quote.command)
        assert result.code in answers(quote.command), f"{quote.command}: exit {result.code}\n{result.out}"
        out = result.out
    assert said.groups() == quote.figures(out), f"{quote.doc}: {said.group(0)!r}"


def test_the_accounting_table_is_what_the_commands_under_it_print() -> None:
    """docs/vllm-accounting.md's table of KV bytes: row i is the i-th command of the block under it."""
    doc = "docs/vllm-accounting.md"
    text = (REPO / doc).read_text(encoding="utf-8")
    table = text.split("## The numbers that matter", 1)[1].split("```", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("|") and not line.startswith("|---") and not line.startswith("| model")
    ]
    block = next(
        b for b in blocks(doc) if b.line > text[: text.index("## The numbers that matter")].count("\n")
    )
    shown = commands(block)
    assert len(rows) == len(shown) > 5, f"{len(rows)} rows, {len(shown)} commands"
    for row, command in zip(rows, shown, strict=True):
        result = run(command.text)
        found = re.search(KV_LINE + r" for one request of ([\d,]+) tokens", result.out)
        assert found, f"{command.key}: no KV line\n{result.out}"
        per_token, gib, tokens = found.groups()
        one_request = re.match(r"([\d.]+) GiB at ([\d,]+)", row[3])
        assert one_request, f"{row[0]}: {row[3]!r}"
        assert row[2].split()[0] == per_token, (
            f"{row[0]} ({command.key}): {row[2]} B/token, printed {per_token}"
        )
        assert one_request.groups() == (gib, tokens), f"{row[0]}: {row[3]}, printed {gib} GiB at {tokens}"


def test_every_operator_command_help_ends_with_examples() -> None:
    """README: "Every command's `--help` ends with examples" (but `node`, which it names as the exception)."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert "Every command's `--help` ends with examples" in readme
    internal = {"node"}
    assert all(
        f"`{name}`" in readme.split("Every command's `--help` ends with examples", 1)[1][:200]
        for name in internal
    )
    listing = help_text(()).out.split("Commands:", 1)[1]
    names = re.findall(r"^\s{2}([a-z][a-z-]+)\s", listing, flags=re.M)
    assert "plan" in names and "deployment" in names
    paths = [(name,) for name in names if name not in internal]
    group = help_text(("deployment",)).out.split("Commands:", 1)[1]
    paths += [("deployment", sub) for sub in re.findall(r"^\s{2}([a-z][a-z-]+)\s", group, flags=re.M)]
    lacking = [" ".join(p) for p in paths if "Examples:" not in help_text(p).out]
    assert not lacking, f"--help without examples: {lacking}"


def test_make_targets_the_docs_name_exist() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = {t for line in re.findall(r"^([\w. -]+):", makefile, flags=re.M) for t in line.split()}
    named = set()
    for doc in DOCS:
        text = (REPO / doc).read_text(encoding="utf-8")
        named |= {(doc, t) for t in re.findall(r"`make ([a-z][\w-]*)", text)}
        for command in (c for c in doc_commands() if c.doc == doc and c.key.startswith("make ")):
            words = _strip_comment(command.key).removeprefix("make ").replace("|", " ").split()
            named |= {(doc, w) for w in words if "=" not in w and not w.startswith("-")}
    assert named, "no make target found in the docs"
    missing = sorted(f"{doc}: make {t}" for doc, t in named if t not in targets)
    assert not missing, f"not targets of the Makefile: {missing}"


def test_versions_in_the_install_lines_are_the_packages() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M)
    galaxy = yaml.safe_load((REPO / "ansible_collections/vllm/ctxmgr/galaxy.yml").read_text())["version"]
    assert version
    for doc in DOCS:
        text = (REPO / doc).read_text(encoding="utf-8")
        for quoted in re.findall(r"vllm_ctxmgr-(\d[\w.]*)-py3-none-any\.whl", text):
            assert quoted == version.group(1), f"{doc}: wheel {quoted}, the package is {version.group(1)}"
        for quoted in re.findall(r"vllm-ctxmgr-(\d[\w.]*)\.tar\.gz", text):
            assert quoted == galaxy, f"{doc}: collection {quoted}, galaxy.yml says {galaxy}"
