"""vLLM's flag table, 0.10 - 0.33: every flag classified, read as vLLM's parser reads it, named when not
modelled, and refused for a unit whose vLLM release does not have it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_merged
from tests.support.paths import REPO
from vllm_ctxmgr.core import vllm_flags
from vllm_ctxmgr.core.serve_args import parse_serve_argv, split_flags
from vllm_ctxmgr.core.vllm_flag_list import ALIAS_RELEASES, RELEASES, VLLM_FLAGS
from vllm_ctxmgr.core.vllm_versions import NEWEST_VLLM, OLDEST_VLLM

LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")
UNITS = REPO / "units"
VLLM_SOURCES = Path("/work/vllm-src")  # one unpacked wheel per release (not on CI: see the fixture tests)
FIXTURE = REPO / "tests" / "data" / "vllm_flags"
GENERATOR = REPO / "benchmarks" / "vllm_flags_table.py"


def test_every_flag_of_every_release_is_classified_and_every_entry_is_a_real_flag() -> None:
    names = [row[0][0] for row in VLLM_FLAGS]
    assert len(names) == len(set(names)) > 350
    newest = [row for row in VLLM_FLAGS if vllm_flags.FLAGS[row[0][0]].minors >= {33}]
    assert len(newest) > 300  # 0.33's `vllm serve --help` lists 330 options
    for name in names:
        kind = vllm_flags.classify(name)
        assert kind is not None and kind.detail != "unclassified", name
        assert kind.effect in ("modelled", "none", "not modelled")
    for table in (vllm_flags.MODELLED, vllm_flags.NOT_MODELLED, vllm_flags.NO_EFFECT):
        assert [name for name in table if name not in vllm_flags.FLAGS] == []
    for family, _detail in vllm_flags.NOT_MODELLED.values():
        assert family in vllm_flags.FAMILIES


def test_the_committed_table_is_consistent_with_itself_and_the_planners_releases() -> None:
    minors = [int(v.split(".")[1]) for v in RELEASES]
    assert all(v.endswith(".0") for v in RELEASES)  # each minor's .0
    assert minors == list(range(OLDEST_VLLM[1], NEWEST_VLLM[1] + 1))  # every release the planner supports
    options = [o for row in VLLM_FLAGS for o in row[0]]
    assert len(options) == len(set(options))  # an option string is one flag's
    only_old = 0
    for names, dest, _cls, kind, releases, source in VLLM_FLAGS:
        assert re.fullmatch(r"0\.\d+(-0\.\d+)?(,0\.\d+(-0\.\d+)?)*", releases), releases
        spans = vllm_flags.FLAGS[names[0]].minors
        assert spans and spans <= set(minors), names
        assert kind in ("json", "bool", "switch", "optional", "list", "value") and dest
        assert re.fullmatch(r"(engine|entrypoints/[a-z]+)/[a-z_]+\.py:\d+", source), source
        # the file of the newest release that has it: the frontend moved to common/ in 0.33
        assert ("common/" in source) == (max(spans) == 33 and "entrypoints" in source)
        only_old += 33 not in spans
    for alias, releases in ALIAS_RELEASES.items():
        owner = vllm_flags.FLAGS[next(row[0][0] for row in VLLM_FLAGS if alias in row[0][1:])]
        assert vllm_flags._minors(releases) < owner.minors
    header = (REPO / "vllm_ctxmgr" / "core" / "vllm_flag_list.py").read_text()
    assert (
        f"{len(VLLM_FLAGS)} flags in all, {len(VLLM_FLAGS) - only_old} in 0.33.0, {only_old} only" in header
    )


def test_flags_of_old_releases_have_the_releases_their_source_shows() -> None:
    # each read in that release's engine/arg_utils.py (`grep -n -- --swap-space vllm/engine/arg_utils.py`)
    expected = {
        "--num-scheduler-steps": "0.10",  # SchedulerConfig.num_scheduler_steps, gone with V0 in 0.11
        "--max-seq-len-to-capture": "0.10",
        "--rope-scaling": "0.10-0.11",  # then --hf-overrides' rope_parameters
        "--rope-theta": "0.10-0.11",
        "--swap-space": "0.10-0.17",
        "--disable-log-requests": "0.10-0.16",  # its successor --enable-log-requests came in 0.11
        "--task": "0.10-0.12",
        "--guided-decoding-backend": "0.10-0.11",  # 0.11: a deprecated loop of add_argument calls
        "--enable-log-requests": "0.11-0.33",
        "--grpc": "0.20-0.33",
        "--reasoning-effort-map": "0.33",
    }
    assert {name: vllm_flags.FLAGS[name].releases for name in expected} == expected
    assert vllm_flags.FLAGS["--num-scheduler-steps"].source == "engine/arg_utils.py:803"
    # -O named --compilation-config in 0.10 - 0.11; since 0.12 FlexibleArgumentParser reads it as
    # --optimization-level, so the union does not take it as an alias
    assert ALIAS_RELEASES["-O"] == "0.10-0.11" and "-O" not in vllm_flags.ALIASES
    assert vllm_flags.ALIASES["-cc"] == "--compilation-config"


@pytest.mark.skipif(
    not (VLLM_SOURCES / "0.10.0" / "vllm").is_dir(), reason="vLLM 0.10.0 is not unpacked here"
)
def test_the_old_flags_are_in_the_unpacked_0_10_source() -> None:
    arg_utils = (VLLM_SOURCES / "0.10.0" / "vllm" / "engine" / "arg_utils.py").read_text().splitlines()
    for name in ("--num-scheduler-steps", "--swap-space", "--max-seq-len-to-capture", "--rope-scaling"):
        assert any(f'"{name}"' in line or f"'{name}'" in line for line in arg_utils), name
    line = int(vllm_flags.FLAGS["--num-scheduler-steps"].source.rsplit(":", 1)[1])
    assert "--num-scheduler-steps" in arg_utils[line - 1]


def _generator():
    spec = importlib.util.spec_from_file_location("vllm_flags_table", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_reads_each_releases_layout_from_the_fixture() -> None:
    generator = _generator()
    releases = generator.read_releases(FIXTURE)
    assert list(releases) == ["0.10.0", "0.11.0", "0.33.0"]
    rows, aliases = generator.merge(releases)
    by_name = {row[0][0]: row for row in rows}
    # the newest release's option strings, class, kind and file:line; the releases it is in
    assert by_name["--compilation-config"] == (
        ("--compilation-config", "-cc", "-O"), "compilation_config", "VllmConfig", "json", "0.10-0.11,0.33",
        "engine/arg_utils.py:14",
    )  # fmt: skip
    assert aliases == {"-O": "0.10-0.11", "-cc": "0.33"}
    assert by_name["--num-scheduler-steps"][3:] == ("value", "0.10", "engine/arg_utils.py:16")
    assert by_name["--enable-lora"][3:5] == ("bool", "0.10,0.33")  # a flag may come and go
    assert by_name["--rope-scaling"][3:5] == ("json", "0.10-0.11")  # Optional[dict]
    assert by_name["--cuda-graph-sizes"][3] == "list"
    assert by_name["--hf-overrides"][3] == "json"  # dict[str, object] | None
    assert by_name["--disable-log-requests"][3] == "switch"
    assert by_name["--guided-decoding-backend"][4:] == ("0.11", "engine/arg_utils.py:15")  # the loop
    # the frontend: openai/cli_args.py before, common/cli_args.py (with BaseFrontendArgs) in 0.33
    assert by_name["--disable-frontend-multiprocessing"][5] == "entrypoints/openai/cli_args.py:7"
    assert by_name["--chat-template"][2:] == (
        "BaseFrontendArgs",
        "value",
        "0.33",
        "entrypoints/common/cli_args.py:2",
    )
    assert by_name["--port"][4] == "0.10-0.11,0.33"
    assert "model_tag" not in by_name


def test_the_generated_file_is_the_data_the_table_reads() -> None:
    text = _generator().render(_generator().read_releases(FIXTURE))
    namespace: dict = {}
    exec(compile(text, "vllm_flag_list.py", "exec"), namespace)
    assert namespace["RELEASES"] == ("0.10.0", "0.11.0", "0.33.0")
    assert len(namespace["VLLM_FLAGS"]) == 21 and namespace["ALIAS_RELEASES"]["-O"] == "0.10-0.11"
    assert "21 flags in all, 13 in 0.33.0, 8 only in older releases." in text
    assert subprocess.run(
        [str(Path(sys.executable).parent / "ruff"), "format", "--check", "-"], input=text, text=True,
        capture_output=True,
    ).returncode == 0  # fmt: skip


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
    code, out = run_merged(
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
    code, plain = run_merged(
        "plan", "32768", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4",
        "--json",
    )  # fmt: skip
    base = json.loads(plain)
    widened = data["gpus"][0]["margin"]["bytes"] - base["gpus"][0]["margin"]["bytes"]
    assert widened == int(0.05 * 80 * (1 << 30))
    assert base["not_modelled_flags"] == []


def test_text_output_names_them_too() -> None:
    code, out = run_merged(
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
    code, out = run_merged(
        "plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", typo, "1"
    )
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
    code, out = run_merged(
        "plan", "32768", "--unit", str(local / "vllm-llama70b.service"), "--gpu-memory", "80GiB",
        "--gpu-count", "4", "--json",
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(out)
    # --enable-lora is counted (a dense model: core/deployment.py lora_bytes), the other two are named
    assert [e["flag"] for e in data["not_modelled_flags"]] == ["--moe-backend", "--limit-mm-per-prompt"]
    assert {e["family"] for e in data["not_modelled_flags"]} == {"kernels", "lowers memory"}
    assert "--enable-lora" in data["gpus"][0]["weights"]["source"]


@pytest.mark.skipif(not (VLLM_SOURCES / "0.33.0").is_dir(), reason="the vLLM releases are not unpacked here")
def test_the_committed_table_is_what_the_generator_reads_from_every_release() -> None:
    """Locally, with every release's wheel unpacked under /work/vllm-src (docs/deployment-flags.md)."""
    trees = [p.name for p in VLLM_SOURCES.iterdir() if re.fullmatch(r"0\.\d+\.0", p.name)]
    if sorted(trees) != sorted(RELEASES):
        pytest.skip(f"not every release of {RELEASES} is unpacked here")
    generated = subprocess.run(
        [sys.executable, str(GENERATOR), str(VLLM_SOURCES)], capture_output=True, text=True, check=True
    ).stdout
    assert generated == (REPO / "vllm_ctxmgr" / "core" / "vllm_flag_list.py").read_text()


