#!/usr/bin/env bash
# Build the mtpserve image where there is no Docker daemon and no container registry, only Debian's
# package mirrors and PyPI: a Debian stand-in for the Ray base image (mmdebstrap, then
# base-standin.Containerfile), then deploy/docker/Dockerfile on it with buildah, passing this machine's pip
# settings (indexes, wheel folders, CA bundle) into the build. Needs root, buildah and mmdebstrap
# (apt-get install buildah mmdebstrap).
#
#   deploy/docker/build-local.sh            # or: make image
#
# Environment (all optional):
#   MTPSERVE_IMAGE        tag of the result (default: the image the KubeRay manifests name)
#   BUILDAH_ROOT          buildah storage folder (default: buildah's own); BUILDAH_RUNROOT its run folder
#   MTPSERVE_IMAGE_CACHE  where the Debian root file system is kept between builds (~/.cache/mtpserve/image)
#   DEBIAN_SUITE, DEBIAN_MIRROR   the stand-in's Debian release and mirror (bookworm: Python 3.11, as py311)
#   TORCH_SPEC            torch requirement (default torch==2.13.0+cpu, the CPU wheel)
#   TORCH_INDEX_URL       extra index for torch (default PyTorch's CPU index, when its host resolves)
#   PYTHON                interpreter whose pip settings the build copies (default python3)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${MTPSERVE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mtpserve/image}
PACKAGES=python3,python3-venv,ca-certificates,passwd
TAG=${MTPSERVE_IMAGE:-$(sed -n 's/^ *image: *//p' deploy/k8s/base/rayjob.yaml | head -n 1)}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
if [[ -z ${TORCH_INDEX_URL+set} ]]; then
    TORCH_INDEX_URL=""
    if getent hosts download.pytorch.org >/dev/null; then
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    fi
fi

for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || { echo "build-local.sh: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "build-local.sh: run as root (buildah --isolation chroot, mmdebstrap)" >&2; exit 2; }

BUILDAH=(buildah --storage-driver vfs)
[[ -n ${BUILDAH_ROOT:-} ]] && BUILDAH+=(--root "$BUILDAH_ROOT" --runroot "${BUILDAH_RUNROOT:-$BUILDAH_ROOT.run}")
start=$SECONDS

# 1. The Debian root file system, kept under a name derived from everything that makes it.
key=$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" minbase tar | sha256sum | cut -c1-16)
rootfs_dir="$CACHE/debian-$SUITE-$key"
if [[ -f $rootfs_dir/rootfs.tar ]]; then
    echo "build-local.sh: cached root file system $rootfs_dir/rootfs.tar"
else
    echo "build-local.sh: mmdebstrap $SUITE ($PACKAGES) from $MIRROR"
    mkdir -p "$rootfs_dir"
    part="$rootfs_dir/rootfs.tar.$$.part"  # renamed into place whole, so a cut-off run leaves no tarball
    mmdebstrap --quiet --variant=minbase --format=tar --include="$PACKAGES" "$SUITE" "$part" "$MIRROR"
    mv -f "$part" "$rootfs_dir/rootfs.tar"
fi

# 2. The stand-in base image, named after the root file system and its Containerfile.
base_key=$( (echo "$key"; cat deploy/docker/base-standin.Containerfile) | sha256sum | cut -c1-16)
BASE="localhost/mtpserve-standin-base:$SUITE-$base_key"
if ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    echo "build-local.sh: stand-in base $BASE"
    "${BUILDAH[@]}" bud --isolation chroot --quiet -f "$REPO/deploy/docker/base-standin.Containerfile" \
        -t "$BASE" "$rootfs_dir" >/dev/null
fi

# 3. The project's Dockerfile on it, with this machine's pip settings.
mapfile -t PIP_ARGS < <("$PYTHON" -m mtpserve.deploy.pip_passthrough)
echo "build-local.sh: building $TAG on $BASE (torch: $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL})"
"${BUILDAH[@]}" bud --isolation chroot -f deploy/docker/Dockerfile \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_SPEC="$TORCH_SPEC" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
    "${PIP_ARGS[@]}" -t "$TAG" .

size=$("${BUILDAH[@]}" images --format '{{.Size}}' "$TAG" | head -n 1)
echo "build-local.sh: built $TAG ($size) in $((SECONDS - start)) s"
