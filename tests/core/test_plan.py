"""The planner on hand-built facts and GPU states: utilisation, verdicts, observations, alternatives."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from tests.support.paths import DATA
from vllm_ctxmgr.core.budget import default_gpu_memory_utilization, kv_budget_at_utilization, margin_bytes
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuProcess, GpuState, platform_for
from vllm_ctxmgr.core.kv.layout import kv_cache_layout
from vllm_ctxmgr.core.kv.specs import cdiv
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.plan_record import PLAN_SCHEMA, StoredPlan
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.errors import CtxmgrError, UsageError
from vllm_ctxmgr.report import plan_text

TOTAL = int(95.6 * GIB)
DRIVER_RESERVED = GIB // 2
WEIGHTS_PER_GPU = 51 * GIB
DERIVED = 202_752
TARGET = 200_000

ALWAYS = ("max_model_len", "gpu_memory_utilization", "feasible", "max_context", "kv_bytes_per_gpu")


def glm5(weight_bytes: int | None = 8 * WEIGHTS_PER_GPU) -> ModelFacts:
    layer = LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576, indexer_head_dim=128)
    return ModelFacts(
        source="/srv/models/GLM-5-Q4_K_M.gguf",
        source_format="gguf",
        model_type="glm-dsa",
        architectures=("GlmMoeDsaForCausalLM",),
        num_attention_heads=64,
        layers=(layer,) * 78,
        dtype="bfloat16",
        hidden_size=6144,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        weight_bytes=weight_bytes,
        provenance={"weight_bytes": "gguf"} if weight_bytes else {},
    )


def gpu(index: int, used: int = DRIVER_RESERVED, processes: tuple[GpuProcess, ...] = ()) -> GpuInfo:
    return GpuInfo(
        index, "NVIDIA H100 NVL", TOTAL, TOTAL - used, used, compute_capability=(9, 0), processes=processes
    )


def eight_gpus(**overrides: GpuInfo) -> GpuState:
    gpus = [overrides.get(f"gpu{i}", gpu(i)) for i in range(8)]
    return GpuState(tuple(gpus), "nvml")


SERVICE = ServeArgs("/srv/models/GLM-5-Q4_K_M.gguf", tensor_parallel_size=8, max_model_len=8192)


def options(target: int = TARGET, **kw: object) -> PlanOptions:
    return PlanOptions(
        target,
        derived_max_model_len=DERIVED,
        derived_max_model_len_key="max_position_embeddings",
        **kw,  # type: ignore[arg-type]
    )


def plan_json(plan: Plan) -> dict:
    data = json.loads(json.dumps(plan.to_json()))  # must be plain JSON
    assert all(key in data for key in (*ALWAYS, "kv_bytes_per_token_per_gpu"))
    return data


# --- GLM-5 at 200k on 8 x 95.6 GiB ----------------------------------------------------------------


def test_glm5_200k_fits_with_the_smallest_utilisation() -> None:
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options())
    assert plan.feasible, plan.reason
    assert plan.kv_bytes_per_gpu == 20_030_400_000  # 18.65 GiB, not the seed's 2.09 GiB
    assert round(plan.kv_bytes_per_gpu / GIB, 2) == 18.65
    assert plan.kv_bytes_per_token_per_gpu == 100_152
    u = plan.gpu_memory_utilization
    assert u is not None and 0.5 < u <= 0.95
    line = plan.gpus[0]
    assert line.kv_needed.bytes == 20_030_400_000 + 6_409_728  # + the null block
    # the KV budget at u holds the need plus the margin; at u - 0.01 it does not
    non_kv = line.non_kv.bytes
    assert non_kv is not None
    assert line.kv_budget.bytes == math.ceil(TOTAL * u) - non_kv
    assert line.kv_budget.bytes >= line.kv_needed.bytes + line.margin.bytes
    assert math.ceil(TOTAL * (u - 0.01)) - non_kv < line.kv_needed.bytes + line.margin.bytes
    assert plan.flag_changes == {"--max-model-len": "200000", "--gpu-memory-utilization": f"{u:.2f}"}
    assert plan.env_changes == {}
    assert plan.max_context == DERIVED  # the derived maximum fits too
    data = plan_json(plan)
    assert data["layout"]["block_size"] == 64 and data["layout"]["bytes_per_block"] == 6_409_728


def test_glm5_figures_carry_their_sources() -> None:
    line = make_plan(glm5(), SERVICE, eight_gpus(), options()).gpus[3]
    assert (line.total.source, line.used_by_others.source) == ("nvml", "nvml")
    assert line.weights == type(line.weights)(WEIGHTS_PER_GPU, "gguf")
    # core/memory.py's terms say which vLLM code they mirror: "estimate (_dummy_run of 8192 tokens)"
    assert line.activation_peak.source.startswith("estimate")
    assert line.cuda_graphs.source.startswith("estimate")
    # 2% of 95.6 GiB (above the 512 MiB floor), widened by the spread of each estimated term
    # (core/memory.py: activation 25%, non-torch 50%, CUDA graphs 50%)
    widening = (
        int(line.activation_peak.bytes * 0.25)
        + int(line.non_torch.bytes * 0.5)
        + int(line.cuda_graphs.bytes * 0.5)
    )
    assert line.margin.bytes == int(TOTAL * 0.02) + widening


def test_a_co_tenant_makes_it_infeasible_and_max_context_shrinks() -> None:
    base = make_plan(glm5(), SERVICE, eight_gpus(), options())
    tenant = make_plan(glm5(), SERVICE, eight_gpus(gpu3=gpu(3, used=30 * GIB)), options())
    bigger = make_plan(glm5(), SERVICE, eight_gpus(gpu3=gpu(3, used=34 * GIB)), options())
    assert not tenant.feasible and "free memory allows" in tenant.reason
    assert tenant.flag_changes == {}
    assert 0 < bigger.max_context < tenant.max_context < TARGET < base.max_context
    # max_context is vLLM's own estimate for the budget at the utilisation the busy GPU still allows
    u = tenant.gpu_memory_utilization
    assert u == tenant.gpus[3].max_gpu_memory_utilization
    layout = kv_cache_layout(glm5(), SERVICE, platform_for(eight_gpus()))
    budget = min(line.kv_budget.bytes - line.margin.bytes for line in tenant.gpus)  # type: ignore[operator]
    assert tenant.max_context == layout.max_model_len_for(budget, DERIVED)


def test_the_services_own_memory_is_not_used_by_others() -> None:
    running = gpu(2, used=80 * GIB, processes=(GpuProcess(4242, "vllm serve", int(79.5 * GIB)),))
    counted = make_plan(glm5(), SERVICE, eight_gpus(gpu2=running), options())
    freed = make_plan(glm5(), SERVICE, eight_gpus(gpu2=running), options(service_pids=(4242,)))
    assert not counted.feasible
    assert freed.feasible
    assert freed.gpus[2].used_by_others.bytes == int(0.5 * GIB)
    assert "service excluded" in freed.gpus[2].used_by_others.source


def test_pipeline_stages_map_to_gpus_and_the_largest_stage_binds() -> None:
    layer = LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576)
    ds3 = ModelFacts(
        "deepseek-v3",
        "hf",
        "deepseek_v3",
        ("DeepseekV3ForCausalLM",),
        128,
        (layer,) * 61,
        "bfloat16",
        qk_nope_head_dim=128,
        weight_bytes=8 * 60 * GIB,
    )
    args = ServeArgs("ds3", tensor_parallel_size=2, pipeline_parallel_size=4)
    plan = make_plan(ds3, args, eight_gpus(), PlanOptions(131_072, derived_max_model_len=163_840))
    assert plan.feasible
    assert [line.pipeline_stage for line in plan.gpus] == [0, 0, 1, 1, 2, 2, 3, 3]
    needed = [line.kv_needed.bytes for line in plan.gpus]
    assert needed[4] == max(needed) > needed[0]  # stage 2 holds 16 of the 61 layers
    assert plan.kv_bytes_per_gpu == 8192 * 16 * 16 * 1152  # 131,072 tokens / block 16 x stage 2's layers


def test_too_few_gpus_for_the_parallel_layout() -> None:
    with pytest.raises(UsageError, match="needs 8 GPUs"):
        make_plan(glm5(), SERVICE, GpuState(eight_gpus().gpus[:4], "nvml"), options())


# --- Target validation and the derived maximum -----------------------------------------------------


@pytest.mark.parametrize("target", [0, -5])
def test_non_positive_target_is_a_usage_error(target: int) -> None:
    with pytest.raises(UsageError, match="must be a positive number of tokens"):
        make_plan(glm5(), SERVICE, eight_gpus(), options(target))


def test_target_above_the_derived_maximum_is_refused() -> None:
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(300_000))
    assert not plan.feasible
    assert "derived maximum (max_position_embeddings=202752)" in plan.reason
    assert plan.flag_changes == {} and plan.env_changes == {}
    assert plan.max_context == DERIVED
    names = [alt.name for alt in plan.alternatives]
    assert names[0] == "shorter-context" and "allow-long" in names
    allow = next(alt for alt in plan.alternatives if alt.name == "allow-long")
    assert allow.env_changes == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert allow.flag_changes["--max-model-len"] == "300000"
    assert plan_json(plan)["feasible"] is False


def test_derived_maximum_comes_from_the_facts_when_not_given() -> None:
    facts = replace(glm5(), position_limits=(("max_position_embeddings", DERIVED),))
    plan = make_plan(facts, SERVICE, eight_gpus(), PlanOptions(300_000))
    assert not plan.feasible
    assert (plan.derived_max_model_len, plan.derived_max_model_len_key) == (
        DERIVED,
        "max_position_embeddings",
    )
    assert make_plan(facts, SERVICE, eight_gpus(), PlanOptions(TARGET)).feasible


def test_allow_long_adds_the_env_and_a_rope_warning() -> None:
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(210_000, allow_long=True))
    assert plan.feasible, plan.reason
    assert plan.env_changes == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert any("RoPE" in warning for warning in plan.warnings)
    assert plan.flag_changes["--max-model-len"] == "210000"


# --- Observations ------------------------------------------------------------------------------------

OBSERVED = Observation(
    vllm_version="0.33.0",
    platform="GPU",
    max_model_len=8192,
    gpu_memory_utilization=0.9,
    model_loading_gib=52.3,
    available_kv_gib=24.5,
    cuda_graph_gib=0.8,
    kv_cache_tokens=999_999_999,  # never read as a capacity
    ready=True,
)


def test_observed_start_replaces_the_estimates() -> None:
    estimated = make_plan(glm5(), SERVICE, eight_gpus(), options())
    observed = make_plan(glm5(), SERVICE, eight_gpus(), options(), [OBSERVED])
    assert observed.feasible
    line = observed.gpus[0]
    assert line.weights.bytes == int(52.3 * GIB) and line.weights.source == "vllm log"
    assert line.cuda_graphs.source == "vllm log" and line.non_kv.source == "vllm log"
    u = observed.gpu_memory_utilization
    assert u is not None
    assert line.kv_budget.bytes == int(24.5 * GIB) + math.ceil(TOTAL * u) - math.ceil(TOTAL * 0.9)
    assert u != estimated.gpu_memory_utilization
    assert any("earlier start" in note for note in observed.notes)
    # the "KV cache size: N tokens" figure is concurrency x max_model_len, never a capacity
    without_tokens = make_plan(
        glm5(), SERVICE, eight_gpus(), options(), [replace(OBSERVED, kv_cache_tokens=None)]
    )
    assert without_tokens.to_json() == observed.to_json()


def test_margin_and_budget_at_utilisation_are_the_planners_rules() -> None:
    """verify.py calls these: the margin it checks is the one the plan kept, the budget the plan's shift."""
    assert margin_bytes(TOTAL) == int(TOTAL * 0.02)  # 1.91 GiB on 95.6 GiB
    assert margin_bytes(16 * GIB) == 512 * 2**20  # 2% would be 0.32 GiB: the 512 MiB floor
    observed = make_plan(glm5(), SERVICE, eight_gpus(), options(), [OBSERVED])
    line, u = observed.gpus[0], observed.gpu_memory_utilization
    assert u is not None and line.margin.bytes == margin_bytes(TOTAL)
    at_u = kv_budget_at_utilization(int(24.5 * GIB), math.ceil(TOTAL * 0.9), TOTAL, u)
    assert line.kv_budget.bytes == at_u
    assert kv_budget_at_utilization(at_u, math.ceil(TOTAL * u), TOTAL, 0.9) == int(24.5 * GIB)


