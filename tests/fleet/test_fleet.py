"""Fleet roll-outs with real parts: hosts in network namespaces, sshd and systemd on each, HAProxy in
front, ansible-core driving the collection's role, and a bounded load client counting lost requests.

One bed per ansible-core version (booted by the fixture, torn down by PID and namespace name at the
end); each test resets every host to a baseline unit at 8,192 tokens first.

Which scenario runs on which ansible-core (the fleet tier is the slow one, ~1 min a roll-out on CI's 2
cores): the oldest claimed (2.15) and the newest (2.19) both run check mode, the roll-out under load
(new connections and kept-alive ones at once) and the failure on the middle host, and the two
scenarios that lean on ansible-core's own machinery, which changed between them: a host that becomes
unreachable, and batches (serial). The scenarios whose logic is the role's own and HAProxy's (each
load-balancer step failing, a failed rollback, the no-drain control) run on the newest only, on a
second bed of their own: each bed is one xdist group (tests/conftest.py), so the newest's scenarios
run beside the five both versions run instead of after them. Every test resets the hosts it uses, so
which bed it gets is not something it can see.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fleet.bed import (
    ANSIBLE_VERSIONS,
    BACKEND,
    BASELINE_CONTEXT,
    REPO_ROOT,
    SERVICE,
    FleetBed,
    FleetHost,
    RollOut,
    ansible_venv,
    build_collection,
    fleet_available,
    roll_out,
)
from tests.support.require import require

pytestmark = pytest.mark.systemd
TARGET = 200_000
# host 2's vLLM derives a model limit of 100,000 tokens (another build of the model than the
# config.json the planner reads, 202,752): nothing in its baseline start shows it, the plan says
# 200,000 fits, vLLM refuses the start, and ctxmgr rolls host 2 back by itself. (A smaller KV cache
# would not do: ctxmgr calibrates from the host's own last start and refuses before touching it.)
FAILURE_ON_H2 = {"h2": {"CTXMGR_STANDIN_MAX_POSITION": "100000"}}


OLDEST, NEWEST = ANSIBLE_VERSIONS[0], ANSIBLE_VERSIONS[-1]
BOTH = pytest.mark.parametrize("bed", ANSIBLE_VERSIONS, indirect=True)
# "X.Y/NAME": ansible-core X.Y on a bed of its own (NAME tells the beds apart; one per param value)
NEWEST_ONLY = pytest.mark.parametrize("bed", [f"{NEWEST}/newest-only"], indirect=True)


@pytest.fixture(scope="module")
def bed(request: pytest.FixtureRequest) -> Iterator[FleetBed]:
    """A bed whose controller runs ansible-core `request.param` (X.Y, or X.Y/NAME for another bed)."""
    version, _, name = str(request.param).partition("/")
    venv = ansible_venv(version)
    require(fleet_available(venv), f"the fleet bed with ansible-core {version}")
    # short: ssh's ControlPath socket lies below it (tests/fleet/bed.py), within a unix socket's 108 bytes
    directory = REPO_ROOT / ".cache" / "fleet" / f"t{os.getpid()}-{version}{'-' + name[:1] if name else ''}"
    tarball = build_collection(directory / "build", venv)
    fleet = FleetBed.up(directory, venv=venv)
    try:
        fleet.install_collection(tarball)
        yield fleet
    finally:
        fleet.down()
    assert not [n for n in fleet.namespaces], "namespaces left behind"


def unit_digest(bed: FleetBed) -> dict[str, str]:
    return {h.name: hashlib.sha256(h.unit_path.read_bytes()).hexdigest() for h in bed.hosts}


def main_pids(bed: FleetBed) -> dict[str, str]:
    return {
        h.name: h.systemctl("show", "-p", "MainPID", "--value", f"{SERVICE}.service").stdout.strip()
        for h in bed.hosts
    }


def assert_nothing_lost(run: RollOut, least: int = 100) -> None:
    load = run.load
    assert load["sent"] > least, load
    assert (load["failed"], load["truncated"], load["lost"]) == (0, 0, 0), load["errors"]
    assert load["answered"] == load["sent"]


def all_up(bed: FleetBed) -> dict[str, str]:
    return {server: row["status"] for (_, server), row in bed.runtime().servers(BACKEND).items()}


def assert_back_where_it_was(bed: FleetBed, run: RollOut, untouched: dict[str, tuple[bytes, str]]) -> None:
    """Every host serves its old context and is UP in HAProxy, the report says so, and the hosts
    the roll-out never reached have the same unit bytes and the same vLLM process."""
    assert [bed.served_context(h) for h in bed.hosts] == [BASELINE_CONTEXT] * 3
    assert all_up(bed) == {h.name: "UP" for h in bed.hosts}
    report = run.report
    assert report["uniform"] is True and report["not_restored"] == {}, report
    for name, host in report["hosts"].items():
        assert host["in_load_balancer"] is True, (name, host)
        if host["before"] is not None:
            assert host["before"] == host["after"] == BASELINE_CONTEXT, (name, host)
    for name, (unit, pid) in untouched.items():
        host = next(h for h in bed.hosts if h.name == name)
        assert host.unit_path.read_bytes() == unit and main_pids(bed)[name] == pid
        assert report["hosts"][name]["outcome"] == "untouched"
        assert report["hosts"][name]["out_of_service_s"] == 0
        assert run.load.get("lb_downtime_s", {}).get(name, 0) == 0


def snapshot(bed: FleetBed, *names: str) -> dict[str, tuple[bytes, str]]:
    pids = main_pids(bed)
    return {h.name: (h.unit_path.read_bytes(), pids[h.name]) for h in bed.hosts if h.name in names}


def when_serving(
    bed: FleetBed, host: FleetHost, context: int, then: Callable[[], None]
) -> Callable[[], None]:
    """A `during` for roll_out: once `host` serves `context` (its change applied), do `then`."""

    def during() -> None:
        deadline = time.monotonic() + 240
        while bed.served_context(host) != context:
            assert time.monotonic() < deadline, f"{host.name} never served {context}"
            time.sleep(0.3)
        then()

    return during


@BOTH
def test_check_mode_reports_what_would_change_on_each_host_and_touches_none(bed: FleetBed) -> None:
    bed.reset()
    units, pids = unit_digest(bed), main_pids(bed)
    run = roll_out(bed, TARGET, "check", rate=0, check=True)
    assert run.returncode == 0, run.output[-3000:]
    assert run.report["would_change"] == ["h1", "h2", "h3"]
    assert run.report["changed"] == [] and run.report["check_mode"] is True
    for host in bed.hosts:
        detail = run.report["hosts"][host.name]["detail"]
        assert f"+    --max-model-len {TARGET}" in detail["diff"]
        assert detail["plan"]["max_model_len"] == TARGET and detail["plan"]["feasible"] is True
    assert f"+    --max-model-len {TARGET}" in run.output  # --diff shows the unit diff
    assert unit_digest(bed) == units and main_pids(bed) == pids
    assert [bed.served_context(h) for h in bed.hosts] == [BASELINE_CONTEXT] * 3
    # no host was drained
    assert all(row["status"] == "UP" for row in bed.runtime().servers(BACKEND).values())


@BOTH
def test_a_roll_out_under_load_loses_no_request_and_every_host_ends_on_the_new_context(bed: FleetBed) -> None:
    """Beside the load of new connections, 12 clients each keep one HTTP/1.1 connection to HAProxy and
    stream request after request over it: draining a server must not cut a stream or the connection."""
    bed.reset()
    run = roll_out(bed, TARGET, "ok", rate=20, kept_alive=(8, 12))
    assert run.returncode == 0, run.output[-3000:]
    assert_nothing_lost(run)
    kept = run.kept_alive
    assert kept["sent"] > 60, kept
    assert (kept["failed"], kept["truncated"], kept["lost"]) == (0, 0, 0), kept["errors"]
    assert kept["answered"] == kept["sent"]
    assert kept["reused"] > kept["sent"] // 2, kept  # they really were kept alive
    # the load runs at most 110 s (roll_out's bound): on a loaded machine the roll-out outlasts it, so
    # only the first host's drain is sure to fall inside it
    assert "DRAIN" in kept["lb_statuses"]["h1"], kept["lb_statuses"]
    assert [bed.served_context(h) for h in bed.hosts] == [TARGET] * 3
    assert run.report["changed"] == ["h1", "h2", "h3"] and run.report["uniform"] is True
    # every host was out of rotation for its change, one at a time, and took traffic otherwise
    for host in bed.hosts:
        assert 0 < run.load["lb_downtime_s"][host.name] < run.seconds
        assert "DRAIN" in run.load["lb_statuses"][host.name]
        assert run.load["served_by"].get(host.name, 0) > 0
        assert kept["served_by"].get(host.name, 0) > 0
        assert f"--max-model-len {TARGET}" in host.unit_path.read_text()
        reported = run.report["hosts"][host.name]
        assert (reported["before"], reported["after"]) == (BASELINE_CONTEXT, TARGET)
        assert 0 < reported["out_of_service_s"] < run.seconds and reported["in_load_balancer"] is True
    # calibrate once: hosts 2 and 3 were handed host 1's observed start (ctxmgr observe --import)
    hosts = run.report["hosts"]
    assert hosts["h1"]["detail"]["calibrated_from"] is None
    for name in ("h2", "h3"):
        assert hosts[name]["detail"]["calibrated_from"] == "h1"
        imported = bed.directory / name / "imports" / f"{SERVICE}-from-h1.json"
        assert hosts[name]["detail"]["import"] == str(imported) and imported.exists()

    # the same roll-out again changes nothing, drains nothing
    again = roll_out(bed, TARGET, "again", rate=0)
    assert again.returncode == 0, again.output[-3000:]
    assert again.report["unchanged"] == ["h1", "h2", "h3"]


@BOTH
def test_a_failure_on_the_middle_host_is_rolled_back_everywhere_and_the_last_is_untouched(
    bed: FleetBed,
) -> None:
    bed.reset(host_environment=FAILURE_ON_H2)
    untouched = snapshot(bed, "h3")
    run = roll_out(bed, TARGET, "fail", rate=20)
    assert run.returncode != 0
    assert_nothing_lost(run)
    report = run.report
    assert report["failed"] == ["h2"] and report["rolled_back"] == ["h1"] and report["untouched"] == ["h3"]
    h2 = report["hosts"]["h2"]["detail"]
    assert h2["rolled_back_by_ctxmgr"] is True and h2["serves_old_context"] is True
    assert h2["result"] == "rolled-back" and "100000" in h2["decisive_line"]
    assert h2["failed_after_its_change"] is False
    assert "h2 failed" in run.output and "Rolled back: h1." in run.output
    assert "Every host serves its old context and is in the load balancer" in run.output
    assert report["hosts"]["h1"]["out_of_service_s"] > 0 and report["hosts"]["h2"]["out_of_service_s"] > 0
    assert_back_where_it_was(bed, run, untouched)


@NEWEST_ONLY
@pytest.mark.parametrize("step", ["drain", "idle", "undrain", "up"])
def test_a_failed_load_balancer_step_on_the_middle_host_ends_with_the_fleet_back(
    bed: FleetBed, step: str
) -> None:
    """The LB's own API fails (through `rolling_context_lb: command`, the bed's HAProxy behind it): before the
    change (drain, wait idle) or after it applied (undrain, wait UP). h2 whose change applied is
    rolled back too, and every host is back in rotation."""
    bed.reset()
    untouched = snapshot(bed, "h3")
    faults = bed.directory / f"faults-{step}"
    # a wait is retried once a second for its timeout (3 s): 4 refusals make it fail once
    faults.write_text(f"h2:{step}:{4 if step in ('idle', 'up') else 1}\n")
    lb = {**bed.command_lb(faults), "rolling_context_lb_idle_timeout": 3, "rolling_context_lb_up_timeout": 3}
    run = roll_out(bed, TARGET, f"lb-{step}", rate=20, extra_vars=lb)
    assert run.returncode != 0
    assert faults.read_text().split() == [f"h2:{step}:0"]  # the injected refusals were all used
    assert_nothing_lost(run)
    report = run.report
    h2 = report["hosts"]["h2"]
    after_change = step in ("undrain", "up")
    assert report["failed"] == ["h2"] and report["untouched"] == ["h3"]
    assert report["rolled_back"] == (["h1", "h2"] if after_change else ["h1"])
    assert h2["detail"]["failed_after_its_change"] is after_change
    assert step in h2["detail"]["failed_task"].lower()  # "Run the command to drain", "Wait until UP", ...
    assert "injected" in h2["detail"]["reason"]  # the LB command's own words
    assert_back_where_it_was(bed, run, untouched)


@NEWEST_ONLY
def test_a_failed_rollback_on_an_earlier_host_is_named_in_the_report(bed: FleetBed) -> None:
    """h1 changed; h2 fails; h1's rollback fails too (its vLLM no longer starts at all, whatever unit:
    a drifted EnvironmentFile makes it run out of GPU memory while loading). The report names h1, why,
    and that it is out of the balancer, which it is: no request reaches a host that does not serve."""
    bed.reset(host_environment=FAILURE_ON_H2)
    h1, untouched = bed.hosts[0], snapshot(bed, "h3")
    breaks_h1 = when_serving(
        bed, h1, TARGET, lambda: h1.env_file.write_text("CTXMGR_STANDIN_FAIL=cuda_oom\n")
    )
    # (a SIGKILL crash loop instead keeps ctxmgr watching until its timeout: rolling_context_timeout
    # bounds it)
    run = roll_out(
        bed, TARGET, "rollback-fails", rate=20, during=breaks_h1, extra_vars={"rolling_context_timeout": 120}
    )
    assert run.returncode != 0
    assert_nothing_lost(run)
    report = run.report
    assert report["failed"] == ["h2"] and report["rollback_failed"] == ["h1"]
    assert report["untouched"] == ["h3"]
    assert report["uniform"] is False and list(report["not_restored"]) == ["h1"]
    why = report["not_restored"]["h1"]
    assert why.startswith(f"not back at max_model_len {BASELINE_CONTEXT}")
    assert "out of the load balancer" in why
    assert "rollback" in why and report["hosts"]["h1"]["in_load_balancer"] is False
    assert "NOT brought back: h1: " in run.output
    assert all_up(bed)["h1"] != "UP" and all_up(bed)["h2"] == all_up(bed)["h3"] == "UP"
    assert bed.served_context(bed.hosts[1]) == BASELINE_CONTEXT
    assert bed.hosts[2].unit_path.read_bytes() == untouched["h3"][0]
    assert main_pids(bed)["h3"] == untouched["h3"][1]


@BOTH
def test_a_host_unreachable_mid_roll_out_stops_it_and_the_changed_hosts_are_rolled_back(
    bed: FleetBed,
) -> None:
    """h2's sshd stops once h1 has changed: Ansible cannot reach h2 when its turn comes."""
    bed.reset()
    h2 = bed.hosts[1]
    untouched = snapshot(bed, "h2", "h3")
    stop_ssh = when_serving(bed, bed.hosts[0], TARGET, lambda: h2.systemctl("stop", "sshd-fleet.service"))
    try:
        run = roll_out(bed, TARGET, "unreachable", rate=20, during=stop_ssh)
    finally:
        h2.systemctl("start", "sshd-fleet.service")
    assert run.returncode != 0
    assert_nothing_lost(run)
    report = run.report
    assert report["failed"] == ["h2"] and report["rolled_back"] == ["h1"] and report["untouched"] == ["h3"]
    assert report["hosts"]["h2"]["unreachable"] is True
    assert report["hosts"]["h2"]["detail"]["reason"].startswith("unreachable")
    assert "unreachable" in run.output
    untouched_h3 = {"h3": untouched["h3"]}
    assert_back_where_it_was(bed, run, untouched_h3)
    assert h2.unit_path.read_bytes() == untouched["h2"][0] and main_pids(bed)["h2"] == untouched["h2"][1]


