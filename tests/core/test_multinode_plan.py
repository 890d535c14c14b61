"""A multi-node deployment's plan calibrated from every node's own journal (issue 19).

TP 8 x PP 2 over two 8-GPU nodes: node 0 (the head) holds stage 0, node 1 (headless) stage 1. The head's
journal has only its own ranks' memory lines; node 1's ranks log theirs in node 1's journal. Here node 1
logged larger weights and a smaller KV budget than the head (the last stage holds the LM head; or its
GPUs differ): its GPU lines must take node 1's figures, and the verdict the smaller budget, as vLLM
sizes the KV cache by the smallest worker's (v1/core/kv_cache_planning.py get_kv_cache_configs).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.core.test_plan import TOTAL, glm5, gpu
from vllm_ctxmgr.change.planning import node_observations_from_json
from vllm_ctxmgr.core.budget import kv_budget_at_utilization
from vllm_ctxmgr.core.calibration import NodeObservation
from vllm_ctxmgr.core.hardware import GIB, GpuState
from vllm_ctxmgr.core.observations import Observation, ObservationRecord
from vllm_ctxmgr.core.plan import PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import UsageError

TARGET = 200_000
ARGS = ServeArgs(
    "/srv/models/GLM-5-Q4_K_M.gguf", tensor_parallel_size=8, pipeline_parallel_size=2, max_model_len=8192
)
WORLD = GpuState(tuple(gpu(i) for i in range(16)), "given")
NODE1_RANKS = tuple(range(8, 16))

HEAD = Observation(
    vllm_version="0.33.0",
    platform="GPU",
    max_model_len=8192,
    gpu_memory_utilization=0.9,
    model_loading_gib=25.42,
    available_kv_gib=53.3,
    cuda_graph_gib=1.37,
    ready=True,
)
# node 1's ranks: 60 GiB of weights each, so 5 GiB of KV budget at the same utilisation
NODE1 = Observation(
    vllm_version="0.33.0",
    max_model_len=8192,
    gpu_memory_utilization=0.9,
    model_loading_gib=60.0,
    available_kv_gib=5.0,
    cuda_graph_gib=1.5,
)


def options(**kw: object) -> PlanOptions:
    return PlanOptions(TARGET, derived_max_model_len=202_752, whole_deployment=True, **kw)  # type: ignore[arg-type]


def plan(nodes: tuple[NodeObservation, ...] = (), **kw: object):  # type: ignore[no-untyped-def]
    return make_plan(glm5(16 * 25 * GIB), ARGS, WORLD, options(**kw), [HEAD], nodes)


def test_each_stage_takes_its_own_nodes_figures_and_the_smaller_budget_decides() -> None:
    node1 = (NodeObservation("node 1", NODE1_RANKS, NODE1),)
    head_only = plan()
    both = plan(node1)
    # without node 1's start every line is the head's: it fits
    assert head_only.feasible, head_only.reason
    assert {line.weights.source for line in head_only.gpus} == {"vllm log"}
    assert head_only.gpus[8].weights.bytes == int(25.42 * GIB)
    # with it, stage 1's lines are node 1's: its weights, CUDA graphs and KV budget
    head_line, node1_line = both.gpus[0], both.gpus[8]
    assert [line.pipeline_stage for line in (head_line, node1_line)] == [0, 1]
    assert head_line.weights.bytes == int(25.42 * GIB) and head_line.weights.source == "vllm log"
    assert node1_line.weights.bytes == int(60.0 * GIB)
    assert node1_line.weights.source == "vllm log (node 1)"
    assert node1_line.cuda_graphs.bytes == int(1.5 * GIB)
    assert node1_line.kv_budget.source == "vllm log (node 1)" == node1_line.non_kv.source
    u = both.gpu_memory_utilization
    assert u is not None
    assert node1_line.kv_budget.bytes == kv_budget_at_utilization(
        int(5.0 * GIB), math.ceil(TOTAL * 0.9), TOTAL, u
    )
    assert head_line.kv_budget.bytes == kv_budget_at_utilization(
        int(53.3 * GIB), math.ceil(TOTAL * 0.9), TOTAL, u
    )
    # vLLM's engine holds a request only where every worker's budget does: node 1's does not, below the
    # cap; the longest context that fits is node 1's
    assert not both.feasible and "does not fit" in both.reason
    assert both.max_context < head_only.max_context
    assert any(note.startswith("node 1: KV budget") for note in both.notes)
    assert both.to_json() != head_only.to_json()


def test_the_pool_is_the_smallest_workers_blocks_per_stage() -> None:
    """At a context both fit, the engine's pool (capacity) is node 1's smaller budget in blocks."""
    node1 = (NodeObservation("node 1", NODE1_RANKS, replace(NODE1, available_kv_gib=20.0)),)
    both, head_only = plan(node1, fixed_gpu_memory_utilization=0.9), plan(fixed_gpu_memory_utilization=0.9)
    assert both.feasible and head_only.feasible
    budgets = [both.gpus[0].kv_budget.bytes, both.gpus[8].kv_budget.bytes]
    assert budgets == [int(53.3 * GIB), int(20.0 * GIB)]
    assert both.capacity[0].num_gpu_blocks == both.layout.num_gpu_blocks(budgets)
    assert both.capacity[0].num_gpu_blocks < head_only.capacity[0].num_gpu_blocks


def test_the_heads_metrics_pool_is_the_smallest_workers_not_the_heads_own_budget() -> None:
    """/metrics' num_gpu_blocks on the head is the engine's pool, cut to node 1's budget: with node 1's own
    lines known, the head's lines take the head's logged budget and node 1's still decides."""
    node1 = (NodeObservation("node 1", NODE1_RANKS, replace(NODE1, available_kv_gib=20.0)),)
    pooled = replace(HEAD, num_gpu_blocks=3_000)
    fixed = {"fixed_gpu_memory_utilization": 0.9}
    alone = make_plan(glm5(16 * 25 * GIB), ARGS, WORLD, options(**fixed), [pooled])
    both = make_plan(glm5(16 * 25 * GIB), ARGS, WORLD, options(**fixed), [pooled], node1)
    assert alone.gpus[0].kv_budget.source == "vllm metrics (num_gpu_blocks)"
    assert both.gpus[0].kv_budget.source == "vllm log"
    assert both.gpus[0].kv_budget.bytes == int(53.3 * GIB)
    assert both.capacity[0].num_gpu_blocks == int(20.0 * GIB) // both.layout.bytes_per_block