def test_the_stored_plan_has_a_schema_and_typed_accessors() -> None:
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(), [OBSERVED])
    record = plan_json(plan)
    assert record["schema"] == PLAN_SCHEMA == 2
    stored = StoredPlan.from_json(record)
    u = plan.gpu_memory_utilization
    assert u is not None
    assert (stored.max_model_len, stored.gpu_memory_utilization) == (TARGET, u)
    assert stored.bytes_per_block == plan.layout.bytes_per_block == 6_409_728
    assert stored.block_size == plan.layout.block_size == 64
    assert stored.min_kv_budget_bytes() == min(line.kv_budget.bytes or 0 for line in plan.gpus)
    # at the utilisation the unit really runs with, the budget moves by the planner's rule
    assert stored.min_kv_budget_bytes(0.95) == kv_budget_at_utilization(
        int(24.5 * GIB), math.ceil(TOTAL * 0.9), TOTAL, 0.95
    )
    assert stored.margins == [line.margin.bytes for line in plan.gpus]
    assert StoredPlan.figure(stored.gpus[0], "kv_needed") == plan.gpus[0].kv_needed.bytes
    # a plan stored before the schema field reads the same; a newer schema is refused, not guessed at
    legacy = {k: v for k, v in record.items() if k != "schema"}
    assert StoredPlan.from_json(legacy).bytes_per_block == stored.bytes_per_block
    assert StoredPlan.from_json({**record, "schema": 1}).bytes_per_block == stored.bytes_per_block
    with pytest.raises(CtxmgrError, match="schema 3"):
        StoredPlan.from_json({**record, "schema": 3})
    assert StoredPlan.from_json(None).min_kv_budget_bytes() is None


