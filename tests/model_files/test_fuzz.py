"""Property tests: whatever a config.json, safetensors header or GGUF header holds, the readers
answer with valid ModelFacts or a one-line ModelFactsError / UsageError, never another
exception, and in bounded time (hypothesis `deadline`; every file here is small or sparse).

The inputs are the real example configs (examples/models/*) and GGUF files written with
gguf.GGUFWriter the way llama.cpp lays them out, with keys replaced by hostile values.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests import gguf_builders
from tests.support.paths import REPO
from vllm_ctxmgr.core.facts import ModelFacts, derived_max_model_len
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.model_files.gguf import GGUF_INTEGER_RANGES
from vllm_ctxmgr.model_files.hf import INTEGER_KEYS, POSITION_KEYS
from vllm_ctxmgr.model_files.load import load_model_facts

MODELS = REPO / "examples" / "models"
CONFIGS = {p.parent.name: json.loads(p.read_text()) for p in sorted(MODELS.glob("*/config.json"))}
FUZZ = settings(
    deadline=timedelta(seconds=2),
    max_examples=200,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2, 7, 10**30, 2**63, -(2**63), True, False, None, "", "32", "auto", [], {}]),
    st.sampled_from([1e30, -1e30, math.nan, math.inf, -math.inf, 0.5, 32.0, -0.0]),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.one_of(st.integers(-3, 70000), st.text(max_size=3), st.none()), max_size=6),
    st.dictionaries(
        st.sampled_from(["rope_type", "type", "factor", "original_max_position_embeddings"]),
        st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=5)),
        max_size=3,
    ),
    st.integers(min_value=1, max_value=300).map(nested),
)
CONFIG_KEYS = sorted(
    set(INTEGER_KEYS)
    | set(POSITION_KEYS)
    | {k for config in CONFIGS.values() for k in config}
    | {
        "text_config", "rope_scaling", "rope_parameters", "layer_types", "quantization_config",
        "sliding_window", "use_sliding_window", "torch_dtype", "dtype", "architectures", "model_type",
        "no_rope_layers", "attn_type_list", "hybrid_override_pattern", "index_topk", "index_topk_pattern",
    }
)  # fmt: skip


def assert_clean(model: str) -> ModelFacts | None:
    try:
        facts = load_model_facts(model)
    except UsageError as error:  # ModelFactsError is one
        assert "\n" not in error.message
        return None
    assert isinstance(facts, ModelFacts)
    length, _ = derived_max_model_len(facts)
    assert isinstance(length, int) and length > 0
    return facts


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), HOSTILE, min_size=1, max_size=4),
    into_text_config=st.booleans(),
)
def test_hostile_config_json(
    workdir: Path, name: str, changes: dict[str, Any], into_text_config: bool
) -> None:
    config = json.loads(json.dumps(CONFIGS[name]))
    target = (
        config["text_config"] if into_text_config and isinstance(config.get("text_config"), dict) else config
    )
    target.update(changes)
    directory = workdir / "hf"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    assert_clean(str(directory))


@FUZZ
@given(
    header=st.one_of(
        st.binary(max_size=64),
        st.dictionaries(
            st.text(max_size=4),
            st.one_of(
                HOSTILE,
                st.fixed_dictionaries(
                    {
                        "dtype": st.sampled_from(["BF16", "F32", "F64", "I8", 7]),
                        "data_offsets": st.lists(st.integers(-10, 5000), min_size=2, max_size=2)
                        | st.lists(st.integers(-(2**65), 2**65), max_size=3)
                        | HOSTILE,
                    },
                ),
            ),
            max_size=3,
        ).map(lambda h: json.dumps(h).encode()),
    ),
    length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40, 2**64 - 1]),
    data=st.integers(0, 4096),
)
def test_hostile_safetensors_header(workdir: Path, header: bytes, length_delta: int, data: int) -> None:
    directory = workdir / "st"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"] | {"torch_dtype": None}))
    length = max(0, min(len(header) + length_delta, 2**64 - 1))
    shard = directory / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", length) + header)
    os.truncate(shard, 8 + len(header) + data)
    facts = assert_clean(str(directory))
    if facts is not None and facts.weight_bytes is not None:
        assert 0 <= facts.weight_bytes <= data


GGUF_VALUES = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**32 - 1),
    st.sampled_from([0, 1, 4096, 2**32 - 1, -1, 0.0, math.nan, math.inf, "", "x", "4096", True]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.lists(st.integers(min_value=0, max_value=2**16), max_size=6),
)
GGUF_BASE = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}


@FUZZ
@given(
    changes=st.dictionaries(
        st.sampled_from(sorted(set(GGUF_INTEGER_RANGES) | {"rope.scaling.type", "rope.scaling.factor"})),
        GGUF_VALUES,
        min_size=1,
        max_size=4,
    ),
    arch=st.sampled_from(["llama", "gemma3", "deepseek2", "qwen3next", "gpt-oss"]),
)
def test_hostile_gguf_metadata(workdir: Path, changes: dict[str, Any], arch: str) -> None:
    path = workdir / "m.gguf"
    path.unlink(missing_ok=True)
    tensors = gguf_builders.block_tensors(2, 64, kv_width=64, ggml_type="F16")
    gguf_builders.write_gguf(path, arch, GGUF_BASE | changes, tensors)
    assert_clean(str(path))


def kv(key: str, value_type: int, payload: bytes) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", value_type) + payload


def string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


GGUF_RAW_KEYS = st.sampled_from(
    ["general.alignment", "general.file_type", "split.count", "llama.block_count", "llama.context_length",
     "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.scaling.factor", "x.y"]
)  # fmt: skip
NESTED = st.integers(1, 6000).map(lambda depth: struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0))
# (GGUF value type, payload): typed as llama.cpp writes them, or with a confused type and payload
TYPED_VALUE = st.one_of(
    st.tuples(st.just(4), st.sampled_from([0, 1, 3, 2**31, 2**32 - 1]).map(lambda n: struct.pack("<I", n))),
    st.tuples(st.just(5), st.integers(-(2**31), 2**31 - 1).map(lambda n: struct.pack("<i", n))),
    st.tuples(
        st.just(6), st.sampled_from([math.nan, math.inf, -1.0, 0.0]).map(lambda f: struct.pack("<f", f))
    ),
    st.tuples(st.just(8), st.text(max_size=8).map(string)),
    st.tuples(st.just(9), NESTED),
    st.tuples(
        st.just(9),
        st.tuples(st.sampled_from([4, 8, 9, 10]), st.integers(0, 2**64 - 1)).map(
            lambda t: struct.pack("<IQ", *t)
        ),
    ),
    st.tuples(st.sampled_from([0, 7, 10, 12, 13, 2**32 - 1]), st.binary(max_size=24)),
)
RAW_KV = st.tuples(GGUF_RAW_KEYS, TYPED_VALUE).map(lambda kv: (kv[0], *kv[1]))


@FUZZ
@given(
    extra=st.lists(RAW_KV, max_size=4),
    cut=st.integers(0, 4096),
    flips=st.lists(st.tuples(st.integers(0, 255), st.sampled_from([0, 1, 9, 0x7F, 0xFF])), max_size=6),
)
def test_garbage_gguf_header(
    workdir: Path, extra: list[tuple[str, int, bytes]], cut: int, flips: list[tuple[int, int]]
) -> None:
    """A hand-laid GGUF header: a valid llama core, then keys of any type with any payload."""
    kvs = [
        kv("general.architecture", 8, string("llama")),
        kv("llama.block_count", 4, struct.pack("<I", 4)),
        kv("llama.attention.head_count", 4, struct.pack("<I", 8)),
        kv("llama.embedding_length", 4, struct.pack("<I", 512)),
    ]
    kvs += [kv(key, value_type, payload) for key, value_type, payload in extra]
    data = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + bytes(64))
    data = data[: max(cut, 4)] if cut < len(data) else data
    for offset, value in flips:
        if offset < len(data):
            data[offset] = value
    path = workdir / "g.gguf"
    path.write_bytes(bytes(data))
    assert_clean(str(path))


# nvidia/Nemotron-H-8B-Base-8K's config.json, the keys the readers use (issue 20)
NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
    "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}  # fmt: skip
PLANNED_KEYS = [
    "mamba_ssm_cache_dtype", "mamba_ssm_dtype", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size", "num_kv_shared_layers", "layer_types", "linear_num_value_heads", "full_attention_interval",
]  # fmt: skip


@settings(FUZZ, max_examples=40, deadline=timedelta(seconds=20))
@example(base="nemotron_h", changes={"mamba_ssm_cache_dtype": "int3"})
@example(base="qwen3_5_moe", changes={"mamba_ssm_dtype": ["float32"]})
@given(
    base=st.sampled_from(["nemotron_h", "qwen3_5_moe", "gemma-3-27b", "llama-3.1-70b"]),
    changes=st.dictionaries(
        st.sampled_from(PLANNED_KEYS),
        HOSTILE | st.sampled_from(["int3", "float32", "auto", ["float32"], 7, 33, 3]),
        min_size=1,
        max_size=3,
    ),
)
def test_what_facts_accepts_plan_can_plan(workdir: Path, base: str, changes: dict[str, Any]) -> None:
    """Issue 20, item 1: `plan` ended in "unexpected error" on inputs `facts` had accepted."""
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    if base == "nemotron_h":
        config = dict(NEMOTRON_H)
    elif base == "qwen3_5_moe":
        config = CONFIGS["qwen3-next-80b-a3b"] | {"model_type": "qwen3_5_moe"}
    else:
        config = json.loads(json.dumps(CONFIGS[base]))
    config.get("text_config", config).update(changes)
    directory = workdir / "planned"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    facts = CliRunner().invoke(main, ["facts", str(directory)])
    plan = CliRunner().invoke(main, ["plan", "--model", str(directory), "4096", "--gpu-memory", "80G"])
    for result in (facts, plan):
        assert "unexpected error" not in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    if facts.exit_code == 0:
        assert plan.exit_code in (0, 3, 6), plan.output  # 6: unknown (these configs have no weights)
    else:
        assert facts.exit_code == plan.exit_code == 2, (facts.output, plan.output)
