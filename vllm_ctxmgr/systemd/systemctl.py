"""The one door to systemd: every systemctl, journalctl and systemd-analyze call ctxmgr makes.

A `Systemd` may reach a manager in another namespace or container: `wrapper` prefixes each command
(for a container, enter.py) and `root` is where the paths systemd reports are found from here
(e.g. /proc/PID/root). Paths in method arguments and results are systemd's own view unless a name
says `host`; use `host_path` to reach them.

Methods return plain data and raise SystemdError with one line that quotes the tool's stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from vllm_ctxmgr import files
from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd.features import (
    ANALYZE,
    FLOOR,
    RECURSIVE_ERRORS_NO,
    SYSTEMCTL,
    TIMESTAMP_UNIX,
    TIMESTAMP_US_UTC,
    parse_version,
    use,
)
from vllm_ctxmgr.systemd.journal import (
    JournalEntry,
    JournalFollower,
    journal_args,
    last_cursor,
    parse_journal_json,
)
from vllm_ctxmgr.systemd.quoting import parse_environment_words
from vllm_ctxmgr.systemd.tools import kill_group, one_line, tool_env

SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
RUNTIME_UNIT_DIR = Path("/run/systemd/system")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_JOB_TIMEOUT_S = 300.0

# What the deployer reads about a unit; `Systemd.state` asks for exactly these.
STATE_PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "NRestarts",
    "MainPID",
    "ExecMainPID",
    "ExecMainCode",
    "ExecMainStatus",
    "InvocationID",
    "ActiveEnterTimestampMonotonic",
    "InactiveEnterTimestampMonotonic",
    "FragmentPath",
    "DropInPaths",
    "ControlGroup",
)

# Values of si_code that systemd reports as ExecMainCode (CLD_* in <signal.h>).
CLD_EXITED = 1
CLD_KILLED = 2
CLD_DUMPED = 3


# ---------------------------------------------------------------------------------------------------------
# Units


@dataclass(frozen=True)
class UnitState:
    """The properties that tell how a start went, typed. Monotonic times are systemd's clock (µs)."""

    unit: str
    load_state: str
    active_state: str
    sub_state: str
    result: str
    n_restarts: int
    main_pid: int | None  # as systemd sees it (its PID namespace); None once the main process ended
    exec_main_pid: int | None  # the last main process started, still set after it ended
    exec_main_code: int  # CLD_EXITED, CLD_KILLED, CLD_DUMPED; 0 while it runs or before
    exec_main_status: int  # exit status, or the signal number when killed
    invocation_id: str
    active_enter_monotonic_us: int
    inactive_enter_monotonic_us: int
    fragment_path: str
    drop_in_paths: tuple[str, ...]
    control_group: str

    @classmethod
    def from_show(cls, unit: str, props: Mapping[str, str]) -> UnitState:
        def number(name: str) -> int:
            value = props.get(name, "")
            return int(value) if value.isdigit() else 0

        main_pid = number("MainPID")
        return cls(
            unit=props.get("Id") or unit,
            load_state=props.get("LoadState", ""),
            active_state=props.get("ActiveState", ""),
            sub_state=props.get("SubState", ""),
            result=props.get("Result", ""),
            n_restarts=number("NRestarts"),
            main_pid=main_pid or None,
            exec_main_pid=number("ExecMainPID") or None,
            exec_main_code=number("ExecMainCode"),
            exec_main_status=number("ExecMainStatus"),
            invocation_id=props.get("InvocationID", ""),
            active_enter_monotonic_us=number("ActiveEnterTimestampMonotonic"),
            inactive_enter_monotonic_us=number("InactiveEnterTimestampMonotonic"),
            fragment_path=props.get("FragmentPath", ""),
            drop_in_paths=tuple(props.get("DropInPaths", "").split()),
            control_group=props.get("ControlGroup", ""),
        )


@dataclass(frozen=True)
class ListedUnit:
    """A row of `systemctl list-units`."""

    unit: str
    load_state: str
    active_state: str
    sub_state: str
    description: str


@dataclass(frozen=True)
class UnitProcess:
    """A process in a unit's cgroup. `pid` is as ctxmgr sees it (what NVML and /proc here report);
    `ns_pid` is as the unit's systemd sees it (MainPID)."""

    pid: int
    ns_pid: int
    ppid: int
    argv: tuple[str, ...]
    is_main: bool


