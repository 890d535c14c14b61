"""The Prometheus textfile: what it says, that prometheus_client's parser reads it, and that it is
replaced whole (never rewritten in place) so node_exporter cannot read half of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_ctxmgr.core.verdict import DEGRADED, OK, Verification
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.metrics import write_textfile

GIB = 1 << 30


def samples(path: Path) -> dict[tuple[str, str | None], tuple[float, str]]:
    return {
        (s.name, s.labels.get("result")): (s.value, s.labels["service"])
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


def verification(**values: object) -> Verification:
    base = Verification(
        service="vllm-glm5",
        result=OK,
        time=1_790_000_000.25,
        max_model_len=200_000,
        probe_latency_s=0.42,
        kv_cache_tokens=298_880,
        margin_bytes=int(1.5 * GIB),
        unit={"n_restarts": 2},
        duration_s=1.3,
    )
    for name, value in values.items():
        setattr(base, name, value)
    return base


def test_the_textfile_parses_and_carries_every_figure_labelled_by_service(tmp_path: Path) -> None:
    path = write_textfile(tmp_path / "ctxmgr-vllm-glm5.prom", verification())
    found = samples(path)
    assert found[("ctxmgr_verify_success", None)] == (1.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "ok")] == (1.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "degraded")] == (0.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "failed")] == (0.0, "vllm-glm5")
    assert found[("ctxmgr_verify_probe_latency_seconds", None)] == (0.42, "vllm-glm5")
    assert found[("ctxmgr_verify_max_model_len", None)] == (200_000.0, "vllm-glm5")
    assert found[("ctxmgr_verify_kv_cache_tokens", None)] == (298_880.0, "vllm-glm5")
    assert found[("ctxmgr_verify_margin_bytes", None)] == (1.5 * GIB, "vllm-glm5")
    assert found[("ctxmgr_verify_unit_restarts", None)] == (2.0, "vllm-glm5")
    assert found[("ctxmgr_verify_last_run_timestamp_seconds", None)] == (1_790_000_000.25, "vllm-glm5")
    assert path.stat().st_mode & 0o777 == 0o644  # node_exporter runs as its own user


def test_unknown_figures_are_left_out_not_written_as_zero(tmp_path: Path) -> None:
    path = write_textfile(
        tmp_path / "x.prom", verification(result=DEGRADED, margin_bytes=None, probe_latency_s=None)
    )
    found = samples(path)
    assert ("ctxmgr_verify_margin_bytes", None) not in found
    assert ("ctxmgr_verify_probe_latency_seconds", None) not in found
    assert found[("ctxmgr_verify_success", None)][0] == 0.0
    assert found[("ctxmgr_verify_result", "degraded")][0] == 1.0
    assert "# TYPE ctxmgr_verify_margin_bytes gauge" in path.read_text()  # the family is still declared


def test_each_write_replaces_the_file_whole_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "vllm-glm5.prom"
    write_textfile(path, verification())
    first_inode = path.stat().st_ino
    reader = path.open()  # a collector in the middle of a read keeps the old file
    write_textfile(path, verification(max_model_len=131_072))
    assert path.stat().st_ino != first_inode  # renamed over, not truncated and rewritten
    assert "200000.0" in reader.read()
    reader.close()
    assert samples(path)[("ctxmgr_verify_max_model_len", None)][0] == 131_072.0
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-glm5.prom"]


def test_paths_the_collector_would_never_read_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"only files ending in \.prom"):
        write_textfile(tmp_path / "metrics.txt", verification())
    with pytest.raises(UsageError, match="no such directory"):
        write_textfile(tmp_path / "missing" / "x.prom", verification())
