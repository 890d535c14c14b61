"""The end of a change (a service's or a deployment's): its result printed, logged to the journal, its
exit code."""

from __future__ import annotations

import functools
import getpass
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from vllm_ctxmgr.cli.output import echo, emit_json

if TYPE_CHECKING:
    from vllm_ctxmgr.change.states import ChangeResult
    from vllm_ctxmgr.systemd.systemctl import Systemd


def finish(
    result: ChangeResult, as_json: bool, *, dry_run: bool = False, systemd: Systemd | None = None
) -> NoReturn:
    """Print a service's change, log it to the journal, exit with its code."""
    from vllm_ctxmgr import report

    if systemd is not None and not dry_run:
        log_change(systemd, result)
    # the diff and the plan were shown before the restart (confirmation): the end says how it went
    text = functools.partial(report.change_text, result, shown_before=not dry_run)
    conclude(result.action, result, text, as_json, dry_run=dry_run)


def conclude(
    command: str, outcome: ChangeResult, text: Callable[[], str], as_json: bool, *, dry_run: bool = False
) -> NoReturn:
    """Print what a command did (its text, or one JSON object) and exit with its code.

    The automation contract: on a dry run `changed` means "would change" and `dry_run` is true, as
    Ansible's check mode reads it.
    """
    from vllm_ctxmgr.change.states import Result

    data = {"command": command, **outcome.to_json(), "dry_run": dry_run}
    if dry_run:
        data["changed"] = outcome.result == Result.DRY_RUN
    if as_json:
        emit_json(data)
    else:
        echo(text())
    sys.exit(outcome.exit_code)


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
