"""A deployment over several nodes read from its units: ranks and stages per node, and every refusal."""

from __future__ import annotations

import shlex

import pytest

from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.core.topology import (
    NodeUnit,
    TopologyError,
    node_lines,
    node_of_rank,
    read_topology,
    with_ray_gpus,
    world_gpus,
)

MODEL = "/srv/models/GLM-5-FP8"
SERVICE = "vllm-glm5.service"
MASTER = "--master-addr 10.0.0.1 --master-port 29501"


def unit(host: str, command: str, env: dict[str, str] | None = None, service: str = SERVICE) -> NodeUnit:
    return NodeUnit(host, service, parse_serve_argv(shlex.split(f"{MODEL} {command}"), env))


def two_nodes(flags: str, head_extra: str = "", worker_extra: str = "") -> list[NodeUnit]:
    return [
        unit("gpu-a", f"{flags} --nnodes 2 --node-rank 0 {MASTER} {head_extra}"),
        unit("gpu-b", f"{flags} --nnodes 2 --node-rank 1 {MASTER} --headless {worker_extra}"),
    ]


def refusal(units: list[NodeUnit]) -> str:
    with pytest.raises(TopologyError) as caught:
        read_topology(units)
    return str(caught.value)


# ---------------------------------------------------------------------------------------------- good


def test_tp16_over_two_nodes_puts_ranks_0_7_on_the_head_and_8_15_on_the_headless_node() -> None:
    topology = read_topology(list(reversed(two_nodes("-tp 16 --max-model-len 8192"))))  # any order
    head, worker = topology.nodes
    assert (topology.backend, topology.nnodes, topology.world_size, topology.local_world_size) == (
        "mp",
        2,
        16,
        8,
    )
    assert (topology.master_addr, topology.master_port) == ("10.0.0.1", 29501)
    assert topology.head is head and topology.workers == (worker,)
    assert (head.host, head.node_rank, head.headless, head.ranks) == ("gpu-a", 0, False, tuple(range(8)))
    assert (worker.host, worker.node_rank, worker.headless, worker.ranks) == (
        "gpu-b",
        1,
        True,
        tuple(range(8, 16)),
    )
    assert head.stages == worker.stages == (0,)
    assert head.local_world_size == worker.local_world_size == 8
    assert topology.start_order() == ((head, worker),)
    assert node_of_rank(topology, 9) is worker and node_of_rank(topology, 0) is head
    with pytest.raises(TopologyError, match="no node holds rank 16"):
        node_of_rank(topology, 16)


def test_tp8_pp2_over_two_nodes_splits_the_stages_by_node() -> None:
    topology = read_topology(two_nodes("--tensor-parallel-size 8 --pipeline-parallel-size 2"))
    head, worker = topology.nodes
    assert head.stages == (0,) and worker.stages == (1,)
    assert worker.ranks == tuple(range(8, 16))
    assert topology.pipeline_parallel_size == 2 and topology.world_size_within_dp == 16


def test_the_same_value_written_two_ways_and_a_per_node_budget_are_accepted() -> None:
    # 8k is 8000 to vLLM's parser; --gpu-memory-utilization is each worker's own budget
    units = two_nodes("-tp 16", "--max-model-len 8k --gpu-memory-utilization 0.9",
                      "--max-model-len 8000 --gpu-memory-utilization 0.8 --download-dir /data")  # fmt: skip
    assert read_topology(units).nnodes == 2


def test_dp2_tp8_with_nnodes_gives_each_node_one_engine() -> None:
    topology = read_topology(two_nodes("-tp 8 -dp 2"))
    head, worker = topology.nodes
    assert head.data_parallel_ranks == (0,) and worker.data_parallel_ranks == (1,)
    assert worker.ranks == tuple(range(8, 16)) and worker.stages == (0,)
    assert topology.data_parallel_address == "10.0.0.1"


def test_dp2_tp4_pp2_over_four_nodes() -> None:
    units = [
        unit(f"n{k}", f"-tp 4 -pp 2 -dp 2 --nnodes 4 --node-rank {k} {MASTER}" + (" --headless" if k else ""))
        for k in range(4)
    ]
    topology = read_topology(units)
    assert [n.ranks[0] for n in topology.nodes] == [0, 4, 8, 12]
    assert [n.stages for n in topology.nodes] == [(0,), (1,), (0,), (1,)]
    assert [n.data_parallel_ranks for n in topology.nodes] == [(0,), (0,), (1,), (1,)]


