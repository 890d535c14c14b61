"""The revision store on its own: records a person can read, old records, finalise-by-rename, the
lock file's holder line, pruning and the leftovers killed runs leave (issue 7, issue 9 items 3, 6, 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.errors import LockedError, UnsafePathError, UsageError
from vllm_ctxmgr.store import (
    PENDING,
    RECORD_FORMAT,
    TRANSITIONS,
    FileChange,
    Revision,
    ServiceStore,
    State,
    Step,
    StoreError,
)

UNIT = (REPO / "units" / "vllm-glm5.service").read_bytes()

# A record exactly as ctxmgr wrote it before issue 7 (format 1: epoch floats, the plan inline).
OLD_RECORD = {
    "number": 1,
    "service": "vllm-glm5",
    "state": "in-progress",
    "unit_path": "/etc/systemd/system/vllm-glm5.service",
    "created": 1767000000.25,
    "max_model_len": 200000,
    "gpu_memory_utilization": 0.9,
    "previous_max_model_len": 8192,
    "previous_gpu_memory_utilization": 0.9,
    "action": "set-context",
    "rollback_of": None,
    "vllm_version": "0.33.0",
    "reason": "",
    "decisive_line": "",
    "finished": None,
    "verified": False,
    "plan": {"max_model_len": 200000, "gpu_memory_utilization": 0.78},
    "capacity": {},
}


@pytest.fixture
def store() -> ServiceStore:
    return ServiceStore(REPO / ".cache" / "store" / uuid.uuid4().hex[:8], "vllm-glm5")


def revision(state: State = State.PLANNED, **kw: object) -> Revision:
    base: dict[str, object] = dict(
        number=0, service="vllm-glm5", state=state, unit_path="/etc/systemd/system/vllm-glm5.service",
        created=time.time(), max_model_len=200000, previous_max_model_len=8192,
    )  # fmt: skip
    base.update(kw)
    return Revision(**base)  # type: ignore[arg-type]


def test_every_state_is_in_the_transition_table_and_only_finished_states_end() -> None:
    assert set(TRANSITIONS) == set(State)
    for state, nexts in TRANSITIONS.items():
        assert nexts <= set(State)
        if state in (State.FINAL, State.ROLLED_BACK, State.ROLLBACK_FAILED, State.BASELINE):
            assert not nexts
        elif state is not State.PLANNED:
            assert state in PENDING
            assert State.ROLLING_BACK in nexts  # every unfinished state can be undone


def test_a_record_is_readable_by_a_person_and_the_plan_lies_beside_it(store: ServiceStore) -> None:
    rev = revision(
        plan={"max_model_len": 200000, "gpus": []}, user="root", host="gpu-7", ctxmgr_version="0.1.0"
    )
    rev.state = State.RECORDED
    rev.steps.append(Step(State.RECORDED, rev.created, "set-context: max_model_len 8192 -> 200000"))
    store.new_revision(rev, unit=UNIT.replace(b"8192", b"200000"), previous=UNIT)
    directory = store.revisions_dir / "0000"
    assert sorted(p.name for p in directory.iterdir()) == ["plan.json", "previous", "record.json", "unit"]
    record = json.loads((directory / "record.json").read_text())
    assert "plan" not in record
    assert json.loads((directory / "plan.json").read_text())["max_model_len"] == 200000
    created = datetime.fromisoformat(record["created"])
    assert created.tzinfo is not None and abs(created.timestamp() - rev.created) < 0.001
    assert record["steps"] == [
        {"state": "recorded", "time": record["created"], "note": "set-context: max_model_len 8192 -> 200000"}
    ]
    assert (record["user"], record["host"], record["ctxmgr_version"]) == ("root", "gpu-7", "0.1.0")
    loaded = store.get(0)
    assert loaded.plan["max_model_len"] == 200000 and loaded.state is State.RECORDED
    assert loaded.steps[0].note.startswith("set-context")


def test_a_record_of_the_old_format_still_loads_and_is_recoverable(store: ServiceStore) -> None:
    store.ensure()
    directory = store.revisions_dir / "0001"
    directory.mkdir()
    (directory / "record.json").write_text(json.dumps(OLD_RECORD, indent=2))
    (directory / "unit").write_bytes(UNIT)
    (directory / "previous").write_bytes(UNIT)
    rev = store.get(1)
    assert rev.state is State.IN_PROGRESS and rev.created == 1767000000.25
    assert rev.plan["gpu_memory_utilization"] == 0.78
    assert store.in_progress() is not None and store.in_progress().number == 1  # type: ignore[union-attr]


def test_a_revision_keeps_every_file_it_changed_with_its_previous_bytes_or_absence(
    store: ServiceStore,
) -> None:
    """Issue 16 item 9: a revision is the set of unit files it changed, each with what it held before and
    after (None: absent); record.json names each path and its two copies for a person to read."""
    fragment = Path("/etc/systemd/system/vllm-glm5.service")
    ours = Path("/etc/systemd/system/vllm-glm5.service.d/50-ctxmgr.conf")
    theirs = Path("/etc/systemd/system/vllm-glm5.service.d/60-operator.conf")
    changes = [
        FileChange(
            theirs, b"[Service]\nExecStart=\nExecStart=/x --max-model-len 120000\n", b"operator's new"
        ),
        FileChange(ours, b"ctxmgr's drop-in", None),  # removed
        FileChange(fragment, None, UNIT),  # created
    ]
    rev = revision(State.RECORDED, action="rollback", rollback_of=0, unit_path=str(theirs))
    store.new_revision(rev, files=changes)
    directory = store.revisions_dir / "0000"
    assert sorted(p.name for p in directory.iterdir()) == [
        "previous", "previous.1", "record.json", "unit", "unit.2",
    ]  # fmt: skip
    record = json.loads((directory / "record.json").read_text())
    assert record["format"] == RECORD_FORMAT == 3
    assert record["files"] == [
        {"path": str(theirs), "unit": "unit", "previous": "previous"},
        {"path": str(ours), "unit": None, "previous": "previous.1"},
        {"path": str(fragment), "unit": "unit.2", "previous": None},
    ]
    assert store.file_changes(store.get(0)) == changes
    assert store.history()[0]["files"] == [str(theirs), str(ours), str(fragment)]


@pytest.mark.parametrize("absent", [[], ["unit"], ["previous"], ["unit", "previous"]])
def test_a_one_file_revision_of_format_2_reads_as_its_unit_path(
    store: ServiceStore, absent: list[str]
) -> None:
    """Revisions ctxmgr wrote before issue 16 item 9 name one file, `unit_path`: its copies are `unit` and
    `previous`, and an absent copy is an absent file (a drop-in ctxmgr created, or removed)."""
    store.ensure()
    directory = store.revisions_dir / "0001"
    directory.mkdir()
    record = {**OLD_RECORD, "format": 2, "state": "final", "created": "2026-01-01T00:00:00.000+00:00"}
    record.pop("plan")
    (directory / "record.json").write_text(json.dumps(record))
    for which in {"unit", "previous"} - set(absent):
        (directory / which).write_bytes(which.encode())
    rev = store.get(1)
    path = Path(OLD_RECORD["unit_path"])  # type: ignore[arg-type]
    assert store.file_changes(rev) == [
        FileChange(path, None if "previous" in absent else b"previous", None if "unit" in absent else b"unit")
    ]
    assert store.file_bytes(1, "unit") == (None if "unit" in absent else b"unit")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (
            [{"path": "/etc/x.service", "unit": "../../../../etc/shadow", "previous": None}],
            "not a stored copy",
        ),
        ([{"path": "/etc/x.service", "unit": "record.json", "previous": None}], "not a stored copy"),
        ([{"path": "x.service", "unit": "unit", "previous": None}], "not an absolute unit file path"),
        ([{"path": "/etc/../x.service", "unit": "unit", "previous": None}], "not an absolute unit file path"),
        ([{"path": "/etc/x.service", "unit": "unit"}], "a file is not {path, unit, previous}"),
        ([], "is not a list of unit files"),
        ("unit", "is not a list of unit files"),
    ],
)
def test_a_record_whose_files_leave_the_revision_is_refused(
    store: ServiceStore, files: object, message: str
) -> None:
    store.new_revision(revision(State.BASELINE), unit=UNIT, previous=UNIT)
    path = store.revisions_dir / "0000" / "record.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "files": files}))
    with pytest.raises(StoreError, match=r"record\.json") as caught:
        store.revisions()
    assert message in caught.value.message


def test_a_further_copy_planted_as_a_link_is_refused(store: ServiceStore) -> None:
    changes = [
        FileChange(Path("/etc/a.service"), b"a0", b"a1"),
        FileChange(Path("/etc/b.service"), b"b0", b"b1"),
    ]
    store.new_revision(revision(State.FINAL), files=changes)
    copy = store.revisions_dir / "0000" / "unit.1"
    copy.unlink()
    copy.symlink_to("/etc/hostname")
    with pytest.raises(UnsafePathError, match="a symbolic link"):
        store.file_changes(store.get(0))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "blue"}, "unknown key 'colour'"),
        ({"created": None, "drop": "created"}, "missing key 'created'"),
        ({"state": "half-done"}, "unknown state 'half-done'"),
        ({"created": "yesterday"}, "not an ISO-8601 time"),
    ],
)
def test_a_record_with_an_unknown_or_missing_key_is_a_one_line_error_naming_the_file(
    store: ServiceStore, change: dict[str, object], message: str
) -> None:
    store.ensure()
    directory = store.revisions_dir / "0001"
    directory.mkdir()
    data = dict(OLD_RECORD)
    drop = change.pop("drop", None)
    data.update(change)
    if drop:
        data.pop(str(drop))
    (directory / "record.json").write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"record\.json") as caught:
        store.revisions()
    assert message in caught.value.message and str(directory / "record.json") in caught.value.message
    assert "\n" not in caught.value.message


def test_a_revision_directory_left_without_a_record_does_not_wedge_the_next_one(store: ServiceStore) -> None:
    # issue 9 item 3: ctxmgr before finalise-by-rename killed between mkdir and writing the record
    store.ensure()
    (store.revisions_dir / "0000").mkdir()
    (store.revisions_dir / "0000" / "previous").write_bytes(UNIT)
    # and one killed while staging a revision now
    (store.revisions_dir / ".new-abc123").mkdir()
    rev = store.new_revision(revision(State.BASELINE), unit=UNIT, previous=UNIT)
    assert rev.number == 0
    assert sorted(p.name for p in store.revisions_dir.iterdir()) == ["0000"]
    assert store.get(0).state is State.BASELINE


def test_a_kill_while_a_revision_is_staged_leaves_no_numbered_directory(store: ServiceStore) -> None:
    """A real kill (os._exit via the test hook) between staging and the rename."""
    code = (
        "import os, sys, time\n"
        "from vllm_ctxmgr import store\n"
        "from vllm_ctxmgr.store import Revision, ServiceStore, State\n"
        "store.step_hook = lambda name, _command: os._exit(137) if name == 'revision-staged' else None\n"
        f"s = ServiceStore({str(store.root.parent)!r}, 'vllm-glm5')\n"
        "s.new_revision(Revision(0, 'vllm-glm5', State.BASELINE, '/u', time.time()), b'u', b'p')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == 137, proc.stderr
    assert [p.name for p in store.revisions_dir.iterdir() if p.name.isdigit()] == []
    assert store.revisions() == []
    assert store.remove_partial() and list(store.revisions_dir.iterdir()) == []


def test_a_run_refused_by_the_lock_leaves_the_holders_line(store: ServiceStore) -> None:
    # issue 9 item 6: the loser truncated the lock file in `finally`, erasing the holder's line
    with store.lock():
        holder = (store.root / "lock").read_text()
        assert holder.startswith(f"pid {os.getpid()}:")
        for _ in range(3):
            with (
                pytest.raises(LockedError, match="locked") as caught,
                ServiceStore(store.root.parent, "vllm-glm5").lock(),
            ):
                pass
            assert (
                f"pid {os.getpid()}" in caught.value.message and "another process" not in caught.value.message
            )
        assert (store.root / "lock").read_text() == holder
    assert (store.root / "lock").read_text() == ""  # the holder clears it when it is done


def _add(store: ServiceStore, state: State, action: str = "set-context") -> Revision:
    return store.new_revision(revision(state, action=action), unit=UNIT, previous=UNIT)


def test_prune_keeps_the_last_n_and_every_revision_a_rollback_may_need(store: ServiceStore) -> None:
    store.keep = 5
    _add(store, State.BASELINE, "baseline")  # 0
    _add(store, State.FINAL)  # 1: the good one before the newest final
    _add(store, State.ROLLING_BACK)  # 2: unfinished
    for _ in range(10):
        _add(store, State.ROLLED_BACK)  # 3..12
    _add(store, State.FINAL)  # 13: the newest final
    for _ in range(6):
        _add(store, State.ROLLED_BACK)  # 14..19
    removed = store.prune()
    kept = [rev.number for rev in store.revisions()]
    assert kept == [0, 1, 2, 13, 15, 16, 17, 18, 19]
    assert removed == [n for n in range(20) if n not in kept]
    # the numbers go on from the newest; a pruned number is never reused
    assert _add(store, State.FINAL).number == 20


def test_observations_keep_the_last_n(store: ServiceStore) -> None:
    store.keep = 4
    for i in range(7):
        store.add_observation({"i": i})
    assert [o["i"] for o in store.observations()] == [3, 4, 5, 6]


def test_leftovers_of_killed_runs_are_removed(store: ServiceStore, tmp_path: Path) -> None:
    # issue 9 item 11: what a kill leaves and nothing cleaned
    unit_dir, run_dir = tmp_path / "system", tmp_path / "run"
    unit_dir.mkdir()
    run_dir.mkdir()
    (unit_dir / "vllm-glm5.service").write_bytes(UNIT)
    tmp = unit_dir / ".vllm-glm5.service.k3j2h1.ctxmgr-tmp"
    tmp.write_bytes(UNIT[:10])
    other = unit_dir / ".other.service.a1.ctxmgr-tmp"  # another unit's: not this service's to remove
    other.write_bytes(b"x")
    stale, fresh = run_dir / "ctxmgr-verify-old", run_dir / "ctxmgr-verify-now"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    store.ensure()
    (store.root / "candidate").mkdir()
    (store.root / "candidate" / "vllm-glm5.service").write_bytes(UNIT)
    removed = store.remove_leftovers([unit_dir], run_dir, ["vllm-glm5.service"])
    assert not tmp.exists() and not stale.exists() and not (store.root / "candidate").exists()
    assert other.exists() and fresh.exists()  # a live run elsewhere may be using it
    assert (unit_dir / "vllm-glm5.service").read_bytes() == UNIT
    assert len(removed) == 3


@pytest.mark.parametrize("name", ["..", ".", "...service", "..service", "a/b", "", "x" * 300])
def test_a_service_name_that_would_be_a_path_is_refused_by_the_store_too(name: str, tmp_path: Path) -> None:
    """Issue 9 item 1, defence in depth: the CLI resolves names first; the store never takes a path."""
    with pytest.raises(UsageError, match=r"unit name|service name|only with dots"):
        ServiceStore(tmp_path / "state", name)
    assert not (tmp_path / "state").exists()
