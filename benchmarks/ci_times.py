"""Where a `make test` run spent its time: each setup step, each test tier, each xdist worker, and the
slowest tests, from the two files the run leaves (`make test` writes both and prints this at its end).

    .venv/bin/python benchmarks/ci_times.py [--times .cache/ci-times.tsv] [--report .cache/test-report.xml]
                                            [--slowest 15] [--markdown]

--times: the rows .ci/timed appends, `STEP<TAB>seconds<TAB>status` (a step run by several commands has a
row for each; they are summed). `setup-wall` is the whole parallel setup, `tests` the whole pytest run.
--report: pytest's JUnit XML. Each test case carries the properties tests/conftest.py gives it: its
tier (fleet, vllm, systemd, quick), whether it is a multinode test, and the worker that ran it. A test's
time there is its setup, call and teardown, so a bed booted by a test's fixture counts in that test.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TIER_ORDER = ("quick", "systemd", "vllm", "fleet")


@dataclass(frozen=True)
class Case:
    name: str
    seconds: float
    tier: str
    multinode: bool
    worker: str
    outcome: str


def read_times(path: Path) -> dict[str, float]:
    """Seconds per setup step (rows of one step summed), in the order the steps first appear."""
    steps: dict[str, float] = {}
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 2:
            continue
        try:
            seconds = float(fields[1])
        except ValueError:
            continue
        steps[fields[0]] = steps.get(fields[0], 0.0) + seconds
    return steps


def read_report(path: Path) -> list[Case]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = kind
        # pytest-xdist's loadgroup appends "@GROUP" to a test's name; the group is not the test's name
        name = re.sub(r"@[^\[\]]*$", "", case.get("name", ""))
        cases.append(
            Case(
                name=f"{case.get('classname', '')}::{name}",
                seconds=float(case.get("time") or 0.0),
                tier=props.get("tier", "?"),
                multinode=props.get("multinode") == "True",
                worker=props.get("worker", "(skipped)"),  # a test skipped by a mark never reaches setup
                outcome=outcome,
            )
        )
    return cases


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def table(headers: tuple[str, ...], rows: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*headers)] + [fmt.format(*row) for row in rows])


def report(steps: dict[str, float], cases: list[Case], slowest: int, markdown: bool) -> str:
    out: list[str] = []
    if steps:
        rows = [(name, f"{s:.0f}", minutes(s)) for name, s in steps.items()]
        out += ["setup and run (wall seconds; setup steps run side by side within setup-wall)", ""]
        out += [table(("step", "s", "m:ss"), rows, markdown), ""]
    if cases:
        by_tier: dict[str, list[Case]] = defaultdict(list)
        for case in cases:
            by_tier[case.tier].append(case)
        rows = []
        for name in [*TIER_ORDER, *sorted(set(by_tier) - set(TIER_ORDER))]:
            group = by_tier.get(name, [])
            if group:
                total = sum(c.seconds for c in group)
                rows.append((name, str(len(group)), f"{total:.0f}", minutes(total)))
        multinode = [c for c in cases if c.multinode]
        if multinode:
            total = sum(c.seconds for c in multinode)
            rows.append(("(multinode, across tiers)", str(len(multinode)), f"{total:.0f}", minutes(total)))
        total = sum(c.seconds for c in cases)
        rows.append(("all", str(len(cases)), f"{total:.0f}", minutes(total)))
        out += ["tests per tier (summed test seconds: setup + call + teardown)", ""]
        out += [table(("tier", "tests", "s", "m:ss"), rows, markdown), ""]
        by_worker: dict[str, float] = defaultdict(float)
        for case in cases:
            by_worker[case.worker] += case.seconds
        rows = [(w, f"{s:.0f}", minutes(s)) for w, s in sorted(by_worker.items())]
        out += ["busy time per xdist worker", "", table(("worker", "s", "m:ss"), rows, markdown), ""]
        top = sorted(cases, key=lambda c: c.seconds, reverse=True)[:slowest]
        rows = [(c.name, c.tier, f"{c.seconds:.1f}") for c in top]
        out += [f"the {len(top)} slowest tests", "", table(("test", "tier", "s"), rows, markdown)]
        bad = [c for c in cases if c.outcome in ("failure", "error")]
        if bad:
            out += ["", f"{len(bad)} failed or errored: " + ", ".join(c.name for c in bad[:10])]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", type=Path, default=Path(".cache/ci-times.tsv"))
    parser.add_argument("--report", type=Path, default=Path(".cache/test-report.xml"))
    parser.add_argument("--slowest", type=int, default=15)
    parser.add_argument("--markdown", action="store_true", help="tables as Markdown (for docs/)")
    args = parser.parse_args(argv)
    steps = read_times(args.times) if args.times.is_file() else {}
    cases = read_report(args.report) if args.report.is_file() else []
    if not steps and not cases:
        print(f"nothing to report: neither {args.times} nor {args.report} exists (run `make test`)")
        return 1
    print(report(steps, cases, args.slowest, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
