"""Unit files as systemd's config parser reads them, and a service's fragment merged with its drop-ins.

Its own module because everything else (finding the vLLM command, editing, the service layer) reads
units through it, and it knows nothing of vLLM: one place to hold against systemd's config_parse(),
service_verify() and exec_context_load_environment(). Hand-written because no INI reader parses as
systemd does (comment lines inside a continued value, a backslash continuation, `;` comments), and
the editor needs each value character's file offset to change a word in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.systemd.quoting import (
    ENV_NAME,
    WHITESPACE,
    parse_env_file,
    resolve_specifiers,
    split_words,
)

# EnvironmentFile= is read here, not by systemd: a FIFO or /dev/zero must not hang ctxmgr
ENV_FILE_MAX_BYTES = 1 << 20
# systemd's config_parse() reads lines of at most LONG_LINE_MAX bytes (a continued line included) and
# refuses the whole unit past it ("Line too long")
LONG_LINE_MAX = 1 << 20
# no unit file is near this; ctxmgr must not read a runaway file whole
UNIT_FILE_MAX_BYTES = 4 * LONG_LINE_MAX


@dataclass(frozen=True)
class Assignment:
    section: str
    key: str
    value: str  # the logical value systemd parses: continuations joined, comment lines inside them skipped
    start: int  # offset of the key in the file text
    value_start: int  # offset of the value's first character
    end: int  # offset just past the value's last character
    offsets: tuple[int, ...] = ()  # file offset of each character of `value`
    lines: tuple[tuple[int, int], ...] = ()  # (start, end) of each physical line that holds the value

    def raw_span(self, start: int, end: int) -> tuple[int, int]:
        """The file span of value[start:end]; UnitError where it crosses a line it does not own."""
        if end <= start:
            at = self.offsets[start] if start < len(self.offsets) else self.end
            return at, at
        first, last = self.offsets[start], self.offsets[end - 1] + 1
        if last - first != end - start:
            raise UnitError(f"{self.key}=: a word that spans a line continuation cannot be edited in place")
        return first, last


@dataclass
class UnitFile:
    path: Path
    text: str
    assignments: list[Assignment] = field(default_factory=list)
    comments: list[tuple[int, int]] = field(default_factory=list)  # spans of comment lines

    @classmethod
    def parse(cls, path: Path | str, text: str) -> UnitFile:
        """config_parse() of systemd 252: a line whose first non-blank character is `#` or `;` is a
        comment (never continued, even when it ends in a backslash); a line ending in an odd number of
        backslashes continues: that backslash becomes a space, comment lines after it are skipped and
        the next other line is joined (an empty line ends the value)."""
        unit = cls(Path(path), text)
        _check_loadable_text(path, text)
        section = ""
        lines: list[tuple[int, int]] = []  # (start, end without the newline), split on "\n" as systemd
        pos = 0
        for line in text.split("\n"):
            lines.append((pos, pos + len(line)))
            pos += len(line) + 1
        idx = 0
        while idx < len(lines):
            begin, stop = lines[idx]
            idx += 1
            if _is_comment(text[begin:stop]):
                unit.comments.append((begin, stop))
                continue
            chars = list(text[begin:stop])
            offsets = list(range(begin, stop))
            held = [(begin, stop)]
            while _ends_escaped(chars) and idx < len(lines):
                chars[-1] = " "
                while idx < len(lines) and _is_comment(text[slice(*lines[idx])]):
                    unit.comments.append(lines[idx])
                    idx += 1
                if idx >= len(lines):
                    break
                begin, stop = lines[idx]
                idx += 1
                chars += text[begin:stop]
                offsets += range(begin, stop)
                held.append((begin, stop))
            logical = "".join(chars)
            if len(held) > 1 and _utf8_len(logical) > LONG_LINE_MAX:
                line_no = text.count("\n", 0, held[0][0]) + 1
                raise UnitError(
                    f"{path}:{line_no}: a continued line longer than {LONG_LINE_MAX} bytes "
                    "(systemd refuses to load the unit)"
                )
            stripped = logical.strip(WHITESPACE)
            if not stripped:
                continue
            if stripped.startswith("["):
                if not stripped.endswith("]"):
                    raise UnitError(f"{path}: invalid section header {stripped!r}")
                section = stripped[1:-1]
                continue
            if "=" not in stripped:
                line_no = text.count("\n", 0, held[0][0]) + 1
                raise UnitError(f"{path}: line {line_no} is not KEY=VALUE")
            key_at = len(logical) - len(logical.lstrip(WHITESPACE))
            eq = logical.index("=")
            value_from = eq + 1
            while value_from < len(logical) and logical[value_from] in WHITESPACE:
                value_from += 1
            value_to = len(logical.rstrip(WHITESPACE))
            value_to = max(value_to, value_from)
            value_offsets = tuple(offsets[value_from:value_to])
            value_start = value_offsets[0] if value_offsets else offsets[eq] + 1
            unit.assignments.append(
                Assignment(
                    section,
                    logical[key_at:eq].strip(WHITESPACE),
                    logical[value_from:value_to],
                    offsets[key_at],
                    value_start,
                    value_offsets[-1] + 1 if value_offsets else value_start,
                    value_offsets,
                    tuple(held),
                )
            )
        return unit

    def get_all(self, section: str, key: str) -> list[Assignment]:
        return [a for a in self.assignments if a.section == section and a.key == key]

    def raw(self, assignment: Assignment) -> str:
        return self.text[assignment.start : assignment.end]


def _utf8_len(text: str) -> int:
    return len(text) if len(text) * 4 <= LONG_LINE_MAX else len(text.encode("utf-8", "surrogatepass"))


def _check_loadable_text(path: Path | str, text: str) -> None:
    """What makes systemd read a unit otherwise than ctxmgr would, or not at all: a NUL byte (systemd's
    read_line() ends the line there, so the rest of it becomes a line of its own) and a line longer than
    LONG_LINE_MAX. Refused with the file and line, before anything is planned from it."""
    nul = text.find("\0")
    if nul >= 0:
        line_no = text.count("\n", 0, nul) + 1
        raise UnitError(f"{path}:{line_no}: a NUL byte (systemd would read it as the end of the line)")
    for line_no, line in enumerate(text.split("\n"), start=1):
        if _utf8_len(line) > LONG_LINE_MAX:
            raise UnitError(
                f"{path}:{line_no}: a line longer than {LONG_LINE_MAX} bytes "
                "(systemd refuses to load the unit)"
            )


def _is_comment(line: str) -> bool:
    head = line.lstrip(WHITESPACE)
    return bool(head) and head[0] in "#;"


def _ends_escaped(chars: Sequence[str]) -> bool:
    escaped = False
    for ch in chars:
        escaped = not escaped if ch == "\\" else False
    return escaped


@dataclass(frozen=True)
class ServiceUnit:
    """A unit as systemd merges it: the fragment, then drop-ins in order."""

    name: str
    files: tuple[UnitFile, ...]

    @classmethod
    def load(
        cls, name: str, fragment: Path | str, dropins: Sequence[Path | str] = (), root: Path = Path("/")
    ) -> ServiceUnit:
        """Read the fragment and drop-ins as systemd would load them, refusing what it would refuse
        (plan --unit, plan --service and set-context all come here)."""
        files = []
        for path in [Path(fragment), *map(Path, dropins)]:
            text = _read_bounded(_host(path, root), path, "unit file", UNIT_FILE_MAX_BYTES)
            files.append(UnitFile.parse(path, text))
        unit = cls(name, tuple(files))
        unit.check_exec_start_count()
        return unit

    @classmethod
    def load_with_dropins(cls, path: Path | str, root: Path = Path("/")) -> ServiceUnit:
        """A unit file given by path, with its `NAME.d/*.conf` drop-ins beside it in name order (what
        `plan --unit FILE` reads; a unit systemd has loaded is read through read_service instead)."""
        fragment = Path(path)
        dropin_dir = _host(fragment.parent / f"{fragment.name}.d", root)
        dropins = sorted(
            (
                fragment.parent / f"{fragment.name}.d" / p.name
                for p in dropin_dir.glob("*.conf")
                if p.is_file()
            ),
            key=lambda p: p.name,
        )
        return cls.load(fragment.name, fragment, dropins, root)

    def exec_start(self) -> tuple[UnitFile, Assignment]:
        """The effective ExecStart= and the file that holds it (an empty ExecStart= resets the list)."""
        found: tuple[UnitFile, Assignment] | None = None
        for unit_file in self.files:
            for a in unit_file.get_all("Service", "ExecStart"):
                found = None if a.value.strip() == "" else (unit_file, a)
        if found is None:
            raise UnitError(f"{self.name}: no ExecStart= in [Service]")
        return found

    def check_exec_start_count(self) -> None:
        """service_verify() of systemd: more than one ExecStart= (after the resets an empty one makes)
        is refused unless Type=oneshot; ctxmgr would otherwise plan from one of two commands."""
        entries: list[tuple[UnitFile, Assignment]] = []
        service_type = "simple"
        for unit_file in self.files:
            for a in unit_file.assignments:
                if a.section != "Service":
                    continue
                if a.key == "ExecStart":
                    entries = [] if a.value.strip() == "" else [*entries, (unit_file, a)]
                elif a.key == "Type":
                    service_type = a.value.strip() or "simple"
        if len(entries) > 1 and service_type != "oneshot":
            unit_file, second = entries[1]
            line_no = unit_file.text.count("\n", 0, second.start) + 1
            raise UnitError(
                f"{unit_file.path}:{line_no}: a second ExecStart= in a Type={service_type} service "
                "(systemd refuses to load it: only Type=oneshot may have several)"
            )

    def service_values(self, key: str) -> list[str]:
        """A list setting across the fragment and drop-ins; an empty assignment resets it."""
        values: list[str] = []
        for unit_file in self.files:
            for a in unit_file.get_all("Service", key):
                if a.value == "":
                    values.clear()
                else:
                    values.append(a.value)
        return values

    def environment(self, root: Path = Path("/")) -> dict[str, str]:
        """The environment systemd gives the service from the unit (exec_context_load_environment and
        build_environment): Environment= assignments in order, then every EnvironmentFile= in order, which
        override them whatever the order of the lines, then UnsetEnvironment=. The manager's own
        variables (PATH, INVOCATION_ID, ...) are not included."""
        env: dict[str, str] = {}
        for value in self.service_values("Environment"):
            for word in split_words(value):
                name, eq, val = word.value.partition("=")
                if eq and ENV_NAME.fullmatch(name):
                    env[name] = resolve_specifiers(val)
        for value in self.service_values("EnvironmentFile"):
            env.update(read_environment_file(value, root))
        for value in self.service_values("UnsetEnvironment"):
            for word in split_words(value):
                name, eq, val = word.value.partition("=")
                if not eq:
                    env.pop(name, None)
                elif env.get(name) == val:
                    del env[name]
        return env


def _host(path: Path, root: Path) -> Path:
    return root / str(path).lstrip("/") if str(root) != "/" else path


def read_environment_file(value: str, root: Path = Path("/")) -> dict[str, str]:
    """One EnvironmentFile= value: `-` ignores a file that cannot be read, a wildcard reads every match
    in order. Only regular files of at most ENV_FILE_MAX_BYTES are read: systemd would block on a FIFO."""
    optional = value.startswith("-")
    spec = resolve_specifiers(value[1:] if optional else value)
    if not spec.startswith("/"):
        if optional:
            return {}
        raise UnitError(f"EnvironmentFile={value}: not an absolute path")
    if any(ch in spec for ch in "*?["):
        base = _host(Path("/"), root)
        paths = sorted(Path("/") / p.relative_to(base) for p in base.glob(spec.lstrip("/")))
        if not paths and not optional:
            raise UnitError(f"EnvironmentFile={value}: no file matches")
    else:
        paths = [Path(spec)]
    env: dict[str, str] = {}
    for path in paths:
        try:
            text = _read_bounded(_host(path, root), path)
        except UnitError:
            if optional and not files.exists(_host(path, root)):
                continue
            raise
        env.update(parse_env_file(text))
    return env


def _read_bounded(
    host: Path, path: Path, what: str = "EnvironmentFile", limit: int = ENV_FILE_MAX_BYTES
) -> str:
    """A regular file of at most `limit` bytes, as UTF-8 (vllm_ctxmgr.files: a FIFO or a device given
    as a file is refused instead of hanging ctxmgr or reading for ever)."""
    try:
        data = files.read_regular(host, limit, what=what, error=UnitError)
    except FileNotFoundError:
        raise UnitError(f"{what} {path}: no such file") from None
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UnitError(f"{what} {path} is not UTF-8 text") from None
