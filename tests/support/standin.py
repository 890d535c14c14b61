"""A stand-in for `vllm serve` where no GPU is at hand: vLLM 0.33.0's real log lines and HTTP API.

    python -m tests.support.standin serve MODEL [vLLM's flags ...]

It reads --max-model-len (int, 1k/1K forms, auto/-1), --port, --host, --api-key, --served-model-name,
--gpu-memory-utilization, --kv-cache-memory-bytes, --tensor-parallel-size/-tp, --block-size and
--kv-cache-dtype, ignores every other vLLM flag, prints an 8-GPU GLM-5-style start with vLLM's own
format strings (GPU wording; each line carries the file:line it comes from in vLLM 0.33.0) and then
serves, on --host (default 127.0.0.1, not vLLM's 0.0.0.0), /health, /version, /v1/models, /tokenize,
/v1/completions, /v1/chat/completions (streaming too) and /metrics. Request validation, error bodies
and 401s follow vLLM 0.33.0 (renderers/params.py, serve/middleware/authenticate.py); response bodies
have the fields of the captured real bodies (tests/data/vllm-logs/http/).

What it cannot be: tracebacks are cut to the raising frame; the tokenizer is one token per
whitespace-separated word (chat: one token per message role, its words, one for the reply); the
text generated is a fixed word cycle; pids of the engine and workers are the real pid plus an offset.

Memory follows vLLM's accounting per GPU: requested = total x gpu_memory_utilization; KV budget =
requested - (weights + non-torch) - activation peak - CUDA-graph estimate (or --kv-cache-memory-bytes);
blocks = budget // (block_size x bytes_per_token); the fit check and the estimated maximum model
length hold one block back (the null block), as in kv_cache_planning.py.

Environment (all optional):
  CTXMGR_STANDIN_TIME_SCALE         multiply the (already compressed, ~5 s) start timeline; 0 = instant
  CTXMGR_STANDIN_KV_CAPACITY_TOKENS  tokens one request may hold: sets the KV budget, so a larger
                                     max_model_len fails with vLLM's KV-too-small error and estimate
  CTXMGR_STANDIN_MAX_POSITION       the model's derived max_model_len (default 202752, GLM-5); a larger
                                     --max-model-len fails with vLLM's ValidationError unless
                                     VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
  CTXMGR_STANDIN_FAIL               cuda_oom | free_memory | hang | crash
                                     (hang: loading lines, then silence; crash: SIGKILL mid-load)
  CTXMGR_STANDIN_GPU_TOTAL_GIB      per-GPU total memory (default 139.81, an H200)
  CTXMGR_STANDIN_WEIGHTS_GIB        per-GPU weights (default 88.47, GLM-5 FP8 over 8 GPUs)
  CTXMGR_STANDIN_ACTIVATION_GIB     activation peak while profiling (default 5.12)
  CTXMGR_STANDIN_CUDA_GRAPH_GIB     CUDA-graph estimate (default 1.37)
  CTXMGR_STANDIN_KV_BYTES_PER_TOKEN KV bytes per token per GPU (default 100152: GLM-5, MLA + indexer, TP 8)
  CTXMGR_STANDIN_BLOCK_SIZE         default block size when --block-size is absent (default 64, FlashMLA)
  CTXMGR_STANDIN_ARCHITECTURE       default GlmMoeDsaForCausalLM
  CTXMGR_STANDIN_SHARDS             safetensors shards to "load" (default 141)
  CTXMGR_STANDIN_EOS_AFTER          tokens generated before a natural stop unless ignore_eos (default 16)
  CTXMGR_STANDIN_TOKEN_DELAY_S      seconds per streamed token (default 0.002)
  VLLM_CACHE_ROOT                   where vLLM keeps its torch.compile cache: set, the stand-in keeps one
                                     there too, keyed by the config (max_model_len in it, as in vLLM's
                                     compute_hash): a config compiled before loads from it (vLLM's cache
                                     hit line), a new one compiles cold (its miss lines, a longer phase,
                                     and a higher profiling peak: CTXMGR_STANDIN_COLD_PEAK_GIB).
                                     Unset: no cache and no cache lines (every start compiles alike)
  CTXMGR_STANDIN_COLD_PEAK_GIB      a cold compile's extra activation peak, charged as vLLM 0.33.0 charges
                                     it (the compile runs inside memory_profiling, gpu_worker.py:L685-L700;
                                     vLLM #54122, #54383): that boot's KV budget is this much smaller
                                     (default 1.64: ~5% of the default warm budget, as #54383 measured)
  VLLM_API_KEY                      the API key when --api-key is absent, as in vLLM
  CTXMGR_STANDIN_ENGINE_SURVIVES    1: a real child "VLLM::EngineCore" that outlives the API server (vLLM
                                     #55510), so a stop under KillMode=process leaves it behind
  CTXMGR_STANDIN_VLLM_VERSION       the release it says it is (default 0.33.0): banner, engine line and
                                     /version; 0.11.x prints 0.11.0's one-line banner instead of the art
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# vllm.__version__ (vllm/_version.py), which the banner (entrypoints/common/startup.py:L21), the engine's
# config line (v1/engine/core.py:L140) and GET /version print; CTXMGR_STANDIN_VLLM_VERSION makes the
# stand-in say it is another release (an upgraded or older vLLM) while its other lines stay 0.33.0's
VLLM_VERSION = os.environ.get("CTXMGR_STANDIN_VLLM_VERSION") or "0.33.0"
GIB = 1 << 30
_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "a",
    "model",
    "serves",
)
_VOCAB_SIZE = 154_880


# ---------------------------------------------------------------- arguments


def human_readable_int(value: str) -> int:
    """vLLM's parser for 1k / 1K / 25.6k (vllm/utils/argparse_utils.py); the name shows in argparse errors."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in "kmgt":
            return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
        try:
            return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))
        except ValueError as error:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use {number}"
                f"{suffix.lower()} instead?"
            ) from error
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm serve", usage="vllm serve [model_tag] [options]", add_help=False
    )
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    parser.add_argument("--max-model-len", type=human_readable_int_or_auto)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host")
    parser.add_argument("--api-key", nargs="+")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.92)
    parser.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=human_readable_int)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--kv-cache-dtype", default="auto")
    # vLLM's own multi-node mode (config/parallel.py: nnodes, node_rank, master_addr, master_port)
    parser.add_argument("--nnodes", "-n", type=int, default=1)
    parser.add_argument("--node-rank", "-r", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29501)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--distributed-timeout-seconds", type=int)
    # `--load-format ipc_cache` maps a `vllm preload` daemon's weights (weight_cache/ipc_loader.py)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--model-loader-extra-config")
    return parser


