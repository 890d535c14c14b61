"""A full state directory (ENOSPC on its filesystem) is one line naming the path, never "unexpected
error"; a change whose record cannot follow it still puts the previous unit back and says so.

The state directory is a 512 KiB tmpfs mounted in a mount namespace of ctxmgr's own (unshare -m):
a real full filesystem, as the host never sees it. The service is the stand-in under the private
systemd (tests/change/test_deploy_standin.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import requests

from tests.ctxmgr_cli import ctxmgr_command
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import TESTS
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.probe import wait_until_serving

FILL_RUN = TESTS / "support" / "fill_run.py"


def in_full_namespace(workdir: Path, script: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run each argv in one mount namespace whose `state` is a fresh 512 KiB tmpfs; each run's stdout
    and stderr and status come back through files outside it."""
    state, out = workdir / "state", workdir / "out"
    state.mkdir()
    out.mkdir()
    lines = [f"mount -t tmpfs -o size=512k,mode=0700 ctxmgr-full {shlex.quote(str(state))}"]
    for index, argv in enumerate(script):
        o = shlex.quote(str(out / f"{index}"))
        lines.append(f"{shlex.join(argv)} >{o}.out 2>{o}.err; echo $? >{o}.rc")
    subprocess.run(["unshare", "-m", "sh", "-c", "\n".join(lines)], check=True, timeout=300)
    return [
        subprocess.CompletedProcess(
            argv,
            int((out / f"{i}.rc").read_text()),
            (out / f"{i}.out").read_text(),
            (out / f"{i}.err").read_text(),
        )
        for i, argv in enumerate(script)
    ]


def ctxmgr_at(sandbox: Sandbox, state: Path, step: str, *args: str) -> list[str]:
    python = sys.executable
    if ctxmgr_command()[0] != python:  # the installed wheel's interpreter (make test, CI)
        python = str(Path(ctxmgr_command()[0]).parent / "python")
    filler = str(state / "filler")
    return [python, str(FILL_RUN), step, filler, "--systemd-pid", str(sandbox.pid), "--state-dir", str(state),
            *args]  # fmt: skip


def test_a_full_state_directory_is_one_line_and_the_way_back_still_runs(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    name = "vllm-it-full"
    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    path = sandbox.systemd.host_unit_dir / unit
    sandbox.systemd.start(unit)
    import time

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    before = path.read_bytes()
    state = workdir / "state"
    change = ("set-context", "16384", "--service", name, *offline_gpu_args(), "--yes", "--json")
    runs = in_full_namespace(
        workdir,
        [
            # full before it starts: nothing can be recorded, nothing is changed
            ["sh", "-c", f"head -c 600000 /dev/zero >{shlex.quote(str(state / 'filler'))}; true"],
            ctxmgr_at(sandbox, state, "-", *change),
            ["rm", "-f", str(state / "filler")],
            # full once the new unit is recorded as installed: the way back runs, and says the record lags
            ctxmgr_at(sandbox, state, "set-context:installed", *change),
            ["rm", "-f", str(state / "filler")],
            ctxmgr_at(sandbox, state, "-", "recover", "--service", name, "--json"),
            ctxmgr_at(sandbox, state, "-", "history", "--service", name, "--json"),
        ],
    )
    full, _, midway, _, recovered, history = runs[1], runs[2], runs[3], runs[4], runs[5], runs[6]

    data = json.loads(full.stdout)
    assert full.returncode == 1, (full.stdout, full.stderr)
    assert "unexpected" not in data["error"] and "Traceback" not in full.stderr
    assert "No space left on device" in data["error"] and str(state) in data["error"]
    assert "\n" not in data["error"]

    data = json.loads(midway.stdout)
    assert midway.returncode == 1, (midway.stdout, midway.stderr)
    assert data["result"] == "rolled-back", data
    assert (
        "No space left on device" in data["reason"] and f"ctxmgr recover --service {name}" in data["reason"]
    )
    assert path.read_bytes() == before
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 8192

    assert recovered.returncode == 0, (recovered.stdout, recovered.stderr)
    states = [r["state"] for r in json.loads(history.stdout)["revisions"]]
    assert states[-1] in ("rolled-back", "final", "baseline"), states
    assert path.read_bytes() == before


# Each step the walk records, with what a state directory that fills right after it must leave: before
# the restart, the service keeps running untouched (no restart for nothing, issue 36 item 4); after it,
# the previous unit is put back and serves again.
BEFORE_RESTART = ("revision-staged", "set-context:recorded", "unit-file-written", "set-context:installed")
AFTER_RESTART = ("set-context:restarting", "set-context:serving", "set-context:probed")


def test_a_state_directory_that_fills_at_any_step_never_restarts_for_nothing(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    name = "vllm-it-fill-each"
    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    path = sandbox.systemd.host_unit_dir / unit
    sandbox.systemd.start(unit)
    import time

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    before = path.read_bytes()
    state = workdir / "state"
    change = ("set-context", "16384", "--service", name, *offline_gpu_args(), "--yes", "--json")
    script: list[list[str]] = []
    invocation = sandbox.systemd.command("systemctl", "show", unit, "-p", "InvocationID", "--value")
    for step in (*BEFORE_RESTART, *AFTER_RESTART):
        script += [
            invocation,
            ctxmgr_at(sandbox, state, step, *change),
            ["rm", "-f", str(state / "filler")],
            ctxmgr_at(sandbox, state, "-", "recover", "--service", name, "--json"),
            ["cat", str(path)],
            invocation,
        ]
    # the first run's baseline is written whole; the filler fills the disk as revision 1 is staged
    runs = in_full_namespace(workdir, script)
    for index, step in enumerate((*BEFORE_RESTART, *AFTER_RESTART)):
        ran_before, run, _, recovered, unit_after, ran_after = runs[6 * index : 6 * index + 6]
        assert ran_before.stdout.strip(), ran_before
        data = json.loads(run.stdout)
        assert run.returncode == 1, (step, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr and "unexpected" not in run.stdout, (step, run.stderr)
        words = data.get("error") or data["reason"]
        assert "No space left on device" in words, (step, data)
        assert "revision 0" not in words and "FAILED" not in words, (step, data)
        assert recovered.returncode == 0, (step, recovered.stdout, recovered.stderr)
        assert unit_after.stdout == before.decode(), (step, words)
        if step in BEFORE_RESTART:
            assert "nothing was" in words, (step, words)
            assert data["result"] in ("rolled-back", "error"), (step, data)
            assert ran_after.stdout == ran_before.stdout, (step, words)  # the same run of vLLM
        else:
            assert ran_after.stdout != ran_before.stdout, (step, words)  # restarted twice, back again
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 8192
