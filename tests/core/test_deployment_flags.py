"""Deployment flags the plan models: each planned with and without the flag, the difference checked
against figures derived from vLLM 0.33.0's code (the file named in each test), not from ctxmgr."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main

MODELS = REPO / "examples" / "models"
QWEN25_VL = REPO / "tests" / "data" / "deployment" / "qwen2.5-vl-72b-instruct"
LLAMA70B = str(MODELS / "llama-3.1-70b")
QWEN3_32B = str(MODELS / "qwen3-32b")
GPT_OSS = str(MODELS / "gpt-oss-120b")
GLM5 = str(MODELS / "glm-5")
UNITS = REPO / "units"
GIB = 1 << 30
H100 = ("--gpu-memory", "80GiB", "--gpu-name", "NVIDIA H100 80GB HBM3")


def plan(*args: str, code: int | None = 0) -> dict:
    """The plan's JSON; `code` 0 also admits 6 where the only unknown is the weights (the example
    configs ship without shards: the plan is then `unknown`, its KV figures exact)."""
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    output = result.stdout + result.stderr
    data = json.loads(result.stdout)
    if code == 0 and result.exit_code == 6:
        assert data["memory"].startswith("weights unknown: fits"), output
    elif code is not None:
        assert result.exit_code == code, output
    return data


def refused(*args: str) -> str:
    result = CliRunner().invoke(main, ["plan", *args])
    output = result.stdout + result.stderr
    assert result.exit_code == 2 and "Traceback" not in output, output
    return output


# ---- a. use_sliding_window: false (transformers' configuration_qwen2_5_vl.py / qwen2_vl.py) --------


def _vl_layouts(tmp_path: Path) -> list[Path]:
    """The published Qwen2.5-VL-72B config, its transformers-5 text_config layout, and Qwen2-VL."""
    top = json.loads((QWEN25_VL / "config.json").read_text())
    vision_keys = {"architectures", "vision_config", "model_type", "image_token_id", "video_token_id"}
    text = {k: v for k, v in top.items() if k not in vision_keys and not k.startswith("vision_")}
    nested = {
        "architectures": top["architectures"],
        "model_type": "qwen2_5_vl",
        "text_config": {**text, "model_type": "qwen2_5_vl_text"},
        "vision_config": top["vision_config"],
    }
    qwen2_vl = {**top, "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}
    out = [QWEN25_VL]
    for name, config in (("nested", nested), ("qwen2-vl", qwen2_vl)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        out.append(tmp_path / name)
    return out


def test_qwen_vl_without_use_sliding_window_keeps_every_token(tmp_path: Path) -> None:
    for model in _vl_layouts(tmp_path):
        data = plan("128000", "--model", str(model), "-tp", "4", "--gpu-count", "4", *H100)
        # Qwen2_5_VLTextConfig: sliding_window = None when use_sliding_window is false, so vLLM's
        # qwen2 layers are all full attention: 80 layers x 2 (K, V) x 8/4 KV heads x 128 x 2 bytes
        assert data["kv_bytes_per_token_per_gpu"] == 80 * 2 * 2 * 128 * 2
        assert data["kv_bytes_per_gpu"] == 128000 * 81920  # 9.77 GiB, not the 3.75 of a window


# ---- b. --hf-overrides and --rope-scaling (config/model.py _apply_dict_overrides, get_max_model_len) --

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_qwens_yarn_recipe_through_hf_overrides_raises_the_derived_maximum() -> None:
    base = ("131072", "--model", QWEN3_32B, "-tp", "2", "--gpu-count", "2", *H100)
    without = plan(*base, code=3)
    assert without["derived_max_model_len"] == 40960 and not without["feasible"]
    overrides = json.dumps({"rope_scaling": YARN, "max_position_embeddings": 131072})
    data = plan(*base, "--hf-overrides", overrides)
    # 0.33: yarn is exempt from the factor, so the derived maximum is max_position_embeddings itself
    assert data["derived_max_model_len"] == 131072 and data["feasible"] and data["env_changes"] == {}
    dotted = plan(*base, "--hf-overrides.max_position_embeddings", "131072")
    assert dotted["derived_max_model_len"] == 131072
    assert data["kv_bytes_per_token_per_gpu"] == without["kv_bytes_per_token_per_gpu"]  # 64 x 2 x 4 x 128 x 2


def test_legacy_rope_scaling_on_0_11_scales_the_original_length() -> None:
    # 0.11's config/model.py: yarn derives original_max_position_embeddings x factor
    data = plan(
        "131072", "--model", QWEN3_32B, "-tp", "2", "--gpu-count", "2", *H100, "--vllm-version", "0.11.0",
        "--rope-scaling", json.dumps(YARN),
    )  # fmt: skip
    assert data["derived_max_model_len"] == 32768 * 4


# ---- c. VLLM_ALLOW_LONG_MAX_MODEL_LEN in the unit (envs.py) ------------------------------------


def test_allow_long_in_the_units_environment_is_honoured(tmp_path: Path) -> None:
    text = (
        (UNITS / "vllm-llama70b.service").read_text().replace("/srv/models/Llama-3.1-70B-Instruct", LLAMA70B)
    )
    local = REPO / ".cache" / "test-units-i15"
    local.mkdir(parents=True, exist_ok=True)
    plain = local / "plain.service"
    plain.write_text(text)
    allowed = local / "allowed.service"
    allowed.write_text(
        text.replace("[Service]\n", "[Service]\nEnvironment=VLLM_ALLOW_LONG_MAX_MODEL_LEN=1\n")
    )
    args = ("200000", "--gpu-memory", "80GiB", "--gpu-count", "4")
    before = plan("--unit", str(plain), *args, code=3)
    assert "refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in before["reason"]
    after = plan("--unit", str(allowed), *args)
    assert after["feasible"] and after["env_changes"] == {}  # nothing to suggest: the unit sets it
    assert any("above the derived maximum" in w for w in after["warnings"])


# ---- d. --no-enable-chunked-prefill (engine/arg_utils.py, config/scheduler.py) ----------------


def test_chunked_prefill_off_batches_the_whole_context() -> None:
    base = ("131072", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100)
    on = plan(*base)
    off = plan(*base, "--no-enable-chunked-prefill")
    # _set_default_max_num_seqs_and_batched_tokens_args: max(max_model_len, default) when unset
    assert on["layout"]["max_num_batched_tokens"] == 8192  # get_batch_defaults: H100, >= 70 GiB
    assert off["layout"]["max_num_batched_tokens"] == 131072
    # the profile run's forward pass is 16x the tokens: its activation dwarfs the 8192-token one
    assert off["gpus"][0]["activation_peak"]["bytes"] > 5 * on["gpus"][0]["activation_peak"]["bytes"]


@pytest.mark.parametrize(
    "flags, message",
    [
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        (
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"],
            "max_num_batched_tokens (8192) is smaller than max_model_len (32768)",
        ),
        (
            ["--max-num-batched-tokens", "256", "--max-num-seqs", "512"],
            "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)",
        ),
        # engine/arg_utils.py parse_type(json.loads)
        (["--speculative-config", '{"method": "ngram",'], "--speculative-config/-sc: Value"),
        # config/speculative.py SpeculativeConfig.__post_init__
        (["--speculative-config", '{"num_speculative_tokens": 2}'], "without speculative model"),
        # engine/arg_utils.py create_speculative_config
        (
            ["--spec-tokens", "2", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
            "--spec-tokens and --speculative-config['num_speculative_tokens'] are mutually exclusive",
        ),
        # model_executor/layers/quantization/fp8.py Fp8Config.__init__
        (["--quantization", "fp8"], "no longer supports online quantization"),
        # config/scheduler.py SchedulerConfig.verify_max_model_len
        (
            ["--max-num-active-seqs", "64", "--max-num-seqs", "32"],
            "max_num_active_seqs (64) cannot be greater",
        ),
        (
            ["--long-prefill-token-threshold", "65536"],
            "long_prefill_token_threshold (65536) cannot be greater",
        ),
        # config/speculative.py SpeculativeConfig.__post_init__
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6, '
                '"prompt_lookup_max": 4}',
            ],
            "prompt_lookup_min=6 must be <= prompt_lookup_max=4",
        ),
        # config/vllm.py: the hybrid manager forced on with a connector without SupportsHMA
        (
            [
                "--no-disable-hybrid-kv-cache-manager",
                "--kv-transfer-config",
                '{"kv_connector": "LMCacheConnectorV1"}',
            ],
            "Hybrid KV cache manager was explicitly enabled but is not supported",
        ),
    ],
)
def test_what_vllm_refuses_at_config_time_is_refused(flags: list[str], message: str) -> None:
    output = refused("32768", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100, *flags)
    assert "vLLM refuses this configuration" in output and message in output


# ---- e. weights on the GPU ----------------------------------------------------------------------

LLAMA70B_TOTAL = 141_107_412_992  # the example's model.safetensors.index.json metadata.total_size


def _weights(*flags: str) -> int:
    data = plan("32768", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100, *flags, code=None)
    return int(data["gpus"][0]["weights"]["bytes"])


def test_cpu_offload_quantization_and_dtype_move_the_weights() -> None:
    per_gpu = LLAMA70B_TOTAL // 4
    assert _weights() == per_gpu
    # model_executor/offloader/uva.py: cpu_offload_gb GiB per GPU stay in host memory
    assert _weights("--cpu-offload-gb", "10") == per_gpu - 10 * GIB
    # quantization/online: each LinearBase weight at 1 byte; embed_tokens and lm_head (vocab 128256
    # x hidden 8192, bf16, sharded over TP 4) are not LinearBase and stay
    embeddings = 2 * 128256 * 8192 * 2 // 4
    assert _weights("--quantization", "fp8_per_tensor") == (per_gpu - embeddings) // 2 + embeddings
    # bitsandbytes in-flight 4-bit (quantization/bitsandbytes.py): nf4 payload + a float32 absmax per
    # 64 weights = 0.5625 bytes per linear weight, by --quantization or by --load-format
    four_bit = int((per_gpu - embeddings) * 0.5625 / 2) + embeddings
    assert _weights("--quantization", "bitsandbytes") == four_bit
    assert _weights("--load-format", "bitsandbytes") == four_bit
    # model_loader/utils.py set_default_torch_dtype: float32 weights from a bf16 checkpoint
    assert _weights("--dtype", "float32") == per_gpu * 2


def test_lora_buffers_are_counted_in_the_weights_of_a_dense_model() -> None:
    plain = _weights()
    with_lora = _weights("--enable-lora", "--max-loras", "4", "--max-lora-rank", "64")
    # lora/layers/base_linear.py create_lora_weights on Llama-3.1-70B at TP 4 (hidden 8192, MLP 28672,
    # 64 query heads, 8 KV heads, head 128, 80 layers): A [4, 1, 64, in] and B [4, 1, out, 64] in bf16
    rank, hidden, q, kv, mlp = 64, 8192, 8192 // 4, 8 // 4 * 128, 28672 // 4
    qkv = 3 * rank * hidden + (q + kv + kv) * rank  # column parallel: whole input, output shards
    o_proj = rank * q + hidden * rank  # row parallel: input shard, whole output
    gate_up = 2 * rank * hidden + 2 * mlp * rank
    down = rank * mlp + hidden * rank
    assert with_lora - plain == 4 * (qkv + o_proj + gate_up + down) * 80 * 2  # 3.18 GiB


def test_lora_on_a_moe_model_is_named() -> None:
    data = plan(
        "8192", "--model", GPT_OSS, "--gpu-count", "1", "--gpu-memory", "141GiB", "--enable-lora", code=None
    )
    assert [n["flag"] for n in data["not_modelled_flags"]] == ["--enable-lora"]


# ---- f. speculative decoding (config/speculative.py) --------------------------------------------


def test_ngram_adds_no_draft_layer_and_mtp_in_its_dotted_form_adds_one() -> None:
    base = ("65536", "--model", GLM5, "-tp", "8", "--gpu-count", "8", *H100, "--weights-bytes", "700GiB")
    plain = plan(*base, code=None)
    ngram = plan(*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', code=None)
    mtp = plan(
        *base,
        "--speculative-config.method",
        "mtp",
        "--speculative-config.num_speculative_tokens",
        "1",
        code=None,
    )
    # GLM-5: 78 MLA layers (576 x 2 B latent + 132 B DSA indexer per token), num_nextn_predict_layers 1
    per_layer = 576 * 2 + 132
    assert plain["kv_bytes_per_token_per_gpu"] == 78 * per_layer
    assert ngram["kv_bytes_per_token_per_gpu"] == 78 * per_layer
    assert mtp["kv_bytes_per_token_per_gpu"] == 79 * per_layer


def test_a_draft_model_is_named() -> None:
    data = plan(
        "32768", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100,
        "--speculative-config", '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-70B", '
        '"num_speculative_tokens": 3}',
    )  # fmt: skip
    named = data["not_modelled_flags"]
    assert [(n["flag"], n["family"]) for n in named] == [("--speculative-config", "speculative draft")]
    assert "eagle3" in named[0]["detail"]


# ---- g. KV connectors without SupportsHMA (config/vllm.py, kv_connector/v1/base.py) --------------


def test_lmcache_turns_the_hybrid_manager_off_and_sliding_layers_keep_every_token() -> None:
    base = (
        "131072",
        "--model",
        GPT_OSS,
        "--gpu-count",
        "1",
        "--gpu-memory",
        "141GiB",
        "--gpu-name",
        "NVIDIA H200",
    )
    hybrid = plan(*base)
    nixl = plan(*base, "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    lmcache = plan(
        *base, "--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'
    )
    # all 36 layers full attention: 36 x 2 x 8 KV heads x 64 x 2 bytes per token = 9.0 GiB at 131,072
    assert lmcache["kv_bytes_per_gpu"] == 131072 * 36 * 2 * 8 * 64 * 2
    assert nixl["kv_bytes_per_gpu"] == hybrid["kv_bytes_per_gpu"] < lmcache["kv_bytes_per_gpu"]
    assert any("lacks SupportsHMA" in note for note in lmcache["notes"])


@pytest.mark.parametrize("extra", ['"x"', '{"connectors": 5}', '{"connectors": "NixlConnector"}'])
def test_a_multi_connector_whose_children_are_no_list_plans_rather_than_failing(extra: str) -> None:
    """A MultiConnector whose kv_connector_extra_config is not an object, or whose connectors are not a
    list, ended in 'unexpected error: AttributeError' (or TypeError); vLLM's KVTransferConfig refuses it
    at start. The plan goes on with the connector's HMA support unknown: the hybrid manager stays on."""
    base = ("131072", "--model", GPT_OSS, "--gpu-count", "1", "--gpu-memory", "141GiB")
    config = '{"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": %s}'
    assert (
        plan(*base, "--kv-transfer-config", config % extra)["kv_bytes_per_gpu"]
        == plan(*base)["kv_bytes_per_gpu"]
    )


