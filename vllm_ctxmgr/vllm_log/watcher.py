"""Deciding a start from its journal: the StartWatcher state machine, and vLLM's numbers from a start.

The lines themselves (what each means, where its wording comes from) are data in vllm_log/patterns.py;
this module holds only the rules: which evidence decides a start and when (see StartWatcher), how a
longer journal is cut into starts, and how one start's events fold into an `Observation`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from vllm_ctxmgr.core.observations import Observation
from vllm_ctxmgr.vllm_log.patterns import (
    RANK_DECISIVE,
    RANK_SPECIFIC,
    EventValue,
    LogEvent,
    ParsedLine,
    classify,
    classify_all,
    failure_reason,
    parse_line,
)


class _ObservationBuilder:
    """Folds one start's events into vLLM's own numbers (an `Observation`)."""

    def __init__(self) -> None:
        self.values: dict[str, EventValue] = {}
        self.best_failure: LogEvent | None = None
        self.ready = False
        self.max_len_source_rank = -1
        self.available: dict[int, float] = {}  # source priority -> smallest value seen

    def _set_once(self, key: str, value: EventValue) -> None:
        if value is not None and key not in self.values:
            self.values[key] = value

    def _set_max_model_len(self, value: int | None, source_rank: int) -> None:
        # capacity line (after auto-fit) > auto-fit > "Using max model len" > the failing request's length
        if value is not None and source_rank >= self.max_len_source_rank:
            self.values["max_model_len"] = value
            self.max_len_source_rank = source_rank

    def add(self, event: LogEvent) -> None:
        data, name = event.data, event.name
        if event.kind == "ready":
            self.ready = True
        if event.kind == "failure" and (self.best_failure is None or event.rank > self.best_failure.rank):
            self.best_failure = event
        if name in ("version_banner", "engine_version", "headless_launch"):  # a headless node has no banner
            self._set_once("vllm_version", data.get("version"))
        if name == "non_default_args" and isinstance(data.get("args"), dict):
            args = data["args"]
            self._set_once("gpu_memory_utilization", _float_or_none(args.get("gpu_memory_utilization")))
            kv_bytes = args.get("kv_cache_memory_bytes")
            self._set_once("kv_cache_memory_bytes", kv_bytes if isinstance(kv_bytes, int) else None)
        if name in (
            "cuda_graph_utilization_notice",
            "kv_cache_memory_suggestion",
            "free_memory_below_utilization",
        ):
            self._set_once("gpu_memory_utilization", data.get("gpu_memory_utilization"))
        if name in ("using_max_model_len", "engine_version"):
            self._set_max_model_len(data.get("max_model_len"), 1)
        elif name in ("auto_fit_reduced", "auto_fit_full"):
            self._set_max_model_len(data["max_model_len"], 2)
        elif name in ("kv_cache_capacity", "max_concurrency") and "max_model_len" in data:
            self._set_max_model_len(data["max_model_len"], 3)
        elif name == "kv_cache_too_small":
            self._set_max_model_len(data["max_model_len"], 0)
            self._set_once("estimated_max_model_len", data.get("estimated_max_model_len"))
            self._set_once("needed_kv_gib", data["needed_kv_gib"])
        if name == "kv_cache_capacity":
            self._set_once("platform", data.get("platform"))
            self._set_once("kv_cache_tokens", data.get("kv_cache_tokens"))
        if "max_concurrency" in data:
            self._set_once("max_concurrency", data["max_concurrency"])
        if name == "num_gpu_blocks":
            self._set_once("num_gpu_blocks", data["num_gpu_blocks"])
        if name == "model_loading_took":
            self._set_once("model_loading_gib", data["model_loading_gib"])
        if name == "estimated_cuda_graph_memory":
            self.values["cuda_graph_gib"] = data["cuda_graph_gib"]
        elif name == "graph_capturing_finished":
            self._set_once("cuda_graph_gib", data["cuda_graph_gib"])
        # the KV budget per GPU: vLLM sizes the cache by the smallest rank's budget
        source = _AVAILABLE_SOURCES.get(name)
        if source is not None:
            value = data["available_kv_gib"]
            known = self.available.get(source)
            self.available[source] = value if known is None else min(known, value)
        if name == "compile_cache_miss":  # one compile range compiled makes the boot a cold one
            self.values["compile_cache"] = "miss"
        elif name == "compile_cache_hit":
            self._set_once("compile_cache", "hit")
        if name == "cpu_kv_cache_set":
            self._set_once("platform", "CPU")
            self._set_once("total_memory_gib", data["total_gib"])

    def build(self, failure: str | None = None) -> Observation:
        values = dict(self.values)
        if self.available:
            values["available_kv_gib"] = self.available[min(self.available)]
        if failure is None and not self.ready and self.best_failure is not None:
            failure = self.best_failure.name
        return Observation(**values, ready=self.ready, failure=failure)


# where the KV budget comes from, best first: the profiler's figure, the --kv-cache-memory-bytes
# reservation, the usable figure (one block less) of the auto-fit and fit-check lines, the CPU request
_AVAILABLE_SOURCES = {
    "available_kv_cache_memory": 0,
    "kv_cache_memory_bytes_reserved": 1,
    "auto_fit_reduced": 2,
    "auto_fit_full": 2,
    "kv_cache_too_small": 2,
    "cpu_kv_cache_set": 3,
}


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _observation(events: Iterable[LogEvent], failure: str | None = None) -> Observation:
    builder = _ObservationBuilder()
    for event in events:
        builder.add(event)
    return builder.build(failure)


def observe_start(messages: Iterable[str]) -> Observation:
    """vLLM's numbers from one start's log (use `split_starts` first on a longer journal)."""
    return _observation(classify_all(messages))


def split_starts(messages: Iterable[str]) -> list[list[str]]:
    """Cut a journal into starts: at systemd's `Started`, or at a second vLLM banner without one."""
    starts: list[list[str]] = []
    current: list[str] = []
    seen_vllm_start = False
    for message in messages:
        parsed = parse_line(message)
        is_unit_start = bool(re.match(r"^(?:Started|Starting) \S+\.service\b", parsed.message))
        is_vllm_start = not is_unit_start and _is_banner_start(parsed.message)
        if is_unit_start or (is_vllm_start and seen_vllm_start):
            carried: list[str] = []
            # the banner's first line is an empty message from the same process: it opens the new start
            while is_vllm_start and current and _same_process_empty(current[-1], parsed):
                carried.insert(0, current.pop())
            if current:
                starts.append(current)
            current, seen_vllm_start = carried, False
        if is_vllm_start:
            seen_vllm_start = True
        current.append(message)
    if current:
        starts.append(current)
    return starts


