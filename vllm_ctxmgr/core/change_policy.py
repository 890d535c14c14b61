"""Which flags a context change writes: the target, and the utilisation only where it must move.

One rule for `set-context` (what it writes) and `plan --service` / `plan --unit` (what set-context
would write): change only what must change. A utilisation the unit already has that holds the target
stays, since raising it to the plan's figure or lowering it to the minimum would move memory other
processes on the GPU count on; asking for the context the unit already has moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ctxmgr.core.budget import default_gpu_memory_utilization
from vllm_ctxmgr.core.plan import Plan
from vllm_ctxmgr.core.serve_args import ServeArgs

UTILIZATION_FLAG = "--gpu-memory-utilization"


@dataclass(frozen=True)
class AppliedFlags:
    """The flags set-context writes and the utilisation the unit then runs with."""

    flag_changes: dict[str, str] = field(default_factory=dict)
    gpu_memory_utilization: float | None = None  # None: the unit sets none (vLLM's default applies)
    kept_utilization: bool = False  # the unit's own utilisation holds the target and stays
    suggestion: str = ""

    def text(self, plan: Plan) -> str:
        """One line: what set-context writes, and why the utilisation is what it is."""
        flags = " ".join(f"{k} {v}" for k, v in self.flag_changes.items())
        line = f"set-context would write: {flags}" if flags else "set-context would write nothing"
        least = least_utilization(plan)
        unit = (
            f"the unit's gpu_memory_utilization {self.gpu_memory_utilization:g}"
            if self.gpu_memory_utilization is not None
            else "the unit's default utilisation"
        )
        runs = self.gpu_memory_utilization or plan.gpu_memory_utilization
        if self.kept_utilization and least is not None and runs is not None and least > runs + 1e-9:
            line += (
                f" ({unit} stays; ctxmgr's margin needs {least:.2f}: pass --gpu-memory-utilization "
                f"{least:.2f} to set it)"
            )
        elif self.kept_utilization and least is not None:
            line += f" ({unit} stays: it holds the target; the least that fits is {least:.2f})"
        elif not flags:
            line += " (the unit already runs this context)"
        return line

    def to_json(self, plan: Plan) -> dict[str, object]:
        """--json's `set_context`: the flags set-context writes and the utilisation the unit runs with."""
        return {
            "flag_changes": dict(self.flag_changes),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kept_utilization": self.kept_utilization,
            "least_gpu_memory_utilization": least_utilization(plan),
        }


def unknown_refusal(plan: Plan) -> str:
    """Why a plan whose result is unknown decides nothing, what would make it known, and that --force
    applies it anyway: set-context and `plan --unit` say the same (set-context must never write and
    restart a plan that `plan` itself exits 6 on)."""
    if not plan.gpus and plan.kv_cache_memory_bytes is None:
        known = (
            "no memory information: run it where NVML sees the GPUs, or give --gpu-memory SIZE "
            "--gpu-count N (or --gpus-from FILE)"
        )
    else:
        known = (
            f"{plan.verdict}: give the weights' size (--weights-bytes SIZE, or --model with the model's "
            "weight files), or start the service once so its journal logs them"
        )
    return (
        f"the plan cannot tell whether max_model_len {plan.max_model_len} fits ({known}); "
        "--force applies it anyway"
    )


def least_utilization(plan: Plan) -> float | None:
    """The least utilisation that holds the plan's target with its margin (None where none does, or where
    an explicit KV budget makes the utilisation no choice): the same figure whatever the plan runs at."""
    return plan.least_gpu_memory_utilization


def current_utilization_suffices(args: ServeArgs, plan: Plan) -> bool:
    """The unit's utilisation is at least the planned minimum and passes vLLM's free-memory check."""
    least = least_utilization(plan)
    if least is None or not plan.feasible or args.kv_cache_memory_bytes:
        return False
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    limit = min((g.max_gpu_memory_utilization for g in plan.gpus), default=1.0)
    return least <= current + 1e-9 and current <= limit + 1e-9


def flags_to_apply(
    args: ServeArgs, plan: Plan, context: int, requested_utilization: float | None = None
) -> AppliedFlags:
    """The plan's flag changes, with --max-model-len CONTEXT where the unit has another, and the
    utilisation kept where it suffices (or set to what the operator asked for). The utilisation it
    reports is the one the unit runs with after the edit: what is written, else what the unit has."""
    flags = dict(plan.flag_changes)
    flags["--max-model-len"] = str(context)
    if args.max_model_len == context:
        flags.pop("--max-model-len")  # a value the unit already has is not a change
    if requested_utilization is not None:
        flags[UTILIZATION_FLAG] = f"{requested_utilization:g}"
        return AppliedFlags(flags, requested_utilization)
    already_there = args.max_model_len == context
    if not (already_there or current_utilization_suffices(args, plan)):
        if UTILIZATION_FLAG in flags:
            return AppliedFlags(flags, float(flags[UTILIZATION_FLAG]))
        # nothing moves the utilisation (a forced change the plan says does not fit): the unit keeps its own
        return AppliedFlags(flags, args.gpu_memory_utilization)
    suggestion = ""
    least = least_utilization(plan)
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    if already_there and least is not None and least > current + 1e-9:
        suggestion = (
            f"the plan would use gpu_memory_utilization {least:g} for its margin; "
            "pass --gpu-memory-utilization to change it"
        )
    flags.pop(UTILIZATION_FLAG, None)
    return AppliedFlags(flags, args.gpu_memory_utilization, kept_utilization=True, suggestion=suggestion)


def kept_utilization(args: ServeArgs, plan: Plan, requested_utilization: float | None = None) -> float | None:
    """The unit's own utilisation where set-context keeps it and the plan chose another (the least that
    fits): the plan is then told again at this one, so what it shows is what the unit will run."""
    if requested_utilization is not None or not plan.feasible or args.kv_cache_memory_bytes:
        return None
    if not flags_to_apply(args, plan, plan.max_model_len).kept_utilization:
        return None
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    if plan.gpu_memory_utilization is not None and abs(current - plan.gpu_memory_utilization) < 1e-9:
        return None
    return current
