"""Changing one service: `ctxmgr set-context`, `rollback`, `recover`, and what it keeps: `history`,
`observe`."""

from __future__ import annotations

import contextlib
from typing import TypedDict, Unpack

import click

from vllm_ctxmgr import files, report
from vllm_ctxmgr.change.observing import observe_last_start
from vllm_ctxmgr.change.planning import MAX_IMPORT_BYTES, PlanRequest, imported_observation
from vllm_ctxmgr.change.recovery import recover_if_needed
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.change.states import ChangeResult, Result
from vllm_ctxmgr.change.walk import SetContextRequest, rollback, set_context
from vllm_ctxmgr.cli.confirm import confirmation
from vllm_ctxmgr.cli.examples import EXAMPLES
from vllm_ctxmgr.cli.finish import finish
from vllm_ctxmgr.cli.output import echo, emit_json, handle_errors
from vllm_ctxmgr.cli.params import (
    CONTEXT,
    PlanningFlags,
    edit_option,
    gpu_memory_utilization_option,
    gpu_options,
    json_changed_option,
    json_option,
    long_probe_option,
    max_model_len_option,
    probe_tokens_option,
    refuse_old_rules,
    start_timeout_option,
    wait_lock_option,
    yes_option,
)
from vllm_ctxmgr.cli.plan import context_from
from vllm_ctxmgr.cli.restarter import restarter_for, systemd_for
from vllm_ctxmgr.cli.service_param import service_param
from vllm_ctxmgr.core.observations import StoredObservation
from vllm_ctxmgr.errors import CtxmgrError, UsageError
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.names import canonical_unit
from vllm_ctxmgr.systemd.service import read_service

start_into_held_gpu_option = click.option(
    "--start-into-held-gpu",
    is_flag=True,
    help="Start even where, after the stop, a process of the old vLLM still holds memory on its GPUs.",
)


@click.command("set-context", epilog=EXAMPLES["set-context"])
@click.argument("context", type=CONTEXT, required=False)
@service_param()
@max_model_len_option
@gpu_memory_utilization_option.but(help="Use this utilisation instead of the planner's choice.")
@probe_tokens_option
@long_probe_option
@start_timeout_option
@click.option("--dry-run", is_flag=True, help="Print the plan and the unit diff; change nothing.")
@click.option(
    "--force", is_flag=True, help="Apply even when the plan says it will not fit, or cannot tell (exit 6)."
)
@start_into_held_gpu_option
@wait_lock_option
@yes_option
@edit_option
@gpu_options
@json_changed_option
@click.pass_context
@handle_errors
def set_context_cmd(ctx: click.Context, context: int | None, max_model_len: int | None, service: str,
                    gpu_memory_utilization: float | None, probe_tokens: int | None, long_probe: bool,
                    timeout: float, dry_run: bool, force: bool, start_into_held_gpu: bool,
                    wait_lock: float, yes: bool, edit: str, as_json: bool,
                    **options: Unpack[PlanningFlags]) -> None:  # fmt: skip
    """Set a service's context to CONTEXT: plan, render, restart, watch, probe, roll back on failure.

    \b
    CONTEXT as vLLM reads --max-model-len: 200000, 200k (= 200,000), 195K (= 199,680), or auto / -1:
    the largest context that fits, resolved before the restart (the unit gets the number).
    """
    target = context_from(context, max_model_len)
    refuse_old_rules(options.get("vllm_version"), "set-context")
    restarter = restarter_for(ctx, service, as_json=as_json, timeout=timeout)
    restarter.start_into_held_gpu = start_into_held_gpu
    request = SetContextRequest(
        context=target,
        gpu_memory_utilization=gpu_memory_utilization,
        probe_tokens=probe_tokens,
        long_probe=long_probe,
        dry_run=dry_run,
        force=force,
        lock_wait=wait_lock,
        planning=PlanRequest(target, **options),
        confirm=None if dry_run else confirmation(yes, as_json, restarter.unit),
        dropin=edit == "dropin",
    )
    result = set_context(restarter, request)
    finish(result, as_json, dry_run=dry_run, systemd=restarter.systemd)


@click.command("rollback", epilog=EXAMPLES["rollback"])
@service_param()
@click.option(
    "--to",
    "to",
    type=click.IntRange(0, None),
    default=None,
    help="Revision to return to (default: the previous good one; see `ctxmgr history`).",
)
@start_timeout_option
@click.option("--dry-run", is_flag=True, help="Print the unit diff; change nothing.")
@start_into_held_gpu_option
@wait_lock_option
@yes_option
@json_changed_option
@click.pass_context
@handle_errors
def rollback_cmd(ctx: click.Context, service: str, to: int | None, timeout: float, dry_run: bool,
                 start_into_held_gpu: bool, wait_lock: float, yes: bool, as_json: bool) -> None:  # fmt: skip
    """Return a service to an earlier revision through the same restart / watch / probe path."""
    restarter = restarter_for(ctx, service, as_json=as_json, timeout=timeout)
    restarter.start_into_held_gpu = start_into_held_gpu
    confirm = None if dry_run else confirmation(yes, as_json, restarter.unit)
    result = rollback(restarter, to, wait_lock, dry_run=dry_run, confirm=confirm)
    finish(result, as_json, dry_run=dry_run, systemd=restarter.systemd)


