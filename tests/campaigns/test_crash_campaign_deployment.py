"""Crash campaign over a deployment (issue 27): the one-service campaign (test_crash_campaign.py) run
over the steps of a two-node deployment, which are the same steps. Killed: (a) one node's
`ctxmgr node STEP` at each state its steps record (prepare, start, finish, restore, settle: node.py),
the node's [[node]] `ctxmgr = [...]` in a deployment file running it under tests/support/crash_run.py;
(b) the coordinator itself between its steps (`after-node:STEP:N`: right after the Nth answer to
`node STEP`), where a kill -9 leaves the nodes with no one to finish them; and the same kills in
`deployment rollback` (the same walk to the previous units) and in `deployment recover` itself, where
a second recover must finish what the first left. Then `deployment recover`
and what an operator relies on: each node's unit byte for byte one that served (never the old on one
node and the new on the other), the deployment serving what its units say, no node revision left
unfinished, and a next change that works.

Two nodes of one private systemd, as tests/deployment/test_multinode.py runs them: the head on host `local`,
the headless rank on `localhost` (this machine under its other name, a host of its own to the
deployment file, so one node's ctxmgr can be the crashing one). One deployment for the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.campaigns.test_crash_campaign import Service
from tests.ctxmgr_cli import crashing_argv, ctxmgr_argv
from tests.deployment.test_multinode import GPU_ARGS, node_unit
from tests.support.demo import make_vllm_wrapper
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.probe import wait_until_serving
from vllm_ctxmgr.store import PENDING

CAPACITY = 100_000  # the headless rank's KV room: the forced FAILING change is refused at start there
FAILING = 200_000
HEAD, RANK1 = "vllm-crashdep-head", "vllm-crashdep-rank1"
HOSTS = {"head": "local", "rank1": "localhost"}

# (command, whose ctxmgr dies: head | rank1 | coordinator, where). set-context changes to a fresh context;
# "failing" is a forced set-context the headless rank's vLLM refuses, so the kill is on the way back.
# Each case restarts the deployment at least once (~12 s on two busy cores): CI runs QUICK, the cases
# that found defects and one of each kind; CTXMGR_CRASH_CAMPAIGN_ALL=1 runs every one (~5 min).
ALL_CASES: list[tuple[str, str, str]] = [
    ("set-context", "head", "revision-staged"),
    ("set-context", "head", "node prepare:recorded"),
    ("set-context", "head", "node prepare:installed"),
    ("set-context", "rank1", "unit-file-written"),  # the head written, the rank's file written, no reload
    ("set-context", "head", "node:restarting"),
    ("set-context", "rank1", "node:restarting"),
    ("set-context", "head", "node:serving"),
    ("set-context", "head", "node:probed"),
    ("set-context", "rank1", "node:serving"),  # finish: the rank checked, not yet final
    ("set-context", "rank1", "node:final"),
    ("set-context", "head", "node:final"),
    ("failing", "head", "node:rolling-back"),
    ("failing", "rank1", "node:rolled-back"),
    ("set-context", "coordinator", "after-node:prepare:1"),  # the head written, the rank not
    ("set-context", "coordinator", "after-node:prepare:2"),
    ("set-context", "coordinator", "after-node:stop:2"),  # every node stopped, none started
    ("set-context", "coordinator", "after-node:start:1"),  # the rank started, the head not
    ("set-context", "coordinator", "after-node:start:2"),  # the head served and was probed
    ("set-context", "coordinator", "after-node:finish:2"),
    ("failing", "coordinator", "after-node:restore:2"),  # every previous unit back, nothing restarted
    ("failing", "coordinator", "after-node:start:4"),  # restarted on the previous units, not settled
    # `deployment rollback` is the same walk to the previous units: killed in it, recover finishes it
    ("rollback", "coordinator", "after-node:prepare:2"),
    ("rollback", "rank1", "node:restarting"),
    ("rollback", "coordinator", "after-node:start:2"),
    # `deployment recover` killed in its own way back (after the coordinator died in a failing change's):
    # the second recover finishes what the first left
    ("recover", "coordinator", "after-node:restore:2"),
    ("recover", "coordinator", "after-node:start:1"),
    ("recover", "head", "node:rolled-back"),
]
QUICK = {
    ("set-context", "rank1", "unit-file-written"),
    ("set-context", "rank1", "node:serving"),
    ("failing", "head", "node:rolling-back"),
    ("set-context", "coordinator", "after-node:stop:2"),
    ("failing", "coordinator", "after-node:start:4"),
}
CASES = (
    ALL_CASES if os.environ.get("CTXMGR_CRASH_CAMPAIGN_ALL") == "1" else [c for c in ALL_CASES if c in QUICK]
)


@dataclass
class Deployment:
    sandbox: Sandbox
    work: Path
    head: Service
    rank1: Service
    contexts: Iterator[int] = field(default_factory=lambda: iter(range(20_000, 100_000, 2_000)))

    @property
    def state(self) -> Path:
        return self.head.state

    def nodes_args(self) -> list[str]:
        return ["--node", f"{HOSTS['head']}:{HEAD}", "--node", f"{HOSTS['rank1']}:{RANK1}"]

    def ctxmgr(self, *args: str, crash: tuple[str, str] | None = None) -> subprocess.CompletedProcess:
        """`ctxmgr deployment ...` over both nodes; `crash` (whose, where) kills that one's ctxmgr there."""
        whose, step = crash or ("", "")
        if whose == "coordinator":
            argv = crashing_argv(self.sandbox.pid, self.state, step, "deployment", *args)
        else:
            argv = ctxmgr_argv(self.sandbox.pid, self.state, "deployment", *args)
        if whose in HOSTS:  # that node's ctxmgr, as its [[node]] may name one, is the crashing one
            crashing = crashing_argv(self.sandbox.pid, self.state, step)
            file = self.work / "deployment.toml"
            file.write_text(
                "".join(
                    f'[[node]]\nhost = "{HOSTS[who]}"\nservice = "{name}"\n'
                    + (f"ctxmgr = {json.dumps(crashing)}\n" if who == whose else "")
                    for who, name in (("head", HEAD), ("rank1", RANK1))
                )
            )
            argv += ["--file", str(file)]
        else:
            argv += self.nodes_args()
        once = self.work / f"crashed-{uuid.uuid4().hex[:8]}"  # the kill comes once (crash_run.py)
        env = {**os.environ, "CTXMGR_CRASH_ONCE": str(once)}
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)

    def set_context(
        self, context: int, crash: tuple[str, str] | None = None, force: bool = False
    ) -> subprocess.CompletedProcess:
        return self.ctxmgr("set-context", str(context), *GPU_ARGS, *(["--force"] if force else []),
                           "--yes", "--json", crash=crash)  # fmt: skip

    def check_whole(self, leftovers: bool = False) -> list[str]:
        """What must hold after any crash and its recovery; the problems found (none is the goal).
        `leftovers`: and no half-written revision (a node clears them at its next change)."""
        problems = [f"{HEAD}: {p}" for p in self.head.check_whole(leftovers)]
        problems += [f"{RANK1}: {p}" for p in self.rank1.check_whole(leftovers)]
        lengths = {
            node.name: node.good_units().get(node.path.read_bytes()) for node in (self.head, self.rank1)
        }
        if len(set(lengths.values())) != 1:
            problems.append(f"the nodes' units are of different changes: {lengths}")
        return problems


