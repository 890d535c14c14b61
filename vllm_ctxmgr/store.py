"""Revisions, the per-service lock and atomic writes.

Layout under the state directory (default /var/lib/ctxmgr, root-only: 0700 dirs, 0600 files,
since unit copies may hold API keys):

    SERVICE/lock                          flock; holds the PID and command of the holder
    SERVICE/revisions/NNNN/record.json    what, who, where, when (ISO 8601), the state and its steps
    SERVICE/revisions/NNNN/plan.json      the plan the change was made from (long: kept apart)
    SERVICE/revisions/NNNN/unit           the unit file content this revision installs
    SERVICE/revisions/NNNN/previous       the content it replaced (byte for byte)
                                          (either is absent where the file is: a drop-in ctxmgr
                                          created did not exist before, and rolling back removes it)
    SERVICE/revisions/NNNN/unit.1, previous.1, ...
                                          the same for every further unit file the revision changed
                                          (a rollback puts back each file changed since its target);
                                          record.json's `files` lists each path with the names of its
                                          two copies, null where the file is (or was) absent
    SERVICE/revisions/.new-XXXX/          a revision being written; renamed to NNNN once whole
    SERVICE/observations.jsonl            what each watched start of the service logged (the last KEEP)
    SERVICE/last-verify.json              the last verification (unit invocation, restarts, result)

The states a change can be in, in the order it walks through them. Each is written to record.json
BEFORE the step it names begins, so a run killed anywhere leaves a record that says which step was
under way, and the next run (`recover`) finishes from there:

    planned        in memory only: a plan and a rendered unit; nothing is written yet
    recorded       the revision directory (record, unit, previous, plan) is in place; the unit is untouched
    installed      the new unit replaces the old one (one atomic rename: the file is one or the other)
    restarting     daemon-reload and restart; the journal is followed until vLLM serves or says why not
    serving        vLLM logged it serves and /health answers; the context-sized probe runs
    probed         the probe passed; only the record is left to finish
    final          done: the new unit serves and passed its probe
    rolling-back   something failed (or the run was interrupted): the previous unit is being put back
    rolled-back    the previous unit is back, restarted and probed at its own context
    rollback-failed  the previous unit did not come back either: the service needs a human
    baseline       the unit as ctxmgr first found it (so `rollback --to 0` can return to it)
    in-progress    written by ctxmgr before the states above existed: recorded or later, not finished

A revision directory appears whole or not at all (written under .new-*, then renamed), so a kill
while it is written leaves only a directory that the next run removes, never one that wedges the
numbering.

Why one module of ~930 lines: every path below the state directory is reached through one checked
walk (owner and mode as sshd's StrictModes, O_NOFOLLOW from the parent's descriptor); the revisions,
the lock and the observations each use it, and splitting them would hand the open descriptors across
modules.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import pwd
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import cast

from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.core.observations import StoredObservation
from vllm_ctxmgr.core.records import HistoryRow, RevisionRecord, StepRecord
from vllm_ctxmgr.errors import CtxmgrError, LockedError, UnsafePathError, UsageError
from vllm_ctxmgr.masking import scrub

KEEP = 50  # revisions and observations kept per service (plus every revision a rollback may need)
RECORD_FORMAT = 3  # 1: epoch floats, the plan inline, no steps; 2: one file (`unit_path`); both read still
STALE_S = 600.0  # a leftover /run/ctxmgr-verify-* older than this belongs to no live run
MAX_STORED = 64 << 20  # no record, plan or unit ctxmgr wrote is near this: a larger one is not ours


class State(StrEnum):
    """The states of a revision; see the module docstring for what each means on disk."""

    PLANNED = "planned"
    RECORDED = "recorded"
    INSTALLED = "installed"
    RESTARTING = "restarting"
    SERVING = "serving"
    PROBED = "probed"
    FINAL = "final"
    ROLLING_BACK = "rolling-back"
    ROLLED_BACK = "rolled-back"
    ROLLBACK_FAILED = "rollback-failed"
    BASELINE = "baseline"
    IN_PROGRESS = "in-progress"  # format 1 only; never entered now


# The only moves a revision makes. Any state between recorded and probed may fail into rolling-back;
# a probed one that was interrupted is finished forward by recovery; rolling-back may be entered again
# when a recovery resumes a rollback an interrupted run left.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.PLANNED: frozenset({State.RECORDED}),
    State.RECORDED: frozenset({State.INSTALLED, State.ROLLING_BACK}),
    State.INSTALLED: frozenset({State.RESTARTING, State.ROLLING_BACK}),
    State.RESTARTING: frozenset({State.SERVING, State.ROLLING_BACK}),
    State.SERVING: frozenset({State.PROBED, State.ROLLING_BACK}),
    State.PROBED: frozenset({State.FINAL, State.ROLLING_BACK}),
    State.ROLLING_BACK: frozenset({State.ROLLING_BACK, State.ROLLED_BACK, State.ROLLBACK_FAILED}),
    State.IN_PROGRESS: frozenset({State.ROLLING_BACK}),
    State.FINAL: frozenset(),
    State.ROLLED_BACK: frozenset(),
    State.ROLLBACK_FAILED: frozenset(),
    State.BASELINE: frozenset(),
}
FINISHED = frozenset({State.FINAL, State.ROLLED_BACK, State.ROLLBACK_FAILED, State.BASELINE})
PENDING = frozenset(TRANSITIONS) - FINISHED - {State.PLANNED}  # what `recover` must finish

# A revision whose unit served and passed its probe, or the unit as ctxmgr first found it: what a
# rollback may return to and what verify counts as a known-good unit (core.verdict keeps the same two
# names as strings, since the core cannot import the store; a test ties them)
GOOD = frozenset({State.FINAL, State.BASELINE})


class StoreError(CtxmgrError):
    """A record in the state directory that ctxmgr cannot read: the message names the file."""


# Called with (step, command) right after each step of a change is recorded (a state, or
# "revision-staged": a revision written but not yet renamed into place). None in every real run: only
# Python code can set it (the crash-campaign tests do, through tests/support/crash_run.py), so no
# environment variable or flag can make ctxmgr stop half-way.
step_hook: Callable[[str, str], None] | None = None


@contextlib.contextmanager
def _closing(fd: int | None) -> Iterator[int | None]:
    """A directory descriptor (or None, where the directory is not there) closed after use."""
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def crash_point(name: str, command: str = "") -> None:
    """Where a test may kill the run (see step_hook); nothing happens otherwise."""
    if step_hook is not None:
        step_hook(name, command)


def iso(epoch: float | None) -> str | None:
    """Local time with its UTC offset, to the millisecond: what a person reading record.json wants."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def _epoch(value: JSONValue, path: Path, key: str) -> float | None:
    """An ISO-8601 time (format 2) or epoch seconds (format 1)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise StoreError(f"{path}: {key} is not a time: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        raise StoreError(f"{path}: {key} is not an ISO-8601 time: {value!r}") from None


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never half of one."""
    path = Path(path)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    try:
        st = path.stat()
        owner: tuple[int, int] | None = (st.st_uid, st.st_gid)
    except FileNotFoundError:
        owner = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ctxmgr-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        if owner is not None and os.geteuid() == 0:
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


