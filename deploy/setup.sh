#!/bin/sh
# Installs what building and testing lockcell needs, only when it is missing:
# protoc (etcd-client's build needs it), etcd and etcdctl (the tests start real etcd).
#
# Also, when missing, libfaketime (the Debian package faketime), which the fault runs'
# clock faults preload, and the servers only the audit store tests use: clickhouse-server
# (Debian package) and the S3-compatible moto server (PyPI, into a virtualenv at
# .lockcell-tools/venv), kubernetes-validate (PyPI, same virtualenv), which checks
# the manifests of deploy/kubernetes/ against the Kubernetes schemas it bundles, offline,
# promtool (the Debian package prometheus), which runs the alert rules' unit tests,
# the etcd client aetcd with its own test suite (PyPI, same virtualenv), and podman,
# runc and mmdebstrap (Debian packages) with the container image's base built from
# Debian's packages, for `make image` and the test that runs the image.
# These are optional: if they cannot be installed, setup says so and succeeds, and
# those tests report themselves skipped.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.lockcell-tools/venv"

can_apt() {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1
}

apt_updated=""
apt_install() {
    if [ -z "$apt_updated" ]; then
        apt-get update -qq || return 1
        apt_updated=yes
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Mandatory: building and the etcd tests fail without these.
need=""
command -v protoc >/dev/null 2>&1 || need="$need protobuf-compiler"
command -v etcd >/dev/null 2>&1 || need="$need etcd-server"
command -v etcdctl >/dev/null 2>&1 || need="$need etcd-client"
if [ -n "$need" ]; then
    if ! can_apt; then
        echo "lockcell setup: missing:$need" >&2
        echo "lockcell setup: install these Debian packages (or put protoc, etcd and etcdctl on PATH) and run again." >&2
        exit 1
    fi
    echo "lockcell setup: installing$need"
    # shellcheck disable=SC2086
    apt_install $need
fi

# Optional: ClickHouse for the audit store tests.
if ! command -v clickhouse-server >/dev/null 2>&1 && ! command -v clickhouse >/dev/null 2>&1 && [ ! -x /usr/sbin/clickhouse-server ]; then
    if can_apt && echo "lockcell setup: installing clickhouse-server" && apt_install clickhouse-server; then
        :
    else
        echo "lockcell setup: missing: clickhouse-server (Debian package); the ClickHouse audit store tests will be skipped" >&2
    fi
fi

# Optional: libfaketime for the fault runs' clock faults.
if [ ! -f /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] && [ ! -f /usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1 ]; then
    if can_apt && echo "lockcell setup: installing faketime" && apt_install faketime; then
        :
    else
        echo "lockcell setup: missing: faketime (Debian package); the fault runs' clock faults will be skipped" >&2
    fi
fi

# Optional: moto, an S3-compatible server, for the audit archive tests.
if [ ! -x "$venv/bin/moto_server" ]; then
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1 && can_apt; then
        echo "lockcell setup: installing python3-venv"
        apt_install python3 python3-venv || true
    fi
    echo "lockcell setup: installing moto[server] into $venv"
    if python3 -m venv "$venv" >/dev/null \
        && "$venv/bin/pip" install -q --disable-pip-version-check 'moto[server]>=5,<6' \
        && [ -x "$venv/bin/moto_server" ]; then
        :
    else
        echo "lockcell setup: missing: moto_server (PyPI moto[server] in $venv); the S3 audit archive tests will be skipped" >&2
    fi
fi

# Optional: kubernetes-validate for the deploy test. 1.37 bundles the schemas of
# Kubernetes 1.25 to 1.37; the test checks against 1.31 and the newest.
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    echo "lockcell setup: installing kubernetes-validate into $venv"
    if { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv" >/dev/null; } \
        && "$venv/bin/pip" install -q --disable-pip-version-check 'kubernetes-validate>=1.37,<1.38' \
        && [ -x "$venv/bin/kubernetes-validate" ]; then
        :
    else
        echo "lockcell setup: missing: kubernetes-validate (PyPI, in $venv); the deploy test's schema check will be skipped" >&2
    fi
fi

# Optional: the etcd client library aetcd and its own test suite (its PyPI source
# distribution ships tests/), which the e2e tests run unmodified against bare etcd.
aetcd_version=1.0.0
aetcd="$root/.lockcell-tools/aetcd-$aetcd_version"
if [ ! -d "$aetcd/tests/integration" ] \
    || ! "$venv/bin/python" -c 'import aetcd, pytest_asyncio, pytest_mock' >/dev/null 2>&1; then
    echo "lockcell setup: installing aetcd $aetcd_version and its test suite into $venv"
    sdist=$(mktemp -d)
    if { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv" >/dev/null; } \
        && "$venv/bin/pip" download -q --disable-pip-version-check --no-deps \
            --no-binary :all: -d "$sdist" "aetcd==$aetcd_version" \
        && "$venv/bin/pip" install -q --disable-pip-version-check \
            "$sdist/aetcd-$aetcd_version.tar.gz" 'pytest==9.0.3' 'pytest-asyncio==1.3.0' \
            'pytest-mock==3.15.1' \
        && tar -xzf "$sdist/aetcd-$aetcd_version.tar.gz" -C "$root/.lockcell-tools" \
        && [ -d "$aetcd/tests/integration" ]; then
        :
    else
        echo "lockcell setup: missing: aetcd $aetcd_version's test suite (PyPI, in $venv); the etcd client suite tests will be skipped" >&2
    fi
    rm -rf "$sdist"
fi

# Optional: promtool for the deploy test (the alert rules' unit tests). Only promtool is
# wanted: the Prometheus server the package also installs is stopped and disabled.
if ! command -v promtool >/dev/null 2>&1; then
    if can_apt && echo "lockcell setup: installing prometheus (for promtool)" \
        && apt_install --no-install-recommends prometheus \
        && command -v promtool >/dev/null 2>&1; then
        if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
            systemctl disable --now prometheus >/dev/null 2>&1 || true
        elif command -v invoke-rc.d >/dev/null 2>&1; then
            invoke-rc.d prometheus stop >/dev/null 2>&1 || true
        fi
    else
        echo "lockcell setup: missing: promtool (Debian package prometheus); the deploy test's alert rule tests will be skipped" >&2
    fi
fi

# Optional: podman to build and run the container image, runc where podman's default
# runtime cannot start containers, mmdebstrap to build the image's base from Debian's
# packages (no registry needed), and that base (about a minute, once).
if ! command -v podman >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1 \
    || ! command -v runc >/dev/null 2>&1; then
    if can_apt && echo "lockcell setup: installing podman, runc and mmdebstrap" \
        && apt_install podman runc mmdebstrap; then
        :
    else
        echo "lockcell setup: missing: podman, runc or mmdebstrap (Debian packages); make image cannot run and the image test will be skipped" >&2
    fi
fi
if command -v podman >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1; then
    sh "$root/deploy/image/image.sh" base \
        || echo "lockcell setup: the container image's base could not be built; the image test will be skipped" >&2
fi
exit 0
