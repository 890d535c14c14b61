"""tests.support.sandbox: a private systemd boots, leaves the host alone, and goes away completely."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.sandbox import (
    CGROUP_PREFIX,
    Sandbox,
    SandboxError,
    _alive,
    _Hierarchy,
    sweep_stale_cgroups,
)
from tests.systemd_fixtures import DEBIAN11_ROOTFS, require_sandbox

THIRTY_DAYS_S = 30 * 24 * 3600


def test_hierarchy_directory_maps_cgroup_paths_under_its_mount() -> None:
    memory = _Hierarchy("memory", Path("/sys/fs/cgroup/memory"), "/")
    assert memory.directory("/process_api/ab") == Path("/sys/fs/cgroup/memory/process_api/ab")
    assert memory.directory("/") == Path("/sys/fs/cgroup/memory")
    # a container that mounts only its own part of the hierarchy
    nested = _Hierarchy("", Path("/sys/fs/cgroup"), "/machine.slice/c1")
    assert nested.directory("/machine.slice/c1/x.service") == Path("/sys/fs/cgroup/x.service")
    assert nested.directory("/machine.slice/other") is None


@pytest.mark.systemd
def test_boot_and_stop_leave_the_host_alone(sandbox: Sandbox, record_property: pytest.RecordProperty) -> None:
    """A second sandbox next to the session's: /tmp survives (tmpfiles is masked), /run stays private,
    and after the power-off neither processes nor cgroups are left."""
    require_sandbox()
    with tempfile.NamedTemporaryFile(
        "w", dir="/tmp", prefix="ctxmgr-sandbox-check-", delete=False
    ) as sentinel:
        sentinel.write("still here")
    sentinel_path = Path(sentinel.name)
    os.utime(sentinel_path, (time.time() - THIRTY_DAYS_S,) * 2)  # old enough for systemd-tmpfiles --clean
    try:
        second = Sandbox.start()
        try:
            record_property("sandbox_boot_s", round(second.boot_seconds or 0, 3))
            print(f"sandbox booted in {second.boot_seconds:.2f} s ({second.state})")
            assert second.pid != sandbox.pid
            assert second.state in ("running", "degraded")
            masked = second.systemd.show("systemd-tmpfiles-setup.service", "LoadState")
            assert masked == {"LoadState": "masked"}
            assert second.run("systemctl", "is-system-running").stdout.strip() == second.state

            private = second.systemd.host_path("/run/ctxmgr-sandbox-private-check")
            private.write_text("inside")
            assert not Path("/run/ctxmgr-sandbox-private-check").exists()

            unit_dir = second.systemd.host_unit_dir
            (unit_dir / "lingering.service").write_text("[Service]\nExecStart=/bin/sleep 600\n")
            second.systemd.daemon_reload()
            second.systemd.start("lingering.service")
            unit_pids = second.systemd.unit_processes("lingering.service")
            assert len(unit_pids) == 1
        finally:
            began = time.monotonic()
            second.stop()
            stop_seconds = time.monotonic() - began
        record_property("sandbox_stop_s", round(stop_seconds, 3))
        print(f"sandbox stopped in {stop_seconds:.2f} s")
        assert not Path(f"/proc/{second.pid}").exists()
        assert not Path(f"/proc/{unit_pids[0]}").exists()
        assert second.cgroup_dirs and not any(d.exists() for d in second.cgroup_dirs)
        assert sentinel_path.read_text() == "still here"
        assert sandbox.run("systemctl", "is-system-running").stdout.strip() in ("running", "degraded")
    finally:
        sentinel_path.unlink(missing_ok=True)


def test_every_cgroup_of_the_sandbox_is_its_own(sandbox: Sandbox) -> None:
    """systemd makes its cgroups (init.scope, system.slice, ...) inside the sandbox's subtree in every
    hierarchy, never at the host's roots, so sandboxes side by side cannot collide."""
    memberships = Path(f"/proc/{sandbox.pid}/cgroup").read_text().splitlines()
    assert memberships
    for line in memberships:
        assert f"/{CGROUP_PREFIX}" in line, line
    assert all(d.name.startswith(CGROUP_PREFIX) and d.is_dir() for d in sandbox.cgroup_dirs)
    journald = sandbox.systemd.unit_processes("systemd-journald.service")
    assert journald
    for line in Path(f"/proc/{journald[0]}/cgroup").read_text().splitlines():
        assert f"/{CGROUP_PREFIX}" in line, line


