"""Hostile-container campaign of hardening round four (items 1 and 2): what a container may make
ctxmgr do when ctxmgr drives its systemd with `--systemd-pid`.

power: every command that takes --systemd-pid runs while a recording `systemctl`, `journalctl` and
  `systemd-analyze` stand first on the container's PATH (a tmpfs over its /usr/local/bin, in its own
  mount namespace). A trial fails when any planted tool ran with a capability (CapInh/Prm/Eff/Bnd/Amb
  not 0), without no_new_privs, outside the manager's PID, mount, UTS, cgroup or network namespace,
  with a variable of the operator's, or when the command hung or ended in an internal error (exit 70).
links: (a container with its own root, Debian 11's) absolute links in the container that point at a
  folder of the host: a drop-in directory (set-context --yes), a model's config.json (plan), an
  EnvironmentFile= folder (node show, plan), and a FIFO bind-mounted over the main process's
  /proc/PID/cmdline (plan). A trial fails when a host file was changed or created, a host secret
  appears in what ctxmgr printed, or the command hung.

Both run on the build machine's systemd and on a booted Debian 11 (systemd 247, its own tools), as
the tests do; root is needed (the private systemd).

    .venv/bin/python benchmarks/campaign_round4_container.py [power] [links] [--managers host,debian11]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from trials import Tally  # noqa: E402

from tests.ctxmgr_cli import ctxmgr_argv  # noqa: E402
from tests.support.demo import make_vllm_wrapper, standin_unit  # noqa: E402
from tests.support.sandbox import Sandbox  # noqa: E402
from tests.support.standin import free_port  # noqa: E402
from vllm_ctxmgr.probe import wait_until_serving  # noqa: E402

WORK = REPO / ".cache" / "campaign-round4" / str(os.getpid())
VICTIMS = Path("/var/cache/ctxmgr/campaign-round4") / str(os.getpid())
DEBIAN11 = Path(os.environ.get("CTXMGR_DEBIAN11_ROOTFS", "/var/cache/ctxmgr/debian11-rootfs"))
SECRET_NAME, SECRET = "CTXMGR_CAMPAIGN_TOKEN", "operator-token-4f2a"
HOST_SECRET = "host-secret-9c1e"
TOOLS = ("systemctl", "journalctl", "systemd-analyze")
SERVICE = "vllm-c4"
RECORDER = """#!/bin/sh
out=/run/ctxmgr-c4/$(basename "$0").$$
{
  echo "uid=$(id -u)"
  grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status
  for ns in pid mnt net uts cgroup; do echo "ns_$ns=$(readlink /proc/self/ns/$ns)"; done
  env | sed 's/^/env_/'
} >"$out" 2>&1
for real in /usr/bin/$(basename "$0") /bin/$(basename "$0"); do [ -x "$real" ] && exec "$real" "$@"; done
exit 127
"""


def run(sandbox: Sandbox, state: Path, *args: str, timeout: float = 180) -> tuple[int | None, str]:
    """ctxmgr as an operator runs it, with a token of theirs in the environment; None on a hang."""
    env = {**os.environ, SECRET_NAME: SECRET}
    argv = ctxmgr_argv(sandbox.pid, state, "--unit-dir", "/run/systemd/system", *args)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, done.stdout + done.stderr


@contextlib.contextmanager
def booted(manager: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.start(rootfs=DEBIAN11 if manager == "debian11" else None)
    try:
        yield sandbox
    finally:
        sandbox.stop()


def serve_standin(sandbox: Sandbox, work: Path) -> None:
    port = free_port()
    unit = standin_unit(make_vllm_wrapper(work), port=port)
    (sandbox.systemd.host_unit_dir / f"{SERVICE}.service").write_text(unit)
    sandbox.systemd.daemon_reload()
    sandbox.systemd.start(f"{SERVICE}.service")
    if not wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 120):
        raise SystemExit(f"the stand-in never served on {port}")


def outcome_problem(code: int | None, output: str, secret: str, leaked: str) -> str | None:
    """What is wrong with a command's end whatever the trial: a hang, an internal error, a leak."""
    if code is None:
        return "hung"
    if code == 70:
        return f"internal error: {output.strip().splitlines()[-1:]}"
    return leaked if secret in output else None


# ---- power --------------------------------------------------------------------------------------------


def _records(folder: Path) -> list[dict[str, str]]:
    parsed = []
    for path in sorted(folder.iterdir()):
        fields: dict[str, str] = {"tool": path.name.split(".")[0]}
        for line in path.read_text(errors="replace").splitlines():
            head = line.split(":", 1)[0]
            key, _, value = line.partition("=") if "=" in head else line.partition(":")
            fields[key.strip()] = value.strip()
        parsed.append(fields)
        path.unlink()
    return parsed


def record_problem(record: dict[str, str], manager_ns: dict[str, str]) -> str | None:
    for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        if int(record.get(name, "1"), 16) != 0:
            return f"{record['tool']} ran with {name} {record.get(name)}"
    if record.get("NoNewPrivs") != "1":
        return f"{record['tool']} ran without no_new_privs"
    for ns, inode in manager_ns.items():
        if record.get(f"ns_{ns}") != inode:
            return f"{record['tool']} ran outside the manager's {ns} namespace"
    if any(SECRET in value for value in record.values()) or f"env_{SECRET_NAME}" in record:
        return f"{record['tool']} saw the operator's {SECRET_NAME}"
    return None


