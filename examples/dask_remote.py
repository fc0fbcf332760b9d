#!/usr/bin/python3
"""The image pipeline's CPU part on Dask workers, its GPU stage here (issue 18,
docs/scale-out.md).

    PYTHONPATH=build/release/python /usr/bin/python3 examples/dask_remote.py [DIR]
        [--workers 2] [--size 96] [--scheduler tcp://host:8786]

Remote, on each Dask worker in its own splitflow runtime: read the file -> decode only the
region of a random-resized-crop (+ flip), reproducible from (seed, epoch, file index), a corrupt
file skipped there. Here: batches of 64 -> normalize in a GPU stage (CUDA when this machine has
a device, else the host backend, the same code) -> the training loop. The labels come from the
dataset indices the remote pass yielded (in the local order). Without DIR, 512 small JPEGs of 4
classes (one corrupt) are written to a temporary directory first; without --scheduler a
LocalCluster of --workers single-threaded worker processes on loopback runs the CPU part.

A real cluster: on one machine ``dask scheduler`` (it prints tcp://<host>:8786), on each CPU
machine ``dask worker tcp://<host>:8786 --nthreads 1 --nworkers <cores>`` (or one worker of
<cores> threads: its splitflow runtime then gets that many threads), with splitflow installed
and this file importable (``PYTHONPATH`` naming examples/, or install it as a module) and the
images at the same path on every machine (a shared file system or object store mount). Then
``examples/dask_remote.py /shared/images --scheduler tcp://<host>:8786`` on the GPU node.
"""
import argparse
import functools
import os
import sys
import tempfile
import time

import numpy as np
import torch

import splitflow as sf
import splitflow.dask as sfd

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@functools.lru_cache(maxsize=4)
def _folder(root):
    return sf.image_folder(root)  # (paths, labels, classes): listed once per worker process


def build_cpu_part(root, size, g, indices, *, seed, epoch):
    """The remote segment (runs on the workers): dataset index -> cropped uint8 HWC image."""
    paths, _, _ = _folder(root)
    read = g.stage("read", sf.ops.read_file(paths), concurrency="auto")
    crop = g.stage("decode+augment", sf.ops.decode_random_resized_crop(size, seed=seed, epoch=epoch),
                   concurrency="auto", on_error="skip")
    return indices >> read >> crop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--scheduler")
    args = ap.parse_args()
    from distributed import Client, LocalCluster

    tmp = None
    if args.dir is None:
        from image_train import write_sample_jpegs
        tmp = tempfile.TemporaryDirectory()
        write_sample_jpegs(tmp.name, 512)
        args.dir = tmp.name
    root = os.path.abspath(args.dir)
    paths, labels, classes = sf.image_folder(root)
    # The workers import the build function by name: from this module, not from __main__.
    from dask_remote import build_cpu_part as build

    cluster = None
    if args.scheduler:
        client = sfd.connect(args.scheduler, timeout=10)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1", silence_logs=40)
        client = Client(cluster)
    try:
        remote = sfd.remote(functools.partial(build, root, args.size), client,
                            items=range(len(paths)), seed=7)
        rt = sf.Runtime(threads=2)
        g = sf.Graph(rt, "train")
        norm = g.gpu_stage("normalize", sf.ops.normalize(MEAN, STD))
        out = g.pull_sink("batches")
        remote.source(g) >> g.batch("batch", 64) >> norm >> out
        for epoch in range(args.epochs):
            remote.set_epoch(epoch)
            remote.items = np.random.default_rng(7 + epoch).permutation(len(paths)).tolist()
            start = time.perf_counter()
            seen = 0
            for batch in g.iterate(out):
                x = torch.from_dlpack(batch)    # float32 (N, 3, size, size), on the device
                done = remote.last_pass.yielded  # dataset indices, in the order they came
                y = torch.tensor([labels[i] for i in done[seen:seen + x.shape[0]]])
                assert x.shape[1:] == (3, args.size, args.size) and len(y) == x.shape[0]
                seen += x.shape[0]
            elapsed = time.perf_counter() - start
            s = remote.stats()
            skipped = ", ".join(os.path.basename(e["message"].split("'")[1]) if "'" in e["message"]
                                else e["message"] for e in s["errors"])
            print(f"epoch {epoch}: {seen} images in {elapsed:.2f} s ({seen / elapsed:.0f} "
                  f"images/s) from {len(s['workers'])} Dask workers, {s['splits']} splits of "
                  f"~{s['split_items']}; skipped {s['skipped']} ({skipped}); local wait "
                  f"{s['wait_s']:.2f} s; {s['bytes_per_s'] / 1e6:.1f} MB/s")
        print(remote.report())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
