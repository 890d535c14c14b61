"""What ctxmgr asks of systemd, with the release that brought each: the inventory behind the floor.

Every option ctxmgr passes to systemctl, journalctl and systemd-analyze, every property it reads with
`systemctl show` and every directive its templates write is listed here with the systemd release that
introduced it and where that is written down (NEWS of that release, or the man page / --help of the
floor's own build where NEWS never named it). tests/systemd/test_features.py scans the source and the
templates: a new call fails the test until it is listed here, so every call states its floor.

FLOOR is the oldest systemd ctxmgr supports (Debian 11's 247; Ubuntu 22.04 ships 249). A use newer than
the floor must name its fallback: what ctxmgr does on an older manager to get the same answer
(`Systemd.version` says which manager it talks to).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FLOOR = 247

# where a use is written down when NEWS never named it: checked in the floor's own build
FLOOR_BUILD = "247.3-7+deb11u5 (Debian 11)"


@dataclass(frozen=True)
class Use:
    """One thing ctxmgr asks of systemd.

    `kind` says what `name` is: an option of a tool ("systemctl", "journalctl", "systemd-analyze"),
    a property read with `systemctl show` ("property"), a journal field ("journal-field") or a unit-file
    directive ("directive", written as `Section.Key`). `since` is the release that introduced it, None
    where NEWS never named it and it predates every release ctxmgr supports (`source` then says where
    it was checked instead). `fallback` is how ctxmgr gets the same answer below `since`."""

    kind: str
    name: str
    since: int | None
    source: str
    fallback: str = ""

    @property
    def above_floor(self) -> bool:
        return self.since is not None and self.since > FLOOR


def _old(kind: str, name: str, where: str) -> Use:
    """A use older than any release ctxmgr supports that NEWS never named: checked in 247's own build."""
    return Use(kind, name, None, f"not in NEWS; {where} of systemd {FLOOR_BUILD}")


SYSTEMCTL = "systemctl"
JOURNALCTL = "journalctl"
ANALYZE = "systemd-analyze"
PROPERTY = "property"
JOURNAL_FIELD = "journal-field"
DIRECTIVE = "directive"

TIMESTAMP_UNIX = "--timestamp=unix"
TIMESTAMP_US_UTC = "--timestamp=us+utc"
RECURSIVE_ERRORS_NO = "--recursive-errors=no"

