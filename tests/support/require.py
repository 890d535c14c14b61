"""Where a tier cannot run here: skip locally, fail in CI, so a broken runner cannot pass by skipping."""

from __future__ import annotations

import os

import pytest


def require(reason: str | None, what: str, required_by: str = "CTXMGR_REQUIRE_SYSTEMD") -> None:
    """Skip where `what` cannot run here (reason), or fail where CI requires it (`required_by`=1):
    a broken runner must not pass by skipping."""
    if reason is None:
        return
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {what} cannot run: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")
