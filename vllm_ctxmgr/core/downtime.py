"""How long a restart keeps the service down, from how long its earlier starts took.

An operator confirms a restart that may take minutes (the seeds' GLM-5 took 7+): the question comes
with the expected downtime, per phase, from the timestamps of the service's own earlier starts in the
journal (vllm_log/timeline.py reads them), and the live status line counts down from the same figures.

One phase moves with the change itself: vLLM keys its torch.compile cache by a hash of the config, and
`max_model_len` is one of ModelConfig.compute_hash's factors (vllm/config/model.py:L453-L503 of the
0.32 wheel: every field not in `ignored_factors`, and max_model_len is not there; VllmConfig.compute_hash
folds it in at vllm/config/vllm.py:L472-L473). A new context therefore compiles cold, and a warm start's
compile time says nothing about it: the estimate takes the last cold compile the journal holds. A
rollback goes the other way: back to the context the service served before, whose graphs vLLM compiled
and cached then, so its compile is a warm one however cold the failed start's was.

A second phase moves with how the engine gets its weights. With `--load-format ipc_cache` (vLLM 0.31+)
the engine maps a `vllm preload` daemon's weights over CUDA IPC instead of reading them from disk
(model_loader/weight_cache/ipc_loader.py:L217-L272): "Starting to load model" and "Model loading took"
are still printed (v1/worker/gpu_model_runner.py:L4978-L4982, L5088-L5092), but between them the line is
"Mapped N tensors from the weight cache daemon" (ipc_loader.py:L321-L325), not the disk loader's
"Loading weights took" (default_loader.py:L506-L509). Such a restart's "loading weights" phase is the
attach, not a cold load; where the change alters the daemon's key (core/weight_cache.py) the daemon
reloads from disk and the cold load is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

# The phases of one start, in vLLM's order; each ends at a line vLLM prints (vllm_log/timeline.py).
STOPPING = "stopping"
STARTING = "starting"  # imports, engine and worker processes, distributed init
LOADING = "loading weights"
COMPILING = "torch.compile"
PROFILING = "KV profiling"
CAPTURING = "CUDA graph capture"
SERVING = "HTTP server"
START_PHASES = (STARTING, LOADING, COMPILING, PROFILING, CAPTURING, SERVING)

CompileCache = Literal["hit", "miss"]
# How a restart's engine gets its weights from a `vllm preload` daemon (--load-format ipc_cache):
# "mapped": the daemon's key still matches, the engine attaches; "reload": the change alters the key, so
# the weights are read from disk again (the daemon reloads, or the engine falls back to a disk load)
WeightCache = Literal["mapped", "reload"]
RECENT_STARTS = 5  # the median of each phase is over at most this many of the last starts


@dataclass(frozen=True)
class StartTiming:
    """One earlier start of the service as the journal timed it: each phase's seconds (a phase with no
    line of its own is counted in the next), and how its instance stopped later where it did."""

    began_at: float  # epoch seconds of systemd's `Started` line (or the start's first line)
    phases: tuple[tuple[str, float], ...]  # (phase, seconds), in START_PHASES order
    ready: bool  # it reached vLLM's ready line
    compiled: bool = False  # torch.compile ran (not --enforce-eager)
    compile_cache: CompileCache | None = None  # what vLLM's compile lines said; None: they said nothing
    max_model_len: int | None = None
    stop_s: float | None = None  # this instance's own stop (`Stopping` to `Stopped`), where it stopped
    clock_stepped: bool = False  # its journal stamps run backwards: its seconds are not to be trusted
    weights_mapped: bool = False  # it mapped a `vllm preload` daemon's weights (ipc_loader.py:L321-L325)
    weights_read_s: float | None = None  # the disk read of its weights ("Loading weights took")

    @property
    def start_s(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def seconds(self, phase: str) -> float | None:
        return next((s for p, s in self.phases if p == phase), None)


@dataclass(frozen=True)
class PhaseEstimate:
    phase: str
    seconds: float
    source: str  # in words: which starts the figure comes from


class PhaseRecord(TypedDict):
    phase: str
    seconds: float
    source: str


class DowntimeRecord(TypedDict, total=False):
    """DowntimeEstimate.to_json(), as a change's result and the confirmation show it; {} where the
    journal held no start to time it by."""

    total_s: float
    phases: list[PhaseRecord]
    based_on_start: float
    starts: int
    compile_cache_misses: bool | None
    notes: list[str]


@dataclass(frozen=True)
class DowntimeEstimate:
    """The expected downtime of one restart: the old instance's stop, then each phase of the start."""

    phases: tuple[PhaseEstimate, ...]
    based_on: float  # epoch seconds of the last start it reads (its `Started` line)
    starts: int  # how many earlier starts it reads
    compile_cache_misses: bool | None = None  # None: no torch.compile in these starts
    notes: tuple[str, ...] = field(default=())

    @property
    def total_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def start_s(self) -> float:
        """The start alone (what the live status counts down): the stop is over when it begins."""
        return sum(p.seconds for p in self.phases if p.phase != STOPPING)

    def time_left(self, elapsed_s: float, phases_done: int) -> float:
        """Seconds the start may still take, `elapsed_s` into it, with the first `phases_done` of
        START_PHASES ended: the rest of the current phase (never below 0) plus the phases after it."""
        done = [p.seconds for p in self.phases if p.phase in START_PHASES[:phases_done]]
        ahead = [p.seconds for p in self.phases if p.phase in START_PHASES[phases_done:]]
        if not ahead:
            return 0.0
        current_ends_at = sum(done) + ahead[0]
        return max(current_ends_at - elapsed_s, 0.0) + sum(ahead[1:])

    def to_json(self) -> DowntimeRecord:
        if not self.phases:  # not known: no figure, only why (never a total of 0 s)
            return {"phases": [], "starts": 0, "notes": list(self.notes)}
        return {
            "total_s": round(self.total_s, 1),
            "phases": [
                {"phase": p.phase, "seconds": round(p.seconds, 1), "source": p.source} for p in self.phases
            ],
            "based_on_start": self.based_on,
            "starts": self.starts,
            "compile_cache_misses": self.compile_cache_misses,
            "notes": list(self.notes),
        }


