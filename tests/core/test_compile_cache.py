"""Every observation says whether its boot compiled cold or loaded warm (issue 34, section 1), and
calibration never takes a cold boot's KV budget as a warm start's: a cold boot's torch.compile peaks
higher while vLLM profiles, so its pool is smaller (vLLM #54383, #54122).

The compile lines are the stand-in's, which prints vLLM's own hit and miss lines under VLLM_CACHE_ROOT
(compilation/backends.py, as tests/harness/test_standin.py checks); the planner is pure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.core.test_plan import OBSERVED, SERVICE, eight_gpus, glm5, options
from tests.harness.test_standin import FAST, TINY
from tests.support.standin import launch
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.observations import ObservationError, ObservationRecord
from vllm_ctxmgr.core.plan import make_plan
from vllm_ctxmgr.vllm_log.watcher import observe_start


def test_a_boot_that_compiled_is_cold_one_that_loaded_the_cache_is_warm(tmp_path: Path) -> None:
    env = {**FAST, "VLLM_CACHE_ROOT": str(tmp_path)}

    def boot(max_model_len: str, extra: dict[str, str] | None = None) -> str | None:
        with launch([TINY, "--max-model-len", max_model_len], env={**env, **(extra or {})}) as standin:
            assert standin.wait_ready(30), standin.lines[-5:]
            return observe_start(standin.lines).compile_cache

    assert boot("1024") == "miss"  # the first boot at this length compiles
    assert boot("1024") == "hit"  # the same config again loads what it compiled
    assert boot("2048") == "miss"  # a new length is a new compile hash
    with launch([TINY], env=FAST) as standin:  # no cache root: no compile-cache line, nothing said
        assert standin.wait_ready(30)
        assert observe_start(standin.lines).compile_cache is None


def test_the_flag_is_stored_and_read_back_and_only_hit_or_miss_comes_in() -> None:
    record = ObservationRecord(replace(OBSERVED, compile_cache="miss"), service="vllm-glm5", time=5.0)
    line = record.to_json()
    assert line["compile_cache"] == "miss"
    assert ObservationRecord.from_json(line, "observations.jsonl").observation.compile_cache == "miss"
    with pytest.raises(ObservationError, match="compile_cache is not one of hit, miss"):
        ObservationRecord.from_json({**line, "compile_cache": "lukewarm"}, "observations.jsonl")


WARM = replace(OBSERVED, compile_cache="hit", available_kv_gib=24.5)
COLD = replace(OBSERVED, compile_cache="miss", available_kv_gib=21.0)  # the higher compile peak


def budget(*starts: object) -> tuple[int | None, list[str]]:
    """The plan's KV budget per GPU at the starts' own utilisation (0.9): the budget a start logged, at
    the length they started at (compiled here: no cold first boot, tests/core/test_cold_boot.py)."""
    unit = replace(SERVICE, gpu_memory_utilization=0.9)
    at_09 = options(SERVICE.max_model_len, fixed_gpu_memory_utilization=0.9)
    plan = make_plan(glm5(), unit, eight_gpus(), at_09, list(starts))  # type: ignore[arg-type]
    return plan.gpus[0].kv_budget.bytes, list(plan.notes)


def test_a_later_cold_boot_is_not_taken_as_the_warm_budget() -> None:
    warm, _ = budget(WARM)
    assert warm == int(24.5 * GIB)
    after_cold, notes = budget(WARM, COLD)
    assert after_cold == warm  # the warm start's figure, not the cold one that came after it
    assert any("a later cold boot's KV budget" in note for note in notes)
    cold_only, _ = budget(COLD)
    assert cold_only == int(21.0 * GIB)  # what it would have taken: the flag moves the plan
    # a start whose log said nothing of the cache counts as before (not a cold one)
    unsaid, _ = budget(WARM, replace(COLD, compile_cache=None))
    assert unsaid == cold_only


def test_a_cold_boot_alone_is_taken_and_said_to_be_cold() -> None:
    taken, notes = budget(COLD)
    assert taken == int(21.0 * GIB)  # no warm start to take: the cold one is the best figure there is
    assert any("KV budget from a cold boot" in note for note in notes)
