"""The command line: thin click commands over the library. Heavy modules load lazily."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import fields, replace
from typing import Any

import click

from vllm_ctxmgr import files, report
from vllm_ctxmgr.cli import ops
from vllm_ctxmgr.cli.common import (
    AUTO_CONTEXT,
    BLOCK_SIZE,
    CONTEXT,
    COUNT,
    PARALLEL,
    SERVICE,
    TIMEOUT,
    UTILIZATION,
    VLLM_BYTES,
    VLLM_VERSION,
    WAIT_LOCK,
    CtxmgrGroup,
    check_state_dir,
    confirm,
    deployer_for,
    echo,
    emit_json,
    finish,
    gpu_options,
    handle_errors,
    systemd_for,
)
from vllm_ctxmgr.core.serve_args import READ_FLAGS, ServeArgs, parse_serve_argv, split_flags
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.deploy import (
    ChangeResult,
    Deployer,
    SetContextRequest,
    history,
    learn_from_running_instance,
    observe_last_start,
    rollback,
    set_context,
)
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.planning import (
    MAX_IMPORT_BYTES,
    PlanRequest,
    imported_observation,
    largest_context,
    plan_for,
    plan_verdict,
    stored_observations,
)
from vllm_ctxmgr.service import read_service, running_argv_mismatch, view_from_unit
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.names import canonical_unit
from vllm_ctxmgr.systemd.unit import ServiceUnit


@click.group(
    cls=CtxmgrGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
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
    help="Drive the systemd whose PID 1 is this host PID (a container or a private systemd), via nsenter.",
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
    cannot decide (no memory information). `verify`: 0 ok, 1 degraded, 2 failed, 3 unknown, 4 locked.
    With --json every command prints exactly one JSON object on stdout, errors included.
    """
    ctx.obj = {"state_dir": check_state_dir(state_dir), "systemd_pid": systemd_pid, "unit_dir": unit_dir}


# ---- facts / gpus ----------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--vllm-version", type=VLLM_VERSION, default=None, help="Derive the maximum length by this vLLM's rules."
)
@handle_errors
def facts(model: str, as_json: bool, vllm_version: str | None) -> None:
    """What vLLM will see in MODEL: a HF model dir, a cached repo id, or a GGUF file."""

    model_facts = load_model_facts(model)

    version = parse_vllm_version(vllm_version) or report.NEWEST_VLLM
    if as_json:
        emit_json(
            {"command": "facts", "result": "ok", "changed": False, **report.facts_json(model_facts, version)}
        )
    else:
        echo(report.facts_text(model_facts, version))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (input for --gpus-from).")
@handle_errors
def gpus(as_json: bool) -> None:
    """The GPUs on this host: total, free, used, and who uses them (NVML)."""

    state = read_nvml()
    if as_json:
        emit_json({"command": "gpus", "result": "ok", "changed": False, **state.to_json()})
    else:
        echo(report.gpus_text(state))


# ---- plan ------------------------------------------------------------------------------------


def context_from(context: int | None, max_model_len: int | None) -> int:
    """The positional CONTEXT or vLLM's own --max-model-len spelling; one of them, or both the same."""
    if context is not None and max_model_len is not None and context != max_model_len:
        raise UsageError(f"CONTEXT {context} and --max-model-len {max_model_len} disagree; give one")
    chosen = context if context is not None else max_model_len
    if chosen is None:
        raise UsageError("give the context: CONTEXT or --max-model-len N (200000, 200k, 195K, auto)")
    return chosen


