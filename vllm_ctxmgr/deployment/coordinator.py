"""A context change of one vLLM deployment that spans machines, made as one change.

vLLM's own multi-node mode runs `vllm serve` on every node with the same engine flags (rank 0 with the
API server, every other rank `--headless`). Changing one node alone breaks it: ranks that disagree on
--max-model-len are not refused by vLLM, they corrupt output or kill the engine on the first long
request, and a head restarted alone waits for ever for its old ranks (shared/recipes). So the walk is
the deployment's, and each node's step is a `ctxmgr node` command there (node.py):

    read    every node's unit (`node show`): refuse an unreachable node or one with a change in progress
    plan    the topology (core/topology.py: vLLM's own refusals), then the head plans the whole
            deployment with every node's GPUs in rank order (the minimum over ranks decides)
    confirm every node's diff, before anything is written
    write   every node's unit (`node prepare`: recorded -> installed); a failure puts back those written
    stop    every node, and wait until each has exited
    start   the headless ranks, then the head, watched until it serves and is probed at the new context
    finish  each headless rank checked in its own journal (a rank's OOM is the deployment's failure),
            then every revision final (a node's faulty answer there: applied, exit 1, that node named;
            the deployment serves, so nothing is rolled back, and `deployment recover` finishes it)

and on any failure after the first write: every node's previous unit back, every node stopped and
started again, the old deployment watched and probed; rolled-back, or rollback-failed (exit 5) when
the old deployment does not serve either. The coordinator's record (deployment@NAME/last-change.json
in the state directory) says which node reached which step; each node's own revision says the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypedDict, TypeVar

from vllm_ctxmgr.change.states import ChangeResult, Interrupted, Result, guard_signals
from vllm_ctxmgr.core.hardware import GpuState
from vllm_ctxmgr.core.json_types import JSONObject, JSONScalar
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.topology import (
    NodeKind,
    NodeRole,
    NodeStep,
    NodeUnit,
    Topology,
    read_topology,
    with_ray_gpus,
    world_gpus,
)
from vllm_ctxmgr.core.verdict import Verdict
from vllm_ctxmgr.deployment.remote import Link, NodeAddress, NodeError
from vllm_ctxmgr.deployment.wire import (
    CheckAnswer,
    InProgress,
    LastChange,
    Message,
    NodeStart,
    PlanAnswer,
    PlannedGpu,
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
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.nvml import gpus_from_json
from vllm_ctxmgr.store import ServiceStore

T = TypeVar("T", bound=Message)

Printer = Callable[[str], None]

SHOW_TIMEOUT = 120.0
WATCH_INTERVAL = 3.0  # s between looks at every headless rank while the head starts
STEP_TIMEOUT = 300.0  # a node's write, stop or check (a headless rank's stop took ~12 s)
# the coordinator's record (last-change.json) while a step is under way; any other state is settled
RECORD_IN_FLIGHT = ("writing", "finishing", "rolling-back")


@dataclass
class NodeOutcome:
    """One node in the deployment's result: its role, what was written there, how its steps ended."""

    host: str
    service: str
    role: NodeKind
    node_rank: int
    stages: list[int] = field(default_factory=list)
    revision: int | None = None
    diff: str = ""
    step: NodeStep = NodeStep.READ  # the last step this node reached
    ok: bool = True
    reason: str = ""
    # the plan's figures for this node's GPUs (the smallest where they differ), and what this node's
    # vLLM logged at its last start: the per-node plan held against each rank's own lines
    planned: dict[str, JSONScalar] = field(default_factory=dict)
    logged: dict[str, JSONScalar] = field(default_factory=dict)  # wire.Logged as a dict


@dataclass
class DeploymentResult(ChangeResult):
    """What a deployment command did: a change's result (its `service` the deployment's name) that
    carries its nodes, printed by --json in the deployment's shape (`to_json`)."""

    result: Result | PlanResult  # a change's Result; a plan's own word (`deployment plan`)
    change_id: str | None = None
    least_gpu_memory_utilization: float | None = None  # the least that fits, one more figure
    backend: str = ""
    nodes: list[NodeOutcome] = field(default_factory=list)
    plan_text: str = ""

    @property
    def deployment(self) -> str:
        return self.service

    def to_json(self) -> JSONObject:
        """The deployment's fields in their order: a change's, less those of one unit (its revision, unit
        file, probe, observation), and every node's diff in one text, as a one-host change has one `diff`.
        gpu_memory_utilization is what every node's unit runs with after the change."""
        data = super().to_json()
        return {
            "deployment": self.service,
            **{name: data[name] for name in DEPLOYMENT_FIELDS},
            "diff": "\n".join(
                f"# node {n.node_rank}: {n.host}:{n.service}\n{n.diff}" for n in self.nodes if n.diff
            ),
        }


DEPLOYMENT_FIELDS = (
    "action", "result", "changed", "exit_code", "change_id", "max_model_len", "previous_max_model_len",
    "gpu_memory_utilization", "least_gpu_memory_utilization", "reason", "decisive_line", "suggestion",
    "backend", "nodes", "plan", "plan_text", "timings",
)  # fmt: skip


@dataclass
class DeploymentRequest:
    """What the operator asked of a deployment; the CLI fills it."""

    context: int
    nodes: tuple[NodeAddress, ...]
    link: Link = field(default_factory=Link)
    name: str | None = None
    gpu_memory_utilization: float | None = None
    # each node's GPUs where its NVML cannot say (a `ctxmgr gpus --json` object), by host
    node_gpus: Mapping[str, GpuState] = field(default_factory=dict)
    default_gpus: GpuState | None = None  # every node's, from --gpu-memory / --gpu-count
    planning: PlanningOptions = field(default_factory=PlanningOptions)
    dry_run: bool = False
    force: bool = False
    dropin: bool = False
    start_timeout: float = 1800.0
    confirm: Callable[[DeploymentResult], bool] | None = None
    on_step: Printer = lambda _text: None
    wait_lock: float = 0.0  # seconds to wait for another run on the deployment's lock
    probe_tokens: int | None = None  # the head's probe after a change (set-context's --probe-tokens)
    long_probe: bool = False  # ... and its 90%-of-the-context prompt (--long-probe; verify's too)


