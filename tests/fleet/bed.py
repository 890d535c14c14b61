"""A fleet from real parts: N vLLM hosts behind HAProxy, each in its own network namespace.

    client netns  (br0 10.249.0.1/24: HAProxy :8080 + its runtime socket, the Ansible controller, the load)
       | veth v1..vN on br0
    host netns hK (eth0 10.249.0.1K/24)  - a private systemd (tests.support.sandbox) that runs
                                           sshd-fleet.service (real OpenSSH) and the vLLM unit (the stand-in)

Nothing is created in the host's own network namespace: the bridge and every veth live in the
namespaces made here, which have no route out and forwarding off, so these addresses exist only inside.
Everything is torn down by PID (HAProxy, each sandbox's systemd) and by namespace name.

    python -m tests.fleet.bed up DIR      boots a bed and prints its description (JSON); `down DIR` ends it
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.demo import GLM5_CONFIG_DIR, REPO_ROOT, make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.sandbox import Sandbox, sandbox_available

SUBNET = "10.249.0"  # only ever inside the namespaces made here
CLIENT_ADDRESS = f"{SUBNET}.1"
LB_PORT = 8080
VLLM_PORT = 8000
NETNS_PREFIX = "ctxf-"  # ctxf-<creator pid>-<tag>-<role>
SERVICE = "vllm-fleet"
BACKEND = "vllm"
# the oldest and the newest ansible-core the collection claims (meta/runtime.yml: >=2.15; 2.19 is the
# newest release), each in the venv `make fleet-deps` makes; `make test ANSIBLE_VERSIONS="2.15 2.17
# 2.19"` passes its list here (oldest first, newest last)
ANSIBLE_VERSIONS = tuple(os.environ.get("CTXMGR_ANSIBLE_VERSIONS", "").split()) or ("2.15", "2.19")
COLLECTION_DIR = REPO_ROOT / "ansible_collections" / "vllm" / "ctxmgr"
BASELINE_CONTEXT = 8192
# The stand-in's start takes ~5 s x this: long enough that a plain restart loses requests, short for CI.
DEFAULT_TIME_SCALE = 0.5
# 30 streamed tokens of 50 ms: a 1.5 s completion, as in the measurements the issue reports
TOKEN_DELAY_S = 0.05


class BedError(RuntimeError):
    """The fleet bed could not be built or reached."""


def ansible_venv(version: str = ANSIBLE_VERSIONS[-1]) -> Path:
    """The venv `make fleet-deps` installs ansible-core `version` (X.Y, its newest patch) into."""
    return REPO_ROOT / f".venv-ansible-{version}"


def hosts_available() -> str | None:
    """Why hosts in namespaces, each a private systemd with a real sshd, cannot run here, or None."""
    reason = sandbox_available()
    if reason:
        return reason
    for tool in ("ip", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make fleet-deps)"
    if not Path("/usr/sbin/sshd").exists():
        return "/usr/sbin/sshd is not installed (make fleet-deps)"
    return None


def fleet_available(venv: Path | None = None) -> str | None:
    """Why a fleet bed cannot run here (with the ansible-core of `venv`, default the newest), or None."""
    venv = venv or ansible_venv()
    reason = hosts_available()
    if reason:
        return reason
    if not Path("/usr/sbin/haproxy").exists():
        return "/usr/sbin/haproxy is not installed (make fleet-deps)"
    if not (venv / "bin" / "ansible-playbook").exists():
        return f"no ansible-core venv at {venv} (make fleet-deps)"
    return None


def _run(
    *argv: str, check: bool = True, timeout: float = 30.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and result.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {(result.stderr or result.stdout).strip() or result.returncode}")
    return result


def in_netns(netns: str, *argv: str) -> list[str]:
    """argv run inside a network namespace only (mounts and PIDs stay the caller's)."""
    return ["nsenter", f"--net=/run/netns/{netns}", *argv]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_namespaces() -> list[str]:
    """Delete the namespaces of beds whose creator is gone (a killed run); returns their names."""
    removed = []
    for name in _run("ip", "netns", "list").stdout.split():
        match = re.fullmatch(rf"{NETNS_PREFIX}(\d+)-[0-9a-f]+-\w+", name)
        if match and not _alive(int(match.group(1))):
            _run("ip", "netns", "delete", name, check=False)
            removed.append(name)
    return removed


@dataclass
class FleetHost:
    name: str  # h1, h2, ... (also HAProxy's server name)
    address: str
    netns: str
    directory: Path
    sandbox: Sandbox | None = None

    @property
    def state_dir(self) -> Path:
        return self.directory / "ctxmgr-state"

    @property
    def unit_path(self) -> Path:
        """The vLLM unit as the host's systemd reads it (its private /run), seen from here."""
        assert self.sandbox is not None
        return self.sandbox.root / "run" / "systemd" / "system" / f"{SERVICE}.service"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{VLLM_PORT}"

    @property
    def env_file(self) -> Path:
        """The vLLM unit's optional EnvironmentFile: what a test writes here breaks the next start
        whatever unit ctxmgr installs (a rollback too), as a host's own drift would."""
        return self.directory / "vllm.env"

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.sandbox is not None
        return self.sandbox.run("systemctl", *args, check=check)


@dataclass
class FleetBed:
    """Build with FleetBed.up(directory); end with down() (also on any failure while building)."""

    directory: Path
    hosts: list[FleetHost] = field(default_factory=list)
    tag: str = ""
    haproxy: subprocess.Popen[bytes] | None = None
    namespaces: list[str] = field(default_factory=list)
    ansible_venv: Path = field(default_factory=ansible_venv)
    # the hosts HAProxy sends requests to, by name (empty: every host); a multi-node deployment's
    # headless nodes serve no HTTP and are no backend
    backends: list[str] = field(default_factory=list)
    # each host's vLLM main PID as the bed last started it (boot or reset): reset() restarts a host
    # only where something else restarted or changed it since
    _started: dict[str, str] = field(default_factory=dict)

    @property
    def lb_hosts(self) -> list[FleetHost]:
        return [h for h in self.hosts if not self.backends or h.name in self.backends]

    # ---- names and paths -----------------------------------------------------------------------

    @property
    def client_netns(self) -> str:
        return f"{NETNS_PREFIX}{os.getpid()}-{self.tag}-c"

    @property
    def haproxy_socket(self) -> Path:
        return self.directory / "haproxy.sock"

    @property
    def lb_url(self) -> str:
        return f"http://{CLIENT_ADDRESS}:{LB_PORT}"

    @property
    def inventory(self) -> Path:
        return self.directory / "inventory.ini"

    @property
    def ctxmgr_bin(self) -> Path:
        return self.directory / "bin" / "ctxmgr"

    # ---- bring-up ------------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        directory: Path,
        count: int = 3,
        time_scale: float = DEFAULT_TIME_SCALE,
        host_environment: dict[str, dict[str, str]] | None = None,
        venv: Path | None = None,
    ) -> FleetBed:
        venv = venv or ansible_venv()
        reason = fleet_available(venv)
        if reason:
            raise BedError(f"cannot build a fleet bed: {reason}")
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        # HAProxy's runtime socket lives here: a unix socket path must fit in 108 bytes
        if len(str(directory / "haproxy.sock")) > 100:
            raise BedError(f"{directory} is too long a path for a unix socket")
        sweep_stale_namespaces()
        bed = cls(directory=directory, tag=secrets.token_hex(2), ansible_venv=venv)
        try:
            bed._network(count)
            bed._keys()
            bed._ctxmgr_wrapper()
            for host in bed.hosts:
                bed._boot(host, time_scale, (host_environment or {}).get(host.name, {}))
            bed._haproxy()
            bed._ansible_files()
            bed.wait_all_up(timeout=60)
        except BaseException:
            bed.down()
            raise
        return bed

    def _network(self, count: int) -> None:
        client = self.client_netns
        self._netns_add(client)
        ip = ("ip", "-n", client)
        _run(*ip, "link", "set", "lo", "up")
        _run(*ip, "link", "add", "br0", "type", "bridge")
        _run(*ip, "addr", "add", f"{CLIENT_ADDRESS}/24", "dev", "br0")
        _run(*ip, "link", "set", "br0", "up")
        for index in range(1, count + 1):
            name = f"h{index}"
            netns = f"{NETNS_PREFIX}{os.getpid()}-{self.tag}-{name}"
            self._netns_add(netns)
            # the veth is made inside the client namespace and its peer moved straight into the host's
            _run(*ip, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0", "netns", netns)
            _run(*ip, "link", "set", f"v{index}", "master", "br0", "up")
            address = f"{SUBNET}.{10 + index}"
            _run("ip", "-n", netns, "link", "set", "lo", "up")
            _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", netns, "link", "set", "eth0", "up")
            host_dir = self.directory / name
            host_dir.mkdir(exist_ok=True)
            self.hosts.append(FleetHost(name, address, netns, host_dir))

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        # forwarding off: nothing is routed through these namespaces (the default, made explicit)
        _run(*in_netns(name, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_forward"))

    def _keys(self) -> None:
        ssh = self.directory / "ssh"
        ssh.mkdir(exist_ok=True)
        key = ssh / "id_ed25519"
        if not key.exists():
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ctxmgr-fleet", "-f", str(key))
        (ssh / "authorized_keys").write_text((ssh / "id_ed25519.pub").read_text())
        known = []
        for host in self.hosts:
            host_key = host.directory / "ssh_host_ed25519_key"
            if not host_key.exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(host_key))
            key_type, key_text = Path(f"{host_key}.pub").read_text().split()[:2]
            known.append(f"{host.address} {key_type} {key_text}")
        (ssh / "known_hosts").write_text("\n".join(known) + "\n")

    def _ctxmgr_wrapper(self) -> None:
        """The `ctxmgr` the module runs on each host: the installed wheel's where CTXMGR_BIN names it
        (make test and CI, as tests/ctxmgr_cli.py), else this checkout's with the dev venv's Python."""
        self.ctxmgr_bin.parent.mkdir(exist_ok=True)
        installed = os.environ.get("CTXMGR_BIN")
        # over ssh, each host's own state directory unless the caller names one (sshd_config's
        # SetEnv): a multi-node head runs the same `ctxmgr` on every node, and in the bed each host
        # keeps its state in a directory of its own
        state = '${CTXMGR_BED_STATE_DIR:+--state-dir "$CTXMGR_BED_STATE_DIR"}'
        if installed:
            command = f'exec {Path(installed).resolve()} {state} "$@"'
        else:
            command = f'PYTHONPATH={REPO_ROOT} exec {sys.executable} -m vllm_ctxmgr {state} "$@"'
        self.ctxmgr_bin.write_text(f"#!/bin/sh\n{command}\n")
        self.ctxmgr_bin.chmod(0o755)

    def _boot(self, host: FleetHost, time_scale: float, environment: dict[str, str]) -> None:
        self.boot_ssh_host(host)
        self.install_vllm(host, BASELINE_CONTEXT, time_scale, environment)
        host.systemctl("daemon-reload")
        host.systemctl("start", f"{SERVICE}.service")
        self._started[host.name] = self._main_pid(host)

    def boot_ssh_host(self, host: FleetHost) -> None:
        """The host's private systemd, in its namespace, running its real sshd (no vLLM unit yet)."""
        host.sandbox = Sandbox.start(netns=host.netns)
        config = host.directory / "sshd_config"
        config.write_text(
            f"""# sshd of fleet host {host.name}: a unit of its private systemd, keys from the test
ListenAddress {host.address}
Port 22
HostKey {host.directory / "ssh_host_ed25519_key"}
AuthorizedKeysFile {self.directory / "ssh" / "authorized_keys"}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
PidFile /run/sshd-fleet.pid
SetEnv CTXMGR_BED_STATE_DIR={host.state_dir}
Subsystem sftp internal-sftp
"""
        )
        unit_dir = host.sandbox.root / "run" / "systemd" / "system"
        (unit_dir / "sshd-fleet.service").write_text(
            f"""[Unit]
Description=OpenSSH server of fleet host {host.name}

[Service]
ExecStartPre=/usr/sbin/sshd -t -f {config}
ExecStart=/usr/sbin/sshd -D -e -f {config}
RuntimeDirectory=sshd
Restart=on-failure
"""
        )
        host.state_dir.mkdir(exist_ok=True)
        host.systemctl("daemon-reload")
        host.systemctl("start", "sshd-fleet.service")

    def vllm_unit_text(
        self, host: FleetHost, context: int, time_scale: float, environment: dict[str, str]
    ) -> str:
        wrapper = make_vllm_wrapper(self.directory)
        text = standin_unit(
            wrapper,
            port=VLLM_PORT,
            max_model_len=context,
            model=GLM5_CONFIG_DIR,
            environment={
                "CTXMGR_STANDIN_TIME_SCALE": str(time_scale),
                "CTXMGR_STANDIN_TOKEN_DELAY_S": str(TOKEN_DELAY_S),
                **environment,
            },
            description=f"vLLM OpenAI server: GLM-5 (stand-in, TP=8) on fleet host {host.name}",
        )
        # vLLM listens on the host's own address, where HAProxy reaches it
        assert "--host 127.0.0.1" in text and "\nType=simple\n" in text
        text = text.replace("\nType=simple\n", f"\nType=simple\nEnvironmentFile=-{host.env_file}\n")
        return text.replace("--host 127.0.0.1", f"--host {host.address}")

    def install_vllm(
        self, host: FleetHost, context: int, time_scale: float, environment: dict[str, str]
    ) -> None:
        """Write the host's vLLM unit and forget ctxmgr's state: a fresh baseline."""
        host.unit_path.write_text(self.vllm_unit_text(host, context, time_scale, environment))
        host.env_file.unlink(missing_ok=True)
        shutil.rmtree(host.state_dir, ignore_errors=True)
        host.state_dir.mkdir()

    def command_lb(self, faults: Path | None = None) -> dict[str, Any]:
        """Extra vars for the role's `rolling_context_lb: command`, driving this bed's HAProxy through
        tests/fleet/lbctl.py (with FILE's injected failures)."""
        script = REPO_ROOT / "tests" / "fleet" / "lbctl.py"
        lbctl = [sys.executable, str(script), str(self.haproxy_socket), BACKEND]
        tail = f" --faults {faults}" if faults else ""

        def step(name: str) -> str:
            return " ".join([*lbctl, "{{ lb_server }}", name]) + tail

        return {
            "rolling_context_lb": "command",
            "rolling_context_lb_drain_cmd": step("drain"),
            "rolling_context_lb_wait_idle_cmd": step("idle"),
            "rolling_context_lb_undrain_cmd": step("undrain"),
            "rolling_context_lb_wait_up_cmd": step("up"),
        }

    def reset(
        self,
        context: int = BASELINE_CONTEXT,
        time_scale: float = DEFAULT_TIME_SCALE,
        host_environment: dict[str, dict[str, str]] | None = None,
    ) -> None:
        """Every host back to a baseline unit at `context`, serving and UP in HAProxy, ctxmgr's state
        forgotten. A host still running the vLLM the bed itself last started, from these very unit
        bytes and with no EnvironmentFile, is left running (a restart would give it the same start:
        the same unit, the same journal's last start); every other host is restarted."""
        restarted = []
        for host in self.hosts:
            host.systemctl("start", "sshd-fleet.service")  # a test may have made it unreachable
            text = self.vllm_unit_text(host, context, time_scale, (host_environment or {}).get(host.name, {}))
            if self._runs_the_beds_start(host, text):
                shutil.rmtree(host.state_dir, ignore_errors=True)
                host.state_dir.mkdir()
                continue
            self.install_vllm(host, context, time_scale, (host_environment or {}).get(host.name, {}))
            host.systemctl("daemon-reload")
            host.systemctl("reset-failed", f"{SERVICE}.service", check=False)
            host.systemctl("restart", f"{SERVICE}.service")
            self._started[host.name] = self._main_pid(host)
            restarted.append(host.name)
        for host in self.hosts:
            self.runtime().set_state(BACKEND, host.name, "ready")
        self._wait_restart_seen(restarted)
        self.wait_all_up(timeout=60)

    def _wait_restart_seen(self, names: list[str], timeout: float = 5.0) -> None:
        """`systemctl restart` of the stand-in returns before it serves again, while HAProxy still shows
        the old process's UP until a health check fails (300 ms apart): waiting for UP right after the
        restart returned at once, and the next test's load met a host that refused or hung (run 8 of
        CI: 6 requests lost in two tests). Wait until HAProxy has seen each restarted host go (a
        status other than UP); a host back before any check failed is serving already."""
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending and time.monotonic() < deadline:
            rows = self.runtime().servers(BACKEND)
            pending -= {server for (_, server), row in rows.items() if row.get("status") != "UP"}
            time.sleep(0.05)

    def _main_pid(self, host: FleetHost) -> str:
        return host.systemctl("show", "-p", "MainPID", "--value", f"{SERVICE}.service").stdout.strip()

    def _runs_the_beds_start(self, host: FleetHost, unit_text: str) -> bool:
        """The host's vLLM is the process the bed started last (same main PID: nothing restarted it
        since), active, from `unit_text`, with no EnvironmentFile a test wrote."""
        started = self._started.get(host.name)
        if not started or started == "0" or host.env_file.exists():
            return False
        if not host.unit_path.exists() or host.unit_path.read_text() != unit_text:
            return False
        state = host.systemctl("is-active", f"{SERVICE}.service", check=False).stdout.strip()
        return state == "active" and self._main_pid(host) == started

    def _haproxy(self) -> None:
        config = self.directory / "haproxy.cfg"
        servers = "\n".join(
            f"    server {host.name} {host.address}:{VLLM_PORT} check" for host in self.lb_hosts
        )
        config.write_text(
            f"""# HAProxy in front of the fleet (runs in the client namespace; no retries or redispatch: the
# roll-out's drain discipline alone has to lose nothing)
global
    stats socket {self.haproxy_socket} mode 600 level admin
    maxconn 2000

defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 0

frontend vllm_front
    bind {CLIENT_ADDRESS}:{LB_PORT}
    default_backend {BACKEND}

backend {BACKEND}
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    http-response set-header X-Served-By %s
    # fall 4 at 300 ms: a host that stopped is out within ~1.2 s, but a 2-core machine that stalls
    # the health check for a second (CI's, under load) does not mark a healthy host down
    default-server inter 300ms fall 4 rise 2
{servers}
"""
        )
        _run("/usr/sbin/haproxy", "-c", "-q", "-f", str(config))
        self.haproxy_socket.unlink(missing_ok=True)  # one a killed run left would look like HAProxy's
        log = (self.directory / "haproxy.log").open("wb")
        tie = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        self.haproxy = subprocess.Popen(
            [*tie, *in_netns(self.client_netns, "/usr/sbin/haproxy", "-db", "-f", str(config))],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not self.haproxy_socket.exists():
            if self.haproxy.poll() is not None or time.monotonic() > deadline:
                raise BedError(
                    f"HAProxy did not start: {(self.directory / 'haproxy.log').read_text()[-500:]}"
                )
            time.sleep(0.05)

    def runtime(self) -> Any:
        from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import Runtime

        return Runtime(str(self.haproxy_socket))

    def wait_all_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for host in self.lb_hosts:
            self.runtime().wait(BACKEND, host.name, "up", max(0.1, deadline - time.monotonic()))

    def _ansible_files(
        self,
        group: str = "vllm",
        host_vars: dict[str, dict[str, Any]] | None = None,
        group_vars: dict[str, Any] | None = None,
    ) -> None:
        """The inventory and ansible.cfg: `group` holds every host, or those named in `host_vars` (each
        with its own extra vars); `group_vars` add to or replace the bed's own."""
        ssh = self.directory / "ssh"
        lines = [f"[{group}]"]
        for host in self.hosts:
            if host_vars is not None and host.name not in host_vars:
                continue
            extra = "".join(
                f" {key}='{json.dumps(value)}'" for key, value in (host_vars or {}).get(host.name, {}).items()
            )
            lines.append(
                f"{host.name} ansible_host={host.address} rolling_context_state_dir={host.state_dir} "
                f"rolling_context_calibration_dir={host.directory / 'imports'} "
                f"rolling_context_lb_server={host.name}{extra}"
            )
        variables: dict[str, Any] = {
            "ansible_user": "root",
            "ansible_python_interpreter": sys.executable,
            "ansible_ssh_private_key_file": ssh / "id_ed25519",
            "rolling_context_bin": self.ctxmgr_bin,
            "rolling_context_service": SERVICE,
            "rolling_context_lb_haproxy_socket": self.haproxy_socket,
            "rolling_context_lb_backend": BACKEND,
            # no NVML in the bed: the seeds' 8-GPU machine, as the integration tests describe it
            "rolling_context_extra_args": offline_gpu_args(),
            **(group_vars or {}),
        }
        lines += ["", f"[{group}:vars]"]
        lines += [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in variables.items()]
        lines.append("")
        self.inventory.write_text("\n".join(lines))
        control = self.directory / "cp"
        control.mkdir(exist_ok=True)
        ssh_args = f"-o UserKnownHostsFile={ssh / 'known_hosts'} -o StrictHostKeyChecking=yes"
        # a unix socket path must fit in 108 bytes: %C adds 41 characters ("/" and a 40-character hash) and
        # ssh binds a temporary name first, 17 more (".XXXXXXXXXXXXXXXX"); longer: no multiplexing
        if len(str(control)) + 41 + 17 < 108:
            ssh_args += f" -o ControlMaster=auto -o ControlPersist=120s -o ControlPath={control}/%C"
        (self.directory / "ansible.cfg").write_text(
            f"""[defaults]
inventory = {self.inventory}
collections_path = {self.directory / "collections"}
remote_tmp = {self.directory / "ansible-remote"}
local_tmp = {self.directory / "ansible-local"}
host_key_checking = True
forks = 5
stdout_callback = default
retry_files_enabled = False
interpreter_python = {sys.executable}

[ssh_connection]
pipelining = True
ssh_args = {ssh_args}
"""
        )

    # ---- using it --------------------------------------------------------------------------------

    def ansible_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update(
            ANSIBLE_CONFIG=str(self.directory / "ansible.cfg"),
            ANSIBLE_NOCOLOR="1",
            ANSIBLE_FORCE_COLOR="0",
            PATH=f"{self.ansible_venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        )
        return env

    def install_collection(self, tarball: Path) -> None:
        _run(
            str(self.ansible_venv / "bin" / "ansible-galaxy"), "collection", "install", "--force",
            "--offline", "-p", str(self.directory / "collections"), str(tarball),
            env=self.ansible_env(), timeout=120,
        )  # fmt: skip

    def ansible(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run an ansible(-playbook) command as the controller, inside the client namespace."""
        tool, *rest = argv
        return subprocess.run(
            in_netns(self.client_netns, str(self.ansible_venv / "bin" / tool), *rest),
            capture_output=True, text=True, timeout=timeout, env=self.ansible_env(), cwd=self.directory,
        )  # fmt: skip

    def served_context(self, host: FleetHost) -> int | None:
        """max_model_len that /v1/models reports on the host itself (None: it does not answer)."""
        code = (
            "import json,sys,urllib.request\n"
            "try: print(json.load(urllib.request.urlopen(sys.argv[1] + '/v1/models', timeout=5))"
            "['data'][0]['max_model_len'])\n"
            "except Exception as e: print('none', e)"
        )
        out = _run(*in_netns(host.netns, sys.executable, "-c", code, host.url)).stdout.strip()
        return int(out) if out.isdigit() else None

    def load(self, rate: float, duration: float, out: Path, keepalive: int = 0) -> subprocess.Popen[str]:
        """Start the bounded load client in the client namespace (stops by itself after `duration`)."""
        return subprocess.Popen(
            in_netns(
                self.client_netns, sys.executable, "-m", "tests.fleet.load", "--url", self.lb_url,
                "--rate", str(rate), "--duration", str(duration), "--keepalive", str(keepalive),
                "--haproxy-socket", str(self.haproxy_socket), "--backend", BACKEND, "--out", str(out),
            ),
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "client_netns": self.client_netns,
            "lb_url": self.lb_url,
            "haproxy_socket": str(self.haproxy_socket),
            "haproxy_pid": self.haproxy.pid if self.haproxy else None,
            "hosts": [
                {
                    "name": h.name,
                    "address": h.address,
                    "netns": h.netns,
                    "systemd_pid": h.sandbox.pid if h.sandbox else None,
                }
                for h in self.hosts
            ],
        }

    # ---- teardown --------------------------------------------------------------------------------

    def down(self) -> None:
        """HAProxy and each host's systemd by PID, then the namespaces by name (taking veths and bridge)."""
        errors = []
        if self.haproxy is not None and self.haproxy.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.haproxy.pid, signal.SIGTERM)
            try:
                self.haproxy.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.haproxy.pid, signal.SIGKILL)
                self.haproxy.wait(timeout=5)
        for host in self.hosts:
            if host.sandbox is not None:
                try:
                    host.sandbox.stop()
                except Exception as exc:  # keep tearing down the rest
                    errors.append(f"{host.name}: {exc}")
                host.sandbox = None
        for name in reversed(self.namespaces):
            _run("ip", "netns", "delete", name, check=False)
        self.namespaces.clear()
        if errors:
            raise BedError("; ".join(errors))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "up":
        bed = FleetBed.up(Path(args[1]))
        print(json.dumps(bed.describe(), indent=2))
        print("press Ctrl-C to tear it down", file=sys.stderr)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            bed.down()
        return 0
    print("usage: python -m tests.fleet.bed up DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())


# ---- a roll-out under load, as the tests and `make fleet-demo` run it ------------------------------


def build_collection(output: Path, venv: Path | None = None) -> Path:
    """`ansible-galaxy collection build` of the repo's collection; returns the tarball."""
    output.mkdir(parents=True, exist_ok=True)
    _run(
        str((venv or ansible_venv()) / "bin" / "ansible-galaxy"), "collection", "build", "--force",
        "--output-path", str(output), str(COLLECTION_DIR), timeout=120,
    )  # fmt: skip
    tarballs = sorted(output.glob("vllm-ctxmgr-*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not tarballs:
        raise BedError(f"ansible-galaxy built no tarball in {output}")
    return tarballs[-1]


@dataclass
class RollOut:
    returncode: int
    seconds: float
    output: str  # ansible-playbook's stdout + stderr
    report: dict[str, Any]  # the role's rolling_context_report_file
    load: dict[str, Any]  # the load client's summary ({} without load)
    kept_alive: dict[str, Any] = field(default_factory=dict)  # the kept-alive load's summary ({} without)


def sessions(bed: FleetBed) -> dict[str, int]:
    """Per load-balanced host, the sessions HAProxy has sent it so far (its `stot`)."""
    rows = bed.runtime().servers(BACKEND)
    return {server: int(row.get("stot") or 0) for (_, server), row in rows.items()}


def wait_each_served(bed: FleetBed, since: dict[str, int], names: list[str], timeout: float = 30.0) -> None:
    """Until HAProxy has sent each of `names` a session more than `since` counted."""
    deadline = time.monotonic() + timeout
    while True:
        now = sessions(bed)
        behind = [n for n in names if now.get(n, 0) <= since.get(n, 0)]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise BedError(f"the load reached no server among {behind} within {timeout:g} s")
        time.sleep(0.05)


def roll_out(
    bed: FleetBed,
    context: int,
    name: str,
    rate: float = 20.0,
    extra_vars: dict[str, Any] | None = None,
    check: bool = False,
    max_load_s: float = 110.0,
    kept_alive: tuple[float, int] | None = None,
    during: Callable[[], None] | None = None,
    playbook: str = "vllm.ctxmgr.rolling_context",
) -> RollOut:
    """Run the collection's `playbook` across the bed (rate 0: no load), load running throughout; with
    `kept_alive` (rate, clients) a second load client beside it, each client on one kept-alive connection.

    The load flows through every host before the playbook starts (HAProxy's own session counts say
    when), and 2 s after it ends."""
    report_file = bed.directory / f"report-{name}.json"
    load_files = [bed.directory / f"load-{name}.json", bed.directory / f"load-{name}-kept-alive.json"]
    report_file.unlink(missing_ok=True)
    variables = {
        "rolling_context_max_model_len": context,
        "rolling_context_report_file": str(report_file),
        **(extra_vars or {}),
    }
    argv = ["ansible-playbook", playbook, "-e", json.dumps(variables)]
    if check:
        argv += ["--check", "--diff"]
    before = sessions(bed) if rate > 0 or kept_alive else {}
    load_began = time.monotonic()
    load = bed.load(rate, max_load_s, load_files[0]) if rate > 0 else None
    kept = bed.load(kept_alive[0], max_load_s, load_files[1], kept_alive[1]) if kept_alive else None
    loads = [p for p in (load, kept) if p is not None]
    try:
        if loads:  # the load is flowing through every host before the first drain
            wait_each_served(bed, before, [h.name for h in bed.lb_hosts])
        began = time.monotonic()
        if during is None:
            result = bed.ansible(*argv, timeout=600)
        else:  # something the test does to the fleet while the playbook runs
            with ThreadPoolExecutor(1) as pool:
                playbook = pool.submit(bed.ansible, *argv, timeout=600)
                during()
                result = playbook.result()
        seconds = time.monotonic() - began
        if loads:
            # and keeps flowing a moment after the last host is back. A fixed 2 s, not "until every
            # host took a request" (h-ci tried it): near the load's own bound that wait met a load
            # that had stopped sending and failed a roll-out that lost nothing (CI run 10).
            time.sleep(min(2.0, max(0.0, load_began + max_load_s - time.monotonic())))
    finally:
        for client in loads:
            client.send_signal(signal.SIGTERM)
        for client in loads:
            try:
                client.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                client.kill()
                client.communicate()
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    summary, kept_summary = (
        json.loads(file.read_text()) if client is not None and file.exists() else {}
        for client, file in zip((load, kept), load_files, strict=True)
    )
    (bed.directory / f"ansible-{name}.log").write_text(result.stdout + result.stderr)
    return RollOut(result.returncode, seconds, result.stdout + result.stderr, report, summary, kept_summary)
