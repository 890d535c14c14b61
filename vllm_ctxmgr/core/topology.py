"""One vLLM deployment over several nodes, read from every node's unit: which node runs which ranks.

A model too big for one host runs as one deployment with a systemd unit per node, in one of vLLM
0.33's two ways: its own multi-node mode (`--nnodes/--node-rank/--master-addr/--master-port`, every
rank > 0 `--headless`; or data parallel over nodes with `--data-parallel-size-local/-start-rank`), or
Ray (`ray start` units on every node, `vllm serve --distributed-executor-backend ray` on the head only).
`read_topology` refuses what vLLM refuses, with vLLM's message and where it comes from, and also what
vLLM accepts and then breaks on (nodes started with a different --max-model-len, as measured with the
real CPU build over two nodes: TP corrupts output, PP kills the engine). `world_gpus` lays
the nodes' GPUs out in rank order so the planner (core/plan.py) plans each pipeline stage with the
GPUs that really hold it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from vllm_ctxmgr.core.hardware import GpuInfo, GpuState, gib, platform_for
from vllm_ctxmgr.core.memory import default_max_num_seqs
from vllm_ctxmgr.core.plan import GpuMemory, Plan
from vllm_ctxmgr.core.serve_args import ServeArgs, human_readable_int
from vllm_ctxmgr.core.vllm_flags import flag as vllm_flag
from vllm_ctxmgr.errors import UsageError

# where vLLM 0.33.0 refuses a layout (paths inside the wheel's vllm/)
WORLD_DIVIDES = "engine/arg_utils.py:2406"
NODE_RANK_RANGE = "engine/arg_utils.py:2414"
DP_BACKEND_MP = "engine/arg_utils.py:2390"
RAY_NNODES = "config/parallel.py:1107"
DP_NODE_GROUPS = "config/parallel.py:827"
REMOTE_HEADLESS = "v1/engine/utils.py:1511"
HEADLESS_API_COUNT = "entrypoints/cli/serve.py:70"
BATCH_DEFAULTS = "engine/arg_utils.py:2973"  # get_batch_defaults: from the node's own device memory
MIN_BLOCKS = "v1/core/kv_cache_planning.py:1583"  # num_blocks of every worker cut to the smallest

# ParallelConfig's defaults (config/parallel.py:317-328, 161)
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501
DEFAULT_DP_RPC_PORT = 29550

# Engine flags that may differ between nodes. Each node's workers are built from that node's own
# command line (run_headless -> create_engine_config -> MultiprocExecutor, entrypoints/cli/serve.py:
# 181-233), and the head's engine core gathers what each worker measured: every worker sizes its own
# KV budget from its own --gpu-memory-utilization / --kv-cache-memory-bytes (v1/worker/gpu_worker.py
# determine_available_memory reads its own cache_config), and the engine cuts every worker's block
# count to the smallest (v1/core/kv_cache_planning.py:1583). So those two are per node, like where the
# node keeps its files and binds its threads. Everything else that builds the engine's configs
# (--max-model-len, --kv-cache-dtype, --block-size, --max-num-seqs, --max-num-batched-tokens, ...)
# must be the same: vLLM does not compare them and a node with another value breaks the deployment
# (the recipe: past the smaller --max-model-len TP silently corrupts output, PP kills the engine).
PER_NODE_FLAGS = frozenset(
    {
        "--node-rank", "--headless", "--data-parallel-start-rank", "--data-parallel-size-local",
        "--data-parallel-rank", "--api-server-count", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
        "--download-dir", "--safetensors-load-strategy", "--safetensors-prefetch-num-threads",
        "--safetensors-prefetch-block-size", "--use-tqdm-on-load", "--distributed-timeout-seconds",
        "--cpu-distributed-timeout-seconds", "--numa-bind", "--numa-bind-nodes", "--numa-bind-cpus",
        "--device-ids", "--max-parallel-loading-workers", "--config", "--log-level", "--log-config-file",
        "--disable-log-stats", "--aggregate-engine-logging", "--fail-on-environ-validation",
        "--shutdown-timeout", "--enable-log-requests", "--logging-config", "--profiler-config",
    }
)  # fmt: skip
# config classes of flags that do not build the engine: the API server, metrics and tracing
_NOT_ENGINE = ("FrontendArgs", "BaseFrontendArgs", "ObservabilityConfig")
# flags without a config class in vLLM's table that still reach the engine or its DP handshake
_ENGINE_WITHOUT_CLASS = frozenset(
    {
        "--disable-cascade-attn", "--enable-lora", "--data-parallel-address", "--data-parallel-rpc-port",
        "--data-parallel-backend", "--gdn-prefill-backend", "--kda-prefill-backend", "--kda-decode-backend",
        "--mm-processor-device",
    }
)  # fmt: skip
# the environment every node must agree on: each node's workers split the layers by their own
# VLLM_PP_LAYER_PARTITION (distributed/utils.py:214), and each node checks --max-model-len against
# the model's maximum under its own VLLM_ALLOW_LONG_MAX_MODEL_LEN (config/model.py)
SAME_ENV = ("VLLM_PP_LAYER_PARTITION", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")
# how ServeArgs reads the flags it models, so `8k` and `8000` compare as the same value
_TYPED = {
    "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--data-parallel-size": "data_parallel_size",
    "--decode-context-parallel-size": "decode_context_parallel_size",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-num-seqs": "max_num_seqs",
    "--block-size": "block_size",
}


class TopologyError(UsageError):
    """A set of node units that is not one deployment vLLM would run: the message is vLLM's own where
    vLLM refuses it (with the file:line of 0.33 it comes from), ctxmgr's where vLLM starts and breaks."""


