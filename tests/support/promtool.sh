#!/usr/bin/env bash
# tests/support/promtool.sh TARGET: Prometheus's promtool at TARGET, for tests/monitor/test_monitoring.py
# (`promtool check rules`, `promtool test rules`). From Debian's prometheus package, the registry CI
# reaches: the .deb is downloaded and promtool alone taken out of it. Not `apt-get install
# prometheus`: its postinst adds a user and, wherever systemd is PID 1, starts a Prometheus server.
# Kept where it is (like the vLLM CPU build); without apt or root it says so and the tests skip,
# except in CI (CTXMGR_REQUIRE_PROMTOOL=1), where they fail.
set -euo pipefail
target=${1:?usage: promtool.sh TARGET}
[[ -x $target ]] && exit 0
skip() { echo "promtool: $1; tests/monitor/test_monitoring.py skips without it (fails under CTXMGR_REQUIRE_PROMTOOL=1)"; exit 0; }
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || skip "needs apt-get and dpkg-deb"
mkdir -p "$(dirname "$target")" 2>/dev/null && [[ -w $(dirname "$target") ]] || skip "cannot write $(dirname "$target")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
[[ $(id -u) == 0 ]] && chown _apt "$work" 2>/dev/null || true  # apt's download sandbox writes as _apt
# apt_get and apt_update wait for another apt's locks (`make promtool` runs after `make host-apt`, the
# setup's one apt step, so the package lists are there)
# shellcheck source=tests/support/host-apt.sh
source "$(dirname "$0")/host-apt.sh"
cd "$work"
if ! apt_get download -qq prometheus >/dev/null; then
  [[ $(id -u) == 0 ]] || skip "apt-get download prometheus failed, and apt-get update needs root"
  apt_update && apt_get download -qq prometheus >/dev/null
fi
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool
install -m 0755 usr/bin/promtool "$target.tmp"
mv "$target.tmp" "$target"
"$target" --version 2>&1 | head -1
