"""`ctxmgr deployment ...` (one vLLM deployment over several machines) and `ctxmgr node ...` (the steps
the coordinator runs on each of them over ssh). Thin: deployment/coordinator.py reads, plans and runs each
command's flow, deployment/walk.py walks the change, deployment/node.py is a step, deployment/file.py reads
the deployment file and deployment/report.py writes the text."""

from __future__ import annotations

import functools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypedDict, TypeVar, Unpack

import click

from vllm_ctxmgr.change.planning import PlanRequest, node_observations_from_json
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.cli.confirm import ask_before
from vllm_ctxmgr.cli.examples import examples
from vllm_ctxmgr.cli.finish import conclude
from vllm_ctxmgr.cli.output import echo, emit_json, handle_errors
from vllm_ctxmgr.cli.params import (
    CONTEXT,
    allow_long_option,
    edit_option,
    gpu_count_option,
    gpu_memory_option,
    gpu_memory_utilization_option,
    json_option,
    long_probe_option,
    options,
    probe_timeout_option,
    probe_tokens_option,
    refuse_old_rules,
    start_timeout_option,
    vllm_version_option,
    wait_lock_option,
    weights_bytes_option,
    yes_option,
)
from vllm_ctxmgr.cli.restarter import restarter_for
from vllm_ctxmgr.core.hardware import uniform_gpus
from vllm_ctxmgr.core.verdict import Verdict
from vllm_ctxmgr.deployment import node as node_steps
from vllm_ctxmgr.deployment.coordinator import (
    DeploymentRequest,
    DeploymentResult,
    plan_deployment,
    recover_deployment,
    rollback_deployment,
    set_deployment_context,
    verify_deployment,
)
from vllm_ctxmgr.deployment.file import DeploymentFile, beside, read_deployment_file
from vllm_ctxmgr.deployment.remote import DEFAULT_SSH, Link, NodeAddress
from vllm_ctxmgr.deployment.report import deployment_text, verdict_text
from vllm_ctxmgr.deployment.wire import (
    WIRE_VERSION,
    CheckAnswer,
    Message,
    PlanAnswer,
    PlanningOptions,
    PlanStdin,
    PrepareAnswer,
    PrepareStdin,
    ReasonStdin,
    ShowAnswer,
    StartAnswer,
    StartStdin,
    StepAnswer,
    StopAnswer,
    VerifyAnswer,
    VerifyStdin,
)
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.monitor.verify import VerifyOptions
from vllm_ctxmgr.nvml import gpus_from_file, gpus_from_json

T = TypeVar("T", bound=Message)
F = TypeVar("F", bound=Callable[..., Any])

# the deployment file's reader and the text, where they were before they moved to deployment/
_read_deployment_file = read_deployment_file
__all__ = ["DeploymentFile", "deployment_text"]

NODES = "--node gpu-a:vllm-glm5 --node gpu-b:vllm-glm5"
DEPLOYMENT_EXAMPLES = {
    "plan": examples(
        f"ctxmgr deployment plan 200000 {NODES}", "ctxmgr deployment plan 200000 --file glm5.toml --json"
    ),
    "set-context": examples(
        f"ctxmgr deployment set-context 200000 {NODES} --dry-run   # every node's diff",
        "ctxmgr deployment set-context 200000 --file glm5.toml --yes --json",
    ),
    "rollback": examples(
        "ctxmgr deployment rollback --file glm5.toml      # every node to before its last good change",
        "ctxmgr deployment rollback --file glm5.toml --to glm5-20260101T120000-1a2b   # as it left them",
    ),
    "recover": examples("ctxmgr deployment recover --file glm5.toml       # after a killed coordinator"),
    "verify": examples(f"ctxmgr deployment verify {NODES}"),
    "deployment": examples(
        f"ctxmgr deployment plan 200000 {NODES}",
        f"ctxmgr deployment set-context 200000 {NODES} --dry-run",
        "ctxmgr deployment verify --file glm5.toml",
    ),
}
MAX_STDIN_BYTES = 16 << 20  # a node step's request: flags, a reason, every node's GPUs


