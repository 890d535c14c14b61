"""Unit parsing, the vLLM command inside it, edits and systemd quoting, on the real units in units/."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.paths import REPO
from vllm_ctxmgr.core.serve_args import human_readable_int, parse_serve_argv
from vllm_ctxmgr.errors import UnitError
from vllm_ctxmgr.masking import mask as mask_secrets
from vllm_ctxmgr.systemd.quoting import (
    quote_env_assignment,
    quote_exec_word,
    resolve_escapes,
    resolve_specifiers,
    split_words,
)
from vllm_ctxmgr.systemd.unit_edit import edit_unit, unified_diff
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import find_vllm_command

UNITS = REPO / "units"


def load(name: str) -> ServiceUnit:
    dropins = (
        sorted((UNITS / f"{name}.service.d").glob("*.conf")) if (UNITS / f"{name}.service.d").is_dir() else []
    )
    return ServiceUnit.load(name, UNITS / f"{name}.service", dropins)


def serve_args(unit: ServiceUnit):  # type: ignore[no-untyped-def]
    _, assignment = unit.exec_start()
    env = unit.environment()
    return parse_serve_argv(find_vllm_command(assignment.value).argv(env), env)


def test_glm5_unit_from_the_seeds() -> None:
    unit = load("vllm-glm5")
    args = serve_args(unit)
    assert args.model == "/models/GLM-5-GGUF/GLM-5-UD-Q2_K_XL-00001-of-00008.gguf"
    assert args.tensor_parallel_size == 8
    assert args.max_model_len == 8192
    assert args.gpu_memory_utilization == pytest.approx(0.90)
    assert args.served_model_name == "glm-5"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    env = unit.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["NCCL_P2P_DISABLE"] == "0"
    assert env["VLLM_API_KEY"] == "sk-glm5-local-7f3a9c"
    # ExecStartPre and the continuation lines are parsed as single directives
    unit_file = unit.files[0]
    assert len(unit_file.get_all("Service", "ExecStartPre")) == 1
    assert unit_file.get_all("Service", "Restart")[0].value == "always"


def test_python_module_form_with_aliases_and_underscores() -> None:
    args = serve_args(load("vllm-llama70b"))
    assert args.model == "/srv/models/Llama-3.1-70B-Instruct"
    assert args.tensor_parallel_size == 4
    assert args.max_model_len == 32768
    assert args.gpu_memory_utilization == pytest.approx(0.92)
    assert args.kv_cache_dtype == "fp8"
    assert args.port == 8001


def test_docker_form_reads_arguments_after_the_image() -> None:
    unit = load("vllm-qwen3-docker")
    _, assignment = unit.exec_start()
    command = find_vllm_command(assignment.value)
    assert command.form == "docker"
    args = parse_serve_argv(command.args)
    assert (args.model, args.tensor_parallel_size, args.max_model_len) == ("Qwen/Qwen3-32B", 2, 16384)
    assert args.served_model_name == "qwen3 32b"


def test_dropin_exec_start_overrides_the_fragment() -> None:
    unit = load("vllm-gemma3")
    unit_file, _ = unit.exec_start()
    assert unit_file.path.name == "override.conf"
    args = serve_args(unit)
    assert args.max_model_len == 32768
    assert args.max_num_seqs == 16
    assert unit.environment()["HF_HOME"] == "/var/lib/vllm/hf cache"


def test_edit_changes_only_the_owned_values() -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {"--max-model-len": "200000", "--gpu-memory-utilization": "0.93"})
    old_lines, new_lines = edit.old_text.splitlines(), edit.new_text.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert changed == [
        ("    --max-model-len 8192 \\", "    --max-model-len 200000 \\"),
        ("    --gpu-memory-utilization 0.90 \\", "    --gpu-memory-utilization 0.93 \\"),
    ]
    reparsed = ServiceUnit((unit.name), (UnitFile.parse(edit.path, edit.new_text),))
    args = serve_args(reparsed)
    assert (args.max_model_len, args.gpu_memory_utilization) == (200000, 0.93)


def test_edit_is_idempotent_when_nothing_changes() -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {"--max-model-len": "8192", "--gpu-memory-utilization": "0.90"})
    assert not edit.changed


def test_missing_flag_is_appended_on_a_continuation_line_in_the_units_style() -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {"--kv-cache-dtype": "fp8"})
    assert "    --trust-remote-code \\\n    --kv-cache-dtype fp8\n" in edit.new_text
    assert (
        serve_args(ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),))).kv_cache_dtype
        == "fp8"
    )


def test_inline_flag_form_keeps_its_form_and_removal_works() -> None:
    unit = load("vllm-llama70b")
    edit = edit_unit(unit, {"--max-model-len": "65536", "--gpu-memory-utilization": None})
    assert "--max_model_len=65536" in edit.new_text
    assert "gpu-memory-utilization" not in edit.new_text
    assert "--kv-cache-dtype fp8 --port 8001" in edit.new_text


def test_environment_added_next_to_exec_start_and_in_container_env() -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {"--max-model-len": "300000"}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert "\nEnvironment=VLLM_ALLOW_LONG_MAX_MODEL_LEN=1\nExecStart=" in edit.new_text
    docker = load("vllm-qwen3-docker")
    edit = edit_unit(docker, {}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert "-e VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 \\" in edit.new_text
    assert "Environment=VLLM_ALLOW_LONG" not in edit.new_text


def test_secrets_are_masked_in_diffs() -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {"--max-model-len": "16384"})
    diff = unified_diff(edit.old_text, edit.old_text.replace("8192", "16384"), "x", ["sk-glm5-local-7f3a9c"])
    assert "sk-glm5" not in mask_secrets(edit.new_text, ["sk-glm5-local-7f3a9c"])
    assert "+    --max-model-len 16384" in diff


@pytest.mark.parametrize(
    "text, message",
    [
        ("[Service]\nExecStart=/usr/bin/python3 -m http.server\n", "does not run vLLM"),
        ("[Service]\nType=simple\n", "no ExecStart="),
        ('[Service]\nExecStart=/bin/vllm serve "unbalanced\n', "unbalanced quote"),
        ("[Service]\nthis is not a directive\n", "not KEY=VALUE"),
    ],
)
def test_bad_units_give_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.service"
    path.write_text(text)
    with pytest.raises(UnitError, match=message) as info:
        unit = ServiceUnit.load("bad", path)
        _, assignment = unit.exec_start()
        find_vllm_command(assignment.value)
    assert "\n" not in str(info.value)


def test_split_words_follows_systemd_quoting() -> None:
    words = [w.value for w in split_words(r"""/bin/x "a b" 'c d' "q\"uote" x\x41 "%%" $$HOME""")]
    assert words == ["/bin/x", "a b", "c d", 'q"uote', "xA", "%%", "$$HOME"]
    assert resolve_escapes("%%d $$HOME") == "%d $HOME"


def test_human_readable_ints_match_vllm() -> None:
    assert human_readable_int("1k") == 1000
    assert human_readable_int("1K") == 1024
    assert human_readable_int("25.6k") == 25600
    assert human_readable_int("auto", allow_auto=True) == -1


# Any text an operator could hand us, control characters included (NUL cannot be in an argv).
values = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\0"), max_size=40
)


def test_nul_is_refused_not_written() -> None:
    with pytest.raises(UnitError, match="NUL"):
        quote_exec_word("a\0b")
    with pytest.raises(UnitError, match="NUL"):
        quote_env_assignment("NAME", "a\0b")


@settings(max_examples=300, deadline=None)
@given(values)
def test_quoted_exec_word_parses_back_unchanged(value: str) -> None:
    quoted = quote_exec_word(value)
    assert "\n" not in quoted
    words = split_words(quoted)
    assert [resolve_escapes(w.value) for w in words] == [value]


@settings(max_examples=300, deadline=None)
@given(values)
def test_rendered_values_never_add_a_directive(value: str) -> None:
    unit = load("vllm-glm5")
    edit = edit_unit(
        unit, {"--served-model-name": value, "--max-model-len": "100000"}, {"CTXMGR_TEST": value}
    )
    new = UnitFile.parse(edit.path, edit.new_text)
    old = UnitFile.parse(edit.path, edit.old_text)
    assert len(new.assignments) == len(old.assignments) + 1
    reparsed = ServiceUnit(unit.name, (new,))
    args = serve_args(reparsed)
    if not value.startswith("-"):  # argparse itself cannot take a value that looks like a flag
        assert args.served_model_name is not None
        assert args.served_model_name == value
    assert args.max_model_len == 100000
    assert reparsed.environment()["CTXMGR_TEST"] == value


@settings(max_examples=200, deadline=None)
@given(values)
def test_environment_items_round_trip(value: str) -> None:
    item = quote_env_assignment("NAME", value)
    assert "\n" not in item
    [word] = split_words(item)
    assert resolve_specifiers(word.value) == f"NAME={value}"  # `$` is not special in Environment=


@pytest.mark.parametrize("flag", ["--served-model-name", "--tokenizer-mode"])  # in the unit / added
@pytest.mark.parametrize("value", ["--", "-x", "--enforce-eager"])
def test_a_value_argparse_would_take_for_a_flag_is_written_joined(flag: str, value: str) -> None:
    """Found by the property above: `--served-model-name --` ended the options, and vLLM lost every
    flag after it. `--flag=value` is the one form argparse gives such a value to the flag."""
    unit = load("vllm-glm5")
    edit = edit_unit(unit, {flag: value, "--max-model-len": "100000"})
    assert f"{flag}={value}" in edit.new_text
    args = serve_args(ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),)))
    assert args.max_model_len == 100000
    assert args.flags[flag] == value