def test_observation_of_another_version_is_ignored() -> None:
    other = Observation(vllm_version="0.11.0", gpu_memory_utilization=0.9, available_kv_gib=1.0)
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(), [other])
    assert plan.gpus[0].weights.source == "gguf"
    assert any("another vLLM version" in note for note in plan.notes)


def test_observation_of_another_gpu_model_is_ignored() -> None:
    same = replace(OBSERVED, gpu_name="NVIDIA H100 NVL")
    other = replace(OBSERVED, gpu_name="NVIDIA A100-SXM4-80GB")
    assert make_plan(glm5(), SERVICE, eight_gpus(), options(), [same]).gpus[0].kv_budget.source == "vllm log"
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(), [other])
    assert plan.gpus[0].kv_budget.source == "estimate"
    assert any("another vLLM version or device" in note for note in plan.notes)


def test_failed_start_estimate_bounds_max_context() -> None:
    failed = Observation(
        vllm_version="0.33.0",
        max_model_len=TARGET,
        gpu_memory_utilization=0.8,
        estimated_max_model_len=150_000,
        failure="kv_cache_too_small",
    )
    same = make_plan(glm5(), SERVICE, eight_gpus(), options(max_gpu_memory_utilization=0.8), [failed])
    assert not same.feasible
    layout = kv_cache_layout(glm5(), SERVICE, platform_for(eight_gpus()))
    logged_budget = layout.bytes_needed(150_000) + layout.bytes_per_block  # the failed check's lower bound
    margin = same.gpus[0].margin.bytes
    assert margin
    assert same.max_context == layout.max_model_len_for(logged_budget - margin, DERIVED) < 150_000
    no_margin = options(max_gpu_memory_utilization=0.8, margin_fraction=0.0, margin_min_bytes=0)
    assert make_plan(glm5(), SERVICE, eight_gpus(), no_margin, [failed]).max_context == 150_000
    assert "vllm log (estimated maximum model length 150000)" in same.gpus[0].kv_budget.source
    higher = make_plan(glm5(), SERVICE, eight_gpus(), options(), [failed])
    assert higher.feasible and higher.gpu_memory_utilization is not None
    assert higher.gpu_memory_utilization > 0.8


