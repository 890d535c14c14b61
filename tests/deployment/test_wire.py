"""The wire between a deployment's coordinator and `ctxmgr node STEP`: typed messages, checked at the
door at both ends (issue 27.2; 29.4, 29.5, 29.10's node fields).

The node end is the real `ctxmgr node` command fed a hostile request on stdin; the coordinator end is
the real Coordinator talking to a stand-in node (a script in place of `ctxmgr`, as a hostile ssh gives
one) whose answers are the ones the adversarial run sent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from vllm_ctxmgr.cli.deployment import _finish
from vllm_ctxmgr.core.hardware import GIB, uniform_gpus
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.verdict import Verdict
from vllm_ctxmgr.deployment.coordinator import (
    Coordinator,
    DeploymentRequest,
    plan_deployment,
    verify_deployment,
)
from vllm_ctxmgr.deployment.remote import Link, NodeAddress, NodeError
from vllm_ctxmgr.deployment.wire import (
    WIRE_VERSION,
    PlanAnswer,
    PrepareStdin,
    ShowAnswer,
    StartStdin,
    VerifyAnswer,
    VerifyStdin,
    WireError,
    check_context_flags,
)
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError

MASTER = "--nnodes 2 --master-addr 10.0.0.1 --master-port 29501"
HOSTILE_FLAGS = {
    "--max-model-len": "16384",
    "--worker-extension-cls": "attacker_pkg.Ext",
    "--trust-remote-code": "",
    "--model": "/tmp/evil",
}


def show_answer(rank: int, **fields: Any) -> dict[str, Any]:
    """A `node show` answer as a real node prints it (the fields node.show fills)."""
    argv = ["Qwen/Qwen3-8B", "-tp", "8", "--max-model-len", "8192", *MASTER.split(), "--node-rank", str(rank)]
    answer: dict[str, Any] = {
        "schema": 2,
        "command": "node show",
        "wire": WIRE_VERSION,
        "service": f"vllm-n{rank}.service",
        "unit_path": f"/etc/systemd/system/vllm-n{rank}.service",
        "unit_digest": "ab" * 32,
        "argv": argv + (["--headless"] if rank else []),
        "environment": {"HF_HOME": "/data/hf"},
        "vllm_version": "0.33.0",
        "active_state": "active",
        "gpus": None,
        "in_progress": None,
        "last_change": None,
        "logged": {
            "max_model_len": 8192,
            "available_kv_gib": 30.5,
            "kv_cache_tokens": 200000,
            "model_loading_gib": 15.2,
            "cuda_graph_gib": 0.5,
            "ready": True,
            "failure": None,
        },
        "observation": None,
    }
    answer.update(fields)
    return answer


def plan_answer(**fields: Any) -> dict[str, Any]:
    """A `node plan` answer (the head's plan of the deployment), trimmed to the keys the wire reads."""
    line = {name: {"bytes": 40 * GIB, "source": "estimate"} for name in ("total", "weights", "kv_budget")}
    answer: dict[str, Any] = {
        "wire": WIRE_VERSION,
        "service": "vllm-n0.service",
        "plan": {
            "schema": 2,
            "result": "feasible",
            "reason": "fits",
            "max_context": 65536,
            "gpus": [line] * 16,
        },
        "text": "plan text",
        "result": "feasible",
        "max_model_len": 16384,
        "flag_changes": {"--max-model-len": "16384"},
        "gpu_memory_utilization": 0.9,
        "least_gpu_memory_utilization": 0.8,
        "applies": "set-context would write: --max-model-len 16384",
        "learned": None,
    }
    answer.update(fields)
    return answer


def test_a_real_answer_passes_the_door_typed() -> None:
    shown = ShowAnswer.from_json(show_answer(1))
    assert shown.argv[-1] == "--headless" and shown.logged is not None and shown.logged.ready is True
    planned = PlanAnswer.from_json(plan_answer()).planned
    assert planned.max_context == 65536 and planned.gpus[0].kv_budget is not None
    assert planned.gpus[0].kv_budget.bytes == 40 * GIB


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"argv": [1, 2]}, r"argv\[0\]=1 is not text"),
        ({"environment": [1, 2]}, r"environment=\[1, 2\] is not an object"),
        ({"in_progress": "x"}, r"in_progress='x' is not a JSON object"),
        ({"in_progress": {"revision": -1, "state": "installed"}}, r"in_progress.revision=-1 is not in"),
        ({"unit_digest": "x"}, r"unit_digest is not a SHA-256 digest"),
        ({"logged": {"available_kv_gib": 9999.0}}, r"logged: available_kv_gib is above 4,096"),
        ({"logged": {"model_loading_gib": float("nan")}}, r"model_loading_gib=nan is not a finite number"),
        ({"observation": {"max_model_len": "x"}}, r"observation: max_model_len='x' is not a int"),
        (
            {"wire": 1},
            rf"speaks wire version 1, this ctxmgr {WIRE_VERSION}: install the same ctxmgr on every",
        ),
        ({"service": None}, r"service=None is not text"),
    ],
)
def test_a_wrongly_typed_show_answer_is_refused_in_one_line(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=message) as caught:
        ShowAnswer.from_json(show_answer(1, **fields))
    assert "\n" not in caught.value.message and caught.value.message.startswith("`node show` answer")


