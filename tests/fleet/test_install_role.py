"""The collection's install role on a fresh host (issue 17 item 1): a private systemd stands for the
host, ansible-core runs the role inside it (its mount and PID namespaces, so `systemctl` and the
installed ctxmgr talk to that systemd), from the wheel this checkout builds, with its dependencies
from a local wheelhouse (a GPU host without the internet gets them the same way).

The host's Python is Debian's /usr/bin/python3 with nothing of ctxmgr's installed: the role makes the
venv, copies the wheel, installs it, links nothing onto the real machine's PATH, and a second run
changes nothing. With the fleet bed's parts (sshd, HAProxy) the role then makes fresh hosts ready for
the rolling playbook over SSH.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fleet.bed import REPO_ROOT, SERVICE, FleetBed, ansible_venv, build_collection, fleet_available
from tests.support.require import require
from tests.support.sandbox import Sandbox

pytestmark = pytest.mark.systemd
HOST_PYTHON = "/usr/bin/python3"  # a fresh host's Python: none of ctxmgr's packages


ANSIBLE_VENV = ansible_venv()  # the newest ansible-core the collection claims


def ansible_missing() -> str | None:
    if not (ANSIBLE_VENV / "bin" / "ansible-playbook").exists():
        return f"no ansible-core venv at {ANSIBLE_VENV} (make fleet-deps)"
    if not Path(HOST_PYTHON).exists():
        return f"no {HOST_PYTHON}"
    return None


def build_wheel(directory: Path) -> Path:
    """`make wheel`'s wheel: pip wheel of this checkout, no dependencies."""
    directory.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(directory), str(REPO_ROOT)]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    (wheel,) = directory.glob("vllm_ctxmgr-*.whl")
    return wheel


def wheelhouse(wheel: Path) -> Path:
    """The wheel's dependencies as files (pip download, once per pyproject.toml), so the host's pip
    installs with --no-index --find-links, as on a host without the internet."""
    key = hashlib.sha256((REPO_ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    house = REPO_ROOT / ".cache" / f"wheelhouse-{key}"
    if not (house / ".complete").exists():
        house.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(house), str(wheel)],
                       check=True, capture_output=True, timeout=900)  # fmt: skip
        for own in house.glob("vllm_ctxmgr-*.whl"):
            own.unlink()
        (house / ".complete").touch()
    return house


