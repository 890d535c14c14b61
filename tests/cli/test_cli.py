"""The command line as a user meets it: output, --json keys, one-line errors and exit codes."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tests.support.cli import run
from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main

GLM5 = str(REPO / "examples" / "models" / "glm-5")
LLAMA70B = str(REPO / "examples" / "models" / "llama-3.1-70b")
UNITS = REPO / "units"
GIB = 1 << 30


def plan_glm5(context: str, *extra: str, gpu_memory: str = "95.6GiB") -> tuple[int, str, str]:
    """GLM-5 at TP 8 on eight GPUs with the seeds' GGUF weights (406.7 GiB)."""
    return run(
        "plan", context, "--model", GLM5, "-tp", "8", "--gpu-memory", gpu_memory, "--gpu-count", "8",
        "--weights-bytes", "406.7GiB", *extra,
    )  # fmt: skip


def test_plan_json_has_the_promised_keys_and_vllm_numbers() -> None:
    code, out, _ = plan_glm5("200000", "--json")
    assert code == 0
    data = json.loads(out)
    for key in (
        "max_model_len",
        "gpu_memory_utilization",
        "feasible",
        "max_context",
        "kv_bytes_per_gpu",
        "kv_bytes_per_token_per_gpu",
    ):
        assert key in data
    assert data["feasible"] is True
    assert data["max_model_len"] == 200000
    # MLA is replicated on every TP rank and the DSA indexer adds 132 B/layer: not the seeds' 11,232
    assert data["kv_bytes_per_token_per_gpu"] == 100_152
    assert data["kv_bytes_per_gpu"] == 3125 * 6_409_728
    assert 0 < data["gpu_memory_utilization"] <= 0.95
    assert data["flag_changes"]["--max-model-len"] == "200000"


def test_plan_human_output_shows_a_table_and_bars() -> None:
    code, out, _ = plan_glm5("200000")
    assert code == 0
    assert "KV needed" in out and "18.66 GiB" in out
    # eight identical GPUs: one row and one bar, labelled with their range (issue 28 item 2)
    assert re.search(r"^ 0-7 \[[#WnKmk.]+\]$", out, re.M)
    assert "FEASIBLE" in out


def test_infeasible_plan_exits_3_with_largest_context_and_alternatives() -> None:
    code, out, _ = plan_glm5("200000", "--json", gpu_memory="72GiB")
    assert code == 3
    data = json.loads(out)
    assert data["feasible"] is False
    assert 0 < data["max_context"] < 200000
    assert data["alternatives"], "an infeasible plan names what would make it fit"
    fp8 = [a for a in data["alternatives"] if a["name"] == "fp8-kv-cache"]
    assert fp8 and fp8[0]["kv_bytes_per_token_per_gpu"] == 61_464


def test_plan_from_a_unit_file_uses_its_flags() -> None:
    code, out, _ = run("plan", "131072", "--service", "vllm-llama70b", "--model", LLAMA70B, "--json")
    assert code == 2  # --service and --model together is a usage error (--unit --model is an override)
    unit = UNITS / "vllm-llama70b.service"
    text = unit.read_text().replace("/srv/models/Llama-3.1-70B-Instruct", LLAMA70B)
    local = REPO / ".cache" / "test-units"
    local.mkdir(parents=True, exist_ok=True)
    (local / "vllm-llama70b.service").write_text(text)
    code, out, _err = run(
        "plan",
        "131072",
        "--unit",
        str(local / "vllm-llama70b.service"),
        "--gpu-memory",
        "80GiB",
        "--gpu-count",
        "4",
        "--json",
    )
    data = json.loads(out)
    # TP 4 and fp8 KV from the unit: 80 layers x 2 heads/GPU x 128 x 2 (K,V) x 1 byte
    assert data["kv_bytes_per_token_per_gpu"] == 40_960
    # 141 GB of weights over 4 x 80 GiB leave room: feasible, and only what must change changes
    assert code == 0 and data["feasible"]
    assert data["flag_changes"]["--max-model-len"] == "131072"
    assert data["gpus"][0]["weights"]["source"] == "safetensors index"


