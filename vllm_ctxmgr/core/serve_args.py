"""The vLLM engine arguments that decide KV-cache memory, in vLLM's own names.

`parse_serve_argv` reads them out of a `vllm serve` command line (as found in a unit's ExecStart);
`ServeArgs` is what the planner takes. Unknown flags are kept untouched by the unit editor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from vllm_ctxmgr.core import nesting
from vllm_ctxmgr.core.bounds import (
    BLOCK_SIZES,
    MAX_BYTES,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_NODES,
    MAX_PARALLEL,
    MAX_WORLD_SIZE,
    block_size_ok,
)
from vllm_ctxmgr.core.json_types import JSONObject, JSONValue
from vllm_ctxmgr.core.nesting import MAX_DEPTH, TooDeep
from vllm_ctxmgr.core.vllm_flags import canonical_name
from vllm_ctxmgr.core.vllm_flags import flag as vllm_flag
from vllm_ctxmgr.errors import UsageError

# vLLM 0.33's --dtype choices (config/model.py ModelDType)
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# and its --mamba-cache-dtype / --mamba-ssm-cache-dtype choices (config/cache.py MambaDType)
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ServeArgs:
    """The engine arguments that size vLLM's KV cache, as the unit sets them; None where the unit
    leaves one to vLLM, so the planner applies that vLLM version's default, never a guess."""

    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None  # None = vLLM derives it; -1 = "auto" (fit to memory)
    gpu_memory_utilization: float | None = None  # None = vLLM's default for the version
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool | None = None  # None = vLLM's default
    enforce_eager: bool = False
    disable_sliding_window: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    num_speculative_tokens: int = 0
    served_model_name: str | None = None
    host: str | None = None
    port: int = 8000
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # the unit's Environment= (VLLM_*, CUDA_*)
    vllm_version: str | None = None  # of the vLLM the unit runs, where it can be read ("0.32.0+cpu")
    cuda_version: str | None = None  # the CUDA runtime of its torch ("12.8"), where it can be read
    flashinfer_installed: bool | None = None  # in its venv or image; None where that cannot be seen
    config_file: str | None = None  # vLLM's `--config FILE` (YAML), as the command names it
    notes: tuple[str, ...] = ()  # what the planner should tell about how these arguments were read
    # every flag the command sets to something other than off (canonical names): the flag table
    # (core/vllm_flags.py) names those that change GPU memory and are not modelled
    given_flags: tuple[str, ...] = ()
    hf_overrides: JSONObject | None = None  # --hf-overrides (JSON or dotted), applied to config.json
    enable_chunked_prefill: bool | None = None  # None: vLLM's default (on for generative models)
    cpu_offload_gb: float = 0.0  # --cpu-offload-gb: GiB of weights per GPU kept in host memory
    quantization: str | None = None  # --quantization / -q
    load_format: str | None = None  # --load-format (bitsandbytes quantizes the weights)
    # --load-format ipc_cache: --model-loader-extra-config's "mode" (zero_copy, vLLM's default, or copy)
    weight_cache_mode: str | None = None
    speculative_method: str | None = None  # as SpeculativeConfig.__post_init__ resolves it
    speculative_model: str | None = None  # a draft model or its path
    kv_transfer_config: JSONObject | None = None  # --kv-transfer-config
    async_scheduling: bool | None = None  # None: vLLM's default (on, on GPUs)
    performance_mode: str | None = None  # --performance-mode (throughput doubles the batch defaults)
    enable_lora: bool = False  # --enable-lora with LoRAConfig's defaults (config/lora.py) below
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    # what vLLM's parser refuses in these arguments (malformed JSON ...): the planner refuses it too
    refusals: tuple[str, ...] = ()
    long_prefill_token_threshold: int | None = None  # checked against max_model_len (config/scheduler.py)
    max_num_active_seqs: int | None = None  # checked against max_num_seqs (config/scheduler.py)
    limit_mm_per_prompt: JSONObject | None = None  # --limit-mm-per-prompt (JSON or dotted)
    compilation_config: JSONObject | None = None  # --compilation-config / -cc (JSON or dotted)
    mamba_cache_dtype: str = "auto"  # conv (and linear-attention) state dtype (config/cache.py)
    mamba_ssm_cache_dtype: str = "auto"  # the SSM / delta-net state's dtype; auto follows the conv state
    optimization_level: str | None = None  # -O / --optimization-level
    # --no-disable-hybrid-kv-cache-manager: the hybrid manager asked for explicitly (config/vllm.py)
    hybrid_kv_cache_manager_forced: bool = False
    # every flag the command gives, by canonical name, with its word as written (True for a bare switch,
    # False for --no-X): core/topology.py compares the nodes of a multi-node deployment flag by flag
    flags: dict[str, str | bool] = field(default_factory=dict)


