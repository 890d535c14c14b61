"""A verification as Prometheus metrics, for node_exporter's textfile collector.

One file per service (the collector reads every *.prom file in its directory), rendered by
prometheus_client and written into a temporary file next to it, then renamed, so the collector never
reads half a file (see write_textfile for the directory others may write). Every series carries a
`service` label.

    ctxmgr_verify_success{service}                 1 when the result is ok, else 0
    ctxmgr_verify_result{service,result}           1 on the last result's series (ok, degraded, failed), 0 on
                                                   the other two
    ctxmgr_verify_probe_latency_seconds{service}   the whole probe: /health to the first token
    ctxmgr_verify_max_model_len{service}           what vLLM reports on /v1/models (else the unit's)
    ctxmgr_verify_planned_max_model_len{service}   the context ctxmgr last put in place (its newest good
                                                   revision; the unit's own where ctxmgr changed nothing):
                                                   an alert compares the served one with it
    ctxmgr_verify_kv_cache_tokens{service}         vLLM's "KV cache size: N tokens"
    ctxmgr_verify_margin_bytes{service}            the smallest margin a restart keeps over the GPUs
    ctxmgr_verify_unit_restarts{service}           systemd's NRestarts
    ctxmgr_verify_vllm_upgrade_kv_cache_tokens_ratio{service}
                                                   where the next start runs another vLLM release than
                                                   the last plan or start: the KV pool under its rules
                                                   over the pool under the old (1 = unmoved)
    ctxmgr_verify_vllm_upgrade_context_fits{service}
                                                   ... and 1 when max_model_len still fits under it, else 0
    ctxmgr_verify_duration_seconds{service}
    ctxmgr_verify_last_run_timestamp_seconds{service}

A value that is not known (no GPU information, the probe did not run) is left out, not written as 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_ctxmgr.core.verdict import RESULTS
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.store import StoreError, atomic_write_at, check_ours_at, open_checked_dir

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
    gauge(
        "planned_max_model_len",
        "The max_model_len of the newest revision ctxmgr installed that served (or the baseline: the unit's)",
        verification.planned_max_model_len,
    )
    gauge("kv_cache_tokens", "vLLM's KV cache size in tokens", verification.kv_cache_tokens)
    gauge("margin", "The smallest margin a restart keeps over the GPUs", verification.margin_bytes, "bytes")
    gauge("unit_restarts", "systemd's NRestarts of the service", verification.unit.get("n_restarts"))
    upgrade = verification.vllm_upgrade
    gauge(
        "vllm_upgrade_kv_cache_tokens_ratio",
        "KV cache tokens under the vLLM release the next start runs over those under the one last planned",
        upgrade["kv_cache_tokens_ratio"] if upgrade else None,
    )
    gauge(
        "vllm_upgrade_context_fits",
        "1 when max_model_len still fits under the vLLM release the next start runs, else 0",
        int(upgrade["fits_after"]) if upgrade else None,
    )
    gauge("duration", "Seconds the verification took", verification.duration_s, "seconds")
    gauge("last_run_timestamp", "When the verification ran (Unix time)", verification.time, "seconds")
    return registry


def check_textfile_path(path: str | Path) -> Path:
    """The collector only reads *.prom files, and the directory must exist and be one ctxmgr may write
    into (see write_textfile)."""
    target = Path(path)
    if target.suffix != ".prom":
        raise UsageError(f"{target}: node_exporter's textfile collector reads only files ending in .prom")
    if not target.parent.is_dir():
        raise UsageError(f"{target.parent}: no such directory (the textfile collector's directory)")
    os.close(open_checked_dir(target.parent, sticky_ok=True))  # refused before the run, not after it
    return target


def write_textfile(path: str | Path, verification: Verification) -> Path:
    """Write the verification's metrics to `path` atomically, as the state directory is written: from
    the checked directory's descriptor, a new temporary (O_EXCL, O_NOFOLLOW) made 0644 on its own
    descriptor, renamed over `path`. node_exporter's directory is often one others may write: it
    must then be sticky, and what is at `path` already must be a regular file of ours, so a link
    planted there is never followed (a root-only file would become world-readable)."""
    from prometheus_client import generate_latest

    target = check_textfile_path(path)
    data = generate_latest(registry_for(verification))
    dir_fd = open_checked_dir(target.parent, sticky_ok=True)
    try:
        if os.fstat(dir_fd).st_mode & 0o022:
            check_ours_at(dir_fd, target.name, target)
        atomic_write_at(dir_fd, target.name, data, mode=0o644)
    except OSError as exc:
        where = target.parent / exc.filename if isinstance(exc.filename, str) else target
        raise StoreError(f"{where}: {exc.strerror or exc}") from None
    finally:
        os.close(dir_fd)
    return target
