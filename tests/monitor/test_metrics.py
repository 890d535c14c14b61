"""The Prometheus textfile: what it says, that prometheus_client's parser reads it, and that it is
replaced whole (never rewritten in place) so node_exporter cannot read half of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_ctxmgr.core.verdict import DEGRADED, OK, Verification
from vllm_ctxmgr.errors import CtxmgrError, UnsafePathError, UsageError
from vllm_ctxmgr.monitor.metrics import write_textfile

GIB = 1 << 30


def samples(path: Path) -> dict[tuple[str, str | None], tuple[float, str]]:
    return {
        (s.name, s.labels.get("result")): (s.value, s.labels["service"])
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


def verification(**values: object) -> Verification:
    base = Verification(
        service="vllm-glm5",
        result=OK,
        time=1_790_000_000.25,
        max_model_len=200_000,
        planned_max_model_len=202_752,
        probe_latency_s=0.42,
        kv_cache_tokens=298_880,
        margin_bytes=int(1.5 * GIB),
        unit={"n_restarts": 2},
        duration_s=1.3,
    )
    for name, value in values.items():
        setattr(base, name, value)
    return base


def test_the_textfile_parses_and_carries_every_figure_labelled_by_service(tmp_path: Path) -> None:
    path = write_textfile(tmp_path / "ctxmgr-vllm-glm5.prom", verification())
    found = samples(path)
    assert found[("ctxmgr_verify_success", None)] == (1.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "ok")] == (1.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "degraded")] == (0.0, "vllm-glm5")
    assert found[("ctxmgr_verify_result", "failed")] == (0.0, "vllm-glm5")
    assert found[("ctxmgr_verify_probe_latency_seconds", None)] == (0.42, "vllm-glm5")
    assert found[("ctxmgr_verify_max_model_len", None)] == (200_000.0, "vllm-glm5")
    assert found[("ctxmgr_verify_planned_max_model_len", None)] == (202_752.0, "vllm-glm5")
    assert found[("ctxmgr_verify_kv_cache_tokens", None)] == (298_880.0, "vllm-glm5")
    assert found[("ctxmgr_verify_margin_bytes", None)] == (1.5 * GIB, "vllm-glm5")
    assert found[("ctxmgr_verify_unit_restarts", None)] == (2.0, "vllm-glm5")
    assert found[("ctxmgr_verify_last_run_timestamp_seconds", None)] == (1_790_000_000.25, "vllm-glm5")
    assert path.stat().st_mode & 0o777 == 0o644  # node_exporter runs as its own user


def test_unknown_figures_are_left_out_not_written_as_zero(tmp_path: Path) -> None:
    path = write_textfile(
        tmp_path / "x.prom",
        verification(result=DEGRADED, margin_bytes=None, probe_latency_s=None, planned_max_model_len=None),
    )
    found = samples(path)
    assert ("ctxmgr_verify_margin_bytes", None) not in found
    assert ("ctxmgr_verify_probe_latency_seconds", None) not in found
    assert ("ctxmgr_verify_planned_max_model_len", None) not in found  # never planned: no alert on 0
    assert found[("ctxmgr_verify_success", None)][0] == 0.0
    assert found[("ctxmgr_verify_result", "degraded")][0] == 1.0
    assert "# TYPE ctxmgr_verify_margin_bytes gauge" in path.read_text()  # the family is still declared


def test_each_write_replaces_the_file_whole_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "vllm-glm5.prom"
    write_textfile(path, verification())
    first_inode = path.stat().st_ino
    reader = path.open()  # a collector in the middle of a read keeps the old file
    write_textfile(path, verification(max_model_len=131_072))
    assert path.stat().st_ino != first_inode  # renamed over, not truncated and rewritten
    assert "200000.0" in reader.read()
    reader.close()
    assert samples(path)[("ctxmgr_verify_max_model_len", None)][0] == 131_072.0
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-glm5.prom"]


def test_paths_the_collector_would_never_read_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"only files ending in \.prom"):
        write_textfile(tmp_path / "metrics.txt", verification())
    with pytest.raises(UsageError, match="no such directory"):
        write_textfile(tmp_path / "missing" / "x.prom", verification())


# ---- a textfile directory another user may write (node_exporter's, often 0777) --------------------
# The writer runs as root from `schedule`; a planted symbolic link must never turn a root-only file
# world-readable, and a temporary file is never opened through a link.

NOBODY = 65534


def victim_in(tmp_path: Path) -> Path:
    """A root-only file elsewhere: what an attacker would like to read."""
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    victim = secrets / "shadow"
    victim.write_text("root:secret\n")
    victim.chmod(0o600)
    return victim


def shared_dir(tmp_path: Path, mode: int) -> Path:
    directory = tmp_path / "textfile"
    directory.mkdir()
    directory.chmod(mode)
    return directory


def plant_link(link: Path, target: Path) -> None:
    """As the other user would: the link is theirs."""
    link.symlink_to(target)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another uid")
def test_a_link_in_a_world_writable_directory_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    victim = victim_in(tmp_path)
    directory = shared_dir(tmp_path, 0o777)
    plant_link(directory / "F.prom", victim)
    with pytest.raises(UnsafePathError, match=r"textfile: writable by group or others \(mode 0777\).*chmod"):
        write_textfile(directory / "F.prom", verification())
    assert victim.stat().st_mode & 0o7777 == 0o600
    assert victim.read_text() == "root:secret\n"
    assert [p.name for p in directory.iterdir()] == ["F.prom"]  # nothing written


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another uid")
def test_a_link_planted_in_a_sticky_directory_is_refused_and_never_followed(tmp_path: Path) -> None:
    victim = victim_in(tmp_path)
    directory = shared_dir(tmp_path, 0o1777)
    plant_link(directory / "F.prom", victim)
    with pytest.raises(UnsafePathError, match=r"F\.prom: a symbolic link.*rm "):
        write_textfile(directory / "F.prom", verification())
    assert victim.stat().st_mode & 0o7777 == 0o600
    assert victim.read_text() == "root:secret\n"
    assert (directory / "F.prom").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another uid")
def test_another_users_file_in_a_sticky_directory_is_refused(tmp_path: Path) -> None:
    directory = shared_dir(tmp_path, 0o1777)
    theirs = directory / "F.prom"
    theirs.write_text("# theirs\n")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=r"F\.prom: owned by uid 65534"):
        write_textfile(theirs, verification())
    assert theirs.read_text() == "# theirs\n"


def test_a_sticky_directory_with_our_own_file_is_written_0644(tmp_path: Path) -> None:
    directory = shared_dir(tmp_path, 0o1777)
    path = write_textfile(directory / "F.prom", verification())
    path = write_textfile(directory / "F.prom", verification(max_model_len=4096))  # over our own file
    assert path.stat().st_mode & 0o7777 == 0o644
    assert samples(path)[("ctxmgr_verify_max_model_len", None)][0] == 4096.0


def test_a_link_planted_at_the_temporary_name_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = victim_in(tmp_path)
    directory = shared_dir(tmp_path, 0o755)
    monkeypatch.setattr(os, "urandom", lambda n: b"\x00" * n)  # the name a guesser would have to hit
    (directory / f".F.prom.{'00' * 6}.ctxmgr-tmp").symlink_to(victim)
    with pytest.raises(CtxmgrError, match=r"\.F\.prom\.000000000000\.ctxmgr-tmp: File exists"):
        write_textfile(directory / "F.prom", verification())
    assert victim.stat().st_mode & 0o7777 == 0o600
    assert victim.read_text() == "root:secret\n"
    assert not (directory / "F.prom").exists()


def test_an_ordinary_write_is_0644_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        path = write_textfile(tmp_path / "F.prom", verification())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o7777 == 0o644
    assert samples(path)[("ctxmgr_verify_success", None)][0] == 1.0


# ---- issue 36 item 17: every component of the textfile directory's path, as sshd's StrictModes ------


@pytest.mark.parametrize("case", ["parent-of-nobody", "parent-0777", "grandparent-0777"])
def test_a_textfile_directory_under_a_parent_another_user_may_change_is_refused(
    tmp_path: Path, case: str
) -> None:
    if "nobody" in case and os.geteuid() != 0:
        pytest.skip("gives a directory to another uid")
    grandparent = tmp_path / "srv"
    parent = grandparent / "node_exporter"
    directory = parent / "textfile"
    directory.mkdir(parents=True, mode=0o755)
    for d in (grandparent, parent, directory):
        d.chmod(0o755)
    weak = grandparent if case.startswith("grandparent") else parent
    if "nobody" in case:
        os.chown(weak, NOBODY, NOBODY)  # they may rename textfile away and put a link in its place
    else:
        weak.chmod(0o777)
    with pytest.raises(UnsafePathError, match=f"^{weak}: "):
        write_textfile(directory / "F.prom", verification())
    assert not (directory / "F.prom").exists()
    weak.chmod(0o1777)  # sticky: nobody else may rename what is in it
    if "nobody" not in case:
        assert write_textfile(directory / "F.prom", verification()).exists()
