"""Scheduled verification: a oneshot `ctxmgr verify` unit and its timer, per service.

`ctxmgr schedule --service vllm-glm5 --every 15min` renders templates/ctxmgr-verify@.service.j2 and
.timer.j2 into ctxmgr-verify@vllm-glm5.service / .timer in the unit directory (each service gets
its own instance files, so each keeps its own interval, textfile and on-failure policy), reloads
systemd and enables and starts the timer. Results go to the journal under the identifier
`ctxmgr-verify` (`journalctl -t ctxmgr-verify`) and, with --textfile, to a Prometheus textfile.

`--every` takes a systemd time span ("15min", "1h 30min", "90s", "2s") or a calendar expression
("hourly", "*:0/15", "Mon..Fri 09:00"); `systemd-analyze calendar` checks the latter.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from vllm_ctxmgr.errors import SystemdError, UsageError
from vllm_ctxmgr.monitor.metrics import check_textfile_path
from vllm_ctxmgr.store import atomic_write
from vllm_ctxmgr.systemd.names import canonical_unit
from vllm_ctxmgr.systemd.render import render
from vllm_ctxmgr.systemd.service import read_service
from vllm_ctxmgr.systemd.systemctl import Systemd, parse_timestamp
from vllm_ctxmgr.systemd.timespan import parse_timespan

IDENTIFIER = "ctxmgr-verify"
UNIT_PREFIX = "ctxmgr-verify@"
SERVICE_TEMPLATE = "ctxmgr-verify@.service.j2"
TIMER_TEMPLATE = "ctxmgr-verify@.timer.j2"
ON_FAILURE = ("none", "restart", "rollback")

Printer = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Time spans, as systemd reads them (systemd.time(7)): parse_timespan lives in systemd/timespan.py


def format_timespan(seconds: float) -> str:
    """A span systemd reads back exactly: 900 -> "15min", 2 -> "2s", 0.2 -> "200ms"."""
    if seconds <= 0:
        return "0"
    micro = round(seconds * 1_000_000)
    parts = []
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("min", 60_000_000), ("s", 1_000_000),
                       ("ms", 1000), ("us", 1)):  # fmt: skip
        if micro >= size:
            parts.append(f"{micro // size}{unit}")
            micro %= size
    return " ".join(parts)


@dataclass(frozen=True)
class TimerSchedule:
    kind: str  # "span" | "calendar"
    every: str  # the span as systemd writes it, or the calendar expression
    seconds: float | None  # the span in seconds
    randomized_delay: str
    accuracy: str

    @property
    def description(self) -> str:
        return f"every {self.every}" if self.kind == "span" else f"at {self.every}"


def timer_schedule(every: str, randomized_delay: str | None = None) -> TimerSchedule:
    """--every as a timer: a span spreads runs by 10% of it (at most 5 min), and is accurate to 10%."""
    seconds = parse_timespan(every)
    delay = parse_timespan(randomized_delay) if randomized_delay is not None else None
    if randomized_delay is not None and delay is None:
        raise UsageError(f"--randomized-delay {randomized_delay!r} is not a time span (e.g. 30s, 5min)")
    if seconds is not None:
        if seconds < 1:
            raise UsageError(f"--every {every!r}: at least 1s between verifications")
        spread = min(seconds / 10, 300.0) if delay is None else delay
        return TimerSchedule(
            "span", format_timespan(seconds), seconds, format_timespan(spread),
            format_timespan(max(min(seconds / 10, 60.0), 0.001)),
        )  # fmt: skip
    if not every.strip() or any(ch in every for ch in "%\n\r\\") or not every.isprintable():
        raise UsageError(f"--every {every!r} is neither a time span nor a calendar expression")
    return TimerSchedule(
        "calendar", " ".join(every.split()), None, format_timespan(60.0 if delay is None else delay), "1s"
    )


# ---------------------------------------------------------------------------------------------
# Rendering


def instance(service: str) -> str:
    return service.removesuffix(".service")


def service_unit_name(service: str) -> str:
    return f"{UNIT_PREFIX}{instance(service)}.service"


def timer_name(service: str) -> str:
    return f"{UNIT_PREFIX}{instance(service)}.timer"


@dataclass(frozen=True)
class ScheduleRequest:
    service: str
    every: str
    on_failure: str = "none"
    textfile: str | None = None
    long_probe: bool = False
    randomized_delay: str | None = None
    python: str = field(default_factory=lambda: sys.executable)
    state_dir: str = "/var/lib/ctxmgr"


def verify_command(request: ScheduleRequest) -> list[str]:
    """The command the oneshot runs: this ctxmgr, by absolute path, on the same state directory."""
    command = [request.python, "-m", "vllm_ctxmgr", "--state-dir", request.state_dir, "verify"]
    command += ["--service", instance(request.service), "--on-failure", request.on_failure]
    if request.textfile:
        command += ["--textfile", request.textfile]
    if request.long_probe:
        command.append("--long-probe")
    return command


def render_units(request: ScheduleRequest, schedule: TimerSchedule) -> dict[str, str]:
    """{unit name: text} of the verify service and its timer."""

    name = instance(request.service)
    timeout = "2h" if request.on_failure != "none" else "30min"
    service_text = render(
        SERVICE_TEMPLATE,
        service=name,
        service_unit=f"{name}.service",
        identifier=IDENTIFIER,
        command=verify_command(request),
        timeout=timeout,
    )
    timer_text = render(
        TIMER_TEMPLATE,
        service=name,
        verify_unit=service_unit_name(name),
        description=schedule.description,
        kind=schedule.kind,
        every=schedule.every,
        randomized_delay=schedule.randomized_delay,
        accuracy=schedule.accuracy,
    )
    return {service_unit_name(name): service_text, timer_name(name): timer_text}


# ---------------------------------------------------------------------------------------------
# Installing and removing


@dataclass
class ScheduleResult:
    service: str
    action: str  # schedule | unschedule
    changed: bool
    reason: str
    units: dict[str, str] = field(default_factory=dict)  # unit name -> path (systemd's view)
    timer: str = ""
    every: str = ""
    on_failure: str = ""
    textfile: str | None = None
    next_run: float | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def check_calendar(systemd: Systemd, expression: str) -> None:
    """systemd-analyze calendar: the manager's own parser says whether the expression is valid."""
    if expression.startswith("-"):
        # `--every --help` would otherwise be systemd-analyze's own option, and exit 0
        raise UsageError(f"--every {expression!r} is neither a time span nor a calendar expression")
    argv = systemd.command("systemd-analyze", "calendar", "--", expression)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise SystemdError("systemd-analyze not found; cannot check the calendar expression") from None
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout).split()) or f"exit status {done.returncode}"
        raise UsageError(f"--every {expression!r} is neither a time span nor a calendar expression: {detail}")


