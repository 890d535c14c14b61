"""Reading a file someone else named: regular files only, and never more than the caller can use.

Model files, EnvironmentFiles, unit files and vLLM's YAML config all come from operators and units,
so any of them may be a FIFO (open() would block for ever), a device (/dev/zero reads without end)
or simply huge. A file is opened non-blocking, refused unless fstat says it is a regular file, and
read up to a cap. The caller names the file kind and the error class, so each message reads in the
caller's words; a missing file stays FileNotFoundError, which each caller words itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import stat
from collections.abc import Iterator
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


def check_trusted(path: Path | str, *, what: str = "", error: type[CtxmgrError] = UsageError) -> None:
    """sshd's StrictModes for a file or directory ctxmgr runs from as root (an operator's templates):
    owned by the running user or root, writable by nobody else."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"cannot read {_label(path, what)}: {exc.strerror or exc}") from None
    if st.st_uid not in (0, os.geteuid()):
        raise error(
            f"{path}: owned by uid {st.st_uid}: another user could change what ctxmgr renders; if it is "
            f"yours, run `chown {os.geteuid()} {path}`"
        )
    if st.st_mode & 0o022:
        raise error(
            f"{path}: writable by group or others (mode {st.st_mode & 0o7777:04o}): run `chmod go-w {path}`"
        )


# ---------------------------------------------------------------------------------------------------------
# Paths below another manager's root (/proc/PID/root, `--systemd-pid`)
#
# The kernel resolves an absolute symbolic link met below /proc/PID/root from the caller's root, not
# the container's: a drop-in directory, a config.json or an EnvironmentFile linked to "/etc/..." in
# the container would be the host's file. Below such a root every open is resolved as the container
# sees it, atomically, by openat2(RESOLVE_IN_ROOT) (Linux 5.6): links, "..", everything stays inside.
# Hand-written with ctypes: Python 3.11 has no openat2.

_PROC_ROOT = re.compile(r"^(/proc/\d+/root)(?:/(.*))?$")
_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall tables were unified)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def split_root(path: Path | str) -> tuple[str, str] | None:
    """(/proc/PID/root, the path inside it) for a path below another process's root, else None."""
    match = _PROC_ROOT.match(os.path.normpath(str(path)))
    if match is None:
        return None
    return match[1], match[2] or "."


def _openat2(dir_fd: int, inner: str, flags: int, mode: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    # openat2 refuses a mode without O_CREAT or O_TMPFILE (whose bits include O_DIRECTORY's)
    creates = bool(flags & os.O_CREAT) or flags & os.O_TMPFILE == os.O_TMPFILE
    how = _OpenHow(flags | os.O_CLOEXEC, mode if creates else 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    while True:
        fd = syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(inner)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        errno = ctypes.get_errno()
        if errno == 4:  # EINTR
            continue
        if errno == 38:  # ENOSYS
            raise OSError(
                errno,
                "this kernel has no openat2 (Linux >= 5.6), so a path in a container's root "
                "cannot be resolved safely",
            )
        raise OSError(errno, os.strerror(errno), inner)


def open_path(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open, except below /proc/PID/root, where `path` is resolved inside that root (see above)."""
    split = split_root(path)
    if split is None:
        return os.open(path, flags | os.O_CLOEXEC, mode)
    root, inner = split
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _openat2(root_fd, inner, flags, mode)
    except OSError as exc:
        if exc.filename is not None:
            exc.filename = str(path)
        raise
    finally:
        os.close(root_fd)


def exists(path: Path | str) -> bool:
    """Whether `path` exists, resolved as open_path resolves it (a link below another root is followed
    inside that root)."""
    try:
        os.close(open_path(path, os.O_PATH))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not ours to open
    return True


@contextlib.contextmanager
def directory_fd(path: Path | str, create: bool = False) -> Iterator[int]:
    """A descriptor on a directory (resolved as open_path does), for the *_at operations; with
    `create`, the last component is made (0755) when missing, never its parents."""
    try:
        fd = open_path(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if not create:
            raise
        parent, name = os.path.split(os.path.normpath(str(path)))
        with directory_fd(parent) as parent_fd, contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        fd = open_path(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(path: Path | str, *, what: str = "", error: type[CtxmgrError] = UsageError) -> int:
    """A read-only, blocking descriptor on a regular file; anything else is refused before a read.
    Below another manager's root the path is resolved inside it (open_path)."""
    try:
        fd = open_path(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
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


# YAML someone else wrote (vLLM's --config): a small file may still expand without end through its
# aliases ("billion laughs"), nest deeper than the parser's recursion, refer to itself, or hold an
# integer int() refuses to read. Each is refused here, before a value is built from it.
YAML_MAX_DEPTH = 64  # no vLLM flag nests a tenth of this
YAML_MAX_NODES = 100_000  # values once every alias is expanded; vLLM's flags are a few hundred
YAML_MAX_INT_DIGITS = 30  # no count or size vLLM takes has more


def load_yaml(data: bytes, label: str, error: type[CtxmgrError] = UsageError) -> object:
    """yaml.safe_load of `data`, with depth, alias expansion, cycles and integer size bounded. The
    messages name the file and never echo a value from it."""
    import yaml

    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise error(f"{label} is not UTF-8 text") from None
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # an event stream: no recursion
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > YAML_MAX_DEPTH:
                    raise error(f"{label}: nested deeper than {YAML_MAX_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_yaml_nodes(node, label, error)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise error(f"{label} is not valid YAML{line}") from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise error(f"{label}: not a YAML file ctxmgr can read ({type(exc).__name__})") from None


def _check_yaml_nodes(root: object, label: str, error: type[CtxmgrError]) -> None:
    """The node graph's size with every alias expanded (each shared node counted once per use, as
    a reader flattening it sees it), without recursion; a node inside itself is a cycle."""
    import yaml

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _yaml_children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in children)
            if size[key] > YAML_MAX_NODES:
                raise error(f"{label}: its aliases expand to more than {YAML_MAX_NODES:,} values")
            continue
        if key in size:
            continue
        if key in on_path:
            raise error(f"{label}: an alias refers to itself (a value inside its own anchor)")
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int":
            digits = sum(ch.isdigit() for ch in node.value)
            if digits > YAML_MAX_INT_DIGITS:
                raise error(f"{label}: an integer of {digits} digits (line {node.start_mark.line + 1})")
        on_path.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                raise error(f"{label}: an alias refers to itself (a value inside its own anchor)")
            if id(child) not in size:
                stack.append((child, False))


def _yaml_children(node: object) -> list[object]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
