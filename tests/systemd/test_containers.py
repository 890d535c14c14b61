"""docker/podman units: vLLM's arguments, the model and the HF cache as the host sees them through the
container's volumes, the image's vLLM version, and plans from what vLLM really receives (units/)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.units import unit_with
from vllm_ctxmgr.change.planning import PlanRequest, plan_for
from vllm_ctxmgr.errors import CtxmgrError, UnitError
from vllm_ctxmgr.systemd.service import container_vllm_version, view_from_unit
from vllm_ctxmgr.systemd.unit_edit import edit_unit
from vllm_ctxmgr.systemd.unit_file import ServiceUnit, UnitFile
from vllm_ctxmgr.systemd.vllm_command import container_volumes, find_vllm_command, host_path

UNITS = REPO / "units"
MODELS = REPO / "examples" / "models"
GiB = 1 << 30


def load(name: str) -> ServiceUnit:
    return ServiceUnit.load_with_dropins(UNITS / name)


def on_disk(root: Path, host: str) -> str:
    """Where a host path of a unit lies in this test's private filesystem."""
    return str(root / host.lstrip("/"))


def fake_hf_cache(hf_home: Path, repo_id: str, model: str) -> None:
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    shutil.copy(MODELS / model / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)


def test_docker_volumes_map_the_model_back_to_the_host_and_the_plan_uses_vllms_arguments(
    tmp_path: Path,
) -> None:
    view = view_from_unit(load("vllm-llama70b-docker-volumes.service"))
    args = view.args
    assert view.command.form == "docker"
    # /models/llama-3.1-70b: the longer target (the NVMe volume) wins over /models
    assert args.model == "/mnt/nvme0/llama-3.1-70b"
    assert (args.tensor_parallel_size, args.max_model_len, args.gpu_memory_utilization) == (4, 32768, 0.9)
    assert args.vllm_version == "0.11.0"
    assert args.env["HF_HOME"] == "/srv/hf"  # -v /srv/hf:/root/.cache/huggingface
    assert view.base_url == "http://127.0.0.1:8003"
    shutil.copytree(MODELS / "llama-3.1-70b", on_disk(tmp_path, args.model))
    plan = plan_for(
        replace(args, model=on_disk(tmp_path, args.model)),
        PlanRequest(32768, gpu_memory=80 * GiB, gpu_count=4, weights_bytes=141107412992),
    )
    # 80 layers x 8 KV heads x 128 x (K+V) x 2 bytes, over 4 ranks: vLLM's -tp 4 is planned
    assert plan.kv_bytes_per_token_per_gpu == 80 * 8 * 128 * 2 * 2 // 4
    assert plan.max_model_len == 32768 and plan.vllm_version == (0, 11, 0)


def test_hf_home_inside_the_container_is_the_host_directory_its_volume_mounts(tmp_path: Path) -> None:
    view = view_from_unit(load("vllm-qwen3-docker-hfhome.service"))
    args = view.args
    assert args.model == "Qwen/Qwen3-32B"  # a model id is not a path: it stays, looked up in the cache
    assert args.env["HF_HOME"] == "/srv/hf"  # -e HF_HOME=/data/hf, -v /srv/hf:/data/hf
    assert (args.tensor_parallel_size, args.max_model_len) == (2, 24576)
    # a private mirror with a registry port: the version is the tag's, not the port's
    assert args.vllm_version == "0.10.2"
    fake_hf_cache(Path(on_disk(tmp_path, "/srv/hf")), "Qwen/Qwen3-32B", "qwen3-32b")
    plan = plan_for(
        replace(args, env={**args.env, "HF_HOME": on_disk(tmp_path, "/srv/hf")}),
        PlanRequest(24576, gpu_memory=80 * GiB, gpu_count=2, weights_bytes=65524246528),
    )
    assert plan.kv_bytes_per_token_per_gpu == 64 * 8 * 128 * 2 * 2 // 2
    assert plan.max_model_len == 24576


def test_podman_mount_and_an_image_whose_command_is_vllm_serve() -> None:
    view = view_from_unit(load("vllm-qwen3-podman-mount.service"))
    args = view.args
    assert view.command.form == "podman"
    assert view.command.args[:1] == ["/weights/qwen3"]
    assert args.model == "/srv/models/qwen3-32b"  # --mount type=bind,source=..,target=..,readonly
    assert args.env["HF_HOME"] == "/srv/hf"  # --mount type=bind,src=/srv/hf,dst=/root/.cache/huggingface
    assert (args.tensor_parallel_size, args.max_model_len, args.enable_prefix_caching) == (2, 16384, True)
    assert args.served_model_name == "qwen3"  # nargs="+": qwen3-32b is a second name, not the model
    assert args.vllm_version is None  # the site image's tag is not vLLM's version
    assert view.base_url == "http://127.0.0.1:8005"
    assert [v.read_only for v in container_volumes(view.command)] == [True, False]


