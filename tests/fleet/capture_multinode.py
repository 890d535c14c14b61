"""Record the real vLLM CPU build's journals of a two-node deployment (tests/data/vllm-logs-multinode/).

    python -m tests.fleet.capture_multinode DIR OUTDIR [SCENARIO...]

DIR holds the bed (keys, sshd configs, cursors); OUTDIR gets SCENARIO-node{0,1}.journal (`journalctl -u
vllm-mn.service -o cat` since the scenario's start), SCENARIO-node{0,1}.service (the units) and
summary.json (timings and unit states). One bed, the scenarios in turn, each from both nodes stopped:

    good        both nodes at --max-model-len 1024: /v1/models 200 on node 0
    change      from `good`: stop both (timed), rewrite both at 2048, start both, /v1/models says 2048
    no-node1    node 0 alone (--distributed-timeout-seconds 30): DistStoreError, exit 1
    no-node0    node 1 alone (30 s): what a headless node does without its head
    kv-node1    node 1 with --kv-cache-memory-bytes of 4 blocks for 1024 tokens: the KV-too-small error
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.fleet.bed import BedError
from tests.fleet.multinode import READY_TIMEOUT_S, MultinodeBed, NodeSettings
from tests.support.vllm_cpu import CPU_BLOCK_SIZE, TINY_KV_BYTES_PER_TOKEN

SCENARIOS = ("good", "change", "no-node1", "no-node0", "kv-node1")
MISSING_PEER_TIMEOUT_S = 30
# TP 2 halves the KV heads per rank: 512 B per token per rank; 4 blocks is far less than 1024 tokens need
KV_TOO_SMALL_BYTES = 4 * CPU_BLOCK_SIZE * TINY_KV_BYTES_PER_TOKEN // 2


def _save(bed: MultinodeBed, outdir: Path, name: str, ranks: range | list[int]) -> None:
    for rank in ranks:
        node = bed.nodes[rank]
        (outdir / f"{name}-node{rank}.journal").write_text(bed.journal(node))
        (outdir / f"{name}-node{rank}.service").write_text(bed.unit_path(node).read_text())


def trim(journal: str) -> str:
    """What tests/data keeps of a journal: all of it but torch's C++ stack dumps (`frame #N: ...`)."""
    keep = [
        line
        for line in journal.split("\n")
        if not line.startswith("frame #") and line != "<omitting python frames>"
    ]
    return "\n".join(keep)


def _states(bed: MultinodeBed) -> dict[str, Any]:
    return {f"node{rank}": bed.unit_state(node) for rank, node in enumerate(bed.nodes)}


def run(directory: Path, outdir: Path, scenarios: list[str]) -> dict[str, Any]:
    outdir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    began = time.monotonic()
    bed = MultinodeBed.up(directory, start=False)
    summary["bed_up_s"] = round(time.monotonic() - began, 1)
    try:
        for name in scenarios:
            record: dict[str, Any] = {}
            summary[name] = record
            bed.stop_all()
            if name in ("good", "change"):
                if name == "change":
                    bed.install(NodeSettings(max_model_len=1024))
                    bed.start_all()
                    record["baseline_ready_s"] = round(bed.wait_ready(), 1)
                    record["stop_both_s"] = round(bed.stop_all(), 1)
                bed.install(NodeSettings(max_model_len=2048 if name == "change" else 1024))
                start = time.monotonic()
                bed.start_all()
                record["ready_s"] = round(bed.wait_ready(), 1)
                record["start_to_ready_s"] = round(time.monotonic() - start, 1)
                record["served_max_model_len"] = bed.served_context()
                time.sleep(3)  # the headless node's last lines
                _save(bed, outdir, name, range(2))
                record["states"] = _states(bed)
                continue
            if name in ("no-node1", "no-node0"):
                bed.timeout_s = MISSING_PEER_TIMEOUT_S
                bed.install(NodeSettings())
                rank = 0 if name == "no-node1" else 1
                start = time.monotonic()
                bed.start_all([rank])
                try:
                    limit = READY_TIMEOUT_S + 2 * MISSING_PEER_TIMEOUT_S  # torch's client retries once
                    record["state"] = bed.wait_ended(bed.nodes[rank], limit)
                    record["ended_after_s"] = round(time.monotonic() - start, 1)
                except BedError as error:
                    record["still_running"] = str(error)
                    record["stop_s"] = round(bed.stop_all(), 1)
                _save(bed, outdir, name, [rank])
                bed.timeout_s = MultinodeBed.timeout_s
                continue
            if name == "kv-node1":
                bed.install(
                    [
                        NodeSettings(),
                        NodeSettings(kv_space_gib=None, kv_cache_memory_bytes=KV_TOO_SMALL_BYTES),
                    ]
                )
                start = time.monotonic()
                bed.start_all()
                try:
                    record["node0_state"] = bed.wait_ended(bed.nodes[0], READY_TIMEOUT_S)
                    record["node0_ended_after_s"] = round(time.monotonic() - start, 1)
                    time.sleep(5)
                    record["node1_state_5s_later"] = bed.unit_state(bed.nodes[1])
                except BedError as error:
                    record["still_running"] = str(error)
                _save(bed, outdir, name, range(2))
                continue
            raise BedError(f"unknown scenario {name!r}")
        summary["total_s"] = round(time.monotonic() - began, 1)
    finally:
        try:
            bed.stop_all()
        finally:
            bed.down()
        (outdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or any(name not in SCENARIOS for name in args[2:]):
        print(
            f"usage: python -m tests.fleet.capture_multinode DIR OUTDIR [{'|'.join(SCENARIOS)}...]",
            file=sys.stderr,
        )
        return 2
    summary = run(Path(args[0]), Path(args[1]), args[2:] or list(SCENARIOS))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
