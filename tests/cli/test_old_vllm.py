"""Issue 28 item 5: a vLLM older than the oldest release ctxmgr knows (0.10.0).

The read-only commands plan it by 0.10's rules (the same public V0-era starts plan within 0.1% under
them) and say which terms those rules do not model for it; only the commands that change a service
refuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import run
from tests.support.paths import REPO
from vllm_ctxmgr.core.vllm_versions import non_default_rules, not_modelled_before_oldest

QWEN = str(REPO / "examples" / "models" / "qwen3-32b")
PLAN = ["plan", "4096", "--model", QWEN, "--gpu-memory", "80GiB", "--gpu-count", "1"]


def test_plan_of_0_6_4_is_made_by_0_10s_rules_and_names_what_they_do_not_model() -> None:
    code, out, err = run(*PLAN, "--vllm-version", "0.6.4")
    assert code == 0, err
    assert "vLLM 0.6.4 (older than any known: planned by 0.10.0's) rules" in out
    assert "warning: not modelled for vLLM 0.6.4: the activation peak: V0's profile run" in out
    assert "with chunked prefill off is max(max_model_len, 2048)" in out
    assert "warning: not modelled for vLLM 0.6.4: the V0 engine itself" in out
    code, out, _ = run(*PLAN, "--vllm-version", "0.6.4", "--json")
    data = json.loads(out)
    assert code == 0 and data["vllm_version"] == "0.6.4"
    assert any(w.startswith("not modelled for vLLM 0.6.4: the activation peak") for w in data["warnings"])
    # the KV figures are 0.10's, byte for byte
    _, out10, _ = run(*PLAN, "--vllm-version", "0.10.0", "--json")
    ten = json.loads(out10)
    for key in ("kv_bytes_per_gpu", "kv_bytes_per_token_per_gpu", "max_context", "gpu_memory_utilization"):
        assert data[key] == ten[key], key


def test_a_v1_era_release_before_0_10_names_only_the_activation_term() -> None:
    assert len(not_modelled_before_oldest((0, 9, 2))) == 1
    assert len(not_modelled_before_oldest((0, 6, 4))) == 2
    assert not_modelled_before_oldest((0, 10, 0)) == []


def test_facts_reads_an_old_release_too() -> None:
    code, out, err = run("facts", QWEN, "--vllm-version", "0.6.4")
    assert code == 0, err
    assert "derived by vLLM 0.6.4" in out


def test_the_commands_that_change_a_service_refuse_it_in_one_line() -> None:
    for argv in (
        ["set-context", "4096", "vllm-x", "--vllm-version", "0.6.4", "--dry-run"],
        ["deployment", "set-context", "4096", "--node", "local:vllm-x", "--vllm-version", "0.6.4"],
    ):
        code, out, err = run(*argv)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert (
            err.startswith("ctxmgr: --vllm-version 0.6.4: older than 0.10.0") and "changes a service" in err
        )
        assert "`ctxmgr plan --vllm-version 0.6.4` plans it read-only" in err


def test_a_service_running_an_old_vllm_is_planned_but_not_changed(
    sandbox, install_unit, workdir: Path
) -> None:  # type: ignore[no-untyped-def]
    """The unit's own vLLM (its venv's dist-info) is 0.6.4: `plan --service` plans it by 0.10's rules
    with the warnings, `set-context` refuses before writing anything."""
    from tests.ctxmgr_cli import run_ctxmgr
    from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit

    wrapper = make_vllm_wrapper(workdir)
    (workdir / "lib" / "python3.11" / "site-packages" / "vllm-0.6.4.dist-info").mkdir(parents=True)
    name = "vllm-old"
    unit = install_unit(f"{name}.service", standin_unit(wrapper, port=18098))
    state = workdir / "state"
    gpus = offline_gpu_args()
    planned = run_ctxmgr(sandbox.pid, state, "plan", "16384", "--service", name, *gpus, "--json", timeout=180)
    assert planned.code == 0, planned.stderr
    assert planned.data["vllm_version"] == "0.6.4"
    assert any(w.startswith("not modelled for vLLM 0.6.4") for w in planned.data["warnings"])
    before = (sandbox.systemd.host_unit_dir / unit).read_text()
    refused = run_ctxmgr(sandbox.pid, state, "set-context", "16384", "--service", name, *gpus, "--yes",
                         timeout=180)  # fmt: skip
    assert refused.code == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{name}.service runs vLLM 0.6.4, older than 0.10.0" in refused.stderr
    assert (sandbox.systemd.host_unit_dir / unit).read_text() == before


def test_facts_of_a_release_older_than_any_known_warns_in_text_and_json() -> None:
    """Issue 35: `facts --vllm-version 0.1.0` derived the length by 0.10's rules without a word."""
    warning = "vLLM 0.1.0 is older than the oldest release ctxmgr knows; planned by vLLM 0.10.0's rules"
    code, out, err = run("facts", QWEN, "--vllm-version", "0.1.0")
    assert code == 0, err
    assert f"warning      {warning}" in out.splitlines()
    code, out, _ = run("facts", QWEN, "--vllm-version", "0.1.0", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [warning]
    _, out, _ = run("facts", QWEN, "--json")
    assert json.loads(out)["warnings"] == []


def test_an_old_releases_rules_line_names_a_few_and_says_where_the_rest_are() -> None:
    """Issue 35: `plan --vllm-version 0.6.4` printed 22 internal rule ids on one line."""
    _, out, _ = run(*PLAN, "--vllm-version", "0.6.4")
    line = next(line for line in out.splitlines() if line.startswith("vLLM 0.6.4 (older than any known"))
    assert line.count("(since ") == 3
    differing = non_default_rules((0, 6, 4))
    assert len(differing) > 20  # what the line listed before
    assert line.endswith(
        f", and {len(differing) - 3} more (`--json`'s vllm_rules lists each; docs/vllm-accounting.md says "
        "what each changes)"
    )
    _, as_json, _ = run(*PLAN, "--vllm-version", "0.6.4", "--json")
    listed = {r["rule"] for r in json.loads(as_json)["vllm_rules"]}
    assert {row.name for row in differing} <= listed
