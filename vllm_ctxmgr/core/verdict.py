"""The verdict of a verification: ok, degraded or failed, each with its reasons. PURE: no I/O.

verify.py gathers (systemd, the journal, HTTP, NVML, the state store) into a VerifyFacts of plain
values; decide() turns it into a Verification. Nothing here reads a file, a clock or the environment,
so a verdict can be replayed from the facts alone (tests/core/test_verdict.py does).

failed: the service cannot serve now, so --on-failure may restart or roll back:
- the unit is not active, or the probe fails (/health, /v1/models reporting the unit's max_model_len,
  the context-sized completion, optionally the ~90% prompt);
- a start has logged no ready line for longer than the start timeout.
degraded: it serves, but something that decides the next start has moved, so the next restart may
not come back as planned (nobody is paged into a restart for it):
- the unit restarted since the last verification, and not by ctxmgr (NRestarts, InvocationID);
- the vLLM version or vLLM's own KV budget differ from those of the last start ctxmgr watched;
- GPU memory now leaves a restart less than the plan's margin: other processes grew so that vLLM's
  startup free-memory check (ceil(total x utilisation) must be free) would fail or nearly so, or the
  KV budget no longer keeps the margin beyond one request;
- vLLM's own GPU memory grew since the last verification of the same process;
- the unit was edited outside ctxmgr, or a change was left in progress by an interrupted run;
- a start is still loading (no ready line yet, within the start timeout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import NotRequired, TypedDict, cast

from vllm_ctxmgr.core.budget import (
    DEFAULT_MARGIN_MIN_BYTES,
    kv_budget_at_utilization,
    margin_bytes,
    requested_bytes,
)
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState, gib
from vllm_ctxmgr.core.json_types import JSONObject
from vllm_ctxmgr.core.observations import ObservationFigures, StoredObservation
from vllm_ctxmgr.core.plan_record import StoredPlan
from vllm_ctxmgr.core.records import ProbeRecord, RevisionRecord
from vllm_ctxmgr.core.upgrade import CapacityMove, CapacityMoveRecord
from vllm_ctxmgr.errors import VerifyExit


class Verdict(StrEnum):
    """A verification's one word: verify's `result`, a deployment's and a node's, with verify's exit
    code (errors.VerifyExit, the monitoring-plugin convention). A StrEnum: JSON writes the word."""

    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"

    @property
    def exit_code(self) -> VerifyExit:
        return VerifyExit[self.name]


OK, DEGRADED, FAILED = Verdict.OK, Verdict.DEGRADED, Verdict.FAILED
RESULTS = tuple(Verdict)
EXIT_CODES = {verdict: verdict.exit_code for verdict in Verdict}  # verify's own exit codes
# the store's State.FINAL and State.BASELINE as Revision.to_json() writes them: the revisions whose unit
# ctxmgr stands behind (the core cannot import the store; tests/core/test_verdict.py ties the two)
GOOD_STATES = ("final", "baseline")

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
    probe: ProbeRecord | None  # None when the unit is not active
    server_vllm_version: str | None  # GET /version
    observation: ObservationFigures | None  # vLLM's numbers logged by the running process
    cache_config: dict[str, str]  # labels of vLLM's vllm:cache_config_info (/metrics); {} when off
    last_start: StoredObservation | None  # the last start ctxmgr watched (observations.jsonl)
    last_verify: LastVerifyRecord | None  # what the last verification stored
    revisions: tuple[RevisionRecord, ...]  # every revision, oldest first
    current_revision: int | None  # the good revision whose unit is installed now
    in_progress: int | None  # a revision left in progress
    gpus: GpuState | None
    gpu_note: str | None  # why GPU memory was not checked
    service_pids: tuple[int, ...]
    notes: tuple[str, ...] = ()
    start_timeout_s: float = 1800.0  # how long a start may take before "still starting" becomes failed
    # the unit re-planned under the release its next start runs, against the one it was planned or last
    # started under (core/upgrade.py); None where that release is the same
    vllm_upgrade: CapacityMoveRecord | None = None


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


class UnitRecord(TypedDict, total=False):
    """UnitFacts as a dict: what systemd said about the service, in a verification's JSON ({} in a
    Verification that decide() has not filled)."""

    active_state: str
    sub_state: str
    result: str
    n_restarts: int
    invocation_id: str
    active_enter_monotonic_us: int
    serving_since: float | None
    started_at: float | None


class GpuMarginRecord(TypedDict):
    """One GPU of a verification's JSON: GpuMargin as a dict, with the margin it leaves."""

    index: int
    total_bytes: int
    used_by_others_planned: int
    used_by_others_now: int
    used_by_others_source: str
    service_bytes: int | None
    startup_bytes: int
    startup_slack_planned: int
    startup_slack_now: int
    kv_budget_bytes: int | None
    kv_budget_source: str
    kv_needed_bytes: int | None
    kv_spare_bytes: int | None
    margin_bytes: int
    margin_left_bytes: int