@dataclass(frozen=True)
class NodeUnit:
    """One node's unit as the caller read it: `args` is parse_serve_argv of its ExecStart (None only
    for a `ray start --head/--address` unit, which runs no `vllm serve`)."""

    host: str  # how the operator names the node ("10.0.0.2", "gpu-b", "local")
    service: str  # the unit name there ("vllm-glm5.service")
    args: ServeArgs | None
    ray_worker: bool = False  # the unit runs `ray start`, not `vllm serve`


@dataclass(frozen=True)
class NodeRole:
    """What one node runs. `ranks` are global worker ranks, vLLM's
    rank = dp x (PP x PCP x TP) + pp x (PCP x TP) + pcp x TP + tp (distributed/parallel_state.py
    initialize_model_parallel's reshape); empty where they are not known yet (Ray, before GPU counts)."""

    host: str
    service: str
    node_rank: int
    headless: bool  # runs no API server (rank > 0, or --headless)
    ranks: tuple[int, ...]
    stages: tuple[int, ...]  # pipeline stages on this node
    local_world_size: int  # GPUs this node's workers use (0: not known yet, Ray)
    data_parallel_ranks: tuple[int, ...] = ()  # the engines (DP ranks) this node's workers belong to
    ray_worker: bool = False  # the node's unit is `ray start`: vLLM's workers there are Ray actors
    args: ServeArgs | None = field(default=None, compare=False, repr=False)


class NodeKind(StrEnum):
    """A node's role as a deployment's result and report name it (a NodeRole's in one word)."""

    HEAD = "head"  # the API server: planned, probed and verified there
    HEADLESS = "headless"  # a rank > 0 (or --headless): started after the head's stop, checked
    RAY = "ray"  # a `ray start` unit: the head's vLLM places workers there; its unit is not changed


class NodeStep(StrEnum):
    """The last step a deployment change reached on a node, in the order the walk takes them."""

    READ = "read"  # `node show` answered
    WRITTEN = "written"  # `node prepare` wrote the change's revision
    STOPPED = "stopped"
    STARTED = "started"
    FINAL = "final"  # `node finish` made the revision final


@dataclass(frozen=True)
class Topology:
    """One deployment over nodes. backend: "mp" (vLLM's own --nnodes, or data parallel over nodes with
    --data-parallel-size-local) or "ray"."""

    nodes: tuple[NodeRole, ...]  # node-rank order
    backend: str
    nnodes: int
    world_size: int  # DP x PP x PCP x TP: every worker of the deployment
    local_world_size: int  # GPUs per node (mp); 0 where nodes differ or it is not known (Ray)
    master_addr: str | None  # --master-addr (mp with --nnodes); None otherwise
    master_port: int | None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_address: str | None = None  # DP over nodes: where the headless engines handshake
    data_parallel_rpc_port: int | None = None
    ray_head_service: str | None = None  # Ray: the head node's own `ray start --head` unit, if given
    notes: tuple[str, ...] = ()

    @property
    def head(self) -> NodeRole:
        """The node with the API server (node rank 0, not headless)."""
        return self.nodes[0]

    @property
    def workers(self) -> tuple[NodeRole, ...]:
        """Every other node."""
        return self.nodes[1:]

    @property
    def world_size_within_dp(self) -> int:
        """One engine's workers: PP x PCP x TP (vLLM's ParallelConfig.world_size)."""
        return self.pipeline_parallel_size * self.prefill_context_parallel_size * self.tensor_parallel_size

    def start_order(self) -> tuple[tuple[NodeRole, ...], ...]:
        """The groups to start, in order. mp: every node together, once every node has stopped (a head
        waits for ever for a headless rank started before it stopped, and a headless rank outlives its
        head silently: the recipe). Ray: only the head's vLLM unit; the `ray start` units stay up."""
        if self.backend == "ray":
            return ((self.head,),)
        return (self.nodes,)


