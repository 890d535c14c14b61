"""The collection's pure parts without a bed: how the module reads ctxmgr's JSON (today's contract and
the one being added), the command lines it runs, and the HAProxy runtime client against a socket
that answers as HAProxy 2.6 does."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import HaproxyError, Runtime
from ansible_collections.vllm.ctxmgr.plugins.modules import ctxmgr as module
from tests.fleet.load import allowed_target, run_load

PARAMS = {
    "command": "set-context",
    "service": "vllm-glm5",
    "context": 200000,
    "ctxmgr_bin": "ctxmgr",
    "state_dir": None,
    "systemd_pid": None,
    "extra_args": ["--gpu-memory", "95.6GiB"],
    "force": False,
    "long_probe": False,
}


def test_set_context_runs_ctxmgr_with_yes_and_json_or_dry_run_in_check_mode() -> None:
    argv = module.command_argv({**PARAMS, "state_dir": "/srv/state", "timeout": 600.0}, check_mode=False)
    assert argv == ["ctxmgr", "--state-dir", "/srv/state", "set-context", "200000", "--service", "vllm-glm5",
                    "--timeout", "600.0", "--yes", "--gpu-memory", "95.6GiB", "--json"]  # fmt: skip
    assert "--dry-run" in module.command_argv(PARAMS, check_mode=True)
    assert "--yes" not in module.command_argv(PARAMS, check_mode=True)
    rollback = module.command_argv({**PARAMS, "command": "rollback", "to": 3}, check_mode=False)
    assert rollback == ["ctxmgr", "rollback", "--service", "vllm-glm5", "--to", "3", "--yes", "--json"]
    verify = module.command_argv({**PARAMS, "command": "verify"}, check_mode=True)
    assert verify == ["ctxmgr", "verify", "--service", "vllm-glm5", "--json"]  # read only either way


def test_with_nodes_the_module_runs_the_deployment_coordinator_and_ctxmgr_parses_its_line() -> None:
    """A multi-node deployment: `ctxmgr deployment COMMAND --node ...` on its head, every command line
    of which ctxmgr's own parser takes (click parses it here, nothing runs)."""
    from vllm_ctxmgr.cli.main import main as ctxmgr_main

    nodes = {"nodes": ["local:vllm-glm5", "gpu-b:vllm-glm5"], "ssh": ["ssh", "-i", "/root/.ssh/a key"]}
    lines = {
        (command, check): module.command_argv(
            {**PARAMS, **nodes, "command": command, "timeout": 600.0}, check
        )
        for command in ("set-context", "rollback", "verify", "plan")
        for check in (False, True)
    }
    set_context = lines[("set-context", False)]
    assert set_context[:4] == ["ctxmgr", "deployment", "set-context", "200000"]
    assert set_context[set_context.index("--ssh") + 1] == "ssh -i '/root/.ssh/a key'"
    assert [set_context[i + 1] for i, w in enumerate(set_context) if w == "--node"] == nodes["nodes"]
    assert "--yes" in set_context and "--dry-run" in lines[("set-context", True)]
    for argv in lines.values():
        ctx = ctxmgr_main.make_context("ctxmgr", argv[1:2])  # the group, then its subcommand's own parse
        group = ctxmgr_main.get_command(ctx, argv[1])
        assert group is not None
        sub = group.get_command(ctx, argv[2])  # type: ignore[attr-defined]
        sub.make_context(argv[2], argv[3:], parent=ctx)  # raises click.UsageError on any unknown option


def test_the_edit_mode_reaches_set_context_in_both_modes() -> None:
    """dropin: the unit file an Ansible template renders is left alone (ctxmgr set-context --edit)."""
    for check_mode in (False, True):
        argv = module.command_argv({**PARAMS, "edit": "dropin"}, check_mode=check_mode)
        assert argv[argv.index("--edit") + 1] == "dropin"
        assert "--edit" not in module.command_argv({**PARAMS, "edit": "in-place"}, check_mode=check_mode)


