"""Issue 28 item 1: the plan an operator reads of a unit is the change set-context makes.

For every unit under units/ and every model under examples/models/, `plan --unit` (text and JSON) is
held against the unit set-context would write (the same edit_unit, with the flags plan says it would
write): planned again, that unit must run at the utilisation the plan told, report the same KV cache,
and leave nothing to change. A unit whose files live under /etc (an EnvironmentFile=, a vLLM --config)
is read from a copy that points at the shipped files next to it.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.cli import run_stdout
from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.core.budget import default_gpu_memory_utilization
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.unit_edit import edit_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit

UNITS = sorted((REPO / "units").glob("*.service"))
MODELS = sorted(p for p in (REPO / "examples" / "models").iterdir() if p.is_dir())
GPUS = ("--gpu-memory", "80GiB", "--gpu-count", "8")


def unit_copy(unit: Path, directory: Path) -> Path:
    """The unit as this checkout can read it: /etc paths pointed at the shipped files next to it."""
    text = unit.read_text()
    text = text.replace(
        "EnvironmentFile=/etc/default/vllm\n", f"EnvironmentFile={REPO}/units/etc/default/vllm\n"
    )
    if "WorkingDirectory=/etc/vllm" in text:
        (directory / "qwen3.yaml").write_text((REPO / "units" / "etc" / "vllm" / "qwen3.yaml").read_text())
        text = text.replace("WorkingDirectory=/etc/vllm", f"WorkingDirectory={directory}")
    copy = directory / unit.name
    copy.write_text(text)
    dropins = unit.with_name(unit.name + ".d")
    if dropins.is_dir():
        (directory / dropins.name).mkdir()
        for conf in dropins.glob("*.conf"):
            (directory / dropins.name / conf.name).write_text(conf.read_text())
    return copy


def plan_unit(unit: Path, model: Path, *extra: str) -> tuple[int, dict, str]:
    args = ("--state-dir", str(unit.parent / "state"), "plan", "--unit", str(unit), "--model", str(model))
    code, out = run_stdout(*args, *GPUS, *extra, "--json")
    text_code, text = run_stdout(*args, *GPUS, *extra)
    assert text_code == code, text
    return code, json.loads(out), text


def written_unit(unit: Path, flag_changes: dict[str, str], env_changes: dict[str, str]) -> Path:
    """The unit set-context would write with these flags (its own edit, not installed anywhere)."""
    if not flag_changes and not env_changes:
        return unit  # nothing to write: set-context leaves the unit as it is
    edit = edit_unit(ServiceUnit.load_with_dropins(str(unit)), flag_changes, env_changes)
    after = unit.parent / "after" / unit.name
    after.parent.mkdir(exist_ok=True)
    if edit.path == unit:
        after.write_text(edit.new_text)
    else:  # the edit went to a drop-in: the unit file as it was, the drop-in next to it
        after.write_text(unit.read_text())
        (after.parent / f"{unit.name}.d").mkdir(exist_ok=True)
        (after.parent / f"{unit.name}.d" / edit.path.name).write_text(edit.new_text)
    return after


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.name)
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_plan_of_a_unit_is_what_set_context_writes_figure_for_figure(
    unit: Path, model: Path, workdir: Path
) -> None:
    copy = unit_copy(unit, workdir)
    code, data, text = plan_unit(copy, model)
    if code == 2:
        pytest.skip(f"vLLM refuses {model.name} on {unit.name}: {data['error']}")
    assert code in (0, 3, 6), text
    headline = next(
        line for line in text.splitlines() if line.startswith(("FEASIBLE", "NOT FEASIBLE", "UNKNOWN"))
    )
    before = view_from_unit(ServiceUnit.load_with_dropins(str(copy))).args
    if data["result"] == "infeasible":
        # set-context refuses what does not fit: plan says nothing would be written
        assert "set_context" not in data and "set-context would write" not in text
        return
    applied = data["set_context"]
    written = applied["flag_changes"].get("--gpu-memory-utilization")
    # the utilisation announced is the one written, else the unit's own (set-context --force included)
    assert applied["gpu_memory_utilization"] == (float(written) if written else before.gpu_memory_utilization)
    if data["result"] == "unknown":
        # the weights are unknown: told at the utilisation the unit runs with, no least one, and
        # set-context refuses any change unforced (issue 35)
        assert data["least_gpu_memory_utilization"] is None
        assert applied["least_gpu_memory_utilization"] is None
        if data["gpus"]:
            version = tuple(int(x) for x in data["vllm_version"].split("."))
            runs = applied["gpu_memory_utilization"] or default_gpu_memory_utilization(version)
            assert data["gpu_memory_utilization"] == runs
            assert "--gpu-memory-utilization" not in data["flag_changes"]
        assert bool(applied["refused"]) == bool(applied["flag_changes"])
        return
    runs_at = data["gpu_memory_utilization"]
    version = tuple(int(x) for x in data["vllm_version"].split("."))
    # the plan's utilisation is the one the unit runs with after the change, the least one more figure
    if applied["gpu_memory_utilization"] is not None:
        assert runs_at == applied["gpu_memory_utilization"]
    elif data["gpus"]:
        assert runs_at == default_gpu_memory_utilization(version)
    least = data["least_gpu_memory_utilization"]
    assert applied["least_gpu_memory_utilization"] == least
    if least is not None and runs_at is not None and abs(least - runs_at) > 1e-9:
        assert f"least gpu_memory_utilization that fits: {least:.2f} (planned at {runs_at:.2f}" in text
    # an unchanged value is not a change
    if before.max_model_len == data["max_model_len"]:
        assert "--max-model-len" not in applied["flag_changes"]
    if applied["flag_changes"].get("--gpu-memory-utilization") is not None:
        assert float(applied["flag_changes"]["--gpu-memory-utilization"]) != before.gpu_memory_utilization
    assert data["flag_changes"].items() <= applied["flag_changes"].items() | {
        ("--max-model-len", str(before.max_model_len))
    }
    # the text tells the same figures
    if runs_at is not None and data["gpus"]:
        assert f"gpu_memory_utilization {runs_at:.2f}" in headline
    flags = " ".join(f"{k} {v}" for k, v in data["flag_changes"].items()) or "(none)"
    assert f"flags: {flags}" in text.splitlines()
    for capacity in data["capacity"]:
        assert f"KV cache size: {capacity['kv_cache_tokens']:,} tokens" in text
        assert f"{capacity['max_concurrency']:.2f}x" in text
    if applied["refused"]:  # set-context does not edit this unit (a Quadlet's): plan says so, as it would
        assert f"set-context would refuse: {applied['refused']}" in text
        with pytest.raises(UnitError, match=re.escape(applied["refused"])):
            edit_unit(ServiceUnit.load_with_dropins(str(copy)), applied["flag_changes"], data["env_changes"])
        return
    # the unit set-context writes, planned again: the same story, and nothing left to change
    after = written_unit(copy, applied["flag_changes"], data["env_changes"])
    code, again, _ = plan_unit(after, model, str(data["max_model_len"]))
    assert code == 0 and again["result"] == "feasible"
    assert again["set_context"]["flag_changes"] == {}
    assert again["flag_changes"] == {}
    for key in ("max_model_len", "gpu_memory_utilization", "kv_cache_tokens", "max_concurrency", "capacity"):
        assert again[key] == data[key], key
    assert [g["kv_budget"] for g in again["gpus"]] == [g["kv_budget"] for g in data["gpus"]]
    assert [g["headroom"] for g in again["gpus"]] == [g["headroom"] for g in data["gpus"]]


# the local model each shipped unit serves (its model path is the production host's)
UNIT_MODELS = {
    "glm5": "glm-5",
    "gemma3": "gemma-3-27b",
    "qwen3": "qwen3-32b",
    "commented": "qwen3-32b",
    "llama70b": "llama-3.1-70b",
    "envfile": "llama-3.1-70b",
    "demo-vllm-cpu": "llama-3.1-70b",
}
# what the files a unit names under /etc (shipped under units/etc/) set, as plan reads them with --root
FROM_ETC = {
    "vllm-envfile.service": {"max_model_len": 16384, "gpu_memory_utilization": 0.92},  # /etc/default/vllm
    "vllm-qwen3-config.service": {"gpu_memory_utilization": 0.85},  # /etc/vllm/qwen3.yaml
}


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_every_shipped_unit_plans_as_shipped_on_a_fresh_clone(unit: Path, workdir: Path) -> None:
    """Issue 33 item 4: each unit under units/ as it is (no copy), a unit's /etc files read from
    units/etc/ (`--root units`, as README shows): an answer (0, 3, 6), never an error."""
    model = next(REPO / "examples" / "models" / m for key, m in UNIT_MODELS.items() if key in unit.name)
    args = ("--state-dir", str(workdir / "state"), "plan", "--unit", str(unit), "--model", str(model))
    code, out = run_stdout(*args, "--root", str(REPO / "units"), *GPUS, "--json")
    assert code in (0, 3, 6), out
    data = json.loads(out)
    for key, value in FROM_ETC.get(unit.name, {}).items():
        assert data[key] == value, f"{unit.name}: {key} {data[key]}, its file under units/etc says {value}"
    etc_files = re.findall(
        r"^EnvironmentFile=(/etc/\S+)$|^WorkingDirectory=(/etc/\S+)$", unit.read_text(), re.M
    )
    if unit.name in FROM_ETC:
        assert etc_files, f"{unit.name} names no file under /etc any more"
        missing = [p for pair in etc_files for p in pair if p and not Path(p).exists()]
        if missing:  # this host lacks them, as a fresh clone's does: without --root the unit cannot plan
            refused = CliRunner().invoke(main, [*args, *GPUS])
            assert refused.exit_code == 2 and re.search(r" /etc/\S+: no such file", refused.output), (
                refused.output
            )
    else:
        assert not [p for pair in etc_files for p in pair if p], f"{unit.name} names /etc: add it to FROM_ETC"


def test_the_issues_unit_is_told_at_its_own_utilisation() -> None:
    """The issue's command: the story was told at 0.52 while set-context kept 0.92."""
    unit = REPO / "units" / "vllm-llama70b.service"
    model = REPO / "examples" / "models" / "llama-3.1-70b"
    code, out = run_stdout(
        "plan", "--unit", str(unit), "--model", str(model), "--gpu-memory", "80GiB", "--gpu-count", "4"
    )
    assert code == 0
    assert "FEASIBLE: fits at gpu_memory_utilization 0.92" in out
    assert "least gpu_memory_utilization that fits: 0.54" in out
    assert re.search(r"vLLM will report: KV cache size: 933,552 tokens, .*28\.49x", out)
    assert "flags: (none)" in out
    assert "--max-model-len 32768" not in out  # the unit already has it


