"""Issue 28 item 2: a plan table an SRE can check by hand.

The margin in its own column (headroom = KV budget - KV needed - margin) with what it is for; the
weights apart from the other non-KV memory; what sets the largest context; identical GPUs as one row;
weights that alone exceed the GPU named as such; the plan's confidence in words and numbers, its error
bands those benchmarks/calibration_logs.py measures.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time

from click.testing import CliRunner

from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.confidence import CALIBRATED_BAND, ESTIMATED_BAND
from vllm_ctxmgr.core.hardware import GIB, GpuInfo, GpuState
from vllm_ctxmgr.core.observations import Observation, ObservationRecord
from vllm_ctxmgr.core.plan import PlanOptions, make_plan
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.report import plan_text

GLM5 = str(REPO / "examples" / "models" / "glm-5")
LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")


def plan_glm5(gpu_memory: str, *extra: str) -> tuple[int, str, dict]:
    """The issue's case: GLM-5 at 200,000 on eight GPUs with the seeds' GGUF weights."""
    args = ["plan", "200000", "--model", GLM5, "-tp", "8", "--gpu-memory", gpu_memory, "--gpu-count", "8",
            "--weights-bytes", "406.72GiB", *extra]  # fmt: skip
    text = CliRunner().invoke(main, args)
    data = CliRunner().invoke(main, [*args, "--json"])
    return text.exit_code, text.stdout, json.loads(data.stdout)


def sentence(text: str, prefix: str) -> str:
    """A note of the plan (margin, confidence) as one line: the report wraps it for a terminal, each
    continuation two columns further in than the line it continues."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(prefix))
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    words = [lines[start].strip()]
    for line in lines[start + 1 :]:
        if len(line) - len(line.lstrip()) != indent or not line.strip():
            break
        words.append(line.strip())
    return " ".join(words)


