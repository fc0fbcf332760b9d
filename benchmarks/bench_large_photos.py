#!/usr/bin/python3
"""Large photos (issue 21): 14.7-megapixel JPEGs (4288x3424, q92, photo-like) cropped and
resized to 224, the work of a training input pipeline on phone / camera photos.

    PYTHONPATH=build/release/python /usr/bin/python3 benchmarks/bench_large_photos.py \
        [--photos 16] [--epochs 3] [--json out.json]

- splitflow full:    read_file >> decode_random_resized_crop(224, scaled_decode="never"): the
                     fused region decode + antialiased resize, the crop decoded in full.
- splitflow scaled:  the same with scaled_decode="large" (the default): a crop that shrinks 2x or
                     more is decoded at libjpeg's 1/2, 1/4 or 1/8 DCT scale (PIL's draft).
- DataLoader w0/w2:  torchvision's RandomResizedCrop(224) + flip on PIL's full decode (no draft,
                     as torchvision users run it), batch_size=None, num_workers 0 and 2.
Runtime threads = cores. Each figure: images/s, the best of --epochs epochs after a warm-up
epoch; full and scaled take turns epoch by epoch, and scaled / full is the median of the rounds'
ratios. Also: the quality cost of scaled decode, the PSNR of its crops against the full decode's
(the same crops), over every photo. Goals: scaled >= 1.5x full, scaled >= 2.5x the best
DataLoader setting.

    ... bench_large_photos.py --photos 1 --quality-by-subsampling [PHOTO]

measures only the quality cost per chroma subsampling (4:4:4, 4:2:0, 4:2:2, 4:4:0, 4:1:1): the
photo (default: the first generated one) re-encoded at q90 each way by TurboJPEG, 48 crops to
224 with scaled_decode "large" against "never".
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.utils.data
import torchvision.transforms as T
from PIL import Image, ImageDraw

import splitflow as sf


def make_photos(root, n):
    marker = os.path.join(root, f".complete-{n}")
    if os.path.exists(marker):
        return
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(5)
    H, W = 3424, 4288
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    for i in range(n):
        base = (127 + 60 * np.sin(xx / (150 + 20 * i)) * np.cos(yy / (90 + 10 * i)))[..., None] * \
            np.array([1.0, 0.8, 0.6], np.float32)
        im = Image.fromarray(np.clip(base + rng.normal(0, 12, (H, W, 3)), 0, 255).astype(np.uint8))
        d = ImageDraw.Draw(im)
        for _ in range(60):
            x, y = rng.integers(0, W - 400), rng.integers(0, H - 400)
            d.rectangle([x, y, x + rng.integers(20, 400), y + rng.integers(20, 400)],
                        fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
        for _ in range(200):
            x = rng.integers(0, W)
            d.line([x, 0, x + 50, H], fill=(255, 255, 255), width=1)
        im.save(os.path.join(root, f"{i:03d}.jpg"), quality=92)
    open(marker, "w").close()


class PilPhotos(torch.utils.data.Dataset):
    def __init__(self, paths):
        self.paths = paths
        self.t = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as im:
            return self.t(im if im.mode == "RGB" else im.convert("RGB"))


def best_rate(make, epochs, n):
    rates = []
    for e in range(epochs + 1):
        start = time.perf_counter()
        count = sum(1 for _ in make(e))
        assert count == n, (count, n)
        if e:
            rates.append(n / (time.perf_counter() - start))
    return max(rates), rates


def turbojpeg_encode(a, subsampling, quality=90):
    """`a` (HWC uint8 RGB) as a JPEG of that chroma subsampling (TurboJPEG's: PIL's encoder
    has no 4:4:0 or 4:1:1)."""
    import ctypes
    tj = ctypes.CDLL("libturbojpeg.so.0")
    tj.tjInitCompress.restype = ctypes.c_void_p
    samp = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2, "4:4:0": 4, "4:1:1": 5}[subsampling]
    h = tj.tjInitCompress()
    buf, size = ctypes.POINTER(ctypes.c_ubyte)(), ctypes.c_ulong(0)
    a = np.ascontiguousarray(a)
    rc = tj.tjCompress2(ctypes.c_void_p(h), a.ctypes.data_as(ctypes.c_void_p), a.shape[1], 0,
                        a.shape[0], 0, ctypes.byref(buf), ctypes.byref(size), samp, quality, 0)
    assert rc == 0, "tjCompress2 failed"
    out = ctypes.string_at(buf, size.value)
    tj.tjFree(buf)
    tj.tjDestroy(ctypes.c_void_p(h))
    return out


def quality_by_subsampling(path, crops):
    """The PSNR of scaled decode (the default) against full decode, over `crops` crops to 224 of
    one photo re-encoded at each chroma subsampling."""
    a = np.asarray(Image.open(path).convert("RGB"))
    rt = sf.Runtime(threads=2)
    rows = {}
    for samp in ("4:4:4", "4:2:0", "4:2:2", "4:4:0", "4:1:1"):
        data = np.frombuffer(turbojpeg_encode(a, samp), np.uint8)
        got = {}
        for mode in ("large", "never"):
            g = sf.Graph(rt, "quality")
            out = g.pull_sink("out")
            (g.source("bytes", [data] * crops)
             >> g.stage("crop", sf.ops.decode_random_resized_crop(224, seed=3, epoch=1, scaled_decode=mode))
             >> out)
            got[mode] = [np.asarray(t).astype(np.float64) for t in g.iterate(out)]
        p = [10 * np.log10(255 ** 2 / max(((x - y) ** 2).mean(), 1e-12))
             for x, y in zip(got["large"], got["never"]) if not np.array_equal(x, y)]
        rows[samp] = {"scaled_crops": len(p), "psnr_min": min(p) if p else None,
                      "psnr_median": statistics.median(p) if p else None}
        print(f"{samp}: {len(p)} of {crops} crops scaled: PSNR against full decode min "
              f"{min(p):.2f} dB, median {statistics.median(p):.2f} dB" if p else f"{samp}: none scaled")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--data", default="build/bench-data/large")
    ap.add_argument("--json")
    ap.add_argument("--quality-by-subsampling", metavar="PHOTO", nargs="?", const="",
                    help="only the PSNR of scaled decode against full decode, per chroma "
                         "subsampling, over 48 crops of PHOTO (default: the first generated photo)")
    args = ap.parse_args()
    root = f"{args.data}-{args.photos}"
    make_photos(root, args.photos)
    paths = sf.image_files(root)[: args.photos]
    if args.quality_by_subsampling is not None:
        rows = quality_by_subsampling(args.quality_by_subsampling or paths[0], 48)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    n = len(paths)
    rt = sf.Runtime()
    graphs = {}
    for mode in ("never", "large"):
        g = sf.Graph(rt, mode)
        out = g.pull_sink("out")
        (g.indices("i", list(range(n))) >> g.stage("read", sf.ops.read_file(paths), concurrency=2)
         >> g.stage("crop", sf.ops.decode_random_resized_crop(224, seed=1, scaled_decode=mode),
                    concurrency=0) >> out)
        graphs[mode] = (g, out)
    res = {}
    # full and scaled take turns, epoch by epoch (the order alternating), after a warm-up epoch
    # of each: their ratio is judged round by round, on the same machine state.
    rounds = {"never": [], "large": []}
    for mode in rounds:  # warm-up
        assert sum(1 for _ in graphs[mode][0].iterate(graphs[mode][1])) == n
    for r in range(args.epochs):
        for mode in (("never", "large") if r % 2 == 0 else ("large", "never")):
            start = time.perf_counter()
            assert sum(1 for _ in graphs[mode][0].iterate(graphs[mode][1])) == n
            rounds[mode].append(n / (time.perf_counter() - start))
    res["splitflow_full"], res["splitflow_scaled"] = max(rounds["never"]), max(rounds["large"])
    round_ratios = [b / a for a, b in zip(rounds["never"], rounds["large"])]
    for w in (0, 2):
        ds = PilPhotos(paths)
        res[f"dataloader_w{w}"], _ = best_rate(
            lambda e: torch.utils.data.DataLoader(ds, batch_size=None, num_workers=w), args.epochs, n)
    # Quality: the same crops (same seed and epoch) decoded both ways.
    full = [np.asarray(t).astype(np.float64) for t in graphs["never"][0].iterate(graphs["never"][1])]
    scaled = [np.asarray(t).astype(np.float64) for t in graphs["large"][0].iterate(graphs["large"][1])]
    psnr = []
    for a, b in zip(full, scaled):
        mse = ((a - b) ** 2).mean()
        psnr.append(99.0 if mse == 0 else 10 * np.log10(255 ** 2 / mse))
    best_dl = max(res["dataloader_w0"], res["dataloader_w2"])
    out = {
        "photos": n, "megapixels": 4288 * 3424 / 1e6, "cores": os.cpu_count(), "rates": res,
        "scaled_vs_full": statistics.median(round_ratios), "scaled_vs_full_rounds": round_ratios,
        "scaled_vs_best_dataloader": res["splitflow_scaled"] / best_dl,
        "psnr_min": min(psnr), "psnr_median": statistics.median(psnr),
    }
    for k, v in res.items():
        print(f"{k:>18}: {v:6.1f} images/s  ({v / best_dl:.2f}x best DataLoader)")
    print("scaled / full by round: " + ", ".join(f"{x:.2f}" for x in round_ratios))
    print(f"scaled / full {out['scaled_vs_full']:.2f} (median of the rounds; goal >= 1.5); scaled / best DataLoader "
          f"{out['scaled_vs_best_dataloader']:.2f} (goal >= 2.5)")
    print(f"quality of scaled decode vs full: PSNR min {out['psnr_min']:.1f} dB, median "
          f"{out['psnr_median']:.1f} dB over {n} crops")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
