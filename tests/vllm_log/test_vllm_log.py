"""vLLM's log vocabulary on real text: the 0.32 CPU-build logs, real GPU lines, systemd's journal."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import DATA
from vllm_ctxmgr.vllm_log.patterns import (
    PATTERNS,
    classify,
    classify_all,
    journal_message,
    parse_line,
)
from vllm_ctxmgr.vllm_log.watcher import (
    StartWatcher,
    last_invocation_start,
    last_start,
    observe_start,
    split_starts,
    up_to_ready,
    watch,
)

LOGS = DATA / "vllm-logs"


def lines_of(name: str) -> list[str]:
    """A log in tests/data/vllm-logs/, or DIR/NAME in another folder of tests/data/."""
    path = LOGS.parent / name if "/" in name else LOGS / name
    # split on "\n" only: the logs hold control bytes that str.splitlines() would also split on
    return path.read_text(encoding="utf-8", errors="replace").rstrip("\n").split("\n")


def line_with(name: str, needle: str, occurrence: int = 0) -> str:
    matches = [line for line in lines_of(name) if needle in line]
    assert matches, f"{needle!r} not in {name}"
    return matches[occurrence]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- single lines

REAL_LINES = [
    # (log, text in the line, pattern, data the line must give)
    ("startup_ok.log", "version 0.32.0", "version_banner", {"version": "0.32.0"}),
    ("startup_ok.log", "model   /srv", "model_banner", {"model": "/srv/vllm/models/tiny-llama"}),
    ("startup_ok.log", "non-default args", "non_default_args", {}),
    ("startup_ok.log", "Using max model len", "using_max_model_len", {"max_model_len": 1024}),
    ("startup_ok.log", "Initializing a V1", "engine_version", {"version": "0.32.0", "max_model_len": 1024}),
    ("startup_ok.log", "Starting to load model", "starting_to_load_model", {}),
    ("startup_ok.log", "shards: 100%", "loading_weights_progress", {"percent": 100, "done": 1, "total": 1}),
    ("startup_ok.log", "Loading weights took", "loading_weights_took", {"seconds": 0.01}),
    ("startup_ok.log", "Explicitly set", "cpu_kv_cache_set", {"mode": "Explicitly", "available_kv_gib": 1.0}),
    (
        "startup_ok.log",
        "KV cache size",
        "kv_cache_capacity",
        {"platform": "CPU", "kv_cache_tokens": 1_048_576, "max_model_len": 1024, "max_concurrency": 1024.0},
    ),
    ("startup_ok.log", "init engine", "init_engine_took", {"seconds": 3.19}),
    ("startup_ok.log", "Supported tasks", "supported_tasks", {}),
    ("startup_ok.log", "Starting vLLM server on", "server_starting", {"url": "http://127.0.0.1:8011"}),
    ("startup_ok.log", "Application startup complete.", "application_startup_complete", {}),
    (
        "ok_auto_gmu_0_5.log",
        "Auto set",
        "cpu_kv_cache_set",
        {"mode": "Auto", "available_kv_gib": 5.62, "total_gib": 12.46, "requested_gib": 6.23},
    ),
    (
        "ok_autofit_mml.log",
        "Auto-fit max_model_len",
        "auto_fit_reduced",
        {"derived_max_model_len": 16384, "max_model_len": 3968, "available_kv_gib": 0.97, "platform": "CPU"},
    ),
    (
        "fail_b_kv_too_small_bytes.log",
        "ValueError: To serve",
        "kv_cache_too_small",
        {
            "max_model_len": 2048,
            "needed_kv_gib": 0.0,
            "available_kv_gib": 0.0,
            "estimated_max_model_len": 896,
        },
    ),
    (
        "fail_b2_kv_too_small_kvspace.log",
        "ValueError: To serve",
        "kv_cache_too_small",
        {
            "max_model_len": 16384,
            "needed_kv_gib": 4.0,
            "available_kv_gib": 0.97,
            "estimated_max_model_len": 3968,
        },
    ),
    (
        "fail_a_mml_gt_mpe.log",
        "Value error, User-specified",
        "max_model_len_exceeds_derived",
        {"max_model_len": 4096, "derived_key": "max_position_embeddings", "derived_max_model_len": 2048},
    ),
    (
        "fail_a_mml_gt_mpe.log",
        "ValidationError: 1 validation",
        "config_validation_error",
        {"config": "ModelConfig"},
    ),
    (
        "fail_d_gmu_0_99.log",
        "ValueError: Available memory on node",
        "free_memory_below_utilization",
        {"free_gib": 10.81, "total_gib": 12.21, "gpu_memory_utilization": 0.99, "requested_gib": 12.09},
    ),
    (
        "fail_h_naive_defaults.log",
        "ValueError: Available memory on node",
        "free_memory_below_utilization",
        {"gpu_memory_utilization": 0.92, "requested_gib": 11.24},
    ),
    (
        "fail_e_gmu_0_05.log",
        "ValueError: Available memory on node",
        "cpu_kv_cache_allocation",
        {"free_gib": 10.84, "requested_kv_gib": -0.01, "requested_gib": 0.61},
    ),
    # the worker's wrapper quotes the root cause: it counts as that cause
    ("fail_e_gmu_0_05.log", "RuntimeError: Worker failed", "cpu_kv_cache_allocation", {"free_gib": 10.84}),
    ("fail_f_kvspace_0.log", "No available memory", "no_kv_cache_memory", {}),
    (
        "fail_g_bad_model_path.log",
        "errors.HFValidationError: Repo id",
        "model_path_missing",
        {"model": "/srv/vllm/models/does-not-exist"},
    ),
    (
        "fail_i_bad_mml_string.log",
        "vllm serve: error",
        "argparse_error",
        {"argument": "--max-model-len"},
    ),
    ("fail_d_gmu_0_99.log", "Exception: WorkerProc initialization failed", "worker_proc_init_failed", {}),
    ("fail_b_kv_too_small_bytes.log", "EngineCore failed to start.", "engine_core_failed_to_start", {}),
    (
        "fail_b_kv_too_small_bytes.log",
        "RuntimeError: Engine core initialization failed",
        "engine_core_init_failed",
        {"failed_core_procs": "{'EngineCore': 1}"},
    ),
    ("fail_b_kv_too_small_bytes.log", "Traceback (most recent call last):", "traceback", {}),
    ("systemd_vllm-ok_journal.log", "EngineDeadError", "engine_dead", {}),
    ("systemd_vllm-ok_journal.log", "Started vllm-ok.service", "unit_started", {"unit": "vllm-ok.service"}),
    (
        "systemd_vllm-bad_journal.log",
        "Main process exited",
        "unit_main_process_exited",
        {"unit": "vllm-bad.service", "exit_code": "exited", "exit_status": 1, "exit_status_name": "FAILURE"},
    ),
    ("systemd_vllm-bad_journal.log", "Failed with result", "unit_failed_result", {"result": "exit-code"}),
    (
        "systemd_vllm-bad_journal.log",
        "Scheduled restart job",
        "unit_restart_scheduled",
        {"restart_counter": 2},
    ),
    ("systemd_vllm-bad_journal.log", "Start request repeated too quickly", "unit_start_limit_hit", {}),
    ("systemd_vllm-bad_journal.log", "Failed to start vllm-bad", "unit_failed_to_start", {}),
    (
        "systemd_vllm-ok_journal.log",
        "Deactivated successfully",
        "unit_deactivated",
        {"unit": "vllm-ok.service"},
    ),
]


@pytest.mark.parametrize(
    ("log", "needle", "name", "data"), REAL_LINES, ids=[f"{r[2]}:{r[0]}" for r in REAL_LINES]
)
def test_pattern_on_real_line(log: str, needle: str, name: str, data: dict[str, object]) -> None:
    occurrence = 1 if name == "unit_restart_scheduled" else 0
    event = classify(line_with(log, needle, occurrence))
    assert event is not None and event.name == name
    for key, value in data.items():
        assert event.data[key] == value


def test_non_default_args_are_parsed_into_a_dict() -> None:
    event = classify(line_with("fail_b_kv_too_small_bytes.log", "non-default args"))
    assert event is not None
    assert event.data["args"]["kv_cache_memory_bytes"] == 1_048_576
    assert event.data["args"]["max_model_len"] == 2048


def test_gpu_memory_utilization_field_line_needs_the_line_before() -> None:
    lines = lines_of("fail_c_gmu_1_5.log")
    index = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Input should be"))
    alone = classify(lines[index])
    with_field = classify(lines[index], previous=lines[index - 1])
    assert alone is not None and alone.name == "config_value_invalid"
    assert with_field is not None and with_field.name == "gpu_memory_utilization_out_of_range"
    assert with_field.data["gpu_memory_utilization"] == 1.5
    assert with_field.rank > alone.rank


def test_public_gpu_lines() -> None:
    """Real GPU-build lines (0.9 to 0.2x) from public threads: the wording the CPU logs lack."""
    rows = [
        line.rstrip("\n").split("\t", 1)
        for line in (LOGS / "public_gpu_lines.tsv").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert len(rows) >= 20
    for name, text in rows:
        event = classify(text)
        assert event is not None and event.name == name, text
    old_kv = classify(next(text for name, text in rows if name == "kv_cache_too_small"))
    assert old_kv is not None
    assert old_kv.data["wording"] == "0.11" and old_kv.data["estimated_max_model_len"] == 59584


def test_engine_error_appears_twice_with_the_same_meaning() -> None:
    events = [
        event
        for event in classify_all(lines_of("fail_b2_kv_too_small_kvspace.log"))
        if event.name == "kv_cache_too_small"
    ]
    assert len(events) == 2
    assert events[0].line.startswith("(EngineCore pid=28850) ERROR")
    assert not events[1].line.startswith("(")
    assert events[0].data == events[1].data


def test_every_pattern_names_its_source() -> None:
    assert all(pattern.source for pattern in PATTERNS)
    assert {p.kind for p in PATTERNS} == {"progress", "ready", "failure", "fact"}


def test_every_pattern_says_what_it_means_and_where_a_real_line_was_seen() -> None:
    """The table's `seen` is checked, not trusted: each log it names holds a line of that name."""
    public = {row.split("\t", 1)[0] for row in (LOGS / "public_gpu_lines.tsv").read_text().splitlines()}
    named = 0
    for pattern in PATTERNS:
        assert pattern.meaning and pattern.seen, pattern.name
        files = [
            word.strip(",;") for word in pattern.seen.split() if word.strip(",;").endswith((".log", ".tsv"))
        ]
        assert files or pattern.seen.startswith("not in a log here"), pattern.name
        for name in files:
            if name == "public_gpu_lines.tsv":
                assert pattern.name in public, pattern.name
            else:
                assert any(e.name == pattern.name for e in classify_all(lines_of(name))), (pattern.name, name)
            named += 1
    assert named >= 60


