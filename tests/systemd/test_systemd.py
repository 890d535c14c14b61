"""vllm_ctxmgr.systemd: parsing on real journalctl/systemctl text, and every call against a real systemd
(the private sandbox from tests/systemd_fixtures.py)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.support.sandbox import Sandbox
from tests.systemd_fixtures import InstallUnit
from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd import enter
from vllm_ctxmgr.systemd.journal import JournalEntry, field_text, parse_journal_json
from vllm_ctxmgr.systemd.quoting import split_words
from vllm_ctxmgr.systemd.systemctl import (
    CLD_EXITED,
    Systemd,
    _verify_problems,
    new_problems,
    parse_environment,
)

# ---------------------------------------------------------------------------------------------------------
# Real `journalctl -o json` lines, captured from the sandbox (systemd 252): a unit printed
#   printf "caf\xe9 latin-1\n"; printf "bell\a and \x1b[1mbold\x1b[0m\n"; printf "%05000d\n" 7; exit 3
# and `printf 'MESSAGE=repeated fields\nFOO=one\nFOO=two\n' | logger --journald` wrote the last one.

LATIN1_LINE = r"""{"SYSLOG_FACILITY":"3","_UID":"0","_STREAM_ID":"1c611df60a6e4347974d0ca692dc1e77","_SYSTEMD_SLICE":"system.slice","SYSLOG_IDENTIFIER":"bash","PRIORITY":"6","__MONOTONIC_TIMESTAMP":"658971193","_EXE":"/usr/bin/bash","__CURSOR":"s=6f521c152fd744fda7b37bac47f8c1a8;i=16c;b=1357f65ac501480e8de601d3a93e7d87;m=27471a39;t=66174644c9841;x=c504d3b67fcb6e3","_TRANSPORT":"stdout","MESSAGE":[99,97,102,233,32,108,97,116,105,110,45,49],"_PID":"192","_CAP_EFFECTIVE":"1fffeffffff","_COMM":"bash","_MACHINE_ID":"3d1219c7c4c5404aaa1f6d2a48adfda4","_RUNTIME_SCOPE":"system","_SYSTEMD_CGROUP":"/system.slice/weird.service","_BOOT_ID":"1357f65ac501480e8de601d3a93e7d87","_GID":"0","_SYSTEMD_INVOCATION_ID":"207464ffb0224df79ef4eb2828d91a9c","_SYSTEMD_UNIT":"weird.service","_HOSTNAME":"vm","__REALTIME_TIMESTAMP":"1796002387105857"}"""  # noqa: E501

CONTROL_CHARS_LINE = r"""{"_UID":"0","_GID":"0","_RUNTIME_SCOPE":"system","_EXE":"/usr/bin/bash","_TRANSPORT":"stdout","_SYSTEMD_SLICE":"system.slice","_MACHINE_ID":"3d1219c7c4c5404aaa1f6d2a48adfda4","_SYSTEMD_INVOCATION_ID":"207464ffb0224df79ef4eb2828d91a9c","_SYSTEMD_CGROUP":"/system.slice/weird.service","MESSAGE":[98,101,108,108,7,32,97,110,100,32,27,91,49,109,98,111,108,100,27,91,48,109],"_HOSTNAME":"vm","_SYSTEMD_UNIT":"weird.service","SYSLOG_FACILITY":"3","__MONOTONIC_TIMESTAMP":"658971421","_STREAM_ID":"1c611df60a6e4347974d0ca692dc1e77","PRIORITY":"6","_CAP_EFFECTIVE":"1fffeffffff","__REALTIME_TIMESTAMP":"1796002387106085","_COMM":"bash","__CURSOR":"s=6f521c152fd744fda7b37bac47f8c1a8;i=16d;b=1357f65ac501480e8de601d3a93e7d87;m=27471b1d;t=66174644c9925;x=9981519be9671e98","_PID":"192","SYSLOG_IDENTIFIER":"bash","_BOOT_ID":"1357f65ac501480e8de601d3a93e7d87"}"""  # noqa: E501

MANAGER_LINE = r"""{"_SOURCE_REALTIME_TIMESTAMP":"1796002387106628","_TRANSPORT":"journal","_CAP_EFFECTIVE":"1fffeffffff","_UID":"0","_SYSTEMD_UNIT":"init.scope","_MACHINE_ID":"3d1219c7c4c5404aaa1f6d2a48adfda4","_PID":"1","COMMAND":"ExecStart","EXIT_STATUS":"3","_RUNTIME_SCOPE":"system","SYSLOG_IDENTIFIER":"systemd","MESSAGE_ID":"98e322203f7a4ed290d09fe03c09fe15","_HOSTNAME":"vm","_BOOT_ID":"1357f65ac501480e8de601d3a93e7d87","MESSAGE":"weird.service: Main process exited, code=exited, status=3/NOTIMPLEMENTED","__MONOTONIC_TIMESTAMP":"658971969","__CURSOR":"s=6f521c152fd744fda7b37bac47f8c1a8;i=170;b=1357f65ac501480e8de601d3a93e7d87;m=27471d41;t=66174644c9b49;x=a6efb30beb04b30a","UNIT":"weird.service","__REALTIME_TIMESTAMP":"1796002387106633","_SYSTEMD_SLICE":"-.slice","_SYSTEMD_CGROUP":"/init.scope","CODE_FILE":"src/core/unit.c","CODE_FUNC":"unit_log_process_exit","INVOCATION_ID":"207464ffb0224df79ef4eb2828d91a9c","_CMDLINE":"/lib/systemd/systemd --system --unit=sandbox.target fstab=no systemd.getty_auto=no","TID":"1","PRIORITY":"5","SYSLOG_FACILITY":"3","_COMM":"systemd","_GID":"0","CODE_LINE":"5671","EXIT_CODE":"exited","_EXE":"/usr/lib/systemd/systemd"}"""  # noqa: E501

# the 5000-character line, as journalctl prints it without --all
TOO_LONG_WITHOUT_ALL_LINE = r"""{"_EXE":"/usr/bin/bash","_STREAM_ID":"1c611df60a6e4347974d0ca692dc1e77","PRIORITY":"6","__CURSOR":"s=6f521c152fd744fda7b37bac47f8c1a8;i=16e;b=1357f65ac501480e8de601d3a93e7d87;m=27471b56;t=66174644c995f;x=d85c24ae057e3cb","_CAP_EFFECTIVE":"1fffeffffff","_HOSTNAME":"vm","_SYSTEMD_CGROUP":"/system.slice/weird.service","_SYSTEMD_UNIT":"weird.service","__REALTIME_TIMESTAMP":"1796002387106143","_SYSTEMD_INVOCATION_ID":"207464ffb0224df79ef4eb2828d91a9c","_UID":"0","_COMM":"bash","_MACHINE_ID":"3d1219c7c4c5404aaa1f6d2a48adfda4","__MONOTONIC_TIMESTAMP":"658971478","_BOOT_ID":"1357f65ac501480e8de601d3a93e7d87","_TRANSPORT":"stdout","SYSLOG_IDENTIFIER":"bash","_GID":"0","SYSLOG_FACILITY":"3","_SYSTEMD_SLICE":"system.slice","_PID":"192","_RUNTIME_SCOPE":"system","MESSAGE":null}"""  # noqa: E501

REPEATED_FIELD_LINE = r"""{"_GID":"0","_MACHINE_ID":"3d1219c7c4c5404aaa1f6d2a48adfda4","__MONOTONIC_TIMESTAMP":"658995873","_PID":"195","_SOURCE_REALTIME_TIMESTAMP":"1796002387130331","_TRANSPORT":"journal","_RUNTIME_SCOPE":"system","_SYSTEMD_CGROUP":"/..","_CAP_EFFECTIVE":"1fffeffffff","_COMM":"logger","__CURSOR":"s=6f521c152fd744fda7b37bac47f8c1a8;i=173;b=1357f65ac501480e8de601d3a93e7d87;m=27477aa1;t=66174644cf8a9;x=da3622359bc674e8","_BOOT_ID":"1357f65ac501480e8de601d3a93e7d87","MESSAGE":"repeated fields","_SYSTEMD_SLICE":"-.slice","FOO":["one","two"],"_UID":"0","__REALTIME_TIMESTAMP":"1796002387130537","_HOSTNAME":"vm","SYSLOG_IDENTIFIER":"logger"}"""  # noqa: E501

# `systemctl show -p Environment` for
#   Environment="A=two words" "B=it's \"quoted\"" C=100%% D=tab\there E=ünï
#   Environment=F=a\\b
SHOWN_ENVIRONMENT = r'''"A=two words" "B=it's \"quoted\"" C=100% "D=tab\there" E=ünï "F=a\\b"'''

# systemd-analyze verify on /run/ctxmgr-verify-x/samename.service, whose installed twin has a drop-in
# and which wants a broken unit
VERIFY_OUTPUT = """\
/run/systemd/system/brokendep.service:3: Unknown key 'FooBar' in section [Service], ignoring.
/run/ctxmgr-verify-x/samename.service:3: Unknown key 'Bogus' in section [Service], ignoring.
/run/systemd/system/samename.service.d/x.conf:2: Unknown key 'DropinBogus' in section [Service], ignoring.
"""


def test_journal_entry_decodes_byte_arrays_with_replacement() -> None:
    entry = JournalEntry.from_json(LATIN1_LINE)
    assert entry.message == "caf\ufffd latin-1"
    assert entry.unit == "weird.service"
    assert entry.pid == 192
    assert entry.realtime_us == 1796002387105857
    assert entry.monotonic_us == 658971193
    assert entry.invocation_id == "207464ffb0224df79ef4eb2828d91a9c"
    assert entry.cursor.startswith("s=6f521c152fd744fda7b37bac47f8c1a8;i=16c;")
    assert entry.identifier == "bash"
    assert not entry.from_manager


def test_journal_entry_keeps_control_characters() -> None:
    assert JournalEntry.from_json(CONTROL_CHARS_LINE).message == "bell\a and \x1b[1mbold\x1b[0m"


def test_journal_entry_of_the_manager_is_about_the_unit() -> None:
    entry = JournalEntry.from_json(MANAGER_LINE)
    assert entry.from_manager
    assert entry.unit == "weird.service"  # UNIT=, not the _SYSTEMD_UNIT=init.scope that logged it
    assert entry.pid == 1
    assert entry.invocation_id == "207464ffb0224df79ef4eb2828d91a9c"
    assert entry.message.endswith("status=3/NOTIMPLEMENTED")
    assert field_text(entry.fields["EXIT_STATUS"]) == "3"


def test_journal_entry_without_all_has_no_message() -> None:
    assert JournalEntry.from_json(TOO_LONG_WITHOUT_ALL_LINE).message == ""


def test_repeated_field_is_joined() -> None:
    entry = JournalEntry.from_json(REPEATED_FIELD_LINE)
    assert field_text(entry.fields["FOO"]) == "one\ntwo"
    assert entry.unit is None


def test_parse_journal_json_reads_each_line_in_order() -> None:
    text = "\n".join([LATIN1_LINE, "", CONTROL_CHARS_LINE, MANAGER_LINE]) + "\n"
    entries = parse_journal_json(text.encode())
    assert [e.cursor.split(";")[1] for e in entries] == ["i=16c", "i=16d", "i=170"]


def test_parse_environment_of_systemctl_show() -> None:
    assert parse_environment(SHOWN_ENVIRONMENT) == {
        "A": "two words",
        "B": 'it\'s "quoted"',
        "C": "100%",
        "D": "tab\there",
        "E": "ünï",
        "F": "a\\b",
    }


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("a b  c", ["a", "b", "c"]),
        (r'"x\x20y" z', ["x y", "z"]),
        (r"caf\303\251", ["café"]),
        # extract_first_word() unescapes inside single quotes too (unlike a shell)
        (r"'single \n unescaped' \u00e9", ["single \n unescaped", "é"]),
        ('"" after', ["", "after"]),
    ],
)
def test_systemctl_show_lists_split_like_unit_files(text: str, words: list[str]) -> None:
    assert [word.value for word in split_words(text)] == words


def test_verify_problems_keep_only_the_candidate() -> None:
    problems = _verify_problems(VERIFY_OUTPUT, "samename.service", "/run/ctxmgr-verify-x/samename.service", 1)
    assert problems == [
        "samename.service:3: Unknown key 'Bogus' in section [Service], ignoring.",
        "/run/systemd/system/samename.service.d/x.conf:2: Unknown key 'DropinBogus' in section [Service], "
        "ignoring.",
    ]


def test_new_problems_ignore_line_numbers() -> None:
    current = ["vllm.service:7: Unknown key 'Foo' in section [Service], ignoring."]
    candidate = [
        "vllm.service:8: Unknown key 'Foo' in section [Service], ignoring.",
        "vllm.service: Command /srv/vllm/bin/vllm is not executable: No such file or directory",
    ]
    assert new_problems(candidate, current) == [candidate[1]]


def test_systemd_for_pid_reaches_through_the_launcher_and_proc_root() -> None:
    systemd = Systemd.for_pid(4242, unit_dir=Path("/run/systemd/system"))
    launcher = str(Path(enter.__file__))
    assert systemd.command("systemctl", "show", "x") == [
        *(sys.executable, "-I", "-S", launcher, "4242"),
        *("systemctl", "show", "x"),
    ]
    assert systemd.host_path("/run/systemd/system/x.service") == Path(
        "/proc/4242/root/run/systemd/system/x.service"
    )
    assert systemd.host_unit_dir == Path("/proc/4242/root/run/systemd/system")
    assert systemd.runtime
    assert not Systemd.local().runtime
    assert Systemd.local().host_path("/etc/systemd/system/a.service") == Path("/etc/systemd/system/a.service")
    with pytest.raises(SystemdError, match="not an absolute path"):
        systemd.host_path("relative/x")


def test_user_manager_commands() -> None:
    systemd = Systemd.local(user=True)
    assert systemd.command("systemctl", "start", "x") == ["systemctl", "--user", "start", "x"]
    assert systemd.command("journalctl", "-n", "1") == ["journalctl", "-n", "1"]
    assert systemd.unit_dir == Path.home() / ".config/systemd/user"


def test_from_env() -> None:
    systemd = Systemd.from_env({"CTXMGR_SYSTEMD_PID": "77", "CTXMGR_UNIT_DIR": "/run/systemd/system"})
    assert systemd.wrapper[-1] == "77" and systemd.wrapper[-2].endswith("enter.py")
    assert systemd.unit_dir == Path("/run/systemd/system")
    assert Systemd.from_env({}) == Systemd.local()
    with pytest.raises(SystemdError, match="CTXMGR_SYSTEMD_PID"):
        Systemd.from_env({"CTXMGR_SYSTEMD_PID": "abc"})


def test_missing_tool_is_a_one_line_error() -> None:
    systemd = Systemd(wrapper=("/nonexistent/wrapper",))
    with pytest.raises(SystemdError, match="not found") as caught:
        systemd.show("x.service")
    assert "\n" not in caught.value.message


# ---------------------------------------------------------------------------------------------------------
# Against the sandbox's systemd

TICKER_UNIT = """\
[Unit]
Description=prints a timestamped line for each line written to its FIFO

