"""Hostile-input campaign against load_model_facts and the planner (issues 9 and 20).

Generates hostile inputs per kind (seeded, reproducible): round one's config.json, safetensors and
GGUF mutations, and round two's classes (hybrid state dtypes, head geometry, partial checkpoints, KV
sharing, zero state dimensions, inputs that stress memory inside the size caps, and the conservative
refusals: layer_types, overlapping tensors, deepseek2 without a latent, refs/main, split parts).
Each input is read in a forked child with a per-input timeout: `facts` (load_model_facts), then, if
accepted, `plan` (the CLI, 4096 tokens on an 80 GiB GPU). Per kind it prints: inputs tried, rejected
cleanly (one-line ModelFactsError / UsageError, or plan's exit 2), accepted, garbage accepted (facts
that fail sanity checks written here, or a round-two input the generator knows vLLM or transformers
refuses), unhandled exceptions (facts or plan), hangs, over-refused (round two: refused although the
generator built a loadable model; information, not a failure), and the child's peak RSS.
Goal: 0 unhandled, 0 hangs, 0 garbage accepted, 0 over 1 GiB. Most files are small or sparse; the
memory class writes a few 55-58 MB files.

    .venv/bin/python benchmarks/campaign_model_files.py [--per-kind 300] [--seed 9] [--timeout 20]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import gguf_builders  # noqa: E402
from vllm_ctxmgr.core.facts import LayerKind, ModelFacts, derived_max_model_len  # noqa: E402
from vllm_ctxmgr.errors import UsageError  # noqa: E402
from vllm_ctxmgr.model_files.load import load_model_facts  # noqa: E402

MODELS = REPO / "examples" / "models"
CONFIGS = {p.parent.name: json.loads(p.read_text()) for p in sorted(MODELS.glob("*/config.json"))}
HOSTILE: list[Any] = [
    0, -1, 1, -(2**63), 2**63, 2**64, 10**30, 1e30, -1e30, math.nan, math.inf, -math.inf, 0.5, True, False,
    None, "", "32", "auto", "banana", [], [0], [1, 2, 3], [-1] * 4, {}, {"a": 1}, {"factor": math.nan},
    {"rope_type": "yarn", "factor": -4.0}, {"rope_type": "yarn", "factor": 1e300}, "x" * 1000,
]  # fmt: skip
HF_KEYS = [
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "max_position_embeddings", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "index_head_dim",
    "index_topk", "index_topk_freq", "sliding_window", "sliding_window_pattern", "layer_types",
    "max_window_layers", "use_sliding_window", "rope_scaling", "rope_parameters", "torch_dtype",
    "architectures", "model_type", "text_config", "quantization_config", "num_nextn_predict_layers",
    "num_kv_shared_layers", "full_attention_interval", "linear_num_value_heads", "linear_key_head_dim",
    "linear_conv_kernel_dim", "attn_type_list", "no_rope_layers", "attention_chunk_size",
    "original_max_position_embeddings", "model_max_length",
]  # fmt: skip
GGUF_KEYS = [
    "block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.kv_lora_rank", "rope.dimension_count",
    "attention.sliding_window", "attention.sliding_window_pattern", "attention.shared_kv_layers",
    "nextn_predict_layers", "rope.scaling.type", "rope.scaling.factor", "ssm.conv_kernel",
    "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
]  # fmt: skip
GGUF_HOSTILE: list[Any] = [
    0,
    1,
    2**32 - 1,
    -1,
    -(2**31),
    0.0,
    math.nan,
    math.inf,
    -1.0,
    "",
    "4096",
    True,
    [0],
    [1] * 3,
]


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


# --- generators: each writes one input under DIRECTORY and returns the model string ---


def hostile_config(rng: random.Random, directory: Path) -> str:
    directory.mkdir(parents=True)
    config = json.loads(json.dumps(CONFIGS[rng.choice(sorted(CONFIGS))]))
    roll = rng.random()
    if roll < 0.08:  # raw bytes: broken, deep, over-long, not UTF-8, not an object
        raw = rng.choice(
            [
                b'{"num_hidden_layers": ',
                b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                b'{"num_hidden_layers": ' + b"9" * 5000 + b"}",
                b"\xff\xfe{}",
                b"[1, 2, 3]",
                b"",
            ]
        )
        (directory / "config.json").write_bytes(raw)
        return str(directory)
    if roll < 0.12:  # not a regular file, or too large
        kind = rng.choice(["fifo", "zero", "huge"])
        if kind == "fifo":
            os.mkfifo(directory / "config.json")
        elif kind == "zero":
            (directory / "config.json").symlink_to("/dev/zero")
        else:
            (directory / "config.json").write_text(json.dumps(config))
            os.truncate(directory / "config.json", 1 << 32)
        return str(directory)
    target = (
        config["text_config"]
        if isinstance(config.get("text_config"), dict) and rng.random() < 0.5
        else config
    )
    for key in rng.sample(HF_KEYS, rng.randint(1, 3)):
        value = nested(rng.randint(10, 900)) if rng.random() < 0.05 else rng.choice(HOSTILE)
        target[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def hostile_safetensors(rng: random.Random, directory: Path) -> str:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"] | {"torch_dtype": None}))
    shard = directory / "model-00001-of-00001.safetensors"
    roll = rng.random()
    if roll < 0.05:
        os.mkfifo(shard)
        return str(directory)
    if roll < 0.15:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": rng.choice([[1], "x", {"total_size": rng.choice(HOSTILE)}, None])})
        )
    if roll < 0.35:
        header = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    else:
        tensors: dict[str, Any] = {}
        for i in range(rng.randint(1, 4)):
            begin, end = rng.randint(-10, 4096), rng.randint(-10, 4096)
            offsets = rng.choice([[begin, end], [0, 2**62], [end], "0-4", [0.5, 2], None, [0, 16]])
            tensors[f"t{i}"] = rng.choice(
                [{"dtype": rng.choice(["BF16", "F16", "F32", "F64", "I8", 7, None]), "data_offsets": offsets},
                 rng.choice(HOSTILE)]
            )  # fmt: skip
        header = json.dumps(tensors).encode()
    length = rng.choice([len(header)] * 6 + [len(header) + 1, 2**40, 2**64 - 1, 100_000_001, 0])
    shard.write_bytes(struct.pack("<Q", length) + header)
    os.truncate(shard, 8 + len(header) + rng.choice([0, 16, 4096, 1 << 30]))
    return str(directory)


def gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: str, value_type: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", value_type) + payload


def hostile_gguf(rng: random.Random, directory: Path) -> str:
    directory.mkdir(parents=True)
    base = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}
    roll = rng.random()
    if roll < 0.5:  # written with gguf.GGUFWriter, hostile values in llama.cpp's keys
        arch = rng.choice(["llama", "gemma3", "deepseek2", "qwen3next", "gpt-oss", "glm-dsa"])
        values = dict(base)
        for key in rng.sample(GGUF_KEYS, rng.randint(1, 3)):
            values[key] = rng.choice(GGUF_HOSTILE)
        name = rng.choice(["m.gguf", "m.gguf", "m-00001-of-00000.gguf", "m-00002-of-00001.gguf"])
        tensors = gguf_builders.block_tensors(2, 64, kv_width=64, ggml_type="F16")
        parts = gguf_builders.write_gguf(directory / "m.gguf", arch, values, tensors)
        if name != "m.gguf":
            parts[0].rename(directory / name)
            return str(directory / name)
        return str(parts[0])
    # laid out by hand: a valid llama core, then keys of confused type, nesting, counts
    kvs = [
        gguf_kv("general.architecture", 8, gguf_string("llama")),
        gguf_kv("llama.block_count", 4, struct.pack("<I", 4)),
        gguf_kv("llama.attention.head_count", 4, struct.pack("<I", 8)),
    ]
    keys = [
        "general.alignment",
        "split.count",
        "general.file_type",
        "llama.context_length",
        "llama.block_count",
    ]
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(keys)
        value_type, payload = rng.choice(
            [
                (8, gguf_string(rng.choice(["32", "", "x" * 100]))),
                (4, struct.pack("<I", rng.choice([0, 3, 2**32 - 1]))),
                (5, struct.pack("<i", rng.choice([-1, -(2**31)]))),
                (6, struct.pack("<f", rng.choice([math.nan, math.inf]))),
                (9, struct.pack("<IQ", 9, 1) * rng.randint(1, 6000) + struct.pack("<IQ", 4, 0)),
                (9, struct.pack("<IQ", rng.choice([4, 8, 9, 10]), rng.choice([2**20, 2**40, 2**64 - 1]))),
                (rng.choice([13, 255, 2**32 - 1]), b""),
            ]
        )
        kvs.append(gguf_kv(key, value_type, payload))
    counts = rng.choice([(0, len(kvs))] * 4 + [(2**62, len(kvs)), (0, 2**62), (2**20, len(kvs))])
    data = bytearray(b"GGUF" + struct.pack("<IQQ", 3, *counts) + b"".join(kvs) + bytes(64))
    if rng.random() < 0.2:
        data = data[: rng.randint(4, len(data))]
    path = directory / "h.gguf"
    path.write_bytes(bytes(data))
    if rng.random() < 0.1:
        os.truncate(path, 1 << 32)  # sparse zeros after the header
    return str(path)


# --- round two (issue 20): each generator returns (model, why vLLM / transformers refuses it or None) ---

Case = tuple[str, str | None]
# vLLM 0.33 config/cache.py MambaDType, and transformers 5.24 configuration_utils.ALLOWED_LAYER_TYPES
MAMBA_DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16")
NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
    "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}  # fmt: skip


def write_config(directory: Path, config: dict[str, Any]) -> str:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def state_dtype(rng: random.Random, directory: Path) -> Case:
    value = rng.choice(["int3", "float64", "fp8", ["float32"], {"a": 1}, 4, None, *MAMBA_DTYPE_NAMES])
    if rng.random() < 0.5:
        config = NEMOTRON_H | {"mamba_ssm_cache_dtype": value}
    else:
        config = CONFIGS["qwen3-next-80b-a3b"] | {"model_type": "qwen3_5_moe", "mamba_ssm_dtype": value}
    valid = value is None or value in MAMBA_DTYPE_NAMES
    return write_config(directory, config), None if valid else f"state dtype {value!r} is no MambaDType"


def head_geometry(rng: random.Random, directory: Path) -> Case:
    heads = rng.choice([1, 7, 8, 16, 32, 33, 64])
    kv = rng.choice([1, 2, 3, 7, 8, 16, 32, 33, 64])
    why = None
    if kv > heads:
        why = f"{kv} KV heads > {heads} heads"
    elif heads % kv:
        why = f"{heads} heads not divisible by {kv} KV heads"
    if rng.random() < 0.35:  # GGUF
        values = {"block_count": 4, "attention.head_count": heads, "attention.head_count_kv": kv,
                  "embedding_length": 64 * heads, "context_length": 4096}  # fmt: skip
        directory.mkdir(parents=True)
        (path,) = gguf_builders.write_gguf(directory / "m.gguf", "llama", values, [])
        return str(path), why
    name = rng.choice(["llama-3.1-70b", "qwen3-32b", "gemma-3-27b"])
    config = json.loads(json.dumps(CONFIGS[name]))
    target = config.get("text_config", config)
    target |= {"num_attention_heads": heads, "num_key_value_heads": kv}
    if name == "llama-3.1-70b" and rng.random() < 0.5:  # LlamaConfig has no head_dim: hidden_size // heads
        target.pop("head_dim", None)
        target["hidden_size"] = rng.choice([128 * heads, 128 * heads + 1])
        if target["hidden_size"] % heads and why is None:
            why = f"hidden_size {target['hidden_size']} not divisible by {heads} heads"
    else:
        target["head_dim"] = 128
    return write_config(directory, config), why


def st_shard(path: Path, tensors: dict[str, tuple[int, int]]) -> None:
    header = json.dumps(
        {
            n: {"dtype": "BF16", "shape": [(e - b) // 2], "data_offsets": [b, e]}
            for n, (b, e) in tensors.items()
        }
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(path, 8 + len(header) + max((e for _, e in tensors.values()), default=0))


def partial_checkpoint(rng: random.Random, directory: Path) -> Case:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"]))
    count = rng.choice([2, 4, 8])
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    present = [n for n in names if rng.random() < 0.6]
    for name in present:
        st_shard(directory / name, {f"{name}.w": (0, 1 << 20)})
    index = rng.choice(["none", "with_total", "without_total"])
    if index != "none":
        metadata = {"total_size": count << 20} if index == "with_total" else {}
        weight_map = {f"{n}.w": n for n in names}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": metadata, "weight_map": weight_map})
        )
    partial = 0 < len(present) < count
    return str(directory), f"{len(present)} of {count} shards" if partial else None


def kv_sharing(rng: random.Random, directory: Path) -> Case:
    shared = rng.choice([0, 1, 2, 4, 31, 32, 33, 64])
    if rng.random() < 0.5:
        values = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512,
                  "context_length": 4096, "attention.shared_kv_layers": shared}  # fmt: skip
        directory.mkdir(parents=True)
        (path,) = gguf_builders.write_gguf(directory / "m.gguf", "gemma3n", values, [])
        return str(path), f"{shared} shared of 4 layers" if shared >= 4 else None
    config = json.loads(json.dumps(CONFIGS["gemma-3-27b"]))
    config["text_config"]["num_kv_shared_layers"] = shared * 2
    why = f"{shared * 2} shared of 62 layers" if shared * 2 >= 62 else None
    return write_config(directory, config), why


def zero_state(rng: random.Random, directory: Path) -> Case:
    directory.mkdir(parents=True)
    (path,) = gguf_builders.qwen3_next_gguf(directory / "q.gguf")
    key = rng.choice(["ssm.time_step_rank", "ssm.group_count", "ssm.state_size", "ssm.inner_size"])
    value = rng.choice([0, 1, 16, 32])
    changed = {"ssm.time_step_rank": 32, "ssm.inner_size": 4096} | {key: value}
    why = None
    if value == 0:
        why = f"{key} 0"
    elif changed["ssm.inner_size"] % changed["ssm.time_step_rank"]:
        why = f"inner_size {changed['ssm.inner_size']} not split over {changed['ssm.time_step_rank']} heads"
    return rewrite_gguf(path, {f"qwen3next.{key}": value}), why


def rewrite_gguf(path: Path, changes: dict[str, Any]) -> str:
    from vllm_ctxmgr.model_files.gguf import read_gguf_header

    header = read_gguf_header(path)
    arch = header.metadata["general.architecture"]
    values = {
        k.removeprefix(f"{arch}."): v for k, v in (header.metadata | changes).items() if k.startswith(arch)
    }
    tensors = [(t.name, tuple(reversed(t.shape)), header.type_names[t.ggml_type]) for t in header.tensors]
    (new,) = gguf_builders.write_gguf(path.with_name("bad-" + path.name), arch, values, tensors)
    return str(new)


def memory(rng: random.Random, directory: Path) -> Case:
    """The inputs that took 1.2-2.9 GiB inside the byte caps (issue 20, item 6)."""
    directory.mkdir(parents=True)
    kinds = ["header", "index", "gguf_arrays", "config", "gguf_strings"]
    kind = kinds[int(directory.name) % len(kinds)]  # each of the five, in turn
    (directory / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"]))
    if kind == "header":  # 55 MB safetensors header of {},{},...
        body = b'{"x": [' + b"{}," * 18_333_333 + b"{}]}"
        path = directory / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(body)) + body)
        return str(directory), "not a safetensors header"
    if kind == "index":  # 58 MB index of {},{},... beside a valid total_size
        body = b'{"metadata": {"total_size": 1000}, "weight_map": {}, "x": [' + b"{}," * 19_333_333 + b"{}]}"
        (directory / "model.safetensors.index.json").write_bytes(body)
        return str(directory), None
    if kind == "config":  # 8 MB config.json (its cap) of {},{},...
        (directory / "config.json").write_bytes(
            json.dumps(CONFIGS["qwen3-32b"])[:-1].encode() + b', "x": [' + b"{}," * 2_700_000 + b"{}]}"
        )
        return str(directory), None
    # 440 kept UINT16[65536] arrays (58 MB), or 4096-string arrays of empty strings, in a valid llama
    kvs = [gguf_kv("general.architecture", 8, gguf_string("llama")),
           gguf_kv("llama.block_count", 4, struct.pack("<I", 4)),
           gguf_kv("llama.attention.head_count", 4, struct.pack("<I", 8)),
           gguf_kv("llama.embedding_length", 4, struct.pack("<I", 512))]  # fmt: skip
    if kind == "gguf_arrays":
        payload = struct.pack("<IQ", 2, 65536) + b"\xff" * (2 * 65536)  # 65535: no cached small ints
        kvs += [gguf_kv(f"x.a{i}", 9, payload) for i in range(440)]
    else:
        payload = struct.pack("<IQ", 8, 4096) + struct.pack("<Q", 0) * 4096
        kvs += [gguf_kv(f"x.s{i}", 9, payload) for i in range(1700)]
    path = directory / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + bytes(64))
    return str(path), None


def conservative(rng: random.Random, directory: Path) -> Case:
    """Item 7: garbage layer_types, overlapping tensors, deepseek2 kv_lora_rank 0, refs/main, split parts."""
    kind = rng.choice(["layer_types", "overlap", "kv_lora_rank", "refs", "split"])
    if kind == "layer_types":
        config = json.loads(json.dumps(CONFIGS["gemma-3-27b"]))
        entry = rng.choice(["banana", 7, None, "sliding_attention", "full_attention", ["full_attention"]])
        config["text_config"]["layer_types"] = ["sliding_attention"] * 61 + [entry]
        known = isinstance(entry, str) and entry in ("sliding_attention", "full_attention")
        return write_config(directory, config), None if known else f"layer type {entry!r}"
    if kind == "overlap":
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"]))
        second = rng.choice([0, 8, 16, 24])
        st_shard(directory / "model.safetensors", {"a": (0, 16), "b": (second, second + 16)})
        return str(
            directory
        ), f"byte ranges [0, 16) and [{second}, {second + 16}) overlap" if second < 16 else None
    if kind == "kv_lora_rank":
        directory.mkdir(parents=True)
        (path,) = gguf_builders.deepseek_v3_gguf(directory / "d.gguf")
        rank = rng.choice([0, 512])
        return rewrite_gguf(
            path, {"deepseek2.attention.kv_lora_rank": rank}
        ), "no latent" if not rank else None
    if kind == "refs":
        org = f"org{rng.randrange(10**9)}"
        repo = Path(os.environ["HF_HUB_CACHE"]) / f"models--{org}--m"
        snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(CONFIGS["qwen3-32b"]))
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(CONFIGS["llama-3.1-70b"]))
        (repo / "refs").mkdir()
        ref = rng.choice([snapshot.name, os.path.relpath(directory, repo / "snapshots"), "../../..", "/etc"])
        (repo / "refs" / "main").write_text(ref)
        return f"{org}/m", None if ref == snapshot.name else f"refs/main {ref!r} leaves the cache"
    directory.mkdir(parents=True)
    parts = gguf_builders.llama_70b_gguf(directory / "l.gguf", parts=2)
    what = rng.choice(["fifo", "dir", "file"])
    if what != "file":
        parts[1].unlink()
        os.mkfifo(parts[1]) if what == "fifo" else parts[1].mkdir()
    return str(parts[0]), None if what == "file" else f"part 2 is a {what}"


ROUND_TWO: dict[str, Callable[[random.Random, Path], Case]] = {
    "state dtype": state_dtype,
    "head geometry": head_geometry,
    "partial ckpt": partial_checkpoint,
    "kv sharing": kv_sharing,
    "zero state": zero_state,
    "memory": memory,
    "item 7": conservative,
}
# the dimensions vLLM's mamba_utils.py state shapes multiply by, per family (written here, not imported)
STATE_DIMS = {
    "mamba2": ("conv_kernel", "intermediate_size", "n_groups", "state_size", "num_heads", "head_dim"),
    "mamba1": ("conv_kernel", "intermediate_size", "state_size"),
    "gdn": ("conv_kernel", "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"),
    "linear": ("num_heads", "head_dim"),
}
MEMORY_PER_KIND = 10  # each memory input writes ~55 MB


# --- judging one input ---


def garbage(facts: ModelFacts) -> str | None:
    """Sanity checks written here, independent of core.facts.validate: what a plan needs to be real."""
    if not 1 <= facts.num_hidden_layers <= 10_000 or not 1 <= facts.num_attention_heads <= 65_536:
        return f"layers {facts.num_hidden_layers}, heads {facts.num_attention_heads}"
    for layer in facts.layers:
        if layer.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED, LayerKind.MLA) and (
            layer.num_kv_heads < 1 or layer.head_size < 1 or layer.head_size_v < 0
        ):
            return f"layer {layer}"
        if layer.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED) and (
            facts.num_attention_heads % layer.num_kv_heads
        ):
            return f"{facts.num_attention_heads} heads over {layer.num_kv_heads} KV heads"
        if layer.window is not None and layer.window < 1:
            return f"window {layer.window}"
        if layer.state is not None:
            state = layer.state
            dims = STATE_DIMS.get(state.family)
            if dims is None or any(getattr(state, d) < 1 for d in dims):
                return f"state {state}"
            if any(
                d is not None and d not in MAMBA_DTYPE_NAMES[1:] for d in (state.conv_dtype, state.ssm_dtype)
            ):
                return f"state dtypes {state.conv_dtype!r}, {state.ssm_dtype!r}"
    if any(value < 1 for _, value in facts.position_limits):
        return f"position limits {facts.position_limits}"
    if facts.weight_bytes is not None and facts.weight_bytes < 0:
        return f"weight_bytes {facts.weight_bytes}"
    length, _ = derived_max_model_len(facts)
    if not isinstance(length, int) or length < 1:
        return f"derived max_model_len {length}"
    return None


def peak_rss_mib() -> float:
    """VmHWM of this process (the child: its parent's pages at fork count too)."""
    text = Path("/proc/self/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", text, re.MULTILINE)
    return int(match[1]) / 1024 if match else 0.0


def plan_outcome(model: str) -> tuple[str, str]:
    """`ctxmgr plan` on an accepted model: exit 2 with one line is a clean refusal; a crash is not."""
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main as cli

    result = CliRunner().invoke(cli, ["plan", "--model", model, "4096", "--gpu-memory", "80G"])
    output = result.output.strip()
    if "unexpected error" in output or (result.exception and not isinstance(result.exception, SystemExit)):
        return "unhandled", f"plan: {output.splitlines()[-1] if output else result.exception!r}"[:200]
    if result.exit_code == 2:
        return (
            ("rejected", output) if "\n" not in output else ("unhandled", f"plan: multi-line: {output[:120]}")
        )
    return "accepted", ""


def child(model: str, why: str | None, conn: Any) -> None:
    try:
        facts = load_model_facts(model)
        problem = garbage(facts)
        outcome = ("garbage", problem) if problem else plan_outcome(model)
        if outcome[0] == "accepted" and why is not None:
            outcome = ("garbage", f"accepted although {why}")
    except UsageError as error:
        outcome = ("rejected", error.message) if "\n" not in error.message else ("unhandled", "multi-line")
    except BaseException as error:  # what the campaign is looking for
        outcome = ("unhandled", f"{type(error).__name__}: {str(error)[:120]}")
    conn.send((*outcome, peak_rss_mib()))


def judge(model: str, why: str | None, timeout: float) -> tuple[str, str, float]:
    ctx = multiprocessing.get_context("fork")
    parent, conn = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child, args=(model, why, conn))
    process.start()
    conn.close()
    if parent.poll(timeout):
        try:
            outcome = parent.recv()
        except EOFError:
            outcome = ("unhandled", "child died", 0.0)
        process.join(5)
        return outcome
    process.kill()
    process.join()
    return ("hang", f"over {timeout:g} s", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-kind", type=int, default=300)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--show", type=int, default=5, help="examples to print per bad outcome")
    parser.add_argument("--only", help="run only the kinds whose name contains this")
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "campaign_model_files")
    args = parser.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    os.environ["HF_HUB_CACHE"] = str(work / "hub")  # the refs/main inputs resolve repo ids here
    kinds: dict[str, Callable[[random.Random, Path], Case]] = {
        "config.json": lambda rng, d: (hostile_config(rng, d), None),
        "safetensors": lambda rng, d: (hostile_safetensors(rng, d), None),
        "gguf": lambda rng, d: (hostile_gguf(rng, d), None),
        **ROUND_TWO,
    }
    outcomes = ("rejected", "accepted", "garbage", "unhandled", "hang")
    widths = (9, 9, 8, 10, 6)
    heading = " ".join(f"{o:>{w}}" for o, w in zip(outcomes, widths, strict=True))
    print(f"{'kind':<14} {'tried':>6} {heading} {'>1GiB':>6} {'over-ref':>8} {'peak MiB':>9} {'s':>6}")
    bad: list[str] = []
    totals: Counter[str] = Counter()
    for kind, make in kinds.items():
        if args.only and args.only not in kind:
            continue
        rng = random.Random(f"{args.seed}-{kind}")
        counts: Counter[str] = Counter()
        peak = 0.0
        start = time.perf_counter()
        tried = min(args.per_kind, MEMORY_PER_KIND) if kind == "memory" else args.per_kind
        for i in range(tried):
            model, why = make(rng, work / kind.replace(" ", "_") / str(i))
            outcome, detail, rss = judge(model, why, args.timeout)
            counts[outcome] += 1
            peak = max(peak, rss)
            if rss > 1024:
                counts[">1GiB"] += 1
                bad.append(f"{kind} #{i} peak {rss:.0f} MiB ({model})")
            if kind in ROUND_TWO and why is None and outcome == "rejected":
                counts["over-refused"] += 1
                if args.show and sum(b.startswith(f"{kind} #") and "over-refused" in b for b in bad) < 2:
                    bad.append(f"{kind} #{i} over-refused (information): {detail[:160]}")
            if (
                outcome in ("garbage", "unhandled", "hang")
                and sum(b.startswith(kind) for b in bad) < args.show
            ):
                bad.append(f"{kind} #{i} {outcome}: {detail} ({model})")
            if kind == "memory":
                shutil.rmtree(work / "memory" / str(i), ignore_errors=True)
        totals.update(counts)
        totals["tried"] += tried
        row = " ".join(f"{counts[o]:>{w}}" for o, w in zip(outcomes, widths, strict=True))
        print(
            f"{kind:<14} {tried:>6} {row} {counts['>1GiB']:>6} {counts['over-refused']:>8} {peak:>9.0f} "
            f"{time.perf_counter() - start:>6.1f}",
            flush=True,
        )
    print(
        f"total: {totals['tried']} inputs, {totals['unhandled']} unhandled, {totals['hang']} hangs, "
        f"{totals['>1GiB']} over 1 GiB, {totals['garbage']} garbage accepted"
    )
    for line in bad:
        print(line)
    if not any(o in line for line in bad for o in ("garbage", "unhandled", "hang", "peak")):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