def test_parse_line_strips_journal_vllm_and_uvicorn_prefixes() -> None:
    journal = line_with("systemd_vllm-ok_journal.log", "Using max model len")
    parsed = parse_line(journal)
    assert parsed.message == "Using max model len 1024"
    assert (parsed.process, parsed.pid, parsed.level, parsed.fileinfo) == (
        "APIServer",
        87,
        "INFO",
        "model.py:2152",
    )
    assert journal_message(journal).startswith("(APIServer pid=87)")
    uvicorn = parse_line(line_with("startup_ok.log", "Application startup complete."))
    assert (uvicorn.message, uvicorn.level) == ("Application startup complete.", "INFO")
    assert parse_line("\x1b[32mINFO\x1b[0m:     Application startup complete.").message == (
        "Application startup complete."
    )


def test_ulimit_warning_mentioning_an_oserror_is_not_a_failure() -> None:
    event = classify(line_with("startup_ok.log", "Found ulimit"))
    assert event is None or event.kind != "failure"


# ---------------------------------------------------------------- whole starts

WHOLE_LOGS = [
    # (log, ok, failure, estimated max, text of the decisive line)
    ("startup_ok.log", True, None, None, "Starting vLLM server on http://127.0.0.1:8011"),
    ("ok_autofit_mml.log", True, None, None, "Starting vLLM server on"),
    ("ok_auto_gmu_0_5.log", True, None, None, "Starting vLLM server on"),
    ("systemd_vllm-ok_journal.log", True, None, None, "Starting vLLM server on"),
    ("fail_a_mml_gt_mpe.log", False, "max_model_len_exceeds_derived", None, "Value error, User-specified"),
    ("fail_b_kv_too_small_bytes.log", False, "kv_cache_too_small", 896, "(EngineCore pid=27975) ERROR"),
    (
        "fail_b2_kv_too_small_kvspace.log",
        False,
        "kv_cache_too_small",
        3968,
        "estimated maximum model length is 3968",
    ),
    ("fail_c_gmu_1_5.log", False, "gpu_memory_utilization_out_of_range", None, "Input should be less than"),
    (
        "fail_d_gmu_0_99.log",
        False,
        "free_memory_below_utilization",
        None,
        "desired CPU memory utilization (0.99",
    ),
    ("fail_e_gmu_0_05.log", False, "cpu_kv_cache_allocation", None, "on kv cache allocation"),
    ("fail_f_kvspace_0.log", False, "no_kv_cache_memory", None, "No available memory for the cache blocks"),
    ("fail_g_bad_model_path.log", False, "model_path_missing", None, "HFValidationError"),
    ("fail_h_naive_defaults.log", False, "free_memory_below_utilization", None, "(0.92, 11.24 GiB)"),
    (
        "fail_i_bad_mml_string.log",
        False,
        "argparse_error",
        None,
        "vllm serve: error: argument --max-model-len",
    ),
    (
        "systemd_vllm-bad_journal.log",
        False,
        "max_model_len_exceeds_derived",
        None,
        "vm vllm[187]:   Value error",
    ),
]


