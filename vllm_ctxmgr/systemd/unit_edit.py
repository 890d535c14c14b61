"""Editing a unit: change only what ctxmgr owns, in place or through a drop-in, and read it back.

Edits are span-based: every byte ctxmgr does not own (comments, other directives, other
arguments, line continuations, `%` specifiers, `$VAR` references) is kept as it was. The
changed pieces are spliced in through `templates/unit.j2`, whose filters quote by systemd's rules.
Hand-written spans, not a parse-and-rewrite, because no unit writer keeps those bytes; every
candidate is then parsed again as systemd parses it (_verify_edit) before it is returned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr.core.serve_args import canonical_flag, split_flags, takes_as_value
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.systemd.quoting import exec_word_value, split_words
from vllm_ctxmgr.systemd.render import render
from vllm_ctxmgr.systemd.unit_file import Assignment, ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import (
    VllmCommand,
    container_image_index,
    find_vllm_command,
    quadlet_source,
)


@dataclass(frozen=True)
class FlagEdit:
    """One piece of new text in the unit, rendered by templates/unit.j2."""

    kind: str  # "value" (replace a word) | "flag" (append words) | "environment" (new line) | ...
    value: str
    flag: str = ""
    separator: str = " "


@dataclass(frozen=True)
class WordOp:
    """A change to the ExecStart words: replace word `index`, delete it, or add words after/before it."""

    index: int
    action: str  # "replace" | "delete" | "after" | "before"
    values: tuple[str, ...] = ()  # program-level values (quoted when written)


def plan_exec_ops(command: VllmCommand, changes: Mapping[str, str | None]) -> list[WordOp]:
    """Replace a flag's value, delete a flag (and its value), or append a missing flag.

    Words are read as vLLM's argparse reads them, and no word but a changed flag's own is ever
    dropped: a flag ctxmgr sets whose next word is another flag (or nothing) is refused, as argparse
    refuses it ("expected one argument"), rather than taking that flag as its value; words after `--`
    are positionals, never flags, and a missing flag goes before the `--`."""
    refusals: list[str] = []
    split_flags(command.args, refusals)
    # a flag left without its value makes any edit a guess; extra positionals (`$VLLM_ARGS` may hold
    # flags until systemd expands it) are the plan's to refuse, and every word is kept here
    refusals = [r for r in refusals if "expected" in r]
    if refusals:
        raise UnitError(f"ExecStart=: vLLM refuses these arguments ({refusals[0]}); fix the unit first")
    ops: list[WordOp] = []
    words = command.words
    done: set[str] = set()
    end = next((j for j in range(command.args_start, command.args_end) if words[j].value == "--"), None)
    boundary = command.args_end if end is None else end
    i = command.args_start
    while i < boundary:
        w = words[i]
        flag = canonical_flag(w.value) if w.value.startswith("-") else None
        if flag in changes:
            new = changes[flag]
            inline = "=" in w.value
            if not inline and (i + 1 >= boundary or not takes_as_value(words[i + 1].value)):
                raise UnitError(
                    f"ExecStart=: {w.value} has no value, which vLLM refuses (argument {flag}: expected "
                    "one argument); give it one in the unit before ctxmgr changes it"
                )
            if new is None or flag in done:
                ops.append(WordOp(i, "delete"))
                if not inline:
                    ops.append(WordOp(i + 1, "delete"))
            elif inline:
                ops.append(WordOp(i, "replace", (f"{w.value.split('=', 1)[0]}={new}",)))
            elif not takes_as_value(new):  # argparse would read it as a flag: only `--flag=value` holds it
                ops.append(WordOp(i, "replace", (f"{w.value}={new}",)))
                ops.append(WordOp(i + 1, "delete"))
            else:
                ops.append(WordOp(i + 1, "replace", (new,)))
            done.add(flag)
            i += 1 if inline else 2
            continue
        i += 1
    missing = [(f, v) for f, v in changes.items() if v is not None and f not in done]
    added = tuple(
        word for flag, new in missing for word in ((flag, new) if takes_as_value(new) else (f"{flag}={new}",))
    )
    if missing and end is not None:
        ops.append(WordOp(end, "before", added))
    elif missing:
        deleted = {op.index for op in ops if op.action == "delete"}
        last = max((j for j in range(command.args_end) if j not in deleted), default=0)
        ops.append(WordOp(last, "after", added))
    return ops


def _container_env_ops(command: VllmCommand, env_changes: Mapping[str, str | None]) -> list[WordOp]:
    """A containerised vLLM gets its environment from `-e NAME=VALUE`, not from the unit."""
    ops: list[WordOp] = []
    pending = dict(env_changes)
    words = command.words
    image = container_image_index(command)
    if image is None:
        raise UnitError("ExecStart=: the container command names no image")
    for i in range(image):
        w = words[i]
        item, prefix = None, ""
        if w.value in ("-e", "--env"):
            item = i + 1
        elif w.value.startswith("--env="):
            item, prefix = i, "--env="
        if item is None or "=" not in words[item].value:
            continue
        name = words[item].value.removeprefix("--env=").split("=", 1)[0]
        if name not in pending:
            continue
        new = pending.pop(name)
        if new is None:
            ops += [WordOp(j, "delete") for j in sorted({i, item})]
        else:
            ops.append(WordOp(item, "replace", (f"{prefix}{name}={new}",)))
    added = [word for name, new in pending.items() if new is not None for word in ("-e", f"{name}={new}")]
    if added:
        ops.append(WordOp(image, "before", tuple(added)))
    return ops


def expected_words(command: VllmCommand, ops: Sequence[WordOp]) -> list[str]:
    """The ExecStart words (as split_words gives them) that `ops` should leave."""
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    replaced: dict[int, list[str]] = {}
    for op in ops:
        values = [exec_word_value(v) for v in op.values]
        if op.action == "before":
            before.setdefault(op.index, []).extend(values)
        elif op.action == "after":
            after.setdefault(op.index, []).extend(values)
        else:
            replaced[op.index] = values
    result: list[str] = []
    for i, w in enumerate(command.words):
        result += before.get(i, []) + replaced.get(i, [w.value]) + after.get(i, [])
    return result


Span = tuple[int, int, "FlagEdit | None"]


def _render_ops(
    unit_file: UnitFile, exec_start: Assignment, command: VllmCommand, ops: Sequence[WordOp]
) -> list[Span]:
    """File spans for the word changes. A deleted word takes the blanks before it on its line; a line
    left with nothing goes, and when it was the value's last line, the continuation backslash of the line
    before goes too, so the next directive is never joined to ExecStart=."""
    text = unit_file.text
    spans: list[Span] = []
    words = command.words

    def raw(i: int) -> tuple[int, int]:
        return exec_start.raw_span(words[i].start, words[i].end)

    deleted = sorted(op.index for op in ops if op.action == "delete")
    groups: list[list[int]] = []
    for i in deleted:
        if groups and groups[-1][-1] == i - 1 and _same_line(text, raw(i - 1)[1], raw(i)[0]):
            groups[-1].append(i)
        else:
            groups.append([i])
    for group in groups:
        start, end = raw(group[0])[0], raw(group[-1])[1]
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        before, after = text[line_start:start], text[end:line_end]
        if before.strip(" \t") == "" and after.strip(" \t") == "\\":
            spans.append((line_start, line_end + 1, None))  # a middle line of the value: it goes
        elif before.strip(" \t") == "" and after.strip(" \t") == "":
            # the value's last line: it goes, and the line before stops continuing
            held = [line for line in exec_start.lines if line[1] <= line_start]
            if not held:
                raise UnitError("ExecStart=: refusing to delete the line that holds the key")
            prev_start, prev_end = held[-1]
            prev = text[prev_start:prev_end]
            keep = len(prev.rstrip(" \t")[:-1].rstrip(" \t"))
            spans.append((prev_start + keep, prev_end, None))
            spans.append(
                (
                    line_start - 1 if line_end >= len(text) else line_start,
                    line_end + (line_end < len(text)),
                    None,
                )
            )
        elif before.strip(" \t"):
            spans.append((start - (len(before) - len(before.rstrip(" \t"))), end, None))
        else:
            spans.append((start, end + len(after) - len(after.lstrip(" \t")), None))
    for op in ops:
        if op.action == "replace":
            (value,) = op.values
            start, end = raw(op.index)
            spans.append((start, end, FlagEdit("value", value)))
        elif op.action == "before":
            at = raw(op.index)[0]
            for flag, value in zip(op.values[::2], op.values[1::2], strict=True):
                spans.append((at, at, FlagEdit("prefix_flag", value, flag=flag)))
        elif op.action == "after":
            at = raw(op.index)[1]
            separator = _continuation_separator(text, exec_start, at)
            if len(op.values) == 1:  # a value after a flag that had none: `{separator}{flag} {value}`
                spans.append((at, at, FlagEdit("flag", op.values[0], flag="", separator="")))
            else:
                for flag, value in zip(op.values[::2], op.values[1::2], strict=True):
                    spans.append((at, at, FlagEdit("flag", value, flag=flag, separator=separator)))
    return spans


def _same_line(text: str, start: int, end: int) -> bool:
    return "\n" not in text[start:end]


def _continuation_separator(text: str, exec_start: Assignment, at: int) -> str:
    """Follow the unit's style: one flag per continuation line if the value already uses them and the
    word is the last on its line."""
    line_end = text.find("\n", at)
    rest = text[at : len(text) if line_end < 0 else line_end]
    if len(exec_start.lines) < 2 or rest.strip(" \t") not in ("", "\\"):
        return " "
    indent = re.match(r"[ \t]*", text[exec_start.lines[-1][0] :])
    return " \\\n" + (indent.group(0) if indent else "")


@dataclass(frozen=True)
class UnitEdit:
    path: Path
    old_text: str  # "" for a drop-in the edit creates
    new_text: str
    existed: bool = True  # False: `path` is a new drop-in (rolling back removes it)

    @property
    def changed(self) -> bool:
        return self.old_text != self.new_text


# A package's units: the next upgrade of the package overwrites an edit made there
VENDOR_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
DROPIN_NAME = "50-ctxmgr.conf"


def is_vendor_unit(path: Path | str) -> bool:
    return Path(path).parent in VENDOR_UNIT_DIRS


def is_vendor_dropin(path: Path | str) -> bool:
    """A package's drop-in (`/usr/lib/systemd/system/NAME.service.d/10-vendor.conf`): the package's next
    upgrade overwrites it as it does the package's unit."""
    path = Path(path)
    return path.parent.name.endswith(".d") and path.parent.parent in VENDOR_UNIT_DIRS


