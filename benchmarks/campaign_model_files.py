"""Hostile-input campaign against load_model_facts (issue 9, item 7): config.json, safetensors, GGUF.

Generates a few hundred hostile inputs per kind (seeded, reproducible), loads each in a forked child
with a per-input timeout, and prints per kind: inputs tried, rejected cleanly (ModelFactsError /
UsageError), accepted (facts that pass sanity checks written here, independent of the validator),
garbage accepted (facts that fail them), unhandled exceptions, and hangs. Goal: 0 unhandled, 0 hangs,
0 garbage accepted. Every file is small or sparse; nothing multi-GB is written.

    .venv/bin/python benchmarks/campaign_model_files.py [--per-kind 300] [--seed 9] [--timeout 10]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
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
        if layer.window is not None and layer.window < 1:
            return f"window {layer.window}"
    if any(value < 1 for _, value in facts.position_limits):
        return f"position limits {facts.position_limits}"
    if facts.weight_bytes is not None and facts.weight_bytes < 0:
        return f"weight_bytes {facts.weight_bytes}"
    length, _ = derived_max_model_len(facts)
    if not isinstance(length, int) or length < 1:
        return f"derived max_model_len {length}"
    return None


def child(model: str, conn: Any) -> None:
    try:
        facts = load_model_facts(model)
        problem = garbage(facts)
        conn.send(("garbage", problem) if problem else ("accepted", ""))
    except UsageError as error:
        conn.send(("rejected", error.message) if "\n" not in error.message else ("unhandled", "multi-line"))
    except BaseException as error:  # what the campaign is looking for
        conn.send(("unhandled", f"{type(error).__name__}: {str(error)[:120]}"))


def judge(model: str, timeout: float) -> tuple[str, str]:
    ctx = multiprocessing.get_context("fork")
    parent, conn = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child, args=(model, conn))
    process.start()
    conn.close()
    if parent.poll(timeout):
        try:
            outcome = parent.recv()
        except EOFError:
            outcome = ("unhandled", "child died")
        process.join(5)
        return outcome
    process.kill()
    process.join()
    return ("hang", f"over {timeout:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-kind", type=int, default=300)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--show", type=int, default=5, help="examples to print per bad outcome")
    args = parser.parse_args()
    work = REPO / ".cache" / "campaign_model_files"
    shutil.rmtree(work, ignore_errors=True)
    kinds: dict[str, Callable[[random.Random, Path], str]] = {
        "config.json": hostile_config,
        "safetensors": hostile_safetensors,
        "gguf": hostile_gguf,
    }
    outcomes = ("rejected", "accepted", "garbage", "unhandled", "hang")
    widths = (9, 9, 8, 10, 6)
    heading = " ".join(f"{o:>{w}}" for o, w in zip(outcomes, widths, strict=True))
    print(f"{'kind':<12} {'tried':>6} {heading} {'s':>6}")
    bad: list[str] = []
    for kind, make in kinds.items():
        rng = random.Random(f"{args.seed}-{kind}")
        counts: Counter[str] = Counter()
        start = time.perf_counter()
        for i in range(args.per_kind):
            model = make(rng, work / kind / str(i))
            outcome, detail = judge(model, args.timeout)
            counts[outcome] += 1
            if (
                outcome in ("garbage", "unhandled", "hang")
                and sum(b.startswith(kind) for b in bad) < args.show
            ):
                bad.append(f"{kind} #{i} {outcome}: {detail} ({model})")
        row = " ".join(f"{counts[o]:>{w}}" for o, w in zip(outcomes, widths, strict=True))
        print(f"{kind:<12} {args.per_kind:>6} {row} {time.perf_counter() - start:>6.1f}", flush=True)
    for line in bad:
        print(line)
    if not bad:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