@dataclass
class Settings:
    """What the stand-in was asked for: vLLM's flags plus the scenario from the environment."""

    model: str
    served_model_names: list[str]
    max_model_len_arg: int | None
    host: str
    port: int
    api_keys: list[str]
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    tensor_parallel_size: int
    block_size: int
    kv_cache_dtype: str
    non_default_args: dict[str, Any]
    time_scale: float = 1.0
    fail: str | None = None
    derived_max_model_len: int = 202_752
    kv_capacity_tokens: int | None = None
    gpu_total_gib: float = 139.81
    weights_gib: float = 88.47
    activation_gib: float = 5.12
    cuda_graph_gib: float = 1.37
    kv_bytes_per_token: int = 100_152
    architecture: str = "GlmMoeDsaForCausalLM"
    shards: int = 141
    eos_after: int = 16
    token_delay_s: float = 0.002
    allow_long_max_model_len: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False
    pipeline_parallel_size: int = 1
    # None: torch's default process-group timeout (30 min), as in vLLM
    distributed_timeout_s: int | None = None
    cache_root: str | None = None  # VLLM_CACHE_ROOT: where the torch.compile cache is kept
    cold_peak_gib: float = 1.64  # a cold compile's extra profiling peak (CTXMGR_STANDIN_COLD_PEAK_GIB)
    compiled_cold: bool = False  # this start's compile missed the cache: its peak is the higher one
    load_format: str = "auto"  # ipc_cache: the weights are a `vllm preload` daemon's, mapped, not read

    @property
    def max_model_len(self) -> int:
        """The context this start runs at (the derived one for none or auto)."""
        arg = self.max_model_len_arg
        return self.derived_max_model_len if arg in (None, -1) else arg

    @property
    def world_size(self) -> int:
        """TP x PP ranks (config/parallel.py world_size)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Ranks on this node: the world's ranks spread evenly over --nnodes (multiproc_executor.py:L303)."""
        return max(1, self.world_size // max(1, self.nnodes))

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """Each pipeline stage holds its share of the layers (an even split), so its GPUs hold that
        share of a token's KV bytes."""
        return self.kv_bytes_per_token // max(1, self.pipeline_parallel_size)

    def worker_name(self, rank: int) -> str:
        """The worker's log prefix as vLLM names it (multiproc_executor.py:L1214-L1222): _PP<stage>
        where PP > 1, then _TP<rank in its stage> where TP > 1."""
        tp = max(1, self.tensor_parallel_size)
        name = "Worker"
        if self.pipeline_parallel_size > 1:
            name += f"_PP{rank // tp}"
        if tp > 1:
            name += f"_TP{rank % tp}"
        return name

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.local_world_size
        return range(first, first + self.local_world_size)


def settings_from(argv: list[str], environ: dict[str, str]) -> Settings:
    # `vllm serve MODEL --flags`: take the model first, so that an unknown flag's value is never taken for it
    leading_model = argv[0] if argv and not argv[0].startswith("-") else None
    args, _unknown = _parser().parse_known_args(argv[1:] if leading_model else argv)  # exits 2 like vLLM
    model = leading_model or args.model or args.model_tag
    if not model:
        _parser().error("the following arguments are required: model_tag")
    env = environ.get
    non_default: dict[str, Any] = {"model_tag": model}
    for name in ("host", "port", "api_key"):
        value = getattr(args, name)
        if value is not None and not (name == "port" and value == 8000):
            non_default[name] = "***" if name == "api_key" else value
    non_default["model"] = model
    for name, default in (
        ("max_model_len", None),
        ("served_model_name", None),
        # the multi-node flags, in the order the real 0.32 line shows them (node 0 of two)
        ("master_addr", "127.0.0.1"),
        ("master_port", 29501),
        ("nnodes", 1),
        ("node_rank", 0),
        ("headless", False),
        ("distributed_timeout_seconds", None),
        ("tensor_parallel_size", 1),
        ("pipeline_parallel_size", 1),
        ("gpu_memory_utilization", 0.92),
        ("kv_cache_memory_bytes", None),
        ("block_size", None),
        ("kv_cache_dtype", "auto"),
        ("load_format", "auto"),
    ):
        if getattr(args, name) != default:
            non_default[name] = getattr(args, name)
    api_keys = [key for key in (args.api_key or [env("VLLM_API_KEY", "")]) if key]
    capacity = env("CTXMGR_STANDIN_KV_CAPACITY_TOKENS")
    return Settings(
        model=model,
        served_model_names=args.served_model_name or [model],
        max_model_len_arg=args.max_model_len,
        host=args.host or "127.0.0.1",
        port=args.port,
        api_keys=api_keys,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        block_size=args.block_size or int(env("CTXMGR_STANDIN_BLOCK_SIZE", "64")),
        kv_cache_dtype=args.kv_cache_dtype,
        non_default_args=non_default,
        time_scale=float(env("CTXMGR_STANDIN_TIME_SCALE", "1")),
        fail=env("CTXMGR_STANDIN_FAIL") or None,
        derived_max_model_len=int(env("CTXMGR_STANDIN_MAX_POSITION", "202752")),
        kv_capacity_tokens=int(capacity) if capacity else None,
        gpu_total_gib=float(env("CTXMGR_STANDIN_GPU_TOTAL_GIB", "139.81")),
        weights_gib=float(env("CTXMGR_STANDIN_WEIGHTS_GIB", "88.47")),
        activation_gib=float(env("CTXMGR_STANDIN_ACTIVATION_GIB", "5.12")),
        cuda_graph_gib=float(env("CTXMGR_STANDIN_CUDA_GRAPH_GIB", "1.37")),
        kv_bytes_per_token=int(env("CTXMGR_STANDIN_KV_BYTES_PER_TOKEN", "100152")),
        architecture=env("CTXMGR_STANDIN_ARCHITECTURE", "GlmMoeDsaForCausalLM"),
        shards=int(env("CTXMGR_STANDIN_SHARDS", "141")),
        eos_after=int(env("CTXMGR_STANDIN_EOS_AFTER", "16")),
        token_delay_s=float(env("CTXMGR_STANDIN_TOKEN_DELAY_S", "0.002")),
        allow_long_max_model_len=env("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true"),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
        distributed_timeout_s=args.distributed_timeout_seconds,
        cache_root=env("VLLM_CACHE_ROOT") or None,
        cold_peak_gib=float(env("CTXMGR_STANDIN_COLD_PEAK_GIB", "1.64")),
        load_format=args.load_format,
    )


# ---------------------------------------------------------------- memory, as vLLM counts it


def format_gib(num_bytes: float) -> str:
    """vllm/utils/mem_utils.py format_gib: round to two decimals, printed with str()."""
    return f"{round(num_bytes / GIB, 2)}"


@dataclass(frozen=True)
class KvPlan:
    """The KV-cache numbers one start arrives at (per GPU)."""

    available_bytes: int
    page_bytes: int  # one block over all layers
    block_size: int
    num_blocks: int  # available // page, the null block included (as in vllm:cache_config_info)
    max_model_len: int  # after auto-fit
    needed_bytes: int  # for one request at max_model_len
    estimated_max_model_len: int  # vLLM's binary search result, 0 if not one block fits
    fits: bool

    @property
    def max_concurrency(self) -> float:
        """kv_cache_utils.get_kv_cache_capacity: blocks over the blocks one full-length request needs."""
        return self.num_blocks / max(1, math.ceil(self.max_model_len / self.block_size))

    @property
    def kv_cache_tokens(self) -> int:
        return int(self.max_concurrency * self.max_model_len)


def plan_kv(settings: Settings, max_model_len: int, available_bytes: int | None = None) -> KvPlan:
    """`available_bytes`: the budget when another node's rank has less than this one (vLLM plans the
    KV cache with the smallest rank's budget, v1/core/kv_cache_planning.py get_kv_cache_configs)."""
    page = settings.block_size * settings.kv_bytes_per_token_per_gpu
    if available_bytes is not None:
        available = available_bytes
    elif settings.kv_capacity_tokens is not None:
        available = (settings.kv_capacity_tokens // settings.block_size + 1) * page  # + the null block
    elif settings.kv_cache_memory_bytes is not None:
        available = settings.kv_cache_memory_bytes
    else:
        available = int(requested_bytes(settings) - non_kv_bytes(settings))
    usable = available - page  # the BlockPool keeps one null block
    fit_blocks = max(0, usable // page)
    target = settings.derived_max_model_len if max_model_len == -1 else max_model_len
    estimated = min(target, fit_blocks * settings.block_size)
    if max_model_len == -1:
        target = estimated  # auto-fit: the largest length one request fits in
    needed = math.ceil(max(target, 1) / settings.block_size) * page
    return KvPlan(
        available_bytes=available,
        page_bytes=page,
        block_size=settings.block_size,
        num_blocks=max(0, available // page),
        max_model_len=target,
        needed_bytes=needed,
        estimated_max_model_len=estimated,
        fits=available > 0 and needed <= usable and target > 0,
    )


def requested_bytes(settings: Settings) -> float:
    return math.ceil(settings.gpu_total_gib * GIB * settings.gpu_memory_utilization)


def activation_peak_gib(settings: Settings) -> float:
    """The profiling pass's peak: a cold compile's temporaries are in it (gpu_worker.py:L685-L700: the
    compile runs inside memory_profiling; mem_utils.py transient_peak_headroom counts them)."""
    return settings.activation_gib + (settings.cold_peak_gib if settings.compiled_cold else 0.0)


def non_kv_bytes(settings: Settings) -> float:
    return (settings.weights_gib + 0.83 + activation_peak_gib(settings) + settings.cuda_graph_gib) * GIB


# ---------------------------------------------------------------- log lines


class VllmLog:
    """Prints lines the way vLLM's logger does: `(Process pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def pid_of(self, process: str) -> int:
        if process == "APIServer":
            return self.pid
        if process == "EngineCore":
            return self.pid + 211
        if process == "MainProcess":
            return self.pid
        # a worker logs as `Worker` until its groups are formed, then by its ranks: one process each
        for rank in self.settings.local_ranks:
            if process == self.settings.worker_name(rank):
                return self.pid + 400 + rank
        return self.pid + 400 + self.settings.local_ranks[0]

    def info(self, process: str, fileinfo: str, message: str, level: str = "INFO") -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        with self.lock:
            for part in message.split("\n"):
                print(
                    f"({process} pid={self.pid_of(process)}) {level} {stamp} [{fileinfo}] {part}", flush=True
                )

    def workers(self, fileinfo: str, message: str) -> None:
        """One line from each of this node's workers (every TP rank on one node)."""
        for rank in self.settings.local_ranks:
            self.info(self.settings.worker_name(rank), fileinfo, message)

    def raw(self, text: str, stream: Any = None) -> None:
        with self.lock:
            print(text, file=stream or sys.stdout, flush=True)

    def error_block(self, process: str, fileinfo: str, header: str, frames: list[str], error: str) -> None:
        """logger.exception: the header and the traceback, every line with the prefix."""
        body = "\n".join([header, "Traceback (most recent call last):", *frames, error])
        self.info(process, fileinfo, body, level="ERROR")

    def traceback(self, frames: list[str], error: str, preamble: str | None = None) -> None:
        lines = ([preamble] if preamble else []) + ["Traceback (most recent call last):", *frames, error]
        self.raw("\n".join(lines), sys.stderr)

    def sleep(self, seconds: float) -> None:
        if self.settings.time_scale > 0:
            time.sleep(seconds * self.settings.time_scale)


_VLLM = "/opt/vllm/venv/lib/python3.12/site-packages/vllm"
_ENGINE_FRAMES = [
    f'  File "{_VLLM}/v1/engine/core.py", line 1555, in run_engine_core',
    "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
]
_KV_CHECK_FRAMES = [
    *_ENGINE_FRAMES,
    f'  File "{_VLLM}/v1/engine/core.py", line 321, in _initialize_kv_caches',
    "    kv_cache_configs = get_kv_cache_configs(",
    f'  File "{_VLLM}/v1/core/kv_cache_planning.py", line 1554, in get_kv_cache_configs',
    "    _check_enough_kv_cache_memory(",
    f'  File "{_VLLM}/v1/core/kv_cache_planning.py", line 77, in _check_enough_kv_cache_memory',
    "    raise ValueError(",
]
_API_FRAMES = [
    f'  File "{_VLLM}/v1/engine/utils.py", line 1473, in wait_for_engine_startup',
    "    raise RuntimeError(",
]
_WORKER_FRAMES = [
    f'  File "{_VLLM}/v1/executor/multiproc_executor.py", line 1023, in worker_main',
    "    worker = WorkerProc(*args, **kwargs)",
]
_CONFIG_FRAMES = [
    f'  File "{_VLLM}/engine/arg_utils.py", line 1955, in create_model_config',
    "    return ModelConfig(",
    '  File "/opt/vllm/venv/lib/python3.12/site-packages/pydantic/_internal/_dataclasses.py", line 121, '
    "in __init__",
    "    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)",
]


class StartFailed(Exception):
    """The start ended the way vLLM's would: the exit status to return."""

    def __init__(self, exit_status: int) -> None:
        super().__init__(exit_status)
        self.exit_status = exit_status


def _engine_failed(log: VllmLog, error: str) -> None:
    """The tail every failed engine start prints: the core's exception, then the API server's."""
    log.traceback(_KV_CHECK_FRAMES[:2], error, preamble="Process EngineCore:")
    log.traceback(
        _API_FRAMES,
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
        "{'EngineCore': 1}",
    )
    raise StartFailed(1)


def _worker_failed(log: VllmLog, frames: list[str], error: str, process: str = "Worker_TP0") -> None:
    """`process`: `Worker` while the worker's groups are not formed (its prefix until then)."""
    log.error_block(process, "multiproc_executor.py:1057", "WorkerProc failed to start.", frames, error)
    worker_error = (
        "Exception: WorkerProc initialization failed due to an exception in a background process. See stack "
        "trace for root cause."
    )
    log.error_block("EngineCore", "core.py:1584", "EngineCore failed to start.", _ENGINE_FRAMES, worker_error)
    _engine_failed(log, worker_error)


def _validation_error(log: VllmLog, config: str, lines: list[str], error_type: str) -> None:
    log.traceback(
        _CONFIG_FRAMES,
        f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {config}\n"
        + "\n".join(lines)
        + f"\n    For further information visit https://errors.pydantic.dev/2.14/v/{error_type}",
    )
    raise StartFailed(1)


def run_start(settings: Settings, log: VllmLog, group: HeadGroup | None = None) -> KvPlan:
    """Print one start up to the engine being ready; raises StartFailed where vLLM would exit.
    With `group` (node 0 of --nnodes > 1), the other nodes' ranks join it, report their KV budget and
    warm up when it says so."""
    model, tp = settings.model, settings.tensor_parallel_size
    if VLLM_VERSION.startswith("0.11."):
        # 0.11.0 has no banner art: entrypoints/openai/api_server.py:L1839 of 0.11.0 (vllm-facts.md 1.x)
        log.info("APIServer", "api_server.py:1839", f"vLLM API server version {VLLM_VERSION}")
    else:
        banner = (
            f"\n       █     █     █▄   ▄█\n ▄▄ ▄█ █     █     █ ▀▄▀ █  version {VLLM_VERSION}\n"
            f"  █▄█▀ █     █     █     █  model   {model}\n   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀\n"
        )
        log.info("APIServer", "startup.py:38", banner)
    log.info("APIServer", "startup.py:96", f"non-default args: {settings.non_default_args}")
    log.sleep(0.3)
    log.info("APIServer", "model.py:744", f"Resolved architecture: {settings.architecture}")

    max_model_len = settings.max_model_len_arg
    derived = settings.derived_max_model_len
    if max_model_len is not None and max_model_len > derived:
        msg = (
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={float(derived)} or model_max_length=None in model's config.json)."
        )
        warning = (
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
            "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model "
            "uses absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA "
            "array out-of-bounds error."
        )
        if settings.allow_long_max_model_len:
            log.info("APIServer", "model.py:2678", f"{msg} {warning}", level="WARNING")
        else:
            _validation_error(
                log,
                "ModelConfig",
                [
                    f"  Value error, {msg} To allow overriding this maximum, set the env var "
                    f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {warning} [type=value_error, "
                    "input_value=ArgsKwargs((), {'model': ...}), input_type=ArgsKwargs]"
                ],
                "value_error",
            )
    log.info(
        "APIServer",
        "model.py:2170",
        f"Using max model len {derived if max_model_len in (None, -1) else max_model_len}",
    )
    utilization = settings.gpu_memory_utilization
    if not 0 < utilization <= 1:
        constraint, kind = (
            ("less than or equal to 1", "less_than_equal")
            if utilization > 1
            else ("greater than 0", "greater_than")
        )
        _validation_error(
            log,
            "CacheConfig",
            [
                "gpu_memory_utilization",
                f"  Input should be {constraint} [type={kind}, input_value={utilization}, input_type=float]",
            ],
            kind,
        )
    log.info("APIServer", "scheduler.py:310", "Chunked prefill is enabled with max_num_batched_tokens=8192.")
    log.sleep(0.4)
    log.info(
        "EngineCore",
        "core.py:139",
        f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model='{model}', "
        f"speculative_config=None, tokenizer='{model}', skip_tokenizer_init=False, tokenizer_mode=auto, "
        "revision=None, tokenizer_revision=None, trust_remote_code=False, dtype=torch.bfloat16, max_seq_len="
        f"{derived if max_model_len in (None, -1) else max_model_len}, download_dir=None, "
        f"load_format={settings.load_format}, "
        f"tensor_parallel_size={tp}, pipeline_parallel_size={settings.pipeline_parallel_size}, "
        "data_parallel_size=1, "
        "decode_context_parallel_size=1, disable_custom_all_reduce=False, quantization=fp8, "
        f"enforce_eager=False, kv_cache_dtype={settings.kv_cache_dtype}, device_config=cuda, seed=0, "
        f"served_model_name={settings.served_model_names[0]}, enable_prefix_caching=True, "
        "enable_chunked_prefill=True",
    )
    total = settings.gpu_total_gib * GIB
    if settings.fail == "free_memory":
        free = total * 0.6
        _worker_failed(
            log,
            [
                *_WORKER_FRAMES,
                f'  File "{_VLLM}/v1/worker/utils.py", line 762, in request_memory',
                "    raise ValueError(",
            ],
            f"ValueError: Free memory on device cuda:0 ({format_gib(free)}/{format_gib(total)} GiB) on "
            f"startup is less than desired GPU memory utilization ({utilization}, "
            f"{format_gib(requested_bytes(settings))} GiB). Decrease GPU memory utilization or reduce GPU "
            "memory used by other processes.",
        )
    if group is not None:
        group.form(log)
    _load_and_profile(settings, log)
    kv = plan_kv(settings, -1 if max_model_len == -1 else (max_model_len or derived))
    _memory_lines(settings, log, kv)
    if group is not None:
        smallest = min([kv.available_bytes, *group.gather("kv_bytes", log)])
        if smallest < kv.available_bytes:
            kv = plan_kv(settings, -1 if max_model_len == -1 else (max_model_len or derived), smallest)
    try:
        _check_kv(settings, log, kv, max_model_len)
    except StartFailed:
        if group is not None:
            group.close()  # the other nodes' ranks lose node 0
        raise
    log.info(
        "EngineCore",
        "kv_cache_utils.py:1147",
        f"GPU KV cache size: {kv.kv_cache_tokens:,} tokens, Maximum concurrency for {kv.max_model_len:,} "
        f"tokens per request: {kv.max_concurrency:.2f}x",
    )
    if group is not None:
        group.broadcast({"warm_up": True})
    _warm_up(settings, log, kv)
    if group is not None:
        group.gather("warmed_up", log)
    log.info(
        "EngineCore",
        "core.py:405",
        "init engine (profile, create kv cache, warmup model) took 61.84 s (compilation: 48.08 s)",
    )
    return kv


def _load_and_profile(settings: Settings, log: VllmLog) -> None:
    """This node's workers load their shard of the weights and profile (every node's ranks do)."""
    model = settings.model
    log.sleep(0.3)
    log.workers("gpu_model_runner.py:4978", f"Starting to load model {model}...")
    if settings.load_format == "ipc_cache":
        _map_daemon_weights(settings, log)
        return
    shards = max(1, settings.shards)
    log.raw(
        f"Loading safetensors checkpoint shards:   0% Completed | 0/{shards} [00:00<?, ?it/s]", sys.stderr
    )
    for done in range(1, shards + 1):
        log.sleep(2.5 / shards)
        if settings.fail in ("hang", "crash", "cuda_oom") and done == shards // 2:
            _fail_while_loading(settings, log)
        elapsed = 4.32 * done
        log.raw(
            f"Loading safetensors checkpoint shards: {round(100 * done / shards):3d}% Completed | {done}/"
            f"{shards} [{_clock(elapsed)}<{_clock(4.32 * (shards - done))},  4.32s/it]",
            sys.stderr,
        )
    load_seconds = 4.32 * shards + 0.41  # what a real GLM-5 load takes, whatever the time scale
    log.workers("default_loader.py:506", f"Loading weights took {load_seconds:.2f} seconds")
    log.workers(
        "gpu_model_runner.py:5088",
        f"Model loading took {format_gib(settings.weights_gib * GIB)} GiB memory and "
        f"{load_seconds + 7.18:.6f} seconds",
    )
    log.sleep(0.8)
    log.info(
        settings.worker_name(settings.local_ranks[0]),
        "backends.py:1187",
        "Dynamo bytecode transform time: 9.87 s",
    )
    _torch_compile(settings, log)
    log.workers(
        "gpu_model_runner.py:6304",
        "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)",
    )
    log.sleep(0.4)


MAPPED_TENSORS = 1791  # what the daemon serves one rank (GLM-5's parameters and buffers, made up)


def _map_daemon_weights(settings: Settings, log: VllmLog) -> None:
    """`--load-format ipc_cache`, zero_copy (vLLM 0.33.0): no shard is read; the IPC loader builds the
    model on the meta device and maps the daemon's tensors, then logs "Mapped %d tensors from the weight
    cache daemon (%s mode)" (model_loader/weight_cache/ipc_loader.py:L321-L325). gpu_model_runner still
    prints "Model loading took" (L5088-L5092), its memory torch.cuda.max_memory_allocated's growth
    (platforms/cuda.py:L369-L374, utils/mem_utils.py:L82-L98): the mapped weights are not the caching
    allocator's, so next to nothing."""
    log.sleep(0.05)
    log.workers(
        "ipc_loader.py:321", f"Mapped {MAPPED_TENSORS} tensors from the weight cache daemon (zero_copy mode)"
    )
    log.workers("gpu_model_runner.py:5088", "Model loading took 0.01 GiB memory and 1.934512 seconds")
    log.sleep(0.8)
    _torch_compile(settings, log)
    log.workers(
        "gpu_model_runner.py:6304",
        "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)",
    )
    log.sleep(0.4)


COLD_COMPILE_S = 2.0  # the extra seconds (before the time scale) a compile with no cache entry takes
WARM_COMPILE_S = 0.2


def _torch_compile(settings: Settings, log: VllmLog) -> None:
    """torch.compile's end: with VLLM_CACHE_ROOT, from the cache where this config compiled before (a
    warm start), else compiled and then kept there (a cold one, whose profiling peak is higher:
    Settings.compiled_cold). The lines are vLLM 0.33.0's: compilation/backends.py:L310 (loaded from the
    cache), L417 (compiled), compilation/monitor.py:L62 (the total)."""
    if settings.cache_root is None:
        log.workers("monitor.py:62", "torch.compile took 38.21 s in total")
        return
    config = (
        f"{settings.model}|{settings.max_model_len}|{settings.tensor_parallel_size}|"
        f"{settings.pipeline_parallel_size}|{settings.kv_cache_dtype}"
    )
    entry = os.path.join(settings.cache_root, "torch_compile_cache", f"{zlib.crc32(config.encode()):08x}")
    if os.path.isdir(entry):
        log.sleep(WARM_COMPILE_S)
        log.workers(
            "backends.py:310",
            "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 9.150 s",
        )
        log.workers("monitor.py:62", "torch.compile took 12.34 s in total")
        return
    log.sleep(COLD_COMPILE_S)
    settings.compiled_cold = True
    log.workers("backends.py:417", "Compiling a graph for compile range (1, 8192) takes 20.51 s")
    log.workers("monitor.py:62", "torch.compile took 38.21 s in total")
    os.makedirs(entry, exist_ok=True)


def _memory_lines(settings: Settings, log: VllmLog, kv: KvPlan) -> None:
    """This node's workers report their KV budget (gpu_worker.py determine_available_memory)."""
    total = settings.gpu_total_gib * GIB
    utilization = settings.gpu_memory_utilization
    if settings.kv_cache_memory_bytes is not None:
        log.workers(
            "gpu_worker.py:676",
            f"Initial free memory {format_gib(total - 0.55 * GIB)} GiB, reserved "
            f"{format_gib(settings.kv_cache_memory_bytes)} GiB memory for KV Cache as specified by "
            "kv_cache_memory_bytes config and skipped memory profiling. This does not respect the "
            "gpu_memory_utilization config. Only use kv_cache_memory_bytes config when you want manual "
            "control of KV cache memory size. If OOM'ed, check the difference of initial free memory "
            "between the current run and the previous run where kv_cache_memory_bytes is suggested and "
            "update it correspondingly.",
        )
    else:
        log.workers(
            "gpu_model_runner.py:6409",
            f"Estimated CUDA graph memory: {settings.cuda_graph_gib:.2f} GiB total",
        )
        log.workers("gpu_worker.py:772", f"Available KV cache memory: {format_gib(kv.available_bytes)} GiB")
        delta = settings.cuda_graph_gib * GIB / total
        log.workers(
            "gpu_worker.py:787",
            "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
            f"--gpu-memory-utilization={utilization:.4f} is equivalent to --gpu-memory-utilization="
            f"{round(utilization - delta, 4):.4f} without CUDA graph memory profiling. To maintain the same "
            "effective KV cache size as before, increase --gpu-memory-utilization to "
            f"{min(round(utilization + delta, 4), 1.0):.4f}. To disable, set "
            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.",
        )


def _warm_up(settings: Settings, log: VllmLog, kv: KvPlan) -> None:
    """This node's workers capture CUDA graphs once node 0 set the KV cache up (compile_or_warm_up_model,
    gpu_worker.py:L933-L1066): on a headless node, the last lines of its start."""
    log.sleep(0.3)
    log.raw(
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|██████████| 51/51 [00:04<00:00, "
        "11.52it/s]",
        sys.stderr,
    )
    log.raw(
        "Capturing CUDA graphs (decode, FULL): 100%|██████████| 35/35 [00:02<00:00, 14.87it/s]", sys.stderr
    )
    graph_taken = settings.cuda_graph_gib * 1.03
    log.workers("gpu_model_runner.py:6516", f"Graph capturing finished in 7 secs, took {graph_taken:.2f} GiB")
    if settings.kv_cache_memory_bytes is None:
        diff = abs(graph_taken - settings.cuda_graph_gib)
        log.workers(
            "gpu_worker.py:1003",
            f"CUDA graph pool memory: {round(graph_taken, 2)} GiB (actual), "
            f"{round(settings.cuda_graph_gib, 2)} GiB (estimated), difference: {round(diff, 2)} GiB ("
            f"{100 * diff / graph_taken:.1f}%).",
        )
        _suggestion(settings, log, kv, graph_taken)


# ---------------------------------------------------------------- several nodes (--nnodes, --headless)
#
# vLLM forms one torch.distributed group over every node's ranks: node 0's first worker holds a TCPStore
# at --master-addr:--master-port, every other node's ranks connect to it, and node 0's engine then asks
# each rank for its KV budget (the smallest decides), and each rank to warm up. Here that is a line
# protocol over one TCP connection per node, so that a missing node, or a node 0 that is not there,
# is a real absence on the network.

_DEFAULT_DISTRIBUTED_TIMEOUT_S = 1800  # torch's default process-group timeout (30 min)
_STORE_FRAMES = [
    *_WORKER_FRAMES,
    f'  File "{_VLLM}/distributed/parallel_state.py", line 1966, in init_distributed_environment',
    "    torch.distributed.init_process_group(",
]


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def _receive(reader: Any) -> dict[str, Any] | None:
    """One message, or None when the other side closed (or the timeout passed)."""
    try:
        line = reader.readline()
    except (OSError, ValueError):
        return None
    if not line:
        return None
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None


@dataclass
class HeadGroup:
    """Node 0's side: where the other nodes' ranks join (torch's TCPStore master, in a worker)."""

    settings: Settings
    listener: socket.socket
    peers: list[tuple[socket.socket, Any]] = field(default_factory=list)

    @classmethod
    def listen(cls, settings: Settings) -> HeadGroup:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((settings.master_addr, settings.master_port))
        listener.listen(16)
        return cls(settings, listener)

    @property
    def timeout_s(self) -> float:
        return float(self.settings.distributed_timeout_s or _DEFAULT_DISTRIBUTED_TIMEOUT_S)

    def form(self, log: VllmLog) -> None:
        """Wait up to the timeout for every node's ranks, as TCPStore's master does; torch's
        DistStoreError (`N/M clients joined`) when some do not come."""
        settings = self.settings
        world_size = settings.world_size
        address = f"tcp://{settings.master_addr}:{settings.master_port}"
        for rank in settings.local_ranks:
            log.info(
                "Worker",
                "parallel_state.py:1930",
                f"world_size={world_size} rank={rank} local_rank={rank - settings.local_ranks[0]} "
                f"distributed_init_method={address} backend=nccl",
            )
        joined = settings.local_world_size
        deadline = time.monotonic() + self.timeout_s
        while len(self.peers) < settings.nnodes - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                _worker_failed(
                    log,
                    _STORE_FRAMES,
                    f"torch.distributed.DistStoreError: Timed out after {int(self.timeout_s)} seconds "
                    f"waiting for clients. {joined}/{world_size} clients joined.",
                    process="Worker",
                )
            self.listener.settimeout(min(remaining, 0.5))
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(max(1.0, remaining))
            reader = connection.makefile("r", encoding="utf-8")
            hello = _receive(reader)
            if hello is None or "hello" not in hello:
                connection.close()
                continue
            self.peers.append((connection, reader))
            joined += int(hello.get("ranks", 1))
        self.broadcast({"formed": True})
        _rank_assigned(settings, log)

    def broadcast(self, message: dict[str, Any]) -> None:
        for connection, _ in self.peers:
            with contextlib.suppress(OSError):
                _send(connection, message)

    def gather(self, key: str, log: VllmLog) -> list[Any]:
        """One `key` from each node; a node that went away fails the start as vLLM's engine does when a
        worker dies (gloo: the peer closed the connection)."""
        values = []
        for connection, reader in self.peers:
            connection.settimeout(None)
            message = _receive(reader)
            if message is None or key not in message:
                peer = connection.getpeername()[0] if _connected(connection) else "unknown"
                self.close()
                log.traceback(
                    _ENGINE_FRAMES,
                    f"RuntimeError: {_gloo_closed(peer, self.settings.master_port)}",
                    preamble="Process EngineCore:",
                )
                raise StartFailed(1)
            values.append(message[key])
        return values

    def close(self) -> None:
        for connection, _ in self.peers:
            connection.close()
        self.peers.clear()
        self.listener.close()


def _rank_assigned(settings: Settings, log: VllmLog) -> None:
    """The group is formed: the node's first rank says where it stands (parallel_state.py:L2385, once
    per node)."""
    first, tp = settings.local_ranks[0], max(1, settings.tensor_parallel_size)
    log.info(
        "Worker",
        "parallel_state.py:2385",
        f"rank {first} in world size {settings.world_size} is assigned as DP rank 0, "
        f"PP rank {first // tp}, PCP rank 0, TP rank {first % tp}, ETP rank {first % tp}, EP rank N/A, "
        "EPLB rank N/A",
    )


def _gloo_closed(peer: str, port: int) -> str:
    """gloo's error when the other side of a pair went away (torch's third_party/gloo tcp/pair.cc)."""
    return f"[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [{peer}]:{port}"


def _connected(connection: socket.socket) -> bool:
    try:
        connection.getpeername()
    except OSError:
        return False
    return True


def _connect_to_head(settings: Settings, timeout_s: float) -> socket.socket | None:
    """Connect to node 0's --master-addr:--master-port, retrying until the timeout (TCPStore client)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(
                (settings.master_addr, settings.master_port), timeout=max(0.1, deadline - time.monotonic())
            )
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


def _glog_stamp() -> str:
    """The time in torch's C++ log prefix: `MMDD HH:MM:SS.nnnnnnnnn`."""
    now = time.time()
    return time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e9):09d}"


def run_headless(settings: Settings, log: VllmLog) -> int:
    """A node with --node-rank > 0 and --headless: its ranks join node 0's group, load, report their KV
    budget and warm up when node 0 says so; no HTTP server (vllm/entrypoints/cli/serve.py run_headless).
    After that it prints nothing and keeps running, even when node 0 goes away, until it is stopped."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    max_model_len = settings.max_model_len_arg
    derived = settings.derived_max_model_len
    head = f"{settings.master_addr}:{settings.master_port}"
    log.info("MainProcess", "model.py:744", f"Resolved architecture: {settings.architecture}")
    log.info(
        "MainProcess",
        "model.py:2170",
        f"Using max model len {derived if max_model_len in (None, -1) else max_model_len}",
    )
    log.info(
        "MainProcess",
        "arg_utils.py:2514",
        f"Inferred data_parallel_rank 0 from node_rank {settings.node_rank}",
    )
    log.info(
        "MainProcess",
        "serve.py:224",
        f"Launching vLLM (v{VLLM_VERSION}) headless multiproc executor, with head node address {head} for "
        "torch.distributed process group.",
    )
    world_size = settings.world_size
    for rank in settings.local_ranks:
        log.info(
            "Worker",
            "parallel_state.py:1930",
            f"world_size={world_size} rank={rank} local_rank={rank - settings.local_ranks[0]} "
            f"distributed_init_method=tcp://{head} backend=nccl",
        )
    timeout_s = float(settings.distributed_timeout_s or _DEFAULT_DISTRIBUTED_TIMEOUT_S)
    connection = _connect_to_head(settings, timeout_s)
    if connection is None:
        # torch's store client logs the timeout, waits a random delay and tries once more
        # (tests/data/vllm-logs-multinode/no-node0-node1.log: 30 s, then 11.9 s, then 30 s)
        delay_ms = int(timeout_s * 400)
        timed_out = (
            f"The client socket has timed out after {int(timeout_s * 1000)}ms while trying to connect to "
            f"({settings.master_addr}, {settings.master_port})."
        )
        log.raw(f"[E{_glog_stamp()} socket.cpp:1028] [c10d] {timed_out}", sys.stderr)
        log.raw(
            f"[W{_glog_stamp()} TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
            f"{settings.master_addr}:{settings.master_port} - retrying (try=0, timeout="
            f"{int(timeout_s * 1000)}ms, delay={delay_ms}ms): {timed_out}",
            sys.stderr,
        )
        connection = _connect_to_head(settings, delay_ms / 1000)
    if connection is None:
        _headless_failed(
            log,
            "torch.distributed.DistNetworkError: The client socket has timed out after "
            f"{int(timeout_s * 1000)}ms while trying to connect to ({settings.master_addr}, "
            f"{settings.master_port}).",
        )
        return 1
    reader = connection.makefile("r", encoding="utf-8")
    _send(connection, {"hello": settings.node_rank, "ranks": settings.local_world_size})
    connection.settimeout(timeout_s)
    if _receive(reader) is None:  # node 0 gave up waiting for another node, or went away
        _headless_failed(
            log,
            f"torch.distributed.DistNetworkError: Connection reset by peer [{settings.master_addr}]:"
            f"{settings.master_port}",
        )
        return 1
    _rank_assigned(settings, log)
    _load_and_profile(settings, log)
    kv = plan_kv(settings, -1 if max_model_len == -1 else (max_model_len or derived))
    _memory_lines(settings, log, kv)
    connection.settimeout(None)
    _send(connection, {"kv_bytes": kv.available_bytes})
    decision = _receive(reader)
    # node 0 failing its start (its KV check with this node's budget, ...) is not seen here: like the
    # real headless node (tests/data/vllm-logs-multinode/kv-node1-node1.log), it prints nothing more
    # and keeps running until it is stopped
    if decision is not None and decision.get("warm_up"):
        _warm_up(settings, log, kv)
        with contextlib.suppress(OSError):
            _send(connection, {"warmed_up": True})
    stop.wait()
    connection.close()
    log.info("MainProcess", "multiproc_executor.py:587", "[shutdown] Executor: all workers exited gracefully")
    return 0


def _headless_failed(log: VllmLog, error: str) -> None:
    """A headless node's start ends in its worker: WorkerProc failed to start, then the executor's error."""
    log.error_block(
        "Worker",  # its groups are not formed: the prefix has no rank yet
        "multiproc_executor.py:1057",
        "WorkerProc failed to start.",
        _STORE_FRAMES,
        error,
    )
    log.traceback(
        [
            f'  File "{_VLLM}/v1/executor/multiproc_executor.py", line 215, in _init_executor',
            "    self.workers = WorkerProc.wait_for_ready(unready_workers)",
        ],
        "Exception: WorkerProc initialization failed due to an exception in a background process. See stack "
        "trace for root cause.",
    )


def _suggestion(settings: Settings, log: VllmLog, kv: KvPlan, graph_taken: float) -> None:
    total = settings.gpu_total_gib * GIB
    free = total - 0.55 * GIB
    consumed = (settings.weights_gib + 0.83) * GIB
    peak = activation_peak_gib(settings) * GIB
    non_kv = consumed + peak + graph_taken * GIB
    buffer = 150 * (1 << 20)
    to_requested = int(requested_bytes(settings) - non_kv - buffer)
    to_gpu = int(free - non_kv - buffer)
    log.workers(
        "gpu_worker.py:1066",
        f"Free memory on device ({format_gib(free)}/{format_gib(total)} GiB) on startup. Desired GPU memory "
        f"utilization is ({settings.gpu_memory_utilization}, {format_gib(requested_bytes(settings))} GiB). "
        f"Actual usage is {format_gib(consumed)} GiB for consumed memory (weights + non-torch), "
        f"{format_gib(peak)} GiB for peak activation, and {format_gib(graph_taken * GIB)} GiB for CUDAGraph "
        f"memory. Replace gpu_memory_utilization config with `--kv-cache-memory={to_requested}` ("
        f"{format_gib(to_requested)} GiB) to fit into requested memory, or `--kv-cache-memory={to_gpu}` ("
        f"{format_gib(to_gpu)} GiB) to fully utilize gpu memory. Current kv cache memory in use is "
        f"{format_gib(kv.available_bytes)} GiB.",
    )


def _check_kv(settings: Settings, log: VllmLog, kv: KvPlan, max_model_len: int | None) -> None:
    """vLLM's fit check (kv_cache_planning.py:L50-L87) and auto-fit (L1337-L1410)."""
    if kv.available_bytes <= 0:
        error = (
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine (this flag also controls CPU memory reservation on the CPU "
            "backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    elif max_model_len == -1 and kv.estimated_max_model_len <= 0:
        error = (
            "ValueError: Cannot auto-fit max_model_len: not enough GPU memory available to serve even a "
            "single token. Try increasing `gpu_memory_utilization`."
        )
    elif not kv.fits:
        usable = kv.available_bytes - kv.page_bytes
        estimate = (
            "Based on the available memory, the estimated maximum model length is "
            f"{kv.estimated_max_model_len}. "
            if kv.estimated_max_model_len > 0
            else ""
        )
        error = (
            f"ValueError: To serve at least one request with the model's max seq len ({kv.max_model_len}), ("
            f"{format_gib(kv.needed_bytes)} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({format_gib(usable)} GiB). {estimate}Try increasing `gpu_memory_utilization` "
            "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when "
            "initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
            "for more details."
        )
    else:
        if max_model_len == -1:
            derived = settings.derived_max_model_len
            where = f"{format_gib(kv.available_bytes - kv.page_bytes)} GiB GPU"
            if kv.max_model_len >= derived:
                line = (
                    f"Auto-fit max_model_len: full model context length {derived} fits in available KV "
                    f"cache memory ({where})"
                )
            else:
                line = (
                    f"Auto-fit max_model_len: reduced from {derived} to {kv.max_model_len} to fit in "
                    f"available KV cache memory ({where})"
                )
            where_logged = (
                "kv_cache_planning.py:1404" if kv.max_model_len < derived else "kv_cache_planning.py:1395"
            )
            log.info("EngineCore", where_logged, line)
        return
    log.error_block("EngineCore", "core.py:1584", "EngineCore failed to start.", _KV_CHECK_FRAMES, error)
    _engine_failed(log, error)


def _fail_while_loading(settings: Settings, log: VllmLog) -> None:
    if settings.fail == "hang":
        while True:  # the loading lines stop; only a signal ends this
            time.sleep(3600)
    if settings.fail == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    total = settings.gpu_total_gib
    oom = (
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of {total:.2f} GiB of "
        f"which 1.12 GiB is free. Including non-PyTorch memory, this process has {total - 1.12:.2f} GiB "
        f"memory in use. Of the allocated memory {total - 3.79:.2f} GiB is allocated by PyTorch, and 1.05 "
        "GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    log.info(
        "Worker_TP0",
        "gpu_model_runner.py:5086",
        "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory "
        "for weights, increasing --tensor-parallel-size, or using --quantization. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more tips. (original error: "
        f"{oom})",
        level="ERROR",
    )
    _worker_failed(
        log,
        [
            *_WORKER_FRAMES,
            f'  File "{_VLLM}/v1/worker/gpu_model_runner.py", line 5087, in load_model',
            "    raise e",
        ],
        f"torch.OutOfMemoryError: {oom}",
    )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


# ---------------------------------------------------------------- tokenizer and generation


def tokenize_text(text: str) -> list[int]:
    """One token per whitespace-separated word; ids are a stable hash of the word."""
    return [zlib.crc32(word.encode()) % _VOCAB_SIZE for word in text.split()]


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> list[int]:
    tokens: list[int] = []
    for message in messages:
        tokens.append(zlib.crc32(str(message.get("role", "user")).encode()) % _VOCAB_SIZE)
        tokens.extend(tokenize_text(_content_text(message.get("content"))))
    tokens.append(zlib.crc32(b"assistant") % _VOCAB_SIZE)
    return tokens


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def generated_words(count: int) -> Iterator[str]:
    for index in range(count):
        yield _WORDS[index % len(_WORDS)]


class RequestError(Exception):
    """An error response, in vLLM's body shape."""

    def __init__(self, status: HTTPStatus, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status.value,
            }
        }


def _validation_error_text(message: str, parameter: str, value: Any) -> str:
    """VLLMValidationError.__str__: the message, then `(parameter=..., value=...)`."""
    return f"{message} (parameter={parameter}, value={value})"


# ---------------------------------------------------------------- HTTP


@dataclass
class ServerState:
    settings: Settings
    kv: KvPlan
    log: VllmLog
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.kv.max_model_len

    @property
    def fingerprint(self) -> str:
        tp = self.settings.tensor_parallel_size
        digest = f"{zlib.crc32(self.settings.model.encode()):08x}"
        return "-".join([f"vllm-{VLLM_VERSION}", *([f"tp{tp}"] if tp > 1 else []), digest])


_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ServerState  # set on the subclass the server builds

    def version_string(self) -> str:
        return "uvicorn"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = HTTPStatus(int(code)) if str(code).isdigit() else None
        phrase = f"{int(code)} {status.phrase}" if status else str(code)
        host, port = self.client_address[:2]
        self.state.log.raw(f'INFO:     {host}:{port} - "{self.requestline}" {phrase}')

    # ---- plumbing
    def _send_json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        keys = self.state.settings.api_keys
        if not keys or not self.path.startswith(_GUARDED_PREFIX):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and any(secrets.compare_digest(token, key) for key in keys)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            value = json.loads(raw or b"{}")
        except json.JSONDecodeError as error:
            raise _JsonInvalid(str(error)) from error
        if not isinstance(value, dict):
            raise _JsonInvalid("not an object")
        return value

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes = {
            ("GET", "/health"): self._health,
            ("GET", "/version"): lambda: self._send_json(200, {"version": VLLM_VERSION}),
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/models"): self._models,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/v1/completions"): lambda: self._generate(chat=False),
            ("POST", "/v1/chat/completions"): lambda: self._generate(chat=True),
        }
        if not self._authorized():
            self._send_json(401, {"error": "Unauthorized"})
            return
        handler = routes.get((method, path))
        if handler is None:
            self._send_json(404, {"detail": "Not Found"})
            return
        try:
            handler()
        except RequestError as error:
            self._send_json(error.status.value, error.body())
        except _JsonInvalid as error:
            self._send_json(
                422,
                {
                    "detail": [
                        {
                            "type": "json_invalid",
                            "loc": ["body", 0],
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": str(error)},
                        }
                    ]
                },
            )
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # ---- endpoints
    def _health(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def _metrics(self) -> None:
        settings, kv = self.state.settings, self.state.kv
        labels = {
            "_block_size_resolved": "True",
            "block_size": str(settings.block_size),
            "cache_dtype": settings.kv_cache_dtype,
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(settings.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": str(settings.gpu_memory_utilization),
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(kv.max_concurrency),
            "kv_cache_memory_bytes": str(settings.kv_cache_memory_bytes),
            "kv_cache_size_tokens": str(kv.kv_cache_tokens),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(kv.num_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": str(bool(self.state.settings.non_default_args.get("block_size"))),
        }
        label_text = ",".join(f'{key}="{value}"' for key, value in labels.items())
        text = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE "
            f"vllm:cache_config_info gauge\nvllm:cache_config_info{{{label_text}}} 1.0\n"
        ).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(text)))
        self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
        self.end_headers()
        self.wfile.write(text)

    def _models(self) -> None:
        created = self.state.created
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.state.settings.model,
                "parent": None,
                "max_model_len": self.state.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{secrets.token_hex(8)}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.state.settings.served_model_names
        ]
        self._send_json(200, {"object": "list", "data": cards})

    def _check_model(self, body: dict[str, Any]) -> None:
        names = self.state.settings.served_model_names
        model = body.get("model")
        if model and model not in names:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",
                "NotFoundError",
                "model",
            )

    def _tokenize(self) -> None:
        body = self._body()
        self._check_model(body)
        if "messages" in body:
            tokens = chat_prompt_tokens(body["messages"])
        else:
            tokens = tokenize_text(str(body.get("prompt", "")))
        self._send_json(
            200,
            {
                "count": len(tokens),
                "max_model_len": self.state.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            },
        )

    def _prompt_tokens(self, body: dict[str, Any], chat: bool) -> tuple[int, bool]:
        """The prompt's length and whether the tokenizer cut it at max_model_len + 1 (vLLM's `at least`)."""
        if chat:
            count = len(chat_prompt_tokens(body.get("messages") or []))
            limit = self.state.max_model_len + 1
            return min(count, limit), count >= limit
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(item, int) for item in prompt):
            return len(prompt), False  # token ids: no tokenizer truncation, the exact count
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        count = len(tokenize_text(str(prompt)))
        limit = self.state.max_model_len + 1
        return min(count, limit), count >= limit

    def _generate(self, chat: bool) -> None:
        body = self._body()
        self._check_model(body)
        max_model_len = self.state.max_model_len
        param = (
            "max_completion_tokens"
            if chat and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        requested = body.get(param)
        if requested is not None and int(requested) > max_model_len:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                _validation_error_text(
                    f"{param}={requested} cannot be greater than max_model_len={max_model_len}. Please "
                    "request fewer output tokens.",
                    param,
                    requested,
                ),
                "BadRequestError",
                param,
            )
        prompt_tokens, truncated = self._prompt_tokens(body, chat)
        if prompt_tokens > max_model_len:
            qualifier = "at least " if truncated else ""
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                _validation_error_text(
                    f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                    f"contains {qualifier}{prompt_tokens} input tokens, which exceeds this limit even "
                    "without any output tokens. Please reduce the length of the input prompt.",
                    "input_tokens",
                    prompt_tokens,
                ),
                "BadRequestError",
                "input_tokens",
            )
        # get_max_tokens (entrypoints/serve/utils/api_utils.py): clamp to what the context leaves
        default = (max_model_len - prompt_tokens) if chat else 16
        max_tokens = min(max_model_len - prompt_tokens, int(requested) if requested is not None else default)
        count = max_tokens if body.get("ignore_eos") else min(max_tokens, self.state.settings.eos_after)
        finish_reason = "length" if count == max_tokens else "stop"
        request_id = secrets.token_hex(8)
        model = body.get("model") or self.state.settings.served_model_names[0]
        if body.get("stream"):
            self._stream(chat, request_id, model, count, finish_reason)
            return
        text = " " + " ".join(generated_words(count)) if count else ""
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + count,
            "completion_tokens": count,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        if chat:
            payload = {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self.state.fingerprint,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        else:
            payload = {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": self.state.fingerprint,
                "usage": usage,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        self._send_json(200, payload)

    def _stream(self, chat: bool, request_id: str, model: str, count: int, finish_reason: str) -> None:
        """Server-sent events in chunked encoding, as uvicorn sends vLLM's StreamingResponse."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        created = int(time.time())
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

        if chat:
            self._chunk(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        words = list(generated_words(count))
        for index, word in enumerate(words):
            last = index == len(words) - 1
            self._chunk({**base, "choices": [choice(" " + word, finish_reason if last else None)]})
            if self.state.settings.token_delay_s > 0:
                time.sleep(self.state.settings.token_delay_s)
        if not words:
            self._chunk({**base, "choices": [choice("", finish_reason)]})
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _chunk(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class _JsonInvalid(Exception):
    pass


_ROUTES = [
    ("/openapi.json", "GET, HEAD"),
    ("/docs", "GET, HEAD"),
    ("/redoc", "GET, HEAD"),
    ("/version", "GET"),
    ("/health", "GET"),
    ("/metrics", "GET"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
    ("/ping", "GET"),
    ("/ping", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/messages", "POST"),
]


def surviving_engine_core() -> subprocess.Popen[bytes] | None:
    """With CTXMGR_STANDIN_ENGINE_SURVIVES=1, a real child process titled as vLLM titles its EngineCore
    ("VLLM::EngineCore": v1/engine/core.py:L1482, utils/system_utils.py:L217 with the default
    VLLM_PROCESS_NAME_PREFIX) that does not end when the API server does, as vLLM #55510's EngineCore and
    workers outlive their API server: a stop under KillMode=process (systemd signals the main process
    only) leaves it in the unit's cgroup, where a GPU would still list its memory."""
    if os.environ.get("CTXMGR_STANDIN_ENGINE_SURVIVES") != "1":
        return None
    sleep = shutil.which("sleep") or "/bin/sleep"
    return subprocess.Popen(["VLLM::EngineCore", "3600"], executable=sleep, stdin=subprocess.DEVNULL)


def serve(settings: Settings, log: VllmLog, listener: ThreadingHTTPServer, kv: KvPlan) -> int:
    """Announce and serve until SIGTERM/SIGINT; then vLLM's and uvicorn's shutdown lines, exit 0."""
    surviving_engine_core()
    state = ServerState(settings=settings, kv=kv, log=log)
    listener.RequestHandlerClass = type("StandinHandler", (Handler,), {"state": state})
    host, port = listener.server_address[:2]
    log.info("APIServer", "entry.py:135", "Supported tasks: ['generate']")
    log.info("APIServer", "entry.py:139", f"Starting vLLM server on http://{host}:{port}")
    log.info("APIServer", "launcher.py:188", "Available routes are:")
    for path, methods in _ROUTES:
        log.info("APIServer", "launcher.py:197", f"Route: {path}, Methods: {methods}")
    listener.server_activate()
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.raw(f"INFO:     Started server process [{log.pid}]")
    log.raw("INFO:     Waiting for application startup.")
    log.raw("INFO:     Application startup complete.")
    thread = threading.Thread(target=listener.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    stop.wait()
    log.info("APIServer", "launcher.py:256", "[shutdown] API server: shutdown triggered")
    listener.shutdown()
    listener.server_close()
    log.raw("INFO:     Shutting down")
    log.raw("INFO:     Waiting for application shutdown.")
    log.raw("INFO:     Application shutdown complete.")
    return 0


def _bind(settings: Settings, log: VllmLog) -> ThreadingHTTPServer:
    """Bind before the engine starts, listen only when serving (vLLM's setup_server, then uvicorn)."""
    listener = ThreadingHTTPServer((settings.host, settings.port), Handler, bind_and_activate=False)
    listener.daemon_threads = True
    listener.allow_reuse_address = True
    try:
        listener.server_bind()
    except OSError as error:
        listener.server_close()
        frames = [
            f'  File "{_VLLM}/entrypoints/launchers/api_server/entry.py", line 175, in run_server',
            "    listen_address, sock = setup_server(args, reuse_port=False)",
        ]
        log.traceback(frames, f"OSError: [Errno {error.errno}] {os.strerror(error.errno or 0)}")
        raise StartFailed(1) from error
    return listener


def run_preload(argv: list[str], environ: dict[str, str]) -> int:
    """`vllm preload --model M ...` (entrypoints/cli/preload.py): one weight-cache daemon per local GPU,
    each loading its rank's weights from disk and keeping them in GPU memory; the parent logs READY
    (L409-L417) and waits on them until SIGTERM (L377-L384). The memory is the test's to play: NVML's
    view lists this process holding CTXMGR_STANDIN_WEIGHTS_GIB on each GPU
    (tests/core/test_weight_cache.py)."""
    settings = settings_from(argv, environ)
    if settings.load_format == "ipc_cache":  # preload.py:L233-L237
        print("ValueError: The weight cache daemon itself must load from disk; use the default --load-format",
              file=sys.stderr)  # fmt: skip
        return 1
    log = VllmLog(settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.sleep(0.3)
    log.workers("default_loader.py:506", f"Loading weights took {4.32 * settings.shards + 0.41:.2f} seconds")
    ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size
    log.info(
        "MainProcess",
        "preload.py:409",
        f"===== Weight cache daemon READY: node 0/1 serving {ranks} local rank(s) x 1 role(s) in the "
        "default socket dir =====",
    )
    while not stop.wait(0.5):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["preload"]:
        return run_preload(argv[1:], dict(os.environ))
    if not argv or argv[0] != "serve":
        print("usage: vllm serve [model_tag] [options]", file=sys.stderr)
        return 2
    settings = settings_from(argv[1:], dict(os.environ))
    log = VllmLog(settings)
    if settings.headless:
        if settings.node_rank < 1 or settings.nnodes < 2:
            print("vllm serve: error: --headless needs --nnodes > 1 and --node-rank > 0", file=sys.stderr)
            return 2
        return run_headless(settings, log)
    group = HeadGroup.listen(settings) if settings.nnodes > 1 else None
    try:
        listener = _bind(settings, log)
        try:
            kv = run_start(settings, log, group)
        except StartFailed:
            listener.server_close()
            raise
    except StartFailed as failed:
        if group is not None:
            group.close()
        return failed.exit_status
    try:
        return serve(settings, log, listener, kv)
    finally:
        if group is not None:
            group.close()


# ---------------------------------------------------------------- launching it (tests, demos)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket:
        probe_socket.bind((host, 0))
        return int(probe_socket.getsockname()[1])


@dataclass
class StandinProcess:
    """A running stand-in: its output lines (stdout and stderr merged, as the journal gets them)."""

    process: subprocess.Popen[str]
    port: int
    host: str = "127.0.0.1"
    lines: list[str] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        """Wait until `predicate(lines)` holds, the process ends, or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.lines):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process.poll() is not None and not self._reader_alive()):
                    return predicate(self.lines)
                self._changed.wait(min(remaining, 0.1))
        return True

    def _reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        return self.wait_for(
            lambda lines: any("Application startup complete." in line for line in lines), timeout
        )

    def wait_exit(self, timeout: float = 30.0) -> int:
        status = self.process.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        return status

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.wait_exit(timeout)

    def __enter__(self) -> StandinProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def launch(
    serve_args: list[str],
    *,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    python: str = sys.executable,
) -> StandinProcess:
    """Start `python -m tests.support.standin serve ...` on a free port; `env` is added to os.environ."""
    port = port if port is not None else free_port(host)
    command = [
        python,
        "-m",
        "tests.support.standin",
        "serve",
        *serve_args,
        "--host",
        host,
        "--port",
        str(port),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        env={**os.environ, **(env or {})},
    )
    standin = StandinProcess(process=process, port=port, host=host)
    standin._reader = threading.Thread(target=standin._read, daemon=True)
    standin._reader.start()
    return standin


if __name__ == "__main__":
    # SIGTERM before serving ends the process by the signal, as a start interrupted under systemd does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(main())