def test_a_config_only_model_keeps_exact_kv_figures() -> None:
    code, out, _ = run("plan", "100000", "--model", GLM5, "-tp", "8", "--json")
    data = json.loads(out)
    assert data["kv_bytes_per_token_per_gpu"] == 100_152
    assert data["kv_bytes_per_gpu"] == 1563 * 6_409_728  # cdiv(100000, 64) blocks
    # no NVML here and no --gpu-memory: the KV figures stand, the memory verdict is unknown (exit 6)
    assert code == 6 and "no memory information" in data["memory"] and data["verdict"] == "unknown"
    assert data["result"] == "unknown" and data["feasible"] is None


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["plan", "0", "--model", GLM5], 2, "must be positive"),
        (["plan", "-5", "--model", GLM5], 2, ""),
        (["plan", "lots", "--model", GLM5], 2, "not a context length"),
        (["plan", "1000", "--model", "/nonexistent/model"], 2, "/nonexistent/model"),
        (["plan", "1000"], 2, "exactly one of --model, --unit or --service"),
        (["facts", str(REPO / "README.md")], 2, ""),
        (["history", "--service", "bad name!"], 2, "is not a unit name"),
    ],
)
def test_bad_input_is_one_line_and_the_right_code(args: list[str], code: int, message: str) -> None:
    exit_code, out, err = run(*args)
    assert exit_code == code
    assert "Traceback" not in err + out
    assert message in err + out


def test_target_above_the_model_maximum_is_refused_unless_allow_long() -> None:
    code, out, _ = plan_glm5("300000", "--json", gpu_memory="141GiB")
    assert code == 3
    assert "202752" in json.loads(out)["reason"].replace(",", "")
    code, out, _ = plan_glm5("300000", "--allow-long", "--json", gpu_memory="141GiB")
    data = json.loads(out)
    assert code == 0 and data["feasible"]
    assert data["env_changes"] == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


def test_bad_unit_file_is_a_usage_error(tmp_path: Path) -> None:
    unit = tmp_path / "web.service"
    unit.write_text("[Service]\nExecStart=/usr/bin/python3 -m http.server 8080\n")
    code, _out, err = run("plan", "8192", "--unit", str(unit))
    assert code == 2
    assert "does not run vLLM" in err
    assert len(err.strip().splitlines()) == 1


