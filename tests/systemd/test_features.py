"""The inventory of what ctxmgr asks of systemd (vllm_ctxmgr/systemd/features.py) covers every call.

The source is scanned: each option string passed to systemctl, journalctl or systemd-analyze, each
property read with `systemctl show`, each directive a template writes must be listed with its release,
so a new call cannot land without stating its floor; and none above the floor may lack a fallback.
"""

from __future__ import annotations

import ast
import itertools
import re
import time

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.change.walk import verify_warnings
from vllm_ctxmgr.monitor.schedule import next_run
from vllm_ctxmgr.systemd import features
from vllm_ctxmgr.systemd.features import FLOOR, USES, option_known, parse_version
from vllm_ctxmgr.systemd.systemctl import _verify_problems, new_problems, parse_timestamp

ROOT = REPO
PACKAGE = ROOT / "vllm_ctxmgr"
TOOLS = (features.SYSTEMCTL, features.JOURNALCTL, features.ANALYZE)
# modules whose every option string goes to a tool, even in a function that does not name the tool
# (journal.py builds journalctl's arguments; in systemctl.py such a function helps any of the three)
TOOL_MODULES = {PACKAGE / "systemd/systemctl.py": "", PACKAGE / "systemd/journal.py": features.JOURNALCTL}
OPTION = re.compile(r"^-{1,2}[a-zA-Z][\w-]*(=[\w+-]+)?$")


def _strings(node: ast.AST) -> list[str]:
    """String constants under node, leaving out f-strings' pieces (messages, not arguments)."""
    inside_fstring = {id(c) for n in ast.walk(node) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)}
    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in inside_fstring
    ]