def masking_copy(unit: ServiceUnit, holder: UnitFile, dropin_dir: Path) -> ServiceUnit:
    """The unit with a package's drop-in `holder` masked by a copy of it in `dropin_dir` (the same name in
    a directory systemd reads first hides the package's file: systemd.unit(5)), ready to be edited in
    place there, so the change survives the package's upgrades and a rollback (removing the copy)
    brings the package's own drop-in back."""
    path = dropin_dir / holder.path.name
    if any(f.path == path for f in unit.files):
        raise UnitError(
            f"{path} exists beside the package's {holder.path} but systemd does not read it first"
        )
    copy = UnitFile.parse(path, holder.text)
    return ServiceUnit(unit.name, tuple(copy if f is holder else f for f in unit.files))


def override_dropin(unit: ServiceUnit, dropin_dir: Path, why: str = "") -> ServiceUnit:
    """The unit with a new drop-in in `dropin_dir` that overrides ExecStart= (an empty `ExecStart=`,
    then the fragment's own ExecStart= copied byte for byte), ready for edit_unit to change in place:
    systemd's way (`systemctl edit`) to change a unit whose file someone else owns, so that the next
    package upgrade or configuration-management run keeps the change."""
    unit_file, assignment = unit.exec_start()
    path = dropin_dir / DROPIN_NAME
    if any(f.path == path for f in unit.files):
        raise UnitError(f"{path} exists but does not set ExecStart=; refusing to overwrite it")
    why = why or "the package's unit {path}, which the\n# package's next upgrade would overwrite"
    text = (
        f"# Written by ctxmgr: it overrides ExecStart= of {why.format(path=unit_file.path)}. Roll back with "
        "`ctxmgr rollback --service "
        f"{unit.name.removesuffix('.service')}`,\n"
        "# or delete this file and run `systemctl daemon-reload`.\n"
        "[Service]\n"
        "ExecStart=\n"
        f"{unit_file.raw(assignment)}\n"
    )
    return ServiceUnit(unit.name, (*unit.files, UnitFile.parse(path, text)))