# ---- the coordinator -------------------------------------------------------------------------------


# the coordinator's options: the deployment's nodes and how to reach them, then the shared options of a
# plan and a change, said of every node
_deployment_options = options(
    click.option(
        "--node",
        "nodes",
        multiple=True,
        metavar="HOST:UNIT",
        help="A node of the deployment (every node, head and headless; HOST `local` is this one).",
    ),
    click.option(
        "--file",
        "deployment_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="A deployment file (TOML: [[node]] host, service, gpus_from; ssh, remote_ctxmgr).",
    ),
    click.option("--ssh", default=None, help=f"The ssh command (default: {' '.join(DEFAULT_SSH)})."),
    click.option("--remote-ctxmgr", default=None, help="ctxmgr on the nodes (default: ctxmgr)."),
    gpu_memory_option.but(help="Every node's GPU memory, where NVML is absent."),
    gpu_count_option.but(help="GPUs per node (with --gpu-memory)."),
    weights_bytes_option.but(help="Weights of all ranks together."),
    vllm_version_option.but(help="Plan by this vLLM's rules."),
    allow_long_option,
    gpu_memory_utilization_option.but(help="Every node's utilisation instead of the planner's choice."),
    wait_lock_option.but(help="Time to wait for another run on the deployment (as a service's --wait-lock)."),
    json_option,
)


class DeploymentFlags(TypedDict):
    """What _deployment_options hand a command, by name (all but --json), for _request."""

    nodes: tuple[str, ...]
    deployment_file: str | None
    ssh: str | None
    remote_ctxmgr: str | None
    gpu_memory: int | None
    gpu_count: int | None
    weights_bytes: int | None
    vllm_version: str | None
    allow_long: bool
    gpu_memory_utilization: float | None
    wait_lock: float


_head_timeout = start_timeout_option.but(help="Time the head's start may take.")
_yes = yes_option.but(help="Do not ask before changing the deployment.")


def _local_ctxmgr(ctx: click.Context) -> tuple[str, ...]:
    """ctxmgr for a `local` node: this program with this run's state directory and systemd."""
    obj = ctx.find_root().obj
    words = [sys.executable, "-m", "vllm_ctxmgr", "--state-dir", str(obj["state_dir"])]
    if obj.get("systemd_pid"):
        words += ["--systemd-pid", str(obj["systemd_pid"])]
    if obj.get("unit_dir"):
        words += ["--unit-dir", str(obj["unit_dir"])]
    return tuple(words)


def _request(
    ctx: click.Context,
    context: int,
    nodes: tuple[str, ...],
    deployment_file: str | None,
    ssh: str | None,
    remote_ctxmgr: str | None,
    gpu_memory: int | None,
    gpu_count: int | None,
    weights_bytes: int | None,
    vllm_version: str | None,
    allow_long: bool,
    gpu_memory_utilization: float | None,
    as_json: bool,
    wait_lock: float = 0.0,
) -> DeploymentRequest:
    """The request from the flags and the deployment file (the flags win where both say)."""
    data = read_deployment_file(Path(deployment_file)) if deployment_file else DeploymentFile()
    addresses = [NodeAddress.parse(n) for n in nodes]
    node_gpus = {}
    per_host: dict[str, tuple[str, ...]] = {}
    for entry in data.nodes:
        address = NodeAddress.of(entry.host, entry.service, f"{deployment_file}: [[node]]")
        if not nodes:
            addresses.append(address)
        if entry.ctxmgr:
            per_host[address.host] = entry.ctxmgr
        if entry.gpus_from:
            node_gpus[address.host] = gpus_from_file(beside(Path(deployment_file or "."), entry.gpus_from))
    if not addresses:
        raise UsageError("name the deployment's nodes: --node HOST:UNIT for each, or --file DEPLOYMENT.toml")
    link = Link(
        local_ctxmgr=_local_ctxmgr(ctx),
        per_host=per_host,
        ssh=tuple(shlex.split(ssh)) if ssh else data.ssh or DEFAULT_SSH,
        remote_ctxmgr=tuple(shlex.split(remote_ctxmgr))
        if remote_ctxmgr
        else data.remote_ctxmgr or ("ctxmgr",),
    )
    default_gpus = None
    if gpu_memory is not None or gpu_count is not None:
        if gpu_memory is None or gpu_count is None:
            raise UsageError("--gpu-memory and --gpu-count go together (each node's GPUs)")
        default_gpus = uniform_gpus(gpu_count, gpu_memory)
    say = (lambda _text: None) if as_json else (lambda text: echo(f"ctxmgr: {text}", err=True))
    return DeploymentRequest(
        context=context,
        nodes=tuple(addresses),
        link=link,
        name=data.name,
        gpu_memory_utilization=gpu_memory_utilization,
        node_gpus=node_gpus,
        default_gpus=default_gpus,
        planning=PlanningOptions(weights_bytes, vllm_version, allow_long),
        on_step=say,
        wait_lock=wait_lock,
    )


