"""A context change of one vLLM deployment that spans machines, made as one change.

vLLM's own multi-node mode runs `vllm serve` on every node with the same engine flags (rank 0 with the
API server, every other rank `--headless`). Changing one node alone breaks it: ranks that disagree on
--max-model-len are not refused by vLLM, they corrupt output or kill the engine on the first long
request, and a head restarted alone waits for ever for its old ranks (shared/recipes). So the walk is
the deployment's, and each node's step is a `ctxmgr node` command there (node.py), reached through
nodes.py; this module reads and plans, walk.py walks:

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

import hashlib
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

from vllm_ctxmgr.change.states import Result
from vllm_ctxmgr.core.hardware import GpuState
from vllm_ctxmgr.core.plan_record import PlanResult
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.topology import (
    NodeKind,
    NodeRole,
    NodeUnit,
    Topology,
    read_topology,
    with_ray_gpus,
    world_gpus,
)
from vllm_ctxmgr.core.verdict import Verdict
from vllm_ctxmgr.deployment.nodes import SHOW_TIMEOUT, STEP_TIMEOUT, Node, NodeOutcome, Nodes
from vllm_ctxmgr.deployment.remote import NodeAddress, NodeError
from vllm_ctxmgr.deployment.walk import (
    DEPLOYMENT_FIELDS,
    WATCH_INTERVAL,
    DeploymentRequest,
    DeploymentResult,
    Printer,
    Walk,
    _logged,
)
from vllm_ctxmgr.deployment.wire import (
    CheckAnswer,
    InProgress,
    LastChange,
    NodeStart,
    PlanAnswer,
    PlannedGpu,
    PlanStdin,
    ShowAnswer,
    VerifyAnswer,
    VerifyStdin,
)
from vllm_ctxmgr.errors import CtxmgrError, ExitCode, UsageError
from vllm_ctxmgr.nvml import gpus_from_json
from vllm_ctxmgr.store import ServiceStore

# the names the deployment's callers import from here (the CLI, the tests), kept where they were
__all__ = [
    "DEPLOYMENT_FIELDS", "SHOW_TIMEOUT", "STEP_TIMEOUT", "WATCH_INTERVAL", "Coordinator", "DeploymentRequest",
    "DeploymentResult", "Node", "NodeOutcome", "Printer", "deployment_name", "plan_deployment",
    "recover_deployment", "rollback_deployment", "set_deployment_context", "verify_deployment",
]  # fmt: skip

# the coordinator's record (last-change.json) while a step is under way; any other state is settled
RECORD_IN_FLIGHT = ("writing", "finishing", "rolling-back")


def deployment_name(nodes: tuple[NodeAddress, ...], name: str | None) -> str:
    """The name the coordinator's lock and record go by: the operator's, else one made of the nodes."""
    if name:
        return name
    digest = hashlib.sha256("\n".join(sorted(map(str, nodes))).encode()).hexdigest()[:10]
    return f"{nodes[0].service.removesuffix('.service')}-{digest}"


def _role_name(role: NodeRole | None) -> str:
    if role is not None and role.ray_worker:
        return NodeKind.RAY  # a Ray node: the head's vLLM places workers there; its unit is not changed
    return NodeKind.HEADLESS if role is not None and role.headless else NodeKind.HEAD


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
        self.reach = Nodes(request.link)
        self.result = DeploymentResult(self.name, "set-context", Result.PLANNED, False)
        self.walk = Walk(request, self.name, self.store, self.reach, self.result)

    # ---- read and plan -----------------------------------------------------------------------

    def read(self, recovering: bool = False) -> Topology:
        """Every node's unit, the topology vLLM will form from them, and refusals before any write
        (a node with a change in progress among them, unless `recovering` it)."""
        request = self.request
        self.say(f"reading {len(request.nodes)} nodes: {', '.join(map(str, request.nodes))}")
        probes = [Node(address) for address in request.nodes]
        answers = self.reach.each(
            probes, lambda n: self.reach.call(n, ShowAnswer, "show", timeout=SHOW_TIMEOUT)
        )
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
        self.reach.nodes = sorted(
            (n for n in probes if n.role), key=lambda n: n.role.node_rank if n.role else 0
        )
        self.reach.topology = topology
        self.result.backend = topology.backend
        self.result.nodes = [
            NodeOutcome(
                n.address.host,
                n.address.service,
                _role_name(n.role),
                n.role.node_rank if n.role else 0,
                list(n.role.stages) if n.role else [],
            )
            for n in self.reach.nodes
        ]
        for node, outcome in zip(self.reach.nodes, self.result.nodes, strict=True):
            node.outcome = outcome
        return topology

    def _drifted(self, units: list[NodeUnit]) -> list[NodeUnit]:
        """The units with every node at the head's --max-model-len, where one was left at another
        (edited by hand): the deployment is the same otherwise, and its drift is said (`self.walk.drift`)
        for each command to act on: verify fails, set-context reconciles, rollback refuses."""
        serving = [u for u in units if u.args is not None]
        heads = [u for u in serving if not u.args or "--headless" not in u.args.flags]
        lengths = {f"{u.host}:{u.service}": u.args.max_model_len for u in serving if u.args}
        if len(set(lengths.values())) < 2 or len(heads) != 1 or heads[0].args is None:
            return units
        head = heads[0].args
        self.walk.drift = "max_model_len differs between nodes: " + ", ".join(
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
        assert self.reach.topology is not None
        per_node: dict[str, GpuState] = {}
        for node in self.reach.nodes:
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
        missing = [n.address.host for n in self.reach.nodes if n.address.host not in per_node]
        if missing:
            raise UsageError(
                f"{missing[0]}: no GPU information (no NVML there): give --gpus-from for it in the "
                "deployment file, or --gpu-memory and --gpu-count for every node"
            )
        if self.reach.topology.backend == "ray":  # which ranks each node holds follows its GPU count
            self.reach.topology = with_ray_gpus(
                self.reach.topology, {h: len(g.gpus) for h, g in per_node.items()}
            )
            roles = {(r.host, r.service): r for r in self.reach.topology.nodes}
            for node in self.reach.nodes:
                node.role = roles[(node.address.host, node.address.service)]
                if node.outcome is not None and node.role is not None:
                    node.outcome.stages = list(node.role.stages)
        return world_gpus(self.reach.topology, per_node)

    def plan(self) -> PlanAnswer:
        """The head plans the deployment (the model files are on the nodes, not necessarily here); its
        answer passed the door, which refuses a flag a context change does not write."""
        head = self.reach.head()
        world = self._world_gpus()
        stdin = PlanStdin(
            planning=self.request.planning,
            world_gpus=world.to_json() if world else None,
            node_observations=self._node_observations() if world else (),
        )
        args = ["plan", "--context", str(self.request.context)]
        if self.request.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{self.request.gpu_memory_utilization:g}"]
        answer = self.reach.call(head, PlanAnswer, *args, timeout=SHOW_TIMEOUT, stdin=stdin)
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
            for node in self.reach.workers()
            if node.role is not None and node.show.observation is not None
        )

    def _per_node(self, lines: tuple[PlannedGpu, ...]) -> None:
        """Split the plan's GPU lines (rank order, the world's GPUs) per node."""
        for node in self.reach.nodes:
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
            if self.walk.drift:
                self.say(f"{self.walk.drift}; every node is written to max_model_len {request.context}")
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
            return self.walk.change(
                flags,
                env,
                context,
                f"every node already has max_model_len {context}: nothing changed, nothing restarted",
                f"{self.walk.drift}: every node is written to {context}" if self.walk.drift else "",
            )

    def recover(self) -> DeploymentResult:
        """Finish a deployment change an interrupted coordinator left in progress on its nodes: every
        node it wrote gets its previous unit back and every node restarts together (Walk.roll_back_all)."""
        result = self.result
        result.action = "recover"
        with self.store.lock(self.request.wait_lock):
            self.read(recovering=True)
            pending = {n.address: n.show.in_progress for n in self.reach.changing}
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
            last = next(n.show.last_change for n in self.reach.changing if pending[n.address] is not None)
            if last is not None:
                result.max_model_len = last.max_model_len
                result.previous_max_model_len = last.previous_max_model_len
            finished = [
                n
                for n in self.reach.changing
                if any(c.change == result.change_id and c.state == "final" for c in n.show.deployment_changes)
            ]
            if finished:
                return self._finish_left(finished, pending)
            interrupted = f"the deployment change {result.change_id} was interrupted"
            failed = self._failed_reason(str(result.change_id))
            if failed:  # the reason the change failed stays first; recover's own is added to it
                interrupted = f"{failed}; {interrupted} while rolling back"
            self.walk.roll_back_all(interrupted)
            result.changed = True  # every node it wrote was written back, and every node restarted
            if result.result is Result.ROLLED_BACK:
                result.exit_code = ExitCode.OK  # recovering is what was asked, and it worked (as `recover`)
                result.reason = (
                    f"{interrupted}: every node it wrote has its previous unit back, and the deployment "
                    f"serves again at max_model_len {result.previous_max_model_len}"
                )
            else:
                result.reason = f"{interrupted}{result.reason}"
            self.walk.record(str(result.result))  # with the reason: the way back recorded it without one
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
            for node in self.reach.changing
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
        self, finished: list[Node], pending: Mapping[NodeAddress, InProgress | None]
    ) -> DeploymentResult:
        """A change final on some node got past its finish step: the deployment served, the head passed
        its probe and every rank was checked, and a node's answer to `finish` failed.
        Its nodes' units are the change's, so putting the previous units back would undo a change that
        served (and the final nodes' would stay): the nodes it left in progress are finished instead, once
        every node is active again."""
        result = self.result
        left = [n for n in self.reach.changing if pending[n.address] is not None]
        down = [
            f"{n.address} is {n.show.active_state}"
            for n in self.reach.changing
            if n.show.active_state != "active"
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
        unfinished = self.walk.finish_all(left)
        result.result = Result.APPLIED
        result.reason = (
            f"the deployment change {result.change_id} had served on every node; its revision is now "
            f"final on {', '.join(str(n.address) for n in left)}, nothing was written or restarted"
        )
        if unfinished:
            result.exit_code = ExitCode.ERROR
            result.reason = f"the deployment change {result.change_id} had served on every node, {unfinished}"
        self.walk.record("unfinished" if unfinished else "final")
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
            if self.walk.drift:
                raise UsageError(
                    f"{self.walk.drift}: there is no one change to roll back; "
                    "`ctxmgr deployment set-context N` writes every node to N"
                )
            target = self._rollback_target(to)
            context = int((target.max_model_len if to else target.previous_max_model_len) or 0)
            if to:
                self.walk.back_to = str(target.change)
            else:
                self.walk.undo = str(target.change)
            result.previous_max_model_len = parse_serve_argv(
                list(self.reach.head().show.argv), dict(self.reach.head().show.environment)
            ).max_model_len
            result.max_model_len = context
            flags = {"--max-model-len": str(context)}
            return self.walk.change(
                flags,
                {},
                context,
                f"every node already has the unit {to or 'from before ' + str(target.change)}",
                keep_previous=result.previous_max_model_len,
            )

    def _rollback_target(self, to: str | None) -> LastChange:
        """The deployment change every node goes back before (its newest final one), or `to`: the same
        on every node, final on every node."""
        found: dict[NodeAddress, LastChange | None] = {}
        if to and to.isdigit():  # a revision number, as one service's rollback takes: the head's
            made = self.reach.head().show.deployment_changes
            change = next((c.change for c in made if c.revision == int(to) and c.change), None)
            if change is None:
                raise UsageError(
                    f"{self.reach.head().address}: revision {to} is not one a deployment change made"
                )
            to = change
        for node in self.reach.changing:
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
    head, workers = coordinator.reach.head(), coordinator.reach.workers()
    asked = VerifyStdin(request.long_probe)
    verified = coordinator.reach.call(head, VerifyAnswer, "verify", timeout=SHOW_TIMEOUT + 600, stdin=asked)
    served = verified.max_model_len
    checks = coordinator.reach.each(
        workers,
        lambda n: coordinator.reach.call(n, CheckAnswer, "check", "--max-model-len", str(served or 0)),
    )
    result = verified.result
    reasons = [f"{head.address}: {r}" for r in verified.reasons]
    if coordinator.walk.drift:
        result = Verdict.FAILED
        reasons.append(
            f"{coordinator.walk.drift}: the next restart breaks the deployment; "
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
    if coordinator.walk.drift:
        coordinator.say(f"{coordinator.walk.drift}; set-context writes every node to the context planned")
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
