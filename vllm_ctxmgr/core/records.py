"""The JSON records one room writes and another reads back, declared once in the pure core.

The store writes revisions and cannot be imported by the core; verify writes a probe's result and the
verdict reads it. Declaring the shapes here lets writer and readers agree on the keys without either
importing the other. tests/core/test_records.py ties each TypedDict to the dataclass it is made from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict


class StepRecord(TypedDict):
    """One step of a revision's story (store.Step.record): its state, an ISO 8601 time, a note."""

    state: str
    time: str | None
    note: str


class RevisionRecord(TypedDict):
    """store.Revision.to_json(): the revision as Python sees it (epoch seconds, the plan inline), for
    --json, history and verify. Its plan is a core.plan_record.PlanRecord as this ctxmgr writes it, or
    the stored plan of an older one: read it through StoredPlan."""

    number: int
    service: str
    state: str  # store.State
    unit_path: str
    created: float
    max_model_len: int | None
    gpu_memory_utilization: float | None
    previous_max_model_len: int | None
    previous_gpu_memory_utilization: float | None
    action: str  # set-context | rollback | baseline
    rollback_of: int | None
    vllm_version: str | None
    reason: str
    decisive_line: str
    finished: float | None
    verified: bool
    plan: Mapping[str, object]
    capacity: dict[str, object]  # a start's figures and the plan's calibration error on it
    user: str | None
    host: str | None
    ctxmgr_version: str | None
    invocation_id: str | None
    deployment: str | None
    steps: list[StepRecord]
    files: list[dict[str, str | None]]  # {path, unit, previous}


class HistoryRow(TypedDict):
    """One revision as `ctxmgr history` shows it (store.ServiceStore.history), text and --json."""

    revision: int
    time: float
    finished: float | None
    action: str
    state: str
    max_model_len: int | None
    gpu_memory_utilization: float | None
    previous_max_model_len: int | None
    rollback_of: int | None
    vllm_version: str | None
    user: str | None
    host: str | None
    ctxmgr_version: str | None
    reason: str
    decisive_line: str
    capacity: dict[str, object]
    steps: list[StepRecord]
    files: list[str]  # the unit files it changed


class ProbeStepRecord(TypedDict):
    """probe.ProbeStep as a dict."""

    name: str
    ok: bool
    status: int | None
    latency_s: float
    detail: str


class ProbeRecord(TypedDict, total=False):
    """probe.ProbeResult as a dict (dataclasses.asdict); {} where no probe ran, and without the
    optional keys where the probe could not start (vLLM reported no max_model_len)."""

    ok: bool
    steps: Sequence[ProbeStepRecord]
    latency_s: float
    error: str | None
    model_id: str | None
    max_model_len: int | None
    prompt_tokens: int | None