def _finish(result: DeploymentResult, as_json: bool, dry_run: bool = False) -> NoReturn:
    """A deployment's end as a service's (cli.finish.conclude): its report or one JSON object, its code."""
    conclude(f"deployment {result.action}", result, lambda: deployment_text(result), as_json, dry_run=dry_run)


@click.group("deployment", epilog=DEPLOYMENT_EXAMPLES["deployment"])
def deployment_group() -> None:
    """One vLLM deployment over several machines (vLLM's --nnodes / --headless), changed as one.

    \b
    Every node is named (--node HOST:UNIT, or a --file); ctxmgr runs `ctxmgr node ...` on each over
    ssh (BatchMode: keys, never passwords), plans on the head with every node's GPUs, writes every
    node's unit, restarts them together, watches the head and every rank's journal, probes the head,
    and rolls every node back when anything fails.
    """


@deployment_group.command("plan", epilog=DEPLOYMENT_EXAMPLES["plan"])
@click.argument("context", type=CONTEXT)
@_deployment_options
@click.pass_context
@handle_errors
def deployment_plan_cmd(
    ctx: click.Context, context: int, as_json: bool, **options: Unpack[DeploymentFlags]
) -> None:
    """Plan CONTEXT for the whole deployment; change nothing."""
    request = _request(ctx, context, as_json=as_json, **options)
    _finish(plan_deployment(request, ctx.find_root().obj["state_dir"]), as_json)


@deployment_group.command("set-context", epilog=DEPLOYMENT_EXAMPLES["set-context"])
@click.argument("context", type=CONTEXT)
@_deployment_options
@_head_timeout
@click.option("--dry-run", is_flag=True, help="Print the plan and every node's diff; change nothing.")
@click.option(
    "--force", is_flag=True, help="Apply even when the plan says it will not fit, or cannot tell (exit 6)."
)
@edit_option.but(envvar=None, help="Where each node's change is written (as set-context --edit).")
@probe_tokens_option.but(help="max_tokens of the head's probe (as set-context's).")
@long_probe_option.but(help="The head's probe also sends a prompt of about 90% of the context.")
@_yes
@click.pass_context
@handle_errors
def deployment_set_context_cmd(
    ctx: click.Context,
    context: int,
    timeout: float,
    dry_run: bool,
    force: bool,
    edit: str,
    probe_tokens: int | None,
    long_probe: bool,
    yes: bool,
    as_json: bool,
    **options: Unpack[DeploymentFlags],
) -> None:
    """Set every node's max_model_len to CONTEXT, restart the deployment as one; roll all back on failure."""
    refuse_old_rules(options.get("vllm_version"), "deployment set-context")
    request = _request(ctx, context, as_json=as_json, **options)
    request.dry_run, request.force, request.dropin, request.start_timeout = (
        dry_run,
        force,
        edit == "dropin",
        timeout,
    )
    request.probe_tokens, request.long_probe = probe_tokens, long_probe
    if not dry_run and not yes:
        request.confirm = _confirmation(as_json)
    _finish(set_deployment_context(request, ctx.find_root().obj["state_dir"]), as_json, dry_run=dry_run)