def deployment_name(nodes: tuple[NodeAddress, ...], name: str | None) -> str:
    """The name the coordinator's lock and record go by: the operator's, else one made of the nodes."""
    if name:
        return name
    digest = hashlib.sha256("\n".join(sorted(map(str, nodes))).encode()).hexdigest()[:10]
    return f"{nodes[0].service.removesuffix('.service')}-{digest}"


def _role_name(role: NodeRole | None) -> NodeKind:
    if role is not None and role.ray_worker:
        return NodeKind.RAY  # a Ray node: the head's vLLM places workers there; its unit is not changed
    return NodeKind.HEADLESS if role is not None and role.headless else NodeKind.HEAD


@dataclass
class _Node:
    address: NodeAddress
    shown: ShowAnswer | None = None  # its `node show` answer, once read
    role: NodeRole | None = None
    outcome: NodeOutcome | None = None

    @property
    def show(self) -> ShowAnswer:
        assert self.shown is not None, "read() reads every node first"
        return self.shown


def _refused(node: _Node, step: str, answer: StepAnswer) -> StepAnswer:
    """A restore or settle answer that says `ok: false` is that node's failure (issue 36 item 10): its
    previous unit is not back (or not recorded), never counted as rolled back."""
    if answer.ok:
        return answer
    said = answer.reason[:200] or f"its revision is {answer.state[:40] or 'in no state'}"
    raise NodeError(f"{node.address}: `node {step}` failed: {said}")


