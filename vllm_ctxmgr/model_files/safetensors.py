"""Weight bytes and dtypes of a safetensors checkpoint, from the index or each shard's header.

Only the index JSON or each shard's 8-byte length + JSON header is read, never the tensor data.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.files import file_kind
from vllm_ctxmgr.model_files.files import MAX_INDEX_BYTES, open_regular, parse_json, read_bounded

MAX_HEADER_BYTES = 100_000_000  # the safetensors reference implementation's cap

# transformers' shard names: model-00001-of-00004.safetensors
SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.safetensors$")

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class SafetensorsWeights:
    total_bytes: int | None = None
    source: str = ""
    dtypes: frozenset[str] = frozenset()


def safetensors_weights(directory: Path) -> SafetensorsWeights:
    """Total tensor bytes from the index, else from each shard's header (never the data).

    A partial checkpoint (shards missing from a -NNNNN-of-MMMMM series or from the index's
    weight_map) is refused: vLLM could not load it, and its sum would be wrong.
    """
    shards = sorted(directory.glob("*.safetensors"))
    if any(s.name != "consolidated.safetensors" for s in shards):
        shards = [s for s in shards if s.name != "consolidated.safetensors"]  # Mistral-format duplicate
    index = directory / "model.safetensors.index.json"
    data = read_json_any(index) if index.is_file() else {}
    _check_index_files(index, data.get("weight_map"))
    _check_shard_series(shards)
    metadata = data.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if isinstance(total, int) and not isinstance(total, bool) and total > 0:
        return SafetensorsWeights(int(total), "safetensors index")
    if not shards:
        return SafetensorsWeights()
    total = 0
    dtypes: set[str] = set()
    for shard in shards:
        nbytes, shard_dtypes = safetensors_header_bytes(shard)
        total += nbytes
        dtypes |= shard_dtypes
    return SafetensorsWeights(total, "safetensors headers", frozenset(dtypes))


def check_present(path: Path, missing: str) -> None:
    """PATH is a regular file; else MISSING, or what it is (a FIFO, a directory) when it is there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFactsError(missing) from None
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        raise ModelFactsError(f"{path}: {file_kind(mode)}, expected a regular file")


def _check_index_files(index: Path, weight_map: JSONValue) -> None:
    """Every shard the index's weight_map names is there, or none is: vLLM loads the weights from
    those files, so a partial download is refused rather than summed (or taken at total_size).

    An index with no shard beside it (a config-only copy, as in examples/models) keeps its total_size.
    """
    if not isinstance(weight_map, dict):
        return
    names = sorted({value for value in weight_map.values() if isinstance(value, str)})
    for name in names:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ModelFactsError(f"{index} names {name[:80]!r}, not a file in the model directory")
    if not any(os.path.lexists(index.parent / name) for name in names):
        return
    for name in names:
        check_present(
            index.parent / name, f"{index} names {name[:80]}, which is missing (a partial download?)"
        )


def _check_shard_series(shards: list[Path]) -> None:
    """All NNNNN of a `-NNNNN-of-MMMMM.safetensors` series are present, as for split GGUF parts."""
    present = {shard.name for shard in shards}
    series = {(m["stem"], int(m["count"])) for shard in shards if (m := SHARD_NAME.match(shard.name))}
    for stem, count in sorted(series):
        for number in range(1, count + 1):
            name = f"{stem}-{number:05d}-of-{count:05d}.safetensors"
            if name not in present:
                raise ModelFactsError(f"safetensors shard missing: {shards[0].parent / name}")


def read_json_any(path: Path) -> JSONObject:
    try:
        data = parse_json(read_bounded(path, MAX_INDEX_BYTES), path)
    except FileNotFoundError as error:
        raise ModelFactsError(f"{path}: unreadable JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def read_header(path: Path) -> tuple[JSONObject, int, int]:
    """One shard's JSON header, its length and the file's size, read as the format's reference reader
    reads it (an 8-byte length, at most 100 MB of header), never the tensor data. Shared by the
    weight sum and the expert split (expert_weights.py)."""
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
    return header, length, file_size


def safetensors_header_bytes(path: Path) -> tuple[int, set[str]]:
    """Sum of the tensors' byte ranges declared in one shard's header, and their dtypes.

    Checked as the format's reference reader checks it: the header at most 100 MB, each tensor's
    data_offsets a [begin, end] pair with 0 <= begin <= end, and the data inside the file.
    """
    header, length, file_size = read_header(path)
    data_size = file_size - 8 - length
    total = 0
    dtypes: set[str] = set()
    ranges: list[tuple[int, int, str]] = []
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
        begin, end = [o for o in offsets if isinstance(o, int)]  # both are, as checked above
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
        ranges.append((begin, end, str(name)))
    # the reference reader refuses overlapping tensors; summed, they would count bytes twice
    ranges.sort()
    for (_, end, name), (begin, _, other) in itertools.pairwise(ranges):
        if begin < end:
            raise ModelFactsError(
                f"{path}: malformed safetensors header (tensors {name[:60]!r} and {other[:60]!r} overlap)"
            )
    return total, dtypes