@pytest.mark.parametrize(
    ("log", "ok", "failure", "estimate", "decisive"), WHOLE_LOGS, ids=[r[0] for r in WHOLE_LOGS]
)
def test_watcher_on_whole_log(
    log: str, ok: bool, failure: str | None, estimate: int | None, decisive: str
) -> None:
    lines = lines_of(log)
    watcher = StartWatcher(clock=FakeClock())
    fed = 0
    for line in lines:
        watcher.feed(line)
        fed += 1
        if watcher.verdict is not None:
            break
    verdict = watcher.verdict
    # decisive evidence gives the verdict on the spot: no waiting, no end of log needed
    assert verdict is not None, f"no verdict after all {len(lines)} lines"
    assert lines[fed - 1] == verdict.decisive_line
    assert verdict.ok is ok
    assert verdict.failure == failure
    assert verdict.estimated_max_model_len == estimate
    assert decisive in verdict.decisive_line
    assert verdict.reason
    assert verdict.observation.ready is ok


def test_kv_too_small_wins_over_the_engine_failure_that_follows() -> None:
    verdict = StartWatcher(clock=FakeClock())
    events = [
        event.name for line in lines_of("fail_b_kv_too_small_bytes.log") for event in verdict.feed(line)
    ]
    assert "engine_core_failed_to_start" in events  # seen first ...
    assert (
        verdict.verdict is not None and verdict.verdict.failure == "kv_cache_too_small"
    )  # ... but outranked
    assert "896" in verdict.verdict.reason


