"""CLI commands for operating services over time: verify, schedule, unschedule, status."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from vllm_ctxmgr.cli.examples import EXAMPLES
from vllm_ctxmgr.cli.finish import invoking_user
from vllm_ctxmgr.cli.output import echo, emit_json, handle_errors
from vllm_ctxmgr.cli.params import (
    TIMEOUT,
    gpus_from_option,
    json_changed_option,
    json_option,
    long_probe_option,
    probe_timeout_option,
    wait_lock_option,
)
from vllm_ctxmgr.cli.restarter import systemd_for
from vllm_ctxmgr.cli.service_param import service_param
from vllm_ctxmgr.core.verdict import FAILED, Verdict, Verification
from vllm_ctxmgr.monitor.metrics import check_textfile_path, write_textfile
from vllm_ctxmgr.monitor.schedule import ScheduleRequest, schedule_service, unschedule_service
from vllm_ctxmgr.monitor.status import fleet_status, status_table
from vllm_ctxmgr.monitor.verify import VerifyOptions, act_on_failure, verify_service
from vllm_ctxmgr.report import verification_text
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.log import Priority, send
from vllm_ctxmgr.systemd.names import canonical_unit
from vllm_ctxmgr.systemd.systemctl import Systemd

ON_FAILURE = ("none", "restart", "rollback")


def _say(as_json: bool):  # type: ignore[no-untyped-def]
    def say(text: str) -> None:
        if not as_json:
            echo(f"ctxmgr: {text}", err=True)

    return say


@click.command("verify", epilog=EXAMPLES["verify"])
@service_param()
@long_probe_option
@click.option(
    "--textfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write Prometheus metrics here (a .prom file in node_exporter's textfile directory).",
)
@gpus_from_option.but(help="GPU memory from a `ctxmgr gpus --json` file instead of NVML.")
@click.option(
    "--on-failure",
    type=click.Choice(ON_FAILURE),
    default="none",
    show_default=True,
    help="When the verification fails: restart the unit, or roll back to the last revision that verified.",
)
@probe_timeout_option
@click.option(
    "--start-timeout",
    type=TIMEOUT,
    default="30min",
    show_default=True,
    help="Time a start may take: until then a vLLM still loading is degraded, not failed.",
)
@wait_lock_option
@json_option
@click.pass_context
@handle_errors
def verify_cmd(ctx: click.Context, service: str, long_probe: bool, textfile: str | None,
               gpus_from: str | None, on_failure: str, timeout: float, start_timeout: float, wait_lock: float,
               as_json: bool) -> None:  # fmt: skip
    """Check that a service still serves what ctxmgr set, and that its next restart still fits.

    \b
    ok        active, not restarted behind ctxmgr's back, /health, /v1/models reports the unit's
              max_model_len, the context-sized probe passes, GPU memory keeps the plan's margin,
              same vLLM version and KV budget as the last start ctxmgr watched
    degraded  it serves, but one of the latter no longer holds (the reasons say which)
    failed    not active, or the probe fails
    \b
    Exit codes of this command (the monitoring-plugin convention): 0 ok, 1 degraded, 2 failed,
    3 unknown (the check could not run: bad arguments, an unknown service), 4 a change on the
    service holds its lock, 70 ctxmgr crashed (a bug: no verdict).
    """

    if textfile:
        check_textfile_path(textfile)
    systemd = systemd_for(ctx)
    service = canonical_unit(systemd, service)
    store = ServiceStore(ctx.find_root().obj["state_dir"], service)
    say = _say(as_json)
    options = VerifyOptions(long_probe, timeout, gpus_from, start_timeout)
    verification, facts = verify_service(systemd, store, service, options, wait_lock, say)
    if verification.result == FAILED and on_failure != "none":
        say(f"verification failed: {'; '.join(verification.reasons)}")
        verification.action = act_on_failure(
            systemd, store, service, on_failure, facts, start_timeout, wait_lock, say
        )
    if textfile:
        write_textfile(textfile, verification)
    log_verification(systemd, service, verification)
    if as_json:
        emit_json({"command": "verify", "changed": bool(verification.action), **verification.to_json()})
    else:
        echo(verification_text(verification))
    sys.exit(verification.exit_code)


@click.command("schedule", epilog=EXAMPLES["schedule"])
@service_param()
@click.option(
    "--every",
    default="15min",
    show_default=True,
    help="A systemd time span (15min, 1h, 30s) or calendar expression (hourly, *:0/15).",
)
@click.option(
    "--on-failure",
    type=click.Choice(ON_FAILURE),
    default="none",
    show_default=True,
    help="What a failed run does: restart the unit, or roll back to the last revision that verified.",
)
@click.option(
    "--textfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Prometheus textfile each run writes (absolute path ending in .prom).",
)
@long_probe_option.but(help="Each run also sends a prompt of about 90% of the context.")
@click.option(
    "--randomized-delay",
    default=None,
    help="RandomizedDelaySec (default: a tenth of the span, at most 5min; 1min for a calendar).",
)
@json_changed_option
@click.pass_context
@handle_errors
def schedule_cmd(ctx: click.Context, service: str, every: str, on_failure: str, textfile: str | None,
                 long_probe: bool, randomized_delay: str | None, as_json: bool) -> None:  # fmt: skip
    """Verify a service on a timer: installs, enables and starts ctxmgr-verify@SERVICE.timer.

    Results go to the journal (`journalctl -t ctxmgr-verify`) and, with --textfile, to Prometheus.
    Scheduling the same again changes nothing.
    """
    request = ScheduleRequest(
        service=service,
        every=every,
        on_failure=on_failure,
        textfile=str(Path(textfile).absolute()) if textfile else None,
        long_probe=long_probe,
        randomized_delay=randomized_delay,
        state_dir=str(Path(ctx.find_root().obj["state_dir"]).absolute()),
    )
    result = schedule_service(systemd_for(ctx), request, _say(as_json))
    if as_json:
        emit_json(
            {
                "command": "schedule",
                "result": "applied" if result.changed else "unchanged",
                **result.to_json(),
            }
        )
        return
    echo(result.reason)
    if result.next_run:
        echo(f"next run: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(result.next_run))}")


@click.command("unschedule", epilog=EXAMPLES["unschedule"])
@service_param()
@json_changed_option
@click.pass_context
@handle_errors
def unschedule_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Stop the scheduled verification of a service and remove its timer and service units."""

    result = unschedule_service(systemd_for(ctx), service, _say(as_json))
    if as_json:
        emit_json(
            {
                "command": "unschedule",
                "result": "applied" if result.changed else "unchanged",
                **result.to_json(),
            }
        )
    else:
        echo(result.reason)