# Flags whose next word is NOT a value (vLLM's store_true / BooleanOptionalAction flags we meet in units).
# Everything else that starts with "-" and has no "=" takes the next word as its value unless that word
# starts with "--".
_BOOLEAN_FLAGS = {
    "--enforce-eager",
    "--trust-remote-code",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--disable-sliding-window",
    "--disable-hybrid-kv-cache-manager",
    "--enable-auto-tool-choice",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enable-expert-parallel",
    "--async-scheduling",
    "--no-async-scheduling",
    "--headless",
    "--disable-custom-all-reduce",
    "--enable-lora",
    "--enable-sleep-mode",
    "--enable-log-requests",
    "--disable-frontend-multiprocessing",
    "--enable-request-id-headers",
    "--enable-prompt-tokens-details",
    "--enable-server-load-tracking",
    "--enable-force-include-usage",
    "--enable-tokenizer-info-endpoint",
    "--disable-fastapi-docs",
    "--enable-scale-out",
    "--enable-eplb",
    "--no-enable-log-requests",
}


# vLLM's nargs="+" options met in units: argparse gives them every word up to the next flag
_LIST_FLAGS = {"--served-model-name", "--api-key"}


def split_flags(
    args: list[str], refusals: list[str] | None = None
) -> tuple[list[str], dict[str, str | bool]]:
    """(positionals, {canonical flag: value}) from vLLM arguments, read as vLLM 0.33's parser reads them.

    Later flags win like argparse. A flag vLLM has takes its value by its kind in vLLM's table
    (core/vllm_flags.py): a boolean takes none and `--no-NAME` is stored as `--NAME: False`; a list
    option (`--served-model-name a b`) keeps its first word and takes the others with it; an optional
    one (`--hf-token`) takes the next word unless it is a flag. The dotted form `--x.key value` (and
    `--x.key=value`, `--x.key+ a,b`) is merged per flag into one JSON object that replaces any
    `--x '{json}'`, as FlexibleArgumentParser.parse_args appends it after every other word; `-O3`
    is `--optimization-level 3`. An unknown flag takes the next word unless that word is a flag.

    What argparse refuses goes to `refusals` in its words: a flag that takes a value followed by another
    flag or by nothing ("argument --max-model-len: expected one argument"), and positionals (a word no
    flag takes, every word after `--`) beyond the one model positional `vllm serve` has."""

    positionals: list[str] = []
    flags: dict[str, str | bool] = {}
    dotted: dict[str, JSONObject] = {}
    problems: list[str] = [] if refusals is None else refusals
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":  # argparse: every later word is a positional
            positionals += args[i + 1 :]
            break
        if word.startswith("-O") and not word.startswith("--") and word != "-O":
            flags["--optimization-level"] = word[3:] if word[2:3] == "=" else word[2:]
        elif word.startswith("-") and len(word) > 1 and not _is_number(word):
            name = canonical_flag(word)
            known = vllm_flag(name)
            kind = known.kind if known is not None else None
            if "." in name.split("=", 1)[0]:
                if "=" in word:
                    value_text = word.split("=", 1)[1]
                elif i + 1 < len(args):
                    value_text = args[i + 1]
                    i += 1
                else:
                    value_text = ""
                try:
                    _merge_dotted(dotted, name, value_text)
                except TooDeep as exc:
                    raise UsageError(f"argument {name.split('.', 1)[0]}: {exc}{_DEEP}") from None
            elif "=" in word:
                flags[name] = word.split("=", 1)[1]
            elif name.startswith("--no-") and (kind in (None, "bool") or name in _BOOLEAN_FLAGS):
                flags[canonical_flag("--" + name[5:])] = False
            elif (
                kind in ("bool", "switch")
                or name in _BOOLEAN_FLAGS
                or i + 1 >= len(args)
                or not takes_as_value(args[i + 1])
            ):
                if kind in ("value", "json", "list") and name not in _BOOLEAN_FLAGS:
                    needs = "at least one argument" if kind == "list" else "one argument"
                    problems.append(f"argument {name}: expected {needs}")
                flags[name] = True
            else:
                flags[name] = args[i + 1]
                i += 1
                while (
                    (kind == "list" or name in _LIST_FLAGS)
                    and i + 1 < len(args)
                    and not args[i + 1].startswith("-")
                ):
                    i += 1
        else:
            positionals.append(word)
        i += 1
    if len(positionals) > 1:  # `vllm serve` has one positional, the model
        problems.append(f"unrecognized arguments: {' '.join(positionals[1:])[:80]}")
    for name, value in dotted.items():
        flags[name] = json.dumps(value)
    return positionals, flags


_DEEP = " (ctxmgr reads a flag's JSON no deeper; vLLM's own configs nest a few levels)"


def _merge_dotted(dotted: dict[str, JSONObject], name: str, value_text: str) -> None:
    """FlexibleArgumentParser's dotted key: JSON, else a human-readable int (`80g`), else the text;
    `key+` splits a comma list; keys nest by their dots and later keys win."""
    head, *keys = name.split(".")
    if len(keys) >= MAX_DEPTH:
        raise TooDeep()
    if keys and keys[-1].endswith("+"):
        keys[-1] = keys[-1][:-1]
        value_text = json.dumps(value_text.split(","))
    value: JSONValue
    try:
        value = nesting.loads(value_text, MAX_DEPTH - len(keys))
    except TooDeep:
        raise
    except ValueError:
        try:
            value = human_readable_int(value_text)
        except UsageError:
            value = value_text
    target = dotted.setdefault(head, {})
    for key in keys[:-1]:
        nested = target.get(key)
        if not isinstance(nested, dict):
            nested = target[key] = {}
        target = nested
    if keys:
        target[keys[-1]] = value