@click.command("recover", epilog=EXAMPLES["recover"])
@service_param()
@start_timeout_option
@json_changed_option
@click.pass_context
@handle_errors
def recover_cmd(ctx: click.Context, service: str, timeout: float, as_json: bool) -> None:
    """Finish the rollback of a change that an interrupted ctxmgr run left in progress."""
    restarter = restarter_for(ctx, service, as_json=as_json, timeout=timeout)
    with restarter.store.lock(0.0):
        result = recover_if_needed(restarter)
    if result is None:
        result = ChangeResult(
            restarter.unit, "recover", Result.UNCHANGED, False, reason="no change was left in progress"
        )
    finish(result, as_json, systemd=restarter.systemd)


@click.command("history", epilog=EXAMPLES["history"])
@service_param()
@json_option
@click.pass_context
@handle_errors
def history_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Every revision ctxmgr made of a service: time, context, utilisation, result, reason."""
    store = ServiceStore(ctx.find_root().obj["state_dir"], service)
    if not store.root.is_dir():
        canonical_unit(systemd_for(ctx), service)  # an unknown service is a usage error (exit 2)
    rows = store.history()
    if as_json:
        emit_json(
            {"command": "history", "result": "ok", "changed": False, "service": service, "revisions": rows}
        )
    else:
        echo(report.history_text(service, rows))


@click.command("observe", epilog=EXAMPLES["observe"])
@service_param()
@click.option(
    "--import",
    "import_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Store an observation that `ctxmgr observe --json` wrote on another host of the same GPU model "
    "and vLLM version, so this host plans from that real start.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Read (and with --import, check) the observation; store nothing, take no lock.",
)
@json_option.but(help="Print one JSON object (its `record` is what --import takes).")
@click.pass_context
@handle_errors
def observe_cmd(
    ctx: click.Context, service: str, import_file: str | None, dry_run: bool, as_json: bool
) -> None:
    """Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans."""
    if import_file:
        # read first, through the bounded door: a FIFO or /dev/zero is refused before anything else
        raw = files.read_regular(import_file, MAX_IMPORT_BYTES, what="observation", error=UsageError)
        restarter = restarter_for(ctx, service, as_json=True, timeout=60.0)
        record = imported_observation(raw.decode(errors="replace"), import_file, **import_match(restarter))
        if dry_run:  # Ansible's check mode: checked as a real import checks it, nothing stored
            if as_json:
                emit_json({"command": "observe", "result": "dry-run", "changed": False, "dry_run": True,
                           "service": restarter.unit, "record": record})  # fmt: skip
            else:
                echo(f"{restarter.unit}: dry run: would store the observation from {record['imported_from']}")
            return
        with restarter.store.lock(0.0):
            restarter.store.add_observation(record)
        if as_json:
            emit_json({"command": "observe", "result": "applied", "changed": True, "service": restarter.unit,
                       "record": record})  # fmt: skip
        else:
            echo(f"{restarter.unit}: stored the observation from {record['imported_from']}")
        return
    restarter = restarter_for(ctx, service, as_json=True, timeout=60.0)
    if dry_run:  # read only: no lock file, no line appended to observations.jsonl
        observed, obs, lines = observe_last_start(restarter.systemd, restarter.service)
        stored: list[StoredObservation] = [observed.to_json()]
    else:
        with restarter.store.lock(0.0):
            observed, obs, lines = observe_last_start(restarter.systemd, restarter.service)
            restarter.store.add_observation(observed.to_json())
            stored = restarter.store.observations()
    last: StoredObservation | dict[str, object] = stored[-1] if stored else {}
    if as_json:
        emit_json({"command": "observe", "result": "ok", "changed": False, "service": restarter.service,
                   "observation": obs, "lines": lines, "record": last})  # fmt: skip
        return
    echo(f"{service}: last start ({lines} journal lines): " + ", ".join(
        f"{k} {v}" for k, v in obs.items() if v not in (None, False, "")
    ))  # fmt: skip


class ImportMatch(TypedDict):
    """What an imported observation is checked against (planning.imported_observation's keywords)."""

    service: str
    vllm_version: str | None
    gpu_names: list[str]
    gpu_total_bytes: float | None  # this host's largest GPU (NVML): what a figure may not pass


def import_match(restarter: Restarter) -> ImportMatch:
    """What an imported observation must match: this service, its vLLM, this host's GPUs (each only
    where it can be known here)."""
    version: str | None = None
    with contextlib.suppress(CtxmgrError):
        version = read_service(restarter.systemd, restarter.unit).args.vllm_version
    gpu_names: list[str] = []
    total: float | None = None
    with contextlib.suppress(CtxmgrError, OSError):
        gpus = read_nvml().gpus
        gpu_names = [gpu.name for gpu in gpus]
        total = max((gpu.total_bytes for gpu in gpus), default=None)
    return {
        "service": restarter.unit,
        "vllm_version": version,
        "gpu_names": gpu_names,
        "gpu_total_bytes": total,
    }