def test_a_dry_run_would_change_under_both_contracts() -> None:
    diff = "-    --max-model-len 8192\n+    --max-model-len 200000\n"
    # today: changed is false on a dry run, the diff says whether anything would change
    assert module.would_change({"result": "dry-run", "changed": False, "diff": diff})
    assert not module.would_change({"result": "dry-run", "changed": False, "diff": ""})
    assert not module.would_change({"result": "unchanged", "changed": False, "diff": ""})
    # being added: dry_run true, and changed then means "would change"
    assert module.would_change({"dry_run": True, "result": "dry-run", "changed": True, "diff": diff})
    assert not module.would_change({"dry_run": True, "result": "unchanged", "changed": False, "diff": ""})


def test_errors_are_read_from_stdout_json_or_from_the_stderr_line() -> None:
    new = module.parse_output(4, json.dumps({"error": "vllm-glm5 is locked by pid 7", "exit_code": 4}), "")
    old = module.parse_output(4, "", "error: vllm-glm5 is locked by pid 7\n")
    assert new == old == {"error": "vllm-glm5 is locked by pid 7", "exit_code": 4}
    message = module.failure_message(PARAMS, old)
    assert "locked by another ctxmgr run" in message and "vllm-glm5 is locked by pid 7" in message
    assert module.import_unsupported(
        module.parse_output(2, "", "Usage: ctxmgr observe [OPTIONS]\nError: No such option '--import'.\n")
    )
    assert not module.import_unsupported({"error": "cannot read /x.json", "exit_code": 2})


def test_a_rolled_back_change_says_what_happened_on_the_host() -> None:
    data = {
        "changed": False,
        "result": "rolled-back",
        "exit_code": 1,
        "max_model_len": 8192,
        "previous_max_model_len": 8192,
        "reason": "vLLM refused the KV cache: 150,000 tokens fit, 200,000 were asked",
        "decisive_line": "ValueError: ... the estimated maximum model length is 149952.",
        "suggestion": "ctxmgr set-context 149952 --service vllm-glm5",
        "plan": {"max_model_len": 200000, "feasible": True, "max_context": 202752, "other": 1},
        "diff": "-a\n+b\n",
    }
    message = module.failure_message(PARAMS, data)
    assert message.startswith("ctxmgr set-context 200000 on vllm-glm5: rolled-back (exit 1)")
    assert "vLLM said: ValueError" in message and "previous unit is back (max_model_len 8192)" in message
    assert "try: ctxmgr set-context 149952" in message
    result = module.summary(PARAMS, data, check_mode=False)
    assert result["rolled_back"] is True and result["changed"] is False
    assert result["plan"] == {"max_model_len": 200000, "feasible": True, "max_context": 202752}
    assert result["unit_diff"] == "-a\n+b\n"


def test_a_deployment_change_a_node_did_not_finish_fails_and_is_changed() -> None:
    """Issue 29 item 5: every node serves the new length, a node's `finish` answer failed (exit 1,
    result applied): the task fails, and it did change the hosts."""
    unfinished = {"exit_code": 1, "result": "applied", "changed": True}
    assert not module.passes("set-context", unfinished)
    assert module.changed_though_failed(1, unfinished) is True
    assert (
        module.changed_though_failed(1, {"exit_code": 1, "result": "rolled-back", "changed": True}) is False
    )
    assert module.changed_though_failed(5, {"exit_code": 5, "result": "rollback-failed"}) is True


# ---- HAProxy's runtime API -----------------------------------------------------------------------

SHOW_STAT = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,\n"
    "vllm_front,FRONTEND,,,3,9,2000,100,OPEN,\n"
    "vllm,h1,0,0,2,5,,40,DRAIN,\n"
    "vllm,h2,0,0,0,5,,40,UP,\n"
    "vllm,BACKEND,0,0,2,9,200,80,UP,\n"
)


