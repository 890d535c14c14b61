"""CPU time of the installed `ctxmgr` console script, beside `python -c pass`.

The measure is user + sys CPU of the whole child process (os.wait4), which a busy machine inflates far
less than wall time. Goals (issue 27): `ctxmgr --help`, `ctxmgr plan --help` and a shell-completion
TAB at most 0.2 s each, `ctxmgr plan` on a local config at most 0.4 s. Prints the median of N runs;
asserts nothing (speed goals belong here, not in timed tests).

Two columns: with cached bytecode (as an installed wheel runs: pip compiles its .pyc; here they go to
.cache/pycache through PYTHONPYCACHEPREFIX, filled by a first run), and compiling every module from
source (PYTHONDONTWRITEBYTECODE=1, as a checkout runs where that is set).

    python benchmarks/cli_start.py [--runs N] [--ctxmgr PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLAN = ["plan", "--model", str(REPO / "examples/models/llama-3.1-70b"), "--gpu-memory", "80GiB",
        "--gpu-count", "1", "--max-model-len", "8192"]  # fmt: skip
# the README's plan on a fresh clone: a shipped unit against a local copy of its model
LLAMA70B = str(REPO / "examples/models/llama-3.1-70b")
PLAN_UNIT = ["plan", "--unit", str(REPO / "units/vllm-llama70b.service"), "--model", LLAMA70B,
             "--gpu-memory", "80GiB", "--gpu-count", "4"]  # fmt: skip
COMPLETION = {"_CTXMGR_COMPLETE": "bash_complete", "COMP_WORDS": "ctxmgr pl", "COMP_CWORD": "1"}


PYCACHE = REPO / ".cache" / "pycache"
CACHED = {"PYTHONPYCACHEPREFIX": str(PYCACHE), "PYTHONDONTWRITEBYTECODE": ""}
FROM_SOURCE = {"PYTHONDONTWRITEBYTECODE": "1"}


def cpu_seconds(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(user + sys CPU, exit status) of one run of cmd as a fresh process, its output discarded."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env}
    )
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, proc.returncode


def median_cpu(
    cmd: list[str], runs: int, env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)
) -> float:
    times = []
    for _ in range(runs):
        seconds, code = cpu_seconds(cmd, env)
        if code not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {code}")
        times.append(seconds)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each command (the median is shown)")
    parser.add_argument("--ctxmgr", default=None, help="the console script (default: beside this python)")
    options = parser.parse_args()
    ctxmgr = options.ctxmgr or str(Path(sys.executable).with_name("ctxmgr"))
    if not Path(ctxmgr).exists():
        ctxmgr = shutil.which("ctxmgr") or ctxmgr
    if not Path(ctxmgr).exists():
        raise SystemExit(f"no ctxmgr console script at {ctxmgr} (pip install -e . first)")
    runs = options.runs
    commands = [
        ("ctxmgr --help", [ctxmgr, "--help"], {}, 0.2),
        ("ctxmgr plan --help", [ctxmgr, "plan", "--help"], {}, 0.2),
        ("completion TAB (ctxmgr pl<TAB>)", [ctxmgr], COMPLETION, 0.2),
        ("ctxmgr plan --model llama-3.1-70b ... 8192", [ctxmgr, *PLAN], {}, 0.4),
        ("ctxmgr plan --unit units/vllm-llama70b.service ...", [ctxmgr, *PLAN_UNIT], {}, 0.4),
    ]
    print(f"CPU (user + sys) of the whole process, median of {runs} runs; {ctxmgr}")
    stale = list((REPO / "vllm_ctxmgr").rglob("__pycache__/*.pyc"))
    if stale:  # read even under PYTHONDONTWRITEBYTECODE=1: the right column would not be from source
        print(f"note: {len(stale)} .pyc beside the sources (vllm_ctxmgr/**/__pycache__): remove them for "
              "a true from-source column")  # fmt: skip
    print(f"{'':52s} {'bytecode cached':>26s}   {'from source':>26s}")
    modes = (CACHED, FROM_SOURCE)
    base = [median_cpu([sys.executable, "-c", "pass"], runs, mode) for mode in modes]
    print(f"{'python -c pass':52s} " + "   ".join(f"{b:6.3f} s {'':19s}" for b in base))
    for label, cmd, env, goal in commands:
        cells = []
        for mode, b in zip(modes, base, strict=True):
            seconds = median_cpu(cmd, runs, {**mode, **env}, ok=(0, 3))
            cells.append(f"{seconds:6.3f} s ({seconds / b:4.1f} x) {'ok' if seconds <= goal else 'MISS':>4s}")
        print(f"{label:52s} " + "   ".join(cells) + f"   (goal {goal} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
