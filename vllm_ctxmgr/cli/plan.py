"""`ctxmgr plan`: flags, memory per GPU, or the largest context that fits.

What the plan runs on (the planner, the model's files, a unit) is imported inside the command, so
`ctxmgr plan --help` and a completion TAB load only click and the option types.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from vllm_ctxmgr.cli.examples import EXAMPLES
from vllm_ctxmgr.cli.group import closest_option
from vllm_ctxmgr.cli.output import echo, emit_json, handle_errors
from vllm_ctxmgr.cli.params import (
    BLOCK_SIZE,
    CONTEXT,
    COUNT,
    PARALLEL,
    VLLM_BYTES,
    gpu_memory_utilization_option,
    gpu_options,
    json_option,
    max_model_len_option,
)
from vllm_ctxmgr.cli.service_param import service_param
from vllm_ctxmgr.errors import UnitError, UsageError

if TYPE_CHECKING:
    from vllm_ctxmgr.change.planning import PlanRequest
    from vllm_ctxmgr.change.restart import Restarter
    from vllm_ctxmgr.core.upgrade import CapacityMove
    from vllm_ctxmgr.systemd.service import ServiceView


def context_from(context: int | None, max_model_len: int | None) -> int:
    """The positional CONTEXT or vLLM's own --max-model-len spelling; one of them, or both the same."""
    if context is not None and max_model_len is not None and context != max_model_len:
        raise UsageError(f"CONTEXT {context} and --max-model-len {max_model_len} disagree; give one")
    chosen = context if context is not None else max_model_len
    if chosen is None:
        raise UsageError("give the context: CONTEXT or --max-model-len N (200000, 200k, 195K, auto)")
    return chosen


def vllm_overrides(
    explicit: Mapping[str, object],
    extra: list[str],
    vllm_version: str | None = None,
    command: click.Command | None = None,
) -> dict[str, object]:
    """ServeArgs fields from ctxmgr's vLLM options and from any other vLLM flag given after them.

    The extra words are parsed by the same parser that reads a unit's ExecStart, so `plan` understands
    exactly the flags a unit can hold: every flag of vLLM 0.10 - 0.33 (core/vllm_flags.py); one no release
    has is refused with the closest real one, since a typo would be a silent no-op. With --vllm-version,
    a flag of other releases only is refused as that release's argparse refuses it.
    """
    from vllm_ctxmgr.core.serve_args import ServeArgs, parse_serve_argv, split_flags
    from vllm_ctxmgr.core.vllm_flags import closest as closest_vllm_flag
    from vllm_ctxmgr.core.vllm_flags import flag as vllm_flag
    from vllm_ctxmgr.core.vllm_flags import unrecognized as unrecognized_vllm_flags
    from vllm_ctxmgr.core.vllm_versions import parse_vllm_version

    overrides = {k: v for k, v in explicit.items() if v is not None}
    if not extra:
        return overrides
    version = parse_vllm_version(vllm_version)
    _positionals, flags = split_flags(extra)
    for name in [f for f in flags if vllm_flag(f) is None] + _positionals:
        # ctxmgr's own options answer a typo first (`--gpu-memroy` is --gpu-memory), then vLLM's flags
        own = closest_option(name, command) if command is not None and name.startswith("-") else None
        guess = own or closest_vllm_flag(name, version)
        hint = f"; did you mean {guess}?" if guess else ""
        raise UsageError(f"{name}: not a vLLM flag nor an option of ctxmgr{hint}")
    refused = unrecognized_vllm_flags(flags, version, vllm_version or "", whose="--vllm-version")
    if refused:
        raise UsageError(refused)
    base = parse_serve_argv(["MODEL"])
    given = parse_serve_argv(["MODEL", *extra])
    for field in fields(ServeArgs):
        if field.name != "model" and getattr(given, field.name) != getattr(base, field.name):
            overrides.setdefault(field.name, getattr(given, field.name))
    return overrides


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, epilog=EXAMPLES["plan"]
)
@click.argument("context", type=CONTEXT, required=False)
@service_param(required=False, argument=False)  # a word after CONTEXT may be a vLLM flag's value
@max_model_len_option
@click.option("--model", "model", default=None, help="HF model dir, cached repo id, or GGUF file.")
@click.option("--unit", "unit_file", type=click.Path(dir_okay=False), default=None,
              help="Read a unit file (and its FILE.d/*.conf drop-ins).")  # fmt: skip