def estimate_downtime(
    starts: Sequence[StartTiming],
    compile_cache: CompileCache | None,
    max_model_len: int | None = None,
    weight_cache: WeightCache | None = None,
) -> DowntimeEstimate | None:
    """The expected downtime of a restart from the service's earlier starts, oldest first; None where
    none of them reached vLLM's ready line. `compile_cache`: what vLLM's compile cache will do at the
    restart: "miss" for a new context, "hit" for one vLLM compiled before (a rollback), None for the
    config the service runs now.

    Each phase is the median over the last RECENT_STARTS starts that served (one slow start does not
    set the figure). torch.compile is the exception where the cache's answer is known: on a miss the
    figure is the last cold compile's (a start whose compile lines say it missed), and where the journal
    holds none, the warm figure stands with a note that it is a lower bound; on a hit it is the median
    of the last warm compiles, not of the recent starts (the failed change's cold one among them).
    `max_model_len`, the context the restart will serve: one a start in the journal compiled and served
    before is a hit (vLLM keeps that compile in its cache), not a miss. `weight_cache`: where the unit
    maps a `vllm preload` daemon's weights, whether the restart attaches to them ("mapped": the loading
    phase is the attach, never a cold load) or the change makes them load from disk again ("reload")."""
    untrusted = sum(1 for s in starts if s.clock_stepped)
    starts = [s for s in starts if not s.clock_stepped]
    served = [s for s in starts if s.ready]
    if not served:
        if untrusted:  # said, never timed as 0 s or hours from a stepped clock
            return DowntimeEstimate((), 0.0, 0, None, (_untrusted(untrusted),))
        return None
    recent = served[-RECENT_STARTS:]
    last = recent[-1]
    notes: list[str] = [_untrusted(untrusted)] if untrusted else []
    if compile_cache == "miss" and max_model_len is not None:
        compile_cache = _served_before(served, max_model_len, notes)
    phases: list[PhaseEstimate] = []
    stops = [s.stop_s for s in starts[-RECENT_STARTS:] if s.stop_s is not None]
    if stops:
        phases.append(PhaseEstimate(STOPPING, _median(stops), _source(len(stops), "stop")))
    else:
        notes.append("the journal holds no stop of this service: the old instance's stop is not counted")
    for phase in START_PHASES:
        figures = [f for f in (s.seconds(phase) for s in recent) if f is not None]
        if last.seconds(phase) is None:
            continue
        estimate = None
        if phase == COMPILING and compile_cache == "miss":
            estimate = _compile_estimate(served, recent, notes)
        elif phase == COMPILING and compile_cache == "hit":
            estimate = _warm_compile_estimate(served, notes)
        elif phase == LOADING and weight_cache == "mapped":
            estimate = _attach_estimate(served, notes)
        elif phase == LOADING and weight_cache == "reload":
            estimate = _reload_estimate(served, notes)
        phases.append(estimate or PhaseEstimate(phase, _median(figures), _source(len(figures), "start")))
    compiled = any(s.compiled for s in recent)
    misses = compile_cache == "miss" if compiled else None
    return DowntimeEstimate(tuple(phases), last.began_at, len(recent), misses, tuple(notes))