def _is_banner_start(message: str) -> bool:
    return bool(re.search(r"█\s+█\s+█▄\s+▄█\s*$|^vLLM (?:API )?server version ", message))


def _same_process_empty(line: str, parsed: ParsedLine) -> bool:
    previous = parse_line(line)
    return previous.message == "" and previous.pid == parsed.pid and previous.pid is not None


def last_start(messages: Iterable[str]) -> list[str]:
    starts = split_starts(messages)
    return starts[-1] if starts else []


def up_to_ready(messages: Iterable[str]) -> list[str]:
    """One start's lines up to vLLM's ready line (`Starting vLLM server on`, uvicorn's `Application
    startup complete`): what a serving vLLM logs after it is up (a client's text echoed to the log, a
    banner or a memory line among it) is no figure of its start."""
    out: list[str] = []
    for message in messages:
        out.append(message)
        event = classify(message)
        if event is not None and event.kind == "ready":
            break
    return out


def last_invocation_start(entries: Sequence[tuple[str | None, str]]) -> list[str]:
    """The last start in a unit's journal, given as (invocation id, message) pairs, oldest first.

    systemd gives every run of a unit its own invocation (_SYSTEMD_INVOCATION_ID on what its processes
    log, INVOCATION_ID on the manager's lines about it): one start per invocation, so a second banner
    inside one is not a new start, and its lines end at the ready line (up_to_ready). A journal whose
    lines name no invocation (a file, an old journald) is cut by split_starts."""
    last = next((invocation for invocation, _ in reversed(entries) if invocation), None)
    if last is None:
        return up_to_ready(last_start(message for _, message in entries))
    return up_to_ready(message for invocation, message in entries if invocation == last)


# ---------------------------------------------------------------- verdict


@dataclass(frozen=True)
class StartVerdict:
    ok: bool
    reason: str  # plain words
    decisive_line: str
    failure: str | None
    estimated_max_model_len: int | None
    observation: Observation


_EXITED_SUBSTATES = frozenset({"auto-restart", "failed"})


