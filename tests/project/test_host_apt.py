"""The test setup's apt step cannot race (issue 33 item 1): `make -j4 test-setup` has one apt user
(`make host-apt`, tests/support/host-apt.sh), every apt call waits for another apt's lock instead of
failing on it, and the step never leaves a host service enabled."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO

HOST_APT = REPO / "tests" / "support" / "host-apt.sh"
FRONTEND_LOCK = Path("/var/lib/dpkg/lock-frontend")
# an apt-get that does something (not `command -v apt-get`, not a comment or a message)
APT_CALL = re.compile(r"\bapt-get\s+(?:-\S+\s+)*(install|update|download|upgrade|remove|purge|check)\b")


def make_n(*targets: str) -> list[str]:
    """The recipe lines `make -n` prints for the targets (run here, outside any make of the caller)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-j4", *targets],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.splitlines()


def test_make_test_setup_runs_one_apt_step_before_every_step_that_needs_debian_packages() -> None:
    lines = make_n("test-setup")
    steps = [line for line in lines if "host-apt.sh" in line]
    assert len(steps) == 1, f"one apt step, not {len(steps)}:\n" + "\n".join(lines)
    for package in ("openssh-server", "openssh-client", "haproxy", "iproute2", "debootstrap"):
        assert f" {package}" in steps[0], f"the apt step does not install {package}: {steps[0]}"
    direct = [line for line in lines if APT_CALL.search(line)]
    assert not direct, f"apt-get run beside the apt step: {direct}"
    for target in ("debian11-rootfs", "promtool", "fleet-deps"):
        recipe = make_n(target)
        first_apt = next((i for i, line in enumerate(recipe) if "host-apt.sh" in line), None)
        assert first_apt == 1, f"make {target} does not run the apt step first:\n" + "\n".join(recipe)


def test_every_apt_call_of_the_setup_waits_for_the_lock() -> None:
    """apt-get is called only through host-apt.sh's apt_get (DPkg::Lock::Timeout) and apt_update."""
    scripts = [REPO / "Makefile", *sorted((REPO / "tests" / "support").glob("*.sh"))]
    scripts += sorted((REPO / "examples").rglob("*.sh"))
    found = []
    for path in scripts:
        for line in path.read_text().splitlines():
            code = "" if line.lstrip().startswith("#") else re.sub(r'"[^"]*"', '""', line)  # no messages
            if APT_CALL.search(code) or re.search(r"\bapt-get -o DPkg::Lock::Timeout=", code):
                found.append((path.relative_to(REPO).as_posix(), code.strip()))
    only = ("tests/support/host-apt.sh", 'apt_get() { apt-get -o DPkg::Lock::Timeout="" ""; }')
    assert found == [only], found
    text = HOST_APT.read_text()
    assert 'apt_get() { apt-get -o DPkg::Lock::Timeout="$LOCK_TIMEOUT" "$@"; }' in text
    assert "  apt_update\n" in text and "apt_get install" in text
    assert "source " in (REPO / "tests/support/promtool.sh").read_text()


