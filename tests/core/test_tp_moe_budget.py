"""Issue 35 §2: the uncalibrated KV budget of the two classes the public logs show it missing — TP >= 2
(NCCL's buffers) and MoE models (the experts' workspace under the profile run) — against real starts.

The starts are tests/data/public-logs' (README there names each source): Qwen3-Next-80B-A3B on two
H200s (TP 2, NVLink, MoE), Qwen3-235B-A22B-FP8 on eight L40S (TP 8 over PCIe, expert parallel, MoE) and
gpt-oss-120b on four A100s over Ray (TP 4, MoE). The two 0.10.2 starts log vLLM's own per-rank
breakdown ("X GiB for peak activation, Y GiB for non-torch memory"), so each term is checked as well as
the budget. Printed figures are benchmarks/calibration_logs.py's.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.core.hardware import GIB, Platform
from vllm_ctxmgr.core.memory import moe_workspace_bytes, moe_workspace_width, non_kv_memory, nvlink_peers
from vllm_ctxmgr.model_files.load import load_model_facts

PUBLIC = REPO / "tests" / "data" / "public-logs"
BREAKDOWN = re.compile(
    r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB for non-torch"
)
CLASS_STARTS = (
    "Qwen3-Next-80B 2xH200 TP2 0.10.2",
    "Qwen3-235B-A22B-FP8 8xL40S TP8 EP 0.10.2",
    "gpt-oss-120b 4xA100 TP4 0.10.1 (dennislee22)",
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "calibration_logs", REPO / "benchmarks" / "calibration_logs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibration_logs"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(bench: ModuleType) -> dict:
    return {case.name: bench.run_case(case) for case in bench.cases() if case.name in CLASS_STARTS}


def _logged_breakdown(log: str) -> tuple[float, float, float]:
    text = (PUBLIC / log).read_text(encoding="utf-8")
    match = BREAKDOWN.search(text)
    assert match is not None
    weights, peak, non_torch = (float(g) for g in match.groups())
    return weights, peak, non_torch


@pytest.mark.parametrize("name", CLASS_STARTS)
def test_the_uncalibrated_budget_of_tp_and_moe_starts_is_within_5_percent_and_never_above(
    bench: ModuleType, rows: dict, name: str
) -> None:
    """Before this model Qwen3-Next was +4.2% and gpt-oss +1.3%: above what vLLM gave, the direction a
    tight plan fails in. Now each is below vLLM's budget and within 5% of it."""
    row = rows[name]
    predicted = bench._budget(row.uncal)
    assert predicted is not None and row.logged_budget
    error = (predicted - row.logged_budget) / row.logged_budget
    assert -0.05 <= error <= 0.0, f"{name}: {error:+.2%}"


@pytest.mark.parametrize(
    ("name", "log"),
    [
        ("Qwen3-Next-80B 2xH200 TP2 0.10.2", "qwen3-next-80b-2xh200-0.10.2.log"),
        ("Qwen3-235B-A22B-FP8 8xL40S TP8 EP 0.10.2", "qwen3-235b-a22b-fp8-8xl40s-0.10.2.log"),
    ],
)
def test_each_term_against_vllms_own_breakdown(rows: dict, name: str, log: str) -> None:
    """The activation peak within 5% of the logged one (it is the PyTorch sort of the sampler pass:
    before, 30 B a logit missed Qwen3-Next's 5.58 GiB by 22%); the non-torch estimate at or above the
    logged figure (NCCL over NVLink: 1.38 GiB logged, 0.75 GiB estimated before), and over PCIe not
    more than 0.25 GiB above it."""
    _weights, peak, non_torch = _logged_breakdown(log)
    gpu = rows[name].uncal.gpus[0]
    estimated_peak = (gpu.activation_peak.bytes or 0) / GIB
    estimated_non_torch = (gpu.non_torch.bytes or 0) / GIB
    assert abs(estimated_peak - peak) / peak < 0.05, (estimated_peak, peak)
    assert estimated_non_torch >= non_torch, (estimated_non_torch, non_torch)
    if "L40S" in name:
        assert estimated_non_torch - non_torch < 0.25
        assert "over PCIe" in (gpu.non_torch.source or "")
    else:
        assert "over NVLink" in (gpu.non_torch.source or "")


def test_the_new_start_calibrates_to_its_own_pool(rows: dict) -> None:
    """The L40S start's own lines (its ranks' prefixes carry _EP) make its pool: 10.65 GiB (logged to
    0.01 GiB) at 48,128 B/token/GPU, 238,208 tokens logged."""
    row = rows["Qwen3-235B-A22B-FP8 8xL40S TP8 EP 0.10.2"]
    assert row.logged_tokens == 238208
    assert row.cal.kv_cache_tokens is not None
    assert abs(row.cal.kv_cache_tokens - 238208) / 238208 < 0.01


def test_nvlink_or_pcie_from_the_boards_name() -> None:
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA B200", ""):
        assert nvlink_peers(Platform("cuda", (9, 0), name)), name
    for name in ("NVIDIA L40S", "NVIDIA L4", "NVIDIA A100 80GB PCIe", "NVIDIA GeForce RTX 4090",
                 "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA A10", "Tesla T4"):  # fmt: skip
        assert not nvlink_peers(Platform("cuda", (8, 9), name)), name


def test_moe_workspace_follows_triton_experts_shapes() -> None:
    """TritonExperts.workspace_shapes (0.33): [M, topk, max(N/2, K)] + [M, topk, max(N, K)], N = 2 x the
    expert's width on the rank. Qwen3-235B at TP 8 (width 1536 / 8 = 192 < hidden 4096): 2 x 4096 per
    expert slot; gpt-oss-120b at TP 1 (2880, hidden 2880): 2880 + 5760."""
    qwen = load_model_facts(str(REPO / "examples" / "models" / "qwen3-next-80b-a3b"))
    assert moe_workspace_width(qwen, 2) == 10 * (2048 + 2048)
    gpt_oss = load_model_facts(str(REPO / "examples" / "models" / "gpt-oss-120b"))
    assert moe_workspace_width(gpt_oss, 1) == 4 * (2880 + 5760)
    assert moe_workspace_bytes(gpt_oss, 1024, 1) == 1024 * 4 * (2880 + 5760) * 2
    dense = load_model_facts(str(REPO / "examples" / "models" / "llama-3.1-70b"))
    assert moe_workspace_bytes(dense, 8192, 4) == 0


def test_the_kept_moe_workspace_stands_under_the_sampler_pass_from_0_11() -> None:
    """0.10.2 freed the workspace after the forward (Qwen3-Next's logged peak is the sampler pass alone);
    0.33's WorkspaceManager keeps it, so the sampler pass's peak stands on it."""
    facts = load_model_facts(str(REPO / "examples" / "models" / "qwen3-next-80b-a3b"))
    h200 = Platform("cuda", (9, 0), "NVIDIA H200", int(139.81 * GIB))

    def sampler(version: tuple[int, int, int]) -> int:
        memory = non_kv_memory(facts, version=version, platform=h200, max_num_batched_tokens=8192,
                               max_num_seqs=1024, tensor_parallel_size=2, world_size=2,
                               enforce_eager=False)  # fmt: skip
        return memory.sampler.bytes

    kept = moe_workspace_bytes(facts, 8192, 2)
    assert kept == 8192 * 10 * 4096 * 2
    assert sampler((0, 33, 0)) == 1024 * 151936 * 14 + kept
    assert sampler((0, 10, 2)) == 1024 * 151936 * 38
