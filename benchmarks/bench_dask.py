#!/usr/bin/python3
"""Remote CPU stages on Dask (issue 18): the image pipeline's CPU part on a LocalCluster of 2
single-threaded worker processes (real scheduler and workers, loopback TCP) against the same
pipeline run locally on 2 threads, interleaved and repeated in one run.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_dask.py \
        [--images 2000] [--repeats 5] [--size 224] [--compression None|auto] [--json out.json]
        (--quick: 256 images, 3 repeats)

The CPU part, per image: read_file -> decode_random_resized_crop(224) (the fused decode + crop +
flip, antialiased), as the image pipeline runs it.
- local:  indices >> read >> crop >> batch(64) >> pull_sink, on a runtime of 2 threads.
- remote: splitflow.dask.remote(the CPU part, client) as the source of a local graph
          >> batch(64) >> pull_sink: each worker runs its splits in its own splitflow runtime
          (1 thread), the crops travel back through Dask (numpy frames, pickle protocol 5).
Goal: remote >= 0.8x local (what serialization and the network path cost, measured), the rate
of a whole pass of 2000 images (about a second of the local pipeline's work; the pass's start,
before its first batch, counted in: the remote pipeline fills with a split's work, its round
trip and its fetch, then flows; a training epoch is thousands of splits long). Also reported:
each pass's time to its first batch, Dask's cost per split (a worker's idle gap between two of its splits, the client's
fetch of a split's results; the round trip of an empty split), the bytes per second received
and the per-item cost on a worker (the inputs of the scaling model in docs/scale-out.md).
Items/s are medians over the repeats; the configurations take turns within each repeat. Data:
500x375 photo-like JPEGs (benchmarks/bench_images.py makes them once under build/bench-data).
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_images import make_dataset  # noqa: E402

import splitflow as sf  # noqa: E402
import splitflow.dask as sfd  # noqa: E402


def build_cpu_part(paths, size, g, indices, *, seed, epoch):
    read = g.stage("read", sf.ops.read_file(paths), concurrency=0)
    crop = g.stage("crop", sf.ops.decode_random_resized_crop(size, seed=seed, epoch=epoch),
                   concurrency=0)
    return indices >> read >> crop


def cpu_s(pids):
    """CPU seconds (user + system, all threads) the processes `pids` have used."""
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


_BLOBS = {}


def transport_split(k, items, shape):
    """A split's worth of results made once per worker process (the arrays a split of the CPU
    part returns, as run_split returns them: its dict, the results as numpy arrays): what Dask's
    transport moves, without the work that makes it."""
    import numpy as np

    key = (items, shape)
    if key not in _BLOBS:
        _BLOBS[key] = [np.full(shape, i % 251, np.uint8) for i in range(items)]
    return {"split": k, "results": list(_BLOBS[key])}


def transport_cost(client, items, shape, pids, splits=24):
    """Dask's transport alone: splits of `items` arrays of `shape` made once on the workers,
    fetched by the client as a pass fetches its splits (two per worker in flight, in order,
    directly from the workers). Returns the CPU seconds per item all the processes (client,
    scheduler, workers) spent."""
    import bench_dask

    n_workers = len(client.scheduler_info()["workers"])
    cap = max(2, 2 * n_workers)
    futs = [client.submit(bench_dask.transport_split, k, items, shape, pure=False)
            for k in range(cap)]
    client.gather(futs, direct=True)  # the arrays made before the count starts
    futs = [client.submit(bench_dask.transport_split, cap + k, items, shape, pure=False)
            for k in range(cap)]
    c0 = cpu_s(pids)
    for k in range(splits):
        out = client.gather(futs.pop(0), direct=True)
        assert len(out["results"]) == items
        futs.append(client.submit(bench_dask.transport_split, 2 * cap + k, items, shape,
                                  pure=False))
    used = cpu_s(pids) - c0
    client.cancel(futs)
    return used / (splits * items)


def timed(g, out, n, pids=None):
    """A pass over the n images: (images/s over the whole pass, seconds to its first batch,
    CPU seconds per image of the processes `pids`)."""
    pids = pids or [os.getpid()]
    c0 = cpu_s(pids)
    start = time.perf_counter()
    first = None
    count = 0
    for b in g.iterate(out):
        if first is None:
            first = time.perf_counter() - start
        count += b.shape[0]
    elapsed = time.perf_counter() - start
    assert count == n, (count, n)
    return n / elapsed, first, (cpu_s(pids) - c0) / n


def model(m, nic_gbit, gpu_rate, workers=(1, 2, 4, 8, 16, 32, 64)):
    """Expected images/s at the GPU node for N single-threaded workers, from the measured
    per-item worker cost t, items per split S, a worker's gap between splits g, the client's
    fetch time per split f and bytes per item b: each worker makes 1 / (t + g / S) items/s;
    the node takes at most NIC / b (network), S / f (the client's fetch: one event loop, one
    core) and the GPU rate; the smallest limit wins."""
    t, S, g, f, b = (m["worker_item_s"], m["split_items"], m["gap_s_per_split"],
                     m["fetch_s_per_split"], m["bytes_per_item"])
    per_worker = 1.0 / (t + g / S)
    limits = {"network": nic_gbit * 1e9 / 8 / b, "client fetch": S / f, "GPU": gpu_rate}
    rows = []
    for n in workers:
        remote = n * per_worker
        name, cap = min(limits.items(), key=lambda kv: kv[1])
        fed = min(remote, cap)
        rows.append({"workers": n, "remote": remote, "fed": fed,
                     "limit": "workers" if remote <= cap else name})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--split-seconds", type=float, default=0.1)
    ap.add_argument("--data", default="build/bench-data/images")
    ap.add_argument("--quick", action="store_true", help="256 images, 3 repeats")
    ap.add_argument("--compression", default="None",
                    help="Dask's distributed.comm.compression for the cluster: None (default "
                         "here: decoded pixels hardly compress and loopback is fast) or auto "
                         "(Dask's default: lz4 when installed)")
    ap.add_argument("--nic-gbit", type=float, default=100.0, help="the model's GPU-node NIC")
    ap.add_argument("--gpu-rate", type=float, default=24000.0,
                    help="the model's GPU-node rate, images/s (e.g. 8 GPUs x 3000)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.images, args.repeats = 256, 3
    root = f"{args.data}-{args.images}"
    make_dataset(root, args.images)
    paths = sf.image_files(root)[: args.images]
    n = len(paths)
    import dask
    from distributed import Client, LocalCluster

    # Set before the cluster starts: the nannies hand this configuration to their workers.
    dask.config.set({"distributed.comm.compression": None if args.compression == "None"
                     else args.compression})

    # The workers import the CPU part by name (this module, not __main__).
    import bench_dask
    build = functools.partial(bench_dask.build_cpu_part, tuple(paths), args.size)  # hashable:
    # the workers cache the graph built from it

    rt = sf.Runtime(threads=2)
    gl = sf.Graph(rt, "local")
    out_l = gl.pull_sink("out")
    src = gl.indices("idx", list(range(n)))
    build(gl, src, seed=1, epoch=0) >> gl.batch("batch", 64) >> out_l

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      host="127.0.0.1", silence_logs=40) as cluster, Client(cluster) as client:
        remote = sfd.remote(build, client, items=list(range(n)), seed=1, threads=1,
                            split_seconds=args.split_seconds)
        gr = sf.Graph(rt, "remote")
        out_r = gr.pull_sink("out")
        remote.source(gr) >> gr.batch("batch", 64) >> out_r

        # CPU counted over every process of the configuration: the local pass's one; the remote
        # pass's client (with the LocalCluster's scheduler and nannies, in this process) and
        # workers.
        pids = {"local": [os.getpid()],
                "remote": [os.getpid()] + sorted(client.run(os.getpid).values())}
        configs = {"local": (gl, out_l), "remote": (gr, out_r)}
        for g, out in configs.values():  # warm-up: worker imports, graphs, the split size
            timed(g, out, n)
        rates = {k: [] for k in configs}
        firsts = {k: [] for k in configs}
        cpus = {k: [] for k in configs}
        passes = []
        for r in range(args.repeats):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for k in order:
                rate, first, cpu = timed(*configs[k], n, pids[k])
                rates[k].append(rate)
                firsts[k].append(first)
                cpus[k].append(cpu)
                if k == "remote":
                    passes.append(remote.stats())
            print(f"repeat {r + 1}: " + ", ".join(f"{k} {rates[k][-1]:.0f}/s" for k in configs),
                  flush=True)

        # Dask's round trip for a split of no items, one at a time (the fixed cost per task).
        opts = dict(remote.opts, threads=1)
        trips = []
        for k in range(20):
            t = time.perf_counter()
            client.submit(sfd.run_split, build, k, [], 1, 0, opts, pure=False).result()
            trips.append(time.perf_counter() - t)
        # Dask's transport of the same bytes alone: splits of the pass's size, arrays of a
        # result's shape, made once on the workers (the CPU it costs per image, every process).
        split_items = int(statistics.median(p["split_items"] for p in passes))
        transport = [transport_cost(client, split_items, (args.size, args.size, 3),
                                    pids["remote"]) for _ in range(3)]
        print(remote.report())

    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["remote"] / med["local"]

    def median_of(key):
        vals = [p[key] for p in passes if p.get(key) is not None]
        return statistics.median(vals) if vals else None

    result = {
        "images": n, "repeats": args.repeats, "cores": os.cpu_count(), "size": args.size,
        "compression": args.compression,
        "items_per_s": med, "all_items_per_s": rates,
        "remote_vs_local": ratio,
        "first_batch_s": {k: statistics.median(v) for k, v in firsts.items()},
        "split_items": median_of("split_items"),
        "gap_s_per_split": median_of("gap_s_per_split"),
        "fetch_s_per_split": median_of("fetch_s_per_split"),
        "overhead_s_per_split": median_of("overhead_s_per_split"),
        "empty_split_round_trip_s": statistics.median(trips),
        "bytes_per_s": median_of("bytes_per_s"),
        "bytes_per_item": median_of("bytes") / n if median_of("bytes") else None,
        "worker_item_s": median_of("item_s"),
        "local_wait_fraction": statistics.median(p["wait_s"] / p["wall_s"] for p in passes),
        "cpu_ms_per_item": {k: 1e3 * statistics.median(v) for k, v in cpus.items()},
        "transport_cpu_ms_per_item": 1e3 * statistics.median(transport),
    }
    # What the transport alone allows when one machine's cores do all the work, the pipeline's,
    # the client's side and the workers' (each image costs the local pipeline's CPU and the
    # transport's): local CPU / (local CPU + the transport's).
    loc = result["cpu_ms_per_item"]["local"]
    result["transport_bound"] = loc / (loc + result["transport_cpu_ms_per_item"])
    for k, v in med.items():
        print(f"{k:>7}: {v:7.0f} images/s")
    print(f"a pass's first batch after: local {1e3 * result['first_batch_s']['local']:.0f} ms, "
          f"remote {1e3 * result['first_batch_s']['remote']:.0f} ms (the remote pipeline's fill: "
          f"a split's work, its round trip and its fetch)")
    print(f"remote / local: {ratio:.2f} (goal >= 0.8); split {result['split_items']:.0f} items; "
          f"Dask per split: worker gap {1e3 * result['gap_s_per_split']:.1f} ms, fetch "
          f"{1e3 * result['fetch_s_per_split']:.1f} ms, empty split round trip "
          f"{1e3 * result['empty_split_round_trip_s']:.1f} ms; "
          f"{result['bytes_per_s'] / 1e6:.1f} MB/s ({result['bytes_per_item'] / 1e3:.0f} kB/item); "
          f"worker {1e3 * result['worker_item_s']:.2f} ms/item")
    print(f"CPU per image, every process: local {loc:.2f} ms, remote "
          f"{result['cpu_ms_per_item']['remote']:.2f} ms; Dask's transport of a result alone "
          f"{result['transport_cpu_ms_per_item']:.2f} ms: on one machine's cores it bounds "
          f"remote / local at {result['transport_bound']:.2f}")
    result["model"] = model(result, args.nic_gbit, args.gpu_rate)
    print(f"model (docs/scale-out.md), NIC {args.nic_gbit:g} Gbit/s, GPU node {args.gpu_rate:.0f} "
          "images/s:")
    for row in result["model"]:
        print(f"  {row['workers']:3d} workers: remote {row['remote']:8.0f}/s  -> fed "
              f"{row['fed']:8.0f}/s  ({row['limit']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