def test_verdict_reason_is_plain_words_with_vllms_numbers() -> None:
    (*_, verdict) = watch(lines_of("fail_b2_kv_too_small_kvspace.log"), StartWatcher(clock=FakeClock()))
    assert verdict.reason == (  # type: ignore[union-attr]
        "the KV cache is too small for max_model_len 16384: one request needs 4.0 GiB but 0.97 GiB is "
        "available per GPU; vLLM estimates the largest max_model_len that fits is 3968"
    )


def test_watch_yields_progress_then_the_verdict() -> None:
    items = list(watch(lines_of("startup_ok.log"), StartWatcher(clock=FakeClock())))
    names = [getattr(item, "name", None) for item in items]
    assert (
        names.index("starting_to_load_model")
        < names.index("kv_cache_capacity")
        < names.index("server_starting")
    )
    assert items[-1].ok is True  # type: ignore[union-attr]


def test_harmless_traceback_before_ready_is_not_a_failure() -> None:
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, grace_s=3, exit_grace_s=1)
    ok_lines = lines_of("startup_ok.log")
    cut = next(i for i, line in enumerate(ok_lines) if "Starting vLLM server on" in line)
    for line in ok_lines[:10]:
        watcher.feed(line)
    watcher.feed("Traceback (most recent call last):")
    watcher.feed("ModuleNotFoundError: No module named 'flashinfer'")
    clock.now += 120  # long after any grace: generic evidence alone never decides
    assert watcher.poll() is None
    for line in ok_lines[10 : cut + 1]:
        watcher.feed(line)
    assert watcher.verdict is not None and watcher.verdict.ok


