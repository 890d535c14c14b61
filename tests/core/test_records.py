"""The TypedDicts of the JSON records say the keys their writers really write.

Each record is made from a dataclass (asdict and a few added keys) and declared once as a TypedDict
for its readers; a field added to the dataclass without its key in the TypedDict (or a key left
behind) fails here rather than in a reader that trusts the declaration.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from vllm_ctxmgr.core.observations import (
    Observation,
    ObservationFigures,
    ObservationRecord,
    StoredObservation,
)
from vllm_ctxmgr.core.records import ProbeRecord, ProbeStepRecord, RevisionRecord, StepRecord
from vllm_ctxmgr.core.verdict import (
    GpuMargin,
    GpuMarginRecord,
    LastVerifyRecord,
    UnitFacts,
    UnitRecord,
    Verification,
    VerifyFacts,
    record,
)
from vllm_ctxmgr.probe import ProbeResult, ProbeStep
from vllm_ctxmgr.store import Revision, State, Step


def keys(typed: type) -> set[str]:
    return set(typed.__required_keys__) | set(typed.__optional_keys__)  # type: ignore[attr-defined]


def test_a_revision_record_has_the_keys_revision_to_json_writes() -> None:
    revision = Revision(
        3, "vllm", State.FINAL, "/etc/systemd/system/vllm.service", 1.0, steps=[Step(State.FINAL, 2.0)]
    )
    data = revision.to_json()
    assert set(data) == keys(RevisionRecord) == {f.name for f in fields(Revision)}
    assert set(data["steps"][0]) == keys(StepRecord)


def test_a_probe_record_has_the_keys_of_a_probe_result() -> None:
    result = ProbeResult(True, (ProbeStep("health", True, 200, 0.1, "ok"),), 0.1)
    data = asdict(result)
    assert set(data) == keys(ProbeRecord)
    assert set(data["steps"][0]) == keys(ProbeStepRecord)


def test_observation_records_have_the_keys_their_dataclasses_write() -> None:
    observation = Observation(vllm_version="0.11.0", available_kv_gib=3.5, ready=True)
    assert set(asdict(observation)) == keys(ObservationFigures)
    stored = ObservationRecord(observation, service="vllm", time=5.0).to_json()
    assert set(stored) == keys(StoredObservation) - {"started_at"}  # stored as the record's `time`


def test_the_last_verify_record_has_the_keys_record_writes() -> None:
    unit = UnitFacts("active", "running", "success", 0, "abc", 7, 1.0)
    facts = VerifyFacts(
        service="vllm", time=10.0, unit=unit, max_model_len=4096, gpu_memory_utilization=0.9,
        configured_gpu_memory_utilization=0.9, kv_cache_memory_bytes=None, graphs_in_budget=True,
        probe=None, server_vllm_version=None, observation=None, cache_config={}, last_start=None,
        last_verify=None, revisions=(), current_revision=1, in_progress=None, gpus=None, gpu_note=None,
        service_pids=(),
    )  # fmt: skip
    margin = GpuMargin(0, 80, 1, 1, "nvml", 10, 70, 5, 5, 20, "plan", 10, 10, 3)
    gpu = GpuMarginRecord(**asdict(margin), margin_left_bytes=margin.margin_left_bytes)
    verification = Verification("vllm", "ok", 10.0, gpus=[gpu])
    data = record(verification, facts)
    assert set(data) | {"trigger"} == keys(LastVerifyRecord)
    assert keys(GpuMarginRecord) == {f.name for f in fields(GpuMargin)} | {"margin_left_bytes"}
    assert set(asdict(unit)) == keys(UnitRecord)