def test_a_plans_and_a_verifys_word_arrive_as_their_vocabulary_and_leave_as_the_word() -> None:
    """The wire reads a result into core's enum (PlanResult, Verdict) and writes back the word alone."""
    answer = PlanAnswer.from_json(plan_answer(result="infeasible"))
    assert answer.result is PlanResult.INFEASIBLE and answer.planned.result is PlanResult.FEASIBLE
    assert answer.result.exit_code == ExitCode.INFEASIBLE
    assert json.loads(json.dumps(answer.to_json())) == plan_answer(result="infeasible", env_changes={})
    verify = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "result": "degraded"}
    verified = VerifyAnswer.from_json(verify)
    assert verified.result is Verdict.DEGRADED and json.dumps(verified.to_json()["result"]) == '"degraded"'


@pytest.mark.parametrize(
    ("kind", "answer", "message"),
    [
        (PlanAnswer, plan_answer(result="fits"), r": result 'fits' is not feasible, infeasible or unknown$"),
        (
            PlanAnswer,
            plan_answer(plan={**plan_answer()["plan"], "result": "maybe"}),
            r": plan.result 'maybe' is not feasible, infeasible or unknown$",
        ),
        (PlanAnswer, plan_answer(result=3), r": result=3 is not text"),
        (
            VerifyAnswer,
            {"wire": WIRE_VERSION, "service": "vllm-n0.service", "result": "fine"},
            r"^`node verify` answer: result 'fine' is not ok, degraded or failed$",
        ),
    ],
)
def test_a_word_outside_the_vocabulary_is_refused_naming_its_words(
    kind: type[PlanAnswer] | type[VerifyAnswer], answer: dict[str, Any], message: str
) -> None:
    with pytest.raises(WireError, match=message):
        kind.from_json(answer)


