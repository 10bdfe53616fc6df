# %preun ($1: 0 on erase, 1 on upgrade). Stop and disable only when the package goes away:
# on an upgrade the service keeps running and %postun restarts it on the new files.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now inferd.socket inferd.service >/dev/null 2>&1 || :
fi
exit 0
