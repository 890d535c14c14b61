"""Validation at the door (issue 9, item 7): each class of hostile model file an adversarial run
found, refused with a one-line ModelFactsError (exit 2) that names the file and the key.

Every case here ended, before the fix, in an unhandled exception, a hang, or facts built from
garbage (negative layers, heads, KV bytes).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests import gguf_builders
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, RopeFacts
from vllm_ctxmgr.errors import ExitCode, ModelFactsError
from vllm_ctxmgr.model_files.load import load_model_facts

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "examples" / "models"


def hf_dir(tmp_path: Path, name: str = "qwen3-32b", **changes: Any) -> Path:
    config = json.loads((MODELS / name / "config.json").read_text())
    config.update(changes)
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def refused(model: Path | str, pattern: str) -> str:
    with pytest.raises(ModelFactsError, match=pattern) as error:
        load_model_facts(str(model))
    assert "\n" not in error.value.message
    return error.value.message


# --- config.json: hangs ---


def test_layer_count_of_1e30_is_refused_not_looped_over(tmp_path: Path) -> None:
    refused(hf_dir(tmp_path, num_hidden_layers=1e30), r"config\.json: num_hidden_layers is 1e\+30, expected")


def test_fifo_as_config_json_is_refused_before_open_blocks(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    os.mkfifo(directory / "config.json")
    refused(directory, r"config\.json: a FIFO, expected a regular file$")


def test_dev_zero_as_config_json_is_not_read(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").symlink_to("/dev/zero")
    refused(directory, r"config\.json: a character device, expected a regular file$")


def test_oversized_config_json_is_refused_unread(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    os.truncate(directory / "config.json", 1 << 30)  # sparse: 1 GiB apparent, nothing written
    refused(directory, r"config\.json: 1073741824 bytes, more than the 8 MiB")


# --- config.json: garbage that used to be accepted ---


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_hidden_layers", -1),
        ("num_hidden_layers", 0),
        ("num_attention_heads", -1),
        ("num_attention_heads", 0),
        ("num_key_value_heads", 0),
        ("head_dim", -7),
        ("max_position_embeddings", -1),
        ("sliding_window", -4096),
    ],
)
def test_negative_or_zero_counts_are_refused_by_name(tmp_path: Path, key: str, value: int) -> None:
    refused(hf_dir(tmp_path, **{key: value}), rf"config\.json: {key} is {value}, expected an integer in")


def test_zero_max_position_embeddings_is_refused(tmp_path: Path) -> None:
    refused(
        hf_dir(tmp_path, max_position_embeddings=0),
        r"max_position_embeddings is 0, expected an integer in 1\.\.",
    )


def test_zero_kv_lora_rank_is_refused(tmp_path: Path) -> None:
    refused(hf_dir(tmp_path, "deepseek-v3", kv_lora_rank=0), r"config\.json: kv_lora_rank is 0, expected")


def test_head_size_derived_to_zero_is_refused(tmp_path: Path) -> None:
    """head_dim null falls back to hidden_size // heads, here 0."""
    refused(hf_dir(tmp_path, head_dim=None, hidden_size=4), r"layer 0 head_size is 0, expected an integer")


def test_facts_and_plan_exit_2_on_negative_heads(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path, num_attention_heads=-1)
    for argv in (["facts", str(directory)], ["plan", "--model", str(directory), "4096"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == ExitCode.USAGE, (argv, result.output)
        assert "num_attention_heads is -1" in result.output
        assert "GiB" not in result.output


# --- config.json: the unhandled exceptions, one per class ---


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"num_hidden_layers": "64"}, r"num_hidden_layers is '64', expected an integer"),  # TypeError
        ({"num_attention_heads": math.nan}, r"num_attention_heads is nan"),  # ValueError
        ({"max_position_embeddings": math.inf}, r"max_position_embeddings is inf"),  # OverflowError
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers is 1000000000000"),  # MemoryError
        ({"num_hidden_layers": [64]}, r"num_hidden_layers is \[64\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": math.nan}}, r"rope_scaling factor is nan"),
        ({"torch_dtype": "banana"}, r"config\.json torch_dtype is 'banana', not a dtype vLLM serves"),
        ({"architectures": "Qwen3ForCausalLM"}, r"architectures is 'Qwen3ForCausalLM', expected a list"),
        ({"quantization_config": {"quant_method": "fp8", "producer": "x"}}, r"config\.json: unusable config"),
    ],
)
def test_values_of_the_wrong_type_are_refused_by_name(
    tmp_path: Path, changes: dict[str, Any], pattern: str
) -> None:
    refused(hf_dir(tmp_path, **changes), pattern)