@BOTH
def test_in_batches_a_failure_rolls_back_the_host_that_changed_beside_it(bed: FleetBed) -> None:
    """serial 67% of 3 hosts: h1 and h2 together, then h3. h2 fails while h1, in the same batch,
    changes; h1 is rolled back, h3 never starts; h3 alone carries the load meanwhile."""
    bed.reset(host_environment=FAILURE_ON_H2)
    untouched = snapshot(bed, "h3")
    run = roll_out(bed, TARGET, "batch", rate=20, extra_vars={"ctxmgr_serial": "67%"})
    assert run.returncode != 0
    assert_nothing_lost(run)
    report = run.report
    assert report["failed"] == ["h2"] and report["rolled_back"] == ["h1"] and report["untouched"] == ["h3"]
    # both were out of rotation at once, in one batch
    assert "DRAIN" in run.load["lb_statuses"]["h1"] and "DRAIN" in run.load["lb_statuses"]["h2"]
    assert_back_where_it_was(bed, run, untouched)


@NEWEST_ONLY
def test_without_the_drain_the_same_roll_out_loses_requests(bed: FleetBed) -> None:
    """The bed is sharp enough to see what the drain saves: vLLM stops hard, so a restart behind
    HAProxy's health checks alone cuts the requests in flight (and sends some to a closed port)."""
    bed.reset()
    run = roll_out(bed, TARGET, "no-drain", rate=20, extra_vars={"rolling_context_lb": "none"})
    assert run.returncode == 0, run.output[-3000:]
    assert [bed.served_context(h) for h in bed.hosts] == [TARGET] * 3
    assert run.load["failed"] + run.load["truncated"] > 0, run.load


@NEWEST_ONLY
def test_the_bed_leaves_nothing_in_the_hosts_network(bed: FleetBed) -> None:
    """The bed's addresses exist only inside its namespaces: none on the host, no route out of them."""
    import subprocess

    host_addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "10.249.0." not in host_addresses
    routes = subprocess.run(
        ["ip", "-n", bed.client_netns, "route"], capture_output=True, text=True, check=True
    ).stdout
    assert "default" not in routes
    for host in bed.hosts:
        routes = subprocess.run(["ip", "-n", host.netns, "route"], capture_output=True, text=True).stdout
        assert "default" not in routes
    assert Path(f"/run/netns/{bed.client_netns}").exists()
