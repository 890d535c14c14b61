"""Issue 16 item 7: `observe --import` checked at the door. A FIFO or /dev/zero hung it; deep JSON
crashed it; `total_memory_gib 1e308` or `num_gpu_blocks 10**400` were stored and every later plan of
the service died with OverflowError; a wrong service, a newline in `host`, a failed start's record
that caps every plan were all accepted."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from tests.support.deadline import deadline
from tests.support.paths import REPO
from vllm_ctxmgr.change.planning import imported_observation
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.errors import ExitCode, UsageError

# what `ctxmgr observe --json` wrote on host 1 (deploy's record: the figures and the configuration)
GOOD = {
    "vllm_version": "0.33.0", "platform": "GPU", "gpu_name": "NVIDIA H200", "host": "gpu-01",
    "service": "vllm-glm5", "ready": True, "failure": None, "total_memory_gib": 139.8,
    "model_loading_gib": 70.2, "available_kv_gib": 52.1, "cuda_graph_gib": 1.2, "num_gpu_blocks": 2840,
    "block_size": 64, "kv_cache_tokens": 181760, "max_model_len": 131072, "gpu_memory_utilization": 0.9,
    "time": 1767000000.5, "configured_max_model_len": 131072, "configured_gpu_memory_utilization": 0.9,
}  # fmt: skip


def text_with(**changes: object) -> str:
    return json.dumps({**GOOD, **changes})


def test_a_sound_record_is_taken() -> None:
    record = imported_observation(json.dumps({"record": GOOD}), "obs.json", service="vllm-glm5",
                                  vllm_version="0.33.0", gpu_names=["NVIDIA H200"])  # fmt: skip
    assert record["num_gpu_blocks"] == 2840 and record["imported_from"] == "gpu-01"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (text_with(total_memory_gib=1e308), "total_memory_gib is above"),
        ('{"vllm_version": "0.33.0", "num_gpu_blocks": 1' + "0" * 400 + "}", "num_gpu_blocks is above"),
        (text_with(available_kv_gib=9999.0), "available_kv_gib is above"),
        ('{"vllm_version": "0.33.0", "total_memory_gib": 1' + "0" * 400 + "}", "total_memory_gib is above"),
        (text_with(available_kv_gib=150.0), "available_kv_gib is more than the GPU's total_memory_gib"),
        (text_with(gpu_memory_utilization=1.5), r"gpu_memory_utilization is not in \(0, 1\]"),
        (text_with(block_size=0), "block_size is not one of vLLM's block sizes"),
        (text_with(host="gpu-01\nForged: line"), "host is not a host name"),
        (text_with(gpu_name="H200\x1b[2J"), "gpu_name is not printable text"),
        (text_with(failure="kv_cache_too_small", estimated_max_model_len=1, ready=False), "failed start"),
        (text_with(vllm_version="not a version"), "vllm_version is not a vLLM version"),
        ("[" * 100_000 + "]" * 100_000, "not JSON"),
        ('{"record": ' * 50_000 + "{}" + "}" * 50_000, "not JSON"),
    ],
)
def test_what_breaks_a_record_invariant_is_refused(text: str, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        imported_observation(text, "obs.json")
    assert "\n" not in info.value.message


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"service": "vllm-other"}, "from service vllm-glm5, not vllm-other"),
        ({"vllm_version": "0.32.0"}, "ran vLLM 0.33.0, this service runs 0.32.0"),
        ({"gpu_names": ["NVIDIA A100-SXM4-80GB"]}, "ran on NVIDIA H200, this host has NVIDIA A100-SXM4-80GB"),
    ],
)
def test_a_record_of_another_service_gpu_or_vllm_is_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        imported_observation(text_with(), "obs.json", **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def bounded() -> Iterator[None]:
    """A hang fails the test instead of stalling the run."""
    with deadline(20, "the import"):
        yield


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_fifo_or_a_device_is_refused_before_anything_is_read(kind: str) -> None:
    directory = REPO / ".cache" / "import" / uuid.uuid4().hex[:8]
    directory.mkdir(parents=True)
    path = "/dev/zero"
    if kind == "fifo":
        path = str(directory / "obs.json")
        os.mkfifo(path)
    state = directory / "state"
    result = CliRunner().invoke(main, ["--state-dir", str(state), "observe", "--service", "vllm-glm5",
                                       "--import", path])  # fmt: skip
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "expected a regular file" in result.output and result.output.count("\n") == 1
    assert not state.exists()


def test_the_record_type_is_the_one_door_for_stored_lines_too() -> None:
    """Issue 14 item 2: ObservationRecord.from_json checks a stored line as it checks an import; a line
    that no start could log (a stored 999 GiB budget on a 95.6 GiB GPU, a 1e308) is left out of the
    plan's observations instead of wedging every later plan, and a good line reads back whole."""
    from vllm_ctxmgr.change.planning import observations_from_store
    from vllm_ctxmgr.core.observations import ObservationError, ObservationRecord

    good = ObservationRecord.from_json(GOOD, "observations.jsonl")
    assert ObservationRecord.from_json(good.to_json(), "again") == good
    poisoned = {**GOOD, "available_kv_gib": 999.0, "total_memory_gib": 95.6}
    with pytest.raises(ObservationError, match="available_kv_gib is more than the GPU's total_memory_gib"):
        ObservationRecord.from_json(poisoned, "observations.jsonl")
    planned = observations_from_store([poisoned, {**GOOD, "time": 1e308}, GOOD])
    assert len(planned) == 1 and planned[0].available_kv_gib == GOOD["available_kv_gib"]


# Issue 36 item 16: an imported observation is bounded by the GPU it claims, as a watched start is
H100 = 95.6 * (1 << 30)  # NVIDIA H100 NVL as NVML reports it


@pytest.mark.parametrize(
    "changes",
    [
        {"available_kv_gib": 4000.0, "total_memory_gib": 4090.0},  # its own total says it fits
        {"available_kv_gib": 4000.0, "total_memory_gib": None},  # no total of its own
        {"model_loading_gib": 60.0, "available_kv_gib": 60.0},  # each fits, both together do not
        {"total_memory_gib": 4000.0},
    ],
    ids=["kv-with-its-own-total", "kv-without-total", "weights-and-kv", "total"],
)
def test_an_imported_figure_above_this_hosts_gpu_of_that_name_is_refused(changes: dict[str, object]) -> None:
    record = {**GOOD, "gpu_name": "NVIDIA H100 NVL", **changes}
    with pytest.raises(UsageError, match=r"more than the 95\.60 GiB of this host's NVIDIA H100 NVL"):
        imported_observation(json.dumps(record), "obs.json", service="vllm-glm5", vllm_version="0.33.0",
                             gpu_names=["NVIDIA H100 NVL"], gpu_total_bytes=H100)  # fmt: skip


def test_an_imported_record_within_this_hosts_gpu_is_taken() -> None:
    record = {**GOOD, "gpu_name": "NVIDIA H100 NVL", "total_memory_gib": 93.1, "model_loading_gib": 30.0,
              "available_kv_gib": 50.0}  # fmt: skip
    taken = imported_observation(json.dumps(record), "obs.json", service="vllm-glm5", vllm_version="0.33.0",
                                 gpu_names=["NVIDIA H100 NVL"], gpu_total_bytes=H100)  # fmt: skip
    assert taken["available_kv_gib"] == 50.0