def parse_environment(value: str) -> dict[str, str]:
    """The `Environment=` property as `systemctl show` prints it: one word per assignment, words with
    spaces or special characters in double quotes with C escapes (`"D=tab\\there"`), split by the same
    rules systemd reads them with."""
    return parse_environment_words(value, shell_quoted=True)


@dataclass
class Systemd:
    """A systemd manager, on this host or reached through `wrapper` (see the module docstring)."""

    wrapper: tuple[str, ...] = ()
    root: Path = Path("/")
    unit_dir: Path = SYSTEM_UNIT_DIR  # systemd's view; ctxmgr writes to host_path(unit_dir)
    user: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    # the manager's release, read once (see `version`); None until then
    _version: int | None = field(default=None, repr=False, compare=False)

    # -- constructors ---------------------------------------------------------------------------------

    @classmethod
    def local(cls, unit_dir: Path | None = None, user: bool = False) -> Systemd:
        if unit_dir is None:
            unit_dir = Path.home() / ".config/systemd/user" if user else SYSTEM_UNIT_DIR
        return cls(unit_dir=unit_dir, user=user)

    @classmethod
    def for_pid(cls, pid: int, unit_dir: Path = SYSTEM_UNIT_DIR) -> Systemd:
        """The manager that runs as `pid` here, in its own namespaces (a sandbox, an nspawn or OCI
        container): its own tools run in every namespace it is in, with no capability and no variable
        of ours (enter.py says why), and its files are under /proc/PID/root."""
        return cls(
            wrapper=container_wrapper(pid),
            root=Path(f"/proc/{pid}/root"),
            unit_dir=unit_dir,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Systemd:
        """CTXMGR_SYSTEMD_PID: reach the manager running as that PID (see for_pid);
        CTXMGR_UNIT_DIR: where new units go (systemd's view)."""
        env = os.environ if environ is None else environ
        unit_dir = Path(env["CTXMGR_UNIT_DIR"]) if env.get("CTXMGR_UNIT_DIR") else None
        pid_text = env.get("CTXMGR_SYSTEMD_PID", "").strip()
        if pid_text:
            if not pid_text.isdigit():
                raise SystemdError(f"CTXMGR_SYSTEMD_PID must be a process id, not {pid_text!r}")
            return cls.for_pid(int(pid_text), unit_dir=unit_dir or SYSTEM_UNIT_DIR)
        return cls.local(unit_dir=unit_dir)

    # -- paths ----------------------------------------------------------------------------------------

    def host_path(self, path: str | os.PathLike[str]) -> Path:
        """Where a path in systemd's view is found from here."""
        pure = PurePosixPath(path)
        if not pure.is_absolute():
            raise SystemdError(f"not an absolute path: {str(path)!r}")
        return self.root.joinpath(*pure.parts[1:])

    @property
    def host_unit_dir(self) -> Path:
        return self.host_path(self.unit_dir)

    @property
    def runtime(self) -> bool:
        """Units live under /run: enabling must stay there too (a plain enable writes to /etc)."""
        return PurePosixPath(self.unit_dir).is_relative_to("/run")

    # -- running the tools ----------------------------------------------------------------------------

    def command(self, tool: str, *args: str) -> list[str]:
        """The argv that runs `tool` against this manager."""
        scope = ["--user"] if self.user and tool in ("systemctl", "systemd-analyze") else []
        return [*self.wrapper, tool, *scope, *args]

    def _run(
        self,
        tool: str,
        *args: str,
        check: bool = True,
        timeout: float | None = None,
        what: str = "",
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = self.command(tool, *args)
        label = what or " ".join([tool, *args])
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**tool_env(), **(env or {})},
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise SystemdError(f"{label}: {exc.filename or argv[0]} not found") from None
        try:
            stdout, stderr = process.communicate(timeout=timeout or self.timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(process)
            process.communicate()
            raise SystemdError(f"{label}: no answer within {timeout or self.timeout_s:g} s") from None
        out = stdout.decode(errors="replace")
        err = stderr.decode(errors="replace")
        if check and process.returncode != 0:
            detail = one_line(err) or one_line(out) or f"exit status {process.returncode}"
            raise SystemdError(f"{label} failed: {detail}")
        return subprocess.CompletedProcess(argv, process.returncode, out, err)

    def systemctl(self, *args: str, check: bool = True, timeout: float | None = None) -> str:
        label = " ".join(["systemctl", *args])
        return self._run("systemctl", "--no-pager", *args, check=check, timeout=timeout, what=label).stdout

    # -- the manager's release ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The manager's systemd release (247, 252, ...), from its own Version property, read once: the
        features above systemd 247 (features.USES) are used only where it has them. The tools run in the
        manager's namespaces (`wrapper`), so they are its release too."""
        if self._version is None:
            done = self._run("systemctl", "--no-pager", "show", "-p", "Version", what="systemctl show")
            text = done.stdout.strip().partition("=")[2]
            number = parse_version(text)
            if number is None:
                raise SystemdError(f"systemctl show -p Version: not a systemd release: {text[:64]!r}")
            if number < FLOOR:  # checked as it runs: below the floor, no use in features.USES is known
                raise SystemdError(
                    f"the manager runs systemd {number}, older than systemd {FLOOR}, the oldest ctxmgr "
                    "supports"
                )
            self._version = number
        return self._version

    def has(self, kind: str, name: str) -> bool:
        """Whether this manager has an inventoried feature (features.USES): its release is at least
        the one that introduced it."""
        since = use(kind, name).since
        return since is None or self.version >= since

    def show_times(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show` of properties that hold timestamps, in a form parse_timestamp reads: Unix
        seconds where the manager has --timestamp=unix (251) and applies it, else (247, and `show`
        of 252, which ignores --timestamp) the date, in UTC since TZ=UTC."""
        style = TIMESTAMP_UNIX if self.has(SYSTEMCTL, TIMESTAMP_UNIX) else TIMESTAMP_US_UTC
        out = self._run(
            "systemctl", "--no-pager", "show", unit, "-p", ",".join(props), style,
            env={"TZ": "UTC"}, what=f"systemctl show {unit}",
        ).stdout  # fmt: skip
        return dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)

    # -- unit properties ------------------------------------------------------------------------------

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show`: every property, or only `props`. A unit that does not exist is not an
        error: its LoadState is "not-found"."""
        args = ["show", unit]
        if props:
            args += ["-p", ",".join(props)]
        out = self._run("systemctl", "--no-pager", *args, what=f"systemctl show {unit}").stdout
        result: dict[str, str] = {}
        for line in out.splitlines():
            name, eq, value = line.partition("=")
            if eq:
                result[name] = value
        return result

    def state(self, unit: str) -> UnitState:
        return UnitState.from_show(unit, self.show(unit, *STATE_PROPERTIES))

    def environment(self, unit: str) -> dict[str, str]:
        """The unit's Environment= assignments, unescaped (EnvironmentFile= is not included)."""
        return parse_environment(self.show(unit, "Environment").get("Environment", ""))

    def cat(self, unit: str) -> str:
        """`systemctl cat`: the unit file and its drop-ins, each after a `# /path` line."""
        return self.systemctl("cat", unit)

    def is_active(self, unit: str) -> bool:
        return self._run("systemctl", "is-active", "--quiet", unit, check=False).returncode == 0

    def list_units(self, pattern: str = "*", all_units: bool = True) -> list[ListedUnit]:
        args = ["list-units", "--plain", "--no-legend", "--full"]
        if all_units:
            args.append("--all")
        rows: list[ListedUnit] = []
        for line in self.systemctl(*args, "--", pattern).splitlines():
            words = line.lstrip("●* ").split(None, 4)
            if len(words) >= 4:
                rows.append(ListedUnit(*words[:4], words[4] if len(words) > 4 else ""))
        return rows

    def list_unit_files(self, pattern: str = "*") -> dict[str, str]:
        """Unit files (loaded or not) and their enablement state, e.g. {"vllm.service": "enabled"}."""
        out = self.systemctl("list-unit-files", "--plain", "--no-legend", "--full", "--", pattern)
        rows: dict[str, str] = {}
        for line in out.splitlines():
            words = line.split()
            if len(words) >= 2:
                rows[words[0]] = words[1]
        return rows

    # -- jobs -----------------------------------------------------------------------------------------

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def _job(self, verb: str, unit: str, no_block: bool, timeout: float | None) -> None:
        # a blocking job lasts as long as the unit's TimeoutStartSec/TimeoutStopSec (90 s by default)
        args = [verb, *(["--no-block"] if no_block else []), unit]
        self.systemctl(*args, timeout=timeout or (self.timeout_s if no_block else DEFAULT_JOB_TIMEOUT_S))

    def start(self, unit: str, no_block: bool = False, timeout: float | None = None) -> None:
        self._job("start", unit, no_block, timeout)

    def stop(self, unit: str, no_block: bool = False, timeout: float | None = None) -> None:
        """Stop; systemd kills every process left in the unit's cgroup, SIGKILL after TimeoutStopSec."""
        self._job("stop", unit, no_block, timeout)

    def restart(self, unit: str, no_block: bool = True, timeout: float | None = None) -> None:
        """Queue a restart; with no_block the journal and `state` tell how it went. A unit that hit its
        start rate limit refuses to start until reset_failed."""
        self._job("restart", unit, no_block, timeout)

    def reset_failed(self, unit: str) -> None:
        """Clear a failed state and the start rate limit, so a new start is not refused.

        A unit stopped behind ctxmgr's back may already be unloaded by systemd's garbage collection;
        `reset-failed` then says "not loaded", and there is nothing to reset.
        """
        try:
            self.systemctl("reset-failed", unit)
        except SystemdError as exc:
            if "not loaded" not in str(exc):
                raise

    def enable(self, unit: str, now: bool = False) -> None:
        self.systemctl("enable", *self._enable_flags(now), unit)

    def disable(self, unit: str, now: bool = False) -> None:
        self.systemctl("disable", *self._enable_flags(now), unit)

    def enable_now(self, unit: str) -> None:
        self.enable(unit, now=True)

    def _enable_flags(self, now: bool) -> list[str]:
        return (["--now"] if now else []) + (["--runtime"] if self.runtime else [])

    # -- processes ------------------------------------------------------------------------------------

    def _cgroup_dir(self, control_group: str) -> Path | None:
        relative = control_group.lstrip("/")
        for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup", "/sys/fs/cgroup/systemd"):
            candidate = self.host_path(base) / relative
            if files.exists(candidate / "cgroup.procs"):
                return candidate
        return None

    def unit_processes(self, unit: str) -> list[int]:
        """PIDs (as seen here) of every process in the unit's cgroup, children included."""
        control_group = self.show(unit, "ControlGroup").get("ControlGroup", "")
        if not control_group:
            return []
        directory = self._cgroup_dir(control_group)
        if directory is None:
            return []
        pids: list[int] = []
        for procs in [directory / "cgroup.procs", *sorted(directory.rglob("*/cgroup.procs"))]:
            with contextlib.suppress(FileNotFoundError):
                text = files.read_regular(procs, CGROUP_PROCS_MAX_BYTES, what="cgroup", error=SystemdError)
                pids.extend(int(word) for word in text.split() if word.isdigit())
        return sorted(set(pids))

    def _pid_namespace_level(self) -> int:
        """How deep the manager's PID namespace is below ours (1: the same), from its NSpid line."""
        match = re.fullmatch(r"/proc/(\d+)/root", str(self.root))
        if not match:
            return 1
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{match[1]}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    return len(line.split()) - 1
        return 1

    def process_tree(self, unit: str) -> list[UnitProcess]:
        """What runs in the unit now, with each process's argv, to report what ran."""
        main_pid = self.state(unit).main_pid
        level = self._pid_namespace_level()
        processes: list[UnitProcess] = []
        for pid in self.unit_processes(unit):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            ns_pids = fields.get("NSpid", str(pid)).split()
            ns_pid = int(ns_pids[min(level, len(ns_pids)) - 1])
            processes.append(
                UnitProcess(
                    pid=pid,
                    ns_pid=ns_pid,
                    ppid=int(fields.get("PPid", "0").strip()),
                    argv=tuple(arg.decode(errors="replace") for arg in argv if arg),
                    is_main=main_pid is not None and ns_pid == main_pid,
                )
            )
        return processes

    # -- verification ---------------------------------------------------------------------------------

    def analyze_verify(self, path: str | os.PathLike[str], unit_name: str | None = None) -> list[str]:
        """Problems `systemd-analyze verify` finds in a candidate unit file before it is installed.

        `path` is a file here (not in systemd's view); see analyze_verify_text."""
        source = Path(path)
        try:
            text = source.read_bytes()
        except OSError as exc:
            raise SystemdError(f"cannot read {source}: {exc.strerror}") from None
        return self.analyze_verify_text(text, unit_name or source.name)

    def analyze_verify_text(self, text: bytes, unit_name: str) -> list[str]:
        """Problems `systemd-analyze verify` finds in a unit's text (fragment and drop-ins merged).

        The text is written to a private directory of the manager's runtime dir (verify_staging_dir),
        named as the unit, since verify takes the unit's name from the file name; nothing is written
        to ctxmgr's state directory, so a dry run needs no write access there. Returned lines are the
        ones about this unit: unknown or misspelt directives, bad values, an ExecStart that is not
        executable there. Problems in units it merely depends on are left out. An empty list means
        systemd accepts it.
        """
        name = unit_name
        if "/" in name or "." not in name:
            raise SystemdError(f"not a unit name: {name!r}")
        base, inner_base = self.verify_staging_dir()
        # below 250 verify also fails on the units this one names (After=, Wants=): its own lines
        # are kept below, and the exit status alone no longer says this unit is at fault
        recursive = not self.has(ANALYZE, RECURSIVE_ERRORS_NO)
        with _staged(base, name, text) as staging:
            inner = inner_base / staging / name
            result = self._run(
                "systemd-analyze",
                "verify",
                "--man=no",
                *([] if recursive else [RECURSIVE_ERRORS_NO]),
                str(inner),
                check=False,
                what=f"systemd-analyze verify {name}",
            )
        output = result.stderr + result.stdout
        return _verify_problems(output, name, str(inner), result.returncode, recursive=recursive)

    def verify_staging_dir(self) -> tuple[Path, PurePosixPath]:
        """Where a candidate is written for systemd-analyze, here and in the manager's view: its /run
        (root) or the user's runtime dir under it ($XDG_RUNTIME_DIR), both visible in its mount namespace;
        for a manager on this host without either, the temporary directory (it sees ours)."""
        candidates = [PurePosixPath("/run")]
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        if runtime.startswith("/run/"):
            candidates.append(PurePosixPath(runtime))
        for inner in candidates:
            host = self.host_path(inner)
            if host.is_dir() and os.access(host, os.W_OK | os.X_OK):
                return host, inner
        if str(self.root) == "/":
            temporary = Path(tempfile.gettempdir())
            return temporary, PurePosixPath(temporary)
        raise SystemdError(
            f"cannot write a candidate unit for systemd-analyze under {self.host_path('/run')}"
        )

    # -- journal --------------------------------------------------------------------------------------

    def journal_cursor(self) -> str:
        """The cursor of the journal's last entry: pass it as after_cursor to see only what follows."""
        return last_cursor(
            self._run("journalctl", "--no-pager", "-o", "json", "-n", "1", what="journalctl -n 1").stdout
        )

    def journal(
        self, unit: str | None, after_cursor: str | None = None, lines: int | None = None
    ) -> list[JournalEntry]:
        """Entries of `unit` (with systemd's messages about it), oldest first: those after the cursor,
        and/or the last `lines`."""
        args = journal_args(unit, self.user, after_cursor, lines)
        return parse_journal_json(self._run("journalctl", *args, what=f"journalctl {unit or ''}").stdout)

    def follow(self, unit: str | None, after_cursor: str | None = None) -> JournalFollower:
        """Start `journalctl -f` for the unit; entries after the cursor come first, then new ones.
        Without a cursor only new entries come. Close the follower when done."""
        return JournalFollower(
            self.command("journalctl", *journal_args(unit, self.user, after_cursor, follow=True))
        )

    def with_unit_dir(self, unit_dir: Path) -> Systemd:
        return replace(self, unit_dir=unit_dir)


@contextlib.contextmanager
def _staged(base: Path, name: str, text: bytes) -> Iterator[str]:
    """A private folder (0700) under `base` holding `text` as `name`, removed afterwards; yields the
    folder's name. Made at descriptors of `base` opened as the manager sees it (files.open_path): a
    container's /run linked to a host folder cannot make root write there."""
    try:
        with files.directory_fd(base) as base_fd:
            folder = f"ctxmgr-verify-{secrets.token_hex(6)}"
            os.mkdir(folder, 0o700, dir_fd=base_fd)
            try:
                folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=base_fd)
                try:
                    fd = os.open(
                        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder_fd
                    )
                    with os.fdopen(fd, "wb") as handle:
                        handle.write(text)
                    yield folder
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=folder_fd)
                    os.close(folder_fd)
            finally:
                with contextlib.suppress(OSError):
                    os.rmdir(folder, dir_fd=base_fd)
    except OSError as exc:
        raise SystemdError(
            f"cannot write a candidate unit for systemd-analyze under {base}: {exc.strerror}"
        ) from None


# the launcher's interpreter flags (Python's, not a systemd tool's): isolated, no site directory
PYTHON_ISOLATED = ("-I", "-S")


def container_wrapper(pid: int) -> tuple[str, ...]:
    """The argv prefix that runs a tool of the manager `pid` as enter.py does: this Python, isolated
    (-I -S: no variable, no site directory, nothing of the container's loaded before exec)."""
    return (sys.executable, *PYTHON_ISOLATED, str(Path(__file__).with_name("enter.py")), str(pid))


CMDLINE_MAX_BYTES = 1 << 20
CGROUP_PROCS_MAX_BYTES = 4 << 20  # a PID is at most 8 digits: half a million processes


def cmdline_argv(systemd: Systemd, main_pid: int) -> list[str] | None:
    """The argv the service's main process really got (/proc/MAINPID/cmdline in the manager's own /proc),
    to cross-check the argv read from the unit; None when the process is gone."""
    path = systemd.host_path(f"/proc/{main_pid}/cmdline")
    try:
        # non-blocking and in the manager's own root: a FIFO mounted over it cannot hang the read
        fd = files.open_path(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise SystemdError(f"cannot read {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SystemdError(f"{path}: {files.file_kind(mode)}, not the process's own cmdline")
        data = os.read(fd, CMDLINE_MAX_BYTES)
    except ProcessLookupError:
        return None
    except OSError as exc:
        raise SystemdError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not data:
        return None  # a zombie or a kernel thread
    return [arg.decode("utf-8", "surrogateescape") for arg in data.removesuffix(b"\0").split(b"\0")]


# colour codes: systemd 247's log lines carry them even into a pipe
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# a unit name as systemd-analyze prints it at the start of a line about that unit ("x.service: ...",
# "/path/x.service:3: ...")
_UNIT_LINE = re.compile(
    r"^(\S*/)?[\w@:.\\-]+\.(service|socket|target|timer|mount|automount|path|slice|scope|device|swap)"
    r"([:\s]|$)"
)


_UTC_TIMESTAMP = re.compile(r"(?:\w{3} )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d{1,6})? UTC")


def parse_timestamp(value: str) -> float | None:
    """A timestamp property as `Systemd.show_times` prints it, as Unix time: "@1765000000.123456"
    (--timestamp=unix where `show` applies it) or "Mon 2026-12-07 03:00:00 UTC" (247 and 252 print
    this whatever --timestamp says; microseconds where us+utc is applied). None for an unset one."""
    value = value.strip()
    if value.startswith("@"):
        try:
            return float(value[1:])
        except ValueError:
            return None
    match = _UTC_TIMESTAMP.fullmatch(value)
    if not match:
        return None
    moment = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return moment.timestamp() + (float(match[2]) if match[2] else 0.0)


def _verify_problems(
    output: str, name: str, inner_path: str, returncode: int, recursive: bool = False
) -> list[str]:
    """The lines of systemd-analyze verify that are about the candidate, its path replaced by its name
    so that the lines for two files of the same unit compare equal (see new_problems).

    `recursive`: verify ran without --recursive-errors=no (systemd < 250), so a non-zero exit may come
    from another unit alone; it counts only when some line is not about another unit."""
    about_unit = re.compile(rf"(^|[\s/'\"]){re.escape(name)}($|[\s:.'\"])")
    problems: list[str] = []
    others: list[str] = []
    for line in _ANSI.sub("", output).splitlines():
        text = line.strip().replace(inner_path, name)
        if text and about_unit.search(text):
            problems.append(text)
        elif text:
            others.append(text)
    if recursive and not problems and any(_UNIT_LINE.match(text) for text in others):
        return []  # the exit status is other units' errors: what --recursive-errors=no leaves out
    if returncode != 0 and not problems:
        detail = one_line(output) or f"exit status {returncode}"
        problems.append(f"{name}: {VERIFY_DID_NOT_RUN}: {detail}")
    return problems


# how a problem says that verify itself failed (no line about the unit): the unit was not checked
VERIFY_DID_NOT_RUN = "systemd-analyze verify failed"


def verify_did_not_run(problem: str) -> bool:
    """Whether a verify problem is verify failing to check the unit at all (an option this manager's
    systemd-analyze lacks, a crash) rather than a finding about the unit."""
    return problem.partition(": ")[2].startswith(VERIFY_DID_NOT_RUN)


def new_problems(candidate: Sequence[str], current: Sequence[str]) -> list[str]:
    """The candidate's verify problems that the installed unit does not have already (line numbers are
    ignored: an edit moves them). A change should not be refused for what it inherited."""

    def key(problem: str) -> str:
        return re.sub(r"^(\S+?):\d+:", r"\1:", problem)

    known = {key(problem) for problem in current}
    return [problem for problem in candidate if key(problem) not in known]
