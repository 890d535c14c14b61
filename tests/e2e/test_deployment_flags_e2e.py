"""set-context on a real private systemd: the unit's not-modelled flags are named on a dry run, and
what vLLM refuses at config time is refused before the unit or the service is touched."""

from __future__ import annotations

from pathlib import Path

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.sandbox import Sandbox
from tests.support.standin import free_port


def _service(sandbox: Sandbox, install_unit, workdir: Path, name: str, flags: str) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    port = free_port()
    text = standin_unit(make_vllm_wrapper(workdir), port=port)
    text = text.replace("--served-model-name glm-5", f"--served-model-name glm-5 {flags}")
    unit = install_unit(f"{name}.service", text)
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    return unit, sandbox.systemd.host_unit_dir / unit


def test_a_dry_run_names_the_units_unmodelled_flags(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-flags"
    _unit, path = _service(sandbox, install_unit, workdir, name, "--enable-eplb --compilation-config.mode 3")
    before = path.read_bytes()
    run = run_ctxmgr(sandbox.pid, workdir / "state", "set-context", "100000", "--service", name,
                     *offline_gpu_args(), "--dry-run", "--json")  # fmt: skip
    assert run.code == 0, run.stderr
    assert [n["flag"] for n in run.data["plan"]["not_modelled_flags"]] == [
        "--enable-eplb",
        "--compilation-config",
    ]
    text = run_ctxmgr(sandbox.pid, workdir / "state", "set-context", "100000", "--service", name,
                      *offline_gpu_args(), "--dry-run")  # fmt: skip
    assert "changes GPU memory, not modelled: --enable-eplb, --compilation-config" in text.stdout
    assert path.read_bytes() == before


def test_what_vllm_refuses_is_refused_before_anything_is_touched(sandbox, install_unit, workdir) -> None:  # type: ignore[no-untyped-def]
    name = "vllm-it-refused"
    unit, path = _service(
        sandbox, install_unit, workdir, name, "--no-enable-chunked-prefill --max-num-batched-tokens 8192"
    )
    before = path.read_bytes()
    pid_before = sandbox.systemd.show(unit, "MainPID")["MainPID"]
    run = run_ctxmgr(sandbox.pid, workdir / "state", "set-context", "100000", "--service", name,
                     *offline_gpu_args(), "--yes")  # fmt: skip
    assert run.code == 2 and "Traceback" not in run.stderr
    assert "max_num_batched_tokens (8192) is smaller than max_model_len (100000)" in run.stderr
    assert path.read_bytes() == before
    assert sandbox.systemd.show(unit, "MainPID")["MainPID"] == pid_before
