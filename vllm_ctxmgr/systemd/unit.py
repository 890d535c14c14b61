"""Unit files: parse them as systemd does, find the vLLM command, and edit only what ctxmgr owns.

Edits are span-based: every byte ctxmgr does not own (comments, other directives, other
arguments, line continuations, `%` specifiers, `$VAR` references) is kept as it was. The
changed pieces are spliced in through `templates/unit.j2`, whose filters quote by systemd's rules.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ctxmgr.core.serve_args import canonical_flag
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.systemd.quoting import (
    Word,
    resolve_escapes,
    split_words,
)
from vllm_ctxmgr.systemd.render import render

# ---------------------------------------------------------------------------------------------
# Unit files: assignments with their line spans, as systemd's config parser sees them.


@dataclass(frozen=True)
class Assignment:
    section: str
    key: str
    value: str  # logical value: continuation lines joined, raw (still quoted)
    start: int  # offset of the key in the file text
    value_start: int  # offset of the value's first character
    end: int  # offset just past the value (before the final newline)


@dataclass
class UnitFile:
    path: Path
    text: str
    assignments: list[Assignment] = field(default_factory=list)

    @classmethod
    def parse(cls, path: Path | str, text: str) -> UnitFile:
        unit = cls(Path(path), text)
        section = ""
        pos = 0
        # systemd splits on "\n" only (Python's splitlines would also split on \x85, \u2028, ...)
        lines = [line + "\n" for line in text.split("\n")]
        lines[-1] = lines[-1][:-1]
        idx = 0
        while idx < len(lines):
            line = lines[idx]
            line_start = pos
            pos += len(line)
            idx += 1
            stripped = line.strip()
            if not stripped or stripped[0] in "#;":
                continue
            if stripped.startswith("[") and stripped.endswith("]"):
                section = stripped[1:-1]
                continue
            if "=" not in stripped:
                raise UnitError(f"{path}: line {text.count(chr(10), 0, line_start) + 1} is not KEY=VALUE")
            # continuation lines: a line ending in a backslash joins the next one
            end = line_start + len(line.rstrip("\n"))
            while text[line_start:end].endswith("\\") and idx < len(lines):
                nxt = lines[idx]
                pos += len(nxt)
                idx += 1
                end = pos - (len(nxt) - len(nxt.rstrip("\n")))
            key_part, _, _ = text[line_start:end].partition("=")
            key = key_part.strip()
            value_start = line_start + len(key_part) + 1
            while value_start < end and text[value_start] in " \t":
                value_start += 1
            unit.assignments.append(
                Assignment(
                    section,
                    key,
                    text[value_start:end],
                    line_start + len(key_part) - len(key_part.lstrip()),
                    value_start,
                    end,
                )
            )
        return unit

    def get_all(self, section: str, key: str) -> list[Assignment]:
        return [a for a in self.assignments if a.section == section and a.key == key]


@dataclass(frozen=True)
class ServiceUnit:
    """A unit as systemd merges it: the fragment, then drop-ins in order."""

    name: str
    files: tuple[UnitFile, ...]

    @classmethod
    def load(
        cls, name: str, fragment: Path | str, dropins: Sequence[Path | str] = (), root: Path = Path("/")
    ) -> ServiceUnit:
        files = []
        for path in [Path(fragment), *map(Path, dropins)]:
            host = root / str(path).lstrip("/") if str(root) != "/" else path
            try:
                text = host.read_text()
            except FileNotFoundError:
                raise UnitError(f"{path}: no such unit file") from None
            except UnicodeDecodeError:
                raise UnitError(f"{path}: not a text file") from None
            files.append(UnitFile.parse(path, text))
        return cls(name, tuple(files))

    def exec_start(self) -> tuple[UnitFile, Assignment]:
        """The effective ExecStart= and the file that holds it (an empty ExecStart= resets the list)."""
        found: tuple[UnitFile, Assignment] | None = None
        for unit_file in self.files:
            for a in unit_file.get_all("Service", "ExecStart"):
                found = None if a.value.strip() == "" else (unit_file, a)
        if found is None:
            raise UnitError(f"{self.name}: no ExecStart= in [Service]")
        return found

    def environment(self, root: Path = Path("/")) -> dict[str, str]:
        """Environment= and EnvironmentFile= merged in systemd's order (later wins)."""
        env: dict[str, str] = {}
        for unit_file in self.files:
            for a in unit_file.assignments:
                if a.section != "Service":
                    continue
                if a.key == "Environment":
                    if not a.value.strip():
                        env.clear()
                        continue
                    for word in split_words(a.value):
                        name, sep, val = word.value.partition("=")
                        if sep:
                            env[name] = resolve_escapes(val.replace("$$", "$$$$"))
                elif a.key == "EnvironmentFile":
                    env.update(_read_environment_file(a.value, root))
        return env


