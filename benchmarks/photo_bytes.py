#!/usr/bin/python3
"""How the benchmark's synthetic JPEGs compare with real photographs: bytes and decode time.

    /usr/bin/python3 benchmarks/photo_bytes.py --data build/bench-data/images-3000 PHOTO [PHOTO ...]

Each PHOTO (any format PIL reads) is centre-cropped to 4:3, resized to 500x375 (bicubic) and saved
at quality 90, the shape and quality of the data set (benchmarks/bench_images.py). Prints each
photo's bytes and PIL decode time (best of --repeats) against the data set's mean, and the ratios of
the means. Photos that Debian packages carry, for a machine without a network:
/usr/share/matplotlib/mpl-data/sample_data/grace_hopper.jpg, scipy.misc.face() saved as a PNG.
"""
import argparse
import glob
import io
import os
import sys
import time

from PIL import Image


def as_dataset_jpeg(path):
    im = Image.open(path).convert("RGB")
    w, h = im.size
    if w * 3 > h * 4:
        nw = h * 4 // 3
        im = im.crop(((w - nw) // 2, 0, (w - nw) // 2 + nw, h))
    else:
        nh = w * 3 // 4
        im = im.crop((0, (h - nh) // 2, w, (h - nh) // 2 + nh))
    im = im.resize((500, 375), Image.BICUBIC)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=90)
    return out.getvalue()


def decode_ms(data, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        Image.open(io.BytesIO(data)).convert("RGB").load()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the data set's folder of JPEGs")
    ap.add_argument("--sample", type=int, default=200, help="data set files timed (all are sized)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("photos", nargs="+")
    a = ap.parse_args()

    # The photos are converted first: their large frames, freed, raise glibc's mmap threshold, so
    # that every decode below reuses heap pages. A process that decodes only 500x375 JPEGs maps and
    # faults in each frame afresh, which on the 2-core VM made PIL's decode ~4.5 ms, not ~0.75.
    photos = [(p, as_dataset_jpeg(p)) for p in a.photos]
    files = sorted(glob.glob(os.path.join(a.data, "*.jpg")))
    if not files:
        sys.exit(f"photo_bytes: no .jpg files in {a.data}")
    sizes = [os.path.getsize(f) for f in files]
    ds_bytes = sum(sizes) / len(sizes)
    step = max(1, len(files) // a.sample)
    timed = [open(f, "rb").read() for f in files[::step][: a.sample]]
    ds_ms = sum(decode_ms(d, max(1, a.repeats // 4)) for d in timed) / len(timed)
    print(f"data set {a.data}: {len(files)} files, mean {ds_bytes:.0f} bytes, "
          f"decode {ds_ms:.2f} ms (mean of {len(timed)})")

    rows = []
    for p, data in photos:
        ms = decode_ms(data, a.repeats)
        rows.append((len(data), ms))
        print(f"{p}: {len(data)} bytes ({len(data) / ds_bytes:.2f}x), decode {ms:.2f} ms "
              f"({ms / ds_ms:.2f}x)")
    mb = sum(r[0] for r in rows) / len(rows)
    mm = sum(r[1] for r in rows) / len(rows)
    print(f"photos: mean {mb:.0f} bytes = {mb / ds_bytes:.2f}x the data set "
          f"({min(r[0] for r in rows) / ds_bytes:.2f}-{max(r[0] for r in rows) / ds_bytes:.2f}x); "
          f"decode {mm:.2f} ms = {mm / ds_ms:.2f}x")


if __name__ == "__main__":
    main()
