"""One vLLM deployment over two nodes, changed as one: a real private systemd, real journald, real HTTP.

The two nodes here are two units of one private systemd (`local:UNIT`, each step a real `ctxmgr node`
subprocess): node 0 runs the API server, node 1 is `--headless`, as vLLM's own multi-node mode runs them
(shared/recipes/vllm-cpu-multinode.md). vLLM is the stand-in (vLLM 0.33's lines, a CUDA deployment);
tests/fleet/test_multinode_fleet.py does the same over ssh between network namespaces, and with the
real vLLM CPU build.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.ctxmgr_cli import ctxmgr_argv, run_ctxmgr
from tests.support.demo import (
    SEED_GPU_COUNT,
    SEED_GPU_GIB,
    SEED_WEIGHTS_GIB_PER_GPU,
    make_vllm_wrapper,
    standin_unit,
)
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.core.hardware import GIB, uniform_gpus
from vllm_ctxmgr.deployment.coordinator import Coordinator, DeploymentRequest
from vllm_ctxmgr.deployment.remote import Link, NodeAddress
from vllm_ctxmgr.deployment.wire import PlanningOptions
from vllm_ctxmgr.store import ServiceStore, State

HEAD, RANK1 = "vllm-mn-head", "vllm-mn-rank1"
# TP 8 x PP 2 over two 8-GPU nodes: each node one pipeline stage, the weights split over 16 GPUs
GPU_ARGS = [
    "--gpu-memory",
    f"{SEED_GPU_GIB}GiB",
    "--gpu-count",
    str(SEED_GPU_COUNT),
    "--weights-bytes",
    f"{SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT:.2f}GiB",
]


def node_unit(
    wrapper: Path, rank: int, port: int, master_port: int, environment: dict[str, str] | None = None
) -> str:
    text = standin_unit(
        wrapper,
        port=port,
        environment={"CTXMGR_STANDIN_WEIGHTS_GIB": str(SEED_WEIGHTS_GIB_PER_GPU / 2), **(environment or {})},
        description=f"vLLM GLM-5 node {rank} of 2 (stand-in, TP 8 x PP 2)",
    )
    flags = "--pipeline-parallel-size 2 --nnodes 2 "
    flags += f"--node-rank {rank} --master-addr 127.0.0.1 --master-port {master_port}"
    if rank > 0:
        flags += " --headless"
    return text.replace("--trust-remote-code", f"--trust-remote-code \\\n    {flags}")


def wait_serving(port: int) -> None:
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 90)


@pytest.fixture
def deployment(sandbox: Sandbox, install_unit, workdir: Path):  # type: ignore[no-untyped-def]
    """Two nodes of one deployment at 8192, running; yields (port of the head, unit paths, state dir)."""

    def make(worker_env: dict[str, str] | None = None) -> tuple[int, dict[str, Path], Path]:
        wrapper = make_vllm_wrapper(workdir)
        port, master = free_port(), free_port()
        paths = {}
        for rank, name in enumerate((HEAD, RANK1)):
            env = worker_env if rank == 1 else None
            unit = install_unit(
                f"{name}.service", node_unit(wrapper, rank, port if rank == 0 else free_port(), master, env)
            )
            paths[name] = sandbox.systemd.host_unit_dir / unit
        sandbox.systemd.start(f"{RANK1}.service")
        sandbox.systemd.start(f"{HEAD}.service")
        wait_serving(port)
        return port, paths, workdir / "state"

    return make


def served(port: int) -> int:
    return requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["max_model_len"]


def nodes_args() -> list[str]:
    return ["--node", f"local:{HEAD}", "--node", f"local:{RANK1}"]


def revisions(state: Path, service: str) -> list[Any]:
    return ServiceStore(state, f"{service}.service").revisions()


def test_every_node_gets_the_context_and_restarts_together(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    run = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        *nodes_args(),
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=300,
    )
    assert run.code == 0, run.stdout + run.stderr
    assert run.data["result"] == "applied" and run.data["changed"] is True
    assert [n["role"] for n in run.data["nodes"]] == ["head", "headless"]
    assert [n["stages"] for n in run.data["nodes"]] == [[0], [1]]
    for path in paths.values():
        assert "--max-model-len 200000" in path.read_text()
    assert served(port) == 200000
    change = run.data["change_id"]
    for service in (HEAD, RANK1):
        last = revisions(state, service)[-1]
        assert last.state is State.FINAL and last.deployment == change and last.max_model_len == 200000
    # the same again: nothing to change, nothing restarted
    pid = sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"]
    again = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        *nodes_args(),
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=300,
    )
    assert again.code == 0 and again.data["result"] == "unchanged", again.stdout + again.stderr
    assert sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"] == pid
    # each node's plan is split out, and held against what that node's own vLLM logged
    head, rank1 = run.data["nodes"]
    assert head["planned"]["gpus"] == rank1["planned"]["gpus"] == 8
    assert rank1["logged"]["max_model_len"] == 200000 and rank1["logged"]["available_kv_gib"] > 0
    # at the utilisation every unit keeps (the least that fits is one more figure): the plan's budget
    # is the one vLLM's ranks logged at the new start, within 2%
    assert run.data["gpu_memory_utilization"] == 0.9
    assert run.data["least_gpu_memory_utilization"] < 0.9
    for node in (head, rank1):
        logged_kv = node["logged"]["available_kv_gib"] * 2**30
        assert abs(node["planned"]["kv_budget_bytes"] - logged_kv) < 0.02 * logged_kv, node


def test_each_nodes_journal_calibrates_its_own_gpu_lines(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    """Node 1 (stage 1) loads 10 GiB more per GPU than the head: its ranks log that, and the smaller KV
    budget it leaves, in node 1's journal only. The plan's stage-1 lines are node 1's figures, and
    what node 1's vLLM logs at the new start is what was planned for it."""
    heavier = round(SEED_WEIGHTS_GIB_PER_GPU / 2 + 10, 2)
    port, _paths, state = deployment({"CTXMGR_STANDIN_WEIGHTS_GIB": str(heavier)})
    run = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                     "--yes", "--json", timeout=300)  # fmt: skip
    assert run.code == 0 and run.data["result"] == "applied", run.stdout + run.stderr
    assert served(port) == 200000
    head, rank1 = run.data["nodes"]
    print("per node planned / logged:", json.dumps([(n["planned"], n["logged"]) for n in (head, rank1)]))
    assert rank1["logged"]["model_loading_gib"] == heavier
    assert rank1["planned"]["weights_source"] == rank1["planned"]["kv_budget_source"] == "vllm log (node 1)"
    assert head["planned"]["weights_source"] == "vllm log"
    for node in (head, rank1):  # each node's weights as its own vLLM logged them, its budget within 2%
        assert node["planned"]["weights_bytes"] == int(node["logged"]["model_loading_gib"] * 2**30), node
        logged_kv = node["logged"]["available_kv_gib"] * 2**30
        assert abs(node["planned"]["kv_budget_bytes"] - logged_kv) < 0.02 * logged_kv, node
    # node 1's budget is 10 GiB below the head's: the smaller one sizes the deployment's pool
    gap = head["planned"]["kv_budget_bytes"] - rank1["planned"]["kv_budget_bytes"]
    assert abs(gap - 10 * 2**30) < 0.05 * 2**30
    pool = run.data["plan"]["capacity"][0]
    budgets = [g["kv_budget"]["bytes"] for g in run.data["plan"]["gpus"]]
    assert pool["num_gpu_blocks"] == min(budgets) // run.data["plan"]["null_block_bytes"]


