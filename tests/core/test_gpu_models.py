"""GPU names -> compute capability (issue 35 section 1): every model nvidia-smi names from Volta on gets
its real capability from NVIDIA's list (vllm_ctxmgr/core/gpu_models.py), matched as a whole model name,
or a clear refusal; --compute-capability plans anything else. Before, the first substring decided:
"rtx 50" made `NVIDIA RTX 5000 Ada Generation` (8.9) and `Quadro RTX 5000` (7.5) Blackwell (12.0), and
`NVIDIA RTX A6000`, `Quadro RTX 6000`, `NVIDIA L20`, ... were refused as unknown."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run
from tests.support.paths import REPO
from vllm_ctxmgr.core.gpu_models import GPU_MODELS
from vllm_ctxmgr.core.hardware import capability_for_name, normalised_gpu_name

LLAMA = str(REPO / "examples" / "models" / "llama-3.1-70b")
GLM5 = str(REPO / "examples" / "models" / "glm-5")

# names as nvidia-smi --query-gpu=name prints them (NVML's nvmlDeviceGetName), with NVIDIA's capability
REAL_NAMES = [
    ("Tesla V100-SXM2-32GB", (7, 0)),
    ("Tesla V100-PCIE-16GB", (7, 0)),
    ("Tesla V100S-PCIE-32GB", (7, 0)),
    ("TITAN V", (7, 0)),
    ("Quadro GV100", (7, 0)),
    ("Tesla T4", (7, 5)),
    ("Quadro RTX 4000", (7, 5)),
    ("Quadro RTX 5000", (7, 5)),
    ("Quadro RTX 6000", (7, 5)),
    ("Quadro RTX 8000", (7, 5)),
    ("NVIDIA TITAN RTX", (7, 5)),
    ("NVIDIA GeForce RTX 2060", (7, 5)),
    ("NVIDIA GeForce RTX 2070 SUPER", (7, 5)),
    ("NVIDIA GeForce RTX 2080 Ti", (7, 5)),
    ("NVIDIA A100-SXM4-80GB", (8, 0)),
    ("NVIDIA A100-SXM4-40GB", (8, 0)),
    ("NVIDIA A100 80GB PCIe", (8, 0)),
    ("NVIDIA A100-PCIE-40GB", (8, 0)),
    ("NVIDIA A800-SXM4-80GB", (8, 0)),
    ("NVIDIA A30", (8, 0)),
    ("NVIDIA A40", (8, 6)),
    ("NVIDIA A10", (8, 6)),
    ("NVIDIA A10G", (8, 6)),
    ("NVIDIA A16", (8, 6)),
    ("NVIDIA A2", (8, 6)),
    ("NVIDIA RTX A2000 12GB", (8, 6)),
    ("NVIDIA RTX A4000", (8, 6)),
    ("NVIDIA RTX A5000", (8, 6)),
    ("NVIDIA RTX A6000", (8, 6)),
    ("NVIDIA GeForce RTX 3050", (8, 6)),
    ("NVIDIA GeForce RTX 3060 Ti", (8, 6)),
    ("NVIDIA GeForce RTX 3090", (8, 6)),
    ("NVIDIA GeForce RTX 3090 Ti", (8, 6)),
    ("NVIDIA L4", (8, 9)),
    ("NVIDIA L40", (8, 9)),
    ("NVIDIA L40S", (8, 9)),
    ("NVIDIA L20", (8, 9)),
    ("NVIDIA L2", (8, 9)),
    ("NVIDIA RTX 4000 Ada Generation", (8, 9)),
    ("NVIDIA RTX 4000 SFF Ada Generation", (8, 9)),
    ("NVIDIA RTX 4500 Ada Generation", (8, 9)),
    ("NVIDIA RTX 5000 Ada Generation", (8, 9)),
    ("NVIDIA RTX 6000 Ada Generation", (8, 9)),
    ("NVIDIA GeForce RTX 4060", (8, 9)),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", (8, 9)),
    ("NVIDIA GeForce RTX 4090", (8, 9)),
    ("NVIDIA GeForce RTX 4090 D", (8, 9)),
    ("NVIDIA H100 80GB HBM3", (9, 0)),
    ("NVIDIA H100 PCIe", (9, 0)),
    ("NVIDIA H100 NVL", (9, 0)),
    ("NVIDIA H200", (9, 0)),
    ("NVIDIA H200 NVL", (9, 0)),
    ("NVIDIA H20", (9, 0)),
    ("NVIDIA H800", (9, 0)),
    ("NVIDIA GH200 480GB", (9, 0)),
    ("NVIDIA B100", (10, 0)),
    ("NVIDIA B200", (10, 0)),
    ("NVIDIA GB200", (10, 0)),
    ("NVIDIA B300 SXM6 AC", (10, 3)),
    ("NVIDIA RTX PRO 4000 Blackwell", (12, 0)),
    ("NVIDIA RTX PRO 4500 Blackwell", (12, 0)),
    ("NVIDIA RTX PRO 5000 Blackwell", (12, 0)),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0)),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", (12, 0)),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0)),
    ("NVIDIA GeForce RTX 5050", (12, 0)),
    ("NVIDIA GeForce RTX 5060 Ti", (12, 0)),
    ("NVIDIA GeForce RTX 5070", (12, 0)),
    ("NVIDIA GeForce RTX 5080", (12, 0)),
    ("NVIDIA GeForce RTX 5090", (12, 0)),
]


@pytest.mark.parametrize(("name", "capability"), REAL_NAMES, ids=[n for n, _ in REAL_NAMES])
def test_a_real_nvidia_smi_name_gets_its_compute_capability(name: str, capability: tuple[int, int]) -> None:
    assert capability_for_name(name) == capability


def test_the_table_is_whole_names_each_its_own() -> None:
    keys = [normalised_gpu_name(model) for model, _ in GPU_MODELS]
    assert len(keys) == len(set(keys))  # no two rows collapse into one
    # a longer name is not its prefix's: the RTX 5000 Ada is not a Quadro RTX 5000, nor an RTX 50x0
    assert capability_for_name("NVIDIA RTX 5000") is None
    assert capability_for_name("NVIDIA GeForce RTX 50") is None
    assert capability_for_name("NVIDIA H100X") is None


@pytest.mark.parametrize("name", ["NVIDIA Z9000", "NVIDIA RTX 9090", "Tesla X1", "NVIDIA Jetson AGX Orin"])
def test_an_unknown_name_is_refused_naming_compute_capability(name: str) -> None:
    code, _, err = run("plan", "8192", "--model", LLAMA, "--gpu-memory", "80GiB", "--gpu-name", name)
    assert code == 2 and err.count("\n") == 1
    assert f"--gpu-name {name!r}: not a GPU ctxmgr knows; known: " in err
    assert "for another GPU give --compute-capability X.Y" in err


@pytest.mark.parametrize(
    ("name", "capability"),
    [
        ("Tesla P100-PCIE-16GB", "6.0"),
        ("Tesla P40", "6.1"),
        ("NVIDIA GeForce GTX 1080 Ti", "6.1"),
        ("Tesla K80", "3.7"),
    ],
)
def test_a_gpu_before_volta_is_refused_saying_vllm_needs_7_0(name: str, capability: str) -> None:
    code, _, err = run("plan", "8192", "--model", LLAMA, "--gpu-memory", "16GiB", "--gpu-name", name)
    assert code == 2 and err.count("\n") == 1
    assert (
        f"--gpu-name {name!r}: compute capability {capability}; vLLM's CUDA build needs 7.0 or newer" in err
    )


def test_compute_capability_plans_a_gpu_the_table_lacks_and_refuses_below_7_0() -> None:
    base = ("plan", "8192", "--model", LLAMA, "-tp", "4", "--gpu-memory", "48GiB", "--gpu-count", "4",
            "--weights-bytes", "140GiB")  # fmt: skip
    code, out, err = run(*base, "--gpu-name", "NVIDIA Z9000", "--compute-capability", "8.9", "--json")
    assert code == 0, err
    platform = json.loads(out)["platform"]
    assert (
        platform["compute_capability"] == [8, 9] and platform["capability_source"] == "--compute-capability"
    )
    assert platform["device_name"] == "NVIDIA Z9000"
    code, _, err = run(*base, "--compute-capability", "6.1")
    assert code == 2 and "--compute-capability: compute capability 6.1; vLLM's CUDA build needs 7.0" in err
    code, _, err = run(*base, "--gpu-name", "NVIDIA L40S", "--compute-capability", "9.0")
    assert code == 2 and "'NVIDIA L40S' is compute capability 8.9 (NVIDIA's CUDA GPUs list), not 9.0" in err
    code, _, err = run(*base, "--compute-capability", "8.99")
    assert code == 2 and "is not a compute capability (X.Y" in err


def test_the_plan_says_which_gpu_decided_the_backend_and_kv_dtype() -> None:
    """GLM-5's sparse MLA: on the seeds' RTX PRO 6000 Blackwell, FLASHINFER_MLA_SPARSE_SM120 and fp8_ds_mla;
    on the RTX 5000 Ada (which "rtx 50" made Blackwell) vLLM has no sparse-MLA backend at all."""
    base = ("plan", "200000", "--model", GLM5, "-tp", "8", "--gpu-memory", "95.6GiB", "--gpu-count", "8",
            "--weights-bytes", "406.7GiB")  # fmt: skip
    name = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    code, out, _ = run(*base, "--gpu-name", name)
    assert code == 0
    assert (
        f"GPU: {name}, compute capability 12.0 (its name, NVIDIA's CUDA GPUs list): decides the backend "
        "FLASHINFER_MLA_SPARSE_SM120 and the KV dtype fp8_ds_mla"
    ) in out.splitlines()
    _, out, _ = run(*base, "--gpu-name", name, "--json")
    platform = json.loads(out)["platform"]
    assert platform["decides"] == {
        "attention_backend": "FLASHINFER_MLA_SPARSE_SM120",
        "kv_cache_dtype": "fp8_ds_mla",
    }
    assert platform["capability_source"] == "its name, NVIDIA's CUDA GPUs list"
    code, out, _ = run(*base)
    assert code == 0 and "GPU: no GPU named, compute capability unknown: planned as Hopper (9.0)" in out
    code, _, err = run(*base, "--gpu-name", "NVIDIA RTX 5000 Ada Generation")
    assert code == 2 and "no sparse-MLA backend for compute capability 8.x" in err
