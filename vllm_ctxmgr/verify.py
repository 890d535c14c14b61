"""Is a vLLM service still what ctxmgr left behind? ok, degraded or failed, each with its reasons.

    gather (I/O: systemd, the journal, HTTP, NVML, the state store) -> VerifyFacts
    decide (pure)                                                   -> Verification

failed: the unit is not active, or the probe fails (/health, /v1/models reporting the unit's
max_model_len, the context-sized completion, optionally the ~90% prompt).
degraded: it serves, but something that decides the next start has moved:
- the unit restarted since the last verification, and not by ctxmgr (NRestarts, InvocationID);
- the vLLM version or vLLM's own KV budget differ from those of the last start ctxmgr watched;
- GPU memory now (NVML, or a `ctxmgr gpus --json` file) leaves a restart less than the plan's margin:
  other processes grew so that vLLM's startup free-memory check (ceil(total x utilisation) must be
  free) would fail or nearly so, or the KV budget no longer keeps the margin beyond one request;
- vLLM's own GPU memory grew since the last verification of the same process;
- the unit was edited outside ctxmgr, or a change was left in progress by an interrupted run.

Each verification is stored as SERVICE/last-verify.json, the baseline of the next one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState
from vllm_ctxmgr.core.kv.backends import NEWEST_VLLM
from vllm_ctxmgr.core.plan import (
    DEFAULT_MARGIN_MIN_BYTES,
    StoredPlan,
    cuda_graphs_in_budget,
    default_gpu_memory_utilization,
    kv_budget_at_utilization,
    margin_bytes,
    parse_vllm_version,
    requested_bytes,
)
from vllm_ctxmgr.deploy import Deployer, rollback
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.planning import gather_gpus, is_cpu_deployment
from vllm_ctxmgr.probe import cache_config_info, probe
from vllm_ctxmgr.service import read_service
from vllm_ctxmgr.store import BASELINE, FINAL, Revision, ServiceStore
from vllm_ctxmgr.systemd.journal import parse_journal_json
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.vllm_log.patterns import classify
from vllm_ctxmgr.vllm_log.watcher import observe_start

OK = "ok"
DEGRADED = "degraded"
FAILED = "failed"
RESULTS = (OK, DEGRADED, FAILED)
EXIT_CODES = {OK: 0, DEGRADED: 1, FAILED: 2}  # verify's own exit codes
LAST_VERIFY = "last-verify.json"

JOURNAL_LINES_LIMIT = 5000  # a start logs a few hundred lines; stop reading the journal after this

Printer = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Facts and results


@dataclass(frozen=True)
class UnitFacts:
    """What systemd says about the service now."""

    active_state: str
    sub_state: str
    result: str
    n_restarts: int
    invocation_id: str
    active_enter_monotonic_us: int
    serving_since: float | None  # wall-clock time of ActiveEnterTimestamp
    started_at: float | None = None  # wall-clock time the current start began (InactiveExitTimestamp)


@dataclass(frozen=True)
class VerifyFacts:
    """Everything a verification looks at, gathered before anything is decided."""

    service: str
    time: float
    unit: UnitFacts
    max_model_len: int | None  # the unit's --max-model-len
    gpu_memory_utilization: float  # the unit's, or vLLM's default for its version
    configured_gpu_memory_utilization: float | None  # the unit's --gpu-memory-utilization
    kv_cache_memory_bytes: int | None
    graphs_in_budget: bool  # vLLM subtracts CUDA graphs from the KV budget (>= 0.21, not eager)
    probe: dict[str, Any] | None  # ProbeResult as a dict; None when the unit is not active
    server_vllm_version: str | None  # GET /version
    observation: dict[str, Any] | None  # vLLM's numbers logged by the running process
    cache_config: dict[str, str]  # labels of vLLM's vllm:cache_config_info (/metrics); {} when off
    last_start: dict[str, Any] | None  # the last start ctxmgr watched (observations.jsonl)
    last_verify: dict[str, Any] | None
    revisions: tuple[dict[str, Any], ...]  # Revision.to_json() of every revision, oldest first
    current_revision: int | None  # the good revision whose unit is installed now
    in_progress: int | None  # a revision left in progress
    gpus: GpuState | None
    gpu_note: str | None  # why GPU memory was not checked
    service_pids: tuple[int, ...]
    notes: tuple[str, ...] = ()
    start_timeout_s: float = 1800.0  # how long a start may take before "still starting" becomes failed


@dataclass(frozen=True)
class GpuMargin:
    """One GPU now, against the plan: what a restart would find and what the KV budget keeps."""

    index: int
    total_bytes: int
    used_by_others_planned: int
    used_by_others_now: int
    used_by_others_source: str
    service_bytes: int | None  # what vLLM's processes hold now (None: the driver does not say)
    startup_bytes: int  # what vLLM asks to be free at startup: ceil(total x utilisation) (+ graphs)
    startup_slack_planned: int  # free memory beyond startup_bytes at plan time
    startup_slack_now: int  # ... and now: below 0 a restart fails vLLM's free-memory check
    kv_budget_bytes: int | None
    kv_budget_source: str
    kv_needed_bytes: int | None  # one request of max_model_len + the null block (the plan's figure)
    kv_spare_bytes: int | None  # kv_budget - kv_needed
    margin_bytes: int  # the plan's margin for this GPU

    @property
    def margin_left_bytes(self) -> int:
        """The smaller of the free memory a restart keeps and the KV budget beyond one request."""
        if self.kv_spare_bytes is None:
            return self.startup_slack_now
        return min(self.startup_slack_now, self.kv_spare_bytes)


@dataclass
class Verification:
    service: str
    result: str  # ok | degraded | failed
    time: float
    reasons: list[str] = field(default_factory=list)  # why it is not ok
    notes: list[str] = field(default_factory=list)  # what was not checked, and other context
    max_model_len: int | None = None  # what vLLM reports (else the unit's)
    probe_ok: bool | None = None
    probe_latency_s: float | None = None
    probe: dict[str, Any] = field(default_factory=dict)
    vllm_version: str | None = None
    kv_cache_tokens: int | None = None
    available_kv_gib: float | None = None
    margin_bytes: int | None = None  # the smallest margin left over the GPUs
    gpus: list[dict[str, Any]] = field(default_factory=list)
    unit: dict[str, Any] = field(default_factory=dict)
    revision: int | None = None
    duration_s: float | None = None
    action: dict[str, Any] = field(default_factory=dict)  # what --on-failure did

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.result]

    @property
    def success(self) -> bool:
        return self.result == OK

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["exit_code"] = self.exit_code
        return data


# ---------------------------------------------------------------------------------------------
# The pure decision


def gib(value: float | int | None) -> str:
    return "?" if value is None else f"{value / GIB:.2f} GiB"


def service_memory(
    gpu: GpuInfo, service_pids: Sequence[int], service_running: bool, startup_bytes: int
) -> tuple[int, int | None, str]:
    """(used by others, used by the service, source) on one GPU.

    The service's processes are told apart by PID; where none of them is visible (a container in
    another PID namespace) a running vLLM is taken to hold what it asked for at startup.
    """
    mine = [p for p in gpu.processes if p.pid in service_pids]
    if mine and all(p.used_bytes is not None for p in mine):
        own = sum(p.used_bytes or 0 for p in mine)
        return max(0, gpu.used_bytes - own), own, "service excluded"
    if mine:
        others = sum(p.used_bytes or 0 for p in gpu.processes if p.pid not in service_pids)
        return others, None, "other processes"
    if not service_running:
        return gpu.used_bytes, 0, "service not running"
    return max(0, gpu.used_bytes - startup_bytes), None, "estimate (no process of the service visible)"


def gpu_margins(
    plan: StoredPlan,
    gpus: GpuState,
    service_pids: Sequence[int],
    service_running: bool,
    gpu_memory_utilization: float,
    graphs_in_budget: bool,
    kv_cache_memory_bytes: int | None,
    available_kv_bytes: int | None,
    same_max_model_len: bool,
) -> tuple[list[GpuMargin], list[str]]:
    """Each planned GPU as it is now. Returns the margins and the GPUs the plan names that are gone."""
    by_index = {g.index: g for g in gpus.gpus}
    margins: list[GpuMargin] = []
    missing: list[str] = []
    for line in plan.gpus:
        index = int(line["index"])
        info = by_index.get(index)
        total = plan.figure(line, "total")
        if info is None or total is None:
            missing.append(f"GPU {index}")
            continue
        overhead = plan.figure(line, "startup_overhead") or 0
        graphs = 0 if graphs_in_budget else (plan.figure(line, "cuda_graphs") or 0)
        startup = requested_bytes(info.total_bytes, gpu_memory_utilization)
        planned_requested = plan.figure(line, "requested")
        if kv_cache_memory_bytes is not None and planned_requested is not None:
            startup = max(startup, planned_requested)  # weights + non-KV + the explicit KV budget
        startup += graphs
        others_planned = plan.figure(line, "used_by_others") or 0
        others_now, own, source = service_memory(info, service_pids, service_running, startup)
        slack_planned = info.total_bytes - others_planned - overhead - startup
        slack_now = info.total_bytes - others_now - overhead - startup
        margin = plan.figure(line, "margin") or margin_bytes(info.total_bytes)
        needed = plan.figure(line, "kv_needed") if same_max_model_len else None
        if available_kv_bytes is not None:
            budget, budget_source = available_kv_bytes, "vllm log"
        else:
            planned_budget = plan.figure(line, "kv_budget")
            budget_source = "plan"
            if planned_budget is not None and kv_cache_memory_bytes is None and planned_requested is not None:
                # the budget moves with the utilisation the unit runs at
                planned_budget = kv_budget_at_utilization(
                    planned_budget, planned_requested, info.total_bytes, gpu_memory_utilization
                )
                budget_source = "plan at the unit's utilisation"
            budget = planned_budget
        spare = budget - needed if budget is not None and needed is not None else None
        margins.append(
            GpuMargin(
                index=index,
                total_bytes=info.total_bytes,
                used_by_others_planned=others_planned,
                used_by_others_now=others_now,
                used_by_others_source=source,
                service_bytes=own,
                startup_bytes=startup,
                startup_slack_planned=slack_planned,
                startup_slack_now=slack_now,
                kv_budget_bytes=budget,
                kv_budget_source=budget_source,
                kv_needed_bytes=needed,
                kv_spare_bytes=spare,
                margin_bytes=margin,
            )
        )
    return margins, missing


def margin_reasons(margins: Sequence[GpuMargin]) -> list[str]:
    """Why the memory around a restart is no longer what the plan kept (empty: it still is)."""
    reasons = []
    for g in margins:
        growth = g.used_by_others_now - g.used_by_others_planned
        if g.startup_slack_now < 0:
            reasons.append(
                f"GPU {g.index}: a restart would fail vLLM's free-memory check: other processes hold "
                f"{gib(g.used_by_others_now)} ({gib(g.used_by_others_planned)} when planned), so only "
                f"{gib(g.startup_bytes + g.startup_slack_now)} would be free for the "
                f"{gib(g.startup_bytes)} vLLM asks for"
            )
        elif growth > g.margin_bytes and g.startup_slack_now < g.margin_bytes:
            reasons.append(
                f"GPU {g.index}: the margin is gone: other processes took {gib(growth)} more since the "
                f"plan ({gib(g.used_by_others_now)} now); a restart would keep only "
                f"{gib(g.startup_slack_now)} free, less than the plan's margin of {gib(g.margin_bytes)}"
            )
        if g.kv_spare_bytes is not None and g.kv_spare_bytes < g.margin_bytes:
            what = "no longer holds" if g.kv_spare_bytes < 0 else "keeps less than the plan's margin beyond"
            reasons.append(
                f"GPU {g.index}: the KV budget ({gib(g.kv_budget_bytes)}, {g.kv_budget_source}) {what} "
                f"one request of max_model_len ({gib(g.kv_needed_bytes)}): "
                f"{gib(g.kv_spare_bytes)} spare, margin {gib(g.margin_bytes)}"
            )
    return reasons


def _latest_plan(revisions: Sequence[Mapping[str, Any]], current: int | None) -> Mapping[str, Any] | None:
    """The plan behind the installed unit: its own revision's, or the one it rolled back to."""
    by_number = {r["number"]: r for r in revisions}
    seen: set[int] = set()
    number = current
    while number is not None and number in by_number and number not in seen:
        seen.add(number)
        rev = by_number[number]
        if rev.get("plan"):
            return rev
        number = rev.get("rollback_of")
    return None


