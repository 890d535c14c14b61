"""The bounds of vLLM's size flags as ctxmgr reads them, wherever they come from: the CLI's click
types, a unit's ExecStart, a `--config` YAML file (core.serve_args.flag_value_problem). One small
module of its own, without the flag tables, so that the CLI can build its option types from it at
import and still start in a fraction of a second."""

from __future__ import annotations

MAX_PARALLEL = 1024  # ranks of one kind: more GPUs than any one deployment has
# every worker of one deployment (DP x PP x PCP x TP) and its nodes: each factor within MAX_PARALLEL
# still multiplies to 2^40 ranks, which ctxmgr would lay out one by one
MAX_WORLD_SIZE = 8 * MAX_PARALLEL
MAX_NODES = MAX_PARALLEL
MAX_COUNT = 1 << 24  # sequences, tokens per batch, KV blocks
MAX_BYTES = 1 << 50  # 1 PiB
MAX_CONTEXT = 1 << 32  # tokens
BLOCK_SIZES = "vLLM's block sizes are 1, 8 or a multiple of 16 up to 4096"


def block_size_ok(number: int) -> bool:
    """vLLM's --block-size: positive (config/cache.py `gt=0`); its CUDA attention kernels take 1, 8 or
    multiples of 16."""
    return number in (1, 8) or (0 < number <= 4096 and number % 16 == 0)