def test_a_connector_this_release_does_not_list_is_named(tmp_path: Path) -> None:
    shutil.copytree(MODELS / "gpt-oss-120b", tmp_path / "oss")
    data = plan(
        "8192", "--model", str(tmp_path / "oss"), "--gpu-count", "1", "--gpu-memory", "141GiB",
        "--kv-transfer-config", '{"kv_connector": "MyConnector", "kv_connector_module_path": "my.mod"}',
    )  # fmt: skip
    assert [n["flag"] for n in data["not_modelled_flags"]] == ["--kv-transfer-config"]


# ---- the scheduler: async scheduling and throughput mode (config/vllm.py, engine/arg_utils.py) ---


def test_no_async_scheduling_halves_the_sliding_windows_in_flight_tokens() -> None:
    base = (
        "131072",
        "--model",
        GPT_OSS,
        "--gpu-count",
        "1",
        "--gpu-memory",
        "141GiB",
        "--gpu-name",
        "NVIDIA H200",
    )
    asynchronous = plan(*base)
    synchronous = plan(*base, "--no-async-scheduling")
    # VllmConfig.max_concurrent_batches: 2 with async scheduling, else 1 (PP 1); a sliding layer keeps
    # window - 1 + max_concurrent_batches x max_num_batched_tokens (8192 on an H200) tokens: 18 sliding
    # layers x 8192 tokens x (2 x 8 KV heads x 64 x 2 bytes) fewer
    assert asynchronous["kv_bytes_per_gpu"] - synchronous["kv_bytes_per_gpu"] == 18 * 8192 * 2048


