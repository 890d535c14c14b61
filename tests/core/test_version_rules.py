"""Each version rule that changes an answer: one real config, two releases either side, two answers.

The configs are examples/models/*; the figures are recomputed by hand in the comments from the
formulas the cited vLLM code uses (core/vllm_versions.py carries the citations). GiB = 2**30.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.core.budget import cuda_graphs_in_budget, default_gpu_memory_utilization
from vllm_ctxmgr.core.facts import ModelFacts
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, Platform
from vllm_ctxmgr.core.kv.layout import kv_cache_layout
from vllm_ctxmgr.core.plan import PlanOptions, make_plan, supports_auto_max_model_len
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, RULES, rule, rule_row
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.report import plan_text

MODELS = REPO / "examples" / "models"
H200 = Platform("cuda", (9, 0), "NVIDIA H200", 140 * GIB)  # 8192 batched tokens
A100 = Platform("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", 80 * GIB)
B200 = Platform("cuda", (10, 0), "NVIDIA B200", 179 * GIB)


def model(name: str) -> ModelFacts:
    return load_model_facts(str(MODELS / name))


def layout(name: str, version: tuple[int, int, int], platform: Platform = H200, **args: object):
    return kv_cache_layout(model(name), ServeArgs(name, **args), platform, version)  # type: ignore[arg-type]


# --- the data -------------------------------------------------------------------------------------


def test_every_rule_row_cites_a_versioned_source_and_rows_ascend() -> None:
    for row in RULES:
        assert "@0." in row.cites and "vllm/" in row.cites, row
    for name in {row.name for row in RULES}:
        sinces = [row.since for row in RULES if row.name == name]
        assert sinces == sorted(sinces) and len(set(sinces)) == len(sinces), name


def test_rule_picks_the_row_in_force() -> None:
    assert rule("fit_check_null_block", (0, 28, 0)) is False
    assert rule("fit_check_null_block", (0, 29, 0)) is True
    assert rule_row("pp_fit_check", (0, 16, 0)).since == (0, 14, 0)
    assert rule("pp_fit_check", (0, 9, 0)) == "per_worker"  # older than all: the oldest row


# --- the startup check ----------------------------------------------------------------------------


def test_null_block_held_back_only_from_0_29() -> None:
    # Llama-3.1-70B TP4, bf16, block 16: 80 layers x 2 KV heads x 128 x 2 (K,V) x 2 B = 81,920 B/token,
    # bytes_per_block = 81,920 x 16 = 1,310,720; 131,072 tokens = 8192 blocks = 10 GiB exactly.
    old = layout("llama-3.1-70b", (0, 28, 0), tensor_parallel_size=4)
    new = layout("llama-3.1-70b", (0, 29, 0), tensor_parallel_size=4)
    assert old.bytes_per_block == new.bytes_per_block == 1_310_720
    assert old.fits(131_072, 10 * GIB)  # 10 GiB <= 10 GiB
    assert not new.fits(131_072, 10 * GIB)  # 10 GiB > 10 GiB - 1.25 MiB
    assert old.max_model_len_for(10 * GIB, 131_072) == 131_072
    assert new.max_model_len_for(10 * GIB, 131_072) == 8191 * 16 == 131_056


def test_pp_check_whole_model_against_smallest_budget_in_0_14_to_0_16() -> None:
    # Llama-3.1-70B TP4 PP2: 40 layers per stage, 5 GiB per stage for 131,072 tokens; whole model 10 GiB.
    budgets = [8 * GIB, 8 * GIB]
    args = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}
    assert layout("llama-3.1-70b", (0, 13, 0), **args).fits(131_072, budgets)  # 5 <= 8 per worker
    whole = layout("llama-3.1-70b", (0, 15, 0), **args)
    assert whole.check_needed_bytes(131_072) == 10 * GIB
    assert not whole.fits(131_072, budgets)  # "(10.0 GiB KV cache is needed ... (8.0 GiB)"
    assert layout("llama-3.1-70b", (0, 17, 0), **args).fits(131_072, budgets)


GEMMA_L = 131_072


def test_needed_bytes_per_layer_sum_then_first_group_then_all_groups() -> None:
    # Gemma-3-27B TP1 bf16: 16 KV heads x 128 x 2 x 2 B = 8192 B/token/layer, page 131,072 B (block 16).
    # 52 sliding (window 1024) + 10 full layers; in flight 8192 tokens before 0.26:
    # sliding blocks = cdiv(1023 + 8192, 16) + 1 = 577, full blocks = 8192.
    per_layer = layout("gemma-3-27b", (0, 13, 0))
    # 0.13: sum over layers = 131072 x (10 x 8192 + 52 x 577) = 14,670,102,528 (no padding layers)
    assert per_layer.check_needed_bytes(GEMMA_L) == 131_072 * (10 * 8192 + 52 * 577) == 14_670_102_528
    # 0.14-0.18: group size 10 (52 >= 1.5 x 10), 1 full + 6 sliding groups; the first group is sliding
    # (layer 0 is): 10 x 131072 x 577 = 756,285,440 -- an undercount the plan warns about
    first = layout("gemma-3-27b", (0, 18, 1))
    assert first.check_needed_bytes(GEMMA_L) == 10 * 131_072 * 577 == 756_285_440
    assert first.check_undercounts(GEMMA_L)
    # 0.19: every group: 10 x 131072 x (8192 + 6 x 577) = 15,275,130,880
    every = layout("gemma-3-27b", (0, 19, 0))
    assert every.check_needed_bytes(GEMMA_L) == 10 * 131_072 * (8192 + 6 * 577) == 15_275_130_880
    assert not every.check_undercounts(GEMMA_L)


def test_plan_warns_when_the_check_undercounts() -> None:
    gpus = GpuState(
        (GpuInfo(0, "NVIDIA H200", 140 * GIB, 139 * GIB, GIB, compute_capability=(9, 0)),), "given"
    )
    args = ServeArgs("gemma", max_model_len=8192)
    old = make_plan(model("gemma-3-27b"), args, gpus, PlanOptions(GEMMA_L, vllm_version=(0, 18, 1)))
    new = make_plan(model("gemma-3-27b"), args, gpus, PlanOptions(GEMMA_L, vllm_version=(0, 19, 0)))
    assert any("startup check counts 756,285,440 B" in w for w in old.warnings)
    assert not any("startup check counts" in w for w in new.warnings)
    assert old.gpus[0].kv_needed.bytes == 756_285_440  # no null block before 0.29
    assert new.gpus[0].kv_needed.bytes == 15_275_130_880


def test_auto_max_model_len_from_0_14() -> None:
    assert not supports_auto_max_model_len((0, 13, 0))
    assert supports_auto_max_model_len((0, 14, 0))
    args = ServeArgs("llama", tensor_parallel_size=4, max_model_len=-1)
    facts = model("llama-3.1-70b")
    old = make_plan(facts, args, None, PlanOptions(8192, vllm_version=(0, 13, 0)))
    new = make_plan(facts, args, None, PlanOptions(8192, vllm_version=(0, 14, 0)))
    assert "this vLLM version has no --max-model-len auto" in old.warnings
    assert "this vLLM version has no --max-model-len auto" not in new.warnings


# --- tokens in flight and batch defaults ----------------------------------------------------------


def test_sliding_window_in_flight_doubles_from_0_26() -> None:
    # Gemma-3-27B, window 1024, 8192 batched tokens, H200 PP1 (async: 2 batches from 0.26):
    # 0.25.1: cdiv(1023 + 8192, 16) + 1 = 577; 0.26.0: cdiv(1023 + 16384, 16) + 1 = 1089 blocks.
    old, new = layout("gemma-3-27b", (0, 25, 1)), layout("gemma-3-27b", (0, 26, 0))
    assert (old.max_in_flight_tokens, new.max_in_flight_tokens) == (8192, 16_384)
    assert old.group_blocks(GEMMA_L)[:2] == (577, 577) and new.group_blocks(GEMMA_L)[:2] == (1089, 1089)


def test_v2_runner_default_for_moe_models_from_0_29() -> None:
    # gpt-oss-120b is MoE: V1 runner by default up to 0.28 (PP2: 2 batches), V2 from 0.29 (pp + 1 = 3)
    args = {"pipeline_parallel_size": 2}
    assert layout("gpt-oss-120b", (0, 28, 0), **args).max_in_flight_tokens == 2 * 8192
    assert layout("gpt-oss-120b", (0, 29, 0), **args).max_in_flight_tokens == 3 * 8192
    # Gemma-3 is dense: V2 already from 0.22 (in flight counts from 0.26)
    assert layout("gemma-3-27b", (0, 26, 0), **args).max_in_flight_tokens == 3 * 8192


def test_b200_batch_tier_from_0_28() -> None:
    # get_batch_defaults: >= 160 GiB -> 16384 from 0.28; 8192 before (>= 70 GiB, not A100)
    assert layout("gpt-oss-120b", (0, 27, 1), B200).max_num_batched_tokens == 8192
    assert layout("gpt-oss-120b", (0, 28, 0), B200).max_num_batched_tokens == 16_384


# --- hybrid mamba models ------------------------------------------------------------------------


def test_qwen3_next_prefix_caching_default_from_0_28() -> None:
    # Qwen3-Next-80B TP4 A100, 262,144 tokens: attention block 272 (mamba page alignment),
    # 12 full layers -> cdiv(262144, 272) = 964 blocks; 3 linear groups: 1 page each ('none', 0.27.1)
    # or 2 each ('align', 0.28.0).
    old = layout("qwen3-next-80b-a3b", (0, 27, 1), A100, tensor_parallel_size=4)
    new = layout("qwen3-next-80b-a3b", (0, 28, 0), A100, tensor_parallel_size=4)
    assert (old.mamba_cache_mode, new.mamba_cache_mode) == ("none", "align")
    assert old.block_size == new.block_size == 272
    assert old.blocks_needed(262_144) == 964 + 3 * 1
    assert new.blocks_needed(262_144) == 964 + 3 * 2


def test_gdn_prefill_checkpoint_page_only_in_0_33() -> None:
    # On SM90 the FlashInfer GDN prefill keeps one checkpoint page per linear group in 0.33.0 only.
    old = layout("qwen3-next-80b-a3b", (0, 32, 0), H200, tensor_parallel_size=4)
    new = layout("qwen3-next-80b-a3b", (0, 33, 0), H200, tensor_parallel_size=4)
    linear_old = [b for g, b in zip(old.groups, old.group_blocks(8192), strict=True) if g.kind == "mamba"]
    linear_new = [b for g, b in zip(new.groups, new.group_blocks(8192), strict=True) if g.kind == "mamba"]
    assert set(linear_old) == {2} and set(linear_new) == {3}


# --- backends, block sizes, dtypes ----------------------------------------------------------------


def test_dense_mla_block_size_on_hopper_before_and_from_0_18() -> None:
    # DeepSeek-V3 TP8 bf16: 61 layers x 576 x 2 B = 70,272 B/token on every GPU.
    # 0.17.1 FlashMLA forced 64: cdiv(100001, 64) = 1563 blocks -> 100,032 tokens -> 7,029,448,704 B
    # 0.18.0 FLASH_ATTN_MLA 16: cdiv(100001, 16) = 6251 blocks -> 100,016 tokens -> 7,028,324,352 B
    old = layout("deepseek-v3", (0, 17, 1), tensor_parallel_size=8)
    new = layout("deepseek-v3", (0, 18, 0), tensor_parallel_size=8)
    assert (old.attention_backend, old.block_size) == ("FLASHMLA", 64)
    assert (new.attention_backend, new.block_size) == ("FLASH_ATTN_MLA", 16)
    assert old.bytes_needed(100_001) == 1563 * 64 * 70_272 == 7_029_448_704
    assert new.bytes_needed(100_001) == 6251 * 16 * 70_272 == 7_028_324_352
    # 0.11.0 forced 64 even over --block-size 16; 0.18 keeps the user's value
    assert layout("deepseek-v3", (0, 11, 0), tensor_parallel_size=8, block_size=16).block_size == 64
    assert layout("deepseek-v3", (0, 18, 0), tensor_parallel_size=8, block_size=16).block_size == 16


def test_dense_mla_on_blackwell_per_version() -> None:
    # DeepSeek-V3 has qk_nope_head_dim 128: CUTLASS 128 (0.10.1-0.14), FlashInfer MLA 64 (0.15-0.17),
    # FlashInfer MLA's preferred 32 (0.18+); 0.10.0 had no Blackwell rule (Triton MLA, 16).
    blocks = {
        v: layout("deepseek-v3", v, B200, tensor_parallel_size=8).block_size
        for v in ((0, 10, 0), (0, 14, 1), (0, 15, 0), (0, 18, 0))
    }
    assert blocks == {(0, 10, 0): 16, (0, 14, 1): 128, (0, 15, 0): 64, (0, 18, 0): 32}


def test_kv_cache_dtypes_each_version_accepts() -> None:
    with pytest.raises(UsageError, match=r"0\.10\.0 has no --kv-cache-dtype bfloat16"):
        layout("llama-3.1-70b", (0, 10, 0), tensor_parallel_size=4, kv_cache_dtype="bfloat16")
    assert layout("llama-3.1-70b", (0, 11, 0), tensor_parallel_size=4, kv_cache_dtype="bfloat16")
    with pytest.raises(UsageError, match=r"0\.11\.0 has no --kv-cache-dtype fp8_ds_mla"):
        layout("deepseek-v3", (0, 11, 0), tensor_parallel_size=8, kv_cache_dtype="fp8_ds_mla")
    assert layout("deepseek-v3", (0, 11, 1), tensor_parallel_size=8, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(UsageError, match=r"0\.17\.1 has no --kv-cache-dtype float16"):
        layout("llama-3.1-70b", (0, 17, 1), tensor_parallel_size=4, kv_cache_dtype="float16")


def test_deepseek_v32_auto_becomes_fp8_ds_mla_only_in_0_11_0() -> None:
    # GLM-5's real config relabelled DeepSeek-V3.2 (same MLA + DSA indexer layers)
    facts = replace(model("glm-5"), model_type="deepseek_v32", architectures=("DeepseekV32ForCausalLM",))
    args = ServeArgs("dsv32", tensor_parallel_size=8)
    assert kv_cache_layout(facts, args, H200, (0, 11, 0)).kv_cache_dtype == "fp8_ds_mla"
    assert kv_cache_layout(facts, args, H200, (0, 11, 1)).kv_cache_dtype == "auto"


# --- the KV budget --------------------------------------------------------------------------------


def test_default_utilisation_and_cuda_graphs_switch_at_0_20() -> None:
    assert default_gpu_memory_utilization((0, 19, 1)) == 0.9
    assert default_gpu_memory_utilization((0, 20, 0)) == 0.92
    plain = ServeArgs("m")
    opt_in = ServeArgs("m", env={"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"})
    opt_out = ServeArgs("m", env={"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"})
    assert not cuda_graphs_in_budget((0, 17, 1), opt_in)  # no estimate before 0.18
    assert not cuda_graphs_in_budget((0, 19, 1), plain) and cuda_graphs_in_budget((0, 19, 1), opt_in)
    assert cuda_graphs_in_budget((0, 20, 0), plain) and not cuda_graphs_in_budget((0, 20, 0), opt_out)


def test_the_sampler_pass_follows_each_versions_kernel_choice() -> None:
    """gpt-oss-120b on one H100 at 1,024 sequences (201,088-word vocabulary), FlashInfer installed:
    0.11 samples with FlashInfer (14 B per logit: 2.69 GiB), 0.15 needs the opt-in and sorts in
    PyTorch (38 B with the sort's buffers and index input: 7.29 GiB), 0.17 masks in place with Triton
    (14 B), 0.21 uses FlashInfer again. Each pass stands on the MoE workspace vLLM keeps (rule
    moe_workspace_persistent): 1,024 tokens x top 4 x (max(2880, 2880) + max(2 x 2880, 2880)) x 2 B."""
    facts = model("gpt-oss-120b")
    h100 = Platform("cuda", (9, 0), "NVIDIA H100 80GB HBM3", 80 * GIB)
    gpus = GpuState(
        (GpuInfo(0, h100.device_name, 80 * GIB, 80 * GIB, 0, compute_capability=(9, 0)),), "given"
    )
    args = ServeArgs("openai/gpt-oss-120b", max_num_batched_tokens=1024, flashinfer_installed=True)
    peaks = {}
    for version in ((0, 11, 0), (0, 15, 0), (0, 17, 0), (0, 21, 0)):
        options = PlanOptions(target_context=8192, vllm_version=version, weights_bytes=int(64.38 * GIB))
        peak = make_plan(facts, args, gpus, options).gpus[0].activation_peak
        peaks[version] = (peak.bytes, "FlashInfer" in peak.source)
    logits = 1024 * 201088
    kept = 1024 * 4 * (2880 + 2 * 2880) * 2
    assert peaks[(0, 11, 0)] == (logits * 14 + kept, True)
    assert peaks[(0, 15, 0)] == (logits * 38 + kept, False)
    assert peaks[(0, 17, 0)] == (logits * 14 + kept, False)
    assert peaks[(0, 21, 0)] == (logits * 14 + kept, True)
    opted_in = replace(args, env={"VLLM_USE_FLASHINFER_SAMPLER": "1"})
    options = PlanOptions(target_context=8192, vllm_version=(0, 15, 0), weights_bytes=int(64.38 * GIB))
    assert "FlashInfer" in make_plan(facts, opted_in, gpus, options).gpus[0].activation_peak.source


def test_nccl_counts_inside_the_budget_before_0_11() -> None:
    """0.10's Worker.init_device took the memory snapshot before init_worker_distributed_environment,
    so NCCL's communicators grew the profiled non-torch memory; from 0.11 they precede the snapshot."""
    facts = model("llama-3.1-70b")
    gpus = GpuState(
        tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GIB, 80 * GIB, 0) for i in range(4)), "given"
    )
    args = ServeArgs("meta-llama/Llama-3.1-70B-Instruct", tensor_parallel_size=4, gpu_memory_utilization=0.9)
    lines = {}
    for version in ((0, 10, 2), (0, 11, 0)):
        options = PlanOptions(target_context=8192, vllm_version=version, fixed_gpu_memory_utilization=0.9)
        lines[version] = make_plan(facts, args, gpus, options).gpus[0]
    old, new = lines[(0, 10, 2)], lines[(0, 11, 0)]
    moved = (old.non_torch.bytes or 0) - (new.non_torch.bytes or 0)
    assert moved == 512 << 20 and "NCCL" in old.non_torch.source
    assert (new.startup_overhead.bytes or 0) - (old.startup_overhead.bytes or 0) == moved
    assert (new.kv_budget.bytes or 0) - (old.kv_budget.bytes or 0) == moved