def test_verify_and_rollback_cover_every_node(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    before = {name: path.read_text() for name, path in paths.items()}
    run = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        *nodes_args(),
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=300,
    )
    assert run.code == 0, run.stdout + run.stderr
    verified = run_ctxmgr(sandbox.pid, state, "deployment", "verify", *nodes_args(), "--json", timeout=300)
    assert verified.data["result"] in ("ok", "degraded") and verified.code in (0, 1), verified.stdout
    assert [n["max_model_len"] for n in verified.data["nodes"]] == [200000, 200000]

    back = run_ctxmgr(
        sandbox.pid, state, "deployment", "rollback", *nodes_args(), "--yes", "--json", timeout=300
    )
    assert back.code == 0 and back.data["result"] == "applied", back.stdout + back.stderr
    assert (back.data["previous_max_model_len"], back.data["max_model_len"]) == (200000, 8192)
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert served(port) == 8192
    last = revisions(state, RANK1)[-1]
    assert last.action == "rollback" and last.state is State.FINAL

    # a headless rank that is gone fails the deployment's verify, though the head still answers
    sandbox.systemd.stop(f"{RANK1}.service")
    gone = run_ctxmgr(sandbox.pid, state, "deployment", "verify", *nodes_args(), "--json", timeout=300)
    assert gone.code == 2 and gone.data["result"] == "failed", gone.stdout
    assert any(reason.startswith(f"local:{RANK1}: ") for reason in gone.data["reasons"])


