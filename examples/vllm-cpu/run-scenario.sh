#!/usr/bin/env bash
# Start one vLLM unit under a private systemd, time it until it serves or fails, and save its journal.
# This is how tests/data/vllm-cpu/*.journal and the timings in tests/vllm_cpu.py were made.
#
#   run-scenario.sh SANDBOX_PID UNIT_FILE PORT OUTDIR [TIMEOUT_S]
#
# SANDBOX_PID is the PID that `systemd-sandbox.sh start` (or tests.support.sandbox) printed. The unit is
# installed under the sandbox's /run/systemd/system and started; every 0.5 s the script samples the summed
# RSS of the unit's processes and probes http://127.0.0.1:PORT/health. It ends at the first of: /health
# answers 200 ("ready"), the unit reaches ActiveState=failed, the timeout. Then it writes
# OUTDIR/NAME.journal (journalctl -o cat), OUTDIR/NAME.journal.json (-o json) and OUTDIR/NAME.summary, and
# leaves the unit as it is (running when ready: stop it yourself).
set -euo pipefail
[[ $# -ge 4 ]] || { echo "usage: $0 SANDBOX_PID UNIT_FILE PORT OUTDIR [TIMEOUT_S]" >&2; exit 2; }
sandbox_pid=$1 unit_file=$2 port=$3 outdir=$4 timeout_s=${5:-180}
unit=$(basename "$unit_file")
name=${unit%.service}
in_sandbox() { nsenter -t "$sandbox_pid" -m -p "$@"; }
now() { date +%s.%N; }

mkdir -p "$outdir"
cp "$unit_file" "/proc/$sandbox_pid/root/run/systemd/system/$unit"
in_sandbox systemctl daemon-reload
in_sandbox systemctl reset-failed "$unit" 2>/dev/null || true
cursor=$(in_sandbox journalctl -n 0 --show-cursor -q | sed -n 's/^-- cursor: //p')

# The unit's processes, from the host's view of the sandbox's name=systemd cgroup hierarchy.
sandbox_cgroup=$(awk -F: '$2=="name=systemd"{print $3}' "/proc/$sandbox_pid/cgroup" | cut -d/ -f2)
procs_file=/sys/fs/cgroup/systemd/$sandbox_cgroup/system.slice/$unit/cgroup.procs
tree_rss_kb() {
  local total=0 pid rss
  [[ -r $procs_file ]] || { echo 0; return; }
  while read -r pid; do
    rss=$(awk '/^VmRSS:/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
    total=$((total + ${rss:-0}))
  done <"$procs_file"
  echo "$total"
}

t0=$(now)
in_sandbox systemctl start --no-block "$unit"
outcome=timeout peak_kb=0 ready_s=
while :; do
  elapsed=$(echo "$(now) - $t0" | bc)
  rss=$(tree_rss_kb); ((rss > peak_kb)) && peak_kb=$rss
  if curl -sf -o /dev/null "http://127.0.0.1:$port/health"; then outcome=ready ready_s=$elapsed; break; fi
  state=$(in_sandbox systemctl show "$unit" -p ActiveState --value)
  [[ $state == failed ]] && { outcome=failed; break; }
  (($(echo "$elapsed > $timeout_s" | bc))) && break
  sleep 0.5
done
elapsed=$(echo "$(now) - $t0" | bc)
sleep 1 # let journald catch up with the last lines
show=$(in_sandbox systemctl show "$unit" -p ActiveState,SubState,Result,NRestarts,ExecMainStatus | tr '\n' ' ')
in_sandbox journalctl --after-cursor "$cursor" -u "$unit" -o cat >"$outdir/$name.journal"
in_sandbox journalctl --after-cursor "$cursor" -u "$unit" -o json >"$outdir/$name.journal.json"
summary="$name outcome=$outcome elapsed_s=$elapsed ready_s=${ready_s:-} peak_tree_rss_kb=$peak_kb $show"
echo "$summary" | tee "$outdir/$name.summary"
