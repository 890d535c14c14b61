"""A private systemd, booted as PID 1 of new cgroup, PID, mount and UTS namespaces, for tests and demos.

The disk is shared with the host: sandbox-boot.sh gives systemd its own /run and cgroup mounts
and runtime-masks every unit that would touch the host (tmpfiles would empty /tmp). Each sandbox gets
its own subtree in every cgroup hierarchy, so systemd sees and kills all of a unit's processes, and
several sandboxes can run side by side.

    python -m tests.support.sandbox start          -> prints the sandbox's systemd PID
    python -m tests.support.sandbox stop PID
    python -m tests.support.sandbox run PID CMD... -> CMD inside (systemctl/journalctl reach its systemd)
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd.systemctl import RUNTIME_UNIT_DIR, Systemd

CGROUP_PREFIX = "ctxmgr-sandbox-"
SYSTEMD_BINARIES = (Path("/lib/systemd/systemd"), Path("/usr/lib/systemd/systemd"))
DEFAULT_BOOT_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 15.0


class SandboxError(SystemdError):
    """The private systemd could not be booted, reached or stopped."""


def boot_script() -> Path:
    return Path(__file__).resolve().parent / "sandbox-boot.sh"


def sandbox_available() -> str | None:
    """Why a sandbox cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (it mounts and creates namespaces and cgroups)"
    for tool in ("unshare", "nsenter", "systemctl", "journalctl", "systemd-analyze", "bash"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not any(path.exists() for path in SYSTEMD_BINARIES):
        return "no systemd binary (/lib/systemd/systemd)"
    if not boot_script().exists():
        return f"{boot_script()} is missing"
    if not _cgroup_hierarchies():
        return "no cgroup file system mounted under /sys/fs/cgroup"
    probe = subprocess.run(
        ["unshare", "--cgroup", "--pid", "--fork", "--mount", "--uts", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip() or probe.returncode}"
    return None


# ---------------------------------------------------------------------------------------------------------
# cgroups


@dataclass(frozen=True)
class _Hierarchy:
    controllers: str  # the middle field of /proc/PID/cgroup: "" for cgroup2, "cpu,cpuacct", "name=systemd"
    mountpoint: Path
    mount_root: str  # the part of the hierarchy mounted there

    def directory(self, cgroup_path: str) -> Path | None:
        """The directory of a cgroup path (relative to our cgroup namespace) under this mount."""
        root = self.mount_root.rstrip("/")
        if cgroup_path != root and not cgroup_path.startswith(root + "/"):
            return None
        return self.mountpoint.joinpath(*Path(cgroup_path[len(root) :] or "/").parts[1:])


def _cgroup_hierarchies() -> list[_Hierarchy]:
    """The mounted cgroup hierarchies, keyed like /proc/PID/cgroup (first mount of each)."""
    controllers = {line.split()[0] for line in _read_lines("/proc/cgroups") if line and line[0] != "#"}
    found: dict[str, _Hierarchy] = {}
    for line in _read_lines("/proc/self/mountinfo"):
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        # a v1 mount's super options name its controllers (cpu,cpuacct) or its name (name=systemd)
        options = tail[2].split(",")
        key = ",".join(sorted(o for o in options if o in controllers or o.startswith("name=")))
        if tail[0] == "cgroup2":
            key = ""
        found.setdefault(key, _Hierarchy(key, Path(fields[4]), fields[3]))
    return list(found.values())


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []


def _cgroup_memberships(pid: int | str = "self") -> dict[str, str]:
    """controllers -> cgroup path, from /proc/PID/cgroup, with controllers sorted like mountinfo's."""
    memberships: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        memberships[",".join(sorted(c for c in controllers.split(",") if c))] = path
    return memberships


def _make_cgroup_dirs(name: str) -> list[Path]:
    """A child of our cgroup in every hierarchy, ready to be joined."""
    made: list[Path] = []
    memberships = _cgroup_memberships()
    try:
        for hierarchy in _cgroup_hierarchies():
            current = memberships.get(hierarchy.controllers)
            parent = hierarchy.directory(current) if current is not None else None
            if parent is None or not parent.is_dir():
                continue
            child = parent / name
            child.mkdir()
            made.append(child)
            if "cpuset" in hierarchy.controllers.split(",") and (parent / "cpuset.cpus").exists():
                # a cgroup v1 cpuset refuses tasks until it has CPUs and memory nodes
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (child / knob).write_text((parent / knob).read_text())
    except OSError as exc:
        _remove_cgroup_dirs(made)
        raise SandboxError(f"cannot create the sandbox's cgroups: {exc}") from None
    return made


def _sandbox_cgroup_dirs(pid: int) -> list[Path]:
    """The per-sandbox cgroup dirs that `pid` lives under (read before it ends)."""
    dirs: list[Path] = []
    memberships = _cgroup_memberships(pid)
    for hierarchy in _cgroup_hierarchies():
        path = memberships.get(hierarchy.controllers)
        if path is None:
            continue
        parts = path.split("/")
        for index, part in enumerate(parts):
            if part.startswith(CGROUP_PREFIX):
                directory = hierarchy.directory("/".join(parts[: index + 1]) or "/")
                if directory is not None:
                    dirs.append(directory)
                break
    return dirs


def sweep_stale_cgroups() -> list[Path]:
    """Remove sandbox cgroups left by a run that was killed: those whose creator is gone and that hold
    no process (a sandbox started from the command line outlives its creator but holds processes;
    one being booted right now has a live creator). Another run may be removing the same dirs at the
    same moment: whatever vanishes meanwhile is fine. Returns what was removed."""
    removed: list[Path] = []
    memberships = _cgroup_memberships()
    for hierarchy in _cgroup_hierarchies():
        current = memberships.get(hierarchy.controllers)
        parent = hierarchy.directory(current) if current is not None else None
        if parent is None:
            continue
        try:
            candidates = [entry.path for entry in os.scandir(parent) if entry.name.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for candidate in map(Path, candidates):
            creator = candidate.name[len(CGROUP_PREFIX) :].split("-", 1)[0]
            if not creator.isdigit() or _alive(int(creator)) or _holds_processes(candidate):
                continue
            if not _remove_cgroup_dirs([candidate], timeout=0):
                removed.append(candidate)
    return removed


def _holds_processes(top: Path) -> bool:
    for directory, _, _ in os.walk(top):
        try:
            if Path(directory, "cgroup.procs").read_text().strip():
                return True
        except OSError:
            continue
    return False


def _remove_cgroup_dirs(dirs: list[Path], timeout: float = 5.0) -> list[Path]:
    """rmdir each tree bottom-up; a cgroup stays busy a moment after its last process ends.
    Returns the dirs that could not be removed."""
    deadline = time.monotonic() + timeout
    left = list(dirs)
    while True:
        for top in left:
            for directory, _, _ in os.walk(top, topdown=False):
                try:
                    os.rmdir(directory)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise SandboxError(f"cannot remove cgroup {directory}: {exc.strerror}") from None
        left = [top for top in left if top.exists()]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------
# the sandbox


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(word) for word in text.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


REPOSITORY = Path(__file__).resolve().parents[2]
HOST_LOADER = Path("/lib64/ld-linux-x86-64.so.2")


def root_environment(rootfs: Path) -> dict[str, str]:
    """What sandbox-boot.sh needs to boot `rootfs`: the paths shared with the host at the same place
    (this repository: its venv, .cache and the tests' files; the prefix of the Python the tests run,
    so a unit's ExecStart= of sys.executable means the same inside) and that Python's real binary,
    which the boot script runs through the host's loader (the tree's own libc is older)."""
    if not (rootfs / "lib/systemd/systemd").exists() and not (rootfs / "usr/lib/systemd/systemd").exists():
        raise SandboxError(f"{rootfs} holds no systemd (run tests/support/debian11-rootfs.sh)")
    prefix = Path(sys.base_prefix)
    # Debian's own Python lives in /usr, which must stay the tree's: share only its standard library
    shared_python = Path(sysconfig.get_paths()["stdlib"]) if prefix == Path("/usr") else prefix
    # the host's loader and library directories by their real paths: /lib64 and /lib are links that would
    # resolve into the tree's own (glibc 2.31) under /run/host
    libdirs = [sysconfig.get_config_var("LIBDIR")] if sysconfig.get_config_var("Py_ENABLE_SHARED") else []
    libdirs += [os.path.realpath(d) for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64")]
    return {
        "SANDBOX_ROOTFS": str(rootfs),
        "SANDBOX_BINDS": ":".join(str(p) for p in (REPOSITORY, shared_python)),
        "SANDBOX_PYTHON": os.path.realpath(sys.executable),
        "SANDBOX_LOADER": os.path.realpath(HOST_LOADER),
        "SANDBOX_LIBRARY_PATH": ":".join(dict.fromkeys(f"/run/host{d}" for d in libdirs if Path(d).is_dir())),
    }


@dataclass
class Sandbox:
    """A booted private systemd. `pid` is its PID 1 as seen from here."""

    pid: int
    cgroup_dirs: list[Path] = field(default_factory=list)
    boot_seconds: float | None = None
    state: str = ""  # what is-system-running said when the boot finished
    netns: str | None = None  # the named network namespace it was booted in (None: the caller's)
    _launcher: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _console_fd: int | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        timeout: float = DEFAULT_BOOT_TIMEOUT_S,
        outlive_caller: bool = False,
        netns: str | None = None,
        rootfs: Path | None = None,
    ) -> Sandbox:
        """Boot and wait until `systemctl is-system-running` says running or degraded.

        Unless `outlive_caller`, the sandbox dies with the calling thread (PR_SET_PDEATHSIG through
        setpriv, then unshare --kill-child): a killed test run leaves no systemd behind, and the next
        start sweeps its empty cgroups. Start it from a thread that lives as long as it should.

        `netns` boots it inside that named network namespace (/run/netns/NAME, made by `ip netns add`),
        so its units, an sshd among them, see only that namespace's addresses. nsenter --net switches
        the network namespace alone (`ip netns exec` would also remount /sys and hide the cgroup mounts).

        `rootfs` boots that root file system's systemd instead of the host's (a Debian 11 tree: systemd
        247), in a writable in-memory overlay of it; see root_environment for what it shares.
        """
        reason = sandbox_available()
        if reason:
            raise SandboxError(f"cannot boot a sandbox: {reason}")
        enter_netns: list[str] = []
        if netns is not None:
            if not Path("/run/netns", netns).exists() or "/" in netns:
                raise SandboxError(
                    f"cannot boot a sandbox in network namespace {netns!r}: no /run/netns/{netns}"
                )
            enter_netns = ["nsenter", f"--net=/run/netns/{netns}"]
        began = time.monotonic()
        sweep_stale_cgroups()
        name = f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        cgroup_dirs = _make_cgroup_dirs(name)
        console_fd = os.memfd_create("ctxmgr-sandbox-console")
        tie = [] if outlive_caller or shutil.which("setpriv") is None else ["setpriv", "--pdeathsig", "KILL"]
        try:
            launcher = subprocess.Popen(
                [*tie, *enter_netns, "bash", str(boot_script()), "launch", *map(str, cgroup_dirs)],
                env={**os.environ, **(root_environment(rootfs) if rootfs is not None else {})},
                stdin=subprocess.DEVNULL,
                stdout=console_fd,
                stderr=console_fd,
                start_new_session=True,
            )
        except OSError as exc:
            os.close(console_fd)
            _remove_cgroup_dirs(cgroup_dirs)
            raise SandboxError(f"cannot run {boot_script()}: {exc}") from None
        sandbox = cls(pid=0, cgroup_dirs=cgroup_dirs, netns=netns, _launcher=launcher, _console_fd=console_fd)
        try:
            sandbox.pid = sandbox._wait_for_pid1(began + timeout)
            sandbox.state = sandbox._wait_for_boot(began + timeout)
        except BaseException:
            sandbox.stop()
            raise
        sandbox.boot_seconds = time.monotonic() - began
        return sandbox

    @classmethod
    def attach(cls, pid: int) -> Sandbox:
        """A sandbox started elsewhere (e.g. by `python -m tests.support.sandbox start`)."""
        if not _alive(pid) or _comm(pid) != "systemd":
            raise SandboxError(f"process {pid} is not a running systemd")
        return cls(pid=pid, cgroup_dirs=_sandbox_cgroup_dirs(pid))

    def _wait_for_pid1(self, deadline: float) -> int:
        assert self._launcher is not None
        while time.monotonic() < deadline:
            if self._launcher.poll() is not None:
                raise SandboxError(f"the sandbox ended while booting: {self.console_tail()}")
            for child in _children(self._launcher.pid):
                if _comm(child) == "systemd":
                    return child
            time.sleep(0.01)
        raise SandboxError(f"systemd did not start within the timeout: {self.console_tail()}")

    def _wait_for_boot(self, deadline: float) -> str:
        private_socket = Path(f"/proc/{self.pid}/root/run/systemd/private")
        state = ""
        while time.monotonic() < deadline:
            if not _alive(self.pid):
                raise SandboxError(f"the sandbox's systemd ended while booting: {self.console_tail()}")
            if private_socket.exists():
                remaining = max(1.0, deadline - time.monotonic())
                result = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=remaining)
                state = result.stdout.strip()
                if state in ("running", "degraded"):
                    return state
                if state in ("maintenance", "stopping", "offline"):
                    break
            time.sleep(0.02)
        raise SandboxError(f"the sandbox did not boot (state {state or 'unknown'!r}): {self.console_tail()}")

    @property
    def systemd(self) -> Systemd:
        return Systemd.for_pid(self.pid, unit_dir=RUNTIME_UNIT_DIR)

    @property
    def root(self) -> Path:
        return Path(f"/proc/{self.pid}/root")

    def run(
        self, *cmd: str, check: bool = True, timeout: float | None = 60.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside (its mount and PID namespaces); raises SandboxError when check fails."""
        try:
            result = subprocess.run(
                ["nsenter", "-t", str(self.pid), "-m", "-p", *cmd],
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env={**os.environ, "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"},
            )
        except subprocess.TimeoutExpired:
            raise SandboxError(f"{' '.join(cmd)}: no answer within {timeout:g} s") from None
        if check and result.returncode != 0:
            detail = " ".join((result.stderr or result.stdout).split()) or f"exit status {result.returncode}"
            raise SandboxError(f"{' '.join(cmd)} failed in the sandbox: {detail}")
        return result

    def console_tail(self, limit: int = 2000) -> str:
        """The last of what systemd and the boot script printed (for error messages)."""
        if self._console_fd is None:
            return "(no console output kept)"
        size = os.fstat(self._console_fd).st_size
        text = os.pread(self._console_fd, limit, max(0, size - limit)).decode(errors="replace")
        return " | ".join(line.strip() for line in text.splitlines() if line.strip()) or "(no output)"

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Power off (SIGRTMIN+4: SIGTERM only makes PID 1 re-execute), SIGKILL if it takes too long,
        then remove its cgroups."""
        if self.pid and _alive(self.pid):
            if not self.cgroup_dirs:
                self.cgroup_dirs = _sandbox_cgroup_dirs(self.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGRTMIN + 4)
            deadline = time.monotonic() + timeout
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self._launcher is not None:
            if self._launcher.poll() is None and not self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._launcher.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._launcher.wait(timeout=timeout)
        else:
            deadline = time.monotonic() + timeout
            while self.pid and _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        left = _remove_cgroup_dirs(self.cgroup_dirs)
        if self._console_fd is not None:
            os.close(self._console_fd)
            self._console_fd = None
        if left:
            raise SandboxError(f"could not remove the sandbox's cgroups: {', '.join(map(str, left))}")

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m tests.support.sandbox start [TIMEOUT_S] | stop PID | run PID CMD..."
    try:
        if args[:1] == ["start"] and len(args) <= 2:
            timeout = float(args[1]) if len(args) == 2 else DEFAULT_BOOT_TIMEOUT_S
            sandbox = Sandbox.start(timeout=timeout, outlive_caller=True)
            # the sandbox outlives this process: leave its launcher running, keep its cgroups
            sandbox._launcher = None
            print(sandbox.pid)
            print(f"booted in {sandbox.boot_seconds:.2f} s ({sandbox.state})", file=sys.stderr)
            return 0
        if args[:1] == ["stop"] and len(args) == 2 and args[1].isdigit():
            Sandbox.attach(int(args[1])).stop()
            return 0
        if args[:1] == ["run"] and len(args) >= 3 and args[1].isdigit():
            Sandbox.attach(int(args[1]))
            return subprocess.call(["nsenter", "-t", args[1], "-m", "-p", *args[2:]])
    except SystemdError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