def test_throughput_mode_doubles_the_default_batch() -> None:
    base = ("32768", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100)
    assert plan(*base)["layout"]["max_num_batched_tokens"] == 8192
    assert plan(*base, "--performance-mode", "throughput")["layout"]["max_num_batched_tokens"] == 16384


# ---- i. data parallelism on a MoE model (model_executor/layers/fused_moe/config.py) --------------

H, V, LAYERS, EXPERTS, MOE_MLP = 256, 4096, 4, 16, 128


def _moe_checkpoint(directory: Path) -> tuple[int, int]:
    """A small Qwen3-MoE checkpoint: config.json and two safetensors shards whose headers declare
    every tensor (the data region is a sparse run of zeros). Returns (expert bytes, other bytes)."""
    directory.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
        "num_hidden_layers": LAYERS, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": EXPERTS, "num_experts_per_tok": 4, "moe_intermediate_size": MOE_MLP,
        "intermediate_size": 512, "vocab_size": V, "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H]}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        for name, rows in (("q_proj", 256), ("k_proj", 64), ("v_proj", 64)):
            shapes[f"{prefix}.self_attn.{name}.weight"] = [rows, H]
        shapes[f"{prefix}.self_attn.o_proj.weight"] = [H, 256]
        shapes[f"{prefix}.mlp.gate.weight"] = [EXPERTS, H]  # the router: not an expert
        for e in range(EXPERTS):
            shapes[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = [MOE_MLP, H]
            shapes[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = [MOE_MLP, H]
            shapes[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = [H, MOE_MLP]
    names = list(shapes)
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        header, offset = {}, 0
        for name in chunk:
            nbytes = shapes[name][0] * shapes[name][1] * 2
            header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header).encode()
        with open(directory / f"model-0000{part + 1}-of-00002.safetensors", "wb") as handle:
            handle.write(len(blob).to_bytes(8, "little") + blob)
            handle.truncate(8 + len(blob) + offset)
    experts = LAYERS * EXPERTS * 3 * MOE_MLP * H * 2
    other = 2 * V * H * 2 + LAYERS * ((256 + 64 + 64) * H + H * 256 + EXPERTS * H) * 2
    return experts, other


def test_data_parallel_splits_the_routed_experts_over_every_gpu(tmp_path: Path) -> None:
    experts, other = _moe_checkpoint(tmp_path / "moe")
    base = ("8192", "--model", str(tmp_path / "moe"), "--gpu-count", "4", *H100)
    alone = plan(*base)
    assert alone["gpus"][0]["weights"]["bytes"] == experts + other  # TP 1, DP 1: everything
    for flags in (["-dp", "4"], ["-dp", "4", "--enable-expert-parallel"]):
        data = plan(*base, *flags)
        # FusedMoEParallelConfig.make: the experts' "TP" is DP x TP = 4 (whole experts with EP);
        # attention, router and embeddings stay whole on every DP rank
        assert data["gpus"][0]["weights"]["bytes"] == other + experts // 4
        assert data["not_modelled_flags"] == []


def test_without_shard_headers_the_split_is_named(tmp_path: Path) -> None:
    _moe_checkpoint(tmp_path / "moe")
    for shard in (tmp_path / "moe").glob("*.safetensors"):
        shard.unlink()
    data = plan("8192", "--model", str(tmp_path / "moe"), "--gpu-count", "4", *H100, "-dp", "4")
    assert [n["flag"] for n in data["not_modelled_flags"]] == ["--data-parallel-size"]


def test_o0_and_cudagraph_mode_none_plan_as_enforce_eager() -> None:
    base = ("32768", "--model", LLAMA70B, "-tp", "4", "--gpu-count", "4", *H100)
    graphs = plan(*base)["gpus"][0]["cuda_graphs"]["bytes"]
    eager = plan(*base, "--enforce-eager")
    assert graphs > 0 and eager["gpus"][0]["cuda_graphs"]["bytes"] == 0
    # config/vllm.py OPTIMIZATION_LEVEL_00 and CompilationConfig.cudagraph_mode NONE: no CUDA graphs
    for flags in (
        ["-O0"],
        ["--compilation-config", '{"cudagraph_mode": "NONE"}'],
        ["--compilation-config.cudagraph_mode", "NONE"],
    ):
        data = plan(*base, *flags)
        assert data["gpus"][0]["cuda_graphs"]["bytes"] == 0 and data["not_modelled_flags"] == []
        assert data["gpus"][0]["margin"] == eager["gpus"][0]["margin"]
    # -O1 keeps PIECEWISE graphs only: fewer than the default's, so named without widening
    o1 = plan(*base, "-O1")
    assert [(n["flag"], n["family"]) for n in o1["not_modelled_flags"]] == [
        ("--optimization-level", "lowers memory")
    ]


def test_flags_after_a_unit_add_to_the_units_own(tmp_path: Path) -> None:
    text = (
        (UNITS / "vllm-llama70b.service").read_text().replace("/srv/models/Llama-3.1-70B-Instruct", LLAMA70B)
    )
    unit = REPO / ".cache" / "test-units-i15" / "eplb.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(text.replace("--port 8001", "--port 8001 --enable-eplb"))
    data = plan(
        "32768", "--unit", str(unit), "--gpu-memory", "80GiB", "--gpu-count", "4", "--moe-backend", "triton"
    )
    assert [n["flag"] for n in data["not_modelled_flags"]] == ["--enable-eplb", "--moe-backend"]


def test_mamba_state_dtypes_follow_the_flags() -> None:
    from vllm_ctxmgr.core.hardware import Platform
    from vllm_ctxmgr.core.kv.layout import kv_cache_layout
    from vllm_ctxmgr.core.kv.specs import MambaSpec
    from vllm_ctxmgr.core.serve_args import parse_serve_argv
    from vllm_ctxmgr.model_files.load import load_model_facts

    model = str(MODELS / "qwen3-next-80b-a3b")
    facts = load_model_facts(model)
    h200 = Platform(
        "cuda", compute_capability=(9, 0), device_name="NVIDIA H200", total_memory_bytes=141 * GIB
    )

    def state(*flags: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        layout = kv_cache_layout(facts, parse_serve_argv([model, "-tp", "4", *flags]), h200)
        spec = next(s for g in layout.groups for s in g.specs if isinstance(s, MambaSpec))
        return spec.shapes, spec.dtype_sizes

    # mamba_utils.py gated_delta_net_state_shape at TP 4 (16 K heads, 32 V heads, dims 128, kernel 4):
    # conv (3, (2 x 16 x 128 + 32 x 128) / 4), ssm (32 / 4, 128, 128)
    shapes, sizes = state()
    assert shapes == ((3, 2048), (8, 128, 128)) and sizes == (2, 2)  # bf16 model: both bf16
    assert state("--mamba-ssm-cache-dtype", "float32")[1] == (2, 4)  # MambaStateDtypeCalculator
    assert state("--mamba-cache-dtype", "float32")[1] == (4, 4)  # "auto" SSM follows the conv state
    assert "--mamba-ssm-cache-dtype" not in {
        n["flag"] for n in plan_named(model, "--mamba-ssm-cache-dtype", "float32")
    }
    refused("8192", "--model", model, "-tp", "4", "--gpu-count", "4", *H100, "--mamba-cache-dtype", "fp8")


def plan_named(model: str, *flags: str) -> list[dict]:
    return plan("8192", "--model", model, "-tp", "4", "--gpu-count", "4", *H100, *flags, code=None)[
        "not_modelled_flags"
    ]


def test_a_unit_on_0_33_with_a_flag_0_33_lacks_is_refused_as_argparse_does() -> None:
    from dataclasses import replace

    from vllm_ctxmgr.change.planning import PlanRequest, plan_for
    from vllm_ctxmgr.core.serve_args import parse_serve_argv
    from vllm_ctxmgr.errors import UsageError

    request = PlanRequest(32768, gpu_memory=80 * GIB, gpu_count=4)
    args = parse_serve_argv([LLAMA70B, "-tp", "4", "--disable-log-requests", "--swap-space", "4"])
    # an older vLLM had both flags: without the unit's version they are read, and --swap-space is named
    assert plan_for(args, request).feasible
    with pytest.raises(UsageError, match="unrecognized arguments: --disable-log-requests --swap-space 4 "):
        plan_for(replace(args, vllm_version="0.33.0"), request)  # engine/arg_utils.py has neither
    plan_for(replace(args, vllm_version="0.11.0"), request)


@pytest.mark.parametrize(
    "flags, version, refusal",
    [
        # removed before 0.33 (SchedulerConfig.num_scheduler_steps, engine/arg_utils.py @0.10)
        (["--num-scheduler-steps", "8"], "0.10.0", None),
        (
            ["--num-scheduler-steps", "8"],
            "0.33.0",
            "vllm serve: error: unrecognized arguments: --num-scheduler-steps 8 "
            "(--num-scheduler-steps is in vLLM 0.10; this unit runs 0.33.0)",
        ),
        (["--max-seq-len-to-capture", "8192"], "0.10.0", None),
        (["--max-seq-len-to-capture", "8192"], "0.11.0", "--max-seq-len-to-capture is in vLLM 0.10;"),
        # added late: the unit's 0.10 parser has neither
        (["--performance-mode", "throughput"], "0.10.0", "--performance-mode is in vLLM 0.17-0.33;"),
        (["--kv-cache-memory-bytes", "20G"], "0.10.0", "--kv-cache-memory-bytes is in vLLM 0.11-0.33;"),
        (["--kv-cache-memory-bytes", "20G"], "0.33.0", None),
        (["--performance-mode", "throughput"], None, None),  # the unit's vLLM unknown: as before
    ],
)
def test_a_units_flags_are_read_by_its_own_releases_parser(
    flags: list[str], version: str | None, refusal: str | None
) -> None:
    from dataclasses import replace

    from vllm_ctxmgr.change.planning import PlanRequest, plan_for
    from vllm_ctxmgr.core.serve_args import parse_serve_argv
    from vllm_ctxmgr.errors import UsageError

    request = PlanRequest(32768, gpu_memory=80 * GIB, gpu_count=4)
    args = replace(parse_serve_argv([LLAMA70B, "-tp", "4", *flags]), vllm_version=version)
    if refusal is None:
        plan_for(args, request)
        return
    with pytest.raises(UsageError) as raised:
        plan_for(args, request)
    assert str(raised.value).startswith("vLLM refuses this configuration: vllm serve: error: unrecognized")
    assert refusal in str(raised.value)


def test_a_unit_whose_venv_is_0_33_is_refused_a_flag_of_0_10_and_left_as_it_is(workdir: Path) -> None:
    """The unit's vLLM comes from the dist-info in its venv (service.py installed_vllm_version)."""
    venv = workdir / "venv"
    (venv / "bin").mkdir(parents=True)
    site = venv / "lib" / "python3.12" / "site-packages"
    text = (UNITS / "vllm-llama70b.service").read_text()
    text = text.replace("/srv/models/Llama-3.1-70B-Instruct", LLAMA70B).replace("/opt/vllm/.venv", str(venv))
    unit = workdir / "vllm-llama70b.service"
    unit.write_text(text.replace("--port 8001", "--port 8001 --num-scheduler-steps 8"))
    before = unit.read_text()
    for version, code in (("0.33.0", 2), ("0.10.0", 0)):
        shutil.rmtree(site, ignore_errors=True)
        (site / f"vllm-{version}.dist-info").mkdir(parents=True)
        result = CliRunner().invoke(
            main, ["plan", "--unit", str(unit), "--gpu-memory", "80GiB", "--gpu-count", "4", "--json"]
        )
        data = json.loads(result.stdout)
        assert result.exit_code == code, result.stdout + result.stderr
        if code == 2:
            assert (
                "unrecognized arguments: --num-scheduler-steps 8 (--num-scheduler-steps is in vLLM 0.10;"
                in (json.dumps(data))
            )
    assert unit.read_text() == before
