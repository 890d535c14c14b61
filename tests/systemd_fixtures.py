"""Pytest plugin: a private systemd (tests.support.sandbox) booted once per session, and unit installation.

Tests that use the `sandbox` fixture get the `systemd` marker, so `-m "not systemd"` leaves them out.
Where a sandbox cannot run (not root, no unshare, ...) they are skipped with the reason, unless
CTXMGR_REQUIRE_SYSTEMD=1 (CI): then they fail, so a broken runner cannot pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.require import require
from tests.support.sandbox import Sandbox, sandbox_available
from vllm_ctxmgr.errors import SystemdError
from vllm_ctxmgr.systemd.systemctl import Systemd

SANDBOX_FIXTURES = {"sandbox", "sandbox_systemd", "install_unit"}
# a test that asks for one manager by name runs on that one only
NAMED_SANDBOXES = {"host_sandbox", "debian11_sandbox"}
# the managers a test marked systemd247 runs on: the build machine's systemd and Debian 11's 247
MANAGERS = ("host", "debian11-247")
DEBIAN11_ROOTFS = Path(os.environ.get("CTXMGR_DEBIAN11_ROOTFS", "/var/cache/ctxmgr/debian11-rootfs"))

InstallUnit = Callable[[str, str], str]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked systemd247 runs once per manager (its `sandbox` is the host's, then Debian 11's)."""
    if metafunc.definition.get_closest_marker("systemd247") and SANDBOX_FIXTURES & set(metafunc.fixturenames):
        metafunc.parametrize("sandbox", MANAGERS, indirect=True, scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if (SANDBOX_FIXTURES | NAMED_SANDBOXES) & fixtures:
            item.add_marker(pytest.mark.systemd)
        if "debian11_sandbox" in fixtures:
            item.add_marker(pytest.mark.systemd247)


def require_sandbox() -> None:
    """Skip (or fail, under CTXMGR_REQUIRE_SYSTEMD=1) when no sandbox can run here."""
    require(sandbox_available(), "the systemd sandbox")


@pytest.fixture(scope="session")
def host_sandbox() -> Iterator[Sandbox]:
    """One private systemd (the host's) for the whole session, powered off at the end whatever happened."""
    require_sandbox()
    booted = Sandbox.start()
    try:
        yield booted
    finally:
        booted.stop()


@pytest.fixture(scope="session")
def debian11_sandbox() -> Iterator[Sandbox]:
    """Debian 11's systemd 247 booted from its root file system (tests/support/debian11-rootfs.sh), for
    the whole session: the floor ctxmgr claims, under test with its own journald and tools."""
    require_sandbox()
    has_tree = (DEBIAN11_ROOTFS / "lib/systemd/systemd").exists()
    require(None if has_tree else f"no {DEBIAN11_ROOTFS} (make debian11-rootfs)", "Debian 11's systemd 247")
    booted = Sandbox.start(rootfs=DEBIAN11_ROOTFS)
    try:
        yield booted
    finally:
        booted.stop()


@pytest.fixture(scope="session")
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    """The private systemd a test drives: the host's, or for a test marked systemd247 each manager in
    turn (MANAGERS). Both stay booted for the session; this only picks one."""
    manager = getattr(request, "param", "host")
    return request.getfixturevalue("debian11_sandbox" if manager == "debian11-247" else "host_sandbox")


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