def decide(facts: VerifyFacts) -> Verification:
    """ok / degraded / failed, with every reason; no I/O."""
    unit = facts.unit
    result = Verification(facts.service, OK, facts.time, notes=list(facts.notes))
    result.unit = asdict(unit)
    result.revision = facts.current_revision
    failed: list[str] = []
    degraded: list[str] = []

    # -- serving at all ------------------------------------------------------------------------
    observation = facts.observation or {}
    probe = facts.probe or {}
    if probe:
        result.probe = dict(probe)
        result.probe_ok = bool(probe.get("ok"))
        result.probe_latency_s = probe.get("latency_s")
        if probe.get("max_model_len") is not None:
            result.max_model_len = probe.get("max_model_len")
    starting = _starting(facts, observation, probe)
    if starting is not None:
        (degraded if starting < facts.start_timeout_s else failed).append(
            f"vLLM is still starting: {starting:.0f} s since the start, no ready line yet"
            + (
                ""
                if starting < facts.start_timeout_s
                else f" (a start may take {facts.start_timeout_s:.0f} s)"
            )
        )
    elif unit.active_state != "active":
        detail = f"{unit.active_state} ({unit.sub_state})"
        if unit.result and unit.result != "success":
            detail += f", result {unit.result}"
        failed.append(f"{facts.service} is not active: {detail}")
    elif probe and not probe.get("ok"):
        failed.append(f"the probe failed: {probe.get('error')}")
    if result.max_model_len is None:
        result.max_model_len = facts.max_model_len

    last_start = facts.last_start or {}
    result.vllm_version = facts.server_vllm_version or observation.get("vllm_version")
    blocks, block_size = (
        _int(facts.cache_config.get("num_gpu_blocks")),
        _int(facts.cache_config.get("block_size")),
    )
    result.kv_cache_tokens = (
        blocks * block_size if blocks and block_size else observation.get("kv_cache_tokens")
    )
    result.available_kv_gib = observation.get("available_kv_gib")

    # -- restarts since the last verification ----------------------------------------------------
    last = facts.last_verify
    if last is None:
        result.notes.append("first verification of this service: its state is the baseline from now on")
    elif unit.active_state == "active":
        changed_by_ctxmgr = [r for r in facts.revisions if r.get("created", 0) > last.get("time", 0)]
        new_invocation = bool(last.get("invocation_id")) and last.get("invocation_id") != unit.invocation_id
        more_restarts = unit.n_restarts > int(last.get("n_restarts") or 0)
        was_down = last.get("active_state") not in (None, "active")
        if (new_invocation or more_restarts) and was_down:
            result.notes.append(f"started again since the last verification found it {last['active_state']}")
        elif (new_invocation or more_restarts) and changed_by_ctxmgr:
            number = changed_by_ctxmgr[-1]["number"]
            result.notes.append(f"restarted by ctxmgr since the last verification (revision {number})")
        elif more_restarts:
            degraded.append(
                f"systemd restarted {facts.service} since the last verification: NRestarts "
                f"{last.get('n_restarts')} -> {unit.n_restarts}"
                + (f", serving again since {_clock(unit.serving_since)}" if unit.serving_since else "")
            )
        elif new_invocation:
            degraded.append(
                f"{facts.service} was restarted since the last verification, not by ctxmgr"
                + (f" (serving since {_clock(unit.serving_since)})" if unit.serving_since else "")
            )

    # -- the running vLLM against the last start ctxmgr watched ---------------------------------
    before = last_start.get("vllm_version")
    if result.vllm_version and before and _version(before) != _version(result.vllm_version):
        degraded.append(
            f"the vLLM version changed since the last start ctxmgr watched: {before} -> {result.vllm_version}"
            f" (`ctxmgr observe --service {facts.service}` makes the running start the reference)"
        )
    planned = _latest_plan(facts.revisions, facts.current_revision)
    plan = StoredPlan.from_json(planned["plan"] if planned else None)
    drift_limit = min(plan.margins, default=DEFAULT_MARGIN_MIN_BYTES)
    same_config = (
        last_start.get("configured_max_model_len") == facts.max_model_len
        and last_start.get("configured_kv_cache_memory_bytes") == facts.kv_cache_memory_bytes
        and _same_float(
            last_start.get("configured_gpu_memory_utilization"), facts.configured_gpu_memory_utilization
        )
    )
    blocks_then = _int(last_start.get("num_gpu_blocks"))
    block_bytes = plan.bytes_per_block
    kv_now, kv_then = observation.get("available_kv_gib"), last_start.get("available_kv_gib")
    if same_config and blocks and blocks_then and block_bytes:
        if abs(blocks - blocks_then) * block_bytes > drift_limit:
            moved = gib((blocks - blocks_then) * block_bytes)
            degraded.append(
                f"memory drifted: vLLM has {blocks:,} KV cache blocks in this process, {blocks_then:,} at "
                f"the last start ctxmgr watched with the same flags ({moved})"
            )
    elif (
        same_config
        and kv_now is not None
        and kv_then is not None
        and abs(kv_now - kv_then) * GIB > drift_limit
    ):
        degraded.append(
            f"memory drifted: vLLM's KV budget is {kv_now:.2f} GiB per GPU in this process, "
            f"{kv_then:.2f} GiB at the last start ctxmgr watched with the same flags"
        )

    # -- the unit against ctxmgr's revisions ----------------------------------------------------
    if facts.in_progress is not None:
        degraded.append(
            f"revision {facts.in_progress} was left in progress by an interrupted ctxmgr run: "
            f"run `ctxmgr recover --service {facts.service}`"
        )
    good = [r for r in facts.revisions if r.get("state") in (FINAL, BASELINE)]
    if good and facts.current_revision is None:
        newest = good[-1]
        degraded.append(
            f"the unit is none of the revisions ctxmgr installed: it was edited outside ctxmgr "
            f"(max_model_len {facts.max_model_len}; revision {newest['number']} has "
            f"{newest.get('max_model_len')})"
        )

    # -- GPU memory now against the plan's margin -----------------------------------------------
    if facts.gpus is None:
        result.notes.append(f"GPU memory not checked: {facts.gpu_note or 'no GPU information'}")
    elif planned is None:
        result.notes.append("GPU memory not checked against a plan: ctxmgr has not planned this unit")
    else:
        available = observation.get("available_kv_gib")
        margins, missing = gpu_margins(
            plan,
            facts.gpus,
            facts.service_pids,
            unit.active_state == "active",
            facts.gpu_memory_utilization,
            facts.graphs_in_budget,
            facts.kv_cache_memory_bytes,
            int(available * GIB) if isinstance(available, int | float) else None,
            plan.max_model_len == facts.max_model_len,
        )
        for name in missing:
            degraded.append(f"{name}, which the plan of revision {planned['number']} uses, is not there now")
        degraded.extend(margin_reasons(margins))
        degraded.extend(_own_memory_drift(margins, last, unit.invocation_id))
        result.gpus = [{**asdict(m), "margin_left_bytes": m.margin_left_bytes} for m in margins]
        if margins:
            result.margin_bytes = min(m.margin_left_bytes for m in margins)

    if result.kv_cache_tokens is None and result.available_kv_gib and planned is not None:
        per_token = plan.kv_bytes_per_token_per_gpu
        if per_token:
            result.kv_cache_tokens = int(result.available_kv_gib * GIB // per_token)

    result.reasons = failed + degraded
    result.result = FAILED if failed else DEGRADED if degraded else OK
    return result


def _starting(facts: VerifyFacts, observation: Mapping[str, Any], probe: Mapping[str, Any]) -> float | None:
    """Seconds since a start that has not logged vLLM's ready line (nor a failure) yet; None otherwise.

    A vLLM loading a large model answers nothing for many minutes while systemd already calls a
    Type=simple unit active: that is not a failure to restart or roll back, until the start timeout.
    """
    unit = facts.unit
    loading = (
        unit.active_state == "active"
        and not probe.get("ok")
        and facts.observation is not None
        and not observation.get("ready")
        and not observation.get("failure")
    )
    if unit.active_state != "activating" and not loading:
        return None
    since = unit.started_at or unit.serving_since
    return None if since is None else max(0.0, facts.time - since)


def _own_memory_drift(
    margins: Sequence[GpuMargin], last: Mapping[str, Any] | None, invocation_id: str
) -> list[str]:
    """vLLM preallocates: the same process holding more than the margin more points at a leak."""
    if not last or last.get("invocation_id") != invocation_id:
        return []
    before = {int(g["index"]): g.get("service_bytes") for g in last.get("gpus", [])}
    reasons = []
    for g in margins:
        then = before.get(g.index)
        if g.service_bytes is not None and then is not None and g.service_bytes - then > g.margin_bytes:
            reasons.append(
                f"GPU {g.index}: vLLM's own memory grew from {gib(then)} to {gib(g.service_bytes)} "
                "since the last verification of the same process"
            )
    return reasons


def _int(value: Any) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def _version(text: str) -> str:
    return text.strip().lstrip("v")


def _same_float(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(float(a) - float(b)) < 1e-6


def _clock(when: float | None) -> str:
    return "?" if when is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def record(verification: Verification, facts: VerifyFacts) -> dict[str, Any]:
    """What the next verification compares against (SERVICE/last-verify.json)."""
    verified = set((facts.last_verify or {}).get("verified_revisions", []))
    if verification.result != FAILED and facts.current_revision is not None:
        verified.add(facts.current_revision)
    return {
        "time": verification.time,
        "result": verification.result,
        "reasons": verification.reasons,
        "active_state": facts.unit.active_state,
        "invocation_id": facts.unit.invocation_id,
        "n_restarts": facts.unit.n_restarts,
        "active_enter_monotonic_us": facts.unit.active_enter_monotonic_us,
        "max_model_len": verification.max_model_len,
        "vllm_version": verification.vllm_version,
        "probe_latency_s": verification.probe_latency_s,
        "kv_cache_tokens": verification.kv_cache_tokens,
        "margin_bytes": verification.margin_bytes,
        "revision": facts.current_revision,
        "verified_revisions": sorted(verified),
        "gpus": [{"index": g["index"], "service_bytes": g["service_bytes"]} for g in verification.gpus],
        "action": verification.action,
    }


# ---------------------------------------------------------------------------------------------
# Gathering (I/O)


@dataclass
class VerifyOptions:
    long_probe: bool = False
    probe_timeout: float = 120.0
    gpus_from: str | None = None  # a `ctxmgr gpus --json` file instead of NVML
    start_timeout: float = 1800.0  # a start without vLLM's ready line is "still starting" this long


def _wall_clock(monotonic_us: int) -> float | None:
    """systemd's CLOCK_MONOTONIC microseconds as Unix time (the same clock here: no time namespace)."""
    if not monotonic_us:
        return None
    return time.time() - (time.clock_gettime(time.CLOCK_MONOTONIC) - monotonic_us / 1e6)


def unit_facts(systemd: Systemd, unit: str) -> UnitFacts:
    state = systemd.state(unit)
    exit_us = systemd.show(unit, "InactiveExitTimestampMonotonic").get("InactiveExitTimestampMonotonic", "")
    return UnitFacts(
        active_state=state.active_state,
        sub_state=state.sub_state,
        result=state.result,
        n_restarts=state.n_restarts,
        invocation_id=state.invocation_id,
        active_enter_monotonic_us=state.active_enter_monotonic_us,
        serving_since=_wall_clock(state.active_enter_monotonic_us),
        started_at=_wall_clock(int(exit_us)) if exit_us.isdigit() else None,
    )


def invocation_messages(systemd: Systemd, invocation_id: str, limit: int = JOURNAL_LINES_LIMIT) -> list[str]:
    """The first log lines of one run of a unit, up to vLLM's ready line (journal match on the invocation)."""

    if not invocation_id:
        return []
    argv = systemd.command(
        "journalctl", "--no-pager", "-o", "json", "--all", f"_SYSTEMD_INVOCATION_ID={invocation_id}"
    )
    env = dict(os.environ, SYSTEMD_PAGER="", SYSTEMD_COLORS="0", PAGER="cat")
    messages: list[str] = []
    try:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
    except FileNotFoundError:
        return []
    try:
        assert process.stdout is not None
        for raw in process.stdout:
            if not raw.strip():
                continue
            entry = parse_journal_json(raw)[0]
            messages.append(entry.message)
            event = classify(entry.message)
            if (event is not None and event.kind == "ready") or len(messages) >= limit:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
    return messages


def server_version(base_url: str, api_key: str | None, timeout: float) -> str | None:
    """vLLM's GET /version."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(base_url.rstrip("/") + "/version", headers=headers, timeout=timeout)
        if response.status_code == 200:
            version = response.json().get("version")
            return str(version) if version else None
    except (requests.RequestException, ValueError, AttributeError):
        return None
    return None


def _served_max_model_len(base_url: str, api_key: str | None, timeout: float) -> int | None:
    """What /v1/models reports, for a unit that leaves max_model_len to vLLM."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        cards = requests.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout).json()
        value = cards["data"][0].get("max_model_len")
        return int(value) if value else None
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
        return None


def installed_revision(store: ServiceStore, revisions: Sequence[Revision], unit_bytes: bytes) -> int | None:
    """The newest good revision whose unit is byte for byte the one installed now."""
    for rev in reversed(revisions):
        if rev.state not in (FINAL, BASELINE):
            continue
        with contextlib.suppress(OSError):
            if store.unit_bytes(rev.number, "unit") == unit_bytes:
                return rev.number
    return None


def gather(
    systemd: Systemd, store: ServiceStore, service: str, options: VerifyOptions, on_step: Printer = _quiet
) -> VerifyFacts:
    """Read the unit, systemd's state, the journal of the running process, GPU memory; probe."""

    now = time.time()
    view = read_service(systemd, service)
    unit = unit_facts(systemd, view.name)
    notes: list[str] = []
    revisions = store.revisions()
    current = installed_revision(store, revisions, systemd.host_path(view.unit_path).read_bytes())
    stored = store.observations()
    last_start = stored[-1] if stored else None

    active = unit.active_state == "active"
    observation = None
    if unit.active_state in ("active", "activating"):
        messages = invocation_messages(systemd, unit.invocation_id)
        if messages:
            observation = asdict(observe_start(messages))
    quick = min(options.probe_timeout, 10.0)
    server = server_version(view.base_url, view.api_key, quick) if active else None
    cache_config = cache_config_info(view.base_url, api_key=view.api_key, timeout=quick) if active else {}
    version_text = (
        server
        or (observation or {}).get("vllm_version")
        or (last_start or {}).get("vllm_version")
        or next((r.vllm_version for r in reversed(revisions) if r.vllm_version), None)
    )
    vllm_version = parse_vllm_version(version_text) or NEWEST_VLLM
    utilization = view.args.gpu_memory_utilization or default_gpu_memory_utilization(vllm_version)

    probe_json = None
    if active:
        expected = (
            view.args.max_model_len if view.args.max_model_len and view.args.max_model_len > 0 else None
        )
        if expected is None:
            expected = (observation or {}).get("max_model_len") or _served_max_model_len(
                view.base_url, view.api_key, min(options.probe_timeout, 10.0)
            )
            notes.append(f"the unit leaves max_model_len to vLLM; the probe expects {expected}")
        if expected:
            on_step(f"probing {view.base_url} at max_model_len {expected}")
            outcome = probe(
                view.base_url,
                api_key=view.api_key,
                expected_max_model_len=int(expected),
                long_probe=options.long_probe,
                timeout=options.probe_timeout,
            )
            probe_json = asdict(outcome)
        else:
            probe_json = {
                "ok": False,
                "error": "vLLM reports no max_model_len",
                "latency_s": 0.0,
                "steps": [],
            }

    gpu_state, gpu_note = None, None
    if is_cpu_deployment(view.args):
        gpu_note = "the vLLM CPU build: its memory is not GPU memory"
    else:
        try:
            gpu_state, gpu_note = gather_gpus(gpus_from=options.gpus_from)
        except CtxmgrError as exc:
            if options.gpus_from:
                raise
            gpu_note = exc.message
    pids = tuple(systemd.unit_processes(view.name)) if gpu_state is not None else ()
    in_progress = store.in_progress()
    return VerifyFacts(
        service=store.service,
        time=now,
        unit=unit,
        max_model_len=view.args.max_model_len,
        gpu_memory_utilization=utilization,
        configured_gpu_memory_utilization=view.args.gpu_memory_utilization,
        kv_cache_memory_bytes=view.args.kv_cache_memory_bytes,
        graphs_in_budget=cuda_graphs_in_budget(vllm_version, view.args),
        probe=probe_json,
        server_vllm_version=server,
        observation=observation,
        cache_config=cache_config,
        last_start=last_start,
        last_verify=store.read_json(LAST_VERIFY),
        revisions=tuple(r.to_json() for r in revisions),
        current_revision=current,
        in_progress=in_progress.number if in_progress else None,
        gpus=gpu_state,
        gpu_note=gpu_note,
        service_pids=pids,
        notes=tuple(notes),
        start_timeout_s=options.start_timeout,
    )


# ---------------------------------------------------------------------------------------------
# Verifying, and acting on a failure


ON_FAILURE = ("none", "restart", "rollback")


def verify_service(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    options: VerifyOptions,
    lock_wait: float = 0.0,
    on_step: Printer = _quiet,
) -> tuple[Verification, VerifyFacts]:
    """Gather and decide under the service's lock (no change runs meanwhile); store the result."""
    started = time.monotonic()
    with store.lock(lock_wait):
        facts = gather(systemd, store, service, options, on_step)
        verification = decide(facts)
        verification.duration_s = round(time.monotonic() - started, 3)
        store.write_json(LAST_VERIFY, record(verification, facts))
    return verification, facts


def rollback_target(
    revisions: Sequence[Revision], verified: Sequence[int], current: int | None, current_unit: bytes,
    unit_bytes: Callable[[int], bytes],
) -> Revision | None:  # fmt: skip
    """The newest good revision other than the installed one that passed a verification (its apply's
    probe or a scheduled one), or the unit as ctxmgr found it."""
    verified_set = set(verified)
    for rev in reversed(revisions):
        if rev.state not in (FINAL, BASELINE) or rev.number == current:
            continue
        if not (rev.verified or rev.number in verified_set or rev.state == BASELINE):
            continue
        with contextlib.suppress(OSError):
            if unit_bytes(rev.number) == current_unit:
                continue
        return rev
    return None


def act_on_failure(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    how: str,
    facts: VerifyFacts,
    timeout: float = 1800.0,
    lock_wait: float = 0.0,
    on_step: Printer = _quiet,
) -> dict[str, Any]:
    """--on-failure restart|rollback after a failed verification; returns what was done (an action that
    could not run says why instead of raising, so the verification's result is still reported)."""
    try:
        return _act(systemd, store, service, how, facts, timeout, lock_wait, on_step)
    except CtxmgrError as exc:
        on_step(f"--on-failure {how} could not run: {exc.message}")
        return {"kind": how, "result": "error", "reason": exc.message}


def _act(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    how: str,
    facts: VerifyFacts,
    timeout: float,
    lock_wait: float,
    on_step: Printer,
) -> dict[str, Any]:

    deployer = Deployer(systemd, store, service, on_step=on_step, start_timeout=timeout)
    if how == "rollback":
        view = read_service(systemd, service)
        revisions = store.revisions()
        verified = (store.read_json(LAST_VERIFY) or {}).get("verified_revisions", [])
        current_unit = systemd.host_path(view.unit_path).read_bytes()
        target = rollback_target(
            revisions, verified, facts.current_revision, current_unit, lambda n: store.unit_bytes(n, "unit")
        )
        if target is not None:
            on_step(f"rolling {service} back to revision {target.number}, the last one that verified")
            change = rollback(deployer, target.number, lock_wait)
            action = {"kind": "rollback", "to": target.number, **_change_summary(change)}
            _note_restart_by_ctxmgr(systemd, store, deployer.unit, action)
            return action
        on_step("no other revision has passed a verification: restarting instead")
    change = restart_and_check(deployer, lock_wait)
    action = {"kind": "restart", **change}
    if how == "rollback":
        action["note"] = "no other revision has passed a verification"
    _note_restart_by_ctxmgr(systemd, store, deployer.unit, action)
    return action


def _change_summary(change: Any) -> dict[str, Any]:
    return {
        "result": change.result,
        "revision": change.revision,
        "reason": change.reason,
        "exit_code": change.exit_code,
        "max_model_len": change.max_model_len,
    }


def restart_and_check(deployer: Any, lock_wait: float = 0.0) -> dict[str, Any]:
    """Restart the unit as it is through the deployer's own path: watch the start, record vLLM's
    numbers, probe at the unit's max_model_len."""

    with deployer.store.lock(lock_wait):
        view = read_service(deployer.systemd, deployer.service)
        if not (view.args.max_model_len and view.args.max_model_len > 0):
            deployer.systemd.reset_failed(deployer.unit)
            deployer.systemd.restart(deployer.unit, no_block=False)
            return {"result": "restarted", "reason": "restarted (the unit sets no max_model_len to probe)"}
        verdict, outcome = deployer.restart_and_check(view, None, False)
    if not verdict.ok:
        return {"result": "failed", "reason": verdict.reason, "decisive_line": verdict.decisive_line}
    if outcome is None or not outcome.ok:
        return {"result": "failed", "reason": f"the probe failed: {outcome.error if outcome else 'no probe'}"}
    return {"result": "serving", "reason": "vLLM started again and served the context-sized probe"}


def _note_restart_by_ctxmgr(systemd: Systemd, store: ServiceStore, unit: str, action: dict[str, Any]) -> None:
    """The next verification must not count ctxmgr's own restart as one behind its back."""
    last = store.read_json(LAST_VERIFY) or {}
    state = systemd.state(unit)
    last.update(
        invocation_id=state.invocation_id,
        n_restarts=state.n_restarts,
        active_enter_monotonic_us=state.active_enter_monotonic_us,
        action=action,
    )
    store.write_json(LAST_VERIFY, last)


# ---------------------------------------------------------------------------------------------
# Text


def verification_text(v: Verification) -> str:
    """One headline (the journal's summary line), then a line per reason and note."""
    parts = []
    if v.max_model_len is not None:
        parts.append(f"max_model_len {v.max_model_len}")
    if v.probe_latency_s is not None:
        parts.append(f"probe {v.probe_latency_s:.2f} s")
    if v.kv_cache_tokens is not None:
        parts.append(f"KV cache {v.kv_cache_tokens:,} tokens")
    if v.margin_bytes is not None:
        parts.append(f"margin {gib(v.margin_bytes)}")
    if v.vllm_version:
        parts.append(f"vLLM {v.vllm_version}")
    lines = [f"{v.service}: {v.result}" + (f" ({', '.join(parts)})" if parts else "")]
    lines += [f"  {v.result}: {reason}" for reason in v.reasons]
    lines += [f"  note: {note}" for note in v.notes]
    if v.action:
        lines.append(
            f"  on failure: {v.action.get('kind')}: {v.action.get('result')}: {v.action.get('reason', '')}"
        )
    return "\n".join(lines)
