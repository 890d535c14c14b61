"""The README's install lines run as written (issue 33 item 3): they name the paths `make wheel` and
`make wheelhouse` really write, `make wheel` needs no test tools, and the ctxmgr every CLI test runs
(CTXMGR_BIN, .cache/wheel-venv) was installed with the README's offline line from the wheelhouse alone,
the network cut off (tests/support/wheel-venv.sh records what ran)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.project.test_docs_commands import doc_commands
from tests.support.paths import REPO

MAKEFILE = (REPO / "Makefile").read_text()
OFFLINE = "pip install --no-index --find-links"


def make_default(name: str) -> str:
    found = re.search(rf"^{name} \?= (.+)$", MAKEFILE, flags=re.M)
    assert found, f"the Makefile sets no {name}"
    return found.group(1).strip()


def make_n(target: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip


def readme_install_lines() -> list[str]:
    install = [c for c in doc_commands() if c.doc == "README.md" and ("install" in c.key or "scp" in c.key)]
    assert install, "README shows no install command"
    return [c.key for c in install]


def test_the_wheel_the_readme_installs_is_the_one_make_wheel_writes() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M)
    assert version
    wheel = f"{make_default('WHEEL_DIR')}/vllm_ctxmgr-{version.group(1)}-py3-none-any.whl"
    named = [w for line in readme_install_lines() for w in line.split() if w.endswith(".whl")]
    assert wheel in named, f"README installs {named}; make wheel writes {wheel}"
    for word in named:  # a glob of the same file, never another place
        assert re.fullmatch(
            r"(\S+=\$PWD/)?" + re.escape(make_default("WHEEL_DIR")) + r"/vllm_ctxmgr-[^/]+\.whl", word
        ), word
    # where make wheel puts it: the dist target's own recipe
    assert f"-w {make_default('WHEEL_DIR')} ." in make_n("dist")


def test_make_wheel_builds_without_the_test_tools() -> None:
    recipe = make_n("wheel")
    assert ".venv/bin/" not in recipe and "[test]" not in recipe, recipe
    build_venv = make_default("BUILD_VENV")
    assert f"-m venv {build_venv}" in recipe and f"{build_venv}/bin/pip wheel" in recipe


def test_the_offline_install_line_is_the_one_make_wheel_runs() -> None:
    """README copies `make wheelhouse`'s directory to the host and installs with a line whose words are
    those tests/support/wheel-venv.sh runs, from the directory the Makefile fills."""
    lines = readme_install_lines()
    wheelhouse = make_default("WHEELHOUSE")
    assert "make wheelhouse" in " ".join(c.key for c in doc_commands() if c.doc == "README.md")
    (copy,) = [line for line in lines if line.startswith("scp ")]
    source, target = copy.split()[2:4]
    assert source == wheelhouse, f"README copies {source}; make wheelhouse fills {wheelhouse}"
    (offline,) = [line for line in lines if OFFLINE in line]
    found = re.search(rf"{OFFLINE} (\S+) vllm-ctxmgr$", offline)
    assert found and found.group(1) == target.split(":", 1)[1], offline
    script = (REPO / "tests/support/wheel-venv.sh").read_text()
    ran = re.search(
        r'"\$venv/bin/pip" install (?:-q )?--no-index --find-links "\$wheelhouse" vllm-ctxmgr', script
    )
    assert ran, "tests/support/wheel-venv.sh no longer runs the README's offline line"
    recipe = make_n("wheel")
    assert f"wheel-venv.sh python3 {wheelhouse} {make_default('WHEEL_VENV')}" in recipe.replace(
        make_default("PYTHON"), "python3"
    )
    assert "--only-binary=:all:" in make_n("wheelhouse") and f"--dest {wheelhouse}" in make_n("wheelhouse")


def test_the_installed_ctxmgr_came_from_the_wheelhouse_with_the_network_cut() -> None:
    binary = os.environ.get("CTXMGR_BIN")
    if not binary:
        if os.environ.get("CTXMGR_REQUIRE_WHEEL") == "1":
            pytest.fail("CTXMGR_REQUIRE_WHEEL=1 but CTXMGR_BIN names no installed ctxmgr")
        pytest.skip("CTXMGR_BIN is not set (make test sets it to the wheel's ctxmgr)")
    venv = Path(binary).parent.parent
    record_file = venv / "offline-install.txt"
    assert record_file.is_file(), f"{venv} was not installed by tests/support/wheel-venv.sh"
    record = dict(line.split(": ", 1) for line in record_file.read_text().splitlines())
    if os.geteuid() == 0:
        assert record["how"] == "network namespace (unshare -n)", record["how"]
        assert record["interfaces"] == "lo" and record["network"].startswith("unreachable"), record
    assert record["help"] == "0" and record["plan"] in ("0", "3", "6"), record
    wheelhouse = REPO / make_default("WHEELHOUSE")
    wheels = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in wheelhouse.glob("*.whl")}
    installed = {re.sub(r"[-_.]+", "-", p.split("==")[0]).lower() for p in record["installed"].split()}
    assert "vllm-ctxmgr" in installed and "transformers" in installed
    # what the venv has besides its own pip and setuptools came from the wheelhouse
    assert installed - {"pip", "setuptools"} <= wheels, sorted(installed - wheels)
