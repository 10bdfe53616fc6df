# %pre (rpm runs this with /bin/sh; $1: 1 on install, 2 on upgrade).
# The service runs as the system user inferd (home /var/lib/inferd, made in %post with the
# model repository); as Fedora's guidelines ask, it stays when the package is removed.
getent group inferd >/dev/null || groupadd -r inferd
getent passwd inferd >/dev/null ||
    useradd -r -g inferd -d /var/lib/inferd -s /sbin/nologin -c "inferd ONNX inference server" inferd
exit 0
