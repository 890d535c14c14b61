"""Which flags set-context writes (core.change_policy.flags_to_apply): the one rule that set-context
applies and a plan of a unit reports. Plans are real plans of a Llama-3.1-8B-shaped model on one
80 GiB GPU."""

from __future__ import annotations

import json
import math
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.ctxmgr_cli import ctxmgr_command
from tests.support.paths import REPO
from vllm_ctxmgr.core.change_policy import current_utilization_suffices, flags_to_apply
from vllm_ctxmgr.core.facts import LayerFacts, LayerKind, ModelFacts
from vllm_ctxmgr.core.hardware import GIB, uniform_gpus
from vllm_ctxmgr.core.plan import Plan, PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import ServeArgs

LLAMA_8B = ModelFacts(
    "llama-8b",
    "hf",
    "llama",
    ("LlamaForCausalLM",),
    32,
    (LayerFacts(LayerKind.FULL, 8, 128),) * 32,
    "bfloat16",
    position_limits=(("max_position_embeddings", 131072),),
)


def plan_of(args: ServeArgs, target: int) -> Plan:
    options = PlanOptions(target, derived_max_model_len=131072, weights_bytes=16 * GIB)
    return make_plan(LLAMA_8B, args, uniform_gpus(1, 80 * GIB), options)


def test_a_utilisation_that_holds_the_target_is_kept() -> None:
    args = ServeArgs("m", max_model_len=8192, gpu_memory_utilization=0.92)
    plan = plan_of(args, 65536)
    assert plan.feasible and plan.gpu_memory_utilization is not None and plan.gpu_memory_utilization < 0.92
    applied = flags_to_apply(args, plan, 65536)
    assert applied.flag_changes == {"--max-model-len": "65536"}
    assert applied.gpu_memory_utilization == 0.92 and applied.kept_utilization


def test_a_utilisation_too_low_for_the_target_is_raised_to_the_plans() -> None:
    args = ServeArgs("m", max_model_len=8192, gpu_memory_utilization=0.25)
    plan = plan_of(args, 131072)
    assert plan.feasible and not current_utilization_suffices(args, plan)
    applied = flags_to_apply(args, plan, 131072)
    assert applied.flag_changes["--gpu-memory-utilization"] == f"{plan.gpu_memory_utilization:g}"
    assert float(applied.flag_changes["--gpu-memory-utilization"]) > 0.25
    assert applied.gpu_memory_utilization == plan.gpu_memory_utilization and not applied.kept_utilization


def test_the_operators_utilisation_wins() -> None:
    args = ServeArgs("m", max_model_len=8192, gpu_memory_utilization=0.92)
    applied = flags_to_apply(args, plan_of(args, 65536), 65536, requested_utilization=0.8)
    assert applied.flag_changes == {"--max-model-len": "65536", "--gpu-memory-utilization": "0.8"}
    assert applied.gpu_memory_utilization == 0.8


def test_the_context_the_unit_has_moves_nothing_and_says_why() -> None:
    args = ServeArgs("m", max_model_len=131072, gpu_memory_utilization=0.25)
    plan = plan_of(args, 131072)
    assert "--gpu-memory-utilization" in plan.flag_changes
    applied = flags_to_apply(args, plan, 131072)
    assert applied.flag_changes == {}  # issue 28: a value the unit already has is not a change
    assert "pass --gpu-memory-utilization" in applied.suggestion


@pytest.mark.parametrize("kv_bytes", [8 * GIB])
def test_an_explicit_kv_budget_never_counts_as_a_sufficient_utilisation(kv_bytes: int) -> None:
    args = ServeArgs("m", max_model_len=8192, gpu_memory_utilization=0.92, kv_cache_memory_bytes=kv_bytes)
    assert not current_utilization_suffices(args, plan_of(args, 16384))


def plan_unit(unit: Path, *args: str) -> tuple[int, dict, str]:
    argv = [*ctxmgr_command(), "--state-dir", str(unit.parent / "state"), "plan", "--unit", str(unit), *args]
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    as_text = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return as_json.returncode, json.loads(as_json.stdout), as_text.stdout


@pytest.fixture
def llama_unit() -> Path:
    """A unit as operators write it, at 0.92, serving the shipped Llama-3.1-70B config on TP 4."""
    directory = REPO / ".cache" / "policy" / uuid.uuid4().hex[:8]
    directory.mkdir(parents=True)
    unit = directory / "vllm-llama.service"
    unit.write_text(
        "[Service]\n"
        f"ExecStart=/opt/vllm/bin/vllm serve {REPO}/examples/models/llama-3.1-70b -tp 4 \\\n"
        "    --max-model-len 8192 --gpu-memory-utilization 0.92\n"
    )
    return unit


GPUS = ("--gpu-memory", "80GiB", "--gpu-count", "4")


def test_plan_of_a_unit_says_what_set_context_writes_and_the_least_that_fits(llama_unit: Path) -> None:
    """Issue 17 item 2: a unit at 0.92 was told "0.55" by plan, while set-context kept 0.92."""
    code, data, text = plan_unit(llama_unit, "65536", *GPUS)
    assert code == 0 and data["result"] == "feasible"
    # issue 28: the plan is at what set-context runs (0.92); the least that fits is one more figure
    assert data["gpu_memory_utilization"] == 0.92
    least = data["least_gpu_memory_utilization"]
    assert least < 0.92
    assert data["set_context"] == {
        "flag_changes": {"--max-model-len": "65536"},
        "gpu_memory_utilization": 0.92,
        "kept_utilization": True,
        "least_gpu_memory_utilization": least,
        "refused": None,  # set-context can edit this unit
    }
    assert (
        "set-context would write: --max-model-len 65536 (the unit's gpu_memory_utilization 0.92 stays" in text
    )
    assert f"the least that fits is {least:.2f}" in text


def test_a_utilisation_given_to_plan_is_the_one_planned_and_written(llama_unit: Path) -> None:
    code, data, _text = plan_unit(llama_unit, "65536", *GPUS, "--gpu-memory-utilization", "0.8")
    assert code == 0 and data["gpu_memory_utilization"] == 0.8  # evaluated at 0.8, not at the least
    assert data["set_context"]["flag_changes"] == {
        "--max-model-len": "65536",
        "--gpu-memory-utilization": "0.8",
    }
    assert all(g["requested"]["bytes"] == math.ceil(g["total"]["bytes"] * 0.8) for g in data["gpus"])
