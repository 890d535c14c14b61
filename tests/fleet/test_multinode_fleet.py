"""The collection's multinode play with real parts: two 2-node deployments behind one HAProxy
(tests/fleet/multinode_fleet.py), `ansible-playbook vllm.ctxmgr.multinode_context` run over their heads
while the bounded load client streams through HAProxy, with each ansible-core the tier runs.

ctxmgr runs on each head (the module's `nodes`), reaches its own nodes over ssh and changes both as
one; the play drains one deployment's head at a time (serial 1 over the heads), so no request is lost.

Both ansible-core versions (the oldest claimed and the newest) run the roll-out under load. The failed
one runs on the newest only: what it adds to that is ctxmgr's deployment rollback and the role's
rollback of an earlier batch, whose ansible-core machinery (rescue, facts carried across serial
batches, delegate_facts) tests/fleet/test_fleet.py's failure on the middle host already runs on both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fleet.bed import (
    ANSIBLE_VERSIONS,
    REPO_ROOT,
    RollOut,
    ansible_venv,
    build_collection,
    fleet_available,
    roll_out,
)
from tests.fleet.multinode_fleet import BASELINE, DEPLOYMENTS, MultinodeFleet
from tests.support.require import require

pytestmark = pytest.mark.systemd
TARGET = 200_000
RATE = 10.0
PLAYBOOK = "vllm.ctxmgr.multinode_context"
HEADS = {members[0]: name for name, members in DEPLOYMENTS.items()}
# h4 (deployment B's headless node) holds 100,000 tokens of KV cache from its next start on: its
# baseline start, which ctxmgr plans from, showed the full cache, so the plan says 200,000 fits; the
# head's KV check (the smallest budget of all ranks) refuses it
H4_DRIFT = "CTXMGR_STANDIN_KV_CAPACITY_TOKENS=100000\n"


@pytest.fixture(scope="module", params=ANSIBLE_VERSIONS)
def bed(request: pytest.FixtureRequest) -> Iterator[MultinodeFleet]:
    """The two-deployment bed whose controller runs ansible-core `request.param` (X.Y)."""
    venv = ansible_venv(request.param)
    require(fleet_available(venv), f"the two-deployment bed with ansible-core {request.param}")
    directory = REPO_ROOT / ".cache" / "fleet" / f"mf{os.getpid()}-{request.param}"
    tarball = build_collection(directory / "build", venv)
    fleet = MultinodeFleet.up(directory, venv=venv)
    try:
        fleet.fleet.install_collection(tarball)
        yield fleet
    finally:
        fleet.down()
    assert not fleet.fleet.namespaces, "namespaces left behind"


def roll(bed: MultinodeFleet, name: str) -> RollOut:
    return roll_out(bed.fleet, TARGET, name, rate=RATE, playbook=PLAYBOOK, max_load_s=150)


def test_both_deployments_go_to_200k_under_load_one_at_a_time(bed: MultinodeFleet) -> None:
    bed.reset()
    run = roll(bed, "mn-rollout")
    assert run.returncode == 0, run.output[-3000:]
    assert bed.unit_contexts() == {
        name: {node: TARGET for node in members} for name, members in DEPLOYMENTS.items()
    }
    assert bed.served() == {"A": TARGET, "B": TARGET} and bed.all_running()
    # no request lost (HAProxy neither retries nor redispatches): a head was out of HAProxy only
    # while its own deployment changed, never both at once
    assert run.load["sent"] > 0 and run.load["lost"] == 0, run.load["errors"]
    assert set(run.load["served_by"]) == set(HEADS), run.load["served_by"]
    report = run.report
    assert sorted(report["changed"]) == sorted(HEADS) and report["uniform"], report
    for head in HEADS:
        host = report["hosts"][head]
        assert host["before"] == BASELINE and host["after"] == TARGET
        assert 0 < host["out_of_service_s"] < run.seconds, host  # each deployment's time out of the LB
        # every node: what ctxmgr planned and what its vLLM logged at the new start
        nodes = host["detail"]["nodes"]
        assert [n["role"] for n in nodes] == ["head", "headless"]
        assert all(n["planned"]["kv_needed_bytes"] > 0 for n in nodes), nodes
        assert all(n["logged"]["max_model_len"] == TARGET for n in nodes), nodes
    # HAProxy's own view: each head out of rotation for a while (its deployment's restart)
    assert all(run.load["lb_downtime_s"].get(head, 0) > 0 for head in HEADS), run.load["lb_downtime_s"]


@pytest.mark.parametrize("bed", [ANSIBLE_VERSIONS[-1]], indirect=True)
def test_a_worker_that_cannot_hold_200k_rolls_the_fleet_back_uniform(bed: MultinodeFleet) -> None:
    bed.reset()
    bed.host("h4").env_file.write_text(H4_DRIFT)
    run = roll(bed, "mn-failure")
    assert run.returncode != 0, run.output[-3000:]
    report = run.report
    # B failed and ctxmgr rolled both its nodes back; A, already changed, came back through the
    # role's fleet rollback
    assert report["failed"] == ["h3"] and "h1" in report["rolled_back"], report
    assert report["hosts"]["h3"]["detail"]["rolled_back_by_ctxmgr"] is True, report["hosts"]["h3"]
    assert report["uniform"] and not report["not_restored"], report
    assert bed.unit_contexts() == {
        name: {node: BASELINE for node in members} for name, members in DEPLOYMENTS.items()
    }
    bed.wait_serving(60)
    assert bed.served() == {"A": BASELINE, "B": BASELINE} and bed.all_running()
    assert run.load["sent"] > 0 and run.load["lost"] == 0, run.load["errors"]
