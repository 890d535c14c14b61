"""API keys never reach what ctxmgr prints or stores (issue 9 item 5).

The key sources are vLLM's own: `--api-key K1 K2` (vLLM's argparse takes nargs="+", as the stand-in
does), `--api-key=K`, and VLLM_API_KEY in the unit's environment, which a unit may set even where
--api-key overrides it. The end-to-end test runs ctxmgr against a private systemd with the stand-in,
including a start that fails with a decisive line quoting a key.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from tests.ctxmgr_cli import Run, run_ctxmgr
from tests.support.demo import make_vllm_wrapper, offline_gpu_args, standin_unit
from tests.support.paths import REPO
from tests.support.standin import free_port
from vllm_ctxmgr.masking import mask, mask_json, secrets_of
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.unit_edit import unified_diff
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

UNITS = REPO / "units"

K1, K2, ENV_KEY = "sk-first-3f9a71", "sk-second-88c2d0", "sk-environment-5be1"


def test_mask_keeps_the_rest_of_the_line() -> None:
    line = f"curl -H 'Authorization: Bearer {K1}' http://127.0.0.1:8000/v1/models"
    assert mask(line, [K1]) == "curl -H 'Authorization: Bearer ***' http://127.0.0.1:8000/v1/models"


def test_mask_leaves_values_under_four_characters() -> None:
    """A one-letter key masked everywhere would hide every word holding that letter."""
    assert mask("a model at /srv/abc", ["a", "abc"]) == "a model at /srv/abc"
    assert mask("key abcd here", ["abcd"]) == "key *** here"


def test_mask_takes_the_longer_of_two_overlapping_keys_first() -> None:
    assert mask("sk-abcd-long and sk-abcd", ["sk-abcd", "sk-abcd-long"]) == "*** and ***"


def test_mask_json_masks_nested_strings_and_the_escaped_form() -> None:
    key = 'ke"y\\5678'
    data = {"reason": f"rejected {key}", "probe": {"steps": [{"detail": key}]}, "n": 3}
    masked = mask_json(data, [key])
    assert masked == {"reason": "rejected ***", "probe": {"steps": [{"detail": "***"}]}, "n": 3}
    assert mask(json.dumps(data), [key]).count("***") == 2


def test_secrets_of_every_api_key_and_every_environment_assignment() -> None:
    args = ["/models/m", "--api-key", K1, K2, "--port", "8000", "--api-key=sk-third-0000"]
    found = secrets_of(
        args, {"VLLM_API_KEY": ENV_KEY}, ["VLLM_API_KEY=sk-dropin-old", "vllm_api_key=sk-lower"]
    )
    assert found == [K1, K2, "sk-third-0000", ENV_KEY, "sk-dropin-old", "sk-lower"]
    assert secrets_of(["/models/m", "--port", "8000"], {"PATH": "/usr/bin"}) == []


def _unit_with_keys(tmp_path: Path) -> ServiceUnit:
    """units/vllm-glm5.service (VLLM_API_KEY in Environment=) plus --api-key K1 K2 and a drop-in."""
    text = (UNITS / "vllm-glm5.service").read_text()
    assert "VLLM_API_KEY=sk-glm5-local-7f3a9c" in text
    text = text.replace("--port 8000", f"--port 8000 --api-key {K1} {K2}", 1)
    assert K1 in text
    fragment = UnitFile.parse(tmp_path / "vllm-glm5.service", text)
    dropin = UnitFile.parse(tmp_path / "override.conf", f"[Service]\nEnvironment=VLLM_API_KEY={ENV_KEY}\n")
    return ServiceUnit("vllm-glm5.service", (fragment, dropin))


def test_service_view_secrets_hold_every_key_even_with_api_key_set(tmp_path: Path) -> None:
    view = view_from_unit(_unit_with_keys(tmp_path))
    assert view.api_key == K1
    assert set(view.secrets) == {K1, K2, ENV_KEY, "sk-glm5-local-7f3a9c"}


def test_unit_diff_masks_environment_key_and_second_api_key(tmp_path: Path) -> None:
    unit = _unit_with_keys(tmp_path)
    view = view_from_unit(unit)
    old = unit.files[0].text
    new = old.replace("VLLM_API_KEY=sk-glm5-local-7f3a9c", "VLLM_API_KEY=sk-glm5-local-7f3a9c X=1").replace(
        f"{K1} {K2}", f"{K1} {K2} --max-num-seqs 8"
    )
    diff = unified_diff(old, new, str(unit.files[0].path), view.secrets)
    assert diff.count("***") >= 4
    for key in view.secrets:
        assert key not in diff


# ---------------------------------------------------------------- end to end, with the stand-in


def _wrapper_failing_with_the_keys(directory: Path) -> Path:
    """The stand-in, except that a start asked for max_model_len 100000 fails as vLLM's argparse does
    when it is given a value it does not take, quoting the key (a decisive line, exit status 2)."""
    wrapper = make_vllm_wrapper(directory)
    standin = wrapper.rename(wrapper.with_name("vllm-standin"))
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --max-model-len 100000 "*)\n'
        '  echo "usage: vllm serve [model_tag] [options]" >&2\n'
        f'  echo "vllm serve: error: unrecognized arguments: {K2}" >&2\n'
        f'  exit 2;;\nesac\nexec {standin} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def _leaks(text: str) -> list[str]:
    return [key for key in (K1, K2, ENV_KEY) if key in text]


def test_no_key_in_any_output_or_state_file(sandbox, install_unit, workdir: Path) -> None:  # type: ignore[no-untyped-def]
    import time

    from vllm_ctxmgr.probe import wait_until_serving

    name = "vllm-it-secrets"
    port = free_port()
    wrapper = _wrapper_failing_with_the_keys(workdir)
    text = standin_unit(wrapper, port=port, environment={"VLLM_API_KEY": ENV_KEY})
    text = text.replace(f"--port {port}", f"--port {port} --api-key {K1} {K2}", 1)
    unit = install_unit(f"{name}.service", text)
    sandbox.systemd.start(unit)
    assert wait_until_serving(f"http://127.0.0.1:{port}", time.monotonic() + 60)
    state = workdir / "state"
    gpus = offline_gpu_args()

    ctxmgr = partial(run_ctxmgr, sandbox.pid, state, timeout=180)

    runs: dict[str, Run] = {}
    runs["dry-run"] = ctxmgr("set-context", "150000", "--service", name, *gpus, "--dry-run")
    runs["dry-run json"] = ctxmgr("set-context", "150000", "--service", name, *gpus, "--dry-run", "--json")
    runs["set-context"] = ctxmgr("set-context", "150000", "--service", name, *gpus, "--yes")
    assert runs["set-context"].code == 0, runs["set-context"].stderr
    runs["set-context json"] = ctxmgr("set-context", "200000", "--service", name, *gpus, "--yes", "--json")
    assert runs["set-context json"].data["result"] == "applied", runs["set-context json"].stderr
    runs["failed"] = ctxmgr("set-context", "100000", "--service", name, *gpus, "--yes", "--json")
    assert runs["failed"].data["result"] == "rolled-back", runs["failed"].stderr
    runs["failed text"] = ctxmgr("set-context", "100000", "--service", name, *gpus, "--yes")
    assert runs["failed text"].code == 1
    runs["history"] = ctxmgr("history", "--service", name)
    runs["history json"] = ctxmgr("history", "--service", name, "--json")
    runs["verify"] = ctxmgr("verify", "--service", name, "--textfile", str(workdir / "ctxmgr.prom"))
    runs["verify json"] = ctxmgr("verify", "--service", name, "--json")
    runs["observe"] = ctxmgr("observe", "--service", name)
    runs["observe json"] = ctxmgr("observe", "--service", name, "--json")
    runs["rollback"] = ctxmgr("rollback", "--service", name, "--yes")
    runs["rollback json"] = ctxmgr("rollback", "--service", name, "--yes", "--json")
    assert runs["rollback json"].code == 0, runs["rollback json"].stderr

    leaks = {
        f"{what} {stream}": _leaks(getattr(run, stream))
        for what, run in runs.items()
        for stream in ("stdout", "stderr")
        if _leaks(getattr(run, stream))
    }
    # the unit copies a revision keeps (mode 0600, like the unit itself) are what a rollback writes back
    # byte for byte: they hold the unit's keys by design; nothing else under the state directory may
    kept = {"unit", "previous"}
    for path in [*state.rglob("*"), workdir / "ctxmgr.prom"]:
        if path.is_file() and path.name not in kept and _leaks(path.read_text(errors="replace")):
            leaks[str(path.relative_to(workdir))] = _leaks(path.read_text(errors="replace"))
    assert leaks == {}
    # and what was masked still says what happened
    assert "unrecognized arguments: ***" in runs["failed"].data["decisive_line"]
    assert any("***" in (r.get("decisive_line") or "") for r in runs["history json"].data["revisions"])
    assert "***" in runs["dry-run"].stdout + runs["dry-run"].stderr  # the diff showed where a key was
