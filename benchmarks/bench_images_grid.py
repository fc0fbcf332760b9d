#!/usr/bin/python3
"""The image pipeline from Python with every stage's concurrency on "auto", against a grid search
over them in the same run (issue 17; the C++ twin: `image_pipeline_bench grid`).

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_images_grid.py \
        [--images 1000] [--epochs 2] [--rounds 3] [--json out.json]

The pipeline of bench_images.py's "splitflow Python": GraphDataset(read_file >>
decode_random_resized_crop(224) >> batch(64) >> normalize) into DataLoader(batch_size=None).
Grid: read (1, 2) x decode+augment (1, 2, unlimited) x normalize (1, unlimited). Each round runs
every configuration (the order reversed every other round) for --epochs epochs, the best epoch
its figure; then the grid's best and the automatic configuration again, 2 x --epochs epochs each,
alternating, compared by their medians (the grid's maximum is the largest of many noisy figures).
Prints a line per round and the median of the rounds' ratios (goal: >= 0.97).
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_images import BATCH, MEAN, SIZE, STD, make_dataset  # noqa: E402

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import splitflow as sf  # noqa: E402
import splitflow.torch as sft  # noqa: E402


def dataset(paths, read, decode, norm):
    holder = {}

    def build(g, indices):
        ds = holder["ds"]
        r = g.stage("read", sf.ops.read_file(paths), concurrency=read)
        crop = g.stage("decode+augment", sf.ops.decode_random_resized_crop(SIZE, seed=1, epoch=ds.epoch),
                       concurrency=decode, on_error="skip")
        n = g.stage("normalize", sf.ops.normalize(MEAN, STD), concurrency=norm)
        return indices >> r >> crop >> g.batch("batch", BATCH) >> n

    ds = sft.GraphDataset(build, len(paths), shuffle=True, seed=1, threads=0, backend="host",
                          name="images")
    holder["ds"] = ds
    return ds


def epoch_rate(ds, epoch, n):
    ds.set_epoch(epoch)
    start = time.perf_counter()
    count = sum(b.shape[0] for b in torch.utils.data.DataLoader(ds, batch_size=None))
    assert count == n, (count, n)
    return n / (time.perf_counter() - start)


def name(c):
    return ", ".join(f"{k} {'inf' if v == 0 else v}" for k, v in zip(("read", "decode", "normalize"), c))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default="build/bench-data/images")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = f"{args.data}-{args.images}"
    make_dataset(root, args.images)
    paths = sf.image_files(root)
    n = len(paths)
    grid = list(itertools.product((1, 2), (1, 2, 0), (1, 0)))
    auto = ("auto", "auto", "auto")
    # One dataset per configuration, each with its own runtime (as separate jobs would have):
    # the automatic one's runtime remembers its last epoch's concurrencies (the warm start).
    sets = {c: dataset(paths, *c) for c in grid + [auto]}
    ratios = []
    for r in range(args.rounds):
        order = grid + [auto] if r % 2 == 0 else [auto] + grid[::-1]
        rate = {c: max(epoch_rate(sets[c], e, n) for e in range(args.epochs)) for c in order}
        best = max(grid, key=lambda c: rate[c])
        again = {best: [], auto: []}
        for e in range(2 * args.epochs):
            for c in ((best, auto) if e % 2 == 0 else (auto, best)):
                again[c].append(epoch_rate(sets[c], e, n))
        ratios.append(statistics.median(again[auto]) / statistics.median(again[best]))
        print(f"round {r + 1}: grid best ({name(best)}) {rate[best]:.0f} images/s, worst "
              f"{min(rate[c] for c in grid):.0f}; auto {rate[auto]:.0f} in the grid; then alternating, "
              f"medians: best {statistics.median(again[best]):.0f}, auto "
              f"{statistics.median(again[auto]):.0f}: {ratios[-1]:.3f} of the best", flush=True)
    tune = sets[auto].last_run.stats().get("autotune", [])
    print("the automatic run's last decisions:\n  " + "\n  ".join(tune[:6]))
    out = {"images": n, "configurations": len(grid), "auto_of_grid_best": statistics.median(ratios),
           "rounds": ratios}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