def test_a_dry_run_repeats_the_named_flags() -> None:
    from vllm_ctxmgr.change.planning import PlanRequest, plan_for
    from vllm_ctxmgr.change.walk import ChangeResult
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
    _, plain = run_merged(*base)
    _, images = run_merged(*base, "--limit-mm-per-prompt", '{"image": 2, "video": 0}')
    _, none = run_merged(*base, "--limit-mm-per-prompt.image", "0", "--limit-mm-per-prompt.video", "0")
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


@pytest.mark.parametrize(
    "name, version, has",
    [
        ("--num-scheduler-steps", (0, 10, 0), True),  # removed before 0.33: 0.10 has it
        ("--num-scheduler-steps", (0, 33, 0), False),
        ("--num-scheduler-steps", None, True),  # the unit's vLLM unknown: any release's flag
        ("--grpc", (0, 10, 0), False),  # added late: 0.20
        ("--grpc", (0, 33, 0), True),
        ("--no-enable-lora", (0, 10, 0), True),  # a BooleanOptionalAction's negative form
        ("--hf-overrides.rope_parameters", (0, 10, 0), True),  # a dotted key is its flag's
        ("--enable-log-requests", (0, 10, 0), False),  # 0.11 on
        ("--enable-log-requests", (0, 10, 2), True),  # a patch release may have what the next minor has
        ("--disable-log-requests", (0, 16, 1), True),
        ("--disable-log-requests", (0, 17, 0), False),
        ("--num-scheduler-steps", (0, 9, 2), True),  # releases not read: as the union
        ("--num-scheduler-steps", (0, 34, 0), True),
    ],
)
def test_a_flag_is_looked_up_in_the_units_release(name: str, version: tuple | None, has: bool) -> None:
    assert (vllm_flags.flag_in(name, version) is not None) is has
    assert vllm_flags.flag(name) is not None  # the union has every one


