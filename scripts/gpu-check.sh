#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU: builds with CUDA, runs every test (the
# CUDA tests run instead of skipping), and the GPU benchmarks; results go under $OUT (default
# build/gpu-check). Prepared so that one short run of it is enough when a GPU is lent.
#   usage: OUT=/some/dir scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: none"
  nvcc --version 2>&1 | tail -n 2 || echo "nvcc: none"
  nproc
} >"$OUT/machine.txt" 2>&1

# Debian packages are installed when the machine can reach a mirror; otherwise they must be there.
scripts/install-deps.sh >"$OUT/deps.log" 2>&1 || log "install-deps failed (offline?): see deps.log"

log "configure + build (CUDA ON, sm_90 + PTX)"
if ! cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_WITH_CUDA=ON >"$OUT/configure.log" 2>&1 ||
   ! cmake --build build/gpu -j"$(nproc)" >"$OUT/build.log" 2>&1; then
  log "build FAILED"; tail -n 40 "$OUT/build.log" "$OUT/configure.log"; exit 1
fi

log "tests (device tests included)"
(cd build/gpu && ctest --output-on-failure -j4 --timeout 300) >"$OUT/ctest.log" 2>&1
log "ctest rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
build/gpu/tests/test_cuda >"$OUT/test_cuda.log" 2>&1
log "test_cuda rc=$? $(grep -cE '^\[       OK' "$OUT/test_cuda.log") ok, $(grep -cE '^\[  SKIPPED' "$OUT/test_cuda.log") skipped"

for b in bench_consolidation bench_ring_handoff bench_chain_hop bench_inference; do
  log "$b"
  SPLITFLOW_BENCH_BACKEND=cuda build/gpu/benchmarks/$b --benchmark_out="$OUT/$b.json" \
    --benchmark_out_format=json >"$OUT/$b.txt" 2>&1
  log "$b rc=$?"
done
build/gpu/examples/consolidation >"$OUT/demo.txt" 2>&1
log "demo rc=$?"
/usr/bin/python3 benchmarks/summary.py "$OUT" >"$OUT/goals.txt" 2>&1 && log "goals: $OUT/goals.txt"
cat "$OUT/summary.txt"
