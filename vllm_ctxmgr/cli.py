"""The command line: thin click commands over the library. Heavy modules load lazily."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from .errors import EXIT_ERROR, CtxmgrError


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures: one line on stderr and the documented exit code; tracebacks only with --debug."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        try:
            return func(*args, **kwargs)
        except CtxmgrError as exc:
            if debug:
                raise
            click.echo(f"ctxmgr: {exc.message}", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, KeyboardInterrupt):
            raise
        except Exception as exc:
            if debug:
                raise
            click.echo(f"ctxmgr: unexpected error: {type(exc).__name__}: {exc} (run with --debug)", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper


class ContextArg(click.ParamType):
    """A context length: 200000, 200k, 128K (vLLM's own forms)."""

    name = "CONTEXT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        else:
            from .serve_args import human_readable_int

            try:
                number = human_readable_int(str(value))
            except CtxmgrError:
                self.fail(f"{value!r} is not a context length (use e.g. 200000, 200k or 128K)", param, ctx)
        if number <= 0:
            self.fail(f"{value!r}: a context length must be positive", param, ctx)
        return number


class ByteSize(click.ParamType):
    """95.6GiB, 80G (GiB), 81920MiB, or plain bytes."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        import re

        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
        if not match:
            self.fail(f"{value!r} is not a size (use e.g. 95.6GiB, 80G, 81920MiB)", param, ctx)
        number, unit = match.groups()
        unit = (unit or "B").upper().rstrip("B").rstrip("I")
        scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        return int(float(number) * scale)


CONTEXT = ContextArg()
SIZE = ByteSize()


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


def _systemd(ctx: click.Context):  # type: ignore[no-untyped-def]
    from pathlib import Path

    from .systemd import Systemd

    obj = ctx.find_root().obj
    systemd = Systemd.for_pid(obj["systemd_pid"]) if obj["systemd_pid"] else Systemd.local()
    if obj["unit_dir"]:
        systemd.unit_dir = Path(obj["unit_dir"])
    return systemd


# ---- facts / gpus ----------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--vllm-version", default=None, help="Derive the maximum length by this vLLM's rules.")
@handle_errors
def facts(model: str, as_json: bool, vllm_version: str | None) -> None:
    """What vLLM will see in MODEL: a HF model dir, a cached repo id, or a GGUF file."""
    from . import report
    from .sources import load_model_facts

    model_facts = load_model_facts(model)
    from .errors import UsageError
    from .plan import parse_vllm_version

    version = parse_vllm_version(vllm_version) or report.NEWEST_VLLM
    if vllm_version and parse_vllm_version(vllm_version) is None:
        raise UsageError(f"{vllm_version!r} is not a vLLM version (e.g. 0.33.0)")
    if as_json:
        _emit_json(report.facts_json(model_facts, version))
    else:
        click.echo(report.facts_text(model_facts, version))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (input for --gpus-from).")
@handle_errors
def gpus(as_json: bool) -> None:
    """The GPUs on this host: total, free, used, and who uses them (NVML)."""
    from . import report
    from .gpus import read_nvml

    state = read_nvml()
    if as_json:
        _emit_json(state.to_json())
    else:
        click.echo(report.gpus_text(state))


# ---- plan ------------------------------------------------------------------------------------


def gpu_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Where the GPUs' memory comes from when NVML is not the answer (offline, another host)."""
    for option in reversed(
        [
            click.option("--gpu-memory", type=SIZE, default=None, help="Plan offline: memory of each GPU."),
            click.option("--gpu-count", type=int, default=None, help="Plan offline: number of GPUs."),
            click.option(
                "--gpu-name",
                default=None,
                help="Plan offline: the GPU model (e.g. 'NVIDIA H200'), which decides backends and defaults.",
            ),
            click.option(
                "--gpus-from",
                type=click.Path(dir_okay=False),
                default=None,
                help="`ctxmgr gpus --json` output.",
            ),
            click.option("--weights-bytes", type=SIZE, default=None, help="Weights of all ranks together."),
            click.option(
                "--vllm-version", default=None, help="Plan by this vLLM's rules (default: newest known)."
            ),
            click.option(
                "--allow-long", is_flag=True, help="Allow a context above the model's derived maximum."
            ),
            click.option(
                "--max-gpu-memory-utilization",
                type=click.FloatRange(0.01, 1.0),
                default=0.95,
                show_default=True,
                help="Never pick a utilisation above this.",
            ),
        ]
    ):
        func = option(func)
    return func


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

    from .errors import EXIT_INFEASIBLE, UsageError
    from .serve_args import ServeArgs

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
        from .deploy import read_service, view_from_unit
        from .unit import ServiceUnit

        if unit_file:
            view = view_from_unit(ServiceUnit.load(unit_file.rsplit("/", 1)[-1], unit_file))
        else:
            systemd = _systemd(ctx)
            view = read_service(systemd, service)  # type: ignore[arg-type]
            service_pids = tuple(systemd.unit_processes(view.name))
            observations = _stored_observations(ctx, view.name)
        args = replace(view.args, **overrides)
    result = _make_plan(args, context, options, service_pids=service_pids, observations=observations)
    if as_json:
        _emit_json(result.to_json())
    else:
        from . import report

        click.echo(report.plan_text(result))
    if not result.feasible:
        sys.exit(EXIT_INFEASIBLE)


def _stored_observations(ctx: click.Context, unit: str) -> list[Any]:
    from .inputs import observations_from_store
    from .store import ServiceStore

    store = ServiceStore(ctx.find_root().obj["state_dir"], unit.removesuffix(".service"))
    return observations_from_store(store.observations())


def _make_plan(args: Any, context: int, options: dict[str, Any], service_pids: tuple[int, ...] = (),
               observations: list[Any] | None = None) -> Any:  # fmt: skip
    """Facts + GPUs + earlier starts -> Plan (the I/O here, the pure planner in plan.make_plan)."""
    from .inputs import effective_args, gather_gpus, is_cpu_deployment
    from .kv import NEWEST_VLLM
    from .plan import PlanOptions, make_plan, parse_vllm_version
    from .sources import load_model_facts

    args = effective_args(args)
    cpu = is_cpu_deployment(args)
    facts_ = load_model_facts(args.model, hf_home=args.env.get("HF_HOME"))
    gpu_state = None
    if cpu and not args.kv_cache_memory_bytes:
        from .inputs import cpu_node_memory

        gpu_state = cpu_node_memory()  # on the CPU build the utilisation is a fraction of node memory
    elif not cpu:
        gpu_state, _note = gather_gpus(
            options.get("gpu_memory"),
            options.get("gpu_count"),
            options.get("gpu_name"),
            options.get("gpus_from"),
            args.env.get("CUDA_VISIBLE_DEVICES"),
        )
    version = (
        parse_vllm_version(options.get("vllm_version"))
        or parse_vllm_version(args.vllm_version)
        or NEWEST_VLLM
    )
    plan_options = PlanOptions(
        target_context=context,
        allow_long=bool(options.get("allow_long")),
        vllm_version=version,
        max_gpu_memory_utilization=options.get("max_gpu_memory_utilization") or 0.95,
        weights_bytes=options.get("weights_bytes"),
        fixed_gpu_memory_utilization=options.get("fixed_gpu_memory_utilization"),
        service_pids=service_pids,
        cpu=cpu,
    )
    return make_plan(facts_, args, gpu_state, plan_options, observations or ())


# ---- changing a service ----------------------------------------------------------------------


def _deployer(ctx: click.Context, service: str, as_json: bool, timeout: float) -> Any:
    from .deploy import Deployer
    from .store import ServiceStore

    store = ServiceStore(ctx.find_root().obj["state_dir"], service.removesuffix(".service"))

    def say(text: str) -> None:
        if not as_json:
            click.echo(f"ctxmgr: {text}", err=True)

    def vllm_line(text: str) -> None:
        if not as_json:
            click.echo(f"  | {text[:160]}", err=True)

    return Deployer(_systemd(ctx), store, service, on_line=vllm_line, on_step=say, start_timeout=timeout)


def _confirm(yes: bool, what: str) -> None:
    from .errors import UsageError

    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(
            f"{what}: not a terminal, so nothing was changed; pass --yes to apply without a prompt"
        )
    if not click.confirm(f"{what}?", default=False, err=True):
        raise UsageError("nothing was changed")


def _finish(result: Any, as_json: bool) -> None:
    from . import report

    if as_json:
        _emit_json(result.to_json())
    else:
        click.echo(report.change_text(result))
    sys.exit(result.exit_code)


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
    from .deploy import SetContextRequest, set_context

    deployer = _deployer(ctx, service, as_json, timeout)
    request = SetContextRequest(
        context=context,
        gpu_memory_utilization=gpu_memory_utilization,
        probe_tokens=probe_tokens,
        long_probe=long_probe,
        dry_run=dry_run or not yes,  # without --yes: show what would change, ask, then apply
        force=force,
        lock_wait=wait_lock,
        plan_options=options,
    )
    result = set_context(deployer, request, _plan_for_service)
    if not dry_run and not yes and result.result == "dry-run":
        from . import report

        if not as_json:
            click.echo(report.change_text(result), err=True)
        _confirm(yes, f"restart {deployer.unit} with max_model_len {context}")
        request.dry_run = False
        result = set_context(deployer, request, _plan_for_service)
    _finish(result, as_json)


def _plan_for_service(args: Any, context: int, options: dict[str, Any], pids: tuple[int, ...],
                      observations: list[Any]) -> Any:  # fmt: skip
    return _make_plan(args, context, options, service_pids=pids, observations=observations)


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
    from .deploy import rollback

    deployer = _deployer(ctx, service, as_json, timeout)
    result = rollback(deployer, to, wait_lock, dry_run=dry_run or not yes)
    if not dry_run and not yes and result.result == "dry-run":
        _confirm(
            yes, f"restart {deployer.unit} with the unit of revision {to if to is not None else 'before'}"
        )
        result = rollback(deployer, to, wait_lock, dry_run=False)
    _finish(result, as_json)


@main.command("recover")
@click.option("--service", required=True)
@click.option("--timeout", type=float, default=1800.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def recover_cmd(ctx: click.Context, service: str, timeout: float, as_json: bool) -> None:
    """Finish the rollback of a change that an interrupted ctxmgr run left in progress."""
    from .deploy import ChangeResult

    deployer = _deployer(ctx, service, as_json, timeout)
    with deployer.store.lock(0.0):
        result = deployer.recover_if_needed()
    if result is None:
        result = ChangeResult(service, "recover", "unchanged", False, reason="no change was left in progress")
    _finish(result, as_json)


@main.command("history")
@click.option("--service", required=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def history_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Every revision ctxmgr made of a service: time, context, utilisation, result, reason."""
    from . import report
    from .deploy import history
    from .store import ServiceStore

    rows = history(ServiceStore(ctx.find_root().obj["state_dir"], service.removesuffix(".service")))
    if as_json:
        _emit_json({"service": service, "revisions": rows})
    else:
        click.echo(report.history_text(service, rows))


@main.command("observe")
@click.option("--service", required=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
@handle_errors
def observe_cmd(ctx: click.Context, service: str, as_json: bool) -> None:
    """Read vLLM's facts from the service's last start (made by ctxmgr or not) to calibrate plans."""
    from .deploy import observe_last_start

    deployer = _deployer(ctx, service, True, 60.0)
    with deployer.store.lock(0.0):
        data = observe_last_start(deployer)
    if as_json:
        _emit_json(data)
        return
    obs = data["observation"]
    click.echo(f"{service}: last start ({data['lines']} journal lines): " + ", ".join(
        f"{k} {v}" for k, v in obs.items() if v not in (None, False, "")
    ))  # fmt: skip


def entry() -> None:  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]) or "ctxmgr")


__all__ = ["main"]


# Commands for scheduled verification and fleet status live in their own module.
from . import cli_ops  # noqa: E402,F401  (registers verify, schedule, unschedule, status, observe)
