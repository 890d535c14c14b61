"""The command line: thin click commands over the library. Heavy modules load lazily."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from vllm_ctxmgr import report
from vllm_ctxmgr.cli import ops
from vllm_ctxmgr.cli.common import (
    CONTEXT,
    SIZE,
    confirm,
    deployer_for,
    emit_json,
    finish,
    gpu_options,
    handle_errors,
    systemd_for,
)
from vllm_ctxmgr.core.plan import parse_vllm_version
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.deploy import (
    ChangeResult,
    SetContextRequest,
    history,
    observe_last_start,
    rollback,
    set_context,
)
from vllm_ctxmgr.errors import EXIT_INFEASIBLE, UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.planning import PlanRequest, plan_for, stored_observations
from vllm_ctxmgr.service import read_service, view_from_unit
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.unit import ServiceUnit


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
    help="Drive the systemd whose PID 1 is this host PID (a container or a private systemd), via nsenter.",
)
@click.option(
    "--unit-dir",
    envvar="CTXMGR_UNIT_DIR",
    default=None,
    help="Where ctxmgr installs the units it creates (timers). Default /etc/systemd/system.",
)
@click.version_option(package_name="vllm-ctxmgr")
@click.pass_context
def main(
    ctx: click.Context, debug: bool, state_dir: str, systemd_pid: int | None, unit_dir: str | None
) -> None:
    """Plan, apply, verify and roll back vLLM context-length changes on systemd hosts.

    \b
    Exit codes: 0 ok / feasible / nothing to do, 1 error (a failed change that was rolled back
    included), 2 usage error, 3 infeasible plan, 4 service locked, 5 rollback failed.
    """
    ctx.obj = {"state_dir": state_dir, "systemd_pid": systemd_pid, "unit_dir": unit_dir}


# ---- facts / gpus ----------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--vllm-version", default=None, help="Derive the maximum length by this vLLM's rules.")
@handle_errors
def facts(model: str, as_json: bool, vllm_version: str | None) -> None:
    """What vLLM will see in MODEL: a HF model dir, a cached repo id, or a GGUF file."""

    model_facts = load_model_facts(model)

    version = parse_vllm_version(vllm_version) or report.NEWEST_VLLM
    if vllm_version and parse_vllm_version(vllm_version) is None:
        raise UsageError(f"{vllm_version!r} is not a vLLM version (e.g. 0.33.0)")
    if as_json:
        emit_json(report.facts_json(model_facts, version))
    else:
        click.echo(report.facts_text(model_facts, version))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (input for --gpus-from).")
@handle_errors
def gpus(as_json: bool) -> None:
    """The GPUs on this host: total, free, used, and who uses them (NVML)."""

    state = read_nvml()
    if as_json:
        emit_json(state.to_json())
    else:
        click.echo(report.gpus_text(state))


# ---- plan ------------------------------------------------------------------------------------


@main.command()
@click.argument("context", type=CONTEXT)
@click.option("--model", "model", default=None, help="HF model dir, cached repo id, or GGUF file.")
@click.option("--unit", "unit_file", type=click.Path(dir_okay=False), default=None, help="Read a unit file.")
@click.option("--service", default=None, help="Read a service's unit as systemd loaded it.")
@click.option("--tensor-parallel-size", "-tp", type=int, default=None)
@click.option("--pipeline-parallel-size", "-pp", type=int, default=None)
@click.option("--decode-context-parallel-size", "-dcp", type=int, default=None)
@click.option("--kv-cache-dtype", default=None)
@click.option("--block-size", type=int, default=None)
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True), default=None)
@click.option("--kv-cache-memory-bytes", type=SIZE, default=None)
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
@handle_errors
def plan(ctx: click.Context, context: int, model: str | None, unit_file: str | None, service: str | None,
         as_json: bool, **options: Any) -> None:  # fmt: skip
    """Plan CONTEXT tokens: flags, memory per GPU, or the largest context that fits and what would help."""
    from dataclasses import replace

    chosen = [
        name for name, value in (("--model", model), ("--unit", unit_file), ("--service", service)) if value
    ]
    if len(chosen) != 1:
        raise UsageError("give exactly one of --model, --unit or --service")
    vllm_flags = {
        "tensor_parallel_size": options.pop("tensor_parallel_size"),
        "pipeline_parallel_size": options.pop("pipeline_parallel_size"),
        "decode_context_parallel_size": options.pop("decode_context_parallel_size"),
        "kv_cache_dtype": options.pop("kv_cache_dtype"),
        "block_size": options.pop("block_size"),
        "max_num_batched_tokens": options.pop("max_num_batched_tokens"),
        "max_num_seqs": options.pop("max_num_seqs"),
        "gpu_memory_utilization": options.pop("gpu_memory_utilization"),
        "kv_cache_memory_bytes": options.pop("kv_cache_memory_bytes"),
    }
    overrides = {k: v for k, v in vllm_flags.items() if v is not None}
    service_pids: tuple[int, ...] = ()
    observations: list[Any] = []
    if model:
        args = ServeArgs(model=model, **overrides)
    else:
        if unit_file:
            view = view_from_unit(ServiceUnit.load(unit_file.rsplit("/", 1)[-1], unit_file))
        else:
            systemd = systemd_for(ctx)
            view = read_service(systemd, service)  # type: ignore[arg-type]
            service_pids = tuple(systemd.unit_processes(view.name))
            observations = stored_observations(ctx.find_root().obj["state_dir"], view.name)
        args = replace(view.args, **overrides)
    result = plan_for(args, PlanRequest(context, **options), service_pids, observations)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(report.plan_text(result))
    if not result.feasible:
        sys.exit(EXIT_INFEASIBLE)


# ---- changing a service ----------------------------------------------------------------------


@main.command("set-context")
@click.argument("context", type=CONTEXT)
@click.option("--service", required=True, help="The systemd service that runs vLLM.")
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Use this utilisation instead of the planner's choice.",
)
@click.option(
    "--probe-tokens", type=int, default=None, help="max_tokens of the probe (default: context - prompt)."
)
@click.option("--long-probe", is_flag=True, help="Also send a prompt of about 90% of the context.")
@click.option("--timeout", type=float, default=1800.0, show_default=True, help="Seconds a start may take.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the unit diff; change nothing.")
@click.option("--force", is_flag=True, help="Apply even when the plan says it will not fit.")
@click.option("--wait-lock", type=float, default=0.0, help="Seconds to wait for another run on the service.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def set_context_cmd(ctx: click.Context, context: int, service: str, gpu_memory_utilization: float | None,
                    probe_tokens: int | None, long_probe: bool, timeout: float, dry_run: bool, force: bool,
                    wait_lock: float, yes: bool, as_json: bool, **options: Any) -> None:  # fmt: skip
    """Set a service's context to CONTEXT: plan, render, restart, watch, probe, roll back on failure."""

    deployer = deployer_for(ctx, service, as_json, timeout)
    request = SetContextRequest(
        context=context,
        gpu_memory_utilization=gpu_memory_utilization,
        probe_tokens=probe_tokens,
        long_probe=long_probe,
        dry_run=dry_run or not yes,  # without --yes: show what would change, ask, then apply
        force=force,
        lock_wait=wait_lock,
        planning=PlanRequest(context, **options),
    )
    result = set_context(deployer, request)
    if not dry_run and not yes and result.result == "dry-run":
        if not as_json:
            click.echo(report.change_text(result), err=True)
        confirm(yes, f"restart {deployer.unit} with max_model_len {context}")
        request.dry_run = False
        result = set_context(deployer, request)
    finish(result, as_json)


