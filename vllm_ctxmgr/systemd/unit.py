"""Unit files: parse them as systemd does, find the vLLM command, and edit only what ctxmgr owns.

Edits are span-based: every byte ctxmgr does not own (comments, other directives, other
arguments, line continuations, `%` specifiers, `$VAR` references) is kept as it was. The
changed pieces are spliced in through `templates/unit.j2`, whose filters quote by systemd's rules.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.core.serve_args import canonical_flag
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.systemd.quoting import (
    ENV_NAME,
    WHITESPACE,
    Word,
    exec_argv,
    exec_word_value,
    parse_env_file,
    resolve_specifiers,
    split_words,
)
from vllm_ctxmgr.systemd.render import render

# ---------------------------------------------------------------------------------------------
# Unit files: assignments with their line spans, as systemd's config parser sees them.

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
            if optional and not _host(path, root).exists():
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
    expand_env: bool = True  # False under the `:` prefix: systemd substitutes no variables

    @property
    def args(self) -> list[str]:
        """The argument words as written (quotes undone; `%%`, `$$`, `$VAR` not yet resolved)."""
        return [w.value for w in self.words[self.args_start : self.args_end]]

    def argv(self, env: Mapping[str, str]) -> list[str]:
        """vLLM's arguments as systemd executes them: specifiers resolved, `$VAR` split into words,
        `${VAR}` substituted (service.environment() gives `env`)."""
        return exec_argv(self.words[self.args_start : self.args_end], env, self.expand_env)


def find_vllm_command(value: str) -> VllmCommand:
    words = split_words(value)
    expand = True
    if words and words[0].value[:1] in "-@:+!":
        # ExecStart prefixes (-, @, :, +, !, !!) belong to the first word
        stripped = words[0].value.lstrip("-@:+!")
        expand = ":" not in words[0].value[: len(words[0].value) - len(stripped)]
        words[0] = Word(stripped, words[0].start + len(words[0].value) - len(stripped), words[0].end)
    separator = next((i for i, w in enumerate(words) if w.separator), len(words))
    words = words[:separator]  # a second command after `;` is not vLLM's
    found = _vllm_bounds([w.value for w in words])
    if found is None:
        raise UnitError(
            "ExecStart= does not run vLLM "
            "(no `vllm serve`, `python -m vllm.entrypoints...` or vllm container)"
        )
    form, start = found
    return VllmCommand(form, tuple(words), start, len(words), expand)


def _vllm_bounds(vals: Sequence[str]) -> tuple[str, int] | None:
    """The launch form and the index of vLLM's first argument in an argv."""
    for i, v in enumerate(vals):
        base = os.path.basename(v)
        if base in ("docker", "podman"):
            run = i + 2 if i + 2 < len(vals) and vals[i + 1] == "container" else i + 1
            if run < len(vals) and vals[run] == "run":
                first = _container_vllm_args(list(vals), run + 1)
                if first is not None:
                    return base, first
        if base == "vllm" and i + 1 < len(vals) and vals[i + 1] == "serve":
            return "vllm serve", i + 2
        if v == "-m" and i + 1 < len(vals):
            if vals[i + 1] in _PYTHON_MODULES:
                return "python -m", i + 2
            if vals[i + 1] in _CLI_MODULES and i + 2 < len(vals) and vals[i + 2] == "serve":
                return "python -m", i + 3
    return None


def _command_bounds(cmd: Sequence[str]) -> int | None:
    """Where vLLM's arguments start in a container's command (`vllm serve ...`, `python3 -m
    vllm.entrypoints.openai.api_server ...`): the command itself, not a word somewhere inside it."""
    base = os.path.basename(cmd[0]) if cmd else ""
    if base == "vllm" and cmd[1:2] == ["serve"]:
        return 2
    if re.fullmatch(r"python[0-9.]*", base) and cmd[1:2] == ["-m"] and len(cmd) > 2:
        if cmd[2] in _PYTHON_MODULES:
            return 3
        if cmd[2] in _CLI_MODULES and cmd[3:4] == ["serve"]:
            return 4
    return None