def test_specific_failure_waits_for_grace_or_exit_not_longer() -> None:
    oom = next(
        line.split("\t", 1)[1]
        for line in (LOGS / "public_gpu_lines.tsv").read_text(encoding="utf-8").splitlines()
        if line.startswith("cuda_oom\t")
    )
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, grace_s=3.0)
    watcher.feed(oom)
    assert watcher.poll() is None  # a more precise line may still come
    clock.now += 3.0
    verdict = watcher.poll()
    assert verdict is not None and verdict.failure == "cuda_oom"
    assert "22.00 MiB" in verdict.reason

    exit_clock = FakeClock()
    exiting = StartWatcher(clock=exit_clock, grace_s=3.0, exit_grace_s=1.0)
    exiting.feed(oom)
    exiting.feed(
        line_with("fail_b_kv_too_small_bytes.log", "RuntimeError: Engine core initialization failed")
    )
    assert exiting.verdict is None  # the process ended: its last lines get exit_grace_s to arrive
    exit_clock.now += 1.0
    verdict = exiting.poll()
    assert verdict is not None and verdict.failure == "cuda_oom"  # well before the 3 s grace


def test_exit_without_error_lines_waits_briefly_for_late_lines() -> None:
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, exit_grace_s=1.0)
    for line in lines_of("startup_ok.log")[:30]:
        watcher.feed(line)
    watcher.feed("vllm.service: Main process exited, code=killed, status=9/KILL")
    assert watcher.verdict is None
    clock.now += 1.0
    verdict = watcher.poll()
    assert verdict is not None and verdict.failure == "unit_main_process_exited"
    assert "status 9/KILL" in verdict.reason


def test_hang_ends_in_a_start_timeout_with_the_last_progress() -> None:
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, timeout_s=600)
    lines = lines_of("startup_ok.log")
    for line in lines[: next(i for i, line in enumerate(lines) if "Loading weights took" in line)]:
        watcher.feed(line)
    clock.now += 599
    assert watcher.poll() is None
    clock.now += 1
    verdict = watcher.poll()
    assert verdict is not None and verdict.failure == "start_timeout"
    assert "Loading safetensors checkpoint shards: 100%" in verdict.reason
    assert watcher.phase == "loading weights"


def _timeline() -> list[tuple[int, dict[str, str]]]:
    rows = []
    for line in (LOGS / "systemd_vllm-bad_show_timeline.txt").read_text().splitlines():
        stamp, *pairs = line.split()
        rows.append(
            (int(stamp.removeprefix("t+").removesuffix("s")), dict(pair.split("=", 1) for pair in pairs))
        )
    return rows


