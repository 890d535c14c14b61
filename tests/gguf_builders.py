"""GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter lays them out.

Files are sparse: header, metadata and tensor infos are real; the data region is only a size
(truncate), so a 400 GiB GLM-5 costs a few MB.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.support.paths import REPO

EXAMPLE_SCRIPT = REPO / "examples" / "make_glm5_gguf.py"

Tensor = tuple[str, tuple[int, ...], str]  # name, numpy-order shape, ggml type name


def glm5_example() -> ModuleType:
    """examples/make_glm5_gguf.py as a module (the demo's writer, reused by the tests)."""
    spec = importlib.util.spec_from_file_location("make_glm5_gguf", EXAMPLE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensor_nbytes(shape: tuple[int, ...], ggml_type: str) -> int:
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    return math.prod(shape) // block_size * type_size


def add_values(writer: Any, values: dict[str, Any]) -> None:
    """Typed like llama.cpp writes them: counts uint32, factors float32, per-layer lists as arrays."""
    for key, value in values.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))


def write_gguf(
    path: Path, arch: str, values: dict[str, Any], tensors: list[Tensor], *, parts: int = 1
) -> list[Path]:
    """A sparse GGUF (or gguf-split parts) with these metadata values and tensor infos."""
    example = glm5_example()
    return example.write_sparse_gguf(
        path,
        arch,
        tensors,
        lambda writer: add_values(writer, {f"{arch}.{k}": v for k, v in values.items()}),
        parts=parts,
    )


def block_tensors(layers: int, hidden: int, *, kv_width: int, ggml_type: str = "Q4_K") -> list[Tensor]:
    """A plain decoder's tensors, enough for names and byte sums."""
    tensors: list[Tensor] = [("token_embd.weight", (32000, hidden), ggml_type)]
    for block in range(layers):
        tensors += [
            (f"blk.{block}.attn_norm.weight", (hidden,), "F32"),
            (f"blk.{block}.attn_q.weight", (hidden, hidden), ggml_type),
            (f"blk.{block}.attn_k.weight", (kv_width, hidden), ggml_type),
            (f"blk.{block}.attn_v.weight", (kv_width, hidden), ggml_type),
            (f"blk.{block}.attn_output.weight", (hidden, hidden), ggml_type),
        ]
    tensors.append(("output_norm.weight", (hidden,), "F32"))
    return tensors


def llama_70b_gguf(path: Path, *, parts: int = 1) -> list[Path]:
    """Llama-3.1-70B as llama.cpp converts it (llama3 RoPE goes into a rope_freqs tensor)."""
    values = {
        "context_length": 131072,
        "embedding_length": 8192,
        "block_count": 80,
        "feed_forward_length": 28672,
        "rope.dimension_count": 128,
        "attention.head_count": 64,
        "attention.head_count_kv": 8,
        "rope.freq_base": 500000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": 128256,
    }
    tensors = [("rope_freqs.weight", (64,), "F32"), *block_tensors(80, 8192, kv_width=1024)]
    return write_gguf(path, "llama", values, tensors, parts=parts)


def gemma3_27b_gguf(path: Path) -> list[Path]:
    """gemma-3-27b: llama.cpp writes the window but no pattern (its C++ code uses 6)."""
    values = {
        "context_length": 131072,
        "embedding_length": 5376,
        "block_count": 62,
        "feed_forward_length": 21504,
        "attention.head_count": 32,
        "attention.head_count_kv": 16,
        "attention.key_length": 128,
        "attention.value_length": 128,
        "attention.sliding_window": 1024,
        "rope.freq_base": 1000000.0,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0,
    }
    return write_gguf(path, "gemma3", values, block_tensors(62, 5376, kv_width=2048, ggml_type="Q8_0"))


def qwen3_next_gguf(path: Path) -> list[Path]:
    """Qwen3-Next-80B-A3B with llama.cpp's qwen3next ssm.* convention."""
    values = {
        "context_length": 262144,
        "embedding_length": 2048,
        "block_count": 48,
        "attention.head_count": 16,
        "attention.head_count_kv": 2,
        "attention.key_length": 256,
        "attention.value_length": 256,
        "rope.dimension_count": 64,
        "ssm.conv_kernel": 4,
        "ssm.state_size": 128,
        "ssm.group_count": 16,
        "ssm.time_step_rank": 32,
        "ssm.inner_size": 4096,
        "full_attention_interval": 4,
    }
    tensors: list[Tensor] = []
    for block in range(48):
        if (block + 1) % 4:
            tensors += [(f"blk.{block}.ssm_conv1d.weight", (8192, 4), "F32")]
        else:
            tensors += [(f"blk.{block}.attn_q.weight", (8192, 2048), "Q8_0")]
    return write_gguf(path, "qwen3next", values, tensors)


def deepseek_v3_gguf(path: Path, *, old_mha_dims: bool = False) -> list[Path]:
    """DeepSeek-V3 as `deepseek2`: MLA stored as MQA, or (old converters) with MHA dims."""
    values: dict[str, Any] = {
        "context_length": 163840,
        "embedding_length": 7168,
        "block_count": 61,
        "feed_forward_length": 18432,
        "attention.head_count": 128,
        "leading_dense_block_count": 3,
        "attention.q_lora_rank": 1536,
        "attention.kv_lora_rank": 512,
        "rope.dimension_count": 64,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 40.0,
        "rope.scaling.original_context_length": 4096,
        "expert_count": 256,
    }
    if old_mha_dims:
        values |= {"attention.head_count_kv": 128, "attention.key_length": 192, "attention.value_length": 128}
    else:
        values |= {
            "attention.head_count_kv": 1,
            "attention.key_length": 576,
            "attention.value_length": 512,
            "attention.key_length_mla": 192,
            "attention.value_length_mla": 128,
        }
    tensors: list[Tensor] = []
    for block in range(61):
        tensors += [
            (f"blk.{block}.attn_kv_a_mqa.weight", (576, 7168), "Q8_0"),
            (f"blk.{block}.ffn_norm.weight", (7168,), "F32"),
        ]
    return write_gguf(path, "deepseek2", values, tensors)
