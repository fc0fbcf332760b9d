#!/bin/bash
# Re-measures BM_ChainHop on earlier versions, interleaved in one session, for the history table
# of docs/benchmarks.md ("The chain hop").
#
#   scripts/bench-history.sh [--runs N] COMMIT...     (HEAD's own build: build/release)
#
# Each COMMIT is checked out in a worktree under build/history/ and its bench_chain_hop built
# (Release, no tests or examples); a version older than the benchmark (de7e805) gets
# benchmarks/ from 72e449d, the commit that added it, whose benchmark code is the same as now's
# but for the trace variant. Then N rounds run every version once, in the order given, and print
# splitflow's and parallel_pipeline's ns per item-stage and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
if [[ "${1:-}" == --runs ]]; then runs=$2; shift 2; fi
[[ $# -gt 0 ]] || { echo "usage: $0 [--runs N] COMMIT..." >&2; exit 2; }
root=build/history
mkdir -p "$root"
bins=()
for c in "$@"; do
  if [[ "$c" == HEAD ]]; then
    bins+=(build/release/benchmarks/bench_chain_hop)
    [[ -x ${bins[-1]} ]] || { echo "$0: build HEAD first (make build)" >&2; exit 1; }
    continue
  fi
  c=$(git rev-parse --short "$c")
  wt=$root/$c
  if [[ ! -d $wt ]]; then
    git worktree add -f --detach "$wt" "$c" >/dev/null
    if [[ ! -f $wt/benchmarks/bench_chain_hop.cpp ]]; then
      git -C "$wt" checkout 72e449d -- benchmarks
    fi
  fi
  if [[ ! -x $wt/b/benchmarks/bench_chain_hop ]]; then
    cmake -S "$wt" -B "$wt/b" -DCMAKE_BUILD_TYPE=Release -DSPLITFLOW_BUILD_TESTS=OFF \
      -DSPLITFLOW_BUILD_EXAMPLES=OFF >"$wt/configure.log" 2>&1
    cmake --build "$wt/b" -j2 --target bench_chain_hop >"$wt/build.log" 2>&1 ||
      { echo "$0: $c did not build; see $wt/build.log" >&2; exit 1; }
  fi
  bins+=("$wt/b/benchmarks/bench_chain_hop")
done
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