USES: tuple[Use, ...] = (
    # -- systemctl ---------------------------------------------------------------------------------------
    _old(SYSTEMCTL, "--no-pager", "systemctl --help"),
    _old(SYSTEMCTL, "--user", "systemctl --help"),
    _old(SYSTEMCTL, "--quiet", "systemctl --help"),
    _old(SYSTEMCTL, "--all", "systemctl --help"),
    _old(SYSTEMCTL, "--full", "systemctl --help"),
    _old(SYSTEMCTL, "--no-legend", "systemctl --help"),
    _old(SYSTEMCTL, "--runtime", "systemctl --help"),
    _old(SYSTEMCTL, "--version", "systemctl --help"),
    _old(SYSTEMCTL, "-p", "systemctl --help (-p/--property=, a comma-separated list)"),
    Use(SYSTEMCTL, "--plain", 203, "NEWS 203: list-dependencies gained --plain (list-units takes it too)"),
    _old(SYSTEMCTL, "--no-block", "systemctl --help"),
    Use(SYSTEMCTL, "--now", 220, 'NEWS 220: enable/disable/mask "now support a new --now switch"'),
    Use(SYSTEMCTL, "--value", 230, 'NEWS 230: "systemctl show gained a new --value switch"'),
    Use(SYSTEMCTL, "--timestamp=us+utc", 247, 'NEWS 247: "systemctl gained a new parameter --timestamp="'),
    Use(
        SYSTEMCTL,
        TIMESTAMP_UNIX,
        251,
        'NEWS 251: "systemctl\'s --timestamp= option gained a new choice unix"',
        fallback=f"{TIMESTAMP_US_UTC} (247) under TZ=UTC, the date parsed as UTC (`show` of 247 and 252 "
        "prints the date whatever --timestamp says: Systemd.show_times reads both)",
    ),
    Use(SYSTEMCTL, "cat", 209, 'NEWS 209: "A new command cat has been added to systemctl"'),
    # -- journalctl --------------------------------------------------------------------------------------
    _old(JOURNALCTL, "--no-pager", "journalctl --help"),
    _old(JOURNALCTL, "--all", "journalctl --help"),
    _old(JOURNALCTL, "--follow", "journalctl --help"),
    _old(JOURNALCTL, "-n", "journalctl --help"),
    _old(JOURNALCTL, "--unit", "journalctl --help"),
    _old(JOURNALCTL, "-o", "journalctl --help (-o json; NEWS 193 already names it as existing)"),
    Use(JOURNALCTL, "--user-unit", 198, 'NEWS 198: "journalctl gained a new --user-unit= option"'),
    Use(JOURNALCTL, "--after-cursor", 206, 'NEWS 206: "the new journalctl --after-cursor= switch"'),
    # -- systemd-analyze ---------------------------------------------------------------------------------
    _old(ANALYZE, "--user", "systemd-analyze --help"),
    Use(ANALYZE, "verify", 216, 'NEWS 216: "systemd-analyze gained a new command verify"'),
    _old(ANALYZE, "--man=no", "systemd-analyze --help (verify's --man=BOOL)"),
    Use(
        ANALYZE,
        RECURSIVE_ERRORS_NO,
        250,
        'NEWS 250: "systemd-analyze verify gained a new switch --recursive-errors="',
        fallback="verify without it; ctxmgr keeps the lines about the unit and drops other units' errors",
    ),
    Use(ANALYZE, "calendar", 236, 'NEWS 236: "systemd-analyze gained a new verb calendar"'),
    # -- properties read with systemctl show -------------------------------------------------------------
    _old(PROPERTY, "Id", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "LoadState", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ActiveState", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "SubState", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "UnitFileState", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "FragmentPath", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "DropInPaths", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ControlGroup", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "MainPID", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ExecMainPID", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ExecMainCode", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ExecMainStatus", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ExecStart", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ExecStartPre", "org.freedesktop.systemd1(5)"),  # node.py: which pre-command failed
    _old(PROPERTY, "ExecStop", "org.freedesktop.systemd1(5)"),  # a container's stop path (systemd/service.py)
    _old(PROPERTY, "KillMode", "org.freedesktop.systemd1(5)"),  # what may survive a stop
    _old(PROPERTY, "TimeoutStopUSec", "org.freedesktop.systemd1(5)"),  # vLLM's drain vs systemd's SIGKILL
    _old(PROPERTY, "Environment", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "ActiveEnterTimestampMonotonic", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "InactiveEnterTimestampMonotonic", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "InactiveExitTimestampMonotonic", "org.freedesktop.systemd1(5)"),
    _old(PROPERTY, "NextElapseUSecRealtime", "org.freedesktop.systemd1(5) (timers, NEWS 197)"),
    _old(PROPERTY, "NextElapseUSecMonotonic", "org.freedesktop.systemd1(5) (timers, NEWS 197)"),
    _old(PROPERTY, "Version", "org.freedesktop.systemd1(5) (the manager's own)"),
    Use(PROPERTY, "Result", 40, 'NEWS 40: the "Result" D-Bus property'),
    Use(PROPERTY, "InvocationID", 232, "NEWS 232: every unit activation gets an invocation ID"),
    Use(PROPERTY, "NRestarts", 235, 'NEWS 235: queried using "systemctl show -p NRestarts"'),
    # -- journal fields matched or read ------------------------------------------------------------------
    Use(JOURNAL_FIELD, "_SYSTEMD_INVOCATION_ID", 232, "NEWS 232: each entry carries the invocation ID"),
    _old(JOURNAL_FIELD, "__REALTIME_TIMESTAMP", "systemd.journal-fields(7)"),
    _old(JOURNAL_FIELD, "__MONOTONIC_TIMESTAMP", "systemd.journal-fields(7)"),
    _old(JOURNAL_FIELD, "__CURSOR", "systemd.journal-fields(7)"),
    # -- directives the templates write (templates/*.j2; unit.j2 edits ExecStart= and Environment=) -------
    _old(DIRECTIVE, "Unit.Description", "systemd.unit(5)"),
    _old(DIRECTIVE, "Unit.After", "systemd.unit(5)"),
    _old(DIRECTIVE, "Service.Type", "systemd.service(5) (Type=oneshot)"),
    _old(DIRECTIVE, "Service.Environment", "systemd.exec(5)"),
    _old(DIRECTIVE, "Service.ExecStart", "systemd.service(5)"),
    _old(DIRECTIVE, "Service.SyslogIdentifier", "systemd.exec(5)"),
    _old(DIRECTIVE, "Install.WantedBy", "systemd.unit(5)"),
    Use(DIRECTIVE, "Service.SuccessExitStatus", 189, "NEWS 189: SuccessExitStatus= (with RestartPrevent...)"),
    Use(DIRECTIVE, "Service.TimeoutStartSec", 188, "NEWS 188: TimeoutStartSec= and TimeoutStopSec="),
    Use(DIRECTIVE, "Timer.Unit", 197, "NEWS 197: timer units (Unit= since timers came, systemd.timer(5))"),
    Use(DIRECTIVE, "Timer.OnActiveSec", 197, "NEWS 197: timer units (systemd.timer(5))"),
    Use(DIRECTIVE, "Timer.OnUnitActiveSec", 197, "NEWS 197: timer units (systemd.timer(5))"),
    Use(DIRECTIVE, "Timer.OnCalendar", 197, 'NEWS 197: "Timer units now support calendar time events"'),
    Use(DIRECTIVE, "Timer.AccuracySec", 209, "NEWS 209: AccuracySec= of timers"),
    Use(DIRECTIVE, "Timer.Persistent", 212, 'NEWS 212: "Timer units gained a new Persistent= switch"'),
    Use(DIRECTIVE, "Timer.RandomizedDelaySec", 229, 'NEWS 229: "a new setting RandomizedDelaySec="'),
)

BY_KEY: dict[tuple[str, str], Use] = {(use.kind, use.name): use for use in USES}


def use(kind: str, name: str) -> Use:
    """The inventory's entry; a KeyError names what is missing (the test lists them all)."""
    return BY_KEY[(kind, name)]


def option_known(tool: str, option: str) -> bool:
    """Whether the inventory lists `option` for `tool`; `--opt=value` matches `--opt=value` or `--opt`."""
    return (tool, option) in BY_KEY or (tool, option.split("=", 1)[0]) in BY_KEY


# a release number, then at most a distribution's suffix ("247.3-7+deb11u4", "v256~rc3") and, in
# `systemctl --version`'s first line, the build in parentheses: nothing else, and never a long run
_VERSION = re.compile(r"v?(\d{1,6})(?:[.~+\-][0-9A-Za-z.~+\-]*)?(?: \([0-9A-Za-z.~+\-]*\))?")
MAX_VERSION_TEXT = 128


def parse_version(text: str) -> int | None:
    """The release number in systemd's Version property or `systemctl --version`'s first line:
    "247.3-7+deb11u4" -> 247, "systemd 252 (252.38-1~deb12u1)" -> 252, "v256~rc3" -> 256.
    Strict: "251junk" or 5,000 digits are no release (None), never a number that
    enables features the manager lacks."""
    text = text.strip().removeprefix("systemd").strip()
    match = _VERSION.fullmatch(text) if len(text) <= MAX_VERSION_TEXT else None
    return int(match[1]) if match else None
