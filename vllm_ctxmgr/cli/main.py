"""The command line: thin click commands over the library. Heavy modules load lazily."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import fields, replace
from typing import Any

import click

from vllm_ctxmgr import files, report
from vllm_ctxmgr.change import ChangeResult, Result
from vllm_ctxmgr.cli import deployment, ops
from vllm_ctxmgr.cli.common import (
    AUTO_CONTEXT,
    BLOCK_SIZE,
    CONTEXT,
    COUNT,
    EXAMPLES,
    PARALLEL,
    TIMEOUT,
    UTILIZATION,
    VLLM_BYTES,
    VLLM_VERSION,
    WAIT_LOCK,
    CtxmgrGroup,
    check_state_dir,
    confirmation,
    echo,
    emit_json,
    finish,
    gpu_options,
    handle_errors,
    restarter_for,
    service_param,
    systemd_for,
)
from vllm_ctxmgr.core.change_policy import flags_to_apply
from vllm_ctxmgr.core.serve_args import ServeArgs, parse_serve_argv, split_flags, with_overrides
from vllm_ctxmgr.core.vllm_flags import closest as closest_vllm_flag
from vllm_ctxmgr.core.vllm_flags import flag as vllm_flag
from vllm_ctxmgr.core.vllm_flags import unrecognized as unrecognized_vllm_flags
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.deploy import SetContextRequest, rollback, set_context
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.observing import observe_last_start
from vllm_ctxmgr.planning import (
    MAX_IMPORT_BYTES,
    PlanRequest,
    imported_observation,
    largest_context,
    plan_for,
    plan_service,
)
from vllm_ctxmgr.recovery import recover_if_needed
from vllm_ctxmgr.restart import Restarter
from vllm_ctxmgr.service import read_service, view_from_unit
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.names import canonical_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit


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
    Every command: 70 ctxmgr crashed (an unexpected error, a bug; --debug shows it): no verdict.
    With --json every command prints exactly one JSON object on stdout, errors included.
    """
    ctx.obj = {"state_dir": check_state_dir(state_dir), "systemd_pid": systemd_pid, "unit_dir": unit_dir}


# ---- facts / gpus ----------------------------------------------------------------------------


@main.command(epilog=EXAMPLES["facts"])
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


@main.command(epilog=EXAMPLES["gpus"])
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