[Service]
ExecStart=/bin/bash -c 'while read -r line; do echo "tick $line $(date +%%s%%N)"; done < /run/ticker.fifo'
"""


def test_follow_returns_lines_as_they_arrive(
    sandbox_systemd: Systemd, install_unit: InstallUnit, record_property: pytest.RecordProperty
) -> None:
    systemd = sandbox_systemd
    fifo = systemd.host_path("/run/ticker.fifo")
    if not fifo.exists():
        os.mkfifo(fifo)
    install_unit("ticker.service", TICKER_UNIT)
    cursor = systemd.journal_cursor()
    with systemd.follow("ticker.service", cursor) as follower:
        systemd.start("ticker.service")
        writer = os.open(fifo, os.O_WRONLY)
        try:
            # poll() returns as soon as a line arrives; its bound only guards a hang (CI's loaded cores
            # once kept systemd's Started line from journald for over 5 s)
            started = follower.poll(30.0)
            assert [e.message for e in started] == [
                "Started ticker.service - prints a timestamped line for each line written to its FIFO."
            ]
            assert started[0].from_manager
            delays_ms = []
            for number in range(3):
                written = time.time_ns()
                os.write(writer, f"{number}\n".encode())
                entries = follower.poll(30.0)
                returned = time.time_ns()
                assert len(entries) == 1
                tick, line, echoed_ns = entries[0].message.split()
                assert (tick, line) == ("tick", str(number))
                assert entries[0].unit == "ticker.service"
                assert written <= int(echoed_ns) <= returned
                delays_ms.append((returned - int(echoed_ns)) / 1e6)
        finally:
            os.close(writer)
    assert not follower.running
    record_property("journal_delay_ms", delays_ms)
    print(f"echo -> poll() delays (ms): {', '.join(f'{d:.0f}' for d in delays_ms)}")


def test_follow_without_cursor_sees_only_new_entries(
    sandbox_systemd: Systemd, install_unit: InstallUnit
) -> None:
    systemd = sandbox_systemd
    install_unit("once.service", "[Service]\nType=oneshot\nExecStart=/bin/echo run-%n\n")
    systemd.start("once.service")
    with systemd.follow("once.service") as follower:
        assert follower.poll(0.3) == []
        systemd.start("once.service")
        messages: list[str] = []
        while "Finished once.service." not in messages:
            entries = follower.poll(5.0)
            assert entries, f"no new entry after {messages}"
            messages += [e.message for e in entries]
    assert messages.count("run-once.service") == 1


def test_closing_a_follower_ends_journalctl_inside(sandbox: Sandbox) -> None:
    follower = sandbox.systemd.follow("no-such-unit-for-close.service")
    follower.close()
    left = sandbox.run("pgrep", "-f", "no-such-unit-for-close", check=False)
    assert left.stdout.strip() == ""


def test_show_state_and_process_tree_of_a_running_unit(
    sandbox_systemd: Systemd, install_unit: InstallUnit
) -> None:
    systemd = sandbox_systemd
    unit_text = "[Service]\nExecStart=/bin/bash -c 'sleep 600 & wait'\n"
    install_unit("sleeper.service", unit_text)
    systemd.start("sleeper.service")
    state = systemd.state("sleeper.service")
    assert (state.load_state, state.active_state, state.sub_state) == ("loaded", "active", "running")
    assert state.fragment_path == "/run/systemd/system/sleeper.service"
    assert systemd.host_path(state.fragment_path).read_text() == unit_text
    assert state.control_group == "/system.slice/sleeper.service"
    assert state.n_restarts == 0 and state.invocation_id and state.active_enter_monotonic_us > 0

    processes = systemd.process_tree("sleeper.service")
    assert sorted(p.argv[0] for p in processes) == ["/bin/bash", "sleep"]
    main = next(p for p in processes if p.is_main)
    assert main.ns_pid == state.main_pid and main.argv[0] == "/bin/bash"
    child = next(p for p in processes if not p.is_main)
    assert child.ppid == main.pid and child.argv == ("sleep", "600")
    assert systemd.unit_processes("sleeper.service") == sorted(p.pid for p in processes)

    assert systemd.show("sleeper.service", "MainPID", "SubState") == {
        "MainPID": str(state.main_pid),
        "SubState": "running",
    }
    assert systemd.is_active("sleeper.service")
    assert systemd.cat("sleeper.service") == f"# /run/systemd/system/sleeper.service\n{unit_text}"
    listed = systemd.list_units("sleeper*")
    assert [(u.unit, u.active_state, u.sub_state) for u in listed] == [
        ("sleeper.service", "active", "running")
    ]

    systemd.restart("sleeper.service")  # no_block: returns once queued
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        restarted = systemd.state("sleeper.service")
        if restarted.invocation_id != state.invocation_id and restarted.active_state == "active":
            break
        time.sleep(0.05)
    assert restarted.invocation_id != state.invocation_id
    assert restarted.main_pid != state.main_pid
    assert restarted.n_restarts == 0  # only automatic restarts count


def test_missing_unit(sandbox_systemd: Systemd) -> None:
    assert sandbox_systemd.show("no-such.service", "LoadState")["LoadState"] == "not-found"
    assert not sandbox_systemd.is_active("no-such.service")
    assert sandbox_systemd.unit_processes("no-such.service") == []
    with pytest.raises(SystemdError, match=r"systemctl start no-such\.service failed") as caught:
        sandbox_systemd.start("no-such.service")
    assert caught.value.message == (
        "systemctl start no-such.service failed: "
        "Failed to start no-such.service: Unit no-such.service not found."
    )


CRASHING_UNIT = """\
[Unit]
StartLimitIntervalSec=30
StartLimitBurst=3

