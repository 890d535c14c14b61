"""What every command shares: error handling, value types, the systemd to drive, output."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from vllm_ctxmgr import report
from vllm_ctxmgr.core.serve_args import human_readable_int
from vllm_ctxmgr.deploy import Deployer
from vllm_ctxmgr.errors import EXIT_ERROR, CtxmgrError, UsageError
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.systemctl import Systemd


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures: one line on stderr and the documented exit code; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        try:
            return func(*args, **kwargs)
        except CtxmgrError as exc:
            if debug:
                raise
            click.echo(f"ctxmgr: {exc.message}", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, KeyboardInterrupt):
            raise
        except Exception as exc:
            if debug:
                raise
            click.echo(f"ctxmgr: unexpected error: {type(exc).__name__}: {exc} (run with --debug)", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper


class ContextArg(click.ParamType):
    """A context length: 200000, 200k, 128K (vLLM's own forms)."""

    name = "CONTEXT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            try:
                number = human_readable_int(str(value))
            except CtxmgrError:
                self.fail(f"{value!r} is not a context length (use e.g. 200000, 200k or 128K)", param, ctx)
        if number <= 0:
            self.fail(f"{value!r}: a context length must be positive", param, ctx)
        return number


class ByteSize(click.ParamType):
    """95.6GiB, 80G (GiB), 81920MiB, or plain bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:

        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
        if not match:
            self.fail(f"{value!r} is not a size (use e.g. 95.6GiB, 80G, 81920MiB)", param, ctx)
        number, unit = match.groups()
        unit = (unit or "B").upper().rstrip("B").rstrip("I")
        scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        return int(float(number) * scale)


CONTEXT = ContextArg()
SIZE = ByteSize()


def systemd_for(ctx: click.Context):  # type: ignore[no-untyped-def]

    obj = ctx.find_root().obj
    systemd = Systemd.for_pid(obj["systemd_pid"]) if obj["systemd_pid"] else Systemd.local()
    if obj["unit_dir"]:
        systemd.unit_dir = Path(obj["unit_dir"])
    return systemd


def gpu_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where the GPUs' memory comes from when NVML is not the answer (offline, another host)."""
    for option in reversed(
        [
            click.option("--gpu-memory", type=SIZE, default=None, help="Plan offline: memory of each GPU."),
            click.option("--gpu-count", type=int, default=None, help="Plan offline: number of GPUs."),
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
            click.option("--weights-bytes", type=SIZE, default=None, help="Weights of all ranks together."),
            click.option(
                "--vllm-version", default=None, help="Plan by this vLLM's rules (default: newest known)."
            ),
            click.option(
                "--allow-long", is_flag=True, help="Allow a context above the model's derived maximum."
            ),
            click.option(
                "--max-gpu-memory-utilization",
                type=click.FloatRange(0.01, 1.0),
                default=0.95,
                show_default=True,
                help="Never pick a utilisation above this.",
            ),
        ]
    ):
        func = option(func)
    return func


def deployer_for(ctx: click.Context, service: str, as_json: bool, timeout: float) -> Any:

    store = ServiceStore(ctx.find_root().obj["state_dir"], service.removesuffix(".service"))

    def say(text: str) -> None:
        if not as_json:
            click.echo(f"ctxmgr: {text}", err=True)

    def vllm_line(text: str) -> None:
        if not as_json:
            click.echo(f"  | {text[:160]}", err=True)

    return Deployer(systemd_for(ctx), store, service, on_line=vllm_line, on_step=say, start_timeout=timeout)


def confirm(yes: bool, what: str) -> None:

    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"{what}: not a terminal, so nothing was changed; pass --yes to apply without a prompt"
        )
    if not click.confirm(f"{what}?", default=False, err=True):
        raise UsageError("nothing was changed")


def finish(result: Any, as_json: bool) -> None:

    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(report.change_text(result))
    sys.exit(result.exit_code)
