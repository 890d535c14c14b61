"""The stand-in as a real process: its lines read as vLLM's, its HTTP answers match the captured ones."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.paths import DATA
from tests.support.standin import StandinProcess, free_port, launch
from vllm_ctxmgr.vllm_log.patterns import classify_all
from vllm_ctxmgr.vllm_log.watcher import StartWatcher, headless_verdict, observe_start

HTTP = DATA / "vllm-logs" / "http"
LOGS = HTTP.parent
FAST = {"CTXMGR_STANDIN_TIME_SCALE": "0", "CTXMGR_STANDIN_SHARDS": "8", "CTXMGR_STANDIN_TOKEN_DELAY_S": "0"}
TINY = "/srv/vllm/models/tiny-llama"
GLM = [
    "zai-org/GLM-5-FP8",
    "--tensor-parallel-size",
    "8",
    "--served-model-name",
    "glm-5",
    "--trust-remote-code",
]
KEY = "sk-standin-test-key"


def run_to_exit(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    with launch(args, env={**FAST, **(env or {})}) as standin:
        status = standin.wait_exit(60)
        return status, standin.lines


def verdict_of(lines: list[str]):  # type: ignore[no-untyped-def]
    watcher = StartWatcher()
    for line in lines:
        watcher.feed(line)
    return watcher.finish()


def captured(name: str) -> Any:
    return json.loads((HTTP / f"{name}.body").read_text(encoding="utf-8"))


def shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (lists by their first item): what 'the same shape' means."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def loose_shape(value: Any) -> Any:
    """Like shape, but a leaf is only 'present' (the real values' types vary: null vs a number)."""
    if isinstance(value, dict):
        return {key: loose_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [loose_shape(value[0])] if value else []
    return "leaf"


@pytest.fixture(scope="module")
def tiny() -> Iterator[StandinProcess]:
    """The captured server's settings: tiny model, max_model_len 1024 of 2048 positions."""
    with launch(
        [TINY, "--max-model-len", "1024"], env={**FAST, "CTXMGR_STANDIN_MAX_POSITION": "2048"}
    ) as standin:
        assert standin.wait_ready(30), standin.lines[-5:]
        yield standin


@pytest.fixture(scope="module")
def glm() -> Iterator[StandinProcess]:
    with launch([*GLM, "--max-model-len", "200000", "--api-key", KEY], env=FAST) as standin:
        assert standin.wait_ready(30), standin.lines[-5:]
        yield standin


# ---------------------------------------------------------------- lines


def test_ok_start_reads_as_a_ready_vllm(glm: StandinProcess) -> None:
    verdict = verdict_of(glm.lines)
    assert verdict.ok and "Starting vLLM server on http://127.0.0.1:" in verdict.decisive_line
    observation = observe_start(glm.lines)
    assert observation.vllm_version == "0.33.0"
    assert observation.platform == "GPU"
    assert observation.max_model_len == 200_000
    assert observation.model_loading_gib == 88.47
    assert observation.cuda_graph_gib == 1.37
    assert observation.gpu_memory_utilization == 0.92  # from the suggestion line: not a flag here
    assert observation.available_kv_gib is not None and observation.available_kv_gib > 18.65
    assert observation.kv_cache_tokens is not None and observation.max_concurrency is not None
    assert abs(observation.kv_cache_tokens / 200_000 - observation.max_concurrency) < 0.01
    names = [event.name for event in classify_all(glm.lines)]
    for expected in (
        "version_banner",
        "non_default_args",
        "using_max_model_len",
        "engine_version",
        "starting_to_load_model",
        "loading_weights_progress",
        "loading_weights_took",
        "model_loading_took",
        "torch_compile_took",
        "profiling_cuda_graph_memory",
        "estimated_cuda_graph_memory",
        "available_kv_cache_memory",
        "cuda_graph_utilization_notice",
        "kv_cache_capacity",
        "capturing_cuda_graphs",
        "graph_capturing_finished",
        "cuda_graph_pool_memory",
        "kv_cache_memory_suggestion",
        "init_engine_took",
        "supported_tasks",
        "server_starting",
        "application_startup_complete",
    ):
        assert expected in names, expected
    assert names.count("model_loading_took") == 8  # one per tensor-parallel rank
    assert not any(KEY in line for line in glm.lines)  # the key is redacted in non-default args


def test_with_a_cache_root_a_config_compiled_before_loads_and_a_new_context_compiles_cold(
    tmp_path: Path,
) -> None:
    """VLLM_CACHE_ROOT as vLLM keeps it: the context is in the compile hash, so only the same
    max_model_len finds its graphs (vLLM's own hit and miss lines)."""
    env = {"VLLM_CACHE_ROOT": str(tmp_path)}

    def compile_lines(max_model_len: str) -> list[str]:
        with launch([TINY, "--max-model-len", max_model_len], env={**FAST, **env}) as standin:
            assert standin.wait_ready(30), standin.lines[-5:]
            events = classify_all(standin.lines)
        return [e.name for e in events if e.name.startswith("compile_cache")]

    assert compile_lines("1024") == ["compile_cache_miss"]
    assert compile_lines("1024") == ["compile_cache_hit"]
    assert compile_lines("2048") == ["compile_cache_miss"]
    assert len(list((tmp_path / "torch_compile_cache").iterdir())) == 2
    # without one (every other test), no cache and no cache line: each start compiles alike
    assert not any(e.name.startswith("compile_cache") for e in classify_all(run_to_ready([TINY])))


def run_to_ready(args: list[str]) -> list[str]:
    with launch(args, env=FAST) as standin:
        assert standin.wait_ready(30), standin.lines[-5:]
        return list(standin.lines)


@pytest.mark.parametrize(("release", "banner"), [("0.11.0", "vLLM API server version 0.11.0"),
                                                   ("0.25.1", "█  version 0.25.1")])  # fmt: skip
def test_another_release_says_its_version_in_the_banner_and_on_version(release: str, banner: str) -> None:
    """An upgraded (or older) vLLM as verify meets it: the banner, the engine line and GET /version."""
    env = {**FAST, "CTXMGR_STANDIN_VLLM_VERSION": release}
    with launch([TINY, "--max-model-len", "1024"], env=env) as standin:
        assert standin.wait_ready(30), standin.lines[-5:]
        assert any(line.endswith(banner) for line in standin.lines)
        assert observe_start(standin.lines).vllm_version == release
        assert requests.get(f"{standin.url}/version", timeout=10).json() == {"version": release}


def test_metrics_agree_with_the_log(glm: StandinProcess) -> None:
    text = requests.get(f"{glm.url}/metrics", timeout=10).text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', text))
    observation = observe_start(glm.lines)
    assert int(labels["kv_cache_size_tokens"]) == observation.kv_cache_tokens
    assert round(float(labels["kv_cache_max_concurrency"]), 2) == observation.max_concurrency
    blocks = int(labels["num_gpu_blocks"])
    page = 64 * 100_152  # block_size x KV bytes per token (GLM-5, TP 8)
    # the blocks fill the budget up to less than one block (the log rounds GiB to two decimals)
    assert observation.available_kv_gib is not None
    assert 0 <= observation.available_kv_gib - blocks * page / 2**30 <= page / 2**30 + 0.005


def test_kv_capacity_scenario_fails_with_vllms_estimate() -> None:
    status, lines = run_to_exit(
        [*GLM, "--max-model-len", "200000"], env={"CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "131072"}
    )
    assert status == 1
    verdict = verdict_of(lines)
    assert verdict.failure == "kv_cache_too_small"
    assert verdict.estimated_max_model_len == 131_072
    assert verdict.decisive_line.startswith("(EngineCore pid=")
    assert lines[-1] == (
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
        "{'EngineCore': 1}"
    )
    # the same arithmetic as vLLM: 200000 tokens x 100152 B = 18.65 GiB needed, the null block held back
    assert "(18.65 GiB KV cache is needed" in verdict.decisive_line
    assert "available KV cache memory (12.23 GiB)" in verdict.decisive_line


def test_auto_fit_serves_the_fitted_length() -> None:
    with launch(
        [*GLM, "--max-model-len", "auto"], env={**FAST, "CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "131072"}
    ) as standin:
        assert standin.wait_ready(30)
        assert any("Auto-fit max_model_len: reduced from 202752 to 131072" in line for line in standin.lines)
        assert observe_start(standin.lines).max_model_len == 131_072
        card = requests.get(f"{standin.url}/v1/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 131_072


def test_max_position_scenario_is_vllms_validation_error() -> None:
    status, lines = run_to_exit(
        [*GLM, "--max-model-len", "200000"], env={"CTXMGR_STANDIN_MAX_POSITION": "131072"}
    )
    assert status == 1
    verdict = verdict_of(lines)
    assert verdict.failure == "max_model_len_exceeds_derived"
    real = next(
        line for line in (LOGS / "fail_a_mml_gt_mpe.log").read_text().split("\n") if "Value error" in line
    )
    ours = verdict.decisive_line
    # the same sentence as the real 0.32 text, with this start's numbers
    assert (
        ours.split("[type=")[0]
        == real.replace("4096", "200000").replace("2048.0", "131072.0").split("[type=")[0]
    )


def test_allow_long_max_model_len_turns_the_error_into_vllms_warning() -> None:
    with launch(
        [*GLM, "--max-model-len", "200000"],
        env={**FAST, "CTXMGR_STANDIN_MAX_POSITION": "131072", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    ) as standin:
        assert standin.wait_ready(30)
        names = [event.name for event in classify_all(standin.lines)]
        assert "max_model_len_override_warning" in names and verdict_of(standin.lines).ok


@pytest.mark.parametrize(
    ("fail", "failure", "reason"),
    [
        ("free_memory", "free_memory_below_utilization", "less than the 128.63 GiB"),
        ("cuda_oom", "model_load_oom", "out of memory while loading the weights"),
    ],
)
def test_failure_scenarios(fail: str, failure: str, reason: str) -> None:
    status, lines = run_to_exit([*GLM, "--max-model-len", "200000"], env={"CTXMGR_STANDIN_FAIL": fail})
    assert status == 1
    verdict = verdict_of(lines)
    assert verdict.failure == failure and reason in verdict.reason
    assert lines[-1].startswith("RuntimeError: Engine core initialization failed.")


def test_cuda_oom_scenario_carries_torchs_own_error() -> None:
    _status, lines = run_to_exit([*GLM, "--max-model-len", "200000"], env={"CTXMGR_STANDIN_FAIL": "cuda_oom"})
    names = [event.name for event in classify_all(lines)]
    assert "cuda_oom" in names and names.index("model_load_oom") < names.index("cuda_oom")


def test_hang_scenario_times_out_in_the_watcher() -> None:
    with launch([*GLM, "--max-model-len", "200000"], env={**FAST, "CTXMGR_STANDIN_FAIL": "hang"}) as standin:
        assert standin.wait_for(lambda lines: any("3/8 [" in line for line in lines), 30)
        watcher = StartWatcher(timeout_s=0.3)
        for line in standin.lines:
            watcher.feed(line)
        assert watcher.verdict is None
        assert standin.wait_for(lambda _lines: watcher.poll() is not None, 5)
        assert watcher.verdict is not None and watcher.verdict.failure == "start_timeout"
        assert "Loading safetensors checkpoint shards" in watcher.verdict.reason
        assert standin.process.poll() is None  # still hanging until stopped
    assert standin.process.returncode == -15  # SIGTERM before serving ends it by the signal


def test_crash_scenario_dies_by_sigkill_mid_load() -> None:
    status, lines = run_to_exit([*GLM, "--max-model-len", "200000"], env={"CTXMGR_STANDIN_FAIL": "crash"})
    assert status == -9
    assert "Loading safetensors checkpoint shards" in lines[-1]
    watcher = StartWatcher()
    for line in lines:
        watcher.feed(line)
    assert watcher.verdict is None  # nothing in the log decides: systemd's exit line will


def test_argparse_error_is_vllms_text_and_exit_status_2() -> None:
    status, lines = run_to_exit([TINY, "--max-model-len", "1x"])
    assert status == 2
    real = (LOGS / "fail_i_bad_mml_string.log").read_text().rstrip("\n").split("\n")
    assert lines == real[1:]  # the real log's first line is a Triton notice
    assert verdict_of(lines).failure == "argparse_error"


def test_gpu_memory_utilization_out_of_range_is_the_real_text() -> None:
    status, lines = run_to_exit([TINY, "--max-model-len", "1024", "--gpu-memory-utilization", "1.5"])
    assert status == 1
    real = (LOGS / "fail_c_gmu_1_5.log").read_text().rstrip("\n").split("\n")
    assert lines[-4:] == real[-4:]
    assert verdict_of(lines).failure == "gpu_memory_utilization_out_of_range"


# ---------------------------------------------------------------- HTTP, against the captured bodies


def test_health_and_version(tiny: StandinProcess) -> None:
    health = requests.get(f"{tiny.url}/health", timeout=10)
    assert (health.status_code, health.content, health.headers["server"]) == (200, b"", "uvicorn")
    version = requests.get(f"{tiny.url}/version", timeout=10).json()
    assert shape(version) == shape(captured("version")) and version["version"] == "0.33.0"


def test_models_body_has_the_real_shape(tiny: StandinProcess) -> None:
    body = requests.get(f"{tiny.url}/v1/models", timeout=10).json()
    assert shape(body) == shape(captured("models"))
    assert body["data"][0]["id"] == TINY and body["data"][0]["max_model_len"] == 1024


@pytest.mark.parametrize(
    ("name", "path", "request_body"),
    [
        ("comp_1025", "/v1/completions", {"model": TINY, "prompt": "Hello", "max_tokens": 1025}),
        ("comp_big", "/v1/completions", {"model": TINY, "prompt": "Hello", "max_tokens": 32000}),
        (
            "chat_big",
            "/v1/chat/completions",
            {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32000},
        ),
        (
            "chat_mct_big",
            "/v1/chat/completions",
            {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 32000},
        ),
        ("comp_longprompt", "/v1/completions", {"model": TINY, "prompt": "word " * 3000, "max_tokens": 4}),
        (
            "chat_longprompt",
            "/v1/chat/completions",
            {"model": TINY, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4},
        ),
        ("comp_ids_1500", "/v1/completions", {"model": TINY, "prompt": list(range(1500)), "max_tokens": 4}),
    ],
)
def test_rejections_are_byte_for_byte_vllms(
    tiny: StandinProcess, name: str, path: str, request_body: dict[str, Any]
) -> None:
    response = requests.post(f"{tiny.url}{path}", json=request_body, timeout=10)
    assert response.status_code == int((HTTP / f"{name}.status").read_text())
    assert response.json() == captured(name)


def test_unknown_model_is_vllms_404(tiny: StandinProcess) -> None:
    response = requests.post(f"{tiny.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=10)
    body, real = response.json(), captured("comp_badmodel")
    assert response.status_code == 404 and shape(body) == shape(real)
    assert body["error"]["message"] == f"The model `nope` does not exist. Valid aliases: {TINY}."
    assert real["error"]["message"].startswith("The model `nope` does not exist. Valid aliases: ")


@pytest.mark.parametrize(
    ("name", "path", "request_body"),
    [
        ("comp_ok", "/v1/completions", {"model": TINY, "prompt": "The capital of", "max_tokens": 16}),
        ("chat_ok", "/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_completion_bodies_have_the_real_shape(
    tiny: StandinProcess, name: str, path: str, request_body: dict[str, Any]
) -> None:
    response = requests.post(f"{tiny.url}{path}", json=request_body, timeout=10)
    assert response.status_code == 200
    assert loose_shape(response.json()) == loose_shape(captured(name))


def test_max_tokens_is_clamped_to_the_context_like_vllm(tiny: StandinProcess) -> None:
    """comp_1024_ignore_eos: max_tokens == max_model_len is admitted and clamped to what the prompt leaves."""
    body = {"model": TINY, "prompt": "The capital of", "max_tokens": 1024, "ignore_eos": True}
    usage = requests.post(f"{tiny.url}/v1/completions", json=body, timeout=30).json()["usage"]
    real = captured("comp_1024_ignore_eos")["usage"]
    assert usage["total_tokens"] == real["total_tokens"] == 1024
    assert usage["completion_tokens"] == 1024 - usage["prompt_tokens"]


def test_tokenize_is_vllms_shape(tiny: StandinProcess) -> None:
    body = requests.post(f"{tiny.url}/tokenize", json={"prompt": "one two three"}, timeout=10).json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == 3 and body["max_model_len"] == 1024


def test_metrics_have_the_real_label_set(tiny: StandinProcess) -> None:
    ours = requests.get(f"{tiny.url}/metrics", timeout=10).text
    real = (HTTP / "metrics_cache_config.txt").read_text()
    label_names = lambda text: re.findall(r'(\w+)="', text)  # noqa: E731
    assert label_names(ours) == label_names(real)
    assert ours.splitlines()[:2] == real.splitlines()[:2]
    assert re.search(r'num_gpu_blocks="\d+"', ours) and ours.rstrip().endswith("} 1.0")


def test_api_key_guards_v1_only(glm: StandinProcess) -> None:
    wrong = requests.get(f"{glm.url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert (wrong.status_code, wrong.json()) == (401, {"error": "Unauthorized"})
    assert requests.get(f"{glm.url}/v1/models", timeout=10).status_code == 401
    right = requests.get(f"{glm.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "glm-5"
    assert requests.get(f"{glm.url}/health", timeout=10).status_code == 200
    assert requests.post(f"{glm.url}/tokenize", json={"prompt": "a b"}, timeout=10).status_code == 200


def test_streaming_completion_is_server_sent_events(glm: StandinProcess) -> None:
    body = {"model": "glm-5", "prompt": "Say hi", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with requests.post(
        f"{glm.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        stream=True,
        timeout=10,
    ) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


def test_access_log_lines_are_uvicorns(glm: StandinProcess) -> None:
    requests.get(f"{glm.url}/health", timeout=10)
    assert glm.wait_for(lambda lines: any('"GET /health HTTP/1.1" 200 OK' in line for line in lines), 5)
    line = next(line for line in glm.lines if '"GET /health HTTP/1.1" 200 OK' in line)
    assert re.fullmatch(r'INFO:     127\.0\.0\.1:\d+ - "GET /health HTTP/1\.1" 200 OK', line)


# ---------------------------------------------------------------- several nodes (--nnodes, --headless)


def multinode_args(rank: int, master_port: int, timeout_s: int = 20) -> list[str]:
    """Node `rank` of a TP 2 deployment over 2 nodes, as the real recipe runs it (rank 1 headless)."""
    args = [
        *GLM[:1], "--tensor-parallel-size", "2", "--max-model-len", "100000", "--nnodes", "2",
        "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
        "--distributed-timeout-seconds", str(timeout_s),
    ]  # fmt: skip
    return [*args, "--headless"] if rank else args


def headless_decided(lines: list[str]) -> bool:
    return headless_verdict(lines) is not None


def test_multinode_head_waits_for_its_headless_node_and_both_start() -> None:
    master = free_port()
    with launch(multinode_args(1, master), env=FAST) as node1:
        # node 0 is not there yet: node 1 waits (silently, as torch's store client retries)
        assert not node1.wait_for(lambda lines: "is assigned as" in "\n".join(lines), 1.0)
        with launch(multinode_args(0, master), env=FAST) as node0:
            assert node0.wait_ready(30), node0.lines[-5:]
            assert (
                requests.get(f"{node0.url}/v1/models", timeout=5).json()["data"][0]["max_model_len"] == 100000
            )
            assert node1.wait_for(headless_decided, 10), node1.lines[-5:]
        verdict = headless_verdict(node1.lines)
        assert verdict is not None and verdict.ok, verdict
        assert "Graph capturing finished" in verdict.decisive_line
        launched = [e.data for e in classify_all(node1.lines) if e.name == "headless_launch"]
        assert launched == [{"version": "0.33.0", "head_address": f"127.0.0.1:{master}"}]
        assert not any("Starting vLLM server" in line for line in node1.lines)
        # node 0 stopped: the headless node keeps running and prints nothing (the recipe's behaviour 3)
        printed = len(node1.lines)
        assert not node1.wait_for(lambda lines: node1.process.poll() is not None, 1.0)
        assert len(node1.lines) == printed
        # ... and a new node 0 waits for a node 1 that never comes
        status, lines = run_to_exit(multinode_args(0, master, timeout_s=1))
        assert status == 1 and verdict_of(lines).failure == "peer_missing"
        assert node1.stop() == 0


def test_multinode_head_alone_fails_with_torchs_store_timeout() -> None:
    status, lines = run_to_exit(multinode_args(0, free_port(), timeout_s=1))
    verdict = verdict_of(lines)
    assert status == 1 and not verdict.ok and verdict.failure == "peer_missing"
    assert "waited 1 s for the other nodes: 1 of 2 ranks joined" in verdict.reason
    assert not any("Starting vLLM server" in line for line in lines)


def test_headless_node_alone_fails_when_node_0_is_not_there() -> None:
    master = free_port()
    status, lines = run_to_exit(multinode_args(1, master, timeout_s=1))
    verdict = headless_verdict(lines, final=True)
    assert status == 1 and verdict is not None and not verdict.ok
    assert verdict.failure == "head_unreachable" and f"127.0.0.1:{master}" in verdict.reason


def test_kv_too_small_on_the_headless_node_fails_node_0_with_its_budget() -> None:
    """vLLM sizes the KV cache by the smallest rank's budget: node 0 fails with node 1's estimate, and
    node 1, like the real one (vllm-logs-multinode/kv-node1-node1.log), stays up and prints nothing."""
    master = free_port()
    small = {**FAST, "CTXMGR_STANDIN_KV_CAPACITY_TOKENS": "4096"}
    with launch(multinode_args(1, master), env=small) as node1:
        status, lines = run_to_exit(multinode_args(0, master))
        verdict = verdict_of(lines)
        assert status == 1 and verdict.failure == "kv_cache_too_small"
        assert verdict.estimated_max_model_len == 4096
        assert headless_verdict(node1.lines) is None and node1.process.poll() is None
        assert node1.stop() == 0


def test_headless_node_logs_torchs_retry_before_it_fails() -> None:
    """As the real one (vllm-logs-multinode/no-node0-node1.log): torch's own timeout line and a retry
    first, which do not decide, then the exception."""
    status, lines = run_to_exit(multinode_args(1, free_port(), timeout_s=1))
    retry = next(i for i, line in enumerate(lines) if "- retrying (try=0, timeout=1000ms" in line)
    assert headless_verdict(lines[: retry + 1]) is None
    verdict = headless_verdict(lines, final=True)
    assert status == 1 and verdict is not None and verdict.failure == "head_unreachable"