TIMER_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "UnitFileState",
    "NextElapseUSecRealtime",
    "NextElapseUSecMonotonic",
)


def check_units(systemd: Systemd, units: dict[str, str]) -> None:
    """systemd-analyze verify on each rendered unit before it is installed (the ExecStart path too)."""
    with tempfile.TemporaryDirectory(prefix="ctxmgr-schedule-") as directory:
        for name, text in units.items():
            candidate = Path(directory) / name
            candidate.write_text(text)
            problems = systemd.analyze_verify(candidate, name)
            if problems:
                raise SystemdError(f"the rendered {name} does not pass systemd-analyze verify: {problems[0]}")


def timer_state(systemd: Systemd, timer: str) -> dict[str, str]:
    """`systemctl show` of a timer, with timestamps in a form parse_timestamp reads."""
    return systemd.show_times(timer, *TIMER_PROPERTIES)


def next_run(state: dict[str, str]) -> float | None:
    """When the timer fires next (Unix time): a calendar timer's realtime elapse, or a span timer's
    monotonic one (printed as a span since boot) moved onto the wall clock."""
    realtime = parse_timestamp(state.get("NextElapseUSecRealtime", ""))
    if realtime is not None:
        return realtime
    monotonic = parse_timespan(state.get("NextElapseUSecMonotonic", ""))
    if not monotonic:
        return None
    return time.time() + monotonic - time.clock_gettime(time.CLOCK_MONOTONIC)