def test_a_unit_with_unknown_weights_is_told_at_what_set_context_would_run() -> None:
    """Issue 35: `flags: --gpu-memory-utilization 0.95` and a least utilisation of 0.95 were printed for
    GLM-5 with its weights unknown, while set-context kept the unit's 0.9 and wrote nothing."""
    unit = REPO / "units" / "vllm-glm5.service"
    model = REPO / "examples" / "models" / "glm-5"
    gpus = ("--gpu-memory", "95.6GiB", "--gpu-count", "8")
    args = ("plan", "--unit", str(unit), "--model", str(model), *gpus)
    code, out = run_stdout(*args, "--json")
    data = json.loads(out)
    assert code == 6 and data["result"] == "unknown"
    assert data["gpu_memory_utilization"] == data["set_context"]["gpu_memory_utilization"] == 0.9
    assert data["flag_changes"] == data["set_context"]["flag_changes"] == {}
    assert data["least_gpu_memory_utilization"] is None
    assert data["memory"].startswith("weights unknown: fits at the unit's gpu_memory_utilization 0.90 if")
    code, text = run_stdout(*args)
    assert code == 6 and "flags: (none)" in text.splitlines()
    assert "0.95" not in text and "least gpu_memory_utilization" not in text
    # a change set-context would make on that plan is refused, saying what would make it known
    code, out = run_stdout("plan", "65536", "--unit", str(unit), "--model", str(model), *gpus, "--json")
    refused = json.loads(out)["set_context"]["refused"]
    assert code == 6 and refused.startswith("the plan cannot tell whether max_model_len 65536 fits")
    assert "--weights-bytes SIZE" in refused and refused.endswith("--force applies it anyway")


