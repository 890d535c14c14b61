"""Pytest plugin: a private systemd (tests.support.sandbox) booted once per session, and unit installation.

Tests that use the `sandbox` fixture get the `systemd` marker, so `-m "not systemd"` leaves them out.
Where a sandbox cannot run (not root, no unshare, ...) they are skipped with the reason, unless
CTXMGR_REQUIRE_SYSTEMD=1 (CI): then they fail, so a broken runner cannot pass by skipping.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

import pytest

from tests.support.require import require
from tests.support.sandbox import Sandbox, sandbox_available
from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd.systemctl import Systemd

SANDBOX_FIXTURES = {"sandbox", "sandbox_systemd", "install_unit"}

InstallUnit = Callable[[str, str], str]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SANDBOX_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.systemd)


def require_sandbox() -> None:
    """Skip (or fail, under CTXMGR_REQUIRE_SYSTEMD=1) when no sandbox can run here."""
    require(sandbox_available(), "the systemd sandbox")


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """One private systemd for the whole session, powered off at the end whatever happened."""
    require_sandbox()
    booted = Sandbox.start()
    try:
        yield booted
    finally:
        booted.stop()


@pytest.fixture
def sandbox_systemd(sandbox: Sandbox) -> Systemd:
    return sandbox.systemd


@pytest.fixture
def install_unit(sandbox: Sandbox) -> Iterator[InstallUnit]:
    """install_unit(name, text) writes the unit to the sandbox's /run/systemd/system and reloads; at the
    end of the test every unit installed is stopped, removed (with drop-ins) and reloaded away."""
    systemd = sandbox.systemd
    installed: list[str] = []

    def install(name: str, text: str) -> str:
        (systemd.host_unit_dir / name).write_text(text)
        if name not in installed:
            installed.append(name)
        systemd.daemon_reload()
        return name

    yield install

    for name in installed:
        with contextlib.suppress(SystemdError):
            systemd.stop(name)
        with contextlib.suppress(SystemdError):
            systemd.reset_failed(name)
        (systemd.host_unit_dir / name).unlink(missing_ok=True)
        shutil.rmtree(systemd.host_unit_dir / f"{name}.d", ignore_errors=True)
    if installed:
        systemd.daemon_reload()
