"""The bytes of a checkpoint's routed experts, from its safetensors shard headers.

vLLM splits a MoE layer's routed experts over every GPU of the data-parallel group, not only over
tensor parallelism: `FusedMoEParallelConfig.make` (model_executor/layers/fused_moe/config.py)
flattens the MoE "tensor parallel" size to DP x PCP x TP (`flatten_tp_across_dp_and_pcp`), and with
`--enable-expert-parallel` gives each of those GPUs whole experts instead. The other weights
(attention, shared experts, embeddings) are split by TP only and repeated on every DP rank. The
planner needs the two apart; they are told apart by tensor name, as vLLM's loaders map them
(`...mlp.experts.N.*`, `block_sparse_moe.experts.*`, fused `mlp.experts.gate_up_proj`; shared
experts are not routed).

Only each shard's 8-byte length and JSON header are read, never tensor data.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_ctxmgr.model_files.safetensors import read_header

ROUTED_EXPERT = re.compile(r"\.experts\.")
SHARED_EXPERT = re.compile(r"shared_expert")


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor (not the router, not a shared expert)."""
    return bool(ROUTED_EXPERT.search(name)) and not SHARED_EXPERT.search(name)


def expert_weight_bytes(directory: Path) -> int | None:
    """Bytes of the routed experts over all shards; None where there are no shard headers to read."""
    shards = sorted(p for p in directory.glob("*.safetensors") if p.name != "consolidated.safetensors")
    if not shards:
        return None
    total = 0
    for shard in shards:
        for name, nbytes in _tensor_bytes(shard):
            if is_routed_expert(name):
                total += nbytes
    return total


def _tensor_bytes(path: Path) -> list[tuple[str, int]]:
    """(name, bytes) of each tensor a shard's header declares."""
    header, _length, _size = read_header(path)
    out = []
    for name, tensor in header.items():
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if name == "__metadata__" or not isinstance(offsets, list) or len(offsets) != 2:
            continue
        begin, end = offsets
        if isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end:
            out.append((str(name), end - begin))
    return out
