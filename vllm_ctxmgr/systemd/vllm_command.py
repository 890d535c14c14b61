"""The vLLM command inside ExecStart=: its launch form and where vLLM's own arguments start.

The forms are `vllm serve`, `python -m vllm.entrypoints...` and `docker`/`podman run IMAGE`; for a
container this module also reads what the engine adds (its -e/--env-file environment, its volumes, the
host path of a path inside it) and whether Quadlet generated the unit. Its own module because this is
vLLM's and the container engines' grammar, not systemd's file format: the service layer asks it what
vLLM runs with, the editor which words to change.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.systemd.quoting import Word, exec_argv, split_words
from vllm_ctxmgr.systemd.unit_file import ENV_FILE_MAX_BYTES, ServiceUnit

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
