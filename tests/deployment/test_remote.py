"""Reaching a node: HOST:UNIT, the ssh command line (quoted for the remote shell), answers and failures."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from vllm_ctxmgr.deployment.remote import Link, NodeAddress, NodeError
from vllm_ctxmgr.errors import ExitCode, UsageError


def test_node_address_takes_host_and_unit_and_refuses_the_rest() -> None:
    assert NodeAddress.parse("gpu-b:vllm-glm5.service") == NodeAddress("gpu-b", "vllm-glm5.service")
    assert NodeAddress.parse("[fd00::2]:vllm") == NodeAddress("[fd00::2]", "vllm")  # the last colon splits
    for bad in ("gpu-b", ":vllm", "gpu-b:", "-oProxyCommand=x:vllm", "a b:vllm"):
        with pytest.raises(UsageError):
            NodeAddress.parse(bad)


def test_the_remote_command_is_one_quoted_word_list_after_the_host() -> None:
    link = Link(
        ssh=("ssh", "-F", "cfg"), remote_ctxmgr=("/opt/ctxmgr/bin/ctxmgr", "--state-dir", "/var/lib/x y")
    )
    argv = link.argv("gpu-b", ["node", "show", "vllm;rm -rf /"])
    assert argv[:5] == ["ssh", "-F", "cfg", "--", "gpu-b"]
    # ssh hands one string to the remote shell: every word comes back out of it unchanged
    assert shlex.split(argv[5]) == [
        "/opt/ctxmgr/bin/ctxmgr",
        "--state-dir",
        "/var/lib/x y",
        "node",
        "show",
        "vllm;rm -rf /",
    ]
    assert link.argv("local", ["node", "show", "u"])[-3:] == ["node", "show", "u"]
    assert "ssh" not in link.argv("local", ["x"])


def _script(tmp: Path, body: str) -> tuple[str, ...]:
    path = tmp / "fake-ctxmgr.py"
    path.write_text(body)
    return (sys.executable, str(path))


def test_a_node_answer_is_its_json_object_and_its_failure_names_the_host(workdir: Path) -> None:
    ok = Link(
        local_ctxmgr=_script(workdir, "import json,sys; print(json.dumps({'args': sys.argv[1:]}, indent=2))")
    )
    assert ok.call("local", ["node", "show", "u"], timeout=30)["args"] == ["node", "show", "u", "--json"]
    failing = Link(
        local_ctxmgr=_script(
            workdir,
            "import json\n"
            "print(json.dumps({'error': 'u: no such unit', 'exit_code': 2}))\n"
            "raise SystemExit(2)",
        )
    )
    with pytest.raises(NodeError, match=r"^local: u: no such unit$") as caught:
        failing.call("local", ["node", "show", "u"], timeout=30)
    assert caught.value.exit_code == 2
    garbage = Link(local_ctxmgr=_script(workdir, "print('not json')"))
    with pytest.raises(NodeError, match=r"^local: its answer is not JSON \(exit status 0\)$"):
        garbage.call("local", ["node", "show", "u"], timeout=30)
    # a step that dies before it can answer: the last line it wrote to stderr, as text
    crashed = Link(
        local_ctxmgr=_script(
            workdir, "import sys\nsys.stderr.write('boom: no ctxmgr here\\n')\nraise SystemExit(3)"
        )
    )
    with pytest.raises(NodeError, match=r"^local: boom: no ctxmgr here$"):
        crashed.call("local", ["node", "show", "u"], timeout=30)


def test_an_unreachable_host_is_an_ssh_failure_with_the_host_first() -> None:
    link = Link(ssh=("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3"))
    with pytest.raises(NodeError, match=r"^no-such-node\.invalid: ssh failed: "):
        link.call("no-such-node.invalid", ["node", "show", "u"], timeout=30)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('import sys; sys.stdout.buffer.write(b\'{"ok": "\\xff\\xfe"}\')', "its answer is not UTF-8"),
        ("print('[' * 100000 + ']' * 100000)", "its answer is JSON nested too deeply"),
        ("print('{\"a\":' * 100000 + '1' + '}' * 100000)", "its answer is JSON nested too deeply"),
        ("print('[1, 2]')", "its answer is not a JSON object"),
    ],
)
def test_any_fault_in_a_nodes_answer_is_that_nodes_failure(workdir: Path, body: str, why: str) -> None:
    """Not UTF-8, nested past the parser, not an object: a NodeError naming the node, never another
    exception (which the coordinator would not take for the node's failure, issue 29.5)."""
    link = Link(local_ctxmgr=_script(workdir, body))
    with pytest.raises(NodeError, match=rf"^local: {why}$"):
        link.call("local", ["node", "start", "u"], timeout=30)


def test_a_nodes_answer_is_bounded_while_it_is_read(workdir: Path) -> None:
    """64 MiB of answer, then a wait: refused once past the 16 MiB cap, at once, without holding the
    rest (the reader does not wait for the end, nor for the timeout)."""
    body = (
        "import sys, time\n"
        "chunk = b'x' * (1 << 20)\n"
        "for _ in range(64):\n"
        "    sys.stdout.buffer.write(chunk)\n"
        "    sys.stdout.buffer.flush()\n"
        "time.sleep(60)\n"
    )
    link = Link(local_ctxmgr=_script(workdir, body))
    started = time.monotonic()
    with pytest.raises(NodeError, match=r"^local: its answer is larger than 16777216 bytes$"):
        link.call("local", ["node", "show", "u"], timeout=40)
    assert time.monotonic() - started < 30


def test_the_request_reaches_the_node_and_a_silent_node_times_out(workdir: Path) -> None:
    echo = Link(
        local_ctxmgr=_script(workdir, "import json,sys; print(json.dumps({'got': json.load(sys.stdin)}))")
    )
    assert echo.call("local", ["node", "settle", "u"], timeout=30, stdin={"reason": "r"}) == {
        "got": {"reason": "r"}
    }
    silent = Link(local_ctxmgr=_script(workdir, "import time; time.sleep(30)"))
    started = time.monotonic()
    # named as every other fault of the call is: the node's label (host:service) and the step
    with pytest.raises(NodeError, match=r"^local:u: `ctxmgr node stop` did not answer within 2 s$"):
        silent.call("local", ["node", "stop", "u"], timeout=2, label="local:u")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("said", [256, 512, -1, 7, True, "2", 1.5, None])
def test_a_node_exit_code_outside_ctxmgrs_documented_set_is_a_plain_failure(
    workdir: Path, said: object
) -> None:
    """Issue 29, item 7: a node answering exit_code 256 made a failed `deployment verify` exit 0
    (256 mod 256). Only ctxmgr's own codes pass through; anything else is the node's failure (1)."""
    link = Link(
        local_ctxmgr=_script(
            workdir,
            "import json\n"
            f"print(json.dumps({{'error': 'the probe failed', 'exit_code': {said!r}}}))\n"
            "raise SystemExit(1)",
        )
    )
    with pytest.raises(NodeError, match=r"^local: the probe failed") as caught:
        link.call("local", ["node", "verify", "u"], timeout=30)
    assert caught.value.exit_code == ExitCode.ERROR
    if said is not None:
        assert "an exit code ctxmgr never uses" in caught.value.message


@pytest.mark.parametrize("said", [2, 3, 4, 5, 6, 70])
def test_a_node_exit_code_of_ctxmgrs_own_passes_through(workdir: Path, said: int) -> None:
    link = Link(
        local_ctxmgr=_script(
            workdir,
            f"import json\nprint(json.dumps({{'error': 'x', 'exit_code': {said}}}))\nraise SystemExit(1)",
        )
    )
    with pytest.raises(NodeError) as caught:
        link.call("local", ["node", "verify", "u"], timeout=30)
    assert caught.value.exit_code == said


def test_a_nodes_terminal_controls_never_reach_the_operators_terminal(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29, item 14: escape codes and a carriage return in a node's error printed a green "all
    nodes OK" over the error line. The door every text leaves by (cli.output.echo) takes them out."""
    from vllm_ctxmgr.cli.output import echo, fail

    hostile = "the probe failed\x1b[2K\r\x1b[32mall nodes OK\x1b[0m\x07\x1b]0;owned\x07\x9b2J\x7f\tend"
    link = Link(
        local_ctxmgr=_script(
            workdir,
            f"import json\nprint(json.dumps({{'error': {hostile!r}, 'exit_code': 2}}))\nraise SystemExit(2)",
        )
    )
    with pytest.raises(NodeError) as caught:
        link.call("local", ["node", "verify", "u"], timeout=30)
    with pytest.raises(SystemExit):
        fail(caught.value.message, caught.value.exit_code, as_json=False, command="deployment verify")
    err = capsys.readouterr().err
    assert err == "ctxmgr: local: the probe failedall nodes OK2J end\n"
    with pytest.raises(SystemExit):
        fail(caught.value.message, caught.value.exit_code, as_json=True, command="deployment verify")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    assert json.loads(out)["error"].startswith("local: the probe failed\x1b[2K\r")  # JSON keeps it, escaped
    echo("a journal line\x1b[1A\x1b[2K rewritten\r\nnext line\tkept")
    assert capsys.readouterr().out == "a journal line rewritten\nnext line\tkept\n"
