#!/bin/bash
# Re-measures BM_ChainHop on earlier versions, interleaved in one session, for the history table
# of docs/benchmarks.md ("The chain hop").
#
#   scripts/bench-history.sh [--runs N] COMMIT...     (HEAD's own build: build/release)
#   scripts/bench-history.sh --image DIR [--runs N] COMMIT...
#
# --image DIR: the C++ image pipeline instead (image_pipeline, image_pipeline_bench since it was
# renamed), `pipeline DIR` on each version, and HEAD's `ceiling DIR` (libjpeg-turbo decode alone,
# on all cores) once per round as the same-session baseline; prints images/s and the fraction of
# the ceiling. A version older than the image benchmark (8831b28) gets benchmarks/ from 45bfb89.
#
# Each COMMIT is checked out in a worktree under build/history/ and its bench_chain_hop built
# (Release, no tests or examples); a version older than the benchmark (de7e805) gets
# benchmarks/ from 72e449d, the commit that added it, whose benchmark code is the same as now's
# but for the trace variant. Then N rounds run every version once, in the order given, and print
# splitflow's and parallel_pipeline's ns per item-stage and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
image=
if [[ "${1:-}" == --image ]]; then image=$2; shift 2; fi
if [[ "${1:-}" == --runs ]]; then runs=$2; shift 2; fi
if [[ -n $image ]]; then
  target=image_pipeline first=45bfb89 bench=benchmarks/image_pipeline.cpp
else
  target=bench_chain_hop first=72e449d bench=benchmarks/bench_chain_hop.cpp
fi
[[ $# -gt 0 ]] || { echo "usage: $0 [--runs N] COMMIT..." >&2; exit 2; }
root=build/history
mkdir -p "$root"
bins=()
for c in "$@"; do
  if [[ "$c" == HEAD ]]; then
    if [[ -n $image ]]; then bins+=(build/release/benchmarks/image_pipeline_bench)
    else bins+=(build/release/benchmarks/bench_chain_hop); fi
    [[ -x ${bins[-1]} ]] || { echo "$0: build HEAD first (make build)" >&2; exit 1; }
    continue
  fi
  c=$(git rev-parse --short "$c")
  wt=$root/$c
  if [[ ! -d $wt ]]; then
    git worktree add -f --detach "$wt" "$c" >/dev/null
  fi
  t=$target
  if [[ -n $image && -f $wt/benchmarks/image_pipeline_bench.cpp ]]; then
    t=image_pipeline_bench  # the benchmark's name since it was renamed
  elif [[ ! -f $wt/$bench ]]; then
    git -C "$wt" checkout "$first" -- benchmarks
  fi
  if [[ ! -x $wt/b/benchmarks/$t ]]; then
    cmake -S "$wt" -B "$wt/b" -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_BUILD_TESTS=OFF \
      -DSPLITFLOW_BUILD_EXAMPLES=OFF >"$wt/configure.log" 2>&1
    cmake --build "$wt/b" -j2 --target $t >"$wt/build.log" 2>&1 ||
      { echo "$0: $c did not build; see $wt/build.log" >&2; exit 1; }
  fi
  bins+=("$wt/b/benchmarks/$t")
done
if [[ -n $image ]]; then
  ceiling=build/release/benchmarks/image_pipeline_bench
  [[ -x $ceiling ]] || { echo "$0: build HEAD first (make build): its ceiling is the baseline" >&2; exit 1; }
  rate() { sed -n 's/.*"images_per_s": \([0-9.]*\).*/\1/p' <<<"$1" | tail -1; }
  printf '%-10s %4s %12s %12s %9s\n' version run images/s ceiling fraction
  for ((r = 1; r <= runs; r++)); do
    ceil=$(rate "$("$ceiling" ceiling "$image" 2>/dev/null)")
    i=0
    for c in "$@"; do
      ips=$(rate "$("${bins[$i]}" pipeline "$image" 2>/dev/null)")
      printf '%-10s %4d %12.0f %12.0f %9.2f\n' "$c" "$r" "$ips" "$ceil" \
        "$(awk -v a="$ips" -v b="$ceil" 'BEGIN { print a / b }')"
      i=$((i + 1))
    done
  done
  exit 0
fi
printf '%-10s %4s %12s %18s %7s\n' version run splitflow parallel_pipeline ratio
for ((r = 1; r <= runs; r++)); do
  i=0
  for c in "$@"; do
    out=$("${bins[$i]}" --benchmark_min_time=1 --benchmark_filter='splitflow/|parallel_pipeline' 2>&1)
    sf=$(grep 'BM_ChainHop/splitflow/' <<<"$out" | sed 's/.*ns_per_item_stage=\([0-9.]*\)ns.*/\1/')
    pp=$(grep 'tbb_parallel_pipeline' <<<"$out" | sed 's/.*ns_per_item_stage=\([0-9.]*\)ns.*/\1/')
    printf '%-10s %4d %12.1f %18.1f %7.2f\n' "$c" "$r" "$sf" "$pp" "$(awk -v a="$sf" -v b="$pp" 'BEGIN { print a / b }')"
    i=$((i + 1))
  done
done