def takes_as_value(word: str) -> bool:
    """Whether argparse gives this word to the flag before it: not an option string ("--" included),
    or a negative number (vLLM has no option that looks like one)."""
    return not word.startswith("-") or _is_number(word)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


AUTO_CONTEXT = -1  # `auto` / -1: the largest context that fits, as `vllm serve --max-model-len auto`


def human_readable_int(value: str, *, allow_auto: bool = False) -> int:
    """vLLM's `1k` (1,000) / `1K` (1,024) / `25.6k` / `auto` forms (vllm/utils/argparse_utils.py)."""
    import re

    value = value.strip()
    if allow_auto and (value == "-1" or value.lower() == "auto"):
        return -1
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}[suffix])
        if "." in number:
            raise UsageError(f"{value!r}: decimals are not allowed with binary suffixes like {suffix}")
        return int(number) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{value!r} is not a number (vLLM accepts forms like 8192, 8k, 32K)") from None


_SIZE = r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT](?:[iI]?B)?|B)?\s*"
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}

# how a size is written, for error messages
SIZE_FORMS = "24GiB or 24G (x 2^30), 24GB or 24g (x 10^9), 81920MiB"


def parse_size(value: str, *, unit_required: bool = False) -> int:
    """Bytes in ctxmgr's one size grammar, a superset of vLLM's human_readable_int so that a flag vLLM
    has reads the same here: `g`/`k`/`m`/`t` (lower case, vLLM's) and `GB`/`kB`/... (SI) are powers of
    ten; `G`/`K`/... (upper case, vLLM's) and `GiB`/`KiB`/... (IEC) are powers of two; `B` is bytes.

    A bare number is bytes, as vLLM reads --kv-cache-memory-bytes; where it stands for a GPU's memory
    (`unit_required`), 24 would be 24 bytes, so it is refused with the unit to add."""
    import re

    match = re.fullmatch(_SIZE, value)
    if not match:
        raise UsageError(f"{value!r} is not a size (e.g. {SIZE_FORMS})")
    number, suffix = match.groups()
    if suffix is None:
        if unit_required:
            raise UsageError(
                f"{value!r} has no unit, so it would be {value.strip()} bytes: add one, e.g. "
                f"{number}GiB (= {number} x 2^30 bytes) or {number}GB (= {number} x 10^9)"
            )
        if "." in number:
            raise UsageError(f"{value!r}: a byte count is a whole number")
        return int(number)
    if suffix == "B":
        if "." in number:
            raise UsageError(f"{value!r}: a byte count is a whole number")
        return int(number)
    letter = suffix[0]
    if suffix[1:].lower() == "ib" or (len(suffix) == 1 and letter.isupper()):
        if len(suffix) == 1 and "." in number:  # vLLM's own rule for its binary letters
            raise UsageError(
                f"{value!r}: decimals are not allowed with binary suffixes like {suffix} "
                f"(as vLLM reads it); write {number}{letter}iB or {number}{letter.lower()}"
            )
        return int(float(number) * _BINARY[letter.lower()])
    return int(float(number) * _DECIMAL[letter.lower()])


def parse_serve_argv(args: list[str], env: dict[str, str] | None = None) -> ServeArgs:
    """ServeArgs from the words after `vllm serve` (or after `-m vllm.entrypoints.openai.api_server`),
    each flag converted as vLLM's argparse converts it; what vLLM's parser refuses is kept in `refusals`
    for the planner, and what ctxmgr cannot read at all is a UsageError."""
    refusals: list[str] = []
    positionals, flags = split_flags(args, refusals)
    _refuse_unreadable_config_values(flags)
    _refuse_world_beyond_bound(flags)
    model = flags.get("--model")
    if positionals:
        model = positionals[0]  # `vllm serve MODEL` (the positional wins, as in vLLM's serve command)
    if not isinstance(model, str) or not model:
        raise UsageError("the vLLM command names no model (`vllm serve MODEL` or `--model MODEL`)")
    read = _FlagReader(flags, refusals)
    _refuse_unknown_dtype(read)
    return _serve_args(model, read, _CombinedFlags.of(read), env)


def _refuse_unreadable_config_values(flags: Mapping[str, str | bool]) -> None:
    """A value ctxmgr's own option of the same name would refuse (a JSON config nested too deep, ...) is
    refused here too, so a unit's flag and the CLI's read the same."""
    for name, value in flags.items():
        problem = flag_value_problem(name, value) if name in CHECKED_CONFIG_FLAGS else None
        if problem and isinstance(value, str):
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise UsageError(f"{name} {shown!r}: {problem} (as ctxmgr's own {name} takes it)")


