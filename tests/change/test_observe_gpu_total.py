"""`observe` keeps no figure its GPU could not hold (issue 29 item 1: "no figure may exceed the GPU it
was measured on"). The planner ignored such a record already; `observe` (and the plan's learning from
a running instance) stored it, so `observations.jsonl` held a 9,999 GiB KV budget for an 80 GiB GPU.
Now the record is checked before it is stored: against NVML's total for the GPUs the unit sees, and
through the store's own door (each part within the record's own total_memory_gib)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_ctxmgr.change import observing
from vllm_ctxmgr.core.hardware import GIB, GpuState, uniform_gpus
from vllm_ctxmgr.core.observations import Observation, ObservationError, ObservationRecord
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.journal import JournalEntry

H100 = uniform_gpus(1, 80 * GIB, name="NVIDIA H100 80GB HBM3")
PREFIX = "(EngineCore_DP0 pid=412) INFO 11-30 00:29:40 [gpu_worker.py:298] "


def start_lines(weights_gib: float, kv_gib: float) -> list[str]:
    """One GPU start as vLLM logs it, up to its ready line."""
    return [
        "vLLM API server version 0.33.0",
        f"{PREFIX}Model loading took {weights_gib:.2f} GiB and 21.5 seconds",
        f"{PREFIX}Available KV cache memory: {kv_gib:.2f} GiB",
        "(APIServer pid=87) INFO 11-30 00:30:10 [api_server.py:1900] Starting vLLM server on http://0.0.0.0:8000",
    ]


@dataclass
class JournalOnly:
    """What observe_last_start asks of systemd, answered from one journal (the unit is not active)."""

    messages: list[str]
    asked: list[str] = field(default_factory=list)

    def journal(self, unit: str, lines: int) -> list[JournalEntry]:
        self.asked.append(unit)
        return [
            JournalEntry(m, i, 412, f"c{i}", unit, {}, invocation_id="a" * 32)
            for i, m in enumerate(self.messages)
        ]

    def is_active(self, unit: str) -> bool:
        return False


@dataclass
class View:
    """The unit as read_service gives it, as far as an observation record reads it."""

    args: ServeArgs = field(default_factory=lambda: ServeArgs("Qwen/Qwen3-32B", max_model_len=32768))
    env: dict[str, str] = field(default_factory=dict)
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None


def observe(monkeypatch: pytest.MonkeyPatch, lines: list[str], gpus: GpuState | None) -> ObservationRecord:
    def nvml() -> GpuState:
        if gpus is None:
            raise observing.CtxmgrError("NVML: no driver")
        return gpus

    monkeypatch.setattr(observing, "read_nvml", nvml)
    monkeypatch.setattr(observing, "read_service", lambda systemd, service: View())
    record, _figures, _count = observing.observe_last_start(JournalOnly(lines), "vllm-q")  # type: ignore[arg-type]
    return record


def test_a_start_that_fits_its_gpu_is_kept_as_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    record = observe(monkeypatch, start_lines(61.0, 12.5), H100)
    assert (record.observation.model_loading_gib, record.observation.available_kv_gib) == (61.0, 12.5)
    assert record.observation.gpu_name == "NVIDIA H100 80GB HBM3" and record.observation.ready


@pytest.mark.parametrize(
    ("weights", "kv", "named"),
    [
        (61.0, 9999.0, "available_kv_gib 9,999.00 GiB"),
        (900.0, 12.5, "model_loading_gib 900.00 GiB"),
        (61.0, 30.0, "model_loading_gib + available_kv_gib 91.00 GiB"),
    ],
)
def test_a_figure_above_the_gpu_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, weights: float, kv: float, named: str
) -> None:
    with pytest.raises(ObservationError) as caught:
        observe(monkeypatch, start_lines(weights, kv), H100)
    assert caught.value.message == (
        f"vllm-q.service: its last start logged {named}, more than the 80.00 GiB of its GPU (NVML): "
        "not stored"
    )
    assert caught.value.exit_code == 2


def test_without_nvml_a_record_is_checked_against_its_own_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU build logs the memory it sized against; a weights figure above it is no start's."""
    lines = start_lines(61.0, 12.5)
    assert observe(monkeypatch, lines, None).observation.available_kv_gib == 12.5  # no total: kept
    record = ObservationRecord(Observation(platform="CPU", total_memory_gib=16.0, model_loading_gib=20.0))
    with pytest.raises(ObservationError, match=r"^vllm-q: its last start: model_loading_gib is more than"):
        observing.within_the_gpu(record, None, "vllm-q")


def test_learning_from_a_running_instance_says_why_nothing_was_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The plan's first look at a running service: the impossible start is named in the plan's note,
    and nothing is stored for later plans."""
    monkeypatch.setattr(observing, "read_nvml", lambda: H100)
    monkeypatch.setattr(observing, "read_service", lambda systemd, service: View())
    systemd = JournalOnly(start_lines(61.0, 9999.0))
    systemd.is_active = lambda unit: True  # type: ignore[method-assign]
    monkeypatch.setattr(observing, "cache_config_info", lambda url, api_key=None: {})
    store = ServiceStore(tmp_path / "state", "vllm-q")
    kept: list[ObservationRecord] = []
    said = observing.learn_from_running_instance(systemd, store, "vllm-q", View(), kept.append)  # type: ignore[arg-type]
    assert said is not None and said.startswith("did not learn from the running instance: vllm-q.service")
    assert "available_kv_gib 9,999.00 GiB" in said and kept == [] and store.observations() == []
