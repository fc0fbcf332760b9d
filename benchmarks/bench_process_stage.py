#!/usr/bin/python3
"""Python stages past the GIL: splitflow's stage(fn, processes=2) against
DataLoader(num_workers=2) on the same per-item work, interleaved and repeated in one run.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_process_stage.py \
        [--images 256] [--repeats 3] [--json out.json]

The work (benchmarks/procs_work.py) is what users write: PIL decode, then torchvision's
RandomResizedCrop(224), RandomHorizontalFlip, ToTensor and Normalize, per item.
- dataloader:  DataLoader(Files(paths), batch_size=None, num_workers=2), the baseline.
- processes:   indices >> stage(FromPath(paths), processes=2) >> pull_sink: the same
               function in splitflow's worker processes (goal >= 1.0x the baseline).
- mixed:       read_file >> decode_jpeg (C++, no GIL) >> stage(OnDecoded(), processes=2):
               the Python transform on the decoded tensor (goal >= 1.5x the baseline).
- mixed_pil:   the same, the decoded array wrapped as a PIL image for the PIL transform.
- thread:      the FromPath function in an ordinary (GIL-holding) thread stage, concurrency 2.
               PIL's decode and torch's ops release the GIL, so this work runs in parallel
               even there.
- gil_thread / gil_processes: FromPath plus 40,000 iterations of pure Python per item (a
               hand-written augmentation that holds the GIL), in a thread stage and in
               processes=2: what processes= is for.
Each configuration reads every image once per repeat; items/s are medians over the repeats,
and the configurations take turns within each repeat. Data: 500x375 photo-like JPEGs
(benchmarks/bench_images.py makes them once under build/bench-data).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.utils.data

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs_work  # noqa: E402
from bench_images import make_dataset  # noqa: E402

import splitflow as sf  # noqa: E402


def timed(iterable, n, check):
    start = time.perf_counter()
    count = 0
    for x in iterable:
        check(x)
        count += 1
    elapsed = time.perf_counter() - start
    assert count == n, (count, n)
    return n / elapsed


def check_tensor(x):
    assert tuple(x.shape) == (3, 224, 224) and x.dtype == torch.float32, (x.shape, x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default="build/bench-data/images")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = f"{args.data}-{args.images}"
    make_dataset(root, args.images)
    paths = sf.image_files(root)[: args.images]
    n = len(paths)

    loader = torch.utils.data.DataLoader(procs_work.Files(paths), batch_size=None, num_workers=2,
                                         persistent_workers=True, prefetch_factor=2,
                                         multiprocessing_context="spawn")
    rt = sf.Runtime(threads=2)
    gp = sf.Graph(rt, "processes")
    out_p = gp.pull_sink("out")
    gp.indices("idx", list(range(n))) >> gp.stage("aug", procs_work.FromPath(paths), processes=2) >> out_p

    gm = sf.Graph(rt, "mixed")
    out_m = gm.pull_sink("out")
    (gm.indices("idx", list(range(n)))
     >> gm.stage("read", sf.ops.read_file(paths), concurrency=2)
     >> gm.stage("decode", sf.ops.decode_jpeg(), concurrency=0)
     >> gm.stage("aug", procs_work.OnDecoded(), processes=2) >> out_m)

    gq = sf.Graph(rt, "mixed-pil")
    out_q = gq.pull_sink("out")
    (gq.indices("idx", list(range(n)))
     >> gq.stage("read", sf.ops.read_file(paths), concurrency=2)
     >> gq.stage("decode", sf.ops.decode_jpeg(), concurrency=0)
     >> gq.stage("aug", procs_work.OnDecodedPil(), processes=2) >> out_q)

    gt = sf.Graph(rt, "thread")
    out_t = gt.pull_sink("out")
    gt.indices("idx", list(range(n))) >> gt.stage("aug", procs_work.FromPath(paths), concurrency=2) >> out_t

    gpt = sf.Graph(rt, "gil-thread")
    out_pt = gpt.pull_sink("out")
    gpt.indices("idx", list(range(n))) >> gpt.stage("aug", procs_work.FromPathPurePython(paths), concurrency=2) >> out_pt
    gpp = sf.Graph(rt, "gil-processes")
    out_pp = gpp.pull_sink("out")
    gpp.indices("idx", list(range(n))) >> gpp.stage("aug", procs_work.FromPathPurePython(paths), processes=2) >> out_pp

    configs = {
        "dataloader": lambda: loader,
        "processes": lambda: gp.iterate(out_p),
        "mixed": lambda: gm.iterate(out_m),
        "mixed_pil": lambda: gq.iterate(out_q),
        "thread": lambda: gt.iterate(out_t),
        "gil_thread": lambda: gpt.iterate(out_pt),
        "gil_processes": lambda: gpp.iterate(out_pp),
    }
    # Warm-up: start every worker process (spawn + imports) before timing.
    for make in configs.values():
        timed(make(), n, check_tensor)
    rates = {k: [] for k in configs}
    for r in range(args.repeats):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for k in order:
            rates[k].append(timed(configs[k](), n, check_tensor))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {rates[k][-1]:.0f}/s" for k in configs), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["dataloader"]
    gil_ratio = med["gil_processes"] / med["gil_thread"]
    result = {
        "images": n, "repeats": args.repeats, "cores": os.cpu_count(),
        "items_per_s": med, "all_items_per_s": rates,
        "processes_vs_dataloader": med["processes"] / base,
        "mixed_vs_dataloader": med["mixed"] / base,
        "mixed_pil_vs_dataloader": med["mixed_pil"] / base,
        "thread_vs_dataloader": med["thread"] / base,
        "gil_processes_vs_gil_thread": gil_ratio,
    }
    for k, v in med.items():
        print(f"{k:>11}: {v:7.0f} items/s  ({v / base:.2f}x dataloader)")
    print(f"pure-Python work: processes / thread stage {gil_ratio:.2f}")
    print(f"goals: processes >= 1.0x: {result['processes_vs_dataloader']:.2f}; "
          f"mixed >= 1.5x: {result['mixed_vs_dataloader']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
