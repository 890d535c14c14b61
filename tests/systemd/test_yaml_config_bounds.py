"""Issue 16 item 4: vLLM's `--config` YAML is read through a bounded door. A 400-byte "billion laughs"
hung plan/set-context/verify/status (its aliases expanded by config_file_flags); deep flow nesting,
circular aliases and 5,000-digit ints raised unexpected exceptions; values the CLI refuses
(`block-size: 0`, negative bytes, a list for a scalar, a key that is no flag) were taken."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.deadline import deadline
from tests.support.paths import REPO
from vllm_ctxmgr.errors import CtxmgrError
from vllm_ctxmgr.systemd.service import view_from_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile

MODEL = "/models/qwen3-32b"


def laughs(levels: int = 9) -> str:
    """The classic: nine levels of nine aliases each, 9**9 strings once expanded, about 400 bytes."""
    lines = ['a0: &a0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return f"model: {MODEL}\n" + "\n".join(lines) + "\n"


@pytest.fixture
def root() -> Iterator[Path]:
    path = REPO / ".cache" / "yaml-bounds" / uuid.uuid4().hex[:8]
    (path / "etc" / "vllm").mkdir(parents=True)
    yield path


@pytest.fixture(autouse=True)
def bounded() -> Iterator[None]:
    """A hang fails the test instead of stalling the run."""
    with deadline(20, "reading the YAML"):
        yield


def view_of(root: Path, text: str, tail: str = "") -> object:
    (root / "etc" / "vllm" / "c.yaml").write_text(text)
    exec_start = f"/opt/vllm/bin/vllm serve --config /etc/vllm/c.yaml{tail}"
    unit = ServiceUnit(
        "t.service",
        (UnitFile.parse("/etc/systemd/system/t.service", f"[Service]\nExecStart={exec_start}\n"),),
    )
    return view_from_unit(unit, root)


def refused(root: Path, text: str, match: str) -> str:
    with pytest.raises(CtxmgrError, match=match) as info:
        view_of(root, text)
    assert "\n" not in info.value.message
    return info.value.message


def test_a_billion_laughs_is_refused_at_once(root: Path) -> None:
    text = laughs()
    assert len(text) < 500
    started = time.monotonic()
    refused(root, text, r"c\.yaml: its aliases expand to more than")
    assert time.monotonic() - started < 2.0


def test_deep_nesting_is_refused(root: Path) -> None:
    refused(root, f"model: {MODEL}\nx: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than")
    refused(root, f"model: {MODEL}\nx: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n", "nested deeper than")


def test_a_circular_alias_is_refused(root: Path) -> None:
    refused(root, f"model: {MODEL}\nx: &loop [1, *loop]\n", "refers to itself")
    refused(root, f"model: {MODEL}\nx: &m {{a: *m}}\n", "refers to itself")


def test_an_integer_of_5000_digits_is_refused(root: Path) -> None:
    message = refused(root, f"model: {MODEL}\nmax-num-seqs: {'7' * 5000}\n", "an integer of 5000 digits")
    assert "7777" not in message  # no value is echoed


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("block-size: 0", "block-size: vLLM's block sizes are 1, 8 or a multiple of 16"),
        ("block_size: 7", "block_size: vLLM's block sizes are 1, 8 or a multiple of 16"),
        ("kv-cache-memory-bytes: -5", "kv-cache-memory-bytes: must be a positive number of bytes"),
        ("max-model-len: [1, 2]", "max-model-len: a list where vLLM takes one value"),
        ("gpu-memory-utilization: {a: 1}", "gpu-memory-utilization: a mapping where vLLM takes one value"),
        ("gpu-memory-utilization: .nan", "gpu-memory-utilization: must be a number in \\(0, 1\\]"),
        ("tensor-parallel-size: 0", "tensor-parallel-size: must be a whole number from 1 to 1024"),
        ("max-num-seqs: -1", "max-num-seqs: must be a whole number from 1 to"),
        ("max-model-len: 0", "max-model-len: must be a positive context length"),
        ("'rm -rf /': true", "is not a vLLM flag name"),
        ("'--model': x", "is not a vLLM flag name"),
        ("1: x", "is not a vLLM flag name"),
    ],
)
def test_values_the_cli_refuses_are_refused_in_the_yaml(root: Path, line: str, match: str) -> None:
    refused(root, f"model: {MODEL}\n{line}\n", match)


def test_a_sound_yaml_with_aliases_still_reads(root: Path) -> None:
    text = f"model: {MODEL}\nmax-model-len: 32k\nblock-size: 16\nx: &a [1, 2]\ny: *a\n"
    text += "served-model-name: [q, r]\n"
    view = view_of(root, text)
    assert view.args.max_model_len == 32000 and view.args.block_size == 16  # type: ignore[attr-defined]
