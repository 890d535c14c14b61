"""Issue 16 items 1 and 2: the state directory is trusted only as sshd's StrictModes trusts a home
directory (owned by the running user or root, writable by nobody else), and no symbolic link in it
is ever followed: the lock, a service directory, observations.jsonl and the revisions are each
opened from a checked directory descriptor with O_NOFOLLOW."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.errors import ExitCode, UnsafePathError
from vllm_ctxmgr.store import Revision, ServiceStore, State

UNIT = (REPO / "units" / "vllm-glm5.service").read_bytes()
NOBODY = 65534


@pytest.fixture
def state() -> Path:
    path = REPO / ".cache" / "store-trust" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True, mode=0o700)
    return path


def revision(**kw: object) -> Revision:
    base: dict[str, object] = dict(number=0, service="vllm-glm5", state=State.BASELINE, created=1767000000.0,
                                   unit_path="/etc/systemd/system/vllm-glm5.service")  # fmt: skip
    base.update(kw)
    return Revision(**base)  # type: ignore[arg-type]


def stored(state: Path) -> ServiceStore:
    store = ServiceStore(state, "vllm-glm5")
    store.new_revision(revision(), unit=UNIT, previous=UNIT)
    return store


def history(state: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--state-dir", str(state), "history", "--service", "vllm-glm5"])
    return result.exit_code, result.output


def test_a_state_dir_writable_by_others_is_refused_with_one_line_naming_the_fix(state: Path) -> None:
    stored(state)
    assert history(state)[0] == 0
    state.chmod(0o777)
    code, out = history(state)
    assert code == ExitCode.USAGE
    assert out.count("\n") == 1 and str(state) in out and f"chmod go-w {state}" in out
    assert "Traceback" not in out


def test_a_service_dir_owned_by_another_user_is_refused(state: Path) -> None:
    store = stored(state)
    os.chown(store.root, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=rf"{store.root}: owned by uid {NOBODY}.*chown"):
        store.revisions()
    code, out = history(state)
    assert code == ExitCode.USAGE and f"chown root {store.root}" in out


@pytest.mark.parametrize("what", ["directory", "record.json", "unit"])
def test_a_revision_another_user_can_change_is_refused(state: Path, what: str) -> None:
    """A planted revision would be installed as root by `rollback --to 0`."""
    store = stored(state)
    directory = store.revisions_dir / "0000"
    target = directory if what == "directory" else directory / what
    target.chmod(0o777 if what == "directory" else 0o666)
    with pytest.raises(UnsafePathError, match=rf"{target}: writable by group or others"):
        store.file_bytes(0, "unit") if what == "unit" else store.revisions()


def test_a_symlinked_lock_does_not_truncate_its_target(state: Path) -> None:
    """Issue 16 item 2: a symlinked `lock` made root truncate its target (a 2-line file emptied)."""
    store = stored(state)
    victim = state.parent / f"victim-{uuid.uuid4().hex[:6]}"
    victim.write_text("line one\nline two\n")
    (store.root / "lock").symlink_to(victim)
    with pytest.raises(UnsafePathError, match=rf"{store.root / 'lock'}: a symbolic link"), store.lock():
        pass
    with pytest.raises(UnsafePathError, match="a symbolic link"), store.read_lock():
        pass
    assert victim.read_text() == "line one\nline two\n"


def test_a_symlinked_service_dir_is_neither_chmodded_nor_written(state: Path) -> None:
    """A symlinked service directory got its target chmodded 0700 and ctxmgr's files created in it."""
    elsewhere = state.parent / f"elsewhere-{uuid.uuid4().hex[:6]}"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    (state / "vllm-glm5").symlink_to(elsewhere)
    store = ServiceStore(state, "vllm-glm5")
    with pytest.raises(UnsafePathError, match=rf"{store.root}: a symbolic link.*rm {store.root}"):
        store.new_revision(revision(), unit=UNIT, previous=UNIT)
    with pytest.raises(UnsafePathError, match="a symbolic link"), store.lock():
        pass
    with pytest.raises(UnsafePathError, match="a symbolic link"):
        store.write_json("last-verify.json", {"result": "ok"})
    assert list(elsewhere.iterdir()) == [] and elsewhere.stat().st_mode & 0o777 == 0o755


