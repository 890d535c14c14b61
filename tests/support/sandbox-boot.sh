#!/bin/bash
# Boots a private systemd for tests and demos (see vllm_ctxmgr/sandbox.py, which runs this file).
#
#   sandbox-boot.sh launch CGROUP_DIR...   join each host cgroup dir (made by sandbox.py), then re-run
#                                          this script as PID 1 of new cgroup/PID/mount/UTS namespaces
#                                          (if unshare dies, its PID 1 and so the whole sandbox die too)
#   sandbox-boot.sh pid1                   (internal) private /run and cgroup mounts, runtime masks, exec systemd
#
# The disk is shared with the host, so every unit that would touch the host is runtime-masked:
# systemd-tmpfiles would empty the host's /tmp, sysusers/sysctl/binfmt/modules-load change it, ...
#
# With SANDBOX_ROOTFS set (a Debian 11 tree, tests/support/debian11-rootfs.sh) PID 1 pivots into a
# writable overlay of it (changes live in memory), so its own systemd, journald, systemctl and
# systemd-analyze are the ones under test. What the tests and their units use from the host is
# bind-mounted at the same path: SANDBOX_BINDS (colon-separated: the repository, Python's prefix).
# That tree has no Python >= 3.11, so SANDBOX_PYTHON (the host interpreter's real path) is replaced by
# a script that runs it with the host's own loader (SANDBOX_LOADER) and libraries (SANDBOX_LIBRARY_PATH),
# from the host's root under /run/host (read-only): the units' ExecStart= paths then mean the same on both sides.
set -eu

case "${1:-}" in
launch)
  shift
  # Own cgroup subtrees, so that the cgroup namespace is rooted there: systemd can then see and kill
  # every process of a unit, and the cgroups it makes never land at the host's roots.
  for dir in "$@"; do echo $$ >"$dir/cgroup.procs"; done
  exec unshare --cgroup --pid --fork --kill-child=SIGKILL --mount --mount-proc --uts /bin/bash "$0" pid1
  ;;
pid1) ;;
*)
  echo "usage: sandbox-boot.sh launch CGROUP_DIR... | pid1" >&2
  exit 2
  ;;
esac

mount --make-rprivate /

if [ -n "${SANDBOX_ROOTFS:-}" ]; then
  # a tmpfs on the old /run (ours alone now) holds the overlay's upper layer and the staged new root
  mount -t tmpfs -o mode=755 tmpfs /run
  mkdir -p /run/stage/upper /run/stage/work /run/stage/root
  mount -t overlay overlay -o "lowerdir=$SANDBOX_ROOTFS,upperdir=/run/stage/upper,workdir=/run/stage/work" \
    /run/stage/root
  new=/run/stage/root
  old_ifs=$IFS
  IFS=:
  for path in ${SANDBOX_BINDS:-}; do
    [ -n "$path" ] || continue
    mkdir -p "$new$path"
    mount --rbind "$path" "$new$path"
  done
  IFS=$old_ifs
  if [ -n "${SANDBOX_PYTHON:-}" ]; then
    cat >/run/stage/python <<WRAPPER
#!/bin/sh
# the host's Python (this root has none that ctxmgr runs on), with the host's loader and libraries
exec "/run/host$SANDBOX_LOADER" --library-path "$SANDBOX_LIBRARY_PATH" --argv0 "\$0" "/run/host$SANDBOX_PYTHON" "\$@"
WRAPPER
    chmod 755 /run/stage/python
    if [ ! -e "$new$SANDBOX_PYTHON" ]; then
      mkdir -p "$(dirname "$new$SANDBOX_PYTHON")"
      : >"$new$SANDBOX_PYTHON"
    fi
    mount --bind /run/stage/python "$new$SANDBOX_PYTHON"
  fi
  mount --rbind /dev "$new/dev"
  mount --rbind /sys "$new/sys"
  mkdir -p "$new/oldroot"
  cd "$new"
  pivot_root . oldroot
  cd /
  mount -t proc proc /proc
  # the private /run, and in it the host's root file system alone (not its submounts), read-only,
  # for the Python wrapper
  mount -t tmpfs -o mode=755 tmpfs /run
  mkdir -p /run/host
  mount --bind /oldroot /run/host
  mount -o remount,bind,ro /run/host
  umount -l /oldroot
  rmdir /oldroot 2>/dev/null || true
