"""How a deployment's nodes are reached, apart from the walk over them (walk.py): one step on one
node, one step on every node at once, and which node is the head and which the headless ranks. Every
answer is the step's wire type, checked at the door (wire.py); any fault in it is that node's NodeError."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from vllm_ctxmgr.core.json_types import JSONScalar
from vllm_ctxmgr.core.topology import NodeKind, NodeRole, NodeStep, Topology
from vllm_ctxmgr.deployment.remote import Link, NodeAddress, NodeError
from vllm_ctxmgr.deployment.wire import Message, ShowAnswer
from vllm_ctxmgr.errors import ExitCode, UsageError

T = TypeVar("T", bound=Message)

SHOW_TIMEOUT = 120.0
STEP_TIMEOUT = 300.0  # a node's write, stop or check (a headless rank's stop took ~12 s)


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
class Node:
    """One node as the coordinator knows it: its address, its `node show` answer, its role in the
    topology and its line in the result."""

    address: NodeAddress
    shown: ShowAnswer | None = None  # its `node show` answer, once read
    role: NodeRole | None = None
    outcome: NodeOutcome | None = None

    @property
    def show(self) -> ShowAnswer:
        assert self.shown is not None, "read() reads every node first"
        return self.shown


class Nodes:
    """The deployment's nodes over the operator's link: the coordinator reads them into `nodes` and
    `topology`; the walk and every command reach them through here."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.nodes: list[Node] = []  # in rank order, once read (a Ray head's `ray start` unit left out)
        self.topology: Topology | None = None

    def call(
        self,
        node: Node,
        kind: type[T],
        *args: str,
        timeout: float = STEP_TIMEOUT,
        stdin: Message | None = None,
    ) -> T:
        """One step on `node`, its answer checked at the door (wire.py): any fault in it is that
        node's NodeError, its address first."""
        address = node.address
        answer = self.link.call(
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

    def each(self, nodes: list[Node], step: Callable[[Node], T]) -> list[T | NodeError]:
        """`step` on every node at once (stops and reads take seconds each; nodes are independent)."""

        def run(node: Node) -> T | NodeError:
            try:
                return step(node)
            except NodeError as exc:
                return exc

        if not nodes:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
            return list(pool.map(run, nodes))

    def head(self) -> Node:
        assert self.topology is not None, "read() reads every node first"
        head = self.topology.head
        return next(n for n in self.nodes if n.role is not None and n.role == head)

    def workers(self) -> list[Node]:
        """The headless ranks a change writes and restarts with the head (Ray's workers run no vLLM
        unit: the head's vLLM places its workers on them, so they are neither written nor restarted)."""
        head = self.head()
        return [n for n in self.nodes if n is not head and not (n.role and n.role.ray_worker)]

    @property
    def changing(self) -> list[Node]:
        """The nodes a change writes and restarts: the head first, then the headless ranks."""
        return [self.head(), *self.workers()]