@click.option("--root", "root", type=click.Path(file_okay=False, exists=True), default=None,
              help="With --unit: read the files the unit names (EnvironmentFile=, a vLLM --config) under "
                   "this directory as the host's root, e.g. a copy of another host's /etc, or units/ for "
                   "the shipped examples' units/etc/.")  # fmt: skip
@click.option("--tensor-parallel-size", "-tp", type=PARALLEL, default=None, help="vLLM's -tp.")
@click.option("--pipeline-parallel-size", "-pp", type=PARALLEL, default=None, help="vLLM's -pp.")
@click.option("--decode-context-parallel-size", "-dcp", type=PARALLEL, default=None, help="vLLM's -dcp.")
@click.option("--data-parallel-size", "-dp", type=PARALLEL, default=None, help="vLLM's -dp.")
@click.option("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype (auto, fp8, fp8_ds_mla, ...).")
@click.option("--block-size", type=BLOCK_SIZE, default=None, help="vLLM's --block-size (tokens per block).")
@click.option("--max-num-batched-tokens", type=COUNT, default=None, help="vLLM's --max-num-batched-tokens.")
@click.option("--max-num-seqs", type=COUNT, default=None, help="vLLM's --max-num-seqs.")
@gpu_memory_utilization_option.but(help="vLLM's utilisation (0-1].")
@click.option(
    "--kv-cache-memory-bytes",
    type=VLLM_BYTES,
    default=None,
    help="vLLM's --kv-cache-memory-bytes, parsed as vLLM does: 20g = 20e9 bytes, 20G = 20 GiB.",
)
@gpu_options
@json_option
@click.pass_context
@handle_errors
def plan(ctx: click.Context, context: int | None, max_model_len: int | None, model: str | None,
         unit_file: str | None, root: str | None, service: str | None, as_json: bool,
         **options: Any) -> None:  # fmt: skip
    """Plan CONTEXT tokens: flags, memory per GPU, or the largest context that fits and what would help.

    \b
    CONTEXT is vLLM's --max-model-len: 200000, 200k (= 200,000), 195K (= 199,680: K is 1,024 as
    vLLM reads it), or auto / -1 for the largest context that fits. Any other vLLM flag that a unit
    can hold (--enforce-eager, --dtype, --speculative-config ...) may follow.
    Exit: 0 feasible, 3 infeasible, 6 unknown (no memory information), 2 usage.
    """
    from vllm_ctxmgr import report
    from vllm_ctxmgr.change.planning import PlanRequest, largest_context, plan_as_run, plan_for, plan_service
    from vllm_ctxmgr.core.change_policy import flags_to_apply
    from vllm_ctxmgr.core.plan_record import PlanResult
    from vllm_ctxmgr.core.serve_args import AUTO_CONTEXT, ServeArgs, with_overrides

    # the words after the options first: a misspelt option of plan's own (`--modle DIR`) is named as
    # such, not answered with what its absence means
    explicit = {name: options.pop(name) for name in VLLM_OPTION_FIELDS}
    overrides = vllm_overrides(explicit, list(ctx.args), options.get("vllm_version"), ctx.command)
    chosen = [
        name for name, value in (("--model", model), ("--unit", unit_file), ("--service", service)) if value
    ]
    if len(chosen) != 1 and chosen != ["--model", "--unit"]:  # --unit --model: the unit on a local copy
        raise UsageError("give exactly one of --model, --unit or --service (--model may go with --unit)")
    if root and not unit_file:
        raise UsageError("--root reads a unit's files: give it with --unit")
    # a utilisation given is the one the deployment runs with (as set-context takes it), not a hint
    fixed = explicit["gpu_memory_utilization"]
    unit_args: ServeArgs | None = None
    unit_view: ServiceView | None = None  # the unit set-context would edit
    # no CONTEXT: the one the unit (or a vLLM flag after the options, `--max_model_len 64k`) gives
    given = context is not None or max_model_len is not None
    if service:
        from vllm_ctxmgr.cli.restarter import restarter_for
        from vllm_ctxmgr.systemd.service import read_service

        restarter = restarter_for(ctx, service, as_json=True, timeout=60.0)
        if not given:  # plan_service reads the unit again with the plan; this is only for its context
            unit_args = with_overrides(read_service(restarter.systemd, restarter.unit).args, overrides)
    elif unit_file:
        from vllm_ctxmgr.systemd.service import view_from_unit
        from vllm_ctxmgr.systemd.unit_file import ServiceUnit

        unit_view = view_from_unit(ServiceUnit.load_with_dropins(unit_file), Path(root or "/"))
        unit_args = with_overrides(unit_view.args, {**overrides, **({"model": model} if model else {})})
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
        result, unit_view = planned.plan, planned.view
        unit_args = with_overrides(planned.view.args, overrides)
    else:
        args = unit_args if unit_args is not None else ServeArgs(model=model, **overrides)  # type: ignore[arg-type]
        if target == AUTO_CONTEXT:
            request = replace(request, context=largest_context(args, request))
        # a unit's plan is at what set-context would run: the unit's utilisation where it holds the
        # target and stays (core.change_policy, the rule set-context applies), the least one more figure
        result = plan_as_run(args, request) if unit_args is not None else plan_for(args, request)
    # what set-context would write to this unit
    applied = (
        flags_to_apply(unit_args, result, result.max_model_len, fixed)
        if unit_args is not None and result.feasible
        else None
    )
    refused = edit_refusal(unit_view, applied.flag_changes, result.env_changes) if applied else None
    verdict = result.result
    if applied is not None and verdict is PlanResult.UNKNOWN and refused is None and applied.flag_changes:
        from vllm_ctxmgr.core.change_policy import unknown_refusal

        refused = unknown_refusal(result)  # set-context acts on no verdict it does not have
    upgrade = None
    if service and unit_view is not None:
        upgrade = upgrade_before(restarter, request, unit_view, overrides)
    if as_json:
        # the object's `schema` is the CLI's (SCHEMA_VERSION), not the stored plan's (PLAN_SCHEMA)
        record = {k: v for k, v in result.to_json().items() if k != "schema"}
        if applied is not None:
            record["set_context"] = {**applied.to_json(result), "refused": refused}
        if upgrade is not None:
            record["vllm_upgrade"] = upgrade.to_json()
        emit_json({"command": "plan", "changed": False, **record})
    else:
        applies = applied.text(result) if applied is not None else ""
        if refused:
            applies = f"set-context would refuse: {refused}"
        echo(report.plan_text(result, applies))
        if upgrade is not None:
            echo(f"upgrade: {upgrade.text()}")
    if verdict is not PlanResult.FEASIBLE:
        sys.exit(verdict.exit_code)


