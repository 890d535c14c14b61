"""Validation at the door (issue 9, item 7): each class of hostile model file an adversarial run
found, refused with a one-line ModelFactsError (exit 2) that names the file and the key.

Every case here ended, before the fix, in an unhandled exception, a hang, or facts built from
garbage (negative layers, heads, KV bytes).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests import gguf_builders
from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, RopeFacts
from vllm_ctxmgr.errors import ExitCode, ModelFactsError
from vllm_ctxmgr.model_files.load import load_model_facts

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
    refused(
        hf_dir(tmp_path, head_dim=None, hidden_size=4),
        r"hidden_size 4 is not a multiple of num_attention_heads 64",
    )


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
        (
            {"layers": (LayerFacts(LayerKind.FULL, 16, 128, 128),)},
            r"layer 0 num_kv_heads is 16, expected .* 1\.\.8$",
        ),
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


# --- round two (issue 20): what vLLM or transformers would refuse is refused at the door ---

# nvidia/Nemotron-H-8B-Base-8K's config.json, the keys the readers use
NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def config_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def facts_and_plan_refuse(directory: Path, pattern: str) -> None:
    """`facts` and `plan` both end in one clear line and exit 2 (plan used to crash after facts passed)."""
    for argv in (["facts", str(directory)], ["plan", "--model", str(directory), "4096"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == ExitCode.USAGE, (argv, result.output)
        assert "unexpected error" not in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert re.search(pattern, result.output), result.output


@pytest.mark.parametrize("value", ["int3", ["float32"], {"a": 1}, 4])
def test_nemotron_h_state_dtype_that_is_no_dtype_is_refused_by_facts_and_plan(
    tmp_path: Path, value: Any
) -> None:
    directory = config_dir(tmp_path, NEMOTRON_H | {"mamba_ssm_cache_dtype": value})
    facts_and_plan_refuse(directory, r"config\.json: mamba_ssm_cache_dtype is .*, expected one of")


@pytest.mark.parametrize("value", ["int3", ["float32"], {"a": 1}])
def test_qwen3_5_state_dtype_that_is_no_dtype_is_refused_by_facts_and_plan(
    tmp_path: Path, value: Any
) -> None:
    config = json.loads((MODELS / "qwen3-next-80b-a3b" / "config.json").read_text())
    directory = config_dir(tmp_path, config | {"model_type": "qwen3_5_moe", "mamba_ssm_dtype": value})
    facts_and_plan_refuse(directory, r"config\.json: mamba_ssm_dtype is .*, expected one of")


def test_state_dtype_auto_follows_the_conv_dtype_as_vllm_does(tmp_path: Path) -> None:
    """vLLM's MambaDType is auto/float32/float16/bfloat16; "auto" leaves the SSM state at the conv dtype."""
    model = load_model_facts(str(config_dir(tmp_path, NEMOTRON_H | {"mamba_ssm_cache_dtype": "auto"})))
    state = model.layers[0].state
    assert state is not None and state.ssm_dtype is None
    result = CliRunner().invoke(main, ["plan", "--model", str(tmp_path / "model"), "4096"])
    assert "unexpected error" not in result.output, result.output


def test_model_facts_refuse_a_state_dtype_whoever_builds_them() -> None:
    from vllm_ctxmgr.core.facts import StateFacts

    state = StateFacts("gdn", conv_kernel=4, num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)
    for bad in ("int3", ["float32"]):
        layer = LayerFacts(LayerKind.MAMBA, state=StateFacts(**(state.__dict__ | {"ssm_dtype": bad})))
        with pytest.raises(ModelFactsError, match=r"layer 0 state ssm_dtype is .*, expected one of"):
            facts(layers=(layer,))


@pytest.mark.parametrize("dtype", ["int3", ["float32"], {"a": 1}, None])
def test_dtype_bytes_refuses_with_value_error_only(dtype: Any) -> None:
    from vllm_ctxmgr.core.facts import dtype_bytes

    with pytest.raises(ValueError, match=r"unknown dtype"):
        dtype_bytes(dtype)


