"""GGUF headers -> ModelFacts: only the key/value and tensor-info sections are read.

Tensor data is never touched (only size-checked), so a 400 GiB GGUF answers in milliseconds.

vLLM 0.33.0 has no GGUF loader any more; older releases built the HF config from the GGUF
metadata through transformers, which carries no torch dtype, so `auto` resolved to bfloat16 on
GPUs with bf16 support (on SM >= 10.0 the GGUF backend rejects bfloat16 and needs
`--dtype float16`, which has the same 2-byte size). That is the dtype recorded for GGUF files.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, RopeFacts, StateFacts
from vllm_ctxmgr.errors import ModelFactsError

SPLIT_GGUF = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


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
    metadata: dict[str, Any]
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

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(self.endian + fmt, self.buffer, self.offset)
        except struct.error:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})") from None
        self.offset += struct.calcsize(self.endian + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.offset + length
        if end > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        text = self.buffer[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_strings(self, count: int) -> None:
        """Step over COUNT strings (a 150k-token vocabulary) without decoding them."""
        unpack = struct.Struct(self.endian + "Q").unpack_from
        buffer, offset = self.buffer, self.offset
        try:
            for _ in range(count):
                offset += 8 + unpack(buffer, offset)[0]
        except struct.error:
            offset = self.size + 1
        if offset > self.size:
            raise ModelFactsError(f"{self.path}: truncated GGUF header (ends at byte {self.size})")
        self.offset = offset


_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_STRING_ARRAYS_UP_TO = 4096


def _read_value(cursor: _Cursor, value_type: int) -> Any:
    if value_type in _SCALAR_FORMATS:
        return cursor.unpack(_SCALAR_FORMATS[value_type])[0]
    if value_type == _STRING:
        return cursor.string()
    if value_type == _ARRAY:
        item_type, count = cursor.unpack("IQ")
        if item_type in _SCALAR_FORMATS:
            return list(cursor.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
        if item_type == _STRING:
            if count > _KEEP_STRING_ARRAYS_UP_TO:
                cursor.skip_strings(count)
                return SkippedArray(count)
            return [cursor.string() for _ in range(count)]
        return [_read_value(cursor, item_type) for _ in range(count)]
    raise ModelFactsError(f"{cursor.path}: unknown GGUF value type {value_type} at byte {cursor.offset}")


def read_gguf_header(path: Path) -> GgufHeader:
    """Metadata and tensor infos of one GGUF file; the tensor data region is only size-checked."""
    constants = gguf_constants()
    try:
        with path.open("rb") as handle:
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
    metadata: dict[str, Any] = {}
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
        shape = cursor.unpack(f"{n_dims}Q")
        ggml_type, offset = cursor.unpack("IQ")
        if ggml_type not in sizes:
            raise ModelFactsError(f"{path}: tensor {name} has unknown ggml type {ggml_type}")
        block_size, type_size = sizes[ggml_type]
        tensors.append(
            GgufTensor(name, tuple(shape), ggml_type, offset, math.prod(shape) // block_size * type_size)
        )
    alignment = int(metadata.get("general.alignment") or 32)
    data_start = -(-cursor.offset // alignment) * alignment
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
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for part in parts:
        if not part.is_file():
            raise ModelFactsError(f"split GGUF part missing: {part}")
    return parts


def load_gguf_facts(path: Path, *, source: str | None = None) -> ModelFacts:
    """Facts from a GGUF file or split GGUF (metadata from part 1, tensor bytes summed over all)."""
    parts = gguf_parts(path)
    headers = [read_gguf_header(part) for part in parts]
    first = headers[0]
    meta = first.metadata
    split_count = meta.get("split.count")
    if split_count and int(split_count) != len(parts):
        raise ModelFactsError(f"{parts[0]}: split.count is {split_count} but {len(parts)} parts are named")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFactsError(f"{parts[0]}: no general.architecture in the GGUF metadata")
    tensors = [t for header in headers for t in header.tensors]
    return gguf_facts(meta, tensors, first.type_names, source=source or str(path), parts=len(parts))


def gguf_facts(
    meta: dict[str, Any],
    tensors: list[GgufTensor],
    type_names: dict[int, str],
    *,
    source: str,
    parts: int = 1,
) -> ModelFacts:
    """Facts from GGUF metadata and tensor infos, following llama.cpp's converter conventions."""
    arch = str(meta["general.architecture"])
    provenance: dict[str, str] = {}
    notes = [
        "vLLM 0.33.0 has no GGUF loader; these facts follow the GGUF path of earlier vLLM releases",
    ]

    def get(key: str, fact: str | None = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is not None and fact:
            provenance.setdefault(fact, f"gguf {arch}.{key}")
        return value

    block_count = get("block_count", "num_hidden_layers")
    heads = get("attention.head_count", "num_attention_heads")
    missing = [k for k, v in (("block_count", block_count), ("attention.head_count", heads)) if v is None]
    if missing:
        raise ModelFactsError(
            f"GGUF {source} (arch {arch!r}) lacks {', '.join(f'{arch}.{k}' for k in missing)}"
        )
    num_heads = int(max(heads) if isinstance(heads, list) else heads)
    nextn = int(get("nextn_predict_layers", "mtp_layers") or 0)
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
    hidden = get("embedding_length", "hidden_size")
    kv_heads = get("attention.head_count_kv", "num_kv_heads")
    kv_per_layer = kv_heads if isinstance(kv_heads, list) else None
    if kv_heads is None:
        kv_heads = num_heads
        provenance["num_kv_heads"] = "gguf attention.head_count (no head_count_kv)"
    key_length = get("attention.key_length", "head_size")
    if key_length is None:
        if not hidden:
            raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.attention.key_length")
        key_length = int(hidden) // num_heads
    value_length = get("attention.value_length") or key_length
    rope_dim = get("rope.dimension_count")
    kv_lora_rank = get("attention.kv_lora_rank", "kv_lora_rank")
    index_head_dim = int(get("attention.indexer.key_length", "indexer") or 0)
    window = get("attention.sliding_window", "sliding_window")
    window = int(window) if window else None

    def kv_at(i: int) -> int:
        return int(kv_per_layer[i]) if kv_per_layer is not None else int(kv_heads)

    tensor_names = {t.name for t in tensors}
    layers: list[LayerFacts] = []
    qk_nope = rope_dims = None
    if kv_lora_rank:
        # llama.cpp writes MLA as MQA (key_length = latent + rope); older deepseek2 files carry
        # MHA dims, so the latent width comes from kv_lora_rank + the rope dims either way.
        latent = int(kv_lora_rank)
        if rope_dim is not None:
            rope_dims = int(rope_dim)
        elif int(key_length) > latent:  # MQA layout: key_length = latent + rope
            rope_dims = int(key_length) - latent
        else:
            raise ModelFactsError(f"GGUF {source} (arch {arch!r}) lacks {arch}.rope.dimension_count")
        head_size = latent + rope_dims
        key_length_mla = get("attention.key_length_mla")
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
                indexer_head_dim=index_head_dim,
            )
            for _ in range(num_layers)
        ]
        provenance["head_size"] = f"gguf {arch}.attention.kv_lora_rank + rope.dimension_count"
    else:
        pattern = _gguf_sliding_pattern(arch, meta, num_layers, window)
        state = _gguf_state(arch, meta)
        interval = get("full_attention_interval")
        for i in range(num_layers):
            prefix = f"blk.{i}."
            if state is not None and interval:
                is_state = (i + 1) % int(interval) != 0
            else:
                is_state = state is not None and any(n.startswith(prefix + "ssm_") for n in tensor_names)
            if is_state:
                layers.append(LayerFacts(LayerKind.MAMBA, state=state))
            elif kv_at(i) == 0:
                layers.append(LayerFacts(LayerKind.NONE))
            elif pattern[i]:
                layers.append(
                    LayerFacts(LayerKind.SLIDING, kv_at(i), int(key_length), int(value_length), window=window)
                )
            else:
                layers.append(LayerFacts(LayerKind.FULL, kv_at(i), int(key_length), int(value_length)))
        shared = int(get("attention.shared_kv_layers") or 0)
        if shared:
            layers[num_layers - shared :] = [LayerFacts(LayerKind.NONE)] * shared

    context_length = get("context_length", "max_position_embeddings")
    rope_type = get("rope.scaling.type")
    rope: tuple[RopeFacts, ...] = ()
    if rope_type and rope_type != "none":
        factor = get("rope.scaling.factor")
        original = get("rope.scaling.original_context_length")
        rope = (
            RopeFacts(str(rope_type), float(factor) if factor else None, int(original) if original else None),
        )
        provenance["rope"] = f"gguf {arch}.rope.scaling.*"
    file_type = meta.get("general.file_type")
    quantization = _gguf_quantization(file_type, tensors, type_names)
    provenance["quantization"] = "gguf general.file_type" if file_type is not None else "gguf tensor types"
    provenance["weight_bytes"] = "gguf tensor infos" + (f" ({parts} parts)" if parts > 1 else "")
    provenance["dtype"] = "vLLM auto for GGUF (no torch dtype in GGUF metadata) -> bfloat16"
    return ModelFacts(
        source=source,
        source_format="gguf",
        model_type=arch,
        architectures=(),
        num_attention_heads=num_heads,
        layers=tuple(layers),
        dtype="bfloat16",
        position_limits=(("max_position_embeddings", int(context_length)),) if context_length else (),
        rope=rope,
        sliding_window=window,
        hidden_size=int(hidden) if hidden else None,
        mtp_layers=nextn,
        kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
        qk_rope_head_dim=rope_dims if kv_lora_rank else None,
        qk_nope_head_dim=qk_nope,
        weight_bytes=sum(t.nbytes for t in tensors),
        quantization=quantization,
        provenance=provenance,
        notes=tuple(notes),
    )