@dataclass
class StartWatcher:
    """Reads one start's journal messages (and unit states) and decides: serving, or failed and why.

    - a ready line (`Starting vLLM server on`, uvicorn's `Application startup complete.`) -> ok at once;
    - a decisive error (rank >= RANK_DECISIVE, e.g. KV cache too small with vLLM's estimate) -> failed
      at once;
    - a specific error -> failed when the process exits, or `grace_s` later if a more precise line
      has not come by then;
    - generic evidence (traceback, the final RuntimeError, systemd's exit) -> failed only once the
      process has exited, `exit_grace_s` after the exit to let late journal lines in;
    - nothing decisive within `timeout_s` (a hang) -> failed with the last progress line.
    Time comes from `clock` (monotonic seconds); call `poll()` while waiting for more lines.
    With `await_start`, lines before the new process announces itself (systemd's `Started`, vLLM's
    banner) are ignored: an older attempt's error that reaches the journal late cannot decide.

    A `headless` node (--headless, --node-rank > 0) has no HTTP server and no ready line of its own: it
    is ok once its ranks log a line that only comes after node 0 accepted the KV-cache configuration
    (HEADLESS_READY: CUDA-graph capture, the memory summary after it), or when the caller reports with
    `head_serving()` that node 0 serves (node 0 cannot serve before every node's ranks finished their
    start) and this node's ranks have joined the group. Its failures are the same lines as any node's,
    plus the multi-node ones (node 0 unreachable, the group not formed).
    """

    grace_s: float = 3.0
    # a process that prints its error and exits at once (argparse) can have its stderr reach the
    # journal follower after systemd's own "Main process exited" line; 1 s was seen to be too short
    # on a loaded 2-core machine, and the wait costs only failed starts, which take minutes anyway
    exit_grace_s: float = 3.0
    timeout_s: float | None = None
    baseline_nrestarts: int | None = None
    await_start: bool = False
    headless: bool = False
    clock: Callable[[], float] = time.monotonic
    events: list[LogEvent] = field(default_factory=list)
    verdict: StartVerdict | None = None
    phase: str = "starting"
    last_progress: LogEvent | None = None
    _started_at: float = field(init=False)
    _previous: str | None = field(default=None, init=False)
    _best: LogEvent | None = field(default=None, init=False)
    _best_at: float | None = field(default=None, init=False)
    _exit_event: LogEvent | None = field(default=None, init=False)
    _exit_line: str | None = field(default=None, init=False)
    _exited_at: float | None = field(default=None, init=False)
    # since when the unit has been inactive (dead) without a start: a restart passes through that state
    # for a moment, a unit stopped under its start stays there (so a stop is seen within seconds)
    stopped_grace_s: float = 5.0
    _inactive_since: float | None = field(default=None, init=False)
    _saw_stop: bool = field(default=False, init=False)  # systemd logged a stop since the last `Started`

    def __post_init__(self) -> None:
        self._started_at = self.clock()

    # ---- input
    def feed(self, message: str) -> list[LogEvent]:
        """Take one journal message; returns the events it carried (0 or 1)."""
        if self.verdict is not None:
            return []
        event = classify(message, self._previous)
        self._previous = message
        if event is not None and event.name in _UNIT_STOPS:
            self._saw_stop = True
        elif event is not None and event.name in _PROCESS_STARTS:
            self._saw_stop = False
        if self.await_start:
            if event is None or event.name not in _PROCESS_STARTS:
                self._decide()
                return []
            self.await_start = False
        if event is None:
            self._decide()
            return []
        if self._is_new_process(event):
            self._forget_previous_process()
        self.events.append(event)
        now = self.clock()
        if event.kind == "ready" or (self.headless and event.name in HEADLESS_READY):
            self._finish_ok(event)
            return [event]
        if self.headless and event.name in _HEADLESS_WAITING:
            self.phase = "waiting for node 0 to finish the start"
        elif event.kind == "progress":
            self.last_progress = event
            self.phase = _PHASES.get(event.name, self.phase)
        elif event.kind == "fact":
            self.phase = _PHASES.get(event.name, self.phase)
        elif event.kind == "failure":
            if self._best is None or event.rank > self._best.rank:
                self._best, self._best_at = event, now
            if event.ends_process and self._exited_at is None:
                self._exited_at, self._exit_event = now, event
        self._decide()
        return [event]

    def feed_unit_state(self, state: Mapping[str, object]) -> None:
        """Take `systemctl show` properties (ActiveState, SubState, NRestarts, ExecMainStatus...)."""
        if self.verdict is not None:
            return
        restarts = _int_or_none(state.get("NRestarts"))
        if restarts is not None and (self.baseline_nrestarts is None or restarts < self.baseline_nrestarts):
            self.baseline_nrestarts = restarts  # first look, or a manual (re)start reset the counter
        active, sub = str(state.get("ActiveState", "")), str(state.get("SubState", ""))
        exited = (
            sub in _EXITED_SUBSTATES
            or active == "failed"
            # inactive with success is also what a restart passes through: only a failed result counts
            or (active == "inactive" and str(state.get("Result", "success")) != "success")
            or (
                restarts is not None
                and self.baseline_nrestarts is not None
                and restarts > self.baseline_nrestarts
            )
        )
        now = self.clock()
        # a start job that waits for its dependencies is inactive too, but logged no stop
        if active == "inactive" and sub == "dead" and self._saw_stop:
            self._inactive_since = now if self._inactive_since is None else self._inactive_since
            if now - self._inactive_since >= self.stopped_grace_s:
                return self._finish_stopped(now - self._inactive_since)
        else:
            self._inactive_since = None
        if exited and self._exited_at is None:
            self._exited_at = self.clock()
            self._exit_line = "unit state: " + " ".join(
                f"{key}={state[key]}"
                for key in ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus")
                if key in state
            )
        self._decide()

    def head_serving(self) -> StartVerdict | None:
        """Node 0 serves: a headless node whose ranks joined the group, with no error, is ok (vLLM's
        node 0 answers only after every rank finished loading, the KV cache and warming up)."""
        if self.verdict is not None:
            return self.verdict
        joined = next((e for e in reversed(self.events) if e.name == "rank_assigned"), None)
        best = self._best
        if joined is not None and (best is None or best.rank < RANK_SPECIFIC):
            self.verdict = StartVerdict(
                ok=True,
                reason="node 0 is serving, and this node's ranks joined its group "
                f"({parse_line(joined.line).message})",
                decisive_line=joined.line,
                failure=None,
                estimated_max_model_len=None,
                observation=_observation(self.events),
            )
        return self.poll()

    def poll(self) -> StartVerdict | None:
        """Apply the time-based rules (grace after an error or an exit, the start timeout)."""
        if self.verdict is None:
            self._decide()
        return self.verdict

    def finish(self) -> StartVerdict:
        """No more input will come: decide with what is known."""
        if self.verdict is None:
            self._decide(final=True)
        assert self.verdict is not None
        return self.verdict

    @property
    def observation(self) -> Observation:
        return _observation(self.events, self._failure_name())

    def _is_new_process(self, event: LogEvent) -> bool:
        """systemd's `Started`, or vLLM's banner: what came before was another process (its shutdown)."""
        if event.name == "unit_started":
            return True
        banners = ("version_banner", "headless_launch")
        return event.name in banners and any(e.name in banners for e in self.events)

    def _forget_previous_process(self) -> None:
        self.events.clear()
        self._best = self._best_at = self._exit_event = self._exit_line = self._exited_at = None
        self.last_progress, self.phase = None, "starting"
        self._started_at = self.clock()

    # ---- decisions
    def _failure_name(self) -> str | None:
        if self.verdict is not None:
            return self.verdict.failure
        return self._best.name if self._best is not None else None

    def _decide(self, final: bool = False) -> None:
        if self.verdict is not None:
            return
        now = self.clock()
        best = self._best
        if best is not None and best.rank >= RANK_DECISIVE:
            return self._finish_failed(best)
        # once the process has exited, its last lines may still be on their way through journald
        # (published in 250 ms steps): give them exit_grace_s to bring a more precise cause
        exit_settled = self._exited_at is not None and now - self._exited_at >= self.exit_grace_s
        grace_over = self._best_at is not None and now - self._best_at >= self.grace_s
        if best is not None and best.rank >= RANK_SPECIFIC and (exit_settled or final or grace_over):
            return self._finish_failed(best)
        exited = self._exited_at is not None
        if exited and (final or now - (self._exited_at or now) >= self.exit_grace_s):
            if best is not None:
                return self._finish_failed(best)
            return self._finish_exit()
        if final:
            if best is not None:
                return self._finish_failed(best)
            return self._finish_incomplete("the log ended before vLLM was ready or failed")
        if self.timeout_s is not None and now - self._started_at >= self.timeout_s:
            what = (
                f"; last progress: {parse_line(self.last_progress.line).message}"
                if self.last_progress
                else ""
            )
            return self._finish_incomplete(
                f"no ready line after {self.timeout_s:.0f} s{what}", "start_timeout"
            )

    def _finish_ok(self, event: LogEvent) -> None:
        what = "this headless node's ranks are ready" if event.kind != "ready" else "vLLM is serving"
        self.verdict = StartVerdict(
            ok=True,
            reason=f"{what} ({parse_line(event.line).message})",
            decisive_line=event.line,
            failure=None,
            estimated_max_model_len=None,
            observation=_observation(self.events),
        )

    def _finish_failed(self, event: LogEvent) -> None:
        self.verdict = StartVerdict(
            ok=False,
            reason=failure_reason(event),
            decisive_line=event.line,
            failure=event.name,
            estimated_max_model_len=event.data.get("estimated_max_model_len"),
            observation=_observation(self.events, event.name),
        )

    def _finish_exit(self) -> None:
        if self._exit_event is not None:
            return self._finish_failed(self._exit_event)
        self.verdict = StartVerdict(
            ok=False,
            reason="the vLLM process exited before it was ready, without an error line in the log",
            decisive_line=self._exit_line or "",
            failure="process_exited",
            estimated_max_model_len=None,
            observation=_observation(self.events, "process_exited"),
        )

    def _finish_stopped(self, seconds: float) -> None:
        """The unit is inactive and stays so: it was stopped (or never started) under the start being
        waited for, which is a failed start, said at once rather than after the whole start timeout."""
        self.verdict = StartVerdict(
            ok=False,
            reason=f"the unit was stopped before vLLM was ready (inactive for {seconds:.0f} s, no start)",
            decisive_line="unit state: ActiveState=inactive SubState=dead",
            failure="unit_stopped",
            estimated_max_model_len=None,
            observation=_observation(self.events, "unit_stopped"),
        )

    def _finish_incomplete(self, reason: str, failure: str = "no_verdict") -> None:
        line = (
            self.last_progress.line if self.last_progress else (self.events[-1].line if self.events else "")
        )
        self.verdict = StartVerdict(
            ok=False,
            reason=reason,
            decisive_line=line,
            failure=failure,
            estimated_max_model_len=None,
            observation=_observation(self.events, failure),
        )


