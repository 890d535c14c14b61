"""Issue 17 item 11: what a verification says about itself (the timer mark, GPU memory not checked, the
textfile's HELP), a span timer's Persistent=, and the download hint."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import replace
from typing import Any

import pytest

from tests.core.test_verdict import facts, observation  # noqa: F401  (the fixture, from a real log)
from tests.ctxmgr_cli import ctxmgr_command
from tests.support.paths import REPO
from tests.support.sandbox import Sandbox
from vllm_ctxmgr.core.verdict import OK, decide, record
from vllm_ctxmgr.monitor.metrics import write_textfile
from vllm_ctxmgr.monitor.schedule import ScheduleRequest, render_units, timer_schedule
from vllm_ctxmgr.monitor.status import ServiceStatus, status_table
from vllm_ctxmgr.monitor.verify import TRIGGER_ENV, trigger_of_this_run
from vllm_ctxmgr.report import verification_text
from vllm_ctxmgr.systemd.unit_file import UnitFile

NOW = 1_790_000_000.0


def test_status_marks_only_a_verification_the_timer_ran_as_timer() -> None:
    row = ServiceStatus("vllm-glm5", "active", "running", 200_000, 0.9, last_verify_time=NOW - 125,
                        last_verify_result="ok", scheduled=True)  # fmt: skip
    manual = status_table([replace(row, last_verify_trigger="manual")], now=NOW).splitlines()[1]
    timer = status_table([replace(row, last_verify_trigger="timer")], now=NOW).splitlines()[1]
    assert "(timer)" not in manual and "2min ago" in manual
    assert "2min ago (timer)" in timer


def test_the_timers_oneshot_says_it_is_the_timer_and_a_run_records_who_ran_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    units = render_units(ScheduleRequest("vllm-glm5", "15min"), timer_schedule("15min"))
    service = UnitFile.parse("s", units["ctxmgr-verify@vllm-glm5.service"])
    environment = [a.value for a in service.assignments if a.key == "Environment"]
    assert f"{TRIGGER_ENV}=timer" in environment
    monkeypatch.delenv(TRIGGER_ENV, raising=False)
    assert trigger_of_this_run() == "manual"
    monkeypatch.setenv(TRIGGER_ENV, "timer")
    assert trigger_of_this_run() == "timer"


def test_ok_with_gpu_memory_unchecked_says_so_in_its_headline(observation: dict[str, Any]) -> None:  # noqa: F811
    seen = facts(observation, gpu_note="NVML: libnvidia-ml.so.1 not found")
    verification = decide(seen)
    assert verification.result == OK
    headline = verification_text(verification).splitlines()[0]
    assert headline.startswith("vllm-tiny: ok, GPU memory not checked ("), headline
    assert verification.to_json()["gpu_memory_checked"] is False
    assert record(verification, seen)["gpu_memory_checked"] is False


def test_the_result_gauge_help_says_what_its_label_means(observation: dict[str, Any]) -> None:  # noqa: F811
    directory = REPO / ".cache" / "it" / f"prom-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True)
    path = write_textfile(directory / "vllm-tiny.prom", decide(facts(observation)))
    (help_line,) = [
        line for line in path.read_text().splitlines() if line.startswith("# HELP ctxmgr_verify_result ")
    ]
    assert help_line == (
        "# HELP ctxmgr_verify_result 1 on the series whose result label is the last verification's result "
        "(ok, degraded or failed), 0 on the other two"
    )


def test_the_download_hint_names_hf_download() -> None:
    home = REPO / ".cache" / "it" / f"hf-{uuid.uuid4().hex[:8]}"
    home.mkdir(parents=True)
    env = {"HF_HOME": str(home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*ctxmgr_command(), "facts", "no-such-org/no-such-model"], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "hf download no-such-org/no-such-model" in done.stderr, done.stderr
    assert "huggingface-cli" not in done.stderr


def test_a_span_timer_leaves_out_persistent_and_a_calendar_timer_keeps_it(sandbox: Sandbox) -> None:
    """systemd.timer(5): Persistent= "only has an effect on timers configured with OnCalendar=". Both
    timers pass the real systemd-analyze verify and list under systemctl list-timers."""
    systemd = sandbox.systemd
    request = ScheduleRequest("vllm-persist", "15min", python=sys.executable)
    span = render_units(request, timer_schedule("15min"))
    calendar = render_units(replace(request, every="hourly"), timer_schedule("hourly"))
    span_timer = UnitFile.parse("t", span["ctxmgr-verify@vllm-persist.timer"])
    calendar_timer = UnitFile.parse("t", calendar["ctxmgr-verify@vllm-persist.timer"])
    assert "Persistent" not in {a.key for a in span_timer.assignments}
    assert {a.key: a.value for a in calendar_timer.assignments}["Persistent"] == "true"

    target = "vllm-persist-target.service"
    (systemd.host_unit_dir / target).write_text("[Service]\nType=oneshot\nExecStart=/bin/true\n")
    names = {"persist-span.timer": span, "persist-cal.timer": calendar}
    try:
        for name, units in names.items():
            text = units["ctxmgr-verify@vllm-persist.timer"].replace(
                "Unit=ctxmgr-verify@vllm-persist.service", f"Unit={target}"
            )
            assert systemd.analyze_verify_text(text.encode(), name) == [], name
            (systemd.host_unit_dir / name).write_text(text)
        systemd.daemon_reload()
        for name in names:
            systemd.systemctl("start", name)
        listed = systemd.systemctl("list-timers", "--all", "--no-legend", *names)
        assert all(name in listed for name in names), listed
    finally:
        for name in names:
            subprocess.run(systemd.command("systemctl", "stop", name), capture_output=True, check=False)
            (systemd.host_unit_dir / name).unlink(missing_ok=True)
        (systemd.host_unit_dir / target).unlink(missing_ok=True)
        systemd.daemon_reload()
