"""Issue 16 items 3 and 5: the probe sends a key vLLM really accepts, and no key source leaks.

vLLM 0.33 declares `api_key: list[str] | None` (entrypoints/common/cli_args.py), which its get_kwargs
turns into argparse `nargs="+"` with the default "store" action: the LAST `--api-key` wins. Its
server then accepts `[key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]`
(entrypoints/serve/middleware/register.py). A `--config` YAML's flags go before the command line's
(FlexibleArgumentParser._pull_args_from_config), so the command line's --api-key wins over the
YAML's. Inside a container the environment is the container's: docker's --env-file first, then each
-e/--env (joined `-eK=V` too), a bare `-e K` passing the caller's value.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.demo import offline_gpu_args
from tests.support.paths import REPO
from tests.support.units import unit_with
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.masking import api_keys_in_args, vllm_api_keys
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.unit_edit import edit_unit, unified_diff

MODEL = REPO / "examples" / "models" / "qwen3-32b"


def vllm_parser() -> argparse.ArgumentParser:
    """The options of vLLM's parser that decide what --api-key takes, declared as vLLM declares them
    (list[str] -> nargs="+"; ints; a positional model; allow_abbrev left on)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--api-key", type=str, nargs="+", default=None)
    parser.add_argument("--api-server-count", type=int, default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=str, default=None)
    return parser


