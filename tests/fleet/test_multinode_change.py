"""`ctxmgr deployment` over real ssh: a coordinator in the client namespace changes a two-node deployment
(tests/fleet/multinode.py, the stand-in's multi-node mode: GLM-5, TP 8 over two 4-GPU nodes) as one.

Each node is its own network namespace with its own systemd, sshd and ctxmgr state; the coordinator
reaches them only through `ssh root@NODE ctxmgr node ...`, as an operator's machine would. The real
CPU vLLM does the same in tests/fleet/test_multinode.py.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from tests.fleet.multinode import UNIT, MultinodeBed
from tests.support.demo import SEED_GPU_GIB, SEED_WEIGHTS_GIB_PER_GPU
from vllm_ctxmgr.store import ServiceStore, State

pytestmark = pytest.mark.systemd
BED_FOLDER = "mc"  # the shared bed's folder (tests/fleet/conftest.py)
# each node's 4 GPUs (no NVML in the bed) and GLM-5's weights over the 8 ranks
GPU_ARGS = ["--gpu-memory", f"{SEED_GPU_GIB}GiB", "--gpu-count", "4",
            "--weights-bytes", f"{SEED_WEIGHTS_GIB_PER_GPU * 8:.2f}GiB"]  # fmt: skip


def node_revisions(node: Any) -> list[Any]:
    return ServiceStore(node.state_dir, UNIT).revisions()


def test_a_coordinator_changes_both_nodes_over_ssh(serving: MultinodeBed) -> None:
    code, data, out = serving.coordinate("set-context", "200000", *GPU_ARGS, "--yes")
    assert code == 0, out
    assert data["result"] == "applied" and [n["role"] for n in data["nodes"]] == ["head", "headless"]
    assert serving.served_context() == 200000
    for node in serving.nodes:
        assert "--max-model-len 200000" in serving.unit_path(node).read_text()
        last = node_revisions(node)[-1]
        assert last.state is State.FINAL and last.deployment == data["change_id"]
    # the headless node's own lines, read over ssh: what its vLLM logged at the new start
    assert data["nodes"][1]["logged"]["max_model_len"] == 200000
    code, verified, out = serving.coordinate("verify")
    assert code in (0, 1) and verified["result"] in ("ok", "degraded"), out


def test_an_unreachable_node_stops_the_change_before_any_write(serving: MultinodeBed) -> None:
    node0, node1 = serving.nodes
    before = serving.unit_path(node0).read_text()
    node1.systemctl("stop", "sshd-fleet.service")
    code, data, out = serving.coordinate("set-context", "200000", *GPU_ARGS, "--yes", timeout=120)
    assert code != 0 and node1.address in data["error"] and "nothing was changed" in data["error"], out
    assert serving.unit_path(node0).read_text() == before
    assert node_revisions(node0) == [] and serving.served_context() == 8192


def test_the_head_dying_during_the_restart_rolls_both_nodes_back(serving: MultinodeBed) -> None:
    """node 0's new vLLM is SIGKILLed as soon as it runs: every node's old unit comes back and serves."""
    node0 = serving.nodes[0]
    old_pid = serving.unit_state(node0)["MainPID"]
    killed: list[str] = []
    stop = threading.Event()

    def kill_the_new_head() -> None:
        while not stop.is_set():
            if "--max-model-len 200000" in serving.unit_path(node0).read_text():
                pid = serving.unit_state(node0).get("MainPID", "0")
                if pid not in ("0", old_pid):
                    time.sleep(0.5)  # it has started loading
                    assert node0.sandbox is not None
                    node0.sandbox.run("kill", f"-{signal.SIGKILL.value}", pid, check=False)
                    killed.append(pid)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_the_new_head, daemon=True)
    killer.start()
    try:
        code, data, out = serving.coordinate("set-context", "200000", *GPU_ARGS, "--yes")
    finally:
        stop.set()
        killer.join(5)
    assert killed, "the new head was never seen running"
    assert code == 1 and data["result"] == "rolled-back", out
    assert data["reason"].startswith(f"{node0.address}:"), data["reason"]
    for node in serving.nodes:
        assert "--max-model-len 8192" in serving.unit_path(node).read_text()
        assert node_revisions(node)[-1].state is State.ROLLED_BACK
    assert serving.served_context() == 8192
