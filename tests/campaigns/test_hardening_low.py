"""Issue 16, low: `--vllm-version` below the oldest release ctxmgr knows is refused (above the newest,
the plan says whose rules it used), and CTXMGR_TEMPLATE_DIR is trusted as the state directory is: a
template another user can change would be rendered into a unit that root installs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.errors import UnsafePathError

PLAN = ["plan", "4096", "--model", str(REPO / "examples" / "models" / "qwen3-32b"), "--gpu-memory", "80G",
        "--gpu-count", "1", "--gpu-name", "NVIDIA H100 80GB HBM3"]  # fmt: skip


@pytest.mark.parametrize("version", ["0.0.0", "0.9.2"])
def test_a_vllm_version_older_than_any_known_is_planned_by_the_oldest_rules(version: str) -> None:
    """Issue 28 item 5: plan is read-only: it plans by 0.10's rules and says so (set-context refuses)."""
    result = CliRunner().invoke(main, [*PLAN, "--vllm-version", version])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert (
        f"vLLM {version} is older than the oldest release ctxmgr knows; planned by vLLM 0.10.0's rules"
        in (result.output)
    )


def test_a_vllm_version_newer_than_any_known_says_whose_rules_plan_it() -> None:
    result = CliRunner().invoke(main, [*PLAN, "--vllm-version", "999.0"])
    assert result.exit_code == 0
    assert "vLLM 999.0.0 is newer than the newest release ctxmgr knows; planned by vLLM 0.33.0's rules" in (
        result.output
    )


@pytest.fixture
def templates() -> Iterator[Path]:
    path = REPO / ".cache" / "templates" / uuid.uuid4().hex[:8]
    shutil.copytree(REPO / "templates", path)
    os.environ["CTXMGR_TEMPLATE_DIR"] = str(path)
    yield path
    del os.environ["CTXMGR_TEMPLATE_DIR"]


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_template_dir_another_user_may_change_is_refused(templates: Path, what: str) -> None:
    from vllm_ctxmgr.systemd.unit_edit import edit_unit
    from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

    text = "[Service]\nExecStart=/opt/vllm/bin/vllm serve m\n"
    unit = ServiceUnit("t.service", (UnitFile.parse("/etc/systemd/system/t.service", text),))
    edit_unit(unit, {"--max-model-len": "8192"})  # renders from the operator's own, sound templates
    target = templates if what == "directory" else templates / "unit.j2"
    target.chmod(0o777 if what == "directory" else 0o666)
    with pytest.raises(UnsafePathError, match=rf"{target}: writable by group or others"):
        edit_unit(unit, {"--max-model-len": "4096"})
    target.chmod(0o755 if what == "directory" else 0o644)
    os.chown(target, 65534, 65534)
    with pytest.raises(UnsafePathError, match=rf"{target}: owned by uid 65534"):
        edit_unit(unit, {"--max-model-len": "4096"})