# --- what vLLM logs -------------------------------------------------------------------------------


def test_capacity_line_figure_changed_in_0_20_1() -> None:
    # gpt-oss-120b TP1: 18 sliding (window 128) + 18 full, 8 KV heads x 64 x 2 x 2 B = 2048 B/token,
    # page 32,768 B; 2 groups of 18: bytes_per_block = 18 x 32768 = 589,824. 10 GiB -> 18,204 blocks.
    # 0.20.0: 18204 // 2 groups x 16 = 145,632 tokens.
    # 0.20.1: int(18204 / (8192 full + cdiv(127 + 8192, 16) + 1 = 521 sliding) x 131072) = 273,847.
    old, new = layout("gpt-oss-120b", (0, 20, 0)), layout("gpt-oss-120b", (0, 20, 1))
    assert old.num_gpu_blocks(10 * GIB) == new.num_gpu_blocks(10 * GIB) == 18_204
    assert old.capacity_tokens(10 * GIB, 131_072) == 18_204 // 2 * 16 == 145_632
    assert new.capacity_tokens(10 * GIB, 131_072) == int(18_204 / (8192 + 521) * 131_072) == 273_847


# --- versions outside the table, and what the plan says -------------------------------------------


@pytest.mark.parametrize(("asked", "nearest"), [((0, 9, 2), (0, 10, 0)), ((0, 40, 0), NEWEST_VLLM)])
def test_unknown_versions_are_planned_by_the_nearest_with_a_warning(
    asked: tuple[int, int, int], nearest: tuple[int, int, int]
) -> None:
    facts, args = model("gemma-3-27b"), ServeArgs("gemma")
    plan = make_plan(facts, args, None, PlanOptions(GEMMA_L, vllm_version=asked))
    same = make_plan(facts, args, None, PlanOptions(GEMMA_L, vllm_version=nearest))
    word = "older than the oldest" if asked < nearest else "newer than the newest"
    assert any(
        word in w and f"planned by vLLM {'.'.join(map(str, nearest))}'s rules" in w for w in plan.warnings
    )
    assert not any("ctxmgr knows" in w for w in same.warnings)
    assert plan.kv_bytes_per_gpu == same.kv_bytes_per_gpu
    assert plan.layout.group_blocks(GEMMA_L) == same.layout.group_blocks(GEMMA_L)