@pytest.mark.parametrize(
    ("model", "changes", "pattern"),
    [
        ("llama-3.1-70b", {"num_attention_heads": 32, "num_key_value_heads": 7, "head_dim": 128},
         r"num_attention_heads 32 is not a multiple of num_key_value_heads 7"),
        ("llama-3.1-70b", {"num_attention_heads": 8, "num_key_value_heads": 32, "head_dim": 128},
         r"num_key_value_heads 32 is more than num_attention_heads 8"),
        ("llama-3.1-70b", {"num_attention_heads": 32, "num_key_value_heads": 33, "head_dim": 128},
         r"num_key_value_heads 33 is more than num_attention_heads 32"),
        ("gemma-3-27b", {"num_key_value_heads": 64},
         r"num_key_value_heads 64 is more than num_attention_heads 32"),
        ("llama-3.1-70b", {"hidden_size": 8190},
         r"hidden_size 8190 is not a multiple of num_attention_heads 64"),
    ],
)  # fmt: skip
def test_head_geometry_vllm_refuses_is_refused(
    tmp_path: Path, model: str, changes: dict[str, Any], pattern: str
) -> None:
    config = json.loads((MODELS / model / "config.json").read_text())
    target = config.get("text_config", config)
    target.update(changes)
    if "hidden_size" in changes:
        target.pop("head_dim", None)
    facts_and_plan_refuse(config_dir(tmp_path, config), pattern)


@pytest.mark.parametrize(
    ("kv", "pattern"),
    [(3, r"attention\.head_count 8 is not a multiple of .*head_count_kv 3"),
     (16, r"attention\.head_count_kv 16 is more than .*head_count 8"),
     ([8, 8, 3, 8], r"layer 2: llama\.attention\.head_count 8 is not a multiple of .*head_count_kv 3")],
)  # fmt: skip
def test_gguf_head_geometry_vllm_refuses_is_refused(tmp_path: Path, kv: Any, pattern: str) -> None:
    refused(gguf(tmp_path, {"attention.head_count_kv": kv}), pattern)


def test_gguf_kv_heads_per_layer_that_divide_are_kept(tmp_path: Path) -> None:
    model = load_model_facts(str(gguf(tmp_path, {"attention.head_count_kv": [8, 2, 4, 0]})))
    assert [layer.num_kv_heads for layer in model.layers] == [8, 2, 4, 0]


def named_shard(directory: Path, name: str, nbytes: int) -> None:
    header = json.dumps(
        {"w": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}
    ).encode()
    (directory / name).write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(directory / name, 8 + len(header) + nbytes)


def test_two_of_four_shards_without_an_index_are_refused_not_summed(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    for i in (1, 2):
        named_shard(directory, f"model-{i:05d}-of-00004.safetensors", 1 << 21)
    facts_and_plan_refuse(directory, r"safetensors shard missing: .*model-00003-of-00004\.safetensors")


def test_index_without_total_size_naming_missing_shards_is_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    names = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    for name in names[:2]:
        named_shard(directory, name, 1 << 21)
    weight_map = {f"layer.{i}.w": name for i, name in enumerate(names)}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    refused(
        directory,
        r"model\.safetensors\.index\.json names model-00003-of-00004\.safetensors, which is missing",
    )


def test_index_with_total_size_naming_missing_shards_is_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    named_shard(directory, "model-00001-of-00002.safetensors", 1 << 21)
    names = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 1 << 22}, "weight_map": names}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(directory, r"names model-00002-of-00002\.safetensors, which is missing")


def test_complete_shards_are_still_summed(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    for i in (1, 2):
        named_shard(directory, f"model-{i:05d}-of-00002.safetensors", 1 << 21)
    assert load_model_facts(str(directory)).weight_bytes == 1 << 22


def test_kv_sharing_beyond_the_layer_count_is_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path, "gemma-3-27b")
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["num_kv_shared_layers"] = 124
    (directory / "config.json").write_text(json.dumps(config))
    facts_and_plan_refuse(directory, r"num_kv_shared_layers is 124, not fewer than the 62 layers")


