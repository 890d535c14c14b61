"""Three public vLLM 0.10.1.1 starts on A100 80GB GPUs (dennislee22/vLLM-benchmarking, quoted in
tests/data/public-logs): what they teach the planner's uncalibrated terms, and that a plan calibrated
from them is exact to the block.

- Qwen2-7B-Instruct on one GPU at utilisations 0.25 and 0.5 (5,867 and 29,053 blocks);
- gpt-oss-120b over Ray, TP 4, one GPU per node (nested log prefixes, Ray's "[repeated Nx]");
and Qwen3-Next-80B-A3B on two H200s (vLLM 0.10.2, a hybrid: 1 attention + 3 GDN groups, block 544).
The accuracy figures themselves are printed by benchmarks/calibration_logs.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, Platform
from vllm_ctxmgr.core.kv.layout import kv_cache_layout
from vllm_ctxmgr.core.kv.specs import SizingContext
from vllm_ctxmgr.core.memory import sampler_bytes, uses_flashinfer_sampler
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan import PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import ServeArgs, parse_serve_argv
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.systemd.service import installed_flashinfer
from vllm_ctxmgr.vllm_log.patterns import parse_line
from vllm_ctxmgr.vllm_log.watcher import observe_start

ROOT = REPO
PUBLIC = ROOT / "tests" / "data" / "public-logs"
MIB = 1 << 20
A100_NVML_TOTAL, A100_RESERVED = 81920 * MIB, 763 * MIB  # nvidia-smi -q of an A100-SXM4-80GB
QWEN_PAGE_BYTES = 16 * 28 * 2 * 4 * 128 * 2  # block_size x layers x (K, V) x KV heads x head_dim x bf16
A100 = Platform("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", A100_NVML_TOTAL - A100_RESERVED)


def _lines(name: str) -> list[str]:
    return [
        line for line in (PUBLIC / name).read_text(encoding="utf-8").splitlines() if not line.startswith("#")
    ]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("qwen2-7b")
    shutil.copyfile(PUBLIC / "config-qwen2-7b-instruct.json", model / "config.json")
    return model


def test_ray_nested_prefixes_name_the_worker_and_lose_the_dedup_note() -> None:
    line = next(line for line in _lines("gpt-oss-120b-4xa100-0.10.1.1.log") if "repeated 3x" in line)
    parsed = parse_line(line)
    assert (parsed.process, parsed.pid, parsed.level) == ("RayWorkerWrapper", 345, "INFO")
    assert parsed.message == "Available KV cache memory: 45.32 GiB"


def test_the_three_starts_are_read_whole() -> None:
    ray = observe_start(_lines("gpt-oss-120b-4xa100-0.10.1.1.log"))
    assert (ray.model_loading_gib, ray.available_kv_gib, ray.cuda_graph_gib) == (17.2217, 45.32, 1.88)
    assert (ray.num_gpu_blocks, ray.kv_cache_tokens, ray.gpu_memory_utilization) == (330018, 2640144, 0.8)
    low = observe_start(_lines("qwen2-7b-a100-0.10.1.1-u0.25.log"))
    high = observe_start(_lines("qwen2-7b-a100-0.10.1.1-u0.5.log"))
    assert (low.num_gpu_blocks, low.kv_cache_tokens, low.available_kv_gib) == (5867, 93872, 5.01)
    assert (high.num_gpu_blocks, high.kv_cache_tokens, high.available_kv_gib) == (29053, 464848, 24.83)


def test_two_utilisations_imply_cudas_total_not_nvidia_smis() -> None:
    """Same model, same host, only the utilisation differs: the budgets differ by 0.25 x CUDA's total.
    That total is nvidia-smi's less the driver's reserve (what nvml.read_nvml now reports), not 80 GiB.
    """
    low = observe_start(_lines("qwen2-7b-a100-0.10.1.1-u0.25.log"))
    high = observe_start(_lines("qwen2-7b-a100-0.10.1.1-u0.5.log"))
    assert low.num_gpu_blocks is not None and high.num_gpu_blocks is not None
    implied_total = (high.num_gpu_blocks - low.num_gpu_blocks) * QWEN_PAGE_BYTES / 0.25
    assert abs(implied_total - (A100_NVML_TOTAL - A100_RESERVED)) < 8 * MIB  # reserves differ per board
    assert A100_NVML_TOTAL - implied_total > 700 * MIB


def test_a_calibrated_plan_makes_vllms_block_count(qwen: Path) -> None:
    facts = load_model_facts(str(qwen))
    for name, blocks in (
        ("qwen2-7b-a100-0.10.1.1-u0.25.log", 5867),
        ("qwen2-7b-a100-0.10.1.1-u0.5.log", 29053),
    ):
        observation = observe_start(_lines(name))
        util = str(observation.gpu_memory_utilization)
        args = parse_serve_argv(
            ["Qwen2-7B-Instruct", "--max-model-len", "16384", "--gpu-memory-utilization", util]
        )
        total = A100.total_memory_bytes or 0
        gpus = GpuState((GpuInfo(0, A100.device_name, total, total, 0, compute_capability=(8, 0)),), "given")
        options = PlanOptions(
            target_context=16384, vllm_version=(0, 10, 1), fixed_gpu_memory_utilization=float(util)
        )
        plan = make_plan(facts, args, gpus, options, [observation])
        assert plan.layout.bytes_per_block == QWEN_PAGE_BYTES
        assert plan.capacity[0].num_gpu_blocks == blocks
        assert plan.kv_cache_tokens == observation.kv_cache_tokens


def test_a_hybrid_models_pool_in_tokens_as_0_10_counts_it(tmp_path: Path) -> None:
    """0.10's capacity line: num_blocks // groups x the smallest block size, where a GDN group outside
    "align" mode is one block of max_model_len tokens: 7162 // 4 x 544 = 973,760, as logged."""
    model = tmp_path / "qwen3-next"
    model.mkdir()
    shutil.copyfile(
        ROOT / "examples" / "models" / "qwen3-next-80b-a3b" / "config.json", model / "config.json"
    )
    observation = observe_start(_lines("qwen3-next-80b-2xh200-0.10.2.log"))
    assert (observation.num_gpu_blocks, observation.kv_cache_tokens) == (7162, 973760)
    total = int(139.81 * GIB)
    gpus = GpuState(
        tuple(GpuInfo(i, "NVIDIA H200", total, total, 0, compute_capability=(9, 0)) for i in range(2)),
        "given",
    )
    args = parse_serve_argv(["/data/models/Qwen3-Next-80B-A3B-Instruct", "--tensor-parallel-size", "2"])
    options = PlanOptions(target_context=262144, vllm_version=(0, 10, 2), fixed_gpu_memory_utilization=0.9)
    plan = make_plan(load_model_facts(str(model)), args, gpus, options, [observation])
    assert plan.layout.groups[-1].block_size == 544
    assert plan.capacity[0].num_gpu_blocks == 7162
    assert plan.kv_cache_tokens == 973760
    assert plan.capacity[0].max_concurrency == observation.max_concurrency == 14.77