def vllm_overrides(
    explicit: dict[str, Any], extra: list[str], vllm_version: str | None = None
) -> dict[str, Any]:
    """ServeArgs fields from ctxmgr's vLLM options and from any other vLLM flag given after them.

    The extra words are parsed by the same parser that reads a unit's ExecStart, so `plan` understands
    exactly the flags a unit can hold: every flag of vLLM 0.10 - 0.33 (core/vllm_flags.py); one no release
    has is refused with the closest real one, since a typo would be a silent no-op. With --vllm-version,
    a flag of other releases only is refused as that release's argparse refuses it.
    """
    overrides = {k: v for k, v in explicit.items() if v is not None}
    if not extra:
        return overrides
    version = parse_vllm_version(vllm_version)
    _positionals, flags = split_flags(extra)
    for name in [f for f in flags if vllm_flag(f) is None] + _positionals:
        guess = closest_vllm_flag(name, version)
        hint = f"; did you mean {guess}?" if guess else ""
        raise UsageError(f"{name}: not a vLLM flag{hint}")
    refused = unrecognized_vllm_flags(flags, version, vllm_version or "", whose="--vllm-version")
    if refused:
        raise UsageError(refused)
    base = parse_serve_argv(["MODEL"])
    given = parse_serve_argv(["MODEL", *extra])
    for field in fields(ServeArgs):
        if field.name != "model" and getattr(given, field.name) != getattr(base, field.name):
            overrides.setdefault(field.name, getattr(given, field.name))
    return overrides


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, epilog=EXAMPLES["plan"]
)
@click.argument("context", type=CONTEXT, required=False)
@service_param(required=False, argument=False)  # a word after CONTEXT may be a vLLM flag's value
@click.option("--max-model-len", "max_model_len", type=CONTEXT, default=None, help="The same as CONTEXT.")
@click.option("--model", "model", default=None, help="HF model dir, cached repo id, or GGUF file.")
@click.option("--unit", "unit_file", type=click.Path(dir_okay=False), default=None,
              help="Read a unit file (and its FILE.d/*.conf drop-ins).")  # fmt: skip
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
    chosen = [
        name for name, value in (("--model", model), ("--unit", unit_file), ("--service", service)) if value
    ]
    if len(chosen) != 1 and chosen != ["--model", "--unit"]:  # --unit --model: the unit on a local copy
        raise UsageError("give exactly one of --model, --unit or --service (--model may go with --unit)")
    explicit = {name: options.pop(name) for name in VLLM_OPTION_FIELDS}
    overrides = vllm_overrides(explicit, list(ctx.args), options.get("vllm_version"))
    # a utilisation given is the one the deployment runs with (as set-context takes it), not a hint
    fixed = explicit["gpu_memory_utilization"]
    unit_args: ServeArgs | None = None
    # no CONTEXT: the one the unit (or a vLLM flag after the options, `--max_model_len 64k`) gives
    given = context is not None or max_model_len is not None
    if service:
        restarter = restarter_for(ctx, service, True, 60.0)
        if not given:  # plan_service reads the unit again with the plan; this is only for its context
            unit_args = with_overrides(read_service(restarter.systemd, restarter.unit).args, overrides)
    elif unit_file:
        view = view_from_unit(ServiceUnit.load_with_dropins(unit_file))
        unit_args = with_overrides(view.args, {**overrides, **({"model": model} if model else {})})
    if given or unit_args is None:
        target = context_from(context, max_model_len)
    else:
        target = context_from(None, unit_args.max_model_len)
    request = PlanRequest(target, fixed_gpu_memory_utilization=fixed, **options)
    if service:
        planned = plan_service(
            restarter.systemd, restarter.store, restarter.service, request, restarter.keep_observation,
            overrides=overrides,
        )  # fmt: skip
        result, unit_args = planned.plan, with_overrides(planned.view.args, overrides)
    else:
        args = unit_args if unit_args is not None else ServeArgs(model=model, **overrides)  # type: ignore[arg-type]
        if target == AUTO_CONTEXT:
            request = replace(request, context=largest_context(args, request))
        result = plan_for(args, request)
    # what set-context would write to this unit: the plan's figure is the least that fits, the unit's
    # own utilisation stays where it holds the target (core.change_policy, the rule set-context applies)
    applied = (
        flags_to_apply(unit_args, result, result.max_model_len, fixed)
        if unit_args is not None and result.feasible
        else None
    )
    verdict = result.result
    if as_json:
        # the object's `schema` is the CLI's (SCHEMA_VERSION), not the stored plan's (PLAN_SCHEMA)
        record = {k: v for k, v in result.to_json().items() if k != "schema"}
        if applied is not None:
            record["set_context"] = applied.to_json(result)
        emit_json({"command": "plan", "changed": False, **record})
    else:
        echo(report.plan_text(result, applied.text(result) if applied is not None else ""))
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


@main.command("set-context", epilog=EXAMPLES["set-context"])
@click.argument("context", type=CONTEXT, required=False)
@service_param()
@click.option("--max-model-len", "max_model_len", type=CONTEXT, default=None, help="The same as CONTEXT.")
@click.option("--gpu-memory-utilization", type=UTILIZATION, default=None,
              help="Use this utilisation instead of the planner's choice.")  # fmt: skip
@click.option("--probe-tokens", type=COUNT, default=None,
              help="max_tokens of the probe (default: what fills the context).")  # fmt: skip