def vllm_overrides(explicit: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """ServeArgs fields from ctxmgr's vLLM options and from any other vLLM flag given after them.

    The extra words are parsed by the same parser that reads a unit's ExecStart, so `plan` understands
    exactly the flags a unit can hold; an unknown flag is refused, since a typo would be a silent no-op.
    """
    overrides = {k: v for k, v in explicit.items() if v is not None}
    if not extra:
        return overrides
    _positionals, flags = split_flags(extra)
    unknown = [f for f in flags if f not in READ_FLAGS] + [w for w in _positionals if not w.startswith("-")]
    if unknown:
        raise UsageError(f"{unknown[0]}: not a vLLM flag that changes the plan (see `ctxmgr plan --help`)")
    base = parse_serve_argv(["MODEL"])
    given = parse_serve_argv(["MODEL", *extra])
    for field in fields(ServeArgs):
        if field.name != "model" and getattr(given, field.name) != getattr(base, field.name):
            overrides.setdefault(field.name, getattr(given, field.name))
    return overrides


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("context", type=CONTEXT, required=False)
@click.option("--max-model-len", "max_model_len", type=CONTEXT, default=None, help="The same as CONTEXT.")
@click.option("--model", "model", default=None, help="HF model dir, cached repo id, or GGUF file.")
@click.option("--unit", "unit_file", type=click.Path(dir_okay=False), default=None,
              help="Read a unit file (and its FILE.d/*.conf drop-ins).")  # fmt: skip
@click.option("--service", type=SERVICE, default=None, help="Read a service's unit as systemd loaded it.")
@click.option("--tensor-parallel-size", "-tp", type=PARALLEL, default=None, help="vLLM's -tp.")
@click.option("--pipeline-parallel-size", "-pp", type=PARALLEL, default=None, help="vLLM's -pp.")
@click.option("--decode-context-parallel-size", "-dcp", type=PARALLEL, default=None, help="vLLM's -dcp.")
@click.option("--data-parallel-size", "-dp", type=PARALLEL, default=None, help="vLLM's -dp.")
@click.option("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype (auto, fp8, fp8_ds_mla, ...).")
@click.option("--block-size", type=BLOCK_SIZE, default=None, help="vLLM's --block-size (tokens per block).")
@click.option("--max-num-batched-tokens", type=COUNT, default=None, help="vLLM's --max-num-batched-tokens.")
@click.option("--max-num-seqs", type=COUNT, default=None, help="vLLM's --max-num-seqs.")
@click.option("--gpu-memory-utilization", type=UTILIZATION, default=None, help="vLLM's utilisation (0-1].")
@click.option(
    "--kv-cache-memory-bytes",
    type=VLLM_BYTES,
    default=None,
    help="vLLM's --kv-cache-memory-bytes, parsed as vLLM does: 20g = 20e9 bytes, 20G = 20 GiB.",
)
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
@handle_errors
def plan(ctx: click.Context, context: int | None, max_model_len: int | None, model: str | None,
         unit_file: str | None, service: str | None, as_json: bool, **options: Any) -> None:  # fmt: skip
    """Plan CONTEXT tokens: flags, memory per GPU, or the largest context that fits and what would help.

    \b
    CONTEXT is vLLM's --max-model-len: 200000, 200k (= 200,000), 195K (= 199,680: K is 1,024 as
    vLLM reads it), or auto / -1 for the largest context that fits. Any other vLLM flag that a unit
    can hold (--enforce-eager, --dtype, --speculative-config ...) may follow.
    Exit: 0 feasible, 3 infeasible, 6 unknown (no memory information), 2 usage.
    """
    target = context_from(context, max_model_len)
    chosen = [
        name for name, value in (("--model", model), ("--unit", unit_file), ("--service", service)) if value
    ]
    if len(chosen) != 1:
        raise UsageError("give exactly one of --model, --unit or --service")
    explicit = {name: options.pop(name) for name in VLLM_OPTION_FIELDS}
    overrides = vllm_overrides(explicit, list(ctx.args))
    service_pids: tuple[int, ...] = ()
    observations: list[Any] = []
    mismatch: str | None = None
    learned: str | None = None
    if model:
        args = ServeArgs(model=model, **overrides)
    else:
        if unit_file:
            view = view_from_unit(ServiceUnit.load_with_dropins(unit_file))
        else:
            deployer = deployer_for(ctx, service, True, 60.0)  # type: ignore[arg-type]
            systemd = deployer.systemd
            view = read_service(systemd, deployer.unit)
            learned = learn_from_running_instance(deployer, view)
            service_pids = tuple(systemd.unit_processes(view.name))
            observations = stored_observations(ctx.find_root().obj["state_dir"], view.name)
            mismatch = running_argv_mismatch(systemd, view)
        args = replace(view.args, **overrides)
    request = PlanRequest(target, **options)
    if target == AUTO_CONTEXT:
        target = largest_context(args, request, service_pids=service_pids, observations=observations)
        request = replace(request, context=target)
    result = plan_for(args, request, service_pids, observations)
    if mismatch:
        result = replace(result, warnings=(mismatch, *result.warnings))
    if learned:
        result = replace(result, notes=(learned, *result.notes))
    verdict = plan_verdict(result)
    if as_json:
        emit_json(
            {
                "command": "plan",
                "result": verdict,
                "changed": False,
                **result.to_json(),
                "feasible": None if verdict == "unknown" else result.feasible,
            }
        )
    else:
        echo(report.plan_text(result))
    if verdict == "infeasible":
        sys.exit(ExitCode.INFEASIBLE)
    if verdict == "unknown":
        sys.exit(ExitCode.UNKNOWN)


VLLM_OPTION_FIELDS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "data_parallel_size",
    "kv_cache_dtype",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
)