def test_a_headless_rank_that_fails_rolls_every_node_back(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    # node 1's KV holds 100,000 tokens: 200,000 fails there with vLLM's KV-too-small error; 8,192 fits
    port, paths, state = deployment({"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "100000"})
    before = {name: path.read_text() for name, path in paths.items()}
    # the head's last start logged the deployment's pool (vLLM sizes it by the smallest rank's budget):
    # the plan learns it and refuses before anything is touched
    refused = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                         "--yes", "--json", timeout=400)  # fmt: skip
    assert refused.code == 3 and refused.data["result"] == "infeasible", refused.stdout + refused.stderr
    assert "100032" in refused.data["plan_text"]  # the tokens vLLM logged, learned from the running head
    assert {name: path.read_text() for name, path in paths.items()} == before
    # forced past the plan, vLLM refuses at start, and every node goes back
    run = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                     "--force", "--yes", "--json", timeout=400)  # fmt: skip
    assert run.code == 1, run.stdout + run.stderr
    assert run.data["result"] == "rolled-back"
    assert "KV cache" in run.data["reason"] and run.data["decisive_line"]
    assert not all(node["ok"] for node in run.data["nodes"])
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert served(port) == 8192
    for service in (HEAD, RANK1):
        assert revisions(state, service)[-1].state is State.ROLLED_BACK


class EditingLink(Link):
    """A Link that edits node 1's unit right after node 0 was written: the operator's hand between the
    plan and the write."""

    def __init__(self, base: list[str], path: Path) -> None:
        super().__init__(local_ctxmgr=tuple(base))
        object.__setattr__(self, "path", path)

    def call(  # type: ignore[override]
        self, host: str, args: Any, timeout: float, stdin: dict | None = None, label: str | None = None
    ) -> dict:
        answer = super().call(host, args, timeout, stdin, label)
        if args[:2] == ["node", "prepare"] and "--dry-run" not in args and args[-1] == HEAD:
            path: Path = self.path  # type: ignore[attr-defined]
            path.write_text(path.read_text().replace("TimeoutStopSec=10", "TimeoutStopSec=11"))
        return answer


def test_a_node_edited_between_the_plan_and_the_write_stops_the_change_before_any_restart(
    sandbox: Sandbox, deployment
) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    head_before = paths[HEAD].read_text()
    pid = sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"]
    link = EditingLink(ctxmgr_argv(sandbox.pid, state), paths[RANK1])
    request = DeploymentRequest(
        context=200000,
        nodes=(NodeAddress("local", HEAD), NodeAddress("local", RANK1)),
        link=link,
        default_gpus=uniform_gpus(SEED_GPU_COUNT, int(SEED_GPU_GIB * GIB)),
        planning=PlanningOptions(weights_bytes=int(SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT * GIB)),
    )
    result = Coordinator(request, state).set_context()
    assert str(result.result) == "rolled-back" and result.exit_code == 1
    assert "changed since the plan" in result.reason and f"local:{RANK1}" in result.reason
    assert paths[HEAD].read_text() == head_before  # node 0's write was put back
    assert "--max-model-len 8192" in paths[RANK1].read_text()  # node 1 keeps the operator's edit
    assert sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"] == pid  # nothing restarted
    assert served(port) == 8192
    assert revisions(state, HEAD)[-1].state is State.ROLLED_BACK


def test_an_unreachable_node_or_a_topology_vllm_refuses_changes_nothing(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    before = {name: path.read_text() for name, path in paths.items()}
    gone = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        "--node",
        f"local:{HEAD}",
        "--node",
        f"no-such-node.invalid:{RANK1}",
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=120,
    )
    assert gone.code != 0 and "no-such-node.invalid" in gone.data["error"], gone.stdout
    assert "nothing was changed" in gone.data["error"]
    # rank 1 without --headless: vLLM would start a second API server there; refused before any write
    paths[RANK1].write_text(paths[RANK1].read_text().replace(" --headless", ""))
    sandbox.systemd.daemon_reload()
    refused = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        *nodes_args(),
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=120,
    )
    assert refused.code == 2, refused.stdout + refused.stderr
    assert "headless" in refused.data["error"]
    assert paths[HEAD].read_text() == before[HEAD]
    assert revisions(state, HEAD) == [] and served(port) == 8192


