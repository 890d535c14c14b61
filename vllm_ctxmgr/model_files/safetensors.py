"""Weight bytes and dtypes of a safetensors checkpoint, from the index or each shard's header.

Only the index JSON or each shard's 8-byte length + JSON header is read, never the tensor data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.model_files.files import MAX_INDEX_BYTES, open_regular, parse_json, read_bounded

MAX_HEADER_BYTES = 100_000_000  # the safetensors reference implementation's cap

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class SafetensorsWeights:
    total_bytes: int | None = None
    source: str = ""
    dtypes: frozenset[str] = frozenset()


def safetensors_weights(directory: Path) -> SafetensorsWeights:
    """Total tensor bytes from the index, else from each shard's header (never the data)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        metadata = read_json_any(index).get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return SafetensorsWeights(int(total), "safetensors index")
    shards = sorted(directory.glob("*.safetensors"))
    if any(s.name != "consolidated.safetensors" for s in shards):
        shards = [s for s in shards if s.name != "consolidated.safetensors"]  # Mistral-format duplicate
    if not shards:
        return SafetensorsWeights()
    total = 0
    dtypes: set[str] = set()
    for shard in shards:
        nbytes, shard_dtypes = safetensors_header_bytes(shard)
        total += nbytes
        dtypes |= shard_dtypes
    return SafetensorsWeights(total, "safetensors headers", frozenset(dtypes))


def read_json_any(path: Path) -> dict[str, Any]:
    try:
        data = parse_json(read_bounded(path, MAX_INDEX_BYTES), path)
    except FileNotFoundError as error:
        raise ModelFactsError(f"{path}: unreadable JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def safetensors_header_bytes(path: Path) -> tuple[int, set[str]]:
    """Sum of the tensors' byte ranges declared in one shard's header, and their dtypes.

    Checked as the format's reference reader checks it: the header at most 100 MB, each tensor's
    data_offsets a [begin, end] pair with 0 <= begin <= end, and the data inside the file.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError as error:
        raise ModelFactsError(f"cannot read {path}: {error.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFactsError(f"{path}: truncated safetensors file (no header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise ModelFactsError(f"{path}: not a safetensors file (header length {length})")
            header_bytes = handle.read(length)
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None
    if len(header_bytes) < length:
        raise ModelFactsError(f"{path}: truncated safetensors header")
    header = parse_json(header_bytes, path)
    if not isinstance(header, dict):
        raise ModelFactsError(f"{path}: malformed safetensors header (not a JSON object)")
    data_size = file_size - 8 - length
    total = 0
    dtypes: set[str] = set()
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        dtype = tensor.get("dtype") if isinstance(tensor, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not isinstance(dtype, str)
        ):
            raise ModelFactsError(
                f"{path}: malformed safetensors header (tensor {str(name)[:60]!r} needs dtype, data_offsets)"
            )
        begin, end = offsets
        if not 0 <= begin <= end:
            raise ModelFactsError(
                f"{path}: malformed safetensors header (tensor {str(name)[:60]!r} data_offsets {offsets})"
            )
        if end > data_size:
            raise ModelFactsError(
                f"{path}: truncated safetensors file (tensor {str(name)[:60]!r} ends at byte {end} "
                f"of a {max(data_size, 0)}-byte data region)"
            )
        total += end - begin
        dtypes.add(dtype)
    return total, dtypes
