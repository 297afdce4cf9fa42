#!/bin/sh
# Builds lockcell's container image with podman (docs/deployment.md, "The image").
#
#   image.sh name              the image's name and tag, from deploy/kubernetes/kustomization.yaml
#   image.sh base              builds the base image from Debian's packages (mmdebstrap), if absent
#   image.sh build BINS [TAG]  builds the image from the binaries in folder BINS, tagged TAG
#                              (default: `image.sh name`), on the base (built first if absent)
#   image.sh run-flags         what `podman run` needs on this machine besides its arguments
#
# BASE names another base image (for example one from your registry); then `base` is
# not built. Run from anywhere: BINS is a path from the current folder.
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
default_base=localhost/lockcell-base:bookworm
base=${BASE:-$default_base}

die() {
    echo "image.sh: $*" >&2
    exit 1
}

need_podman() {
    command -v podman >/dev/null 2>&1 || die "no podman: install the podman package (make setup does)"
}

# The name and tag kustomize gives the manifests' `lockcell` image.
name() {
    k="$root/deploy/kubernetes/kustomization.yaml"
    new_name=$(sed -n 's/^ *newName: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$k")
    new_tag=$(sed -n 's/^ *newTag: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$k")
    [ -n "$new_name" ] && [ -n "$new_tag" ] || die "no images entry with newName and newTag in $k"
    echo "$new_name:$new_tag"
}

# Debian's minimal installable system (minbase: dpkg, apt and the essential tools)
# plus curl and the CA certificates, without documentation, man pages or locales.
build_base() {
    if podman image exists "$base"; then
        return 0
    fi
    [ "$base" = "$default_base" ] || die "base image $base is not here: pull it first (podman pull $base)"
    command -v mmdebstrap >/dev/null 2>&1 || die "no mmdebstrap: install the mmdebstrap package (make setup)"
    tarball=$(mktemp --suffix=.tar)
    trap 'rm -f "$tarball"' EXIT
    echo "image.sh: building the base $base from Debian bookworm's packages"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates,curl \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
        bookworm "$tarball"
    podman import --quiet --change 'CMD ["/bin/sh"]' "$tarball" "$base" >/dev/null
    rm -f "$tarball"
    trap - EXIT
}

# Most machines need no flags. Where podman's default runtime cannot start a container
# (crun refuses cgroups v1 and v2 mounted together, and a runtime may not raise the
# open files limit past this shell's), runc with the limits this shell has can.
run_flags() {
    podman image exists "$base" || die "no base image $base: run \`$0 base\` first"
    if podman run --rm --network none "$base" true >/dev/null 2>&1; then
        return 0
    fi
    files=$(ulimit -Hn)
    flags="--runtime runc --ulimit nofile=$files:$files --ulimit nproc=4096:4096"
    # shellcheck disable=SC2086
    if command -v runc >/dev/null 2>&1 && podman run --rm --network none $flags "$base" true >/dev/null 2>&1; then
        echo "$flags"
        return 0
    fi
    # shellcheck disable=SC2086
    why=$(podman run --rm --network none "$base" true 2>&1 | tail -n 1)
    die "podman cannot run a container here: $why"
}

build() {
    bins=$1
    tag=${2:-$(name)}
    for bin in lockcell-proxy lockcell-cell lockctl; do
        [ -e "$bins/$bin" ] || die "no $bins/$bin: build the binaries first (cargo build --release --workspace --bins)"
        [ -x "$bins/$bin" ] || die "$bins/$bin is not executable"
    done
    version=$("$bins/lockctl" --version | sed -n 's/^lockctl //p')
    revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
    build_base
    flags=$(run_flags)
    # The build context is a folder of its own: the Containerfile and the binaries.
    context=$(mktemp -d)
    trap 'rm -rf "$context"' EXIT
    mkdir "$context/bins"
    cp "$root/Containerfile" "$context/"
    for bin in lockcell-proxy lockcell-cell lockctl; do
        cp "$bins/$bin" "$context/bins/"
    done
    before=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
    started=$(date +%s)
    # shellcheck disable=SC2086
    podman build --quiet $flags --build-arg BASE="$base" --build-arg BINS=bins \
        --label org.opencontainers.image.title=lockcell \
        --label org.opencontainers.image.version="$version" \
        --label org.opencontainers.image.revision="$revision" \
        --tag "$tag" "$context" >/dev/null
    took=$(($(date +%s) - started))
    # What the build leaves behind: the first stage, and the image the tag named before.
    podman image prune --force --filter label=org.lockcell.stage=binaries >/dev/null 2>&1 || true
    after=$(podman image inspect --format '{{.Id}}' "$tag")
    if [ -n "$before" ] && [ "$before" != "$after" ]; then
        podman rmi "$before" >/dev/null 2>&1 || true
    fi
    size=$(podman image inspect --format '{{.Size}}' "$tag")
    echo "image.sh: built $tag: $((size / 1000000)) MB, in ${took}s (on $base)"
}

case "${1:-}" in
name) name ;;
base)
    need_podman
    build_base
    ;;
build)
    [ $# -ge 2 ] || die "usage: image.sh build BINS [TAG]"
    need_podman
    build "$2" "${3:-}"
    ;;
run-flags)
    need_podman
    run_flags
    ;;
*) die "usage: image.sh name | base | build BINS [TAG] | run-flags" ;;
esac