class VerifiedGpu(TypedDict):
    """What last-verify.json keeps of a GPU: vLLM's own memory then, for own_memory_drift."""

    index: int
    service_bytes: int | None


class LastVerifyRecord(TypedDict):
    """SERVICE/last-verify.json as `record` writes it (verify adds `trigger`): what the next
    verification compares against. ctxmgr's own root-only file, read back as written."""

    time: float
    result: str
    reasons: list[str]
    active_state: str
    invocation_id: str
    n_restarts: int
    active_enter_monotonic_us: int
    max_model_len: int | None
    vllm_version: str | None
    probe_latency_s: float | None
    kv_cache_tokens: int | None
    margin_bytes: int | None
    revision: int | None
    verified_revisions: list[int]
    gpus: list[VerifiedGpu]
    action: JSONObject
    gpu_memory_checked: bool | None
    trigger: NotRequired[str]  # added by verify: what started this run (timer, command)


@dataclass
class Verification:
    service: str
    result: Verdict
    time: float
    reasons: list[str] = field(default_factory=list)  # why it is not ok
    notes: list[str] = field(default_factory=list)  # what was not checked, and other context
    max_model_len: int | None = None  # what vLLM reports (else the unit's)
    planned_max_model_len: int | None = None  # the newest good revision's: what ctxmgr last put in place
    probe_ok: bool | None = None
    probe_latency_s: float | None = None
    probe: ProbeRecord = field(default_factory=ProbeRecord)
    vllm_version: str | None = None
    kv_cache_tokens: int | None = None
    available_kv_gib: float | None = None
    margin_bytes: int | None = None  # the smallest margin left over the GPUs
    gpus: list[GpuMarginRecord] = field(default_factory=list)
    unit: UnitRecord = field(default_factory=UnitRecord)  # {} until decide() fills it
    revision: int | None = None
    duration_s: float | None = None
    action: JSONObject = field(default_factory=dict)  # what --on-failure did
    gpu_memory_checked: bool | None = None  # False: ok says nothing about the next restart's memory
    vllm_upgrade: CapacityMoveRecord | None = None  # what another vLLM release moves (core/upgrade.py)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.result]

    @property
    def success(self) -> bool:
        return self.result == OK

    def to_json(self) -> JSONObject:
        data = asdict(self)
        data["exit_code"] = self.exit_code
        return data


# ---------------------------------------------------------------------------------------------
# The pure decision


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
    """Why the memory around a restart is no longer what the plan kept (empty: it still is); degraded,
    since vLLM serves on what it preallocated and only its next start meets the memory now.

    - other processes hold so much that ceil(total x utilisation) is no longer free: vLLM's startup
      check would refuse the next start outright;
    - they grew by more than the plan's margin and the free memory beyond the request is under it;
    - the KV budget keeps less than the margin beyond one request of max_model_len (the plan's figure,
      else vLLM's log): a start would fail, or nearly, vLLM's "not enough KV cache" check.
    """
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


def _latest_plan(revisions: Sequence[RevisionRecord], current: int | None) -> RevisionRecord | None:
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


Clock = Callable[[float], str]


def utc_clock(when: float) -> str:
    """Unix time as UTC 'YYYY-MM-DD HH:MM:SS'. The local zone is the environment's (TZ, /etc/localtime),
    which the core may not read: verify.py passes a local-time clock; this default keeps a verdict
    replayed from its facts alone the same on every machine (days to civil date: Hinnant's algorithm,
    since datetime would bring clocks into the core)."""
    seconds = int(when)
    days, rest = divmod(seconds, 86400)
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    return f"{year:04d}-{month:02d}-{day:02d} {rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def _baseline_context(facts: VerifyFacts) -> int | None:
    """A service ctxmgr has not changed: the context its unit sets, the baseline as ctxmgr finds it, so
    ctxmgr_verify_planned_max_model_len is written and the alert that compares the served context
    with it can fire (left out, CtxmgrContextBelowPlanned never could). None where
    the unit sets none (or `auto`): vLLM's own choice is then no plan to hold it to."""
    if facts.revisions or facts.max_model_len is None or facts.max_model_len <= 0:
        return None
    return facts.max_model_len