def _read_environment_file(value: str, root: Path) -> dict[str, str]:
    optional = value.startswith("-")
    path = Path(value.lstrip("-").strip())
    host = root / str(path).lstrip("/") if str(root) != "/" else path
    try:
        text = host.read_text()
    except OSError:
        if optional:
            return {}
        raise UnitError(f"EnvironmentFile {path} cannot be read") from None
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        name, _, val = line.partition("=")
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
            val = val[1:-1]
        env[name.strip().removeprefix("export ").strip()] = val
    return env


# ---------------------------------------------------------------------------------------------
# The vLLM command inside ExecStart=


_PYTHON_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
_CLI_MODULES = ("vllm.entrypoints.cli.main",)


@dataclass(frozen=True)
class VllmCommand:
    """Where vLLM's own arguments start in an ExecStart= and what form launches them."""

    form: str  # "vllm serve" | "python -m" | "docker" | "podman"
    words: tuple[Word, ...]  # every word of the ExecStart value
    args_start: int  # index of the first vLLM argument word (the model for `vllm serve MODEL`)
    args_end: int  # one past the last vLLM argument word

    @property
    def args(self) -> list[str]:
        return [w.value for w in self.words[self.args_start : self.args_end]]


def find_vllm_command(value: str) -> VllmCommand:
    words = split_words(value)
    if words and words[0].value[:1] in "-@:+!":
        # ExecStart prefixes (-, @, :, +, !, !!) belong to the first word
        stripped = words[0].value.lstrip("-@:+!")
        words[0] = Word(stripped, words[0].start + len(words[0].value) - len(stripped), words[0].end)
    vals = [w.value for w in words]
    for i, v in enumerate(vals):
        base = os.path.basename(v)
        if base in ("docker", "podman") and i + 1 < len(vals) and vals[i + 1] == "run":
            image = _container_image_index(vals, i + 2)
            if image is not None:
                return VllmCommand(base, tuple(words), image + 1, len(words))
        if base == "vllm" and i + 1 < len(vals) and vals[i + 1] == "serve":
            return VllmCommand("vllm serve", tuple(words), i + 2, len(words))
        if v == "-m" and i + 1 < len(vals):
            if vals[i + 1] in _PYTHON_MODULES:
                return VllmCommand("python -m", tuple(words), i + 2, len(words))
            if vals[i + 1] in _CLI_MODULES and i + 2 < len(vals) and vals[i + 2] == "serve":
                return VllmCommand("python -m", tuple(words), i + 3, len(words))
    raise UnitError(
        "ExecStart= does not run vLLM (no `vllm serve`, `python -m vllm.entrypoints...` or vllm container)"
    )


# docker/podman run options that take a value (so the image is the first word that is not one)
_CONTAINER_VALUE_OPTS = {
    "-e",
    "--env",
    "-v",
    "--volume",
    "-p",
    "--publish",
    "--name",
    "--gpus",
    "--device",
    "--ipc",
    "--network",
    "--net",
    "--shm-size",
    "-w",
    "--workdir",
    "-u",
    "--user",
    "--runtime",
    "--env-file",
    "--mount",
    "--entrypoint",
    "--label",
    "-l",
    "--cpus",
    "--memory",
    "-m",
    "--ulimit",
    "--restart",
    "--pull",
    "--platform",
    "--hostname",
    "-h",
    "--security-opt",
    "--cap-add",
    "--cap-drop",
    "--log-driver",
    "--log-opt",
    "--add-host",
    "--group-add",
    "--cgroupns",
    "--pid",
    "--tmpfs",
    "--health-cmd",
    "--stop-timeout",
    "--stop-signal",
    "--annotation",
}


