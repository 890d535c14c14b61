"""vllm_ctxmgr/systemd/enter.py: a container's own systemctl, journalctl and systemd-analyze run in
every namespace of its manager, with no capability and none of the operator's variables.

The containment test plants a `systemctl` first on the container's PATH (a tmpfs over its
/usr/local/bin, in its own mount namespace: nothing of the host's is written) that records what it
ran as, then runs `ctxmgr --systemd-pid PID status` as an operator does. Before the launcher,
`nsenter -t PID -m -p` ran that file as the host's root: CapEff 000001ffffffffff, the host's network,
IPC, UTS and cgroup namespaces, and the operator's whole environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.sandbox import Sandbox
from vllm_ctxmgr.systemd import enter
from vllm_ctxmgr.systemd.systemctl import container_wrapper

SECRET = "CTXMGR_TEST_OPERATOR_TOKEN"

PLANTED = """#!/bin/sh
# what the tool really runs as, written where the test reads it back (the container's private /run)
out=/run/ctxmgr-planted/$$
{
  echo "uid=$(id -u)"
  grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status
  for ns in pid mnt net ipc uts cgroup user; do echo "ns_$ns=$(readlink /proc/self/ns/$ns)"; done
  env | sed 's/^/env_/'
} >"$out" 2>&1
for real in /usr/bin/systemctl /bin/systemctl; do [ -x "$real" ] && exec "$real" "$@"; done
exit 127
"""


def test_a_tool_outside_the_three_is_refused_before_anything_is_entered() -> None:
    launched = subprocess.run(
        [*container_wrapper(os.getpid()), "sh", "-c", "echo ran"], capture_output=True, text=True, check=False
    )
    assert launched.returncode == enter.EXIT_FAILED
    assert "ran" not in launched.stdout
    assert "usage: enter.py PID" in launched.stderr


def test_the_tool_gets_only_the_listed_variables() -> None:
    environ = {"PATH": "/home/op/bin", SECRET: "s3", "TZ": "UTC", "SYSTEMD_PAGER": "", "LD_PRELOAD": "x.so"}
    assert enter.tool_environment(environ) == {"PATH": enter.PATH, "TZ": "UTC", "SYSTEMD_PAGER": ""}


def test_a_pid_that_is_not_running_is_one_line() -> None:
    launched = subprocess.run(
        [sys.executable, "-I", "-S", enter.__file__, "999999999", "systemctl", "show"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert launched.returncode == enter.EXIT_FAILED
    assert launched.stderr.count("\n") == 1 and "cannot enter the manager 999999999" in launched.stderr


@pytest.fixture
def planted_systemctl(sandbox: Sandbox) -> Iterator[Path]:
    """A recording `systemctl` first on the container's PATH, on a tmpfs of the container's own mount
    namespace; unmounted afterwards. Yields where its records land, as seen from here."""
    bin_dir = sandbox.root / "usr/local/bin"
    if not bin_dir.is_dir():
        pytest.fail(f"{bin_dir} is missing in the container")
    sandbox.run("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/usr/local/bin")
    records = sandbox.root / "run/ctxmgr-planted"
    try:
        records.mkdir(exist_ok=True)
        for old in records.iterdir():
            old.unlink()
        planted = bin_dir / "systemctl"
        planted.write_text(PLANTED)
        planted.chmod(0o755)
        yield records
    finally:
        sandbox.run("umount", "/usr/local/bin", check=False)


def _records(records: Path) -> list[dict[str, str]]:
    parsed = []
    for path in sorted(records.iterdir()):
        fields: dict[str, str] = {}
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=") if "=" in line.split(":", 1)[0] else line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        parsed.append(fields)
    return parsed


@pytest.mark.systemd247
def test_a_planted_systemctl_runs_without_the_hosts_power(
    sandbox: Sandbox, planted_systemctl: Path, tmp_path: Path
) -> None:
    env_before = os.environ.get(SECRET)
    os.environ[SECRET] = "operator-secret-value"
    try:
        run = run_ctxmgr(sandbox.pid, tmp_path / "state", "status", "--json", timeout=120)
    finally:
        if env_before is None:
            del os.environ[SECRET]
        else:
            os.environ[SECRET] = env_before
    assert run.code == 0, run.stderr
    records = _records(planted_systemctl)
    assert records, "the planted systemctl never ran: the test proves nothing"
    ours = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "mnt", "cgroup", "uts")}
    names = ("pid", "mnt", "cgroup", "uts", "net")
    theirs = {ns: os.readlink(f"/proc/{sandbox.pid}/ns/{ns}") for ns in names}
    for record in records:
        assert record["uid"] == "0"  # the container's root: the identity its manager's bus accepts
        for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(record[name], 16) == 0, f"{name} {record[name]}"
        assert record["NoNewPrivs"] == "1"
        for ns, inode in theirs.items():
            assert record[f"ns_{ns}"] == inode, f"not in the manager's {ns} namespace"
        for ns, inode in ours.items():
            assert record[f"ns_{ns}"] != inode, f"still in ctxmgr's {ns} namespace"
        variables = {key for key in record if key.startswith("env_")}
        assert f"env_{SECRET}" not in variables
        assert variables <= {f"env_{name}" for name in ("PATH", "PWD", "SHLVL", "_", *enter.PASSED)}