def _gguf_sliding_pattern(arch: str, meta: dict[str, Any], num_layers: int, window: int | None) -> list[bool]:
    """Per layer: sliding? From sliding_window_pattern (int period or bool per layer) or arch."""
    if not window:
        return [False] * num_layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
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


def _gguf_state(arch: str, meta: dict[str, Any]) -> StateFacts | None:
    """Recurrent state dims from {arch}.ssm.* (llama.cpp's qwen3next / mamba2 conventions)."""

    def ssm(key: str) -> int:
        return int(meta.get(f"{arch}.ssm.{key}") or 0)

    if not ssm("conv_kernel"):
        return None
    if arch.startswith(("qwen3next", "qwen35")):
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
        return StateFacts(
            family="mamba2",
            conv_kernel=ssm("conv_kernel"),
            intermediate_size=ssm("inner_size"),
            n_groups=ssm("group_count"),
            state_size=ssm("state_size"),
            num_heads=heads,
            head_dim=ssm("inner_size") // heads if heads else 0,
        )
    return StateFacts(
        family="mamba1",
        conv_kernel=ssm("conv_kernel"),
        intermediate_size=ssm("inner_size"),
        state_size=ssm("state_size"),
    )


def _gguf_quantization(file_type: Any, tensors: list[GgufTensor], type_names: dict[int, str]) -> str | None:
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