def test_gguf_kv_sharing_beyond_the_layer_count_is_refused(tmp_path: Path) -> None:
    refused(
        gguf(tmp_path, {"attention.shared_kv_layers": 8}),
        r"llama\.attention\.shared_kv_layers is 8, not fewer than the 4 layers",
    )


def test_gguf_zero_state_dimension_is_refused(tmp_path: Path) -> None:
    """ssm.time_step_rank 0 made the V heads 0 and cut the state pool by 69%."""
    (path,) = gguf_builders.qwen3_next_gguf(tmp_path / "q.gguf")
    (bad,) = rewrite_gguf(path, {"qwen3next.ssm.time_step_rank": 0})
    refused(bad, r"qwen3next\.ssm\.time_step_rank is 0, expected an integer in 1\.\.")


def test_gguf_state_width_that_divides_to_zero_is_refused(tmp_path: Path) -> None:
    (path,) = gguf_builders.qwen3_next_gguf(tmp_path / "q.gguf")
    (bad,) = rewrite_gguf(path, {"qwen3next.ssm.inner_size": 16})
    refused(bad, r"qwen3next\.ssm\.inner_size 16 is not a multiple of qwen3next\.ssm\.time_step_rank 32")


def test_model_facts_refuse_a_zero_state_dimension() -> None:
    from vllm_ctxmgr.core.facts import StateFacts

    state = StateFacts("gdn", conv_kernel=4, num_k_heads=16, num_v_heads=0, k_head_dim=128, v_head_dim=128)
    with pytest.raises(
        ModelFactsError, match=r"layer 0 state num_v_heads is 0, expected an integer in 1\.\."
    ):
        facts(layers=(LayerFacts(LayerKind.MAMBA, state=state),))


def rewrite_gguf(path: Path, changes: dict[str, Any]) -> list[Path]:
    """PATH with some metadata values replaced, the tensor infos kept (the way a broken converter writes)."""
    from vllm_ctxmgr.model_files.gguf import read_gguf_header

    header = read_gguf_header(path)
    arch = header.metadata["general.architecture"]
    values = {k.removeprefix(f"{arch}."): v for k, v in header.metadata.items() if k.startswith(f"{arch}.")}
    values |= {k.removeprefix(f"{arch}."): v for k, v in changes.items()}
    tensors = [(t.name, tuple(reversed(t.shape)), header.type_names[t.ggml_type]) for t in header.tensors]
    return gguf_builders.write_gguf(path.with_name("bad-" + path.name), arch, values, tensors)


def test_garbage_layer_types_are_refused_as_transformers_does(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path, "gemma-3-27b")
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["layer_types"] = ["banana"] * 62
    (directory / "config.json").write_text(json.dumps(config))
    refused(directory, r"layer_types entry 'banana' is not a layer type transformers knows")


def test_overlapping_tensor_byte_ranges_are_refused(tmp_path: Path) -> None:
    directory = hf_dir(tmp_path)
    tensors = {"a": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 16]},
               "b": {"dtype": "BF16", "shape": [8], "data_offsets": [8, 24]}}  # fmt: skip
    shard(directory, tensors, data=24)
    refused(directory, r"model\.safetensors: malformed safetensors header \(tensors 'a' and 'b' overlap\)$")


def test_gguf_deepseek2_with_zero_kv_lora_rank_is_refused(tmp_path: Path) -> None:
    (path,) = gguf_builders.deepseek_v3_gguf(tmp_path / "d.gguf")
    (bad,) = rewrite_gguf(path, {"deepseek2.attention.kv_lora_rank": 0})
    refused(bad, r"deepseek2\.attention\.kv_lora_rank is 0, expected an integer in 1\.\.")


def test_refs_main_escaping_the_cache_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567").mkdir(parents=True)
    (repo / "refs").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text((MODELS / "qwen3-32b" / "config.json").read_text())
    (repo / "refs" / "main").write_text("../../../outside")
    refused_repo = pytest.raises(
        ModelFactsError, match=r"refs/main is '\.\./\.\./\.\./outside', not a revision"
    )
    with refused_repo:
        load_model_facts("org/name", hf_home=str(tmp_path))


