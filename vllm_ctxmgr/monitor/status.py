"""Every service on the host that runs vLLM at a glance, the way `systemctl list-units` shows units.

Per service: systemd's state, the unit's max_model_len and gpu_memory_utilization, the last
verification (when, result, KV capacity, margin), the newest revision, whether a change is in progress
(a ctxmgr run holds the service's lock, or a change was left in progress), and the verify timer.
Nothing here takes a lock or sends a request: status must never get in the way of a change.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_ctxmgr.errors import CtxmgrError, UnitError
from vllm_ctxmgr.monitor.schedule import UNIT_PREFIX, next_run, timer_name, timer_state
from vllm_ctxmgr.monitor.verify import last_verify
from vllm_ctxmgr.report import gib
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.service import ServiceView, read_service
from vllm_ctxmgr.systemd.systemctl import Systemd


@dataclass
class ServiceStatus:
    service: str
    active_state: str
    sub_state: str
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    base_url: str = ""
    last_verify_time: float | None = None
    last_verify_result: str | None = None
    last_verify_trigger: str | None = None  # timer | manual (None: recorded before ctxmgr kept it)
    last_verify_reasons: list[str] = field(default_factory=list)
    kv_cache_tokens: int | None = None
    margin_bytes: int | None = None
    revision: int | None = None  # the newest revision
    revision_state: str | None = None
    change_in_progress: bool = False
    change_detail: str = ""
    scheduled: bool = False
    next_verify_time: float | None = None
    error: str = ""  # why the unit could not be read

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _lock_holder(store: ServiceStore) -> str | None:
    """Who holds the service's lock, read without taking it (taking it could refuse a real change)."""
    text = store.lock_holder_line()
    if not text or not text.startswith("pid "):
        return None
    pid = text[4:].split(":", 1)[0]
    return text if pid.isdigit() and Path(f"/proc/{pid}").exists() else None


def vllm_units(systemd: Systemd) -> list[str]:
    """Services whose ExecStart mentions vLLM, loaded or only installed (one `systemctl show` for all)."""

    names = {u.unit for u in systemd.list_units("*.service")}
    names.update(name for name in systemd.list_unit_files("*.service") if not name.endswith("@.service"))
    names = {name for name in names if not name.startswith(UNIT_PREFIX)}
    if not names:
        return []
    out = systemd.systemctl("show", "-p", "Id,ExecStart", "--", *sorted(names))
    found: list[str] = []
    block: dict[str, str] = {}
    for line in [*out.splitlines(), ""]:
        if line.strip():
            key, _, value = line.partition("=")
            block[key] = value
            continue
        if block.get("Id") and "vllm" in block.get("ExecStart", "").lower():
            found.append(block["Id"])
        block = {}
    return found


def service_status(
    systemd: Systemd, state_dir: Path | str, unit: str, view: ServiceView | None = None
) -> ServiceStatus:
    """One service's row; `view` is its read unit, None when it cannot be read."""

    store = ServiceStore(state_dir, unit.removesuffix(".service"))
    state = systemd.state(unit)
    status = ServiceStatus(store.service, state.active_state, state.sub_state)
    if view is not None:
        status.max_model_len = view.args.max_model_len
        status.gpu_memory_utilization = view.args.gpu_memory_utilization
        status.base_url = view.base_url
    last = last_verify(store)
    if last:  # else the fields keep their defaults: never verified
        status.last_verify_time = last.get("time")
        status.last_verify_result = last.get("result")
        status.last_verify_trigger = last.get("trigger")
        status.last_verify_reasons = list(last.get("reasons", []))
        status.margin_bytes = last.get("margin_bytes")
        status.kv_cache_tokens = last.get("kv_cache_tokens")
    observed = store.observations()
    if status.kv_cache_tokens is None and observed:
        start = observed[-1]
        blocks, block_size = start.get("num_gpu_blocks"), start.get("block_size")
        status.kv_cache_tokens = (
            blocks * block_size if blocks and block_size else start.get("kv_cache_tokens")
        )
    revisions = store.revisions()
    if revisions:
        status.revision, status.revision_state = revisions[-1].number, revisions[-1].state
    holder = _lock_holder(store)
    in_progress = store.in_progress()
    if holder:
        status.change_in_progress, status.change_detail = True, holder
    elif in_progress is not None:
        status.change_in_progress = True
        status.change_detail = f"revision {in_progress.number} left in progress: run `ctxmgr recover`"
    timer = timer_state(systemd, timer_name(store.service))
    status.scheduled = timer.get("ActiveState") == "active"
    status.next_verify_time = next_run(timer)
    return status


def fleet_status(systemd: Systemd, state_dir: Path | str) -> list[ServiceStatus]:
    """Every service that runs vLLM, plus those ctxmgr's state knows that are gone now."""

    rows = []
    for unit in vllm_units(systemd):
        try:
            view = read_service(systemd, unit)
        except UnitError:
            continue  # mentions vllm, but runs no vLLM server
        except CtxmgrError as exc:
            row = service_status(systemd, state_dir, unit)
            row.error = exc.message
        else:
            row = service_status(systemd, state_dir, unit, view)
        rows.append(row)
    known = {row.service for row in rows}
    root = Path(state_dir)
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.is_dir() and entry.name not in known and (entry / "revisions").is_dir():
                row = service_status(systemd, state_dir, f"{entry.name}.service")
                row.error = "ctxmgr has revisions of it, but systemd has no such vLLM unit now"
                rows.append(row)
    return sorted(rows, key=lambda row: row.service)


def status_table(rows: Sequence[ServiceStatus], now: float | None = None) -> str:
    """Like `systemctl list-units`: one line per service, a legend after."""
    now = time.time() if now is None else now
    header = (
        "SERVICE",
        "ACTIVE",
        "SUB",
        "CONTEXT",
        "UTIL",
        "VERIFIED",
        "RESULT",
        "KV TOKENS",
        "MARGIN",
        "CHANGE",
    )
    table = [header]
    for r in rows:
        table.append(
            (
                r.service,
                r.active_state,
                r.sub_state,
                str(r.max_model_len) if r.max_model_len is not None else "-",
                f"{r.gpu_memory_utilization:.2f}" if r.gpu_memory_utilization is not None else "default",
                _ago(r.last_verify_time, now) + (" (timer)" if r.last_verify_trigger == "timer" else ""),
                r.last_verify_result or "-",
                f"{r.kv_cache_tokens:,}" if r.kv_cache_tokens is not None else "-",
                gib(r.margin_bytes) if r.margin_bytes is not None else "-",
                "in progress" if r.change_in_progress else (r.revision_state or "-"),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    lines.append("")
    lines.append(f"{len(rows)} vLLM service{'s' if len(rows) != 1 else ''} listed.")
    return "\n".join(lines)


def _ago(when: float | None, now: float) -> str:
    if when is None:
        return "never"
    seconds = max(0, int(now - when))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"