def test_zero_sliding_window_pattern_is_refused_not_divided_by(tmp_path: Path) -> None:  # ZeroDivisionError
    refused(hf_dir(tmp_path, "gemma-3-27b", sliding_window_pattern=0), r"sliding_window_pattern is 0")


def test_deep_nesting_is_refused(tmp_path: Path) -> None:  # RecursionError
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(directory, r"config\.json: JSON nested deeper than 64 levels$")


def test_an_integer_of_5000_digits_is_refused(tmp_path: Path) -> None:  # ValueError from json
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    refused(directory, r"config\.json: malformed JSON")


# --- safetensors headers ---


def shard(directory: Path, header: Any, *, data: int = 0, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path = directory / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw)
    os.truncate(path, 8 + len(raw) + data)
    return path


def test_inverted_offsets_are_refused_not_negative_weights(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path, torch_dtype=None)
    shard(directory, {"w": {"dtype": "BF16", "shape": [8], "data_offsets": [16, 0]}}, data=16)
    refused(
        directory, r"model\.safetensors: malformed safetensors header \(tensor 'w' data_offsets \[16, 0\]\)$"
    )


def test_offsets_past_the_end_of_the_file_are_truncation(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    shard(directory, {"w": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 1 << 40]}}, data=16)
    refused(directory, r"model\.safetensors: truncated safetensors file \(tensor 'w' ends at byte")


def test_a_dtype_that_is_no_string_is_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path, torch_dtype=None)
    shard(directory, {"w": {"dtype": 7, "data_offsets": [0, 2]}}, data=2)
    refused(
        directory,
        r"model\.safetensors: malformed safetensors header \(tensor 'w' needs dtype, data_offsets\)$",
    )


def test_fifo_shard_is_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    os.mkfifo(directory / "model.safetensors")
    refused(directory, r"model\.safetensors: a FIFO, expected a regular file$")


def test_index_with_a_list_for_metadata_falls_back_cleanly(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    (directory / "model.safetensors.index.json").write_text('{"metadata": [1]}')
    assert load_model_facts(str(directory)).weight_bytes is None


# --- GGUF ---


def gguf(tmp_path: Path, values: dict[str, Any], name: str = "m.gguf") -> Path:
    base = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}
    (path,) = gguf_builders.write_gguf(tmp_path / name, "llama", base | values, [])
    return path


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        ({"block_count": -1}, r"llama\.block_count is -1, expected an integer in 1\.\."),
        ({"context_length": 0}, r"llama\.context_length is 0, expected an integer in 1\.\."),
        ({"attention.head_count": 0}, r"llama\.attention\.head_count is 0"),
        ({"context_length": "4096"}, r"llama\.context_length is '4096'"),
        ({"rope.scaling.type": "linear", "rope.scaling.factor": math.inf}, r"rope\.scaling\.factor is inf"),
        ({"block_count": 3, "nextn_predict_layers": 3}, r"num_hidden_layers is 0, expected 1\.\."),
    ],
)
def test_gguf_garbage_values_are_refused_by_key(tmp_path: Path, values: dict[str, Any], pattern: str) -> None:
    refused(gguf(tmp_path, values), pattern)


def test_gguf_string_alignment_is_refused(tmp_path: Path) -> None:
    import gguf as gguf_py

    path = tmp_path / "a.gguf"
    writer = gguf_py.GGUFWriter(str(path), "llama")
    writer.add_string("general.alignment", "32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(path, r"a\.gguf: general\.alignment is '32', expected a power of two$")


def raw_gguf(path: Path, kv: bytes, kv_count: int = 1) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, kv_count) + kv)
    return path


def test_gguf_arrays_nested_5000_deep_are_refused(tmp_path: Path) -> None:
    key = b"x.nested"
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    path = raw_gguf(tmp_path / "deep.gguf", struct.pack("<Q", len(key)) + key + value)
    refused(path, r"deep\.gguf: GGUF arrays nested deeper than 4 levels$")