def _clipped(value: str, keep: int = 80) -> str:
    """A value quoted in a one-line refusal: its first `keep` characters (a 5,000-digit value is not
    echoed whole)."""
    return value if len(value) <= keep else f"{value[:keep]}... ({len(value):,} characters)"


def _refuse_world_beyond_bound(flags: Mapping[str, str | bool]) -> None:
    """The product of the parallel sizes (the deployment's world) and --nnodes are bounded as a whole,
    not only each factor: a world of 2^30 ranks is laid out rank by rank (MemoryError)."""
    world = 1
    for name in ("--tensor-parallel-size", "--pipeline-parallel-size", "--prefill-context-parallel-size",
                 "--data-parallel-size"):  # fmt: skip
        world *= max(_whole(flags.get(name, 1)) or 1, 1)
    if world > MAX_WORLD_SIZE:
        raise UsageError(
            f"a world of {world:,} GPUs (data x pipeline x prefill context x tensor parallel sizes) is more "
            f"than ctxmgr reads: at most {MAX_WORLD_SIZE:,}"
        )
    nnodes = flags.get("--nnodes")
    if nnodes is not None and not isinstance(nnodes, bool):
        number = _whole(nnodes)
        if number is None or not 1 <= number <= MAX_NODES:
            shown = str(nnodes)[:20]
            raise UsageError(f"--nnodes {shown!r}: must be a whole number from 1 to {MAX_NODES}")


@dataclass
class _FlagReader:
    """One command's flags, each read by the type vLLM's argparse gives it; what vLLM's parser refuses
    goes to `refusals` (the planner refuses it), what ctxmgr cannot read raises UsageError."""

    flags: Mapping[str, str | bool]
    refusals: list[str]

    def integer(self, flag: str, *, allow_auto: bool = False) -> int | None:
        """An int flag; max_model_len, kv_cache_memory_bytes and max_num_batched_tokens also take vLLM's
        human-readable forms (`32k`, `1G`, and `auto` for max_model_len)."""
        value = self.flags.get(flag)
        if value is None or isinstance(value, bool):
            return None
        try:
            if flag in ("--max-model-len", "--kv-cache-memory-bytes", "--max-num-batched-tokens"):
                return human_readable_int(str(value), allow_auto=allow_auto)
            return int(str(value))
        except ValueError:
            raise UsageError(f"{flag} {value!r} is not a number") from None

    def fraction(self, flag: str) -> float | None:
        """A float flag (gpu_memory_utilization)."""
        value = self.flags.get(flag)
        if value is None or isinstance(value, bool):
            return None
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"{flag} {value!r} is not a number") from None

    def switch(self, flag: str) -> bool | None:
        """A boolean flag: True, False for `--no-X`, None where the command leaves it to vLLM."""
        value = self.flags.get(flag)
        return value if isinstance(value, bool) else None

    def text(self, flag: str) -> str | None:
        """A string flag's value; None where it is not given (or given bare)."""
        value = self.flags.get(flag)
        return value if isinstance(value, str) else None

    def json_object(self, name: str, label: str) -> JSONObject | None:
        """A JSON-valued flag as vLLM's type parses it (engine/arg_utils.py parse_type: json.loads)."""
        value = self.flags.get(name)
        if not isinstance(value, str) or value in ("", "None"):
            return None
        try:
            parsed = nesting.loads(value)
        except TooDeep as exc:
            raise UsageError(f"argument {label}: {exc}{_DEEP}") from None
        except ValueError:
            self.refusals.append(
                f"argument {label}: Value {_clipped(value)} cannot be converted to json.loads "
                "(vLLM's parser refuses it: engine/arg_utils.py parse_type)"
            )
            return None
        if not isinstance(parsed, dict):
            self.refusals.append(
                f"argument {label}: {_clipped(value)} is not a JSON object (vLLM's config refuses it)"
            )
            return None
        return parsed


def _refuse_unknown_dtype(read: _FlagReader) -> None:
    """--dtype outside vLLM's choices is argparse's refusal (config/model.py ModelDType)."""
    dtype = str(read.flags.get("--dtype", "auto"))
    if dtype not in MODEL_DTYPES:
        choices = ", ".join(repr(c) for c in MODEL_DTYPES)
        read.refusals.append(f"argument --dtype: invalid choice: {dtype!r} (choose from {choices})")


def _mamba_dtype(read: _FlagReader, flag_name: str) -> str:
    """--mamba-cache-dtype / --mamba-ssm-cache-dtype, refused outside vLLM's choices (config/cache.py
    MambaDType) and then planned as auto."""
    value = str(read.flags.get(flag_name, "auto"))
    if value not in MAMBA_DTYPES:
        choices = ", ".join(repr(c) for c in MAMBA_DTYPES)
        read.refusals.append(f"argument {flag_name}: invalid choice: {value!r} (choose from {choices})")
        return "auto"
    return value