def flexible(args: list[str]) -> list[str]:
    """FlexibleArgumentParser.parse_args: underscores to dashes in every `--name` (up to a dot)."""
    out = []
    for arg in args:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            out.append(
                re.sub(r"(?<=--)[^\.]*", lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value
            )
        else:
            out.append(arg)
    return out


ARGVS = [
    ["m", "--api-key", "sk-aaaa", "--api-key", "sk-bbbb"],
    ["m", "--api-key", "sk-aaaa", "sk-bbbb", "--port", "8001"],
    ["m", "--api-key=sk-aaaa", "--api_key", "sk-cccc", "sk-dddd"],
    ["m", "--api-k", "sk-abbrev"],
    ["m", "--api-key", "-123", "sk-after-negative"],
    ["m", "--api-key", "sk-aaaa", "--max-model-len", "4096", "--api-key=sk-last"],
    ["m", "--port", "8001"],
    ["m", "--api-key", ""],
    ["m", "--api-key", "sk-x y", "--port", "1"],
]


@pytest.mark.parametrize("argv", ARGVS)
@pytest.mark.parametrize("env", [{}, {"VLLM_API_KEY": "sk-env-1234"}, {"VLLM_API_KEY": ""}])
def test_the_keys_are_those_vllms_argparse_and_server_take(argv: list[str], env: dict[str, str]) -> None:
    parsed, _ = vllm_parser().parse_known_args(flexible(argv))
    expected = [key for key in (parsed.api_key or [env.get("VLLM_API_KEY", "")]) if key]
    assert vllm_api_keys(argv, env) == expected


def test_the_first_of_two_flags_is_not_the_key() -> None:
    """Before: the probe took the first --api-key, which vLLM discards."""
    assert vllm_api_keys(ARGVS[0], {}) == ["sk-bbbb"]


def test_two_api_key_flags_probe_with_the_last() -> None:
    view = view_from_unit(
        unit_with(f"/opt/vllm/bin/vllm serve {MODEL} --api-key sk-first-1111 --api-key sk-last-2222")
    )
    assert view.api_key == "sk-last-2222"
    assert {"sk-first-1111", "sk-last-2222"} <= set(view.secrets)


def test_the_command_lines_key_wins_over_the_yamls(workdir: Path) -> None:
    config = workdir / "k.yaml"
    config.write_text(f"model: {MODEL}\napi-key: sk-yaml-0123456789\n")
    view = view_from_unit(
        unit_with(f"/opt/vllm/bin/vllm serve --config {config} --api-key sk-cli-9876543210")
    )
    assert view.api_key == "sk-cli-9876543210"
    config.write_text(f"model: {MODEL}\napi-key: [sk-yaml-0123456789, sk-yaml-second-22]\n")
    view = view_from_unit(unit_with(f"/opt/vllm/bin/vllm serve --config {config}"))
    assert view.api_key == "sk-yaml-0123456789" and "sk-yaml-second-22" in view.secrets


DOCKER = (
    "/usr/bin/docker run --rm --gpus all -v /srv/models:/models {opts} "
    "vllm/vllm-openai:v0.11.0 --model /models/m"
)


@pytest.mark.parametrize(
    ("opts", "extra", "expected"),
    [
        ("-eVLLM_API_KEY=sk-joined-4444", "", "sk-joined-4444"),
        ("--env=VLLM_API_KEY=sk-long-5555", "", "sk-long-5555"),
        ("-e VLLM_API_KEY=sk-one-6666 -e VLLM_API_KEY=sk-two-7777", "", "sk-two-7777"),
        ("-e VLLM_API_KEY", "Environment=VLLM_API_KEY=sk-caller-8888\n", "sk-caller-8888"),
        ("--env VLLM_API_KEY", "", None),  # the caller has none: docker passes nothing
        ("", "Environment=VLLM_API_KEY=sk-unit-only-9999\n", None),  # the container never sees it
        ("--env-host", "Environment=VLLM_API_KEY=sk-envhost-1212\n", "sk-envhost-1212"),  # podman
    ],
)
def test_a_containers_key_is_the_one_the_container_gets(opts: str, extra: str, expected: str | None) -> None:
    view = view_from_unit(unit_with(DOCKER.format(opts=opts), extra))
    assert view.api_key == expected


def test_a_docker_env_file_gives_the_key_and_the_command_line_overrides_it(workdir: Path) -> None:
    env_file = workdir / "vllm.env"
    env_file.write_text('# keys\nHF_TOKEN=hf_abc\n  VLLM_API_KEY="sk-file-quoted-3131"\nPASSED\n')
    view = view_from_unit(unit_with(DOCKER.format(opts=f"--env-file {env_file}")))
    assert view.api_key == '"sk-file-quoted-3131"'  # docker keeps the quotes: they are part of the key
    assert view.vllm_env["HF_TOKEN"] == "hf_abc" and "PASSED" not in view.vllm_env
    view = view_from_unit(unit_with(DOCKER.format(opts=f"--env-file={env_file} -e VLLM_API_KEY=sk-cli-3232")))
    assert view.api_key == "sk-cli-3232"


def test_a_joined_docker_key_is_masked_in_the_diff() -> None:
    """Item 5: `-eVLLM_API_KEY=...` showed unmasked in the dry run's diff."""
    unit = unit_with(DOCKER.format(opts="-eVLLM_API_KEY=sk-joined-secret-77"))
    view = view_from_unit(unit)
    edit = edit_unit(unit, {"--max-model-len": "8192"})
    diff = unified_diff(edit.old_text, edit.new_text, str(edit.path), view.secrets)
    assert "--max-model-len" in diff and "sk-joined-secret-77" not in diff and "***" in diff
    assert "sk-joined-secret-77" not in "".join(api_keys_in_args(view.vllm_argv))


def test_no_key_of_the_yaml_or_the_command_line_in_plans_text_or_json(workdir: Path) -> None:
    """Item 5: with a key in both the YAML and the command line, the --config note quoted both."""
    config = workdir / "k.yaml"
    config.write_text(f"model: {MODEL}\napi-key: sk-yaml-note-4545\nmax-model-len: 4096\n")
    unit = workdir / "vllm-k.service"
    unit.write_text(
        f"[Service]\nExecStart=/opt/vllm/bin/vllm serve --config {config} --api-key sk-cli-note-4646\n"
    )
    for fmt in ([], ["--json"]):
        result = CliRunner().invoke(main, ["plan", "8192", "--unit", str(unit), *offline_gpu_args(), *fmt])
        assert result.exit_code in (0, 3), result.output
        assert "api-key" in result.output  # the note is there, its values are not
        assert "sk-yaml-note-4545" not in result.output and "sk-cli-note-4646" not in result.output
        if fmt:
            json.loads(result.output)