fi
# Hide the host's cgroup mounts. On a pure cgroup2 host, mount a cgroup2 rooted at our namespace;
# otherwise leave an empty tmpfs: systemd mounts its own hierarchies (rooted at our namespace) on it.
if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
else
  mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup
fi
[ -n "${SANDBOX_ROOTFS:-}" ] || mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/systemd/system /run/systemd/system.control
echo unshare >/run/systemd/container

mask() { ln -sf /dev/null "/run/systemd/system.control/$1"; }

# Everything the standard targets pull in from the host's unit dirs (services, timers, sockets, mounts...),
# except journald: that catches host-specific units (network setup, cloud agents, ...) by construction.
keep=" systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket "
for wants in /etc/systemd/system/*.target.wants /etc/systemd/system/*.target.requires \
  /lib/systemd/system/*.target.wants /lib/systemd/system/*.target.requires \
  /usr/lib/systemd/system/*.target.wants /usr/lib/systemd/system/*.target.requires; do
  [ -d "$wants" ] || continue
  for link in "$wants"/*; do
    [ -e "$link" ] || [ -L "$link" ] || continue
    unit=${link##*/}
    case "$unit" in *.target) continue ;; esac
    case "$keep" in *" $unit "*) continue ;; esac
    mask "$unit"
  done
done

# Units reached by other paths (timers' services, static units, templates, generators' targets).
for unit in systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service \
  systemd-tmpfiles-setup-dev-early.service systemd-tmpfiles-clean.service systemd-tmpfiles-clean.timer \
  systemd-sysusers.service systemd-sysctl.service systemd-modules-load.service systemd-binfmt.service \
  proc-sys-fs-binfmt_misc.automount proc-sys-fs-binfmt_misc.mount systemd-remount-fs.service \
  ldconfig.service systemd-journal-flush.service systemd-journal-catalog-update.service \
  systemd-update-utmp.service systemd-update-utmp-runlevel.service systemd-random-seed.service \
  systemd-machine-id-commit.service systemd-firstboot.service systemd-hwdb-update.service \
  systemd-update-done.service kmod-static-nodes.service systemd-udevd.service systemd-udev-trigger.service \
  systemd-udev-settle.service systemd-pstore.service systemd-boot-update.service systemd-logind.service \
  systemd-user-sessions.service console-getty.service getty.target getty-static.service tmp.mount \
  systemd-fsck-root.service systemd-fsck@.service systemd-growfs-root.service systemd-growfs@.service \
  systemd-quotacheck.service quotaon.service systemd-repart.service systemd-timesyncd.service \
  systemd-networkd.service systemd-networkd-wait-online.service systemd-resolved.service \
  networking.service NetworkManager.service NetworkManager-wait-online.service dbus.service dbus.socket \
  apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer man-db.timer dpkg-db-backup.timer \
  logrotate.timer; do
  mask "$unit"
done

cat >/run/systemd/system/sandbox.target <<'UNIT'
[Unit]
Description=Private systemd for ctxmgr tests and demos
Wants=systemd-journald.socket systemd-journald.service
UNIT

unset SANDBOX_ROOTFS SANDBOX_BINDS SANDBOX_PYTHON SANDBOX_LOADER SANDBOX_LIBRARY_PATH
export container=unshare
systemd=/lib/systemd/systemd
[ -x "$systemd" ] || systemd=/usr/lib/systemd/systemd
# In a container systemd reads its "kernel command line" from PID 1's argv: fstab=no keeps the fstab
# generator from making mount units for the host's file systems.
exec "$systemd" --system --unit=sandbox.target fstab=no systemd.getty_auto=no
