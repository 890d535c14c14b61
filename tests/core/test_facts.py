"""vLLM's derived maximum model length, on ModelFacts built by hand (no I/O)."""

from __future__ import annotations

import pytest

from vllm_ctxmgr.core.facts import (
    LayerFacts,
    LayerKind,
    ModelFacts,
    RopeFacts,
    auto_dtype,
    default_max_model_len,
    derived_max_model_len,
)

V0_11 = (0, 11, 0)
V0_33 = (0, 33, 0)


def facts(
    limits: tuple[tuple[str, int], ...] = (("max_position_embeddings", 40960),),
    rope: tuple[RopeFacts, ...] = (),
    model_type: str = "qwen3",
    sliding_window: int | None = None,
) -> ModelFacts:
    return ModelFacts(
        source="test",
        source_format="hf",
        model_type=model_type,
        architectures=(),
        num_attention_heads=8,
        layers=(LayerFacts(LayerKind.FULL, 8, 128, 128),),
        dtype="bfloat16",
        position_limits=limits,
        rope=rope,
        sliding_window=sliding_window,
    )


def test_minimum_over_the_keys_present_names_the_smallest() -> None:
    model = facts((("max_position_embeddings", 8192), ("seq_length", 4096), ("max_seq_len", 16384)))
    assert derived_max_model_len(model) == (4096, "seq_length")


def test_model_max_length_overrides_even_a_smaller_key() -> None:
    model = facts((("max_position_embeddings", 8192), ("model_max_length", 131072)))
    assert derived_max_model_len(model) == (131072, "model_max_length")


def test_no_key_falls_back_to_2048() -> None:
    assert derived_max_model_len(facts(())) == (2048, "default")


def test_disable_sliding_window_caps_at_the_window() -> None:
    model = facts((("max_position_embeddings", 131072),), sliding_window=4096, model_type="mistral")
    assert derived_max_model_len(model, V0_33, disable_sliding_window=True) == (4096, "sliding_window")
    assert derived_max_model_len(model, V0_33) == (131072, "max_position_embeddings")


def test_qwen3_user_yarn_override_differs_between_versions() -> None:
    """max_position_embeddings 40960 + yarn x4 from 32768: 0.11 scaled it, 0.33 does not."""
    model = facts(rope=(RopeFacts("yarn", 4.0, 32768),))
    assert derived_max_model_len(model, V0_33) == (40960, "max_position_embeddings")
    assert derived_max_model_len(model, V0_11) == (131072, "max_position_embeddings")


def test_deepseek_v3_yarn_agrees_in_both_versions() -> None:
    model = facts((("max_position_embeddings", 163840),), (RopeFacts("yarn", 40.0, 4096),), "deepseek_v3")
    assert derived_max_model_len(model, V0_33)[0] == 163840
    assert derived_max_model_len(model, V0_11)[0] == 163840


@pytest.mark.parametrize("version", [V0_11, V0_33])
def test_linear_and_dynamic_factors_are_multiplied(version: tuple[int, int, int]) -> None:
    assert derived_max_model_len(facts(rope=(RopeFacts("linear", 2.0),)), version)[0] == 81920
    assert derived_max_model_len(facts(rope=(RopeFacts("dynamic", 4.0),)), version)[0] == 163840


@pytest.mark.parametrize("version", [V0_11, V0_33])
def test_llama3_and_longrope_are_exempt(version: tuple[int, int, int]) -> None:
    assert derived_max_model_len(facts(rope=(RopeFacts("llama3", 8.0, 8192),)), version)[0] == 40960
    assert derived_max_model_len(facts(rope=(RopeFacts("longrope", 32.0, 4096),)), version)[0] == 40960


def test_gemma3_skips_rope_scaling() -> None:
    limits = (("max_position_embeddings", 131072),)
    rope = (RopeFacts("linear", 8.0), RopeFacts("default"))
    assert derived_max_model_len(facts(limits, rope, "gemma3_text"))[0] == 131072
    assert derived_max_model_len(facts(limits, rope, "llama"))[0] == 131072 * 8


def test_0_33_keeps_the_last_non_exempt_factor_not_a_product() -> None:
    rope = (RopeFacts("linear", 2.0), RopeFacts("default"), RopeFacts("linear", 3.0))
    assert derived_max_model_len(facts(rope=rope))[0] == 40960 * 3


def test_default_rope_changes_nothing() -> None:
    assert derived_max_model_len(facts(rope=(RopeFacts("default"),)), V0_11)[0] == 40960
    assert derived_max_model_len(facts(rope=(RopeFacts("default"),)), V0_33)[0] == 40960


def test_0_11_refuses_disabled_sliding_window_with_rope_scaling() -> None:
    model = facts(rope=(RopeFacts("linear", 2.0),), sliding_window=4096)
    with pytest.raises(ValueError, match="Disabling sliding window is not supported"):
        derived_max_model_len(model, V0_11, disable_sliding_window=True)
    assert derived_max_model_len(model, V0_33, disable_sliding_window=True) == (8192, "sliding_window")


def test_longrope_serves_the_original_length_by_default() -> None:
    model = facts((("max_position_embeddings", 131072),), (RopeFacts("longrope", None, 4096),), "phi3")
    assert derived_max_model_len(model) == (131072, "max_position_embeddings")
    assert default_max_model_len(model) == 4096
    assert default_max_model_len(facts()) == 40960


def test_auto_dtype_downcasts_float32() -> None:
    assert auto_dtype("float32") == "bfloat16"
    assert auto_dtype(None) == "bfloat16"
    assert auto_dtype("float16") == "float16"
    assert auto_dtype("bfloat16", bfloat16_supported=False) == "float16"
    assert auto_dtype("float32", bfloat16_supported=False) == "float16"