[Service]
ExecStart=/bin/bash -c 'echo boom; exit 1'
Restart=on-failure
RestartSec=200ms
"""


def test_crash_loop_under_restart_on_failure(sandbox_systemd: Systemd, install_unit: InstallUnit) -> None:
    systemd = sandbox_systemd
    install_unit("crasher.service", CRASHING_UNIT)
    cursor = systemd.journal_cursor()
    seen_restarts: list[int] = []
    messages: list[str] = []
    with systemd.follow("crasher.service", cursor) as follower:
        systemd.start("crasher.service", no_block=True)
        deadline = time.monotonic() + 20
        while "Failed to start crasher.service." not in messages and time.monotonic() < deadline:
            messages += [e.message for e in follower.poll(0.1)]
            seen_restarts.append(systemd.state("crasher.service").n_restarts)
    counters = [int(m.rsplit(" ", 1)[1].rstrip(".")) for m in messages if "restart counter is at" in m]
    assert counters == [1, 2, 3]
    assert messages.count("boom") == 3
    assert "crasher.service: Start request repeated too quickly." in messages
    assert seen_restarts == sorted(seen_restarts) and seen_restarts[-1] == 3
    state = systemd.state("crasher.service")
    assert (state.active_state, state.result, state.n_restarts) == ("failed", "exit-code", 3)
    assert (state.exec_main_code, state.exec_main_status) == (CLD_EXITED, 1)
    assert state.main_pid is None and state.exec_main_pid is not None

    systemd.reset_failed("crasher.service")
    assert systemd.state("crasher.service").active_state == "inactive"
    assert systemd.state("crasher.service").n_restarts == 0


STUBBORN_UNIT = """\
[Service]
# the child leaves the process group and ignores SIGTERM; only the cgroup still knows it
ExecStart=/bin/bash -c '( trap "" TERM; exec setsid sleep 600 ) & exec sleep 600'
TimeoutStopSec=1
"""


def test_stop_kills_children_that_ignore_sigterm(sandbox_systemd: Systemd, install_unit: InstallUnit) -> None:
    systemd = sandbox_systemd
    install_unit("stubborn.service", STUBBORN_UNIT)
    systemd.start("stubborn.service")
    deadline = time.monotonic() + 5
    while len(systemd.unit_processes("stubborn.service")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    processes = systemd.process_tree("stubborn.service")
    assert len(processes) == 2
    cursor = systemd.journal_cursor()
    began = time.monotonic()
    systemd.stop("stubborn.service")
    assert time.monotonic() - began >= 1  # it waited TimeoutStopSec for the SIGTERM-proof child
    assert systemd.unit_processes("stubborn.service") == []
    for process in processes:
        assert not Path(f"/proc/{process.pid}").exists(), process
    messages = [e.message for e in systemd.journal("stubborn.service", after_cursor=cursor)]
    # the main process obeyed SIGTERM; the child outlived it, so the final SIGTERM round timed out
    assert "stubborn.service: State 'final-sigterm' timed out. Killing." in messages
    assert "stubborn.service: Failed with result 'timeout'." in messages
    assert any(
        re.match(r"stubborn\.service: Killing process \d+ \(sleep\) with signal SIGKILL\.", m)
        for m in messages
    )


def test_environment_reaches_the_process_intact(sandbox_systemd: Systemd, install_unit: InstallUnit) -> None:
    systemd = sandbox_systemd
    expected = {
        "SPACES": "two  words",
        "QUOTES": 'it\'s "quoted"',
        "PERCENT": "100%",
        "DOLLAR": "$HOME stays",
        "BACKSLASH": "a\\b",
        "UNICODE": "ünï",
    }
    install_unit(
        "environ.service",
        "[Service]\n"
        'Environment="SPACES=two  words" "QUOTES=it\'s \\"quoted\\"" PERCENT=100%% "DOLLAR=$HOME stays"\n'
        'Environment="BACKSLASH=a\\\\b" UNICODE=ünï\n'
        "ExecStart=/bin/sleep 600\n",
    )
    systemd.start("environ.service")
    assert systemd.environment("environ.service") == expected
    main = next(p for p in systemd.process_tree("environ.service") if p.is_main)
    raw = Path(f"/proc/{main.pid}/environ").read_bytes().split(b"\0")
    environ = dict(item.decode().split("=", 1) for item in raw if item)
    assert {name: environ.get(name) for name in expected} == expected


def test_analyze_verify_candidates(sandbox: Sandbox, install_unit: InstallUnit, tmp_path: Path) -> None:
    systemd = sandbox.systemd
    good = tmp_path / "good.service"
    good.write_text("[Unit]\nWants=network-online.target\n[Service]\nExecStart=/bin/sleep 1\n")
    assert systemd.analyze_verify(good) == []

    misspelt = tmp_path / "candidate"
    misspelt.write_text("[Service]\nExecStart=/bin/sleep 1\nRestart=sometimes\nExecStrat=/bin/true\n")
    problems = systemd.analyze_verify(misspelt, unit_name="vllm-x.service")
    assert problems == [
        "vllm-x.service:3: Failed to parse service restart specifier, ignoring: sometimes",
        "vllm-x.service:4: Unknown key 'ExecStrat' in section [Service], ignoring.",
    ]

    no_section_end = tmp_path / "syntax.service"
    no_section_end.write_text("[Service\nExecStart=/bin/true\n")
    assert systemd.analyze_verify(no_section_end) == [
        "syntax.service:1: Invalid section header '[Service'",
        "Unit syntax.service failed to load properly, please adjust/correct and reload service manager: "
        "Bad message",
    ]

    missing = tmp_path / "missing.service"
    missing.write_text("[Service]\nExecStart=/srv/vllm/venv/bin/vllm serve /srv/models/x\n")
    assert systemd.analyze_verify(missing) == [
        "missing.service: Command /srv/vllm/venv/bin/vllm is not executable: No such file or directory"
    ]

    # the candidate is checked, not the installed unit of the same name; a broken dependency is not its fault
    install_unit("broken-dep.service", "[Service]\nExecStart=/bin/true\nFooBar=1\n")
    install_unit("twin.service", "[Service]\nExecStart=/bin/true\n")
    twin = tmp_path / "twin.service"
    twin.write_text("[Unit]\nWants=broken-dep.service\n[Service]\nExecStart=/bin/true\nBogus=1\n")
    assert systemd.analyze_verify(twin) == [
        "twin.service:5: Unknown key 'Bogus' in section [Service], ignoring."
    ]
    assert not list(systemd.host_path("/run").glob("ctxmgr-verify-*"))


def test_enable_in_a_runtime_unit_dir_stays_in_run(
    sandbox_systemd: Systemd, install_unit: InstallUnit
) -> None:
    systemd = sandbox_systemd
    install_unit(
        "enabled.service", "[Service]\nExecStart=/bin/sleep 600\n[Install]\nWantedBy=multi-user.target\n"
    )
    systemd.enable_now("enabled.service")
    link = systemd.host_path("/run/systemd/system/multi-user.target.wants/enabled.service")
    assert link.is_symlink()
    assert not Path("/etc/systemd/system/multi-user.target.wants/enabled.service").exists()
    assert systemd.list_unit_files("enabled*") == {"enabled.service": "enabled-runtime"}
    assert systemd.is_active("enabled.service")
    systemd.disable("enabled.service", now=True)
    assert not link.exists()
    assert not systemd.is_active("enabled.service")


def test_journal_reads_non_utf8_and_long_lines(sandbox_systemd: Systemd, install_unit: InstallUnit) -> None:
    systemd = sandbox_systemd
    install_unit(
        "weird.service",
        "[Service]\nType=oneshot\n"
        'ExecStart=/bin/bash -c \'printf "caf\\\\xe9\\\\n"; printf "%%05000d\\\\n" 7; echo ünï; exit 3\'\n',
    )
    cursor = systemd.journal_cursor()
    with pytest.raises(SystemdError, match=r"weird\.service failed"):
        systemd.start("weird.service")
    # journald reads the service's stdout stream on its own time: under load the manager's "Failed to
    # start" can be in the journal before the stream's first line is
    deadline = time.monotonic() + 10
    while True:
        entries = systemd.journal("weird.service", after_cursor=cursor)
        own = [e.message for e in entries if not e.from_manager]
        if len(own) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert own == ["caf\ufffd", "7".zfill(5000), "ünï"]
    assert "Failed to start weird.service." in [e.message for e in entries if e.from_manager]
    assert [e.message for e in systemd.journal("weird.service", lines=1)] == [
        "Failed to start weird.service."
    ]
    assert systemd.journal("weird.service", after_cursor=entries[-1].cursor) == []
