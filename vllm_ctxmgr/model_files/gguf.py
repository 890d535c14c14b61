"""GGUF headers -> ModelFacts: only the key/value and tensor-info sections are read.

Tensor data is never touched (only size-checked), so a 400 GiB GGUF answers in milliseconds.

vLLM 0.33.0 has no GGUF loader any more; older releases built the HF config from the GGUF
metadata through transformers, which carries no torch dtype, so `auto` resolved to bfloat16 on
GPUs with bf16 support (on SM >= 10.0 the GGUF backend rejects bfloat16 and needs
`--dtype float16`, which has the same 2-byte size). That is the dtype recorded for GGUF files.

Why ~890 lines: the keys as named data (one record per architecture), a bounded reader of the
header, and gguf_facts' stages; the data is most of it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import mmap
import os
import re
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

from vllm_ctxmgr.core.facts import (
    MAX_HEAD_SIZE,
    MAX_HEADS,
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_ROPE_FACTOR,
    MAX_STATE_DIM,
    LayerFacts,
    LayerKind,
    ModelFacts,
    RopeFacts,
    StateFacts,
)
from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.files import file_kind
from vllm_ctxmgr.model_files.files import open_regular

SPLIT_GGUF = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# The GGUF metadata keys read here, as named data: (attribute of gguf-py's constants.Keys, the
# authority llama.cpp writes with; our own spelling for a gguf-py release that lacks the key).
GGUF_KEYS: dict[str, tuple[str, str]] = {
    "general.architecture": ("General.ARCHITECTURE", "general.architecture"),
    "general.alignment": ("General.ALIGNMENT", "general.alignment"),
    "general.file_type": ("General.FILE_TYPE", "general.file_type"),
    "split.count": ("Split.LLM_KV_SPLIT_COUNT", "split.count"),
    "block_count": ("LLM.BLOCK_COUNT", "{arch}.block_count"),
    "context_length": ("LLM.CONTEXT_LENGTH", "{arch}.context_length"),
    "embedding_length": ("LLM.EMBEDDING_LENGTH", "{arch}.embedding_length"),
    "nextn_predict_layers": ("LLM.NEXTN_PREDICT_LAYERS", "{arch}.nextn_predict_layers"),
    # the shapes core/memory.py estimates the activations from, as transformers' GGUF config mapping
    # reads them into the HF config vLLM built (unread, a GGUF's activation peak came out 0.56 GiB
    # against 2.07 GiB for the same model's config.json)
    "vocab_size": ("LLM.VOCAB_SIZE", "{arch}.vocab_size"),
    "feed_forward_length": ("LLM.FEED_FORWARD_LENGTH", "{arch}.feed_forward_length"),
    "expert_feed_forward_length": ("LLM.EXPERT_FEED_FORWARD_LENGTH", "{arch}.expert_feed_forward_length"),
    "expert_count": ("LLM.EXPERT_COUNT", "{arch}.expert_count"),
    "expert_used_count": ("LLM.EXPERT_USED_COUNT", "{arch}.expert_used_count"),
    "full_attention_interval": ("LLM.FULL_ATTENTION_INTERVAL", "{arch}.full_attention_interval"),
    "attention.head_count": ("Attention.HEAD_COUNT", "{arch}.attention.head_count"),
    "attention.head_count_kv": ("Attention.HEAD_COUNT_KV", "{arch}.attention.head_count_kv"),
    "attention.key_length": ("Attention.KEY_LENGTH", "{arch}.attention.key_length"),
    "attention.value_length": ("Attention.VALUE_LENGTH", "{arch}.attention.value_length"),
    "attention.kv_lora_rank": ("Attention.KV_LORA_RANK", "{arch}.attention.kv_lora_rank"),
    "attention.key_length_mla": ("Attention.KEY_LENGTH_MLA", "{arch}.attention.key_length_mla"),
    "attention.sliding_window": ("Attention.SLIDING_WINDOW", "{arch}.attention.sliding_window"),
    "attention.sliding_window_pattern": (
        "Attention.SLIDING_WINDOW_PATTERN",
        "{arch}.attention.sliding_window_pattern",
    ),
    "attention.shared_kv_layers": ("Attention.SHARED_KV_LAYERS", "{arch}.attention.shared_kv_layers"),
    "attention.indexer.key_length": ("Attention.Indexer.KEY_LENGTH", "{arch}.attention.indexer.key_length"),
    "rope.dimension_count": ("Rope.DIMENSION_COUNT", "{arch}.rope.dimension_count"),
    "rope.scaling.type": ("Rope.SCALING_TYPE", "{arch}.rope.scaling.type"),
    "rope.scaling.factor": ("Rope.SCALING_FACTOR", "{arch}.rope.scaling.factor"),
    "rope.scaling.original_context_length": (
        "Rope.SCALING_ORIG_CTX_LEN",
        "{arch}.rope.scaling.original_context_length",
    ),
    "ssm.conv_kernel": ("SSM.CONV_KERNEL", "{arch}.ssm.conv_kernel"),
    "ssm.inner_size": ("SSM.INNER_SIZE", "{arch}.ssm.inner_size"),
    "ssm.state_size": ("SSM.STATE_SIZE", "{arch}.ssm.state_size"),
    "ssm.time_step_rank": ("SSM.TIME_STEP_RANK", "{arch}.ssm.time_step_rank"),
    "ssm.group_count": ("SSM.GROUP_COUNT", "{arch}.ssm.group_count"),
}
# Integer values and the ranges a real file holds (a list: one value per layer); 0 is llama.cpp's
# "absent" where the readers below treat it so.
GGUF_INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "block_count": (1, MAX_LAYERS),
    "context_length": (1, MAX_POSITIONS),
    "embedding_length": (1, MAX_HIDDEN_SIZE),
    "nextn_predict_layers": (0, MAX_LAYERS),
    "vocab_size": (0, MAX_HIDDEN_SIZE),
    "feed_forward_length": (0, MAX_HIDDEN_SIZE),
    "expert_feed_forward_length": (0, MAX_HIDDEN_SIZE),
    "expert_count": (0, MAX_HEADS),
    "expert_used_count": (0, MAX_HEADS),
    "full_attention_interval": (0, MAX_LAYERS),
    "attention.head_count": (1, MAX_HEADS),
    "attention.head_count_kv": (0, MAX_HEADS),
    "attention.key_length": (1, MAX_HEAD_SIZE),
    "attention.value_length": (0, MAX_HEAD_SIZE),
    "attention.kv_lora_rank": (1, MAX_HEAD_SIZE),  # llama.cpp writes it for MLA only: 0 is no latent
    "attention.key_length_mla": (0, MAX_HEAD_SIZE),
    "attention.sliding_window": (0, MAX_POSITIONS),
    "attention.sliding_window_pattern": (0, MAX_LAYERS),
    "attention.shared_kv_layers": (0, MAX_LAYERS - 1),
    "attention.indexer.key_length": (0, MAX_HEAD_SIZE),
    "rope.dimension_count": (0, MAX_HEAD_SIZE),
    "rope.scaling.original_context_length": (0, MAX_POSITIONS),
    **dict.fromkeys(
        ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"),
        (0, MAX_STATE_DIM),
    ),
}
MAX_GGUF_KV_COUNT = 1 << 16
MAX_GGUF_TENSOR_COUNT = 1 << 17  # unfused MoE experts: ~50k
MAX_GGUF_ARRAY_COUNT = 1 << 24  # a 256k-token vocabulary is 1 << 18
MAX_GGUF_STRING = 1 << 24
MAX_GGUF_DECODED = 1 << 26  # all strings decoded from one header (chat templates, names)
MAX_GGUF_NESTING = 4
MAX_GGUF_DIMS = 8  # ggml has 4
# Array items kept (decoded into Python objects) over one header: each costs ~36 bytes or more, so
# 440 kept UINT16[65536] arrays in a 58 MB file took 1.18 GiB. Past this, arrays are stepped over
# (SkippedArray); the keys read here are per-layer arrays of at most MAX_LAYERS items.
MAX_GGUF_KEPT_ITEMS = 1 << 20
# Work, not only bytes: every array item read one by one in Python (a string stepped over or decoded,
# an array inside an array) over one header. A real header's largest are the vocabulary and merges
# (~1M strings together for a 262k vocabulary); llama.cpp writes no arrays of arrays, so a few of
# those are plenty, where 4M empty ones in a 49 MB file took 16 s to walk.
MAX_GGUF_VISITED = 1 << 23
MAX_GGUF_NESTED_ITEMS = 1 << 16


@functools.cache
def gguf_key(name: str) -> str:
    """The key template for NAME ({arch} unfilled): gguf-py's constants.Keys, else our table."""
    path, fallback = GGUF_KEYS[name]
    value: object = gguf_constants().Keys
    for part in path.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, str) else fallback


