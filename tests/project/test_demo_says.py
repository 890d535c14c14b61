"""`make demo` says what it shows (issue 33 item 5): each claim the demo (examples/demo.py) and README's
paragraph on it make is checked against what the demo runs: the co-tenant's plan has a co-tenant (the
`others` column), "fits" comes with the headroom the plan printed, the time note names the stand-in's
real time scale, and a journal line cut for the echo says so."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from click.testing import CliRunner

from tests.support.demo import offline_gpu_args, standin_unit
from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.cli.restarter import ECHO_WIDTH, journal_echo

README = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())


def demo_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ctxmgr_demo", REPO / "examples" / "demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(*args: str) -> tuple[int, str]:
    model = str(REPO / "examples/models/glm-5")
    result = CliRunner().invoke(main, ["plan", "200000", "--model", model, "-tp", "8", *args])
    return result.exit_code, result.stdout


def test_the_co_tenant_plan_has_a_co_tenant_in_the_others_column(tmp_path: Path) -> None:
    demo = demo_module()
    gpus = demo.co_tenant_gpus(tmp_path)
    weights = offline_gpu_args()[offline_gpu_args().index("--weights-bytes") + 1]
    code, out = plan("--gpus-from", str(gpus), "--weights-bytes", weights)
    assert code == 3 and "NOT FEASIBLE" in out, out  # the demo's banner: not feasible
    row = next(line for line in out.splitlines() if line.lstrip().startswith("0-7 "))
    others = row.split()[3]
    assert others == f"{demo.CO_TENANT_GIB:.2f}", row  # the co-tenant's GiB in the others column
    assert f"holds {demo.CO_TENANT_GIB} GiB of each GPU" in README
    assert "what would make it fit" in out
    listed = json.loads(gpus.read_text())["gpus"]
    assert all(g["processes"] and g["processes"][0]["used_bytes"] == g["used_bytes"] for g in listed)


def test_fits_is_told_with_the_headroom_the_plan_printed() -> None:
    demo = demo_module()
    code, out = plan(*offline_gpu_args(), "--json")
    assert code == 0
    told = demo.estimate_verdict(json.loads(out))
    code, text = plan(*offline_gpu_args())
    row = next(line for line in text.splitlines() if line.lstrip().startswith("0-7 "))
    headroom = row.split()[-2]  # the table's last column, in GiB
    util = re.search(r"FEASIBLE: fits at gpu_memory_utilization ([\d.]+)", text)
    assert util, text
    assert f"fits at gpu_memory_utilization {util.group(1)}, with {headroom} GiB per GPU to spare" in told
    assert (
        f"says 200,000 fits at gpu_memory_utilization {util.group(1)}, with {headroom} GiB per GPU" in README
    )
    assert "fits easily" not in README and "looks easy" not in (REPO / "examples/demo.py").read_text()


def test_the_time_note_names_the_scale_the_stand_in_runs_at() -> None:
    demo = demo_module()
    scale = re.search(
        r"Environment=CTXMGR_STANDIN_TIME_SCALE=([\d.]+)", standin_unit(Path("/bin/true"), port=8000)
    )
    assert scale and f"CTXMGR_STANDIN_TIME_SCALE={scale.group(1)}" in demo.STANDIN_TIME
    assert float(scale.group(1)) == 0.2 and "a fifth of that" in demo.STANDIN_TIME
    assert "the stand-in's seconds" in README


def test_the_seeds_are_said_before_they_are_used() -> None:
    demo_text = " ".join((REPO / "examples/demo.py").read_text().split())
    for text in (README, demo_text):
        first = text.index("seeds")
        assert (
            "the notes and logs of the GLM-5 deployment this project started from"
            in text[first : first + 400]
        )


def test_a_journal_line_cut_for_the_echo_ends_in_an_ellipsis() -> None:
    log = (REPO / "tests/data/vllm-logs/fail_b_kv_too_small_bytes.log").read_text().splitlines()
    line = next(line for line in log if "KV cache is needed" in line)
    assert len(line) > ECHO_WIDTH
    echoed = journal_echo(line)
    assert len(echoed) == ECHO_WIDTH and echoed.endswith("...") and line.startswith(echoed[:-3])
    short = "INFO 12-07 21:50:36 [entry.py:139] Starting vLLM server on http://127.0.0.1:43681"
    assert journal_echo(short) == short