def _container_image_index(vals: list[str], start: int) -> int | None:
    i = start
    while i < len(vals):
        v = vals[i]
        if v.startswith("-"):
            i += 1 if ("=" in v or v not in _CONTAINER_VALUE_OPTS) else 2
            continue
        return i if "vllm" in v.lower() else None
    return None


def container_environment(command: VllmCommand) -> dict[str, str]:
    """`-e NAME=VALUE` options of a docker/podman command (they reach vLLM, not the unit's env)."""
    if command.form not in ("docker", "podman"):
        return {}
    env: dict[str, str] = {}
    vals = [w.value for w in command.words[: command.args_start]]
    for i, v in enumerate(vals):
        item = None
        if v in ("-e", "--env") and i + 1 < len(vals):
            item = vals[i + 1]
        elif v.startswith("--env="):
            item = v.split("=", 1)[1]
        if item and "=" in item:
            name, _, val = item.partition("=")
            env[name] = val
    return env


# ---------------------------------------------------------------------------------------------
# Editing: splice new flag values into the raw text.


@dataclass(frozen=True)
class FlagEdit:
    """One piece of new text in the unit, rendered by templates/unit.j2."""

    kind: str  # "value" (replace a value word) | "flag" (append a flag) | "environment" (new line)
    value: str
    flag: str = ""
    separator: str = " "


def plan_exec_edits(
    command: VllmCommand, value: str, changes: Mapping[str, str | None]
) -> list[tuple[int, int, FlagEdit | None]]:
    """(start, end, edit) spans in the ExecStart value: replace a value, delete, or append a flag."""
    edits: list[tuple[int, int, FlagEdit | None]] = []
    words = command.words
    done: set[str] = set()
    i = command.args_start
    while i < command.args_end:
        w = words[i]
        flag = canonical_flag(w.value) if w.value.startswith("-") else None
        if flag in changes:
            new = changes[flag]
            inline = "=" in w.value
            value_word = w if inline else (words[i + 1] if i + 1 < command.args_end else None)
            span_end = value_word.end if value_word else w.end
            if new is None or flag in done:
                # delete the flag (and its value), including the whitespace before it
                prev_end = words[i - 1].end if i > 0 else w.start
                edits.append((prev_end, span_end, None))
            elif inline:
                name = w.value.split("=", 1)[0]
                edits.append((w.start, w.end, FlagEdit("value", f"{name}={new}", flag=flag)))
            elif value_word is None:
                edits.append((w.end, w.end, FlagEdit("flag", new, flag="", separator=" ")))
            else:
                edits.append((value_word.start, value_word.end, FlagEdit("value", new, flag=flag)))
            done.add(flag)
            i += 1 if inline else 2
            continue
        i += 1
    missing = [(f, v) for f, v in changes.items() if v is not None and f not in done]
    if missing:
        last = words[command.args_end - 1] if command.args_end > 0 else words[-1]
        separator = _continuation_separator(command, value)
        for flag, new in missing:
            edits.append((last.end, last.end, FlagEdit("flag", new, flag=flag, separator=separator)))
    return edits


def _continuation_separator(command: VllmCommand, value: str) -> str:
    """Follow the unit's style: one flag per continuation line if it already uses them."""
    last = command.words[command.args_end - 1]
    cut = value.rfind("\\\n", 0, last.start)
    if cut < 0:
        return " "
    indent = re.match(r"[ \t]*", value[cut + 2 :])
    return " \\\n" + (indent.group(0) if indent else "")


@dataclass(frozen=True)
class UnitEdit:
    path: Path
    old_text: str
    new_text: str

    @property
    def changed(self) -> bool:
        return self.old_text != self.new_text