def _compile_estimate(
    served: list[StartTiming], recent: list[StartTiming], notes: list[str]
) -> PhaseEstimate:
    """torch.compile's figure where the context changes: the compile cache misses."""
    cold = [s for s in served if s.compile_cache == "miss" and s.seconds(COMPILING) is not None]
    if cold:
        seconds = cold[-1].seconds(COMPILING) or 0.0
        notes.append(
            "a new max_model_len changes vLLM's compile hash (ModelConfig.compute_hash), so the "
            f"torch.compile cache misses: {seconds:.0f} s, the last cold compile's time"
        )
        return PhaseEstimate(COMPILING, seconds, "the last cold compile (cache miss)")
    warm = [s.seconds(COMPILING) for s in recent if s.seconds(COMPILING) is not None]
    seconds = _median(warm) if warm else 0.0
    said = {s.compile_cache for s in recent} - {None}
    how = "warm (cache hit)" if said == {"hit"} else "of unknown cache state"
    notes.append(
        "a new max_model_len changes vLLM's compile hash (ModelConfig.compute_hash), so the torch.compile "
        f"cache misses; the journal holds no cold compile, so the {seconds:.0f} s of the starts "
        f"{how} is a lower bound"
    )
    return PhaseEstimate(COMPILING, seconds, f"the median of {len(warm)} start(s) {how}: a lower bound")


def _attach_estimate(served: list[StartTiming], notes: list[str]) -> PhaseEstimate:
    """The loading phase of a restart that maps the daemon's weights: the attach of the last starts that
    mapped them; where the journal holds none (the unit loaded from disk until now, or its daemon was
    not up), the last disk start's loading phase less its weight read, which the attach skips."""
    mapped = _loading(served, mapped=True)
    if mapped:
        notes.append(
            "the weights come from the `vllm preload` daemon (--load-format ipc_cache): loading weights is "
            "the CUDA IPC attach of the earlier starts that mapped them, not a cold load from disk"
        )
        which = "the last start" if len(mapped) == 1 else f"the median of the last {len(mapped)} starts"
        return PhaseEstimate(LOADING, _median(mapped), f"{which} that mapped the daemon's weights")
    disk = [s for s in served if not s.weights_mapped and s.seconds(LOADING) is not None]
    last = disk[-1]
    loading = last.seconds(LOADING) or 0.0
    if last.weights_read_s is None:
        notes.append(
            "the weights come from the `vllm preload` daemon (--load-format ipc_cache), but the journal "
            "holds no start that mapped them and no weight read to take off: the last start's "
            f"{loading:.0f} s of loading weights is an upper bound"
        )
        return PhaseEstimate(LOADING, loading, "the last start's loading: an upper bound")
    attach = max(loading - last.weights_read_s, 0.0)
    notes.append(
        "the weights come from the `vllm preload` daemon (--load-format ipc_cache): the journal holds no "
        f"start that mapped them, so loading weights is the last start's {loading:.0f} s less its "
        f"{last.weights_read_s:.0f} s weight read from disk, which the CUDA IPC attach skips"
    )
    return PhaseEstimate(LOADING, attach, "the last start's loading less its weight read (not a cold load)")


def _loading(served: list[StartTiming], mapped: bool) -> list[float]:
    """The loading phase of the last starts that mapped the daemon's weights (or read them from disk)."""
    return [f for s in served if s.weights_mapped == mapped and (f := s.seconds(LOADING)) is not None][
        -RECENT_STARTS:
    ]