def _confirmation(as_json: bool) -> Callable[[DeploymentResult], bool]:
    """What a deployment's change shows and asks before any node is written: every node's diff and the
    plan, then the one question (--yes: neither, --json: the question only)."""

    def ask(result: DeploymentResult) -> bool:
        if not as_json:
            echo(deployment_text(result), err=True)
        question = f"restart every node of {result.deployment} with max_model_len {result.max_model_len}"
        return ask_before(question)

    return ask


@deployment_group.command("rollback", epilog=DEPLOYMENT_EXAMPLES["rollback"])
@_deployment_options
@_head_timeout
@click.option("--dry-run", is_flag=True, help="Print every node's diff; change nothing.")
@click.option(
    "--to",
    "to",
    default=None,
    metavar="CHANGE|N",
    help="Every node's unit as this deployment change left it: its id, or the head's revision number "
    "(as `history` on a node shows them).",
)
@_yes
@click.pass_context
@handle_errors
def deployment_rollback_cmd(
    ctx: click.Context,
    timeout: float,
    dry_run: bool,
    to: str | None,
    yes: bool,
    as_json: bool,
    **options: Unpack[DeploymentFlags],
) -> None:
    """Put every node's unit back as it was before the deployment's last good change (failed attempts
    are skipped), or as change --to left it; restart them together."""
    request = _request(ctx, 0, as_json=as_json, **options)
    request.dry_run, request.start_timeout = dry_run, timeout
    if not dry_run and not yes:
        request.confirm = _confirmation(as_json)
    state_dir = ctx.find_root().obj["state_dir"]
    _finish(rollback_deployment(request, state_dir, to), as_json, dry_run=dry_run)


@deployment_group.command("recover", epilog=DEPLOYMENT_EXAMPLES["recover"])
@_deployment_options
@_head_timeout
@click.pass_context
@handle_errors
def deployment_recover_cmd(
    ctx: click.Context, timeout: float, as_json: bool, **options: Unpack[DeploymentFlags]
) -> None:
    """Finish a deployment change an interrupted run left in progress: every node it wrote gets its
    previous unit back, and every node restarts together."""
    request = _request(ctx, 0, as_json=as_json, **options)
    request.start_timeout = timeout
    _finish(recover_deployment(request, ctx.find_root().obj["state_dir"]), as_json)


@deployment_group.command("verify", epilog=DEPLOYMENT_EXAMPLES["verify"])
@_deployment_options
@long_probe_option.but(help="The head's verify also sends a prompt of about 90% of the context.")
@click.pass_context
@handle_errors
def deployment_verify_cmd(
    ctx: click.Context, as_json: bool, long_probe: bool, **options: Unpack[DeploymentFlags]
) -> None:
    """Check every node: the head as `ctxmgr verify` does, each headless rank active with no failure
    since its start and the head's max_model_len. Exit codes as verify: 0 ok, 1 degraded, 2 failed,
    70 crashed."""
    request = _request(ctx, 0, as_json=as_json, **options)
    request.long_probe = long_probe
    data = verify_deployment(request, ctx.find_root().obj["state_dir"])
    if as_json:
        emit_json({"command": "deployment verify", "changed": False, **data})
    else:
        echo(verdict_text(data))
    sys.exit(Verdict(data["result"]).exit_code)


# ---- the steps on each node (run by the coordinator over ssh) ---------------------------------------