class Coordinator:
    """One deployment change, walked over its nodes (see the module docstring for the steps)."""

    def __init__(self, request: DeploymentRequest, state_dir: Path | str) -> None:
        if len(request.nodes) < 2:
            raise UsageError("a multi-node deployment needs at least two --node HOST:UNIT")
        if len(set(request.nodes)) != len(request.nodes):
            raise UsageError("a node is given twice")
        self.request = request
        self.name = deployment_name(request.nodes, request.name)
        self.store = ServiceStore(state_dir, f"deployment@{self.name}")
        self.say = request.on_step
        self.nodes: list[_Node] = []
        self.topology: Topology | None = None
        self.result = DeploymentResult(self.name, "set-context", Result.PLANNED, False)
        self.undo: str | None = None  # a rollback: the change whose previous units go back
        self.back_to: str | None = None  # a rollback --to: the change whose units go back
        self.drift = ""  # what was found where the nodes' units give different max_model_len
        self.not_back: list[_Node] = []  # nodes that did not stop or start on the way back

    # ---- talking to nodes --------------------------------------------------------------------

    def _call(
        self,
        node: _Node,
        kind: type[T],
        *args: str,
        timeout: float = STEP_TIMEOUT,
        stdin: Message | None = None,
    ) -> T:
        """One step on `node`, its answer checked at the door (wire.py): any fault in it is that
        node's NodeError, its address first."""
        address = node.address
        answer = self.request.link.call(
            address.host,
            ["node", *args, address.service],
            timeout,
            stdin.to_json() if stdin is not None else None,
            str(address),
        )
        try:  # named by the step asked (StepAnswer is finish's, restore's and settle's answer)
            return kind.from_json(answer, f"`node {args[0]}` answer")
        except UsageError as exc:  # refused at the door: nothing that node said is used
            raise NodeError(f"{address}: {exc.message}", exit_code=ExitCode.USAGE) from None

    def _each(self, nodes: list[_Node], step: Callable[[_Node], T]) -> list[T | NodeError]:
        """`step` on every node at once (stops and reads take seconds each; nodes are independent)."""

        def run(node: _Node) -> T | NodeError:
            try:
                return step(node)
            except NodeError as exc:
                return exc

        if not nodes:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
            return list(pool.map(run, nodes))

    # ---- read and plan -----------------------------------------------------------------------

    def read(self, recovering: bool = False) -> Topology:
        """Every node's unit, the topology vLLM will form from them, and refusals before any write
        (a node with a change in progress among them, unless `recovering` it)."""
        request = self.request
        self.say(f"reading {len(request.nodes)} nodes: {', '.join(map(str, request.nodes))}")
        probes = [_Node(address) for address in request.nodes]
        answers = self._each(probes, lambda n: self._call(n, ShowAnswer, "show", timeout=SHOW_TIMEOUT))
        for node, answer in zip(probes, answers, strict=True):
            if isinstance(answer, NodeError):
                raise NodeError(
                    f"cannot read every node, nothing was changed: {answer.message}",
                    exit_code=answer.exit_code,
                )
            node.shown = answer
            pending = answer.in_progress
            if pending and not recovering:
                raise UsageError(
                    f"{node.address}: revision {pending.revision} is still {pending.state}: "
                    "another change is under way there, or was interrupted: "
                    "`ctxmgr deployment recover` with the same nodes"
                )
        units = [
            NodeUnit(node.address.host, node.address.service, None, ray_worker=True)
            if node.show.ray_worker
            else NodeUnit(
                node.address.host,
                node.address.service,
                parse_serve_argv(list(node.show.argv), dict(node.show.environment)),
            )
            for node in probes
        ]
        topology = read_topology(self._drifted(units))
        by_address = {(r.host, r.service): r for r in topology.nodes}
        for node in probes:
            node.role = by_address.get((node.address.host, node.address.service))
            if node.role is None:  # the Ray head's own `ray start`: it runs beside the head's vLLM
                self.say(f"{node.address}: the Ray head's `ray start` unit; it is not restarted")
        self.nodes = sorted((n for n in probes if n.role), key=lambda n: n.role.node_rank if n.role else 0)
        self.topology = topology
        self.result.backend = topology.backend
        self.result.nodes = [
            NodeOutcome(
                n.address.host,
                n.address.service,
                _role_name(n.role),
                n.role.node_rank if n.role else 0,
                list(n.role.stages) if n.role else [],
            )
            for n in self.nodes
        ]
        for node, outcome in zip(self.nodes, self.result.nodes, strict=True):
            node.outcome = outcome
        return topology

    def _drifted(self, units: list[NodeUnit]) -> list[NodeUnit]:
        """The units with every node at the head's --max-model-len, where one was left at another
        (edited by hand): the deployment is the same otherwise, and its drift is said (`self.drift`)
        for each command to act on: verify fails, set-context reconciles, rollback refuses."""
        serving = [u for u in units if u.args is not None]
        heads = [u for u in serving if not u.args or "--headless" not in u.args.flags]
        lengths = {f"{u.host}:{u.service}": u.args.max_model_len for u in serving if u.args}
        if len(set(lengths.values())) < 2 or len(heads) != 1 or heads[0].args is None:
            return units
        head = heads[0].args
        self.drift = "max_model_len differs between nodes: " + ", ".join(
            f"{name} {'(unset)' if n is None else n}" for name, n in lengths.items()
        )
        flags = dict(head.flags)
        same = [
            u
            if u.args is None
            else replace(
                u,
                args=replace(
                    u.args,
                    max_model_len=head.max_model_len,
                    flags={
                        **{k: v for k, v in u.args.flags.items() if k != "--max-model-len"},
                        **(
                            {"--max-model-len": flags["--max-model-len"]}
                            if "--max-model-len" in flags
                            else {}
                        ),
                    },
                ),
            )
            for u in units
        ]
        return same

    def _world_gpus(self) -> GpuState | None:
        """Every node's GPUs in rank order: given for the node, else its NVML, else --gpu-memory."""
        assert self.topology is not None
        per_node: dict[str, GpuState] = {}
        for node in self.nodes:
            host = node.address.host
            given = self.request.node_gpus.get(host)
            shown = node.show.gpus
            if given is not None:
                per_node[host] = given
            elif shown:
                per_node[host] = gpus_from_json(shown, f"NVML on {host}")
            elif self.request.default_gpus is not None:
                per_node[host] = self.request.default_gpus
        if not per_node:
            return None  # the CPU build, or no memory information anywhere: the head plans with its own
        missing = [n.address.host for n in self.nodes if n.address.host not in per_node]
        if missing:
            raise UsageError(
                f"{missing[0]}: no GPU information (no NVML there): give --gpus-from for it in the "
                "deployment file, or --gpu-memory and --gpu-count for every node"
            )
        if self.topology.backend == "ray":  # which ranks each node holds follows its GPU count
            self.topology = with_ray_gpus(self.topology, {h: len(g.gpus) for h, g in per_node.items()})
            roles = {(r.host, r.service): r for r in self.topology.nodes}
            for node in self.nodes:
                node.role = roles[(node.address.host, node.address.service)]
                if node.outcome is not None and node.role is not None:
                    node.outcome.stages = list(node.role.stages)
        return world_gpus(self.topology, per_node)

    def plan(self) -> PlanAnswer:
        """The head plans the deployment (the model files are on the nodes, not necessarily here); its
        answer passed the door, which refuses a flag a context change does not write."""
        head = self._head()
        world = self._world_gpus()
        stdin = PlanStdin(
            planning=self.request.planning,
            world_gpus=world.to_json() if world else None,
            node_observations=self._node_observations() if world else (),
        )
        args = ["plan", "--context", str(self.request.context)]
        if self.request.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{self.request.gpu_memory_utilization:g}"]
        answer = self._call(head, PlanAnswer, *args, timeout=SHOW_TIMEOUT, stdin=stdin)
        planned = answer.planned
        self.result.plan, self.result.plan_text = answer.planned.record, answer.text
        self.result.max_model_len = answer.max_model_len
        self.result.gpu_memory_utilization = answer.gpu_memory_utilization
        self.result.least_gpu_memory_utilization = answer.least_gpu_memory_utilization
        self.result.previous_max_model_len = parse_serve_argv(
            list(head.show.argv), dict(head.show.environment)
        ).max_model_len
        if answer.learned:
            self.say(answer.learned)
        self._per_node(planned.gpus)
        return answer

    def _node_observations(self) -> tuple[NodeStart, ...]:
        """Each headless node's last start as its own journal logged it, with the global ranks it
        holds: the head's journal has only its own ranks' memory lines, and with PP over nodes the
        stages differ (the embedding on the first, the LM head on the last), so each node's GPU lines
        are calibrated from that node's start (the head checks each record, node.plan)."""
        return tuple(
            NodeStart(f"node {node.role.node_rank}", tuple(node.role.ranks), node.show.observation)
            for node in self._workers()
            if node.role is not None and node.show.observation is not None
        )

    def _per_node(self, lines: tuple[PlannedGpu, ...]) -> None:
        """Split the plan's GPU lines (rank order, the world's GPUs) per node."""
        for node in self.nodes:
            if node.role is None or node.outcome is None:
                continue
            mine = [lines[r] for r in node.role.ranks if r < len(lines)]
            node.outcome.logged = _logged(node.show)
            if not mine:
                continue

            def least(name: str, gpus: list[PlannedGpu] = mine) -> int | None:
                figures = (getattr(g, name) for g in gpus)
                values = [f.bytes for f in figures if f is not None and f.bytes is not None]
                return min(values) if values else None

            def sources(name: str, gpus: list[PlannedGpu] = mine) -> str:
                found = [f.source for f in (getattr(g, name) for g in gpus) if f is not None]
                return ", ".join(dict.fromkeys(found))

            node.outcome.planned = {
                "gpus": len(mine),
                "total_bytes": least("total"),
                "weights_bytes": least("weights"),
                "kv_budget_bytes": least("kv_budget"),
                "kv_needed_bytes": least("kv_needed"),
                "headroom_bytes": least("headroom"),
                # where this node's figures came from: its own journal ("vllm log (node 1)"), the
                # head's, the model files, or estimates
                "weights_source": sources("weights"),
                "kv_budget_source": sources("kv_budget"),
            }

    def _head(self) -> _Node:
        return next(n for n in self.nodes if n.role is not None and n.role == self._topology().head)

    def _topology(self) -> Topology:
        assert self.topology is not None
        return self.topology

    def _workers(self) -> list[_Node]:
        """The headless ranks a change writes and restarts with the head (Ray's workers run no vLLM
        unit: the head's vLLM places its workers on them, so they are neither written nor restarted)."""
        head = self._head()
        return [n for n in self.nodes if n is not head and not (n.role and n.role.ray_worker)]

    @property
    def changing(self) -> list[_Node]:
        return [self._head(), *self._workers()]

    # ---- the change --------------------------------------------------------------------------

    def set_context(self) -> DeploymentResult:
        """Read, plan, confirm, write every node, restart them together, watch, probe; roll all back.
        A deployment whose nodes run different lengths (one edited by hand) is reconciled: every node
        is written to the context asked for and the deployment restarts once."""
        request, result = self.request, self.result
        wait = request.wait_lock
        lock = self.store.read_lock(wait) if request.dry_run else self.store.lock(wait)
        with lock:
            self.read()
            if self.drift:
                self.say(f"{self.drift}; every node is written to max_model_len {request.context}")
            answer = self.plan()
            planned = answer.planned
            context = answer.max_model_len
            if answer.result is not PlanResult.FEASIBLE and not request.force:
                result.result = Result.INFEASIBLE
                result.exit_code = answer.result.exit_code
                result.reason = planned.reason or "the plan does not say it fits"
                result.suggestion = f"largest context that fits: {planned.max_context}"
                return result
            flags, env = answer.flag_changes, answer.env_changes
            # the head leaves out a length its own unit has; every node gets it (a node's own edit of a
            # value it already has changes nothing; a node left at another length is written to it)
            flags = {**flags}
            flags.setdefault("--max-model-len", str(context))
            if not self._diffs(flags, env, context):
                result.result = Result.UNCHANGED
                result.reason = (
                    f"every node already has max_model_len {context}: nothing changed, nothing restarted"
                )
                return result
            if self.drift:
                result.reason = f"{self.drift}: every node is written to {context}"
            if request.dry_run:  # what was found is said (the reconciling diffs are the dry run's)
                result.result = Result.DRY_RUN
                result.reason = "dry run: nothing was written or restarted" + (
                    f"; {result.reason}" if self.drift else ""
                )
                return result
            if request.confirm is not None and not request.confirm(result):
                raise UsageError("nothing was changed")
            return self._apply(flags, context, env=env)

    def _diffs(self, flags: dict[str, str], env: dict[str, str], context: int) -> bool:
        """Every node's diff (a dry run of its write), before anything is written: whether any changes."""
        diffs = self._each(self.changing, lambda n: self._prepare(n, flags, context, True, env))
        for node, diff in zip(self.changing, diffs, strict=True):
            if isinstance(diff, NodeError):
                raise NodeError(f"nothing was changed: {diff.message}")
            assert node.outcome is not None
            node.outcome.diff = diff.diff
        return any(not isinstance(d, NodeError) and d.changed for d in diffs)

    def recover(self) -> DeploymentResult:
        """Finish a deployment change an interrupted coordinator left in progress on its nodes: every
        node it wrote gets its previous unit back and every node restarts together (_roll_back_all)."""
        result = self.result
        result.action = "recover"
        with self.store.lock(self.request.wait_lock):
            self.read(recovering=True)
            pending = {n.address: n.show.in_progress for n in self.changing}
            changes = {p.change for p in pending.values() if p is not None}
            if not changes:
                result.result = Result.UNCHANGED
                result.reason = "no node has a deployment change in progress: nothing to recover"
                result.reason += self._close_stale_record()
                return result
            if len(changes) > 1 or None in changes:
                raise UsageError(
                    "the nodes' changes in progress are not one deployment change: "
                    + ", ".join(f"{a}: {(p.change if p else None) or 'none'}" for a, p in pending.items())
                )
            result.change_id = str(changes.pop())
            last = next(n.show.last_change for n in self.changing if pending[n.address] is not None)
            if last is not None:
                result.max_model_len = last.max_model_len
                result.previous_max_model_len = last.previous_max_model_len
            finished = [
                n
                for n in self.changing
                if any(c.change == result.change_id and c.state == "final" for c in n.show.deployment_changes)
            ]
            if finished:
                return self._finish_left(finished, pending)
            interrupted = f"the deployment change {result.change_id} was interrupted"
            failed = self._failed_reason(str(result.change_id))
            if failed:  # the reason the change failed stays first; recover's own is added to it
                interrupted = f"{failed}; {interrupted} while rolling back"
            self._roll_back_all(interrupted)
            result.changed = True  # every node it wrote was written back, and every node restarted
            if result.result is Result.ROLLED_BACK:
                result.exit_code = ExitCode.OK  # recovering is what was asked, and it worked (as `recover`)
                result.reason = (
                    f"{interrupted}: every node it wrote has its previous unit back, and the deployment "
                    f"serves again at max_model_len {result.previous_max_model_len}"
                )
            else:
                result.reason = f"{interrupted}{result.reason}"
            self._record(str(result.result))  # with the reason: the way back recorded it without one
            return result

    def _close_stale_record(self) -> str:
        """The coordinator's record still names a step under way while no node has its change in
        progress: that coordinator died after every node had settled (or before any was written). The
        record a person reads first is set to what the nodes' own revisions say, instead of "writing"
        for ever; returns what recover adds to its reason ("" when the record was already settled)."""
        try:
            record = self.store.read_json("last-change.json") or {}
        except CtxmgrError:
            return ""
        change, was = record.get("change_id"), record.get("state")
        if was not in RECORD_IN_FLIGHT or not isinstance(change, str):
            return ""
        states = {
            next((c.state for c in node.show.deployment_changes if c.change == change), None)
            for node in self.changing
        }
        if states == {None}:
            now = "interrupted"  # no node has a revision of it: the coordinator stopped before any write
        elif len(states) == 1:
            now = str(states.pop())
        else:
            return ""  # the nodes disagree: left for a person, as `deployment history` shows them
        said = f"the record of change {change} said {was} and now says {now}, as its nodes' revisions do"
        reason = record.get("reason")
        kept = f"{reason}; " if isinstance(reason, str) and reason else ""
        self.store.write_json(
            "last-change.json", {**record, "state": now, "time": time.time(), "reason": kept + said}
        )
        return f"; {said}"

    def _failed_reason(self, change_id: str) -> str:
        """Why the change failed, as its own run recorded it before rolling back (the coordinator's
        record, where that run was this one's), else "": recover adds to that reason, never replaces it."""
        try:
            record = self.store.read_json("last-change.json") or {}
        except CtxmgrError:
            return ""
        reason = record.get("reason")
        if record.get("change_id") != change_id or record.get("state") != "rolling-back":
            return ""
        return reason if isinstance(reason, str) else ""

    def _finish_left(
        self, finished: list[_Node], pending: Mapping[NodeAddress, InProgress | None]
    ) -> DeploymentResult:
        """A change final on some node got past its finish step: the deployment served, the head passed
        its probe and every rank was checked, and a node's answer to `finish` failed (issue 29 item 5).
        Its nodes' units are the change's, so putting the previous units back would undo a change that
        served (and the final nodes' would stay): the nodes it left in progress are finished instead, once
        every node is active again."""
        result = self.result
        left = [n for n in self.changing if pending[n.address] is not None]
        down = [
            f"{n.address} is {n.show.active_state}" for n in self.changing if n.show.active_state != "active"
        ]
        if down:
            raise CtxmgrError(
                f"the deployment change {result.change_id} is final on "
                + ", ".join(str(n.address) for n in finished)
                + f" but not on {', '.join(str(n.address) for n in left)}, and "
                + ", ".join(down)
                + ": nothing was changed; start it, then run `ctxmgr deployment recover` again"
            )
        self.say(
            f"the deployment change {result.change_id} served and is final on "
            + ", ".join(str(n.address) for n in finished)
            + "; finishing it on "
            + ", ".join(str(n.address) for n in left)
        )
        unfinished = self._finish_all(left)
        result.result = Result.APPLIED
        result.reason = (
            f"the deployment change {result.change_id} had served on every node; its revision is now "
            f"final on {', '.join(str(n.address) for n in left)}, nothing was written or restarted"
        )
        if unfinished:
            result.exit_code = ExitCode.ERROR
            result.reason = f"the deployment change {result.change_id} had served on every node, {unfinished}"
        self._record("unfinished" if unfinished else "final")
        return result

    def rollback(self, to: str | None = None) -> DeploymentResult:
        """Every node back to the unit it had before the deployment's last good change (failed attempts,
        rolled back already, are skipped, as one service's rollback skips them), or to the unit change
        `to` left; through the same walk as a change."""
        request, result = self.request, self.result
        result.action = "rollback"
        wait = request.wait_lock
        with self.store.read_lock(wait) if request.dry_run else self.store.lock(wait):
            self.read()
            if self.drift:
                raise UsageError(
                    f"{self.drift}: there is no one change to roll back; `ctxmgr deployment set-context N` "
                    "writes every node to N"
                )
            target = self._rollback_target(to)
            context = int((target.max_model_len if to else target.previous_max_model_len) or 0)
            if to:
                self.back_to = str(target.change)
            else:
                self.undo = str(target.change)
            result.previous_max_model_len = parse_serve_argv(
                list(self._head().show.argv), dict(self._head().show.environment)
            ).max_model_len
            result.max_model_len = context
            flags = {"--max-model-len": str(context)}
            if not self._diffs(flags, {}, context):
                result.result = Result.UNCHANGED
                result.reason = f"every node already has the unit {to or 'from before ' + str(target.change)}"
                return result
            if request.dry_run:
                result.result, result.reason = Result.DRY_RUN, "dry run: nothing was written or restarted"
                return result
            if request.confirm is not None and not request.confirm(result):
                raise UsageError("nothing was changed")
            return self._apply(flags, context, keep_previous=result.previous_max_model_len)

    def _rollback_target(self, to: str | None) -> LastChange:
        """The deployment change every node goes back before (its newest final one), or `to`: the same
        on every node, final on every node."""
        found: dict[NodeAddress, LastChange | None] = {}
        if to and to.isdigit():  # a revision number, as one service's rollback takes: the head's
            made = self._head().show.deployment_changes
            change = next((c.change for c in made if c.revision == int(to) and c.change), None)
            if change is None:
                raise UsageError(f"{self._head().address}: revision {to} is not one a deployment change made")
            to = change
        for node in self.changing:
            finals = [c for c in node.show.deployment_changes if c.state == "final"]
            if to:
                found[node.address] = next((c for c in reversed(finals) if c.change == to), None)
            else:
                found[node.address] = finals[-1] if finals else None
        if to and any(c is None for c in found.values()):
            missing = next(a for a, c in found.items() if c is None)
            raise UsageError(f"{missing}: no final revision of deployment change {to} there")
        changes = {c.change if c else None for c in found.values()}
        if len(changes) != 1 or None in changes:
            raise UsageError(
                "the nodes' last good deployment changes differ, nothing to roll back as one: "
                + ", ".join(f"{a}: {(c.change if c else None) or 'none'}" for a, c in found.items())
            )
        target = next(iter(found.values()))
        assert target is not None
        return target

    def _prepare(
        self, node: _Node, flags: dict[str, str], context: int, dry_run: bool, env: dict[str, str]
    ) -> PrepareAnswer:
        args = [
            "prepare",
            "--change",
            self.result.change_id or "dry-run",
            "--max-model-len",
            str(context),
            "--expect-digest",
            node.show.unit_digest,
        ]
        if self.undo is not None:
            args += ["--undo", self.undo]
        elif self.back_to is not None:
            args += ["--back-to", self.back_to]
        elif self.request.dropin:
            args.append("--dropin")
        if dry_run:
            args.append("--dry-run")
        return self._call(node, PrepareAnswer, *args, stdin=PrepareStdin(flags, env))

    def _record(self, state: str) -> None:
        """The coordinator's own record: which node reached which step (a person reads it first)."""
        if self.request.dry_run:
            return
        data = self.result.to_json()
        data.pop("plan", None)
        self.store.write_json("last-change.json", {"state": state, "time": time.time(), **data})

    def _apply(
        self,
        flags: dict[str, str],
        context: int,
        keep_previous: int | None = None,
        env: dict[str, str] | None = None,
    ) -> DeploymentResult:
        result = self.result
        t0 = time.monotonic()
        if keep_previous is not None:
            result.previous_max_model_len = keep_previous
        result.change_id = f"{self.name}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(2)}"
        result.max_model_len = context
        self._record("writing")

        def left(signal: str) -> str:
            return (
                f"interrupted again by {signal} while rolling back: change {result.change_id} is left "
                "in progress on its nodes; run `ctxmgr deployment recover` with the same nodes"
            )

        # a signal fails the deployment change: every node is put back; a second one stops at once,
        # leaving `deployment recover` to finish
        with guard_signals(lambda: False, left):
            try:
                return self._walk(flags, env or {}, context, t0)
            except Interrupted as exc:
                result.reason = f"ctxmgr was interrupted by {exc.name}"
                self.say(f"{result.reason}; rolling every node back")
                self._roll_back_all(result.reason)
                result.timings["total_s"] = round(time.monotonic() - t0, 3)
                return result

    def _walk(self, flags: dict[str, str], env: dict[str, str], context: int, t0: float) -> DeploymentResult:
        result = self.result
        written: list[_Node] = []
        for node in self.changing:
            assert node.outcome is not None
            try:
                answer = self._prepare(node, flags, context, False, env)
            except NodeError as exc:
                node.outcome.ok, node.outcome.reason = False, exc.message
                self._undo_unanswered(node, exc.message)
                return self._put_back_unrestarted(written, exc.message)
            node.outcome.revision, node.outcome.step = answer.revision, NodeStep.WRITTEN
            written.append(node)
        result.timings["write_s"] = round(time.monotonic() - t0, 3)
        failure = self._restart_all(back=False)
        result.timings["start_s"] = round(time.monotonic() - t0, 3)
        if failure is None:
            self._record("finishing")
            unfinished = self._finish_all(self.changing)
            result.result, result.changed = Result.APPLIED, True
            self._read_logged()
            found = f"found {self.drift}; " if self.drift else ""
            result.reason = (
                f"{found}every node runs max_model_len {context}; the head served the context-sized probe"
            )
            if unfinished:
                result.exit_code = ExitCode.ERROR
                result.reason += f"; {unfinished}"
            self._record("unfinished" if unfinished else "final")
            result.timings["total_s"] = round(time.monotonic() - t0, 3)
            return result
        result.reason, result.decisive_line = failure
        self.say(f"the change failed: {result.reason}; rolling every node back")
        self._roll_back_all(result.reason)
        result.timings["total_s"] = round(time.monotonic() - t0, 3)
        return result

    def _finish_all(self, nodes: list[_Node]) -> str:
        """Every node's revision final, once the deployment served and every rank was checked. Any fault
        in a node's answer is that node's failure (issue 29 item 5): nothing more is asked of it, so its
        revision stays as that answer left it, and `deployment recover` (or the next change's refusal)
        finds it there. "" where every node finished, else what failed, each node named."""
        change = str(self.result.change_id)
        finished = self._each(nodes, lambda n: self._call(n, StepAnswer, "finish", "--change", change))
        faults: list[str] = []
        for node, done in zip(nodes, finished, strict=True):
            assert node.outcome is not None
            if isinstance(done, NodeError):
                fault = done.message
            elif not done.ok or done.state not in ("final", "not written"):
                said = done.reason or f"its revision is {done.state[:40] or 'in no state'}, not final"
                fault = f"{node.address}: `node finish` failed: {said}"
            else:
                node.outcome.step = NodeStep.FINAL
                continue
            node.outcome.ok, node.outcome.reason = False, fault
            faults.append(fault)
        if not faults:
            return ""
        return (
            "but not every node recorded it final: "
            + "; ".join(faults)
            + ": its revision is left as that answer left it; `ctxmgr deployment recover` with the same "
            "nodes finishes it"
        )

    def _read_logged(self) -> None:
        """What every rank logged at the start just made (each node's own memory lines)."""
        shown = self._each(self.changing, lambda n: self._call(n, ShowAnswer, "show", timeout=SHOW_TIMEOUT))
        for node, answer in zip(self.changing, shown, strict=True):
            if not isinstance(answer, NodeError) and node.outcome is not None:
                node.outcome.logged = _logged(answer)

    def _settle_all(self, nodes: list[_Node], ok: bool, reason: str) -> None:
        """Every node's revision rolled-back (or rollback-failed). A node that could not record it is
        named in the result: its revision stays in progress there, and the next change will say so."""
        change = str(self.result.change_id)
        verdict = "--ok" if ok else "--failed"
        stdin = ReasonStdin(reason)
        settled = self._each(
            nodes,
            lambda n: _refused(n, "settle", self._call(n, StepAnswer, "settle", "--change", change, verdict,
                                                        stdin=stdin)),
        )  # fmt: skip
        for node, answer in zip(nodes, settled, strict=True):
            if isinstance(answer, NodeError):
                self.result.reason += f"; the rollback is not recorded on {answer.message}"
                if node.outcome is not None:
                    node.outcome.ok, node.outcome.reason = False, answer.message

    def _restore_all(self, nodes: list[_Node], reason: str) -> list[StepAnswer | NodeError]:
        change, stdin = str(self.result.change_id), ReasonStdin(reason)
        return self._each(
            nodes,
            lambda n: _refused(n, "restore", self._call(n, StepAnswer, "restore", "--change", change,
                                                         stdin=stdin)),
        )  # fmt: skip

    def _undo_unanswered(self, node: _Node, reason: str) -> None:
        """A node whose write failed may have recorded and written it all the same (its ctxmgr killed
        mid-step): it is put back too. Where it cannot be reached, what it holds is left to
        `deployment recover`, which the next change names."""
        back = self._restore_all([node], reason)[0]
        if not isinstance(back, NodeError) and back.revision is not None:
            self._settle_all([node], True, reason)

    def _put_back_unrestarted(self, written: list[_Node], reason: str) -> DeploymentResult:
        """A write failed before anything restarted: the nodes already written get their unit back."""
        result = self.result
        result.reason = f"nothing was restarted: {reason}"
        back = self._restore_all(written, reason)
        ok = not any(isinstance(b, NodeError) for b in back)
        self._settle_all(written, ok, reason)
        result.settled(ok)
        self._record(str(result.result))
        return result

    def _restart_all(self, back: bool) -> tuple[str, str] | None:
        """Stop every node (head first), start the headless ranks, then the head, watched and probed;
        then check every headless rank's journal. None when the deployment serves, else (reason, line)."""
        change = str(self.result.change_id)
        head, workers = self._head(), self._workers()
        self.say("stopping every node: " + ", ".join(str(n.address) for n in self.changing))
        stopped = self._each([head], lambda n: self._call(n, StopAnswer, "stop"))
        stopped += self._each(workers, lambda n: self._call(n, StopAnswer, "stop"))
        # on the way back one node that fails must not leave every other node stopped (issue 36 item 8):
        # each node that can start is started, and what failed is said with the rest
        early: list[tuple[str, str]] = []
        for node, answer in zip([head, *workers], stopped, strict=True):
            assert node.outcome is not None
            if isinstance(answer, NodeError):
                if not back:
                    return f"{node.address} did not stop: {answer.message}", ""
                node.outcome.ok, node.outcome.reason = False, answer.message
                early.append((f"{node.address} did not stop: {answer.message}", ""))
                self.not_back.append(node)
                continue
            node.outcome.step = NodeStep.STOPPED
        extra = ["--back"] if back else []
        cursors: dict[NodeAddress, str] = {}
        started = self._each(
            workers, lambda n: self._call(n, StartAnswer, "start", "--change", change, *extra)
        )
        for node, answer in zip(workers, started, strict=True):
            assert node.outcome is not None
            if isinstance(answer, NodeError):
                if not back:
                    return f"{node.address} did not start: {answer.message}", ""
                node.outcome.ok, node.outcome.reason = False, answer.message
                early.append((f"{node.address} did not start: {answer.message}", ""))
                self.not_back.append(node)
                continue
            cursors[node.address] = answer.cursor
            node.outcome.step = NodeStep.STARTED
        workers = [n for n in workers if n.address in cursors]
        self.say(f"starting the head {head.address}; following its journal and every node's unit")
        expected = str(self._expected(back))

        def check(node: _Node) -> CheckAnswer:
            cursor = cursors[node.address]
            return self._call(node, CheckAnswer, "check", "--cursor", cursor, "--max-model-len", expected)

        with ThreadPoolExecutor(max_workers=1) as pool:
            head_start = pool.submit(self._start_head, head, change, extra)
            first = self._watch(workers, check, head_start)
            if first is not None:  # the deployment failed there: the head would wait for it in vain
                self.say(f"{first[0]}: stopping the head")
                with contextlib.suppress(NodeError):
                    self._call(head, StopAnswer, "stop")
            answer = head_start.result()
        assert head.outcome is not None
        head.outcome.step = NodeStep.STARTED
        checks = self._each(workers, check)
        failures: list[tuple[str, str]] = list(
            early
        )  # (node: reason, vLLM's decisive line), first failed first
        if first is not None:
            failures.append((first[0], first[1]))
        if not answer.ok:
            head.outcome.ok, head.outcome.reason = False, answer.reason
            failures.append((f"{head.address}: {answer.reason}", answer.decisive_line))
        for node, checked in zip(workers, checks, strict=True):
            assert node.outcome is not None
            if first is not None and node is first[2]:
                node.outcome.ok, node.outcome.reason = False, first[0].removeprefix(f"{node.address}: ")
            elif isinstance(checked, NodeError):
                node.outcome.ok, node.outcome.reason = False, checked.message
                failures.append((checked.message, ""))
            elif not checked.ok:
                node.outcome.ok, node.outcome.reason = False, checked.reason
                failures.append((f"{node.address}: {checked.reason}", checked.decisive_line))
        if not failures:
            return None
        # every node that failed says why (vLLM's KV check runs in the head's engine; a rank's own OOM is
        # in its journal); the first decisive line vLLM printed is the one quoted
        line = next((line for _, line in failures if line), "")
        return "; ".join(reason for reason, _ in failures), line

    def _start_head(self, head: _Node, change: str, extra: list[str]) -> StartAnswer:
        """The head's start, watched until it serves and probed as the operator asked (a rollback's
        start: the plain probe); its failure, as any, an answer."""
        request = self.request
        probe = StartStdin() if extra else StartStdin(request.probe_tokens, request.long_probe)
        try:
            return self._call(
                head,
                StartAnswer,
                "start",
                "--change",
                change,
                "--head",
                *extra,
                # the head's own watch is bounded by the operator's --timeout (issue 36 item 7), the wait
                # for its answer by that and a step's time on top
                "--timeout",
                f"{request.start_timeout:g}",
                timeout=request.start_timeout + STEP_TIMEOUT,
                stdin=probe,
            )
        except NodeError as exc:  # its own words: the reason is put after the head's name
            return StartAnswer(
                head.address.service, False, reason=exc.message.removeprefix(f"{head.address}: ")
            )

    def _watch(
        self, workers: list[_Node], check: Callable[[_Node], CheckAnswer], head_start: Future[StartAnswer]
    ) -> tuple[str, str, _Node] | None:
        """Every headless rank's unit and journal while the head starts: the first that failed (its unit
        failed or stopped, or its journal holds vLLM's failure) as (node: reason, decisive line, node),
        at once, rather than after the head gave up waiting for it; None once the head's start ended."""
        while workers and not head_start.done():
            wait([head_start], timeout=WATCH_INTERVAL)
            if head_start.done():
                return None
            for node, checked in zip(workers, self._each(workers, check), strict=True):
                if isinstance(checked, NodeError) or checked.ok:
                    continue  # a check that could not be made is made again; the final one decides
                if checked.active_state == "failed" or checked.decisive_line:
                    return f"{node.address}: {checked.reason}", checked.decisive_line, node
        return None

    def _expected(self, back: bool) -> int:
        return int((self.result.previous_max_model_len if back else self.result.max_model_len) or 0)

    def _roll_back_all(self, reason: str) -> None:
        """Every node's previous unit back, every node restarted together, the old deployment probed:
        the one way back, for a failed change, an interrupted one and `deployment recover`."""
        result = self.result
        self._record("rolling-back")
        restored = self._restore_all(self.changing, reason)
        failure: tuple[str, str] | None = next(
            (
                (f"{n.address}: {r.message}", "")
                for n, r in zip(self.changing, restored, strict=True)
                if isinstance(r, NodeError)
            ),
            None,
        )
        if failure is None:
            failure = self._restart_all(back=True)
        ok = failure is None
        settle_reason = "" if failure is None else failure[0]
        # a node whose restore did not answer may not have its previous unit back: its revision stays
        # in progress there, for `deployment recover` to put back, not settled as if it had
        unanswered = [n for n, r in zip(self.changing, restored, strict=True) if isinstance(r, NodeError)]
        for node, answer in zip(self.changing, restored, strict=True):
            if isinstance(answer, NodeError) and node.outcome is not None:
                node.outcome.ok, node.outcome.reason = False, answer.message
        # a node that did not stop or start on the way back is left in progress too, for `recover`
        unanswered += [n for n in self.not_back if n not in unanswered]
        self._settle_all([n for n in self.changing if n not in unanswered], ok, settle_reason)
        result.settled(ok, settle_reason)
        if unanswered:
            result.reason += (
                f"; {', '.join(str(n.address) for n in unanswered)} may still hold the new unit, or not run "
                "the previous one: run `ctxmgr deployment recover` with the same nodes"
            )
        if ok:
            self.say("every node runs its previous unit again; the head passed its probe")
        self._record(str(result.result))


