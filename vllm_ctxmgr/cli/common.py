"""What every command shares: error handling, value types, the systemd to drive, output."""

from __future__ import annotations

import functools
import getpass
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from vllm_ctxmgr import report
from vllm_ctxmgr.core.serve_args import human_readable_int
from vllm_ctxmgr.core.vllm_versions import OLDEST_VLLM, parse_vllm_version
from vllm_ctxmgr.deploy import ChangeResult, Deployer
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError, VerifyExit
from vllm_ctxmgr.masking import scrub
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.log import Priority, send
from vllm_ctxmgr.systemd.names import canonical_unit, unit_name
from vllm_ctxmgr.systemd.systemctl import Systemd

SCHEMA_VERSION = 1  # of every --json object; a field's meaning never changes without a new version


def echo(message: object = "", err: bool = False) -> None:
    """The door every text leaves by (stdout and stderr): every key of every service read is masked
    here, whichever message quotes it (masking.scrub)."""
    click.echo(scrub(str(message)), err=err)


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
        echo(f"ctxmgr: {message}", err=True)
    sys.exit(exit_code)


class CtxmgrGroup(click.Group):
    """click's own usage errors (a bad option, a missing argument) obey --json and verify's codes too."""

    def main(self, args: Sequence[str] | None = None, *pos: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        try:
            return super().main(argv, *pos, standalone_mode=False, **kwargs)
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
            if wants_json(argv):
                emit_json(error_object(command, exc.format_message(), code))
            else:
                exc.show()
            sys.exit(code)


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures: one line on stderr (or one JSON object with --json) and the documented exit
    code; a permission problem names the path; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        command = ctx.info_name
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
            fail(exc.message, code, as_json=as_json, command=command)
        except PermissionError as exc:
            if debug:
                raise
            where = exc.filename or "a file ctxmgr needs"
            fail(
                f"permission denied on {where}: changing services, their state directory and the journal "
                "needs root (run with sudo, or point --state-dir at a directory you own)",
                VerifyExit.UNKNOWN if command == "verify" else ExitCode.ERROR,
                as_json=as_json,
                command=command,
            )
        except Exception as exc:
            if debug:
                raise
            message = f"unexpected error: {type(exc).__name__}: {exc} (run with --debug)"
            fail(message, ExitCode.ERROR, as_json=as_json, command=command)

    return wrapper


# ---- values, checked at the door ----------------------------------------------------------------


class ContextArg(click.ParamType):
    """A context length as vLLM reads --max-model-len: 200000, 200k (x1,000), 195K (x1,024), auto or -1."""

    name = "CONTEXT"

    def __init__(self, allow_auto: bool = True) -> None:
        self.allow_auto = allow_auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
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


AUTO_CONTEXT = -1  # `auto` / -1: the largest context that fits, as `vllm serve --max-model-len auto`
MAX_CONTEXT = 1 << 32


class ByteSize(click.ParamType):
    """ctxmgr's own sizes: 95.6GiB, 80G and 80GB (all GiB), 81920MiB, or plain bytes; positive."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
            if not match:
                self.fail(f"{value!r} is not a size (use e.g. 95.6GiB, 80G, 81920MiB)", param, ctx)
            digits, unit = match.groups()
            unit = (unit or "B").upper().rstrip("B").rstrip("I")
            scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
            number = int(float(digits) * scale)
        if not 0 < number <= MAX_BYTES:
            self.fail(f"{value!r}: a size must be positive and at most 1 PiB", param, ctx)
        return number


MAX_BYTES = 1 << 50


class VllmBytes(click.ParamType):
    """A byte count exactly as vLLM parses the same flag: 20g = 20,000,000,000, 20G = 20 x 2**30."""

    name = "BYTES"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number = value if isinstance(value, int) else human_readable_int(str(value))
        except CtxmgrError as exc:
            self.fail(exc.message, param, ctx)
        if not 0 < number <= MAX_BYTES:
            self.fail(f"{value!r}: must be positive and at most 1 PiB", param, ctx)
        return number


class Finite(click.FloatRange):
    """A FloatRange that also refuses nan and inf (a plain range check lets nan through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class BlockSize(click.ParamType):
    """vLLM's --block-size: positive (config/cache.py `gt=0`); its CUDA attention kernels take 1, 8 or
    multiples of 16, so 7 is refused here rather than by a 7-minute start."""

    name = "TOKENS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = click.INT.convert(value, param, ctx)
        if number not in (1, 8) and not (number > 0 and number % 16 == 0 and number <= 4096):
            self.fail(f"{value!r}: vLLM's block sizes are 1, 8 or a multiple of 16 up to 4096", param, ctx)
        return number


class VllmVersionArg(click.ParamType):
    """0.33.0, v0.11.0, 0.32.0+cpu."""

    name = "VERSION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        version = parse_vllm_version(text)
        if version is None:
            self.fail(f"{text!r} is not a vLLM version (e.g. 0.33.0)", param, ctx)
        if version < OLDEST_VLLM:
            # above the newest known, the plan says whose rules it used; below the oldest, none fit
            oldest = ".".join(map(str, OLDEST_VLLM))
            self.fail(
                f"vLLM {text} is older than {oldest}, the oldest release ctxmgr knows the rules of",
                param,
                ctx,
            )
        return text


class ServiceName(click.ParamType):
    """A unit name by systemd's rules (`vllm-glm5` means vllm-glm5.service); never a path."""

    name = "UNIT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return unit_name(str(value))
        except CtxmgrError as exc:
            self.fail(exc.message, param, ctx)


CONTEXT = ContextArg()
SIZE = ByteSize()
VLLM_BYTES = VllmBytes()
BLOCK_SIZE = BlockSize()
VLLM_VERSION = VllmVersionArg()
SERVICE = ServiceName()
UTILIZATION = Finite(0.0, 1.0, min_open=True)
TIMEOUT = Finite(0.0, 7 * 24 * 3600.0, min_open=True)  # a start may take minutes, never "for ever"
WAIT_LOCK = Finite(0.0, 24 * 3600.0)
PARALLEL = click.IntRange(1, 1024)
COUNT = click.IntRange(1, 1 << 24)


def systemd_for(ctx: click.Context) -> Systemd:
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
                help="Plan offline: memory of each GPU (95.6GiB, 80G = GiB).",
            ),
            click.option(
                "--gpu-count",
                type=click.IntRange(1, 1024),
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
                help="Weights of all ranks together (e.g. 406.7GiB).",
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


def deployer_for(ctx: click.Context, service: str, as_json: bool, timeout: float) -> Deployer:
    """The orchestrator for a service systemd knows, under its canonical name (an alias shares the
    real unit's lock, journal and history); an unknown service stops here, before anything is written."""
    systemd = systemd_for(ctx)
    unit = canonical_unit(systemd, service)
    store = ServiceStore(ctx.find_root().obj["state_dir"], unit)

    def say(text: str) -> None:
        if not as_json:
            echo(f"ctxmgr: {text}", err=True)

    def vllm_line(text: str) -> None:
        if not as_json:
            echo(f"  | {text[:160]}", err=True)

    return Deployer(systemd, store, unit, on_line=vllm_line, on_step=say, start_timeout=timeout)


def confirm(yes: bool, what: str) -> None:

    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"{what}: not a terminal, so nothing was changed; pass --yes to apply without a prompt"
        )
    if not click.confirm(f"{what}?", default=False, err=True):
        raise UsageError("nothing was changed")


# journald priorities of the results of a change: what an operator's alerting should see
RESULT_PRIORITY = {
    "applied": Priority.INFO,
    "unchanged": Priority.INFO,
    "dry-run": Priority.DEBUG,
    "infeasible": Priority.NOTICE,
    "rolled-back": Priority.WARNING,
    "rollback-failed": Priority.CRIT,
}


def finish(
    result: ChangeResult, as_json: bool, *, dry_run: bool = False, systemd: Systemd | None = None
) -> None:
    """Print a change's result, log it to the journal, exit with its code.

    The automation contract: on a dry run `changed` means "would change" and `dry_run` is true, as
    Ansible's check mode reads it.
    """
    data = result.to_json()
    data = {"command": result.action, **data, "dry_run": dry_run}
    if dry_run:
        data["changed"] = result.result == "dry-run"
    if systemd is not None and not dry_run:
        log_change(systemd, result)
    if as_json:
        emit_json(data)
    else:
        echo(report.change_text(result))
    sys.exit(result.exit_code)


def log_change(systemd: Systemd, result: ChangeResult) -> None:
    before, after = result.previous_max_model_len, result.max_model_len
    message = f"{result.service}: {result.action} {result.result}"
    if result.changed or result.result in ("rolled-back", "rollback-failed"):
        message += f" (max_model_len {before or 'default'} -> {after or 'default'})"
    if result.reason:
        message += f": {result.reason}"
    send(
        systemd,
        message,
        RESULT_PRIORITY.get(result.result, Priority.ERR),
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
