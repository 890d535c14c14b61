"""Crash campaign (issue 9): kill ctxmgr at every step of set-context, of a failing set-context's own
rollback, of `rollback` and of `recover`, then recover (with `recover`, or by the next set-context)
and check what an operator relies on: the unit is byte for byte the last good one or the new one,
never half; the service serves what its unit says; no revision is left unfinished; a new change works.

The kill is tests/support/crash_run.py, which sets store.step_hook: os._exit(137) right after the
state was recorded, exactly where a kill -9 at that step would leave things. SIGTERM mid-restart is
the real signal, sent from outside (issue 8 item 6). One service in one private systemd for the
module; the stand-in's CTXMGR_STANDIN_TIME_SCALE keeps each start short.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.ctxmgr_cli import crashing_argv, ctxmgr_argv, run_ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.probe import wait_until_serving
from vllm_ctxmgr.store import GOOD, PENDING, ServiceStore

CAPACITY = 150_000  # the stand-in's KV room: a change above it is refused by "vLLM" and rolled back
FAILING = "200000"

# (command, crash point, how to recover). set-context changes to a fresh context each time; "failing"
# is a set-context vLLM refuses, killed inside its own rollback.
CASES: list[tuple[str, str, str]] = [
    ("set-context", "revision-staged", "recover"),
    ("set-context", "set-context:recorded", "next"),
    ("set-context", "set-context:installed", "recover"),
    ("set-context", "unit-file-written", "next"),  # the file written, systemd not yet reloaded
    ("set-context", "set-context:restarting", "next"),
    ("set-context", "set-context:serving", "recover"),
    ("set-context", "set-context:probed", "next"),
    ("set-context", "set-context:final", "recover"),
    ("failing", "set-context:rolling-back", "recover"),
    ("failing", "set-context:rolled-back", "next"),
    ("rollback", "rollback:installed", "recover"),
    ("rollback", "unit-file-written", "recover"),
    ("rollback", "rollback:restarting", "next"),
    ("rollback", "rollback:serving", "recover"),
    ("rollback", "rollback:probed", "recover"),
    ("recover", "recover:rolling-back", "recover"),
]


@dataclass
class Service:
    sandbox: Sandbox
    name: str
    port: int
    path: Path  # the unit file as the host sees it
    state: Path
    contexts: Iterator[int] = field(default_factory=lambda: iter(range(60_000, 140_000, 2_000)))
    headless: bool = False  # a deployment's headless rank: no API server to ask what it serves

    @property
    def store(self) -> ServiceStore:
        return ServiceStore(self.state, self.name)

    def ctxmgr(
        self, *args: str, crash_at: str | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess:
        argv = (
            crashing_argv(self.sandbox.pid, self.state, crash_at, *args)
            if crash_at
            else ctxmgr_argv(self.sandbox.pid, self.state, *args)
        )
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def set_context(self, context: int | str, crash_at: str | None = None) -> subprocess.CompletedProcess:
        # --force: the planner learns from a refused start and would not try the same one again
        return self.ctxmgr("set-context", str(context), "--service", self.name, *offline_gpu_args(), "--yes",
                           "--force", "--json", crash_at=crash_at)  # fmt: skip

    def served_max_model_len(self) -> int:
        models = requests.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=5).json()
        return models["data"][0]["max_model_len"]

    def good_units(self) -> dict[bytes, int]:
        """Unit bytes a revision proved (final or baseline), or that a rollback put back."""
        good: dict[bytes, int] = {}
        for rev in self.store.revisions():
            if rev.state in GOOD:
                for f in self.store.file_changes(rev):
                    good[f.unit or b""] = rev.max_model_len or 0
            if rev.state == "rolled-back":
                for f in self.store.file_changes(rev):
                    good[f.previous or b""] = rev.previous_max_model_len or 0
        return good

    def check_whole(self, leftovers: bool = True) -> list[str]:
        """What must hold after any crash and its recovery; the problems found (none is the goal).
        `leftovers`: and nothing a killed run left half written (a deployment's node clears them at its
        next change, not at `deployment recover`)."""
        problems = []
        unit = self.path.read_bytes()
        good = self.good_units()
        if unit not in good:
            problems.append("the installed unit is none of the revisions that served")
        left = [rev.number for rev in self.store.revisions() if rev.state in PENDING]
        if left:
            problems.append(f"revisions left unfinished: {left}")
        if not self.sandbox.systemd.is_active(f"{self.name}.service"):
            problems.append("the service is not active")
        elif unit in good and not self.headless:
            if not wait_until_serving(f"http://127.0.0.1:{self.port}", time.monotonic() + 30):
                problems.append("the service does not answer /health")
            elif self.served_max_model_len() != good[unit]:
                problems.append(f"it serves {self.served_max_model_len()}, its unit says {good[unit]}")
        if leftovers:
            left = list(self.path.parent.glob(f".{self.path.name}.*.ctxmgr-tmp"))
            left += [p for p in self.store.revisions_dir.iterdir() if p.name.startswith(".new-")]
            if left:
                problems.append(f"leftovers: {left}")
        return problems


def start(sandbox: Sandbox, work: Path, name: str) -> Service:
    port = free_port()
    env = {"CTXMGR_STANDIN_TIME_SCALE": "0.2", "CTXMGR_STANDIN_KV_CAPACITY_TOKENS": str(CAPACITY)}
    unit = f"{name}.service"
    path = sandbox.systemd.host_unit_dir / unit
    path.write_text(standin_unit(make_vllm_wrapper(work), port=port, environment=env))
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return Service(sandbox, name, port, path, work / "state")


def stop(service: Service) -> None:
    systemd = service.sandbox.systemd
    with contextlib.suppress(Exception):
        systemd.stop(f"{service.name}.service")
    service.path.unlink(missing_ok=True)
    systemd.daemon_reload()


def run_case(service: Service, command: str, crash_at: str, then: str) -> list[str]:
    """One crash and its recovery; the problems found."""
    problems: list[str] = []
    if command == "rollback" and service.path.read_bytes() == (service.store.file_bytes(0, "unit") or b""):
        done = service.set_context(next(service.contexts))  # something to roll back from
        if done.returncode != 0:
            return [f"set-context before the rollback failed: {done.stderr.strip()[-300:]}"]
    if command == "recover":  # leave a change for recover to find, then kill recover itself
        service.set_context(next(service.contexts), crash_at="set-context:restarting")
        crashed = service.ctxmgr("recover", "--service", service.name, "--json", crash_at=crash_at)
    elif command == "rollback":
        crashed = service.ctxmgr("rollback", "--service", service.name, "--to", "0", "--yes", "--json",
                                 crash_at=crash_at)  # fmt: skip
    else:
        crashed = service.set_context(FAILING if command == "failing" else next(service.contexts), crash_at)
    if crashed.returncode != 137:
        problems.append(f"the crash hook did not fire (exit {crashed.returncode}): {crashed.stderr[-300:]}")
    if then == "recover":
        done = service.ctxmgr("recover", "--service", service.name, "--json")
    else:
        done = service.set_context(next(service.contexts))
    if done.returncode != 0:
        problems.append(f"{then} after the crash exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return problems + service.check_whole()


@pytest.fixture(scope="module")
def service(sandbox: Sandbox) -> Iterator[Service]:
    work = REPO / ".cache" / "crash" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    booted = start(sandbox, work, "vllm-crash")
    # the first change records the baseline the campaign's rollbacks return to
    first = booted.set_context(next(booted.contexts))
    assert first.returncode == 0, first.stderr
    yield booted
    stop(booted)


@pytest.mark.parametrize(("command", "crash_at", "then"), CASES, ids=[f"{c}@{p}" for c, p, _ in CASES])
def test_a_kill_at_any_step_is_recovered_whole(
    service: Service, command: str, crash_at: str, then: str
) -> None:
    assert run_case(service, command, crash_at, then) == []


def test_after_the_campaign_a_new_change_succeeds_and_the_record_reads_as_a_story(service: Service) -> None:
    done = service.set_context(next(service.contexts))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == "applied"
    newest = max(service.store.revisions_dir.glob("[0-9]*"))
    record = json.loads((newest / "record.json").read_text())
    assert [s["state"] for s in record["steps"]] == [
        "recorded", "installed", "restarting", "serving", "probed", "final",
    ]  # fmt: skip
    assert (newest / "plan.json").is_file() and record["user"] and record["host"]


def test_sigterm_mid_restart_rolls_back_and_exits_non_zero(service: Service) -> None:
    """Issue 8 item 6: what Ansible's async timeout and systemd send, during the restart."""
    before = service.path.read_bytes()
    served = service.served_max_model_len()
    argv = ctxmgr_argv(service.sandbox.pid, service.state, "set-context", str(next(service.contexts)),
                       "--service", service.name, *offline_gpu_args(), "--yes", "--json")  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rev = service.store.in_progress()
        if rev is not None and rev.state == "restarting":
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("set-context never reached the restart")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    data = json.loads(out)
    assert data["result"] == "rolled-back" and "SIGTERM" in data["reason"]
    assert service.path.read_bytes() == before
    assert service.served_max_model_len() == served
    assert service.store.revisions()[-1].state == "rolled-back"
    assert service.check_whole() == []


def test_a_dry_run_while_a_recovery_is_pending_says_so(service: Service) -> None:
    """Issue 8 item 6: after a kill, a dry run must not say "nothing to change"."""
    context = next(service.contexts)
    crashed = service.set_context(context, crash_at="set-context:serving")
    assert crashed.returncode == 137
    dry = service.ctxmgr("set-context", str(context), "--service", service.name, *offline_gpu_args(),
                         "--dry-run", "--json")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    data = json.loads(dry.stdout)
    assert data["result"] == "dry-run" and data["changed"] is True
    assert data["pending_recovery"] is not None and "interrupted run" in data["reason"]
    text = run_ctxmgr(service.sandbox.pid, service.state, "set-context", str(context), "--service",
                      service.name, *offline_gpu_args(), "--dry-run")  # fmt: skip
    assert "a recovery is pending" in text.stdout + text.stderr and "unchanged" not in text.stdout
    done = service.ctxmgr("recover", "--service", service.name, "--json")
    assert done.returncode == 0, done.stderr
    recovered = json.loads(done.stdout)
    assert recovered["max_model_len"] == context and recovered["previous_max_model_len"] is not None
    assert service.check_whole() == []
