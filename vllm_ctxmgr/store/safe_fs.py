"""The state directory's safe file system: every path below it opened from its checked parent's
descriptor with O_NOFOLLOW, each checked as sshd's StrictModes checks a home directory, and writes
that readers see whole or not at all (atomic_write, atomic_write_at). A revision planted there is
installed as root by `rollback`, so anything another user could have written is refused, never read."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import pwd
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_ctxmgr.errors import CtxmgrError, UnsafePathError

MAX_STORED = 64 << 20  # no record, plan or unit ctxmgr wrote is near this: a larger one is not ours


class StoreError(CtxmgrError):
    """A record in the state directory that ctxmgr cannot read: the message names the file."""


@contextlib.contextmanager
def closing_fd(fd: int | None) -> Iterator[int | None]:
    """A directory descriptor (or None, where the directory is not there) closed after use."""
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


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
    return "root" if os.geteuid() == 0 else user_name()


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
    put a link in its place, where a root run would then write. The real path must still be the
    directory opened."""
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


def open_file_at(parent_fd: int, name: str, path: Path, flags: int, mode: int = 0o600) -> int | None:
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
    fd = open_file_at(parent_fd, name, path, os.O_RDONLY)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_STORED + 1)
    if len(data) > MAX_STORED:
        raise StoreError(f"{path}: larger than {MAX_STORED >> 20} MiB: not a file ctxmgr wrote")
    return data


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


def exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())
