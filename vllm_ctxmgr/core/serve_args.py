"""The vLLM engine arguments that decide KV-cache memory, in vLLM's own names.

`parse_serve_argv` reads them out of a `vllm serve` command line (as found in a unit's ExecStart);
`ServeArgs` is what the planner takes. Unknown flags are kept untouched by the unit editor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from vllm_ctxmgr.errors import UsageError


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


def split_flags(args: list[str]) -> tuple[list[str], dict[str, str | bool]]:
    """(positionals, {canonical flag: value}) from vLLM arguments; later flags win like argparse.

    `--no-NAME` (argparse's BooleanOptionalAction, which every boolean engine argument has in vLLM 0.33)
    is stored as `--NAME: False`, so `--enforce-eager ... --no-enforce-eager` ends False as in vLLM.
    A list option (`--served-model-name a b`) keeps its first word and takes the others with it."""

    positionals: list[str] = []
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            name = canonical_flag(word)
            if "=" in word:
                flags[name] = word.split("=", 1)[1]
            elif name.startswith("--no-"):
                flags[canonical_flag("--" + name[5:])] = False
            elif (
                name in _BOOLEAN_FLAGS
                or i + 1 >= len(args)
                or (args[i + 1].startswith("-") and not _is_number(args[i + 1]))
            ):
                flags[name] = True
            else:
                flags[name] = args[i + 1]
                i += 1
                while name in _LIST_FLAGS and i + 1 < len(args) and not args[i + 1].startswith("-"):
                    i += 1
        else:
            positionals.append(word)
        i += 1
    return positionals, flags


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


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


def parse_serve_argv(args: list[str], env: dict[str, str] | None = None) -> ServeArgs:
    """ServeArgs from the words after `vllm serve` (or after `-m vllm.entrypoints.openai.api_server`)."""

    positionals, flags = split_flags(args)
    model = flags.get("--model")
    if positionals:
        model = positionals[0]  # `vllm serve MODEL` (the positional wins, as in vLLM's serve command)
    if not isinstance(model, str) or not model:
        raise UsageError("the vLLM command names no model (`vllm serve MODEL` or `--model MODEL`)")

    def num(flag: str, kind: type = int, **kw: bool) -> int | float | None:
        value = flags.get(flag)
        if value is None or isinstance(value, bool):
            return None
        try:
            if kind is float:
                return float(value)  # type: ignore[arg-type]
            if flag in ("--max-model-len", "--kv-cache-memory-bytes", "--max-num-batched-tokens"):
                return human_readable_int(str(value), **kw)
            return int(str(value))
        except ValueError:
            raise UsageError(f"{flag} {value!r} is not a number") from None

    def boolean(on: str) -> bool | None:
        value = flags.get(on)
        return value if isinstance(value, bool) else None

    speculative = flags.get("--speculative-config")
    num_spec = 0
    if isinstance(speculative, str):
        import json

        try:
            num_spec = int(json.loads(speculative).get("num_speculative_tokens", 0))
        except (ValueError, AttributeError):
            num_spec = 0
    port = num("--port")
    return ServeArgs(
        model=model,
        tensor_parallel_size=int(num("--tensor-parallel-size") or 1),
        pipeline_parallel_size=int(num("--pipeline-parallel-size") or 1),
        decode_context_parallel_size=int(num("--decode-context-parallel-size") or 1),
        data_parallel_size=int(num("--data-parallel-size") or 1),
        kv_cache_dtype=str(flags.get("--kv-cache-dtype", "auto")),
        dtype=str(flags.get("--dtype", "auto")),
        block_size=num("--block-size"),  # type: ignore[arg-type]
        max_num_batched_tokens=num("--max-num-batched-tokens"),  # type: ignore[arg-type]
        max_num_seqs=num("--max-num-seqs"),  # type: ignore[arg-type]
        max_model_len=num("--max-model-len", allow_auto=True),  # type: ignore[arg-type]
        gpu_memory_utilization=num("--gpu-memory-utilization", float),  # type: ignore[arg-type]
        kv_cache_memory_bytes=num("--kv-cache-memory-bytes"),  # type: ignore[arg-type]
        enable_prefix_caching=boolean("--enable-prefix-caching"),
        enforce_eager=bool(boolean("--enforce-eager")),
        disable_sliding_window=bool(boolean("--disable-sliding-window")),
        disable_hybrid_kv_cache_manager=bool(boolean("--disable-hybrid-kv-cache-manager")),
        num_speculative_tokens=num_spec,
        served_model_name=flags.get("--served-model-name")
        if isinstance(flags.get("--served-model-name"), str)
        else None,  # type: ignore[arg-type]
        host=flags.get("--host") if isinstance(flags.get("--host"), str) else None,  # type: ignore[arg-type]
        port=int(port) if port is not None else 8000,
        api_key=flags.get("--api-key") if isinstance(flags.get("--api-key"), str) else None,  # type: ignore[arg-type]
        env=dict(env or {}),
    )


# The flags parse_serve_argv reads (canonical names): what `ctxmgr plan` also takes after the model, so
# a plan from the command line can say everything a unit can.
READ_FLAGS = frozenset(
    {
        "--model",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--decode-context-parallel-size",
        "--data-parallel-size",
        "--kv-cache-dtype",
        "--dtype",
        "--block-size",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--disable-sliding-window",
        "--disable-hybrid-kv-cache-manager",
        "--speculative-config",
        "--served-model-name",
        "--quantization",
    }
)


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
    """`--max_model_len=5` -> `--max-model-len`; aliases map to their main name."""
    name = word.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
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
_BLOCK_SIZES = "vLLM's block sizes are 1, 8 or a multiple of 16 up to 4096"
_MAX_COUNT = 1 << 24
_MAX_BYTES = 1 << 50
_MAX_CONTEXT = 1 << 32


def _whole(value: object) -> int | None:
    """An int as vLLM's argparse reads the word str(value); None where it is not one."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _config_value_problem(flag: str, value: object) -> str | None:
    """Why ctxmgr's CLI door would refuse this value of a flag it reads (its click types), or None."""
    if isinstance(value, list) and flag != "--served-model-name":
        return "a list where vLLM takes one value"
    if isinstance(value, dict) and flag != "--speculative-config":
        return "a mapping where vLLM takes one value"
    if isinstance(value, list | dict) or value is None or isinstance(value, bool):
        return None
    if flag == "--block-size":
        number = _whole(value)
        if number is None or (number not in (1, 8) and not (0 < number <= 4096 and number % 16 == 0)):
            return _BLOCK_SIZES
    elif flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--decode-context-parallel-size",
                  "--data-parallel-size"):  # fmt: skip
        number = _whole(value)
        if number is None or not 1 <= number <= 1024:
            return "must be a whole number from 1 to 1024"
    elif flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        try:
            number = human_readable_int(str(value))
        except UsageError:
            number = 0
        if not 1 <= number <= _MAX_COUNT:
            return f"must be a whole number from 1 to {_MAX_COUNT:,}"
    elif flag == "--max-model-len":
        try:
            number = human_readable_int(str(value), allow_auto=True)
        except UsageError:
            number = 0
        if number != -1 and not 0 < number <= _MAX_CONTEXT:
            return "must be a positive context length (or auto / -1)"
    elif flag == "--kv-cache-memory-bytes":
        try:
            number = human_readable_int(str(value))
        except UsageError:
            number = 0
        if not 0 < number <= _MAX_BYTES:
            return "must be a positive number of bytes, at most 1 PiB"
    elif flag == "--gpu-memory-utilization":
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
        if flag in READ_FLAGS:
            problem = _config_value_problem(flag, value)
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
