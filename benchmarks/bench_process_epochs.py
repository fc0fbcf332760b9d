"""A GraphDataset's processes=N stage from epoch to epoch: each epoch's wall time with the
workers kept across epochs (the dataset's pool scope, the default) and with a fresh pool each
epoch (what the dataset did before: a spawn and the function's imports per worker per epoch),
in turn, in one process.

    PYTHONPATH=build/release/python python3 benchmarks/bench_process_epochs.py [--epochs 4]
"""
import argparse
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/python/tests")  # procs_fns: importable by workers

import procs_fns as fns  # noqa: E402
import splitflow._procs as procs  # noqa: E402
import splitflow.torch as sft  # noqa: E402


def build(g, src):
    return src >> g.stage("square", fns.square, processes=2)


def epochs(kept, n):
    ds = sft.GraphDataset(build, 64, shuffle=True, threads=2, backend="host", to_torch=False)
    if not kept:
        ds._pools = lambda: procs.PoolScope()  # a scope per epoch: nothing kept
    times = []
    for e in range(n):
        ds.set_epoch(e)
        t0 = time.perf_counter()
        got = list(ds)
        times.append(time.perf_counter() - t0)
        assert sorted(got) == sorted(i * i for i in range(64))
    ds._pools().close() if kept else None
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for r in range(a.rounds):
        for kept in (True, False):
            t = epochs(kept, a.epochs)
            later = statistics.median(t[1:])
            print(f"round {r + 1} {'kept ' if kept else 'fresh'}: first epoch {t[0]:.3f} s, "
                  f"later epochs median {later:.3f} s ({', '.join(f'{x:.3f}' for x in t)})")


if __name__ == "__main__":
    main()
