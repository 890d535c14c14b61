"""Cold wall time of `ctxmgr --help` and `ctxmgr plan` (goals: 0.3 s and 0.5 s on a 2-core machine).

Each command runs as a fresh process (interpreter start and imports included), several times; the
page cache is warm after the first run, so the first figure is the coldest. Prints figures; asserts
nothing (speed goals belong here, not in timed tests).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = 5


def timed(cmd: list[str]) -> list[float]:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode not in (0, 3):
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return times


def report(label: str, times: list[float], goal: float) -> None:
    verdict = "meets" if statistics.median(times) <= goal else "MISSES"
    print(
        f"{label:58s} first {times[0]:.3f} s  median {statistics.median(times):.3f} s  "
        f"min {min(times):.3f} s  (goal {goal} s: {verdict})"
    )


def main() -> int:
    ctxmgr = [sys.executable, "-m", "vllm_ctxmgr"]
    work = REPO / ".cache" / "bench"
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / "GLM-5-00001-of-00003.gguf"
    if not gguf.exists():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "make_glm5_gguf.py"),
                str(work / "GLM-5.gguf"),
                "--parts",
                "3",
            ],
            check=True,
            capture_output=True,
        )
    parts = sorted(work.glob("GLM-5-0000*-of-00003.gguf"))
    apparent = sum(p.stat().st_size for p in parts)
    on_disk = sum(p.stat().st_blocks * 512 for p in parts)
    print(
        f"GLM-5 GGUF: {len(parts)} parts, {apparent / 2**30:.1f} GiB apparent, "
        f"{on_disk / 2**20:.1f} MiB on disk"
    )
    gpus = ["--gpu-memory", "95.6GiB", "--gpu-count", "8"]
    report("ctxmgr --help", timed([*ctxmgr, "--help"]), 0.3)
    report(
        "ctxmgr plan 200000 --model examples/models/glm-5 (config dir)",
        timed([*ctxmgr, "plan", "200000", "--model", str(REPO / "examples/models/glm-5"), "-tp", "8", *gpus]),
        0.5,
    )
    report(
        "ctxmgr plan 131072 --model examples/models/gemma-3-27b",
        timed([*ctxmgr, "plan", "131072", "--model", str(REPO / "examples/models/gemma-3-27b"), *gpus]),
        0.5,
    )
    report(
        f"ctxmgr plan 200000 --model <{apparent / 2**30:.0f} GiB split GGUF>",
        timed([*ctxmgr, "plan", "200000", "--model", str(parts[0]), "-tp", "8", *gpus]),
        0.5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