def edit_unit(
    unit: ServiceUnit,
    flag_changes: Mapping[str, str | None],
    env_changes: Mapping[str, str | None] | None = None,
) -> UnitEdit:
    """Set vLLM flags (value None removes a flag) and Environment= items in the file that holds ExecStart."""

    unit_file, assignment = unit.exec_start()
    command = find_vllm_command(assignment.value)
    text = unit_file.text
    spans = [
        (assignment.value_start + s, assignment.value_start + e, edit)
        for s, e, edit in plan_exec_edits(command, assignment.value, flag_changes)
    ]
    if env_changes and command.form in ("docker", "podman"):
        spans.extend(
            (assignment.value_start + s, assignment.value_start + e, edit)
            for s, e, edit in _container_env_edits(command, env_changes)
        )
    elif env_changes:
        spans.extend(_environment_edits(unit_file, assignment, env_changes))
    spans.sort(key=lambda t: (t[0], t[1]))
    segments: list[dict[str, str]] = []
    pos = 0
    for start, end, edit in spans:
        segments.append({"kind": "raw", "text": text[pos:start]})
        if edit is not None:
            segments.append(
                {"kind": edit.kind, "value": edit.value, "flag": edit.flag, "separator": edit.separator}
            )
        pos = end
    segments.append({"kind": "raw", "text": text[pos:]})
    new_text = render("unit.j2", segments=segments)
    added = sum(1 for seg in segments if seg["kind"] == "environment")
    _check_no_new_directive(unit_file.path, text, new_text, added)
    return UnitEdit(unit_file.path, text, new_text)


def _container_env_edits(
    command: VllmCommand, env_changes: Mapping[str, str | None]
) -> list[tuple[int, int, FlagEdit | None]]:
    """A containerised vLLM gets its environment from `-e NAME=VALUE`, not from the unit."""
    edits: list[tuple[int, int, FlagEdit | None]] = []
    pending = dict(env_changes)
    words = command.words
    for i in range(command.args_start - 1):
        w = words[i]
        item_word, opt = None, ""
        if w.value in ("-e", "--env"):
            item_word, opt = words[i + 1], w.value
        elif w.value.startswith("--env="):
            item_word, opt = w, "--env="
        if item_word is None or "=" not in item_word.value:
            continue
        name = item_word.value.removeprefix("--env=").split("=", 1)[0]
        if name not in pending:
            continue
        new = pending.pop(name)
        if new is None:
            edits.append((words[i - 1].end if opt != "--env=" else w.start - 1, item_word.end, None))
        else:
            prefix = "--env=" if opt == "--env=" else ""
            edits.append((item_word.start, item_word.end, FlagEdit("value", f"{prefix}{name}={new}")))
    image = words[command.args_start - 1]
    for name, new in pending.items():
        if new is not None:
            edits.append((image.start, image.start, FlagEdit("prefix_flag", f"{name}={new}", flag="-e")))
    return edits


def _environment_edits(
    unit_file: UnitFile, exec_start: Assignment, env_changes: Mapping[str, str | None]
) -> list[tuple[int, int, FlagEdit | None]]:
    edits: list[tuple[int, int, FlagEdit | None]] = []
    pending = dict(env_changes)
    for a in unit_file.get_all("Service", "Environment"):
        words = split_words(a.value)
        for w in words:
            name = w.value.split("=", 1)[0]
            if name in pending:
                new = pending.pop(name)
                if new is None:
                    edits.append((a.value_start + w.start, a.value_start + w.end, None))
                else:
                    edits.append(
                        (a.value_start + w.start, a.value_start + w.end, FlagEdit("env_item", new, flag=name))
                    )
    # new variables go on their own Environment= line just before ExecStart=
    line_start = unit_file.text.rfind("\n", 0, exec_start.start) + 1
    for name, new in pending.items():
        if new is not None:
            edits.append((line_start, line_start, FlagEdit("environment", new, flag=name)))
    return edits


def _check_no_new_directive(path: Path, old: str, new: str, added_lines: int) -> None:
    """Belt and braces: an edit may never add or remove a directive beyond the lines it means to add."""
    if len(UnitFile.parse(path, new).assignments) != len(UnitFile.parse(path, old).assignments) + added_lines:
        raise UnitError(f"{path}: refusing an edit that would change the unit's directives")


def unified_diff(old: str, new: str, path: str, secrets: Iterable[str] = ()) -> str:
    import difflib

    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a{path}", f"b{path}"))
    return mask(diff, secrets)
