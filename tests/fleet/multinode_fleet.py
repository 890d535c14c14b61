"""Two multi-node deployments behind one HAProxy, from real parts: the collection's multinode play.

    client netns  (br0: HAProxy :8080 with the two heads as its servers, the Ansible controller, the load)
       | veth v1..v4 on br0
    deployment A: h1 (10.249.0.11, node 0, HTTP)  +  h2 (10.249.0.12, node 1, --headless)
    deployment B: h3 (10.249.0.13, node 0, HTTP)  +  h4 (10.249.0.14, node 1, --headless)

Every node is a tests/fleet/bed.py host (its own network namespace, private systemd, real sshd) running
the stand-in's multi-node mode (GLM-5, TP 8 over the two 4-GPU nodes of its deployment; each deployment
its own --master-addr, its head's). The play runs on the heads (inventory group vllm_heads); ctxmgr on
a head reaches its own nodes over ssh with the bed's key and known_hosts, and runs the bed's `ctxmgr`
there (rolling_context_remote_ctxmgr), each host keeping its own state directory.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fleet.bed import (
    BedError,
    FleetBed,
    FleetHost,
    ansible_venv,
    fleet_available,
    sweep_stale_namespaces,
)
from tests.fleet.multinode import SERVICE, UNIT, MultinodeBed, NodeSettings
from tests.support.demo import GLM5_CONFIG_DIR, SEED_GPU_GIB, SEED_WEIGHTS_GIB_PER_GPU

DEPLOYMENTS = {"A": ("h1", "h2"), "B": ("h3", "h4")}
HEADS_GROUP = "vllm_heads"  # the play's default group (playbooks/multinode_context.yml)
BASELINE = 8192
# 30 streamed tokens of 50 ms, as the single-node fleet bed: a 1.5 s completion
TOKEN_DELAY_S = 0.05
# each node's 4 GPUs (no NVML in the bed) and GLM-5's weights over the 8 ranks
GPU_ARGS = ["--gpu-memory", f"{SEED_GPU_GIB}GiB", "--gpu-count", "4",
            "--weights-bytes", f"{SEED_WEIGHTS_GIB_PER_GPU * 8:.2f}GiB"]  # fmt: skip
DISTRIBUTED_TIMEOUT_S = 20  # a start whose peer is gone ends in this long


@dataclass
class MultinodeFleet:
    """Build with MultinodeFleet.up(directory); end with down() (also on any failure while building)."""

    fleet: FleetBed
    deployments: dict[str, MultinodeBed]
    # up() left every node as reset() would (its own reset, then HAProxy): the first reset() at the
    # baseline has nothing to do
    fresh: bool = False

    @classmethod
    def up(cls, directory: Path, venv: Path | None = None) -> MultinodeFleet:
        venv = venv or ansible_venv()
        reason = fleet_available(venv)
        if reason:
            raise BedError(f"cannot build the two-deployment bed: {reason}")
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        if len(str(directory / "haproxy.sock")) > 100:
            raise BedError(f"{directory} is too long a path for a unix socket")
        sweep_stale_namespaces()
        heads = [names[0] for names in DEPLOYMENTS.values()]
        fleet = FleetBed(directory=directory, tag=secrets.token_hex(2), ansible_venv=venv, backends=heads)
        bed = cls(fleet=fleet, deployments={})
        try:
            fleet._network(sum(len(names) for names in DEPLOYMENTS.values()))
            fleet._keys()
            fleet._ctxmgr_wrapper()
            by_name = {host.name: host for host in fleet.hosts}
            for host in fleet.hosts:
                fleet.boot_ssh_host(host)
            for name, members in DEPLOYMENTS.items():
                bed.deployments[name] = MultinodeBed(
                    fleet=fleet,
                    model_dir=GLM5_CONFIG_DIR,
                    timeout_s=DISTRIBUTED_TIMEOUT_S,
                    standin=True,
                    members=[by_name[m] for m in members],
                )
            bed.reset()
            fleet._haproxy()
            fleet._ansible_files(
                HEADS_GROUP,
                {d.head.name: bed.head_vars(d) for d in bed.deployments.values()},
                bed.heads_group_vars(),
            )
            fleet.wait_all_up(timeout=60)
        except BaseException:
            bed.down()
            raise
        bed.fresh = True
        return bed

    # ---- the inventory -------------------------------------------------------------------------

    @property
    def key(self) -> Path:
        return self.fleet.directory / "ssh" / "id_ed25519"

    def ssh_words(self) -> list[str]:
        """The ssh a head's ctxmgr reaches its nodes with: the bed's key and known_hosts only."""
        known = self.fleet.directory / "ssh" / "known_hosts"
        return [
            "ssh", "-F", "/dev/null", "-l", "root", "-i", str(self.key),
            "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
        ]  # fmt: skip

    def head_vars(self, deployment: MultinodeBed) -> dict[str, Any]:
        return {"rolling_context_nodes": [f"{n.address}:{UNIT}" for n in deployment.nodes]}

    def heads_group_vars(self) -> dict[str, Any]:
        """What every head shares: the ssh, the nodes' ctxmgr, the unit and the GPUs (no NVML here)."""
        return {
            "rolling_context_ssh": self.ssh_words(),
            "rolling_context_remote_ctxmgr": [str(self.fleet.ctxmgr_bin)],
            "rolling_context_service": SERVICE,
            "rolling_context_extra_args": GPU_ARGS,
        }

    # ---- driving it ----------------------------------------------------------------------------

    def reset(self, context: int = BASELINE) -> None:
        """Every node at `context` with no drift, ctxmgr state forgotten, each head serving."""
        fresh, self.fresh = self.fresh, False
        if fresh and context == BASELINE and not any(h.env_file.exists() for h in self.fleet.hosts):
            return
        for deployment in self.deployments.values():
            if any(deployment.active_state(n) not in ("inactive", "failed") for n in deployment.nodes):
                deployment.stop_all()
        settings = NodeSettings(
            max_model_len=context, extra_environment=(("CTXMGR_STANDIN_TOKEN_DELAY_S", str(TOKEN_DELAY_S)),)
        )
        for deployment in self.deployments.values():
            for node in deployment.nodes:
                node.systemctl("start", "sshd-fleet.service")
                node.env_file.unlink(missing_ok=True)
                for path in sorted(node.state_dir.rglob("*"), reverse=True):
                    path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
            deployment.install(settings)
        for deployment in self.deployments.values():
            deployment.start_all()
        for deployment in self.deployments.values():
            deployment.wait_ready(90)
        if self.fleet.haproxy is not None:
            for deployment in self.deployments.values():
                self.fleet.runtime().set_state("vllm", deployment.head.name, "ready")
            self.fleet.wait_all_up(timeout=60)

    def unit_contexts(self) -> dict[str, dict[str, int | None]]:
        """Per deployment, each node's --max-model-len as its unit file says."""
        out: dict[str, dict[str, int | None]] = {}
        for name, deployment in self.deployments.items():
            out[name] = {}
            for node in deployment.nodes:
                words = deployment.unit_path(node).read_text().split()
                index = words.index("--max-model-len") if "--max-model-len" in words else -1
                out[name][node.name] = int(words[index + 1]) if index >= 0 else None
        return out

    def served(self) -> dict[str, int | None]:
        """Per deployment, what its head's /v1/models says."""
        return {name: d.served_context() for name, d in self.deployments.items()}

    def all_running(self) -> bool:
        return all(d.active_state(n) == "active" for d in self.deployments.values() for n in d.nodes)

    def wait_serving(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while any(v is None for v in self.served().values()):
            if time.monotonic() > deadline:
                raise BedError(f"not every head serves within {timeout:g} s: {self.served()}")
            time.sleep(1)

    def host(self, name: str) -> FleetHost:
        return next(h for h in self.fleet.hosts if h.name == name)

    def down(self) -> None:
        self.fleet.down()
