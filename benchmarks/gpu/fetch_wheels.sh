#!/usr/bin/env bash
# Download the wheels that benchmarks/gpu/run.sh installs on a GPU machine with no network, into the
# ignored folder .whl/ at the repository root (or $1). Run here, where PyPI is reachable, in an
# environment that has torch (the DeepSpeed wheel is built from its sdist with --no-build-isolation,
# so the build finds torch without pulling a CUDA torch into an isolated build environment).
#
#   bash benchmarks/gpu/fetch_wheels.sh [DIR]     # then carry DIR with the device call
#
# The set is benchmarks/gpu/wheels.txt: exact pins for CPython 3.12 on manylinux x86_64.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
mkdir -p "$dest"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
mapfile -t pins < <(grep -v '^\s*#' benchmarks/gpu/wheels.txt | grep -v '^\s*$')
binary=()
for pin in "${pins[@]}"; do
    case "$pin" in deepspeed==*) deepspeed_pin=$pin ;; *) binary+=("$pin") ;; esac
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "${binary[@]}"
if [ -n "${deepspeed_pin:-}" ] && ! ls "$dest"/deepspeed-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$deepspeed_pin"
fi
# One version of each package, or the install on the device stops.
ls "$dest"/*.whl | sed 's#.*/##' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d | grep . \
    && { echo "several versions of one package in $dest" >&2; exit 1; }
echo "wheels in $dest: $(ls "$dest"/*.whl | wc -l) files, $(du -sh "$dest" | cut -f1)"