# ---------------------------------------------------------------- set-context --dry-run itself


def test_set_context_dry_run_writes_what_plan_of_the_service_and_the_unit_told(
    sandbox, install_unit, workdir: Path
) -> None:  # type: ignore[no-untyped-def]
    """Against a real private systemd: `set-context --dry-run` of a unit at 0.90 announces, diffs and
    plans what `plan --service` and `plan --unit` of that unit said; `--force` past the plan announces
    the utilisation its diff keeps (it announced the plan's 0.95 while writing nothing of it)."""
    from tests.ctxmgr_cli import run_ctxmgr
    from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit

    name = "vllm-asrun"
    unit = install_unit(f"{name}.service", standin_unit(make_vllm_wrapper(workdir), port=18099))
    state = workdir / "state"
    gpus = offline_gpu_args()

    ctxmgr = partial(run_ctxmgr, sandbox.pid, state, timeout=180)

    dry = ctxmgr("set-context", "131072", "--service", name, *gpus, "--dry-run", "--json")
    assert dry.code == 0 and dry.data["result"] == "dry-run", dry.stderr
    service = ctxmgr("plan", "131072", "--service", name, *gpus, "--json")
    unit_file = str(sandbox.systemd.host_unit_dir / unit)
    of_unit = ctxmgr("plan", "131072", "--unit", unit_file, *gpus, "--json")
    for told in (service, of_unit):
        assert told.code == 0, told.stderr
        assert told.data["gpu_memory_utilization"] == dry.data["gpu_memory_utilization"] == 0.9
        assert told.data["set_context"]["gpu_memory_utilization"] == 0.9
        for key in ("max_model_len", "least_gpu_memory_utilization", "kv_cache_tokens", "max_concurrency"):
            assert told.data[key] == dry.data["plan"][key], key
        changed = [line for line in dry.data["diff"].splitlines() if line.startswith("+") and "--" in line]
        written = " ".join(changed)
        assert all(f"{k} {v}" in written for k, v in told.data["set_context"]["flag_changes"].items())
        assert "--gpu-memory-utilization" not in told.data["set_context"]["flag_changes"]
    text = ctxmgr("set-context", "131072", "--service", name, *gpus, "--dry-run")
    least = dry.data["plan"]["least_gpu_memory_utilization"]
    assert f"gpu_memory_utilization 0.9 (the least that fits: {least:g})" in text.stdout

    small = ["--gpu-memory", "64GiB", *gpus[2:]]  # eight 64 GiB GPUs: 131072 does not fit
    forced = ctxmgr("set-context", "131072", "--service", name, *small, "--dry-run", "--force", "--json")
    assert forced.code == 0 and forced.data["plan"]["result"] == "infeasible", forced.stderr
    assert forced.data["plan"]["gpu_memory_utilization"] == 0.95  # the most the plan would take
    added = [line for line in forced.data["diff"].splitlines() if line.startswith("+") and "--" in line]
    assert added and not any("--gpu-memory-utilization" in line for line in added)
    assert forced.data["gpu_memory_utilization"] == 0.9  # what the unit keeps, as the diff says
    forced_text = ctxmgr("set-context", "131072", "--service", name, *small, "--dry-run", "--force")
    assert "-> max_model_len 131,072 / gpu_memory_utilization 0.9." in forced_text.stdout


def test_root_without_a_unit_is_refused_in_one_line() -> None:
    model = str(REPO / "examples" / "models" / "qwen3-32b")
    refused = CliRunner().invoke(main, ["plan", "--model", model, "--root", str(REPO / "units"), *GPUS])
    assert (
        refused.exit_code == 2
        and refused.output == "ctxmgr: --root reads a unit's files: give it with --unit\n"
    )