def test_data_parallel_over_nodes_without_nnodes_as_the_recipe_runs_it() -> None:
    dp = "-dp 2 --data-parallel-size-local 1 --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345"
    units = [
        unit("node1", f"{dp} --headless --data-parallel-start-rank 1"),
        unit("node0", dp),
    ]
    topology = read_topology(units)
    assert [n.host for n in topology.nodes] == ["node0", "node1"]
    assert topology.head.headless is False and topology.workers[0].headless is True
    assert topology.workers[0].data_parallel_ranks == (1,) and topology.workers[0].ranks == (1,)
    assert (topology.data_parallel_address, topology.data_parallel_rpc_port) == ("10.0.0.1", 13345)
    assert topology.start_order() == (topology.nodes,)


def test_ray_has_one_vllm_on_the_head_and_ranks_known_from_gpu_counts() -> None:
    units = [
        NodeUnit("gpu-b", "ray-worker.service", None, ray_worker=True),
        unit("gpu-a", "-tp 8 -pp 2 --distributed-executor-backend ray"),
        NodeUnit("gpu-a", "ray-head.service", None, ray_worker=True),
    ]
    topology = read_topology(units)
    assert topology.backend == "ray" and topology.nnodes == 2 and topology.world_size == 16
    assert topology.head.service == SERVICE and topology.ray_head_service == "ray-head.service"
    assert topology.workers[0].ray_worker and topology.workers[0].ranks == ()
    assert topology.start_order() == ((topology.head,),)
    assert any("get_bundles_sorted_by_node" in note for note in topology.notes)
    with pytest.raises(TopologyError, match="not known yet"):
        world_gpus(topology, {"gpu-a": eight("a", 80), "gpu-b": eight("b", 80)})
    placed = with_ray_gpus(topology, {"gpu-a": 8, "gpu-b": 8})
    assert placed.head.ranks == tuple(range(8)) and placed.workers[0].ranks == tuple(range(8, 16))
    assert placed.workers[0].stages == (1,)
    with pytest.raises(TopologyError, match="has 12 GPUs, the deployment needs 16"):
        with_ray_gpus(topology, {"gpu-a": 8, "gpu-b": 4})


# ---------------------------------------------------------------------------------------------- refusals


def test_world_size_not_divisible_by_nnodes_is_vllms_refusal() -> None:
    units = [unit(f"n{k}", f"-tp 4 --nnodes 3 --node-rank {k} {MASTER}") for k in range(3)]
    message = refusal(units)
    assert "`--nnodes 3` must evenly divide the total world size (4)" in message
    assert "engine/arg_utils.py:2406" in message


def test_a_node_rank_out_of_range_is_vllms_refusal() -> None:
    units = two_nodes("-tp 16", worker_extra="--node-rank 2")
    assert "`--node-rank` must be between 0 and 1; got `--node-rank 2`" in refusal(units)


def test_nnodes_launch_refusals_of_one_node_and_a_data_parallel_split_vllm_refuses() -> None:
    """The rest of what _refuse_nnodes_launch and _nnodes_role refuse, which no other test reaches."""
    uni = refusal(two_nodes("-tp 16 --distributed-executor-backend uni"))
    assert "gpu-a vllm-glm5.service: --distributed-executor-backend uni with --nnodes" in uni
    api_servers = refusal(two_nodes("-tp 16", worker_extra="--api-server-count 2"))
    assert (
        "gpu-b vllm-glm5.service: vLLM refuses it: --api-server-count=2 cannot be used with --headless"
        in api_servers
    )
    local = refusal(two_nodes("-dp 3 -tp 2", head_extra="--data-parallel-size-local 2"))
    assert (
        "gpu-a vllm-glm5.service: --data-parallel-size-local 2 does not divide --data-parallel-size 3"
        in local
    )
    groups = refusal(two_nodes("-dp 4", head_extra="--data-parallel-size-local 1"))
    assert "nnodes (2) must be divisible by the number of data parallel node groups (4 = " in groups
    assert "config/parallel.py:827" in groups


def test_a_missing_and_a_duplicate_node_rank() -> None:
    units = [unit(f"n{k}", f"-tp 24 --nnodes 3 --node-rank {k} {MASTER}" + (" --headless" if k else ""))
             for k in range(2)]  # fmt: skip
    assert "node rank 2 missing" in refusal(units)
    duplicate = two_nodes("-tp 16", worker_extra="--node-rank 0")
    assert "node rank 0 is given by more than one node: gpu-a vllm-glm5.service, gpu-b" in refusal(duplicate)


def test_headless_rules() -> None:
    head, worker = two_nodes("-tp 16")
    not_headless = unit("gpu-b", f"-tp 16 --nnodes 2 --node-rank 1 {MASTER}")
    assert "node rank 1 lacks --headless" in refusal([head, not_headless])
    headless_head = unit("gpu-a", f"-tp 16 --nnodes 2 --node-rank 0 {MASTER} --headless")
    assert "node rank 0 runs --headless" in refusal([headless_head, worker])
    dp_worker = unit("gpu-b", f"-tp 8 -dp 2 --nnodes 2 --node-rank 1 {MASTER}")
    dp_head = unit("gpu-a", f"-tp 8 -dp 2 --nnodes 2 --node-rank 0 {MASTER}")
    message = refusal([dp_head, dp_worker])
    assert "Remote engine 1 must use --headless unless in external or hybrid dp lb mode" in message
    assert "v1/engine/utils.py" in message