def edit_unit(
    unit: ServiceUnit,
    flag_changes: Mapping[str, str | None],
    env_changes: Mapping[str, str | None] | None = None,
    dropin_dir: Path | None = None,
    dropin_mode: bool = False,
) -> UnitEdit:
    """Set vLLM flags (value None removes a flag) and Environment= items in the file that holds ExecStart.

    With `dropin_dir` (systemd's view, e.g. /etc/systemd/system/NAME.service.d), an ExecStart= held by
    a package's unit (VENDOR_UNIT_DIRS) is changed through a new drop-in there instead (override_dropin);
    a unit under /etc or /run, or a drop-in that holds ExecStart=, is edited in place. `dropin_mode`
    changes a unit under /etc the same way (its file may belong to configuration management, whose
    next run would revert an edit in place); an ExecStart= already held by a drop-in is edited there.

    Before returning, the candidate is read back as systemd reads it: its ExecStart words must be the
    intended ones and every other directive and comment line byte-identical (UnitError if not)."""

    created = False
    holder = unit.exec_start()[0]
    if dropin_dir is not None and holder is not unit.files[0] and is_vendor_dropin(holder.path):
        unit = masking_copy(unit, holder, dropin_dir)
        created = True
    elif dropin_dir is not None and holder is unit.files[0]:
        if is_vendor_unit(unit.files[0].path):
            unit = override_dropin(unit, dropin_dir)
            created = True
        elif dropin_mode:
            why = (
                "the unit file {path}, which\n# configuration management may rewrite (ctxmgr's drop-in mode)"
            )
            unit = override_dropin(unit, dropin_dir, why)
            created = True
    unit_file, assignment = unit.exec_start()
    source = quadlet_source(unit)
    if source and unit_file is unit.files[0]:
        raise UnitError(
            f"{unit.name} is generated by Quadlet from {source}: edit Exec= there and run "
            "`systemctl daemon-reload` (ctxmgr does not edit Quadlet files)"
        )
    command = find_vllm_command(assignment.value)
    ops = plan_exec_ops(command, flag_changes)
    if env_changes and command.form in ("docker", "podman"):
        ops += _container_env_ops(command, env_changes)
    spans = _render_ops(unit_file, assignment, command, ops)
    if env_changes and command.form not in ("docker", "podman"):
        spans.extend(_environment_edits(unit_file, assignment, env_changes))
    spans.sort(key=lambda t: (t[0], t[1]))
    text = unit_file.text
    segments: list[dict[str, str]] = []
    pos = 0
    for start, end, edit in spans:
        if start < pos:
            raise UnitError(f"{unit_file.path}: edits of ExecStart= overlap; refusing to guess")
        segments.append({"kind": "raw", "text": text[pos:start]})
        if edit is not None:
            segments.append(
                {"kind": edit.kind, "value": edit.value, "flag": edit.flag, "separator": edit.separator}
            )
        pos = end
    segments.append({"kind": "raw", "text": text[pos:]})
    new_text = render("unit.j2", segments=segments)
    env_edit = None if command.form in ("docker", "podman") else env_changes
    _verify_edit(unit_file, assignment, new_text, expected_words(command, ops), env_edit)
    if created:
        return UnitEdit(unit_file.path, "", new_text if new_text != text else "", existed=False)
    return UnitEdit(unit_file.path, text, new_text)


