"""Issue 16 item 12: a container path is resolved in the container's view, not by string prefix.
`-v /v:/models` with the model `/models/../outside` planned from the host's `/v/../outside` (which
the container cannot see); an absolute symlink inside the volume was followed on the host; a
`--tmpfs /models` over the volume was ignored."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ctxmgr_cli import run_ctxmgr
from tests.support.demo import GLM5_CONFIG_DIR, make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import REPO
from tests.support.standin import free_port
from vllm_ctxmgr.errors import CtxmgrError, UnitError
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import container_volumes, find_vllm_command, host_path

IMAGE = "vllm/vllm-openai:v0.11.0"


@pytest.fixture
def root() -> Iterator[Path]:
    """A private host filesystem: /srv/models (a volume's source) and /srv/data (another's)."""
    path = REPO / ".cache" / "container-paths" / uuid.uuid4().hex[:8]
    (path / "srv" / "models" / "m").mkdir(parents=True)
    (path / "srv" / "data" / "d").mkdir(parents=True)
    (path / "etc").mkdir()
    yield path


def volumes_of(options: str) -> list:  # type: ignore[type-arg]
    return container_volumes(find_vllm_command(f"/usr/bin/docker run {options} {IMAGE} --model /models/m"))


def test_dot_dot_is_resolved_inside_the_container(root: Path) -> None:
    volumes = volumes_of("-v /v:/models")
    assert host_path("/models/../outside", volumes) is None  # the container's /outside: no volume
    on_disk = volumes_of("-v /srv/models:/models")
    assert host_path("/models/m/../m", on_disk, root) == "/srv/models/m"
    assert host_path("/models/missing/../m", on_disk, root) is None  # the kernel stops at the missing name
    (root / "srv" / "models" / "file").write_text("x")
    assert host_path("/models/file/.", on_disk, root) is None  # ENOTDIR
    both = volumes_of("-v /srv/models:/models -v /srv/data:/outside")
    assert host_path("/models/../outside/d", both, root) == "/srv/data/d"


def test_an_absolute_symlink_in_a_volume_is_resolved_in_the_containers_view(root: Path) -> None:
    volumes = volumes_of("-v /srv/models:/models -v /srv/data:/data")
    (root / "srv" / "models" / "to-etc").symlink_to("/etc")  # the container's /etc, not the host's
    assert host_path("/models/to-etc", volumes, root) is None
    (root / "srv" / "models" / "to-data").symlink_to("/data/d")  # into the other volume
    assert host_path("/models/to-data", volumes, root) == "/srv/data/d"
    (root / "srv" / "models" / "up").symlink_to("../../etc")  # relative, out of the volume's root
    assert host_path("/models/up", volumes, root) is None
    (root / "srv" / "models" / "m" / "same").symlink_to("../m")
    assert host_path("/models/m/same/same", volumes, root) == "/srv/models/m"
    (root / "srv" / "models" / "loop").symlink_to("loop")
    with pytest.raises(UnitError, match="too many symbolic links"):
        host_path("/models/loop", volumes, root)


def test_a_tmpfs_over_a_volume_hides_it() -> None:
    volumes = volumes_of("-v /v:/models --tmpfs /models")
    with pytest.raises(UnitError, match=r"/models/m is on the container's tmpfs at /models"):
        host_path("/models/m", volumes)
    deeper = volumes_of("-v /v:/models --tmpfs /models/cache:size=1g")
    assert host_path("/models/m", deeper) == "/v/m"
    mount = volumes_of("-v /v:/models --mount type=tmpfs,destination=/models")
    with pytest.raises(UnitError, match="tmpfs"):
        host_path("/models/m", mount)


def test_a_later_mount_on_the_same_target_shadows_the_earlier() -> None:
    assert host_path("/models/m", volumes_of("-v /a:/models -v /b:/models")) == "/b/m"


def test_the_view_refuses_a_model_that_escapes_its_volume(root: Path) -> None:
    (root / "srv" / "models" / "esc").symlink_to("/etc")
    text = f"[Service]\nExecStart=/usr/bin/docker run -v /srv/models:/models {IMAGE} --model /models/esc\n"
    unit = ServiceUnit("t.service", (UnitFile.parse("/etc/systemd/system/t.service", text),))
    with pytest.raises(CtxmgrError, match="no -v/--mount maps it"):
        view_from_unit(unit, root)


def test_a_manager_in_another_root_has_the_model_read_from_its_root(  # type: ignore[no-untyped-def]
    debian11_sandbox, workdir: Path
) -> None:
    """Issue 26 item 4: the Debian 11 sandbox is a manager with a root of its own (an overlay of its
    tree). A model at /srv/models/glm-5 exists only there, as it does for the vLLM that manager starts:
    `ctxmgr plan --service` reads it through /proc/PID/root, not at the host's /srv/models/glm-5."""
    box = debian11_sandbox
    inside = "/srv/models/ctxmgr-root-check/glm-5"
    assert not Path(inside).exists()  # not on the host
    shutil.copytree(GLM5_CONFIG_DIR, box.systemd.host_path(inside))
    unit = "vllm-own-root.service"
    (box.systemd.host_unit_dir / unit).write_text(
        standin_unit(make_vllm_wrapper(workdir), port=free_port(), model=Path(inside))
    )
    box.systemd.daemon_reload()
    try:
        run = run_ctxmgr(box.pid, workdir / "state", "plan", "100000", "--service", unit,
                         *offline_gpu_args(), "--json")  # fmt: skip
        assert run.code == 0, run.stdout + run.stderr
        assert run.data["feasible"] is True and run.data["max_context"] > 100000
    finally:
        (box.systemd.host_unit_dir / unit).unlink()
        box.systemd.daemon_reload()
        shutil.rmtree(box.systemd.host_path("/srv/models/ctxmgr-root-check"))