# --- Unknown weights, old versions, explicit budgets ------------------------------------------------


def test_unknown_weights_keep_kv_exact_and_say_so() -> None:
    plan = make_plan(glm5(weight_bytes=None), SERVICE, eight_gpus(), options())
    assert plan.kv_bytes_per_gpu == 20_030_400_000
    # no utilisation can be chosen without the weights: the plan is at the one the unit would run with
    # (vLLM's default here), never the cap set-context would not write (issue 35)
    default = default_gpu_memory_utilization(plan.vllm_version)
    assert plan.verdict.startswith(
        f"weights unknown: fits at vLLM's default gpu_memory_utilization {default:.2f} if the weights take "
        "at most"
    )
    assert plan.gpus[0].weights.bytes is None and plan.gpus[0].weights.source == "unknown"
    assert plan.gpu_memory_utilization == default and plan.least_gpu_memory_utilization is None
    assert "--gpu-memory-utilization" not in plan.flag_changes
    # said once, in the headline (the plan is `unknown`), not again as a warning
    assert plan.result == "unknown" and plan.reason.startswith("weights unknown: fits")


def test_unknown_weights_beside_a_co_tenant_are_planned_at_what_the_free_memory_allows() -> None:
    """Where the unit's utilisation would fail vLLM's free-memory check, the weights-unknown plan is at
    the most the GPUs allow, and that is the utilisation its flags (and set-context) write."""
    plan = make_plan(glm5(weight_bytes=None), SERVICE, eight_gpus(gpu3=gpu(3, used=30 * GIB)), options())
    assert plan.result == "unknown" and plan.least_gpu_memory_utilization is None
    u = plan.gpu_memory_utilization
    assert u is not None and u < default_gpu_memory_utilization(plan.vllm_version)
    assert plan.verdict.startswith(
        f"weights unknown: fits at the most the free memory allows, gpu_memory_utilization {u:.2f} if"
    )
    assert plan.flag_changes["--gpu-memory-utilization"] == f"{u:.2f}"