# ---- trusted, symlink-free access to the state directory ------------------------------------------
# Every file and directory below the state directory is opened from its checked parent's descriptor
# with O_NOFOLLOW, and each is checked as sshd's StrictModes checks a home directory: owned by the
# running user (or root) and writable by nobody else. A revision planted there is installed as root
# by `rollback`, so anything another user could have written is refused, never read.

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _who() -> str:
    return "root" if os.geteuid() == 0 else _user()


def check_trusted(st: os.stat_result, path: Path | str, sticky_ok: bool = False) -> None:
    """StrictModes: refuse what another user owns or what group or others may write. With `sticky_ok`,
    a directory others may write passes when it is sticky (/tmp's 1777: nobody else may remove or
    rename what is ours there)."""
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePathError(
            f"{path}: owned by uid {st.st_uid}, not {_who()}: another user could plant what ctxmgr "
            f"runs as {_who()}; if it is yours, run `chown {_who()} {path}`"
        )
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        mode = f"mode {st.st_mode & 0o7777:04o}"
        if sticky_ok:
            raise UnsafePathError(
                f"{path}: writable by group or others ({mode}) and not sticky: another user could swap a "
                f"link in; run `chmod +t {path}` (or `chmod go-w {path}`)"
            )
        raise UnsafePathError(f"{path}: writable by group or others ({mode}): run `chmod go-w {path}`")