@dataclass(frozen=True)
class _SpeculativeDecoding:
    """What speculative decoding adds to the KV cache: num_speculative_tokens, and the method and draft
    model SpeculativeConfig resolves (a draft model has a KV cache of its own)."""

    num_speculative_tokens: int = 0
    method: str | None = None
    model: str | None = None

    @classmethod
    def of(cls, read: _FlagReader) -> _SpeculativeDecoding:
        """--speculative-config merged with the --spec-* shorthands, which may not repeat one of its keys
        (engine/arg_utils.py create_speculative_config)."""
        speculative = read.json_object("--speculative-config", "--speculative-config/-sc") or {}
        speculative = {key.replace("-", "_"): item for key, item in speculative.items()}
        for flag_name, key in (
            ("--spec-method", "method"),
            ("--spec-model", "model"),
            ("--spec-tokens", "num_speculative_tokens"),
        ):
            value = read.flags.get(flag_name)
            if isinstance(value, str):
                if key in speculative:
                    read.refusals.append(
                        f"{flag_name} and --speculative-config['{key}'] are mutually exclusive"
                    )
                speculative[key] = value
        num_spec = 0
        try:
            num_spec = int(speculative.get("num_speculative_tokens") or 0)
        except (TypeError, ValueError, OverflowError):  # 1e400 is JSON's inf
            read.refusals.append(
                f"speculative num_speculative_tokens {speculative.get('num_speculative_tokens')!r} "
                "is not an integer (vLLM's config refuses it)"
            )
        if not 0 <= num_spec <= MAX_COUNT:
            read.refusals.append(
                f"speculative num_speculative_tokens {num_spec}: ctxmgr reads 0 to {MAX_COUNT:,}"
            )
            num_spec = 0
        method, model = speculative_method(speculative, read.refusals)
        return cls(num_spec, method, model)


def _hf_overrides(read: _FlagReader) -> JSONObject | None:
    """--hf-overrides with the legacy --rope-scaling / --rope-theta folded in, as vLLM applies them to
    config.json (they change the model's derived max_model_len)."""
    hf_overrides = read.json_object("--hf-overrides", "--hf-overrides")
    rope_scaling = read.json_object("--rope-scaling", "--rope-scaling")
    if rope_scaling is not None:
        hf_overrides = {**(hf_overrides or {}), "rope_scaling": rope_scaling}
    rope_theta = read.text("--rope-theta")
    if rope_theta is not None:
        hf_overrides = {**(hf_overrides or {}), "rope_theta": rope_theta}
    return hf_overrides


def _weight_cache_mode(read: _FlagReader) -> str | None:
    """The IPC loader's mode (model_loader/weight_cache/ipc_loader.py:L86, L114: "mode" in
    --model-loader-extra-config, zero_copy by default); None for every other load format."""
    if read.text("--load-format") != "ipc_cache":
        return None
    extra = read.json_object("--model-loader-extra-config", "--model-loader-extra-config") or {}
    mode = extra.get("mode", "zero_copy")
    return mode if isinstance(mode, str) else "zero_copy"


@dataclass(frozen=True)
class _CombinedFlags:
    """The flags vLLM checks or combines beyond converting one word, read in the order vLLM's parser and
    configs meet them (so the first refusal is the one vLLM would give)."""

    mamba_cache_dtype: str
    mamba_ssm_cache_dtype: str
    speculative: _SpeculativeDecoding
    hf_overrides: JSONObject | None
    kv_transfer_config: JSONObject | None
    cpu_offload_gb: float
    compilation_config: JSONObject | None
    optimization_level: str | None

    @classmethod
    def of(cls, read: _FlagReader) -> _CombinedFlags:
        mamba_cache_dtype = _mamba_dtype(read, "--mamba-cache-dtype")
        mamba_ssm_cache_dtype = _mamba_dtype(read, "--mamba-ssm-cache-dtype")
        speculative = _SpeculativeDecoding.of(read)
        hf_overrides = _hf_overrides(read)
        kv_transfer = read.json_object("--kv-transfer-config", "--kv-transfer-config")
        offload = read.flags.get("--cpu-offload-gb")
        try:
            cpu_offload_gb = float(offload) if isinstance(offload, str) else 0.0
        except ValueError:
            raise UsageError(f"--cpu-offload-gb {offload!r} is not a number") from None
        compilation = read.json_object("--compilation-config", "--compilation-config/-cc")
        level = read.text("--optimization-level")
        return cls(
            mamba_cache_dtype, mamba_ssm_cache_dtype, speculative, hf_overrides, kv_transfer, cpu_offload_gb,
            compilation, level,
        )  # fmt: skip

    @property
    def cuda_graphs_off(self) -> bool:
        """config/vllm.py OPTIMIZATION_LEVEL_00 and CompilationConfig.cudagraph_mode NONE: no CUDA graphs,
        as --enforce-eager."""
        mode = str((self.compilation_config or {}).get("cudagraph_mode", ""))
        return self.optimization_level == "0" or mode.upper() == "NONE"


