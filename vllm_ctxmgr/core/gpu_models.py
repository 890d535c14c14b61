"""GPU model -> CUDA compute capability, as data: NVIDIA's own list, https://developer.nvidia.com/cuda-gpus
("Your GPU Compute Capability": the datacenter, workstation / Quadro / RTX PRO and GeForce / TITAN
tables), for every model from Volta (7.0) to Blackwell (10.x, 12.x); Jetson (embedded SoCs, no
nvidia-smi model name of this form) is left aside. Pre-Volta models that servers still carry are
listed too, so that a plan for one is refused by name rather than as unknown.

Each row is a whole model name as nvidia-smi prints it without its vendor, brand and board words
("NVIDIA GeForce RTX 4090" -> "RTX 4090", "Tesla V100-SXM2-32GB" -> "V100", "NVIDIA H100 80GB HBM3" ->
"H100"): core/hardware.py normalises a name the same way and looks it up whole, never by a substring
(a substring, "rtx 50", would match `NVIDIA RTX 5000 Ada Generation` and `Quadro RTX 5000` as Blackwell).
"""

from __future__ import annotations

SOURCE = "https://developer.nvidia.com/cuda-gpus"

# (model, (major, minor)), grouped by architecture as NVIDIA's list groups them
GPU_MODELS: tuple[tuple[str, tuple[int, int]], ...] = (
    # --- Blackwell: datacenter 10.0 / 10.3, workstation and GeForce 12.0, GB10 (DGX Spark) 12.1
    ("B100", (10, 0)),
    ("B200", (10, 0)),
    ("GB200", (10, 0)),
    ("B300", (10, 3)),
    ("GB300", (10, 3)),
    ("GB10", (12, 1)),
    ("RTX PRO 6000 Blackwell", (12, 0)),  # Workstation, Max-Q Workstation and Server Edition
    ("RTX PRO 5000 Blackwell", (12, 0)),
    ("RTX PRO 4500 Blackwell", (12, 0)),
    ("RTX PRO 4000 Blackwell", (12, 0)),
    ("RTX PRO 4000 Blackwell SFF", (12, 0)),
    ("RTX PRO 2000 Blackwell", (12, 0)),
    ("RTX 5090", (12, 0)),
    ("RTX 5090 D", (12, 0)),
    ("RTX 5080", (12, 0)),
    ("RTX 5070 Ti", (12, 0)),
    ("RTX 5070", (12, 0)),
    ("RTX 5060 Ti", (12, 0)),
    ("RTX 5060", (12, 0)),
    ("RTX 5050", (12, 0)),
    # --- Hopper 9.0
    ("H100", (9, 0)),
    ("H200", (9, 0)),
    ("H800", (9, 0)),
    ("H20", (9, 0)),
    ("GH200", (9, 0)),
    # --- Ada Lovelace 8.9
    ("L4", (8, 9)),
    ("L40", (8, 9)),
    ("L40S", (8, 9)),
    ("L20", (8, 9)),
    ("L2", (8, 9)),
    ("RTX 6000 Ada Generation", (8, 9)),
    ("RTX 5000 Ada Generation", (8, 9)),
    ("RTX 4500 Ada Generation", (8, 9)),
    ("RTX 4000 Ada Generation", (8, 9)),
    ("RTX 4000 SFF Ada Generation", (8, 9)),
    ("RTX 2000 Ada Generation", (8, 9)),
    ("RTX 4090", (8, 9)),
    ("RTX 4090 D", (8, 9)),
    ("RTX 4080 SUPER", (8, 9)),
    ("RTX 4080", (8, 9)),
    ("RTX 4070 Ti SUPER", (8, 9)),
    ("RTX 4070 Ti", (8, 9)),
    ("RTX 4070 SUPER", (8, 9)),
    ("RTX 4070", (8, 9)),
    ("RTX 4060 Ti", (8, 9)),
    ("RTX 4060", (8, 9)),
    # --- Ampere: A100 class 8.0, the rest 8.6
    ("A100", (8, 0)),
    ("A800", (8, 0)),
    ("A30", (8, 0)),
    ("A40", (8, 6)),
    ("A10", (8, 6)),
    ("A10G", (8, 6)),  # AWS g5
    ("A16", (8, 6)),
    ("A2", (8, 6)),
    ("RTX A6000", (8, 6)),
    ("RTX A5500", (8, 6)),
    ("RTX A5000", (8, 6)),
    ("RTX A4500", (8, 6)),
    ("RTX A4000", (8, 6)),
    ("RTX A2000", (8, 6)),
    ("RTX 3090 Ti", (8, 6)),
    ("RTX 3090", (8, 6)),
    ("RTX 3080 Ti", (8, 6)),
    ("RTX 3080", (8, 6)),
    ("RTX 3070 Ti", (8, 6)),
    ("RTX 3070", (8, 6)),
    ("RTX 3060 Ti", (8, 6)),
    ("RTX 3060", (8, 6)),
    ("RTX 3050", (8, 6)),
    # --- Turing 7.5
    ("T4", (7, 5)),
    ("Quadro RTX 8000", (7, 5)),
    ("Quadro RTX 6000", (7, 5)),
    ("Quadro RTX 5000", (7, 5)),
    ("Quadro RTX 4000", (7, 5)),
    ("TITAN RTX", (7, 5)),
    ("RTX 2080 Ti", (7, 5)),
    ("RTX 2080 SUPER", (7, 5)),
    ("RTX 2080", (7, 5)),
    ("RTX 2070 SUPER", (7, 5)),
    ("RTX 2070", (7, 5)),
    ("RTX 2060 SUPER", (7, 5)),
    ("RTX 2060", (7, 5)),
    ("GTX 1660 Ti", (7, 5)),
    ("GTX 1660 SUPER", (7, 5)),
    ("GTX 1660", (7, 5)),
    ("GTX 1650", (7, 5)),
    # --- Volta 7.0
    ("V100", (7, 0)),
    ("V100S", (7, 0)),
    ("TITAN V", (7, 0)),
    ("Quadro GV100", (7, 0)),
    # --- before Volta: vLLM's CUDA build does not run on them (listed to be refused by name)
    ("P100", (6, 0)),
    ("P40", (6, 1)),
    ("P4", (6, 1)),
    ("Quadro P6000", (6, 1)),
    ("TITAN Xp", (6, 1)),
    ("GTX 1080 Ti", (6, 1)),
    ("GTX 1080", (6, 1)),
    ("M60", (5, 2)),
    ("M40", (5, 2)),
    ("K80", (3, 7)),
)