def _reload_estimate(served: list[StartTiming], notes: list[str]) -> PhaseEstimate:
    """The loading phase where the change alters the daemon's key: a cold load from disk, the last
    starts' that read their weights (the mapped attaches say nothing of it)."""
    disk = _loading(served, mapped=False)
    if disk:
        notes.append(
            "this change alters the `vllm preload` daemon's weight-cache key: the weights load from disk "
            "again (the daemon reloads, or the engine falls back to a disk load), a cold load counted here"
        )
        which = "the last start" if len(disk) == 1 else f"the median of the last {len(disk)} starts"
        return PhaseEstimate(LOADING, _median(disk), f"{which} that read the weights from disk")
    mapped = [f for s in served if (f := s.seconds(LOADING)) is not None][-RECENT_STARTS:]
    notes.append(
        "this change alters the `vllm preload` daemon's weight-cache key: the weights load from disk "
        "again, and the journal holds only starts that mapped them, so the loading figure is a lower "
        "bound: the restart is not a short one"
    )
    return PhaseEstimate(LOADING, _median(mapped), "the starts that mapped the weights: a lower bound")


def _served_before(served: list[StartTiming], max_model_len: int, notes: list[str]) -> CompileCache:
    """A change back to a context the service compiled and served before (the one before last, say):
    vLLM saved that compile under its hash, which the same config gives again, so the cache hits. It
    misses still where anything else in the config changed since, or the cache was cleared: said so."""
    before = [s for s in served if s.compiled and s.max_model_len == max_model_len]
    if not before:
        return "miss"
    back = len(served) - served.index(before[-1])
    which = "the last start" if back == 1 else f"the start {back} back in the journal"
    notes.append(
        f"max_model_len {max_model_len} was compiled and served here before ({which}), so "
        "vLLM's compile cache holds it: counted warm (cold, if the cache was cleared or another flag "
        "changed since)"
    )
    return "hit"


def _warm_compile_estimate(served: list[StartTiming], notes: list[str]) -> PhaseEstimate | None:
    """torch.compile's figure where the cache hits: the last warm compiles; where the journal holds
    none, those of unknown cache state (None: it holds only cold ones, so the median of the recent
    starts stands, with a note that it is an upper bound)."""
    for cache, how in (("hit", "warm (cache hit)"), (None, "of unknown cache state")):
        figures = [f for s in served if s.compile_cache == cache and (f := s.seconds(COMPILING)) is not None][
            -RECENT_STARTS:
        ]
        if figures:
            count = len(figures)
            which = "the last start" if count == 1 else f"the median of the last {count} starts"
            return PhaseEstimate(COMPILING, _median(figures), f"{which} {how}")
    notes.append(
        "vLLM compiled this context before, so its torch.compile cache hits; the journal holds only "
        "cold compiles, so their time is an upper bound"
    )
    return None


def _untrusted(count: int) -> str:
    starts = "start" if count == 1 else "starts"
    return (
        f"the journal's clock cannot be trusted: its stamps run backwards in {count} {starts} of this "
        f"service (a clock step), so {'it is' if count == 1 else 'they are'} not counted"
    )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _source(count: int, what: str) -> str:
    return f"the last {what}" if count == 1 else f"the median of the last {count} {what}s"


def span(seconds: float) -> str:
    """`7m 05s`, `42s`, `1h 02m`: a duration as an operator reads it."""
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def downtime_text(data: DowntimeRecord) -> list[str]:
    """The expected downtime as the operator reads it before confirming (from `to_json`'s shape; empty:
    the journal held no start to time it by)."""
    if not data:
        return ["expected downtime: not known (the journal holds no start of this service that served)"]
    if not data.get("phases"):
        return ["expected downtime: not known", *(f"  note: {note}" for note in data.get("notes", []))]
    phases = ", ".join(f"{p['phase']} {span(p['seconds'])}" for p in data["phases"])
    starts = data["starts"]
    lines = [
        f"expected downtime: {span(data['total_s'])} ({phases}); from the last "
        f"{'start' if starts == 1 else f'{starts} starts'} in the journal"
    ]
    lines += [f"  note: {note}" for note in data.get("notes", [])]
    return lines
