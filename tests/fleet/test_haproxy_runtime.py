"""Issue 16 item 11: the HAProxy runtime client is bounded. `recv` looped until EOF with a per-recv
timeout only (a reply of 1 byte/s took 25 s against timeout=5, and could last for ever); a 300 MB
reply grew memory by 1.8 GB, then raised an unhandled csv.Error; `scur: abc` raised ValueError; a
backend or server name with `;` or a space was sent as is (HAProxy splits commands there)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import (
    HaproxyError,
    Runtime,
)

REPO = Path(__file__).resolve().parents[2]
CAP = 16 << 20  # haproxy_runtime.MAX_ANSWER
HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,\n"


def drip(conn: socket.socket) -> None:
    for _ in range(100):
        conn.sendall(b"#")
        time.sleep(0.1)


def huge(conn: socket.socket) -> None:
    block = (HEADER + "vllm,h1,0,0,0,5,,40,UP,\n" * 2000).encode()
    with contextlib.suppress(OSError):
        for _ in range(CAP // len(block) + 50):
            conn.sendall(block)


def answer(text: str) -> Callable[[socket.socket], None]:
    return lambda conn: conn.sendall(text.encode())


@pytest.fixture
def haproxy() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """A unix socket that answers each connection with the behaviour it is given."""
    directory = REPO / ".cache" / "hap" / uuid.uuid4().hex[:8]
    directory.mkdir(parents=True)
    servers: list[socket.socket] = []

    def start(behaviour: Callable[[socket.socket], None]) -> str:
        path = str(directory / f"{len(servers)}.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(4)
        servers.append(server)

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    with contextlib.suppress(OSError):
                        behaviour(conn)

        threading.Thread(target=serve, daemon=True).start()
        return path

    yield start
    for server in servers:
        server.close()


def test_a_reply_that_drips_ends_at_the_whole_deadline(haproxy) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    with pytest.raises(HaproxyError, match=r"no whole answer within 1 s"):
        Runtime(haproxy(drip), timeout=1).command("show stat")
    assert time.monotonic() - started < 2.0


def test_a_reply_without_end_is_cut_at_the_cap(haproxy) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(HaproxyError, match=r"an answer larger than 16 MiB"):
        Runtime(haproxy(huge), timeout=30).command("show stat")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('# pxname,svname,scur\nvllm,h1,"' + "x" * 200_000 + "\n", "'show stat' is not CSV"),
        ("Unknown command.\n", "'show stat' answered 'Unknown command"),
        (HEADER + "vllm,h1,0,0,abc,5,,40,UP,\n", r"vllm/h1 scur 'abc', not a count"),
        (HEADER + "vllm,h1,-3,0,0,5,,40,UP,\n", r"vllm/h1 qcur '-3', not a count"),
        (HEADER + "vllm,h1\n", "row of vllm/h1 has no scur column"),  # not "0 in flight"
        (HEADER + 'vllm,h1,"0,0,0,5,,40,UP,\n', "'show stat' is not CSV"),  # an unterminated quote
    ],
)
def test_garbage_is_the_clients_own_error(haproxy, text: str, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(HaproxyError, match=match):
        Runtime(haproxy(answer(text)), timeout=2).wait("vllm", "h1", "idle", timeout=0.5)


@pytest.mark.parametrize("name", ["h1; shutdown sessions server vllm/h2", "h 1", "h1\nset", "", "h1/x"])
def test_a_name_that_would_be_other_commands_is_refused(haproxy, name: str) -> None:  # type: ignore[no-untyped-def]
    received: list[bytes] = []
    runtime = Runtime(haproxy(lambda conn: received.append(b"called")), timeout=2)
    with pytest.raises(HaproxyError, match="HAProxy names hold only"):
        runtime.set_state("vllm", name, "drain")
    with pytest.raises(HaproxyError, match="HAProxy names hold only"):
        runtime.set_state(name, "h1", "ready")
    assert received == []


def test_a_refusal_of_many_lines_is_one_line(haproxy) -> None:  # type: ignore[no-untyped-def]
    path = haproxy(answer("No such server.\nSee 'help'.\n\n"))
    with pytest.raises(HaproxyError, match=r"No such server\. / See 'help'\.") as info:
        Runtime(path, timeout=2).set_state("vllm", "h9", "drain")
    assert "\n" not in str(info.value)


SERVERS_STATE = (
    "1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight\n"
    "3 vllm 1 h1 10.0.0.1 2 {admin} 1\n"
)


@pytest.mark.parametrize(("admin", "state"), [("0", "ready"), ("8", "drain"), ("1", "maint"), ("9", "maint")])
def test_the_admin_state_is_read_from_show_servers_state(haproxy, admin: str, state: str) -> None:  # type: ignore[no-untyped-def]
    assert (
        Runtime(haproxy(answer(SERVERS_STATE.format(admin=admin))), timeout=2).admin_state("vllm", "h1")
        == state
    )


@pytest.mark.parametrize("admin", ["x", "-1", "1e3", "0x8", "99999999999", "٣", "８"])
def test_an_admin_state_that_is_not_a_number_is_the_clients_own_error(haproxy, admin: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 29, item 13: a non-integer admin state raised ValueError out of the module."""
    with pytest.raises(HaproxyError, match=r"vllm/h1 admin state .*not a number"):
        Runtime(haproxy(answer(SERVERS_STATE.format(admin=admin))), timeout=2).admin_state("vllm", "h1")


@pytest.mark.parametrize("name", ["be1 extra args", "be1;help", "be1\nshow info", ""])
def test_the_backend_is_checked_before_show_servers_state_is_sent(haproxy, name: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 29, item 13: `show servers state 'be1 extra args'` went out as is."""
    received: list[bytes] = []
    runtime = Runtime(haproxy(lambda conn: received.append(b"called")), timeout=2)
    with pytest.raises(HaproxyError, match="HAProxy names hold only"):
        runtime.admin_state(name, "h1")
    with pytest.raises(HaproxyError, match="HAProxy names hold only"):
        runtime.admin_state("vllm", name)
    assert received == []
