"""The confirmation before a change restarts a service (or every node of a deployment)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from vllm_ctxmgr.cli.output import echo
from vllm_ctxmgr.errors import UsageError

if TYPE_CHECKING:
    from vllm_ctxmgr.change.states import ChangeResult


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
        return ask_before(question)

    return ask


def ask_before(question: str) -> bool:
    """The operator's yes, asked on the terminal (a service's change and a deployment's ask the same);
    with no terminal to ask on, nothing is changed and the error says how to apply without a prompt."""
    if not sys.stdin.isatty():
        raise UsageError(
            f"{question}: not a terminal, so nothing was changed; pass --yes to apply without a prompt"
        )
    return click.confirm(f"{question}?", default=False, err=True)