def _serve_args(
    model: str, read: _FlagReader, combined: _CombinedFlags, env: dict[str, str] | None
) -> ServeArgs:
    """ServeArgs from the read flags: each plain flag converted here, in the order the checked ones leave
    (a wrong --port is reported before a wrong --tensor-parallel-size, as before)."""
    port = read.integer("--port")
    speculative = combined.speculative
    return ServeArgs(
        model=model,
        tensor_parallel_size=read.integer("--tensor-parallel-size") or 1,
        pipeline_parallel_size=read.integer("--pipeline-parallel-size") or 1,
        decode_context_parallel_size=read.integer("--decode-context-parallel-size") or 1,
        data_parallel_size=read.integer("--data-parallel-size") or 1,
        kv_cache_dtype=str(read.flags.get("--kv-cache-dtype", "auto")),
        dtype=str(read.flags.get("--dtype", "auto")),
        block_size=read.integer("--block-size"),
        max_num_batched_tokens=read.integer("--max-num-batched-tokens"),
        max_num_seqs=read.integer("--max-num-seqs"),
        max_model_len=read.integer("--max-model-len", allow_auto=True),
        gpu_memory_utilization=read.fraction("--gpu-memory-utilization"),
        kv_cache_memory_bytes=read.integer("--kv-cache-memory-bytes"),
        enable_prefix_caching=read.switch("--enable-prefix-caching"),
        enforce_eager=bool(read.switch("--enforce-eager")) or combined.cuda_graphs_off,
        disable_sliding_window=bool(read.switch("--disable-sliding-window")),
        disable_hybrid_kv_cache_manager=bool(read.switch("--disable-hybrid-kv-cache-manager")),
        num_speculative_tokens=speculative.num_speculative_tokens,
        given_flags=tuple(name for name, value in read.flags.items() if value is not False),
        hf_overrides=combined.hf_overrides,
        enable_chunked_prefill=read.switch("--enable-chunked-prefill"),
        cpu_offload_gb=combined.cpu_offload_gb,
        quantization=read.text("--quantization"),
        load_format=read.text("--load-format"),
        weight_cache_mode=_weight_cache_mode(read),
        speculative_method=speculative.method,
        speculative_model=speculative.model,
        kv_transfer_config=combined.kv_transfer_config,
        async_scheduling=read.switch("--async-scheduling"),
        performance_mode=read.text("--performance-mode"),
        enable_lora=bool(read.switch("--enable-lora")),
        max_loras=read.integer("--max-loras") or 1,
        max_lora_rank=read.integer("--max-lora-rank") or 16,
        lora_dtype=str(read.flags.get("--lora-dtype", "auto")),
        fully_sharded_loras=bool(read.switch("--fully-sharded-loras")),
        long_prefill_token_threshold=read.integer("--long-prefill-token-threshold"),
        max_num_active_seqs=read.integer("--max-num-active-seqs"),
        limit_mm_per_prompt=read.json_object("--limit-mm-per-prompt", "--limit-mm-per-prompt"),
        compilation_config=combined.compilation_config,
        mamba_cache_dtype=combined.mamba_cache_dtype,
        mamba_ssm_cache_dtype=combined.mamba_ssm_cache_dtype,
        optimization_level=combined.optimization_level,
        hybrid_kv_cache_manager_forced=read.flags.get("--disable-hybrid-kv-cache-manager") is False,
        refusals=tuple(read.refusals),  # after limit_mm_per_prompt, whose refusal it holds
        flags=dict(read.flags),
        served_model_name=read.text("--served-model-name"),
        host=read.text("--host"),
        port=port if port is not None else 8000,
        api_key=read.text("--api-key"),
        env=dict(env or {}),
    )


def speculative_method(config: JSONObject, refusals: list[str]) -> tuple[str | None, str | None]:
    """(method, draft model) as SpeculativeConfig.__post_init__ resolves them (config/speculative.py):
    no method and a model of "ngram" is ngram, any other model a draft model; the `*_mtp` methods are
    mtp; tokens without a model are refused unless the method brings its own (mtp, ngram, ...)."""
    if not config:
        return None, None
    model = config.get("model")
    method = config.get("method")
    if method is None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    method = str(method)
    if method.endswith("_mtp"):
        method = "mtp"
    if method == "[ngram]":
        method = "ngram"
    if method in ("ngram", "ngram_gpu"):
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = (high if low is None else low), (low if high is None else high)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            refusals.append(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    self_drafting = ("mtp", "dspark", "ngram", "ngram_gpu", "suffix", "extract_hidden_states")
    if model is None and config.get("num_speculative_tokens") is not None and method not in self_drafting:
        refusals.append("num_speculative_tokens was provided but without speculative model.")
    return method, None if model is None or method in self_drafting else str(model)


# vLLM's flags and their aliases (vllm/engine/arg_utils.py); underscores are accepted too.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "--max-model-len": ("--max-model-len",),
    "--gpu-memory-utilization": ("--gpu-memory-utilization", "--device-memory-utilization"),
    "--kv-cache-memory-bytes": ("--kv-cache-memory-bytes", "--kv-cache-memory"),
    "--tensor-parallel-size": ("--tensor-parallel-size", "-tp"),
    "--pipeline-parallel-size": ("--pipeline-parallel-size", "-pp"),
    "--decode-context-parallel-size": ("--decode-context-parallel-size", "-dcp"),
    "--data-parallel-size": ("--data-parallel-size", "-dp"),
    "--kv-cache-dtype": ("--kv-cache-dtype",),
    "--max-num-seqs": ("--max-num-seqs",),
    "--max-num-batched-tokens": ("--max-num-batched-tokens",),
}