@pytest.mark.parametrize(("kind", "said"), [("fifo", "a FIFO"), ("dir", "a directory")])
def test_split_gguf_part_that_is_no_file_is_named_for_what_it_is(
    tmp_path: Path, kind: str, said: str
) -> None:
    parts = gguf_builders.llama_70b_gguf(tmp_path / "l.gguf", parts=2)
    parts[1].unlink()
    os.mkfifo(parts[1]) if kind == "fifo" else parts[1].mkdir()
    refused(parts[0], rf"split GGUF part .*{parts[1].name}: {said}, expected a regular file$")


def test_safetensors_header_of_millions_of_nodes_is_refused_before_parsing(tmp_path: Path) -> None:
    """A 6 MB header of `{},{},...` (the 55 MB one took 2.8 GiB and 20 s to parse)."""
    directory = hf_dir(tmp_path)
    body = b'{"a": [' + b"{}," * 2_000_000 + b"{}]}"
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    refused(directory, r"model\.safetensors: JSON of more than \d+ values$")


def test_gguf_kept_arrays_are_bounded_in_total(tmp_path: Path) -> None:
    """440 kept UINT16[65536] arrays took 1.18 GiB: past a total, arrays are stepped over, not decoded."""
    from vllm_ctxmgr.model_files.gguf import MAX_GGUF_KEPT_ITEMS, SkippedArray, read_gguf_header

    count, arrays = 10_000, 2 * MAX_GGUF_KEPT_ITEMS // 10_000 + 1
    kv = b"".join(
        struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 2, count) + bytes(2 * count)
        for key in (f"x.a{i}".encode() for i in range(arrays))
    )
    header = read_gguf_header(raw_gguf(tmp_path / "arrays.gguf", kv + bytes(64), kv_count=arrays))
    kept = sum(len(v) for v in header.metadata.values() if isinstance(v, list))
    assert 0 < kept <= MAX_GGUF_KEPT_ITEMS
    assert any(isinstance(v, SkippedArray) for v in header.metadata.values())


def test_an_index_without_any_shard_keeps_its_total_size(tmp_path: Path) -> None:
    """A config-only copy (examples/models) plans with the index's total_size, as before."""
    directory = hf_dir(tmp_path)
    names = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 1 << 22}, "weight_map": names}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model_facts(str(directory)).weight_bytes == 1 << 22


@pytest.mark.parametrize(
    ("changes", "tp", "pattern"),
    [
        ({}, "3", r"Total number of attention heads \(64\) must be divisible by tensor parallel size \(3\)"),
        ({"num_attention_heads": 48, "num_key_value_heads": 12, "head_dim": 128}, "8",
         r"12 KV heads are not divisible by tensor parallel size 8"),
        ({"num_attention_heads": 48, "num_key_value_heads": 16, "head_dim": 128}, "24",
         r"tensor parallel size 24 is not a multiple of the 16 KV heads"),
    ],
)  # fmt: skip
def test_tensor_parallel_against_heads_and_kv_heads_is_one_line(
    tmp_path: Path, changes: dict[str, Any], tp: str, pattern: str
) -> None:
    """Issue 20, item 2 (TP against both): already refused by the planner; kept as a regression test."""
    directory = hf_dir(tmp_path, "llama-3.1-70b", **changes)
    result = CliRunner().invoke(
        main, ["plan", "--model", str(directory), "4096", "-tp", tp, "--gpu-memory", "80G", "--gpu-count", tp]
    )
    assert result.exit_code == ExitCode.USAGE, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert re.search(pattern, result.output), result.output


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", ""])
def test_index_naming_a_file_outside_the_model_directory_is_refused(tmp_path: Path, name: str) -> None:
    directory = hf_dir(tmp_path)
    index = {"metadata": {"total_size": 1 << 22}, "weight_map": {"a": name}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(directory, r"model\.safetensors\.index\.json names '.*', not a file in the model directory$")


def test_index_total_size_beside_a_partial_series_is_refused(tmp_path: Path) -> None:
    """An index without weight_map must not vouch for 2 of 4 shards with its total_size."""
    directory = hf_dir(tmp_path)
    for i in (1, 2):
        named_shard(directory, f"model-{i:05d}-of-00004.safetensors", 1 << 21)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1 << 23}}))
    refused(directory, r"safetensors shard missing: .*model-00003-of-00004\.safetensors$")