def test_plan_json_and_text_name_the_rules_used() -> None:
    facts, args = model("gemma-3-27b"), ServeArgs("gemma")
    old = make_plan(facts, args, None, PlanOptions(GEMMA_L, vllm_version=(0, 25, 1)))
    new = make_plan(facts, args, None, PlanOptions(GEMMA_L))
    rules = {r["rule"]: r for r in json.loads(json.dumps(old.to_json()))["vllm_rules"]}
    assert rules["sliding_window_in_flight"] == {
        "rule": "sliding_window_in_flight",
        "since": "0.10.0",
        "value": "max_num_batched_tokens",
    }
    assert rules["fit_check_null_block"]["value"] is False
    assert "budget_non_kv_formula" not in rules  # informational rows change no figure
    assert "vLLM 0.25.1 rules, unlike 0.33.0: fit_check_null_block=False (since 0.10.0)" in plan_text(old)
    assert "vLLM 0.33.0 rules: as 0.33.0 (newest known)" in plan_text(new)


def test_docs_table_matches_the_rules() -> None:
    text = (REPO / "docs" / "vllm-accounting.md").read_text()
    section = text.split("## What changed between versions", 1)[1]
    for row in RULES:
        assert f"| {row.name} | {'.'.join(map(str, row.since))} |" in section, row