def decide(facts: VerifyFacts, clock: Clock = utc_clock) -> Verification:
    """ok / degraded / failed, with every reason; no I/O. `clock` writes the times in the reasons."""
    unit = facts.unit
    result = Verification(facts.service, OK, facts.time, notes=list(facts.notes))
    result.unit = cast(UnitRecord, asdict(unit))
    result.revision = facts.current_revision
    good = [r for r in facts.revisions if r.get("state") in GOOD_STATES]
    result.planned_max_model_len = good[-1].get("max_model_len") if good else _baseline_context(facts)
    observation = facts.observation or {}
    probe = facts.probe or {}
    if probe:
        result.probe = probe.copy()
        result.probe_ok = bool(probe.get("ok"))
        result.probe_latency_s = probe.get("latency_s")
        if probe.get("max_model_len") is not None:
            result.max_model_len = probe.get("max_model_len")
    failed, degraded = serving_reasons(facts)
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

    restart_degraded, restart_notes = restart_reasons(facts, clock)
    degraded += restart_degraded
    result.notes += restart_notes
    degraded += version_reasons(facts.service, result.vllm_version, last_start)
    degraded += upgrade_reasons(facts)
    result.vllm_upgrade = facts.vllm_upgrade
    planned = _latest_plan(facts.revisions, facts.current_revision)
    plan = StoredPlan.from_json(planned["plan"] if planned else None)
    degraded += kv_drift_reasons(facts, plan, blocks)
    degraded += revision_reasons(facts)

    # -- GPU memory now against the plan's margin -----------------------------------------------
    result.gpu_memory_checked = facts.gpus is not None and planned is not None
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
            # the plan's margins are per GPU: a GPU gone (a failed card, CUDA_VISIBLE_DEVICES) leaves
            # the next start without the memory it was planned on
            degraded.append(f"{name}, which the plan of revision {planned['number']} uses, is not there now")
        degraded.extend(margin_reasons(margins))
        degraded.extend(own_memory_drift(margins, facts.last_verify, unit.invocation_id))
        result.gpus = [
            cast(GpuMarginRecord, {**asdict(m), "margin_left_bytes": m.margin_left_bytes}) for m in margins
        ]
        if margins:
            result.margin_bytes = min(m.margin_left_bytes for m in margins)

    if result.kv_cache_tokens is None and result.available_kv_gib and planned is not None:
        per_token = plan.kv_bytes_per_token_per_gpu
        if per_token:
            result.kv_cache_tokens = int(result.available_kv_gib * GIB // per_token)

    result.reasons = failed + degraded
    result.result = FAILED if failed else DEGRADED if degraded else OK
    return result


def serving_reasons(facts: VerifyFacts) -> tuple[list[str], list[str]]:
    """(failed, degraded) about serving at all.

    Not active, or a probe that fails, is failed: the service does not answer what ctxmgr set, and
    only a restart or a rollback can change that. A start without vLLM's ready line is degraded while
    it is within the start timeout (a large model loads for many minutes) and failed beyond it.
    """
    unit = facts.unit
    observation = facts.observation or {}
    probe = facts.probe or {}
    failed: list[str] = []
    degraded: list[str] = []
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
    return failed, degraded


def restart_reasons(facts: VerifyFacts, clock: Clock = utc_clock) -> tuple[list[str], list[str]]:
    """(degraded, notes) about restarts since the last verification.

    A restart nobody asked for (systemd's Restart= after a crash, an operator, a reboot) is degraded:
    the service serves again, but something made it stop. A restart by ctxmgr's own change (a revision
    created since) or a start after a verification that found it down is only a note.
    """
    unit = facts.unit
    last = facts.last_verify
    degraded: list[str] = []
    notes: list[str] = []
    if last is None:
        notes.append("first verification of this service: its state is the baseline from now on")
    elif unit.active_state == "active":
        changed_by_ctxmgr = [r for r in facts.revisions if r.get("created", 0) > last.get("time", 0)]
        new_invocation = bool(last.get("invocation_id")) and last.get("invocation_id") != unit.invocation_id
        more_restarts = unit.n_restarts > int(last.get("n_restarts") or 0)
        was_down = last.get("active_state") not in (None, "active")
        if (new_invocation or more_restarts) and was_down:
            notes.append(f"started again since the last verification found it {last['active_state']}")
        elif (new_invocation or more_restarts) and changed_by_ctxmgr:
            number = changed_by_ctxmgr[-1]["number"]
            notes.append(f"restarted by ctxmgr since the last verification (revision {number})")
        elif more_restarts:
            degraded.append(
                f"systemd restarted {facts.service} since the last verification: NRestarts "
                f"{last.get('n_restarts')} -> {unit.n_restarts}"
                + (f", serving again since {clock(unit.serving_since)}" if unit.serving_since else "")
            )
        elif new_invocation:
            degraded.append(
                f"{facts.service} was restarted since the last verification, not by ctxmgr"
                + (f" (serving since {clock(unit.serving_since)})" if unit.serving_since else "")
            )
    return degraded, notes


def version_reasons(service: str, vllm_version: str | None, last_start: StoredObservation) -> list[str]:
    """A vLLM version other than the last watched start's is degraded: the plan's accounting (page
    sizes, the null block, CUDA graphs in the budget) is per version, so the next start may not fit."""
    before = last_start.get("vllm_version")
    if vllm_version and before and _version(before) != _version(vllm_version):
        return [
            f"the vLLM version changed since the last start ctxmgr watched: {before} -> {vllm_version}"
            f" (`ctxmgr observe --service {service}` makes the running start the reference)"
        ]
    return []


def upgrade_reasons(facts: VerifyFacts) -> list[str]:
    """Capacity that another vLLM release moves is degraded: the next start gets another KV pool (or
    none at this context) than the one planned, so what was promised (concurrency, the context) no
    longer holds without a new plan."""
    record = facts.vllm_upgrade
    if record is None:
        return []
    move = CapacityMove.from_json(record)
    if not move.moved:
        return []
    return [f"{move.text()} (`ctxmgr plan --service {facts.service}` plans under it)"]


def kv_drift_reasons(facts: VerifyFacts, plan: StoredPlan, blocks: int | None) -> list[str]:
    """vLLM's KV budget moving by more than the plan's smallest margin under the same flags is
    degraded: vLLM profiles memory at each start, so the same unit no longer gets what was planned
    (a driver, a library or another process changed what a start finds)."""
    observation = facts.observation or {}
    last_start = facts.last_start or {}
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
            return [
                f"memory drifted: vLLM has {blocks:,} KV cache blocks in this process, {blocks_then:,} at "
                f"the last start ctxmgr watched with the same flags ({moved})"
            ]
    elif (
        same_config
        and kv_now is not None
        and kv_then is not None
        and abs(kv_now - kv_then) * GIB > drift_limit
    ):
        return [
            f"memory drifted: vLLM's KV budget is {kv_now:.2f} GiB per GPU in this process, "
            f"{kv_then:.2f} GiB at the last start ctxmgr watched with the same flags"
        ]
    return []


def revision_reasons(facts: VerifyFacts) -> list[str]:
    """The unit against ctxmgr's revisions, degraded either way: a revision left in progress means an
    interrupted run whose undo has not happened (`recover` finishes it); a unit that is none of the
    good revisions was edited outside ctxmgr, so no plan stands behind what the next restart runs."""
    degraded = []
    if facts.in_progress is not None:
        degraded.append(
            f"revision {facts.in_progress} was left in progress by an interrupted ctxmgr run: "
            f"run `ctxmgr recover --service {facts.service}`"
        )
    good = [r for r in facts.revisions if r.get("state") in GOOD_STATES]
    if good and facts.current_revision is None:
        newest = good[-1]
        degraded.append(
            f"the unit is none of the revisions ctxmgr installed: it was edited outside ctxmgr "
            f"(max_model_len {facts.max_model_len}; revision {newest['number']} has "
            f"{newest.get('max_model_len')})"
        )
    return degraded


def _starting(facts: VerifyFacts, observation: ObservationFigures, probe: ProbeRecord) -> float | None:
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


def own_memory_drift(
    margins: Sequence[GpuMargin], last: LastVerifyRecord | None, invocation_id: str
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


def _int(value: str | int | None) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def _version(text: str) -> str:
    return text.strip().lstrip("v")


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(float(a) - float(b)) < 1e-6


def record(verification: Verification, facts: VerifyFacts) -> LastVerifyRecord:
    """What the next verification compares against (SERVICE/last-verify.json). A revision counts as
    verified unless the result is failed: --on-failure rollback goes back only to one that served."""
    verified = set(facts.last_verify.get("verified_revisions", []) if facts.last_verify else [])
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
        "gpu_memory_checked": verification.gpu_memory_checked,
    }