def test_gguf_nested_arrays_are_bounded_by_the_items_walked_not_only_the_bytes(tmp_path: Path) -> None:
    """Issue 29 item 19: 4M empty arrays nested two deep in a 49 MB file took 16-20 s to walk."""
    import time

    key = b"x.nested"
    inner = struct.pack("<IQ", 9, 4096) + struct.pack("<IQ", 0, 0) * 4096
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1000) + inner * 1000
    path = raw_gguf(tmp_path / "nested.gguf", struct.pack("<Q", len(key)) + key + value)
    assert path.stat().st_size > 49_000_000
    started = time.perf_counter()
    refused(path, r"nested\.gguf: GGUF header of more than 65536 arrays inside arrays \(at byte \d+\)$")
    assert time.perf_counter() - started < 3


def test_gguf_string_items_walked_are_bounded_over_the_header(tmp_path: Path) -> None:
    from vllm_ctxmgr.model_files.gguf import MAX_GGUF_VISITED

    # nine arrays of a million empty strings each: every array alone is a vocabulary's size
    kv = b""
    for n in range(9):
        key = f"x.strings{n}".encode()
        kv += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, 1 << 20) + bytes(8 << 20)
    path = raw_gguf(tmp_path / "strings.gguf", kv, kv_count=9)
    refused(path, rf"strings\.gguf: GGUF header of more than {MAX_GGUF_VISITED} array items \(at byte \d+\)$")


def _set_tensor_offset(path: Path, name: str, offset: int) -> None:
    """Rewrite one tensor info's data offset in a GGUF the gguf package wrote (little-endian, v3)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "offset"), [("blk.0.attn_k.weight", 0), ("blk.1.attn_q.weight", 64)])
def test_gguf_overlapping_tensor_data_is_refused(tmp_path: Path, name: str, offset: int) -> None:
    """Issue 29 item 18: overlapping tensors were summed, naming more weight bytes than the file holds."""
    base = {"block_count": 2, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}
    tensors = gguf_builders.block_tensors(2, 512, kv_width=512, ggml_type="F16")
    (path,) = gguf_builders.write_gguf(tmp_path / "m.gguf", "llama", base, tensors)
    assert load_model_facts(str(path)).weight_bytes == sum(
        gguf_builders.tensor_nbytes(shape, kind) for _, shape, kind in tensors
    )
    _set_tensor_offset(path, name, offset)
    refused(path, r"m\.gguf: malformed GGUF header \(tensors '.+' and '.+' overlap\)$")


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        (
            {"attention.head_count_kv": [8, 8]},
            r"llama\.attention\.head_count_kv has 2 per-layer values, expected 4",
        ),
        (
            {"attention.head_count": [8, 8, 8]},
            r"llama\.attention\.head_count has 3 per-layer values, expected 4",
        ),
        ({"attention.head_count_kv": [8] * 5}, r"llama\.attention\.head_count_kv has 5 per-layer values"),
    ],
)
def test_gguf_per_layer_arrays_of_the_wrong_length_are_refused_by_key(
    tmp_path: Path, values: dict[str, Any], pattern: str
) -> None:
    """Issue 29 item 20: these were `unusable GGUF metadata (IndexError: list index out of range)`;
    llama.cpp refuses them too (llama_model_loader::get_key_or_arr: "wrong array length")."""
    message = refused(gguf(tmp_path, values), pattern)
    assert "Error" not in message


def test_gguf_per_layer_arrays_without_the_nextn_layers_are_read(tmp_path: Path) -> None:
    path = gguf(
        tmp_path, {"block_count": 5, "nextn_predict_layers": 1, "attention.head_count_kv": [8, 8, 4, 4]}
    )
    assert [layer.num_kv_heads for layer in load_model_facts(str(path)).layers] == [8, 8, 4, 4]
