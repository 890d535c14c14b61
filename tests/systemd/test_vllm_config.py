"""`vllm serve --config FILE`: vLLM's own YAML config, read with vLLM's precedence (the command line over
the file), checked against vLLM 0.33's own code for it (tests/data/vllm-source, verbatim), and planned."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import DATA, REPO
from tests.support.units import unit_with
from vllm_ctxmgr.change.planning import PlanRequest, plan_for
from vllm_ctxmgr.core.serve_args import ServeArgs
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.systemd.service import VLLM_CONFIG_MAX_BYTES, view_from_unit
from vllm_ctxmgr.systemd.unit_edit import edit_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

UNITS = REPO / "units"
MODELS = REPO / "examples" / "models"
VLLM_SOURCE = DATA / "vllm-source" / "argparse_config_0.33.0.py.txt"
GiB = 1 << 30


class VllmServeParser(argparse.ArgumentParser):
    """The `vllm serve` options these tests use, as vLLM 0.33 declares them (bool engine arguments are
    BooleanOptionalAction, --served-model-name is nargs="+"), with vLLM's own two methods bound."""

    def __init__(self) -> None:
        super().__init__(prog="vllm serve", exit_on_error=False)
        self.add_argument("model_tag", nargs="?")
        self.add_argument("--model")
        self.add_argument("--config")
        self.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        self.add_argument("--max-model-len", type=int)
        self.add_argument("--gpu-memory-utilization", type=float)
        self.add_argument("--max-num-seqs", type=int)
        self.add_argument("--port", type=int, default=8000)
        self.add_argument("--served-model-name", nargs="+")
        self.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
        self.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
        self.add_argument("--headless", action="store_true")


def _bind_vllm_methods() -> None:
    code = textwrap.dedent("".join(line for line in VLLM_SOURCE.open() if not line.startswith("#")))
    namespace: dict[str, Any] = {"json": json, "yaml": yaml, "Any": Any, "logger": logging.getLogger("vllm")}
    exec(compile(code, str(VLLM_SOURCE), "exec"), namespace)  # vLLM's own code, from tests/data
    VllmServeParser._pull_args_from_config = namespace["_pull_args_from_config"]  # type: ignore[attr-defined]
    VllmServeParser.load_config_file = namespace["load_config_file"]  # type: ignore[attr-defined]


_bind_vllm_methods()


def vllm_reads(argv: list[str], config_path: Path) -> argparse.Namespace:
    """What vLLM 0.33 parses for `vllm serve ARGV`: its _pull_args_from_config on ["serve", ...], then
    FlexibleArgumentParser.parse_args's underscore-to-dash step, then argparse."""
    parser = VllmServeParser()
    at = argv.index("--config") + 1  # the file as vLLM opens it (from its working directory)
    args = ["serve", *argv[:at], str(config_path), *argv[at + 1 :]]
    pulled = parser._pull_args_from_config(args)[1:]  # type: ignore[attr-defined]
    dashed = [
        ("--" + w[2:].split("=", 1)[0].replace("_", "-") + ("=" + w.split("=", 1)[1] if "=" in w else ""))
        if w.startswith("--")
        else w
        for w in pulled
    ]
    namespace = parser.parse_args(dashed)
    namespace.model = namespace.model_tag or namespace.model
    return namespace


def same_as_vllm(args: ServeArgs, vllm: argparse.Namespace) -> None:
    assert args.model == vllm.model
    assert args.tensor_parallel_size == vllm.tensor_parallel_size
    assert args.max_model_len == vllm.max_model_len
    assert args.gpu_memory_utilization == vllm.gpu_memory_utilization
    assert args.max_num_seqs == vllm.max_num_seqs
    assert args.port == vllm.port
    assert args.served_model_name == (vllm.served_model_name or [None])[0]
    assert args.enable_prefix_caching == vllm.enable_prefix_caching
    assert args.enforce_eager == vllm.enforce_eager


def installed_config(root: Path, text: str | None = None, name: str = "qwen3.yaml") -> Path:
    path = root / "etc" / "vllm" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text is not None else (UNITS / "etc" / "vllm" / "qwen3.yaml").read_text())
    return path


