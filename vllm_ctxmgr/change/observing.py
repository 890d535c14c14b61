"""What ctxmgr learns from a start: follow it in the journal, keep vLLM's figures, compare with the plan.

Three uses share it: a change watches the start it caused (deploy, recovery, verify's restart), a plan
of a running service first reads that service's last start (`learn_from_running_instance`: the first
restart is then the right one), and a finished change compares its plan with what vLLM allocated
(`calibration`). The observation record written here is what the planner reads back
(planning.observations_from_store).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import cast

from vllm_ctxmgr.core.budget import effective_args
from vllm_ctxmgr.core.calibration import CalibrationRecord
from vllm_ctxmgr.core.downtime import (
    LOADING,
    CompileCache,
    DowntimeEstimate,
    WeightCache,
    estimate_downtime,
    span,
)
from vllm_ctxmgr.core.hardware import GIB, GpuState
from vllm_ctxmgr.core.observations import (
    Observation,
    ObservationError,
    ObservationFigures,
    ObservationRecord,
    figure_above_the_device,
)
from vllm_ctxmgr.core.plan_record import StoredPlan
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.nvml import read_nvml
from vllm_ctxmgr.probe import cache_config_info
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.journal import JournalEntry
from vllm_ctxmgr.systemd.names import unit_name
from vllm_ctxmgr.systemd.service import ServiceView, read_service
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.vllm_log.patterns import EventValue
from vllm_ctxmgr.vllm_log.timeline import phases_done, start_timings
from vllm_ctxmgr.vllm_log.watcher import StartVerdict, StartWatcher, last_invocation_start, observe_start

Printer = Callable[[str], None]


def quiet(_: str) -> None:
    """A printer that prints nothing (library use, --json)."""
    return None


@dataclass(frozen=True)
class StartProgress:
    """Where a start is, for a live status while vLLM prints nothing: its phase (from vLLM's own
    lines), how long it has taken, how long it may still take, and a fraction where vLLM prints one
    (checkpoint shards loaded, CUDA graphs captured)."""

    unit: str
    phase: str
    elapsed_s: float
    remaining_s: float
    done: int | None = None
    total: int | None = None
    expected_left_s: float | None = None  # from the service's earlier starts (core.downtime)

    def text(self) -> str:
        """One line: `vllm-glm5: loading weights 3/8 [###.....], 1m 23s, about 5m 40s left, timeout in
        28m 37s` (the time left where the journal held an earlier start to time it by)."""
        line = f"{self.unit}: {self.phase}"
        if self.done is not None and self.total:
            filled = round(10 * min(self.done, self.total) / self.total)
            line += f" {self.done}/{self.total} [{'#' * filled}{'.' * (10 - filled)}]"
        left = f"about {span(self.expected_left_s)} left, " if self.expected_left_s is not None else ""
        return f"{line}, {span(self.elapsed_s)}, {left}timeout in {span(self.remaining_s)}"


# vLLM's progress bars: (done, total) from the line's own figures or its percentage
_FRACTIONS = ("loading_weights_progress", "capturing_cuda_graphs")


def watch_start(
    systemd: Systemd,
    unit: str,
    cursor: str,
    timeout: float,
    on_line: Printer = quiet,
    state_interval: float = 0.5,
    progress_interval: float = 3.0,
    on_tick: Callable[[StartProgress], None] | None = None,
    tick_interval: float = 1.0,
    head_serving: Callable[[], bool] | None = None,
    expected: DowntimeEstimate | None = None,
) -> StartVerdict:
    """Follow the unit's journal from `cursor` and decide as soon as vLLM's decisive line appears.

    `head_serving` makes the unit a headless node (--headless): it has no ready line of its own (the CPU
    build none at all), so it is also ok once `head_serving()`, asked every `state_interval`, says that
    node 0 serves and the node's ranks have joined (StartWatcher.head_serving).

    `on_tick` is called about every `tick_interval` seconds with where the start is, so a terminal can
    show that a start that prints nothing for minutes (loading, compiling, capturing) is still alive,
    and, with the `expected` downtime, how long it may still take."""

    baseline = systemd.state(unit).n_restarts
    watcher = StartWatcher(
        timeout_s=timeout, baseline_nrestarts=baseline, await_start=True, headless=head_serving is not None
    )
    next_state = 0.0
    last_progress = 0.0
    started = time.monotonic()
    next_tick = started + tick_interval
    fraction: tuple[int | None, int | None] = (None, None)
    done = 0  # phases of core.downtime.START_PHASES over
    with systemd.follow(unit, after_cursor=cursor) as follower:
        while True:
            for entry in follower.poll(0.2):
                for event in watcher.feed(entry.message):
                    now = time.monotonic()
                    done = max(done, phases_done(event.name))
                    if event.name in _FRACTIONS:
                        fraction = _fraction(event.data)
                    elif event.kind == "progress":
                        fraction = (None, None)
                    # progress during a minutes-long start: one line every few seconds is enough
                    if event.kind == "progress" and now - last_progress < progress_interval:
                        continue
                    if event.kind in ("progress", "ready", "failure"):
                        last_progress = now
                        on_line(entry.message)
            now = time.monotonic()
            if on_tick is not None and now >= next_tick:
                elapsed = now - started
                left = expected.time_left(elapsed, done) if expected is not None and expected.phases else None
                on_tick(StartProgress(unit, watcher.phase, elapsed, timeout - elapsed, *fraction, left))
                next_tick = now + tick_interval
            if now >= next_state:
                state = systemd.show(
                    unit, "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "ExecMainCode"
                )
                watcher.feed_unit_state(state)
                if head_serving is not None and head_serving():
                    watcher.head_serving()
                next_state = now + state_interval
            verdict = watcher.poll()
            if verdict is not None:
                return verdict


def _fraction(data: dict[str, EventValue]) -> tuple[int | None, int | None]:
    """(done, total) of a progress bar line; its percentage out of 100 where it names no counts."""
    done, total, percent = data.get("done"), data.get("total"), data.get("percent")
    if done is not None and total is not None:
        return int(done), int(total)
    return (int(percent), 100) if percent is not None else (None, None)


def expected_downtime(
    systemd: Systemd,
    unit: str,
    compile_cache: CompileCache | None,
    max_model_len: int | None = None,
    weight_cache: WeightCache | None = None,
) -> DowntimeEstimate | None:
    """What a restart of the unit will cost, timed by its earlier starts in the journal (None: the
    journal holds no start that served). `compile_cache`: what vLLM's compile cache will do ("miss": a
    new context; "hit": one it compiled before; None: the config it runs now); `max_model_len`: the
    context the restart serves (a "miss" to one the journal shows served before is a hit);
    `weight_cache`: where the unit maps a `vllm preload` daemon's weights, whether the restart attaches
    ("mapped") or loads them cold ("reload"), core/weight_cache.restart_weights."""
    entries = systemd.journal(unit, lines=20000)
    lines = [(entry.realtime_us / 1e6, entry.invocation_id, entry.message) for entry in entries]
    return estimate_downtime(start_timings(lines), compile_cache, max_model_len, weight_cache)


def last_weight_load(systemd: Systemd, unit: str) -> float | None:
    """The loading-weights phase of the unit's last start that served and read its weights from disk:
    what a `vllm preload` daemon's attach would replace (None: the journal holds no such start)."""
    entries = systemd.journal(unit, lines=20000)
    starts = start_timings(
        [(entry.realtime_us / 1e6, entry.invocation_id, entry.message) for entry in entries]
    )
    served = [s for s in starts if s.ready and not s.clock_stepped]
    if not served or served[-1].weights_mapped:
        return None
    return served[-1].seconds(LOADING)