@pytest.fixture
def fake_haproxy(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """A unix socket answering `show stat` and `set server` the way HAProxy's non-interactive mode does."""
    path = str(tmp_path / "admin.sock")
    received: list[str] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                line = conn.recv(4096).decode().strip()
                received.append(line)
                if line == "show stat":
                    conn.sendall(SHOW_STAT.encode())
                elif line.startswith("set server vllm/nope"):
                    conn.sendall(b"No such server.\n\n")
                else:
                    conn.sendall(b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, received
    stop.set()
    server.close()


def test_runtime_reads_servers_and_sets_states(fake_haproxy: tuple[str, list[str]]) -> None:
    path, received = fake_haproxy
    runtime = Runtime(path, timeout=2)
    rows = runtime.servers("vllm")
    assert set(rows) == {("vllm", "h1"), ("vllm", "h2")}  # no FRONTEND / BACKEND rows
    assert rows[("vllm", "h1")]["scur"] == "2" and rows[("vllm", "h1")]["status"] == "DRAIN"
    runtime.set_state("vllm", "h1", "drain")
    assert received[-1] == "set server vllm/h1 state drain"
    with pytest.raises(HaproxyError, match="No such server"):
        runtime.set_state("vllm", "nope", "ready")
    assert runtime.wait("vllm", "h2", "up", timeout=1)["status"] == "UP"
    with pytest.raises(HaproxyError, match=r"vllm/h1 was not idle within 0.3 s \(status DRAIN, 2 in flight"):
        runtime.wait("vllm", "h1", "idle", timeout=0.3)


def test_runtime_says_where_it_could_not_connect(tmp_path: Path) -> None:
    with pytest.raises(HaproxyError, match="cannot reach the HAProxy runtime API"):
        Runtime(str(tmp_path / "absent.sock")).command("show info")


def test_the_load_client_only_targets_loopback_and_the_bed() -> None:
    assert allowed_target("http://127.0.0.1:8080") and allowed_target("http://10.249.0.1:8080")
    assert not allowed_target("http://10.0.0.1:8080") and not allowed_target("http://192.168.1.2/")
    assert not allowed_target("http://example.com/")


class _Streams(BaseHTTPRequestHandler):
    """Streams 3 tokens the way the stand-in does (HTTP/1.1, chunked SSE); the 2nd request on any
    connection is cut mid-stream when `cut` is set, as a server killed under a kept-alive client."""

    protocol_version = "HTTP/1.1"
    cut = False

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.served = getattr(self, "served", 0) + 1  # one handler object per connection
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for index in range(3):
            if self.cut and self.served == 2 and index == 1:
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            finish = "length" if index == 2 else None
            self._chunk(f"data: {json.dumps({'choices': [{'text': 'x', 'finish_reason': finish}]})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


@pytest.mark.parametrize("cut", [False, True])
def test_kept_alive_clients_reuse_their_connection_and_a_cut_stream_counts_as_lost(cut: bool) -> None:
    handler = type("Handler", (_Streams,), {"cut": cut})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        summary = run_load(url, rate=10, duration=1.0, max_tokens=3, keepalive=2)
    finally:
        server.shutdown()
    assert summary["sent"] == summary["answered"] == 10 and summary["keepalive_clients"] == 2
    if not cut:
        assert (summary["lost"], summary["reused"]) == (0, 8)  # 2 connections carried all 10
    else:
        # each client's 2nd request is cut; its next one opens a new connection (whose 2nd is cut too)
        assert summary["lost"] == summary["failed"] + summary["truncated"] >= 2
        assert all(error["tokens"] <= 1 and error["reused"] for error in summary["errors"])
        assert summary["reused"] < 8


def test_only_a_verdict_passes_and_a_crash_never_does() -> None:
    """Issue 29, item 7: the module took verify's exit 1 as a pass whatever it meant; a crash (70, or 1
    with result "error" from a ctxmgr before 70) is no verdict and fails the task."""
    assert module.passes("verify", {"exit_code": 0, "result": "ok"})
    assert module.passes("verify", {"exit_code": 1, "result": "degraded"})
    assert not module.passes("verify", {"exit_code": 70, "result": "error", "error": "unexpected error: X"})
    assert not module.passes("verify", {"exit_code": 1, "result": "error", "error": "unexpected error: X"})
    assert not module.passes("verify", {"exit_code": 2, "result": "failed"})
    assert not module.passes("set-context", {"exit_code": 1, "result": "degraded"})
    assert module.passes("set-context", {"exit_code": 0, "result": "applied"})
    assert not module.passes("plan", {"exit_code": 70, "result": "error"})
    assert "crashed" in module.failure_message(
        {**PARAMS, "command": "verify"}, {"exit_code": 70, "error": "unexpected error: ZeroDivisionError"}
    )


def test_with_nodes_every_parameter_of_one_hosts_command_is_passed() -> None:
    """Issue 29, item 13: with `nodes`, `rollback, to: 3` went to the deployment's last change, and
    wait_lock, probe_tokens and long_probe were dropped without a word."""
    from vllm_ctxmgr.cli.main import main as ctxmgr_main

    nodes = {"nodes": ["local:vllm-glm5", "gpu-b:vllm-glm5"]}
    rollback = module.command_argv(
        {**PARAMS, **nodes, "command": "rollback", "to": 3, "wait_lock": 30.0}, False
    )
    assert rollback[rollback.index("--to") + 1] == "3"
    assert rollback[rollback.index("--wait-lock") + 1] == "30.0"
    change = module.command_argv(
        {**PARAMS, **nodes, "probe_tokens": 1000, "long_probe": True, "wait_lock": 5.0}, False
    )
    assert change[change.index("--probe-tokens") + 1] == "1000" and "--long-probe" in change
    assert change[change.index("--wait-lock") + 1] == "5.0"
    verify = module.command_argv({**PARAMS, **nodes, "command": "verify", "long_probe": True}, False)
    assert "--long-probe" in verify
    # one host's command line for the same parameters: the deployment's says no less
    single = module.command_argv({**PARAMS, "command": "rollback", "to": 3, "wait_lock": 30.0}, False)
    assert set(single) - {"--service", "vllm-glm5"} <= set(rollback)
    # the deployment's --wait-lock, --to, --probe-tokens and --long-probe are ctxmgr's own options
    # (click parses them, nothing runs)
    for command in ("set-context", "rollback"):
        argv = module.command_argv({**PARAMS, **nodes, "command": command, "wait_lock": 5.0}, False)
        ctx = ctxmgr_main.make_context("ctxmgr", argv[1:2])
        sub = ctxmgr_main.get_command(ctx, "deployment").get_command(ctx, command)  # type: ignore[union-attr]
        assert sub.make_context(command, argv[3:], parent=ctx).params["wait_lock"] == 5.0
    assert sub.make_context("rollback", rollback[3:], parent=ctx).params["to"] == "3"
    set_context = ctxmgr_main.get_command(ctx, "deployment").get_command(ctx, "set-context")  # type: ignore[union-attr]
    parsed = set_context.make_context("set-context", change[3:], parent=ctx).params
    assert (parsed["probe_tokens"], parsed["long_probe"], parsed["wait_lock"]) == (1000, True, 5.0)


def test_a_handed_over_observation_is_written_whole_where_import_reads_it(tmp_path: Path) -> None:
    """The module writes the observation itself (one task hands it over and imports it): a directory
    only its owner enters, a file only its owner reads, the JSON as given, a stale file replaced."""
    path = tmp_path / "imports" / "vllm-from-h1.json"
    module.write_observation(str(path), {"observation": {"gpu_name": "H100", "num_gpu_blocks": 4670}})
    assert json.loads(path.read_text()) == {"observation": {"gpu_name": "H100", "num_gpu_blocks": 4670}}
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    path.parent.chmod(0o755)
    module.write_observation(str(path), {"observation": {"gpu_name": "H200"}})
    assert json.loads(path.read_text())["observation"] == {"gpu_name": "H200"}
    # issue 36 item 14: a directory that exists is the operator's: left 0755, never changed back
    assert path.parent.stat().st_mode & 0o777 == 0o755 and sorted(p.name for p in path.parent.iterdir()) == [
        path.name
    ]


def test_the_last_start_observed_first_is_the_observation_or_why_there_is_none() -> None:
    seen = module.parse_output(0, json.dumps({"result": "ok", "observation": {"vllm_version": "0.33.0"}}), "")
    assert module.last_start(PARAMS, seen) == {"observation": {"vllm_version": "0.33.0"}, "error": ""}
    failed = module.last_start(PARAMS, module.parse_output(1, "", "error: no start in the journal\n"))
    assert failed["observation"] == {}
    assert failed["error"].startswith("ctxmgr observe on vllm-glm5: no start in the journal (exit 1")
