#!/usr/bin/env bash
# Stages a prebuilt device check for a GPU machine that has the CUDA driver but not splitflow's
# Debian packages (oneTBB, fmt, Google Benchmark, libjpeg) and cannot install them: the release
# build's tests, benchmarks and examples (CUDA backend on, sm_90 + PTX), the shared libraries
# they load, the Python module built for that machine's Python, and a few sample JPEGs, in one
# tarball. There, `scripts/gpu-check.sh --prebuilt STAGE_DIR` runs them.
#   usage: scripts/stage-gpu-check.sh OUT.tgz [PYTHON_FOR_THE_MODULE]
# PYTHON_FOR_THE_MODULE: an interpreter of the GPU machine's Python version (headers only are
# used: an extension module does not link libpython); without it the module is not staged.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1")
py=${2:-}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_WITH_CUDA=ON >/dev/null
cmake --build build/release -j"$(nproc)"
mkdir -p "$stage/bin" "$stage/lib" "$stage/lib-fallback" "$stage/python" "$stage/images"
cp build/release/tests/test_* build/release/tests/arbiter_member "$stage/bin/" 2>/dev/null || true
rm -f "$stage"/bin/*.cmake
cp build/release/benchmarks/bench_* build/release/examples/consolidation \
   build/release/examples/inference_server "$stage/bin/"
strip --strip-debug "$stage"/bin/*

# The libraries outside glibc and the compiler's runtime that the binaries load (CUDA's runtime
# is linked statically; the driver's libcuda is the machine's own).
for b in "$stage"/bin/*; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u | while read -r so; do
  case $(basename "$so") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
    libstdc++.so*|libgcc_s.so*) cp -L "$so" "$stage/lib-fallback/" ;;  # used only if theirs is older
    *) cp -L "$so" "$stage/lib/" ;;
  esac
done

if [ -n "$py" ]; then
  tag=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  cmake -S . -B "build/py$tag" -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_WITH_CUDA=ON \
    -DPython_EXECUTABLE="$py" -DSPLITFLOW_BUILD_TESTS=OFF -DSPLITFLOW_BUILD_BENCHMARKS=OFF \
    -DSPLITFLOW_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "build/py$tag" -j"$(nproc)" --target splitflow_python
  cp -r "build/py$tag/python/splitflow" "$stage/python/"
  strip --strip-debug "$stage"/python/splitflow/*.so
fi

# A few JPEGs for the consolidation demo (made with PIL by benchmarks/bench_images.py).
if [ ! -d build/demo-data/images-480 ]; then
  PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_images.py --only-data \
    --images 480 --data build/demo-data/images
fi
ls build/demo-data/images-480/*.jpg | head -n 96 | xargs cp -t "$stage/images/"

git rev-parse HEAD >"$stage/commit.txt"
git status --short >>"$stage/commit.txt"
mkdir -p "$(dirname "$out")"
tar czf "$out" -C "$stage" .
du -h "$out"
