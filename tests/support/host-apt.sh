#!/usr/bin/env bash
# tests/support/host-apt.sh [PACKAGE...]: the one apt step of the test setup (`make host-apt`). Every
# target that needs Debian packages (the fleet tier's sshd, HAProxy and ip; debootstrap for Debian 11's
# root file system; the package lists promtool is downloaded from) depends on it, so `make -j4
# test-setup` has one apt user, and every apt call waits for another one on the host (unattended-
# upgrades, an operator's apt) instead of failing on its lock:
# - apt-get install/check/download: `-o DPkg::Lock::Timeout=` (apt waits for the dpkg frontend lock);
# - apt-get update: apt does not wait for the lists lock, so it is tried again while the lock is held.
# CTXMGR_APT_LOCK_TIMEOUT (seconds, default 600) bounds both waits. Sourced (tests/support/promtool.sh,
# tests/project/test_host_apt.py), it only defines apt_get and apt_update.
#
# Leaves the host as it was: only missing packages are installed; while they are, a policy-rc.d that
# refuses every start is in place (unless the host has its own), so no maintainer script starts a
# service; and the systemd units those packages (and the dependencies this step pulled in) enabled are
# disabled again with deb-systemd-helper (so an upgrade does not enable them either). A package the
# host already had is never touched. Without root or apt-get it says why and exits 0 (the tests that
# need the packages then skip, or fail under CTXMGR_REQUIRE_*). The packages installed (with the
# dependencies they pulled in) are listed in /var/cache/ctxmgr/host-apt.installed; `make clean-host`
# (host-apt.sh --purge) purges those again.
set -euo pipefail

LOCK_TIMEOUT=${CTXMGR_APT_LOCK_TIMEOUT:-600}
POLICY=${CTXMGR_POLICY_RC_D:-/usr/sbin/policy-rc.d}  # another path only in tests/project/test_host_apt.py
# the packages this step installed, one a line (what `make clean-host` purges)
INSTALLED_LIST=${CTXMGR_HOST_APT_LIST:-/var/cache/ctxmgr/host-apt.installed}

say() { printf '[host-apt] %s\n' "$*"; }

# apt-get that waits for the dpkg frontend lock instead of failing on it
apt_get() { apt-get -o DPkg::Lock::Timeout="$LOCK_TIMEOUT" "$@"; }

# apt-get update, again while another apt holds the lists lock (apt has no wait of its own for it)
apt_update() {
  local deadline=$((SECONDS + LOCK_TIMEOUT)) out
  while :; do
    if out=$(apt_get update -qq 2>&1); then
      return 0
    fi
    if [[ $out != *"Could not get lock"* ]] || ((SECONDS >= deadline)); then
      printf '%s\n' "$out" >&2
      return 1
    fi
    sleep 2
  done
}

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# `make clean-host`: the packages this step installed (and only those) purged again
purge() {
  [[ -s $INSTALLED_LIST ]] || { say "no package installed by this step ($INSTALLED_LIST)"; return 0; }
  local packages
  mapfile -t packages <"$INSTALLED_LIST"
  say "apt-get purge ${packages[*]} (installed by make host-apt)"
  DEBIAN_FRONTEND=noninteractive apt_get purge -y -qq "${packages[@]}" >/dev/null
  rm -f "$INSTALLED_LIST"
}

main() {
  if [[ ${1:-} == --purge ]]; then
    purge
    return
  fi
  local missing=() p
  for p in "$@"; do installed "$p" || missing+=("$p"); done
  local lists=no
  compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null && lists=yes
  if ((${#missing[@]} == 0)) && [[ $lists == yes ]]; then
    exit 0
  fi
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    say "needs root and apt-get (for apt-get update${missing[*]:+ and install ${missing[*]}}); the tests that need them skip"
    exit 0
  fi
  if ((${#missing[@]} == 0)); then
    say "apt-get update (no package lists yet)"
    apt_update
    exit 0
  fi

  local before
  before=$(dpkg-query -W -f='${Package}\n' | sort)
  if [[ ! -e $POLICY ]]; then
    # no maintainer script may start a host service while this step installs (invoke-rc.d and
    # deb-systemd-invoke both ask policy-rc.d; 101: action forbidden)
    printf '#!/bin/sh\n# installed by vllm-ctxmgr tests/support/host-apt.sh while it runs apt-get\nexit 101\n' \
      >"$POLICY.ctxmgr"
    chmod 0755 "$POLICY.ctxmgr"
    mv "$POLICY.ctxmgr" "$POLICY"
    trap 'rm -f "$POLICY"' EXIT
  fi
  say "apt-get install ${missing[*]} (no service is started or left enabled)"
  apt_update
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

  local new
  new=$(comm -13 <(printf '%s\n' "$before") <(dpkg-query -W -f='${Package}\n' | sort))
  mkdir -p "$(dirname "$INSTALLED_LIST")"
  { [[ -f $INSTALLED_LIST ]] && cat "$INSTALLED_LIST"; printf '%s\n' "$new"; } | sed '/^$/d' | sort -u \
    >"$INSTALLED_LIST.tmp"
  mv "$INSTALLED_LIST.tmp" "$INSTALLED_LIST"
  # shellcheck disable=SC2086
  leave_disabled $new
}

# the systemd units of these packages, as their postinst left them: enabled -> disabled again (with
# deb-systemd-helper, as the postinst enabled them, so the package's next upgrade keeps them disabled);
# started (where systemd runs and a host policy-rc.d let it) -> stopped
leave_disabled() {
  local pkg unit
  for pkg in "$@"; do
    for unit in $(dpkg-query -L "$pkg" 2>/dev/null |
      grep -E '^/(usr/)?lib/systemd/system/[^/]+\.(service|socket|timer)$' | xargs -r -n1 basename | sort -u); do
      if command -v deb-systemd-helper >/dev/null &&
        DPKG_MAINTSCRIPT_PACKAGE=$pkg deb-systemd-helper is-enabled "$unit" >/dev/null 2>&1; then
        DPKG_MAINTSCRIPT_PACKAGE=$pkg deb-systemd-helper disable "$unit"
        say "disabled $unit (its package's postinst enabled it)"
      fi
      if [[ -d /run/systemd/system ]] && systemctl --quiet is-active "$unit" 2>/dev/null; then
        systemctl stop "$unit" || true
        say "stopped $unit (started by its package's postinst)"
      fi
    done
  done
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