def power(sandbox: Sandbox, manager: str, tally: Tally, work: Path) -> None:
    bin_dir, records = sandbox.root / "usr/local/bin", sandbox.root / "run/ctxmgr-c4"
    sandbox.run("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/usr/local/bin")
    try:
        records.mkdir(exist_ok=True)
        for tool in TOOLS:
            (bin_dir / tool).write_text(RECORDER)
            (bin_dir / tool).chmod(0o755)
        manager_ns = {
            ns: os.readlink(f"/proc/{sandbox.pid}/ns/{ns}") for ns in ("pid", "mnt", "net", "uts", "cgroup")
        }
        commands = [
            ("status", "--json"),
            ("plan", "16384", "--service", SERVICE, "--json"),
            ("verify", "--service", SERVICE, "--json"),
            ("set-context", "16384", SERVICE, "--dry-run", "--json"),
            ("node", "show", SERVICE, "--json"),
            ("history", SERVICE, "--json"),
        ]
        for command in commands:
            code, output = run(sandbox, work / "state", *command)
            found = _records(records)
            label = f"{manager}: ctxmgr {' '.join(command)} ({len(found)} tool runs)"
            problem = outcome_problem(code, output, SECRET, "printed the operator's token")
            for record in found:
                problem = problem or record_problem(record, manager_ns)
            tally.add(label, problem)
            print(f"    {label}: exit {code}")
    finally:
        sandbox.run("umount", "/usr/local/bin", check=False)


# ---- links --------------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def links(sandbox: Sandbox, manager: str, tally: Tally, work: Path) -> None:
    # outside every folder the sandbox binds into the container (the repository, Python's prefix):
    # there the container sees the same folder, and writing it is no escape
    victim = VICTIMS / work.name
    victim.mkdir(parents=True)
    (victim / "config.json").write_text(f'{{"architectures": ["{HOST_SECRET}"], "hidden_size": 1}}')
    (victim / "vllm.env").write_text(f"VLLM_LOGGING_PREFIX={HOST_SECRET}\n")
    root, units = sandbox.root, sandbox.systemd.host_unit_dir

    def judged(label: str, *command: str) -> None:
        before = snapshot(victim)
        code, output = run(sandbox, work / "state", *command, timeout=240)
        problem = outcome_problem(code, output, HOST_SECRET, "printed a host file's secret")
        if problem is None and snapshot(victim) != before:
            problem = f"a host file was written: {sorted(set(snapshot(victim)) ^ set(before))}"
        tally.add(f"{manager}: {label}", problem)
        print(f"    {manager}: {label}: exit {code}")

    # a drop-in directory linked to the host's folder: set-context writes its drop-in
    dropins = units / f"{SERVICE}.service.d"
    dropins.symlink_to(victim)
    try:
        judged("drop-in directory linked to a host folder (set-context --edit dropin --yes)",
               "set-context", "16384", SERVICE, "--edit", "dropin", "--yes", "--force", "--json")  # fmt: skip
    finally:
        dropins.unlink()
        sandbox.systemd.daemon_reload()

    # a model whose config.json is a link to a host file
    model = root / "srv/c4-model"
    model.mkdir(parents=True)
    (model / "config.json").symlink_to(victim / "config.json")
    (root / "etc/c4").symlink_to(victim)
    unit = (
        "[Service]\nEnvironmentFile=/etc/c4/vllm.env\n"
        "ExecStart=/usr/bin/vllm serve /srv/c4-model --max-model-len 8192 --port 18000\n"
    )
    (units / "vllm-c4-links.service").write_text(unit)
    sandbox.systemd.daemon_reload()
    judged(
        "config.json linked to a host file (plan)", "plan", "16384", "--service", "vllm-c4-links", "--json"
    )
    judged(
        "EnvironmentFile= folder linked to the host's (node show)", "node", "show", "vllm-c4-links", "--json"
    )

    # a FIFO bind-mounted over the main process's cmdline
    main_pid = sandbox.systemd.state(f"{SERVICE}.service").main_pid
    fifo = root / "run/c4-fifo"
    os.mkfifo(fifo)
    sandbox.run("mount", "--bind", "/run/c4-fifo", f"/proc/{main_pid}/cmdline")
    try:
        judged("a FIFO over /proc/MAINPID/cmdline (plan)", "plan", "16384", "--service", SERVICE, "--json")
    finally:
        sandbox.run("umount", f"/proc/{main_pid}/cmdline", check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sections", nargs="*", default=["power", "links"], help="power, links (default: both)"
    )
    parser.add_argument("--managers", default="host,debian11")
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args()
    if not set(args.sections) <= {"power", "links"}:
        parser.error(f"unknown section: {' '.join(sorted(set(args.sections) - {'power', 'links'}))}")
    if os.geteuid() != 0:
        print("needs root (a private systemd)", file=sys.stderr)
        return 2
    failed = 0
    tallies = {name: Tally(name, args.show) for name in args.sections}
    for manager in args.managers.split(","):
        if manager == "debian11" and not (DEBIAN11 / "lib/systemd/systemd").exists():
            print(f"no {DEBIAN11}: make debian11-rootfs", file=sys.stderr)
            return 2
        work = WORK / f"{manager}-{uuid.uuid4().hex[:6]}"
        work.mkdir(parents=True)
        with booted(manager) as sandbox:
            serve_standin(sandbox, work)
            if "power" in tallies:
                power(sandbox, manager, tallies["power"], work)
            if "links" in tallies and manager != "host":  # the host's sandbox shares the host's root
                links(sandbox, manager, tallies["links"], work)
    shutil.rmtree(VICTIMS, ignore_errors=True)
    for tally in tallies.values():
        failed += tally.report()
    print(f"{'total':<10} failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
