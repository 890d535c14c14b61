"""Units as systemd loads them: what it refuses to load, a package's unit (changed through a drop-in
under /etc, never in place), and findings of systemd-analyze verify the unit already had.

vLLM is played by the stand-in (tests.support.demo standin_unit, make_vllm_wrapper).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.ctxmgr_cli import crashing_argv, ctxmgr_command, run_ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import REPO
from tests.support.standin import free_port


def plan_unit(path: Path) -> tuple[int, str]:
    import subprocess

    argv = [*ctxmgr_command(), "plan", "100000", "--unit", str(path), *offline_gpu_args(), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    return proc.returncode, proc.stderr + proc.stdout


# ---------------------------------------------------------------------------------------------
# Issue 9 item 9: units systemd refuses to load are refused by `plan --unit` as by set-context


def _unit_text(workdir: Path) -> str:
    return standin_unit(make_vllm_wrapper(workdir), port=8000)


def test_plan_unit_accepts_the_unit_systemd_loads(workdir: Path) -> None:
    path = workdir / "vllm-ok.service"
    path.write_text(_unit_text(workdir))
    code, err = plan_unit(path)
    assert code == 0, err


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        (
            "duplicate ExecStart",
            lambda text: text.replace("Restart=", "ExecStart=/bin/true\nRestart=", 1),
            "a second ExecStart= in a Type=simple service",
        ),
        ("NUL byte", lambda text: text.replace("RestartSec=1", "RestartSec=1\0Nice=5"), "a NUL byte"),
        (
            "2 MB line",
            lambda text: text.replace("[Unit]\n", "[Unit]\nDocumentation=" + "x" * (2 << 20) + "\n"),
            "a line longer than 1048576 bytes",
        ),
    ],
)
def test_plan_unit_refuses_what_systemd_refuses_naming_file_and_line(
    workdir: Path, name: str, damage, message: str
) -> None:  # type: ignore[no-untyped-def]
    text = _unit_text(workdir)
    bad = damage(text)
    path = workdir / "vllm-bad.service"
    path.write_text(bad)
    code, err = plan_unit(path)
    assert code == 2, err
    line = bad[: bad.index({"duplicate ExecStart": "ExecStart=/bin/true", "NUL byte": "\0",
                            "2 MB line": "Documentation="}[name])].count("\n") + 1  # fmt: skip
    assert f"{path}:{line}: {message}" in err
    assert "Traceback" not in err


def test_several_exec_start_are_fine_for_a_oneshot_and_after_a_reset(workdir: Path) -> None:
    from vllm_ctxmgr.systemd.unit_file import ServiceUnit

    text = _unit_text(workdir)
    reset = workdir / "vllm-reset.service"
    reset.write_text(text.replace("Restart=", "ExecStart=\nExecStart=/usr/bin/vllm serve m\nRestart=", 1))
    assert ServiceUnit.load_with_dropins(reset).exec_start()[1].value == "/usr/bin/vllm serve m"
    oneshot = workdir / "vllm-oneshot.service"
    oneshot.write_text(
        text.replace("Type=simple", "Type=oneshot").replace("Restart=", "ExecStart=/bin/true\nRestart=", 1)
    )
    assert len(ServiceUnit.load_with_dropins(oneshot).files[0].get_all("Service", "ExecStart")) == 2


def test_plan_unit_refuses_a_fifo_and_an_oversized_file_without_hanging(workdir: Path) -> None:
    fifo = workdir / "vllm-fifo.service"
    os.mkfifo(fifo)
    code, err = plan_unit(fifo)
    assert code == 2 and f"unit file {fifo}: a FIFO, expected a regular file" in err
    big = workdir / "vllm-big.service"
    big.write_text(_unit_text(workdir) + ("# padding\n" * 500_000))
    code, err = plan_unit(big)
    assert code == 2 and "more than the 4 MiB it may have" in err


# ---------------------------------------------------------------------------------------------
# Issue 8 item 4: a package's unit is changed through a drop-in, never in place

VENDOR_DIR = Path("/usr/lib/systemd/system")
# the oldest release whose `systemd-analyze verify` is known to flag MemoryLimit= as deprecated: 252
# does (the build machine's), Debian 11's 247 does not; NEWS does not say when it began
MEMORYLIMIT_FLAGGED_SINCE = 252


@pytest.fixture
def vendor_dir(sandbox, workdir: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The sandbox's /usr/lib/systemd/system is a copy under .cache, bind-mounted in the sandbox's own
    mount namespace only: a unit written there is a package's unit to systemd, and the host's /usr is
    never written. ctxmgr's drop-ins go to the sandbox's /run (CTXMGR_UNIT_DIR), never the host's /etc."""
    copy = workdir / "vendor"
    copy.mkdir()
    sandbox.run("cp", "-a", f"{VENDOR_DIR}/.", str(copy))
    sandbox.run("mount", "--bind", str(copy), str(VENDOR_DIR))
    monkeypatch.setenv("CTXMGR_UNIT_DIR", "/run/systemd/system")
    host_listing = sorted(os.listdir(VENDOR_DIR))
    installed: list[str] = []
    yield copy, installed
    for unit in installed:
        sandbox.run("systemctl", "stop", unit, check=False)
        sandbox.run("systemctl", "reset-failed", unit, check=False)
        (sandbox.systemd.host_path("/run/systemd/system") / f"{unit}.d" / "50-ctxmgr.conf").unlink(
            missing_ok=True
        )
    sandbox.run("umount", str(VENDOR_DIR))
    sandbox.systemd.daemon_reload()
    assert sorted(os.listdir(VENDOR_DIR)) == host_listing  # the host's /usr is as it was
    for unit in installed:
        assert not (VENDOR_DIR / unit).exists() and not Path(f"/etc/systemd/system/{unit}.d").exists()


