"""Revisions, the per-service lock and atomic writes.

Layout under the state directory (default /var/lib/ctxmgr, root-only: 0700 dirs, 0600 files,
since unit copies may hold API keys):

    SERVICE/lock                      flock; holds the PID and command of the holder
    SERVICE/revisions/NNNN/record.json  what, when, why, and the change's state
    SERVICE/revisions/NNNN/unit         the unit file content this revision installs
    SERVICE/revisions/NNNN/previous     the content it replaced (byte for byte)
    SERVICE/observations.jsonl        what each watched start of the service logged
    SERVICE/last-verify.json          the last verification (unit invocation, restarts, result)

A record is written "in-progress" before the unit is touched and finalised after, so a run that
is killed anywhere leaves enough behind for the next run to finish the rollback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_ctxmgr.errors import LockedError, UsageError

DEFAULT_STATE_DIR = Path("/var/lib/ctxmgr")

# Revision states, in the order a change walks through them (certbot-reverter style).
IN_PROGRESS = "in-progress"  # recorded; the unit may or may not be installed yet
FINAL = "final"  # installed, restarted, serving, probed
ROLLED_BACK = "rolled-back"  # failed, and the previous unit is back and serving
ROLLBACK_FAILED = "rollback-failed"  # failed, and the previous unit did not come back either
BASELINE = "baseline"  # the unit as ctxmgr first found it


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
    dir_fd = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class Revision:
    number: int
    service: str
    state: str
    unit_path: str  # the file this revision changes (where ExecStart lives)
    created: float
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
    plan: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ServiceStore:
    """One service's revisions, observations and lock."""

    def __init__(self, state_dir: Path | str, service: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9:_.@\\-]+", service):
            raise UsageError(f"{service!r} is not a valid unit name")
        self.service = service.removesuffix(".service")
        self.root = Path(state_dir) / self.service
        self.revisions_dir = self.root / "revisions"

    def ensure(self) -> None:
        for directory in (self.root.parent, self.root, self.revisions_dir):
            directory.mkdir(mode=0o700, exist_ok=True, parents=True)
        os.chmod(self.root, 0o700)
        os.chmod(self.revisions_dir, 0o700)

    # ---- revisions -------------------------------------------------------------------------

    def revisions(self) -> list[Revision]:
        if not self.revisions_dir.is_dir():
            return []
        found = []
        for entry in sorted(self.revisions_dir.iterdir()):
            record = entry / "record.json"
            if entry.name.isdigit() and record.is_file():
                data = json.loads(record.read_text())
                found.append(Revision(**data))
        return found

    def get(self, number: int) -> Revision:
        for rev in self.revisions():
            if rev.number == number:
                return rev
        raise UsageError(f"{self.service}: there is no revision {number} (see `ctxmgr history`)")

    def unit_bytes(self, number: int, which: str = "unit") -> bytes:
        return (self.revisions_dir / f"{number:04d}" / which).read_bytes()

    def new_revision(self, rev: Revision, unit: bytes, previous: bytes) -> Revision:
        """Record a change before anything is touched; the number is the next free one."""
        self.ensure()
        existing = self.revisions()
        rev.number = (existing[-1].number + 1) if existing else 0
        directory = self.revisions_dir / f"{rev.number:04d}"
        directory.mkdir(mode=0o700)
        atomic_write(directory / "previous", previous, mode=0o600)
        atomic_write(directory / "unit", unit, mode=0o600)
        self.save(rev)
        return rev

    def save(self, rev: Revision) -> None:
        directory = self.revisions_dir / f"{rev.number:04d}"
        atomic_write(directory / "record.json", json.dumps(rev.to_json(), indent=2).encode(), mode=0o600)

    def in_progress(self) -> Revision | None:
        for rev in reversed(self.revisions()):
            if rev.state == IN_PROGRESS:
                return rev
        return None

    def last_good(self, before: int | None = None) -> Revision | None:
        """The newest revision whose unit served and passed its probe (or the baseline)."""
        for rev in reversed(self.revisions()):
            if before is not None and rev.number >= before:
                continue
            if rev.state in (FINAL, BASELINE):
                return rev
        return None

    # ---- observations ----------------------------------------------------------------------

    def add_observation(self, data: dict[str, Any]) -> None:
        self.ensure()
        path = self.root / "observations.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(json.dumps(data, sort_keys=True) + "\n")

    def observations(self) -> list[dict[str, Any]]:
        path = self.root / "observations.jsonl"
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        self.ensure()
        atomic_write(self.root / name, json.dumps(data, indent=2, sort_keys=True).encode(), mode=0o600)

    def read_json(self, name: str) -> dict[str, Any] | None:
        path = self.root / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    # ---- lock ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, wait: float = 0.0) -> Iterator[None]:
        """One ctxmgr run per service: wait up to `wait` seconds, then refuse naming the holder."""
        self.ensure()
        path = self.root / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
