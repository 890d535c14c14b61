"""What every command shares: error handling, value types, the systemd to drive, output.

Light on purpose: `ctxmgr --help`, each command's --help and a completion TAB load this module, so the
project's heavier modules (the store, systemd, a change) are imported inside the functions that use them.
"""

from __future__ import annotations

import difflib
import functools
import getpass
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from vllm_ctxmgr.core.bounds import (
    BLOCK_SIZES,
    MAX_BYTES,
    MAX_CONTEXT,
    MAX_COUNT,
    MAX_PARALLEL,
    block_size_ok,
)
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError, VerifyExit
from vllm_ctxmgr.masking import scrub

if TYPE_CHECKING:
    from vllm_ctxmgr.change.observing import StartProgress
    from vllm_ctxmgr.change.restart import Restarter
    from vllm_ctxmgr.change.states import ChangeResult
    from vllm_ctxmgr.systemd.systemctl import Systemd

SCHEMA_VERSION = 2  # of every --json object; a field's meaning never changes without a new version
# 2: plan's `verdict` is its `result` (feasible | infeasible | unknown); the memory text is `memory`


# C0 controls but tab and newline, DEL, and C1: what a node's answer, a journal line or a unit may
# carry to move the cursor, recolour or rewrite the line above ("all nodes OK" printed over an error)
# (a whole escape sequence first, so no "[2K" is left behind: CSI, OSC to its terminator, ESC + one)
_CONTROLS = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def printable(text: str) -> str:
    """`text` without terminal controls: ctxmgr itself prints none (LiveStatus draws its own line)."""
    return _CONTROLS.sub("", text)


def echo(message: object = "", err: bool = False) -> None:
    """The door every text leaves by (stdout and stderr): every key of every service read is masked
    here, whichever message quotes it (masking.scrub), and every terminal control is taken out, so what
    a node, a journal or a unit says cannot drive the operator's terminal (printable). JSON escapes its
    own controls (\u001b), so it passes unchanged."""
    click.echo(printable(scrub(str(message))), err=err)


def emit_json(data: dict[str, Any]) -> None:
    """The one JSON object a command prints with --json: `schema` first, then the command's fields."""
    echo(json.dumps({"schema": SCHEMA_VERSION, **data}, indent=2, sort_keys=False, default=str))


def wants_json(args: Sequence[str]) -> bool:
    return "--json" in args


def command_of(args: Sequence[str]) -> str | None:
    """The subcommand named in a command line (global options and their values skipped)."""
    i = 0
    while i < len(args):
        word = args[i]
        if word in GLOBAL_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if not word.startswith("-"):
            return word
        i += 1
    return None


GLOBAL_OPTIONS_WITH_VALUE = ("--state-dir", "--systemd-pid", "--unit-dir")


def usage_exit(command: str | None) -> int:
    """verify speaks the monitoring-plugin convention: a check that could not run is UNKNOWN (3)."""
    return VerifyExit.UNKNOWN if command == "verify" else ExitCode.USAGE


def error_object(command: str | None, message: str, exit_code: int) -> dict[str, Any]:
    result = "locked" if command != "verify" and exit_code == ExitCode.LOCKED else "error"
    return {"command": command, "result": result, "changed": False, "error": message, "exit_code": exit_code}


def fail(message: str, exit_code: int, *, as_json: bool, command: str | None) -> NoReturn:
    """Print an expected failure as the caller asked (one line on stderr, or one JSON object) and exit."""
    if as_json:
        emit_json(error_object(command, message, exit_code))
    else:
        echo(f"ctxmgr: {message.replace(chr(9), ' ')}", err=True)
    sys.exit(exit_code)


def vllm_spelling(argv: list[str]) -> list[str]:
    """`--max_model_len 64k` as `--max-model-len 64k`: vLLM's argparse takes either spelling of every
    flag (FlexibleArgumentParser), and a unit's ExecStart may use it, so the command line takes it too.
    Only option names change (the part before `=`, and before the first dot: a dotted
    `--hf-overrides.max_position_embeddings` keeps its key, as vLLM's parser does), and nothing after a
    bare `--`."""
    out: list[str] = []
    for index, word in enumerate(argv):
        if word == "--":
            return out + argv[index:]
        name, eq, value = word.partition("=")
        head, dot, key = name.partition(".")
        if word.startswith("--") and "_" in head:
            word = head.replace("_", "-") + dot + key + eq + value
        out.append(word)
    return out


