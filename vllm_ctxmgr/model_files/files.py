"""Reading-time checks shared by every model-file reader: regular files only (vllm_ctxmgr.files),
bounded sizes, and JSON whose nesting is bounded before any reader walks it."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_ctxmgr import files
from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.errors import ModelFactsError

MAX_CONFIG_BYTES = 8 << 20  # config.json: real ones are a few KiB to a few hundred KiB
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor
MAX_JSON_DEPTH = 64
# Values one JSON document may build. Parsed, each value is a Python object of 30-60 bytes or more,
# so the byte caps alone allowed ~5 GiB for a 100 MB header of `{},{},...`. A real index names one
# tensor per entry (Kimi-K2: ~140k) and a real shard header spends ~8 values per tensor.
MAX_JSON_VALUES = 2_000_000


def open_regular(path: Path) -> int:
    """A read-only descriptor on PATH, refused (and closed) unless it is a regular file."""
    return files.open_regular(path, error=ModelFactsError)


def read_bounded(path: Path, limit: int) -> bytes:
    """The whole of a regular file of at most LIMIT bytes."""
    return files.read_regular(path, limit, error=ModelFactsError)


def json_depth_ok(value: JSONValue, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether VALUE nests no deeper than LIMIT, at the model files' own limit (core.nesting's walk)."""
    from vllm_ctxmgr.core.nesting import depth_ok

    return depth_ok(value, limit)


def json_values_at_most(data: bytes) -> int:
    """An upper bound on the values DATA can hold: one per separator or opening bracket, plus one.

    Counted on the bytes (C speed, no allocation) before the parser builds anything.
    """
    return data.count(b",") + data.count(b"{") + data.count(b"[") + 1


def parse_json(data: bytes, path: Path) -> JSONValue:
    """JSON from bytes; malformed, over-deep or over-long input is a one-line ModelFactsError."""
    if json_values_at_most(data) > MAX_JSON_VALUES:
        raise ModelFactsError(f"{path}: JSON of more than {MAX_JSON_VALUES} values")
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


def read_json_object(path: Path, limit: int) -> JSONObject:
    """config.json and the safetensors index: a bounded JSON object, or a one-line ModelFactsError."""
    data = parse_json(read_bounded(path, limit), path)
    if not isinstance(data, dict):
        raise ModelFactsError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
