"""How far a plan's figures can be off: calibrated from a start of the service, or estimated.

A FEASIBLE verdict from a budget vLLM itself logged and one from core/memory.py's estimates are not
the same promise; the plan says which it is, from which start, and with the error that
benchmarks/calibration_logs.py measures against real vLLM starts (tests/test_plan_table.py
reruns the benchmark and holds the bands below to its output).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_ctxmgr.core.calibration import Observed
from vllm_ctxmgr.core.plan_record import ConfidenceRecord, ErrorBandRecord


@dataclass(frozen=True)
class ErrorBand:
    """The planner's error on one figure over the public starts of benchmarks/calibration_logs.py."""

    figure: str
    starts: int
    median: float  # fractions: +0.001 is +0.1%
    worst: float

    def text(self) -> str:
        return (
            f"its {self.figure} was off by median {self.median:+.1%}, worst {self.worst:+.1%} over "
            f"{self.starts} public starts (benchmarks/calibration_logs.py)"
        )

    def to_json(self) -> ErrorBandRecord:
        return {
            "figure": self.figure,
            "starts": self.starts,
            "median_percent": round(self.median * 100, 2),
            "worst_percent": round(self.worst * 100, 2),
            "measured_by": "benchmarks/calibration_logs.py",
        }


# the uncalibrated plan's KV budget against the budget vLLM logged (core/memory.py's estimates), over
# the public GPU starts only: ctxmgr's own CPU-build journals have a fixed KV space, no estimate
ESTIMATED_BAND = ErrorBand("KV budget", 9, -0.004, -0.031)
# the calibrated plan's KV cache tokens against the "GPU KV cache size" vLLM logged (GPU starts too)
CALIBRATED_BAND = ErrorBand("KV cache tokens", 10, 0.0, -0.003)


@dataclass(frozen=True)
class Confidence:
    """calibrated (every GPU's budget from a logged start), partly calibrated, estimated, or exact (an
    explicit KV budget: vLLM's check is the plan's arithmetic); `start` names the start used."""

    level: str
    basis: str  # one line: where the KV budget comes from
    started_at: float | None = None  # when that start was recorded (None: not known, or estimated)
    vllm_version: str | None = None
    band: ErrorBand | None = None

    def to_json(self) -> ConfidenceRecord:
        return {
            "level": self.level,
            "basis": self.basis,
            "started_at": self.started_at,
            "vllm_version": self.vllm_version,
            "error_band": self.band.to_json() if self.band else None,
        }


def plan_confidence(budget_sources: list[str], observed: Observed | None, explicit: bool) -> Confidence:
    """The plan's confidence from its GPU lines' KV-budget sources and the start it was calibrated from."""
    if explicit:
        return Confidence("exact", "an explicit KV budget (--kv-cache-memory-bytes): vLLM's check is exact")
    logged = [s for s in budget_sources if s.startswith("vllm")]
    start = observed.start if observed is not None else None
    all_logged = bool(budget_sources) and len(logged) == len(budget_sources)
    if all_logged or (not budget_sources and start is not None):
        what = "this service's last start" if observed is None or not observed.origin else observed.origin
        return Confidence(
            "calibrated",
            f"the KV budget is the one {what} logged"
            + (
                f" at gpu_memory_utilization {observed.utilization:.2f}"
                if observed and observed.utilization
                else ""
            ),
            start.started_at if start else None,
            start.vllm_version if start else None,
            CALIBRATED_BAND,
        )
    if logged:
        return Confidence(
            "partly calibrated",
            f"{len(logged)} of {len(budget_sources)} GPUs' KV budgets logged by a start, the rest estimated",
            start.started_at if start else None,
            start.vllm_version if start else None,
            ESTIMATED_BAND,
        )
    return Confidence(
        "estimated",
        "no start of this service on record: the non-KV memory is core/memory.py's estimate",
        band=ESTIMATED_BAND,
    )
