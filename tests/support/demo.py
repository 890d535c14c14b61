"""The built-in demo deployment: a GLM-5 service as the seeds' machine had it, served by the stand-in.

Used by `make demo` (examples/demo.py) and by the integration tests, so both run the same service.
The stand-in (tests.support.standin) prints vLLM 0.33's own log lines and answers its HTTP API; the
unit still reads `.../bin/vllm serve MODEL ...` because a tiny `bin/vllm` wrapper execs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm_ctxmgr.systemd.quoting import quote_env_assignment, quote_exec_word

REPO_ROOT = Path(__file__).resolve().parents[2]
GLM5_CONFIG_DIR = REPO_ROOT / "examples" / "models" / "glm-5"

# The seeds' machine: 8 x RTX PRO 6000 Blackwell (95.6 GiB each), GLM-5 GGUF weights of ~50.8 GiB/GPU.
SEED_GPU_COUNT = 8
SEED_GPU_GIB = 95.6
SEED_WEIGHTS_GIB_PER_GPU = 50.84


def make_vllm_wrapper(directory: Path, python: str | None = None) -> Path:
    """`DIR/bin/vllm`: a console script that runs the stand-in, so ExecStart and the process's own argv
    (/proc/PID/cmdline: `python DIR/bin/vllm serve MODEL ...`) look like a venv's vllm."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "vllm"
    text = (
        f"#!{python or sys.executable}\n"
        "import runpy\n"
        'runpy.run_module("tests.support.standin", run_name="__main__")\n'
    )
    if wrapper.exists() and wrapper.read_text() == text:
        return wrapper
    # Written beside and renamed over: a stand-in still exec'ing the old file (a unit restarting on
    # another fleet host) makes an in-place write fail with ETXTBSY ("Text file busy").
    partial = bin_dir / f".vllm.{os.getpid()}"
    partial.write_text(text)
    partial.chmod(0o755)
    os.replace(partial, wrapper)
    return wrapper


def standin_unit(
    wrapper: Path,
    *,
    port: int,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.90,
    model: Path = GLM5_CONFIG_DIR,
    environment: dict[str, str] | None = None,
    restart: str = "on-failure",
    description: str = "vLLM OpenAI server: GLM-5 (stand-in, TP=8)",
) -> str:
    """A unit in the shape of the seeds' vllm-glm5.service, pointing at the stand-in."""
    env = {
        "CTXMGR_STANDIN_GPU_TOTAL_GIB": str(SEED_GPU_GIB),
        "CTXMGR_STANDIN_WEIGHTS_GIB": str(SEED_WEIGHTS_GIB_PER_GPU),
        "CTXMGR_STANDIN_TIME_SCALE": "0.2",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(REPO_ROOT),
        **(environment or {}),
    }
    env_lines = "\n".join(f"Environment={quote_env_assignment(k, v)}" for k, v in env.items())
    return f"""# Demo: GLM-5 as the seeds ran it (TP 8), served by ctxmgr's vLLM stand-in.
[Unit]
Description={description}

[Service]
Type=simple
{env_lines}
ExecStart={quote_exec_word(str(wrapper))} serve {quote_exec_word(str(model))} \\
    --served-model-name glm-5 \\
    --host 127.0.0.1 --port {port} \\
    --tensor-parallel-size 8 \\
    --max-model-len {max_model_len} \\
    --gpu-memory-utilization {gpu_memory_utilization:.2f} \\
    --trust-remote-code
Restart={restart}
RestartSec=1
TimeoutStopSec=10
"""


def offline_gpu_args() -> list[str]:
    """The planner flags that describe the seeds' GPUs where no NVML is at hand."""
    weights_total = SEED_WEIGHTS_GIB_PER_GPU * SEED_GPU_COUNT
    return [
        "--gpu-memory",
        f"{SEED_GPU_GIB}GiB",
        "--gpu-count",
        str(SEED_GPU_COUNT),
        "--weights-bytes",
        f"{weights_total:.2f}GiB",
    ]
