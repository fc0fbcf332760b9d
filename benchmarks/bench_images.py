#!/usr/bin/python3
"""The end-to-end image input benchmark: splitflow against torch's DataLoader, same files, same run.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_images.py \
        --bin build/release/benchmarks/image_pipeline_bench [--images 2000] [--json out.json]

Data: --images JPEGs of 500x375 at quality 90 (photo-like: smooth structure, edges and grain),
written once by PIL and cached under build/bench-data/. Every contender does the same work per
image: decode, random-resized-crop to 224, horizontal flip (p=0.5), batches of 64, normalize
(float32 NCHW, ImageNet mean/std):

  splitflow C++        benchmarks/image_pipeline_bench.cpp, the calling thread consumes the batches;
                       decode and crop fused (only the crop's region of each JPEG is decoded)
  splitflow C++, full  the same with a full decode, then the crop (two stages)
  splitflow Python     splitflow.torch.GraphDataset (C++ ops, fused) into DataLoader(batch_size=None)
  ..., labelled        the same on samples {"image", "label", "index"} (read_file(paths, labels=),
                       the ops on field="image", batches collated field by field)
  DataLoader w0 / w2   torchvision transforms on PIL decode, num_workers 0 and 2, batch_size 64,
                       (image, label) samples as ImageFolder's
  decode-only ceiling  libjpeg-turbo full decode of the same files on all cores, nothing else

Each timed figure is the best of --epochs epochs (after the first, which warms caches), in
images/s. Prints each as a ratio to the best DataLoader setting (goal: >= 2x) and as a fraction
of the ceiling (goal: >= 0.7).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.utils.data
from PIL import Image

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
BATCH = 64
SIZE = 224


def make_dataset(root, n):
    """n photo-like 500x375 JPEGs (q90), made once: a smooth field, shapes with edges, grain."""
    marker = os.path.join(root, f".complete-{n}")
    if os.path.exists(marker):
        return
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(1234)
    from PIL import ImageDraw, ImageFilter
    for i in range(n):
        small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((500, 375), Image.BICUBIC)
        draw = ImageDraw.Draw(img)
        for _ in range(12):
            x0, y0 = int(rng.integers(0, 450)), int(rng.integers(0, 330))
            x1, y1 = x0 + int(rng.integers(10, 200)), y0 + int(rng.integers(10, 150))
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
        img = img.filter(ImageFilter.GaussianBlur(1.2))
        px = np.asarray(img).astype(np.int16) + rng.normal(0, 7, (375, 500, 3)).astype(np.int16)
        Image.fromarray(px.clip(0, 255).astype(np.uint8)).save(
            os.path.join(root, f"{i:05d}.jpg"), quality=90)
    open(marker, "w").close()


class TorchvisionFolder(torch.utils.data.Dataset):
    def __init__(self, paths):
        import torchvision.transforms as T
        self.paths = paths
        self.transform = T.Compose([
            T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as im:
            # torchvision's ImageFolder loader converts unconditionally; that copy costs PIL 9.4
            # several times the decode, so the baseline skips it for RGB files (a fair fight).
            # (image, label), as ImageFolder yields (the label: a class per 10 files here).
            return self.transform(im if im.mode == "RGB" else im.convert("RGB")), i % 10


def timed_epochs(make_loader, epochs, n):
    best = 0.0
    for epoch in range(epochs):
        loader = make_loader(epoch)
        start = time.perf_counter()
        count = 0
        for batch in loader:
            labels = None
            if isinstance(batch, dict):  # a labelled sample batch: {"image", "label", "index"}
                batch, labels = batch["image"], batch["label"]
            elif isinstance(batch, (list, tuple)):  # DataLoader's (images, labels)
                batch, labels = batch
            count += batch.shape[0]
            assert batch.shape[1:] == (3, SIZE, SIZE), batch.shape
            assert labels is None or len(labels) == batch.shape[0]
        elapsed = time.perf_counter() - start
        assert count == n, (count, n)
        best = max(best, count / elapsed)
    return best


def run_cpp(binary, mode, root, epochs, *extra):
    out = subprocess.run([binary, mode, root, "--epochs", str(epochs), *extra], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["images_per_s"], out.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/release/benchmarks/image_pipeline_bench")
    ap.add_argument("--data", default="build/bench-data/images")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--only-data", action="store_true", help="make (or find) the data set, print its directory")
    args = ap.parse_args()
    root = f"{args.data}-{args.images}"
    t0 = time.perf_counter()
    make_dataset(root, args.images)
    if args.only_data:
        print(root)
        return 0
    import splitflow as sf
    paths = sf.image_files(root)
    n = len(paths)
    mb = sum(os.path.getsize(p) for p in paths) / n / 1024
    print(f"data: {n} JPEGs, 500x375 q90, mean {mb:.0f} KiB ({root}; ready in "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)

    results = {}
    # PIL's full decode on one core, for reference.
    start = time.perf_counter()
    for p in paths[:500]:
        with Image.open(p) as im:
            im.load()
    results["pil_decode_1core"] = min(500, n) / (time.perf_counter() - start)
    print(f"  pil_decode_1core: {results['pil_decode_1core']:.0f} images/s", flush=True)
    # DataLoader first: its workers fork from a process that has not started splitflow.
    for workers in (0, 2):
        ds = TorchvisionFolder(paths)
        results[f"dataloader_w{workers}"] = timed_epochs(
            lambda e: torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers,
                                                  persistent_workers=False),
            args.epochs, n)
        print(f"  dataloader_w{workers}: {results[f'dataloader_w{workers}']:.0f} images/s", flush=True)

    results["splitflow_cpp"], table = run_cpp(args.bin, "pipeline", root, args.epochs)
    print(f"  splitflow_cpp: {results['splitflow_cpp']:.0f} images/s", flush=True)
    results["splitflow_cpp_full_decode"], _ = run_cpp(args.bin, "pipeline", root, args.epochs, "--fused", "0")
    print(f"  splitflow_cpp_full_decode: {results['splitflow_cpp_full_decode']:.0f} images/s", flush=True)

    import splitflow.torch as sft
    holder = {}

    def build(g, indices):
        epoch = holder["ds"].epoch
        read = g.stage("read", sf.ops.read_file(paths), concurrency=2)
        crop = g.stage("decode+augment", sf.ops.decode_random_resized_crop(SIZE, seed=1, epoch=epoch),
                       concurrency=0, on_error="skip")
        norm = g.stage("normalize", sf.ops.normalize(MEAN, STD), concurrency=0)
        return indices >> read >> crop >> g.batch("batch", BATCH) >> norm

    ds = sft.GraphDataset(build, n, shuffle=True, seed=1)
    holder["ds"] = ds

    def sf_loader(epoch):
        ds.set_epoch(epoch)
        return torch.utils.data.DataLoader(ds, batch_size=None)

    results["splitflow_python"] = timed_epochs(sf_loader, args.epochs, n)
    print(f"  splitflow_python: {results['splitflow_python']:.0f} images/s", flush=True)

    # The labelled pipeline (issue 15): samples {"image", "label", "index"} from read_file's
    # labels, the ops on the "image" field, batches of 64 collated field by field.
    labels = [i % 10 for i in range(n)]

    def build_labelled(g, indices):
        epoch = holder["ds"].epoch
        read = g.stage("read", sf.ops.read_file(paths, labels=labels), concurrency=2)
        crop = g.stage("decode+augment", sf.ops.decode_random_resized_crop(SIZE, seed=1, epoch=epoch),
                       field="image", concurrency=0, on_error="skip")
        norm = g.stage("normalize", sf.ops.normalize(MEAN, STD), field="image", concurrency=0)
        return indices >> read >> crop >> g.batch("batch", BATCH) >> norm

    ds = sft.GraphDataset(build_labelled, n, shuffle=True, seed=1)
    holder["ds"] = ds
    results["splitflow_python_labelled"] = timed_epochs(sf_loader, args.epochs, n)
    print(f"  splitflow_python_labelled: {results['splitflow_python_labelled']:.0f} images/s", flush=True)

    results["decode_ceiling"], _ = run_cpp(args.bin, "ceiling", root, args.epochs)
    print(f"  decode_ceiling: {results['decode_ceiling']:.0f} images/s", flush=True)

    best_dl = max(results["dataloader_w0"], results["dataloader_w2"])
    ceiling = results["decode_ceiling"]
    print(f"\n{'':22s} {'images/s':>9s} {'vs best DataLoader':>19s} {'of ceiling':>11s}")
    for k in ("dataloader_w0", "dataloader_w2", "splitflow_python", "splitflow_python_labelled", "splitflow_cpp",
              "splitflow_cpp_full_decode", "decode_ceiling"):
        v = results[k]
        print(f"{k:22s} {v:9.0f} {v / best_dl:18.2f}x {v / ceiling:11.2f}")
    print(f"(PIL full decode on one core: {results['pil_decode_1core']:.0f} images/s)")
    print("goals: splitflow >= 2x the best DataLoader, >= 0.70 of the decode-only ceiling")
    print(f"\nsplitflow C++ pipeline, last epoch:\n{table}")
    summary = {
        "machine": {"cores": os.cpu_count()},
        "cpp_full_decode_of_ceiling": results["splitflow_cpp_full_decode"] / ceiling,
        "images": n, "results": results,
        "ratio_cpp_vs_best_dataloader": results["splitflow_cpp"] / best_dl,
        "ratio_python_vs_best_dataloader": results["splitflow_python"] / best_dl,
        "cpp_of_ceiling": results["splitflow_cpp"] / ceiling,
        "python_of_ceiling": results["splitflow_python"] / ceiling,
        "labelled_python_vs_cpp": results["splitflow_python_labelled"] / results["splitflow_cpp"],
        "labelled_python_vs_best_dataloader": results["splitflow_python_labelled"] / best_dl,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
