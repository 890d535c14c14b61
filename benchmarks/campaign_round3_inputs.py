"""Hostile-input campaign of issue 29 (round three), items 8-11 and 17-20: what a unit, a node, a GPU file
or a model file may say. Each trial runs in a forked child with a timeout; each section prints `tried`
and `failed`. A trial fails on an unhandled exception, a hang, an error of more than one line, or a
verdict its oracle (written here, independently of the code under test) disagrees with:

    sizes     a size flag in a unit's ExecStart: refused (exit 2, one line naming the flag) iff the
              value is outside the bounds of ctxmgr's own option for it; in bounds, never "unexpected"
    editor    random ExecStart arguments, edited to --max-model-len 16384: Python's argparse, built with
              vLLM's option kinds, is the oracle: where it refuses the words the editor refuses them;
              where it accepts, the edited words parse to the same options with the new length
    values    deep JSON in --hf-overrides / --speculative-config / dotted keys, JSON's inf, deep TOML,
              wrongly typed `node show` fields: a one-line refusal or a plan, never "unexpected error"
    gpus      GPU records with totals of every kind: accepted iff an int in (0, 16 TiB]
    dtype     config dtypes x GPUs: the model dtype and KV bytes per token vLLM's _resolve_auto_dtype
              gives (a non-float dtype runs in the platform's preferred one)
    gguf      overlapping tensor ranges (refused iff they overlap), nested arrays (refused or read in
              under the timeout), per-layer arrays of every length (refused iff not one per layer,
              naming the key, never a Python error)

    .venv/bin/python benchmarks/campaign_round3_inputs.py [SECTION ...] [--seed 29] [--timeout 15]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


WORK = REPO / ".cache" / "campaign-round3" / str(os.getpid())
MODEL = REPO / "examples" / "models" / "qwen3-32b"
OFFLINE = ["--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3"]
TIB = 1 << 40


# ---- running one trial ------------------------------------------------------------------------


from trials import Tally, isolated, outcome_problem, run_sections  # noqa: E402  (benchmarks/trials.py)


def cli(*args: str) -> tuple[int, str]:
    """ctxmgr in this process (the trial's fork): exit code and output."""
    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout + result.stderr


def cli_problem(outcome: tuple[str, Any], *, refuse: bool | None, match: str = "") -> str | None:
    """A CLI trial's problem: exit 2 is a refusal of one line; exit 1 ("unexpected") is never right."""
    problem = outcome_problem(outcome)
    if problem:
        return problem
    code, out = outcome[1]
    lines = [line for line in out.strip().splitlines() if not line.startswith(("note:", "ctxmgr: reading "))]
    if "unexpected error" in out or code == 1:
        return f"exit {code}: {out.strip()[-200:]!r}"
    if code == 2 and len(lines) != 1:
        return f"a refusal of {len(lines)} lines: {out.strip()[:160]!r}"
    if refuse is True and (code != 2 or match not in out):
        return f"accepted (exit {code}) where it must be refused ({match}): {out.strip()[-160:]!r}"
    if refuse is False and code == 2:
        return f"refused where it must be read: {out.strip()[-160:]!r}"
    return None


def unit_file(directory: Path, flags: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vllm-x.service"
    path.write_text(f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {MODEL} --max-model-len 8192 {flags}\n")
    return path


# ---- sizes: a unit's size flags have the CLI's bounds (item 8) --------------------------------------

PARALLEL = [
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--decode-context-parallel-size",
    "-dcp",
]
COUNTS = ["--max-num-seqs", "--max-num-batched-tokens", "--num-gpu-blocks-override"]


def _size_expected(flag: str, word: str) -> bool:
    """Whether ctxmgr's own option for FLAG refuses WORD (the campaign's own reading of the bounds)."""
    suffix = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}

    def number(text: str, human: bool) -> int | None:
        try:
            return int(text)
        except ValueError:
            if human and text[-1:] in suffix and text[:-1].isdigit():
                return int(text[:-1]) * suffix[text[-1]]
            return None

    if flag in PARALLEL:
        n = number(word, False)
        return n is None or not 1 <= n <= 1024
    if flag in COUNTS:
        n = number(word, True)
        return n is None or not 1 <= n <= 1 << 24
    if flag == "--block-size":
        n = number(word, False)
        return n is None or not (n in (1, 8) or (0 < n <= 4096 and n % 16 == 0))
    if flag == "--max-model-len":
        n = number(word, True)
        return n is None or (n != -1 and not 0 < n <= 1 << 32)
    if flag == "--gpu-memory-utilization":
        try:
            f = float(word)
        except ValueError:
            return True
        return not (math.isfinite(f) and 0 < f <= 1)
    raise AssertionError(flag)


def campaign_sizes(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally("sizes", args.show)
    words = [
        "0",
        "1",
        "2",
        "7",
        "8",
        "16",
        "-16",
        "1024",
        "1025",
        "4096",
        "4112",
        "100000000",
        "1e12",
        "99999999999",
        "16777216",
        "16777217",
        "64k",
        "17M",
        "1G",
        "nan",
        "inf",
        "-inf",
        "0.5",
        "1.0",
        "1.01",
        "-0.5",
        "abc",
        "1_000",
        " 5",
        "1" * 5000,
    ]
    flags = [*PARALLEL, *COUNTS, "--block-size", "--max-model-len", "--gpu-memory-utilization"]
    trials = [(flag, word) for flag in flags for word in words]
    rng.shuffle(trials)
    for i, (flag, word) in enumerate(trials[: args.sizes]):
        path = unit_file(WORK / "sizes" / str(i), f"{flag} {word!r}" if " " in word else f"{flag} {word}")
        refuse = _size_expected(flag, word.strip())
        started = time.perf_counter()
        outcome = isolated(lambda p=path: cli("plan", "8192", "--unit", str(p), *OFFLINE), args.timeout)
        problem = cli_problem(outcome, refuse=True if refuse else None, match="")
        if not problem and time.perf_counter() - started > 10:
            problem = f"took {time.perf_counter() - started:.1f} s"
        if not problem and not refuse and outcome[0] == "ok" and outcome[1][0] == 2:
            out = outcome[1][1]
            if "must be" in out and "as ctxmgr's own" in out:
                problem = f"a value in bounds refused by the bounds: {out.strip()[:160]!r}"
        tally.add(f"{flag} {word[:20]}", problem)
    return tally.report()


# ---- editor: the words as argparse reads them (item 9) --------------------------------------------

VALUE_FLAGS = ["--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "-tp", "--port"]
SWITCHES = ["--enforce-eager", "--trust-remote-code"]


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _Refused(message)


def _oracle() -> _Parser:
    """`vllm serve`'s shape: one optional model positional, one-word options, switches, a list option."""
    parser = _Parser(prog="vllm serve", allow_abbrev=False, add_help=False)
    parser.add_argument("model_tag", nargs="?")
    for flag in VALUE_FLAGS:
        parser.add_argument(flag)
    for flag in SWITCHES:
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--served-model-name", nargs="+")
    return parser


def _argparse(words: list[str]) -> dict[str, Any] | None:
    try:
        return vars(_oracle().parse_args(words))
    except _Refused:
        return None


def _random_words(rng: random.Random) -> list[str]:
    words: list[str] = ["/m"] if rng.random() < 0.8 else []
    for _ in range(rng.randint(0, 6)):
        pick = rng.random()
        if pick < 0.45:
            flag = rng.choice(VALUE_FLAGS)
            words.append(flag)
            if rng.random() < 0.8:
                words.append(rng.choice(["2048", "-1", "0.9", "4", "x"]))
        elif pick < 0.7:
            words.append(rng.choice(SWITCHES))
        elif pick < 0.8:
            words += ["--served-model-name", *(["a", "b"][: rng.randint(0, 2)])]
        elif pick < 0.9:
            words.append("--")
        else:
            words.append(rng.choice(["/m", "--max-model-len", "1024", "--enforce-eager"]))
    while words and words[-1] == "--":
        words.pop()  # a trailing `--` is read by argparse differently from Python 3.12 to 3.13
    return words


def _plan_refusals(words: list[str]) -> list[str]:
    """What the plan refuses in these words (ServeArgs.refusals, read before any edit)."""
    from vllm_ctxmgr.core.serve_args import split_flags

    refusals: list[str] = []
    split_flags(words, refusals)
    return refusals


def _kept(old: list[str], new: list[str]) -> bool:
    """Every word but --max-model-len's own (the flag and its value, before any `--`) is kept, in order."""

    def others(words: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(words):
            if words[i] == "--":
                return out + words[i:]
            if words[i] == "--max-model-len":
                i += 2
                continue
            out.append(words[i])
            i += 1
        return out

    return others(old) == others(new)


def _edit(words: list[str]) -> list[str]:
    from vllm_ctxmgr.systemd.quoting import split_words
    from vllm_ctxmgr.systemd.unit_edit import edit_unit
    from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

    text = f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {' '.join(words)}\n"
    unit = ServiceUnit("vllm-x.service", (UnitFile.parse("/etc/systemd/system/vllm-x.service", text),))
    new = edit_unit(unit, {"--max-model-len": "16384"}).new_text
    line = next(line for line in new.splitlines() if line.startswith("ExecStart="))
    return [w.value for w in split_words(line.removeprefix("ExecStart="))][2:]


def campaign_editor(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally("editor", args.show)
    seen: set[tuple[str, ...]] = set()
    while tally.tried < args.editor:
        words = _random_words(rng)
        if tuple(words) in seen:
            continue
        seen.add(tuple(words))
        before = _argparse(words)
        outcome = isolated(lambda w=words: _edit(w), args.timeout)
        problem = outcome_problem(outcome)
        plan_refuses = bool(_plan_refusals(words))
        if not problem and before is None and outcome[0] == "ok" and not plan_refuses:
            problem = f"argparse refuses these words; the editor wrote {outcome[1]} and the plan reads them"
        elif not problem and before is None and outcome[0] == "ok" and not _kept(words, outcome[1]):
            problem = f"a word dropped: {outcome[1]}"
        elif not problem and before is not None and (outcome[0] == "refused" or plan_refuses):
            problem = f"argparse reads them, ctxmgr refused: {outcome[1] if outcome[0] == 'refused' else ''}"
        elif not problem and before is not None:
            after = _argparse(outcome[1])
            expected = {**before, "max_model_len": "16384"}
            if after != expected:
                problem = f"edited to {outcome[1]}: argparse reads {after}, expected {expected}"
        tally.add(" ".join(words) or "(nothing)", problem)
    return tally.report()


# ---- values: deep JSON, inf, deep TOML, node fields (item 10) -------------------------------------


def _deep(rng: random.Random, depth: int) -> str:
    opener, closer = rng.choice([('{"a":', "}"), ("[", "]"), ('{"text_config":', "}")])
    return opener * depth + "1" + closer * depth


def campaign_values(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally("values", args.show)
    flags: list[tuple[str, bool | None]] = []
    for depth in (1, 5, 60, 64, 65, 100, 999, 1000, 3000, 20000):
        deep = _deep(rng, depth)
        for flag in (
            "--hf-overrides",
            "--speculative-config",
            "--kv-transfer-config",
            "--compilation-config",
        ):
            flags.append((f"{flag} '{deep}'", True if depth > 64 else None))
        flags.append(("--hf-overrides." + ".".join(["a"] * depth) + " 1", True if depth >= 64 else None))
        flags.append((f"--hf-overrides.rope_scaling '{deep}'", True if depth > 63 else None))
    for number in ("1e400", "-1e400", "1e30", "NaN", "Infinity", "-1", "2.5", '"3"', "null", "[]", "{}"):
        flags.append(
            (f"""--speculative-config '{{"method": "ngram", "num_speculative_tokens": {number}}}'""", None)
        )
        flags.append((f"""--hf-overrides '{{"max_position_embeddings": {number}}}'""", None))
    for block in ("-16", "-1", "0", "7", "99999", "16", "1e3"):
        flags.append((f"--block-size {block}", block != "16" or None))
    for i, (flag, refuse) in enumerate(flags):
        path = unit_file(WORK / "values" / str(i), flag)
        outcome = isolated(lambda p=path: cli("plan", "8192", "--unit", str(p), *OFFLINE), args.timeout)
        tally.add(flag[:60], cli_problem(outcome, refuse=refuse))
    # deployment files nested deep
    tomls = [f"x = {'[' * d}{']' * d}\n" for d in (10, 65, 500, 5000, 50000)]
    tomls += [f"x.{'.'.join(['a'] * d)} = 1\n" for d in (10, 65, 3000)]
    tomls += [f"x = {'{a=' * d}1{'}' * d}\n" for d in (10, 65, 3000)]
    for i, text in enumerate(tomls):
        path = WORK / "values" / f"d{i}.toml"
        path.write_text(text)
        outcome = isolated(
            lambda p=path, s=str(WORK / "values" / "state"): cli(
                "--state-dir", s, "deployment", "plan", "8192", "--file", str(p)
            ),
            args.timeout,
        )
        tally.add(f"toml {text[:30]!r}", cli_problem(outcome, refuse=True))
    # node show fields: every field, every type
    from vllm_ctxmgr.deployment.remote import NodeAddress

    expected_types: dict[str, Callable[[Any], bool]] = {
        "argv": lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v),
        "environment": lambda v: isinstance(v, dict) and all(isinstance(w, str) for w in v.values()),
        **{
            k: (lambda v: isinstance(v, dict))
            for k in ("in_progress", "last_change", "logged", "observation", "gpus")
        },
        "unit_digest": lambda v: isinstance(v, str),
        "ray_worker": lambda v: isinstance(v, bool),
    }
    values: list[Any] = [
        [1, 2],
        ["a"],
        [],
        "x",
        "",
        0,
        1,
        1.5,
        True,
        False,
        {},
        {"a": 1},
        {"a": "b"},
        [None],
        {"a": [1]},
    ]
    for field, valid in expected_types.items():
        for value in values:

            def show(f: str = field, v: Any = value) -> bool:
                from vllm_ctxmgr.deployment.coordinator import checked_show

                checked_show({f: v}, NodeAddress.parse("node1:vllm-x"))
                return True

            outcome = isolated(show, args.timeout)
            problem = outcome_problem(outcome)
            if not problem and valid(value) != (outcome[0] == "ok"):
                problem = f"{'refused' if outcome[0] == 'refused' else 'accepted'}: {outcome[1]}"
            tally.add(f"node show {field}={value!r}", problem)
    return tally.report()


# ---- gpus: totals in range (item 11) --------------------------------------------------------------


def campaign_gpus(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally("gpus", args.show)
    totals: list[str] = [
        "85520809984",
        "1",
        "0",
        "-1",
        "-85899345920",
        str(16 * TIB),
        str(16 * TIB + 1),
        "1e24",
        "1e400",
        "-1e400",
        "80.5",
        '"80"',
        "null",
        "true",
        "[]",
        str(10**30),
        str(2**63),
        "NaN",
        "Infinity",
    ]
    totals += [str(rng.randint(-(2**50), 2**50)) for _ in range(20)]
    for total in totals:
        text = (
            '{"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": '
            + total
            + ', "free_bytes": 1000, "used_bytes": 0}]}'
        )
        try:
            value = json.loads(text)["gpus"][0]["total_bytes"]
        except ValueError:
            continue
        good = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 16 * TIB

        def read(t: str = text) -> int:
            from vllm_ctxmgr.nvml import gpus_from_json

            return gpus_from_json(json.loads(t), "a node's NVML").gpus[0].total_bytes

        outcome = isolated(read, args.timeout)
        problem = outcome_problem(outcome)
        if not problem and good != (outcome[0] == "ok"):
            problem = f"{outcome[0]}: {outcome[1]}"
        tally.add(f"total_bytes {total[:30]}", problem)
        path = WORK / "gpus" / f"{len(totals)}-{tally.tried}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        unit = unit_file(WORK / "gpus" / str(tally.tried), "")
        outcome = isolated(
            lambda u=unit, p=path: cli("plan", "8192", "--unit", str(u), "--gpus-from", str(p)), args.timeout
        )
        tally.add(
            f"plan --gpus-from total_bytes {total[:30]}", cli_problem(outcome, refuse=None if good else True)
        )
    return tally.report()


# ---- dtype: vLLM's _resolve_auto_dtype (item 17) ---------------------------------------------------


def _vllm_auto_dtype(config: str, capability: tuple[int, int]) -> str:
    """vllm/config/model.py _resolve_auto_dtype on CUDA (platforms/cuda.py supported_dtypes)."""
    supported = ["bfloat16", "float16", "float32"] if capability >= (8, 0) else ["float16", "float32"]
    config = {"float": "float32", "half": "float16"}.get(config, config)
    if config == "float32":
        return supported[0]
    return config if config in supported else supported[0]


def campaign_dtype(args: argparse.Namespace) -> int:
    tally = Tally("dtype", args.show)
    gpus = {
        "NVIDIA H100 80GB HBM3": (9, 0),
        "NVIDIA A100-SXM4-80GB": (8, 0),
        "Tesla V100-SXM2-32GB": (7, 0),
        "Tesla T4": (7, 5),
    }
    dtypes = [
        "bfloat16",
        "float16",
        "float32",
        "float",
        "half",
        "int8",
        "uint8",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "torch.int8",
        "torch.bfloat16",
    ]
    base = json.loads((MODEL / "config.json").read_text())
    per_element = 64 * 8 * 128 * 2  # Qwen3-32B: layers x KV heads x head size x (K and V)
    for dtype in dtypes:
        model = WORK / "dtype" / dtype
        model.mkdir(parents=True, exist_ok=True)
        shutil.copy(MODEL / "model.safetensors.index.json", model)
        (model / "config.json").write_text(json.dumps({**base, "torch_dtype": dtype}))
        for name, capability in gpus.items():
            expected = _vllm_auto_dtype(dtype.removeprefix("torch."), capability)
            offline = ["--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", name, "--json"]
            outcome = isolated(
                lambda m=model, o=offline: cli("plan", "4096", "--model", str(m), *o), args.timeout
            )
            problem = outcome_problem(outcome)
            if not problem and outcome[0] == "ok":
                code, out = outcome[1]
                try:
                    plan = json.loads(out[out.index("{") :])
                    got = (plan["layout"]["model_dtype"], plan["kv_bytes_per_token_per_gpu"])
                    size = 4 if expected == "float32" else 2
                    if got != (expected, per_element * size):
                        problem = f"planned {got}, vLLM: {(expected, per_element * size)}"
                except (ValueError, KeyError) as exc:
                    problem = f"exit {code}, no plan ({exc}): {out.strip()[-160:]!r}"
            tally.add(f"{dtype} on {name}", problem)
    return tally.report()


# ---- gguf: overlaps, nested arrays, per-layer arrays (items 18-20) ---------------------------------


def _raw_gguf(path: Path, kv: bytes, kv_count: int = 1) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, kv_count) + kv)
    return path


def _set_offset(path: Path, name: str, offset: int) -> None:
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)
    path.write_bytes(bytes(data))


def _facts(path: Path) -> Any:
    from vllm_ctxmgr.model_files.load import load_model_facts

    facts = load_model_facts(str(path))
    return facts.weight_bytes, [layer.num_kv_heads for layer in facts.layers]


def campaign_gguf(args: argparse.Namespace) -> int:
    from tests import gguf_builders

    rng = random.Random(args.seed)
    tally = Tally("gguf", args.show)
    (WORK / "gguf").mkdir(parents=True, exist_ok=True)
    base = {"block_count": 2, "attention.head_count": 8, "embedding_length": 256, "context_length": 4096}
    tensors = gguf_builders.block_tensors(2, 256, kv_width=256, ggml_type="F16")
    sizes = {name: gguf_builders.tensor_nbytes(shape, kind) for name, shape, kind in tensors}
    pad = lambda n: -(-n // 32) * 32  # noqa: E731
    for i in range(args.gguf):
        (path,) = gguf_builders.write_gguf(WORK / "gguf" / f"o{i}.gguf", "llama", base, tensors)
        data_start = path.stat().st_size - sum(pad(n) for n in sizes.values())
        offsets, at = {}, 0
        for name, _, _ in tensors:
            offsets[name] = at
            at += pad(sizes[name])
        for name in rng.sample(list(offsets), rng.randint(1, 3)):
            offsets[name] = rng.choice([0, 32, rng.randrange(0, at, 32), rng.randrange(0, at), at, at + 64])
            _set_offset(path, name, offsets[name])
        ranges = sorted((o, o + sizes[n]) for n, o in offsets.items())
        overlap = any(b < e for (_, e), (b, _) in itertools.pairwise(ranges))
        beyond = data_start + max(e for _, e in ranges) > path.stat().st_size
        outcome = isolated(lambda p=path: _facts(p), args.timeout)
        problem = outcome_problem(outcome)
        if not problem:
            if (overlap or beyond) and outcome[0] == "ok":
                kind = "overlapping" if overlap else "truncated"
                problem = f"accepted {outcome[1][0]} weight bytes with {kind} tensors"
            elif overlap and not beyond and "overlap" not in outcome[1]:
                problem = f"refused, but not for the overlap: {outcome[1]}"
            elif not (overlap or beyond) and outcome[0] != "ok":
                problem = f"a sound layout refused: {outcome[1]}"
            elif outcome[0] == "ok" and outcome[1][0] != sum(sizes.values()):
                problem = f"weight bytes {outcome[1][0]}, tensors hold {sum(sizes.values())}"
        tally.add(f"offsets {sorted(offsets.values())}", problem)
    # nested arrays: every shape inside the byte caps is refused or read in bounded time
    for i, (outer, inner, leaf) in enumerate(
        [
            (1000, 4096, 0),
            (4096, 1000, 0),
            (16, 4096, 0),
            (2, 3, 5),
            (4096, 16, 4),
            (64, 64, 1),
            (1, 4096, 4096),
            (3000, 4000, 0),
        ]
    ):
        key = b"x.nested"
        inner_bytes = struct.pack("<IQ", 9, inner) + (struct.pack("<IQ", 0, leaf) + bytes(leaf)) * inner
        value = struct.pack("<I", 9) + struct.pack("<IQ", 9, outer) + inner_bytes * outer
        path = _raw_gguf(WORK / "gguf" / f"n{i}.gguf", struct.pack("<Q", len(key)) + key + value)
        started = time.perf_counter()
        outcome = isolated(lambda p=path: _facts(p), args.timeout)
        problem = outcome_problem(outcome)
        if not problem and time.perf_counter() - started > 5:
            problem = f"took {time.perf_counter() - started:.1f} s for {path.stat().st_size / 1e6:.0f} MB"
        tally.add(f"nested {outer} x {inner} x {leaf} ({path.stat().st_size / 1e6:.1f} MB)", problem)
        path.unlink()
    # per-layer arrays of every length
    for i in range(args.gguf):
        blocks = rng.randint(1, 6)
        nextn = rng.choice([0, 0, 1]) if blocks > 1 else 0
        key = rng.choice(["attention.head_count_kv", "attention.head_count"])
        # gguf's writer leaves an empty array out: lengths from 1
        length = max(1, rng.choice([1, blocks - 1, blocks, blocks - nextn, blocks + 1, 2 * blocks]))
        values = {
            "block_count": blocks,
            "attention.head_count": 8,
            "embedding_length": 256,
            "context_length": 4096,
            key: [rng.choice([8, 4, 2]) for _ in range(length)],
        }
        if nextn:
            values["nextn_predict_layers"] = nextn
        (path,) = gguf_builders.write_gguf(WORK / "gguf" / f"l{i}.gguf", "llama", values, [])
        outcome = isolated(lambda p=path: _facts(p), args.timeout)
        problem = outcome_problem(outcome)
        wrong = length not in (blocks, blocks - nextn)
        if not problem and outcome[0] == "refused" and ("Error" in outcome[1] or "unusable" in outcome[1]):
            problem = f"a Python error, not the key: {outcome[1]}"
        elif not problem and wrong and outcome[0] == "ok":
            problem = f"{length} values for {blocks} blocks accepted"
        elif not problem and wrong and f"llama.{key} has {length} per-layer values" not in outcome[1]:
            problem = f"refused without naming the key and its length: {outcome[1]}"
        tally.add(f"{key} x {length} for {blocks} blocks (nextn {nextn})", problem)
    return tally.report()


SECTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "sizes": campaign_sizes,
    "editor": campaign_editor,
    "values": campaign_values,
    "gpus": campaign_gpus,
    "dtype": campaign_dtype,
    "gguf": campaign_gguf,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=[], help=", ".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--timeout", type=float, default=15.0)
    parser.add_argument("--sizes", type=int, default=400, help="size-flag trials (390 in all)")
    parser.add_argument("--editor", type=int, default=400, help="ExecStart word sequences")
    parser.add_argument("--gguf", type=int, default=60, help="GGUF files per kind")
    parser.add_argument("--show", type=int, default=5, help="failures printed per section")
    run_sections(parser, SECTIONS, WORK)


if __name__ == "__main__":
    main()