def test_flashinfer_samples_where_each_version_lets_it() -> None:
    hopper, turing, cpu = Platform("cuda", (9, 0)), Platform("cuda", (7, 5)), Platform("cpu")
    assert uses_flashinfer_sampler((0, 10, 1), A100, {}, installed=True)
    assert not uses_flashinfer_sampler((0, 10, 1), A100, {}, installed=None)  # the costlier guess
    assert not uses_flashinfer_sampler((0, 11, 0), hopper, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, True)
    assert not uses_flashinfer_sampler((0, 15, 0), hopper, {}, installed=True)  # opt-in in 0.12-0.20
    assert uses_flashinfer_sampler((0, 15, 0), hopper, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, None)
    assert uses_flashinfer_sampler((0, 21, 0), hopper, {}, installed=None)  # a dependency, on by default
    assert not uses_flashinfer_sampler((0, 33, 0), turing, {}, installed=True)
    assert not uses_flashinfer_sampler((0, 33, 0), cpu, {}, installed=True)


def test_flashinfers_sampler_pass_is_smaller_than_pytorchs_sort(qwen: Path) -> None:
    """0.10's FlashInfer path: bf16 logits, their float32 copy, the top-k-masked copy, its softmax."""
    facts = load_model_facts(str(qwen))
    assert sampler_bytes(facts, 256, (0, 10, 1), flashinfer=True) == 256 * 152064 * (2 + 4 + 4 + 4)
    assert sampler_bytes(facts, 256, (0, 10, 1)) == 256 * 152064 * (2 + 4 + (4 + 8) + 8 + (4 + 8))
    args = parse_serve_argv(["Qwen2-7B-Instruct", "--max-model-len", "16384"])
    total = A100.total_memory_bytes or 0
    gpus = GpuState((GpuInfo(0, A100.device_name, total, total, 0, compute_capability=(8, 0)),), "given")
    options = PlanOptions(target_context=16384, vllm_version=(0, 10, 1), weights_bytes=15231233024)
    plain = make_plan(facts, args, gpus, options)
    with_flashinfer = make_plan(facts, replace(args, flashinfer_installed=True), gpus, options)
    assert "FlashInfer" in with_flashinfer.gpus[0].activation_peak.source
    peak_gap = (plain.gpus[0].activation_peak.bytes or 0) - (
        with_flashinfer.gpus[0].activation_peak.bytes or 0
    )
    assert peak_gap == 256 * 152064 * 24
    assert peak_gap > 0.3 * GIB


