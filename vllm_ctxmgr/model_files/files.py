"""Reading-time checks shared by every model-file reader: regular files only, bounded sizes and nesting.

A FIFO named config.json would block open() forever and /dev/zero would be read without end, so a
file is opened non-blocking and refused unless fstat says it is a regular file; JSON is read up to
a cap and its nesting is bounded before any reader walks it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from vllm_ctxmgr.errors import ModelFactsError

MAX_CONFIG_BYTES = 8 << 20  # config.json: real ones are a few KiB to a few hundred KiB
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor
MAX_JSON_DEPTH = 64


def _kind(mode: int) -> str:
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


def open_regular(path: Path) -> int:
    """A read-only descriptor on PATH, refused (and closed) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ModelFactsError(f"{path}: {_kind(mode)}, expected a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: Path, limit: int) -> bytes:
    """The whole of a regular file of at most LIMIT bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise ModelFactsError(
                f"{path}: {size} bytes, more than the {limit >> 20} MiB a model file may have"
            )
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ModelFactsError(f"{path}: more than the {limit >> 20} MiB a model file may have")
    return data


def json_depth_ok(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether VALUE nests no deeper than LIMIT (iterative: deep input must not recurse)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True


def parse_json(data: bytes, path: Path) -> Any:
    """JSON from bytes; malformed, over-deep or over-long input is a one-line ModelFactsError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelFactsError(
            f"{path}: malformed JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None
    except RecursionError:
        raise ModelFactsError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # an integer of more than 4300 digits
        raise ModelFactsError(f"{path}: malformed JSON ({error})") from None
    if not json_depth_ok(value):
        raise ModelFactsError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json_object(path: Path, limit: int) -> dict[str, Any]:
    data = parse_json(read_bounded(path, limit), path)
    if not isinstance(data, dict):
        raise ModelFactsError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
