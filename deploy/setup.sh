#!/bin/sh
# Installs what building and testing lockcell needs, only when it is missing:
# protoc (etcd-client's build needs it), etcd and etcdctl (the tests start real etcd).
set -eu

need=""
command -v protoc >/dev/null 2>&1 || need="$need protobuf-compiler"
command -v etcd >/dev/null 2>&1 || need="$need etcd-server"
command -v etcdctl >/dev/null 2>&1 || need="$need etcd-client"
[ -z "$need" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "lockcell setup: missing:$need" >&2
    echo "lockcell setup: install these Debian packages (or put protoc, etcd and etcdctl on PATH) and run again." >&2
    exit 1
fi
echo "lockcell setup: installing$need"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
