"""What a change that vLLM refused and ctxmgr rolled back tells the operator (issue 35): the advice is
at the utilisation vLLM's estimate holds at, and the headline says which revision failed and that the
unit from before it is back. The demo's forced change (examples/demo.py, revision 2: 202,752 tokens at
0.80 while revision 1 runs 0.93) is the case; the sandbox reaches it only in the demo and the
stand-in tier, so the texts are checked here in the quick tier."""

from __future__ import annotations

from vllm_ctxmgr.change.states import ChangeResult, Result
from vllm_ctxmgr.change.walk import estimate_advice
from vllm_ctxmgr.errors import ExitCode
from vllm_ctxmgr.report import change_text

SERVICE = "vllm-glm5"


def test_the_advice_after_a_forced_utilisation_keeps_the_utilisation_the_estimate_holds_at() -> None:
    advice = estimate_advice(SERVICE, 79680, tried=0.8, runs_again=0.93)
    assert advice.startswith(
        "vLLM estimates the largest max_model_len that fits at gpu_memory_utilization 0.8 (the one this "
        "change tried) is 79680: try `ctxmgr set-context 79680 --gpu-memory-utilization 0.8 --service "
        "vllm-glm5`"
    )
    assert "vllm-glm5 runs at 0.93 again, where that estimate does not hold" in advice
    assert "`ctxmgr plan 79680 --service vllm-glm5`" in advice


def test_the_advice_at_the_utilisation_the_service_runs_again_is_plain() -> None:
    for tried, runs_again in ((0.9, 0.9), (None, 0.9), (0.9, None)):
        assert estimate_advice(SERVICE, 79680, tried, runs_again) == (
            "vLLM estimates the largest max_model_len that fits is 79680: try `ctxmgr set-context 79680 "
            "--service vllm-glm5`, or free GPU memory / raise --gpu-memory-utilization"
        )


def test_the_rolled_back_headline_names_the_failed_revision_and_the_unit_put_back() -> None:
    result = ChangeResult(
        SERVICE, "set-context", Result.ROLLED_BACK, False, exit_code=ExitCode.ERROR, revision=2,
        previous_max_model_len=200_000, previous_gpu_memory_utilization=0.93,
        max_model_len=202_752, gpu_memory_utilization=0.8, reason="the KV cache is too small",
    )  # fmt: skip
    text = change_text(result)
    assert (
        "vllm-glm5: the change to max_model_len 202,752 / gpu_memory_utilization 0.8 (revision 2) FAILED "
        "and was rolled back: the unit from before it is in place again, max_model_len 200,000 / "
        "gpu_memory_utilization 0.93. Why: the KV cache is too small"
    ) in text
    assert "rolled back to" not in text