def test_weights_option_overrides_the_files() -> None:
    plan = make_plan(glm5(weight_bytes=None), SERVICE, eight_gpus(), options(weights_bytes=8 * 40 * GIB))
    assert plan.gpus[0].weights == type(plan.gpus[0].weights)(40 * GIB, "option")
    assert plan.verdict == "fits"


def test_before_0_20_cuda_graphs_live_in_the_slack() -> None:
    assert default_gpu_memory_utilization((0, 11, 0)) == 0.9
    assert default_gpu_memory_utilization((0, 33, 0)) == 0.92
    new = make_plan(glm5(), SERVICE, eight_gpus(), options())
    old = make_plan(glm5(), SERVICE, eight_gpus(), options(vllm_version=(0, 11, 0)))
    graphs = new.gpus[0].cuda_graphs.bytes
    assert graphs
    assert old.gpus[0].non_kv.bytes == new.gpus[0].non_kv.bytes - graphs  # type: ignore[operator]
    assert old.gpus[0].max_gpu_memory_utilization < new.gpus[0].max_gpu_memory_utilization


def test_explicit_kv_cache_memory_bytes_is_an_exact_budget() -> None:
    args = ServeArgs(
        SERVICE.model, tensor_parallel_size=8, max_model_len=8192, kv_cache_memory_bytes=10 * GIB
    )
    plan = make_plan(glm5(), args, eight_gpus(), options())
    assert plan.feasible
    needed = 20_030_400_000 + 6_409_728
    new_budget = int(plan.flag_changes["--kv-cache-memory-bytes"])
    assert new_budget == math.ceil(needed / 2**20) * 2**20
    assert plan.gpus[0].kv_budget == type(plan.gpus[0].kv_budget)(new_budget, "--kv-cache-memory-bytes")
    assert "--gpu-memory-utilization" not in plan.flag_changes


