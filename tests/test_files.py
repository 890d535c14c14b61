"""vllm_ctxmgr/files.py's open_path: a path below another manager's root (/proc/PID/root) is resolved
as that container sees it, for reads and writes alike.

The container here is a child process of this test chrooted into a folder (no sandbox needed, but
root is: chroot). In it an absolute link points at a folder of "the host" (another folder of this
test): the kernel alone follows it from the caller's root, so ctxmgr read the host's file, and wrote
a drop-in into the host's folder. Every case below failed that way before open_path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.require import require
from vllm_ctxmgr import files
from vllm_ctxmgr.change.restart import Restarter
from vllm_ctxmgr.errors import SystemdError, UsageError
from vllm_ctxmgr.store import ServiceStore
from vllm_ctxmgr.systemd.systemctl import Systemd, cmdline_argv
from vllm_ctxmgr.systemd.unit_file import read_environment_file


@pytest.fixture
def container(tmp_path: Path) -> Iterator[tuple[Path, Path, int]]:
    """(the container's root folder, a host folder with a secret, the PID whose root is the folder)."""
    require(None if os.geteuid() == 0 else "needs root (chroot)", "a chrooted process")
    rootfs, host = tmp_path / "rootfs", tmp_path / "host"
    (rootfs / "etc/systemd/system").mkdir(parents=True)
    (rootfs / "run").mkdir()
    host.mkdir()
    (host / "config.json").write_text('{"password_hash": "$6$host-secret"}')
    (host / "vllm.env").write_text("HF_TOKEN=host-secret\n")
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # the "container": chrooted, says so, then waits until the test closes the pipe
        os.close(write_end)
        os.close(ready_read)
        os.chroot(rootfs)
        os.write(ready_write, b"r")
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(ready_write)
    chrooted = os.read(ready_read, 1)  # /proc/CHILD/root is the folder only once it has chrooted
    os.close(ready_read)
    assert chrooted == b"r", "the chrooted child died before it was ready"
    try:
        yield rootfs, host, child
    finally:
        os.close(write_end)
        os.waitpid(child, 0)


def test_a_path_below_a_process_root_is_split_there() -> None:
    assert files.split_root("/proc/42/root/etc/x.json") == ("/proc/42/root", "etc/x.json")
    assert files.split_root("/proc/42/root") == ("/proc/42/root", ".")
    assert files.split_root("/proc/self/root/etc") is None  # ours: nothing to resolve apart
    assert files.split_root("/etc/proc/42/root/x") is None


def test_a_linked_folder_is_the_containers_not_the_hosts(container: tuple[Path, Path, int]) -> None:
    rootfs, host, pid = container
    (rootfs / "etc/model").symlink_to(host)  # absolute: "/…/host" means the container's own path
    (rootfs / "etc/other.json").symlink_to("/../../..//" + str(host / "config.json"))
    inside = Path(f"/proc/{pid}/root")
    for path in (inside / "etc/model/config.json", inside / "etc/other.json"):
        with pytest.raises(FileNotFoundError):
            files.read_regular(path, 1 << 20)
    # the container's own file at the same path is what is read
    (rootfs / str(host).lstrip("/")).mkdir(parents=True)
    (rootfs / str(host / "config.json").lstrip("/")).write_text('{"inside": true}')
    assert files.read_regular(inside / "etc/model/config.json", 1 << 20) == b'{"inside": true}'


def test_an_environment_file_through_a_linked_folder_stays_inside(container: tuple[Path, Path, int]) -> None:
    rootfs, host, pid = container
    (rootfs / "etc/default").symlink_to(host)
    with pytest.raises(Exception) as caught:
        read_environment_file("/etc/default/vllm.env", root=Path(f"/proc/{pid}/root"))
    assert "host-secret" not in str(caught.value)
    assert read_environment_file("-/etc/default/vllm.env", root=Path(f"/proc/{pid}/root")) == {}


def test_a_drop_in_folder_linked_to_the_host_is_written_in_the_container(
    container: tuple[Path, Path, int], tmp_path: Path
) -> None:
    rootfs, host, pid = container
    (rootfs / "etc/systemd/system/vllm.service.d").symlink_to(host)
    systemd = Systemd(root=Path(f"/proc/{pid}/root"))
    restarter = Restarter(systemd, ServiceStore(tmp_path / "state", "vllm"), "vllm")
    drop_in = Path("/etc/systemd/system/vllm.service.d/50-ctxmgr.conf")
    with pytest.raises(Exception, match="cannot write"):
        restarter._install_file(drop_in, b"[Service]\nExecStart=/bin/true\n")
    assert sorted(p.name for p in host.iterdir()) == ["config.json", "vllm.env"]  # the host's, untouched
    assert restarter.installed_bytes(drop_in) is None
    # a real drop-in folder of the container's is written and removed as before
    (rootfs / "etc/systemd/system/vllm.service.d").unlink()
    restarter._install_file(drop_in, b"[Service]\n")
    assert (rootfs / "etc/systemd/system/vllm.service.d/50-ctxmgr.conf").read_bytes() == b"[Service]\n"
    assert restarter.installed_bytes(drop_in) == b"[Service]\n"
    restarter._install_file(drop_in, None)
    assert not (rootfs / "etc/systemd/system/vllm.service.d").exists()


def test_a_fifo_over_the_main_process_cmdline_cannot_hang_the_plan(container: tuple[Path, Path, int]) -> None:
    rootfs, _, pid = container
    (rootfs / "proc/4242").mkdir(parents=True)
    os.mkfifo(rootfs / "proc/4242/cmdline")
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(cmdline_argv(Systemd(root=Path(f"/proc/{pid}/root")), 4242))
        except SystemdError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader so the test process can end
        with open(rootfs / "proc/4242/cmdline", "wb"):
            pass
        pytest.fail("cmdline_argv blocked on a FIFO")
    assert isinstance(outcome[0], SystemdError) and "a FIFO" in str(outcome[0])


def test_an_unknown_file_kind_is_refused_in_the_callers_words(container: tuple[Path, Path, int]) -> None:
    rootfs, _, pid = container
    (rootfs / "etc/vllm").mkdir()
    with pytest.raises(UsageError, match="a directory, expected a regular file"):
        files.read_regular(Path(f"/proc/{pid}/root/etc/vllm"), 1 << 20)