def config_unit() -> ServiceUnit:
    return ServiceUnit.load_with_dropins(UNITS / "vllm-qwen3-config.service")


def test_unit_and_yaml_give_the_arguments_vllm_parses_and_the_plan_uses_them(tmp_path: Path) -> None:
    config = installed_config(tmp_path)
    unit = config_unit()
    view = view_from_unit(unit, tmp_path)
    args = view.args
    same_as_vllm(args, vllm_reads(view.command.argv(view.env), config))
    assert args.model == "Qwen/Qwen3-32B"  # only in the YAML's `model:` key
    assert (args.tensor_parallel_size, args.max_model_len, args.port) == (2, 16384, 8006)  # the CLI wins
    assert (args.gpu_memory_utilization, args.enable_prefix_caching, args.enforce_eager) == (
        0.85,
        False,
        True,
    )
    assert args.max_num_seqs == 64 and args.served_model_name == "qwen3"
    assert args.config_file == "qwen3.yaml" and view.base_url == "http://127.0.0.1:8006"
    assert any(
        "qwen3.yaml sets max-model-len 32768" in n and "--max-model-len 16384" in n for n in args.notes
    )
    hf_home = tmp_path / "hf"
    snapshot = hf_home / "hub" / "models--Qwen--Qwen3-32B" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(MODELS / "qwen3-32b" / "config.json", snapshot)
    (hf_home / "hub" / "models--Qwen--Qwen3-32B" / "refs").mkdir()
    (hf_home / "hub" / "models--Qwen--Qwen3-32B" / "refs" / "main").write_text("0" * 40)
    plan = plan_for(
        replace(args, env={**args.env, "HF_HOME": str(hf_home)}),
        PlanRequest(16384, gpu_memory=80 * GiB, gpu_count=2, weights_bytes=65524246528),
    )
    assert plan.kv_bytes_per_token_per_gpu == 64 * 8 * 128 * 2 * 2 // 2  # tensor-parallel-size 2 (YAML)
    assert any("the command line takes precedence over --config" in n for n in plan.notes)


def test_set_context_writes_the_command_line_and_leaves_the_yaml_as_it_is(tmp_path: Path) -> None:
    config = installed_config(tmp_path)
    before = config.read_bytes()
    unit = unit_with("/opt/vllm/bin/vllm serve --config /etc/vllm/qwen3.yaml")
    view = view_from_unit(unit, tmp_path)
    assert view.args.max_model_len == 32768  # from the YAML, no flag on the command line
    assert any("ctxmgr writes --max-model-len on the unit's command line" in n for n in view.args.notes)
    edit = edit_unit(unit, {"--max-model-len": "20000"})
    assert "--config /etc/vllm/qwen3.yaml --max-model-len 20000" in edit.new_text
    new = view_from_unit(ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),)), tmp_path)
    same_as_vllm(new.args, vllm_reads(new.command.argv(new.env), config))
    assert new.args.max_model_len == 20000
    assert config.read_bytes() == before


@pytest.mark.parametrize(
    ("yaml_text", "argv"),
    [
        # booleans: `false` adds --no-KEY where the parser has it; an underscored key never matches
        ("model: m/a\nenable-prefix-caching: false\n", ["--config", "c.yaml"]),
        ("model: m/a\nenable_prefix_caching: false\n", ["--config", "c.yaml"]),
        ("model: m/a\nenforce-eager: true\n", ["--config", "c.yaml", "--no-enforce-eager"]),
        ("model: m/a\nheadless: false\nenforce_eager: true\n", ["--config", "c.yaml"]),
        # the positional model beats the YAML's; a CLI --model beats it too (vLLM moves it to the front)
        ("model: m/yaml\ntensor_parallel_size: 4\n", ["m/cli", "--config", "c.yaml", "-tp", "2"]),
        ("model: m/yaml\nmax-model-len: 4096\n", ["--config", "c.yaml", "--model", "m/cli"]),
        # lists: every item is a word; an empty list adds nothing
        ("served-model-name: [a, b]\nmax_num_seqs: 8\n", ["m/x", "--config", "c.yaml"]),
        ("served-model-name: []\n", ["m/x", "--config", "c.yaml", "--served-model-name", "z"]),
        ("gpu-memory-utilization: 0.8\nport: 9000\n", ["m/x", "--port", "8100", "--config", "c.yaml"]),
    ],
)
def test_precedence_and_yaml_types_are_vllms(tmp_path: Path, yaml_text: str, argv: list[str]) -> None:
    config = installed_config(tmp_path, yaml_text, "c.yaml")
    unit = unit_with("/opt/vllm/bin/vllm serve " + " ".join(argv), "WorkingDirectory=/etc/vllm\n")
    view = view_from_unit(unit, tmp_path)
    same_as_vllm(view.args, vllm_reads(argv, config))


