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
            echo(f"  | {journal_echo(text)}", err=True)

    return Restarter(
        systemd, store, unit, on_line=vllm_line, on_step=say, start_timeout=timeout, on_tick=live.tick
    )
