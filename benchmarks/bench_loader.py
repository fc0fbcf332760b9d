#!/usr/bin/python3
"""splitflow loader vs torch.utils.data.DataLoader, same per-item work, same run.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_loader.py [--items N]

Per item: make a 224x224x3 uint8 image (filled with the index, standing in for decoding) and
normalise it to float32 CHW with per-channel mean and std. splitflow does both with C++ ops
(no GIL) in its own threads, read with DataLoader(batch_size=None, num_workers=0); the
DataLoader baselines do the same with torch ops in __getitem__, at num_workers 0 and 2.
Prints items/s and the ratio of splitflow to the best DataLoader setting (goal: >= 2x).
Writes JSON to --json if given.
"""
import argparse
import json
import time

import torch
import torch.utils.data

import splitflow as sf
import splitflow.torch as sft

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
SHAPE = [224, 224, 3]


class TorchImages(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = torch.full(SHAPE, i % 256, dtype=torch.uint8)
        x = img.permute(2, 0, 1).float().div_(255.0)
        return x.sub_(self.mean).div_(self.std).contiguous()


def build(g, indices):
    img = indices >> g.stage("image", sf.ops.fill(SHAPE, "uint8"), concurrency=0)
    return img >> g.stage("normalize", sf.ops.normalize(MEAN, STD), concurrency=0)


def timed(loader, n):
    start = time.perf_counter()
    count = 0
    checksum = 0.0
    for x in loader:
        count += 1
        checksum += float(x[0, 0, 0])
    elapsed = time.perf_counter() - start
    assert count == n, (count, n)
    return n / elapsed, checksum


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=3000)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.items
    results = {}
    # DataLoader first: its workers fork from a process that has not started splitflow.
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(TorchImages(n), batch_size=None, num_workers=workers)
        rate, check_dl = timed(loader, n)
        results[f"dataloader_w{workers}"] = rate
    ds = sft.GraphDataset(build, n)
    rate, check_sf = timed(torch.utils.data.DataLoader(ds, batch_size=None), n)
    results["splitflow_w0"] = rate
    assert abs(check_sf - check_dl) < 1e-3 * max(1.0, abs(check_dl)), (check_sf, check_dl)
    best = max(results["dataloader_w0"], results["dataloader_w2"])
    results["ratio_vs_best_dataloader"] = results["splitflow_w0"] / best
    for k, v in results.items():
        print(f"{k:28s} {v:10.2f}" + (" items/s" if not k.startswith("ratio") else "x  (goal >= 2x)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