@main.command("rollback")
@click.option("--service", required=True)
@click.option(
    "--to", "to", type=int, default=None, help="Revision to return to (default: the previous good one)."
)
@click.option("--timeout", type=float, default=1800.0, show_default=True)
@click.option("--dry-run", is_flag=True)
@click.option("--wait-lock", type=float, default=0.0)
@click.option("--yes", "-y", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def rollback_cmd(ctx: click.Context, service: str, to: int | None, timeout: float, dry_run: bool,
                 wait_lock: float, yes: bool, as_json: bool) -> None:  # fmt: skip
    """Return a service to an earlier revision through the same restart / watch / probe path."""

    deployer = deployer_for(ctx, service, as_json, timeout)
    result = rollback(deployer, to, wait_lock, dry_run=dry_run or not yes)
    if not dry_run and not yes and result.result == "dry-run":
        confirm(
            yes, f"restart {deployer.unit} with the unit of revision {to if to is not None else 'before'}"
        )
        result = rollback(deployer, to, wait_lock, dry_run=False)
    finish(result, as_json)


@main.command("recover")
@click.option("--service", required=True)
@click.option("--timeout", type=float, default=1800.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def recover_cmd(ctx: click.Context, service: str, timeout: float, as_json: bool) -> None:
    """Finish the rollback of a change that an interrupted ctxmgr run left in progress."""

    deployer = deployer_for(ctx, service, as_json, timeout)
    with deployer.store.lock(0.0):
        result = deployer.recover_if_needed()
    if result is None:
        result = ChangeResult(service, "recover", "unchanged", False, reason="no change was left in progress")
    finish(result, as_json)


@main.command("history")
@click.option("--service", required=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def history_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Every revision ctxmgr made of a service: time, context, utilisation, result, reason."""

    rows = history(ServiceStore(ctx.find_root().obj["state_dir"], service.removesuffix(".service")))
    if as_json:
        emit_json({"service": service, "revisions": rows})
    else:
        click.echo(report.history_text(service, rows))


@main.command("observe")
@click.option("--service", required=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def observe_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans."""

    deployer = deployer_for(ctx, service, True, 60.0)
    with deployer.store.lock(0.0):
        data = observe_last_start(deployer)
    if as_json:
        emit_json(data)
        return
    obs = data["observation"]
    click.echo(f"{service}: last start ({data['lines']} journal lines): " + ", ".join(
        f"{k} {v}" for k, v in obs.items() if v not in (None, False, "")
    ))  # fmt: skip


def entry() -> None:  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]) or "ctxmgr")


__all__ = ["main"]


# Operating services over time (verify, schedule, unschedule, status) lives in cli/ops.py.
for command in (ops.verify_cmd, ops.schedule_cmd, ops.unschedule_cmd, ops.status_cmd):
    main.add_command(command)