def test_a_symlinked_observations_file_gets_nothing_appended(state: Path) -> None:
    store = stored(state)
    victim = state.parent / f"victim-{uuid.uuid4().hex[:6]}"
    victim.write_text('{"a": 1}\n')
    (store.root / "observations.jsonl").symlink_to(victim)
    with pytest.raises(UnsafePathError, match=rf"{store.root / 'observations.jsonl'}: a symbolic link"):
        store.add_observation({"num_gpu_blocks": 1})
    with pytest.raises(UnsafePathError, match="a symbolic link"):
        store.observations()
    assert victim.read_text() == '{"a": 1}\n'


def test_a_symlinked_revision_or_record_is_not_read(state: Path) -> None:
    store = stored(state)
    planted = state.parent / f"planted-{uuid.uuid4().hex[:6]}"
    planted.mkdir(mode=0o700)
    (planted / "record.json").write_text(json.dumps(revision(number=1).record()))
    (planted / "unit").write_bytes(b"[Service]\nExecStartPre=/bin/sh -c 'id > /tmp/pwned'\n")
    (store.revisions_dir / "0001").symlink_to(planted)
    with pytest.raises(UnsafePathError, match=rf"{store.revisions_dir / '0001'}: a symbolic link"):
        store.revisions()
    (store.revisions_dir / "0001").unlink()
    record = store.revisions_dir / "0000" / "record.json"
    record.unlink()
    record.symlink_to(planted / "record.json")
    with pytest.raises(UnsafePathError, match=rf"{record}: a symbolic link"):
        store.revisions()


def test_a_fifo_as_record_does_not_hang(state: Path) -> None:
    store = stored(state)
    record = store.revisions_dir / "0000" / "record.json"
    record.unlink()
    os.mkfifo(record, 0o600)
    with pytest.raises(UnsafePathError, match=rf"{record}: not a regular file"):
        store.revisions()


def test_a_sound_store_still_works_and_tightens_its_dirs(state: Path) -> None:
    store = stored(state)
    store.root.chmod(0o755)
    with store.lock():
        store.add_observation({"num_gpu_blocks": 7})
        store.write_json("last-verify.json", {"result": "ok"})
    assert store.root.stat().st_mode & 0o777 == 0o700
    assert [o["num_gpu_blocks"] for o in store.observations()] == [7]
    assert store.read_json("last-verify.json") == {"result": "ok"}
    assert [r.number for r in store.revisions()] == [0] and store.file_bytes(0) == UNIT


@pytest.mark.parametrize("where", ["/proc/self", "/proc/self/fd", "/sys/kernel", "/dev/shm"])
def test_a_state_dir_in_the_kernels_trees_is_one_line(where: str) -> None:
    """Issue 16, low: `--state-dir /proc/self` was an unexpected error."""
    result = CliRunner().invoke(main, ["--state-dir", where, "history", "--service", "vllm-glm5"])
    assert result.exit_code == ExitCode.USAGE and result.output.count("\n") == 1
    assert f"--state-dir {where}: in /" in result.output and "Traceback" not in result.output


def test_an_observation_line_that_is_json_but_not_an_object_is_skipped_as_a_torn_one(state: Path) -> None:
    """verify, status and the planner read fields of every stored start: a line of observations.jsonl
    that parses but is a list, a string or a number made them fail with AttributeError ('list' object
    has no attribute 'get'); it is skipped, as a torn line is, and the records around it are kept."""
    store = stored(state)
    store.add_observation({"service": "vllm-glm5", "max_model_len": 8192})
    with (store.root / "observations.jsonl").open("a") as f:
        f.write('[1, 2]\n"text"\n5\nnull\n{"torn": \n')
    store.add_observation({"service": "vllm-glm5", "max_model_len": 16384})
    assert [o.get("max_model_len") for o in store.observations()] == [8192, 16384]