def read_topology(units: Sequence[NodeUnit]) -> Topology:
    """The deployment the units form, or TopologyError saying why vLLM would not run it."""
    if not units:
        raise TopologyError("no node units given")
    seen: set[tuple[str, str]] = set()
    for unit in units:
        if (unit.host, unit.service) in seen:
            raise TopologyError(f"{unit.host} {unit.service} is given twice")
        seen.add((unit.host, unit.service))
        if unit.args is None and not unit.ray_worker:
            raise TopologyError(f"{_name(unit)}: no `vllm serve` command read from its unit")
    serve = [u for u in units if not u.ray_worker]
    if not serve:
        raise TopologyError("no node runs `vllm serve` (only `ray start` units given)")
    for unit in serve:
        refusal = _args(unit).refusals
        if refusal:
            raise TopologyError(f"{_name(unit)}: vLLM refuses its arguments: {refusal[0]}")
    if any(u.ray_worker for u in units) or any(
        _flag(u, "--distributed-executor-backend") == "ray" for u in serve
    ):
        return _read_ray(units, serve)
    if any(_int(u, "--nnodes", 1) > 1 for u in serve):
        return _read_nnodes(serve)
    if len(serve) > 1 and any(_dp_over_nodes(u) for u in serve):
        return _read_dp(serve)
    if len(serve) == 1:
        raise TopologyError(
            f"{_name(serve[0])}: not a multi-node deployment (no --nnodes > 1, no Ray, no data parallel "
            "over nodes): change it as one service"
        )
    raise TopologyError(
        "not a multi-node deployment: none of "
        + ", ".join(_name(u) for u in serve)
        + " gives --nnodes > 1, Ray, or data parallel over nodes (--data-parallel-size-local); they are "
        "separate services"
    )


def node_of_rank(topology: Topology, rank: int) -> NodeRole:
    """The node whose workers include global rank `rank`."""
    for node in topology.nodes:
        if rank in node.ranks:
            return node
    raise TopologyError(
        f"no node holds rank {rank} (the deployment's ranks are 0..{topology.world_size - 1})"
    )


def world_gpus(topology: Topology, per_node: Mapping[str, GpuState]) -> GpuState:
    """The deployment's GPUs in global rank order: node k's first local_world_size GPUs after its
    CUDA_VISIBLE_DEVICES, its lowest rank on its first GPU (MultiprocExecutor starts local rank i as
    global rank local_world_size x node_rank_within_dp + i, v1/executor/multiproc_executor.py:192, on
    GPU i, config/parallel.py get_local_gpu_index). core/plan.py make_plan puts rank r in stage
    (r % (TP x PP)) // TP, so each stage is planned with the GPUs that hold it, and the smallest
    worker's KV budget decides (vLLM cuts every worker to the smallest block count: MIN_BLOCKS)."""
    by_rank: dict[int, GpuInfo] = {}
    selected: dict[str, GpuState] = {}
    sources: list[str] = []
    drivers: set[str | None] = set()
    notes: list[str] = []
    for node in topology.nodes:
        if not node.ranks:
            raise TopologyError(
                f"{node.host}: which ranks its GPUs hold is not known yet (Ray places workers at start; "
                "give every node's GPU count with with_ray_gpus)"
            )
        state = per_node.get(node.host)
        if state is None:
            raise TopologyError(f"{node.host}: no GPU state given for this node")
        visible = node.args.env.get("CUDA_VISIBLE_DEVICES") if node.args is not None else None
        try:
            state = state.select(visible)
        except UsageError as error:
            raise TopologyError(f"{node.host}: {error}") from None
        if len(state.gpus) < len(node.ranks):
            # the worker's own assertion (v1/worker/gpu_worker.py:487)
            raise TopologyError(
                f"{node.host}: its workers need {len(node.ranks)} GPUs, it has {len(state.gpus)} (vLLM: "
                f"DP adjusted local rank {len(state.gpus)} is out of bounds for {len(state.gpus)} devices.)"
            )
        for rank, info in zip(sorted(node.ranks), state.gpus, strict=False):
            by_rank[rank] = info
        selected[node.host] = state
        sources.append(state.source)
        drivers.add(state.driver_version)
        notes.extend(f"{node.host}: {note}" for note in state.notes)
    missing = [r for r in range(topology.world_size) if r not in by_rank]
    if missing:
        raise TopologyError(f"no node holds rank(s) {_ranges(missing)}")
    _same_batch_defaults(topology, selected)
    source = "nvml" if all(s == "nvml" for s in sources) else ", ".join(dict.fromkeys(sources))
    driver = next(iter(drivers)) if len(drivers) == 1 else None
    ordered = tuple(by_rank[r] for r in range(topology.world_size))
    return GpuState(ordered, source, driver, tuple(notes))