def vllm_args_from_cmdline(cmdline: Sequence[str]) -> list[str] | None:
    """vLLM's arguments in a process's real argv (/proc/PID/cmdline: the interpreter of a `vllm` console
    script comes first), to compare with VllmCommand.argv; None when it does not run vLLM."""
    found = _vllm_bounds(cmdline)
    return None if found is None else list(cmdline[found[1] :])


# docker/podman run options that take a value (so the image is the first word that is not one)
_CONTAINER_VALUE_OPTS = {
    "-e", "--env", "-v", "--volume", "-p", "--publish", "--name", "--gpus", "--device", "--ipc",
    "--network", "--net", "--shm-size", "-w", "--workdir", "-u", "--user", "--runtime", "--env-file",
    "--mount", "--entrypoint", "--label", "-l", "--cpus", "--memory", "-m", "--ulimit", "--restart",
    "--pull", "--platform", "--hostname", "-h", "--security-opt", "--cap-add", "--cap-drop",
    "--log-driver", "--log-opt", "--add-host", "--group-add", "--cgroupns", "--pid", "--tmpfs",
    "--health-cmd", "--stop-timeout", "--stop-signal", "--annotation", "--cidfile", "--sdnotify",
    "--cgroups", "--pod", "--secret", "--userns", "--uidmap", "--gidmap", "--volumes-from",
    "--network-alias", "--ip", "--ip6", "--mac-address", "--dns", "--dns-search", "--dns-option",
    "--expose", "--label-file", "--cpu-shares", "-c", "--cpuset-cpus", "--cpuset-mems", "--memory-swap",
    "--memory-reservation", "--oom-score-adj", "--pids-limit", "--sysctl", "--systemd", "--timeout",
    "--health-interval", "--health-retries", "--health-start-period", "--health-timeout", "--attach",
    "-a", "--cpu-period", "--cpu-quota", "--device-cgroup-rule", "--uts", "--arch", "--os", "--variant",
    "--requires", "--umask", "--authfile", "--pidfile", "--tz", "--unsetenv", "--log-level",
    "--init-path", "--cgroup-parent", "--conmon-pidfile", "--image-volume",
    "--seccomp-policy", "--decryption-key", "--passwd-entry", "--group-entry", "--chrootdirs",
    "--preserve-fds", "--rdt-class", "--personality", "--blkio-weight", "--storage-opt",
}  # fmt: skip


def _container_image_index(vals: list[str], start: int) -> int | None:
    """The image: the first word after `run` that is neither an option nor an option's value."""
    i = start
    while i < len(vals):
        v = vals[i]
        if v.startswith("-"):
            i += 1 if ("=" in v or v not in _CONTAINER_VALUE_OPTS) else 2
            continue
        return i
    return None


def _container_vllm_args(vals: list[str], start: int) -> int | None:
    """The index of vLLM's first argument in `docker run [OPTIONS] IMAGE [COMMAND...]`.

    Any image whose command (the words after it, after `--entrypoint X` where given) is `vllm serve` or
    `python3 -m vllm.entrypoints.openai.api_server`; else an image whose name says vllm (the official
    vllm/vllm-openai from any registry or mirror, or a build FROM it), whose entrypoint is vLLM's
    server, so the words after it are vLLM's arguments."""
    image = _container_image_index(vals, start)
    if image is None:
        return None
    cmd = vals[image + 1 :]
    entrypoint = _container_option(vals[start:image], "--entrypoint")
    if entrypoint:
        found = _command_bounds([*entrypoint[-1].split(), *cmd])
        return None if found is None else image + 1 + found - len(entrypoint[-1].split())
    found = _command_bounds(cmd)
    if found is not None:
        return image + 1 + found
    return image + 1 if is_vllm_image(vals[image]) else None


def is_vllm_image(image: str) -> bool:
    """An image name (any registry prefix, tag or digest) that says vllm."""
    return "vllm" in image_repository(image).lower()


def image_repository(image: str) -> str:
    """`docker.io/vllm/vllm-openai:v0.11.0@sha256:...` -> `docker.io/vllm/vllm-openai`."""
    name = image.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def image_tag(image: str) -> str | None:
    name = image.split("@", 1)[0]
    last = name.rpartition("/")[2]
    return last.split(":", 1)[1] if ":" in last else None


