"""`ctxmgr facts` and `ctxmgr gpus`: what vLLM will see in a model, and the GPUs on this host."""

from __future__ import annotations

import click

from vllm_ctxmgr import report
from vllm_ctxmgr.cli.examples import EXAMPLES
from vllm_ctxmgr.cli.output import echo, emit_json, handle_errors
from vllm_ctxmgr.cli.params import json_option, vllm_version_option
from vllm_ctxmgr.core.vllm_versions import parse_vllm_version
from vllm_ctxmgr.model_files.load import load_model_facts
from vllm_ctxmgr.nvml import read_nvml


@click.command(epilog=EXAMPLES["facts"])
@click.argument("model")
@json_option
@vllm_version_option.but(help="Derive the maximum length by this vLLM's rules.")
@handle_errors
def facts(model: str, as_json: bool, vllm_version: str | None) -> None:
    """What vLLM will see in MODEL: a HF model dir, a cached repo id, or a GGUF file."""

    model_facts = load_model_facts(model)

    version = parse_vllm_version(vllm_version) or report.NEWEST_VLLM
    if as_json:
        emit_json(
            {"command": "facts", "result": "ok", "changed": False, **report.facts_json(model_facts, version)}
        )
    else:
        echo(report.facts_text(model_facts, version))


@click.command(epilog=EXAMPLES["gpus"])
@json_option.but(help="Print one JSON object (input for --gpus-from).")
@handle_errors
def gpus(as_json: bool) -> None:
    """The GPUs on this host: total, free, used, and who uses them (NVML)."""

    state = read_nvml()
    if as_json:
        emit_json({"command": "gpus", "result": "ok", "changed": False, **state.to_json()})
    else:
        echo(report.gpus_text(state))
