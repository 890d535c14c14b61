"""tests/vllm_cpu.py: the unit it writes, its KV-budget arithmetic against vLLM's recorded errors, the tiny
model it builds, and (slow) the real vLLM CPU build serving that unit under the sandbox systemd."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import time
from pathlib import Path

import pytest

from tests.support import vllm_cpu as vllm_cpu
from tests.support.standin import free_port
from tests.systemd_fixtures import InstallUnit
from vllm_ctxmgr.core.serve_args import parse_serve_argv
from vllm_ctxmgr.systemd.quoting import resolve_escapes
from vllm_ctxmgr.systemd.systemctl import Systemd
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import find_vllm_command

needs_vllm = pytest.mark.usefixtures("require_vllm")  # skip here, fail in CI when it is missing


def parsed_unit(text: str) -> tuple[ServiceUnit, list[str]]:
    unit = ServiceUnit("t.service", (UnitFile.parse("/run/systemd/system/t.service", text),))
    _, exec_start = unit.exec_start()
    return unit, find_vllm_command(exec_start.value).args


def test_unit_text_reads_back_through_ctxmgrs_own_parsers() -> None:
    model_dir = Path("/srv/models/50% tiny $HOME")  # a space, a specifier and a variable must survive
    text = vllm_cpu.unit_text(
        model_dir, 8123, 1536, kv_cache_memory_bytes=1_179_648, extra_args=["--seed", "7"]
    )
    unit, args = parsed_unit(text)
    serve_args = parse_serve_argv(args, unit.environment())
    assert resolve_escapes(serve_args.model) == str(model_dir)  # what systemd hands vLLM
    assert (serve_args.max_model_len, serve_args.kv_cache_memory_bytes) == (1536, 1_179_648)
    assert (serve_args.host, serve_args.port, serve_args.dtype, serve_args.enforce_eager) == (
        "127.0.0.1",
        8123,
        "float32",
        True,
    )
    assert args[-2:] == ["--seed", "7"]
    environment = unit.environment()
    assert environment["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in environment  # --kv-cache-memory-bytes wins


def test_unit_text_with_kv_space_and_a_start_limit() -> None:
    text = vllm_cpu.unit_text(Path("/m"), 8000, "auto", kv_space_gib=2, start_limit_burst=3)
    unit, args = parsed_unit(text)
    assert unit.environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--kv-cache-memory-bytes" not in args
    assert args[args.index("--max-model-len") + 1] == "auto"
    unit_section = {a.key: a.value for a in unit.files[0].assignments if a.section == "Unit"}
    assert unit_section["StartLimitBurst"] == "3"


def non_default_args(journal: str) -> dict[str, object]:
    """The engine arguments vLLM logs at start (`non-default args: {...}`), as a dict."""
    match = re.search(r"non-default args: (\{.*\})", journal)
    assert match, "no 'non-default args' line"
    return ast.literal_eval(match[1])


def estimated_in(journal: str) -> int:
    match = re.search(r"the estimated maximum model length is (\d+)\.", journal)
    assert match, "no KV-too-small error"
    return int(match[1])


@pytest.mark.parametrize("name", ["vllm-kv-too-small", "vllm-kv-one-block-short"])
def test_estimated_max_model_len_matches_vllms_kv_too_small_error(name: str) -> None:
    journal = (vllm_cpu.FIXTURES_DIR / f"{name}.journal").read_text()
    budget = non_default_args(journal)["kv_cache_memory_bytes"]
    assert isinstance(budget, int)
    assert vllm_cpu.estimated_max_model_len(budget) == estimated_in(journal)


def test_estimated_max_model_len_for_fat_kv_with_one_gib() -> None:
    journal = (vllm_cpu.FIXTURES_DIR / "vllm-fat-kv-too-small.journal").read_text()
    estimate = vllm_cpu.estimated_max_model_len(1 << 30, vllm_cpu.FAT_KV_KV_BYTES_PER_TOKEN)
    assert estimate == estimated_in(journal)
    autofit = (vllm_cpu.FIXTURES_DIR / "vllm-fat-kv-autofit.journal").read_text()
    assert f"reduced from {vllm_cpu.FAT_KV_MAX_POSITION_EMBEDDINGS} to {estimate} " in autofit


def test_kv_cache_memory_bytes_for_is_the_boundary_vllm_drew() -> None:
    started = (vllm_cpu.FIXTURES_DIR / "vllm-ok-bytes.journal").read_text()
    refused = (vllm_cpu.FIXTURES_DIR / "vllm-kv-one-block-short.journal").read_text()
    started_args, refused_args = non_default_args(started), non_default_args(refused)
    max_model_len = started_args["max_model_len"]
    assert isinstance(max_model_len, int) and refused_args["max_model_len"] == max_model_len
    exact = vllm_cpu.kv_cache_memory_bytes_for(max_model_len)
    assert started_args["kv_cache_memory_bytes"] == exact
    assert "Application startup complete." in started
    assert refused_args["kv_cache_memory_bytes"] == exact - 1
    assert estimated_in(refused) < max_model_len


def file_digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.mark.vllm
@needs_vllm
def test_tiny_model_is_deterministic_and_counts_one_token_per_word(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    first = vllm_cpu.ensure_tiny_model(tmp_path / "a")
    second = vllm_cpu.ensure_tiny_model(tmp_path / "b")
    assert file_digests(first) == file_digests(second)
    config = json.loads((first / "config.json").read_text())
    kv_bytes_per_token = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    )
    assert kv_bytes_per_token == vllm_cpu.TINY_KV_BYTES_PER_TOKEN
    assert config["max_position_embeddings"] == vllm_cpu.TINY_MAX_POSITION_EMBEDDINGS
    tokenizer = Tokenizer.from_file(str(first / "tokenizer.json"))
    encoding = tokenizer.encode("Hello world, said nobody")
    assert len(encoding.ids) == 1 + 4  # <s> and one token per word, unknown words included
    assert encoding.tokens[:2] == ["<s>", "hello"]
    assert max(tokenizer.get_vocab().values()) < config["vocab_size"]


def wait_for_health(port: int, systemd: Systemd, unit: str, timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        state = systemd.state(unit)
        assert state.active_state != "failed", f"{unit} failed before serving"
        time.sleep(0.5)
    pytest.fail(f"{unit} did not answer /health within {timeout:.0f} s")


@pytest.mark.vllm
@needs_vllm
def test_real_vllm_serves_the_unit_and_stops_clean(
    install_unit: InstallUnit, sandbox_systemd: Systemd
) -> None:
    import requests

    model_dir = vllm_cpu.ensure_tiny_model()
    port, max_model_len = free_port(), 1024
    budget = vllm_cpu.kv_cache_memory_bytes_for(max_model_len)
    unit = install_unit(
        "vllm-cpu-smoke.service",
        vllm_cpu.unit_text(model_dir, port, max_model_len, kv_cache_memory_bytes=budget),
    )
    sandbox_systemd.start(unit, no_block=True)
    wait_for_health(port, sandbox_systemd, unit, vllm_cpu.READY_TIMEOUT_S)

    base = f"http://127.0.0.1:{port}"
    cards = requests.get(f"{base}/v1/models", timeout=10).json()["data"]
    assert [(card["id"], card["max_model_len"]) for card in cards] == [(str(model_dir), max_model_len)]
    words = "hello " * (max_model_len - 2)  # + <s> = max_model_len - 1 prompt tokens: room for one
    fits = requests.post(
        f"{base}/v1/completions", json={"model": str(model_dir), "prompt": words, "max_tokens": 1}, timeout=60
    )
    assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] == max_model_len
    too_long = requests.post(
        f"{base}/v1/completions", json={"model": str(model_dir), "prompt": words + "hello"}, timeout=60
    )
    assert too_long.status_code == 400

    assert sandbox_systemd.unit_processes(unit)
    sandbox_systemd.stop(unit, timeout=vllm_cpu.STOP_TIMEOUT_S)
    assert sandbox_systemd.unit_processes(unit) == []
