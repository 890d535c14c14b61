"""The two-node bed with the stand-in's multi-node mode (tests/fleet/multinode.py, standin=True): the
same hosts, sshd, units and network as with the real CPU vLLM, in seconds; what a coordinator of one
deployment over several nodes meets, in the order it meets it.
"""

from __future__ import annotations

import time

import pytest

from tests.fleet.multinode import BASELINE, UNIT, MultinodeBed, NodeSettings
from vllm_ctxmgr.vllm_log.watcher import headless_verdict, last_start, observe_start, watch

pytestmark = pytest.mark.systemd
BED_FOLDER = "ms"  # the shared bed's folder (tests/fleet/conftest.py)


def node_lines(bed: MultinodeBed, rank: int) -> list[str]:
    return last_start(bed.journal(bed.nodes[rank]).splitlines())


def test_both_nodes_serve_one_context(serving: MultinodeBed) -> None:
    assert serving.served_context() == 8192
    verdict = headless_verdict(node_lines(serving, 1))
    assert verdict is not None and verdict.ok, verdict  # the stand-in logs 0.33's GPU warm-up lines
    assert observe_start(node_lines(serving, 1)).max_model_len == 8192


def test_a_change_is_stop_both_then_start_both(serving: MultinodeBed) -> None:
    serving.stop_all()
    serving.install(NodeSettings(max_model_len=16384))
    serving.start_all()
    serving.wait_ready(60)
    assert serving.served_context() == 16384
    assert observe_start(node_lines(serving, 1)).max_model_len == 16384


def test_node_0_alone_fails_on_the_missing_node(serving: MultinodeBed) -> None:
    serving.stop_all()
    serving.timeout_s = 2
    serving.install(BASELINE)
    serving.start_all([0])
    state = serving.wait_ended(serving.head, 60)
    assert state["Result"] == "exit-code" and state["ExecMainStatus"] == "1"
    verdict = list(watch(node_lines(serving, 0)))[-1]
    assert not verdict.ok and verdict.failure == "peer_missing"  # type: ignore[union-attr]


def test_the_headless_node_outlives_node_0(serving: MultinodeBed) -> None:
    """Node 0 stopped: node 1 keeps running and prints nothing (the real one does the same); a coordinator
    has to stop it itself before a new node 0 can form a group."""
    before = node_lines(serving, 1)
    serving.head.systemctl("stop", UNIT)
    time.sleep(2)  # time enough for node 1 to notice and say so, were it to
    assert serving.active_state(serving.nodes[1]) == "active"
    assert node_lines(serving, 1) == before
    result = serving.ssh(serving.nodes[1], "systemctl", "is-active", UNIT)
    assert result.stdout.strip() == "active"