@pytest.mark.parametrize(
    ("tail", "model", "version"),
    [
        (
            "nvcr.io/nvidia/pytorch:24.05 python3 -m vllm.entrypoints.openai.api_server --model /m/x",
            "/srv/x",
            None,
        ),
        ("--entrypoint vllm quay.io/acme/llm:1.2 serve /m/x -tp 2", "/srv/x", None),
        ("docker.io/vllm/vllm-openai:latest /m/x", "/srv/x", None),
        ("vllm/vllm-openai:nightly --model /m/x", "/srv/x", None),
        ("ghcr.io/mirror/vllm-openai:0.9.2@sha256:" + "ab" * 32 + " --model /m/x", "/srv/x", "0.9.2"),
        ("vllm/vllm-openai:v0.11.0 meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "0.11.0"),
    ],
)
def test_images_are_recognised_by_their_command_or_as_vllms_own(tail: str, model: str, version: str) -> None:
    view = view_from_unit(unit_with(f"/usr/bin/docker run --rm -v /srv:/m {tail}"))
    assert view.args.model == model
    assert view.args.vllm_version == version


def test_an_image_that_does_not_run_vllm_is_refused() -> None:
    with pytest.raises(UnitError, match="does not run vLLM"):
        find_vllm_command("/usr/bin/docker run --rm -v /srv:/m nginx:1.27 --model /m/x")


def test_a_container_path_no_volume_holds_or_a_named_volume_is_a_one_line_error() -> None:
    with pytest.raises(CtxmgrError, match="no -v/--mount maps it"):
        view_from_unit(unit_with("/usr/bin/docker run vllm/vllm-openai:v0.11.0 --model /models/x"))
    with pytest.raises(CtxmgrError, match="named volume 'models'"):
        view_from_unit(
            unit_with("/usr/bin/docker run -v models:/models vllm/vllm-openai:v0.11.0 --model /models/x")
        )


def test_tilde_volume_is_the_units_users_home_and_no_cache_volume_leaves_the_hosts_default() -> None:
    tilde = (
        "/usr/bin/docker run -v ~/.cache/huggingface:/root/.cache/huggingface vllm/vllm-openai:v0.11.0 m/x"
    )
    assert view_from_unit(unit_with(tilde)).args.env["HF_HOME"] == "/root/.cache/huggingface"
    inside = "/usr/bin/docker run -e HF_HOME=/cache vllm/vllm-openai:v0.11.0 m/x"
    assert "HF_HOME" not in view_from_unit(unit_with(inside)).args.env  # a container path means nothing here


def test_volume_mapping_takes_the_longest_target_and_whole_path_components() -> None:
    command = find_vllm_command(
        "docker run -v /a:/models -v /b:/models/big --mount type=bind,source=/c,target=/modelsx "
        "vllm/vllm-openai:v0.11.0 --model /models/big/x"
    )
    volumes = container_volumes(command)
    assert host_path("/models/big/x", volumes) == "/b/x"
    assert host_path("/models/small", volumes) == "/a/small"
    assert host_path("/modelsx/y", volumes) == "/c/y"
    assert host_path("/models", volumes) == "/a"
    assert host_path("/other", volumes) is None


def test_set_context_edits_vllms_arguments_and_puts_env_before_the_image() -> None:
    unit = load("vllm-qwen3-podman-mount.service")
    edit = edit_unit(unit, {"--max-model-len": "32768"}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert "-e VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 ghcr.io/example/inference-runtime:2025.09" in edit.new_text
    assert "vllm serve /weights/qwen3" in edit.new_text
    new = ServiceUnit(unit.name, (UnitFile.parse(edit.path, edit.new_text),))
    args = view_from_unit(new).args
    assert (args.max_model_len, args.env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"]) == (32768, "1")


def test_quadlet_generated_unit_is_read_and_its_edit_refused_naming_the_container_file() -> None:
    unit = ServiceUnit.load("vllm-qwen3-quadlet.service", UNITS / "vllm-qwen3-quadlet.service")
    view = view_from_unit(unit)
    args = view.args
    assert view.command.form == "podman"
    assert (args.model, args.tensor_parallel_size, args.max_model_len) == ("/srv/models/qwen3-32b", 2, 16384)
    assert args.env["HF_HOME"] == "/srv/hf" and args.env["HF_HUB_OFFLINE"] == "1"
    assert args.vllm_version == "0.11.0" and view.base_url == "http://127.0.0.1:8007"
    with pytest.raises(
        UnitError, match=r"generated by Quadlet from /etc/containers/systemd/vllm-qwen3-quadlet"
    ):
        edit_unit(unit, {"--max-model-len": "32768"})


def test_quadlet_fixture_is_its_container_file_as_the_generator_lays_it_out() -> None:
    """No Quadlet generator can be had here (Debian 12's podman 4.3 predates it): check the generated
    fixture against its source, key by key, as Quadlet maps them (Volume= -> -v, PublishPort= ->
    --publish, Environment= -> --env, AddDevice= -> --device=, PodmanArgs= and Exec= after/around Image=)."""
    source = UnitFile.parse("c", (UNITS / "vllm-qwen3-quadlet.container").read_text())
    generated = UnitFile.parse("s", (UNITS / "vllm-qwen3-quadlet.service").read_text())
    keys = [(a.key, a.value) for a in source.assignments if a.section == "Container"]
    assert keys == [(a.key, a.value) for a in generated.assignments if a.section == "X-Container"]
    words = find_vllm_command(generated.get_all("Service", "ExecStart")[0].value).words
    exec_words = " ".join(w.value for w in words)
    container = dict(keys)
    expected_run = (
        f"--device={container['AddDevice']} "
        + " ".join(f"-v {a.value}" for a in source.get_all("Container", "Volume"))
        + f" --publish {container['PublishPort']} --env {container['Environment']} "
        f"{container['PodmanArgs']} {container['Image']} {container['Exec']}"
    )
    assert exec_words.endswith(expected_run)


def test_image_versions_from_tags() -> None:
    assert container_vllm_version("vllm/vllm-openai:v0.11.0") == "0.11.0"
    assert container_vllm_version("registry.local:5000/vllm/vllm-openai:0.10.1.1") == "0.10.1"
    assert container_vllm_version("vllm/vllm-openai:latest") is None
    assert container_vllm_version("vllm/vllm-openai") is None
    assert container_vllm_version("nvcr.io/nvidia/pytorch:24.05") is None