def test_a_flag_the_release_lacks_gets_argparses_own_message_and_its_releases() -> None:
    given = {"--port": "8000", "--num-scheduler-steps": "8", "--disable-log-requests": False, "--grpc": True}
    # argparse (parse_args) lists every word it could not place, as `vllm serve: error: ...` prints it
    assert vllm_flags.unrecognized(given, (0, 33, 0), "0.33.0+cpu") == (
        "vllm serve: error: unrecognized arguments: --num-scheduler-steps 8 --no-disable-log-requests "
        "(--num-scheduler-steps is in vLLM 0.10, --disable-log-requests is in vLLM 0.10-0.16; "
        "this unit runs 0.33.0+cpu)"
    )
    assert vllm_flags.unrecognized(given, (0, 10, 0)) == (
        "vllm serve: error: unrecognized arguments: --grpc "
        "(--grpc is in vLLM 0.20-0.33; this unit runs 0.10.0)"
    )
    assert vllm_flags.unrecognized(given, None) is None
    assert vllm_flags.unrecognized({"--not-a-vllm-flag": "1"}, (0, 33, 0)) is None  # a plugin's, maybe
    # a typo's suggestion comes from the release's own flags
    assert vllm_flags.closest("--num-scheduler-step", (0, 10, 0)) == "--num-scheduler-steps"
    assert vllm_flags.closest("--num-scheduler-step", (0, 33, 0)) != "--num-scheduler-steps"


def test_plan_with_a_vllm_version_refuses_a_flag_of_other_releases() -> None:
    base = ("plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4")
    code, out = run_merged(*base, "--vllm-version", "0.33.0", "--num-scheduler-steps", "8")
    assert code == 2 and "Traceback" not in out
    assert "vllm serve: error: unrecognized arguments: --num-scheduler-steps 8" in out
    assert "--num-scheduler-steps is in vLLM 0.10; --vllm-version 0.33.0" in out
    code, out = run_merged(*base, "--vllm-version", "0.10.0", "--num-scheduler-steps", "8")
    assert code == 0, out
    code, out = run_merged(*base, "--vllm-version", "0.10.0", "--performance-mode", "throughput")
    assert code == 2 and "--performance-mode is in vLLM 0.17-0.33" in out