def test_flashinfer_is_seen_in_the_units_venv(tmp_path: Path) -> None:
    site = tmp_path / "opt/vllm/lib/python3.12/site-packages"
    site.mkdir(parents=True)
    assert installed_flashinfer("/opt/vllm/bin/vllm", tmp_path) is False
    (site / "flashinfer_python-0.2.8.dist-info").mkdir()
    assert installed_flashinfer("/opt/vllm/bin/vllm", tmp_path) is True
    assert installed_flashinfer("vllm", tmp_path) is None  # not a venv path
    assert installed_flashinfer("/srv/none/bin/vllm", tmp_path) is None  # no site-packages to look in


@pytest.mark.parametrize(
    ("name", "version", "total", "argv"),
    [
        ("llama-3.1-8b-l4-0.11.0.log", (0, 11, 0), int(22.03 * GIB), ["--max-model-len", "32000",
         "--gpu-memory-utilization", "0.92", "--max-num-seqs", "128"]),
        ("llama-3.1-8b-a100-40gb-0.11.0.log", (0, 11, 0), int(39.39 * GIB), ["--max-model-len", "4096"]),
        ("llama-3.1-8b-a100-40gb-0.15.1-eager.log", (0, 15, 1), int(39.39 * GIB),
         ["--enforce-eager", "--max-num-batched-tokens", "8192"]),
        ("llama-3.1-8b-a100-80gb-0.17.1.log", (0, 17, 1), A100_NVML_TOTAL - A100_RESERVED,
         ["--max-model-len", "32768"]),
    ],
)  # fmt: skip
def test_llama_starts_0_11_to_0_17_calibrate_to_their_logged_pool(
    tmp_path: Path, name: str, version: tuple[int, int, int], total: int, argv: list[str]
) -> None:
    """Four Llama-3.1-8B starts (L4, A100 40GB, A100 80GB; 0.11.0, 0.15.1, 0.17.1): a plan calibrated
    from each start's own lines makes the pool in tokens and the concurrency that start logged."""
    model = tmp_path / "llama"
    model.mkdir()
    shutil.copyfile(PUBLIC / "config-llama-3.1-8b-instruct.json", model / "config.json")
    observation = observe_start(_lines(name))
    assert observation.model_loading_gib == pytest.approx(14.99, abs=0.01)
    assert observation.available_kv_gib is not None and observation.kv_cache_tokens is not None
    args = parse_serve_argv(["meta-llama/Llama-3.1-8B-Instruct", *argv])
    gpus = GpuState((GpuInfo(0, "NVIDIA GPU", total, total, 0, compute_capability=(8, 0)),), "given")
    util = args.gpu_memory_utilization or 0.9
    mml = observation.max_model_len or 131072
    options = PlanOptions(target_context=mml, vllm_version=version, fixed_gpu_memory_utilization=util)
    plan = make_plan(load_model_facts(str(model)), args, gpus, options, [observation])
    assert plan.kv_cache_tokens == observation.kv_cache_tokens
    assert plan.capacity[0].max_concurrency == observation.max_concurrency