def _start_vendor_unit(
    sandbox, vendor_dir, workdir: Path, name: str, extra: str = ""
) -> tuple[str, int, Path]:  # type: ignore[no-untyped-def]
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    copy, installed = vendor_dir
    port = free_port()
    unit = f"{name}.service"
    text = standin_unit(make_vllm_wrapper(workdir), port=port)
    (copy / unit).write_text(text.replace("[Service]\n", f"[Service]\n{extra}", 1))
    installed.append(unit)
    sandbox.systemd.daemon_reload()
    assert sandbox.systemd.show(unit, "FragmentPath")["FragmentPath"] in (
        f"{VENDOR_DIR}/{unit}",
        f"/lib/systemd/system/{unit}",
    )
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return unit, port, copy / unit


def _served(port: int) -> int:
    import requests

    return requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["max_model_len"]


@pytest.mark.systemd247
def test_a_package_unit_is_changed_by_a_dropin_and_rolled_back_by_removing_it(  # type: ignore[no-untyped-def]
    sandbox, vendor_dir, workdir
) -> None:
    # MemoryLimit= is deprecated: systemd-analyze verify says so about the unit as it is (issue 8 item 5)
    unit, port, fragment = _start_vendor_unit(
        sandbox, vendor_dir, workdir, "vllm-vendor", "MemoryLimit=64G\n"
    )
    before = fragment.read_bytes()
    state = workdir / "state"
    run = run_ctxmgr(sandbox.pid, state, "set-context", "100000", "--service", unit, *offline_gpu_args(),
                     "--yes", "--json")  # fmt: skip
    assert run.code == 0, run.stdout + run.stderr
    dropin = f"/run/systemd/system/{unit}.d/50-ctxmgr.conf"
    assert run.data["result"] == "applied" and run.data["unit_path"] == dropin
    # 252's verify calls MemoryLimit= deprecated; Debian 11's 247 says nothing of it (seen on both)
    flagged = sandbox.systemd.version >= MEMORYLIMIT_FLAGGED_SINCE
    assert any("MemoryLimit=" in w for w in run.data["warnings"]) == flagged
    assert fragment.read_bytes() == before  # the package's file is untouched
    text = sandbox.systemd.host_path(dropin).read_text()
    assert text.startswith("# Written by ctxmgr") and "ctxmgr rollback --service vllm-vendor" in text
    assert "[Service]\nExecStart=\nExecStart=" in text and "--max-model-len 100000" in text
    assert dropin in sandbox.systemd.show(unit, "DropInPaths")["DropInPaths"].split()
    assert _served(port) == 100000
    # the baseline records that the drop-in did not exist: not an empty file
    baseline = state / "vllm-vendor" / "revisions" / "0000"
    assert not (baseline / "unit").exists() and not (state / "vllm-vendor/revisions/0001/previous").exists()
    verify = run_ctxmgr(sandbox.pid, state, "verify", "--service", unit, "--json")
    assert not [r for r in verify.data["reasons"] if "none of the revisions" in r], verify.data

    run = run_ctxmgr(sandbox.pid, state, "rollback", "--service", unit, "--yes", "--json")
    assert run.code == 0, run.stdout + run.stderr
    assert not sandbox.systemd.host_path(dropin).exists()
    assert not sandbox.systemd.host_path(f"/run/systemd/system/{unit}.d").exists()
    assert sandbox.systemd.show(unit, "DropInPaths")["DropInPaths"] == ""
    assert fragment.read_bytes() == before and _served(port) == 8192
    # back at the baseline, which is the drop-in's absence: verify knows the unit as ctxmgr found it
    verify = run_ctxmgr(sandbox.pid, state, "verify", "--service", unit, "--json")
    assert not [r for r in verify.data["reasons"] if "none of the revisions" in r], verify.data


