#!/usr/bin/env bash
# A Debian 11 (bullseye) root file system whose systemd 247, journald, systemctl and systemd-analyze the
# tests boot as a sandbox's PID 1 (tests/support/sandbox.py, Sandbox.start(rootfs=...)): the oldest
# systemd ctxmgr supports (vllm_ctxmgr/systemd/features.py FLOOR), from Debian's own packages.
#
#   tests/support/debian11-rootfs.sh      # tree at ${CTXMGR_DEBIAN11_ROOTFS:-/var/cache/ctxmgr/debian11-rootfs}
#
# Idempotent: a tree that passes the health check is reused untouched. Otherwise debootstrap (minbase,
# plus systemd and systemd-sysv; about 240 MB, 2-4 minutes) from CTXMGR_DEBIAN_MIRROR (deb.debian.org)
# into a fresh directory, moved into place only once it is healthy. Needs root and debootstrap (installed
# with apt-get when missing); without them it says why and exits 0: the 247 tests then skip with that
# reason (or fail under CTXMGR_REQUIRE_SYSTEMD=1).
set -euo pipefail

ROOTFS=${CTXMGR_DEBIAN11_ROOTFS:-/var/cache/ctxmgr/debian11-rootfs}
MIRROR=${CTXMGR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
EXPECTED="systemd 247 "

say() { printf '[debian11-rootfs] %s\n' "$*"; }

# systemd 247 and its tools in the tree, run from the tree itself
healthy() {
  local root=$1
  [[ -x $root/lib/systemd/systemd && -x $root/bin/systemctl && -x $root/bin/journalctl ]] || return 1
  [[ -x $root/bin/systemd-analyze && -x $root/lib/systemd/systemd-journald ]] || return 1
  local version
  version=$(chroot "$root" /bin/systemctl --version 2>/dev/null | head -1) || return 1
  [[ $version == "$EXPECTED"* ]] || return 1
  echo "$version"
}

if [[ -e $ROOTFS ]]; then
  if version=$(healthy "$ROOTFS"); then
    say "$ROOTFS is already healthy ($version), nothing to do"
    exit 0
  fi
  say "$ROOTFS fails the health check: building it again"
fi
if [[ $(id -u) != 0 ]]; then
  say "not root: cannot debootstrap $ROOTFS; the systemd 247 tests skip"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    say "no debootstrap and no apt-get to install it; the systemd 247 tests skip"
    exit 0
  fi
  # `make debian11-rootfs` runs after `make host-apt`, which installs it; run on its own, the same step
  bash "$(dirname "$0")/host-apt.sh" debootstrap
  command -v debootstrap >/dev/null || { say "no debootstrap; the systemd 247 tests skip"; exit 0; }
fi

staging="$ROOTFS.new"
rm -rf "$staging"
mkdir -p "$(dirname "$ROOTFS")"
say "debootstrap bullseye from $MIRROR into $staging (2-4 minutes)"
if ! debootstrap --variant=minbase --include=systemd,systemd-sysv bullseye "$staging" "$MIRROR" \
  >"$staging.log" 2>&1; then
  say "debootstrap failed (tail of $staging.log follows); the systemd 247 tests skip"
  tail -5 "$staging.log" >&2
  rm -rf "$staging"
  exit 0
fi
version=$(healthy "$staging") || {
  say "the new tree fails the health check; the systemd 247 tests skip"
  exit 0
}
rm -rf "$ROOTFS"
mv "$staging" "$ROOTFS"
rm -f "$staging.log"
say "$ROOTFS ready ($version)"
