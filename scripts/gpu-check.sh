#!/usr/bin/env bash
# The device check, for a machine with an NVIDIA GPU: the CUDA tests (C++ and Python), the
# DLPack stream control, the GPU benchmarks and the consolidation demo, then every other test.
# Each step has a time limit, so one short run is enough when a GPU is lent.
#   OUT=DIR scripts/gpu-check.sh                    build here with CUDA (sm_90 + PTX); needs the
#                                                   Debian packages of scripts/install-deps.sh
#   OUT=DIR scripts/gpu-check.sh --prebuilt STAGE   run what scripts/stage-gpu-check.sh staged
#                                                   (unpacked in STAGE), for a machine that has the
#                                                   driver but not those packages
# Results: $OUT/summary.txt (one line per step), $OUT/goals.txt, $OUT/logs.tgz (every log and
# benchmark JSON, under logs/). Default OUT: build/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-check}
LOGS=$(mktemp -d)/logs  # packed into $OUT/logs.tgz after every step (a killed run keeps them)
mkdir -p "$OUT" "$LOGS"
: >"$OUT/summary.txt"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

# step NAME LIMIT_S CMD...: runs CMD with a time limit, its output in $LOGS/NAME.log; logs the exit
# status, the seconds taken and, for Google Test binaries, the counts and the failed tests.
step() {
  local name=$1 limit=$2 t0 rc extra=""
  shift 2
  t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && extra=" TIMED OUT after ${limit}s"
  if grep -q '^\[==========\]' "$LOGS/$name.log"; then
    tests_marked() { grep "^\\[ *$1 *\\] [A-Za-z]" "$LOGS/$name.log" | awk '{print $4}' | sort -u; }
    extra+=" $(tests_marked OK | wc -l) ok, $(tests_marked SKIPPED | wc -l) skipped,"
    extra+=" $(tests_marked FAILED | wc -l) failed $(tests_marked FAILED | tr '\n' ' ')"
  fi
  [ "${name#pytest}" != "$name" ] && extra+=" $(tail -n 1 "$LOGS/$name.log")"
  log "$name rc=$rc $(( ($(date +%s%N) - t0) / 1000000 )) ms$extra"
  tar czf "$OUT/.logs.$name.tgz" -C "$(dirname "$LOGS")" logs && mv -f "$OUT/.logs.$name.tgz" "$OUT/logs.tgz"
  return $rc
}

if [ "${1:-}" = "--prebuilt" ]; then
  stage=$(realpath "$2")
  TESTS=$stage/bin BENCH=$stage/bin EXAMPLES=$stage/bin PYPATH=$stage/python IMAGES=$stage/images
  PY=${PY:-python3}
  export LD_LIBRARY_PATH=$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # The machine's own libstdc++ unless it is older than the one the binaries were built with.
  if ! "$TESTS/test_cuda" --gtest_list_tests >/dev/null 2>&1; then
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$stage/lib-fallback
    log "using the staged libstdc++"
  fi
  log "prebuilt: $(head -n 1 "$stage/commit.txt")"
else
  scripts/install-deps.sh >"$LOGS/deps.log" 2>&1 || log "install-deps failed (offline?): see deps.log"
  log "configure + build (CUDA ON, sm_90 + PTX)"
  if ! cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_WITH_CUDA=ON >"$LOGS/configure.log" 2>&1 ||
     ! cmake --build build/gpu -j"$(nproc)" >"$LOGS/build.log" 2>&1; then
    log "build FAILED"; tail -n 40 "$LOGS/build.log" "$LOGS/configure.log"; exit 1
  fi
  TESTS=build/gpu/tests BENCH=build/gpu/benchmarks EXAMPLES=build/gpu/examples
  PYPATH=build/gpu/python PY=/usr/bin/python3 IMAGES=build/demo-data/images-480
  [ -d "$IMAGES" ] || PYTHONPATH=$PYPATH $PY benchmarks/bench_images.py --only-data --images 480 \
    --data build/demo-data/images >"$LOGS/images.log" 2>&1
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi: none"
  nvcc --version 2>&1 | tail -n 2 || echo "nvcc: none"
  echo "cores: $(nproc)"
  grep PRETTY_NAME /etc/os-release
  ldd --version | head -n 1
  $PY -c 'import sys, torch, numpy; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), "numpy", numpy.__version__)'
} >"$LOGS/machine.txt" 2>&1
log "machine: $(sed -n 3p "$LOGS/machine.txt")"

export PYTHONPATH=$PYPATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The CUDA parts first: they are what this machine is for.
step test_cuda 120 "$TESTS/test_cuda"
step pytest_cuda 150 $PY -m pytest -q -rs -p no:cacheprovider python/tests/test_cuda.py
step dlpack_control 90 $PY scripts/dlpack_stream_control.py && log "$(cat "$LOGS/dlpack_control.log" | tr '\n' ' ')"
step bench_consolidation 150 "$BENCH/bench_consolidation" --benchmark_out="$LOGS/bench_consolidation.json" --benchmark_out_format=json
SPLITFLOW_BENCH_BACKEND=cuda step bench_ring_handoff 150 "$BENCH/bench_ring_handoff" --benchmark_out="$LOGS/bench_ring_handoff.json" --benchmark_out_format=json
step bench_inference 200 "$BENCH/bench_inference" --benchmark_out="$LOGS/bench_inference.json" --benchmark_out_format=json
# Jobs as separate processes sharing the GPU through the arbiter (docs/sharing.md), without MPS
# (kernels of different processes time-slice), then with the MPS control daemon running.
SPLITFLOW_BENCH_BACKEND=cuda step bench_shared_device 200 "$BENCH/bench_shared_device" --benchmark_out="$LOGS/bench_shared_device.json" --benchmark_out_format=json
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  if nvidia-cuda-mps-control -d; then
    SPLITFLOW_BENCH_BACKEND=cuda step bench_shared_device_mps 200 "$BENCH/bench_shared_device" --benchmark_out="$LOGS/bench_shared_device_mps.json" --benchmark_out_format=json
    echo quit | nvidia-cuda-mps-control
  else
    log "MPS: the control daemon did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  log "MPS: nvidia-cuda-mps-control not found"
fi
step demo 150 "$EXAMPLES/consolidation" "$IMAGES" "$LOGS/demo"
step inference_server 120 "$EXAMPLES/inference_server"
$PY benchmarks/summary.py "$LOGS" >"$OUT/goals.txt" 2>&1 && log "goals: $OUT/goals.txt"

# Then every other test (most run on the host backend, some on whatever the machine has).
for t in "$TESTS"/test_*; do
  case $(basename "$t") in test_cuda|*.cmake) continue ;; esac
  step "$(basename "$t")" 180 "$t" &
done
wait
step pytest_core 240 $PY -m pytest -q -rs -p no:cacheprovider python/tests/test_core.py

tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" logs
