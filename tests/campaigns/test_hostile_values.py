"""Values that used to end in "unexpected error" (exit 1) and are now one-line refusals (exit 2), and GPU
figures no GPU has (issue 29, items 10 and 11): JSON nested deep in a flag, JSON's inf (1e400) where an
integer belongs, a deeply nested deployment TOML, a node's `show` fields of the wrong type."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_merged
from tests.support.paths import REPO
from vllm_ctxmgr.deployment.wire import WIRE_VERSION

MODEL = str(REPO / "examples" / "models" / "qwen3-32b")
OFFLINE = ("--gpu-memory", "80GiB", "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3")
DEEP = '{"a":' * 3000 + "1" + "}" * 3000


def one_line_refusal(code: int, out: str, match: str) -> None:
    assert code == 2, out
    assert "unexpected error" not in out and match in out, out
    assert len(out.strip().splitlines()) == 1, out


def plan_unit(directory: Path, flags: str, *extra: str) -> tuple[int, str]:
    path = directory / "vllm-x.service"
    path.write_text(f"[Service]\nExecStart=/opt/vllm/bin/vllm serve {MODEL} --max-model-len 8192 {flags}\n")
    return run_merged("plan", "8192", "--unit", str(path), *(extra or OFFLINE))


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (f"--hf-overrides '{DEEP}'", "argument --hf-overrides: nested deeper than 64 levels"),
        (f"--speculative-config '{DEEP}'", "argument --speculative-config/-sc: nested deeper than 64 levels"),
        ("--hf-overrides." + ".".join(["a"] * 3000) + " 1", "argument --hf-overrides: nested deeper"),
        ("--hf-overrides.a " + "'" + DEEP + "'", "argument --hf-overrides: nested deeper"),
        (
            """--speculative-config '{"method": "ngram", "num_speculative_tokens": 1e400}'""",
            "num_speculative_tokens inf is not an integer",
        ),
        ("--block-size -16", "vLLM's block sizes are 1, 8 or a multiple of 16"),
    ],
)
def test_a_units_flag_values_are_refused_in_one_line(tmp_path: Path, flags: str, match: str) -> None:
    one_line_refusal(*plan_unit(tmp_path, flags), match)


def test_a_shallow_hf_override_still_plans(tmp_path: Path) -> None:
    code, out = plan_unit(
        tmp_path, """--hf-overrides '{"text_config": {"a": {"b": 1}}}' --hf-overrides.x.y 2"""
    )
    assert code == 0, out


def test_a_deeply_nested_deployment_file_is_refused(tmp_path: Path) -> None:
    for text in ("x = " + "[" * 5000 + "]" * 5000 + "\n", "x." + ".".join(["a"] * 3000) + " = 1\n"):
        path = tmp_path / "d.toml"
        path.write_text(text)
        code, out = run_merged(
            "--state-dir", str(tmp_path / "state"), "deployment", "plan", "8192", "--file", str(path)
        )
        one_line_refusal(code, out, "nested deeper")


def test_a_gpu_total_of_json_inf_is_refused(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.json"
    gpus.write_text('{"gpus": [{"index": 0, "name": "NVIDIA H100", "total_bytes": 1e400, "free_bytes": 1, '
                    '"used_bytes": 0}]}')  # fmt: skip
    code, out = plan_unit(tmp_path, "", "--gpus-from", str(gpus))
    one_line_refusal(code, out, "not a `ctxmgr gpus --json` object")


FAKE_NODE = """import json, sys
WIRE = @WIRE@
args = sys.argv[1:]
if args[:2] == ["node", "show"]:
    show = json.loads(open(sys.argv[0] + ".show").read())
    # what every `node show` answer carries on the wire (deployment/wire.py ShowAnswer), where the test
    # does not say otherwise
    base = {"wire": WIRE, "service": "vllm-x.service", "unit_digest": "ab" * 32, "active_state": "active"}
    print(json.dumps({**base, **show}))
else:
    print(json.dumps({"result": "error", "error": "not in this test"}))
    sys.exit(2)
