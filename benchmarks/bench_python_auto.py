#!/usr/bin/python3
"""Python stages on concurrency="auto" against a grid of hand-set concurrencies, in the same run
(issue 17: "GIL share of Python bodies on auto"; docs/autotune.md, "Python functions on auto").

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_python_auto.py \
        [--rounds 3] [--epochs 2] [--json out.json]

Two graphs of one Python stage each, on a runtime of 2 threads, read by a loop:
- "gil": a pure-Python loop (about 1 ms an item) that holds the GIL throughout: a second thread
  only waits for it; the fewest threads that reach the rate are 1.
- "numpy": a numpy sort (about 5 ms an item) that releases the GIL while it sorts: two threads
  run two items at once.
- "shared": the pure-Python loop on auto after a stage of the same loop whose concurrency its
  user set (1): the two hold the GIL in turn, and the tuned stage has what the other leaves of it
  (the model's "N% of it left by the Python bodies outside the model").
Each round runs concurrency 1, 2 and "auto" (the order reversed every other round), --epochs
epochs each (a graph of one name: the tuner's warm start carries over), each configuration's
figure its best epoch. Per graph it prints the median over the rounds of auto's rate over the
best of (1, 2), and auto's threads at its last epoch's end; goals: "numpy" >= 0.95 of the best,
"gil" the fewest threads that reach 0.95 of it (its rates move by a quarter from epoch to epoch
of one setting, with the interpreter's handing the GIL to the reading thread: its ratio is
stated, not judged). For every graph on auto it also prints the tuner's last rate over its
model's bound ("converged at R items/s, X of the bound"; a model that had the whole GIL for the
tuned stage bounds it at one over its holds per item: that figure too).
"""
import argparse
import json
import re
import statistics
import time

import numpy as np

import splitflow as sf

ARRAY = np.random.default_rng(0).random(60_000)


def pure_python(i):
    s = 0
    for k in range(60_000):  # ~1 ms of the interpreter, the GIL held throughout
        s += k
    return i


def numpy_sort(i):
    np.sort(ARRAY, kind="stable")  # ~5 ms; numpy releases the GIL while it sorts
    return i


BODIES = {"gil": (pure_python, 1500), "numpy": (numpy_sort, 400), "shared": (pure_python, 800)}


def epoch(rt, which, concurrency):
    body, n = BODIES[which]
    g = sf.Graph(rt, f"{which}-{concurrency}")  # one name per configuration: its own warm start
    out = g.pull_sink("out")
    src = g.indices("i", list(range(n)))
    if which == "shared":
        src = src >> g.stage("pre", body, concurrency=1)
    src >> g.stage("work", body, concurrency=concurrency) >> out
    run = g.run()
    start = time.perf_counter()
    count = sum(1 for _ in out)
    rate = count / (time.perf_counter() - start)
    assert run.wait(timeout=600) == "succeeded" and count == n
    st = run.stats()
    work = next(s for s in st["stages"] if s["name"] == "work")
    return rate, work["concurrency_limit"], st["autotune"]


def bound_figures(events):
    """The tuner's last rate over its bound, and over one over the tuned stages' GIL holds per
    item (what a model that gave them the whole GIL would bound them at); None where absent."""
    over_bound = over_holds = None
    for e in events:
        m = re.search(r"at ([\d.e+]+) items/s, ([\d.]+) of the bound", e)
        if m:
            over_bound = float(m.group(2))
            h = re.search(r"held ([\d.]+) (us|ms) per item", e)
            if h:
                held = float(h.group(1)) * (1e-6 if h.group(2) == "us" else 1e-3)
                over_holds = float(m.group(1)) * held
    return over_bound, over_holds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = sf.Runtime(threads=2, backend="host")
    result = {}
    for which in BODIES:
        ratios, threads, best_k, fewest, over_bound, over_holds = [], [], [], [], [], []
        for r in range(args.rounds):
            configs = [1, 2, "auto"] if r % 2 == 0 else ["auto", 2, 1]
            rates, last = {}, None
            for c in configs:
                best = 0.0
                for _ in range(args.epochs):
                    rate, k, events = epoch(rt, which, c)
                    best = max(best, rate)
                    if c == "auto":
                        last = (k, events)
                rates[c] = best
            grid_best = max(rates[1], rates[2])
            ratios.append(rates["auto"] / grid_best)
            threads.append(last[0])
            best_k.append(1 if rates[1] >= rates[2] else 2)
            fewest.append(1 if rates[1] >= 0.95 * grid_best else 2)
            ob, oh = bound_figures(last[1])
            if ob is not None:
                over_bound.append(ob)
            if oh is not None:
                over_holds.append(oh)
            print(f"{which} round {r}: 1: {rates[1]:.0f}/s, 2: {rates[2]:.0f}/s, auto: "
                  f"{rates['auto']:.0f}/s ({ratios[-1]:.3f} of the grid's best), auto's threads "
                  f"at the end {last[0]}", flush=True)
            if r == args.rounds - 1:
                for e in last[1]:
                    print(f"    {e}")
        result[which] = {"rate_over_best_grid": statistics.median(ratios),
                         "auto_threads": statistics.median(threads),
                         "fewest_threads": min(fewest), "ratios": ratios,
                         "rate_over_model_bound": statistics.median(over_bound) if over_bound else None,
                         "rate_over_whole_gil_bound": statistics.median(over_holds) if over_holds else None}
        print(f"{which}: auto / best of the grid, median of {args.rounds} rounds: "
              f"{result[which]['rate_over_best_grid']:.3f} (goal >= 0.95); auto's threads "
              f"{result[which]['auto_threads']:g}, the fewest reaching 0.95 of the best "
              f"{result[which]['fewest_threads']}", flush=True)
        if over_bound:
            print(f"{which}: the tuner's last rate / its model's bound, median: "
                  f"{result[which]['rate_over_model_bound']:.2f}"
                  + (f"; / one over the tuned stage's GIL holds: {result[which]['rate_over_whole_gil_bound']:.2f}"
                     if over_holds else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
