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

The package in its parts; every name a caller uses is imported from `vllm_ctxmgr.store` as before:

    transitions.py  the states above and the only moves between them (TRANSITIONS, FINISHED, GOOD)
    safe_fs.py      the one checked walk every path below the state directory is reached through
                    (owner and mode as sshd's StrictModes, O_NOFOLLOW from the parent's descriptor),
                    and the writes a reader sees whole or not at all (atomic_write, atomic_write_at)
    records.py      record.json's schema: Revision, its Steps, the unit files it changes (FileChange)
    here            ServiceStore: one service's revisions, lock and observations, which hold the open
                    descriptors of that walk; and `step_hook`/`crash_point`, since a test sets the
                    hook on this module (tests/support/crash_run.py) and what reads it must live here
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path

from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.observations import StoredObservation
from vllm_ctxmgr.core.records import HistoryRow
from vllm_ctxmgr.errors import LockedError, UsageError
from vllm_ctxmgr.masking import scrub
from vllm_ctxmgr.store.records import (
    RECORD_FORMAT,
    STORED_NAME,
    FileChange,
    Revision,
    Step,
    iso,
    stored_names,
)
from vllm_ctxmgr.store.safe_fs import (
    MAX_STORED,
    StoreError,
    atomic_leftovers,
    atomic_write,
    atomic_write_at,
    check_ours_at,
    check_trusted,
    closing_fd,
    open_checked_dir,
    open_dir_at,
    open_file_at,
    open_state_dir,
    read_at,
    user_name,
    write_new_at,
    writing,
)
from vllm_ctxmgr.store.transitions import FINISHED, GOOD, PENDING, TRANSITIONS, State

# what callers import from `vllm_ctxmgr.store`, whichever part declares it
__all__ = [
    "FINISHED", "GOOD", "KEEP", "MAX_STORED", "PENDING", "RECORD_FORMAT", "STALE_S", "STORED_NAME",
    "TRANSITIONS", "FileChange", "Revision", "ServiceStore", "State", "Step", "StoreError",
    "atomic_leftovers", "atomic_write", "atomic_write_at", "check_ours_at", "check_trusted", "crash_point",
    "ctxmgr_version", "iso", "made_by", "open_checked_dir", "open_dir_at", "open_state_dir", "read_at",
    "step_hook", "stored_names", "write_new_at", "writing",
]  # fmt: skip

KEEP = 50  # revisions and observations kept per service (plus every revision a rollback may need)
STALE_S = 600.0  # a leftover /run/ctxmgr-verify-* older than this belongs to no live run


# Called with (step, command) right after each step of a change is recorded (a state, or
# "revision-staged": a revision written but not yet renamed into place). None in every real run: only
# Python code can set it (the crash-campaign tests do, through tests/support/crash_run.py), so no
# environment variable or flag can make ctxmgr stop half-way.
step_hook: Callable[[str, str], None] | None = None


def crash_point(name: str, command: str = "") -> None:
    """Where a test may kill the run (see step_hook); nothing happens otherwise."""
    if step_hook is not None:
        step_hook(name, command)


def _name_of_host() -> str:
    return os.uname().nodename


def _text(text: str) -> bytes:
    """What leaves ctxmgr for the state directory (records, plans, observations; never a unit copy,
    which must stay byte for byte): every key of every service read masked (masking.scrub)."""
    return scrub(text).encode()


def ctxmgr_version() -> str | None:
    """The installed ctxmgr's version for the record, so a record another version wrote can be told
    apart; None when run from a source tree without package metadata."""
    try:
        return metadata.version("vllm-ctxmgr")
    except metadata.PackageNotFoundError:
        return None


def made_by() -> dict[str, str | None]:
    """Who, where and with which ctxmgr a change is made, for the record."""
    return {"user": user_name(), "host": _name_of_host(), "ctxmgr_version": ctxmgr_version()}


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
        with closing_fd(fd) as opened:
            yield opened

    @contextlib.contextmanager
    def _revisions_fd(self, create: bool = False) -> Iterator[int | None]:
        with self._service_fd(create) as service_fd:
            fd = (
                None
                if service_fd is None
                else open_dir_at(service_fd, "revisions", self.revisions_dir, create, tighten=create)
            )
            with closing_fd(fd) as opened:
                yield opened

    def _revision_fd(self, revisions_fd: int, name: str) -> contextlib.AbstractContextManager[int | None]:
        return closing_fd(open_dir_at(revisions_fd, name, self.revisions_dir / name, create=False))

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
            fd_cm = closing_fd(None) if revisions_fd is None else self._revision_fd(revisions_fd, name)
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
            fd = open_file_at(service_fd, "observations.jsonl", path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
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
            fd = open_file_at(service_fd, "lock", path, os.O_RDWR | os.O_CREAT)
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