def _refuse_link(parent_fd: int, name: str, path: Path) -> None:
    """Say why an O_NOFOLLOW open failed where the name is a symbolic link."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{path}: a symbolic link; ctxmgr follows none in its state directory: remove it (`rm {path}`)"
        )


def _os_error(path: Path, exc: OSError) -> CtxmgrError:
    return StoreError(f"{path}: {exc.strerror or exc}")


@contextlib.contextmanager
def writing(directory: Path) -> Iterator[None]:
    """Writes below `directory` of the state directory: an OSError on the way (a full filesystem,
    ENOSPC; a quota, EDQUOT; a read-only mount) becomes one StoreError line naming the file, not an
    "unexpected error". Names below a directory descriptor are relative: they are joined to it."""
    try:
        yield
    except OSError as exc:
        name = exc.filename if isinstance(exc.filename, str) else ""
        path = directory / name if name else directory
        hint = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = " (free space on its filesystem, or name another with --state-dir)"
        raise StoreError(f"{path}: {exc.strerror or exc}: ctxmgr could not write its state{hint}") from None


def open_state_dir(state_dir: Path, create: bool) -> int | None:
    """The state directory the operator named (a link there is the operator's own), checked; None
    where it does not exist and `create` is false."""
    if create:
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise _os_error(state_dir, exc) from None
    try:
        fd = os.open(state_dir, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        if create:
            raise StoreError(f"{state_dir}: not a directory") from None
        return None  # a read-only run (a dry run, status) by a user who may not read it: nothing stored
    except OSError as exc:
        raise _os_error(state_dir, exc) from None
    try:
        check_trusted(os.fstat(fd), state_dir)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_checked_dir(directory: Path, sticky_ok: bool = False) -> int:
    """A directory the operator named (a link on the way is the operator's own), checked as the state
    directory is; with `sticky_ok` a sticky directory others may write passes (see check_trusted)."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise _os_error(directory, exc) from None
    try:
        st = os.fstat(fd)
        check_trusted(st, directory, sticky_ok)
        _check_ancestors(directory, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_ancestors(directory: Path, opened: os.stat_result) -> None:
    """Every directory above `directory` (its real path), as sshd's StrictModes checks each component:
    one another user owns, or may write without the sticky bit, could rename `directory` away and
    put a link in its place (issue 36 item 17). The real path must still be the directory opened."""
    real = Path(os.path.realpath(directory))
    try:
        now = os.stat(real)
    except OSError as exc:
        raise _os_error(directory, exc) from None
    if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
        raise UnsafePathError(f"{directory}: moved while it was checked; run again")
    for parent in reversed(real.parents):
        try:
            check_trusted(os.stat(parent), parent, sticky_ok=True)
        except OSError as exc:
            raise _os_error(parent, exc) from None


def check_ours_at(parent_fd: int, name: str, path: Path) -> None:
    """In a directory others may write: `name`, where present, must be a regular file of ours (not a
    link, nor another user's file that ctxmgr would take over)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _os_error(path, exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{path}: a symbolic link in a directory others may write; ctxmgr follows none there: "
            f"remove it (`rm {path}`)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path}: not a regular file: remove it (`rm {path}`)")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path}: owned by uid {st.st_uid}, not {_who()}, in a directory others may write: "
            f"remove it (`rm {path}`) if it is not needed"
        )


def open_dir_at(parent_fd: int, name: str, path: Path, create: bool, tighten: bool = False) -> int | None:
    """A directory below a checked one, never through a link; None where absent and not `create`."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise _os_error(path, exc) from None
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError, OSError) as exc:
        _refuse_link(parent_fd, name, path)
        if isinstance(exc, FileNotFoundError | PermissionError) and not create:
            return None  # absent, or not readable by this (read-only) run: nothing stored for it
        if isinstance(exc, NotADirectoryError):
            raise StoreError(f"{path}: not a directory (remove it, ctxmgr keeps a directory there)") from None
        raise _os_error(path, exc) from None
    try:
        check_trusted(os.fstat(fd), path)
        if tighten:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file_at(parent_fd: int, name: str, path: Path, flags: int, mode: int = 0o600) -> int | None:
    """A regular file below a checked directory, never through a link, checked once open; None where
    absent (and not created). O_NONBLOCK so that a FIFO planted there cannot hang the open."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _refuse_link(parent_fd, name, path)
        raise _os_error(path, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path}: not a regular file: remove it (`rm {path}`)")
        check_trusted(st, path)
        if st.st_nlink > 1:
            raise UnsafePathError(
                f"{path}: has {st.st_nlink} hard links; ctxmgr writes only its own: remove it"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(parent_fd: int, name: str, path: Path) -> bytes | None:
    """A stored file's bytes (bounded), or None where it is absent."""
    fd = _open_file_at(parent_fd, name, path, os.O_RDONLY)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_STORED + 1)
    if len(data) > MAX_STORED:
        raise StoreError(f"{path}: larger than {MAX_STORED >> 20} MiB: not a file ctxmgr wrote")
    return data


def _text(text: str) -> bytes:
    """What leaves ctxmgr for the state directory (records, plans, observations; never a unit copy,
    which must stay byte for byte): every key of every service read masked (masking.scrub)."""
    return scrub(text).encode()


def write_new_at(parent_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """A new file (never an existing one, never through a link), created 0600 and given `mode` on its
    own descriptor, so neither the umask nor a path swapped in between decides what it becomes."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=parent_fd)  # fmt: skip
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        if mode != 0o600:
            os.fchmod(handle.fileno(), mode)
        os.fsync(handle.fileno())


def atomic_write_at(parent_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """atomic_write below a checked directory: a temporary beside `name` (0600 until written, then
    `mode`), renamed over it."""
    tmp = f".{name}.{os.urandom(6).hex()}.ctxmgr-tmp"
    try:
        write_new_at(parent_fd, tmp, data, mode)
        os.replace(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except FileExistsError:
        raise  # the temporary name was taken (O_EXCL): not ours to remove
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=parent_fd)
        raise
    os.fsync(parent_fd)


def atomic_leftovers(directory: Path, name: str) -> list[Path]:
    """The temporary files atomic_write leaves beside `name` when the process is killed mid-write."""
    with contextlib.suppress(OSError):
        return sorted(directory.glob(f".{glob.escape(name)}.*.ctxmgr-tmp"))
    return []


# The names a revision keeps a unit file's two copies under: `unit`/`previous` for its first file (as
# every format-2 revision did), `unit.N`/`previous.N` for the N-th further one. Nothing else is read
# from record.json's `files`: a name like `../x` would leave the checked revision directory.
STORED_NAME = re.compile(r"(unit|previous)(\.[1-9][0-9]{0,3})?")


@dataclass(frozen=True)
class FileChange:
    """One unit file a revision writes or removes, with its bytes before and after (None: absent). A
    revision is the list of them, written in order and put back in the reverse order."""

    path: Path
    previous: bytes | None
    unit: bytes | None


def stored_names(index: int) -> tuple[str, str]:
    """(unit, previous) names of a revision's `index`-th file."""
    suffix = f".{index}" if index else ""
    return f"unit{suffix}", f"previous{suffix}"


def _files_of_record(value: JSONValue, path: Path) -> list[dict[str, str | None]]:
    """record.json's `files`, checked: absolute unit paths, each copy named as stored_names names it."""
    if not isinstance(value, list) or not value:
        raise StoreError(f"{path}: `files` is not a list of unit files")
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"path", "unit", "previous"}:
            raise StoreError(f"{path}: a file is not {{path, unit, previous}}: {item!r}")
        where = item["path"]
        if (
            not isinstance(where, str)
            or not where.startswith("/")
            or "\0" in where
            or ".." in where.split("/")
        ):
            raise StoreError(f"{path}: not an absolute unit file path: {where!r}")
        for which in ("unit", "previous"):
            name = item[which]
            if name is not None and not (isinstance(name, str) and STORED_NAME.fullmatch(name)):
                raise StoreError(f"{path}: {which} of {where} is not a stored copy's name: {name!r}")
        out.append({"path": where, "unit": item["unit"], "previous": item["previous"]})
    return out


@dataclass
class Step:
    """One line of a revision's story: the state it entered, when, and a note for a person."""

    state: State
    time: float
    note: str = ""

    def record(self) -> StepRecord:
        """The step as record.json keeps it: an ISO time a person reads, not epoch seconds."""
        return {"state": str(self.state), "time": iso(self.time), "note": self.note}


@dataclass
class Revision:
    """One change of a unit as recorded: what `history` shows, what `recover` resumes from and what
    `rollback` restores; epoch floats in memory, ISO 8601 in record.json."""

    number: int
    service: str
    state: State
    unit_path: str  # the file this revision changes (where ExecStart lives)
    created: float  # epoch seconds here; ISO 8601 in record.json
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    previous_max_model_len: int | None = None
    previous_gpu_memory_utilization: float | None = None
    action: str = "set-context"  # set-context | rollback | baseline
    rollback_of: int | None = None  # for a rollback: the revision whose unit it restores
    vllm_version: str | None = None
    reason: str = ""
    decisive_line: str = ""
    finished: float | None = None
    verified: bool = False
    plan: Mapping[str, object] = field(default_factory=dict)  # a PlanRecord, in plan.json beside the record
    capacity: dict[str, object] = field(default_factory=dict)  # change.observing.capacity and calibration
    user: str | None = None  # who made the change
    host: str | None = None  # where
    ctxmgr_version: str | None = None  # with which ctxmgr
    invocation_id: str | None = None  # the unit's InvocationID when the change was recorded
    # the multi-node change (the coordinator) this revision is one node's part of; None: a one-host change
    deployment: str | None = None
    steps: list[Step] = field(default_factory=list)
    # every unit file it changed, in the order written: {path, unit, previous}, each copy's name in the
    # revision directory or None where the file is (or was) absent (a format-2 record: `unit_path` only)
    files: list[dict[str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = State(self.state)

    def to_json(self) -> RevisionRecord:
        """The revision as Python sees it (epoch seconds, the plan inline): for --json and verify."""
        data = asdict(self)
        data["state"] = str(self.state)
        data["steps"] = [step.record() for step in self.steps]
        return cast(RevisionRecord, data)  # its keys are the fields (tests/test_records.py)

    def record(self) -> dict[str, object]:
        """record.json: ISO times, the steps a person reads, no plan (plan.json holds it)."""
        data: dict[str, object] = {"format": RECORD_FORMAT}
        for f in fields(self):
            if f.name == "plan":
                continue
            value = getattr(self, f.name)
            if f.name in ("created", "finished"):
                value = iso(value)
            elif f.name == "state":
                value = str(value)
            elif f.name == "steps":
                value = [step.record() for step in self.steps]
            data[f.name] = value
        return data

    @classmethod
    def load(cls, directory: Path, dir_fd: int) -> Revision:
        """Read record.json (format 1 or 2) and plan.json from the revision's checked directory
        descriptor; anything else is a StoreError naming the file."""
        path = directory / "record.json"
        try:
            raw = read_at(dir_fd, "record.json", path)
            if raw is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
            data = json.loads(raw.decode())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise StoreError(f"{path}: not a readable revision record ({exc})") from None
        if not isinstance(data, dict):
            raise StoreError(f"{path}: not a revision record (a JSON object was expected)")
        data = dict(data)
        version = data.pop("format", 1)
        if version not in (1, 2, RECORD_FORMAT):
            raise StoreError(f"{path}: record format {version!r} is newer than this ctxmgr reads")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StoreError(f"{path}: unknown key {unknown[0]!r} (written by another ctxmgr version?)")
        required = ("number", "service", "state", "unit_path", "created")
        missing = [key for key in required if key not in data]
        if missing:
            raise StoreError(f"{path}: missing key {missing[0]!r}")
        try:
            data["state"] = State(data["state"])
        except ValueError:
            raise StoreError(f"{path}: unknown state {data['state']!r}") from None
        data["created"] = _epoch(data["created"], path, "created")
        data["finished"] = _epoch(data.get("finished"), path, "finished")
        steps = []
        for raw in data.get("steps") or []:
            try:
                steps.append(Step(State(raw["state"]), _epoch(raw["time"], path, "steps.time") or 0.0,
                                  str(raw.get("note", ""))))  # fmt: skip
            except (KeyError, TypeError, ValueError):
                raise StoreError(f"{path}: a step is not {{state, time, note}}: {raw!r}") from None
        data["steps"] = steps
        if "files" in data:
            data["files"] = _files_of_record(data["files"], path)
        else:  # format 1 and 2: one file, its copies `unit` and `previous` where they exist
            data["files"] = [
                {"path": str(data["unit_path"])}
                | {which: which if _exists_at(dir_fd, which) else None for which in ("unit", "previous")}
            ]
        plan_path = directory / "plan.json"
        if "plan" not in data:
            plan = read_at(dir_fd, "plan.json", plan_path)
            try:
                if plan is not None:
                    data["plan"] = json.loads(plan.decode())
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise StoreError(f"{plan_path}: not readable JSON ({exc})") from None
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"{path}: {exc}") from None


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _name_of_host() -> str:
    return os.uname().nodename


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def ctxmgr_version() -> str | None:
    """The installed ctxmgr's version for the record, so a record another version wrote can be told
    apart; None when run from a source tree without package metadata."""
    try:
        return metadata.version("vllm-ctxmgr")
    except metadata.PackageNotFoundError:
        return None


def made_by() -> dict[str, str | None]:
    """Who, where and with which ctxmgr a change is made, for the record."""
    return {"user": _user(), "host": _name_of_host(), "ctxmgr_version": ctxmgr_version()}


class ServiceStore:
    """One service's revisions, observations and lock. Every access walks from the checked state
    directory's descriptor (see check_trusted): no path below it is followed through a link."""

    def __init__(self, state_dir: Path | str, service: str, keep: int = KEEP) -> None:
        # the CLI hands over systemd's canonical name (systemd/names.py); this is the last line of
        # defence for a path component: systemd's characters only, and never "." or ".."
        stem = service.removesuffix(".service")
        if not re.fullmatch(r"[A-Za-z0-9:_.@\\-]{1,255}", service) or set(stem) <= {"."}:
            raise UsageError(f"{service!r} is not a valid unit name")
        self.service = stem
        self.root = Path(state_dir) / self.service
        self.revisions_dir = self.root / "revisions"
        self.keep = keep

    @contextlib.contextmanager
    def _service_fd(self, create: bool = False) -> Iterator[int | None]:
        """The service's directory, checked (None where it does not exist and not `create`)."""
        state_fd = open_state_dir(self.root.parent, create)
        if state_fd is None:
            yield None
            return
        try:
            fd = open_dir_at(state_fd, self.service, self.root, create, tighten=create)
        finally:
            os.close(state_fd)
        with _closing(fd) as opened:
            yield opened

    @contextlib.contextmanager
    def _revisions_fd(self, create: bool = False) -> Iterator[int | None]:
        with self._service_fd(create) as service_fd:
            fd = (
                None
                if service_fd is None
                else open_dir_at(service_fd, "revisions", self.revisions_dir, create, tighten=create)
            )
            with _closing(fd) as opened:
                yield opened

    def _revision_fd(self, revisions_fd: int, name: str) -> contextlib.AbstractContextManager[int | None]:
        return _closing(open_dir_at(revisions_fd, name, self.revisions_dir / name, create=False))

    def ensure(self) -> None:
        """Make the state directories root-only (0700), and tighten ones that exist: the unit copies
        in revisions may hold API keys."""
        with self._revisions_fd(create=True):
            pass

    def _has_record(self, revisions_fd: int, name: str) -> bool:
        with self._revision_fd(revisions_fd, name) as fd:
            if fd is None:
                return False
            try:
                os.stat("record.json", dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            return True

    # ---- revisions -------------------------------------------------------------------------

    def revisions(self) -> list[Revision]:
        """Every whole revision, oldest first; a directory without a record is not one."""
        with self._revisions_fd() as revisions_fd:
            if revisions_fd is None:
                return []
            found = []
            for name in sorted(os.listdir(revisions_fd)):
                if not name.isdigit():
                    continue
                with self._revision_fd(revisions_fd, name) as fd:
                    if fd is None:
                        continue
                    try:
                        os.stat("record.json", dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    found.append(Revision.load(self.revisions_dir / name, fd))
        return sorted(found, key=lambda rev: rev.number)

    def get(self, number: int) -> Revision:
        """A revision by number; a missing one is the user's error (exit 2) pointing at `history`."""
        for rev in self.revisions():
            if rev.number == number:
                return rev
        raise UsageError(f"{self.service}: there is no revision {number} (see `ctxmgr history`)")

    def file_bytes(self, number: int, which: str = "unit") -> bytes | None:
        """`unit` or `previous` of a revision; None where the file was (or is to be) absent."""
        name = f"{number:04d}"
        directory = self.revisions_dir / name
        missing = FileNotFoundError(errno.ENOENT, "No such file or directory", str(directory / which))
        with self._revisions_fd() as revisions_fd:
            if revisions_fd is None:
                raise missing
            with self._revision_fd(revisions_fd, name) as fd:
                if fd is None:
                    raise missing
                data = read_at(fd, which, directory / which)
                if data is None and read_at(fd, "record.json", directory / "record.json") is None:
                    raise missing
                return data

    def file_changes(self, rev: Revision) -> list[FileChange]:
        """Every unit file `rev` changed with its two copies, in the order it wrote them."""
        name = f"{rev.number:04d}"
        directory = self.revisions_dir / name
        with self._revisions_fd() as revisions_fd:
            fd_cm = _closing(None) if revisions_fd is None else self._revision_fd(revisions_fd, name)
            with fd_cm as fd:
                if fd is None:
                    raise StoreError(
                        f"{directory}: missing, the files of revision {rev.number} cannot be read"
                    )

                def copy(stored: str | None) -> bytes | None:
                    if stored is None:
                        return None
                    data = read_at(fd, stored, directory / stored)
                    if data is None:
                        raise StoreError(f"{directory / stored}: missing, though record.json names it")
                    return data

                return [
                    FileChange(Path(str(f["path"])), copy(f["previous"]), copy(f["unit"])) for f in rev.files
                ]

    def new_revision(
        self,
        rev: Revision,
        unit: bytes | None = None,
        previous: bytes | None = None,
        files: list[FileChange] | None = None,
    ) -> Revision:
        """Write the whole revision under .new-*, then rename it to the next free number. `files`: every
        unit file it changes (without: `unit` and `previous` of `rev.unit_path`). A None copy is left
        out: the unit file is (or was) absent, not empty."""
        changes = files if files is not None else [FileChange(Path(rev.unit_path), previous, unit)]
        rev.files = []
        for index, change in enumerate(changes):
            unit_name, previous_name = stored_names(index)
            rev.files.append({
                "path": str(change.path),
                "unit": None if change.unit is None else unit_name,
                "previous": None if change.previous is None else previous_name,
            })  # fmt: skip
        self.remove_partial()
        with self._revisions_fd(create=True) as revisions_fd, writing(self.revisions_dir):
            assert revisions_fd is not None
            numbers = [int(name) for name in os.listdir(revisions_fd) if name.isdigit()]
            rev.number = max(numbers) + 1 if numbers else 0
            staging = f".new-{os.urandom(6).hex()}"
            os.mkdir(staging, 0o700, dir_fd=revisions_fd)
            try:
                fd = open_dir_at(revisions_fd, staging, self.revisions_dir / staging, create=False)
                assert fd is not None
                try:
                    with writing(self.revisions_dir / staging):
                        for change, stored in zip(changes, rev.files, strict=True):
                            for which, data in (("previous", change.previous), ("unit", change.unit)):
                                if data is not None:
                                    write_new_at(fd, str(stored[which]), data)
                        if rev.plan:
                            write_new_at(fd, "plan.json", _text(json.dumps(rev.plan, indent=2)))
                        write_new_at(fd, "record.json", _text(json.dumps(rev.record(), indent=2)))
                        os.fsync(fd)
                finally:
                    os.close(fd)
                crash_point("revision-staged")
                os.rename(staging, f"{rev.number:04d}", src_dir_fd=revisions_fd, dst_dir_fd=revisions_fd)
            except BaseException:
                shutil.rmtree(staging, dir_fd=revisions_fd, ignore_errors=True)
                raise
            os.fsync(revisions_fd)
        return rev

    def save(self, rev: Revision) -> None:
        """Rewrite a recorded revision's record.json atomically: a kill mid-write leaves the previous
        state readable for `recover`."""
        name = f"{rev.number:04d}"
        with self._revisions_fd() as revisions_fd:
            if revisions_fd is None:
                raise StoreError(f"{self.revisions_dir}: missing, revision {rev.number} cannot be saved")
            with self._revision_fd(revisions_fd, name) as fd:
                if fd is None:
                    raise StoreError(f"{self.revisions_dir / name}: missing, the revision cannot be saved")
                with writing(self.revisions_dir / name):
                    atomic_write_at(fd, "record.json", _text(json.dumps(rev.record(), indent=2)))

    def in_progress(self) -> Revision | None:
        """The newest revision an interrupted run left unfinished."""
        for rev in reversed(self.revisions()):
            if rev.state in PENDING:
                return rev
        return None

    def history(self) -> list[HistoryRow]:
        """Every revision as plain rows for `ctxmgr history` (text and --json), for a person auditing
        changes; plans and unit bytes stay in their files."""
        return [
            {
                "revision": rev.number,
                "time": rev.created,
                "finished": rev.finished,
                "action": rev.action,
                "state": str(rev.state),
                "max_model_len": rev.max_model_len,
                "gpu_memory_utilization": rev.gpu_memory_utilization,
                "previous_max_model_len": rev.previous_max_model_len,
                "rollback_of": rev.rollback_of,
                "vllm_version": rev.vllm_version,
                "user": rev.user,
                "host": rev.host,
                "ctxmgr_version": rev.ctxmgr_version,
                "reason": rev.reason,
                "decisive_line": rev.decisive_line,
                "capacity": rev.capacity,
                "steps": [step.record() for step in rev.steps],
                "files": [str(f["path"]) for f in rev.files],
            }
            for rev in self.revisions()
        ]

    def last_good(self, before: int | None = None) -> Revision | None:
        """The newest revision whose unit served and passed its probe (or the baseline)."""
        for rev in reversed(self.revisions()):
            if before is not None and rev.number >= before:
                continue
            if rev.state in GOOD:
                return rev
        return None

    def remove_partial(self) -> list[str]:
        """Revision directories a killed run left half written: .new-* and numbered ones without a
        record (written by a ctxmgr before finalise-by-rename). Nothing refers to them."""
        removed: list[str] = []
        with self._revisions_fd() as revisions_fd:
            if revisions_fd is None:
                return removed
            for name in sorted(os.listdir(revisions_fd)):
                try:
                    st = os.stat(name, dir_fd=revisions_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                partial = name.startswith(".new-") or (
                    name.isdigit() and not self._has_record(revisions_fd, name)
                )
                if partial:
                    shutil.rmtree(name, dir_fd=revisions_fd, ignore_errors=True)
                    removed.append(str(self.revisions_dir / name))
                elif name.isdigit():
                    with self._revision_fd(revisions_fd, name) as fd:
                        for leftover in os.listdir(fd) if fd is not None else []:
                            if leftover.startswith(".record.json.") and leftover.endswith(".ctxmgr-tmp"):
                                os.unlink(leftover, dir_fd=fd)
                                removed.append(str(self.revisions_dir / name / leftover))
        return removed

    def needed(self, revisions: list[Revision]) -> set[int]:
        """What a rollback or a recovery may still need: the baseline, the newest final, the good one
        before it (the default target of `rollback`), and anything unfinished."""
        keep = {rev.number for rev in revisions if rev.state == State.BASELINE or rev.state in PENDING}
        newest_final = next((rev for rev in reversed(revisions) if rev.state == State.FINAL), None)
        if newest_final is not None:
            keep.add(newest_final.number)
            before = next(
                (r for r in reversed(revisions) if r.number < newest_final.number and r.state in GOOD),
                None,
            )
            if before is not None:
                keep.add(before.number)
        return keep

    def prune(self) -> list[int]:
        """Keep the last `keep` revisions and every one `needed`; remove the rest."""
        revisions = self.revisions()
        keep = self.needed(revisions) | {rev.number for rev in revisions[-self.keep :]}
        removed = []
        with self._revisions_fd() as revisions_fd:
            for rev in revisions:
                if rev.number not in keep and revisions_fd is not None:
                    shutil.rmtree(f"{rev.number:04d}", dir_fd=revisions_fd, ignore_errors=True)
                    removed.append(rev.number)
        return removed

    # ---- observations ----------------------------------------------------------------------

    def add_observation(self, data: Mapping[str, object]) -> None:
        """Append one watched start for the planner to learn from, then trim to the last `keep` so
        the file stays small."""
        path = self.root / "observations.jsonl"
        with self._service_fd(create=True) as service_fd, writing(self.root):
            assert service_fd is not None
            fd = _open_file_at(service_fd, "observations.jsonl", path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
            assert fd is not None
            with os.fdopen(fd, "r+b") as handle:
                handle.write(_text(json.dumps(data, sort_keys=True) + "\n"))
                handle.flush()
                handle.seek(0)
                lines = handle.read(MAX_STORED + 1).splitlines(keepends=True)
            if len(lines) > self.keep:
                atomic_write_at(service_fd, "observations.jsonl", b"".join(lines[-self.keep :]))

    def observations(self) -> list[StoredObservation]:
        """The stored starts, oldest first; a torn line (a kill during the append) is skipped rather
        than failing every later plan, and so is a line that is JSON but not an object (verify, status
        and the planner read fields of each). Each as ObservationRecord.to_json() wrote it; the planner
        checks one (ObservationRecord.from_json) before it trusts its figures."""
        with self._service_fd() as service_fd:
            if service_fd is None:
                return []
            data = read_at(service_fd, "observations.jsonl", self.root / "observations.jsonl")
        out = []
        for line in (data or b"").decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def write_json(self, name: str, data: Mapping[str, object]) -> None:
        """A per-service record (last-verify.json) written atomically and root-only, like revisions."""
        with self._service_fd(create=True) as service_fd, writing(self.root):
            assert service_fd is not None
            atomic_write_at(service_fd, name, _text(json.dumps(data, indent=2, sort_keys=True)))

    def read_json(self, name: str) -> JSONObject | None:
        """A per-service record, or None where it is absent or not JSON: read as never written."""
        with self._service_fd() as service_fd:
            if service_fd is None:
                return None
            raw = read_at(service_fd, name, self.root / name)
        if raw is None:
            return None
        try:
            data = json.loads(raw.decode())
        except (ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def lock_holder_line(self) -> str | None:
        """The lock file's line, read without taking the lock (status shows who holds it)."""
        with self._service_fd() as service_fd:
            if service_fd is None:
                return None
            raw = read_at(service_fd, "lock", self.root / "lock")
        return None if raw is None else raw[:4096].decode(errors="replace").strip()

    # ---- leftovers -------------------------------------------------------------------------

    def remove_leftovers(
        self, unit_dirs: list[Path], run_dir: Path | None, unit_names: list[str]
    ) -> list[str]:
        """What killed runs leave and nothing else removes: atomic_write's temporaries beside the
        service's unit files, stale `systemd-analyze verify` staging directories in /run, the
        candidate directory, half-written revisions. Call it holding the lock."""
        removed = self.remove_partial()
        for directory in unit_dirs:
            for name in unit_names:
                for path in atomic_leftovers(directory, name):
                    path.unlink(missing_ok=True)
                    removed.append(str(path))
        with self._service_fd() as service_fd:
            for name in sorted(os.listdir(service_fd)) if service_fd is not None else []:
                if name.startswith(".") and name.endswith(".ctxmgr-tmp"):
                    os.unlink(name, dir_fd=service_fd)
                    removed.append(str(self.root / name))
                elif name == "candidate":  # an older ctxmgr's dry-run directory
                    shutil.rmtree(name, dir_fd=service_fd, ignore_errors=True)
                    removed.append(str(self.root / name))
        if run_dir is not None:
            now = time.time()
            with contextlib.suppress(OSError):
                for entry in run_dir.glob("ctxmgr-verify-*"):
                    # another service's run may be verifying right now: only old ones are leftovers
                    with contextlib.suppress(OSError):
                        if entry.is_dir() and now - entry.stat().st_mtime > STALE_S:
                            shutil.rmtree(entry, ignore_errors=True)
                            removed.append(str(entry))
        return removed

    # ---- lock ------------------------------------------------------------------------------

    def writable(self) -> bool:
        """The service's directory exists (checked, not a link) and this process may write there."""
        with self._service_fd() as service_fd:
            return service_fd is not None and os.access(self.root, os.W_OK | os.X_OK)

    @contextlib.contextmanager
    def read_lock(self, wait: float = 0.0) -> Iterator[bool]:
        """The lock for a run that only reads (a dry run): taken where the service's directory exists
        and is writable, so a dry run never creates the state directory nor needs write access to it.
        Yields whether the lock is held."""
        if not self.writable():
            yield False
            return
        with self.lock(wait, create=False):
            yield True

    @contextlib.contextmanager
    def lock(self, wait: float = 0.0, create: bool = True) -> Iterator[None]:
        """One ctxmgr run per service: wait up to `wait` seconds, then refuse naming the holder.
        Only the holder writes (and at the end clears) the lock file: a run that is refused leaves
        the holder's line for the next one to read. `create`: make the state directories first.
        The lock is opened from the checked service directory and never through a link: a planted
        `lock -> /etc/something` would have been truncated by root."""
        if create:
            self.ensure()
        path = self.root / "lock"
        with self._service_fd() as service_fd:
            if service_fd is None:
                raise StoreError(f"{self.root}: missing, the lock cannot be taken")
            fd = _open_file_at(service_fd, "lock", path, os.O_RDWR | os.O_CREAT)
        assert fd is not None
        deadline = time.monotonic() + wait
        held = False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                        raise LockedError(
                            f"{self.service} is locked by another ctxmgr run ({holder}); try again later"
                        ) from None
                    time.sleep(0.2)
            with contextlib.suppress(OSError):  # who holds it is a courtesy to the next run (ENOSPC)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
            yield
        finally:
            if held:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.close(fd)