def test_config_inside_a_container_is_read_through_its_volumes(tmp_path: Path) -> None:
    installed_config(tmp_path)  # /etc/vllm/qwen3.yaml on the host, /config/qwen3.yaml inside
    unit = unit_with(
        "/usr/bin/docker run -v /etc/vllm:/config:ro -w /config vllm/vllm-openai:v0.11.0 "
        "--config qwen3.yaml --max-model-len 8192"
    )
    args = view_from_unit(unit, tmp_path).args
    assert (args.model, args.tensor_parallel_size, args.max_model_len) == ("Qwen/Qwen3-32B", 2, 8192)
    with pytest.raises(CtxmgrError, match="no -v/--mount maps it"):
        view_from_unit(unit_with("/usr/bin/docker run vllm/vllm-openai:v0.11.0 --config /c/q.yaml"), tmp_path)


def test_config_equals_form_is_not_read_by_vllm_and_ctxmgr_says_so(tmp_path: Path) -> None:
    installed_config(tmp_path)
    view = view_from_unit(unit_with("/opt/vllm/bin/vllm serve m/x --config=/etc/vllm/qwen3.yaml"), tmp_path)
    assert view.args.tensor_parallel_size == 1 and view.args.config_file is None
    assert any("--config=FILE" in n for n in view.args.notes)


def test_hostile_or_broken_config_files_are_one_line_errors(tmp_path: Path) -> None:
    def fails(path: str, match: str) -> None:
        with pytest.raises(CtxmgrError, match=match) as info:
            view_from_unit(unit_with(f"/opt/vllm/bin/vllm serve m/x --config {path}"), tmp_path)
        assert "\n" not in info.value.message

    etc = tmp_path / "etc" / "vllm"
    etc.mkdir(parents=True)
    os.mkfifo(etc / "fifo.yaml")
    fails("/etc/vllm/fifo.yaml", "expected a regular file")  # a FIFO would block a plain open()
    (etc / "dir.yaml").mkdir()
    fails("/etc/vllm/dir.yaml", "a directory, expected a regular file")
    (etc / "big.yaml").write_text("a: " + "x" * VLLM_CONFIG_MAX_BYTES)
    fails("/etc/vllm/big.yaml", "more than the 1 MiB")
    (etc / "bad.yaml").write_text("model: [unclosed\n")
    fails("/etc/vllm/bad.yaml", r"not valid YAML \(line")
    (etc / "list.yaml").write_text("- model\n")
    fails("/etc/vllm/list.yaml", "not a YAML mapping")
    (etc / "c.json").write_text("{}")
    fails("/etc/vllm/c.json", r"only \.yaml/\.yml")
    fails("/etc/vllm/missing.yaml", "no such file")
    with pytest.raises(CtxmgrError, match="more than once"):
        view_from_unit(unit_with("/opt/vllm/bin/vllm serve m/x --config a.yaml --config b.yaml"), tmp_path)
    with pytest.raises(CtxmgrError, match="names no model"):
        (etc / "empty.yaml").write_text("port: 8001\n")
        view_from_unit(unit_with("/opt/vllm/bin/vllm serve --config /etc/vllm/empty.yaml"), tmp_path)


def test_an_api_key_in_the_yaml_is_the_probes_key_and_masked(tmp_path: Path) -> None:
    installed_config(tmp_path, "model: m/x\napi-key: sk-yaml-0123456789\n", "k.yaml")
    view = view_from_unit(unit_with("/opt/vllm/bin/vllm serve --config /etc/vllm/k.yaml"), tmp_path)
    assert view.api_key == "sk-yaml-0123456789"
    assert "sk-yaml-0123456789" in view.secrets