def upgrade_before(
    restarter: Restarter, request: PlanRequest, view: ServiceView, overrides: Mapping[str, object]
) -> CapacityMove | None:
    """With --vllm-version other than the release the unit runs (its installed vLLM, else its last
    watched start's): the unit planned under both, so the answer says what the upgrade moves before it
    is made. None where no other release was asked for or the unit's own is not known."""
    from vllm_ctxmgr.change.planning import upgrade_move
    from vllm_ctxmgr.core.vllm_versions import parse_vllm_version

    if request.vllm_version is None:
        return None
    stored = restarter.store.observations()
    current = view.args.vllm_version or (stored[-1].get("vllm_version") if stored else None)
    if not current or parse_vllm_version(current) == parse_vllm_version(request.vllm_version):
        return None
    systemd, store = restarter.systemd, restarter.store
    return upgrade_move(systemd, store, restarter.service, current, request.vllm_version, request, overrides)


def edit_refusal(view: ServiceView | None, flags: dict[str, str], env: dict[str, str]) -> str | None:
    """Why set-context could not write these flags into the unit (a Quadlet-generated unit, ...): the
    same edit, not installed anywhere; None where it could."""
    if view is None or not (flags or env):
        return None
    from vllm_ctxmgr.systemd.unit_edit import edit_unit

    try:
        edit_unit(view.unit, flags, env)
    except UnitError as exc:
        return exc.message
    return None


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