def test_a_different_max_model_len_on_one_node_is_refused_naming_both_nodes() -> None:
    message = refusal(two_nodes("-tp 16", "--max-model-len 200000", "--max-model-len 8192"))
    assert message.startswith("--max-model-len differs between nodes: gpu-a vllm-glm5.service gives 200000")
    assert "gpu-b vllm-glm5.service gives 8192" in message
    missing = refusal(two_nodes("-tp 16", "--kv-cache-dtype fp8"))
    assert "--kv-cache-dtype differs" in missing and "leaves it to vLLM's default" in missing
    for flags in ("--block-size 32", "--max-num-seqs 64", "--max-num-batched-tokens 4096", "--enforce-eager"):
        assert refusal(two_nodes("-tp 16", flags)).startswith(f"{flags.split()[0]} differs between nodes")


def test_nodes_must_agree_on_nnodes_master_model_and_the_layer_partition() -> None:
    head, _ = two_nodes("-tp 16")
    three = unit("gpu-b", f"-tp 16 --nnodes 4 --node-rank 1 {MASTER} --headless")
    assert "--nnodes differs between nodes" in refusal([head, three])
    other_master = unit("gpu-b", "-tp 16 --nnodes 2 --node-rank 1 --master-addr 10.0.0.9 --headless")
    assert "--master-addr differs" in refusal([head, other_master])
    other_model = NodeUnit("gpu-b", SERVICE, parse_serve_argv(["/srv/other", *shlex.split(
        f"-tp 16 --nnodes 2 --node-rank 1 {MASTER} --headless")]))  # fmt: skip
    assert "the nodes serve different models" in refusal([head, other_model])
    split = unit("gpu-b", f"-tp 8 -pp 2 --nnodes 2 --node-rank 1 {MASTER} --headless",
                 {"VLLM_PP_LAYER_PARTITION": "40,38"})  # fmt: skip
    head_pp = unit("gpu-a", f"-tp 8 -pp 2 --nnodes 2 --node-rank 0 {MASTER}")
    assert "VLLM_PP_LAYER_PARTITION differs between nodes" in refusal([head_pp, split])
    no_master = [
        unit(f"n{k}", f"-tp 16 --nnodes 2 --node-rank {k}" + (" --headless" if k else "")) for k in (0, 1)
    ]
    assert "no node gives --master-addr" in refusal(no_master)


def test_ray_with_nnodes_and_nnodes_with_a_ray_dp_backend_are_vllms_refusals() -> None:
    units = [
        unit("gpu-a", "-tp 16 --distributed-executor-backend ray --nnodes 2"),
        NodeUnit("gpu-b", "ray.service", None, ray_worker=True),
    ]
    message = refusal(units)
    assert (
        "nnodes > 1 can only be set when distributed executor backend is mp, uni or external_launcher."
        in message
    )
    assert "config/parallel.py" in message
    dp_ray = refusal(two_nodes("-tp 16 --data-parallel-backend ray"))
    assert "`--nnodes 2` requires `--data-parallel-backend mp`; got `--data-parallel-backend ray`" in dp_ray
    alone = [unit("gpu-a", "-tp 8 --distributed-executor-backend ray")]
    assert "not a multi-node deployment" in refusal(alone)
    ray_b = NodeUnit("gpu-b", "ray.service", None, ray_worker=True)
    no_ray_head = [unit("gpu-a", "-tp 16"), ray_b]
    assert "no node runs `vllm serve --distributed-executor-backend ray`" in refusal(no_ray_head)
    second_vllm = [unit("gpu-a", "-tp 16 --distributed-executor-backend ray"), unit("gpu-b", "-tp 16"), ray_b]
    assert "in a Ray deployment only the head runs vLLM" in refusal(second_vllm)


def test_a_single_node_unit_list_is_not_a_multi_node_deployment() -> None:
    assert "not a multi-node deployment" in refusal([unit("gpu-a", "-tp 8 --max-model-len 8192")])
    assert "not a multi-node deployment" in refusal([unit("gpu-a", "-tp 8"), unit("gpu-b", "-tp 8")])
    with pytest.raises(TopologyError, match="no node units"):
        read_topology([])


def test_data_parallel_over_nodes_refusals() -> None:
    dp = "-dp 2 --data-parallel-size-local 1 --data-parallel-address 10.0.0.1"
    both_rank_0 = [unit("node0", dp), unit("node1", f"{dp} --headless")]
    assert "data parallel rank 0 is given by more than one node" in refusal(both_rank_0)
    hybrid = [unit("node0", dp), unit("node1", f"{dp} --data-parallel-start-rank 1")]
    assert "hybrid load balancing" in refusal(hybrid)
    no_address = [unit("node0", dp), unit("node1", "-dp 2 --data-parallel-size-local 1 --headless -dpr 1")]
    assert "without --data-parallel-address" in refusal(no_address)