def _logged(shown: ShowAnswer) -> dict[str, JSONScalar]:
    """A node's logged figures as the result prints them ({} for a Ray node, which logs none here)."""
    return asdict(shown.logged) if shown.logged is not None else {}


def recover_deployment(request: DeploymentRequest, state_dir: Path | str) -> DeploymentResult:
    """`ctxmgr deployment recover`: finish what an interrupted deployment change left (every node back)."""
    return Coordinator(request, state_dir).recover()


def rollback_deployment(
    request: DeploymentRequest, state_dir: Path | str, to: str | None = None
) -> DeploymentResult:
    """`ctxmgr deployment rollback`: every node's unit as it was before the deployment's last good
    change (or as change `to` left it), restarted together through the same walk (written, stopped,
    started, checked, probed)."""
    return Coordinator(request, state_dir).rollback(to)


class NodeVerdict(TypedDict):
    host: str
    service: str
    role: NodeKind  # head | headless
    result: Verdict  # the head's verify result; ok | failed for a headless rank's check
    max_model_len: int | None


class DeploymentVerdict(TypedDict):
    """What `ctxmgr deployment verify` prints (--json: beside `command` and `changed`)."""

    deployment: str
    result: Verdict
    max_model_len: int | None
    probe_ok: bool | None
    reasons: list[str]
    nodes: list[NodeVerdict]