def _same_batch_defaults(topology: Topology, selected: Mapping[str, GpuState]) -> None:
    """A flag left to vLLM's default must come out the same on every node: --max-num-batched-tokens and
    --max-num-seqs default from the node's own GPU memory (BATCH_DEFAULTS), so a head on 141 GB GPUs
    schedules 8192-token steps into a node whose 48 GB GPUs sized its workers' buffers for 2048.
    (v1/worker/gpu_model_runner.py:524; Ray's workers take the head's config: nothing to compare.)"""
    if topology.backend == "ray":
        return
    for flag_name, default in (
        ("--max-num-batched-tokens", lambda p: p.default_max_num_batched_tokens(topology.world_size)),
        ("--max-num-seqs", default_max_num_seqs),
    ):
        values: dict[str, tuple[int, str]] = {}
        for node in topology.nodes:
            state = selected[node.host]
            if node.args is None or flag_name in node.args.flags or not state.gpus:
                continue
            platform = platform_for(state)
            first = state.gpus[0]
            values[node.host] = (default(platform), f"{first.name}, {gib(first.total_bytes)}")
        if len({value for value, _ in values.values()}) > 1:
            shown = ", ".join(f"{host} {value} ({gpu})" for host, (value, gpu) in values.items())
            raise TopologyError(
                f"{flag_name} is left to vLLM's default, which each node takes from its own GPUs "
                f"(vLLM 0.33 {BATCH_DEFAULTS} get_batch_defaults): {shown}; the head schedules by its "
                f"value and each node's workers size their buffers by theirs: give {flag_name} on every node"
            )


def node_lines(topology: Topology, plan: Plan) -> dict[str, tuple[GpuMemory, ...]]:
    """The plan's GPU lines per node (host -> its lines, lowest rank first): plan.gpus holds one line
    per global rank, in rank order, as world_gpus laid the GPUs out."""
    lines: dict[str, tuple[GpuMemory, ...]] = {}
    for node in topology.nodes:
        if not node.ranks and node.ray_worker:
            raise TopologyError(f"{node.host}: its ranks are not known yet (Ray: give GPU counts first)")
        lines[node.host] = tuple(plan.gpus[r] for r in sorted(node.ranks) if r < len(plan.gpus))
    return lines


