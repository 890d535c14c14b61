"""Reading a file someone else named: regular files only, and never more than the caller can use.

Model files, EnvironmentFiles, unit files and vLLM's YAML config all come from operators and units,
so any of them may be a FIFO (open() would block for ever), a device (/dev/zero reads without end)
or simply huge. A file is opened non-blocking, refused unless fstat says it is a regular file, and
read up to a cap. The caller names the file kind and the error class, so each message reads in the
caller's words; a missing file stays FileNotFoundError, which each caller words itself.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from vllm_ctxmgr.errors import CtxmgrError, UsageError

MIB = 1 << 20


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words for an error ("a FIFO", "a directory")."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _label(path: Path | str, what: str) -> str:
    return f"{what} {path}" if what else str(path)


def _limit_text(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit % MIB == 0 else f"{limit} bytes"


def open_regular(path: Path | str, *, what: str = "", error: type[CtxmgrError] = UsageError) -> int:
    """A read-only, blocking descriptor on a regular file; anything else is refused before a read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"cannot read {_label(path, what)}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{_label(path, what)}: {file_kind(mode)}, expected a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: Path | str, limit: int, *, what: str = "", error: type[CtxmgrError] = UsageError
) -> bytes:
    """The whole of a regular file of at most `limit` bytes (a file that grows while read included)."""
    fd = open_regular(path, what=what, error=error)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise error(f"{_label(path, what)}: {size} bytes, more than the {_limit_text(limit)} it may have")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise error(f"{_label(path, what)}: more than the {_limit_text(limit)} it may have")
    return data