def test_unit_states_of_the_crash_loop_show_the_exit() -> None:
    """`systemctl show` polled every 3 s: only NRestarts rises for the first attempts."""
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, exit_grace_s=1.0)
    decided_at = None
    for seconds, state in _timeline():
        clock.now = 1000.0 + seconds
        watcher.feed_unit_state(state)
        if watcher.poll() is not None and decided_at is None:
            decided_at = seconds
    assert decided_at == 18  # NRestarts 0 -> 1 seen at t+15 s, decided after the exit grace
    assert watcher.verdict is not None and watcher.verdict.failure == "process_exited"
    assert "NRestarts=1" in watcher.verdict.decisive_line


def test_unit_state_exit_turns_generic_evidence_into_the_verdict() -> None:
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, exit_grace_s=1.0)
    watcher.feed_unit_state({"ActiveState": "activating", "SubState": "start", "NRestarts": "0"})
    watcher.feed("Traceback (most recent call last):")
    watcher.feed("RuntimeError: CUDA error: an illegal memory access was encountered")
    watcher.feed_unit_state({"ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "0"})
    assert watcher.verdict is None
    clock.now += 1
    verdict = watcher.poll()
    assert verdict is not None and verdict.failure == "python_exception"
    assert "illegal memory access" in verdict.reason


def test_restart_read_from_a_cursor_before_it_forgets_the_old_process() -> None:
    """The stopped process's shutdown (an EngineDeadError traceback, `Deactivated successfully`) comes
    first in the journal; systemd's `Started` opens the new process's evidence."""
    ok = lines_of("systemd_vllm-ok_journal.log")
    stopping = next(i for i, line in enumerate(ok) if "Stopping vllm-ok.service" in line)
    old_shutdown = ok[stopping:]
    clock = FakeClock()
    watcher = StartWatcher(clock=clock, exit_grace_s=1.0)
    for line in old_shutdown:
        watcher.feed(line)
    assert watcher.verdict is None  # the old process's exit is pending a grace...
    for line in ok[: stopping - 5]:  # ... and the new start's `Started` comes first
        watcher.feed(line)
        clock.now += 0.01
    assert watcher.verdict is not None and watcher.verdict.ok
    assert watcher.verdict.observation.failure is None
    assert not any(event.name == "engine_dead" for event in watcher.events)


def test_await_start_ignores_an_older_attempts_late_error() -> None:
    old_attempt = split_starts(lines_of("systemd_vllm-bad_journal.log"))[-1]
    new_start = lines_of("systemd_vllm-ok_journal.log")
    eager = StartWatcher(clock=FakeClock())
    for line in old_attempt + new_start:
        eager.feed(line)
    assert eager.verdict is not None and eager.verdict.failure == "max_model_len_exceeds_derived"
    late = next(i for i, line in enumerate(old_attempt) if "Traceback" in line)
    waiting = StartWatcher(clock=FakeClock(), await_start=True)
    for line in old_attempt[late:] + new_start:  # the old attempt's error and exit arrive after the cursor
        waiting.feed(line)
    assert waiting.verdict is not None and waiting.verdict.ok


def test_unit_state_during_a_restart_is_not_an_exit() -> None:
    clock = FakeClock()
    # the deploy watches from the restart: the old crash loop left NRestarts=3, `systemctl restart`
    # passes inactive/dead and resets the counter
    watcher = StartWatcher(clock=clock, exit_grace_s=1.0)
    for state in (
        {"ActiveState": "inactive", "SubState": "dead", "Result": "success", "NRestarts": "3"},
        {"ActiveState": "activating", "SubState": "start", "Result": "success", "NRestarts": "0"},
        {"ActiveState": "active", "SubState": "running", "Result": "success", "NRestarts": "0"},
    ):
        watcher.feed_unit_state(state)
        clock.now += 5
        assert watcher.poll() is None
    watcher.feed_unit_state({"ActiveState": "active", "SubState": "running", "NRestarts": "1"})
    clock.now += 1
    verdict = watcher.poll()
    assert verdict is not None and verdict.failure == "process_exited"


def test_finish_decides_with_what_is_known() -> None:
    watcher = StartWatcher(clock=FakeClock())
    for line in lines_of("startup_ok.log")[:20]:
        watcher.feed(line)
    verdict = watcher.finish()
    assert verdict.ok is False and verdict.failure == "no_verdict"


# ---------------------------------------------------------------- observations and starts


def test_observe_start_ok() -> None:
    observation = observe_start(lines_of("startup_ok.log"))
    assert observation.vllm_version == "0.32.0"
    assert observation.platform == "CPU"
    assert observation.max_model_len == 1024
    assert observation.kv_cache_tokens == 1_048_576
    assert observation.max_concurrency == 1024.0
    assert observation.available_kv_gib == 1.0  # the CPU backend's KV space: VLLM_CPU_KVCACHE_SPACE=1
    assert observation.ready is True and observation.failure is None


def test_observe_start_auto_fit_takes_the_fitted_length() -> None:
    observation = observe_start(lines_of("ok_autofit_mml.log"))
    assert observation.max_model_len == 3968  # not the derived 16384 of "Using max model len"
    assert observation.available_kv_gib == 0.97  # vLLM's figure, one block below the 1.0 GiB asked for
    assert observation.kv_cache_tokens == 4096
    assert observation.max_concurrency == 1.03
    assert observation.ready is True


def test_observe_start_failed() -> None:
    observation = observe_start(lines_of("fail_b2_kv_too_small_kvspace.log"))
    assert observation.estimated_max_model_len == 3968
    assert observation.needed_kv_gib == 4.0
    assert observation.available_kv_gib == 0.97
    assert observation.max_model_len == 16384
    assert observation.ready is False and observation.failure == "kv_cache_too_small"


def test_observe_start_takes_the_smallest_rank_budget() -> None:
    public = (LOGS / "public_gpu_lines.tsv").read_text(encoding="utf-8").splitlines()
    small_rank = next(
        line.split("\t", 1)[1] for line in public if line.startswith("available_kv_cache_memory\t")
    )
    big_rank = small_rank.replace("Worker_TP0", "Worker_TP1").replace("6.87 GiB", "7.12 GiB")
    assert observe_start([big_rank, small_rank]).available_kv_gib == 6.87


def test_split_starts_on_the_crash_loop_journal() -> None:
    starts = split_starts(lines_of("systemd_vllm-bad_journal.log"))
    assert len(starts) == 3
    for start in starts:
        assert "Started vllm-bad.service" in start[0]
        assert any("User-specified max_model_len (4096)" in line for line in start)
        assert any("Main process exited" in line for line in start)
    assert any("Start request repeated too quickly" in line for line in starts[-1])
    assert last_start(lines_of("systemd_vllm-bad_journal.log")) == starts[-1]
    observation = observe_start(starts[-1])
    assert observation.vllm_version == "0.32.0" and observation.failure == "max_model_len_exceeds_derived"


def test_split_starts_without_systemd_lines_uses_the_banner() -> None:
    first, second = lines_of("fail_a_mml_gt_mpe.log"), lines_of("startup_ok.log")
    starts = split_starts(first + second)
    assert len(starts) == 2
    assert starts[1][0] == second[1]  # the banner's empty first line opens the start
    assert starts[0][-1] == second[0]  # a line printed before vLLM's logger starts cannot be told apart
    assert observe_start(starts[-1]).ready is True
    assert observe_start(starts[0]).failure == "max_model_len_exceeds_derived"


# ---- a start is one invocation of the unit, up to its ready line (issue 29, item 1) -------------------
# What a serving vLLM echoes to its log (a client's prompt logged by --enable-log-requests, a user's
# text) can hold a banner and memory lines; from the same MainPID and invocation they are no start.

ECHOED = [
    "2026-11-30T00:29:40+0000 vm vllm[87]: vLLM API server version 0.32.0",
    "2026-11-30T00:29:40+0000 vm vllm[87]: Model loading took 1.00 GiB and 0.5 seconds",
    "2026-11-30T00:29:40+0000 vm vllm[87]: Available KV cache memory: 9999.00 GiB",
    "2026-11-30T00:29:40+0000 vm vllm[87]: GPU KV cache size: 9,999,999 tokens",
    "2026-11-30T00:29:40+0000 vm vllm[87]: Starting vLLM server on http://0.0.0.0:9999",
]


def invocations(journal: list[str], first: str = "a") -> list[tuple[str | None, str]]:
    """A journal's lines with the invocation systemd gives each run: a new one at each `Started`."""
    out: list[tuple[str | None, str]] = []
    number = ord(first) - 1
    for line in journal:
        if "systemd[1]: Started " in line:
            number += 1
        out.append((chr(max(number, ord(first))) * 32, line))
    return out


def test_an_echoed_banner_inside_one_invocation_is_not_a_new_start() -> None:
    journal = lines_of("systemd_vllm-ok_journal.log")
    ready = next(i for i, line in enumerate(journal) if "Application startup complete" in line)
    serving = journal[: ready + 3] + ECHOED  # the server is up, answers, and a client's text is logged
    real = observe_start(last_start(journal))
    assert real.available_kv_gib == 1.0 and real.ready
    # cut by banners alone (what the journal paths did), the echo was the last start
    assert observe_start(last_start(serving)).available_kv_gib == 9999.0
    learned = observe_start(last_invocation_start(invocations(serving)))
    assert learned == real
    assert learned.model_loading_gib is None and learned.kv_cache_tokens == 1_048_576


def test_the_last_invocation_is_the_start_after_a_crash_loop() -> None:
    crash_loop = invocations(lines_of("systemd_vllm-bad_journal.log"), "a")
    served = invocations(lines_of("systemd_vllm-ok_journal.log") + ECHOED, "x")
    last = last_invocation_start(crash_loop + served)
    assert "Started vllm-ok.service" in last[0]
    assert "Application startup complete" in last[-1] or "Starting vLLM server on" in last[-1]
    assert observe_start(last).available_kv_gib == 1.0
    # the crash loop's own last invocation is its third start, as split_starts cut it
    assert last_invocation_start(crash_loop) == up_to_ready(split_starts([m for _, m in crash_loop])[-1])


def test_figures_after_the_ready_line_are_not_the_starts_without_invocations() -> None:
    """A log file (no invocation ids): still cut at the ready line."""
    journal = lines_of("startup_ok.log")
    ready = next(i for i, line in enumerate(journal) if "Starting vLLM server on" in line)
    lines = [*journal[: ready + 1], "Available KV cache memory: 0.01 GiB", *journal[ready + 1 :]]
    assert observe_start(last_invocation_start([(None, line) for line in lines])) == observe_start(journal)


def test_the_pattern_table_compiles_on_first_use_not_at_import() -> None:
    """Every ctxmgr command imports the table's module (via the watcher), few classify a line: its
    ~80 expressions cost 0.1 s of each start, so each is compiled when a line is first matched."""
    code = (
        "import re, sys\n"
        "compiled = []\n"
        "plain = re.compile\n"
        "re.compile = lambda pattern, flags=0: compiled.append(pattern) or plain(pattern, flags)\n"
        "from vllm_ctxmgr.vllm_log import patterns\n"
        "at_import = len(compiled)\n"
        "event = patterns.classify(sys.argv[1])\n"
        "print(at_import, len(patterns.PATTERNS), len(compiled) - at_import, event and event.name)\n"
    )
    line = line_with("startup_ok.log", "Starting vLLM server on")
    out = subprocess.run(
        [sys.executable, "-c", code, line], capture_output=True, text=True, check=True
    ).stdout
    at_import, table, on_use, name = out.split()
    assert int(table) > 70
    assert int(at_import) < 10  # the few line-prefix expressions, not the table
    assert 0 < int(on_use) <= int(table)
    assert name == "server_starting"