def start(sandbox: Sandbox, work: Path) -> Deployment:
    wrapper = make_vllm_wrapper(work)
    port, master = free_port(), free_port()
    nodes = []
    for rank, name in enumerate((HEAD, RANK1)):
        env = {"CTXMGR_STANDIN_TIME_SCALE": "0.1"}
        if rank == 1:
            env["CTXMGR_STANDIN_KV_CAPACITY_TOKENS"] = str(CAPACITY)
        node_port = port if rank == 0 else free_port()
        path = sandbox.systemd.host_unit_dir / f"{name}.service"
        path.write_text(node_unit(wrapper, rank, node_port, master, env))
        nodes.append(Service(sandbox, name, node_port, path, work / "state", headless=rank == 1))
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(f"{RANK1}.service")
    sandbox.systemd.start(f"{HEAD}.service")
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return Deployment(sandbox, work, nodes[0], nodes[1])


def stop(deployment: Deployment) -> None:
    systemd = deployment.sandbox.systemd
    for node in (deployment.head, deployment.rank1):
        with contextlib.suppress(Exception):
            systemd.stop(f"{node.name}.service")
        node.path.unlink(missing_ok=True)
    systemd.daemon_reload()


def said(run: subprocess.CompletedProcess) -> str:
    """A deployment command's result and reason (or error), as its --json says them."""
    try:
        data = json.loads(run.stdout)
    except ValueError:
        return run.stderr.strip()[-300:]
    return f"{data.get('result')}: {data.get('reason') or data.get('error')}"


