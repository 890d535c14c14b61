"""The two-node bed with the stand-in's multi-node mode, shared by the modules that change or watch it
(test_multinode_change.py, test_multinode_standin.py). `bed` is of module scope, so tests/conftest.py
puts each module's tests on one xdist worker and each module boots its own bed once; a module names its
bed's folder with BED_FOLDER (short: the bed's sockets live below it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fleet.bed import REPO_ROOT
from tests.fleet.multinode import BASELINE, MultinodeBed, multinode_available
from tests.support.require import require


@pytest.fixture(scope="module")
def bed(request: pytest.FixtureRequest) -> Iterator[MultinodeBed]:
    require(multinode_available(standin=True), "the two-node bed")
    folder = REPO_ROOT / ".cache" / "fleet" / f"{request.module.BED_FOLDER}{os.getpid()}"
    multinode = MultinodeBed.up(folder, settings=BASELINE, standin=True)
    try:
        yield multinode
    finally:
        multinode.down()
    assert not multinode.fleet.namespaces, "namespaces left behind"


@pytest.fixture
def serving(bed: MultinodeBed) -> MultinodeBed:
    """Both nodes at the baseline, node 0 serving, every node's sshd up and ctxmgr state forgotten (a
    test before may have stopped sshd or left a change behind)."""
    bed.stop_all()
    bed.timeout_s = 20
    bed.install(BASELINE)
    for node in bed.nodes:
        node.systemctl("start", "sshd-fleet.service")
        for path in sorted(node.state_dir.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
    bed.coordinator_state.mkdir(mode=0o700, exist_ok=True)
    bed.start_all()
    bed.wait_ready(60)
    return bed