def _model_dir(tmp_path: Path, config: str) -> Path:
    model = tmp_path / config.removesuffix(".json")
    model.mkdir()
    shutil.copyfile(PUBLIC / config, model / "config.json")
    return model


def _one_gpu(name: str, total: int, capability: tuple[int, int]) -> GpuState:
    return GpuState((GpuInfo(0, name, total, total, 0, compute_capability=capability),), "given")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "tokens", "concurrency"),
    [("fp8", 417022, 12.73), ("fp8_per_token_head", 325335, 9.93)],
)
def test_a_gemma4_hybrids_pool_matches_its_public_start(
    tmp_path: Path, kv_cache_dtype: str, tokens: int, concurrency: float
) -> None:
    """vllm-project/vllm#40388 (a comment, vLLM 0.26.0): gemma-4-26B-A4B-it on one L40S, max_model_len
    32768, the same 15.18 GiB KV budget, only --kv-cache-dtype changed: 417,022 tokens (12.73x) with fp8,
    325,335 (9.93x) with fp8_per_token_head. The post gives no --max-num-batched-tokens; the pool pins
    the tokens in flight to 8192 (each sliding group holds cdiv(1023 + 8192, 16) + 1 = 577 blocks), i.e.
    vLLM's recipe flag 4096 x 0.26's two concurrent batches (vllm-project/recipes#572)."""
    facts = load_model_facts(str(_model_dir(tmp_path, "config-gemma-4-26b-a4b.json")))
    args = parse_serve_argv(
        ["google/gemma-4-26B-A4B-it", "--max-model-len", "32768", "--kv-cache-dtype", kv_cache_dtype,
         "--max-num-batched-tokens", "4096"]
    )  # fmt: skip
    # the post's budget; its utilisation is not stated (0.26's default)
    observation = Observation(max_model_len=32768, available_kv_gib=15.18, gpu_memory_utilization=0.92)
    options = PlanOptions(target_context=32768, vllm_version=(0, 26, 0), fixed_gpu_memory_utilization=0.92)
    gpus = _one_gpu("NVIDIA L40S", int(44.39 * GIB), (8, 9))
    plan = make_plan(facts, args, gpus, options, [observation])
    assert plan.kv_cache_tokens is not None
    assert abs(plan.kv_cache_tokens - tokens) / tokens < 0.01
    assert plan.capacity[0].max_concurrency == pytest.approx(concurrency, abs=0.011)


def test_gemma4_raises_a_default_batch_to_one_video_from_0_22(tmp_path: Path) -> None:
    """engine/arg_utils.py (0.22.0..0.33.0): a multimodal prefix-LM model (Gemma-4: text_config
    use_bidirectional_attention "vision") gets max_num_batched_tokens raised to its largest item,
    gemma4_mm.py's video: 32 frames x (70 soft tokens + boi + eoi + 6 timestamp tokens) = 2496; with 0.26's
    two batches in flight a sliding group holds cdiv(1023 + 2 x 2496, 16) + 1 = 377 blocks. 0.21.0 kept
    the L40S's default 2048."""
    facts = load_model_facts(str(_model_dir(tmp_path, "config-gemma-4-26b-a4b.json")))
    assert facts.mm_prefix_lm_item_tokens == 32 * (70 + 2 + 6) == 2496
    l40s = Platform("cuda", (8, 9), "NVIDIA L40S", int(44.39 * GIB))
    args = ServeArgs("gemma", max_model_len=32768)
    raised = kv_cache_layout(facts, args, l40s, (0, 26, 0))
    assert (raised.max_num_batched_tokens, raised.max_in_flight_tokens) == (2496, 4992)
    ctx = SizingContext(32768, raised.max_in_flight_tokens)
    assert raised.groups[0].specs[0].blocks_per_request(ctx) == 377
    assert kv_cache_layout(facts, args, l40s, (0, 21, 0)).max_num_batched_tokens == 2048
    given = kv_cache_layout(facts, replace(args, max_num_batched_tokens=2048), l40s, (0, 26, 0))
    assert given.max_num_batched_tokens == 2048  # only a default is raised
    text_only = load_model_facts(str(ROOT / "examples" / "models" / "qwen3-32b"))
    assert text_only.mm_prefix_lm_item_tokens is None


