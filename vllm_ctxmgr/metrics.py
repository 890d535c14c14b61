"""A verification as Prometheus metrics, for node_exporter's textfile collector.

One file per service (the collector reads every *.prom file in its directory), written with
prometheus_client's `write_to_textfile`: into a temporary file next to it, then renamed, so the
collector never reads half a file. Every series carries a `service` label.

    ctxmgr_verify_success{service}                 1 when the result is ok, else 0
    ctxmgr_verify_result{service,result}           1 on the last result's series (ok, degraded, failed), 0 on
                                                   the other two
    ctxmgr_verify_probe_latency_seconds{service}   the whole probe: /health to the first token
    ctxmgr_verify_max_model_len{service}           what vLLM reports on /v1/models (else the unit's)
    ctxmgr_verify_kv_cache_tokens{service}         vLLM's "KV cache size: N tokens"
    ctxmgr_verify_margin_bytes{service}            the smallest margin a restart keeps over the GPUs
    ctxmgr_verify_unit_restarts{service}           systemd's NRestarts
    ctxmgr_verify_duration_seconds{service}
    ctxmgr_verify_last_run_timestamp_seconds{service}

A value that is not known (no GPU information, the probe did not run) is left out, not written as 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from vllm_ctxmgr.core.verdict import RESULTS
from vllm_ctxmgr.errors import UsageError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from vllm_ctxmgr.core.verdict import Verification

PREFIX = "ctxmgr_verify"


def registry_for(verification: Verification) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    service = verification.service

    def gauge(name: str, documentation: str, value: float | int | None, unit: str = "") -> None:
        metric = Gauge(f"{PREFIX}_{name}", documentation, ["service"], unit=unit, registry=registry)
        if value is not None:
            metric.labels(service=service).set(float(value))

    gauge("success", "1 when the last verification found the service ok, else 0", int(verification.success))
    result = Gauge(
        f"{PREFIX}_result",
        "1 on the series whose result label is the last verification's result (ok, degraded or failed), "
        "0 on the other two",
        ["service", "result"],
        registry=registry,
    )
    for name in RESULTS:
        result.labels(service=service, result=name).set(1.0 if verification.result == name else 0.0)
    gauge(
        "probe_latency",
        "Seconds the probe took, /health to the first token",
        verification.probe_latency_s,
        "seconds",
    )
    gauge("max_model_len", "The max_model_len vLLM reports", verification.max_model_len)
    gauge("kv_cache_tokens", "vLLM's KV cache size in tokens", verification.kv_cache_tokens)
    gauge("margin", "The smallest margin a restart keeps over the GPUs", verification.margin_bytes, "bytes")
    gauge("unit_restarts", "systemd's NRestarts of the service", verification.unit.get("n_restarts"))
    gauge("duration", "Seconds the verification took", verification.duration_s, "seconds")
    gauge("last_run_timestamp", "When the verification ran (Unix time)", verification.time, "seconds")
    return registry


def check_textfile_path(path: str | Path) -> Path:
    """The collector only reads *.prom files, and the directory must exist."""
    target = Path(path)
    if target.suffix != ".prom":
        raise UsageError(f"{target}: node_exporter's textfile collector reads only files ending in .prom")
    if not target.parent.is_dir():
        raise UsageError(f"{target.parent}: no such directory (the textfile collector's directory)")
    return target


def write_textfile(path: str | Path, verification: Verification) -> Path:
    """Write the verification's metrics to `path` atomically (prometheus_client's textfile writer)."""
    from prometheus_client import write_to_textfile

    target = check_textfile_path(path)
    write_to_textfile(str(target), registry_for(verification))
    target.chmod(0o644)
    return target
