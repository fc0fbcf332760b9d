#!/usr/bin/python3
"""Memory bounded by configuration, not by data (issue 16): the peak RSS of one image pipeline
over N and 10N JPEGs of one size, same configuration, one epoch each.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_memory.py \
        [--data build/bench-data/images] [--images 300] [--repeats 3] [--json out.json]

Data: bench_images.py's make_dataset (500x375 photo-like JPEGs, q90, made once and cached under
build/bench-data/images-N; the first N files of images-10N are the same as images-N's).

Each measurement is a fresh child process (this file with --child) that imports splitflow and
numpy (not torch), runs one epoch of

    indices >> read_file (concurrency 2) >> decode_random_resized_crop(224) (concurrency 0,
    on_error skip) >> batch(64, drop_last) >> normalize (GPU stage, host backend)
    >> to_host (GPU stage) >> pull_sink, the calling thread reading every batch

on Runtime(threads=2, backend="host") and Graph(max_in_flight=64, capacity=32), the stages after
the batch (whose items are batches: 9.2 MiB of uint8, then 36.8 MiB of float32) with queues of
--batch-capacity batches (default 2; 0: the graph's 32): the same numbers for N and 10N.
drop_last: a short last batch is a block size met once (300 images: 4 batches and one of 44),
which the 1x run pays for and the 10x run dilutes. max_in_flight=64 (one batch's images) and
queues of 2 batches keep the bound within what a 1x epoch reaches; with max_in_flight=256 and the
graph's default capacities (which now count source items: 2 batches of 64 after the batch) the
bound is reached by 3,000 images, not by 300 (docs/reliability.md, "Memory bounded by
configuration", "With Graph's default settings").
The child reads its own VmHWM (the peak resident set, from
/proc/self/status, i.e. /proc/<pid>/status of that child) after the epoch; no process stages
run, so no other process does the pipeline's work. 1x and 10x alternate (1x first in odd
repeats, 10x first in even ones). Prints each peak, the median of each size and their ratio
(goal: 10x / 1x within 10%, 0.90 to 1.10).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
BATCH, SIZE = 64, 224
CONFIG = {"threads": 2, "backend": "host", "max_in_flight": 64, "capacity": 32,
          "read_concurrency": 2, "decode_concurrency": 0, "gpu_concurrency": 2, "batch": BATCH,
          "size": SIZE, "batch_capacity": 2}


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(root, batch_capacity, max_in_flight):
    """One epoch of the pipeline over the JPEGs in `root`; prints one JSON line."""
    CONFIG["batch_capacity"], CONFIG["max_in_flight"] = batch_capacity, max_in_flight
    import numpy as np
    import splitflow as sf
    paths = sf.image_files(root)
    baseline = status_kib("VmRSS")
    rt = sf.Runtime(threads=CONFIG["threads"], backend=CONFIG["backend"])
    g = sf.Graph(rt, "memory", max_in_flight=CONFIG["max_in_flight"], capacity=CONFIG["capacity"])
    sink = g.pull_sink("out", capacity=CONFIG["batch_capacity"])
    (g.indices("i", list(range(len(paths))))
     >> g.stage("read", sf.ops.read_file(paths), concurrency=CONFIG["read_concurrency"])
     >> g.stage("decode+crop", sf.ops.decode_random_resized_crop(SIZE, seed=1, epoch=0),
                concurrency=CONFIG["decode_concurrency"], on_error="skip")
     >> g.batch("batch", BATCH, drop_last=True)
     >> g.gpu_stage("normalize", sf.ops.normalize(MEAN, STD), concurrency=CONFIG["gpu_concurrency"],
                    capacity=CONFIG["batch_capacity"])
     >> g.gpu_stage("to_host", sf.ops.to_host(), concurrency=CONFIG["gpu_concurrency"],
                    capacity=CONFIG["batch_capacity"])
     >> sink)
    start = time.perf_counter()
    images = 0
    it = g.iterate(sink)
    for b in it:
        a = np.asarray(b)
        assert a.shape[1:] == (3, SIZE, SIZE) and a.dtype == np.float32, (a.shape, a.dtype)
        images += a.shape[0]
        del a, b
    seconds = time.perf_counter() - start
    stats = it.run.stats()
    assert images == len(paths) // BATCH * BATCH, (images, len(paths))
    dev = rt.device_stats() or {}
    print(json.dumps({
        "images": images, "seconds": seconds, "peak_kib": status_kib("VmHWM"),
        "baseline_kib": baseline, "end_kib": status_kib("VmRSS"),
        "host_cache": sf._core.host_cache_stats(),
        "max_queue": {s["name"]: s["max_queue"] for s in stats["stages"]},
        "device_bytes_cap": dev.get("device_bytes_cap"), "pinned_bytes_cap": dev.get("pinned_bytes_cap"),
    }))
    return 0


def measure(root):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", root,
                          "--batch-capacity", str(CONFIG["batch_capacity"]),
                          "--max-in-flight", str(CONFIG["max_in_flight"])], check=True,
                         capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="build/bench-data/images")
    ap.add_argument("--images", type=int, default=300, help="N: the 1x set (10x is 10N)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--batch-capacity", type=int, default=2,
                    help="queue capacity of the stages after the batch (normalize, to_host, the pull "
                         "sink), in batches of 36.8 MiB (float32); 0: the graph's default (capacity=32)")
    ap.add_argument("--max-in-flight", type=int, default=64, help="Graph(max_in_flight=)")
    ap.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.batch_capacity, args.max_in_flight)
    CONFIG["batch_capacity"], CONFIG["max_in_flight"] = args.batch_capacity, args.max_in_flight

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_images import make_dataset
    sizes = {"1x": args.images, "10x": 10 * args.images}
    roots = {k: f"{args.data}-{n}" for k, n in sizes.items()}
    for k, n in sizes.items():
        t0 = time.perf_counter()
        make_dataset(roots[k], n)
        print(f"data {k}: {n} JPEGs 500x375 q90 in {roots[k]} (ready in {time.perf_counter() - t0:.1f} s)",
              flush=True)
    print("config: " + ", ".join(f"{k}={v}" for k, v in CONFIG.items()), flush=True)

    runs = {"1x": [], "10x": []}
    for rep in range(args.repeats):
        for k in (("1x", "10x") if rep % 2 == 0 else ("10x", "1x")):
            r = measure(roots[k])
            assert r["images"] == sizes[k] // BATCH * BATCH, r
            runs[k].append(r)
            print(f"  repeat {rep + 1} {k:>3s}: {r['images']:5d} images in {r['seconds']:5.1f} s, "
                  f"peak RSS {r['peak_kib'] / 1024:6.1f} MiB (before the run {r['baseline_kib'] / 1024:.1f}, "
                  f"after {r['end_kib'] / 1024:.1f}; host cache {r['host_cache']['cached_bytes'] / 2**20:.0f} MiB)",
                  flush=True)

    med = {k: statistics.median(r["peak_kib"] for r in v) for k, v in runs.items()}
    growth = {k: statistics.median(r["peak_kib"] - r["baseline_kib"] for r in v) for k, v in runs.items()}
    ratio = med["10x"] / med["1x"]
    print(f"\n{'':4s} {'images':>7s} {'peak RSS (MiB), each repeat':>30s} {'median':>8s} {'over baseline':>14s}")
    for k in ("1x", "10x"):
        peaks = " ".join(f"{r['peak_kib'] / 1024:6.1f}" for r in runs[k])
        print(f"{k:4s} {sizes[k]:7d} {peaks:>30s} {med[k] / 1024:8.1f} {growth[k] / 1024:14.1f}")
    print(f"peak RSS 10x / 1x: {ratio:.3f} (goal: within 10%, 0.90 to 1.10); "
          f"over the pre-run baseline: {growth['10x'] / growth['1x']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "config": CONFIG, "images": sizes, "repeats": args.repeats,
                "peak_kib": {k: [r["peak_kib"] for r in v] for k, v in runs.items()},
                "baseline_kib": {k: [r["baseline_kib"] for r in v] for k, v in runs.items()},
                "seconds": {k: [r["seconds"] for r in v] for k, v in runs.items()},
                "median_peak_kib": med, "median_growth_kib": growth,
                "peak_10x_vs_1x": ratio, "growth_10x_vs_1x": growth["10x"] / growth["1x"],
                "runs": runs,
            }, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