def _stdin(kind: type[T]) -> T:
    """A node step's request from the coordinator (one wire message, JSON on stdin), checked at the
    door: bounded while read, UTF-8, JSON, the message's own fields and ranges."""
    raw = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1) if not sys.stdin.isatty() else b""
    if len(raw) > MAX_STDIN_BYTES:
        raise UsageError("the request on stdin is too large")
    if not raw.strip():  # none (a step run by hand): the message's defaults
        return kind.from_json({"wire": WIRE_VERSION}, f"the `node {kind.step}` request")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError("the request on stdin is not UTF-8") from None
    except RecursionError:
        raise UsageError("the request on stdin is JSON nested too deeply") from None
    except ValueError as exc:
        raise UsageError(f"the request on stdin is not JSON ({exc})") from None
    return kind.from_json(data, f"the `node {kind.step}` request")


def _emit(answer: Message, command: str) -> None:
    emit_json({"command": f"node {command}", **answer.to_json()})


@click.group("node")
def node_group() -> None:
    """The steps of a multi-node change on one node (`ctxmgr deployment` runs them over ssh)."""


_json_flag = json_option.but(help="Print one JSON object (always).")


def _node_step(
    name: str,
    *declared: Callable[[F], F],
    stdin: type[Message] | None = None,
    start_timeout: bool = False,
) -> Callable[[Callable[..., Message]], click.Command]:
    """A `ctxmgr node NAME SERVICE ... --json` command declared once: the service argument, --json, the
    context and the error handling. The step is called with the node's Restarter (quiet: its answer is
    the one JSON object; --timeout its start's bound where `start_timeout`), the coordinator's request
    on stdin as `asked` where it takes one (read and checked at the door first), and its own options by
    keyword; its answer is printed as its wire message."""

    def declare(step: Callable[..., Message]) -> click.Command:
        @functools.wraps(step)
        def command(ctx: click.Context, service: str, as_json: bool, **options: Any) -> None:
            if stdin is not None:
                options["asked"] = _stdin(stdin)
            timeout = options["timeout"] if start_timeout else 0.0
            _emit(step(restarter_for(ctx, service, as_json=True, timeout=timeout), **options), name)

        declared_command: Callable[..., None] = click.pass_context(handle_errors(command))
        for option in reversed((click.argument("service"), *declared, _json_flag)):
            declared_command = option(declared_command)
        return node_group.command(name)(declared_command)

    return declare


@_node_step("show")
def node_show_cmd(restarter: Restarter) -> ShowAnswer:
    """The unit's vLLM arguments (keys masked), its digest, this node's GPUs and any change in progress."""
    return node_steps.show(restarter)


@_node_step(
    "plan",
    click.option("--context", type=CONTEXT, required=True),
    gpu_memory_utilization_option,
    stdin=PlanStdin,
)
def node_plan_cmd(
    restarter: Restarter, asked: PlanStdin, context: int, gpu_memory_utilization: float | None
) -> PlanAnswer:
    """The head's plan of the whole deployment, with every node's GPUs and every other node's last start
    (stdin: world_gpus, planning, node_observations)."""
    world = asked.world_gpus
    world_gpus = gpus_from_json(world, "the deployment's nodes") if world else None
    starts = [{"node": n.node, "ranks": list(n.ranks), "record": n.record} for n in asked.node_observations]
    nodes = node_observations_from_json(starts, len(world_gpus.gpus)) if world_gpus is not None else ()
    planning = asked.planning
    plan_request = PlanRequest(
        context,
        world_gpus=world_gpus,
        node_observations=nodes,
        weights_bytes=planning.weights_bytes,
        vllm_version=planning.vllm_version,
        allow_long=planning.allow_long,
    )
    return node_steps.plan(restarter, plan_request, gpu_memory_utilization)