def test_a_ray_deployment_changes_the_heads_vllm_alone_and_plans_with_every_nodes_gpus(
    sandbox: Sandbox, install_unit, workdir: Path
) -> None:  # type: ignore[no-untyped-def]
    """Ray: one `vllm serve --distributed-executor-backend ray` on the head places its workers on the
    Ray cluster; the nodes' `ray start` units carry no vLLM flag, so only the head's unit is written and
    restarted. Ray itself is not run here (a `ray` that only waits stands in for its process): what is
    tested is which units ctxmgr reads, plans from, writes and restarts. The Ray node is this machine
    under its other name (`localhost`), as two hosts to the topology."""
    wrapper = make_vllm_wrapper(workdir)
    ray = workdir / "bin" / "ray"
    ray.parent.mkdir(exist_ok=True)
    ray.write_text("#!/bin/sh\nexec sleep infinity\n")
    ray.chmod(0o755)
    port = free_port()
    head_text = standin_unit(
        wrapper, port=port, environment={"CTXMGR_STANDIN_WEIGHTS_GIB": str(SEED_WEIGHTS_GIB_PER_GPU / 2)}
    ).replace("--tensor-parallel-size 8", "--tensor-parallel-size 16 --distributed-executor-backend ray")
    head = install_unit(f"{HEAD}.service", head_text)
    worker = install_unit(
        "ray-worker.service",
        "[Unit]\nDescription=Ray worker node\n\n[Service]\n"
        f"ExecStart={ray} start --address 127.0.0.1:6379 --block\n",
    )
    sandbox.systemd.start(worker)
    sandbox.systemd.start(head)
    wait_serving(port)
    state = workdir / "state"
    worker_pid = sandbox.systemd.show(worker, "MainPID")["MainPID"]
    worker_text = (sandbox.systemd.host_unit_dir / worker).read_text()
    run = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        "--node",
        f"local:{HEAD}",
        "--node",
        "localhost:ray-worker",
        *GPU_ARGS,
        "--yes",
        "--json",
        timeout=300,
    )
    assert run.code == 0, run.stdout + run.stderr
    assert run.data["backend"] == "ray" and run.data["result"] == "applied"
    # the plan had both nodes' GPUs: 16 lines, ranks 0-7 on the head and 8-15 on the Ray worker
    assert len(run.data["plan"]["gpus"]) == 16
    assert [(n["role"], n["step"]) for n in run.data["nodes"]] == [("head", "final"), ("ray", "read")]
    assert served(port) == 200000
    assert (sandbox.systemd.host_unit_dir / worker).read_text() == worker_text
    assert sandbox.systemd.show(worker, "MainPID")["MainPID"] == worker_pid


