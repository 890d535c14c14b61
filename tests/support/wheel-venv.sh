#!/usr/bin/env bash
# tests/support/wheel-venv.sh PYTHON WHEELHOUSE VENV: ctxmgr as a GPU host without a package index installs
# it (`make wheel`): a fresh venv, then README's offline line, `pip install --no-index --find-links
# WHEELHOUSE vllm-ctxmgr`, with the network cut off, and `ctxmgr --help` and a plan run there. The CLI
# tiers run this venv's ctxmgr (CTXMGR_BIN), so every test of the console script tests the offline install.
#
# The network is cut with `unshare -n` (root): a network namespace with a loopback that is down and no
# routes. Without root pip runs with --no-index alone, and the record says so. pip's own configuration
# (an index, find-links of the machine) is left out, so the wheelhouse is all it can read. What ran is
# recorded in VENV/offline-install.txt (tests/project/test_wheelhouse.py reads it).
set -euo pipefail
python=$1 wheelhouse=$2 venv=$3
rm -rf "$venv"
"$python" -m venv "$venv"
record=$venv/offline-install.txt
if [[ $(id -u) == 0 ]] && unshare -n true 2>/dev/null; then
  cut=(unshare -n)
  how="network namespace (unshare -n)"
else
  cut=(env)
  how="no root: --no-index only, the network is not cut"
fi
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_NO_INDEX
# shellcheck disable=SC2016
"${cut[@]}" bash -c '
  set -euo pipefail
  how=$1 venv=$2 wheelhouse=$3
  echo "how: $how"
  echo "interfaces: $(tail -n +3 /proc/net/dev | cut -d: -f1 | xargs)"
  echo "network: $("$venv/bin/python" -c "
import socket
try:
    socket.create_connection((\"151.101.0.223\", 443), timeout=5).close()
    print(\"reachable\")
except OSError as e:
    print(\"unreachable:\", e)
")"
  "$venv/bin/pip" install -q --no-index --find-links "$wheelhouse" vllm-ctxmgr
  echo "installed: $("$venv/bin/pip" list --format=freeze | xargs)"
  "$venv/bin/ctxmgr" --help >/dev/null
  echo "help: 0"
  code=0
  "$venv/bin/ctxmgr" plan 200000 --model examples/models/glm-5 -tp 8 --gpu-memory 95.6GiB --gpu-count 8 \
    --weights-bytes 406.7GiB >/dev/null || code=$?
  echo "plan: $code"
  [[ $code == 0 || $code == 3 || $code == 6 ]]  # a plan answers: fits, does not fit, unknown
' wheel-venv "$how" "$venv" "$wheelhouse" >"$record.tmp"
mv "$record.tmp" "$record"
cat "$record"
