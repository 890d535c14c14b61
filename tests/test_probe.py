"""The probe over real HTTP against the stand-in: what passes, what fails, and what it says."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.standin import StandinProcess, free_port, launch
from vllm_ctxmgr.masking import mask
from vllm_ctxmgr.probe import probe, wait_until_serving

FAST = {
    "CTXMGR_STANDIN_TIME_SCALE": "0",
    "CTXMGR_STANDIN_SHARDS": "8",
    "CTXMGR_STANDIN_TOKEN_DELAY_S": "0.001",
}
KEY = "sk-probe-secret-4f1c"
GLM = ["zai-org/GLM-5-FP8", "-tp", "8", "--served-model-name", "glm-5"]


@pytest.fixture(scope="module")
def server() -> Iterator[StandinProcess]:
    with launch([*GLM, "--max-model-len", "200000", "--api-key", KEY], env=FAST) as standin:
        assert standin.wait_ready(30)
        yield standin


@pytest.fixture(scope="module")
def small() -> Iterator[StandinProcess]:
    with launch(["/srv/vllm/models/tiny-llama", "--max-model-len", "4096"], env=FAST) as standin:
        assert standin.wait_ready(30)
        yield standin


def test_probe_passes_on_the_new_context(server: StandinProcess) -> None:
    result = probe(server.url, api_key=KEY, expected_max_model_len=200_000, timeout=10)
    assert result.ok, result.error
    assert [step.name for step in result.steps] == ["health", "models", "tokenize", "context_completion"]
    assert all(step.ok and step.status == 200 for step in result.steps)
    assert (result.model_id, result.max_model_len) == ("glm-5", 200_000)
    assert result.prompt_tokens == 8  # the probe prompt, counted by the server's /tokenize
    assert "admitted prompt + max_tokens = 200000 tokens" in result.steps[-1].detail
    assert result.latency_s >= sum(step.latency_s for step in result.steps) * 0.99
    # the completion was cut after its first token: the server logged one 200, not 200K tokens of waiting
    assert result.steps[-1].latency_s < 5


def test_long_probe_prefills_ninety_percent(small: StandinProcess) -> None:
    result = probe(small.url, expected_max_model_len=4096, long_probe=True, timeout=30)
    assert result.ok, result.error
    step = result.step("long_prompt")
    assert step is not None and step.ok
    assert "prefilled 3686 prompt tokens (target 3686)" in step.detail


def test_max_model_len_mismatch_fails_at_the_model_card(server: StandinProcess) -> None:
    result = probe(server.url, api_key=KEY, expected_max_model_len=131_072, timeout=10)
    assert not result.ok
    assert [step.name for step in result.steps] == ["health", "models"]
    assert result.error == ("/v1/models: vLLM reports max_model_len=200000 for glm-5, expected 131072")
    assert result.max_model_len == 200_000


def test_request_above_the_context_quotes_vllms_400(server: StandinProcess) -> None:
    result = probe(server.url, api_key=KEY, expected_max_model_len=200_000, probe_tokens=250_000, timeout=10)
    assert not result.ok
    step = result.step("context_completion")
    assert step is not None and step.status == 400
    assert result.error == (
        "/v1/completions (max_tokens=250000): 400 Bad Request: max_tokens=250000 cannot be greater than "
        "max_model_len=200000. Please request fewer output tokens. (parameter=max_tokens, value=250000)"
    )


def test_long_prompt_above_a_smaller_context_is_rejected(small: StandinProcess) -> None:
    """A server still on 4096 while 8192 was meant: caught by the card, and by vLLM's own 400 too."""
    result = probe(small.url, expected_max_model_len=8192, timeout=10)
    assert not result.ok and result.step("models") is not None
    assert "max_model_len=4096" in (result.error or "")
    forced = probe(small.url, expected_max_model_len=4096, probe_tokens=8192, timeout=10)
    assert forced.step("context_completion").status == 400  # type: ignore[union-attr]
    assert "cannot be greater than max_model_len=4096" in (forced.error or "")


def test_wrong_key_is_a_401_and_no_key_is_ever_shown(server: StandinProcess) -> None:
    wrong = "sk-wrong-key-77aa"
    result = probe(server.url, api_key=wrong, expected_max_model_len=200_000, timeout=10)
    assert not result.ok
    models = result.step("models")
    assert models is not None and models.status == 401
    assert result.error == "/v1/models: 401 Unauthorized: Unauthorized"
    good = probe(server.url, api_key=KEY, expected_max_model_len=200_000, timeout=10)
    for outcome, key in ((result, wrong), (good, KEY)):
        assert key not in repr(outcome)


def test_mask_secret() -> None:
    assert mask(f"Bearer {KEY} rejected", [KEY]) == "Bearer *** rejected"
    assert mask("nothing to hide", []) == "nothing to hide"


def test_server_down() -> None:
    port = free_port()
    result = probe(f"http://127.0.0.1:{port}", expected_max_model_len=1024, timeout=2)
    assert not result.ok
    assert [(step.name, step.status) for step in result.steps] == [("health", None)]
    assert result.error is not None and result.error.startswith("/health: cannot connect")


def test_wait_until_serving_follows_a_start() -> None:
    down = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert wait_until_serving(down, time.monotonic() + 0.3, interval_s=0.05) is False
    assert time.monotonic() - started < 2
    env = {**FAST, "CTXMGR_STANDIN_TIME_SCALE": "0.2"}  # a ~1 s start: /health refuses until it serves
    with launch(["/srv/vllm/models/tiny-llama", "--max-model-len", "1024"], env=env) as standin:
        assert wait_until_serving(standin.url, time.monotonic() + 30, interval_s=0.05)
        assert standin.wait_ready(5)  # uvicorn's line was printed before /health answered
        result = probe(standin.url, expected_max_model_len=1024, timeout=10)
        assert result.ok, result.error