def test_facts_json_for_a_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "glm5.gguf"
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_glm5_gguf.py"), str(gguf)],
        check=True,
        capture_output=True,
    )
    code, out, _ = run("facts", str(gguf), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["layer_kinds"] == {"mla": 78}
    assert data["weight_bytes"] > 400 * GIB
    assert data["source_format"] == "gguf"


def test_help_is_fast_enough_to_not_import_heavy_modules() -> None:
    # `ctxmgr --help` must not import transformers, gguf, numpy or requests (the benchmark times it)
    code = (
        "import sys; from vllm_ctxmgr.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('transformers', 'gguf', 'numpy', 'requests', 'jinja2') if m in sys.modules]\n"
        "print('HEAVY:' + ','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY:"


def test_the_command_table_says_what_each_command_says() -> None:
    """`ctxmgr --help` and completion list the commands from COMMANDS without importing them: each
    entry must name its command and carry that command's own short help, so the two cannot drift."""
    from vllm_ctxmgr.cli.main import COMMANDS

    ctx = click.Context(main)
    for name, entry in COMMANDS.items():
        command = main.get_command(ctx, name)
        assert command is not None and command.name == name
        assert entry.short_help == command.get_short_help_str(limit=1 << 20), name
    assert sorted(main.commands) == sorted(COMMANDS)


def test_help_from_the_table_is_the_help_of_the_loaded_commands() -> None:
    """A fresh `ctxmgr --help` (no command imported) prints what it prints with every command loaded."""
    code = (
        "import sys, click; from vllm_ctxmgr.cli.main import COMMANDS, main\n"
        "if sys.argv[1] == 'loaded':\n"
        "    [main.get_command(click.Context(main), name) for name in COMMANDS]\n"
        "print(main.get_help(click.Context(main, info_name='ctxmgr')))\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_ctxmgr.cli.')))\n"
    )

    def help_text(mode: str) -> list[str]:
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        return run.stdout.splitlines()

    lazy, loaded = help_text("lazy"), help_text("loaded")
    assert lazy[:-1] == loaded[:-1]
    assert any(line.split()[:3] == ["plan", "Plan", "CONTEXT"] for line in lazy)
    assert lazy[-1] == "['vllm_ctxmgr.cli.group', 'vllm_ctxmgr.cli.main', 'vllm_ctxmgr.cli.output']"
    assert "vllm_ctxmgr.cli.plan" in loaded[-1]


# the shared parts of the CLI a command's --help builds on: output, the group, the option types, SERVICE,
# the examples; not the Restarter factory, the live status, the confirmation or the finish
SHARED_LIGHT = ("cli.output", "cli.group", "cli.params", "cli.service_param", "cli.examples")


def test_plan_help_and_completion_import_only_the_plan_command() -> None:
    """`ctxmgr plan --help` and `ctxmgr pl<TAB>` are answered by click and the option types: the planner,
    the model readers and systemd are imported when a plan runs."""
    code = (
        "import os, sys; from vllm_ctxmgr.cli.main import main\n"
        "try:\n    main(sys.argv[1:], prog_name='ctxmgr')\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_ctxmgr.')))\n"
    )
    completion = {"_CTXMGR_COMPLETE": "bash_complete", "COMP_WORDS": "ctxmgr pl", "COMP_CWORD": "1"}
    for args, env in ((["plan", "--help"], {}), ([], completion)):
        run = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env={**os.environ, **env}
        )
        *shown, modules = run.stdout.splitlines()
        assert ("--max-model-len" in "\n".join(shown)) if args else shown == ["plain,plan"]
        light = {"cli", "cli.main", "cli.plan", *SHARED_LIGHT, "errors", "masking", "core", "core.bounds"}
        assert set(ast.literal_eval(modules)) <= {f"vllm_ctxmgr.{name}" for name in light}, args


def test_plan_on_a_local_model_reads_no_unit_store_or_log() -> None:
    """`ctxmgr plan --model DIR` plans from the model's files and the GPUs given: the modules that read
    a unit, the revision store, systemd, vLLM's log or a GGUF are not imported for it."""
    code = (
        "import sys; from vllm_ctxmgr.cli.main import main\n"
        "try:\n    main(sys.argv[1:], prog_name='ctxmgr')\nexcept SystemExit as exit:\n"
        "    sys.exit(f'exit {exit.code}')\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm_ctxmgr.')))\n"
    )
    args = ["plan", "8192", "--model", LLAMA70B, "-tp", "4", "--gpu-memory", "80GiB", "--gpu-count", "4"]
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    *shown, modules = run.stdout.splitlines()  # a plan that fits returns from main (exit 0)
    assert any(line.startswith("FEASIBLE") for line in shown)
    loaded = set(ast.literal_eval(modules))
    assert "vllm_ctxmgr.change.planning" in loaded
    for room in ("systemd.service", "store", "change.observing", "systemd.systemctl", "vllm_log.watcher",
                 "model_files.gguf", "core.verdict", "change.walk", "change.states",
                 "change.restart"):  # fmt: skip
        assert f"vllm_ctxmgr.{room}" not in loaded, room


@pytest.mark.skipif(not hasattr(click.exceptions, "NoSuchCommand"), reason="click < 8.4 suggests nothing")
def test_a_mistyped_command_is_offered_the_closest_one_not_yet_imported() -> None:
    code, _, err = run("plann", "200000")
    assert code == 2
    assert "No such command 'plann'. Did you mean 'plan'?" in err