def canonical_flag(word: str) -> str:
    """`--max_model_len=5` -> `--max-model-len`; aliases map to their main name (vLLM's table)."""
    name = canonical_name(word)
    for main, aliases in FLAG_ALIASES.items():
        if name in aliases:
            return main
    return name


# ---------------------------------------------------------------------------------------------
# vLLM's own YAML config (`--config FILE`), pulled into the arguments as vLLM does it
# (FlexibleArgumentParser._pull_args_from_config and load_config_file, vllm/utils/argparse_utils.py).

# the flags ctxmgr writes on the unit's command line when it changes a service
OWNED_FLAGS = ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes")


def config_file_arg(args: list[str]) -> str | None:
    """The YAML file vLLM pulls arguments from. vLLM looks for the exact word `--config` (so
    `--config=FILE` is accepted by argparse and read by nothing), at most once, followed by a path."""
    count = args.count("--config")
    if count == 0:
        return None
    if count > 1:
        raise UsageError("the vLLM command gives --config more than once (vLLM refuses to start)")
    index = args.index("--config")
    if index == len(args) - 1:
        raise UsageError("the vLLM command ends in --config with no file (vLLM refuses to start)")
    return args[index + 1]


def config_file_flags(config: object, source: str) -> list[str]:
    """load_config_file's flattening of a YAML mapping into flags, key by key in the file's order:
    `true` -> `--key`; `false` -> `--no-key` (vLLM adds it only where the parser has that option: every
    boolean engine argument in 0.33; a store_true flag's `--no-key` reads back as its default False here,
    and an underscored key never matches an option string, so `key_name: false` adds nothing); a list
    -> `--key item ...` (an empty one adds nothing); a mapping -> `--key JSON`; anything else ->
    `--key str(value)` (so an empty value is the word `None`, as vLLM passes it)."""
    import json

    if not isinstance(config, dict):
        raise UsageError(f"{source}: not a YAML mapping of vLLM flags (vLLM refuses to start)")
    check_config_values(config, source)
    flags: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            if value:
                flags.append("--" + key)
            elif "_" not in key:
                flags.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                flags += ["--" + key, *(str(item) for item in value)]
        elif isinstance(value, dict):
            flags += ["--" + key, json.dumps(value)]
        else:
            flags += ["--" + key, str(value)]
    return flags


# a vLLM flag's name as a YAML key: letters, digits, `-`, `_` and `.` (vLLM's dotted sub-keys), no
# leading dash (load_config_file adds `--`), nothing a shell or argparse would read otherwise
_FLAG_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# The bounds of every size flag ctxmgr reads, whichever door it comes through: its own CLI options
# (cli/params.py builds its click types from these), a unit's ExecStart and vLLM's --config YAML. A
# size far beyond any machine (`-pp 100000000`) is refused before it drives a loop or an allocation.
PARALLEL_FLAGS = (
    "--tensor-parallel-size", "--pipeline-parallel-size", "--decode-context-parallel-size",
    "--data-parallel-size", "--data-parallel-size-local", "--prefill-context-parallel-size",
)  # fmt: skip
COUNT_FLAGS = (
    "--max-num-seqs", "--max-num-batched-tokens", "--num-gpu-blocks-override", "--max-loras",
    "--max-lora-rank", "--long-prefill-token-threshold", "--max-num-active-seqs",
)  # fmt: skip


