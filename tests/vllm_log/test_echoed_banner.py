"""Issue 29, item 1, in a real journal: lines the serving service prints after it is up (a client's
text echoed to its log: a fresh banner, a 9999 GiB KV line, a weights line, another "Starting vLLM
server on") come from the same invocation of the unit, and are not a start. ExecStartPost= prints
them from inside the unit (a background process of ExecStartPost=: same cgroup, same
_SYSTEMD_INVOCATION_ID) once /health answers."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.demo import make_vllm_wrapper, standin_unit
from tests.support.standin import free_port
from vllm_ctxmgr.probe import wait_until_serving

ECHOED = [
    "vLLM API server version 0.99.0",
    "Model loading took 1.00 GiB and 0.5 seconds",
    "Available KV cache memory: 9999.00 GiB",
    "GPU KV cache size: 9,999,999 tokens",
    "Starting vLLM server on http://0.0.0.0:9999",
]


def echo_script(workdir: Path, port: int) -> Path:
    script = workdir / "echo_after_ready.py"
    script.write_text(
        "import time, urllib.request\n"
        "for _ in range(600):\n"
        "    try:\n"
        f"        urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=1)\n"
        "        break\n"
        "    except Exception:\n"
        "        time.sleep(0.2)\n"
        f"for line in {ECHOED!r}:\n"
        "    print(line, flush=True)\n"
    )
    return script


def test_an_echoed_banner_of_the_running_service_is_not_learned(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-echo"
    port = free_port()
    text = standin_unit(make_vllm_wrapper(workdir), port=port)
    # in the background, so systemd's "Started" comes first, as it does for an echo long after the start
    text += f'ExecStartPost=/bin/sh -c "{sys.executable} {echo_script(workdir, port)} &"\n'
    unit = install_unit(f"{name}.service", text)
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
        "9999.00 GiB" in entry.message for entry in sandbox.systemd.journal(unit, lines=200)
    ):
        time.sleep(0.5)
    entries = sandbox.systemd.journal(unit, lines=400)
    echoed = [e for e in entries if "9999.00 GiB" in e.message]
    real = [e for e in entries if "Available KV cache memory" in e.message and "9999" not in e.message]
    assert echoed and real and echoed[0].invocation_id == real[0].invocation_id  # one invocation

    run = run_ctxmgr(sandbox.pid, workdir / "state", "observe", "--service", name, "--json")
    assert run.code == 0, run.stderr
    observed = run.data["observation"]
    assert observed["vllm_version"] != "0.99.0"
    assert observed["available_kv_gib"] is not None and observed["available_kv_gib"] < 9999
    assert observed["model_loading_gib"] != 1.0
    assert observed["ready"] is True
    assert run.data["record"] and "9999" not in json.dumps(run.data["record"])  # what observe stored
