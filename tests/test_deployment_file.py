"""A deployment file (TOML) is read as the flags are: its hosts go through NodeAddress.parse like
--node (issue 29, item 12), and its gpus_from is a bounded read of a regular file (item 6)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.errors import ExitCode


def plan_with(path: Path, text: str) -> tuple[int, dict]:
    path.write_text(text)
    result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize(
    "host",
    ["-oProxyCommand=touch /tmp/x", "gpu b", "gpu\\nb", "gpu\\tb", "gpu\\u001bb", ""],
)
def test_a_deployment_files_host_is_parsed_as_a_node_flag_is(workdir: Path, host: str) -> None:
    path = workdir / "d.toml"
    code, data = plan_with(path, f'[[node]]\nhost = "{host}"\nservice = "vllm-glm5"\n')
    assert code == ExitCode.USAGE, data
    assert data["error"].startswith(f"{path}: "), data
    assert "expected HOST:UNIT" in data["error"] or "host and service" in data["error"]
    assert "\n" not in data["error"]


@pytest.mark.parametrize("service", ["-x", "vllm glm5", "vllm\\nglm5"])
def test_a_deployment_files_service_is_parsed_as_a_node_flag_is(workdir: Path, service: str) -> None:
    path = workdir / "d.toml"
    code, data = plan_with(path, f'[[node]]\nhost = "gpu-b"\nservice = "{service}"\n')
    assert code == ExitCode.USAGE, data
    assert "expected HOST:UNIT" in data["error"]


def test_a_non_string_host_is_refused(workdir: Path) -> None:
    code, data = plan_with(workdir / "d.toml", '[[node]]\nhost = 5\nservice = "vllm-glm5"\n')
    assert code == ExitCode.USAGE and "host" in data["error"], data