def _whole(value: object) -> int | None:
    """An int as vLLM's argparse reads the word str(value); None where it is not one."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


# The flags whose value ctxmgr checks as its own CLI options would, in a unit and in a YAML file (a
# flag that takes a mapping, like --hf-overrides, is not among them)
CHECKED_CONFIG_FLAGS = frozenset(
    {
        *PARALLEL_FLAGS, *COUNT_FLAGS, "--kv-cache-dtype", "--dtype", "--block-size", "--max-model-len",
        "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--speculative-config",
        "--served-model-name", "--quantization",
    }
)  # fmt: skip


def flag_value_problem(flag: str, value: object) -> str | None:
    """Why ctxmgr's CLI door would refuse this value of a flag it reads (its click types), or None:
    the one place the bounds of a size flag are checked, for the CLI, a unit and a YAML file alike."""
    if isinstance(value, list) and flag != "--served-model-name":
        return "a list where vLLM takes one value"
    if isinstance(value, dict) and flag != "--speculative-config":
        return "a mapping where vLLM takes one value"
    if isinstance(value, list | dict) or value is None or isinstance(value, bool):
        return None
    if flag == "--block-size":
        number = _whole(value)
        if number is None or not block_size_ok(number):
            return BLOCK_SIZES
    elif flag in PARALLEL_FLAGS:
        number = _whole(value)
        if number is None or not 1 <= number <= MAX_PARALLEL:
            return f"must be a whole number from 1 to {MAX_PARALLEL}"
    elif flag in COUNT_FLAGS:
        try:
            number = human_readable_int(str(value))
        except UsageError:
            number = 0
        if not 1 <= number <= MAX_COUNT:
            return f"must be a whole number from 1 to {MAX_COUNT:,}"
    elif flag == "--max-model-len":
        try:
            number = human_readable_int(str(value), allow_auto=True)
        except UsageError:
            number = 0
        if number != -1 and not 0 < number <= MAX_CONTEXT:
            return f"must be a positive context length of at most {MAX_CONTEXT:,} tokens (or auto / -1)"
    elif flag == "--kv-cache-memory-bytes":
        try:
            number = human_readable_int(str(value))
        except UsageError:
            number = 0
        if not 0 < number <= MAX_BYTES:
            return "must be a positive number of bytes, at most 1 PiB"
    elif flag == "--gpu-memory-utilization":
        # config/cache.py gpu_memory_utilization: Field(gt=0, le=1), which nan and inf fail
        try:
            fraction = float(str(value))
        except ValueError:
            fraction = math.nan
        if not (math.isfinite(fraction) and 0 < fraction <= 1):
            return "must be a number in (0, 1]"
    return None


def check_config_values(config: dict[object, object], source: str) -> None:
    """The YAML door refuses what the CLI door refuses: a key that is no flag name, and for the flags
    ctxmgr reads, a value its own options would not take (`block-size: 0`, negative bytes, a list for
    one value). The message names the key, never the value (the file may hold a key)."""
    for key, value in config.items():
        if not isinstance(key, str) or not _FLAG_KEY.fullmatch(key):
            shown = key if isinstance(key, str) and len(key) <= 40 and key.isprintable() else "a key"
            raise UsageError(f"{source}: {shown!r} is not a vLLM flag name (vLLM refuses to start)")
        flag = canonical_flag("--" + key.replace("_", "-"))
        if flag in CHECKED_CONFIG_FLAGS:
            problem = flag_value_problem(flag, value)
            if problem:
                raise UsageError(f"{source}: {key}: {problem}")


def with_config_args(args: list[str], config_flags: list[str]) -> list[str]:
    """The arguments vLLM parses once it has pulled the file in: the file's flags go after the model
    positional (where the command names one) and before the command line's other words, which drops
    `--config FILE`; argparse's last-one-wins then gives the command line precedence over the file."""
    index = args.index("--config")
    rest = args[:index] + args[index + 2 :]
    if args and not args[0].startswith("-"):
        return [args[0], *config_flags, *rest[1:]]
    return [*config_flags, *rest]


def config_notes(args: list[str], config_flags: list[str], source: str) -> list[str]:
    """What a reader of the YAML would get wrong: keys the command line overrides, and the keys
    ctxmgr changes (it writes them on the unit's command line, leaving the file as it is)."""
    index = args.index("--config")
    _, cli = split_flags(args[:index] + args[index + 2 :])
    _, yaml_flags = split_flags(config_flags)
    notes: list[str] = []
    for flag, value in yaml_flags.items():
        shown = "true" if value is True else "false" if value is False else value
        if flag in cli and cli[flag] != value:
            notes.append(
                f"{source} sets {flag.removeprefix('--')} {shown}, but the unit's command line gives "
                f"{flag} {cli[flag]}, which vLLM uses (the command line takes precedence over --config)"
            )
        elif flag in OWNED_FLAGS:
            notes.append(
                f"{source} sets {flag.removeprefix('--')} {shown}: a change by ctxmgr writes {flag} on "
                "the unit's command line, which overrides the YAML value (the YAML file is left as it is)"
            )
    return notes


def with_overrides(args: ServeArgs, overrides: Mapping[str, object]) -> ServeArgs:
    """A unit's arguments with vLLM flags given on ctxmgr's command line on top: each field replaced,
    except `given_flags` and `flags`, which add to the unit's own (both are what vLLM would be given)."""
    extra = tuple(overrides.get("given_flags", ()))  # type: ignore[call-overload]
    flags = {**args.flags, **overrides.get("flags", {})}  # type: ignore[dict-item]
    fields_ = {k: v for k, v in overrides.items() if k not in ("given_flags", "flags")}
    return replace(args, given_flags=(*args.given_flags, *extra), flags=flags, **fields_)  # type: ignore[arg-type]


# vLLM's own multi-node flags (entrypoints/cli/serve.py, config/parallel.py @0.33): a unit that holds
# one of them is one node of a deployment that spans machines
MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--headless", "--data-parallel-start-rank", "--master-addr")


def multi_node_flag(args: ServeArgs) -> str | None:
    """The first multi-node flag the unit gives, or None: such a unit is one node of a deployment whose
    every node must get the same --max-model-len and restart together, which one unit's change cannot do."""
    return next((flag for flag in MULTI_NODE_FLAGS if flag in args.given_flags), None)