def _container_option(vals: Sequence[str], *names: str) -> list[str]:
    """Every value of a docker/podman option (`-v X`, `--volume X`, `--volume=X`), in order."""
    found: list[str] = []
    i = 0
    while i < len(vals):
        v = vals[i]
        if v in names and i + 1 < len(vals):
            found.append(vals[i + 1])
            i += 2
            continue
        flag, eq, value = v.partition("=")
        if eq and flag in names and flag.startswith("--"):
            found.append(value)
        i += 1
    return found


def _run_options(command: VllmCommand) -> list[str]:
    """The option words of `docker run` (between `run` and the image)."""
    vals = [w.value for w in command.words[: command.args_start]]
    run = next((i for i, v in enumerate(vals) if v == "run"), 0)
    image = _container_image_index(vals, run + 1)
    return vals[run + 1 : image if image is not None else len(vals)]


def _container_env_options(command: VllmCommand) -> list[tuple[str, str]]:
    """("env", VALUE) and ("env-file", PATH) of `docker/podman run`, in order: `-e X`, `-eX` (a short
    option with its value joined, as the engines' flag parsers take it), `--env X`, `--env=X`,
    `--env-file F`, `--env-file=F`."""
    found: list[tuple[str, str]] = []
    options = _run_options(command)
    i = 0
    while i < len(options):
        word = options[i]
        following = options[i + 1] if i + 1 < len(options) else None
        if word in ("-e", "--env", "--env-file") and following is not None:
            found.append(("env-file" if word == "--env-file" else "env", following))
            i += 2
            continue
        if word.startswith(("--env=", "--env-file=")):
            flag, _, value = word.partition("=")
            found.append(("env-file" if flag == "--env-file" else "env", value))
        elif word.startswith("-e") and not word.startswith("--") and len(word) > 2:
            found.append(("env", word[2:].removeprefix("=")))
        i += 1
    return found


def container_env_words(command: VllmCommand) -> list[str]:
    """Every `-e` value as written (`NAME=VALUE` or a bare `NAME`), overridden ones too: each is a
    secret to mask where it assigns VLLM_API_KEY, whichever one the container ends up with."""
    if command.form not in ("docker", "podman"):
        return []
    return [value for kind, value in _container_env_options(command) if kind == "env"]


def _docker_env_file(path: str, caller: Mapping[str, str], root: Path) -> list[tuple[str, str | None]]:
    """docker's --env-file format (opts.ParseEnvFile): one NAME=VALUE a line, the value as written (no
    quotes removed), `#` lines and blank lines skipped, a bare NAME taken from the caller's environment."""
    host = root / path.lstrip("/") if str(root) != "/" else Path(path)
    try:
        data = files.read_regular(host, ENV_FILE_MAX_BYTES, what="container --env-file", error=UnitError)
    except FileNotFoundError:
        raise UnitError(
            f"--env-file {path}: no such file (docker would refuse to start the container)"
        ) from None
    out: list[tuple[str, str | None]] = []
    for line in data.decode(errors="replace").splitlines():
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.partition("=")
        out.append((name, value) if eq else (name.rstrip(), caller.get(name.rstrip())))
    return out


def container_environment(
    command: VllmCommand, caller: Mapping[str, str] | None = None, root: Path = Path("/")
) -> dict[str, str]:
    """The environment the container's process (vLLM) gets from the command, as docker and podman
    build it: every --env-file first, then every -e/--env (the later of two wins); a bare `-e NAME`
    (or a bare NAME in an env file) passes the caller's value (the unit's environment, which systemd
    gives the engine's client), and is absent where the caller has none; podman's --env-host starts
    from the caller's whole environment. The image's own ENV is unknown here and left out."""
    if command.form not in ("docker", "podman"):
        return {}
    caller = caller or {}
    options = _container_env_options(command)
    env: dict[str, str] = dict(caller) if "--env-host" in _run_options(command) else {}
    pairs: list[tuple[str, str | None]] = []
    for kind, value in options:
        if kind == "env-file":
            pairs += _docker_env_file(value, caller, root)
    for kind, value in options:
        if kind == "env":
            name, eq, val = value.partition("=")
            pairs.append((name, val) if eq else (name, caller.get(name)))
    for name, val in pairs:
        if val is None:
            env.pop(name, None)
        else:
            env[name] = val
    return env