def _start_and_wait_written(sandbox: Sandbox, state: Path, paths: dict[str, Path]) -> subprocess.Popen[str]:
    """A coordinator in the background, returned once it has written node 1 (every node is written
    before any restarts)."""
    proc = subprocess.Popen(
        ctxmgr_argv(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                    "--yes", "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "--max-model-len 200000" not in paths[RANK1].read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def test_sigterm_during_a_deployment_change_rolls_every_node_back(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    proc = _start_and_wait_written(sandbox, state, paths)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    data = json.loads(out)
    assert proc.returncode == 1 and data["result"] == "rolled-back", out + err
    assert "interrupted by SIGTERM" in data["reason"]
    for path in paths.values():
        assert "--max-model-len 8192" in path.read_text()
    assert served(port) == 8192
    assert [revisions(state, s)[-1].state for s in (HEAD, RANK1)] == [State.ROLLED_BACK] * 2


def test_a_killed_coordinator_is_finished_by_deployment_recover(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    port, paths, state = deployment()
    proc = _start_and_wait_written(sandbox, state, paths)
    proc.kill()  # SIGKILL: no handler runs; the nodes keep their revisions in progress
    proc.communicate(timeout=60)
    refused = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "100000", *nodes_args(), *GPU_ARGS,
                         "--yes", "--json", timeout=120)  # fmt: skip
    assert refused.code == 2 and "deployment recover" in refused.data["error"], refused.stdout
    done = run_ctxmgr(sandbox.pid, state, "deployment", "recover", *nodes_args(), "--json", timeout=300)
    assert done.code == 0 and done.data["result"] == "rolled-back", done.stdout + done.stderr
    # issue 29.16: both nodes were written back and restarted, and it says so
    assert done.data["changed"] is True and "was interrupted" in done.data["reason"], done.stdout
    for path in paths.values():
        assert "--max-model-len 8192" in path.read_text()
    assert served(port) == 8192
    again = run_ctxmgr(sandbox.pid, state, "deployment", "recover", *nodes_args(), "--json", timeout=120)
    assert again.code == 0 and again.data["result"] == "unchanged", again.stdout


def corrupting_ctxmgr(
    workdir: Path, base: list[str], trigger: list[str], answer: bytes, take_step: bool = True
) -> tuple[str, ...]:
    """A `ctxmgr` for `local` nodes that runs the real one and, where its words hold every word of
    `trigger` (and not --back), prints `answer` in place of the real answer: a node behind a hostile
    or broken ssh, after the step itself was taken (or, `take_step` False, without taking it)."""
    script = workdir / f"corrupting-ctxmgr-{len(list(workdir.glob('corrupting-ctxmgr*')))}.py"
    script.write_text(
        "import subprocess, sys\n"
        f"base, trigger, answer, take_step = {base!r}, {trigger!r}, {answer!r}, {take_step!r}\n"
        "args = sys.argv[1:]\n"
        "hit = all(t in args for t in trigger) and '--back' not in args\n"
        "if hit and not take_step:\n"
        "    sys.stdout.buffer.write(answer)\n"
        "    raise SystemExit(0)\n"
        "done = subprocess.run([*base, *args], stdin=sys.stdin, capture_output=True)\n"
        "sys.stdout.buffer.write(answer if hit else done.stdout)\n"
        "sys.stderr.buffer.write(done.stderr)\n"
        "raise SystemExit(0 if hit else done.returncode)\n"
    )
    return (sys.executable, str(script))


def test_a_node_answer_that_is_not_utf8_after_every_node_stopped_rolls_the_deployment_back(
    sandbox: Sandbox, deployment, workdir: Path
) -> None:  # type: ignore[no-untyped-def]
    """Issue 29.5: every node written and stopped, the head started, and its answer is not UTF-8: the
    head's failure, so every node goes back and restarts (not "unexpected error" with all down)."""
    port, paths, state = deployment()
    before = {name: path.read_text() for name, path in paths.items()}
    base = ctxmgr_argv(sandbox.pid, state)
    link = Link(local_ctxmgr=corrupting_ctxmgr(workdir, base, ["start", "--head"], b'{"ok": "\xff\xfe"}'))
    request = DeploymentRequest(
        context=200000,
        nodes=(NodeAddress("local", HEAD), NodeAddress("local", RANK1)),
        link=link,
        default_gpus=uniform_gpus(SEED_GPU_COUNT, int(SEED_GPU_GIB * GIB)),
        planning=PlanningOptions(weights_bytes=int(SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT * GIB)),
    )
    result = Coordinator(request, state).set_context()
    assert str(result.result) == "rolled-back" and result.exit_code == 1, result.reason
    assert result.reason.startswith(f"local:{HEAD}: its answer is not UTF-8"), result.reason
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert served(port) == 8192
    assert [revisions(state, s)[-1].state for s in (HEAD, RANK1)] == [State.ROLLED_BACK] * 2


def test_a_faulty_answer_to_finish_is_that_nodes_failure_and_recover_finds_its_revision(
    sandbox: Sandbox, deployment, workdir: Path
) -> None:  # type: ignore[no-untyped-def]
    """Issue 29.5 at the last step: every node serves the new length and node 1's answer to `finish` is
    faulty. That is node 1's failure (named, exit 1), with no rollback of a deployment that serves;
    nothing more is asked of node 1, so its revision is as the answer left it: final where node 1 took
    the step, in progress where it did not, and then the next change refuses and `deployment recover`
    finishes it (nothing written, nothing restarted)."""
    port, paths, state = deployment()
    base = ctxmgr_argv(sandbox.pid, state)
    nodes = (NodeAddress("local", HEAD), NodeAddress("local", RANK1))

    def change(context: int, take_step: bool) -> Any:
        corrupt = corrupting_ctxmgr(workdir, base, ["finish", RANK1], b'{"ok": "\xff\xfe"}', take_step)
        request = DeploymentRequest(
            context=context,
            nodes=nodes,
            link=Link(local_ctxmgr=corrupt),
            default_gpus=uniform_gpus(SEED_GPU_COUNT, int(SEED_GPU_GIB * GIB)),
            planning=PlanningOptions(weights_bytes=int(SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT * GIB)),
        )
        return Coordinator(request, state).set_context()

    # node 1 finished, its answer is garbled: its revision is final, as that step left it
    result = change(200000, take_step=True)
    assert str(result.result) == "applied" and result.exit_code == 1, result.reason
    assert f"local:{RANK1}: its answer is not UTF-8" in result.reason, result.reason
    assert [(n.step, n.ok) for n in result.nodes] == [("final", True), ("started", False)]
    assert served(port) == 200000
    assert [revisions(state, s)[-1].state for s in (HEAD, RANK1)] == [State.FINAL] * 2
    nothing = run_ctxmgr(sandbox.pid, state, "deployment", "recover", *nodes_args(), "--json", timeout=120)
    assert nothing.code == 0 and nothing.data["result"] == "unchanged", nothing.stdout + nothing.stderr

    # node 1 never took the step: its revision is left in progress, and the next change says so
    result = change(100000, take_step=False)
    assert str(result.result) == "applied" and result.exit_code == 1, result.reason
    assert "deployment recover" in result.reason
    assert revisions(state, HEAD)[-1].state is State.FINAL
    assert revisions(state, RANK1)[-1].state is State.RESTARTING
    refused = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "65536", *nodes_args(), *GPU_ARGS,
                         "--yes", "--json", timeout=120)  # fmt: skip
    assert refused.code == 2 and "deployment recover" in refused.data["error"], refused.stdout
    pid = sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"]
    done = run_ctxmgr(sandbox.pid, state, "deployment", "recover", *nodes_args(), "--json", timeout=300)
    assert done.code == 0 and done.data["result"] == "applied", done.stdout + done.stderr
    assert [revisions(state, s)[-1].state for s in (HEAD, RANK1)] == [State.FINAL] * 2
    for path in paths.values():
        assert "--max-model-len 100000" in path.read_text()
    assert served(port) == 100000
    assert sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"] == pid  # nothing restarted


def test_rollback_skips_a_failed_attempt_and_takes_to(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    """Issue 29.16: after a change that was rolled back, `deployment rollback` returns to before the
    last good change (as one service's rollback does), and `--to CHANGE` to what that change left."""
    # node 1's KV holds 100,000 tokens: 65,536 fits, 200,000 fails at start
    port, paths, state = deployment({"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "100000"})
    before = {name: path.read_text() for name, path in paths.items()}
    good = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "65536", *nodes_args(), *GPU_ARGS,
                      "--yes", "--json", timeout=400)  # fmt: skip
    assert good.code == 0 and good.data["result"] == "applied", good.stdout + good.stderr
    at_good = {name: path.read_text() for name, path in paths.items()}
    failed = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                        "--force", "--yes", "--json", timeout=400)  # fmt: skip
    assert failed.code == 1 and failed.data["result"] == "rolled-back", failed.stdout + failed.stderr
    back = run_ctxmgr(sandbox.pid, state, "deployment", "rollback", *nodes_args(), "--yes", "--json",
                      timeout=400)  # fmt: skip
    assert back.code == 0 and back.data["result"] == "applied", back.stdout + back.stderr
    assert (back.data["previous_max_model_len"], back.data["max_model_len"]) == (65536, 8192)
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert served(port) == 8192
    forward = run_ctxmgr(sandbox.pid, state, "deployment", "rollback", *nodes_args(), "--to",
                         good.data["change_id"], "--yes", "--json", timeout=400)  # fmt: skip
    assert forward.code == 0 and forward.data["result"] == "applied", forward.stdout + forward.stderr
    assert forward.data["max_model_len"] == 65536
    assert {name: path.read_text() for name, path in paths.items()} == at_good
    assert served(port) == 65536


def test_a_drifted_deployment_fails_verify_and_set_context_reconciles_it(
    sandbox: Sandbox, deployment
) -> None:  # type: ignore[no-untyped-def]
    """Issue 29.16: node 1 left at another length by hand is a failed check (exit 2, not UNKNOWN), and
    `deployment set-context N` writes every node to N with one restart, saying what it found."""
    port, paths, state = deployment()
    paths[RANK1].write_text(paths[RANK1].read_text().replace("--max-model-len 8192", "--max-model-len 4096"))
    sandbox.systemd.daemon_reload()
    verified = run_ctxmgr(sandbox.pid, state, "deployment", "verify", *nodes_args(), "--json", timeout=300)
    assert verified.code == 2 and verified.data["result"] == "failed", verified.stdout + verified.stderr
    drift = f"max_model_len differs between nodes: local:{HEAD} 8192, local:{RANK1} 4096"
    assert any(reason.startswith(drift) for reason in verified.data["reasons"]), verified.data["reasons"]
    pid = sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"]
    fixed = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "8192", *nodes_args(), *GPU_ARGS,
                       "--yes", "--json", timeout=400)  # fmt: skip
    assert fixed.code == 0 and fixed.data["result"] == "applied", fixed.stdout + fixed.stderr
    assert drift in fixed.data["reason"]
    for path in paths.values():
        assert "--max-model-len 8192" in path.read_text()
    assert sandbox.systemd.show(f"{HEAD}.service", "MainPID")["MainPID"] != pid  # restarted, once
    assert served(port) == 8192
    # issue 36 item 9: the head, whose unit already said 8192, records the change as every node does
    for service in (HEAD, RANK1):
        rows = run_ctxmgr(sandbox.pid, state, "history", "--service", service, "--json").data["revisions"]
        assert rows[-1]["state"] == "final" and fixed.data["change_id"] in json.dumps(rows[-1]), (
            service,
            rows,
        )
    again = run_ctxmgr(sandbox.pid, state, "deployment", "verify", *nodes_args(), "--json", timeout=300)
    assert again.code in (0, 1) and again.data["result"] in ("ok", "degraded"), again.stdout


def test_a_worker_that_fails_to_start_is_the_deployments_failure_at_once(
    sandbox: Sandbox, deployment
) -> None:  # type: ignore[no-untyped-def]
    """Issue 29.15: node 1 cannot start (a drop-in's ExecStartPre=/bin/false); the head would wait for
    its ranks for torch's 30 minutes. The coordinator watches node 1's unit while the head starts: its
    failure is the deployment's at once, the head is stopped, and the rollback (which cannot start node
    1 either) says so and leaves no node half up. The reason leads with node 1's own."""
    _port, paths, state = deployment()
    dropin = paths[RANK1].parent / f"{RANK1}.service.d" / "50-fault.conf"
    dropin.parent.mkdir(exist_ok=True)
    dropin.write_text("[Service]\nExecStartPre=/bin/false\n")
    sandbox.systemd.daemon_reload()
    started = time.monotonic()
    run = run_ctxmgr(sandbox.pid, state, "deployment", "set-context", "200000", *nodes_args(), *GPU_ARGS,
                     "--timeout", "10min", "--yes", "--json", timeout=400)  # fmt: skip
    took = time.monotonic() - started
    print(f"set-context with a worker that cannot start ended after {took:.0f} s")
    assert run.code == 5 and run.data["result"] == "rollback-failed", run.stdout + run.stderr
    assert took < 180, took  # two head starts waiting out torch's timeout would be an hour
    # node 1's own cause first, as systemd reports it, with the file that sets it
    assert run.data["reason"].startswith(
        f"local:{RANK1}: ExecStartPre=/bin/false in 50-fault.conf exited 1"
    ), run.data["reason"]
    rank1 = run.data["nodes"][1]
    assert not rank1["ok"] and rank1["reason"]
    states = [sandbox.systemd.show(f"{n}.service", "ActiveState")["ActiveState"] for n in (HEAD, RANK1)]
    assert states[0] != "active" and states[1] != "active", states  # no node half up


def test_the_heads_probe_takes_set_contexts_probe_options(sandbox: Sandbox, deployment) -> None:  # type: ignore[no-untyped-def]
    """`deployment set-context --probe-tokens N` reaches the head's probe (over the wire, StartStdin):
    250,000 tokens asked of a 200,000 context is vLLM's own 400, the change fails there and every node
    goes back (before: ctxmgr refused --probe-tokens by name)."""
    port, paths, state = deployment()
    before = {name: path.read_text() for name, path in paths.items()}
    run = run_ctxmgr(
        sandbox.pid,
        state,
        "deployment",
        "set-context",
        "200000",
        *nodes_args(),
        *GPU_ARGS,
        "--probe-tokens",
        "250000",
        "--long-probe",
        "--yes",
        "--json",
        timeout=300,
    )
    assert run.code == 1 and run.data["result"] == "rolled-back", run.stdout + run.stderr
    assert run.data["reason"].startswith(f"local:{HEAD}: the probe failed: ")
    assert "max_tokens=250000 cannot be greater than max_model_len=200000" in run.data["reason"]
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert served(port) == 8192
