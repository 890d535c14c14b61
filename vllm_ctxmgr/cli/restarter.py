"""The systemd a command drives, and the Restarter a command that changes a service goes through."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from vllm_ctxmgr.cli.output import echo
from vllm_ctxmgr.cli.progress import LiveStatus

if TYPE_CHECKING:
    from vllm_ctxmgr.change.restart import Restarter
    from vllm_ctxmgr.systemd.systemctl import Systemd


def systemd_for(ctx: click.Context) -> Systemd:
    from vllm_ctxmgr.systemd.systemctl import Systemd

    obj = ctx.find_root().obj
    systemd = Systemd.for_pid(obj["systemd_pid"]) if obj["systemd_pid"] else Systemd.local()
    if obj["unit_dir"]:
        systemd.unit_dir = Path(obj["unit_dir"])
    return systemd


ECHO_WIDTH = 160  # a vLLM line as the restart follows it; the decisive line is printed whole after


def journal_echo(text: str, width: int = ECHO_WIDTH) -> str:
    """A journal line cut to `width` characters, saying so with "..." (never cut mid-sentence silently)."""
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def restarter_for(ctx: click.Context, service: str, *, as_json: bool, timeout: float) -> Restarter:
    """A command's restart path (change.restart.restarter_for_service) with this run's systemd and state
    directory, printing its steps and vLLM's lines on stderr unless the command prints JSON."""
    from vllm_ctxmgr.change.restart import restarter_for_service

    live = LiveStatus(enabled=not as_json, terminal=sys.stderr.isatty())

    def say(text: str) -> None:
        if not as_json:
            live.clear()
            echo(f"ctxmgr: {text}", err=True)

    def vllm_line(text: str) -> None:
        if not as_json:
            live.clear()
            echo(f"  | {journal_echo(text)}", err=True)

    state_dir = ctx.find_root().obj["state_dir"]
    return restarter_for_service(
        systemd_for(ctx), state_dir, service, start_timeout=timeout, on_step=say, on_line=vllm_line,
        on_tick=live.tick,
    )  # fmt: skip