def test_gguf_huge_array_count_is_refused_unread(tmp_path: Path) -> None:
    key = b"x.big"
    value = struct.pack("<I", 9) + struct.pack("<IQ", 10, 1 << 40)
    path = raw_gguf(tmp_path / "big.gguf", struct.pack("<Q", len(key)) + key + value + bytes(16))
    refused(path, r"big\.gguf: GGUF array of 1099511627776 items")


def test_gguf_huge_key_count_is_refused(tmp_path: Path) -> None:
    path = raw_gguf(tmp_path / "keys.gguf", bytes(64), kv_count=1 << 62)
    refused(path, r"keys\.gguf: GGUF header claims 4611686018427387904 keys")


def test_split_name_of_zero_parts_is_refused(tmp_path: Path) -> None:
    path = gguf(tmp_path, {}, name="m-00001-of-00000.gguf")
    refused(path, r"split GGUF part 00001 of 00000 does not exist$")


def test_fifo_gguf_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.gguf")
    # load_model_facts refuses it by path (below); the reader also refuses it on its own
    from vllm_ctxmgr.model_files.gguf import read_gguf_header

    with pytest.raises(ModelFactsError, match=r"m\.gguf: a FIFO, expected a regular file$"):
        read_gguf_header(tmp_path / "m.gguf")


# --- the ModelFacts invariant: no path builds garbage facts ---


def facts(**changes: Any) -> ModelFacts:
    fields: dict[str, Any] = {
        "source": "hand-built",
        "source_format": "hf",
        "model_type": "llama",
        "architectures": (),
        "num_attention_heads": 8,
        "layers": (LayerFacts(LayerKind.FULL, 8, 128, 128),) * 4,
        "dtype": "bfloat16",
    }
    return ModelFacts(**(fields | changes))


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"num_attention_heads": -1}, r"^hand-built: num_attention_heads is -1"),
        ({"layers": ()}, r"^hand-built: num_hidden_layers is 0"),
        ({"layers": (LayerFacts(LayerKind.FULL, 8, -128, 128),)}, r"layer 0 head_size is -128"),
        ({"layers": (LayerFacts(LayerKind.NONE),)}, r"no layer holds a KV cache"),
        ({"position_limits": (("max_position_embeddings", 0),)}, r"max_position_embeddings is 0"),
        ({"rope": (RopeFacts("yarn", math.nan),)}, r"rope factor is nan"),
        ({"weight_bytes": -5}, r"weight_bytes is -5"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank is 0"),
        ({"dtype": "float64"}, r"dtype 'float64' is not one vLLM serves"),
    ],
)
def test_model_facts_refuse_garbage_whoever_builds_them(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ModelFactsError, match=pattern):
        facts(**changes)


def test_gguf_million_nested_arrays_in_a_sparse_file_are_refused(tmp_path: Path) -> None:
    """Found by benchmarks/campaign_model_files.py: 2**20 empty arrays over sparse zeros took > 10 s."""
    key = b"llama.context_length"
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1 << 20)
    path = raw_gguf(tmp_path / "many.gguf", struct.pack("<Q", len(key)) + key + value)
    os.truncate(path, 1 << 32)
    refused(path, r"many\.gguf: GGUF array of 1048576 arrays at byte \d+$")


def test_gguf_large_scalar_arrays_are_stepped_over_not_decoded(tmp_path: Path) -> None:
    from vllm_ctxmgr.model_files.gguf import SkippedArray, read_gguf_header

    key = b"tokenizer.ggml.token_type"
    value = struct.pack("<I", 9) + struct.pack("<IQ", 0, 1 << 24)
    path = raw_gguf(tmp_path / "vocab.gguf", struct.pack("<Q", len(key)) + key + value)
    os.truncate(path, 128 + (1 << 24))
    assert read_gguf_header(path).metadata["tokenizer.ggml.token_type"] == SkippedArray(1 << 24)


def test_a_fifo_named_as_the_model_is_refused_as_such(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.gguf")
    refused(tmp_path / "model.gguf", r"model\.gguf: not a regular file or a directory$")