NO_ARGS_IS_HELP: type[click.UsageError] = getattr(click.exceptions, "NoArgsIsHelpError", ())  # type: ignore[assignment]


class CtxmgrGroup(click.Group):
    """click's own usage errors (a bad option, a missing argument) obey --json and verify's codes too."""

    def main(self, args: Sequence[str] | None = None, *pos: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        argv = vllm_spelling(list(sys.argv[1:] if args is None else args))
        try:
            return super().main(argv, *pos, standalone_mode=False, **kwargs)
        except NO_ARGS_IS_HELP as exc:  # a bare `ctxmgr`: the help, as asked for, not a usage error
            click.echo(exc.ctx.get_help() if exc.ctx else "")
            sys.exit(0)
        except click.exceptions.Abort:
            echo("ctxmgr: aborted", err=True)
            sys.exit(ExitCode.ERROR)
        except CtxmgrError as exc:  # from the group's own options (--state-dir)
            command = command_of(argv)
            code = usage_exit(command) if exc.exit_code == ExitCode.USAGE else exc.exit_code
            fail(exc.message, code, as_json=wants_json(argv), command=command)
        except click.ClickException as exc:
            command = command_of(argv)
            code = usage_exit(command) if isinstance(exc, click.UsageError) else exc.exit_code
            fail(click_message(exc), code, as_json=wants_json(argv), command=command)
        except Exception as exc:  # a bug outside any command (the group's own options): exit 70 too
            if "--debug" in argv:
                raise
            message = f"unexpected error: {type(exc).__name__}: {exc} (run with --debug)"
            fail(message, ExitCode.INTERNAL, as_json=wants_json(argv), command=command_of(argv))


def click_message(exc: click.ClickException) -> str:
    """click's own usage error as one line, like every other error (not click's four-line usage block):
    the command, what is wrong, the closest option of that command, where to read more."""
    ctx = exc.ctx if isinstance(exc, click.UsageError) else None
    where = " ".join(ctx.command_path.split()[1:]) if ctx is not None else ""
    if isinstance(exc, click.NoSuchOption) and ctx is not None:
        guess = closest_option(exc.option_name, ctx.command)
        message = f"no such option {exc.option_name}" + (f"; did you mean {guess}?" if guess else "")
    else:
        message = exc.format_message().rstrip(".")
    help_hint = f" (ctxmgr {where + ' ' if where else ''}--help)" if ctx is not None else ""
    return (f"{where}: " if where else "") + message + help_hint


def closest_option(name: str, command: click.Command) -> str | None:
    """The command's own option closest to a misspelt `name`, as its long name (with the short spelling
    that matched: `--tp` finds `-tp`, answered as `--tensor-parallel-size (-tp)`); None if none is close.
    ctxmgr's options answer first; vLLM's flags are for the caller to try next."""
    spellings: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            for opt in (*param.opts, *param.secondary_opts):
                spellings[opt] = param
    matches = difflib.get_close_matches(name, list(spellings), n=1, cutoff=0.75)
    if not matches:
        return None
    option = spellings[matches[0]]
    long = max(option.opts, key=len)
    return long if matches[0] == long else f"{long} ({matches[0]})"


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures: one line on stderr (or one JSON object with --json) and the documented exit
    code; a permission problem names the path; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        # verify's exit codes go by the command's own name (`deployment verify` too); the JSON names
        # the whole path under ctxmgr (`deployment set-context`, `node show`)
        command = ctx.info_name
        path = " ".join(ctx.command_path.split()[1:]) or command
        as_json = bool(ctx.params.get("as_json"))
        try:
            return func(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, KeyboardInterrupt):
            raise
        except CtxmgrError as exc:
            if debug:
                raise
            code = usage_exit(command) if exc.exit_code == ExitCode.USAGE else exc.exit_code
            if command == "verify" and exc.exit_code == ExitCode.ERROR:
                code = VerifyExit.UNKNOWN
            fail(exc.message, code, as_json=as_json, command=path)
        except PermissionError as exc:
            if debug:
                raise
            where = exc.filename or "a file ctxmgr needs"
            fail(
                f"permission denied on {where}: changing services, their state directory and the journal "
                "needs root (run with sudo, or point --state-dir at a directory you own)",
                VerifyExit.UNKNOWN if command == "verify" else ExitCode.ERROR,
                as_json=as_json,
                command=path,
            )
        except Exception as exc:
            if debug:
                raise
            message = f"unexpected error: {type(exc).__name__}: {exc} (run with --debug)"
            fail(message, ExitCode.INTERNAL, as_json=as_json, command=path)

    return wrapper


# ---- values, checked at the door ----------------------------------------------------------------


class ContextArg(click.ParamType):
    """A context length as vLLM reads --max-model-len: 200000, 200k (x1,000), 195K (x1,024), auto or -1."""

    name = "CONTEXT"

    def __init__(self, allow_auto: bool = True) -> None:
        self.allow_auto = allow_auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class TimeSpan(click.ParamType):
    """Seconds, as a number (90, 1.5) or a systemd time span (10min, 1h 30min, 90s) as --every takes."""

    name = "SPAN"

    def __init__(self, low: float, high: float, *, allow_zero: bool = False) -> None:
        self.low, self.high, self.allow_zero = low, high, allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = click.INT.convert(value, param, ctx)
        if not block_size_ok(number):
            self.fail(f"{value!r}: {BLOCK_SIZES}", param, ctx)
        return number


class VllmVersionArg(click.ParamType):
    """0.33.0, v0.11.0, 0.32.0+cpu."""

    name = "VERSION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from vllm_ctxmgr.systemd.names import unit_name

        try:
            return unit_name(str(value))
        except CtxmgrError as exc:
            self.fail(exc.message, param, ctx)


def complete_services(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of the host's vLLM services, found the way `ctxmgr status` finds them.

    The group's callback has not run while the shell completes, so the systemd to ask comes from the
    root's parsed options; any failure completes nothing rather than printing into the shell."""
    from click.shell_completion import CompletionItem

    from vllm_ctxmgr.monitor.status import vllm_units
    from vllm_ctxmgr.systemd.systemctl import Systemd

    root = ctx.find_root().params
    try:
        systemd = Systemd.for_pid(root["systemd_pid"]) if root.get("systemd_pid") else Systemd.local()
        names = [name.removesuffix(".service") for name in vllm_units(systemd)]
    except Exception:  # completion must never break the shell
        return []
    return [CompletionItem(name) for name in sorted(names) if name.startswith(incomplete)]


def one_service(argument: str | None, option: str | None, *, required: bool = True) -> str | None:
    """SERVICE as an argument (as systemctl and journalctl take it) or as --service (what the cards and
    the Ansible module say): either, or both when they name the same unit."""
    if argument and option and argument != option:
        raise UsageError(f"SERVICE {argument} and --service {option} disagree; give one")
    chosen = argument or option
    if chosen is None and required:
        raise UsageError(
            "give the service: ctxmgr COMMAND SERVICE, or --service SERVICE "
            "(`ctxmgr status` lists the vLLM services on this host)"
        )
    return chosen


def service_param(
    required: bool = True, argument: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """SERVICE as an optional argument and as --service, merged into the command's `service`, both
    completed with the host's vLLM services. Place it right after the command's other arguments."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, service_arg: str | None = None, **kwargs: Any) -> Any:
            kwargs["service"] = one_service(service_arg, kwargs.get("service"), required=required)
            return func(*args, **kwargs)

        wrapper = click.option(
            "--service",
            type=SERVICE,
            default=None,
            shell_complete=complete_services,
            help="The systemd service that runs vLLM (the same as SERVICE).",
        )(wrapper)
        if not argument:
            return wrapper
        return click.argument(
            "service_arg", metavar="[SERVICE]", type=SERVICE, required=False, shell_complete=complete_services
        )(wrapper)

    return decorate


CONTEXT = ContextArg()
SIZE = ByteSize()
VLLM_BYTES = VllmBytes()
BLOCK_SIZE = BlockSize()
VLLM_VERSION = VllmVersionArg()
SERVICE = ServiceName()
UTILIZATION = Finite(0.0, 1.0, min_open=True)
TIMEOUT = TimeSpan(0.0, 7 * 24 * 3600.0)  # a start may take minutes, never "for ever"
WAIT_LOCK = TimeSpan(0.0, 24 * 3600.0, allow_zero=True)
PARALLEL = click.IntRange(1, MAX_PARALLEL)  # the same bounds as a unit's or a YAML file's flags
COUNT = click.IntRange(1, MAX_COUNT)


def examples(*lines: str) -> str:
    """A command's epilog: its examples, one per line, kept as written."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLES = {
    "facts": examples(
        "ctxmgr facts /srv/models/Llama-3.1-70B-Instruct",
        "ctxmgr facts Qwen/Qwen3-8B --json            # a repo in the HF cache",
    ),
    "gpus": examples(
        "ctxmgr gpus", "ctxmgr gpus --json > h200.json     # for plan --gpus-from on another host"
    ),
    "plan": examples(
        "ctxmgr plan 200000 --service vllm-glm5         # what set-context would do to a service",
        "ctxmgr plan auto --service vllm-glm5          # the largest context that fits",
        "ctxmgr plan --unit units/vllm-llama70b.service --model examples/models/llama-3.1-70b \\",
        "    --gpu-memory 80GiB --gpu-count 4            # a shipped unit against a local model",
        "ctxmgr plan 128k --model /srv/models/X -tp 8 --gpu-memory 141GiB --gpu-count 8 --kv-cache-dtype fp8",
    ),
    "set-context": examples(
        "ctxmgr set-context 200000 vllm-glm5 --dry-run  # the plan and the unit diff",
        "sudo ctxmgr set-context 200k vllm-glm5 --yes",
        "sudo ctxmgr set-context auto --service vllm-glm5 --timeout 45min --json",
    ),
    "rollback": examples(
        "ctxmgr rollback vllm-glm5 --dry-run", "sudo ctxmgr rollback vllm-glm5 --to 3 --yes"
    ),
    "recover": examples("sudo ctxmgr recover vllm-glm5"),
    "history": examples("ctxmgr history vllm-glm5", "ctxmgr history --service vllm-glm5 --json"),
    "observe": examples(
        "sudo ctxmgr observe vllm-glm5",
        "sudo ctxmgr observe vllm-glm5 --json > start.json",
        "sudo ctxmgr observe vllm-glm5 --import start.json   # on another host, same GPU and vLLM",
    ),
    "verify": examples(
        "sudo ctxmgr verify vllm-glm5",
        "sudo ctxmgr verify vllm-glm5 --on-failure rollback --textfile /var/lib/node_exporter/glm5.prom",
    ),
    "schedule": examples(
        "sudo ctxmgr schedule vllm-glm5 --every 15min",
        "sudo ctxmgr schedule vllm-glm5 --every '*:0/30' --on-failure restart",
    ),
    "unschedule": examples("sudo ctxmgr unschedule vllm-glm5"),
    "status": examples("ctxmgr status", "ctxmgr status --json"),
}


def systemd_for(ctx: click.Context) -> Systemd:
    from vllm_ctxmgr.systemd.systemctl import Systemd

    obj = ctx.find_root().obj
    systemd = Systemd.for_pid(obj["systemd_pid"]) if obj["systemd_pid"] else Systemd.local()
    if obj["unit_dir"]:
        systemd.unit_dir = Path(obj["unit_dir"])
    return systemd


def check_state_dir(value: str) -> str:
    """An empty --state-dir would silently be the current directory; a file cannot hold revisions."""
    if not value.strip():
        raise UsageError("--state-dir cannot be empty (default /var/lib/ctxmgr)")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--state-dir {value}: not a directory")
    resolved = path.resolve()
    if len(resolved.parts) > 1 and resolved.parts[1] in ("proc", "sys", "dev"):
        # the kernel's own trees: nothing ctxmgr writes can live there (and /proc/self is a link)
        raise UsageError(f"--state-dir {value}: in /{resolved.parts[1]}, the kernel's tree, not a directory "
                         "for ctxmgr's revisions (default /var/lib/ctxmgr)")  # fmt: skip
    return value


def gpu_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where the GPUs' memory comes from when NVML is not the answer (offline, another host)."""
    for option in reversed(
        [
            click.option(
                "--gpu-memory",
                type=SIZE,
                default=None,
                help="Plan offline: memory of each GPU, with its unit: 95.6GiB, 80G (x 2^30), 80GB or "
                "80g (x 10^9).",
            ),
            click.option(
                "--gpu-count",
                type=click.IntRange(1, MAX_PARALLEL),
                default=None,
                help="Plan offline: number of GPUs.",
            ),
            click.option(
                "--gpu-name",
                default=None,
                help="Plan offline: the GPU model (e.g. 'NVIDIA H200'), which decides backends and defaults.",
            ),
            click.option(
                "--gpus-from",
                type=click.Path(dir_okay=False),
                default=None,
                help="`ctxmgr gpus --json` output.",
            ),
            click.option(
                "--weights-bytes",
                type=SIZE,
                default=None,
                help="Weights of all ranks together, with its unit (e.g. 406.7GiB).",
            ),
            click.option(
                "--concurrency",
                type=click.IntRange(1, 1 << 16),
                default=1,
                show_default=True,
                help="Size the KV cache for this many requests of the full context at once.",
            ),
            click.option(
                "--vllm-version",
                type=VLLM_VERSION,
                default=None,
                help="Plan by this vLLM's rules (default: the version the unit runs, else the newest known).",
            ),
            click.option(
                "--cuda-version",
                default=None,
                metavar="X.Y",
                help="CUDA runtime of the vLLM the unit runs (its torch's, e.g. 12.8): it picks backends "
                "(FlashInfer GDN prefill on SM10x/12x only from 13). Default: read from the unit's venv.",
            ),
            click.option(
                "--allow-long", is_flag=True, help="Allow a context above the model's derived maximum."
            ),
            click.option(
                "--max-gpu-memory-utilization",
                type=Finite(0.01, 1.0),
                default=0.95,
                show_default=True,
                help="Never pick a utilisation above this.",
            ),
        ]
    ):
        func = option(func)
    return func


def restarter_for(ctx: click.Context, service: str, as_json: bool, timeout: float) -> Restarter:
    """The restart path for a service systemd knows, under its canonical name (an alias shares the
    real unit's lock, journal and history); an unknown service stops here, before anything is written."""
    from vllm_ctxmgr.change.restart import Restarter
    from vllm_ctxmgr.store import ServiceStore
    from vllm_ctxmgr.systemd.names import canonical_unit

    systemd = systemd_for(ctx)
    unit = canonical_unit(systemd, service)
    store = ServiceStore(ctx.find_root().obj["state_dir"], unit)

    live = LiveStatus(enabled=not as_json, terminal=sys.stderr.isatty())

    def say(text: str) -> None:
        if not as_json:
            live.clear()
            echo(f"ctxmgr: {text}", err=True)

    def vllm_line(text: str) -> None:
        if not as_json:
            live.clear()
            echo(f"  | {text[:160]}", err=True)

    return Restarter(
        systemd, store, unit, on_line=vllm_line, on_step=say, start_timeout=timeout, on_tick=live.tick
    )


class LiveStatus:
    """While a start is watched: on a terminal, one status line rewritten every second (phase from vLLM's
    lines, elapsed, time left, a bar where vLLM counts); elsewhere (a pipe, the journal, Ansible's log)
    a plain timestamped line every `every` seconds. No colour either way; the terminal line only uses
    carriage return and erase-line, so NO_COLOR has nothing to turn off."""

    def __init__(self, enabled: bool, terminal: bool, every: float = 30.0) -> None:
        self.enabled, self.terminal, self.every = enabled, terminal, every
        self.shown = False
        self.last = time.monotonic()

    def tick(self, progress: StartProgress) -> None:
        if not self.enabled:
            return
        if self.terminal:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stderr.write("\r\x1b[K" + printable(scrub(progress.text()))[:width])
            sys.stderr.flush()
            self.shown = True
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            echo(f"ctxmgr: {time.strftime('%H:%M:%S')} {progress.text()}", err=True)

    def clear(self) -> None:
        """Erase the status line before a line of its own is printed (it is drawn again next tick)."""
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def confirmation(yes: bool, as_json: bool, unit: str) -> Callable[[ChangeResult], bool] | None:
    """What set-context and rollback show and ask before they write: the callback is shown the change
    under the service's lock, so the diff confirmed is the diff applied, and the diff and the plan are
    on the screen before a restart that may take minutes (--yes: shown, not asked; --json: neither).
    Not a terminal and no --yes: nothing is changed, and the change is printed for the operator."""
    from vllm_ctxmgr import report

    if yes and as_json:
        return None

    def ask(result: ChangeResult) -> bool:
        if yes and result.pending_recovery is not None:
            return True  # recover says what it does as it does it; the pending text is a dry run's
        if not as_json:
            echo(report.change_text(result), err=True)
        if yes:
            return True
        if result.pending_recovery is not None:
            question = f"first put back the unit that revision {result.pending_recovery} replaced"
        else:
            question = f"restart {unit} with max_model_len {result.max_model_len}"
        if not sys.stdin.isatty():
            raise UsageError(
                f"{question}: not a terminal, so nothing was changed; pass --yes to apply without a prompt"
            )
        return click.confirm(f"{question}?", default=False, err=True)

    return ask


def finish(
    result: ChangeResult, as_json: bool, *, dry_run: bool = False, systemd: Systemd | None = None
) -> None:
    """Print a change's result, log it to the journal, exit with its code.

    The automation contract: on a dry run `changed` means "would change" and `dry_run` is true, as
    Ansible's check mode reads it.
    """
    from vllm_ctxmgr import report
    from vllm_ctxmgr.change.states import Result

    data = result.to_json()
    data = {"command": result.action, **data, "dry_run": dry_run}
    if dry_run:
        data["changed"] = result.result is Result.DRY_RUN
    if systemd is not None and not dry_run:
        log_change(systemd, result)
    if as_json:
        emit_json(data)
    else:
        # the diff and the plan were shown before the restart (confirmation): the end says how it went
        echo(report.change_text(result, shown_before=not dry_run))
    sys.exit(result.exit_code)


def log_change(systemd: Systemd, result: ChangeResult) -> None:
    from vllm_ctxmgr.change.states import Result
    from vllm_ctxmgr.systemd.log import Priority, send

    # journald priorities of the results of a change: what an operator's alerting should see
    result_priority = {
        Result.APPLIED: Priority.INFO,
        Result.UNCHANGED: Priority.INFO,
        Result.DRY_RUN: Priority.DEBUG,
        Result.INFEASIBLE: Priority.NOTICE,
        Result.ROLLED_BACK: Priority.WARNING,
        Result.ROLLBACK_FAILED: Priority.CRIT,
    }
    before, after = result.previous_max_model_len, result.max_model_len
    message = f"{result.service}: {result.action} {result.result}"
    if result.changed or result.result in (Result.ROLLED_BACK, Result.ROLLBACK_FAILED):
        message += f" (max_model_len {before or 'default'} -> {after or 'default'})"
    if result.reason:
        message += f": {result.reason}"
    send(
        systemd,
        message,
        result_priority.get(result.result, Priority.ERR),
        service=result.service,
        action=result.action,
        result=result.result,
        revision=result.revision,
        max_model_len=after,
        previous_max_model_len=before,
        gpu_memory_utilization=result.gpu_memory_utilization,
        exit_code=result.exit_code,
        user=invoking_user(),
    )


def invoking_user() -> str:
    """Who asked: the sudo caller where there is one, else the user ctxmgr runs as."""
    return os.environ.get("SUDO_USER") or getpass.getuser()