def container_image_index(command: VllmCommand) -> int | None:
    """The index of the image among the command's words (vLLM's arguments may start later)."""
    if command.form not in ("docker", "podman"):
        return None
    vals = [w.value for w in command.words]
    run = next((i for i, v in enumerate(vals) if v == "run"), 0)
    return _container_image_index(vals, run + 1)


def container_image(command: VllmCommand) -> str | None:
    image = container_image_index(command)
    return None if image is None else command.words[image].value


def container_workdir(command: VllmCommand) -> str | None:
    found = _container_option(_run_options(command), "-w", "--workdir")
    return found[-1] if found else None


@dataclass(frozen=True)
class ContainerVolume:
    """A host path (or a named volume) the container sees at `target`."""

    source: str  # an absolute host path, or a named volume's name ("" for a tmpfs)
    target: str
    read_only: bool = False
    tmpfs: bool = False  # `--tmpfs DST` / `--mount type=tmpfs`: empty at each start, on no host path

    @property
    def named(self) -> bool:
        return not self.tmpfs and not self.source.startswith("/")


def container_volumes(command: VllmCommand, home: str = "/root") -> list[ContainerVolume]:
    """`-v SRC:DST[:OPTS]`, `--volume`, `--mount type=bind,source=..,target=..[,readonly]` of a
    docker/podman command. A leading `~` is the home of the unit's user (`home`): docker does not
    expand it, but a unit copied from a shell line has it; a bare `-v /dst` is an anonymous volume."""
    if command.form not in ("docker", "podman"):
        return []
    options = _run_options(command)
    volumes: list[ContainerVolume] = []
    for spec in _container_option(options, "-v", "--volume"):
        parts = spec.split(":")
        if len(parts) < 2:
            continue
        source, target = parts[0], parts[1]
        flags = parts[2].split(",") if len(parts) > 2 else []
        volumes.append(ContainerVolume(_expand_home(source, home), target, "ro" in flags))
    for spec in _container_option(options, "--mount"):
        fields: dict[str, str] = {}
        for item in spec.split(","):
            key, eq, value = item.partition("=")
            fields[key.strip()] = value if eq else "true"
        target = fields.get("target") or fields.get("destination") or fields.get("dst")
        source = fields.get("source") or fields.get("src")
        kind = fields.get("type", "volume")
        if kind == "tmpfs" and target:
            volumes.append(ContainerVolume("", target, tmpfs=True))
            continue
        if not target or not source or kind not in ("bind", "volume"):
            continue
        read_only = any(fields.get(k, "false") in ("true", "1") for k in ("readonly", "ro"))
        source = _expand_home(source, home) if kind == "bind" else source
        volumes.append(ContainerVolume(source, target, read_only))
    for spec in _container_option(options, "--tmpfs"):
        volumes.append(ContainerVolume("", spec.split(":", 1)[0], tmpfs=True))
    return volumes


def _expand_home(source: str, home: str) -> str:
    if source == "~" or source.startswith("~/"):
        return home.rstrip("/") + source[1:]
    return source


MAX_SYMLINKS = 40  # the kernel's own limit on links followed in one lookup (ELOOP)


def _covering(path: str, volumes: Sequence[ContainerVolume]) -> ContainerVolume | None:
    """The mount the container sees at `path` (a normalised absolute path): the one with the longest
    target holding it (docker mounts parents before children), the later of two on one target."""
    best: ContainerVolume | None = None
    for volume in volumes:
        target = posixpath.normpath(volume.target) if volume.target.startswith("/") else None
        if target is None:
            continue
        inside = target == "/" or path == target or path.startswith(target + "/")
        if inside and (best is None or len(target) >= len(posixpath.normpath(best.target))):
            best = volume
    return best


def _on_host(path: str, volume: ContainerVolume) -> str:
    target = posixpath.normpath(volume.target)
    rest = path[len(target) :] if target != "/" else path
    return (volume.source.rstrip("/") + rest) or "/"