def run_case(deployment: Deployment, command: str, whose: str, step: str) -> list[str]:
    """One crash and `deployment recover`; the problems found."""
    problems: list[str] = []
    if command == "failing":
        crashed = deployment.set_context(FAILING, crash=(whose, step), force=True)
    elif command == "rollback":
        crashed = deployment.ctxmgr("rollback", "--yes", "--json", crash=(whose, step))
    elif command == "recover":
        # a failing change whose coordinator dies on the way back, then the recover itself is killed
        first = deployment.set_context(FAILING, crash=("coordinator", "after-node:restore:2"), force=True)
        if first.returncode != 137:
            problems.append(f"the failing change's crash hook did not fire (exit {first.returncode})")
        crashed = deployment.ctxmgr("recover", "--json", crash=(whose, step))
    else:
        crashed = deployment.set_context(next(deployment.contexts), crash=(whose, step))
    print(f"{command} killed ({whose} at {step}): exit {crashed.returncode}: {said(crashed)}")
    if whose == "coordinator" and crashed.returncode != 137:
        problems.append(f"the crash hook did not fire (exit {crashed.returncode}): {crashed.stderr[-300:]}")
    if whose != "coordinator" and "exit status 137" not in crashed.stdout + crashed.stderr:
        problems.append(f"the node's crash hook did not fire (exit {crashed.returncode}): {said(crashed)}")
    if whose != "coordinator" and said(crashed).startswith("rolled-back:"):
        # the coordinator lived and says every node is back: so it must be, before any recover
        problems += [f"before recover: {p}" for p in deployment.check_whole()]
    # the revisions the crash left under way: recover finishes these, and says so in each
    pending = {
        node.name: rev.number
        for node in (deployment.head, deployment.rank1)
        for rev in node.store.revisions()
        if rev.deployment and rev.state in PENDING
    }
    done = deployment.ctxmgr("recover", "--json")
    print(f"recover: exit {done.returncode}: {said(done)}")
    if done.returncode != 0:
        problems.append(f"recover after the crash exited {done.returncode}: {said(done)}")
    elif said(done).startswith("rolled-back:"):
        # each revision recover finished says so (one already rolling back kept only its first reason)
        for node in (deployment.head, deployment.rank1):
            if node.name in pending:
                rev = node.store.get(pending[node.name])
                if "was interrupted" not in (rev.reason or ""):
                    problems.append(f"{node.name}: revision {rev.number} does not say recover's word: "
                                    f"{rev.reason!r}")  # fmt: skip
    return problems + deployment.check_whole()


@pytest.fixture(scope="module")
def deployment(sandbox: Sandbox) -> Iterator[Deployment]:
    work = REPO / ".cache" / "crash" / f"deployment-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    booted = start(sandbox, work)
    # the first change records each node's baseline
    first = booted.set_context(next(booted.contexts))
    assert first.returncode == 0, first.stdout + first.stderr
    yield booted
    stop(booted)


@pytest.mark.parametrize(
    ("command", "whose", "step"), CASES, ids=[f"{c}:{w}@{s.replace(' ', '-')}" for c, w, s in CASES]
)
def test_a_kill_at_any_step_of_any_node_is_recovered_whole(
    deployment: Deployment, command: str, whose: str, step: str
) -> None:
    assert run_case(deployment, command, whose, step) == []


def test_after_the_campaign_a_new_change_succeeds_and_verifies(deployment: Deployment) -> None:
    context = next(deployment.contexts)
    done = deployment.set_context(context)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["result"] == "applied"
    verified = deployment.ctxmgr("verify", "--json")
    assert json.loads(verified.stdout)["result"] in ("ok", "degraded"), verified.stdout
    assert deployment.head.served_max_model_len() == context
    assert deployment.check_whole(leftovers=True) == []