def _hold(path: Path, seconds: float) -> threading.Thread:
    """Another apt: the lock taken as apt takes it (an fcntl write lock), let go after `seconds`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # after a real apt of the host, if one holds it now

    def release() -> None:
        time.sleep(seconds)
        os.close(fd)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(os.geteuid() != 0 or not FRONTEND_LOCK.exists(), reason="dpkg's lock needs root and dpkg")
def test_the_apt_step_waits_while_another_apt_holds_the_dpkg_lock_then_succeeds() -> None:
    """apt-get check takes the dpkg frontend lock and changes nothing: plain, it fails on the held lock
    (the race of issue 33); through apt_get it waits the 3 s out and succeeds."""
    holder = _hold(FRONTEND_LOCK, 3.0)
    started = time.monotonic()
    plain = subprocess.run(["apt-get", "check", "-qq"], capture_output=True, text=True, timeout=30)
    assert plain.returncode == 100 and "Could not get lock" in plain.stderr, plain.stderr
    waited = subprocess.run(
        ["bash", "-c", f"source {HOST_APT} && apt_get check -qq"],
        env={**os.environ, "CTXMGR_APT_LOCK_TIMEOUT": "60"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    holder.join()
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert 2.5 <= elapsed < 30, f"took {elapsed:.1f} s"


def test_apt_update_is_tried_again_while_the_lists_lock_is_held(tmp_path: Path) -> None:
    """apt-get update has no lock wait of its own (apt 2.6 fails at once on /var/lib/apt/lists/lock):
    apt_update tries again until it gets it, and gives up on any other error or at the timeout."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    # apt-get as it answers while another apt-get update runs: its real message, then success
    (fake / "apt-get").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >>{calls}\n'
        f"if (( $(wc -l <{calls}) < 2 )); then\n"
        '  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 42 (apt-get)" >&2\n'
        '  echo "E: Unable to lock directory /var/lib/apt/lists/" >&2; exit 100; fi\n'
    )
    (fake / "apt-get").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CTXMGR_APT_LOCK_TIMEOUT": "30"}
    update = ["bash", "-c", f"source {HOST_APT} && apt_update"]
    done = subprocess.run(update, env=env, timeout=60, check=False)
    assert done.returncode == 0
    assert calls.read_text().splitlines() == ["-o DPkg::Lock::Timeout=30 update -qq"] * 2
    calls.write_text("x\nx\nx\nx\n")  # from now on it succeeds: a different error must not be retried
    (fake / "apt-get").write_text('#!/bin/bash\necho "E: The repository is not signed." >&2; exit 100\n')
    failed = subprocess.run(update, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert failed.returncode == 1 and "not signed" in failed.stderr


def _stub(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text("#!/bin/bash\n" + body)
    (folder / name).chmod(0o755)


UNIT = "[Service]\nExecStart=/usr/sbin/sshd -D\n\n[Install]\nWantedBy=multi-user.target\nAlias=sshd.service\n"


@pytest.mark.skipif(shutil.which("deb-systemd-helper") is None, reason="Debian's init-system-helpers")
def test_units_the_step_installed_are_left_disabled_and_the_operators_untouched(tmp_path: Path) -> None:
    """Debian's postinst enables ssh.service with deb-systemd-helper; leave_disabled undoes it with the
    same tool (in a root of its own: DPKG_ROOT), for the packages it is given and no other."""
    root = tmp_path / "root"
    (root / "lib/systemd/system").mkdir(parents=True)
    for name in ("ssh.service", "operator.service"):
        (root / "lib/systemd/system" / name).write_text(UNIT.replace("sshd", name.split(".")[0] + "d"))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    # dpkg-query -L PACKAGE: the files each package shipped
    _stub(
        stubs,
        "dpkg-query",
        'case "$2" in openssh-server) echo /lib/systemd/system/ssh.service;;\n'
        "  operator-pkg) echo /lib/systemd/system/operator.service;; esac\n",
    )
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "DPKG_ROOT": str(root)}
    for package, unit in (("openssh-server", "ssh.service"), ("operator-pkg", "operator.service")):
        # what the postinst does (dh_installsystemd's snippet)
        subprocess.run(
            ["deb-systemd-helper", "enable", unit],
            env={**env, "DPKG_MAINTSCRIPT_PACKAGE": package},
            check=True,
            capture_output=True,
            timeout=30,
        )
    wants = root / "etc/systemd/system/multi-user.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == ["operator.service", "ssh.service"]
    assert (root / "etc/systemd/system/sshd.service").is_symlink()
    done = subprocess.run(
        ["bash", "-c", f"source {HOST_APT} && leave_disabled openssh-server"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "disabled ssh.service" in done.stdout
    assert sorted(p.name for p in wants.iterdir()) == ["operator.service"]
    assert not (root / "etc/systemd/system/sshd.service").exists()
    was = subprocess.run(
        ["deb-systemd-helper", "was-enabled", "ssh.service"],
        env={**env, "DPKG_MAINTSCRIPT_PACKAGE": "openssh-server"},
        check=False,
        timeout=30,
    )
    assert was.returncode == 1  # the next upgrade's postinst keeps it disabled


@pytest.mark.skipif(os.geteuid() != 0, reason="the apt step installs only as root")
def test_no_service_may_start_while_the_step_installs_and_the_policy_goes_afterwards(tmp_path: Path) -> None:
    """Without a policy-rc.d on the host, one refusing every start (101) is there while apt-get installs
    and gone afterwards; the packages it installed are listed, and `make clean-host` purges those alone."""
    policy, listed, seen = tmp_path / "policy-rc.d", tmp_path / "installed", tmp_path / "seen"
    state = tmp_path / "dpkg-state"
    state.write_text("dpkg\n")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    # apt-get install: records the policy-rc.d in place at that moment, "installs" the packages
    _stub(
        stubs,
        "apt-get",
        f'echo "$*" >>{tmp_path / "calls"}\nif [[ " $* " == *" install "* ]]; then\n'
        f'  {{ "{policy}" ra; echo "rc=$?"; }} >{seen} 2>&1\n'
        f'  printf "%s\\n" "$@" | grep -v -e "^-" -e = -e "^install$" >>{state}; fi\n',
    )
    _stub(
        stubs,
        "dpkg-query",
        f'if [[ $2 == *Status* ]]; then grep -qx "$3" {state} && echo "install ok installed"\n'
        f"elif [[ $1 == -W ]]; then cat {state}; fi; exit 0\n",
    )
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "CTXMGR_POLICY_RC_D": str(policy),
        "CTXMGR_HOST_APT_LIST": str(listed),
    }
    done = subprocess.run(
        ["bash", str(HOST_APT), "dpkg", "haproxy", "debootstrap"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert seen.read_text().split() == ["rc=101"], "no policy-rc.d refused starts during the install"
    assert not policy.exists(), "the temporary policy-rc.d was left behind"
    assert listed.read_text().split() == ["debootstrap", "haproxy"]
    # the host's own policy-rc.d is used as it is, and kept
    policy.write_text("#!/bin/sh\nexit 0\n")
    policy.chmod(0o755)
    state.write_text("dpkg\n")
    subprocess.run(["bash", str(HOST_APT), "haproxy"], env=env, capture_output=True, timeout=60, check=True)
    assert seen.read_text().split() == ["rc=0"] and policy.read_text() == "#!/bin/sh\nexit 0\n"
    # make clean-host: what the step installed (the list), nothing the host had
    purged = subprocess.run(["bash", str(HOST_APT), "--purge"], env=env, capture_output=True, timeout=60)
    assert purged.returncode == 0
    last = (tmp_path / "calls").read_text().splitlines()[-1]
    assert last == "-o DPkg::Lock::Timeout=600 purge -y -qq debootstrap haproxy", last
    assert not listed.exists()
