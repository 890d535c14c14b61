"""A vLLM upgrade moves capacity (issue 34, section 4): the same unit planned under two releases' rules
(core/upgrade.py), the verdict and the textfile that report it. Quick tier: the planner and the
verdict are pure; verify's gathering end to end is in test_verify.py (sandbox)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.core.test_plan import SERVICE, eight_gpus, glm5, options
from tests.core.test_verdict import facts, observation  # noqa: F401 (the fixture)
from vllm_ctxmgr.core.plan import make_plan
from vllm_ctxmgr.core.upgrade import CapacityMove
from vllm_ctxmgr.core.verdict import DEGRADED, OK, decide
from vllm_ctxmgr.monitor.metrics import write_textfile


def plans(
    before: tuple[int, ...], after: tuple[int, ...], target: int = 8192, utilization: float = 0.90
) -> CapacityMove:
    unit = replace(SERVICE, gpu_memory_utilization=utilization)
    fixed = {"fixed_gpu_memory_utilization": utilization}
    old = make_plan(glm5(), unit, eight_gpus(), options(target, vllm_version=before, **fixed))
    new = make_plan(glm5(), unit, eight_gpus(), options(target, vllm_version=after, **fixed))
    return CapacityMove.between(old, new)


def test_cuda_graphs_entering_the_kv_budget_at_0_20_shrink_the_pool_and_the_move_says_by_how_much() -> None:
    move = plans((0, 11, 0), (0, 20, 0))
    before, after = move.kv_cache_tokens_before, move.kv_cache_tokens_after
    assert before is not None and after is not None and after < before  # graphs now come out of the pool
    assert move.moved and move.fits_before and move.fits_after
    assert move.kv_cache_tokens_ratio == round(after / before, 4)
    assert move.max_concurrency_after is not None and move.max_concurrency_before is not None
    assert move.max_concurrency_after < move.max_concurrency_before
    text = move.text()
    assert text.startswith(f"vLLM 0.11.0 -> 0.20.0: KV cache size {before:,} -> {after:,} tokens (-")
    assert "max_model_len 8,192 still fits" in text
    assert CapacityMove.from_json(move.to_json()) == move


def test_the_same_rules_move_nothing() -> None:
    move = plans((0, 32, 0), (0, 33, 0))
    assert move.kv_cache_tokens_ratio == 1.0 and not move.moved
    assert "capacity unmoved" in move.text()


def test_a_context_that_no_longer_fits_under_the_new_release_is_said() -> None:
    # at 0.76 of each GPU, 200,000 tokens fit beside the CUDA graphs in the slack, not with them in the pool
    move = plans((0, 11, 0), (0, 20, 0), 200_000, 0.76)
    assert move.fits_before and not move.fits_after
    assert move.text().endswith("; max_model_len 200,000 no longer fits")


def upgraded(seen: dict[str, Any], move: CapacityMove):  # type: ignore[no-untyped-def]
    """The CPU vLLM of test_verdict.facts, its next start under another release."""
    return facts(seen, vllm_upgrade=move.to_json())


def test_verify_reports_what_an_upgrade_moved_as_degraded(observation: dict[str, Any]) -> None:  # noqa: F811
    assert decide(facts(observation)).result == OK  # the same facts without the upgrade
    move = plans((0, 11, 0), (0, 20, 0))
    verification = decide(upgraded(observation, move))
    assert verification.result == DEGRADED
    (reason,) = verification.reasons
    assert reason == f"{move.text()} (`ctxmgr plan --service vllm-tiny` plans under it)"
    assert verification.to_json()["vllm_upgrade"] == move.to_json()


def test_an_upgrade_that_moved_nothing_is_reported_but_not_degraded(observation: dict[str, Any]) -> None:  # noqa: F811
    verification = decide(upgraded(observation, plans((0, 32, 0), (0, 33, 0))))
    assert verification.result == OK and verification.vllm_upgrade is not None


def test_the_textfile_carries_the_upgrades_ratio_and_fit(observation: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    move = plans((0, 11, 0), (0, 20, 0))
    path = write_textfile(tmp_path / "vllm-tiny.prom", decide(upgraded(observation, move)))
    samples = {s.name: s.value for f in text_string_to_metric_families(path.read_text()) for s in f.samples}
    assert samples["ctxmgr_verify_vllm_upgrade_kv_cache_tokens_ratio"] == move.kv_cache_tokens_ratio
    assert samples["ctxmgr_verify_vllm_upgrade_context_fits"] == 1.0
    plain = write_textfile(tmp_path / "plain.prom", decide(facts(observation))).read_text()
    assert "ctxmgr_verify_vllm_upgrade_kv_cache_tokens_ratio{" not in plain  # unknown: left out, not 0
