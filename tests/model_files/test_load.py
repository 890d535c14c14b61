"""load_model_facts on the real example configs and on GGUF files written with gguf.GGUFWriter."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests import gguf_builders
from tests.support.paths import REPO
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts, StateFacts, derived_max_model_len
from vllm_ctxmgr.errors import ModelFactsError
from vllm_ctxmgr.model_files.gguf import read_gguf_header
from vllm_ctxmgr.model_files.hf_defaults import transformers_defaults
from vllm_ctxmgr.model_files.load import load_model_facts

MODELS = REPO / "examples" / "models"


def kinds(model: ModelFacts) -> Counter[LayerKind]:
    return Counter(layer.kind for layer in model.layers)


def copy_config(tmp_path: Path, name: str, **changes: Any) -> Path:
    """An example config with some keys changed (None deletes a key)."""
    config = json.loads((MODELS / name / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_config(tmp_path: Path, config: dict[str, Any], name: str = "model") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- the example configs ---


def test_glm5_is_78_mla_layers_with_indexers() -> None:
    glm5 = load_model_facts(str(MODELS / "glm-5"))
    assert glm5.model_type == "glm_moe_dsa"
    assert kinds(glm5) == {LayerKind.MLA: 78}
    assert set(glm5.layers) == {
        LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576, indexer_head_dim=128)
    }
    assert (glm5.kv_lora_rank, glm5.qk_rope_head_dim, glm5.qk_nope_head_dim) == (512, 64, 192)
    assert glm5.mtp_layers == 1
    assert glm5.dtype == "bfloat16"
    assert derived_max_model_len(glm5) == (202752, "max_position_embeddings")


def test_deepseek_v3_is_61_mla_layers_without_indexers() -> None:
    model = load_model_facts(str(MODELS / "deepseek-v3"))
    assert set(model.layers) == {LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576)}
    assert model.num_hidden_layers == 61
    assert model.quantization == "fp8"
    assert model.kv_cache_scheme is None
    assert derived_max_model_len(model, (0, 33, 0)) == (163840, "max_position_embeddings")
    assert derived_max_model_len(model, (0, 11, 0)) == (163840, "max_position_embeddings")


def test_glm47_flash_is_mla_whatever_num_key_value_heads_says() -> None:
    model = load_model_facts(str(MODELS / "glm-4.7-flash"))
    assert set(model.layers) == {LayerFacts(LayerKind.MLA, num_kv_heads=1, head_size=576)}
    assert model.num_hidden_layers == 47
    assert derived_max_model_len(model)[0] == 202752


def test_llama_31_70b_weights_from_the_index() -> None:
    model = load_model_facts(str(MODELS / "llama-3.1-70b"))
    assert set(model.layers) == {LayerFacts(LayerKind.FULL, num_kv_heads=8, head_size=128, head_size_v=128)}
    assert model.num_hidden_layers == 80
    assert model.weight_bytes == 141107412992
    assert model.provenance["weight_bytes"] == "safetensors index"
    assert derived_max_model_len(model) == (131072, "max_position_embeddings")


def test_qwen3_32b_full_attention_and_no_window() -> None:
    model = load_model_facts(str(MODELS / "qwen3-32b"))
    assert set(model.layers) == {LayerFacts(LayerKind.FULL, num_kv_heads=8, head_size=128, head_size_v=128)}
    assert model.num_hidden_layers == 64
    assert model.sliding_window is None
    assert model.weight_bytes == 65524246528
    assert derived_max_model_len(model) == (40960, "max_position_embeddings")


def test_qwen3_user_yarn_override_from_config(tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    model = load_model_facts(str(copy_config(tmp_path, "qwen3-32b", rope_scaling=rope)))
    assert derived_max_model_len(model, (0, 33, 0)) == (40960, "max_position_embeddings")
    assert derived_max_model_len(model, (0, 11, 0)) == (131072, "max_position_embeddings")


def test_gemma3_27b_text_config_with_transformers_defaults() -> None:
    model = load_model_facts(str(MODELS / "gemma-3-27b"))
    assert model.model_type == "gemma3_text"
    assert model.architectures == ("Gemma3ForConditionalGeneration",)
    assert kinds(model) == {LayerKind.SLIDING: 52, LayerKind.FULL: 10}
    full = [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL]
    assert full == list(range(5, 62, 6))
    assert {layer.window for layer in model.layers if layer.kind == LayerKind.SLIDING} == {1024}
    assert {(layer.num_kv_heads, layer.head_size) for layer in model.layers} == {(16, 128)}
    # config.json has no max_position_embeddings: Gemma3TextConfig's default applies
    assert derived_max_model_len(model) == (131072, "max_position_embeddings")
    assert model.provenance["max_position_embeddings"] == "transformers default (Gemma3TextConfig)"
    assert derived_max_model_len(model, disable_sliding_window=True) == (1024, "sliding_window")


def test_gpt_oss_120b_even_layers_slide() -> None:
    model = load_model_facts(str(MODELS / "gpt-oss-120b"))
    assert kinds(model) == {LayerKind.SLIDING: 18, LayerKind.FULL: 18}
    assert all((layer.kind == LayerKind.SLIDING) == (i % 2 == 0) for i, layer in enumerate(model.layers))
    assert {(layer.num_kv_heads, layer.head_size, layer.window) for layer in model.layers} == {
        (8, 64, 128),
        (8, 64, None),
    }
    assert model.quantization == "mxfp4"
    assert model.dtype == "bfloat16"  # no dtype in config.json: vLLM's float32 default, auto -> bf16
    assert derived_max_model_len(model) == (131072, "max_position_embeddings")


def test_qwen3_next_12_full_and_36_gated_delta_net() -> None:
    model = load_model_facts(str(MODELS / "qwen3-next-80b-a3b"))
    assert kinds(model) == {LayerKind.FULL: 12, LayerKind.MAMBA: 36}
    full = [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL]
    assert full == list(range(3, 48, 4))
    assert {layer for layer in model.layers if layer.kind == LayerKind.FULL} == {
        LayerFacts(LayerKind.FULL, num_kv_heads=2, head_size=256, head_size_v=256)
    }
    states = {layer.state for layer in model.layers if layer.kind == LayerKind.MAMBA}
    assert states == {
        StateFacts(
            family="gdn", conv_kernel=4, num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128
        )
    }
    assert derived_max_model_len(model) == (262144, "max_position_embeddings")


def test_config_json_path_is_accepted() -> None:
    assert load_model_facts(str(MODELS / "glm-5" / "config.json")).num_hidden_layers == 78


# --- layer rules on edited configs ---


def test_dsa_index_topk_freq_skips_layers_like_vllm(tmp_path: Path) -> None:
    """GLM-5.2 style IndexShare: freq 4, offset 3 -> 3 leading + every 4th layer own an indexer."""
    model = load_model_facts(str(copy_config(tmp_path, "glm-5", index_topk_freq=4, index_skip_topk_offset=3)))
    owners = [i for i, layer in enumerate(model.layers) if layer.indexer_head_dim]
    assert owners == [0, 1, 2, *range(6, 78, 4)]
    assert len(owners) == 21


def test_dsa_index_topk_pattern_skips_s(tmp_path: Path) -> None:
    pattern = "FFFS" * 19 + "FS"
    model = load_model_facts(str(copy_config(tmp_path, "glm-5", index_topk_pattern=pattern)))
    assert [bool(layer.indexer_head_dim) for layer in model.layers] == [c == "F" for c in pattern]


def test_mla_type_without_kv_lora_rank_is_not_mla(tmp_path: Path) -> None:
    config = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "hidden_size": 2048,
    }
    config |= {"kv_lora_rank": None, "num_key_value_heads": 16, "max_position_embeddings": 4096}
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert set(model.layers) == {LayerFacts(LayerKind.FULL, num_kv_heads=16, head_size=128, head_size_v=128)}


def test_mistral_without_layer_types_slides_everywhere(tmp_path: Path) -> None:
    config = {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_size": 4096,
    }
    config |= {"num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 32768}
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert set(model.layers) == {LayerFacts(LayerKind.SLIDING, 8, 128, 128, window=4096)}


def test_sliding_window_zero_means_disabled(tmp_path: Path) -> None:
    config = {"model_type": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 1024}
    config |= {"sliding_window": 0}
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert kinds(model) == {LayerKind.FULL: 4}
    assert model.sliding_window is None


def test_qwen2_sliding_window_only_when_every_layer_slides(tmp_path: Path) -> None:
    base = {"model_type": "qwen2", "num_hidden_layers": 32, "num_attention_heads": 28, "hidden_size": 3584}
    base |= {"num_key_value_heads": 4, "sliding_window": 32768, "use_sliding_window": True}
    off = load_model_facts(str(write_config(tmp_path, base | {"use_sliding_window": False}, "off")))
    assert kinds(off) == {LayerKind.FULL: 32}
    assert off.sliding_window is None
    mixed = load_model_facts(str(write_config(tmp_path, base | {"max_window_layers": 28}, "mixed")))
    assert kinds(mixed) == {LayerKind.FULL: 32}
    assert any("refuses" in note for note in mixed.notes)
    every = load_model_facts(str(write_config(tmp_path, base | {"max_window_layers": 0}, "every")))
    assert kinds(every) == {LayerKind.SLIDING: 32}
    none = load_model_facts(str(write_config(tmp_path, base | {"max_window_layers": 32}, "none")))
    assert kinds(none) == {LayerKind.FULL: 32}
    assert not any("refuses" in note for note in none.notes)


def test_llama4_chunked_attention_on_rope_layers(tmp_path: Path) -> None:
    text = {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "hidden_size": 5120,
    }
    text |= {"num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192}
    config = {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
    }
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert kinds(model) == {LayerKind.CHUNKED: 36, LayerKind.FULL: 12}
    assert [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.FULL] == list(
        range(3, 48, 4)
    )
    assert {layer.window for layer in model.layers if layer.kind == LayerKind.CHUNKED} == {8192}


def test_gemma3n_shared_kv_layers_hold_no_cache(tmp_path: Path) -> None:
    config = {
        "model_type": "gemma3n_text",
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "hidden_size": 2048,
    }
    config |= {"num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512, "num_kv_shared_layers": 15}
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert kinds(model) == {LayerKind.SLIDING: 16, LayerKind.FULL: 4, LayerKind.NONE: 15}
    assert all(layer.kind == LayerKind.NONE for layer in model.layers[20:])


def test_nemotron_h_pattern(tmp_path: Path) -> None:
    config = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "hidden_size": 4096,
    }
    config |= {"hybrid_override_pattern": "M-M*-M-E", "num_key_value_heads": 8, "head_dim": 128}
    config |= {
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
    }
    model = load_model_facts(str(write_config(tmp_path, config)))
    assert [layer.kind.value for layer in model.layers] == [
        "mamba",
        "none",
        "mamba",
        "full",
        "none",
        "mamba",
        "none",
        "none",
    ]
    state = model.layers[0].state
    assert state is not None and (state.family, state.intermediate_size, state.ssm_dtype) == (
        "mamba2",
        8192,
        "float32",
    )


def test_kv_cache_scheme_declared_by_the_checkpoint(tmp_path: Path) -> None:
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    compressed = {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}
    model = load_model_facts(str(copy_config(tmp_path, "llama-3.1-70b", quantization_config=compressed)))
    assert (model.quantization, model.kv_cache_scheme) == ("compressed-tensors", "fp8")
    modelopt = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    other = tmp_path / "other"
    other.mkdir()
    model = load_model_facts(str(copy_config(other, "llama-3.1-70b", quantization_config=modelopt)))
    assert (model.quantization, model.kv_cache_scheme) == ("modelopt", "fp8_e4m3")


def test_weight_bytes_and_dtype_from_safetensors_headers(tmp_path: Path) -> None:
    """Only the 8-byte length and the JSON header are read: the data region is a sparse hole."""
    directory = copy_config(tmp_path, "gpt-oss-120b")
    sizes = {"model-00001-of-00002.safetensors": 3 * 2**30, "model-00002-of-00002.safetensors": 2**30 + 6}
    for name, nbytes in sizes.items():
        header = json.dumps(
            {"w": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}
        ).encode()
        shard = directory / name
        shard.write_bytes(struct.pack("<Q", len(header)) + header)
        os.truncate(shard, 8 + len(header) + nbytes)
    model = load_model_facts(str(directory))
    assert model.weight_bytes == sum(sizes.values())
    assert model.provenance["weight_bytes"] == "safetensors headers"
    assert model.dtype == "bfloat16"
    assert model.provenance["dtype"] == "safetensors headers"


# --- the Hugging Face cache ---


def fake_cache(root: Path, repo_id: str, model: str) -> Path:
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    shutil.copy(MODELS / model / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_repo_id_from_a_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cache(tmp_path, "zai-org/GLM-5", "glm-5")
    model = load_model_facts("zai-org/GLM-5", hf_home=str(tmp_path))
    assert model.source == "zai-org/GLM-5"
    assert kinds(model) == {LayerKind.MLA: 78}
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_model_facts("zai-org/GLM-5").num_hidden_layers == 78


def test_uncached_repo_id_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(
        ModelFactsError, match=r"^zai-org/GLM-5: no such local path, and not in the local Hugging Face cache"
    ):
        load_model_facts("zai-org/GLM-5")


# --- bad input ---


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelFactsError, match=r"^model path not found: "):
        load_model_facts(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFactsError, match=r"^no config\.json in "):
        load_model_facts(str(tmp_path))


def test_malformed_json_names_the_position(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "num_hidden_layers": 32,,}')
    with pytest.raises(
        ModelFactsError, match=r"config\.json: malformed JSON \(.* at line 2 column 26\)$"
    ) as error:
        load_model_facts(str(tmp_path))
    assert "\n" not in error.value.message


def test_missing_essential_fields_are_named(tmp_path: Path) -> None:
    directory = write_config(tmp_path, {"model_type": "my_new_arch", "hidden_size": 1024})
    with pytest.raises(ModelFactsError, match=r"lacks num_hidden_layers, num_attention_heads$"):
        load_model_facts(str(directory))


def test_mla_without_rope_dims_is_named(tmp_path: Path) -> None:
    """kimi_k2 is MLA to vLLM but unknown to transformers here, so nothing fills the gap."""
    config = {
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
    }
    with pytest.raises(
        ModelFactsError, match=r"config\.json \(model_type 'kimi_k2'\) lacks qk_rope_head_dim$"
    ):
        load_model_facts(str(write_config(tmp_path, config)))


def test_unknown_model_type_with_the_fields_loads_from_raw_json(tmp_path: Path) -> None:
    config = {
        "model_type": "my_new_arch",
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "hidden_size": 1024,
    }
    model = load_model_facts(str(write_config(tmp_path, config | {"max_position_embeddings": 8192})))
    assert set(model.layers) == {LayerFacts(LayerKind.FULL, num_kv_heads=8, head_size=128, head_size_v=128)}
    assert any("unknown to transformers" in note for note in model.notes)


# --- GGUF ---


@pytest.fixture(scope="module")
def glm5_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glm5") / "GLM-5-Q4_K_M.gguf"
    gguf_builders.glm5_example().write_glm5_gguf(path)
    return path


def test_glm5_gguf_matches_the_hf_config(glm5_gguf: Path) -> None:
    gguf_facts = load_model_facts(str(glm5_gguf))
    hf_facts = load_model_facts(str(MODELS / "glm-5"))
    assert gguf_facts.layers == hf_facts.layers
    assert gguf_facts.model_type == "glm-dsa"
    assert gguf_facts.mtp_layers == 1
    assert any("includes 1 nextn" in note and "confirm" in note for note in gguf_facts.notes)
    assert (gguf_facts.kv_lora_rank, gguf_facts.qk_rope_head_dim, gguf_facts.qk_nope_head_dim) == (
        512,
        64,
        192,
    )
    assert (
        derived_max_model_len(gguf_facts)
        == derived_max_model_len(hf_facts)
        == (202752, "max_position_embeddings")
    )
    assert gguf_facts.quantization == "Q4_K_M"
    assert gguf_facts.dtype == "bfloat16"


def test_a_gguf_plan_estimates_by_the_same_shapes_and_says_which_vllm_loads_it(glm5_gguf: Path) -> None:
    """Issue 35: the GGUF's activation peak was 0.56 GiB against 2.07 GiB for the same model's
    config.json (vocab, MLP widths and experts went unread), and its plan under vLLM 0.33's rules said
    FEASIBLE with no word that 0.33 has no GGUF loader."""
    from vllm_ctxmgr.core.hardware import GIB, uniform_gpus
    from vllm_ctxmgr.core.plan import PlanOptions, make_plan
    from vllm_ctxmgr.core.serve_args import ServeArgs

    gguf_facts = load_model_facts(str(glm5_gguf))
    hf_facts = load_model_facts(str(MODELS / "glm-5"))
    shapes = (
        "vocab_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
    )
    assert [getattr(gguf_facts, k) for k in shapes] == [getattr(hf_facts, k) for k in shapes]
    assert gguf_facts.provenance["vocab_size"] == "gguf glm-dsa.vocab_size"
    gpus = uniform_gpus(8, int(95.6 * GIB))
    args = ServeArgs(str(glm5_gguf), tensor_parallel_size=8)
    options = PlanOptions(200_000, weights_bytes=int(406.7 * GIB))
    gguf_plan, hf_plan = (make_plan(f, args, gpus, options) for f in (gguf_facts, hf_facts))
    assert gguf_plan.gpus[0].activation_peak == hf_plan.gpus[0].activation_peak
    # the sampler pass, over the MoE workspace vLLM keeps (8192 tokens x top 8 x (6144 + 6144) x 2 B)
    assert gguf_plan.gpus[0].activation_peak.bytes == 1024 * 154_880 * 14 + 8192 * 8 * (6144 + 6144) * 2
    assert any(w.startswith("vLLM 0.33.0 has no GGUF loader") for w in gguf_plan.warnings)
    assert not any("GGUF" in w for w in hf_plan.warnings + hf_plan.notes)
    older = make_plan(gguf_facts, args, gpus, replace(options, vllm_version=(0, 20, 0)))
    assert not any("GGUF" in w for w in older.warnings)
    assert any(n.startswith("GGUF: the facts follow the GGUF path") for n in older.notes)


def test_glm5_gguf_weight_bytes_are_the_tensor_sizes(glm5_gguf: Path) -> None:
    example = gguf_builders.glm5_example()
    expected = sum(example.tensor_nbytes(shape, kind) for _, shape, kind in example.glm5_tensors())
    model = load_model_facts(str(glm5_gguf))
    assert model.weight_bytes == expected
    assert 400 * 2**30 < expected < 420 * 2**30  # ~8 x 51 GiB, the seed deployment's weights
    assert os.path.getsize(glm5_gguf) > expected  # the sparse file has the full apparent size
    assert os.stat(glm5_gguf).st_blocks * 512 < 64 * 2**20  # ...and no data blocks


def test_split_gguf_from_the_example_script(tmp_path: Path, glm5_gguf: Path) -> None:
    subprocess.run(
        [sys.executable, str(gguf_builders.EXAMPLE_SCRIPT), str(tmp_path / "GLM-5.gguf"), "--parts", "3"],
        check=True,
        capture_output=True,
    )
    parts = sorted(tmp_path.glob("GLM-5-*.gguf"))
    assert [p.name for p in parts] == [f"GLM-5-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    split = load_model_facts(str(parts[0]))
    whole = load_model_facts(str(glm5_gguf))
    assert split.weight_bytes == whole.weight_bytes
    assert split.layers == whole.layers
    assert "3 parts" in split.provenance["weight_bytes"]
    assert sum(len(read_gguf_header(p).tensors) for p in parts) == len(read_gguf_header(glm5_gguf).tensors)


def test_split_gguf_weight_bytes_sum_over_parts(tmp_path: Path) -> None:
    parts = gguf_builders.llama_70b_gguf(tmp_path / "llama.gguf", parts=3)
    assert len(parts) == 3
    tensors = [("rope_freqs.weight", (64,), "F32"), *gguf_builders.block_tensors(80, 8192, kv_width=1024)]
    expected = sum(gguf_builders.tensor_nbytes(shape, kind) for _, shape, kind in tensors)
    assert load_model_facts(str(parts[0])).weight_bytes == expected
    per_part = [sum(t.nbytes for t in read_gguf_header(p).tensors) for p in parts]
    assert all(size > 0 for size in per_part) and sum(per_part) == expected


def test_split_gguf_part_missing(tmp_path: Path) -> None:
    parts = gguf_builders.llama_70b_gguf(tmp_path / "llama.gguf", parts=3)
    parts[1].unlink()
    with pytest.raises(ModelFactsError, match=r"^split GGUF part missing: .*llama-00002-of-00003\.gguf$"):
        load_model_facts(str(parts[0]))


def test_llama_gguf_matches_the_hf_config(tmp_path: Path) -> None:
    (path,) = gguf_builders.llama_70b_gguf(tmp_path / "llama.gguf")
    gguf_facts, hf_facts = load_model_facts(str(path)), load_model_facts(str(MODELS / "llama-3.1-70b"))
    assert gguf_facts.layers == hf_facts.layers
    assert derived_max_model_len(gguf_facts) == derived_max_model_len(hf_facts)
    assert gguf_facts.quantization == "Q4_K"  # no general.file_type: the dominant tensor type


def test_gemma3_gguf_matches_the_hf_config(tmp_path: Path) -> None:
    (path,) = gguf_builders.gemma3_27b_gguf(tmp_path / "gemma.gguf")
    gguf_facts, hf_facts = load_model_facts(str(path)), load_model_facts(str(MODELS / "gemma-3-27b"))
    assert gguf_facts.layers == hf_facts.layers
    assert derived_max_model_len(gguf_facts) == (131072, "max_position_embeddings")  # gemma3: factor skipped


def test_qwen3next_gguf_matches_the_hf_config(tmp_path: Path) -> None:
    (path,) = gguf_builders.qwen3_next_gguf(tmp_path / "qwen3next.gguf")
    gguf_facts, hf_facts = load_model_facts(str(path)), load_model_facts(str(MODELS / "qwen3-next-80b-a3b"))
    assert gguf_facts.layers == hf_facts.layers
    assert derived_max_model_len(gguf_facts) == derived_max_model_len(hf_facts)


@pytest.mark.parametrize("old_mha_dims", [False, True])
def test_deepseek2_gguf_is_mla_in_both_layouts(tmp_path: Path, old_mha_dims: bool) -> None:
    (path,) = gguf_builders.deepseek_v3_gguf(tmp_path / "dsv3.gguf", old_mha_dims=old_mha_dims)
    gguf_facts, hf_facts = load_model_facts(str(path)), load_model_facts(str(MODELS / "deepseek-v3"))
    assert gguf_facts.layers == hf_facts.layers
    assert gguf_facts.qk_nope_head_dim == 128
    assert derived_max_model_len(gguf_facts, (0, 33, 0))[0] == 163840
    assert derived_max_model_len(gguf_facts, (0, 11, 0))[0] == 163840


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ModelFactsError, match=r"model\.bin: not a GGUF file \(magic b'PK\\x03\\x04'\)$"):
        load_model_facts(str(path))


def test_truncated_gguf_header(tmp_path: Path) -> None:
    (path,) = gguf_builders.gemma3_27b_gguf(tmp_path / "gemma.gguf")
    header_end = read_gguf_header(path).data_start
    with path.open("r+b") as handle:
        handle.truncate(header_end // 2)
    with pytest.raises(ModelFactsError, match=r"gemma\.gguf: truncated GGUF header"):
        load_model_facts(str(path))


def test_truncated_gguf_data(tmp_path: Path) -> None:
    (path,) = gguf_builders.gemma3_27b_gguf(tmp_path / "gemma.gguf")
    with path.open("r+b") as handle:
        handle.truncate(os.path.getsize(path) - 4096)
    with pytest.raises(
        ModelFactsError, match=r"gemma\.gguf: truncated GGUF file \(tensor data ends at byte \d+"
    ):
        load_model_facts(str(path))


def test_gguf_without_layer_count(tmp_path: Path) -> None:
    (path,) = gguf_builders.write_gguf(tmp_path / "x.gguf", "mystery", {"context_length": 4096}, [])
    with pytest.raises(
        ModelFactsError,
        match=r"\(arch 'mystery'\) lacks mystery\.block_count, mystery\.attention\.head_count$",
    ):
        load_model_facts(str(path))


# --- transformers defaults read from source ---


@pytest.mark.parametrize(
    "model_type",
    ["gemma3_text", "glm_moe_dsa", "glm4_moe_lite", "deepseek_v3", "qwen3_next", "gpt_oss", "llama", "qwen3"],
)
def test_static_defaults_equal_the_imported_class(model_type: str) -> None:
    from transformers import CONFIG_MAPPING

    static = transformers_defaults(model_type)
    assert static is not None
    instance = CONFIG_MAPPING[model_type]()
    assert static.class_name == type(instance).__name__
    keys = (
        "max_position_embeddings",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "sliding_window",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "index_topk",
        "index_head_dim",
        "num_nextn_predict_layers",
        "linear_num_value_heads",
        "linear_key_head_dim",
    )
    compared = 0
    for key in keys:
        # None: __post_init__ derives it; Qwen3Config nulls sliding_window unless use_sliding_window.
        # model_files/hf.py applies both rules itself (tested above).
        if static.values.get(key) is not None and (model_type, key) != ("qwen3", "sliding_window"):
            assert static.values[key] == getattr(instance, key), key
            compared += 1
    assert compared >= 3
