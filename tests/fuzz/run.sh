#!/usr/bin/env bash
# Runs the fuzz targets built by tests/fuzz/Makefile, one after another (each is one process).
#
#   run.sh smoke OUT SECONDS RUNS TARGET...   each target SECONDS on its seeds (new inputs go to
#                                             a scratch folder, removed), then every input under
#                                             tests/fuzz/regressions/TARGET/; fails on the first
#                                             finding
#   run.sh fuzz  OUT SECONDS RUNS TARGET...   each target SECONDS (TARGET:SECONDS for its own
#                                             time) or RUNS executions (-1: no count), its
#                                             corpus kept in OUT/corpus/TARGET;
#                                             prints and writes OUT/summary.txt: executions per
#                                             target and in total; fails if any target found
#                                             something (the input is in OUT/artifacts/TARGET/)
set -uo pipefail
mode=$1 out=$2 seconds=$3 runs=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
# -timeout: a slow input is a finding; -rss_limit_mb: the decoders' heap bound is checked by
# the targets themselves (fuzz_jpeg.hpp), below this.
opts=(-timeout=20 -rss_limit_mb=3072 -malloc_limit_mb=3072 -print_final_stats=1)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# Debian's clang-16 finds no symbolizer of its own: stacks with function names and lines.
for s in /usr/bin/llvm-symbolizer-16 /usr/lib/llvm-16/bin/llvm-symbolizer /usr/bin/llvm-symbolizer; do
  if [[ -z ${ASAN_SYMBOLIZER_PATH:-} && -x $s ]]; then export ASAN_SYMBOLIZER_PATH=$s; fi
done

executions() { sed -n 's/^stat::number_of_executed_units: *//p' "$1" | tail -1; }

case $mode in
smoke)
  start=$(date +%s)
  for t in "$@"; do
    scratch=$(mktemp -d)
    log=$out/smoke-$t.log
    if ! nice "$out/fuzz_$t" "${opts[@]}" -max_total_time="$seconds" -runs="$runs" \
        -artifact_prefix="$out/" "$scratch" "$out/seeds/$t" >"$log" 2>&1; then
      rm -rf "$scratch"
      tail -40 "$log"
      echo "fuzz smoke: $t found something (log $log)"
      exit 1
    fi
    rm -rf "$scratch"
    n=$(executions "$log")
    regressions=()
    if [[ -d $here/regressions/$t ]]; then
      while IFS= read -r -d '' f; do regressions+=("$f"); done < <(find "$here/regressions/$t" -type f ! -name '*.md' -print0 | sort -z)
    fi
    if ((${#regressions[@]})); then
      if ! nice "$out/fuzz_$t" "${opts[@]}" "${regressions[@]}" >>"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz smoke: $t fails a regression input (log $log)"
        exit 1
      fi
    fi
    echo "fuzz smoke: $t: $n executions in ${seconds}s, ${#regressions[@]} regression inputs replayed"
  done
  echo "fuzz smoke: all $# targets passed in $(($(date +%s) - start))s"
  ;;
fuzz)
  summary=$out/summary.txt
  status=0 total=0
  tmp=$(mktemp)
  {
    echo "# splitflow fuzzing: $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $(uname -m)"
    echo "# target executions seconds exec/s result"
  } >"$tmp"
  for arg in "$@"; do
    t=${arg%%:*} secs=$seconds
    [[ $arg == *:* ]] && secs=${arg#*:}
    mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
    log=$out/fuzz-$t.log
    echo "== fuzz_$t: ${secs}s (runs $runs), corpus $out/corpus/$t, log $log"
    t0=$(date +%s)
    nice "$out/fuzz_$t" "${opts[@]}" -max_total_time="$secs" -runs="$runs" \
      -artifact_prefix="$out/artifacts/$t/" "$out/corpus/$t" "$out/seeds/$t" >"$log" 2>&1
    rc=$?
    dt=$(($(date +%s) - t0))
    n=$(executions "$log")
    n=${n:-0}
    result=clean
    if ((rc != 0)); then
      result="FINDING (exit $rc; see $log and $out/artifacts/$t/)"
      status=1
      grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz check failed|.*runtime error)' "$log" | head -5
    fi
    total=$((total + n))
    echo "$t $n $dt $((n / (dt > 0 ? dt : 1))) $result" | tee -a "$tmp"
  done
  echo "total $total" | tee -a "$tmp"
  mv "$tmp" "$summary"
  echo "written: $summary"
  exit $status
  ;;
*)
  echo "usage: run.sh smoke|fuzz OUT SECONDS RUNS TARGET..." >&2
  exit 2
  ;;
esac