def _calls(node: ast.AST, method: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method


def _tools_in(function: ast.AST) -> set[str]:
    """The tools a function runs: a tool's name as a string, or a call of `.systemctl(...)`."""
    tools = {s for s in _strings(function) if s in TOOLS}
    for node in ast.walk(function):
        if _calls(node, "systemctl"):
            tools.add(features.SYSTEMCTL)
    return tools


def tool_options() -> list[tuple[str, str, str]]:
    """(module, tools, option) for every option string in a function that runs a tool."""
    found: list[tuple[str, str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "features.py":
            continue
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if "nsenter" in _strings(function):
                continue  # the wrapper's own options (nsenter -t PID -m -p), not a tool's
            tools = _tools_in(function)
            if not tools:
                if path not in TOOL_MODULES:
                    continue
                tools = {TOOL_MODULES[path]} - {""}
            for text in _strings(function):
                if OPTION.match(text):
                    found.append((str(path.relative_to(ROOT)), ",".join(sorted(tools)), text))
    return found


def shown_properties() -> set[str]:
    """Properties read with `systemctl show`: `.show(unit, "A", "B")`, `"-p", "A,B"`, *_PROPERTIES."""
    names: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if _calls(node, "show"):
                names.update(_strings(ast.Tuple(elts=node.args[1:], ctx=ast.Load())))
            if isinstance(node, ast.Call):
                args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
                for flag, value in itertools.pairwise(args):
                    if flag == "-p" and isinstance(value, str):
                        names.update(value.split(","))
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id.endswith("_PROPERTIES") for t in node.targets
            ):
                names.update(_strings(node.value))
    return {name for name in names if re.fullmatch(r"[A-Z]\w+", name)}


def template_directives() -> set[str]:
    """`Section.Key` of every directive the templates write, read from the templates' own lines."""
    found: set[str] = set()
    for template in sorted((ROOT / "templates").glob("*.j2")):
        section = "Service"  # unit.j2 edits a service's ExecStart=/Environment= in place
        for line in template.read_text().splitlines():
            header = re.fullmatch(r"\[(\w+)\]", line.strip())
            if header:
                section = header[1]
                continue
            key = re.match(r"^([A-Z]\w+)=", line)
            if key:
                found.add(f"{section}.{key[1]}")
            if "Environment={{" in line or "ExecStart=" in line:
                found.add(f"{section}.{'Environment' if 'Environment' in line else 'ExecStart'}")
    return found


def test_the_scan_finds_the_calls_it_is_meant_to_find() -> None:
    """The scanner itself: known calls are found (a scanner that finds nothing would pass anything)."""
    options = {(tools, option) for _, tools, option in tool_options()}
    assert ("systemctl", "--no-pager") in options
    assert ("journalctl", "--after-cursor") in options  # journal.py, by its module
    assert ("systemd-analyze", "--man=no") in options
    assert {"NRestarts", "NextElapseUSecRealtime", "ExecStart", "Version"} <= shown_properties()
    directives = {"Timer.RandomizedDelaySec", "Service.SuccessExitStatus", "Service.ExecStart"}
    assert directives <= template_directives()


def test_every_option_passed_to_a_tool_is_in_the_inventory() -> None:
    missing = []
    for module, tools, option in tool_options():
        candidates = tools.split(",") if tools else list(TOOLS)
        if not any(option_known(tool, option) for tool in candidates):
            missing.append(f"{module}: {option} ({tools or 'any tool'})")
    assert not missing, "not in vllm_ctxmgr/systemd/features.py USES (say its release): " + "; ".join(missing)


def test_every_property_read_is_in_the_inventory() -> None:
    listed = {u.name for u in USES if u.kind == features.PROPERTY}
    assert sorted(shown_properties() - listed) == []


def test_every_directive_the_templates_write_is_in_the_inventory() -> None:
    listed = {u.name for u in USES if u.kind == features.DIRECTIVE}
    assert sorted(template_directives() - listed) == []


def test_nothing_above_the_floor_without_a_fallback() -> None:
    above = [u for u in USES if u.above_floor]
    assert {u.name for u in above} == {"--timestamp=unix", "--recursive-errors=no"}
    assert [u.name for u in above if not u.fallback] == []
    assert all(u.source for u in USES)
    assert all(u.since is None or u.since <= FLOOR or u.fallback for u in USES)


@pytest.mark.parametrize(
    ("text", "release"),
    [
        ("247.3-7+deb11u4", 247),  # Debian 11's Version property
        ("systemd 252 (252.38-1~deb12u1)", 252),  # `systemctl --version`'s first line
        ("249.11-0ubuntu3.12", 249),  # Ubuntu 22.04
        ("239 (239-78.el8)", 239),  # RHEL 8
        ("v256~rc3", 256),
        ("", None),
        ("unknown", None),
    ],
)
def test_parse_version(text: str, release: int | None) -> None:
    assert parse_version(text) == release


# What a booted Debian 11 (systemd 247.3-7+deb11u5) printed, captured from its own tools in the sandbox
# (tests/support/sandbox.py with its root file system); ESC is the colour code 247 puts even into a pipe.
ESC = "\x1b"
SHOW_247_CALENDAR_TIMER = """NextElapseUSecRealtime=Mon 2026-12-07 03:00:00 UTC
NextElapseUSecMonotonic=0
LoadState=loaded
ActiveState=active
UnitFileState=static
"""
SHOW_247_SPAN_TIMER = """NextElapseUSecRealtime=
NextElapseUSecMonotonic=1h 8min 35.768736s
LoadState=loaded
ActiveState=active
UnitFileState=static
"""
SHOW_247_UNIX = "Invalid value: unix.\n"  # `systemctl show --timestamp=unix` on 247, exit status 1
VERIFY_247_OTHER_UNIT = (
    f"{ESC}[0;1;38;5;185mCouldn't move remaining userspace processes, ignoring: Input/output error{ESC}[0m\n"
    f"{ESC}[0;1;38;5;185m/run/systemd/system/broken.service:3: Unknown key name 'BogusKey' in section "
    f"'Service', ignoring.{ESC}[0m\n"
)
VERIFY_247_OWN_AND_OTHER = (
    f"{ESC}[0;1;38;5;185mCouldn't move remaining userspace processes, ignoring: Input/output error{ESC}[0m\n"
    f"{ESC}[0;1;38;5;185m/run/cand/bad.service:5: Unknown key name 'FooBar' in section 'Service', "
    f"ignoring.{ESC}[0m\n"
    f"{ESC}[0;1;38;5;185m/run/systemd/system/broken.service:3: Unknown key name 'BogusKey' in section "
    f"'Service', ignoring.{ESC}[0m\n"
)
VERIFY_247_RECURSIVE_ERRORS = "systemd-analyze: unrecognized option '--recursive-errors=no'\n"


def _show(text: str) -> dict[str, str]:
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


def test_247_timestamps_parse() -> None:
    assert parse_timestamp(_show(SHOW_247_CALENDAR_TIMER)["NextElapseUSecRealtime"]) == 1796612400.0
    assert parse_timestamp("Mon 2026-12-07 03:00:00.250000 UTC") == 1796612400.25  # us+utc where applied
    assert parse_timestamp("@1796612400") == 1796612400.0  # --timestamp=unix where `show` applies it
    assert parse_timestamp("") is None
    assert parse_timestamp("Mon 2026-12-07 04:00:00 CET") is None  # only UTC: show_times sets TZ=UTC


def test_next_run_of_247_timers() -> None:
    assert next_run(_show(SHOW_247_CALENDAR_TIMER)) == 1796612400.0
    before = time.time()
    span = next_run(_show(SHOW_247_SPAN_TIMER))
    assert span is not None
    # the monotonic elapse (1h 8min 35.77s since boot) moved onto the wall clock
    since_boot = 4115.768736 - time.clock_gettime(time.CLOCK_MONOTONIC)
    assert before + since_boot - 1 <= span <= time.time() + since_boot + 1


def test_verify_on_247_keeps_the_units_own_lines_and_drops_other_units() -> None:
    """Without --recursive-errors (250) verify also reports the units the candidate names: those go."""
    assert _verify_problems(VERIFY_247_OTHER_UNIT, "cand.service", "/run/cand/cand.service", 0, True) == []
    # a non-zero exit caused by another unit alone is that unit's, not the candidate's
    assert _verify_problems(VERIFY_247_OTHER_UNIT, "cand.service", "/run/cand/cand.service", 1, True) == []
    assert _verify_problems(VERIFY_247_OWN_AND_OTHER, "bad.service", "/run/cand/bad.service", 0, True) == [
        "bad.service:5: Unknown key name 'FooBar' in section 'Service', ignoring."
    ]


def test_verify_that_could_not_run_is_a_problem_not_a_pass() -> None:
    """247 given --recursive-errors=no: an error about no unit, reported as the candidate's problem (it is
    never silently a pass); the version check keeps ctxmgr from passing the option there at all."""
    problems = _verify_problems(VERIFY_247_RECURSIVE_ERRORS, "cand.service", "/run/x/cand.service", 1, True)
    assert problems == [
        "cand.service: systemd-analyze verify failed: "
        "systemd-analyze: unrecognized option '--recursive-errors=no'"
    ]


def test_a_verify_that_could_not_run_is_said_as_such_not_as_an_inherited_finding() -> None:
    """Issue 26: the candidate and the current unit both "failed" verify with 247's unrecognized-option
    error, so the failure counted as inherited and read as a finding the unit had: no candidate was ever
    checked. Now the warning says the unit was not checked."""
    current = _verify_problems(VERIFY_247_RECURSIVE_ERRORS, "vllm.service", "/run/a/vllm.service", 1)
    candidate = _verify_problems(VERIFY_247_RECURSIVE_ERRORS, "vllm.service", "/run/b/vllm.service", 1)
    assert new_problems(candidate, current) == []  # the same failure both times: nothing new
    assert verify_warnings(candidate) == [
        "systemd-analyze verify could not check the new unit on this systemd: vllm.service: "
        "systemd-analyze verify failed: systemd-analyze: unrecognized option '--recursive-errors=no'"
    ]
    finding = _verify_problems(VERIFY_247_OWN_AND_OTHER, "bad.service", "/run/cand/bad.service", 0, True)
    assert verify_warnings(finding) == [
        "systemd-analyze verify (the unit had it before): "
        "bad.service:5: Unknown key name 'FooBar' in section 'Service', ignoring."
    ]
