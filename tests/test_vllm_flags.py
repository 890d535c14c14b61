"""vLLM 0.33's flag table: every flag classified, read as vLLM's parser reads it, named when not modelled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core import vllm_flags
from vllm_ctxmgr.core.serve_args import parse_serve_argv, split_flags
from vllm_ctxmgr.core.vllm_flag_list import VLLM_0_33_0_FLAGS

REPO = Path(__file__).resolve().parent.parent
LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")
UNITS = REPO / "units"
VLLM_SOURCE = Path("/work/vllm-src/0.33.0/vllm")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout + result.stderr


def test_every_flag_of_0_33_is_classified_and_every_entry_is_a_real_flag() -> None:
    names = [row[0][0] for row in VLLM_0_33_0_FLAGS]
    assert len(names) == len(set(names)) > 300  # 0.33's `vllm serve --help` lists 330 options
    for name in names:
        kind = vllm_flags.classify(name)
        assert kind is not None and kind.detail != "unclassified", name
        assert kind.effect in ("modelled", "none", "not modelled")
    for table in (vllm_flags.MODELLED, vllm_flags.NOT_MODELLED, vllm_flags.NO_EFFECT):
        assert [name for name in table if name not in vllm_flags.FLAGS] == []
    for family, _detail in vllm_flags.NOT_MODELLED.values():
        assert family in vllm_flags.FAMILIES


@pytest.mark.parametrize(
    "word, name, kind",
    [
        ("-tp", "--tensor-parallel-size", "value"),
        ("-q", "--quantization", "value"),
        ("-sc", "--speculative-config", "json"),
        ("-cc", "--compilation-config", "json"),
        ("--device-memory-utilization", "--gpu-memory-utilization", "value"),
        ("--enable_lora", "--enable-lora", "bool"),
        ("--hf-overrides", "--hf-overrides", "json"),
        ("--limit-mm-per-prompt", "--limit-mm-per-prompt", "json"),  # MultiModalDummyOptions: a dict
        ("--served-model-name", "--served-model-name", "list"),
        ("--headless", "--headless", "switch"),
        ("--hf-token", "--hf-token", "optional"),
    ],
)
def test_the_table_has_vllms_option_strings_and_kinds(word: str, name: str, kind: str) -> None:
    flag = vllm_flags.flag(vllm_flags.canonical_name(word))
    assert flag is not None and flag.name == name and flag.kind == kind


def test_the_dotted_and_the_json_forms_read_the_same() -> None:
    dotted = parse_serve_argv(
        ["m", "--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens", "1"]
    )
    whole = parse_serve_argv(["m", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    assert (dotted.speculative_method, dotted.num_speculative_tokens) == ("mtp", 1)
    assert (whole.speculative_method, whole.num_speculative_tokens) == ("mtp", 1)
    # FlexibleArgumentParser appends the merged dotted keys after every other word: they replace
    # an earlier JSON value of the same flag as a whole
    _, flags = split_flags(["--hf-overrides", '{"a": 1}', "--hf-overrides.b.c=2", "--hf-overrides.d", "3k"])
    assert json.loads(str(flags["--hf-overrides"])) == {"b": {"c": 2}, "d": 3000}


def test_flag_kinds_decide_what_takes_a_value() -> None:
    positionals, flags = split_flags(
        [
            "m",
            "-O3",
            "--enable-lora",
            "x",
            "--served-model-name",
            "a",
            "b",
            "--no-enforce-eager",
            "--port",
            "9",
        ]
    )
    # --enable-lora is a BooleanOptionalAction: "x" is a positional, not its value
    assert positionals == ["m", "x"]
    assert flags == {
        "--optimization-level": "3",
        "--enable-lora": True,
        "--served-model-name": "a",
        "--enforce-eager": False,
        "--port": "9",
    }


def test_plan_takes_every_real_vllm_flag_and_names_the_unmodelled_ones() -> None:
    code, out = run(
        "plan", "32768", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4",
        "--enable-eplb", "--eplb-config.num_redundant_experts", "32", "--disable-log-stats",
        "--tool-call-parser", "llama3_json", "--json",
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(out)
    named = {entry["flag"] for entry in data["not_modelled_flags"]}
    assert named == {"--enable-eplb", "--eplb-config"}
    warning = next(w for w in data["warnings"] if w.startswith("changes GPU memory, not modelled"))
    assert "--enable-eplb, --eplb-config" in warning and "5%" in warning
    # the margin grew by the expert-parallel family's 5% of each 80 GiB GPU
    code, plain = run(
        "plan", "32768", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4",
        "--json",
    )  # fmt: skip
    base = json.loads(plain)
    widened = data["gpus"][0]["margin"]["bytes"] - base["gpus"][0]["margin"]["bytes"]
    assert widened == int(0.05 * 80 * (1 << 30))
    assert base["not_modelled_flags"] == []


def test_text_output_names_them_too() -> None:
    code, out = run(
        "plan", "32768", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4",
        "--compilation-config.cudagraph_mode", "FULL_DECODE_ONLY",
    )  # fmt: skip
    assert code == 0, out
    assert "warning: changes GPU memory, not modelled: --compilation-config" in out
    assert "margin widened by 2.40 GiB per GPU" in out  # cuda graphs: 3% of 80 GiB


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ("--enable-lorra", "--enable-lora"),
        ("--max-lora-rnk", "--max-lora-rank"),
        ("--gpu-memory-utilisation", ""),
    ],
)
def test_a_typo_is_not_a_vllm_flag_with_the_closest_real_one(typo: str, suggestion: str) -> None:
    code, out = run("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", typo, "1")
    assert code == 2 and "Traceback" not in out
    assert f"{typo}: not a vLLM flag" in out
    assert (f"did you mean {suggestion}?" in out) if suggestion else True


def test_a_unit_names_its_unmodelled_flags(tmp_path: Path) -> None:
    text = (
        (UNITS / "vllm-llama70b.service").read_text().replace("/srv/models/Llama-3.1-70B-Instruct", LLAMA70B)
    )
    text = text.replace(
        "--port 8001", "--port 8001 --moe-backend triton --enable-lora --limit-mm-per-prompt.image 0"
    )
    local = REPO / ".cache" / "test-units-i15"
    local.mkdir(parents=True, exist_ok=True)
    (local / "vllm-llama70b.service").write_text(text)
    code, out = run(
        "plan", "32768", "--unit", str(local / "vllm-llama70b.service"), "--gpu-memory", "80GiB",
        "--gpu-count", "4", "--json",
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(out)
    # --enable-lora is counted (a dense model: core/deployment.py lora_bytes), the other two are named
    assert [e["flag"] for e in data["not_modelled_flags"]] == ["--moe-backend", "--limit-mm-per-prompt"]
    assert {e["family"] for e in data["not_modelled_flags"]} == {"kernels", "lowers memory"}
    assert "--enable-lora" in data["gpus"][0]["weights"]["source"]


@pytest.mark.skipif(not VLLM_SOURCE.is_dir(), reason="vLLM 0.33.0's source is not unpacked here")
def test_the_committed_table_is_what_the_generator_reads_from_vllm() -> None:
    generated = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vllm_flags_table.py"), str(VLLM_SOURCE), "0.33.0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    committed = (REPO / "vllm_ctxmgr" / "core" / "vllm_flag_list.py").read_text()
    assert [line for line in generated.splitlines() if line.startswith("    ((")] == [
        line for line in committed.splitlines() if line.startswith("    ((")
    ]


def test_a_dry_run_repeats_the_named_flags() -> None:
    from vllm_ctxmgr.deploy import ChangeResult
    from vllm_ctxmgr.planning import PlanRequest, plan_for
    from vllm_ctxmgr.report import change_text

    args = parse_serve_argv([LLAMA70B, "-tp", "4", "--enable-eplb", "--max-model-len", "8192"])
    plan = plan_for(args, PlanRequest(32768, gpu_memory=80 * (1 << 30), gpu_count=4))
    result = ChangeResult("vllm-llama70b.service", "set-context", "dry-run", False, plan=plan.to_json())
    text = change_text(result)
    assert "warning: changes GPU memory, not modelled: --enable-eplb" in text
    assert (
        json.loads(json.dumps(result.to_json()))["plan"]["not_modelled_flags"][0]["flag"] == "--enable-eplb"
    )


def test_a_logged_start_with_the_same_flags_widens_only_for_the_kv_layout() -> None:
    from vllm_ctxmgr.core.hardware import GpuInfo, GpuState
    from vllm_ctxmgr.core.observations import Observation
    from vllm_ctxmgr.core.plan import PlanOptions, make_plan
    from vllm_ctxmgr.model_files.load import load_model_facts

    facts = load_model_facts(LLAMA70B)
    total = 80 * (1 << 30)
    gpus = GpuState(tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", total, total, 0) for i in range(4)), "given")
    logged = Observation(
        vllm_version="0.33.0", platform="GPU", max_model_len=8192, gpu_memory_utilization=0.9,
        model_loading_gib=35.0, available_kv_gib=30.0, ready=True,
    )  # fmt: skip

    def margin(*flags: str, observations: tuple[Observation, ...] = ()) -> int:
        args = parse_serve_argv([LLAMA70B, "-tp", "4", "--max-model-len", "8192", *flags])
        plan = make_plan(facts, args, gpus, PlanOptions(16384), observations)
        return int(plan.gpus[0].margin.bytes or 0)

    # estimated: every family widens; logged: the start's own budget already holds EPLB's experts
    assert margin("--enable-eplb") - margin() == int(0.05 * total)
    assert margin("--enable-eplb", observations=(logged,)) == margin(observations=(logged,))
    # a changed KV layout is still ctxmgr's own arithmetic after a logged start
    kv = margin("--num-gpu-blocks-override", "100", observations=(logged,)) - margin(observations=(logged,))
    assert kv == int(0.02 * total)


def test_no_modality_at_all_is_named_without_widening() -> None:
    base = (
        "plan",
        "32768",
        "--model",
        LLAMA70B,
        "-tp",
        "4",
        "--gpu-memory",
        "80GiB",
        "--gpu-count",
        "4",
        "--json",
    )
    _, plain = run(*base)
    _, images = run(*base, "--limit-mm-per-prompt", '{"image": 2, "video": 0}')
    _, none = run(*base, "--limit-mm-per-prompt.image", "0", "--limit-mm-per-prompt.video", "0")
    margin = {
        k: json.loads(v)["gpus"][0]["margin"]["bytes"] for k, v in (("p", plain), ("i", images), ("n", none))
    }
    assert margin["i"] - margin["p"] == int(0.05 * 80 * (1 << 30))  # the multimodal family
    assert margin["n"] == margin["p"]  # every limit 0 is --language-model-only: it only lowers memory
    assert json.loads(none)["not_modelled_flags"][0]["family"] == "lowers memory"


def test_a_units_short_dotted_alias_reads_like_the_long_form() -> None:
    # FlexibleArgumentParser takes any "-x.key" word as dotted; -cc is --compilation-config's alias
    short = parse_serve_argv(["m", "-cc.cudagraph_mode", "NONE"])
    long = parse_serve_argv(["m", "--compilation-config", '{"cudagraph_mode": "NONE"}'])
    assert short.compilation_config == long.compilation_config == {"cudagraph_mode": "NONE"}
    assert short.enforce_eager and long.enforce_eager
