"""An operator's conventions, against a real private systemd and journald, with the stand-in vLLM.

- every change is in the journal under SYSLOG_IDENTIFIER=ctxmgr, at a priority alerting can use,
  with CTXMGR_* fields (`journalctl -t ctxmgr CTXMGR_SERVICE=...` is a service's history);
- a service systemd does not know is a usage error (exit 2), and nothing is written for it;
- an alias (a symlinked unit name) is the real unit: one lock, one journal, one history.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.change.planning import imported_observation
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.probe import wait_until_serving


def start_service(sandbox: Sandbox, install_unit, workdir: Path, name: str, **unit_kw) -> int:  # type: ignore[no-untyped-def]
    import time

    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port, **unit_kw))
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return port


def ctxmgr_journal(sandbox: Sandbox, unit: str) -> list[dict[str, str]]:
    argv = sandbox.systemd.command(
        "journalctl", "-t", "ctxmgr", f"CTXMGR_SERVICE={unit}", "-o", "json", "--no-pager"
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_changes_are_in_the_journal_with_priority_and_fields(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-jl"
    start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "150000"}
    )
    state = workdir / "state"
    # forced past the plan, vLLM refuses the KV cache: rolled back
    failed = run_ctxmgr(sandbox.pid, state, "set-context", "200000", "--service", name, *offline_gpu_args(),
                        "--yes", "--json", "--force")  # fmt: skip
    assert failed.code == 1 and failed.data["result"] == "rolled-back", failed.stderr
    args = ("set-context", "16384", "--service", name, *offline_gpu_args(), "--yes", "--json")
    ok = run_ctxmgr(sandbox.pid, state, *args)
    assert ok.code == 0, ok.stderr
    entries = ctxmgr_journal(sandbox, f"{name}.service")
    by_result = {e["CTXMGR_RESULT"]: e for e in entries}
    applied, rolled_back = by_result["applied"], by_result["rolled-back"]
    assert applied["SYSLOG_IDENTIFIER"] == "ctxmgr" and applied["PRIORITY"] == "6"
    assert (applied["CTXMGR_MAX_MODEL_LEN"], applied["CTXMGR_PREVIOUS_MAX_MODEL_LEN"]) == ("16384", "8192")
    assert applied["CTXMGR_ACTION"] == "set-context" and applied["CTXMGR_REVISION"].isdigit()
    assert "16384" in applied["MESSAGE"]
    assert rolled_back["PRIORITY"] == "4"  # warning: what alerting watches
    assert rolled_back["CTXMGR_EXIT_CODE"] == "1" and "KV cache" in rolled_back["MESSAGE"]


def test_a_service_systemd_does_not_know_is_a_usage_error_and_nothing_is_written(sandbox, workdir) -> None:  # type: ignore[no-untyped-def]
    state = workdir / "state"
    for args in (
        ("set-context", "16384", "--service", "vllm-typo", *offline_gpu_args(), "--yes"),
        ("set-context", "16384", "--service", "vllm-typo", *offline_gpu_args(), "--dry-run"),
        ("rollback", "--service", "vllm-typo", "--yes"),
        ("recover", "--service", "vllm-typo"),
        ("history", "--service", "vllm-typo"),
        ("observe", "--service", "vllm-typo"),
        ("unschedule", "--service", "vllm-typo"),
    ):
        run = run_ctxmgr(sandbox.pid, state, *args, "--json")
        assert run.code == 2, (args, run.stdout, run.stderr)
        assert run.data["result"] == "error" and "no such unit" in run.data["error"]
        assert not (state / "vllm-typo").exists(), args
    run = run_ctxmgr(sandbox.pid, state, "verify", "--service", "vllm-typo", "--json")
    assert run.code == 3 and run.data["exit_code"] == 3  # UNKNOWN, as monitoring plugins say it
    run = run_ctxmgr(sandbox.pid, state, "status", "--json")
    assert "vllm-typo" not in json.dumps(run.data)  # no phantom service


def test_an_alias_is_the_real_unit_one_lock_one_journal_one_history(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    """Issue 9 item 4: the journal was followed under the alias, so a good change waited out --timeout."""
    name = "vllm-real"
    port = start_service(sandbox, install_unit, workdir, name)
    alias = sandbox.systemd.host_unit_dir / "vllm-alias.service"
    alias.symlink_to(f"{name}.service")
    try:
        sandbox.systemd.daemon_reload()
        state = workdir / "state"
        args = ("set-context", "16384", "--service", "vllm-alias", *offline_gpu_args(), "--yes", "--json")
        run = run_ctxmgr(sandbox.pid, state, *args, "--timeout", "120")
        assert run.code == 0, run.stderr
        assert run.data["service"] == f"{name}.service" and run.data["result"] == "applied"
        served = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]
        assert served["max_model_len"] == 16384
        assert (state / name).is_dir() and not (state / "vllm-alias").exists()
        hist = run_ctxmgr(sandbox.pid, state, "history", "--service", name, "--json")
        assert [r["max_model_len"] for r in hist.data["revisions"]][-1] == 16384
    finally:
        alias.unlink()
        sandbox.systemd.daemon_reload()


def test_an_observation_exported_on_one_host_calibrates_the_plan_on_the_next(
    sandbox, install_unit, workdir
) -> None:  # type: ignore[no-untyped-def]
    """Calibrate once, apply everywhere: host 2 plans from host 1's real start before its own restart."""
    env = {"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "150000"}  # the real starts hold fewer tokens than estimated
    start_service(sandbox, install_unit, workdir, "vllm-host1", environment=env)
    start_service(sandbox, install_unit, workdir, "vllm-host2", environment=env)
    sandbox.systemd.stop("vllm-host2.service")  # not running: nothing of its own to learn from
    host1, host2 = workdir / "state-host1", workdir / "state-host2"
    plan = ("plan", "200000", "--service", "vllm-host2", *offline_gpu_args(), "--json")
    before = run_ctxmgr(sandbox.pid, host2, *plan)
    assert before.code == 0 and before.data["feasible"] is True  # from estimates only
    exported = run_ctxmgr(sandbox.pid, host1, "observe", "--service", "vllm-host1", "--json")
    assert exported.code == 0, exported.stderr
    assert exported.data["record"]["vllm_version"] == "0.33.0"
    handoff = workdir / "host1-observation.json"
    handoff.write_text(exported.stdout)
    args = ("observe", "--service", "vllm-host2", "--import", str(handoff), "--json")
    refused = run_ctxmgr(sandbox.pid, host2, *args)  # issue 16 item 7: another service's start is not taken
    assert refused.code == 2 and "from service vllm-host1.service, not vllm-host2" in refused.data["error"]
    # a fleet runs the same service on every host: one sandbox holds both hosts under two names, so the
    # handoff is renamed as host 2's own service
    record = json.loads(exported.stdout)
    record["record"]["service"] = "vllm-host2.service"
    handoff.write_text(json.dumps(record))
    imported = run_ctxmgr(sandbox.pid, host2, *args)
    assert imported.code == 0 and imported.data["changed"] is True, imported.stderr
    after = run_ctxmgr(sandbox.pid, host2, *plan)
    # host 1's start logged vLLM's real KV budget: 200,000 no longer fits, and the plan says by how much
    assert after.code == 3 and after.data["feasible"] is False
    assert after.data["max_context"] < before.data["max_context"]
    without = run_ctxmgr(sandbox.pid, workdir / "state-host3", *plan)  # a host that imported nothing
    assert without.data["max_context"] == before.data["max_context"]


@pytest.mark.parametrize(
    "text",
    [
        '{"gpu_name": "NVIDIA H200"}',
        "[]",
        "not json",
        '{"vllm_version": "0.33.0", "gpu_name": "H200", "available_kv_gib": "lots"}',
        '{"vllm_version": "0.33.0", "gpu_name": "H200", "num_gpu_blocks": -5}',
        '{"vllm_version": "0.33.0", "gpu_name": "H200", "available_kv_gib": NaN}',
        '{"vllm_version": "0.33.0", "gpu_name": "H200", "ready": "yes"}',
    ],
)
def test_an_import_that_cannot_be_matched_or_holds_garbage_is_refused(text: str) -> None:
    with pytest.raises(UsageError, match=r"^obs\.json: "):
        imported_observation(text, "obs.json")


def test_an_import_keeps_the_known_fields_and_says_where_it_came_from() -> None:
    text = json.dumps({"record": {"vllm_version": "0.33.0", "gpu_name": "NVIDIA H200", "available_kv_gib": 61,
                                  "host": "gpu-01", "unknown_future_field": 1}})  # fmt: skip
    record = imported_observation(text, "obs.json")
    assert record["available_kv_gib"] == 61.0 and record["imported_from"] == "gpu-01"
    assert "unknown_future_field" not in record


def test_plan_says_when_the_running_vllm_got_other_arguments_than_the_unit_holds(
    sandbox, install_unit, workdir
) -> None:  # type: ignore[no-untyped-def]
    """/proc/MAINPID/cmdline is what vLLM really got: an edit without a restart shows there."""
    name = "vllm-argv"
    start_service(sandbox, install_unit, workdir, name)
    plan = ("plan", "16384", "--service", name, *offline_gpu_args(), "--json")
    same = run_ctxmgr(sandbox.pid, workdir / "state", *plan)
    assert same.code == 0 and not [w for w in same.data["warnings"] if "running vLLM" in w]
    path = sandbox.systemd.host_unit_dir / f"{name}.service"
    path.write_text(path.read_text().replace("--max-model-len 8192", "--max-model-len 4096"))
    sandbox.systemd.daemon_reload()
    edited = run_ctxmgr(sandbox.pid, workdir / "state", *plan)
    (warning,) = [w for w in edited.data["warnings"] if "running vLLM" in w]
    assert "8192" in warning and "4096" in warning