def test_no_gpu_information_still_gives_exact_kv_figures() -> None:
    plan = make_plan(glm5(), SERVICE, None, options())
    assert plan.feasible and plan.verdict.startswith("no memory information")
    assert plan.kv_bytes_per_gpu == 20_030_400_000 and plan.gpus == ()
    assert plan_json(plan)["gpus"] == []


def test_cpu_kv_space_budget_reproduces_vllms_estimate() -> None:
    """fail_b2_kv_too_small_kvspace.log: fat-kv at 16384 with VLLM_CPU_KVCACHE_SPACE=1 -> estimate 3968."""
    fat = ModelFacts(
        "fat-kv",
        "hf",
        "llama",
        ("LlamaForCausalLM",),
        16,
        (LayerFacts(LayerKind.FULL, 16, 256),) * 8,
        "float32",
    )
    args = ServeArgs("fat-kv", dtype="float32", max_model_len=16384, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    plan = make_plan(fat, args, None, PlanOptions(16384, derived_max_model_len=16384, cpu=True))
    assert not plan.feasible and plan.max_context == 3968
    raised = next(alt for alt in plan.alternatives if alt.name == "kv-cache-memory-bytes")
    assert raised.feasible and raised.env_changes == {"VLLM_CPU_KVCACHE_SPACE": "5"}  # 4 GiB + one block
    assert plan.alternatives[0].name == "kv-cache-memory-bytes"


# --- Alternatives -------------------------------------------------------------------------------------


def test_infeasible_alternatives_are_ranked_and_carry_their_numbers() -> None:
    plan = make_plan(glm5(), SERVICE, eight_gpus(gpu3=gpu(3, used=30 * GIB)), options())
    alternatives = {alt.name: alt for alt in plan.alternatives}
    assert [alt.rank for alt in plan.alternatives] == list(range(1, len(plan.alternatives) + 1))
    assert alternatives["fp8-kv-cache"].kv_bytes_per_token_per_gpu == 61_464
    assert alternatives["fp8-kv-cache"].kv_cache_dtype == "fp8_ds_mla"
    assert alternatives["fp8-kv-cache"].flag_changes["--kv-cache-dtype"] == "fp8"
    dcp = alternatives["decode-context-parallel"]
    assert dcp.kv_bytes_per_token_per_gpu == 7_683 and dcp.feasible
    assert dcp.flag_changes["--decode-context-parallel-size"] == "8"
    assert alternatives["shorter-context"].flag_changes["--max-model-len"] == str(plan.max_context)
    assert alternatives["tensor-parallel"].needs_gpus == 8
    # feasible ones first, those on the GPUs the service has before those that need more
    feasible = [alt.feasible for alt in plan.alternatives]
    assert feasible == sorted(feasible, reverse=True)
    assert plan.alternatives[0].name == "decode-context-parallel"
    assert plan.alternatives[0].needs_gpus == 0
    assert plan_json(plan)["alternatives"][0]["rank"] == 1


def test_sliding_window_models_get_the_batch_token_alternative() -> None:
    layers = tuple(
        LayerFacts(LayerKind.FULL, 16, 128)
        if i % 6 == 5
        else LayerFacts(LayerKind.SLIDING, 16, 128, window=1024)
        for i in range(62)
    )
    gemma = ModelFacts(
        "gemma-3-27b",
        "safetensors",
        "gemma3",
        ("Gemma3ForConditionalGeneration",),
        32,
        layers,
        "bfloat16",
        hidden_size=5376,
        weight_bytes=54 * GIB,
    )
    h100 = GpuState(
        (GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GIB, 80 * GIB, 0, compute_capability=(9, 0)),), "nvml"
    )
    args = ServeArgs("gemma", max_model_len=32768)
    tight = make_plan(
        gemma, args, h100, PlanOptions(131_072, derived_max_model_len=131_072, max_gpu_memory_utilization=0.9)
    )
    assert not tight.feasible
    small = next(alt for alt in tight.alternatives if alt.name == "max-num-batched-tokens")
    assert small.flag_changes["--max-num-batched-tokens"] == "2048"
    assert small.kv_bytes_per_gpu < tight.kv_bytes_per_gpu  # 10,118 blocks instead of 14,726
    assert small.max_context > tight.max_context


