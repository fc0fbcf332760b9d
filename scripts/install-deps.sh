#!/usr/bin/env bash
# Installs the Debian packages splitflow needs, only those missing. Idempotent; fast (one
# dpkg-query) when everything is there. Nothing else is downloaded at build time.
set -euo pipefail

packages=(
  # build
  cmake g++ make pkg-config
  # libraries
  libtbb-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
  # JPEG decode for the image ops (libjpeg-turbo: the TurboJPEG API, and libjpeg's for regions)
  libturbojpeg0-dev libjpeg62-turbo-dev
  # the fuzz targets (tests/fuzz/): clang 16's libFuzzer, ASan and UBSan
  clang-16 libclang-rt-16-dev
  # the TSan build of oneTBB is built from Debian's own source package (scripts/build-tsan-tbb.sh)
  dpkg-dev xz-utils
  # telemetry checks (tests/check_telemetry.py) and scripts/plot_run.py, run with /usr/bin/python3
  python3 python3-matplotlib
  # the Python module (python/): Debian's interpreter, pybind11, numpy, torch (CPU), pytest
  python3-dev pybind11-dev python3-numpy python3-torch python3-pytest
  # the property tests of the executor (python/tests/test_properties.py) and remote stages on
  # Dask distributed (python/splitflow/dask.py: real scheduler and worker processes)
  python3-hypothesis python3-distributed
  # the end-to-end image benchmark's baseline: DataLoader with torchvision transforms, PIL decode
  python3-torchvision python3-pil
)

missing=()
status=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${packages[@]}" 2>/dev/null || true)
for p in "${packages[@]}"; do
  grep -q "^$p ii" <<<"$status" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# Update the lists only if a package is unknown to them (a fresh machine), not every time.
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
  $sudo apt-get update -q
fi
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
