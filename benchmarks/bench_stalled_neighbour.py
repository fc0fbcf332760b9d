#!/usr/bin/python3
"""Two automatic graphs on one runtime, one of them held back by its reader: does the other
get the runtime's cores back? (issue 17: graphs share a runtime's budget by their demand.)

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_stalled_neighbour.py \
        [--items 1500] [--stall 8] [--rounds 2]

Graph A: indices >> stage(work, concurrency="auto") >> pull_sink, read as fast as it comes;
graph B: the same graph, whose reader takes 20 items and then sleeps --stall seconds (its pull
sink fills, its stage waits for room). `work` inverts a 200x200 matrix in numpy (which releases
the GIL: about 2x faster on two threads). Each round runs A beside B, then A alone, and prints
A's rate and the concurrency its stage ended at; "beside / alone" is the rate A keeps with a
stalled neighbour. Before the paced demand, B kept its share and A ran on one core of two.
"""
import argparse
import os
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # (numpy's own threads would blur the cores)

import numpy as np  # noqa: E402
import splitflow as sf  # noqa: E402

_M = np.random.default_rng(0).random((200, 200))
_M = _M @ _M.T + 200 * np.eye(200)


def work(i):
    return float(np.linalg.inv(_M)[0, 0])


def graph(rt, name, items):
    g = sf.Graph(rt, name)
    out = g.pull_sink("out")
    g.indices("src", range(items)) >> g.stage("work", work, concurrency="auto") >> out
    return g, out


def run_a(rt, items, result):
    g, out = graph(rt, "A", items)
    t = time.perf_counter()
    it = g.iterate(out)
    n = sum(1 for _ in it)
    seconds = time.perf_counter() - t
    stage = next(s for s in it.run.stats()["stages"] if s["name"] == "work")
    result.update(rate=n / seconds, concurrency=stage["concurrency_limit"],
                  events=it.run.stats()["autotune"])


def run_b(rt, stall):
    g, out = graph(rt, "B", 400)
    for k, _ in enumerate(g.iterate(out), 1):
        if k == 20:
            time.sleep(stall)


def one(items, stall, beside):
    rt = sf.Runtime(threads=2)
    result = {}
    threads = [threading.Thread(target=run_a, args=(rt, items, result))]
    if beside:
        b = threading.Thread(target=run_b, args=(rt, stall))
        b.start()
        time.sleep(0.5)  # (B's reader stalled before A starts: the case measured)
    threads[0].start()
    threads[0].join()
    if beside:
        b.join()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1500)
    ap.add_argument("--stall", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-v", action="store_true", help="print graph A's tuner events")
    args = ap.parse_args()
    print(f"{'round':>5} {'A beside B':>16} {'A alone':>16} {'beside / alone':>15}")
    for r in range(1, args.rounds + 1):
        beside = one(args.items, args.stall, True)
        alone = one(args.items, args.stall, False)
        print(f"{r:>5} {beside['rate']:>9.1f} /s ({beside['concurrency']}) "
              f"{alone['rate']:>9.1f} /s ({alone['concurrency']}) "
              f"{beside['rate'] / alone['rate']:>15.2f}")
        if args.v:
            for e in beside["events"]:
                print("     A:", e[:200])


if __name__ == "__main__":
    main()