def test_a_gated_delta_net_hybrids_pool_on_a_consumer_gpu_matches_its_public_start(tmp_path: Path) -> None:
    """noonghunna/club-3090#612 (vLLM 0.24.0): Qwen3.6-35B-A3B NVFP4 on one RTX 5090, fp8 KV,
    max_model_len 131072, prefix caching (mamba "align"), 8192 batched tokens, one sequence; "Available KV
    cache memory: 5.98 GiB", "GPU KV cache size: 567,978 tokens", 4.33x. The config's mamba_ssm_dtype
    float32 (model_executor/models/config.py Qwen3_5ForConditionalGenerationConfig) doubles the GDN state:
    page 2,146,304 B, attention block 2096 tokens, 299 blocks / (63 + 3 x 2) = 4.33. With a bfloat16
    state (a config without the key) the pool would be 593,380 tokens, 4.5% above."""
    model = _model_dir(tmp_path, "config-qwen3.6-35b-a3b.json")
    argv = ["qwen3.6-35b-a3b", "--max-model-len", "131072", "--kv-cache-dtype", "fp8",
            "--enable-prefix-caching", "--max-num-batched-tokens", "8192", "--max-num-seqs", "1"]  # fmt: skip
    args = parse_serve_argv(argv)
    logged = observe_start(_lines("qwen3.6-35b-a3b-5090-0.24.0.log"))
    assert (logged.available_kv_gib, logged.kv_cache_tokens) == (5.98, 567978)
    observation = replace(logged, gpu_memory_utilization=0.92)  # 0.24's default: no flag, no args line
    options = PlanOptions(target_context=131072, vllm_version=(0, 24, 0), fixed_gpu_memory_utilization=0.92)
    gpus = _one_gpu("NVIDIA GeForce RTX 5090", int(31.36 * GIB), (12, 0))
    facts = load_model_facts(str(model))
    plan = make_plan(facts, args, gpus, options, [observation])
    assert plan.layout.block_size == 2096
    assert plan.kv_cache_tokens is not None and abs(plan.kv_cache_tokens - 567978) / 567978 < 0.01
    assert plan.capacity[0].max_concurrency == observation.max_concurrency == 4.33
    bf16_state = load_model_facts(str(_bf16_state_copy(tmp_path, model)))
    assert make_plan(bf16_state, args, gpus, options, [observation]).kv_cache_tokens == 593380


def _bf16_state_copy(tmp_path: Path, model: Path) -> Path:
    """The same checkpoint with mamba_ssm_dtype dropped: vLLM then keeps the GDN state in bfloat16."""
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    del config["text_config"]["mamba_ssm_dtype"]
    copy = tmp_path / "bf16-state"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy


def test_gemma4_with_a_batch_smaller_than_one_video_is_refused_as_vllm_refuses_it(tmp_path: Path) -> None:
    """vllm-project/recipes#572: gemma-4-26B-A4B-it on one A100 failed with vLLM's "Chunked MM input
    disabled but max_tokens_per_mm_item (2496) is larger than max_num_batched_tokens (2048)" (CUDA forces
    unchunked MM input for a prefix-LM model, encoder_cache_manager.py refuses): a default 2048 before 0.22,
    an explicit one on any version; the default is raised from 0.22, and no video means no such item."""
    facts = load_model_facts(str(_model_dir(tmp_path, "config-gemma-4-26b-a4b.json")))
    a100 = _one_gpu("NVIDIA A100-SXM4-40GB", int(39.39 * GIB), (8, 0))

    def plan(version: tuple[int, int, int], *flags: str) -> None:
        args = parse_serve_argv(["google/gemma-4-26B-A4B-it", "--max-model-len", "32768", *flags])
        options = PlanOptions(target_context=32768, vllm_version=version, weights_bytes=int(25 * GIB))
        make_plan(facts, args, a100, options)

    message = r"max_tokens_per_mm_item \(2496\) is larger than max_num_batched_tokens \(2048\)"
    with pytest.raises(UsageError, match=message):
        plan((0, 21, 0))
    with pytest.raises(UsageError, match=message):
        plan((0, 26, 0), "--max-num-batched-tokens", "2048")
    plan((0, 26, 0))
    plan((0, 21, 0), "--max-num-batched-tokens", "4096")
    plan((0, 21, 0), "--limit-mm-per-prompt", '{"image": 0, "video": 0}')
