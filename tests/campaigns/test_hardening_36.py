"""Issue 36: hostile or failing inputs that must end in one clear line, never in a change that goes on
unchecked or an exit 70. Quick tier: real parsers and real subprocesses, no sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.paths import REPO
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.systemd.features import FLOOR, parse_version
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.systemctl import Systemd, _verify_problems
from vllm_ctxmgr.systemd.unit_file import ServiceUnit

UNITS = REPO / "units"

# systemd 247's systemd-analyze given an option it does not have (the text 247 prints; see
# tests/systemd/test_features.py VERIFY_247_RECURSIVE_ERRORS)
VERIFY_247_UNRECOGNIZED = "systemd-analyze: unrecognized option '--recursive-errors=no'\n"


# ---------------------------------------------------------------------------------------------------------
# item 3: systemd's Version is not trusted


def manager_saying(version: str) -> Systemd:
    """A manager whose `systemctl show -p Version` prints `version` (a real subprocess: sh stands in for
    the nsenter wrapper and prints the property as systemctl does)."""
    return Systemd(wrapper=("sh", "-c", 'printf "Version=%s\\n" "$CTXMGR_TEST_VERSION"', "sh"))


@pytest.mark.parametrize(
    "text",
    ["251junk", "9" * 5000, "25x", "v", "247" + "." * 300],
    ids=["junk", "5000-digits", "25x", "v", "long"],
)
def test_a_version_that_is_not_a_systemd_release_is_refused(text: str) -> None:
    assert parse_version(text) is None


@pytest.mark.parametrize(
    ("version", "words"),
    [
        ("251junk", "not a systemd release"),
        ("9" * 5000, "not a systemd release"),
        ("25", f"older than systemd {FLOOR}"),
    ],
    ids=["junk", "5000-digits", "below-floor"],
)
def test_the_managers_version_is_checked_when_it_is_read(
    monkeypatch: pytest.MonkeyPatch, version: str, words: str
) -> None:
    monkeypatch.setenv("CTXMGR_TEST_VERSION", version)
    with pytest.raises(CtxmgrError) as caught:
        _ = manager_saying(version).version
    assert words in caught.value.message
    assert "\n" not in caught.value.message and len(caught.value.message) < 300


def test_the_floor_itself_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXMGR_TEST_VERSION", "247.3-7+deb11u4")
    assert manager_saying("").version == 247


class VerifyFailsToRun:
    """A manager whose systemd-analyze cannot run the check at all (247 given --recursive-errors=no
    because its Version claimed 999): every unit, the current one and the candidate, gets the same
    failure, parsed by the real _verify_problems."""

    def analyze_verify_text(self, text: bytes, name: str) -> list[str]:
        return _verify_problems(VERIFY_247_UNRECOGNIZED, name, f"/run/x/{name}", 1)


def test_a_verify_that_could_not_run_refuses_the_change_even_where_the_unit_failed_it_too() -> None:
    from vllm_ctxmgr.change.walk import verify_candidate

    view = view_from_unit(ServiceUnit.load_with_dropins(UNITS / "vllm-glm5.service"))
    text = view.unit.files[0].text.replace("--max-model-len", "--max-model-len 4096 --x-unused")
    added, inherited = verify_candidate(VerifyFailsToRun(), view, view.unit.files[0].path, text)  # type: ignore[arg-type]
    assert added and "systemd-analyze verify failed" in added[0]
    assert inherited == []


# ---------------------------------------------------------------------------------------------------------
# item 6: a string length of 2^64-1 inside a string array that is stepped over, not decoded


@pytest.mark.parametrize("which", [0, 1, 4999], ids=["first", "second", "last"])
def test_a_huge_string_length_in_a_skipped_string_array_is_one_line(tmp_path: Path, which: int) -> None:
    import struct

    from tests import gguf_builders
    from vllm_ctxmgr.model_files.load import load_model_facts

    path = tmp_path / "m.gguf"
    tokens = [f"t{i:05d}" for i in range(5000)]  # more than the 4096 kept: walked with skip_strings
    base = {"block_count": 4, "attention.head_count": 8, "embedding_length": 512, "context_length": 4096}
    tensors = gguf_builders.block_tensors(2, 64, kv_width=64, ggml_type="F16")
    gguf_builders.write_gguf(path, "llama", base | {"vocab.tokens": tokens}, tensors)
    data = bytearray(path.read_bytes())
    at = data.index(struct.pack("<Q", 6) + tokens[which].encode())
    data[at : at + 8] = struct.pack("<Q", 2**64 - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(CtxmgrError) as caught:
        load_model_facts(str(path))
    assert str(path) in caught.value.message and "\n" not in caught.value.message


# ---------------------------------------------------------------------------------------------------------
# item 11: the world size is bounded, not only each parallel size


@pytest.mark.parametrize(
    "argv",
    [
        ["-tp", "1024", "-pp", "1024", "--prefill-context-parallel-size", "1024", "--nnodes", "2"],
        ["-tp", "8", "--nnodes", "1099511627776", "--node-rank", "0"],
        ["-tp", "1024", "-dp", "1024"],
    ],
    ids=["tp-pp-pcp", "nnodes", "tp-dp"],
)
def test_a_world_size_beyond_any_deployment_is_one_line(argv: list[str]) -> None:
    from vllm_ctxmgr.core.bounds import MAX_WORLD_SIZE
    from vllm_ctxmgr.core.serve_args import parse_serve_argv
    from vllm_ctxmgr.errors import UsageError

    with pytest.raises(UsageError) as caught:
        parse_serve_argv(["Qwen/Qwen3-8B", *argv, "--master-addr", "10.0.0.1"])
    assert f"{MAX_WORLD_SIZE:,}" in caught.value.message or "--nnodes" in caught.value.message
    assert "\n" not in caught.value.message and len(caught.value.message) < 300


def test_the_largest_real_layouts_still_read() -> None:
    from vllm_ctxmgr.core.serve_args import parse_serve_argv

    args = parse_serve_argv(
        ["m", "-tp", "8", "-pp", "4", "-dp", "64", "--nnodes", "256", "--master-addr", "a"]
    )
    assert args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size == 2048


# ---------------------------------------------------------------------------------------------------------
# item 13: the wire's version, a node's answer that is not JSON, a node's GPU count, a service with `:`


@pytest.mark.parametrize("version", [3.0, "3", True, None])
def test_only_the_wires_own_version_passes(version: object) -> None:
    from vllm_ctxmgr.deployment.wire import WIRE_VERSION, StepAnswer, WireError

    assert WIRE_VERSION == 3
    with pytest.raises(WireError, match="speaks wire version"):
        StepAnswer.from_json({"wire": version, "service": "vllm.service", "ok": True})


def test_a_node_answer_that_is_not_json_says_so(workdir: Path) -> None:
    import sys

    from vllm_ctxmgr.deployment.remote import Link, NodeError

    script = workdir / "not-json-ctxmgr.py"
    script.write_text("print('Welcome to gpu-b! (a login banner)')\n")
    with pytest.raises(NodeError) as caught:
        Link(local_ctxmgr=(sys.executable, str(script))).call("local", ["node", "show", "u"], timeout=30)
    assert caught.value.message == "local: its answer is not JSON (exit status 0)"


def test_a_node_that_reports_more_gpus_than_any_deployment_has_is_refused() -> None:
    from vllm_ctxmgr.core.bounds import MAX_WORLD_SIZE
    from vllm_ctxmgr.errors import UsageError
    from vllm_ctxmgr.nvml import gpus_from_json

    gpu = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_899_345_920,
           "free_bytes": 85_000_000_000, "used_bytes": 899_345_920}  # fmt: skip
    with pytest.raises(UsageError, match=f"more than {MAX_WORLD_SIZE:,} GPUs"):
        gpus_from_json({"gpus": [dict(gpu, index=i) for i in range(60_000)]}, "gpu-b: `node show` answer")
    assert len(gpus_from_json({"gpus": [gpu] * 8}, "x").gpus) == 8


def test_a_deployment_files_service_with_a_colon_is_refused_not_split(workdir: Path) -> None:
    import json

    from click.testing import CliRunner

    from vllm_ctxmgr.cli.main import main

    path = workdir / "d.toml"
    path.write_text('[[node]]\nhost = "gpu-b"\nservice = "evil:vllm-glm5"\n')
    result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
    error = json.loads(result.stdout)["error"]
    assert result.exit_code == 2 and "evil:vllm-glm5" in error and "gpu-b:evil" not in error, error


# ---------------------------------------------------------------------------------------------------------
# item 18: a `show stat` count of '²', and a 5,000-digit --speculative-config echoed whole


@pytest.mark.parametrize(
    "value", ["²", "٣", "1²", "１２"], ids=["superscript", "arabic-indic", "mixed", "fullwidth"]
)
def test_a_count_that_is_a_digit_only_to_unicode_is_the_clients_own_error(value: str) -> None:
    from ansible_collections.vllm.ctxmgr.plugins.module_utils.haproxy_runtime import HaproxyError, _count

    with pytest.raises(HaproxyError, match="not a count"):
        _count({"scur": value}, "scur", "vllm", "h1")
    assert _count({"scur": "12"}, "scur", "vllm", "h1") == 12


def test_a_huge_speculative_config_is_not_echoed_whole() -> None:
    from vllm_ctxmgr.core.serve_args import parse_serve_argv

    for value in ('{"num_speculative_tokens": ' + "9" * 5000 + "}", "[" + "1," * 3000 + "1]"):
        args = parse_serve_argv(["m", "--speculative-config", value])
        assert args.refusals and all(len(r) < 400 for r in args.refusals), [len(r) for r in args.refusals]


# ---------------------------------------------------------------------------------------------------------
# item 14: the Ansible module creates only the directories it needs and changes none it did not make


def test_the_module_leaves_an_existing_directory_as_it_is(workdir: Path) -> None:
    import json
    import stat

    from ansible_collections.vllm.ctxmgr.plugins.modules import ctxmgr as module

    shared = workdir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # /tmp-like: its sticky bit keeps others' files safe
    module.write_observation(str(shared / "obs.json"), {"observation": {"gpu_name": "H100"}})
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert json.loads((shared / "obs.json").read_text()) == {"observation": {"gpu_name": "H100"}}
    assert stat.S_IMODE((shared / "obs.json").stat().st_mode) == 0o600

    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o755)
    (workdir / "link").symlink_to(elsewhere)
    module.write_observation(str(workdir / "link" / "obs.json"), {"observation": {}})
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755  # never through the link either

    made = workdir / "new" / "deeper"
    module.write_observation(str(made / "obs.json"), {"observation": {}})
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and stat.S_IMODE(made.parent.stat().st_mode) == 0o700


# ---------------------------------------------------------------------------------------------------------
# item 15: check mode (declared `support: full`) writes nothing on the host: observe reads only


def test_in_check_mode_the_module_observes_read_only() -> None:
    from ansible_collections.vllm.ctxmgr.plugins.modules import ctxmgr as module
    from vllm_ctxmgr.cli.main import main

    params = {"command": "observe", "service": "vllm-glm5", "nodes": [], "ctxmgr_bin": "ctxmgr",
              "state_dir": None, "systemd_pid": None}  # fmt: skip
    assert "--dry-run" in module.command_argv(params, True) and "--dry-run" in module.observe_argv(
        params, True
    )
    assert "--dry-run" not in module.command_argv(params, False)
    assert "--dry-run" not in module.observe_argv(params, False)
    # and the ctxmgr it runs takes the flag (its parser, not a guess)
    observe = main.get_command(None, "observe")  # type: ignore[arg-type]
    argv = module.observe_argv(params, True)
    parsed = observe.make_context("observe", argv[argv.index("observe") + 1 :]).params  # type: ignore[union-attr]
    assert parsed["dry_run"] is True and parsed["service"] == "vllm-glm5.service"


# ---------------------------------------------------------------------------------------------------------
# item 7: a unit stopped under a start that is being waited for is a failure at once, not a 30 min wait


@pytest.mark.parametrize("headless", [False, True])
def test_a_unit_stopped_while_its_start_is_awaited_fails_within_seconds(headless: bool) -> None:
    """systemd's own lines of a stop (as tests/data/vllm-logs/systemd_vllm-ok_journal.log has them)
    come before any `Started` of the new process, so the watcher, awaiting that line, ignored them; the
    unit then sits inactive (Result=success, what a restart also passes through) and the start was
    waited for until its timeout."""
    from vllm_ctxmgr.vllm_log.watcher import StartWatcher

    now = [1000.0]
    watcher = StartWatcher(timeout_s=1800, await_start=True, headless=headless, clock=lambda: now[0])
    for line in (
        "Stopping vllm-ok.service - vLLM tiny model (good config)...",
        "vllm-ok.service: Deactivated successfully.",
        "Stopped vllm-ok.service - vLLM tiny model (good config).",
    ):
        watcher.feed(line)
    inactive = {"ActiveState": "inactive", "SubState": "dead", "Result": "success", "NRestarts": "0"}
    watcher.feed_unit_state(inactive)
    assert watcher.poll() is None  # a restart passes through inactive: not at once
    for step in range(1, 21):
        now[0] = 1000.0 + step * 0.5
        watcher.feed_unit_state(inactive)
        if watcher.poll() is not None:
            break
    verdict = watcher.poll()
    assert verdict is not None and not verdict.ok, "still waiting after 10 s of an inactive unit"
    assert "stopped" in verdict.reason and now[0] - 1000.0 <= 10.0
    # a start job still waiting for its dependencies is inactive too, but no stop was logged: no verdict
    waiting = StartWatcher(timeout_s=1800, await_start=True, clock=lambda: now[0])
    for step in range(20):
        now[0] = 1500.0 + step
        waiting.feed_unit_state(inactive)
    assert waiting.poll() is None
    # a restart's moment of inactive, then activating: no verdict
    other = StartWatcher(timeout_s=1800, await_start=True, clock=lambda: now[0])
    for line in ("Stopping vllm-ok.service - vLLM.", "Stopped vllm-ok.service - vLLM."):
        other.feed(line)
    now[0] = 2000.0
    other.feed_unit_state(inactive)
    now[0] = 2000.5
    other.feed_unit_state({"ActiveState": "activating", "SubState": "start", "Result": "success"})
    now[0] = 2030.0
    other.feed_unit_state({"ActiveState": "activating", "SubState": "start", "Result": "success"})
    assert other.poll() is None