def table_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["GPU"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_the_margin_has_its_column_and_the_headroom_adds_up() -> None:
    code, text, data = plan_glm5("95.6GiB")
    assert code == 0
    header = next(line for line in text.splitlines() if line.split()[:1] == ["GPU"])
    assert header.split() == ["GPU", "total", "others", "weights", "other", "non-KV", "KV", "budget", "KV",
                              "needed", "margin", "headroom"]  # fmt: skip
    [row] = table_rows(text)  # eight identical GPUs: one row
    assert row[0] == "0-7"
    figures = [float(v) for v in row[1::2]]
    _total, _others, weights, other, budget, needed, margin, headroom = figures
    g = data["gpus"][0]
    assert weights == round(g["weights"]["bytes"] / GIB, 2)
    assert other == round((g["non_kv"]["bytes"] - g["weights"]["bytes"]) / GIB, 2)  # weights apart
    assert margin == round(g["margin"]["bytes"] / GIB, 2) == 3.99
    assert abs(budget - needed - margin - headroom) <= 0.011  # checkable by hand
    note = sentence(text, "margin: ")
    assert note.startswith(f"margin: {margin:.2f} GiB of KV budget kept spare")
    assert "widened for what is not known exactly (the spread of the estimated terms" in note
    assert "n other non-KV" in text


def test_gpus_that_differ_keep_their_own_rows() -> None:
    facts = load_model_facts(LLAMA70B)
    busy = GpuInfo(2, "GPU", 80 * GIB, 70 * GIB, 10 * GIB)
    gpus = GpuState(
        (
            GpuInfo(0, "GPU", 80 * GIB, 80 * GIB, 0),
            GpuInfo(1, "GPU", 80 * GIB, 80 * GIB, 0),
            busy,
            GpuInfo(3, "GPU", 80 * GIB, 80 * GIB, 0),
        ),
        "given",
    )
    plan = make_plan(facts, ServeArgs(LLAMA70B, tensor_parallel_size=4), gpus, PlanOptions(32768))
    labels = [row[0] for row in table_rows(plan_text(plan))]
    assert labels == ["0-1", "2", "3"]


def test_weights_that_alone_exceed_the_gpu_are_named() -> None:
    code, text, data = plan_glm5("40GiB")
    assert code == 3
    assert "NOT FEASIBLE: does not fit: the weights alone take 50.84 GiB per GPU, more than the" in text
    assert "weights alone" in data["reason"]
    code, text, _ = plan_glm5("56GiB")
    assert "even the whole GPU is too small: weights 50.84 GiB + other non-KV" in text


def test_what_sets_the_largest_context_is_said() -> None:
    _, text, data = plan_glm5("95.6GiB")
    assert data["max_context_limit"] == "model"
    assert "largest context that fits: 202,752 (the model's limit: max_position_embeddings)" in text
    _, text, data = plan_glm5("70GiB")
    assert data["max_context_limit"] == "memory"
    assert "largest context that fits: 55,424 (memory:" in text


def test_an_estimated_plan_says_so_with_the_benchmarks_band_in_its_own_gib() -> None:
    _, text, data = plan_glm5("95.6GiB")
    confidence = data["confidence"]
    assert confidence["level"] == "estimated" and confidence["started_at"] is None
    assert confidence["error_band"]["worst_percent"] == -3.1
    line = sentence(text, "confidence: ")
    assert "estimated" in line and "worst -3.1% over 9 public starts" in line
    assert "3.1% of this plan's 23.41 GiB is 0.73 GiB, inside its 3.99 GiB margin" in line


def test_a_calibrated_plan_names_the_start_and_its_age() -> None:
    facts = load_model_facts(LLAMA70B)
    gpus = GpuState(tuple(GpuInfo(i, "GPU", 80 * GIB, 80 * GIB, 0) for i in range(4)), "given")
    when = time.time() - 3 * 3600
    record = ObservationRecord(
        Observation(vllm_version="0.33.0", gpu_memory_utilization=0.9, available_kv_gib=30.0,
                    model_loading_gib=32.9, ready=True),
        time=when,
        ok=True,
    )  # fmt: skip
    args = ServeArgs(LLAMA70B, tensor_parallel_size=4, gpu_memory_utilization=0.9, vllm_version="0.33.0")
    plan = make_plan(facts, args, gpus, PlanOptions(32768, vllm_version=(0, 33, 0)), [record.planned()])
    assert plan.confidence is not None and plan.confidence.level == "calibrated"
    assert plan.confidence.started_at == when
    line = sentence(plan_text(plan), "confidence: ")
    assert "calibrated: the KV budget is the one this service's last start logged" in line
    assert "vLLM 0.33.0, recorded " in line and ", 3.0 h old)" in line
    assert "KV cache tokens was off by median +0.0%, worst -0.3% over 10 public starts" in line
    assert plan.to_json()["confidence"]["level"] == "calibrated"


def test_the_error_bands_are_what_the_calibration_benchmark_measures() -> None:
    spec = importlib.util.spec_from_file_location(
        "calibration_logs", REPO / "benchmarks" / "calibration_logs.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["calibration_logs"] = bench
    spec.loader.exec_module(bench)
    budget_errors, token_errors = bench.errors([bench.run_case(case) for case in bench.cases()])
    assert ESTIMATED_BAND.starts == len(budget_errors)
    assert round(statistics.median(budget_errors), 3) == ESTIMATED_BAND.median
    assert round(max(budget_errors, key=abs), 3) == ESTIMATED_BAND.worst
    assert CALIBRATED_BAND.starts == len(token_errors)
    assert round(statistics.median(token_errors), 3) == CALIBRATED_BAND.median
    assert round(max(token_errors, key=abs), 3) == CALIBRATED_BAND.worst
    # issue 35: the bands are over public GPU starts; ctxmgr's own CPU-build journals (a fixed KV
    # space, not an estimate) were 3 of the 11
    cpu_rows = [bench.run_case(case) for case in bench.cases() if case.total_bytes is None]
    assert len(cpu_rows) == 3 and bench.errors(cpu_rows) == ([], [])
    assert "public starts" in ESTIMATED_BAND.text()