def install_collection(directory: Path) -> Path:
    collections = directory / "collections"
    tarball = build_collection(directory / "build")
    subprocess.run([str(ANSIBLE_VENV / "bin" / "ansible-galaxy"), "collection", "install", "--force",
                    "--offline", "-p", str(collections), str(tarball)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    return collections


def recap_changed(output: str) -> int:
    """changed=N of the play recap's one host."""
    (changed,) = re.findall(r"\bok=\d+\s+changed=(\d+)", output)
    return int(changed)


def test_the_install_role_makes_a_fresh_host_run_ctxmgr_and_a_second_run_changes_nothing(  # type: ignore[no-untyped-def]
    sandbox: Sandbox, install_unit: Callable[[str, str], str], workdir: Path
) -> None:
    require(ansible_missing(), "ansible-core for the install role")
    wheel = build_wheel(workdir / "dist")
    house = wheelhouse(wheel)
    collections = install_collection(workdir)
    install_unit(f"{SERVICE}-installed.service", (REPO_ROOT / "units" / "vllm-llama70b.service").read_text())
    venv = workdir / "opt-ctxmgr"
    (workdir / "inventory.ini").write_text(
        f"fresh ansible_connection=local ansible_python_interpreter={HOST_PYTHON}\n"
    )
    (workdir / "ansible.cfg").write_text(
        f"[defaults]\ninventory = {workdir / 'inventory.ini'}\ncollections_path = {collections}\n"
        f"local_tmp = {workdir / 'ansible-local'}\nremote_tmp = {workdir / 'ansible-remote'}\n"
        "retry_files_enabled = False\nstdout_callback = default\n"
    )
    status_file = workdir / "status.json"
    (workdir / "site.yml").write_text(
        f"""---
- name: ctxmgr on a fresh host, then what it sees
  hosts: fresh
  gather_facts: false
  roles:
    - role: vllm.ctxmgr.install
  tasks:
    - name: the installed ctxmgr lists the host's vLLM services
      ansible.builtin.command:
        argv: ["{{{{ install_ctxmgr_bin }}}}", "--state-dir", "{workdir / "state"}", status, --json]
      register: status
      changed_when: false
    - name: keep it for the test
      ansible.builtin.copy:
        content: "{{{{ status.stdout }}}}"
        dest: {status_file}
        mode: "0644"
      changed_when: false
"""
    )
    variables = {
        "install_wheel": str(wheel),
        "install_python": HOST_PYTHON,
        "install_venv": str(venv),
        "install_link": "",  # never onto this machine's own PATH
        "install_pip_args": ["--no-index", "--find-links", str(house)],
    }

    def playbook(*extra: str) -> subprocess.CompletedProcess[str]:
        return sandbox.run(
            "env", f"ANSIBLE_CONFIG={workdir / 'ansible.cfg'}", "ANSIBLE_NOCOLOR=1", f"HOME={workdir}",
            str(ANSIBLE_VENV / "bin" / "ansible-playbook"), str(workdir / "site.yml"),
            "-e", json.dumps(variables), *extra, check=False, timeout=900,
        )  # fmt: skip

    first = playbook()
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert recap_changed(first.stdout) >= 3  # the venv, the copied wheel, pip install
    version = subprocess.run([str(venv / "bin" / "ctxmgr"), "--version"], capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
    assert "0.1.0" in version.stdout
    services = [row["service"] for row in json.loads(status_file.read_text())["services"]]
    assert f"{SERVICE}-installed" in services  # it drove the host's (the sandbox's) systemd

    second = playbook()
    assert second.returncode == 0, second.stdout[-4000:]
    assert recap_changed(second.stdout) == 0, second.stdout[-4000:]

    too_old = playbook("-e", "install_min_systemd=9999")
    assert too_old.returncode != 0
    assert "ctxmgr needs systemd 9999 or newer" in too_old.stdout, too_old.stdout[-3000:]
    nothing = playbook("-e", '{"install_wheel": ""}')
    assert nothing.returncode != 0 and "set install_wheel" in nothing.stdout


def test_fresh_fleet_hosts_get_ctxmgr_from_the_role_and_the_rolling_playbook_runs_it(workdir: Path) -> None:
    """Over SSH, on the fleet bed's hosts: install, then roll a context with the installed ctxmgr."""
    require(fleet_available(), "the fleet bed")
    wheel = build_wheel(workdir / "dist")
    house = wheelhouse(wheel)
    tarball = build_collection(workdir / "build")
    bed = FleetBed.up(REPO_ROOT / ".cache" / "fleet" / f"i{uuid.uuid4().hex[:6]}", count=2)
    try:
        bed.install_collection(tarball)
        # per host: the hosts share a disk here
        venv = "{{ rolling_context_state_dir | dirname }}/ctxmgr-venv"
        variables = {
            "install_wheel": str(wheel),
            "install_python": HOST_PYTHON,
            "install_venv": venv,
            "install_link": "",
            "install_pip_args": ["--no-index", "--find-links", str(house)],
        }
        done = bed.ansible(
            "ansible-playbook", "vllm.ctxmgr.install", "-e", json.dumps(variables), timeout=900
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        for host in bed.hosts:
            assert (host.directory / "ctxmgr-venv" / "bin" / "ctxmgr").exists()
        rolled = bed.ansible(
            "ansible-playbook", "vllm.ctxmgr.rolling_context",
            "-e", json.dumps({"rolling_context_max_model_len": 16384,
                              "rolling_context_bin": f"{venv}/bin/ctxmgr"}),
            timeout=900,
        )  # fmt: skip
        assert rolled.returncode == 0, rolled.stdout[-4000:] + rolled.stderr[-2000:]
        assert [bed.served_context(host) for host in bed.hosts] == [16384, 16384]
    finally:
        bed.down()