def observation_record(
    service: str, observation: Observation, ok: bool, view: ServiceView, metrics: dict[str, str]
) -> ObservationRecord:
    """One start as the store keeps it: vLLM's figures plus the configuration that produced them."""
    blocks = metrics.get("num_gpu_blocks", "")
    if blocks.isdigit():
        observation = replace(observation, num_gpu_blocks=int(blocks))
    if not observation.gpu_name:
        name = "CPU" if observation.platform == "CPU" else _gpu_name(view.env)
        observation = replace(observation, gpu_name=name)
    block_size = metrics.get("block_size", "")
    return ObservationRecord(
        observation,
        service=service,
        host=socket.gethostname(),
        time=time.time(),
        block_size=int(block_size) if block_size.isdigit() else None,
        configured_max_model_len=view.args.max_model_len,
        configured_gpu_memory_utilization=view.args.gpu_memory_utilization,
        configured_kv_cache_memory_bytes=effective_args(view.args).kv_cache_memory_bytes,
        ok=ok,
    )


def within_the_gpu(record: ObservationRecord, gpus: GpuState | None, unit: str) -> ObservationRecord:
    """`record` as the store may keep it: through the door every stored line passes on its way back
    (ObservationRecord.from_json: bounds, each part within the record's own total_memory_gib), and no
    figure more than the largest GPU the unit sees (NVML): a start holds no more memory than its GPU
    has, so such a figure is an echo or a lie and would move every later plan. ObservationError
    naming the figure."""
    if gpus is not None and gpus.gpus and record.observation.platform != "CPU":
        total = max(gpu.total_bytes for gpu in gpus.gpus)
        found = figure_above_the_device(record.observation, total)
        if found is not None:
            name, gib = found
            raise ObservationError(
                f"{unit}: its last start logged {name} {gib:,.2f} GiB, more than the {total / GIB:.2f} "
                "GiB of its GPU (NVML): not stored"
            )
    return ObservationRecord.from_json(record.to_json(), f"{unit}: its last start")