# A new vLLM process announces itself: systemd's `Started`, the banner, a headless node's first line.
_PROCESS_STARTS = frozenset({"unit_started", "version_banner", "headless_launch"})
_UNIT_STOPS = frozenset({"unit_stopping", "unit_deactivated", "unit_stopped"})
# On a headless node, lines its ranks log only after node 0 accepted the KV-cache configuration and
# asked every rank to warm up (vllm/v1/worker/gpu_worker.py compile_or_warm_up_model, L933-L1066):
# the node's part of the start is done. The CPU build logs none of them after its KV-cache line.
HEADLESS_READY = frozenset(
    {"graph_capturing_finished", "cuda_graph_pool_memory", "kv_cache_memory_suggestion"}
)
# A headless node's last lines before node 0 decides (its KV budget): it waits for node 0 after them.
_HEADLESS_WAITING = frozenset(
    {"cpu_kv_cache_set", "available_kv_cache_memory", "kv_cache_memory_bytes_reserved"}
)

_PHASES = {
    "unit_started": "starting",
    "headless_launch": "starting",
    "distributed_init": "waiting for the other nodes",
    "rank_assigned": "loading weights",
    "resolved_architecture": "configuring",
    "using_max_model_len": "configuring",
    "starting_to_load_model": "loading weights",
    "loading_weights_progress": "loading weights",
    "loading_weights_took": "loading weights",
    "model_loading_took": "compiling and profiling",
    "torch_compile_took": "compiling and profiling",
    "compile_cache_hit": "compiling and profiling",
    "compile_cache_miss": "compiling and profiling",
    "profiling_cuda_graph_memory": "compiling and profiling",
    "available_kv_cache_memory": "allocating the KV cache",
    "kv_cache_capacity": "capturing CUDA graphs",
    "capturing_cuda_graphs": "capturing CUDA graphs",
    "graph_capturing_finished": "warming up",
    "init_engine_took": "starting the HTTP server",
    "supported_tasks": "starting the HTTP server",
}


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def watch(messages: Iterable[str], watcher: StartWatcher | None = None) -> Iterator[LogEvent | StartVerdict]:
    """Events as they come, then the verdict (at once when decisive, else when the messages end)."""
    watcher = watcher or StartWatcher()
    for message in messages:
        yield from watcher.feed(message)
        if watcher.verdict is not None:
            yield watcher.verdict
            return
    yield watcher.finish()


def headless_verdict(
    messages: Iterable[str], head_serving: bool = False, final: bool = False
) -> StartVerdict | None:
    """A headless node's start, decided from its journal so far (use `last_start` on a longer one):
    ok, failed, or None while it is still starting. `head_serving`: node 0 answers HTTP (then a node
    that joined without an error is ok); `final`: no more lines will come (its process ended)."""
    watcher = StartWatcher(headless=True)
    for message in messages:
        watcher.feed(message)
        if watcher.verdict is not None:
            return watcher.verdict
    if head_serving:
        watcher.head_serving()
    return watcher.finish() if final else watcher.verdict
