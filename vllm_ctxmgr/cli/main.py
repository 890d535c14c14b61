"""The command line: the `ctxmgr` group and the table of its commands, each imported when it runs.

Importing every module of the project before a word is parsed cost half a second of CPU on each
`ctxmgr --help` and each completion TAB. This module imports only click and the light cli/group.py
(with cli/output.py); the group imports a command's module from COMMANDS when that command is asked
for (click's lazy group pattern), and lists the commands (`--help`, completion) from the table's short
help, which tests/cli/test_cli.py checks against each command's own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from vllm_ctxmgr.cli.group import CtxmgrGroup, check_state_dir

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem


@dataclass(frozen=True)
class LazyCommand:
    """Where a command lives (module and attribute) and its short help, shown without importing it."""

    module: str
    attribute: str
    short_help: str


# Operating services over time (verify, schedule, unschedule, status) lives in cli/ops.py; one deployment
# over several machines, and the steps its coordinator runs on each, in cli/deployment.py.
COMMANDS = {
    "deployment": LazyCommand(
        "vllm_ctxmgr.cli.deployment",
        "deployment_group",
        "One vLLM deployment over several machines (vLLM's --nnodes / --headless), changed as one.",
    ),
    "facts": LazyCommand(
        "vllm_ctxmgr.cli.facts",
        "facts",
        "What vLLM will see in MODEL: a HF model dir, a cached repo id, or a GGUF file.",
    ),
    "gpus": LazyCommand(
        "vllm_ctxmgr.cli.facts",
        "gpus",
        "The GPUs on this host: total, free, used, and who uses them (NVML).",
    ),
    "history": LazyCommand(
        "vllm_ctxmgr.cli.change",
        "history_cmd",
        "Every revision ctxmgr made of a service: time, context, utilisation, result, reason.",
    ),
    "node": LazyCommand(
        "vllm_ctxmgr.cli.deployment",
        "node_group",
        "The steps of a multi-node change on one node (`ctxmgr deployment` runs them over ssh).",
    ),
    "observe": LazyCommand(
        "vllm_ctxmgr.cli.change",
        "observe_cmd",
        "Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans.",
    ),
    "plan": LazyCommand(
        "vllm_ctxmgr.cli.plan",
        "plan",
        "Plan CONTEXT tokens: flags, memory per GPU, or the largest context that fits and what would help.",
    ),
    "recover": LazyCommand(
        "vllm_ctxmgr.cli.change",
        "recover_cmd",
        "Finish the rollback of a change that an interrupted ctxmgr run left in progress.",
    ),
    "rollback": LazyCommand(
        "vllm_ctxmgr.cli.change",
        "rollback_cmd",
        "Return a service to an earlier revision through the same restart / watch / probe path.",
    ),
    "schedule": LazyCommand(
        "vllm_ctxmgr.cli.ops",
        "schedule_cmd",
        "Verify a service on a timer: installs, enables and starts ctxmgr-verify@SERVICE.timer.",
    ),
    "set-context": LazyCommand(
        "vllm_ctxmgr.cli.change",
        "set_context_cmd",
        "Set a service's context to CONTEXT: plan, render, restart, watch, probe, roll back on failure.",
    ),
    "status": LazyCommand(
        "vllm_ctxmgr.cli.ops",
        "status_cmd",
        "Every service on this host that runs vLLM: context, utilisation, last verification, KV, margin.",
    ),
    "unschedule": LazyCommand(
        "vllm_ctxmgr.cli.ops",
        "unschedule_cmd",
        "Stop the scheduled verification of a service and remove its timer and service units.",
    ),
    "verify": LazyCommand(
        "vllm_ctxmgr.cli.ops",
        "verify_cmd",
        "Check that a service still serves what ctxmgr set, and that its next restart still fits.",
    ),
}


# click 8.4+ names the closest command of those it is given; before, it names none
NO_SUCH_COMMAND: type[click.UsageError] = getattr(click.exceptions, "NoSuchCommand", ())  # type: ignore[assignment]


class LazyGroup(CtxmgrGroup):
    """The root group: a command is imported when it is run; `--help` and completion list them all
    from COMMANDS."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if cmd_name not in self.commands and entry is not None:
            self.add_command(getattr(importlib.import_module(entry.module), entry.attribute), cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """click's, offering every command of the table as "did you mean" (click offers the imported)."""
        try:
            return super().resolve_command(ctx, args)
        except NO_SUCH_COMMAND as exc:
            raise NO_SUCH_COMMAND(exc.command_name, possibilities=COMMANDS, ctx=ctx) from None

    def listed(self, name: str) -> click.Command:
        """A command as `--help` and completion show it: the real one once imported, else a stand-in
        with the table's help, which click shortens the same way."""
        if name in self.commands:
            return self.commands[name]
        return click.Command(name, help=COMMANDS[name].short_help)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        with formatter.section("Commands"):
            formatter.write_dl([(name, self.listed(name).get_short_help_str(limit)) for name in names])

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        from click.shell_completion import CompletionItem

        commands = [
            CompletionItem(name, help=self.listed(name).get_short_help_str())
            for name in self.list_commands(ctx)
            if name.startswith(incomplete)
        ]
        return commands + click.Command.shell_complete(self, ctx, incomplete)  # and the group's options


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.option("--debug", is_flag=True, help="Show tracebacks of unexpected errors.")
@click.option(
    "--state-dir",
    envvar="CTXMGR_STATE_DIR",
    default="/var/lib/ctxmgr",
    show_default=True,
    help="Where revisions, observations and locks live (root-only).",
)
@click.option(
    "--systemd-pid",
    envvar="CTXMGR_SYSTEMD_PID",
    type=int,
    default=None,
    help="Drive the systemd whose PID 1 is this host PID (a container or a private systemd): its own "
    "tools run in its namespaces, without capabilities.",
)
@click.option(
    "--unit-dir",
    envvar="CTXMGR_UNIT_DIR",
    default=None,
    help="Where ctxmgr installs the units it creates: verify timers, and the drop-in that overrides a "
    "package's unit (under /usr/lib). Default /etc/systemd/system.",
)
@click.version_option(package_name="vllm-ctxmgr")
@click.pass_context
def main(
    ctx: click.Context, debug: bool, state_dir: str, systemd_pid: int | None, unit_dir: str | None
) -> None:
    """Plan, apply, verify and roll back vLLM context-length changes on systemd hosts.

    \b
    Exit codes: 0 ok / feasible / nothing to do, 1 error (a failed change that was rolled back
    included), 2 usage error, 3 infeasible plan, 4 service locked, 5 rollback failed, 6 the plan
    cannot decide (no memory information, or the weights unknown; set-context then changes nothing).
    `verify`: 0 ok, 1 degraded, 2 failed, 3 unknown, 4 locked.
    Every command: 70 ctxmgr crashed (an unexpected error, a bug; --debug shows it): no verdict.
    With --json every command prints exactly one JSON object on stdout, errors included.
    """
    ctx.obj = {"state_dir": check_state_dir(state_dir), "systemd_pid": systemd_pid, "unit_dir": unit_dir}


__all__ = ["main"]