def visible_gpus(env: dict[str, str]) -> GpuState | None:
    """The GPUs the service sees (CUDA_VISIBLE_DEVICES), or None without NVML (the CPU build)."""
    try:
        return read_nvml().select(env.get("CUDA_VISIBLE_DEVICES"))
    except CtxmgrError:
        return None


def last_start_of(entries: Sequence[JournalEntry]) -> list[str]:
    """The messages of the last start in a unit's journal: its last invocation, up to the ready line
    (vllm_log.watcher.last_invocation_start)."""
    return last_invocation_start([(entry.invocation_id, entry.message) for entry in entries])


def observe_last_start(systemd: Systemd, service: str) -> tuple[ObservationRecord, ObservationFigures, int]:
    """The last start of a unit from its journal (made by ctxmgr or not): (the record to keep,
    vLLM's figures as read, how many journal lines that start had)."""
    unit = unit_name(service)
    view = read_service(systemd, service)
    messages = last_start_of(systemd.journal(unit, lines=20000))
    if not messages:
        raise CtxmgrError(f"{unit}: the journal holds no start of vLLM")
    observation = observe_start(messages)
    metrics = cache_config_info(view.base_url, api_key=view.api_key) if systemd.is_active(unit) else {}
    record = within_the_gpu(
        observation_record(service, observation, observation.ready, view, metrics),
        visible_gpus(view.env),
        unit,
    )
    data = cast(ObservationFigures, asdict(observation))
    if metrics.get("num_gpu_blocks", "").isdigit():
        data["num_gpu_blocks"] = int(metrics["num_gpu_blocks"])
    return record, data, len(messages)


