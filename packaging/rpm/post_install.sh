# %post ($1: 1 on install, 2 on upgrade).
# The model repository: owned by root and readable by the service's group, so the service
# can load models but not change them (a compromised worker cannot plant one); the operator
# puts models there as root. It is made here, not listed in the payload, because
# cargo-generate-rpm 0.21.1 cannot package an empty folder; only when missing, so an upgrade
# keeps the owner and mode an admin chose.
[ -d /var/lib/inferd ] || install -d -m 0755 -o root -g root /var/lib/inferd
[ -d /var/lib/inferd/models ] || install -d -m 0750 -o root -g inferd /var/lib/inferd/models

# What %systemd_post and %sysctl_apply do, without the macros (the package is built without
# rpmbuild): only where systemd is the running init, so an install into a container image or
# a chroot (rpm --root) does not fail.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    # Apply 99-inferd.conf now rather than at the next boot; a key the kernel lacks
    # (tcp_migrate_req on RHEL 8's 4.18) is reported and skipped by systemd-sysctl.
    /usr/lib/systemd/systemd-sysctl 99-inferd.conf >/dev/null 2>&1 || :
    # An upgrade of a running service: the new binary and library go into service by
    # `inferd upgrade` (docs/operations.md, "Upgrading inferd": no failed request, no cold
    # start), and the marker tells %postun not to restart it. If the upgrade fails, the old
    # supervisor serves as before and %postun restarts the service as it always did.
    # /etc/inferd/restart-on-upgrade opts out: a plain restart, as before this package.
    if [ "$1" -ge 2 ] && [ ! -e /etc/inferd/restart-on-upgrade ] && systemctl is-active --quiet inferd.service; then
        if /usr/bin/inferd upgrade --control-socket /run/inferd/control.sock; then
            touch /run/inferd-upgraded-in-place
        else
            echo "inferd: the upgrade in place failed (above); the service is restarted instead" >&2
        fi
    fi
fi
exit 0
