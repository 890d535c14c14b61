"""Values checked at the door: the click types of the CLI, and the options several commands share,
each declared once.

Light on purpose (`--help` and a completion TAB build these): what a conversion needs beyond the size
bounds is imported inside it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import click

from vllm_ctxmgr.core.bounds import (
    BLOCK_SIZES,
    MAX_BYTES,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_PARALLEL,
    block_size_ok,
)
from vllm_ctxmgr.errors import CtxmgrError, UsageError

# ---- values, checked at the door ----------------------------------------------------------------
# Each `convert` takes what click hands it: the command line's text, or a default as declared (a
# number), so its value is `object` until it is checked.


class ContextArg(click.ParamType):
    """A context length as vLLM reads --max-model-len: 200000, 200k (x1,000), 195K (x1,024), auto or -1."""

    name = "CONTEXT"

    def __init__(self, allow_auto: bool = True) -> None:
        self.allow_auto = allow_auto

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from vllm_ctxmgr.core.serve_args import AUTO_CONTEXT, human_readable_int

        if isinstance(value, int):
            number = value
        else:
            try:
                number = human_readable_int(str(value), allow_auto=self.allow_auto)
            except CtxmgrError:
                self.fail(
                    f"{value!r} is not a context length (e.g. 200000, 200k = 200,000, 128K = 131,072, auto)",
                    param,
                    ctx,
                )
        if number == -1 and self.allow_auto:
            return AUTO_CONTEXT
        if number <= 0:
            self.fail(f"{value!r}: a context length must be positive (or auto)", param, ctx)
        if number > MAX_CONTEXT:
            self.fail(f"{value!r}: a context length above {MAX_CONTEXT:,} tokens is not one", param, ctx)
        return number


class ByteSize(click.ParamType):
    """A size in ctxmgr's one grammar (core.serve_args.parse_size, vLLM's where vLLM has the flag):
    95.6GiB, 80G and 80GiB = 80 x 2^30, 80GB and 80g = 80 x 10^9, 81920MiB. A GPU's memory or the
    weights' size never means bytes by a bare number (24 would plan 24 bytes), so it needs its unit."""

    name = "SIZE"

    def __init__(self, unit_required: bool = True) -> None:
        self.unit_required = unit_required

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from vllm_ctxmgr.core.serve_args import parse_size

        if isinstance(value, int):
            number = value
        else:
            try:
                number = parse_size(str(value), unit_required=self.unit_required)
            except CtxmgrError as exc:
                self.fail(exc.message, param, ctx)
        if not 0 < number <= MAX_BYTES:
            self.fail(f"{value!r}: a size must be positive and at most 1 PiB", param, ctx)
        return number


class VllmBytes(ByteSize):
    """A byte count as vLLM parses the same flag (human_readable_int: 20g = 20,000,000,000, 20G =
    20 x 2^30, a bare number is bytes), plus the GiB / GB spellings of the one grammar."""

    name = "BYTES"

    def __init__(self) -> None:
        super().__init__(unit_required=False)


class Finite(click.FloatRange):
    """A FloatRange that also refuses nan and inf (a plain range check lets nan through)."""

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class TimeSpan(click.ParamType):
    """Seconds, as a number (90, 1.5) or a systemd time span (10min, 1h 30min, 90s) as --every takes."""

    name = "SPAN"

    def __init__(self, low: float, high: float, *, allow_zero: bool = False) -> None:
        self.low, self.high, self.allow_zero = low, high, allow_zero

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        from vllm_ctxmgr.monitor.schedule import format_timespan, parse_timespan

        seconds = float(value) if isinstance(value, (int, float)) else parse_timespan(str(value))
        if seconds is None or not math.isfinite(seconds):
            self.fail(f"{value!r} is not a time span (seconds, or e.g. 90s, 10min, 1h 30min)", param, ctx)
        if seconds < self.low or (seconds == 0 and not self.allow_zero) or seconds > self.high:
            self.fail(f"{value!r}: must be {'' if self.allow_zero else 'above 0 and '}at most "
                      f"{format_timespan(self.high)}", param, ctx)  # fmt: skip
        return seconds


class BlockSize(click.ParamType):
    """vLLM's --block-size: positive (config/cache.py `gt=0`); its CUDA attention kernels take 1, 8 or
    multiples of 16, so 7 is refused here rather than by a 7-minute start."""

    name = "TOKENS"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = click.INT.convert(value, param, ctx)
        if not block_size_ok(number):
            self.fail(f"{value!r}: {BLOCK_SIZES}", param, ctx)
        return number


