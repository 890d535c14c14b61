"""A change to a length this host has not compiled is planned for its cold first boot (issue 34, §1).

vLLM's compile-cache key takes max_model_len (config/model.py:L457-L507 leaves it out of the ignored
factors; compilation/backends.py:L1062 keys the cache by vllm_config.compute_hash()), and the cold
compile runs inside the profiling window (v1/worker/gpu_worker.py:L685-L700): the first boot at a new
length gets a smaller KV pool (vLLM #54122, #54383). The extra peak is learned from a cold and a warm
boot of one configuration in this service's journal, else estimated per release, and said to be an
estimate. The planner is pure: the observations come in as data."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.core.test_plan import OBSERVED, SERVICE, TARGET, eight_gpus, glm5, options
from tests.harness.test_standin import FAST, TINY
from tests.support.paths import REPO
from tests.support.standin import launch
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.budget import MIB
from vllm_ctxmgr.core.cold_boot import cold_boot
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.core.plan import Plan, make_plan
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.report import plan_text
from vllm_ctxmgr.vllm_log.watcher import observe_start

MODELS = REPO / "examples" / "models"

UNIT = replace(SERVICE, gpu_memory_utilization=0.9)  # runs at 8192, the length its starts logged
WARM = replace(OBSERVED, compile_cache="hit", available_kv_gib=24.5)
COLD = replace(OBSERVED, compile_cache="miss", available_kv_gib=21.0)  # 3.5 GiB more peak


def plan(*starts: Observation, target: int = TARGET, rule: bool = True, **kw: object) -> Plan:
    return make_plan(glm5(), UNIT, eight_gpus(), options(target, cold_boot_rule=rule, **kw), list(starts))


def budget(p: Plan) -> int:
    assert p.gpus[0].kv_budget.bytes is not None
    return p.gpus[0].kv_budget.bytes


def test_a_new_length_takes_the_cold_boots_budget_learned_from_a_cold_and_a_warm_boot() -> None:
    at_09 = {"fixed_gpu_memory_utilization": 0.9}
    warm_plan = plan(COLD, WARM, rule=False, **at_09)
    cold_plan = plan(COLD, WARM, **at_09)
    assert budget(warm_plan) == int(24.5 * GIB)  # calibration keeps the warm start's budget
    assert budget(warm_plan) - budget(cold_plan) == int(3.5 * GIB)  # the first boot's, 3.5 GiB less
    assert cold_plan.cold_boot is not None and not cold_plan.cold_boot.estimate
    note = "first boot at 200,000 compiles cold: 3.50 GiB less KV than a warm boot"
    assert any(n.startswith(note) and "learned" in n for n in cold_plan.notes)
    assert note in plan_text(cold_plan)
    record = json.loads(json.dumps(cold_plan.to_json()))["cold_boot"]
    assert record == {
        "max_model_len": 200_000,
        "extra_bytes": int(3.5 * GIB),
        "source": "learned: a cold boot at 8,192 had 21.0 GiB, a warm one 24.5 GiB",
        "estimate": False,
    }
    assert "cold compile" in cold_plan.gpus[0].activation_peak.source  # the non-KV line carries it
    assert json.loads(json.dumps(warm_plan.to_json()))["cold_boot"] is None


def test_without_a_pair_the_per_release_rule_is_used_and_said_to_be_an_estimate() -> None:
    p = plan(WARM, fixed_gpu_memory_utilization=0.9)
    assert p.cold_boot is not None and p.cold_boot.estimate
    assert p.cold_boot.extra_bytes == -(-int(24.5 * GIB) * 5 // 100)  # 5% of the warm budget, rounded up
    assert budget(p) == int(24.5 * GIB) - p.cold_boot.extra_bytes
    assert "estimate" in p.cold_boot.source and "gpu_worker.py:L685-L700" in p.cold_boot.source
    assert "#54383" in p.cold_boot.source


def test_the_verdict_and_utilisation_hold_for_the_cold_boot() -> None:
    colder = replace(COLD, available_kv_gib=18.0)  # 6.5 GiB more peak when it compiles
    # at the unit's 0.9: a warm boot would hold 200,000 tokens, the cold first boot would not
    assert plan(colder, WARM, rule=False, fixed_gpu_memory_utilization=0.9).feasible
    refused = plan(colder, WARM, fixed_gpu_memory_utilization=0.9)
    assert not refused.feasible and refused.result == "infeasible"
    # searched: the utilisation chosen is the one the cold boot needs, higher than a warm one's
    warm_u = plan(colder, WARM, rule=False).gpu_memory_utilization
    cold_u = plan(colder, WARM).gpu_memory_utilization
    assert warm_u is not None and cold_u is not None and cold_u > warm_u
    chosen = plan(colder, WARM)
    assert chosen.feasible and (chosen.gpus[0].headroom.bytes or 0) >= 0  # for the cold boot


def test_a_length_compiled_here_a_cache_never_seen_and_eager_starts_are_warm() -> None:
    assert plan(COLD, WARM, target=8192).cold_boot is None  # 8192 is in the cache now
    unsaid = replace(WARM, compile_cache=None)  # no compile-cache line: no cache to miss
    assert plan(unsaid).cold_boot is None
    eager = replace(UNIT, enforce_eager=True)
    p = make_plan(glm5(), eager, eight_gpus(), options(TARGET), [WARM])
    assert p.cold_boot is None


def test_a_budget_a_cold_boot_logged_is_not_made_colder() -> None:
    # the only start with a budget compiled: its budget is already the first boot's
    p = plan(COLD, fixed_gpu_memory_utilization=0.9)
    assert p.cold_boot is None and budget(p) == int(21.0 * GIB)


def test_the_rule_is_pure_data_in_data_out() -> None:
    assert cold_boot(200_000, [WARM], None, (0, 33, 0), compiles=True) is None  # uncalibrated
    learned = cold_boot(200_000, [COLD, WARM], int(24.5 * GIB), (0, 33, 0), compiles=True)
    assert learned is not None and learned.extra_bytes == int(3.5 * GIB)
    # a pair at another utilisation is not a pair: the estimate stands
    other = replace(WARM, gpu_memory_utilization=0.8)
    estimated = cold_boot(200_000, [COLD, other], int(24.5 * GIB), (0, 33, 0), compiles=True)
    assert estimated is not None and estimated.estimate


# --- pinning the pool instead: --kv-cache-memory-bytes ------------------------------------------


def test_a_cold_boot_plan_offers_to_pin_the_pool_and_says_what_that_gives_up() -> None:
    p = plan(COLD, WARM, fixed_gpu_memory_utilization=0.9)
    pool = int(24.5 * GIB) // MIB * MIB  # the warm budget at the unit's 0.9, whole MiB
    offer = next(n for n in p.notes if n.startswith("or pin the pool"))
    assert f"--kv-cache-memory-bytes {pool} (`--pin-kv-cache-memory`)" in offer
    assert "#47356" in offer and "no longer profiles" in offer and "co-tenant that grows" in offer


def test_a_pinned_pool_is_the_warm_one_on_the_first_boot_too() -> None:
    colder = replace(COLD, available_kv_gib=18.0)
    assert not plan(colder, WARM, fixed_gpu_memory_utilization=0.9).feasible  # the cold boot's pool
    pinned = plan(colder, WARM, fixed_gpu_memory_utilization=0.9, pin_kv_cache_memory=True)
    pool = int(24.5 * GIB) // MIB * MIB
    assert pinned.feasible and pinned.cold_boot is None  # the compile runs before the pool is set
    assert pinned.flag_changes["--kv-cache-memory-bytes"] == str(pool)
    assert budget(pinned) == pool
    assert any("no longer profiles" in n for n in pinned.notes)
    # the unit's own pin stays: pinning twice writes nothing new
    again = make_plan(
        glm5(),
        replace(UNIT, kv_cache_memory_bytes=pool),
        eight_gpus(),
        options(TARGET, pin_kv_cache_memory=True),
        [colder, WARM],
    )
    assert "--kv-cache-memory-bytes" not in again.flag_changes


def test_pinning_is_refused_on_a_plan_no_start_calibrated() -> None:
    with pytest.raises(UsageError, match="needs a plan calibrated by a start of this service"):
        make_plan(glm5(), UNIT, eight_gpus(), options(TARGET, pin_kv_cache_memory=True), [])
    result = CliRunner().invoke(
        main,
        ["plan", "100000", "--model", str(MODELS / "llama-3.1-70b"), "-tp", "4", "--gpu-name",
         "NVIDIA H100 80GB HBM3", "--gpu-memory", "80G", "--gpu-count", "4", "--pin-kv-cache-memory"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "needs a plan calibrated" in result.output


# --- the stand-in's cold and warm boots, read as the journal would be ----------------------------


def test_the_standins_cold_boot_peaks_higher_and_the_pair_teaches_the_planner(tmp_path: Path) -> None:
    """The stand-in under VLLM_CACHE_ROOT: the first boot at a length prints vLLM's compile (miss) line
    and a budget smaller by its cold peak; the same boot again prints the load-from-cache (hit) line and
    the warm budget. Read by the watcher, the pair gives the planner the learned extra peak."""
    env = {**FAST, "VLLM_CACHE_ROOT": str(tmp_path), "CTXMGR_STANDIN_COLD_PEAK_GIB": "2.5"}

    def boot() -> Observation:
        with launch([TINY, "--max-model-len", "1024"], env=env) as standin:
            assert standin.wait_ready(30), standin.lines[-5:]
            return observe_start(standin.lines)

    cold, warm = boot(), boot()
    assert (cold.compile_cache, warm.compile_cache) == ("miss", "hit")
    assert cold.available_kv_gib is not None and warm.available_kv_gib is not None
    assert round(warm.available_kv_gib - cold.available_kv_gib, 2) == 2.5
    learned = cold_boot(200_000, [cold, warm], int(warm.available_kv_gib * GIB), (0, 33, 0), compiles=True)
    assert learned is not None and not learned.estimate
    assert abs(learned.extra_bytes - 2.5 * GIB) <= 0.01 * GIB  # the logged figures' two decimals
    # pinned: the pool is the same on the cold and the warm boot (the compile runs before it is set)
    pinned = [TINY, "--max-model-len", "4096", "--kv-cache-memory-bytes", "20G"]
    starts = []
    for _ in range(2):
        with launch(pinned, env=env) as standin:
            assert standin.wait_ready(30), standin.lines[-5:]
            starts.append(observe_start(standin.lines))
    assert [s.compile_cache for s in starts] == ["miss", "hit"]
    assert starts[0].kv_cache_tokens == starts[1].kv_cache_tokens is not None