# ---- changing a service ----------------------------------------------------------------------


@main.command("set-context")
@click.argument("context", type=CONTEXT, required=False)
@click.option("--max-model-len", "max_model_len", type=CONTEXT, default=None, help="The same as CONTEXT.")
@click.option("--service", type=SERVICE, required=True, help="The systemd service that runs vLLM.")
@click.option("--gpu-memory-utilization", type=UTILIZATION, default=None,
              help="Use this utilisation instead of the planner's choice.")  # fmt: skip
@click.option("--probe-tokens", type=COUNT, default=None,
              help="max_tokens of the probe (default: what fills the context).")  # fmt: skip
@click.option("--long-probe", is_flag=True, help="Also send a prompt of about 90% of the context.")
@click.option("--timeout", type=TIMEOUT, default=1800.0, show_default=True, help="Seconds a start may take.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the unit diff; change nothing.")
@click.option("--force", is_flag=True, help="Apply even when the plan says it will not fit.")
@click.option(
    "--wait-lock", type=WAIT_LOCK, default=0.0, help="Seconds to wait for another run on the service."
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def set_context_cmd(ctx: click.Context, context: int | None, max_model_len: int | None, service: str,
                    gpu_memory_utilization: float | None, probe_tokens: int | None, long_probe: bool,
                    timeout: float, dry_run: bool, force: bool, wait_lock: float, yes: bool, as_json: bool,
                    **options: Any) -> None:  # fmt: skip
    """Set a service's context to CONTEXT: plan, render, restart, watch, probe, roll back on failure.

    \b
    CONTEXT as vLLM reads --max-model-len: 200000, 200k (= 200,000), 195K (= 199,680), or auto / -1:
    the largest context that fits, resolved before the restart (the unit gets the number).
    """
    target = context_from(context, max_model_len)
    deployer = deployer_for(ctx, service, as_json, timeout)
    planning = PlanRequest(target, **options)
    if target == AUTO_CONTEXT:
        target = largest_context(read_service(deployer.systemd, deployer.unit).args, planning)
        deployer.on_step(f"auto: the largest context that fits is {target}")
        planning = replace(planning, context=target)
    request = SetContextRequest(
        context=target,
        gpu_memory_utilization=gpu_memory_utilization,
        probe_tokens=probe_tokens,
        long_probe=long_probe,
        dry_run=dry_run or not yes,  # without --yes: show what would change, ask, then apply
        force=force,
        lock_wait=wait_lock,
        planning=planning,
    )
    result = set_context(deployer, request)
    if not dry_run and not yes and result.result == "dry-run":
        if not as_json:
            echo(report.change_text(result), err=True)
        confirm(yes, f"restart {deployer.unit} with max_model_len {target}")
        request.dry_run = False
        result = set_context(deployer, request)
    finish(result, as_json, dry_run=request.dry_run, systemd=deployer.systemd)


@main.command("rollback")
@click.option("--service", type=SERVICE, required=True, help="The systemd service that runs vLLM.")
@click.option(
    "--to",
    "to",
    type=click.IntRange(0, None),
    default=None,
    help="Revision to return to (default: the previous good one; see `ctxmgr history`).",
)
@click.option("--timeout", type=TIMEOUT, default=1800.0, show_default=True, help="Seconds a start may take.")
@click.option("--dry-run", is_flag=True, help="Print the unit diff; change nothing.")
@click.option(
    "--wait-lock", type=WAIT_LOCK, default=0.0, help="Seconds to wait for another run on the service."
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def rollback_cmd(ctx: click.Context, service: str, to: int | None, timeout: float, dry_run: bool,
                 wait_lock: float, yes: bool, as_json: bool) -> None:  # fmt: skip
    """Return a service to an earlier revision through the same restart / watch / probe path."""
    deployer = deployer_for(ctx, service, as_json, timeout)
    preview = dry_run or not yes
    result = rollback(deployer, to, wait_lock, dry_run=preview)
    if not dry_run and not yes and result.result == "dry-run":
        confirm(
            yes, f"restart {deployer.unit} with the unit of revision {to if to is not None else 'before'}"
        )
        preview = False
        result = rollback(deployer, to, wait_lock, dry_run=False)
    finish(result, as_json, dry_run=preview, systemd=deployer.systemd)


@main.command("recover")
@click.option("--service", type=SERVICE, required=True, help="The systemd service that runs vLLM.")
@click.option("--timeout", type=TIMEOUT, default=1800.0, show_default=True, help="Seconds a start may take.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def recover_cmd(ctx: click.Context, service: str, timeout: float, as_json: bool) -> None:
    """Finish the rollback of a change that an interrupted ctxmgr run left in progress."""
    deployer = deployer_for(ctx, service, as_json, timeout)
    with deployer.store.lock(0.0):
        result = deployer.recover_if_needed()
    if result is None:
        result = ChangeResult(
            deployer.unit, "recover", "unchanged", False, reason="no change was left in progress"
        )
    finish(result, as_json, systemd=deployer.systemd)


@main.command("history")
@click.option("--service", type=SERVICE, required=True, help="The systemd service that runs vLLM.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
@handle_errors
def history_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Every revision ctxmgr made of a service: time, context, utilisation, result, reason."""
    store = ServiceStore(ctx.find_root().obj["state_dir"], service)
    if not store.root.is_dir():
        canonical_unit(systemd_for(ctx), service)  # an unknown service is a usage error (exit 2)
    rows = history(store)
    if as_json:
        emit_json(
            {"command": "history", "result": "ok", "changed": False, "service": service, "revisions": rows}
        )
    else:
        echo(report.history_text(service, rows))


@main.command("observe")
@click.option("--service", type=SERVICE, required=True, help="The systemd service that runs vLLM.")
@click.option(
    "--import",
    "import_file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Store an observation that `ctxmgr observe --json` wrote on another host of the same GPU model "
    "and vLLM version, so this host plans from that real start.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (its `record` is what --import takes)."
)
@click.pass_context
@handle_errors
def observe_cmd(ctx: click.Context, service: str, import_file: str | None, as_json: bool) -> None:
    """Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans."""
    if import_file:
        # read first, through the bounded door: a FIFO or /dev/zero is refused before anything else
        raw = files.read_regular(import_file, MAX_IMPORT_BYTES, what="observation", error=UsageError)
        deployer = deployer_for(ctx, service, True, 60.0)
        record = imported_observation(raw.decode(errors="replace"), import_file, **import_match(deployer))
        with deployer.store.lock(0.0):
            deployer.store.add_observation(record)
        if as_json:
            emit_json({"command": "observe", "result": "applied", "changed": True, "service": deployer.unit,
                       "record": record})  # fmt: skip
        else:
            echo(f"{deployer.unit}: stored the observation from {record['imported_from']}")
        return
    deployer = deployer_for(ctx, service, True, 60.0)
    with deployer.store.lock(0.0):
        data = observe_last_start(deployer)
        stored = deployer.store.observations()
    record = stored[-1] if stored else {}
    if as_json:
        emit_json({"command": "observe", "result": "ok", "changed": False, **data, "record": record})
        return
    obs = data["observation"]
    echo(f"{service}: last start ({data['lines']} journal lines): " + ", ".join(
        f"{k} {v}" for k, v in obs.items() if v not in (None, False, "")
    ))  # fmt: skip


def import_match(deployer: Deployer) -> dict[str, Any]:
    """What an imported observation must match: this service, its vLLM, this host's GPUs (each only
    where it can be known here)."""
    version: str | None = None
    with contextlib.suppress(CtxmgrError):
        version = read_service(deployer.systemd, deployer.unit).args.vllm_version
    gpu_names: list[str] = []
    with contextlib.suppress(CtxmgrError, OSError):
        gpu_names = [gpu.name for gpu in read_nvml().gpus]
    return {"service": deployer.unit, "vllm_version": version, "gpu_names": gpu_names}


def entry() -> None:  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]) or "ctxmgr")


__all__ = ["main"]


# Operating services over time (verify, schedule, unschedule, status) lives in cli/ops.py.
for command in (ops.verify_cmd, ops.schedule_cmd, ops.unschedule_cmd, ops.status_cmd):
    main.add_command(command)
