"""Weight bytes and dtypes of a safetensors checkpoint, from the index or each shard's header.

Only the index JSON or each shard's 8-byte length + JSON header is read, never the tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ctxmgr.errors import ModelFactsError

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
        total = (read_json_any(index).get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > 0:
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
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFactsError(f"{path}: unreadable JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def safetensors_header_bytes(path: Path) -> tuple[int, set[str]]:
    """Sum of the tensors' byte ranges declared in one shard's header, and their dtypes."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFactsError(f"{path}: truncated safetensors file (no header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > 100_000_000:
                raise ModelFactsError(f"{path}: not a safetensors file (header length {length})")
            header_bytes = handle.read(length)
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None
    if len(header_bytes) < length:
        raise ModelFactsError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(header_bytes)
        tensors = [v for k, v in header.items() if k != "__metadata__"]
        total = sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0]) for t in tensors)
        dtypes = {str(t["dtype"]) for t in tensors}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ModelFactsError(f"{path}: malformed safetensors header ({error})") from None
    return total, dtypes