def host_path(path: str, volumes: Sequence[ContainerVolume], root: Path = Path("/")) -> str | None:
    """The host path of a container path, resolved as the container's kernel resolves it: `.` and
    `..` walk the container's tree, each symbolic link met under a bind mount is read on the host
    (below `root`) and followed in the container's view (an absolute link from the container's `/`,
    a relative one from its directory), and the mount at each step is the one the container sees
    there (the longest target, a later mount shadowing an earlier one, a tmpfs hiding what is under
    it). None where the path ends outside every volume (in the image, or escaped from its volume);
    UnitError where it lies in a tmpfs or a named volume, which ctxmgr cannot read from the host."""
    pending = [part for part in path.split("/") if part]
    resolved = "/"
    links = 0
    unseen = False  # the walk went through a name no host path shows (the image, a tmpfs, a named volume)
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if unseen:
                return None  # `..` out of a directory ctxmgr cannot see: it may not even exist there
            resolved = posixpath.dirname(resolved) or "/"
            continue
        candidate = posixpath.join(resolved, part)
        volume = _covering(candidate, volumes)
        if volume is None or volume.tmpfs or volume.named:
            resolved, unseen = candidate, True  # no link is read where no host path holds it
            continue
        on_host = _on_host(candidate, volume)
        host = root / on_host.lstrip("/") if str(root) != "/" else Path(on_host)
        try:
            target = os.readlink(host)
        except OSError:  # not a link: the container sees the same name
            not_a_dir = host.exists() and not host.is_dir()
            if pending and (not_a_dir or (".." in pending and not host.exists())):
                return None  # the kernel stops at a file with a name after it, or a missing one before `..`
            resolved = candidate
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise UnitError(f"{path}: too many symbolic links inside the container (a loop?)")
        pending = [p for p in target.split("/") if p] + pending
        if target.startswith("/"):
            resolved = "/"
    volume = _covering(resolved, volumes)
    if volume is None:
        return None
    if volume.tmpfs:
        raise UnitError(
            f"{path} is on the container's tmpfs at {volume.target} (--tmpfs): empty at each start, "
            "so vLLM finds nothing there and ctxmgr has nothing to read"
        )
    if volume.named:
        raise UnitError(
            f"{path} is in the container's named volume {volume.source!r}: give the model as a bind "
            "mount (-v /host/path:/container/path) so ctxmgr can read it"
        )
    return _on_host(resolved, volume)


def quadlet_source(unit: ServiceUnit) -> str | None:
    """The Quadlet file (`.container`, ...) a unit was generated from, where it was: podman's generator
    writes `SourcePath=` into [Unit] and keeps the source's sections as `[X-Container]` etc."""
    fragment = unit.files[0]
    for a in fragment.get_all("Unit", "SourcePath"):
        if a.value.endswith((".container", ".kube", ".pod", ".network", ".volume", ".image", ".build")):
            return a.value
    if any(a.section.startswith("X-Container") for a in fragment.assignments):
        found = fragment.get_all("Unit", "SourcePath")
        return found[-1].value if found else f"the .container file behind {unit.name}"
    return None


# ---------------------------------------------------------------------------------------------
# Editing: word-level changes, spliced into the raw text, then read back as systemd reads it.


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
    """Replace a flag's value, delete a flag (and its value), or append a missing flag."""
    ops: list[WordOp] = []
    words = command.words
    done: set[str] = set()
    i = command.args_start
    while i < command.args_end:
        w = words[i]
        flag = canonical_flag(w.value) if w.value.startswith("-") else None
        if flag in changes:
            new = changes[flag]
            inline = "=" in w.value
            has_value = not inline and i + 1 < command.args_end
            if new is None or flag in done:
                ops.append(WordOp(i, "delete"))
                if has_value:
                    ops.append(WordOp(i + 1, "delete"))
            elif inline:
                ops.append(WordOp(i, "replace", (f"{w.value.split('=', 1)[0]}={new}",)))
            elif not has_value:
                ops.append(WordOp(i, "after", (new,)))
            else:
                ops.append(WordOp(i + 1, "replace", (new,)))
            done.add(flag)
            i += 1 if inline else 2
            continue
        i += 1
    missing = [(f, v) for f, v in changes.items() if v is not None and f not in done]
    if missing:
        deleted = {op.index for op in ops if op.action == "delete"}
        last = max((j for j in range(command.args_end) if j not in deleted), default=0)
        ops.append(WordOp(last, "after", tuple(word for flag, new in missing for word in (flag, new))))
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
    if dropin_dir is not None and unit.exec_start()[0] is unit.files[0]:
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
