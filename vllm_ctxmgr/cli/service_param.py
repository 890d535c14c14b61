"""SERVICE, as an argument and as --service, completed with the host's vLLM services."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from vllm_ctxmgr.cli.params import SERVICE
from vllm_ctxmgr.errors import UsageError

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem


def complete_services(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
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


Command = Callable[..., None]  # a click command's callback: click passes its parameters by name


def service_param(required: bool = True, argument: bool = True) -> Callable[[Command], Command]:
    """SERVICE as an optional argument and as --service, merged into the command's `service`, both
    completed with the host's vLLM services. Place it right after the command's other arguments."""

    def decorate(func: Command) -> Command:
        @functools.wraps(func)
        def wrapper(*args: Any, service_arg: str | None = None, **kwargs: Any) -> None:
            kwargs["service"] = one_service(service_arg, kwargs.get("service"), required=required)
            func(*args, **kwargs)

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