@click.command("status", epilog=EXAMPLES["status"])
@json_option
@click.pass_context
@handle_errors
def status_cmd(ctx: click.Context, as_json: bool) -> None:
    """Every service on this host that runs vLLM: context, utilisation, last verification, KV, margin."""

    rows = fleet_status(systemd_for(ctx), ctx.find_root().obj["state_dir"])
    if as_json:
        emit_json(
            {"command": "status", "result": "ok", "changed": False, "services": [r.to_json() for r in rows]}
        )
    else:
        echo(status_table(rows))


# journald priorities of a verification: degraded and failed are what an operator's alerting watches
VERIFY_PRIORITY = {
    Verdict.OK: Priority.INFO,
    Verdict.DEGRADED: Priority.WARNING,
    Verdict.FAILED: Priority.ERR,
}


def log_verification(systemd: Systemd, service: str, verification: Verification) -> None:
    message = f"{service}: verify {verification.result}"
    if verification.reasons:
        message += ": " + "; ".join(verification.reasons)
    send(
        systemd,
        message,
        VERIFY_PRIORITY.get(verification.result, Priority.ERR),
        service=service,
        action="verify",
        result=verification.result,
        max_model_len=verification.max_model_len,
        exit_code=verification.exit_code,
        user=invoking_user(),
    )