def schedule_service(systemd: Systemd, request: ScheduleRequest, on_step: Printer = _quiet) -> ScheduleResult:
    """Render, install, reload, enable and start; nothing is touched when all is already in place."""

    if request.on_failure not in ON_FAILURE:
        raise UsageError(f"--on-failure must be one of {', '.join(ON_FAILURE)}")
    read_service(systemd, request.service)  # a vLLM unit, or a one-line error now rather than at 3am
    if not Path(request.state_dir).is_absolute():
        raise UsageError(f"the state directory must be an absolute path, not {request.state_dir!r}")
    if request.textfile:
        if not Path(request.textfile).is_absolute():
            raise UsageError(f"--textfile must be an absolute path, not {request.textfile!r}")
        check_textfile_path(request.textfile)
    if not systemd.host_path(request.python).exists():
        raise UsageError(f"{request.python} (this ctxmgr's Python) is not visible to that systemd")
    schedule = timer_schedule(request.every, request.randomized_delay)
    if schedule.kind == "calendar":
        check_calendar(systemd, schedule.every)
    units = render_units(request, schedule)
    directory = systemd.host_unit_dir
    timer = timer_name(request.service)
    result = ScheduleResult(
        instance(request.service),
        "schedule",
        False,
        "",
        units={name: str(PurePosixPath(systemd.unit_dir) / name) for name in units},
        timer=timer,
        every=schedule.every,
        on_failure=request.on_failure,
        textfile=request.textfile,
    )
    changed = [name for name, text in units.items() if _read(directory / name) != text]
    if changed:
        check_units(systemd, units)
    state = timer_state(systemd, timer)
    running = state.get("ActiveState") == "active" and state.get("UnitFileState", "").startswith("enabled")
    if not changed and running:
        result.reason = f"{timer} already runs {schedule.description} with these settings: nothing changed"
        result.next_run = next_run(state)
        return result
    directory.mkdir(parents=True, exist_ok=True)
    for name in changed:
        on_step(f"writing {PurePosixPath(systemd.unit_dir) / name}")
        atomic_write(directory / name, units[name].encode(), mode=0o644)
    systemd.daemon_reload()
    on_step(f"enabling and starting {timer}")
    systemd.enable(timer, now=True)
    if changed and state.get("ActiveState") == "active":
        systemd.systemctl("restart", timer)  # the new interval counts from now
    result.changed = True
    result.reason = f"{timer} runs `ctxmgr verify` {schedule.description}"
    result.next_run = next_run(timer_state(systemd, timer))
    return result


def unschedule_service(systemd: Systemd, service: str, on_step: Printer = _quiet) -> ScheduleResult:
    """Stop and disable the timer, stop a verification in flight, remove both units."""
    timer, verify_unit = timer_name(service), service_unit_name(service)
    directory = systemd.host_unit_dir
    paths = [directory / verify_unit, directory / timer]
    result = ScheduleResult(instance(service), "unschedule", False, "", timer=timer)
    state = timer_state(systemd, timer)
    if not any(p.exists() for p in paths) and state.get("LoadState") in ("not-found", "", None):
        canonical_unit(systemd, service)  # a service systemd does not know is a usage error (exit 2)
        result.reason = f"{service} has no scheduled verification here: nothing changed"
        return result
    if state.get("LoadState") == "loaded":
        on_step(f"stopping and disabling {timer}")
        with contextlib.suppress(SystemdError):
            systemd.disable(timer, now=True)
        with contextlib.suppress(SystemdError):
            systemd.stop(verify_unit)
        with contextlib.suppress(SystemdError):
            systemd.reset_failed(verify_unit)
    for path in paths:
        if path.exists():
            on_step(f"removing {PurePosixPath(systemd.unit_dir) / path.name}")
            path.unlink()
            result.units[path.name] = str(PurePosixPath(systemd.unit_dir) / path.name)
    systemd.daemon_reload()
    result.changed = True
    result.reason = f"{timer} and {verify_unit} are stopped and removed"
    return result


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
