# %postun ($1: 0 on erase, 1 on upgrade).
# On erase, the package's folders that are now empty: rpm removes only the folders a package
# lists, and cargo-generate-rpm 0.21.1 cannot list folders. Models in /var/lib/inferd/models
# and an edited config (inferd.toml.rpmsave) keep theirs, as does the user inferd.
if [ "$1" -eq 0 ]; then
    for dir in /usr/lib/inferd /usr/share/doc/inferd/docs /usr/share/doc/inferd \
        /usr/share/licenses/inferd/onnxruntime /usr/share/licenses/inferd /etc/inferd \
        /var/lib/inferd/models /var/lib/inferd; do
        rmdir "$dir" 2>/dev/null || :
    done
fi

# What %systemd_postun_with_restart does: forget the removed units, and on an upgrade restart
# a running inferd so it runs the new binary and library (try-restart leaves a stopped service
# stopped; with inferd.socket active, no connection is refused meanwhile), unless the new
# package's %post put it into service in place already (`inferd upgrade`).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        if [ -e /run/inferd-upgraded-in-place ]; then
            rm -f /run/inferd-upgraded-in-place
        else
            systemctl try-restart inferd.service >/dev/null 2>&1 || :
        fi
    fi
fi
exit 0
