"""One vLLM deployment over two nodes, from real parts (tests/fleet/multinode.py): the real CPU vLLM, TP 2
over --nnodes 2, each node a systemd unit in its own network namespace, reached over real sshd.

One bring-up for the module (~1.5-3 min on 2 shared cores), torn down by PID and namespace name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fleet.bed import REPO_ROOT
from tests.fleet.multinode import UNIT, MultinodeBed, multinode_available
from tests.support.require import require
from vllm_ctxmgr.vllm_log.watcher import headless_verdict, last_start, observe_start

pytestmark = [pytest.mark.systemd, pytest.mark.vllm]


@pytest.fixture(scope="module")
def multinode() -> Iterator[MultinodeBed]:
    """Both nodes started at --max-model-len 1024 and node 0 serving."""
    require(multinode_available(), "the two-node vLLM bed", required_by="CTXMGR_REQUIRE_VLLM")
    bed = MultinodeBed.up(REPO_ROOT / ".cache" / "fleet" / f"mn{os.getpid()}")
    try:
        yield bed
    finally:
        bed.down()
    assert not bed.fleet.namespaces, "namespaces left behind"


def test_node_0_serves_the_deployments_context(multinode: MultinodeBed) -> None:
    assert multinode.served_context() == 1024


def test_the_headless_node_joined_and_is_ready_once_node_0_serves(multinode: MultinodeBed) -> None:
    node1 = multinode.nodes[1]
    lines = last_start(multinode.journal(node1).splitlines())
    assert any("headless multiproc executor" in line for line in lines)
    assert headless_verdict(lines) is None  # the CPU build's headless node logs no ready line
    verdict = headless_verdict(lines, head_serving=multinode.served_context() is not None)
    assert verdict is not None and verdict.ok, verdict
    assert observe_start(lines).max_model_len == 1024


def test_each_node_is_reached_over_ssh(multinode: MultinodeBed) -> None:
    """What a coordinator runs: `ssh NODE ...` from the client namespace, the node's own systemd."""
    for node in multinode.nodes:
        result = multinode.ssh(node, "systemctl", "is-active", UNIT)
        assert result.returncode == 0 and result.stdout.strip() == "active", result.stderr
        version = multinode.ssh(node, str(multinode.fleet.ctxmgr_bin), "--version")
        assert version.returncode == 0, version.stderr


def test_ctxmgr_changes_the_real_two_node_deployment_as_one(multinode: MultinodeBed) -> None:
    """The coordinator over ssh, the real CPU vLLM on both nodes: 1024 -> 2048, stop both, start both,
    node 1's own journal checked, node 0 probed at the new context (last: it leaves the bed at 2048)."""
    code, data, out = multinode.coordinate("set-context", "2048", "--yes", timeout=1200)
    assert code == 0, out
    assert data["result"] == "applied" and [n["role"] for n in data["nodes"]] == ["head", "headless"]
    assert multinode.served_context() == 2048
    for node in multinode.nodes:
        assert "--max-model-len 2048" in multinode.unit_path(node).read_text()
    assert data["nodes"][1]["logged"]["max_model_len"] == 2048  # what node 1's own vLLM logged
    assert data["timings"]["total_s"] > 0