def verify_deployment(request: DeploymentRequest, state_dir: Path | str) -> DeploymentVerdict:
    """`ctxmgr deployment verify`: the head's verify, and every headless rank active with no failure
    since its start and the same max_model_len: ok | degraded | failed, as `verify`. Units that give
    the nodes different lengths fail the check (TP corrupts output past the smaller one)."""
    coordinator = Coordinator(request, state_dir)
    coordinator.read()
    head, workers = coordinator._head(), coordinator._workers()
    asked = VerifyStdin(request.long_probe)
    verified = coordinator._call(head, VerifyAnswer, "verify", timeout=SHOW_TIMEOUT + 600, stdin=asked)
    served = verified.max_model_len
    checks = coordinator._each(
        workers, lambda n: coordinator._call(n, CheckAnswer, "check", "--max-model-len", str(served or 0))
    )
    result = verified.result
    reasons = [f"{head.address}: {r}" for r in verified.reasons]
    if coordinator.drift:
        result = Verdict.FAILED
        reasons.append(
            f"{coordinator.drift}: the next restart breaks the deployment; "
            "`ctxmgr deployment set-context N` writes every node to N"
        )
    nodes: list[NodeVerdict] = [
        {
            "host": head.address.host,
            "service": head.address.service,
            "role": NodeKind.HEAD,
            "result": verified.result,
            "max_model_len": served,
        }
    ]
    for node, checked in zip(workers, checks, strict=True):
        ok = not isinstance(checked, NodeError) and checked.ok
        if isinstance(checked, NodeError):
            result = Verdict.FAILED
            reasons.append(checked.message)
        elif not checked.ok:
            result = Verdict.FAILED
            reasons.append(f"{node.address}: {checked.reason}")
        nodes.append(
            {
                "host": node.address.host,
                "service": node.address.service,
                "role": NodeKind.HEADLESS,
                "result": Verdict.OK if ok else Verdict.FAILED,
                "max_model_len": None if isinstance(checked, NodeError) else checked.max_model_len,
            }
        )
    return {
        "deployment": coordinator.name,
        "result": result,
        "max_model_len": served,
        "probe_ok": verified.probe_ok,
        "reasons": reasons,
        "nodes": nodes,
    }


def plan_deployment(request: DeploymentRequest, state_dir: Path | str) -> DeploymentResult:
    """`ctxmgr deployment plan`: read and plan, change nothing."""
    coordinator = Coordinator(request, state_dir)
    coordinator.read()
    if coordinator.drift:
        coordinator.say(f"{coordinator.drift}; set-context writes every node to the context planned")
    answer = coordinator.plan()
    result = coordinator.result
    result.action = "plan"
    result.result = answer.result  # a plan's own vocabulary: feasible | infeasible | unknown
    result.exit_code = answer.result.exit_code
    result.reason = answer.planned.reason
    return result


def set_deployment_context(request: DeploymentRequest, state_dir: Path | str) -> DeploymentResult:
    """`ctxmgr deployment set-context`: the whole change (module docstring)."""
    return Coordinator(request, state_dir).set_context()