def with_ray_gpus(topology: Topology, gpu_counts: Mapping[str, int]) -> Topology:
    """A Ray topology with the ranks each node holds, from each node's GPU count. vLLM 0.33 orders the
    placement group's bundles driver node first, then by Ray's node id (v1/executor/ray_utils.py
    get_bundles_sorted_by_node), so the head holds the first ranks; with one worker node it holds the
    rest, with more the order of their ids is Ray's and their ranks stay empty."""
    if topology.backend != "ray":
        return topology
    world = topology.world_size
    head_gpus = int(gpu_counts.get(topology.head.host, 0))
    total = sum(int(gpu_counts.get(n.host, 0)) for n in topology.nodes)
    if total < world:
        raise TopologyError(
            f"the Ray cluster has {total} GPUs, the deployment needs {world} (vLLM: The number of required "
            "GPUs exceeds the total number of available GPUs in the placement group.)"
        )
    wdp = topology.world_size_within_dp
    tp_pcp = topology.tensor_parallel_size * topology.prefill_context_parallel_size

    def role(node: NodeRole, ranks: range | tuple[int, ...]) -> NodeRole:
        ranks = tuple(ranks)
        stages = tuple(sorted({(r % wdp) // tp_pcp for r in ranks}))
        return replace(node, ranks=ranks, stages=stages, local_world_size=len(ranks))

    head_ranks = range(min(head_gpus, world))
    nodes = [role(topology.head, head_ranks)]
    workers = topology.workers
    if len(workers) == 1:
        nodes.append(role(workers[0], range(len(head_ranks), world)))
    else:
        nodes.extend(workers)
    return replace(topology, nodes=tuple(nodes))


# --------------------------------------------------------------------------------------------------
# the three ways to span nodes
# --------------------------------------------------------------------------------------------------


def _read_nnodes(serve: list[NodeUnit]) -> Topology:
    """vLLM's own multi-node mode: every node `vllm serve ... --nnodes N --node-rank k`, master on rank 0."""
    for unit in serve:  # what each node's vLLM refuses on its own, in create_engine_config's order
        _refuse_nnodes_launch(unit)
    _same_everywhere(serve)
    first = serve[0]
    nnodes = _int(first, "--nnodes", 1)
    master_addr = _flag(first, "--master-addr")
    if master_addr is None:
        raise TopologyError(
            "no node gives --master-addr: vLLM's default 127.0.0.1 (config/parallel.py:317) cannot reach "
            "node rank 0 from another node"
        )
    by_rank: dict[int, list[NodeUnit]] = {}
    for unit in serve:
        by_rank.setdefault(_int(unit, "--node-rank", 0), []).append(unit)
    _each_once("node rank", by_rank, nnodes, "--node-rank")

    sizes = _NnodesSizes.of(first, nnodes)
    roles = [_nnodes_role(by_rank[rank][0], rank, sizes) for rank in range(nnodes)]
    _each_rank_once(roles, sizes.world_size)
    dp = sizes.data_parallel_size
    return Topology(
        nodes=tuple(roles),
        backend="mp",
        nnodes=nnodes,
        world_size=sizes.world_size,
        local_world_size=sizes.local_world_size,
        master_addr=master_addr,
        master_port=_int(first, "--master-port", DEFAULT_MASTER_PORT),
        tensor_parallel_size=sizes.tensor_parallel_size,
        pipeline_parallel_size=sizes.pipeline_parallel_size,
        prefill_context_parallel_size=sizes.prefill_context_parallel_size,
        data_parallel_size=dp,
        data_parallel_address=_flag(first, "--data-parallel-address") or (master_addr if dp > 1 else None),
        data_parallel_rpc_port=_int(first, "--data-parallel-rpc-port", DEFAULT_DP_RPC_PORT)
        if dp > 1
        else None,
    )


def _refuse_nnodes_launch(unit: NodeUnit) -> None:
    """What one node's vLLM refuses in its --nnodes launch options on its own, before any other node is
    read, in create_engine_config's order (so the first refusal is the one that node's vLLM would log)."""
    nnodes = _int(unit, "--nnodes", 1)
    node_rank = _int(unit, "--node-rank", 0)
    dp_backend = _flag(unit, "--data-parallel-backend") or "mp"
    if nnodes > 1 and dp_backend != "mp":
        _vllm(
            unit,
            "Invalid data-parallel launch options: "
            f"`--nnodes {nnodes}` requires `--data-parallel-backend mp`; got "
            f"`--data-parallel-backend {dp_backend}`. Use the MP backend or set `--nnodes 1`.",
            DP_BACKEND_MP,
        )
    world = _world(unit)
    if nnodes > 1 and world % nnodes != 0:
        _vllm(
            unit,
            "Invalid data-parallel launch options: "
            f"`--nnodes {nnodes}` must evenly divide the total world size ({world}). Adjust `--nnodes`, "
            "`--data-parallel-size`, `--pipeline-parallel-size`, `--tensor-parallel-size`, or "
            "`--prefill-context-parallel-size`.",
            WORLD_DIVIDES,
        )
    if nnodes > 1 and not 0 <= node_rank < nnodes:
        _vllm(
            unit,
            "Invalid data-parallel launch options: `--node-rank` must "
            f"be between 0 and {nnodes - 1}; got `--node-rank {node_rank}`. Set it to this node's "
            "zero-based index.",
            NODE_RANK_RANGE,
        )
    backend = _flag(unit, "--distributed-executor-backend")
    if backend not in (None, "mp"):
        raise TopologyError(
            f"{_name(unit)}: --distributed-executor-backend {backend} with --nnodes: ctxmgr reads "
            "vLLM's own multi-node mode with the mp backend only"
        )
    if _headless(unit) and _int(unit, "--api-server-count", 0) > 0:
        count = _int(unit, "--api-server-count", 0)
        _vllm(
            unit,
            f"--api-server-count={count} cannot be used with --headless (no API servers are started "
            "in headless mode).",
            HEADLESS_API_COUNT,
        )
    _refuse_lb_modes(unit)


@dataclass(frozen=True)
class _NnodesSizes:
    """The parallel sizes every node shares (the head's, once _same_everywhere has compared them) and
    what vLLM derives from them for --nnodes: each node's rank layout is computed from these alone."""

    nnodes: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    prefill_context_parallel_size: int

    @classmethod
    def of(cls, first: NodeUnit, nnodes: int) -> _NnodesSizes:
        args = _args(first)
        return cls(
            nnodes=nnodes,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size,
            prefill_context_parallel_size=_int(first, "--prefill-context-parallel-size", 1),
        )

    @property
    def world_size_within_dp(self) -> int:
        """vLLM's world_size_within_dp: one engine's GPUs (TP x PP x PCP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.world_size_within_dp

    @property
    def local_world_size(self) -> int:
        """The GPUs each node holds (arg_utils.py:2421)."""
        return self.world_size // self.nnodes


def _nnodes_role(unit: NodeUnit, rank: int, sizes: _NnodesSizes) -> NodeRole:
    """Node `rank`'s global ranks and DP ranks as vLLM lays them out for --nnodes (arg_utils.py:2421-2444,
    ParallelConfig), refusing a DP split vLLM refuses and a node that runs the wrong half (API server or
    --headless workers) for its rank."""
    nnodes, dp, wdp = sizes.nnodes, sizes.data_parallel_size, sizes.world_size_within_dp
    local = sizes.local_world_size
    given_local = _int_or_none(unit, "--data-parallel-size-local")
    dp_local = given_local if given_local is not None else max(local // wdp, 1)  # arg_utils.py:2444
    if dp_local < 1 or dp % dp_local:
        raise TopologyError(
            f"{_name(unit)}: --data-parallel-size-local {dp_local} does not divide --data-parallel-size {dp}"
        )
    node_groups = dp // dp_local
    if nnodes % node_groups:
        _vllm(
            unit,
            "Invalid data parallel configuration: "
            f"nnodes ({nnodes}) must be divisible by the number of data parallel node groups "
            f"({node_groups} = data_parallel_size {dp} / data_parallel_size_local {dp_local})",
            DP_NODE_GROUPS,
        )
    within = nnodes // node_groups  # nnodes_within_dp
    rank_within = rank % within
    start = _int_or_none(unit, "--data-parallel-start-rank")
    dp_start = start if start is not None else (rank * local) // wdp  # arg_utils.py:2422
    per_engine = wdp // within  # ParallelConfig.local_world_size
    dp_ranks = tuple(range(dp_start, dp_start + dp_local))
    ranks = tuple(d * wdp + per_engine * rank_within + i for d in dp_ranks for i in range(per_engine))
    headless = _headless(unit)
    if rank == 0 and headless:
        raise TopologyError(
            f"{_name(unit)}: node rank 0 runs --headless, so no node runs the API server (vLLM waits "
            "for a front end that never comes)"
        )
    if rank > 0 and not headless:
        if rank_within == 0:  # the first node of another engine: the head's DP handshake refuses it
            _vllm(
                unit,
                f"Remote engine {dp_start} must use --headless unless in external or hybrid dp lb mode",
                REMOTE_HEADLESS,
            )
        raise TopologyError(
            f"{_name(unit)}: node rank {rank} lacks --headless: every rank > 0 runs vLLM's headless "
            "workers (entrypoints/cli/serve.py run_headless), not a second API server and engine"
        )
    tp_pcp = sizes.tensor_parallel_size * sizes.prefill_context_parallel_size
    return _role(unit, rank, headless or rank > 0, ranks, dp_ranks, tp_pcp, wdp)


def _read_dp(serve: list[NodeUnit]) -> Topology:
    """Data parallel over nodes without --nnodes: the head runs the API server and its local engines, each
    other node `--headless --data-parallel-start-rank S` with its engines (docs: multi-node data parallel)."""
    for unit in serve:
        _refuse_lb_modes(unit)
        if _headless(unit) and _flag(unit, "--data-parallel-address") is None:
            raise TopologyError(
                f"{_name(unit)}: a headless node without --data-parallel-address connects to 127.0.0.1 "
                "(engine/arg_utils.py:2551: the DP address defaults to the master address) and never reaches "
                "the head"
            )
    _same_everywhere(serve)
    first = serve[0]
    args = _args(first)
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    pcp = _int(first, "--prefill-context-parallel-size", 1)
    wdp = tp * pp * pcp
    by_dp: dict[int, list[NodeUnit]] = {}
    spans: dict[str, range] = {}
    for unit in serve:
        local = _int_or_none(unit, "--data-parallel-size-local")
        local = dp if local is None else local  # arg_utils.py:2535: local DP size defaults to the global one
        start = _int(unit, "--data-parallel-start-rank", 0)
        if local < 1:
            raise TopologyError(f"{_name(unit)}: data_parallel_size_local must be > 0 in headless mode")
        spans[_name(unit)] = range(start, start + local)
        for d in range(start, start + local):
            by_dp.setdefault(d, []).append(unit)
    _each_once("data parallel rank", by_dp, dp, "--data-parallel-start-rank/--data-parallel-size-local")
    ordered = sorted(serve, key=lambda u: spans[_name(u)].start)
    heads = [u for u in ordered if not _headless(u)]
    if not heads:
        raise TopologyError("every node runs --headless: no node runs the API server")
    if heads[0] is not ordered[0] or len(heads) > 1:
        stray = heads[1] if heads[0] is ordered[0] else heads[0]
        _vllm(
            stray,
            f"Remote engine {spans[_name(stray)].start} must use --headless unless in external or hybrid "
            "dp lb mode",
            REMOTE_HEADLESS,
        )
    roles = []
    for rank, unit in enumerate(ordered):
        dp_ranks = tuple(spans[_name(unit)])
        ranks = tuple(d * wdp + i for d in dp_ranks for i in range(wdp))
        roles.append(_role(unit, rank, rank > 0, ranks, dp_ranks, tp * pcp, wdp))
    _each_rank_once(roles, dp * wdp)
    sizes = {r.local_world_size for r in roles}
    return Topology(
        nodes=tuple(roles),
        backend="mp",
        nnodes=len(roles),
        world_size=dp * wdp,
        local_world_size=sizes.pop() if len(sizes) == 1 else 0,
        master_addr=None,
        master_port=None,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        data_parallel_size=dp,
        data_parallel_address=_flag(ordered[-1], "--data-parallel-address"),
        data_parallel_rpc_port=_int(first, "--data-parallel-rpc-port", DEFAULT_DP_RPC_PORT),
    )


def _read_ray(units: Sequence[NodeUnit], serve: list[NodeUnit]) -> Topology:
    """Ray: `vllm serve --distributed-executor-backend ray` on the head, a `ray start` unit on every node."""
    heads = [u for u in serve if _flag(u, "--distributed-executor-backend") == "ray"]
    others = [u for u in serve if u not in heads]
    if others:
        raise TopologyError(
            f"{_name(others[0])} runs `vllm serve` without --distributed-executor-backend ray beside the Ray "
            f"head {_name(heads[0]) if heads else '?'}: in a Ray deployment only the head runs vLLM"
            if heads
            else f"{_name(others[0])}: `ray start` units given, but no node runs "
            "`vllm serve --distributed-executor-backend ray`"
        )
    if len(heads) > 1:
        raise TopologyError(
            f"{_name(heads[0])} and {_name(heads[1])} both run `vllm serve --distributed-executor-backend "
            "ray`: a Ray deployment has one vLLM, on the head"
        )
    head = heads[0]
    if _int(head, "--nnodes", 1) > 1:
        _vllm(
            head,
            "nnodes > 1 can only be set when distributed executor backend is mp, uni or external_launcher.",
            RAY_NNODES,
        )
    _refuse_lb_modes(head)
    head_ray: str | None = None
    workers: dict[str, NodeUnit] = {}
    for unit in units:
        if not unit.ray_worker:
            continue
        if unit.host == head.host:
            if head_ray is not None:
                raise TopologyError(f"{head.host} has two `ray start` units: {head_ray} and {unit.service}")
            head_ray = unit.service
        elif unit.host in workers:
            raise TopologyError(
                f"{unit.host} has two `ray start` units: {workers[unit.host].service} and {unit.service}"
            )
        else:
            workers[unit.host] = unit
    if not workers:
        raise TopologyError(
            f"{_name(head)}: not a multi-node deployment (Ray, but no `ray start` unit on another node)"
        )
    args = _args(head)
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    pcp = _int(head, "--prefill-context-parallel-size", 1)
    roles = [_role(head, 0, False, (), (), tp * pcp, tp * pp * pcp)]
    roles.extend(
        NodeRole(unit.host, unit.service, rank, True, (), (), 0, ray_worker=True)
        for rank, unit in enumerate(workers.values(), start=1)
    )
    return Topology(
        nodes=tuple(roles),
        backend="ray",
        nnodes=len(roles),
        world_size=dp * tp * pp * pcp,
        local_world_size=0,
        master_addr=None,
        master_port=None,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        data_parallel_size=dp,
        ray_head_service=head_ray,
        notes=(
            "Ray places the workers when vLLM starts (driver node first, then by Ray's node id: "
            "v1/executor/ray_utils.py get_bundles_sorted_by_node): which ranks each node holds is known "
            "from each node's GPU count (with_ray_gpus); node ranks after the head follow the units' order",
            "only the head's unit carries vLLM's flags: Ray's workers take the head's engine config",
        ),
    )


# --------------------------------------------------------------------------------------------------
# checks shared by the modes
# --------------------------------------------------------------------------------------------------


def _same_everywhere(serve: list[NodeUnit]) -> None:
    """The model, every engine flag but PER_NODE_FLAGS, and SAME_ENV: the same word on every node."""
    first = serve[0]
    for unit in serve[1:]:
        if _args(unit).model != _args(first).model:
            raise TopologyError(
                f"the nodes serve different models: {_name(first)} {_args(first).model!r}, "
                f"{_name(unit)} {_args(unit).model!r}; every node must run the same model"
            )
    names = sorted({name for unit in serve for name in _args(unit).flags if _must_match(name)})
    for name in names:
        values = [(_value(unit, name), unit) for unit in serve]
        base, base_unit = values[0]
        for value, unit in values[1:]:
            if value != base:
                why = (
                    "past the smaller value TP silently corrupts output and PP kills the engine"
                    if name == "--max-model-len"
                    else "a node with another value breaks the deployment"
                )
                raise TopologyError(
                    f"{name} differs between nodes: {_name(base_unit)} {_shown(base)}, {_name(unit)} "
                    f"{_shown(value)}; vLLM does not compare the nodes' flags ({why}), so every node must "
                    "give the same"
                )
    for key in SAME_ENV:
        values_env = {_name(u): _args(u).env.get(key) for u in serve}
        if len(set(values_env.values())) > 1:
            shown = ", ".join(f"{n} {v if v is not None else '(unset)'}" for n, v in values_env.items())
            raise TopologyError(f"{key} differs between nodes: {shown}; every node must set the same")


def _must_match(name: str) -> bool:
    if name in PER_NODE_FLAGS:
        return False
    known = vllm_flag(name)
    if known is None:
        return True  # a flag of an older vLLM, or one ctxmgr does not know: assume it builds the engine
    if known.config_class == "":
        return name in _ENGINE_WITHOUT_CLASS
    return known.config_class not in _NOT_ENGINE


def _value(unit: NodeUnit, name: str) -> object:
    """The flag's value as vLLM reads it where ServeArgs models it (`8k` == `8000`), else its word."""
    args = _args(unit)
    if name in _TYPED:
        return getattr(args, _TYPED[name]) if name in args.flags else None
    return args.flags.get(name)


def _shown(value: object) -> str:
    if value is None:
        return "leaves it to vLLM's default"
    if value is True:
        return "sets it"
    if value is False:
        return "turns it off"
    return f"gives {value}"


def _each_once(what: str, by: dict[int, list[NodeUnit]], count: int, flag_name: str) -> None:
    """Every value 0..count-1 held by exactly one node: a missing rank leaves the head waiting for ever
    (the recipe: DistStoreError after --distributed-timeout-seconds at best), a duplicate never joins."""
    for value, holders in sorted(by.items()):
        if len(holders) > 1:
            raise TopologyError(
                f"{what} {value} is given by more than one node: "
                + ", ".join(_name(u) for u in holders)
                + f" (check {flag_name})"
            )
    missing = [v for v in range(count) if v not in by]
    if missing:
        raise TopologyError(
            f"{what} {_ranges(missing)} missing: no node given runs it (expected {count}, 0..{count - 1}); "
            "the head would wait for it for ever"
        )
    extra = [v for v in by if not 0 <= v < count]
    if extra:
        raise TopologyError(f"{what} {_ranges(sorted(extra))} is outside 0..{count - 1} ({flag_name})")


def _each_rank_once(roles: list[NodeRole], world: int) -> None:
    owners: dict[int, str] = {}
    for role in roles:
        for rank in role.ranks:
            if rank in owners:
                raise TopologyError(f"worker rank {rank} would run on both {owners[rank]} and {role.host}")
            owners[rank] = role.host
    missing = [r for r in range(world) if r not in owners]
    if missing:
        raise TopologyError(f"worker rank(s) {_ranges(missing)} run on no node")


def _refuse_lb_modes(unit: NodeUnit) -> None:
    """Hybrid and external DP load balancing run an API server per node: not one head, not read here."""
    flags = _args(unit).flags
    for name in (
        "--data-parallel-hybrid-lb",
        "--data-parallel-external-lb",
        "--data-parallel-multi-port-external-lb",
    ):
        if flags.get(name) is True:
            raise TopologyError(
                f"{_name(unit)}: {name}: every node runs its own API server; ctxmgr reads deployments with "
                "one API server on the head (internal load balancing) only"
            )
    if "--data-parallel-rank" in flags:
        raise TopologyError(
            f"{_name(unit)}: --data-parallel-rank is vLLM's external load balancing (an API server per "
            "rank); ctxmgr reads deployments with one API server on the head only"
        )
    if _int_or_none(unit, "--data-parallel-start-rank") is not None and not _headless(unit):
        # arg_utils.py:2489: a start rank without --headless is hybrid load balancing
        raise TopologyError(
            f"{_name(unit)}: --data-parallel-start-rank without --headless is vLLM's hybrid load balancing "
            "(an API server per node); ctxmgr reads deployments with one API server on the head only"
        )


def _role(
    unit: NodeUnit,
    rank: int,
    headless: bool,
    ranks: tuple[int, ...],
    dp_ranks: tuple[int, ...],
    tp_pcp: int,
    world_within_dp: int,
) -> NodeRole:
    stages = tuple(sorted({(r % world_within_dp) // tp_pcp for r in ranks}))
    return NodeRole(
        host=unit.host,
        service=unit.service,
        node_rank=rank,
        headless=headless,
        ranks=ranks,
        stages=stages,
        local_world_size=len(ranks),
        data_parallel_ranks=dp_ranks,
        args=unit.args,
    )


def _dp_over_nodes(unit: NodeUnit) -> bool:
    args = _args(unit)
    local = _int_or_none(unit, "--data-parallel-size-local")
    return _headless(unit) or (local is not None and local < args.data_parallel_size)


def _world(unit: NodeUnit) -> int:
    args = _args(unit)
    pcp = _int(unit, "--prefill-context-parallel-size", 1)
    return args.data_parallel_size * args.pipeline_parallel_size * args.tensor_parallel_size * pcp


def _headless(unit: NodeUnit) -> bool:
    return _args(unit).flags.get("--headless") is True


def _args(unit: NodeUnit) -> ServeArgs:
    assert unit.args is not None
    return unit.args


def _flag(unit: NodeUnit, name: str) -> str | None:
    value = _args(unit).flags.get(name)
    return value if isinstance(value, str) else None


def _int_or_none(unit: NodeUnit, name: str) -> int | None:
    value = _flag(unit, name)
    if value is None:
        return None
    try:
        return human_readable_int(value)
    except UsageError:
        raise TopologyError(f"{_name(unit)}: {name} {value!r} is not a whole number") from None


def _int(unit: NodeUnit, name: str, default: int) -> int:
    value = _int_or_none(unit, name)
    return default if value is None else value


def _vllm(unit: NodeUnit, message: str, where: str) -> None:
    raise TopologyError(f"{_name(unit)}: vLLM refuses it: {message} (vLLM 0.33 {where})")


def _name(unit: NodeUnit) -> str:
    return f"{unit.host} {unit.service}"


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)
