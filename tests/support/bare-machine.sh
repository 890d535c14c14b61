#!/usr/bin/env bash
# tests/support/bare-machine.sh: README's setup on a bare Debian 12 (`make test-bare`), as a new user
# runs it: a fresh Debian 12 root file system (debootstrap minbase with what README's "What the host
# needs" names: Python 3.11 with venv, systemd, and make to run the two commands; nothing of the
# project), the clone's committed files copied in (`git archive HEAD`: a fresh clone), then `make demo`
# and `make test-quick` there, as root in a chroot with its own mount namespace.
#
# The base tree is debootstrapped once into CTXMGR_BARE_BASE (about 300 MB, 2-4 minutes) and copied
# fresh for every run, so each run starts bare. Not in CI: it adds the minutes of a second `make setup`,
# the demo and the quick tier (docs/testing.md).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${CTXMGR_BARE_BASE:-/var/cache/ctxmgr/debian12-bare-base}
ROOT=${CTXMGR_BARE_ROOTFS:-/var/cache/ctxmgr/debian12-bare}
MIRROR=${CTXMGR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TARGETS=${CTXMGR_BARE_TARGETS:-demo test-quick}

say() { printf '[test-bare] %s\n' "$*"; }
[[ $(id -u) == 0 ]] || { say "needs root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null || bash "$REPO/tests/support/host-apt.sh" debootstrap

if [[ ! -x $BASE/usr/bin/python3 ]]; then
  say "debootstrap bookworm into $BASE (2-4 minutes)"
  rm -rf "$BASE.new"
  debootstrap --variant=minbase --include=python3,python3-venv,make,systemd,ca-certificates \
    bookworm "$BASE.new" "$MIRROR" >"$BASE.log" 2>&1 || { tail -5 "$BASE.log"; exit 1; }
  rm -rf "$BASE"
  mv "$BASE.new" "$BASE"
fi
say "a fresh copy of the bare tree: $ROOT"
rm -rf "$ROOT"
cp -a "$BASE" "$ROOT"
mkdir -p "$ROOT/root/ctxmgr"
# modes as a clone checks them out under umask 022 (git archive's own default is 002)
git -C "$REPO" -c tar.umask=0022 archive HEAD | tar -x -C "$ROOT/root/ctxmgr"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# the network's trust, not the project's: where this machine reaches the index through a TLS proxy, its
# CA bundle (and PIP_CERT naming it) come along
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
pass=()
[[ -n ${PIP_CERT:-} ]] && pass+=("PIP_CERT=/etc/ssl/certs/ca-certificates.crt")

say "in the bare tree: make $TARGETS"
start=$SECONDS
# shellcheck disable=SC2016
unshare -m --propagation private bash -c '
  set -euo pipefail
  root=$1 targets=$2
  shift 2
  mount --bind "$root" "$root"  # its / a mount point of its own: the sandbox makes it private
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  mount -t tmpfs tmpfs "$root/run"
  mount -t tmpfs tmpfs "$root/tmp"
  umask 022  # root'"'"'s on Debian
  # the tree becomes this namespace'"'"'s root (pivot_root, not a chroot: systemd boots there as on a host)
  cd "$root"
  mkdir -p .host
  pivot_root . .host
  umount -l /.host
  rmdir /.host
  for target in $targets; do
    /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root LANG=C.UTF-8 "$@" /bin/bash -c "cd /root/ctxmgr && make $target"
  done
' test-bare "$ROOT" "$TARGETS" "${pass[@]}"
say "make $TARGETS passed on a bare Debian 12 in $((SECONDS - start)) s"
rm -rf "$ROOT"  # kept only when it fails, to look into
