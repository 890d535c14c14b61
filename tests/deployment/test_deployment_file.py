"""A deployment file (TOML) is read as the flags are: its hosts go through NodeAddress.parse like
--node (issue 29, item 12), and its gpus_from is a bounded read of a regular file (item 6)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.paths import REPO
from vllm_ctxmgr.cli.main import main
from vllm_ctxmgr.errors import ExitCode


def plan_with(path: Path, text: str) -> tuple[int, dict]:
    path.write_text(text)
    result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize(
    "host",
    ["-oProxyCommand=touch /tmp/x", "gpu b", "gpu\\nb", "gpu\\tb", "gpu\\u001bb", ""],
)
def test_a_deployment_files_host_is_parsed_as_a_node_flag_is(workdir: Path, host: str) -> None:
    path = workdir / "d.toml"
    code, data = plan_with(path, f'[[node]]\nhost = "{host}"\nservice = "vllm-glm5"\n')
    assert code == ExitCode.USAGE, data
    assert data["error"].startswith(f"{path}: "), data
    assert "expected HOST:UNIT" in data["error"] or "host and service" in data["error"]
    assert "\n" not in data["error"]


@pytest.mark.parametrize("service", ["-x", "vllm glm5", "vllm\\nglm5"])
def test_a_deployment_files_service_is_parsed_as_a_node_flag_is(workdir: Path, service: str) -> None:
    path = workdir / "d.toml"
    code, data = plan_with(path, f'[[node]]\nhost = "gpu-b"\nservice = "{service}"\n')
    assert code == ExitCode.USAGE, data
    assert "expected HOST:UNIT" in data["error"]


def test_a_non_string_host_is_refused(workdir: Path) -> None:
    code, data = plan_with(workdir / "d.toml", '[[node]]\nhost = 5\nservice = "vllm-glm5"\n')
    assert code == ExitCode.USAGE and "host" in data["error"], data


# ---- gpus_from and --gpus-from: a bounded read of a regular file (issue 29, item 6) -----------------

GPU = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_899_345_920,
       "free_bytes": 85_000_000_000, "used_bytes": 899_345_920}  # fmt: skip
GPUS = {"source": "nvml", "gpus": [GPU]}


def gpus_from(value: str) -> list[str]:
    model = str(REPO / "examples" / "models" / "qwen3-32b")
    return ["plan", "4096", "--model", model, "--gpus-from", value, "--json"]


def run_bounded(args: list[str], seconds: float = 30.0) -> tuple[int, dict]:
    """The CLI as a process with a deadline and 2 GiB of address space: a read of /dev/zero or a FIFO
    must end by itself (before the fix one read /dev/zero until the OOM killer)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "vllm_ctxmgr", *args],
        capture_output=True,
        text=True,
        timeout=seconds,
        preexec_fn=limit,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("kind", ["zero", "fifo", "directory", "huge"])
def test_gpus_from_is_a_regular_file_read_within_a_bound(workdir: Path, kind: str) -> None:
    path = workdir / "gpus.json"
    if kind == "zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # nobody ever writes: open() without O_NONBLOCK blocks for ever
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text(json.dumps(GPUS) + " " * (2 << 20))
    code, data = run_bounded(gpus_from(str(path)))
    assert code == ExitCode.USAGE, data
    assert str(path) in data["error"]
    assert any(why in data["error"] for why in ("regular file", "more than", "is a directory")), data


def test_gpus_from_a_good_file_still_plans(workdir: Path) -> None:
    path = workdir / "gpus.json"
    path.write_text(json.dumps(GPUS))
    code, data = run_bounded(gpus_from(str(path)))
    assert code == 0, data


def test_a_deployment_files_gpus_from_is_bounded_and_stays_beside_it(workdir: Path) -> None:
    (workdir / "elsewhere.json").write_text(json.dumps(GPUS))
    here = workdir / "deploy"
    here.mkdir()
    path = here / "d.toml"
    node = '[[node]]\nhost = "local"\nservice = "vllm-glm5"\n'
    code, data = plan_with(path, node + 'gpus_from = "../elsewhere.json"\n')
    assert code == ExitCode.USAGE and "'..'" in data["error"], data
    code, data = plan_with(path, node + 'gpus_from = "/dev/zero"\n')
    assert code == ExitCode.USAGE and "regular file" in data["error"], data
    os.mkfifo(here / "fifo.json")
    code, data = run_bounded(["deployment", "plan", "4096", "--file", str(path), "--json"])
    path.write_text(node + 'gpus_from = "fifo.json"\n')
    code, data = run_bounded(["deployment", "plan", "4096", "--file", str(path), "--json"])
    assert code == ExitCode.USAGE and "FIFO" in data["error"], data


def test_the_deployment_file_itself_is_a_bounded_regular_file(workdir: Path) -> None:
    fifo = workdir / "d.toml"
    os.mkfifo(fifo)
    code, data = run_bounded(["deployment", "plan", "4096", "--file", str(fifo), "--json"])
    assert code == ExitCode.USAGE and "FIFO" in data["error"], data
    code, data = run_bounded(["deployment", "plan", "4096", "--file", "/dev/zero", "--json"])
    assert code == ExitCode.USAGE and "regular file" in data["error"], data


# ---- issue 36 item 12: a deployment file is command input: StrictModes, as the state dir's ----------

GOOD_FILE = (
    '[[node]]\nhost = "local"\nservice = "a.service"\n[[node]]\nhost = "local"\nservice = "b.service"\n'
)
HOSTILE_FILE = 'ssh = ["sh", "-c", "id > OUT; exit 255", "x"]\n' + GOOD_FILE.replace("local", "gpu-b")


@pytest.mark.parametrize("case", ["file-0666", "dir-0777", "file-of-nobody", "dir-of-nobody"])
def test_a_deployment_file_another_user_could_write_is_refused_before_it_is_read(
    workdir: Path, case: str
) -> None:
    if "nobody" in case and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    directory = workdir / "deploy"
    directory.mkdir(mode=0o755)
    path = directory / "d.toml"
    out = workdir / "OUT"
    path.write_text(HOSTILE_FILE.replace("OUT", str(out)))
    path.chmod(0o644)
    if case == "file-0666":
        path.chmod(0o666)
    elif case == "dir-0777":
        directory.chmod(0o777)
    elif case == "file-of-nobody":
        os.chown(path, 65534, 65534)
    else:
        os.chown(directory, 65534, 65534)
    result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == ExitCode.USAGE, data
    assert not out.exists(), "the file's ssh command ran"
    assert "owned by uid 65534" in data["error"] or "writable by group or others" in data["error"], data
    assert "\n" not in data["error"]


def test_a_deployment_file_of_its_own_user_in_a_private_directory_is_read(workdir: Path) -> None:
    directory = workdir / "deploy-ok"
    directory.mkdir(mode=0o755)
    path = directory / "d.toml"
    path.write_text(GOOD_FILE)
    path.chmod(0o644)
    result = CliRunner().invoke(main, ["deployment", "plan", "4096", "--file", str(path), "--json"])
    assert "writable" not in result.stdout and "owned by" not in result.stdout, result.stdout