class VllmVersionArg(click.ParamType):
    """0.33.0, v0.11.0, 0.32.0+cpu."""

    name = "VERSION"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from vllm_ctxmgr.core.vllm_versions import parse_vllm_version

        text = str(value)
        version = parse_vllm_version(text)
        if version is None:
            self.fail(f"{text!r} is not a vLLM version (e.g. 0.33.0)", param, ctx)
        # older than the oldest release known: the read-only commands plan it by the oldest rules and
        # say what they do not model for it; the commands that change a service refuse it
        # (refuse_old_rules), as they refuse a plan they cannot stand behind
        return text


def refuse_old_rules(vllm_version: str | None, command: str) -> None:
    """A command that changes a service does not apply a plan made by another release's rules: a vLLM
    older than the oldest release ctxmgr knows is refused here (`plan` still plans it, read-only)."""
    from vllm_ctxmgr.core.vllm_versions import OLDEST_VLLM, parse_vllm_version

    version = parse_vllm_version(vllm_version)
    if version is not None and version < OLDEST_VLLM:
        oldest = ".".join(map(str, OLDEST_VLLM))
        raise UsageError(
            f"--vllm-version {vllm_version}: older than {oldest}, the oldest release ctxmgr knows the rules "
            f"of; {command} changes a service and refuses it (`ctxmgr plan --vllm-version {vllm_version}` "
            f"plans it read-only by {oldest}'s rules and says what they do not model)"
        )


class ServiceName(click.ParamType):
    """A unit name by systemd's rules (`vllm-glm5` means vllm-glm5.service); never a path."""

    name = "UNIT"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from vllm_ctxmgr.systemd.names import unit_name

        try:
            return unit_name(str(value))
        except CtxmgrError as exc:
            self.fail(exc.message, param, ctx)


CONTEXT = ContextArg()
SIZE = ByteSize()
VLLM_BYTES = VllmBytes()
BLOCK_SIZE = BlockSize()


class ComputeCapabilityArg(click.ParamType):
    """8.9, 12.0: a CUDA compute capability, major.minor."""

    name = "X.Y"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value  # type: ignore[return-value]
        text = str(value).strip()
        match = re.fullmatch(r"(\d{1,2})\.(\d)", text)
        if match is None:
            self.fail(f"{text[:40]!r} is not a compute capability (X.Y, e.g. 8.9 or 12.0)", param, ctx)
        return int(match.group(1)), int(match.group(2))


COMPUTE_CAPABILITY = ComputeCapabilityArg()
VLLM_VERSION = VllmVersionArg()
SERVICE = ServiceName()
UTILIZATION = Finite(0.0, 1.0, min_open=True)
TIMEOUT = TimeSpan(0.0, 7 * 24 * 3600.0)  # a start may take minutes, never "for ever"
WAIT_LOCK = TimeSpan(0.0, 24 * 3600.0, allow_zero=True)
PARALLEL = click.IntRange(1, MAX_PARALLEL)  # the same bounds as a unit's or a YAML file's flags
COUNT = click.IntRange(1, MAX_COUNT)


# ---- the options several commands share, each declared once -------------------------------------

F = TypeVar("F", bound=Callable[..., object])


@dataclass(frozen=True)
class SharedOption:
    """An option several commands take, declared once (its name, type, default and help), so two
    commands cannot drift apart on what --timeout or --gpu-memory parse. A command whose subject differs
    (every node of a deployment, not one service) says so in its own help with `but(help=...)`."""

    decls: tuple[str, ...]
    attrs: Mapping[str, Any]  # click.option's keyword arguments, typed as click types them

    def __call__(self, func: F) -> F:
        return click.option(*self.decls, **self.attrs)(func)

    def but(self, **changes: Any) -> SharedOption:
        """The same option, with these of its attributes (its help, its default) changed."""
        return SharedOption(self.decls, {**self.attrs, **changes})


