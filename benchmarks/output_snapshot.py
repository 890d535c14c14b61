"""Write what `ctxmgr facts` and `ctxmgr plan` print for a matrix of models, contexts and flags.

Run it before and after a refactor and diff the two folders: a refactor must leave every output byte
for byte (usage: output_snapshot.py OUT_DIR; `diff -r BEFORE AFTER` then prints nothing).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted(p for p in (ROOT / "examples" / "models").iterdir() if (p / "config.json").exists())
CONTEXTS = ("8192", "131072", "200k", "auto")
SHAPES = (
    ("--gpu-memory", "80GiB", "--gpu-count", "8", "-tp", "8"),
    ("--gpu-memory", "24GiB", "--gpu-count", "1"),
    ("--gpu-memory", "141GiB", "--gpu-count", "4", "-tp", "2", "-pp", "2", "--kv-cache-dtype", "fp8"),
)
VERSIONS = ("0.10.1", "0.20.0", "0.33.0")


def run(argv: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_ctxmgr", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "CTXMGR_STATE_DIR": str(ROOT / ".cache" / "snapshot-state"), "NO_COLOR": "1"},
        cwd=ROOT,
        check=False,
    )
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}"


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for model in MODELS:
        for fmt in ((), ("--json",)):
            (out / f"facts-{model.name}{'-json' if fmt else ''}.txt").write_text(
                run(["facts", str(model), *fmt])
            )
            count += 1
        for (i, shape), context, version, fmt in itertools.product(
            enumerate(SHAPES), CONTEXTS, VERSIONS, ((), ("--json",))
        ):
            name = f"plan-{model.name}-{context}-s{i}-{version}{'-json' if fmt else ''}.txt"
            argv = ["plan", context, "--model", str(model), *shape, "--vllm-version", version, *fmt]
            (out / name).write_text(run(argv))
            count += 1
    print(f"{count} outputs written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
