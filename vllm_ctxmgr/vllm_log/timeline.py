"""How long each phase of a service's earlier starts took, from the journal's timestamps.

The lines are the table's (patterns.py); this module says which line ends which phase of
core.downtime.START_PHASES, and turns a journal, cut into starts as the watcher cuts it (one start per
systemd invocation, or at systemd's `Started` and vLLM's banner), into one `StartTiming` each.
A phase ends at the last of its lines (every TP worker prints its own) up to the ready lines; a
phase with no line in a start (no torch.compile under --enforce-eager, no CUDA graphs on the CPU build)
is counted in the next one. A start whose stamps run backwards (the clock stepped) is marked as such:
its seconds are not to be trusted.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_ctxmgr.core.downtime import (
    CAPTURING,
    COMPILING,
    LOADING,
    PROFILING,
    SERVING,
    START_PHASES,
    STARTING,
    CompileCache,
    StartTiming,
)
from vllm_ctxmgr.vllm_log.patterns import LogEvent, classify
from vllm_ctxmgr.vllm_log.watcher import split_starts

# The lines that end each phase (vLLM's names in patterns.py).
PHASE_ENDS: dict[str, frozenset[str]] = {
    STARTING: frozenset({"starting_to_load_model"}),
    LOADING: frozenset({"loading_weights_took", "model_loading_took"}),
    COMPILING: frozenset({"torch_compile_took", "compile_cache_hit", "compile_cache_miss"}),
    PROFILING: frozenset(
        {
            "available_kv_cache_memory",
            "kv_cache_memory_bytes_reserved",
            "cpu_kv_cache_set",
            "auto_fit_reduced",
            "auto_fit_full",
            "kv_cache_capacity",
        }
    ),
    CAPTURING: frozenset({"graph_capturing_finished"}),
    SERVING: frozenset({"server_starting", "application_startup_complete"}),
}
_COMPILE_LINES = frozenset({"torch_compile_took", "compile_cache_hit", "compile_cache_miss"})

TimedLine = tuple[float, str | None, str]  # (epoch seconds, systemd invocation id or None, message)


def phases_done(event_name: str) -> int:
    """How many of START_PHASES are over once this line is printed (0: it ends none)."""
    for index, phase in enumerate(START_PHASES):
        if event_name in PHASE_ENDS[phase]:
            return index + 1
    return 0


def start_timings(lines: Sequence[TimedLine]) -> list[StartTiming]:
    """Each start in a unit's journal (oldest first) with its phases' seconds."""
    return [timing for chunk in _starts(lines) if (timing := _timing(chunk)) is not None]


def _starts(lines: Sequence[TimedLine]) -> list[list[TimedLine]]:
    """One list per start: by invocation where the journal names them, else as split_starts cuts."""
    if any(invocation for _, invocation, _ in lines):
        groups: dict[str, list[TimedLine]] = {}
        for line in lines:
            if line[1]:
                groups.setdefault(line[1], []).append(line)
        return list(groups.values())
    chunks, at = [], 0
    for messages in split_starts(message for _, _, message in lines):
        chunks.append(list(lines[at : at + len(messages)]))
        at += len(messages)
    return chunks


def _timing(chunk: list[TimedLine]) -> StartTiming | None:
    """A start's phases (None: a chunk with no start in it, such as a journal's first lines)."""
    began: float | None = None
    ready_at: float | None = None
    stopping_at = stopped_at = None
    ends: dict[str, float] = {}
    compiled = False
    cache: CompileCache | None = None
    max_model_len: int | None = None
    mapped = False  # the weights came from a `vllm preload` daemon
    read_s: float | None = None  # the disk read of the weights (the slowest worker's)
    previous: str | None = None
    latest = None  # the latest stamp so far: a line stamped before it is a clock step
    stepped = False
    ready_lines: set[str] = (
        set()
    )  # each ready line counts once: a second one (hours later) is not this start's
    for at, _, message in chunk:
        stepped = stepped or (latest is not None and at < latest)
        latest = at if latest is None else max(latest, at)
        event = classify(message, previous)
        previous = message
        if event is None:
            continue
        name = event.name
        if name in ("unit_started", "version_banner") and began is None:
            began = at
        if name == "unit_stopping" and stopping_at is None:
            stopping_at = at
        elif name in ("unit_stopped", "unit_deactivated") and stopping_at is not None:
            stopped_at = at
        if began is None or stopping_at is not None:
            continue  # before the start, or the instance's shutdown
        if ready_at is not None and (event.kind != "ready" or name in ready_lines):
            continue  # past the ready lines (vLLM's, then uvicorn's): nothing later is this start's
        compiled = compiled or name in _COMPILE_LINES
        cache = _cache_state(event, cache)
        if name == "using_max_model_len":
            max_model_len = event.data.get("max_model_len")
        mapped = mapped or name == "weight_cache_mapped"
        if name == "loading_weights_took" and isinstance(seconds := event.data.get("seconds"), int | float):
            read_s = max(read_s or 0.0, float(seconds))
        for phase, names in PHASE_ENDS.items():
            if name in names:
                ends[phase] = at
        if event.kind == "ready":
            ready_lines.add(name)
            ready_at = at if ready_at is None else max(ready_at, at)
    if began is None:
        return None
    phases: list[tuple[str, float]] = []
    mark = began
    for phase in START_PHASES:
        if phase in ends and (ready_at is None or ends[phase] <= ready_at):
            end = max(ends[phase], mark)
            phases.append((phase, end - mark))
            mark = end
    stop_s = stopped_at - stopping_at if stopping_at is not None and stopped_at is not None else None
    if stepped:
        stop_s = None  # stamps that run backwards time nothing (never a negative stop time)
    return StartTiming(
        began_at=began,
        phases=tuple(phases),
        ready=ready_at is not None,
        compiled=compiled,
        compile_cache=cache,
        max_model_len=max_model_len,
        stop_s=stop_s,
        clock_stepped=stepped,
        weights_mapped=mapped,
        weights_read_s=read_s,
    )


def _cache_state(event: LogEvent, known: CompileCache | None) -> CompileCache | None:
    """A miss anywhere (one compile range compiled) makes the start a cold one."""
    if event.name == "compile_cache_miss":
        return "miss"
    if event.name == "compile_cache_hit" and known is None:
        return "hit"
    return known