@click.option("--long-probe", is_flag=True, help="Also send a prompt of about 90% of the context.")
@click.option("--timeout", type=TIMEOUT, default="30min", show_default=True, help="Time a start may take.")
@click.option("--dry-run", is_flag=True, help="Print the plan and the unit diff; change nothing.")
@click.option("--force", is_flag=True, help="Apply even when the plan says it will not fit.")
@click.option("--wait-lock", type=WAIT_LOCK, default=0.0, help="Time to wait for another run on the service.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
@click.option(
    "--edit",
    type=click.Choice(["in-place", "dropin"]),
    envvar="CTXMGR_EDIT",
    default="in-place",
    show_default=True,
    help="in-place: change the file that holds ExecStart=. dropin: leave the unit file alone and write "
    "ExecStart= to UNIT.d/50-ctxmgr.conf, as `systemctl edit` would (for a unit that configuration "
    "management renders). Env CTXMGR_EDIT.",
)
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def set_context_cmd(ctx: click.Context, context: int | None, max_model_len: int | None, service: str,
                    gpu_memory_utilization: float | None, probe_tokens: int | None, long_probe: bool,
                    timeout: float, dry_run: bool, force: bool, wait_lock: float, yes: bool, edit: str,
                    as_json: bool, **options: Any) -> None:  # fmt: skip
    """Set a service's context to CONTEXT: plan, render, restart, watch, probe, roll back on failure.

    \b
    CONTEXT as vLLM reads --max-model-len: 200000, 200k (= 200,000), 195K (= 199,680), or auto / -1:
    the largest context that fits, resolved before the restart (the unit gets the number).
    """
    target = context_from(context, max_model_len)
    restarter = restarter_for(ctx, service, as_json, timeout)
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


@main.command("rollback", epilog=EXAMPLES["rollback"])
@service_param()
@click.option(
    "--to",
    "to",
    type=click.IntRange(0, None),
    default=None,
    help="Revision to return to (default: the previous good one; see `ctxmgr history`).",
)
@click.option("--timeout", type=TIMEOUT, default="30min", show_default=True, help="Time a start may take.")
@click.option("--dry-run", is_flag=True, help="Print the unit diff; change nothing.")
@click.option("--wait-lock", type=WAIT_LOCK, default=0.0, help="Time to wait for another run on the service.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing the service.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def rollback_cmd(ctx: click.Context, service: str, to: int | None, timeout: float, dry_run: bool,
                 wait_lock: float, yes: bool, as_json: bool) -> None:  # fmt: skip
    """Return a service to an earlier revision through the same restart / watch / probe path."""
    restarter = restarter_for(ctx, service, as_json, timeout)
    confirm = None if dry_run else confirmation(yes, as_json, restarter.unit)
    result = rollback(restarter, to, wait_lock, dry_run=dry_run, confirm=confirm)
    finish(result, as_json, dry_run=dry_run, systemd=restarter.systemd)


@main.command("recover", epilog=EXAMPLES["recover"])
@service_param()
@click.option("--timeout", type=TIMEOUT, default="30min", show_default=True, help="Time a start may take.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with `changed`).")
@click.pass_context
@handle_errors
def recover_cmd(ctx: click.Context, service: str, timeout: float, as_json: bool) -> None:
    """Finish the rollback of a change that an interrupted ctxmgr run left in progress."""
    restarter = restarter_for(ctx, service, as_json, timeout)
    with restarter.store.lock(0.0):
        result = recover_if_needed(restarter)
    if result is None:
        result = ChangeResult(
            restarter.unit, "recover", Result.UNCHANGED, False, reason="no change was left in progress"
        )
    finish(result, as_json, systemd=restarter.systemd)


@main.command("history", epilog=EXAMPLES["history"])
@service_param()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
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


@main.command("observe", epilog=EXAMPLES["observe"])
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
    "--json", "as_json", is_flag=True, help="Print one JSON object (its `record` is what --import takes)."
)
@click.pass_context
@handle_errors
def observe_cmd(ctx: click.Context, service: str, import_file: str | None, as_json: bool) -> None:
    """Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans."""
    if import_file:
        # read first, through the bounded door: a FIFO or /dev/zero is refused before anything else
        raw = files.read_regular(import_file, MAX_IMPORT_BYTES, what="observation", error=UsageError)
        restarter = restarter_for(ctx, service, True, 60.0)
        record = imported_observation(raw.decode(errors="replace"), import_file, **import_match(restarter))
        with restarter.store.lock(0.0):
            restarter.store.add_observation(record)
        if as_json:
            emit_json({"command": "observe", "result": "applied", "changed": True, "service": restarter.unit,
                       "record": record})  # fmt: skip
        else:
            echo(f"{restarter.unit}: stored the observation from {record['imported_from']}")
        return
    restarter = restarter_for(ctx, service, True, 60.0)
    with restarter.store.lock(0.0):
        observed, obs, lines = observe_last_start(restarter.systemd, restarter.service)
        restarter.store.add_observation(observed.to_json())
        stored = restarter.store.observations()
    record = stored[-1] if stored else {}
    if as_json:
        emit_json({"command": "observe", "result": "ok", "changed": False, "service": restarter.service,
                   "observation": obs, "lines": lines, "record": record})  # fmt: skip
        return
    echo(f"{service}: last start ({lines} journal lines): " + ", ".join(
        f"{k} {v}" for k, v in obs.items() if v not in (None, False, "")
    ))  # fmt: skip


def import_match(restarter: Restarter) -> dict[str, Any]:
    """What an imported observation must match: this service, its vLLM, this host's GPUs (each only
    where it can be known here)."""
    version: str | None = None
    with contextlib.suppress(CtxmgrError):
        version = read_service(restarter.systemd, restarter.unit).args.vllm_version
    gpu_names: list[str] = []
    with contextlib.suppress(CtxmgrError, OSError):
        gpu_names = [gpu.name for gpu in read_nvml().gpus]
    return {"service": restarter.unit, "vllm_version": version, "gpu_names": gpu_names}


__all__ = ["main"]


# Operating services over time (verify, schedule, unschedule, status) lives in cli/ops.py.
for command in (ops.verify_cmd, ops.schedule_cmd, ops.unschedule_cmd, ops.status_cmd):
    main.add_command(command)
# One deployment over several machines, and the steps its coordinator runs on each: cli/deployment.py.
main.add_command(deployment.deployment_group)
main.add_command(deployment.node_group)