""".replace("@WIRE@", str(WIRE_VERSION))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("argv", [1, 2], "`node show` answer: argv[0]=1 is not text"),
        ("argv", "vllm serve m", "`node show` answer: argv='vllm serve m' is not a list"),
        ("environment", [1, 2], "`node show` answer: environment=[1, 2] is not an object"),
        ("environment", {"A": 1}, "`node show` answer: environment.A=1 is not text"),
        ("in_progress", "x", "`node show` answer: in_progress='x' is not a JSON object"),
        ("gpus", [1], "`node show` answer: gpus=[1] is not a JSON object"),
    ],
)
def test_a_nodes_wrongly_typed_show_fields_are_refused(
    tmp_path: Path, field: str, value: object, match: str
) -> None:
    node = tmp_path / "node.py"
    node.write_text(FAKE_NODE)
    show = {"argv": [MODEL, "--max-model-len", "8192"], "environment": {}, field: value}
    (tmp_path / "node.py.show").write_text(json.dumps(show))
    deployment = tmp_path / "d.toml"
    deployment.write_text(
        "".join(
            f'[[node]]\nhost = "{host}"\nservice = "vllm-x"\nctxmgr = ["{sys.executable}", "{node}"]\n'
            for host in ("local", "localhost")
        )
    )
    code, out = run_merged(
        "--state-dir", str(tmp_path / "state"), "deployment", "plan", "8192", "--file", str(deployment),
        "--gpu-memory", "80GiB", "--gpu-count", "1",
    )  # fmt: skip
    progress = "ctxmgr: reading 2 nodes: local:vllm-x, localhost:vllm-x\n"
    assert out.startswith(progress), out
    one_line_refusal(code, out.removeprefix(progress), match)


# ---- item 11: GPU figures no GPU has ----------------------------------------------------------


def gpus_file(directory: Path, total: object) -> Path:
    path = directory / "gpus.json"
    gpu = {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "total_bytes": total,
        "free_bytes": 0,
        "used_bytes": 0,
    }
    path.write_text(json.dumps({"gpus": [gpu]}))
    return path


@pytest.mark.parametrize("total", [10**24, -(80 << 30), 0, (16 << 40) + 1])
def test_a_gpu_total_out_of_range_is_refused(tmp_path: Path, total: int) -> None:
    # 1e24 bytes planned "FEASIBLE at 0.03"; a negative total was accepted
    code, out = plan_unit(tmp_path, "", "--gpus-from", str(gpus_file(tmp_path, total)))
    one_line_refusal(code, out, "is no GPU's (a GPU has more than 0 and at most 16 TiB)")


def test_a_nodes_nvml_answer_out_of_range_is_refused() -> None:
    from vllm_ctxmgr.errors import UsageError
    from vllm_ctxmgr.nvml import gpus_from_json

    answer = {
        "gpus": [{"index": 0, "name": "NVIDIA H100", "total_bytes": 10**24, "free_bytes": 0, "used_bytes": 0}]
    }
    with pytest.raises(UsageError, match="is no GPU's"):
        gpus_from_json(answer, "NVML on node1")


def test_a_real_gpu_total_still_plans(tmp_path: Path) -> None:
    code, out = plan_unit(tmp_path, "", "--gpus-from", str(gpus_file(tmp_path, 85_520_809_984)))
    assert code == 0, out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "1.5", "-0.5"])
def test_a_units_utilisation_out_of_range_is_refused(tmp_path: Path, value: str) -> None:
    # vLLM's config/cache.py gpu_memory_utilization: Field(gt=0, le=1); nan was kept and planned feasible
    code, out = plan_unit(tmp_path, f"--gpu-memory-utilization {value}")
    one_line_refusal(code, out, "--gpu-memory-utilization")
    assert "must be a number in (0, 1]" in out


@pytest.mark.parametrize(
    ("total", "free", "match"),
    [
        ("80.5", "0", "total_bytes '80.5' is not a whole number of bytes"),
        ('"85520809984"', "0", "total_bytes '85520809984' is not a whole number of bytes"),
        ("true", "0", "total_bytes 'True' is not a whole number of bytes"),
    ],
)
def test_gpu_figures_of_the_wrong_kind_are_refused(tmp_path: Path, total: str, free: str, match: str) -> None:
    # int() had read 80.5 as 80, "80" as 80 and true as 1 byte, each planned
    path = tmp_path / "gpus.json"
    path.write_text(
        '{"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": ' + total
        + ', "free_bytes": ' + free + ', "used_bytes": 0}]}'
    )  # fmt: skip
    code, out = plan_unit(tmp_path, "", "--gpus-from", str(path))
    one_line_refusal(code, out, match)


def test_speculative_tokens_beyond_the_count_bound_are_refused(tmp_path: Path) -> None:
    flags = """--speculative-config '{"method": "ngram", "num_speculative_tokens": 1000000000000}'"""
    one_line_refusal(
        *plan_unit(tmp_path, flags), "num_speculative_tokens 1000000000000: ctxmgr reads 0 to 16,777,216"
    )


def test_a_nodes_unit_with_a_size_beyond_the_bounds_is_refused(tmp_path: Path) -> None:
    """Item 8 in a deployment: -pp 1e12 on every node was still in the rank loop after 60 s."""
    node = tmp_path / "node.py"
    node.write_text(FAKE_NODE)
    argv = [MODEL, "--max-model-len", "8192", "--nnodes", "2", "--pipeline-parallel-size", "1000000000000"]
    (tmp_path / "node.py.show").write_text(json.dumps({"argv": argv, "environment": {}}))
    deployment = tmp_path / "d.toml"
    deployment.write_text(
        "".join(
            f'[[node]]\nhost = "{host}"\nservice = "vllm-x"\nctxmgr = ["{sys.executable}", "{node}"]\n'
            for host in ("local", "localhost")
        )
    )
    code, out = run_merged(
        "--state-dir", str(tmp_path / "state"), "deployment", "plan", "8192", "--file", str(deployment),
        "--gpu-memory", "80GiB", "--gpu-count", "1",
    )  # fmt: skip
    progress = "ctxmgr: reading 2 nodes: local:vllm-x, localhost:vllm-x\n"
    one_line_refusal(
        code, out.removeprefix(progress), "--pipeline-parallel-size '1000000000000': must be a whole"
    )