def test_attach_refuses_a_process_that_is_not_systemd(sandbox: Sandbox) -> None:
    assert Sandbox.attach(sandbox.pid).cgroup_dirs == sandbox.cgroup_dirs
    with pytest.raises(SandboxError, match="is not a running systemd"):
        Sandbox.attach(os.getpid())


@pytest.mark.systemd
def test_command_line_start_run_stop() -> None:
    require_sandbox()
    module = [sys.executable, "-m", "tests.support.sandbox"]
    started = subprocess.run([*module, "start"], capture_output=True, text=True, check=True, timeout=60)
    pid = started.stdout.strip()
    assert pid.isdigit(), started
    try:
        inside = subprocess.run(
            [*module, "run", pid, "systemctl", "is-system-running"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert inside.stdout.strip() in ("running", "degraded")
        assert "booted in" in started.stderr
        dirs = Sandbox.attach(int(pid)).cgroup_dirs
        assert dirs
    finally:
        stopped = subprocess.run([*module, "stop", pid], capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/comm").read_text().strip() != "systemd"
    assert not any(d.exists() for d in dirs)
    usage = subprocess.run([*module, "stop"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and usage.stderr.startswith("usage:")


@pytest.mark.systemd
def test_a_killed_caller_takes_its_sandbox_along() -> None:
    """SIGKILL leaves no finaliser to run: the sandbox dies with its caller (PR_SET_PDEATHSIG, unshare
    --kill-child) and the next start sweeps its empty cgroups."""
    require_sandbox()
    boot = "from tests.support.sandbox import Sandbox; import time; print(Sandbox.start().pid, flush=True); "
    caller = subprocess.Popen(
        [sys.executable, "-c", boot + "time.sleep(600)"], stdout=subprocess.PIPE, text=True
    )
    assert caller.stdout is not None
    pid = int(caller.stdout.readline())
    dirs = Sandbox.attach(pid).cgroup_dirs
    assert dirs
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # gone, or a zombie until the host's init reaps it
    sweep_stale_cgroups()  # (a concurrent test run's start may have swept them already)
    assert not any(d.exists() for d in dirs)


def test_the_debian11_sandbox_is_systemd_247_with_its_own_tools_and_the_hosts_paths(
    debian11_sandbox: Sandbox,
) -> None:
    """The bed for the floor (issue 26): its PID 1, systemctl and systemd-analyze are Debian 11's 247,
    the repository is at the same path inside, the Python the tests run works there (through the host's
    loader), and what the overlay takes is in memory, never in the cached tree."""
    box = debian11_sandbox
    assert box.systemd.version == 247
    assert box.run("systemctl", "--version").stdout.startswith("systemd 247 ")
    assert "--recursive-errors" not in box.run("systemd-analyze", "--help").stdout
    pid1 = Path(f"/proc/{box.pid}/exe").read_bytes()  # the tree's own binary, not the host's
    assert (
        pid1
        == (DEBIAN11_ROOTFS / "lib/systemd/systemd").read_bytes()
        != Path("/lib/systemd/systemd").read_bytes()
    )
    inside = box.run(sys.executable, "-c", "import sys, click; print(sys.executable)").stdout.strip()
    assert inside == sys.executable
    here = Path(__file__).resolve()
    assert box.run("cat", str(here)).stdout == here.read_text()
    marker = box.systemd.host_path("/etc/ctxmgr-overlay-check")
    marker.write_text("in memory")
    assert not (DEBIAN11_ROOTFS / "etc/ctxmgr-overlay-check").exists()
    marker.unlink()


def test_the_managers_version_is_read_from_the_manager(sandbox: Sandbox) -> None:
    """`Systemd.version` asks the manager (its Version property) through its own namespaces: the host
    sandbox's is the host's systemd."""
    host = subprocess.run(["systemctl", "--version"], capture_output=True, text=True, check=True).stdout
    assert sandbox.systemd.version == int(host.split()[1])
