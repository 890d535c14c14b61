"""Run one of systemd's tools against a manager in another container, with no more power than that
container's own processes have.

`--systemd-pid PID` reaches a manager that runs in its own namespaces (a container, a private
systemd). Its systemctl, journalctl and systemd-analyze must be the container's own: they speak its
manager's release, read its journal and its unit files. But they are files the container chose, so
they must not run as the host's root: `nsenter -t PID -m -p` ran them with every capability, in the
host's user, network, IPC and cgroup namespaces, with the operator's environment. This launcher is
what `Systemd.for_pid` runs instead, by the host's own Python interpreter (`-I -S`: nothing but the
standard library is imported, so nothing of the container's or the venv's is loaded before exec):

1. it opens the manager's namespaces and root before it enters any (so /proc is the host's);
2. it enters every namespace the manager is in and this process is not (user first, mount last),
   and takes the manager's root directory as its own;
3. inside a user namespace of the container's it becomes that namespace's root (uid 0 there), the
   identity the manager's private bus accepts;
4. it forks, so that the tool is a process of the manager's PID namespace (a tool left in the host's
   PID namespace as uid 0 could signal the host's root processes);
5. the child drops every capability (bounding, permitted, effective, inheritable, ambient), locks
   SECBIT_NOROOT so that executing a file as uid 0 grants none back, and sets no_new_privs;
6. it executes the tool by the container's PATH with an environment built here from a fixed list (the
   operator's variables, tokens included, never reach it); only systemctl, journalctl and
   systemd-analyze are run.

The parent waits and exits as the child did (128 + the signal's number if it was killed); a signal
sent to the parent is passed on. Hand-written with ctypes: Python 3.11 has no os.setns, and nsenter
cannot drop capabilities after it has entered (a host `setpriv` after `nsenter -m` would be the
container's file again).

    python -I -S enter.py PID TOOL [ARG...]
"""

import contextlib
import ctypes
import os
import signal
import sys

TOOLS = ("systemctl", "journalctl", "systemd-analyze")
# entered in this order: the user namespace first (the others are owned by it), the mount namespace
# last (after it, /proc is the container's)
NAMESPACES = (
    ("user", 0x10000000),
    ("cgroup", 0x02000000),
    ("ipc", 0x08000000),
    ("uts", 0x04000000),
    ("net", 0x40000000),
    ("pid", 0x20000000),
    ("time", 0x00000080),
    ("mnt", 0x00020000),
)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the only variables the tool gets from ctxmgr: how systemd's tools print (systemctl.tool_env) and TZ
PASSED = ("SYSTEMD_PAGER", "SYSTEMD_COLORS", "SYSTEMD_LOG_COLOR", "SYSTEMD_URLIFY", "PAGER", "TZ")

PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT | _LOCKED, SECBIT_KEEP_CAPS_LOCKED (off), SECBIT_NO_CAP_AMBIENT_RAISE | _LOCKED
SECUREBITS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)
CAPABILITY_VERSION_3 = 0x20080522
EXIT_FAILED = 125  # the launcher itself failed (as env(1) and nsenter do)

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class LaunchError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise LaunchError(f"{what}: {os.strerror(error)}")


def _same(fd: int, name: str) -> bool:
    """Whether this process is in the namespace `fd` already (setns into one's own user namespace fails)."""
    theirs = os.fstat(fd)
    try:
        ours = os.stat(f"/proc/self/ns/{name}")
    except FileNotFoundError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def enter(pid: int) -> bool:
    """Enter every namespace and the root of `pid`; True when a user namespace was entered."""
    opened: list[tuple[str, int, int]] = []
    for name, flag in NAMESPACES:
        try:
            fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if name in ("time", "cgroup"):
                continue  # a kernel without it
            raise LaunchError(f"no process {pid} (or it has no {name} namespace)") from None
        opened.append((name, flag, fd))
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    entered_user = False
    for name, flag, fd in opened:
        if not _same(fd, name):
            _check(_libc.setns(fd, flag), f"cannot enter the {name} namespace of {pid}")
            entered_user = entered_user or name == "user"
        os.close(fd)
    os.fchdir(root)
    os.chroot(".")
    os.chdir("/")
    os.close(root)
    if entered_user:
        # the container's /proc/PID/setgroups may say deny: its own processes cannot either
        with contextlib.suppress(PermissionError):
            os.setgroups([])
        try:
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
        except OSError as exc:
            raise LaunchError(f"the user namespace of {pid} maps no root: {exc.strerror}") from None
    return entered_user


def drop_privileges() -> None:
    """No capability now or after exec, whatever the uid; no setuid file can grant one back."""
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "cannot lock the securebits")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "cannot clear the ambient set")
    for capability in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                break
            _check(-1, f"cannot drop capability {capability} from the bounding set")
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "cannot clear the capabilities")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "cannot set no_new_privs")


def tool_environment(environ: dict[str, str]) -> dict[str, str]:
    env = {"PATH": PATH}
    env.update({name: environ[name] for name in PASSED if name in environ})
    return env


def _wait(child: int) -> int:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or argv[1] not in TOOLS:
        print(f"usage: enter.py PID {{{'|'.join(TOOLS)}}} [ARG...]", file=sys.stderr)
        return EXIT_FAILED
    pid, tool, args = int(argv[0]), argv[1], argv[2:]
    env = tool_environment(dict(os.environ))
    try:
        enter(pid)
    except (LaunchError, OSError) as exc:
        print(f"ctxmgr: cannot enter the manager {pid}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    sys.stdout.flush()
    child = os.fork()
    if child:
        return _wait(child)
    try:
        drop_privileges()
        os.execvpe(tool, [tool, *args], env)
    except (LaunchError, OSError) as exc:
        print(f"ctxmgr: cannot run {tool} in the manager {pid}'s namespaces: {exc}", file=sys.stderr)
    os._exit(EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