def learn_from_running_instance(
    systemd: Systemd,
    store: ServiceStore,
    service: str,
    view: ServiceView,
    keep: Callable[[ObservationRecord], None],
) -> str | None:
    """Before the first plan of a running service, keep what its last start logged; say so, or why not.

    A service ctxmgr did not start has vLLM's own figures in its journal ("Model loading took",
    "Available KV cache memory", the CUDA-graph estimate): planning from them makes the first restart
    the right one. Only when no observation of this unit at this vLLM version is stored yet; `keep`
    stores the record (or holds it in memory, for a dry run).
    """
    unit = unit_name(service)
    if not systemd.is_active(unit):
        return None
    version = view.args.vllm_version
    for stored in store.observations():
        same_version = version is None or stored.get("vllm_version") in (version, None)
        if stored.get("service") == service and same_version:
            return None
    try:
        record, obs, lines = observe_last_start(systemd, service)
    except ObservationError as exc:
        return f"did not learn from the running instance: {exc.message}"
    except CtxmgrError:
        return (
            f"the journal no longer holds the start of the running {unit} (rotated?): planned from estimates"
        )
    except PermissionError as exc:
        return f"could not keep what the running instance logged ({exc.filename}: permission denied)"
    keep(record)
    figures = ", ".join(
        f"{name} {obs[key]}"
        for key, name in (
            ("model_loading_gib", "weights GiB"),
            ("available_kv_gib", "KV GiB"),
            ("cuda_graph_gib", "CUDA graphs GiB"),
            ("kv_cache_tokens", "KV tokens"),
        )
        if obs.get(key) is not None
    )
    return f"learned from the running instance's last start ({lines} journal lines: {figures or 'none'})"


def calibration(
    plan: Mapping[str, object],
    observation: Observation,
    metrics: dict[str, str],
    applied_utilization: float | None = None,
) -> CalibrationRecord:
    """Predicted against observed KV capacity of a start: the planner's calibration error.

    The prediction is re-derived at the utilisation the unit really runs with: a change that keeps
    the unit's utilisation (higher than the plan's minimum) must not be compared with a budget
    planned at a utilisation that was never applied (that read +92% .. +373% on correct changes).
    Observed capacity is vLLM's block count (/metrics num_gpu_blocks, exact) or, without metrics,
    the logged KV budget; never the "KV cache size: N tokens" line (concurrency x length, derived).
    """
    stored = StoredPlan.from_json(plan)
    planned_u = stored.gpu_memory_utilization
    predicted_budget = stored.min_kv_budget_bytes(applied_utilization)
    bytes_per_block, block_size = stored.bytes_per_block, stored.block_size
    if not predicted_budget or not bytes_per_block:
        return {}
    predicted_blocks = predicted_budget // bytes_per_block
    out: CalibrationRecord = {
        "predicted_kv_budget_bytes": predicted_budget,
        "predicted_num_gpu_blocks": predicted_blocks,
        "predicted_at_gpu_memory_utilization": (
            applied_utilization if applied_utilization is not None else planned_u
        ),
    }
    blocks = metrics.get("num_gpu_blocks", "")
    if blocks.isdigit():
        observed_blocks = int(blocks)
        out["observed_num_gpu_blocks"] = observed_blocks
        out["observed_source"] = "vllm metrics (num_gpu_blocks)"
    elif observation.available_kv_gib is not None:
        observed_blocks = int(observation.available_kv_gib * GIB) // bytes_per_block
        out["observed_num_gpu_blocks"] = observed_blocks
        out["observed_source"] = "vllm log (Available KV cache memory, 0.01 GiB)"
    else:
        return out
    if block_size:
        out["predicted_capacity_tokens"] = predicted_blocks * block_size
        out["observed_capacity_tokens"] = observed_blocks * block_size
    if predicted_blocks:
        out["error_percent"] = round(100.0 * (observed_blocks - predicted_blocks) / predicted_blocks, 3)
    return out


def capacity(observation: Observation) -> dict[str, object]:
    """The figures of a start a revision keeps (history shows them)."""
    keys = ("available_kv_gib", "kv_cache_tokens", "max_concurrency", "model_loading_gib", "cuda_graph_gib")
    return {k: getattr(observation, k) for k in keys if getattr(observation, k, None) is not None}


def _gpu_name(env: dict[str, str]) -> str | None:
    """The model of the first GPU the service sees, so observations are not carried to other GPUs."""

    try:
        state = read_nvml().select(env.get("CUDA_VISIBLE_DEVICES"))
    except CtxmgrError:
        return None
    return state.gpus[0].name if state.gpus else None