@functools.cache
def gguf_constants() -> ModuleType:
    """gguf-py's constants module; loaded on its own when gguf is not imported yet.

    `import gguf` pulls in numpy and the whole package (~0.2 s); constants.py needs neither.
    """
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    spec = importlib.util.find_spec("gguf")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
        module_spec = importlib.util.spec_from_file_location("_vllm_ctxmgr_gguf_constants", path)
        if module_spec is not None and module_spec.loader is not None:
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    import gguf.constants

    return gguf.constants


@dataclass(frozen=True)
class SkippedArray:
    """A large string array (tokenizer vocabulary, merges) left undecoded."""

    count: int


# One metadata value as the header holds it: a number, a string, an array of them, or an array too
# long to keep (its length only)
GgufValue: TypeAlias = int | float | bool | str | list["GgufValue"] | SkippedArray
GgufMetadata: TypeAlias = dict[str, GgufValue]


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class GgufHeader:
    path: Path
    version: int
    metadata: GgufMetadata
    tensors: list[GgufTensor]
    data_start: int
    file_size: int
    type_names: dict[int, str] = field(default_factory=dict)


class _Cursor:
    """struct reads over an mmap, turning every overrun into a truncated-file error."""

    def __init__(self, buffer: mmap.mmap, path: Path, endian: str) -> None:
        self.buffer = buffer
        self.path = path
        self.endian = endian
        self.offset = 0
        self.size = len(buffer)
        self.decoded = 0  # string bytes decoded so far, bounded by MAX_GGUF_DECODED
        self.kept = 0  # array items decoded so far, bounded by MAX_GGUF_KEPT_ITEMS
        self.visited = 0  # array items walked one by one, bounded by MAX_GGUF_VISITED
        self.nested = 0  # arrays inside arrays walked, bounded by MAX_GGUF_NESTED_ITEMS

    def visit(self, count: int, *, nested: bool = False) -> None:
        """Count COUNT items about to be walked one by one; refuse past the header's bound of work."""
        self.visited += count
        self.nested += count if nested else 0
        if self.visited > MAX_GGUF_VISITED or self.nested > MAX_GGUF_NESTED_ITEMS:
            what = "arrays inside arrays" if self.nested > MAX_GGUF_NESTED_ITEMS else "array items"
            limit = MAX_GGUF_NESTED_ITEMS if self.nested > MAX_GGUF_NESTED_ITEMS else MAX_GGUF_VISITED
            raise ModelFactsError(
                f"{self.path}: GGUF header of more than {limit} {what} (at byte {self.offset})"
            )

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(self.endian + fmt, self.buffer, self.offset)
        except struct.error:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})") from None
        self.offset += struct.calcsize(self.endian + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        if length > MAX_GGUF_STRING:
            raise ModelFactsError(f"{self.path}: GGUF string of {length} bytes at byte {self.offset}")
        end = self.offset + length
        if end > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        self.decoded += length
        if self.decoded > MAX_GGUF_DECODED:
            raise ModelFactsError(
                f"{self.path}: GGUF strings of more than {MAX_GGUF_DECODED >> 20} MiB in the header"
            )
        text = self.buffer[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_strings(self, count: int) -> None:
        """Step over COUNT strings (a 150k-token vocabulary) without decoding them."""
        self.check_count(count, 8)
        self.visit(count)
        unpack = struct.Struct(self.endian + "Q").unpack_from
        buffer, offset, size = self.buffer, self.offset, self.size
        try:
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
                if offset > size:  # a length past the file (2^64-1): stop before the next read overflows
                    break
        except struct.error:
            offset = size + 1
        if offset > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        self.offset = offset

    def check_count(self, count: int, item_size: int) -> None:
        """An array count the rest of the file can hold, and no more than a real file has."""
        if count > MAX_GGUF_ARRAY_COUNT or self.offset + count * item_size > self.size:
            raise ModelFactsError(f"{self.path}: GGUF array of {count} items at byte {self.offset}")


_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_STRING_ARRAYS_UP_TO = 4096
_KEEP_SCALAR_ARRAYS_UP_TO = 65536  # per-layer arrays have one value per layer


def _read_value(cursor: _Cursor, value_type: int, depth: int = 0, *, keep: bool = True) -> GgufValue:
    """One metadata value; with keep=False (past MAX_GGUF_KEPT_ITEMS) arrays are walked, not built."""
    if value_type in _SCALAR_FORMATS:
        return cursor.unpack(_SCALAR_FORMATS[value_type])[0]
    if value_type == _STRING:
        return cursor.string()
    if value_type == _ARRAY:
        if depth >= MAX_GGUF_NESTING:
            raise ModelFactsError(f"{cursor.path}: GGUF arrays nested deeper than {MAX_GGUF_NESTING} levels")
        item_type, count = cursor.unpack("IQ")
        keep = keep and cursor.kept + count <= MAX_GGUF_KEPT_ITEMS
        if item_type in _SCALAR_FORMATS:
            size = struct.calcsize(_SCALAR_FORMATS[item_type])
            cursor.check_count(count, size)
            if count > _KEEP_SCALAR_ARRAYS_UP_TO or not keep:  # token scores and types: never read here
                cursor.offset += count * size
                return SkippedArray(count)
            cursor.kept += count
            return list(cursor.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
        if item_type == _STRING:
            if count > _KEEP_STRING_ARRAYS_UP_TO or not keep:
                cursor.skip_strings(count)
                return SkippedArray(count)
            cursor.kept += count
            cursor.visit(count)
            return [cursor.string() for _ in range(count)]
        if count > _KEEP_STRING_ARRAYS_UP_TO:
            raise ModelFactsError(f"{cursor.path}: GGUF array of {count} arrays at byte {cursor.offset}")
        cursor.check_count(count, 12)
        cursor.visit(count, nested=True)
        if not keep:
            for _ in range(count):
                _read_value(cursor, item_type, depth + 1, keep=False)
            return SkippedArray(count)
        cursor.kept += count
        return [_read_value(cursor, item_type, depth + 1) for _ in range(count)]
    raise ModelFactsError(f"{cursor.path}: unknown GGUF value type {value_type} at byte {cursor.offset}")


def read_gguf_header(path: Path) -> GgufHeader:
    """Metadata and tensor infos of one GGUF file; the tensor data region is only size-checked."""
    constants = gguf_constants()
    try:
        fd = open_regular(path)
    except FileNotFoundError as error:
        raise ModelFactsError(f"cannot read {path}: {error.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            if file_size < 24:
                magic = handle.read(4)
                if magic != b"GGUF":
                    raise ModelFactsError(f"{path}: not a GGUF file (magic {magic!r})")
                raise ModelFactsError(f"{path}: truncated GGUF header ({file_size} bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse_gguf(buffer, path, file_size, constants)
    except OSError as error:
        raise ModelFactsError(f"cannot read {path}: {error}") from None


def _parse_gguf(buffer: mmap.mmap, path: Path, file_size: int, constants: ModuleType) -> GgufHeader:
    if buffer[:4] != b"GGUF":
        raise ModelFactsError(f"{path}: not a GGUF file (magic {bytes(buffer[:4])!r})")
    (version,) = struct.unpack_from("<I", buffer, 4)
    endian = "<"
    if version & 0xFFFF == 0:
        endian = ">"
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in (2, 3):
        raise ModelFactsError(f"{path}: unsupported GGUF version {version}")
    cursor = _Cursor(buffer, path, endian)
    cursor.offset = 8
    tensor_count, kv_count = cursor.unpack("QQ")
    if kv_count > MAX_GGUF_KV_COUNT or tensor_count > MAX_GGUF_TENSOR_COUNT:
        raise ModelFactsError(f"{path}: GGUF header claims {kv_count} keys and {tensor_count} tensors")
    metadata: GgufMetadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        (value_type,) = cursor.unpack("I")
        metadata[key] = _read_value(cursor, value_type)
    sizes = {int(t): size for t, size in constants.GGML_QUANT_SIZES.items()}
    type_names = {int(t): t.name for t in constants.GGMLQuantizationType}
    tensors = []
    for _ in range(tensor_count):
        name = cursor.string()
        (n_dims,) = cursor.unpack("I")
        if n_dims > MAX_GGUF_DIMS:
            raise ModelFactsError(f"{path}: tensor {name[:60]!r} has {n_dims} dimensions")
        shape = cursor.unpack(f"{n_dims}Q")
        ggml_type, offset = cursor.unpack("IQ")
        if ggml_type not in sizes:
            raise ModelFactsError(f"{path}: tensor {name} has unknown ggml type {ggml_type}")
        block_size, type_size = sizes[ggml_type]
        tensors.append(
            GgufTensor(name, tuple(shape), ggml_type, offset, math.prod(shape) // block_size * type_size)
        )
    alignment = metadata.get(gguf_key("general.alignment"))
    if alignment is None:
        alignment = 32
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or not 0 < alignment <= 1 << 20
        or alignment & (alignment - 1)
    ):
        raise ModelFactsError(f"{path}: general.alignment is {alignment!r}, expected a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    # as safetensors.py refuses them: summed, overlapping tensors count the same bytes twice (a header
    # naming 256,000 bytes of weights in an 89,600-byte file); llama.cpp's gguf.cpp lays each tensor
    # after the one before, so no GGUF it writes or reads has them
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, name), (begin, _, other) in itertools.pairwise(ranges):
        if begin < end:
            raise ModelFactsError(
                f"{path}: malformed GGUF header (tensors {name[:60]!r} and {other[:60]!r} overlap)"
            )
    data_end = data_start + max((t.offset + t.nbytes for t in tensors), default=0)
    if data_end > file_size:
        raise ModelFactsError(
            f"{path}: truncated GGUF file (tensor data ends at byte {data_end}, file has {file_size})"
        )
    return GgufHeader(path, version, metadata, tensors, data_start, file_size, type_names)


def gguf_parts(path: Path) -> list[Path]:
    """All parts of a split GGUF (from any part), or [path]."""
    match = SPLIT_GGUF.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count:
        raise ModelFactsError(f"{path}: split GGUF part {match['no']} of {match['count']} does not exist")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for part in parts:
        try:
            mode = os.stat(part).st_mode
        except FileNotFoundError:
            raise ModelFactsError(f"split GGUF part missing: {part}") from None
        except OSError as error:
            raise ModelFactsError(f"cannot read split GGUF part {part}: {error.strerror or error}") from None
        if not stat.S_ISREG(mode):
            raise ModelFactsError(f"split GGUF part {part}: {file_kind(mode)}, expected a regular file")
    return parts


def load_gguf_facts(path: Path, *, source: str | None = None) -> ModelFacts:
    """Facts from a GGUF file or split GGUF (metadata from part 1, tensor bytes summed over all)."""
    parts = gguf_parts(path)
    headers = [read_gguf_header(part) for part in parts]
    first = headers[0]
    meta = first.metadata
    split_count = meta.get(gguf_key("split.count"))
    if split_count and split_count != len(parts):
        raise ModelFactsError(f"{parts[0]}: split.count is {split_count!r} but {len(parts)} parts are named")
    arch = meta.get(gguf_key("general.architecture"))
    if not isinstance(arch, str) or not re.fullmatch(r"[\w.-]{1,64}", arch):
        raise ModelFactsError(f"{parts[0]}: no general.architecture in the GGUF metadata")
    check_gguf_values(meta, arch, str(parts[0]))
    tensors = [t for header in headers for t in header.tensors]
    try:
        return gguf_facts(meta, tensors, first.type_names, source=source or str(path), parts=len(parts))
    except (
        TypeError,
        ValueError,
        OverflowError,
        ZeroDivisionError,
        AttributeError,
        KeyError,
        IndexError,
    ) as error:
        raise ModelFactsError(
            f"{parts[0]}: unusable GGUF metadata ({type(error).__name__}: {error})"
        ) from None


def check_gguf_values(meta: GgufMetadata, arch: str, label: str) -> None:
    """Types and ranges of the metadata the facts come from, naming the key that is wrong."""
    for name, (low, high) in GGUF_INTEGER_RANGES.items():
        key = gguf_key(name).format(arch=arch)
        value = meta.get(key)
        if value is None:
            continue
        items: Sequence[GgufValue | None] = value if isinstance(value, list) else [value]
        if isinstance(value, list) and name not in PER_LAYER_KEYS:
            items = [None]
        for item in items:
            if name == "attention.sliding_window_pattern" and isinstance(item, bool):
                continue
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                raise ModelFactsError(
                    f"{label}: {key} is {_shown(value)}, expected an integer in {low}..{high}"
                )
    blocks = meta.get(gguf_key("block_count").format(arch=arch))
    nextn = meta.get(gguf_key("nextn_predict_layers").format(arch=arch))
    lengths = {blocks, blocks - nextn} if isinstance(blocks, int) and isinstance(nextn, int) else {blocks}
    for name in sorted(PER_LAYER_KEYS):
        key = gguf_key(name).format(arch=arch)
        value = meta.get(key)
        # llama.cpp's llama_model_loader::get_key_or_arr refuses a per-layer array whose length is not
        # its layer count ("wrong array length": block_count, or block_count less the nextn layers
        # for some architectures); read shorter, a layer would have no value here
        if isinstance(value, list) and isinstance(blocks, int) and len(value) not in lengths:
            raise ModelFactsError(
                f"{label}: {key} has {len(value)} per-layer values, expected {blocks} (block_count)"
            )
    key = gguf_key("rope.scaling.factor").format(arch=arch)
    factor = meta.get(key)
    if factor is not None and (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or not math.isfinite(factor)
        or not 0 <= factor <= MAX_ROPE_FACTOR
    ):
        raise ModelFactsError(f"{label}: {key} is {_shown(factor)}, expected a positive number")
    key = gguf_key("rope.scaling.type").format(arch=arch)
    if meta.get(key) is not None and not isinstance(meta[key], str):
        raise ModelFactsError(f"{label}: {key} is {_shown(meta[key])}, expected a name")
    file_type = meta.get(gguf_key("general.file_type"))
    if file_type is not None and (isinstance(file_type, bool) or not isinstance(file_type, int)):
        raise ModelFactsError(f"{label}: general.file_type is {_shown(file_type)}, expected an integer")


PER_LAYER_KEYS = frozenset(
    {
        "attention.head_count",
        "attention.head_count_kv",
        "attention.sliding_window_pattern",
        "feed_forward_length",  # one per layer in some architectures (gemma3n)
    }
)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class _ArchKeys:
    """One header's keys under its general.architecture prefix ("{arch}.block_count"), noting for
    each fact the key it was first read from, so a plan can say where a number came from."""

    meta: GgufMetadata
    arch: str
    provenance: dict[str, str] = field(default_factory=dict)

    def get(self, name: str, fact: str | None = None) -> Any:
        key = gguf_key(name).format(arch=self.arch)
        value = self.meta.get(key)
        if value is not None and fact:
            self.provenance.setdefault(fact, f"gguf {key}")
        return value


@dataclass(frozen=True)
class _GgufLayerCounts:
    """The query heads and decoder layers vLLM builds; counts as check_gguf_values let them through."""

    heads: int | list[int]  # attention.head_count: one value, or one per layer
    num_heads: int
    nextn: int
    num_layers: int


@dataclass(frozen=True)
class _GgufAttention:
    """The attention.* keys every layer's KV cache is sized from, llama.cpp's defaults filled in.

    Values as check_gguf_values let them through, converted with int() only where they are used."""

    kv_heads: int | list[int]  # attention.head_count_kv, or head_count where absent
    key_length: int
    value_length: int
    hidden: int | None
    rope_dim: int | None
    kv_lora_rank: int | None
    indexer_head_dim: int
    window: int | None

    def kv_at(self, index: int) -> int:
        """KV heads of one layer: head_count_kv may be one value per layer (0 = no attention)."""
        kv_heads = self.kv_heads
        return int(kv_heads[index]) if isinstance(kv_heads, list) else int(kv_heads)


def gguf_facts(
    meta: GgufMetadata,
    tensors: list[GgufTensor],
    type_names: dict[int, str],
    *,
    source: str,
    parts: int = 1,
) -> ModelFacts:
    """Facts from GGUF metadata and tensor infos, following llama.cpp's converter conventions.

    The stages read one header's keys in the order llama.cpp writes them, each checked at the door;
    the provenance and notes fill in that order."""
    keys = _ArchKeys(meta, str(meta[gguf_key("general.architecture")]))
    notes = ["vLLM 0.33.0 has no GGUF loader; these facts follow the GGUF path of earlier vLLM releases"]
    counts = _gguf_layer_counts(keys, tensors, source, notes)
    attention = _gguf_attention(keys, counts.num_heads, source)
    qk_rope: int | None = None
    qk_nope: int | None = None
    if attention.kv_lora_rank:
        layers, qk_rope, qk_nope = _gguf_mla_layers(keys, attention, counts.num_layers, source, notes)
    else:
        layers = _gguf_kv_layers(keys, attention, counts, tensors, source)
    context_length = keys.get("context_length", "max_position_embeddings")
    rope = _gguf_rope_scaling(keys)
    quantization = _gguf_weights(keys, tensors, type_names, parts)
    shapes = _gguf_shapes(keys, meta, tensors)
    return ModelFacts(
        source=source,
        source_format="gguf",
        model_type=keys.arch,
        architectures=(),
        num_attention_heads=counts.num_heads,
        layers=tuple(layers),
        dtype="bfloat16",
        position_limits=(("max_position_embeddings", int(context_length)),) if context_length else (),
        rope=rope,
        sliding_window=attention.window,
        hidden_size=int(attention.hidden) if attention.hidden else None,
        mtp_layers=counts.nextn,
        kv_lora_rank=int(attention.kv_lora_rank) if attention.kv_lora_rank else None,
        qk_rope_head_dim=qk_rope,
        qk_nope_head_dim=qk_nope,
        weight_bytes=sum(t.nbytes for t in tensors),
        quantization=quantization,
        provenance=keys.provenance,
        notes=tuple(notes),
        **shapes,
    )


def _gguf_shapes(keys: _ArchKeys, meta: GgufMetadata, tensors: list[GgufTensor]) -> dict[str, int | None]:
    """vocab_size, the MLP widths and the experts, as transformers' GGUF config mapping names them
    (feed_forward_length -> intermediate_size, expert_count -> num_local_experts, ...): the same
    config.json facts core/memory.py estimates an HF directory's activations from. vocab_size where no
    key gives it: the tokenizer's token count, else token_embd's rows (its ne1)."""

    def positive(name: str, fact: str) -> int | None:
        value = keys.get(name, fact)
        if isinstance(value, list):
            value = max((v for v in value if isinstance(v, int)), default=None)
        return int(value) if value else None

    vocab = positive("vocab_size", "vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        count = (
            tokens.count
            if isinstance(tokens, SkippedArray)
            else len(tokens)
            if isinstance(tokens, list)
            else 0
        )
        embedding = next((t for t in tensors if t.name == "token_embd.weight" and len(t.shape) == 2), None)
        if count:
            vocab, keys.provenance["vocab_size"] = count, "gguf tokenizer.ggml.tokens (its length)"
        elif embedding is not None and embedding.shape[1]:
            vocab, keys.provenance["vocab_size"] = embedding.shape[1], "gguf token_embd.weight (its rows)"
    return {
        "vocab_size": vocab,
        "intermediate_size": positive("feed_forward_length", "intermediate_size"),
        "moe_intermediate_size": positive("expert_feed_forward_length", "moe_intermediate_size"),
        "num_experts": positive("expert_count", "num_experts"),
        "num_experts_per_tok": positive("expert_used_count", "num_experts_per_tok"),
    }


def _gguf_layer_counts(
    keys: _ArchKeys, tensors: list[GgufTensor], source: str, notes: list[str]
) -> _GgufLayerCounts:
    """Decoder layers are block_count less nextn_predict_layers: llama.cpp counts the MTP layers in
    block_count, vLLM does not (num_hidden_layers). The nextn tensor names confirm the split."""
    arch = keys.arch
    block_count = keys.get("block_count", "num_hidden_layers")
    heads = keys.get("attention.head_count", "num_attention_heads")
    missing = [k for k, v in (("block_count", block_count), ("attention.head_count", heads)) if v is None]
    if missing:
        raise ModelFactsError(
            f"GGUF {source} (arch {arch!r}) lacks {', '.join(f'{arch}.{k}' for k in missing)}"
        )
    num_heads = int(max(heads) if isinstance(heads, list) else heads)
    nextn = int(keys.get("nextn_predict_layers", "mtp_layers") or 0)
    num_layers = int(block_count) - nextn
    if nextn:
        tail = {int(m[1]) for t in tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t.name))}
        seen = (
            "its nextn tensors confirm it"
            if tail and min(tail) >= num_layers
            else "not confirmed by tensor names"
        )
        notes.append(
            f"block_count {block_count} includes {nextn} nextn (MTP) layer(s), llama.cpp's convention; "
            f"counted {num_layers} decoder layers ({seen})"
        )
    return _GgufLayerCounts(heads, num_heads, nextn, num_layers)


def _gguf_attention(keys: _ArchKeys, num_heads: int, source: str) -> _GgufAttention:
    """The attention keys, with llama.cpp's defaults where a converter left one out: head_count_kv
    is head_count (no GQA), key_length is embedding_length / head_count, value_length is key_length."""
    arch = keys.arch
    hidden = keys.get("embedding_length", "hidden_size")
    kv_heads = keys.get("attention.head_count_kv", "num_kv_heads")
    if kv_heads is None:
        kv_heads = num_heads
        keys.provenance["num_kv_heads"] = "gguf attention.head_count (no head_count_kv)"
    key_length = keys.get("attention.key_length", "head_size")
    if key_length is None:
        if not hidden:
            raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.attention.key_length")
        key_length = int(hidden) // num_heads
    value_length = keys.get("attention.value_length") or key_length
    rope_dim = keys.get("rope.dimension_count")
    kv_lora_rank = keys.get("attention.kv_lora_rank", "kv_lora_rank")
    indexer_head_dim = int(keys.get("attention.indexer.key_length", "indexer") or 0)
    window = keys.get("attention.sliding_window", "sliding_window")
    window = int(window) if window else None
    return _GgufAttention(
        kv_heads, key_length, value_length, hidden, rope_dim, kv_lora_rank, indexer_head_dim, window
    )


def _gguf_mla_layers(
    keys: _ArchKeys, attention: _GgufAttention, num_layers: int, source: str, notes: list[str]
) -> tuple[list[LayerFacts], int, int | None]:
    """MLA layers (kv_lora_rank set) and (qk_rope_head_dim, qk_nope_head_dim): vLLM caches one
    latent of kv_lora_rank + rope dims per token, whatever the head counts say.

    llama.cpp writes MLA as MQA (key_length = latent + rope); older deepseek2 files carry MHA dims,
    so the latent width comes from kv_lora_rank + the rope dims either way."""
    arch = keys.arch
    latent = int(attention.kv_lora_rank or 0)  # set, or this is no MLA
    key_length = attention.key_length
    if attention.rope_dim is not None:
        rope_dims = int(attention.rope_dim)
    elif int(key_length) > latent:  # MQA layout: key_length = latent + rope
        rope_dims = int(key_length) - latent
    else:
        raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.rope.dimension_count")
    head_size = latent + rope_dims
    key_length_mla = keys.get("attention.key_length_mla")
    if key_length_mla:
        qk_nope = int(key_length_mla) - rope_dims
    else:
        qk_nope = int(key_length) - rope_dims if int(key_length) != head_size else None
        notes.append(
            "GGUF without key_length_mla (older converter, MHA dims): MLA detected from kv_lora_rank"
        )
    layers = [
        LayerFacts(
            LayerKind.MLA,
            num_kv_heads=1,
            head_size=head_size,
            head_size_v=0,
            indexer_head_dim=attention.indexer_head_dim,
        )
        for _ in range(num_layers)
    ]
    keys.provenance["head_size"] = f"gguf {arch}.attention.kv_lora_rank + rope.dimension_count"
    return layers, rope_dims, qk_nope


def _gguf_kv_layers(
    keys: _ArchKeys,
    attention: _GgufAttention,
    counts: _GgufLayerCounts,
    tensors: list[GgufTensor],
    source: str,
) -> list[LayerFacts]:
    """Per layer, what vLLM caches when there is no MLA: a Mamba/GDN state (hybrid models, by
    full_attention_interval or the layer's ssm_ tensors), nothing (head_count_kv 0), or full or
    sliding-window KV; the last shared_kv_layers reuse earlier layers' KV and cache nothing."""
    arch, meta, num_layers = keys.arch, keys.meta, counts.num_layers
    tensor_names = {t.name for t in tensors}
    layers: list[LayerFacts] = []
    key_length, value_length, window = attention.key_length, attention.value_length, attention.window
    pattern = _gguf_sliding_pattern(arch, meta, num_layers, window)
    state = _gguf_state(arch, meta, source)
    interval = keys.get("full_attention_interval")
    for i in range(num_layers):
        prefix = f"blk.{i}."
        if state is not None and interval:
            is_state = (i + 1) % int(interval) != 0
        else:
            is_state = state is not None and any(n.startswith(prefix + "ssm_") for n in tensor_names)
        if is_state:
            layers.append(LayerFacts(LayerKind.MAMBA, state=state))
        elif attention.kv_at(i) == 0:
            layers.append(LayerFacts(LayerKind.NONE))
        elif pattern[i]:
            layers.append(
                LayerFacts(
                    LayerKind.SLIDING, attention.kv_at(i), int(key_length), int(value_length), window=window
                )
            )
        else:
            layers.append(LayerFacts(LayerKind.FULL, attention.kv_at(i), int(key_length), int(value_length)))
        if layers[-1].kind in (LayerKind.FULL, LayerKind.SLIDING):
            _check_gguf_heads(source, arch, i, counts.heads, attention.kv_heads)
    shared = int(keys.get("attention.shared_kv_layers") or 0)
    if shared and shared >= num_layers:  # a negative slice start would lengthen the layer list
        raise ModelFactsError(
            f"GGUF {source}: {arch}.attention.shared_kv_layers is {shared}, "
            f"not fewer than the {num_layers} layers"
        )
    if shared:
        layers[num_layers - shared :] = [LayerFacts(LayerKind.NONE)] * shared
    return layers


def _gguf_rope_scaling(keys: _ArchKeys) -> tuple[RopeFacts, ...]:
    """rope.scaling.* in vLLM's rope_scaling terms: vLLM derives the longest usable position from the
    scaling type, its factor and the original context length."""
    rope_type = keys.get("rope.scaling.type")
    if not rope_type or rope_type == "none":
        return ()
    factor = keys.get("rope.scaling.factor")
    original = keys.get("rope.scaling.original_context_length")
    rope = RopeFacts(str(rope_type), float(factor) if factor else None, int(original) if original else None)
    keys.provenance["rope"] = f"gguf {keys.arch}.rope.scaling.*"
    return (rope,)


def _gguf_weights(
    keys: _ArchKeys, tensors: list[GgufTensor], type_names: dict[int, str], parts: int
) -> str | None:
    """The quantization (general.file_type, else the commonest tensor type by bytes) and where the
    weight facts come from: GGUF carries no torch dtype, so vLLM's auto dtype was bfloat16."""
    file_type = keys.meta.get(gguf_key("general.file_type"))
    quantization = _gguf_quantization(file_type, tensors, type_names)
    keys.provenance["quantization"] = (
        "gguf general.file_type" if file_type is not None else "gguf tensor types"
    )
    keys.provenance["weight_bytes"] = "gguf tensor infos" + (f" ({parts} parts)" if parts > 1 else "")
    keys.provenance["dtype"] = "vLLM auto for GGUF (no torch dtype in GGUF metadata) -> bfloat16"
    return quantization


def _gguf_sliding_pattern(arch: str, meta: GgufMetadata, num_layers: int, window: int | None) -> list[bool]:
    """Per layer: sliding? From sliding_window_pattern (int period or bool per layer) or arch."""
    if not window:
        return [False] * num_layers
    pattern = meta.get(gguf_key("attention.sliding_window_pattern").format(arch=arch))
    if isinstance(pattern, list):
        return [bool(p) for p in pattern[:num_layers]] + [False] * (num_layers - len(pattern))
    period = {"gemma3": 6, "gemma2": 2, "cohere2": 4, "gemma3n": 5}.get(arch)
    if isinstance(pattern, int) and pattern > 0:
        period = pattern
    if arch == "gpt-oss":
        return [i % 2 == 0 for i in range(num_layers)]
    if period:
        return [(i + 1) % period != 0 for i in range(num_layers)]
    return [True] * num_layers  # one model-level window: every layer slides


def _check_gguf_heads(
    source: str, arch: str, index: int, heads: int | list[int], kv_heads: int | list[int]
) -> None:
    """vLLM's Attention asserts num_heads % num_kv_heads == 0 (so KV heads <= heads), per layer.

    The counts are as check_gguf_values let them through: an integer, or one per layer."""
    per_layer = isinstance(heads, list) or isinstance(kv_heads, list)
    q = int(heads[index] if isinstance(heads, list) else heads)
    kv = int(kv_heads[index] if isinstance(kv_heads, list) else kv_heads)
    where = f"GGUF {source}: " + (f"layer {index}: " if per_layer else "")
    if kv > q:
        raise ModelFactsError(
            f"{where}{arch}.attention.head_count_kv {kv} is more than {arch}.attention.head_count {q}"
        )
    if q % kv:
        raise ModelFactsError(
            f"{where}{arch}.attention.head_count {q} is not a multiple of {arch}.attention.head_count_kv {kv}"
        )


def _gguf_state(arch: str, meta: GgufMetadata, source: str) -> StateFacts | None:
    """Recurrent state dims from {arch}.ssm.* (llama.cpp's qwen3next / mamba2 conventions).

    Every dimension vLLM's state shapes multiply by must be at least 1 (a time_step_rank of 0 cut
    the state pool by 69%), and a width split over heads must divide evenly.
    """

    def ssm(key: str) -> int:
        return int(meta.get(gguf_key(f"ssm.{key}").format(arch=arch)) or 0)

    def need(*keys: str) -> None:
        for key in keys:
            if ssm(key) < 1:
                name = gguf_key(f"ssm.{key}").format(arch=arch)
                raise ModelFactsError(
                    f"GGUF {source}: {name} is {ssm(key)}, expected an integer in 1..{MAX_STATE_DIM}"
                )

    def divides(width: str, heads: str) -> None:
        if ssm(width) % ssm(heads):
            names = [gguf_key(f"ssm.{key}").format(arch=arch) for key in (width, heads)]
            raise ModelFactsError(
                f"GGUF {source}: {names[0]} {ssm(width)} is not a multiple of {names[1]} {ssm(heads)}"
            )

    if not ssm("conv_kernel"):
        return None
    if arch.startswith(("qwen3next", "qwen35")):
        need("time_step_rank", "group_count", "state_size", "inner_size")
        divides("inner_size", "time_step_rank")
        v_heads = ssm("time_step_rank")
        return StateFacts(
            family="gdn",
            conv_kernel=ssm("conv_kernel"),
            num_k_heads=ssm("group_count"),
            num_v_heads=v_heads,
            k_head_dim=ssm("state_size"),
            v_head_dim=ssm("inner_size") // v_heads if v_heads else 0,
        )
    heads = ssm("time_step_rank")
    if ssm("group_count"):
        need("time_step_rank", "state_size", "inner_size")
        divides("inner_size", "time_step_rank")
        return StateFacts(
            family="mamba2",
            conv_kernel=ssm("conv_kernel"),
            intermediate_size=ssm("inner_size"),
            n_groups=ssm("group_count"),
            state_size=ssm("state_size"),
            num_heads=heads,
            head_dim=ssm("inner_size") // heads if heads else 0,
        )
    need("state_size", "inner_size")
    return StateFacts(
        family="mamba1",
        conv_kernel=ssm("conv_kernel"),
        intermediate_size=ssm("inner_size"),
        state_size=ssm("state_size"),
    )


def _gguf_quantization(
    file_type: int | None, tensors: list[GgufTensor], type_names: dict[int, str]
) -> str | None:
    if file_type is not None:
        constants = gguf_constants()
        try:
            return str(constants.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_"))
        except ValueError:
            return f"file_type {file_type}"
    by_type: dict[int, int] = {}
    for tensor in tensors:
        by_type[tensor.ggml_type] = by_type.get(tensor.ggml_type, 0) + tensor.nbytes
    if not by_type:
        return None
    return type_names.get(max(by_type, key=by_type.__getitem__))