def test_a_dropin_ctxmgr_created_is_removed_by_recover_after_a_kill(
    sandbox, vendor_dir, workdir, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    unit, port, fragment = _start_vendor_unit(sandbox, vendor_dir, workdir, "vllm-vendor-kill")
    before = fragment.read_bytes()
    state = workdir / "state"
    dropin = sandbox.systemd.host_path(f"/run/systemd/system/{unit}.d/50-ctxmgr.conf")
    argv = crashing_argv(sandbox.pid, state, "set-context:restarting", "set-context", "100000", "--service",
                         unit, *offline_gpu_args(), "--yes", "--json")  # fmt: skip
    assert subprocess.run(argv, capture_output=True, timeout=300).returncode == 137 and dropin.exists()
    run = run_ctxmgr(sandbox.pid, state, "recover", "--service", unit, "--json")
    assert run.code == 0, run.stdout + run.stderr
    assert run.data["result"] == "rolled-back"
    assert not dropin.exists() and sandbox.systemd.show(unit, "DropInPaths")["DropInPaths"] == ""
    assert fragment.read_bytes() == before and _served(port) == 8192


# ---------------------------------------------------------------------------------------------
# Issue 8 item 5: verify blocks only on what the change adds


@pytest.mark.systemd247
def test_findings_the_unit_already_had_do_not_block_a_change_new_ones_do(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    from vllm_ctxmgr.change.walk import verify_candidate
    from vllm_ctxmgr.systemd.service import read_service

    text = standin_unit(make_vllm_wrapper(workdir), port=free_port())
    harmless = "MemoryLimit=64G\nExecStartPre=/opt/ctxmgr-absent/check-gpus\n"
    unit = install_unit("vllm-warned.service", text.replace("[Service]\n", f"[Service]\n{harmless}", 1))
    path = sandbox.systemd.host_unit_dir / unit
    before = path.read_bytes()
    run = run_ctxmgr(sandbox.pid, workdir / "state", "set-context", "100000", "--service", unit,
                     *offline_gpu_args(), "--dry-run", "--json")  # fmt: skip
    assert run.code == 0, run.stdout + run.stderr
    assert run.data["result"] == "dry-run" and run.data["changed"] is True
    warnings = " ".join(run.data["warnings"])
    flagged = sandbox.systemd.version >= MEMORYLIMIT_FLAGGED_SINCE  # 247 does not flag MemoryLimit=
    assert ("MemoryLimit=" in warnings) == flagged
    assert "/opt/ctxmgr-absent/check-gpus is not executable" in warnings
    assert path.read_bytes() == before

    view = read_service(sandbox.systemd, unit)
    fragment = view.unit.files[0]
    worse = fragment.text.replace("Restart=", "ExecStopPost=/opt/ctxmgr-absent/cleanup\nRestart=", 1)
    added, inherited = verify_candidate(sandbox.systemd, view, fragment.path, worse)
    assert len(added) == 1 and "/opt/ctxmgr-absent/cleanup is not executable" in added[0]
    assert len(inherited) == (2 if flagged else 1)


def test_a_package_dropin_holding_execstart_is_masked_by_a_copy_and_never_edited(  # type: ignore[no-untyped-def]
    sandbox, vendor_dir, workdir
) -> None:
    """Issue 16 item 8: where a package's ExecStart= lives in its own drop-in
    (/usr/lib/systemd/system/NAME.service.d/10-vendor.conf), set-context edited that file in place (the
    next package upgrade reverts it). Now the change goes to a copy of the same name in the unit
    directory systemd reads first, which masks the package's file; a rollback removes the copy."""
    copy, installed = vendor_dir
    port = free_port()
    unit = "vllm-vendor-dropin.service"
    text = standin_unit(make_vllm_wrapper(workdir), port=port)
    head, _, rest = text.partition("ExecStart=")
    exec_lines, _, tail = rest.partition("\nRestart=")
    (copy / unit).write_text(head + "Restart=" + tail)  # the package's unit, without a command line
    (copy / f"{unit}.d").mkdir()
    vendor_dropin = copy / f"{unit}.d" / "10-vendor.conf"
    vendor_dropin.write_text(f"# shipped by the package\n[Service]\nExecStart=\nExecStart={exec_lines}\n")
    installed.append(unit)
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(unit)
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    package_bytes = vendor_dropin.read_bytes(), (copy / unit).read_bytes()
    state = workdir / "state"
    run = run_ctxmgr(sandbox.pid, state, "set-context", "100000", "--service", unit, *offline_gpu_args(),
                     "--yes", "--json")  # fmt: skip
    assert run.code == 0, run.stdout + run.stderr
    masking = f"/run/systemd/system/{unit}.d/10-vendor.conf"
    assert run.data["unit_path"] == masking
    assert (vendor_dropin.read_bytes(), (copy / unit).read_bytes()) == package_bytes  # never edited
    assert "--max-model-len 100000" in sandbox.systemd.host_path(masking).read_text()
    assert (
        f"{VENDOR_DIR}/{unit}.d/10-vendor.conf"
        not in sandbox.systemd.show(unit, "DropInPaths")["DropInPaths"]
    )
    assert _served(port) == 100000

    run = run_ctxmgr(sandbox.pid, state, "rollback", "--service", unit, "--yes", "--json")
    assert run.code == 0, run.stdout + run.stderr
    assert not sandbox.systemd.host_path(masking).exists()
    assert (vendor_dropin.read_bytes(), (copy / unit).read_bytes()) == package_bytes
    assert _served(port) == 8192