def shared(*decls: str, **attrs: Any) -> SharedOption:
    return SharedOption(decls, attrs)


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator, shown in --help in the order given."""

    def decorate(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return decorate


json_option = shared("--json", "as_json", is_flag=True, help="Print one JSON object.")
# the commands that may change something: their object says whether they did
json_changed_option = json_option.but(help="Print one JSON object (with `changed`).")
yes_option = shared("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
start_timeout_option = shared(
    "--timeout", type=TIMEOUT, default="30min", show_default=True, help="Time a start may take."
)
probe_timeout_option = shared(
    "--timeout", type=TIMEOUT, default="2min", show_default=True, help="Time the probe may wait."
)
wait_lock_option = shared(
    "--wait-lock", type=WAIT_LOCK, default=0.0, help="Time to wait for another run on the service."
)
max_model_len_option = shared(
    "--max-model-len", "max_model_len", type=CONTEXT, default=None, help="The same as CONTEXT."
)
gpu_memory_utilization_option = shared("--gpu-memory-utilization", type=UTILIZATION, default=None)
probe_tokens_option = shared(
    "--probe-tokens",
    type=COUNT,
    default=None,
    help="max_tokens of the probe (default: what fills the context).",
)
long_probe_option = shared(
    "--long-probe", is_flag=True, help="Also send a prompt of about 90% of the context."
)
edit_option = shared(
    "--edit",
    type=click.Choice(["in-place", "dropin"]),
    envvar="CTXMGR_EDIT",
    default="in-place",
    show_default=True,
    help="in-place: change the file that holds ExecStart=. dropin: leave the unit file alone and write "
    "ExecStart= to UNIT.d/50-ctxmgr.conf, as `systemctl edit` would (for a unit that configuration "
    "management renders). Env CTXMGR_EDIT.",
)

gpu_memory_option = shared(
    "--gpu-memory",
    type=SIZE,
    default=None,
    help="Plan offline: memory of each GPU, with its unit: 95.6GiB, 80G (x 2^30), 80GB or 80g (x 10^9).",
)
gpu_count_option = shared("--gpu-count", type=PARALLEL, default=None, help="Plan offline: number of GPUs.")
gpus_from_option = shared(
    "--gpus-from", type=click.Path(dir_okay=False), default=None, help="`ctxmgr gpus --json` output."
)
weights_bytes_option = shared(
    "--weights-bytes",
    type=SIZE,
    default=None,
    help="Weights of all ranks together, with its unit (e.g. 406.7GiB).",
)
vllm_version_option = shared(
    "--vllm-version",
    type=VLLM_VERSION,
    default=None,
    help="Plan by this vLLM's rules (default: the version the unit runs, else the newest known).",
)
allow_long_option = shared(
    "--allow-long", is_flag=True, help="Allow a context above the model's derived maximum."
)


class PlanningFlags(TypedDict):
    """What gpu_options hand the command, by name: the fields of change.planning.PlanRequest they set."""

    gpu_memory: int | None
    gpu_count: int | None
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    gpus_from: str | None
    weights_bytes: int | None
    concurrency: int
    vllm_version: str | None
    cuda_version: str | None
    allow_long: bool
    max_gpu_memory_utilization: float
    pin_kv_cache_memory: bool


# the planning options of `plan` and `set-context`: where the GPUs' memory comes from when NVML is not
# the answer (offline, another host), and the rules to plan by
gpu_options = options(
    gpu_memory_option,
    gpu_count_option,
    shared(
        "--gpu-name",
        default=None,
        help="Plan offline: the GPU model as nvidia-smi names it (e.g. 'NVIDIA H200'), which decides "
        "backends and defaults (NVIDIA's CUDA GPUs list, Volta on).",
    ),
    shared(
        "--compute-capability",
        type=COMPUTE_CAPABILITY,
        default=None,
        help="The GPUs' CUDA compute capability (e.g. 8.9) where --gpu-name is not in NVIDIA's list "
        "ctxmgr carries, or a GPU list lacks it; vLLM's CUDA build needs 7.0 or newer.",
    ),
    gpus_from_option,
    weights_bytes_option,
    shared(
        "--concurrency",
        type=click.IntRange(1, 1 << 16),
        default=1,
        show_default=True,
        help="Size the KV cache for this many requests of the full context at once.",
    ),
    vllm_version_option,
    shared(
        "--cuda-version",
        default=None,
        metavar="X.Y",
        help="CUDA runtime of the vLLM the unit runs (its torch's, e.g. 12.8): it picks backends "
        "(FlashInfer GDN prefill on SM10x/12x only from 13). Default: read from the unit's venv.",
    ),
    allow_long_option,
    shared(
        "--max-gpu-memory-utilization",
        type=Finite(0.01, 1.0),
        default=0.95,
        show_default=True,
        help="Never pick a utilisation above this.",
    ),
    shared(
        "--pin-kv-cache-memory",
        is_flag=True,
        help="Write --kv-cache-memory-bytes at the calibrated warm KV budget: the same pool on every boot, "
        "the cold first one at a new length too; vLLM then skips profiling (a co-tenant that grows can "
        "make a start fail). Refused where no start calibrated the plan.",
    ),
)
