"""status: every vLLM service on the host at a glance, under the private systemd."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest

from tests.support.cli import ctxmgr_said
from tests.support.demo import make_vllm_wrapper, standin_unit
from tests.support.standin import free_port
from vllm_ctxmgr.monitor.status import ServiceStatus, status_table
from vllm_ctxmgr.store import ServiceStore

NOW = 1_790_000_000.0


def test_the_table_lines_up_like_systemctl_list_units() -> None:
    rows = [
        ServiceStatus("vllm-glm5", "active", "running", 200_000, 0.9, last_verify_time=NOW - 125,
                      last_verify_result="degraded", kv_cache_tokens=298_880, margin_bytes=-(1 << 30),
                      revision_state="final", scheduled=True, last_verify_trigger="timer"),
        ServiceStatus("vllm-small", "failed", "failed", None, None, change_in_progress=True),
    ]  # fmt: skip
    lines = status_table(rows, now=NOW).splitlines()
    assert lines[0].split() == ["SERVICE", "ACTIVE", "SUB", "CONTEXT", "UTIL", "VERIFIED", "RESULT", "KV",
                                "TOKENS", "MARGIN", "CHANGE"]  # fmt: skip
    assert lines[1].split() == ["vllm-glm5", "active", "running", "200000", "0.90", "2min", "ago", "(timer)",
                                "degraded", "298,880", "-1.00", "GiB", "final"]  # fmt: skip
    assert lines[2].split() == ["vllm-small", "failed", "failed", "-", "default", "never", "-", "-", "-",
                                "in", "progress"]  # fmt: skip
    # columns start where their headers start
    assert lines[1].index("200000") == lines[0].index("CONTEXT")
    assert lines[2].index("default") == lines[0].index("UTIL")
    assert lines[-1] == "2 vLLM services listed."


ctxmgr = partial(ctxmgr_said, unit_dir="/run/systemd/system")


@pytest.mark.systemd247
def test_status_lists_vllm_services_with_their_last_verification(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    from vllm_ctxmgr.probe import wait_until_serving

    name, port = "vllm-status", free_port()
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=port))
    install_unit("not-vllm.service", "[Service]\nExecStart=/bin/sleep 600\n")
    sandbox.systemd.start(unit)
    sandbox.systemd.start("not-vllm.service")
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    state = workdir / "state"
    code, _, out = ctxmgr(sandbox, state, "verify", "--service", name)
    assert code == 0, out

    code, _, out = ctxmgr(sandbox, state, "status", "--json")
    assert code == 0, out
    rows = {row["service"]: row for row in json.loads(out)["services"]}
    assert "not-vllm" not in rows
    row = rows[name]
    assert (row["active_state"], row["max_model_len"], row["gpu_memory_utilization"]) == ("active", 8192, 0.9)
    assert row["last_verify_result"] == "ok" and time.time() - row["last_verify_time"] < 60
    assert row["kv_cache_tokens"] > 0 and row["base_url"] == f"http://127.0.0.1:{port}"
    assert row["change_in_progress"] is False and row["scheduled"] is False

    # while another ctxmgr run holds the service's lock, status says so (and does not take the lock)
    with ServiceStore(state, name).lock():
        code, _, out = ctxmgr(sandbox, state, "status", "--json")
        assert code == 0, out
        row = {r["service"]: r for r in json.loads(out)["services"]}[name]
        assert row["change_in_progress"] is True and row["change_detail"].startswith("pid ")
        code, _, out = ctxmgr(sandbox, state, "status")
    line = next(line for line in out.splitlines() if line.startswith(name))
    assert line.split()[1:5] == ["active", "running", "8192", "0.90"]
    assert line.endswith("in progress")

    sandbox.systemd.stop(unit)
    code, _, out = ctxmgr(sandbox, state, "status", "--json")
    row = {r["service"]: r for r in json.loads(out)["services"]}[name]
    assert (row["active_state"], row["sub_state"]) == ("inactive", "dead")  # listed though not loaded now