def _verify_edit(
    old: UnitFile,
    exec_start: Assignment,
    new_text: str,
    words: list[str],
    env_changes: Mapping[str, str | None] | None,
) -> None:
    """Belt and braces, for every edit: read the candidate back as systemd does."""
    new = UnitFile.parse(old.path, new_text)

    def others(unit_file: UnitFile, skip: Assignment | None) -> list[tuple[str, str, str]]:
        return [
            (a.section, a.key, unit_file.raw(a))
            for a in unit_file.assignments
            if a is not skip and not (a.section == "Service" and a.key == "Environment")
        ]

    ordinal = old.get_all("Service", "ExecStart").index(exec_start)
    new_exec_all = new.get_all("Service", "ExecStart")
    new_exec = new_exec_all[ordinal] if ordinal < len(new_exec_all) else None
    problem = ""
    if new_exec is None or others(new, new_exec) != others(old, exec_start):
        problem = "would change other directives"
    elif [old.text[s:e] for s, e in old.comments] != [new.text[s:e] for s, e in new.comments]:
        problem = "would move, delete or activate a comment line"
    elif _prefix(new_exec.value) != _prefix(exec_start.value):
        problem = "would change the ExecStart= prefix"
    elif [w.value for w in find_vllm_command(new_exec.value).words] != words:
        problem = "would not run the intended command"
    elif _after_separator(new_exec.value) != _after_separator(exec_start.value):
        problem = "would change the command after `;`"
    elif _file_environment(new) != _changed_env(_file_environment(old), env_changes):
        problem = "would not set the intended Environment="
    if problem:
        raise UnitError(f"{old.path}: refusing an edit that {problem}")