def test_a_nodes_start_on_another_gpu_model_or_vllm_is_not_used() -> None:
    head_only = plan()
    for other in (replace(NODE1, gpu_name="NVIDIA A100-SXM4-80GB"), replace(NODE1, vllm_version="0.31.0")):
        made = plan((NodeObservation("node 1", NODE1_RANKS, other),))
        assert made.gpus[8].weights.source == "vllm log"
        assert any(note.startswith("node 1: ignored 1 earlier start") for note in made.notes)
        assert [line.to_json() for line in made.gpus] == [line.to_json() for line in head_only.gpus]


def record(**kw: object) -> dict:
    return {k: v for k, v in ObservationRecord(replace(NODE1, **kw)).to_json().items() if v is not None}  # type: ignore[arg-type]


def test_node_observations_pass_the_import_door() -> None:
    ok = node_observations_from_json([{"node": "node 1", "ranks": list(NODE1_RANKS), "record": record()}], 16)
    assert ok == (NodeObservation("node 1", NODE1_RANKS, NODE1),)
    failed = [{"node": "node 1", "ranks": [8], "record": record(failure="kv_cache_too_small")}]
    assert node_observations_from_json(failed, 16) == ()  # a failed start's figures are not its budget
    assert node_observations_from_json(None, 16) == ()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"node": "node 1"}, "not a list"),
        ([{"node": "node 1", "ranks": [16], "record": record()}], "below the world size 16"),
        ([{"node": "node 1", "ranks": [True], "record": record()}], "below the world size"),
        ([{"node": "rm -rf", "ranks": [8], "record": record()}], "node is not"),
        ([{"node": "node 1", "ranks": [8], "record": "x"}], "record is not"),
        ([{"node": "node 1", "ranks": [8], "record": record(available_kv_gib=1e308)}], "above 4,096"),
        ([{"node": "node 1", "ranks": [8], "record": {"available_kv_gib": -1.0}}], "is negative"),
        ([{"node": "node 1", "ranks": [8], "record": {"gpu_memory_utilization": 3.0}}], "not in \\(0, 1\\]"),
    ],
)
def test_a_bad_node_observation_is_refused_in_one_line(data: object, message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        node_observations_from_json(data, 16)
    assert "\n" not in str(caught.value)