def test_parse_vllm_version() -> None:
    assert parse_vllm_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_vllm_version("v0.11") == (0, 11, 0)
    assert parse_vllm_version(None) is None


# --- What vLLM will report, sizing for N requests, explicit budgets (issue 10) -----------------------

VLLM_CPU_LOGS = DATA / "vllm-cpu"
CAPACITY_LINE = re.compile(
    r"CPU (KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ tokens per request: [\d.]+x)"
)


def tiny_llama() -> ModelFacts:
    """tests/data/vllm-cpu/README.md: tiny-llama, 2 layers, 4 heads, 2 KV heads, head_dim 32, fp32."""
    layer = LayerFacts(LayerKind.FULL, num_kv_heads=2, head_size=32)
    return ModelFacts("tiny-llama", "hf", "llama", ("LlamaForCausalLM",), 4, (layer,) * 2, "float32")


@pytest.mark.parametrize(
    ("journal", "args"),
    [
        # --max-model-len 1024 --kv-cache-memory-bytes 1179648 (9 blocks): "1,152 tokens ... 1.12x"
        (
            "vllm-ok-bytes",
            ServeArgs("tiny", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1179648),
        ),
        # --max-model-len 1024, VLLM_CPU_KVCACHE_SPACE=1: "1,048,576 tokens ... 1024.00x"
        (
            "vllm-ok",
            ServeArgs("tiny", dtype="float32", max_model_len=1024, env={"VLLM_CPU_KVCACHE_SPACE": "1"}),
        ),
    ],
)
def test_the_plan_reports_vllms_capacity_line_of_a_real_start(journal: str, args: ServeArgs) -> None:
    text = (VLLM_CPU_LOGS / f"{journal}.journal").read_text()
    logged = CAPACITY_LINE.search(text)
    assert logged is not None
    assert "'max_model_len': 1024" in text
    plan = make_plan(tiny_llama(), args, None, PlanOptions(1024, derived_max_model_len=2048, cpu=True))
    assert plan.feasible and len(plan.capacity) == 1
    tokens, concurrency = re.search(r"([\d,]+) tokens.*: ([\d.]+)x", logged.group(1)).groups()  # type: ignore[union-attr]
    record = plan_json(plan)
    assert record["kv_cache_tokens"] == int(tokens.replace(",", ""))
    assert f"{record['max_concurrency']:.2f}" == concurrency
    assert record["capacity"][0]["kv_cache_tokens"] == record["kv_cache_tokens"]
    assert f"vLLM will report: {logged.group(1)}" in plan_text(plan)