# ---------------------------------------------------------------------------------------------- planning


def eight(name: str, total_gib: float) -> GpuState:
    total = int(total_gib * GIB)
    used = GIB // 2
    gpus = tuple(
        GpuInfo(i, f"NVIDIA {name}", total, total - used, used, compute_capability=(9, 0)) for i in range(8)
    )
    return GpuState(gpus, "nvml")


def glm5() -> ModelFacts:
    layer = LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576, indexer_head_dim=128)
    return ModelFacts(
        source=MODEL,
        source_format="hf",
        model_type="glm-dsa",
        architectures=("GlmMoeDsaForCausalLM",),
        num_attention_heads=64,
        layers=(layer,) * 78,
        dtype="bfloat16",
        hidden_size=6144,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        weight_bytes=16 * 40 * GIB,
        provenance={"weight_bytes": "config"},
    )


def test_the_plan_of_a_two_node_deployment_is_bounded_by_the_node_with_the_smaller_gpus() -> None:
    # TP 8 x PP 2: stage 1 lives on gpu-b. vLLM cuts every worker's KV blocks to the smallest worker's
    # (v1/core/kv_cache_planning.py:1583), so the smaller node decides the context for the whole model.
    batch = "--max-num-batched-tokens 8192 --max-num-seqs 256"
    topology = read_topology(two_nodes(f"-tp 8 -pp 2 --max-model-len 8192 {batch}"))
    args = topology.head.args
    assert args is not None
    options = PlanOptions(1_000_000, derived_max_model_len=1_000_000, derived_max_model_len_key="test")

    def plan(node_a_gib: float, node_b_gib: float) -> Plan:
        gpus = world_gpus(topology, {"gpu-a": eight("H200", node_a_gib), "gpu-b": eight("B", node_b_gib)})
        assert len(gpus.gpus) == 16
        return make_plan(glm5(), args, gpus, options)

    big, mixed, small = plan(139, 139), plan(139, 60), plan(60, 60)
    assert mixed.max_context < big.max_context
    assert mixed.max_context == small.max_context == plan(60, 139).max_context  # the minimum decides
    per_node = node_lines(topology, mixed)
    assert {line.pipeline_stage for line in per_node["gpu-a"]} == {0}
    assert {line.pipeline_stage for line in per_node["gpu-b"]} == {1}
    assert all(line.total.bytes == int(60 * GIB) for line in per_node["gpu-b"])
    smallest = min(mixed.gpus, key=lambda line: line.kv_budget.bytes or 0)
    assert smallest in per_node["gpu-b"]


def test_batch_defaults_that_would_differ_by_node_must_be_given() -> None:
    # vLLM takes --max-num-batched-tokens / --max-num-seqs defaults from each node's own GPU memory
    topology = read_topology(two_nodes("-tp 16"))
    with pytest.raises(TopologyError) as caught:
        world_gpus(topology, {"gpu-a": eight("H200", 139), "gpu-b": eight("L40S", 44)})
    message = str(caught.value)
    assert message.startswith("--max-num-batched-tokens is left to vLLM's default")
    assert "gpu-a 8192 (NVIDIA H200, 139.00 GiB), gpu-b 2048 (NVIDIA L40S, 44.00 GiB)" in message
    assert len(world_gpus(topology, {"gpu-a": eight("H200", 139), "gpu-b": eight("H100", 80)}).gpus) == 16


def test_world_gpus_follows_cuda_visible_devices_and_refuses_too_few_gpus() -> None:
    head = unit("gpu-a", f"-tp 4 --nnodes 2 --node-rank 0 {MASTER}", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    worker = unit("gpu-b", f"-tp 4 --nnodes 2 --node-rank 1 {MASTER} --headless")
    topology = read_topology([head, worker])
    gpus = world_gpus(topology, {"gpu-a": eight("A", 80), "gpu-b": eight("B", 72)})
    assert [g.index for g in gpus.gpus] == [4, 5, 0, 1]
    assert [g.name for g in gpus.gpus] == ["NVIDIA A", "NVIDIA A", "NVIDIA B", "NVIDIA B"]
    one = GpuState(eight("B", 72).gpus[:1], "nvml")
    with pytest.raises(TopologyError, match="gpu-b: its workers need 2 GPUs, it has 1"):
        world_gpus(topology, {"gpu-a": eight("A", 80), "gpu-b": one})
    with pytest.raises(TopologyError, match="gpu-b: no GPU state"):
        world_gpus(topology, {"gpu-a": eight("A", 80)})