@_node_step(
    "prepare",
    click.option("--change", "change_id", required=True),
    click.option("--max-model-len", type=CONTEXT, required=True),
    click.option("--expect-digest", required=True),
    click.option("--dropin", is_flag=True),
    click.option("--dry-run", is_flag=True),
    click.option(
        "--undo", "undo_change", default=None, help="Put back what this node had before that change."
    ),
    click.option("--back-to", "back_to", default=None, help="Put back the unit that change installed."),
    stdin=PrepareStdin,
)
def node_prepare_cmd(
    restarter: Restarter,
    asked: PrepareStdin,
    change_id: str,
    max_model_len: int,
    expect_digest: str,
    dropin: bool,
    dry_run: bool,
    undo_change: str | None,
    back_to: str | None,
) -> PrepareAnswer:
    """Write this node's new unit (stdin: flag_changes, env_changes) and record its revision; restart
    nothing. Only the flags a context change writes are taken (wire.check_context_flags)."""
    flags = asked.flag_changes
    if flags["--max-model-len"] != str(max_model_len):
        raise UsageError(
            f"the flag changes set --max-model-len {flags['--max-model-len']}, not {max_model_len}"
        )
    request = node_steps.PrepareRequest(
        change_id=change_id,
        flag_changes=flags,
        expected_digest=expect_digest,
        env_changes=asked.env_changes,
        max_model_len=max_model_len,
        gpu_memory_utilization=float(flags["--gpu-memory-utilization"])
        if "--gpu-memory-utilization" in flags
        else None,
        dropin=dropin,
        dry_run=dry_run,
        undo_change=undo_change,
        back_to=back_to,
    )
    return node_steps.prepare(restarter, request)


@_node_step("stop", start_timeout_option.but(default="5min", help=None))
def node_stop_cmd(restarter: Restarter, timeout: float) -> StopAnswer:
    """Stop this node's vLLM and wait until it has exited."""
    return node_steps.stop(restarter, timeout)


@_node_step(
    "start",
    click.option("--change", "change_id", required=True),
    click.option("--head", is_flag=True, help="Watch until it serves, then probe (the head)."),
    click.option("--back", is_flag=True, help="The start of a rollback."),
    start_timeout_option.but(help=None),
    stdin=StartStdin,
    start_timeout=True,
)
def node_start_cmd(
    restarter: Restarter, asked: StartStdin, change_id: str, head: bool, back: bool, timeout: float
) -> StartAnswer:
    """Start this node's vLLM (the head: watched and probed as the request on stdin asks)."""
    return node_steps.start(restarter, change_id, head, back, asked)


@_node_step(
    "check",
    click.option("--cursor", default=None, help="Since this journal cursor (default: its last start)."),
    click.option("--max-model-len", type=int, default=0),
)
def node_check_cmd(restarter: Restarter, cursor: str | None, max_model_len: int) -> CheckAnswer:
    """A headless rank since CURSOR: active, no failure in its journal, the expected max_model_len."""
    return node_steps.check(restarter, cursor, max_model_len or None)


_change_id = click.option("--change", "change_id", required=True)


@_node_step("finish", _change_id)
def node_finish_cmd(restarter: Restarter, change_id: str) -> StepAnswer:
    """The deployment served and was probed: this node's revision is final."""
    return node_steps.finish(restarter, change_id)


@_node_step("restore", _change_id, stdin=ReasonStdin)
def node_restore_cmd(restarter: Restarter, asked: ReasonStdin, change_id: str) -> StepAnswer:
    """Put this node's previous unit back (stdin: reason); restart nothing."""
    return node_steps.restore(restarter, change_id, asked.reason or "the deployment change failed")


@_node_step("settle", _change_id, click.option("--ok/--failed", "ok", required=True), stdin=ReasonStdin)
def node_settle_cmd(restarter: Restarter, asked: ReasonStdin, change_id: str, ok: bool) -> StepAnswer:
    """The end of a rollback on this node: rolled-back, or rollback-failed (stdin: reason)."""
    return node_steps.settle(restarter, change_id, ok, asked.reason)


@_node_step("verify", probe_timeout_option, stdin=VerifyStdin)
def node_verify_cmd(restarter: Restarter, asked: VerifyStdin, timeout: float) -> VerifyAnswer:
    """The head's `ctxmgr verify`, answered as a step (exit 0; the verdict is in the object; stdin:
    long_probe)."""
    options = VerifyOptions(long_probe=asked.long_probe, probe_timeout=timeout)
    return node_steps.verify(restarter, options)