def test_only_the_flags_a_context_change_writes_cross_the_wire() -> None:
    check_context_flags(
        {"--max-model-len": "16384", "--gpu-memory-utilization": "0.85"},
        {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
        "x",
    )
    refusals = [
        ({"--worker-extension-cls": "attacker_pkg.Ext"}, {}, "is not a flag a context change writes"),
        ({"--max-model-len": "16384 --trust-remote-code"}, {}, "is not a whole number"),
        ({"--max-model-len": "0"}, {}, "is not a whole number"),
        ({"--max-model-len": str(1 << 40)}, {}, "is not a whole number"),
        ({"--gpu-memory-utilization": "nan"}, {}, r"is not in \(0, 1\]"),
        ({"--gpu-memory-utilization": "1.5"}, {}, r"is not in \(0, 1\]"),
        # float() takes these; the unit would get a line break, a blank or another script's digits
        ({"--gpu-memory-utilization": "0.9\n"}, {}, r"is not in \(0, 1\]"),
        ({"--gpu-memory-utilization": " 0.9"}, {}, r"is not in \(0, 1\]"),
        ({"--gpu-memory-utilization": "\u0660.\u0669"}, {}, r"is not in \(0, 1\]"),
        ({}, {"LD_PRELOAD": "/tmp/evil.so"}, "is not an environment variable a context change writes"),
        ({}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1; rm"}, "is not 0 or 1"),
    ]
    for flags, env, message in refusals:
        with pytest.raises(WireError, match=message):
            check_context_flags(flags, env, "x")
    # at both doors: the head's plan answer on the coordinator, the request on the node
    with pytest.raises(WireError, match="--worker-extension-cls"):
        PlanAnswer.from_json(plan_answer(flag_changes=HOSTILE_FLAGS))
    with pytest.raises(WireError, match="--worker-extension-cls"):
        PrepareStdin.from_json({"wire": WIRE_VERSION, "flag_changes": HOSTILE_FLAGS}, "request")


def test_a_node_refuses_to_write_a_flag_a_context_change_does_not_change(workdir: Path) -> None:
    """The node end: `ctxmgr node prepare` fed the head-chosen `--worker-extension-cls` refuses it in
    one line, exit 2, before it reads (let alone writes) any unit."""
    request = {"wire": WIRE_VERSION, "flag_changes": HOSTILE_FLAGS}
    argv = [sys.executable, "-m", "vllm_ctxmgr", "--state-dir", str(workdir / "state"), "node", "prepare"]
    argv += ["vllm-n1.service", "--change", "c1", "--max-model-len", "16384", "--expect-digest", "ab" * 32]
    for extra in ([], ["--dry-run"]):
        done = subprocess.run([*argv, *extra, "--json"], input=json.dumps(request), capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        error = json.loads(done.stdout)["error"]
        assert "'--worker-extension-cls' is not a flag a context change writes" in error
        assert "\n" not in error and not (workdir / "state").exists()
    for bad in (b"\xff\xfe", b"[" * 100000, json.dumps({"wire": 0, "flag_changes": {}}).encode()):
        done = subprocess.run([*argv, "--json"], input=bad, capture_output=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "unexpected" not in json.loads(done.stdout)["error"]


def stand_in_node(workdir: Path, answers: dict[str, dict[str, Any]]) -> tuple[tuple[str, ...], Path]:
    """A `ctxmgr` for `local` nodes that answers each step from `answers` (by step and service) and
    logs every call: what a hostile node behind ssh sends."""
    log = workdir / "calls.log"
    script = workdir / "stand-in-node.py"
    script.write_text(
        "import json, sys\n"
        f"answers = json.loads({json.dumps(json.dumps(answers))})\n"
        "args = sys.argv[1:]\n"
        f"open({str(log)!r}, 'a').write(' '.join(args) + '\\n')\n"
        "step, service = args[1], [a for a in args if a.endswith('.service')][0]\n"
        f"open({str(log) + '.stdin'!r}, 'a').write(json.dumps([' '.join(args), sys.stdin.read()]) + '\\n')\n"
        "key = step + ' ' + service\n"
        "if step == 'prepare' and '--dry-run' not in args and 'write ' + service in answers:\n"
        "    key = 'write ' + service\n"  # the write itself, where its dry run answered otherwise
        f"calls = [c.split() for c in open({str(log)!r}).read().splitlines()]\n"
        "nth = sum(1 for c in calls if c[1] == step and service in c)\n"
        "if f'{nth} {key}' in answers:\n"
        "    key = f'{nth} {key}'\n"  # this step's nth call on this node, where it answers otherwise
        "if '--back' in args and 'back ' + key in answers:\n"
        "    key = 'back ' + key\n"  # the way back's step, where it answers otherwise
        "answer = answers[key]\n"
        "if answer.pop('signal', None):\n"  # the operator's SIGTERM to the coordinator, during this step
        "    import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(0.5)\n"
        "print(json.dumps(answer))\n"
    )
    return (sys.executable, str(script)), log


def requests_of(log: Path, step: str, service: str) -> list[dict[str, Any] | None]:
    """The request on stdin of each `node STEP ... SERVICE` call, in order (None: no request)."""
    calls = [json.loads(line) for line in Path(f"{log}.stdin").read_text().splitlines()]
    return [
        json.loads(stdin) if stdin else None
        for args, stdin in calls
        if args.split()[1] == step and service in args.split()
    ]


def walk_answers(**overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A stand-in node's answer to every step of a two-node change that serves (show, plan, prepare,
    stop, start, check, finish; restore and settle for a rollback), as real nodes give them."""
    answers: dict[str, dict[str, Any]] = {"plan vllm-n0.service": plan_answer()}
    for rank in (0, 1):
        service = f"vllm-n{rank}.service"
        wire = {"wire": WIRE_VERSION, "service": service}
        answers |= {
            f"show {service}": show_answer(rank),
            f"prepare {service}": {**wire, "unit_path": f"/etc/systemd/system/{service}", "changed": True,
                                   "diff": "-8192\n+16384", "revision": 5},
            f"stop {service}": {**wire, "active_state": "inactive"},
            f"start {service}": {**wire, "ok": True, "cursor": "s=1", "revision": 5},
            f"check {service}": {**wire, "ok": True, "active_state": "active", "max_model_len": 16384},
            f"finish {service}": {**wire, "ok": True, "revision": 5, "state": "final"},
            f"restore {service}": {**wire, "ok": True, "revision": 5, "state": "rolling-back"},
            f"settle {service}": {**wire, "ok": True, "revision": 5, "state": "rolled-back"},
        }  # fmt: skip
    return answers | overrides


def two_node_request(workdir: Path, answers: dict[str, dict[str, Any]]) -> tuple[DeploymentRequest, Path]:
    ctxmgr, log = stand_in_node(workdir, answers)
    request = DeploymentRequest(
        context=16384,
        nodes=(NodeAddress("local", "vllm-n0.service"), NodeAddress("local", "vllm-n1.service")),
        link=Link(local_ctxmgr=ctxmgr),
        default_gpus=uniform_gpus(8, 80 * GIB),
    )
    return request, log


def test_the_coordinator_refuses_a_heads_plan_that_names_another_flag(workdir: Path) -> None:
    """The coordinator end: a head whose plan says `--worker-extension-cls` for every worker is refused
    with one line naming it, and no node is asked to write anything."""
    answers = {
        "show vllm-n0.service": show_answer(0),
        "show vllm-n1.service": show_answer(1),
        "plan vllm-n0.service": plan_answer(flag_changes=HOSTILE_FLAGS),
    }
    request, log = two_node_request(workdir, answers)
    with pytest.raises(
        NodeError, match=r"^local:vllm-n0.service: `node plan` answer: '--worker-extension-cls'"
    ):
        Coordinator(request, workdir / "state").set_context()
    assert "prepare" not in log.read_text()


def test_a_wrongly_typed_node_answer_is_refused_with_the_nodes_name(workdir: Path) -> None:
    answers = {
        "show vllm-n0.service": show_answer(0),
        "show vllm-n1.service": show_answer(1, in_progress="x"),
    }
    request, log = two_node_request(workdir, answers)
    with pytest.raises(NodeError) as caught:
        Coordinator(request, workdir / "state").set_context()
    assert caught.value.message == (
        "cannot read every node, nothing was changed: local:vllm-n1.service: "
        "`node show` answer: in_progress='x' is not a JSON object"
    )
    assert "plan" not in log.read_text()


def test_rollback_goes_before_the_last_good_change_or_to_the_one_named(workdir: Path) -> None:
    """Issue 29.16, the coordinator's choice: a rolled-back attempt (c-b) is skipped, as one service's
    rollback skips it; `--to` takes a change id or, as one service's rollback does, a revision number
    (the head's, as the collection's `to: 3` passes it)."""
    made = [
        {"change": "c-a", "revision": 3, "state": "final", "max_model_len": 16384,
         "previous_max_model_len": 8192},
        {"change": "c-b", "revision": 4, "state": "rolled-back", "max_model_len": 32768,
         "previous_max_model_len": 16384},
    ]  # fmt: skip
    answers = {
        f"{step} vllm-n{rank}.service": answer
        for rank in (0, 1)
        for step, answer in (
            ("show", show_answer(rank, deployment_changes=made, last_change=made[-1])),
            ("prepare", {"wire": WIRE_VERSION, "service": f"vllm-n{rank}.service", "unit_path": "/u",
                         "changed": True, "diff": "-8192\n+16384"}),
        )
    }  # fmt: skip
    for to, context, words in (
        (None, 8192, "--undo c-a"),
        ("3", 16384, "--back-to c-a"),
        ("c-a", 16384, "--back-to c-a"),
    ):
        request, log = two_node_request(workdir, answers)
        request.dry_run = True
        result = Coordinator(request, workdir / "state").rollback(to)
        assert (str(result.result), result.max_model_len) == ("dry-run", context)
        prepared = [line for line in log.read_text().splitlines() if line.startswith("node prepare")]
        assert len(prepared) == 2 and all(words in line for line in prepared), prepared
        log.unlink()
    request, _log = two_node_request(workdir, answers)
    with pytest.raises(UsageError, match=r"no final revision of deployment change c-b there"):
        Coordinator(request, workdir / "state").rollback("4")


def test_the_probe_options_reach_the_heads_start_over_the_wire(workdir: Path) -> None:
    """`deployment set-context --probe-tokens N --long-probe`: the head's `node start` gets them in its
    request (StartStdin), checked at the door; a rollback's start gets the plain probe."""
    request, log = two_node_request(workdir, walk_answers())
    request.probe_tokens, request.long_probe = 1000, True
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "applied", result.reason
    expected = {"wire": WIRE_VERSION, "probe_tokens": 1000, "long_probe": True}
    assert requests_of(log, "start", "vllm-n0.service") == [expected]  # the head
    assert requests_of(log, "start", "vllm-n1.service") == [None]  # a headless rank: no probe

    failing = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "ok": False, "reason": "the probe failed"}
    (workdir / "again").mkdir()
    request, log = two_node_request(workdir / "again", walk_answers(**{"start vllm-n0.service": failing}))
    request.probe_tokens = 1000
    result = Coordinator(request, workdir / "again" / "state").set_context()
    assert str(result.result) == "rollback-failed", result.reason
    starts = requests_of(log, "start", "vllm-n0.service")
    assert [r and r["probe_tokens"] for r in starts] == [1000, None]  # forward, then --back

    for bad in (0, -1, 1 << 40, "1000", 1.5, True):
        with pytest.raises(WireError, match=r"request: probe_tokens="):
            StartStdin.from_json({"wire": WIRE_VERSION, "probe_tokens": bad}, "request")


def test_a_node_that_cannot_record_the_rollback_is_named(workdir: Path) -> None:
    """Issue 29.5 at the last step: a change that fails at the head's probe is rolled back; node 1's
    `settle` answer is not one the wire carries, so its revision stays in progress there. The result
    names it (before: the answer was dropped, and the next change found node 1 "still rolling-back")."""
    failing = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "ok": False, "reason": "the probe failed"}
    answers = walk_answers(
        **{"start vllm-n0.service": failing, "settle vllm-n1.service": {"wire": WIRE_VERSION}}
    )
    request, _log = two_node_request(workdir, answers)
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "rollback-failed"  # the stand-in head's start fails again on the way back
    assert "; the rollback is not recorded on local:vllm-n1.service: `node settle` answer: no service" in (
        result.reason
    )
    assert [(n.service, n.ok) for n in result.nodes] == [
        ("vllm-n0.service", False),
        ("vllm-n1.service", False),
    ]


def test_a_dry_run_on_a_drifted_deployment_says_what_it_found(workdir: Path) -> None:
    """Issue 29.16: node 1 left at 4096 by hand; `deployment set-context 16384 --dry-run` prints the
    diffs that reconcile it and says why (before: only "dry run: nothing was written or restarted")."""
    drifted = show_answer(1, argv=[w if w != "8192" else "4096" for w in show_answer(1)["argv"]])
    request, _log = two_node_request(workdir, walk_answers(**{"show vllm-n1.service": drifted}))
    request.dry_run = True
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "dry-run"
    assert result.reason == (
        "dry run: nothing was written or restarted; max_model_len differs between nodes: "
        "local:vllm-n0.service 8192, local:vllm-n1.service 4096: every node is written to 16384"
    )


# The JSON a deployment command prints, key for key in its order: the automation contract (Ansible's
# modules and scripts read these), pinned so a change of the result's type cannot move or drop one.
DEPLOYMENT_KEYS = [
    "schema", "command", "deployment", "action", "result", "changed", "exit_code", "change_id",
    "max_model_len", "previous_max_model_len", "gpu_memory_utilization", "least_gpu_memory_utilization",
    "reason", "decisive_line", "suggestion", "backend", "nodes", "plan", "plan_text", "timings", "diff",
    "dry_run",
]  # fmt: skip
NODE_KEYS = [
    "host", "service", "role", "node_rank", "stages", "revision", "diff", "step", "ok", "reason", "planned",
    "logged",
]  # fmt: skip


def printed(capsys: pytest.CaptureFixture[str], result: Any, dry_run: bool = False) -> tuple[int, Any]:
    """What `ctxmgr deployment ... --json` prints for `result`, and its exit code."""
    with pytest.raises(SystemExit) as exited:
        _finish(result, True, dry_run=dry_run)
    return int(exited.value.code or 0), json.loads(capsys.readouterr().out)


def test_every_deployment_command_prints_the_same_json_fields(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27.1: the deployment's result is one change result carrying its nodes; what each command
    prints stays field for field (and value for value) what it printed as a DeploymentResult of its own."""
    failing = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "ok": False, "reason": "the probe failed"}
    unwritable = {"wire": WIRE_VERSION, "service": "vllm-n1.service"}  # no unit_path: refused at the door
    change, infeasible = Coordinator.set_context, plan_answer(result="infeasible")
    runs: dict[str, tuple[dict[str, dict[str, Any]], Any, bool]] = {
        "applied": (walk_answers(), change, False),
        "rollback-failed": (walk_answers(**{"start vllm-n0.service": failing}), change, False),
        "put-back": (walk_answers(**{"write vllm-n1.service": unwritable}), change, False),
        "put-back-failed": (walk_answers(**{"write vllm-n1.service": unwritable,
                                            "restore vllm-n0.service": unwritable}), change, False),
        "dry-run": (walk_answers(), change, True),
        "infeasible": (walk_answers(**{"plan vllm-n0.service": infeasible}), change, False),
        "recover": (walk_answers(), Coordinator.recover, False),
        "plan": (walk_answers(), lambda c: plan_deployment(c.request, workdir / "plan-state"), False),
    }  # fmt: skip
    seen: dict[str, tuple[int, Any]] = {}
    for name, (answers, run, dry_run) in runs.items():
        (workdir / name).mkdir()
        request, _log = two_node_request(workdir / name, answers)
        request.dry_run = dry_run
        seen[name] = printed(capsys, run(Coordinator(request, workdir / name / "state")), dry_run)
        assert list(seen[name][1]) == DEPLOYMENT_KEYS, name
        assert [list(n) for n in seen[name][1]["nodes"]] == [NODE_KEYS, NODE_KEYS], name
    code, data = seen["applied"]
    assert code == 0 and set(data["timings"]) == {"write_s", "start_s", "total_s"}
    assert data["change_id"].startswith(data["deployment"] + "-")
    pinned = {k: v for k, v in data.items() if k not in ("change_id", "timings", "nodes", "plan")}
    assert pinned == {
        "schema": 2, "command": "deployment set-context", "deployment": data["deployment"],
        "action": "set-context", "result": "applied", "changed": True, "exit_code": 0, "max_model_len": 16384,
        "previous_max_model_len": 8192, "gpu_memory_utilization": 0.9, "least_gpu_memory_utilization": 0.8,
        "reason": "every node runs max_model_len 16384; the head served the context-sized probe",
        "decisive_line": "", "suggestion": "", "backend": "mp", "plan_text": "plan text",
        "diff": "# node 0: local:vllm-n0.service\n-8192\n+16384\n"
                "# node 1: local:vllm-n1.service\n-8192\n+16384",
        "dry_run": False,
    }  # fmt: skip
    assert data["plan"] == plan_answer()["plan"]
    head = {k: v for k, v in data["nodes"][0].items() if k not in ("planned", "logged")}
    assert head == {
        "host": "local", "service": "vllm-n0.service", "role": "head", "node_rank": 0, "stages": [0],
        "revision": 5, "diff": "-8192\n+16384", "step": "final", "ok": True, "reason": "",
    }  # fmt: skip
    assert data["nodes"][1]["planned"]["kv_budget_bytes"] == 40 * GIB
    assert data["nodes"][1]["logged"] == show_answer(1)["logged"]
    # the ways back and the ends before any write: result, exit code and reason as before
    ends = {name: (code, d["result"], d["changed"], d["reason"], d["change_id"] is None)
            for name, (code, d) in seen.items() if name != "applied"}  # fmt: skip
    assert ends == {
        "rollback-failed": (5, "rollback-failed", False, "local:vllm-n0.service: the probe failed; and the "
                            "rollback failed too: local:vllm-n0.service: the probe failed", False),
        "put-back": (1, "rolled-back", False, "nothing was restarted: local:vllm-n1.service: `node prepare` "
                     "answer: no unit_path", False),
        # (the reason does not say which node's restore failed: as before)
        "put-back-failed": (5, "rollback-failed", False, "nothing was restarted: local:vllm-n1.service: "
                            "`node prepare` answer: no unit_path", False),
        "dry-run": (0, "dry-run", True, "dry run: nothing was written or restarted", True),
        "infeasible": (3, "infeasible", False, "fits", True),
        "recover": (0, "unchanged", False,
                    "no node has a deployment change in progress: nothing to recover", True),
        "plan": (0, "feasible", False, "fits", True),
    }  # fmt: skip


def test_a_signal_rolls_every_node_back_and_a_second_one_leaves_the_change_to_recover(workdir: Path) -> None:
    """The deployment's walk under the one signal guard of every walk (states.guard_signals): SIGTERM
    while a node is written rolls every node back (rolled-back, exit 1); another while the way back
    runs stops at once, exit 5, and says what is left for `deployment recover`."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("only the main thread takes signals")
    written = {"wire": WIRE_VERSION, "service": "vllm-n1.service", "unit_path": "/u", "changed": True,
               "diff": "-8192\n+16384", "revision": 5, "signal": True}  # fmt: skip
    (workdir / "once").mkdir()
    request, log = two_node_request(workdir / "once", walk_answers(**{"write vllm-n1.service": written}))
    result = Coordinator(request, workdir / "once" / "state").set_context()
    assert (str(result.result), result.exit_code) == ("rolled-back", ExitCode.ERROR)
    assert result.reason == "ctxmgr was interrupted by SIGTERM"
    assert "node stop" not in log.read_text().split("node restore")[0]  # nothing restarted before
    again = {**walk_answers()["restore vllm-n0.service"], "signal": True}
    (workdir / "twice").mkdir()
    answers = walk_answers(**{"write vllm-n1.service": written, "restore vllm-n0.service": again})
    request, _log = two_node_request(workdir / "twice", answers)
    coordinator = Coordinator(request, workdir / "twice" / "state")
    with pytest.raises(CtxmgrError) as stopped:
        coordinator.set_context()
    assert stopped.value.exit_code == ExitCode.ROLLBACK_FAILED
    assert stopped.value.message == (
        f"interrupted again by SIGTERM while rolling back: change {coordinator.result.change_id} is left in "
        "progress on its nodes; run `ctxmgr deployment recover` with the same nodes"
    )


def test_deployment_verify_takes_long_probe_to_the_heads_verify(workdir: Path) -> None:
    """`deployment verify --long-probe` (refused as no such option before): the head's `node verify`
    gets it in its request (VerifyStdin), as set-context's reaches the head's start; a headless rank's
    check gets none. Checked at the door on the node."""
    verified = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "result": "ok", "max_model_len": 8192,
                "probe_ok": True}  # fmt: skip
    check = {"wire": WIRE_VERSION, "service": "vllm-n1.service", "ok": True, "active_state": "active",
             "max_model_len": 8192}  # fmt: skip
    answers = walk_answers(**{"verify vllm-n0.service": verified, "check vllm-n1.service": check})
    for long_probe in (True, False):
        (workdir / str(long_probe)).mkdir()
        request, log = two_node_request(workdir / str(long_probe), answers)
        request.long_probe = long_probe
        data = verify_deployment(request, workdir / "state")
        assert data["result"] == "ok", data
        assert requests_of(log, "verify", "vllm-n0.service") == [
            {"wire": WIRE_VERSION, "long_probe": long_probe}
        ]
        assert requests_of(log, "check", "vllm-n1.service") == [None]
    for bad in ("yes", 1, None):
        with pytest.raises(WireError, match=r"request: long_probe="):
            VerifyStdin.from_json({"wire": WIRE_VERSION, "long_probe": bad}, "request")
    # the CLI takes it (before: "no such option --long-probe")
    argv = [sys.executable, "-m", "vllm_ctxmgr", "deployment", "verify", "--long-probe", "--help"]
    assert subprocess.run(argv, capture_output=True, text=True, timeout=60).returncode == 0


@pytest.mark.parametrize(
    ("finish", "fault"),
    [
        ({"ok": True, "revision": 5, "state": "final"}, None),
        (
            {"ok": False, "revision": 5, "state": "probed", "reason": "disk full"},
            "`node finish` failed: disk full",
        ),
        (
            {"ok": True, "revision": 5, "state": "probed"},
            "`node finish` failed: its revision is probed, not final",
        ),
        ({"ok": True, "revision": -5, "state": "final"}, "`node finish` answer: revision=-5 is not in"),
    ],
)
def test_a_faulty_finish_answer_is_that_nodes_failure(
    workdir: Path, finish: dict[str, Any], fault: str | None
) -> None:
    """Issue 29.5 at the finish step: every node served, node 1's answer to `finish` is faulty (said
    failed, not final, or refused at the door): applied, but exit 1, node 1 named with its fault, and
    nothing more asked of it (no restore, no settle: the deployment serves)."""
    answers = walk_answers(**{"finish vllm-n1.service": {"wire": WIRE_VERSION, "service": "vllm-n1.service",
                                                         **finish}})  # fmt: skip
    request, log = two_node_request(workdir, answers)
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "applied" and result.changed
    steps = [line.split()[1] for line in log.read_text().splitlines()]
    assert "restore" not in steps and "settle" not in steps
    if fault is None:
        assert result.exit_code == 0 and [n.step for n in result.nodes] == ["final", "final"]
        return
    assert result.exit_code == 1, result.reason
    assert f"local:vllm-n1.service: {fault}" in result.reason and "deployment recover" in result.reason
    assert [(n.step, n.ok) for n in result.nodes] == [("final", True), ("started", False)]
    assert fault in result.nodes[1].reason


def test_recover_keeps_the_reason_the_change_failed_and_adds_its_own(workdir: Path) -> None:
    """A change failed (the head's KV check) and its coordinator died while rolling back: `deployment
    recover` put every node back, but wrote only "was interrupted" into the nodes' revisions and the
    deployment's record, replacing why the change had failed. The failure stays first, recover's own
    reason after it."""
    failed = "local:vllm-n0.service: vLLM refused the KV cache: 100,032 tokens fit, 200,000 were asked"
    in_progress = {"revision": 5, "state": "restarting", "change": "c-x"}
    answers = walk_answers(
        **{f"show vllm-n{rank}.service": show_answer(rank, in_progress=in_progress) for rank in (0, 1)}
    )
    request, log = two_node_request(workdir, answers)
    coordinator = Coordinator(request, workdir / "state")
    coordinator.store.write_json(
        "last-change.json", {"state": "rolling-back", "change_id": "c-x", "reason": failed}
    )
    result = coordinator.recover()
    assert str(result.result) == "rolled-back" and result.exit_code == 0, result.reason
    kept = f"{failed}; the deployment change c-x was interrupted while rolling back"
    assert result.reason.startswith(kept + ": every node it wrote has its previous unit back"), result.reason
    for rank in (0, 1):
        assert requests_of(log, "restore", f"vllm-n{rank}.service") == [
            {"wire": WIRE_VERSION, "reason": kept}
        ]
    assert (coordinator.store.read_json("last-change.json") or {})["reason"].startswith(kept)
    # a record of another change (or none) is not this change's reason
    coordinator.store.write_json(
        "last-change.json", {"state": "rolling-back", "change_id": "c-y", "reason": "x"}
    )
    (workdir / "again").mkdir()
    request, log = two_node_request(workdir / "again", answers)
    again = Coordinator(request, workdir / "state").recover()
    assert again.reason.startswith("the deployment change c-x was interrupted: every node"), again.reason


@pytest.mark.parametrize(
    ("made", "now"),
    [
        ([{"change": "c-z", "revision": 5, "state": "final", "max_model_len": 16384}], "final"),
        ([], "interrupted"),
    ],
)
def test_recover_settles_a_record_its_dead_coordinator_left_under_way(
    workdir: Path, made: list[dict[str, Any]], now: str
) -> None:
    """The coordinator died after every node's finish (or before any node's write): no node has the
    change in progress, so recover has nothing to do on the nodes, but the deployment's record still
    said "finishing" ("writing") for ever. It now says what the nodes' revisions say; a settled record
    and one of another change's nodes are left as they are."""
    answers = walk_answers(**{f"show vllm-n{rank}.service": show_answer(rank, deployment_changes=made)
                              for rank in (0, 1)})  # fmt: skip
    request, log = two_node_request(workdir, answers)
    coordinator = Coordinator(request, workdir / "state")
    coordinator.store.write_json("last-change.json", {"state": "finishing", "change_id": "c-z", "reason": ""})
    result = coordinator.recover()
    assert (str(result.result), result.exit_code, result.changed) == ("unchanged", 0, False)
    said = f"the record of change c-z said finishing and now says {now}, as its nodes' revisions do"
    assert result.reason == f"no node has a deployment change in progress: nothing to recover; {said}"
    record = coordinator.store.read_json("last-change.json") or {}
    assert (record["state"], record["reason"]) == (now, said)
    steps = [line.split()[1] for line in log.read_text().splitlines()]
    assert set(steps) == {"show"}  # nothing asked of any node but what it holds
    # run again: the record is settled, so nothing more is said or written
    (workdir / "again").mkdir()
    request, _log = two_node_request(workdir / "again", answers)
    again = Coordinator(request, workdir / "state").recover()
    assert again.reason == "no node has a deployment change in progress: nothing to recover"
    assert (Coordinator(request, workdir / "state").store.read_json("last-change.json") or {}) == record


@pytest.mark.parametrize("step", ["restore", "settle"])
def test_a_node_that_refuses_its_restore_or_settle_is_not_reported_rolled_back(
    workdir: Path, step: str
) -> None:
    """Issue 36 item 10: node 1 answers `ok: false` to the way back's restore (or settle): the
    deployment is not reported rolled back as if it had put its unit back (or recorded it)."""
    failing = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "ok": False, "reason": "the probe failed"}
    refused = {
        "wire": WIRE_VERSION,
        "service": "vllm-n1.service",
        "ok": False,
        "reason": "lock held by pid 7",
    }
    answers = walk_answers(
        **{
            "start vllm-n0.service": failing,  # the change fails at the head's start; its way back starts
            "back start vllm-n0.service": walk_answers()["start vllm-n0.service"],
            f"{step} vllm-n1.service": refused,
        }
    )
    request, _log = two_node_request(workdir, answers)
    result = Coordinator(request, workdir / "state").set_context()
    assert "lock held by pid 7" in result.reason and "local:vllm-n1.service" in result.reason, result.reason
    assert result.exit_code != 0
    if step == "restore":
        assert str(result.result) == "rollback-failed", result.reason
        assert "deployment recover" in result.reason
    assert [(n.service, n.ok) for n in result.nodes][1] == ("vllm-n1.service", False)


def test_the_operators_timeout_reaches_the_heads_start(workdir: Path) -> None:
    """Issue 36 item 7: `deployment set-context --timeout 7min` bounds the head's `node start` (its own
    --timeout), not only the coordinator's wait for its answer: before, the head watched its start for
    its default 30 minutes whatever the operator gave."""
    request, log = two_node_request(workdir, walk_answers())
    request.start_timeout = 420.0
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "applied", result.reason
    head = [
        line.split()
        for line in log.read_text().splitlines()
        if line.split()[1] == "start" and "vllm-n0.service" in line
    ]
    assert head and all(words[words.index("--timeout") + 1] == "420" for words in head), head
    # and the node's own parser takes what is sent
    from vllm_ctxmgr.cli.main import main

    node = main.get_command(None, "node").get_command(None, "start")  # type: ignore[arg-type, union-attr]
    words = head[0][2:]
    parsed = node.make_context("start", [w for w in words if w != "--json"]).params  # type: ignore[union-attr]
    assert parsed["timeout"] == 420.0


@pytest.mark.parametrize("step", ["stop", "start"])
def test_one_node_that_fails_on_the_way_back_does_not_leave_every_node_stopped(
    workdir: Path, step: str
) -> None:
    """Issue 36 item 8: the change fails at the head's start; on the way back node 1's stop (or start)
    fails. Before, the way back ended there with every node stopped; now every node that can start is
    started (the head included), and the deployment is rollback-failed with node 1 named."""
    failing = {"wire": WIRE_VERSION, "service": "vllm-n0.service", "ok": False, "reason": "the probe failed"}
    answers = walk_answers(
        **{
            "start vllm-n0.service": failing,
            "back start vllm-n0.service": walk_answers()["start vllm-n0.service"],
            f"2 {step} vllm-n1.service": {"wire": WIRE_VERSION},  # an answer the wire refuses
        }
    )
    request, log = two_node_request(workdir, answers)
    result = Coordinator(request, workdir / "state").set_context()
    assert str(result.result) == "rollback-failed", result.reason
    assert f"local:vllm-n1.service did not {step}" in result.reason, result.reason
    assert "deployment recover" in result.reason, result.reason
    calls = [line.split() for line in log.read_text().splitlines()]
    back_starts = [c for c in calls if c[1] == "start" and "--back" in c]
    assert any("vllm-n0.service" in c for c in back_starts), calls  # the head started again
    assert [(n.service, n.ok) for n in result.nodes][1] == ("vllm-n1.service", False)