def _prefix(value: str) -> str:
    """The ExecStart= prefix characters (`-@:+!`) before the command."""
    return value[: len(value) - len(value.lstrip("-@:+!"))]


def _after_separator(value: str) -> list[str]:
    words = split_words(value)
    separator = next((i for i, w in enumerate(words) if w.separator), len(words))
    return [w.value for w in words[separator:]]


def _file_environment(unit_file: UnitFile) -> dict[str, str]:
    env: dict[str, str] = {}
    for a in unit_file.get_all("Service", "Environment"):
        if a.value == "":
            env.clear()
        for word in split_words(a.value):
            name, eq, val = word.value.partition("=")
            if eq:
                env[name] = val
    return env


def _changed_env(env: dict[str, str], changes: Mapping[str, str | None] | None) -> dict[str, str]:
    result = dict(env)
    for name, value in (changes or {}).items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = value.replace("%", "%%")
    return result


def _environment_edits(
    unit_file: UnitFile, exec_start: Assignment, env_changes: Mapping[str, str | None]
) -> list[Span]:
    edits: list[Span] = []
    pending = dict(env_changes)
    for a in unit_file.get_all("Service", "Environment"):
        for w in split_words(a.value):
            name = w.value.split("=", 1)[0]
            if name in pending:
                new = pending.pop(name)
                start, end = a.raw_span(w.start, w.end)
                if new is None:
                    edits.append((start, end, None))
                else:
                    edits.append((start, end, FlagEdit("env_item", new, flag=name)))
    # new variables go on their own Environment= line just before ExecStart=
    line_start = unit_file.text.rfind("\n", 0, exec_start.start) + 1
    for name, new in pending.items():
        if new is not None:
            edits.append((line_start, line_start, FlagEdit("environment", new, flag=name)))
    return edits


def unified_diff(old: str, new: str, path: str, secrets: Iterable[str] = ()) -> str:
    import difflib

    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a{path}", f"b{path}"))
    return mask(diff, secrets)