def test_capacity_is_per_engine_and_vllms_two_decimals() -> None:
    args = replace(SERVICE, data_parallel_size=2)
    gpus = GpuState(tuple(gpu(i) for i in range(16)), "nvml")
    plan = make_plan(glm5(), args, gpus, options())
    assert [c.gpus for c in plan.capacity] == [tuple(range(8)), tuple(range(8, 16))]
    engine = plan.capacity[0]
    budget = min(line.kv_budget.bytes or 0 for line in plan.gpus[:8])
    assert engine.num_gpu_blocks == budget // 6_409_728
    exact = engine.num_gpu_blocks / 3125  # blocks one request of 200k takes
    assert engine.max_concurrency == round(exact, 2) and engine.kv_cache_tokens == int(exact * TARGET)
    assert plan_json(plan)["max_concurrency"] == engine.max_concurrency
    # one request plus the margin (and the 0.01 step of the utilisation), not room for a second
    assert plan.max_concurrency is not None and 1 <= plan.max_concurrency < 1.5


def test_concurrency_sizes_the_kv_need_for_n_full_requests() -> None:
    one = make_plan(glm5(), SERVICE, eight_gpus(), options(100_000))
    three = make_plan(glm5(), SERVICE, eight_gpus(), options(100_000, concurrency=3))
    assert plan_json(three)["concurrency"] == 3 and plan_json(one)["concurrency"] == 1
    blocks = cdiv(100_000, 64)  # 1563 blocks of 6,409,728 B per request
    assert three.gpus[0].kv_needed.bytes == (3 * blocks + 1) * 6_409_728  # + the null block
    assert three.kv_bytes_per_gpu == one.kv_bytes_per_gpu == blocks * 6_409_728  # per request, as before
    assert three.feasible, three.reason
    assert (three.gpu_memory_utilization or 0) > (one.gpu_memory_utilization or 1)
    assert three.max_concurrency is not None and three.max_concurrency >= 3
    assert "3 requests at once" in three.reason
    # the longest context of which three fit at once is shorter than the longest single one
    assert three.max_context < one.max_context
    with pytest.raises(UsageError, match="concurrency"):
        make_plan(glm5(), SERVICE, eight_gpus(), options(concurrency=0))


def test_kv_cache_memory_bytes_wins_over_free_memory_for_max_context() -> None:
    """vLLM sizes the KV cache by --kv-cache-memory-bytes, whatever else the GPUs have free."""
    args = replace(SERVICE, kv_cache_memory_bytes=10 * GIB)
    offline = make_plan(glm5(), args, eight_gpus(), options())
    no_gpus = make_plan(glm5(), args, None, options())
    layout = kv_cache_layout(glm5(), args, platform_for(eight_gpus()))
    assert offline.max_context == no_gpus.max_context == layout.max_model_len_for(10 * GIB, DERIVED)
    assert offline.max_context < TARGET  # 10 GiB holds ~107k tokens, not the target the GPUs could


@pytest.mark.parametrize(
    "figures",
    [
        {"available_kv_gib": 9999.0},  # a client's text echoed to the log (issue 29, item 1)
        {"model_loading_gib": 96.0},
        {"cuda_graph_gib": 100.0},
        {"model_loading_gib": 60.0, "available_kv_gib": 40.0},  # each fits, together they do not
    ],
)
def test_a_start_whose_figures_exceed_its_gpu_is_ignored(figures: dict[str, float]) -> None:
    estimated = make_plan(glm5(), SERVICE, eight_gpus(), options())
    impossible = replace(OBSERVED, **figures)
    plan = make_plan(glm5(), SERVICE, eight_gpus(), options(), [impossible])
    assert plan.to_json() | {"notes": []} == estimated.to_json() | {"notes": []}
    assert any("exceed the 95.60 GiB of the GPU" in note for note in plan.notes)
    # the real start before it still counts
    both = make_plan(glm5(), SERVICE, eight_gpus(), options(), [OBSERVED, impossible])
    assert both.gpus[0].kv_budget.source == "vllm log"
