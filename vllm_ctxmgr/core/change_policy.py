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
        line = f"set-context would write: {flags}"
        least = plan.gpu_memory_utilization
        if self.kept_utilization and self.gpu_memory_utilization is not None and least is not None:
            line += (
                f" (the unit's gpu_memory_utilization {self.gpu_memory_utilization:g} stays: it holds the "
                f"target; the least that fits is {least:.2f})"
            )
        elif self.kept_utilization and least is not None:
            line += (
                " (the unit's default utilisation stays: it holds the target; the least that fits is "
                f"{least:.2f})"
            )
        return line

    def to_json(self, plan: Plan) -> dict[str, object]:
        """--json's `set_context`: the flags set-context writes and the utilisation the unit runs with."""
        return {
            "flag_changes": dict(self.flag_changes),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kept_utilization": self.kept_utilization,
            "least_gpu_memory_utilization": plan.gpu_memory_utilization,
        }


def current_utilization_suffices(args: ServeArgs, plan: Plan) -> bool:
    """The unit's utilisation is at least the planned minimum and passes vLLM's free-memory check."""
    if plan.gpu_memory_utilization is None or not plan.feasible or args.kv_cache_memory_bytes:
        return False
    current = args.gpu_memory_utilization or default_gpu_memory_utilization(plan.vllm_version)
    limit = min((g.max_gpu_memory_utilization for g in plan.gpus), default=1.0)
    return plan.gpu_memory_utilization <= current + 1e-9 and current <= limit + 1e-9


def flags_to_apply(
    args: ServeArgs, plan: Plan, context: int, requested_utilization: float | None = None
) -> AppliedFlags:
    """The plan's flag changes, with --max-model-len CONTEXT, and the utilisation kept where it suffices
    (or set to what the operator asked for)."""
    flags = dict(plan.flag_changes)
    flags["--max-model-len"] = str(context)
    if requested_utilization is not None:
        flags[UTILIZATION_FLAG] = f"{requested_utilization:g}"
        return AppliedFlags(flags, requested_utilization)
    already_there = args.max_model_len == context
    if not (already_there or current_utilization_suffices(args, plan)):
        return AppliedFlags(flags, plan.gpu_memory_utilization)
    suggestion = ""
    if already_there and UTILIZATION_FLAG in flags:
        suggestion = (
            f"the plan would use gpu_memory_utilization {plan.gpu_memory_utilization} for its margin; "
            "pass --gpu-memory-utilization to change it"
        )
    flags.pop(UTILIZATION_FLAG, None)
    return AppliedFlags(flags, args.gpu_memory_utilization, kept_utilization=True, suggestion=suggestion)
