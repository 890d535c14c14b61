"""Hostile-input campaign of issue 36 (round four): the classes fixed in that round, each against an
oracle written here, independently of the code under test. Each trial runs in a forked child with a
timeout (benchmarks/trials.py); each section prints `tried` and `failed`. A trial fails on an unhandled
exception, a hang, an error of more than one line, or a verdict its oracle disagrees with:

    version   systemd Version strings (suffixes, junk, 5,000 digits, below the floor): a release is read
              iff the text is digits then a distribution's suffix, at most 128 characters
    gguf      a string length of up to 2^64-1 planted at any item of a string array that is stepped
              over: a one-line refusal naming the file, never a Python error
    timeline  the real CPU start's journal with its stamps stepped back or a second ready line hours
              later: the estimate is "not known" (a clock step) or within the start's own span
    world     parallel sizes and --nnodes: refused iff the world (DP x PP x PCP x TP) is over 8,192 GPUs or
              --nnodes over 1,024, in one line and at once
    wire      the `wire` field of an answer: taken iff it is the integer 3
    counts    HAProxy `show stat` counters of any Unicode: a count iff 1-12 ASCII digits
    imports   observations whose figures straddle this host's GPU: refused iff a figure is above it

    .venv/bin/python benchmarks/campaign_round4_inputs.py [SECTION ...] [--seed 36] [--timeout 15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import struct
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trials import Tally, isolated, outcome_problem, run_sections  # noqa: E402  (benchmarks/trials.py)

WORK = REPO / ".cache" / "campaign-round4" / str(os.getpid())
GIB = 1 << 30
OK_JOURNAL = REPO / "tests" / "data" / "vllm-logs" / "systemd_vllm-ok_journal.log"


def campaign_version(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.systemd.features import parse_version

    rng = random.Random(args.seed)
    tally = Tally("version", args.show)
    pieces = ["", ".3-7+deb11u4", "~rc3", "junk", ".38-1~deb12u1", " (252.38-1~deb12u1)", "x", "-", "/"]
    for _ in range(args.version):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 2, 3, 3, 3, 7, 5000])))
        text = rng.choice(["", "v", "systemd "]) + digits + rng.choice(pieces) * rng.choice([1, 1, 60])
        outcome = isolated(lambda t=text: parse_version(t), args.timeout)
        problem = outcome_problem(outcome)
        body = text.removeprefix("systemd ").strip()
        lead = re.match(r"v?(\d+)", body)
        rest = body[lead.end() :] if lead else body
        readable = (
            lead is not None
            and len(lead[1]) <= 6
            and len(body) <= 128
            and (rest == "" or rest[0] in ".~+-" or rest.startswith(" ("))
            and "x" not in rest
            and "/" not in rest
            and "junk" not in rest
        )
        if not problem:
            read = outcome[1]
            if readable and read != int(lead[1]):  # type: ignore[index]
                problem = f"{text[:40]!r} read as {read}"
            elif not readable and read is not None:
                problem = f"{text[:40]!r} ({len(text)} characters) read as a release"
        tally.add(text[:40], problem)
    return tally.report()


def campaign_gguf(args: argparse.Namespace) -> int:
    from tests import gguf_builders
    from vllm_ctxmgr.model_files.load import load_model_facts

    rng = random.Random(args.seed)
    tally = Tally("gguf", args.show)
    path = WORK / "gguf" / "m.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = [f"t{i:05d}" for i in range(5000)]  # past the 4096 kept: stepped over
    base = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}
    tensors = gguf_builders.block_tensors(2, 64, kv_width=64, ggml_type="F16")
    gguf_builders.write_gguf(path, "llama", base | {"vocab.tokens": tokens}, tensors)
    clean = path.read_bytes()
    for _ in range(args.gguf):
        which = rng.randrange(len(tokens))
        length = rng.choice([2**64 - 1, 2**63, 2**32, len(clean), len(clean) * 2, 1 << 40])
        data = bytearray(clean)
        at = data.index(struct.pack("<Q", 6) + tokens[which].encode())
        data[at : at + 8] = struct.pack("<Q", length)
        trial = WORK / "gguf" / f"t{which}.gguf"
        trial.write_bytes(bytes(data))
        outcome = isolated(lambda p=trial: load_model_facts(str(p)), args.timeout)
        problem = outcome_problem(outcome)
        if not problem and (outcome[0] != "refused" or str(trial) not in outcome[1]):
            problem = f"not a refusal naming the file: {str(outcome)[:160]}"
        tally.add(f"token {which} length {length}", problem)
        trial.unlink()
    return tally.report()


def _stamped() -> list[tuple[float, None, str]]:
    out = []
    for line in OK_JOURNAL.read_text().splitlines():
        stamp = datetime.strptime(line[:24], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        out.append((stamp, None, line))
    return out


def campaign_timeline(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.core.downtime import downtime_text, estimate_downtime
    from vllm_ctxmgr.vllm_log.timeline import start_timings

    rng = random.Random(args.seed)
    tally = Tally("timeline", args.show)
    lines = _stamped()
    ready = next(i for i, (_, _, m) in enumerate(lines) if "Application startup complete" in m)
    stopping = next(i for i, (_, _, m) in enumerate(lines) if "Stopping vllm-ok" in m)
    span = lines[-1][0] - lines[0][0]
    for _ in range(args.timeline):
        trial = list(lines)
        kind = rng.choice(["step-back", "step-forward", "late-ready"])
        at = rng.randrange(1, len(trial))
        hours = rng.choice([1, 3, 9, 24]) * 3600.0
        if kind == "late-ready":
            at = rng.randrange(ready + 1, stopping + 1)  # while it serves: a stop of hours is a real stop
            trial = [*trial[:at], (trial[at - 1][0] + hours, None, lines[ready][2]),
                     *((s + hours, i, m) for s, i, m in trial[at:])]  # fmt: skip
        else:
            by = -hours if kind == "step-back" else hours
            trial = [*trial[:at], *((s + by, i, m) for s, i, m in trial[at:])]
        stepped = kind == "step-back"

        def run(t: list[tuple[float, None, str]] = trial) -> tuple[float | None, int, list[str]]:
            estimate = estimate_downtime(start_timings(t), compile_cache="miss")
            text = downtime_text(estimate.to_json() if estimate else {})
            return (estimate.total_s if estimate and estimate.phases else None), len(t), text

        outcome = isolated(run, args.timeout)
        problem = outcome_problem(outcome)
        if not problem:
            total, _, text = outcome[1]
            if stepped and (total is not None or "clock" not in " ".join(text)):
                problem = f"a clock step read as {total} s: {text}"
            elif kind == "late-ready" and (total is None or total > span):
                problem = f"a ready line {hours / 3600:g} h later read as {total} s"
            elif total is not None and total < 0:
                problem = f"a negative downtime {total}"
        tally.add(f"{kind} at line {at} by {hours / 3600:g} h", problem)
    return tally.report()


def campaign_world(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.core.serve_args import parse_serve_argv

    rng = random.Random(args.seed)
    tally = Tally("world", args.show)
    sizes = [1, 2, 4, 8, 16, 64, 256, 1024]
    for _ in range(args.world):
        tp, pp, pcp, dp = (rng.choice(sizes) for _ in range(4))
        nnodes = rng.choice([1, 2, 8, 1024, 1025, 1 << 40])
        argv = ["m", "-tp", str(tp), "-pp", str(pp), "--prefill-context-parallel-size", str(pcp),
                "-dp", str(dp), "--nnodes", str(nnodes), "--master-addr", "10.0.0.1"]  # fmt: skip
        outcome = isolated(lambda a=argv: parse_serve_argv(a).tensor_parallel_size, args.timeout)
        problem = outcome_problem(outcome)
        refuse = tp * pp * pcp * dp > 8192 or nnodes > 1024
        if not problem and refuse != (outcome[0] == "refused"):
            problem = f"{'accepted' if outcome[0] == 'ok' else 'refused'}: {str(outcome[1])[:120]}"
        if not problem and outcome[0] == "refused" and len(outcome[1]) > 300:
            problem = f"a refusal of {len(outcome[1])} characters"
        tally.add(f"tp {tp} pp {pp} pcp {pcp} dp {dp} nnodes {nnodes}", problem)
    return tally.report()


def campaign_wire(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.deployment.wire import StepAnswer

    tally = Tally("wire", args.show)
    for version in [3, 3.0, "3", True, False, None, 2, 4, 3.5, [3], {"v": 3}, -3, 10**400, "3.0"]:
        answer = {"wire": version, "service": "vllm.service", "ok": True}
        outcome = isolated(lambda a=answer: StepAnswer.from_json(a).ok, args.timeout)
        problem = outcome_problem(outcome)
        taken = type(version) is int and version == 3
        if not problem and taken != (outcome[0] == "ok"):
            problem = f"{'taken' if outcome[0] == 'ok' else 'refused'}: {str(outcome[1])[:100]}"
        tally.add(repr(version)[:40], problem)
    return tally.report()


def campaign_counts(args: argparse.Namespace) -> int:
    from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import _count

    rng = random.Random(args.seed)
    tally = Tally("counts", args.show)
    alphabet = "0123456789²³¹٠١٢٣۴५६０１２ -+.e\u200b"
    for _ in range(args.counts):
        value = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 3, 12, 13, 5000])))
        outcome = isolated(lambda v=value: _count({"scur": v}, "scur", "vllm", "h1"), args.timeout)
        kind, said = outcome
        problem = None if kind in ("ok", "refused") else f"{kind}: {said}"
        if kind == "unhandled" and "HaproxyError" in said:
            problem = None  # the module's own error (not a CtxmgrError): what its callers catch
        stripped = value.strip() or "0"
        count = bool(re.fullmatch(r"[0-9]{1,12}", stripped))
        if not problem and count != (kind == "ok"):
            problem = f"{'read' if kind == 'ok' else 'refused'} {value[:20]!r}"
        if not problem and kind == "unhandled" and len(said) > 300:
            problem = f"an error of {len(said)} characters"
        tally.add(repr(value[:20]), problem)
    return tally.report()


def campaign_imports(args: argparse.Namespace) -> int:
    from vllm_ctxmgr.change.planning import imported_observation

    rng = random.Random(args.seed)
    tally = Tally("imports", args.show)
    gpu_gib = 95.6
    for _ in range(args.imports):
        weights = round(rng.uniform(1, 120), 1)
        kv = round(rng.uniform(1, 4000), 1)
        total = rng.choice([None, 93.1, 95.6, 140.0, 4090.0])
        record = {"vllm_version": "0.33.0", "platform": "GPU", "gpu_name": "NVIDIA H100 NVL", "ready": True,
                  "failure": None, "total_memory_gib": total, "model_loading_gib": weights,
                  "available_kv_gib": kv, "num_gpu_blocks": 100, "block_size": 16}  # fmt: skip
        text = json.dumps({k: v for k, v in record.items() if v is not None})
        outcome = isolated(
            lambda t=text: imported_observation(
                t, "obs.json", vllm_version="0.33.0", gpu_names=["NVIDIA H100 NVL"],
                gpu_total_bytes=gpu_gib * GIB,
            ),
            args.timeout,
        )  # fmt: skip
        problem = outcome_problem(outcome)
        above = weights + kv > gpu_gib or (total is not None and total > gpu_gib * 1.01)
        if not problem and above and outcome[0] == "ok":
            problem = f"weights {weights} + KV {kv} GiB (total {total}) on a {gpu_gib} GiB GPU was stored"
        elif not problem and not above and outcome[0] != "ok":
            problem = f"refused within the GPU: {outcome[1][:120]}"
        tally.add(f"weights {weights} kv {kv} total {total}", problem)
    return tally.report()


SECTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "version": campaign_version,
    "gguf": campaign_gguf,
    "timeline": campaign_timeline,
    "world": campaign_world,
    "wire": campaign_wire,
    "counts": campaign_counts,
    "imports": campaign_imports,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", default=[], help=", ".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--timeout", type=float, default=15.0)
    parser.add_argument("--version", type=int, default=300)
    parser.add_argument("--gguf", type=int, default=40)
    parser.add_argument("--timeline", type=int, default=200)
    parser.add_argument("--world", type=int, default=300)
    parser.add_argument("--counts", type=int, default=300)
    parser.add_argument("--imports", type=int, default=300)
    parser.add_argument("--show", type=int, default=5, help="failures printed per section")
    run_sections(parser, SECTIONS, WORK)


if __name__ == "__main__":
    main()
