"""set-context's answers that write nothing, on a real plan: the unit already has the target (unchanged),
the target does not fit (infeasible, with the best alternative), or --force goes on. The sandbox reaches
these only in the vLLM and multi-node tiers; here each is checked in the quick tier."""

from __future__ import annotations

from dataclasses import replace

from tests.core.test_plan import SERVICE, TARGET, eight_gpus, glm5, gpu, options
from vllm_ctxmgr.change.states import ChangeResult, Result
from vllm_ctxmgr.change.walk import SetContextRequest, _already_set, _kept_or_infeasible
from vllm_ctxmgr.core.hardware import GIB
from vllm_ctxmgr.core.plan import Plan, make_plan
from vllm_ctxmgr.errors import ExitCode

NAME = "vllm-glm5.service"


def infeasible_plan() -> Plan:
    """200,000 tokens with a co-tenant taking 30 GiB of GPU 3: does not fit (tests/core/test_plan.py)."""
    plan = make_plan(glm5(), SERVICE, eight_gpus(gpu3=gpu(3, used=30 * GIB)), options())
    assert not plan.feasible and plan.max_model_len == TARGET
    return plan


def planned() -> ChangeResult:
    return ChangeResult(NAME, "set-context", Result.PLANNED, False)


def test_an_infeasible_target_the_unit_already_has_is_unchanged_with_the_plans_note() -> None:
    plan = infeasible_plan()
    result = _kept_or_infeasible(
        NAME, SetContextRequest(TARGET), plan, replace(SERVICE, max_model_len=TARGET), planned()
    )
    assert result is not None and (result.result, result.exit_code) == (Result.UNCHANGED, ExitCode.OK)
    assert result.reason == f"{NAME} already has max_model_len {TARGET}: nothing changed, nothing restarted"
    assert result.suggestion == f"note: the plan says it does not fit with ctxmgr's margin: {plan.reason}"


def test_an_infeasible_target_is_refused_with_the_largest_context_and_the_best_alternative() -> None:
    plan = infeasible_plan()
    for args, request in [
        (SERVICE, SetContextRequest(TARGET)),  # the unit has 8192
        (replace(SERVICE, max_model_len=TARGET), SetContextRequest(TARGET, gpu_memory_utilization=0.9)),
    ]:
        result = _kept_or_infeasible(NAME, request, plan, args, planned())
        assert result is not None and (result.result, result.exit_code) == (
            Result.INFEASIBLE,
            ExitCode.INFEASIBLE,
        )
        assert result.reason == plan.reason
        assert result.suggestion.startswith(f"largest context that fits: {plan.max_context}")
        best = next(a for a in plan.alternatives if a.feasible)
        assert f"; or {best.description}" in result.suggestion


def test_force_goes_on_with_an_infeasible_plan() -> None:
    result = planned()
    request = SetContextRequest(TARGET, force=True)
    assert _kept_or_infeasible(NAME, request, infeasible_plan(), SERVICE, result) is None
    assert (result.result, result.reason, result.suggestion) == (Result.PLANNED, "", "")


def test_a_unit_the_edit_leaves_as_it_is_says_what_it_already_has() -> None:
    assert _already_set(NAME, 8192, SERVICE) == (
        f"{NAME} already has max_model_len 8192: nothing to change, nothing restarted"
    )
    assert _already_set(NAME, 8192, replace(SERVICE, gpu_memory_utilization=0.85)) == (
        f"{NAME} already has max_model_len 8192 and gpu_memory_utilization 0.85: "
        "nothing to change, nothing restarted"
    )


def unknown_plan() -> Plan:
    """GLM-5 with its weights unknown: the plan cannot tell whether 200,000 tokens fit (exit 6)."""
    plan = make_plan(glm5(weight_bytes=None), SERVICE, eight_gpus(), options())
    assert plan.result == "unknown" and plan.feasible  # the memory left over is only an allowance
    return plan


def test_an_unknown_plan_is_not_applied_and_says_what_would_make_it_known() -> None:
    """Issue 35: set-context wrote and restarted a plan `plan` itself exited 6 on (weights unknown)."""
    result = _kept_or_infeasible(NAME, SetContextRequest(TARGET), unknown_plan(), SERVICE, planned())
    assert result is not None and (result.result, result.exit_code) == (Result.INFEASIBLE, ExitCode.UNKNOWN)
    told = f"the plan cannot tell whether max_model_len {TARGET} fits (weights unknown"
    assert result.reason.startswith(told)
    assert "--weights-bytes SIZE" in result.reason and result.reason.endswith("--force applies it anyway")
    # the unit already has it: nothing to write, and the note says the plan does not know
    kept = _kept_or_infeasible(
        NAME, SetContextRequest(TARGET), unknown_plan(), replace(SERVICE, max_model_len=TARGET), planned()
    )
    assert kept is not None and (kept.result, kept.exit_code) == (Result.UNCHANGED, ExitCode.OK)
    assert kept.suggestion.startswith(f"note: the plan cannot tell whether max_model_len {TARGET} fits")


def test_force_goes_on_with_an_unknown_plan_and_a_feasible_plan_goes_on_unforced() -> None:
    request = SetContextRequest(TARGET, force=True)
    assert _kept_or_infeasible(NAME, request, unknown_plan(), SERVICE, planned()) is None
    fits = make_plan(glm5(), SERVICE, eight_gpus(), options())
    assert fits.result == "feasible"
    assert _kept_or_infeasible(NAME, SetContextRequest(TARGET), fits, SERVICE, planned()) is None
