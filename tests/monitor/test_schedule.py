"""schedule / unschedule: time spans as systemd reads them, the rendered units, and a real timer.

The timer test runs the verify unit every 2 s under the private systemd and reads its results from
journald (identifier ctxmgr-verify) and from the Prometheus textfile it leaves.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from tests.support.cli import ctxmgr_said
from tests.support.demo import make_vllm_wrapper, standin_unit
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port
from vllm_ctxmgr.errors import UsageError
from vllm_ctxmgr.monitor.schedule import (
    ScheduleRequest,
    check_calendar,
    format_timespan,
    parse_timespan,
    render_units,
    timer_schedule,
)
from vllm_ctxmgr.systemd.quoting import resolve_escapes, split_words
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit_file import UnitFile

SPANS = ["15min", "1h 30min", "2s", "90", "500ms", "1.5h", "2 days", "1h30m", "1w 2d", "3 min 4 sec", "250us"]
NOT_SPANS = ["hourly", "*:0/15", "Mon..Fri 09:00", "5 parsecs", "", "min"]


def systemd_timespan_us(text: str) -> int | None:
    """What systemd itself makes of a span (`systemd-analyze timespan`), in µs; None if it refuses."""
    done = subprocess.run(["systemd-analyze", "timespan", text], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    match = re.search(r"μs: (\d+)", done.stdout)
    assert match, done.stdout
    return int(match[1])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("text", SPANS + NOT_SPANS)
def test_time_spans_read_as_systemd_reads_them(text: str) -> None:
    ours = parse_timespan(text)
    theirs = systemd_timespan_us(text) if text else None
    if theirs is None:
        assert ours is None
    else:
        assert ours is not None and round(ours * 1_000_000) == theirs


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("seconds", [2, 0.2, 900, 5400, 90061.5, 0.000250])
def test_formatted_spans_mean_the_same_to_systemd(seconds: float) -> None:
    assert systemd_timespan_us(format_timespan(seconds)) == round(seconds * 1_000_000)


def test_a_span_spreads_and_keeps_accuracy_to_a_tenth_and_a_calendar_catches_up() -> None:
    span = timer_schedule("15min")
    assert (span.kind, span.every, span.randomized_delay, span.accuracy) == (
        "span",
        "15min",
        "1min 30s",
        "1min",
    )
    fast = timer_schedule("2s")
    assert (fast.every, fast.randomized_delay, fast.accuracy) == ("2s", "200ms", "200ms")
    day = timer_schedule("1d")
    assert day.randomized_delay == "5min"  # spread at most 5 minutes
    calendar = timer_schedule("Mon..Fri   09:00", randomized_delay="30s")
    assert (calendar.kind, calendar.every, calendar.randomized_delay) == ("calendar", "Mon..Fri 09:00", "30s")
    with pytest.raises(UsageError, match="at least 1s"):
        timer_schedule("500ms")
    with pytest.raises(UsageError, match="neither a time span nor a calendar"):
        timer_schedule("daily\nExecStart=/bin/sh")
    with pytest.raises(UsageError, match="not a time span"):
        timer_schedule("15min", randomized_delay="soon")


def test_rendered_units_run_this_ctxmgr_with_exactly_its_arguments(tmp_path: Path) -> None:
    state_dir = tmp_path / "state 50% $HOME"  # a space, a specifier and a variable: all must survive
    request = ScheduleRequest(
        service="vllm-glm5.service",
        every="15min",
        on_failure="rollback",
        textfile=str(tmp_path / "prom dir" / "vllm-glm5.prom"),
        long_probe=True,
        python=sys.executable,
        state_dir=str(state_dir),
    )
    units = render_units(request, timer_schedule("15min"))
    assert sorted(units) == ["ctxmgr-verify@vllm-glm5.service", "ctxmgr-verify@vllm-glm5.timer"]
    service = UnitFile.parse("ctxmgr-verify@vllm-glm5.service", units["ctxmgr-verify@vllm-glm5.service"])
    (exec_start,) = service.get_all("Service", "ExecStart")
    argv = [resolve_escapes(word.value) for word in split_words(exec_start.value)]
    textfile = str(tmp_path / "prom dir" / "vllm-glm5.prom")
    assert argv == [
        sys.executable, "-m", "vllm_ctxmgr", "--state-dir", str(state_dir), "verify", "--service",
        "vllm-glm5", "--on-failure", "rollback", "--textfile", textfile, "--long-probe",
    ]  # fmt: skip
    values = {(a.section, a.key): a.value for a in service.assignments}
    assert values[("Service", "Type")] == "oneshot"
    assert values[("Service", "SyslogIdentifier")] == "ctxmgr-verify"
    assert values[("Unit", "After")] == "vllm-glm5.service"
    timer = UnitFile.parse("t", units["ctxmgr-verify@vllm-glm5.timer"])
    values = {(a.section, a.key): a.value for a in timer.assignments}
    assert values[("Timer", "Unit")] == "ctxmgr-verify@vllm-glm5.service"
    assert values[("Timer", "OnActiveSec")] == values[("Timer", "OnUnitActiveSec")] == "15min"
    assert ("Timer", "Persistent") not in values  # systemd.timer(5): no effect without OnCalendar=
    assert values[("Install", "WantedBy")] == "timers.target"
    hourly = UnitFile.parse(
        "t", render_units(request, timer_schedule("hourly"))["ctxmgr-verify@vllm-glm5.timer"]
    )
    keys = {a.key: a.value for a in hourly.assignments}
    assert keys["OnCalendar"] == "hourly" and "OnUnitActiveSec" not in keys
    assert keys["Persistent"] == "true"  # a calendar timer catches up after downtime


# ---------------------------------------------------------------------------------------------
# Under the private systemd


ctxmgr = partial(ctxmgr_said, unit_dir="/run/systemd/system")


def verify_journal(sandbox: Sandbox, name: str) -> list[str]:
    """What the scheduled verifications of `name` wrote to the journal under their own identifier."""
    argv = sandbox.systemd.command("journalctl", "--no-pager", "-o", "json", "-t", "ctxmgr-verify",
                                   f"_SYSTEMD_UNIT=ctxmgr-verify@{name}.service")  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [json.loads(line)["MESSAGE"] for line in out.splitlines() if line.strip()]


@pytest.mark.systemd247
def test_a_timer_verifies_every_few_seconds_into_the_journal_and_a_textfile(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_ctxmgr.probe import wait_until_serving

    name = "vllm-sched"
    port = free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    state, prom = workdir / "state", workdir / "metrics" / f"{name}.prom"
    prom.parent.mkdir()
    timer = f"ctxmgr-verify@{name}.timer"
    unit_dir = sandbox.systemd.host_unit_dir
    try:
        code, data, out = ctxmgr(sandbox, state, "schedule", "--service", name, "--every", "2s",
                                 "--textfile", str(prom), "--json")  # fmt: skip
        assert code == 0, out
        assert data["changed"] is True and data["timer"] == timer and data["every"] == "2s"
        assert (unit_dir / timer).is_file() and (unit_dir / f"ctxmgr-verify@{name}.service").is_file()
        assert sandbox.systemd.show(timer, "ActiveState")["ActiveState"] == "active"

        deadline = time.monotonic() + 20
        results: list[str] = []
        while time.monotonic() < deadline:
            results = [m for m in verify_journal(sandbox, name) if m.startswith(f"{name}: ")]
            if len(results) >= 2 and prom.exists():
                break
            time.sleep(0.5)
        assert len(results) >= 2, results  # it fired, and fired again
        # the stand-in has no GPU: ok, and the headline says its GPU memory was not checked
        assert results[-1].startswith(f"{name}: ok, GPU memory not checked (max_model_len 8192, probe ")
        samples = {
            (s.name, s.labels.get("result")): (s.value, s.labels["service"])
            for family in text_string_to_metric_families(prom.read_text())
            for s in family.samples
        }
        assert samples[("ctxmgr_verify_success", None)] == (1.0, name)
        assert samples[("ctxmgr_verify_max_model_len", None)] == (8192.0, name)
        assert samples[("ctxmgr_verify_kv_cache_tokens", None)][0] > 0
        assert time.time() - samples[("ctxmgr_verify_last_run_timestamp_seconds", None)][0] < 30
        assert sorted(p.name for p in prom.parent.iterdir()) == [prom.name]  # no temporary file left

        # the same again: nothing is written or restarted
        before = {p.name: p.stat().st_mtime_ns for p in unit_dir.glob(f"ctxmgr-verify@{name}.*")}
        code, data, out = ctxmgr(sandbox, state, "schedule", "--service", name, "--every", "2s",
                                 "--textfile", str(prom), "--json")  # fmt: skip
        assert code == 0 and data["changed"] is False, out
        assert {p.name: p.stat().st_mtime_ns for p in unit_dir.glob(f"ctxmgr-verify@{name}.*")} == before

        code, data, out = ctxmgr(sandbox, state, "unschedule", "--service", name, "--json")
        assert code == 0 and data["changed"] is True, out
        assert not list(unit_dir.glob(f"ctxmgr-verify@{name}.*"))
        assert sandbox.systemd.show(timer, "LoadState")["LoadState"] == "not-found"
        code, data, out = ctxmgr(sandbox, state, "unschedule", "--service", name, "--json")
        assert code == 0 and data["changed"] is False, out
    finally:
        ctxmgr(sandbox, state, "unschedule", "--service", name)


@pytest.mark.systemd247
def test_a_calendar_timer_says_when_it_runs_next_and_status_shows_it(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    """Issue 26: `systemctl show` prints a timer's next elapse as a date on 247 and on 252 alike (252
    ignores --timestamp=unix there): read as UTC, the next run of a daily 03:00 timer is that moment."""
    name = "vllm-sched-cal"
    install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=free_port()))
    state = workdir / "state"
    try:
        every = "*-*-* 03:00:00 UTC"
        code, data, out = ctxmgr(sandbox, state, "schedule", "--service", name, "--every", every,
                                 "--randomized-delay", "0", "--json")  # fmt: skip
        assert code == 0, out
        now = time.time()
        three_am = now - now % 86400 + 3 * 3600
        expected = three_am if three_am > now else three_am + 86400
        assert data["next_run"] == expected, out
        code, _, out = ctxmgr(sandbox, state, "status", "--json")
        assert code == 0, out
        row = {r["service"]: r for r in json.loads(out)["services"]}[name]
        assert row["scheduled"] is True and row["next_verify_time"] == expected
    finally:
        ctxmgr(sandbox, state, "unschedule", "--service", name)


@pytest.mark.systemd247
def test_schedule_refuses_what_it_cannot_verify_and_times_systemd_cannot_read(  # type: ignore[no-untyped-def]
    sandbox, install_unit, workdir
) -> None:
    install_unit("plain-sleeper.service", "[Service]\nExecStart=/bin/sleep 600\n")
    code, _, out = ctxmgr(sandbox, workdir / "state", "schedule", "--service", "plain-sleeper")
    assert code == 2 and "ctxmgr:" in out and "vllm" in out.lower(), out
    assert not list(sandbox.systemd.host_unit_dir.glob("ctxmgr-verify@plain-sleeper.*"))

    name = "vllm-sched-bad"
    install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=free_port()))
    code, _, out = ctxmgr(
        sandbox, workdir / "state", "schedule", "--service", name, "--every", "Mon..Fri 25:00"
    )
    assert code == 2, out
    assert "Failed to parse calendar specification" in out  # systemd's own words
    code, _, out = ctxmgr(sandbox, workdir / "state", "schedule", "--service", name, "--textfile", "/x/y.txt")
    assert code == 2 and "only files ending in .prom" in out, out


def test_a_name_ending_in_a_backslash_cannot_continue_the_description_into_after() -> None:
    """Issue 9 item 10: `Description=... foo\\` swallowed the next line (After=) into the description."""
    request = ScheduleRequest(service="vllm\\.service", every="15min", python=sys.executable)
    units = render_units(request, timer_schedule("15min"))
    text = units["ctxmgr-verify@vllm\\.service"]
    service = UnitFile.parse("ctxmgr-verify@vllm\\.service", text)
    values = {(a.section, a.key): a.value for a in service.assignments}
    assert values[("Unit", "After")] == "vllm\\.service"
    assert not values[("Unit", "Description")].endswith("\\")
    assert not [line for line in text.splitlines() if line.endswith("\\")]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_an_every_that_looks_like_an_option_is_not_handed_to_systemd_analyze() -> None:
    """Issue 9 item 10: `--every --help` ran `systemd-analyze calendar --help`, which exits 0."""
    with pytest.raises(UsageError, match="neither a time span nor a calendar"):
        check_calendar(Systemd.local(), "--help")
    check_calendar(Systemd.local(), "hourly")  # a real expression still passes
