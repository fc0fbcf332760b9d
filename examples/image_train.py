#!/usr/bin/python3
"""An image training input pipeline from Python: splitflow's C++ ops into a DataLoader.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/image_train.py [DIR] [--epochs N]

DIR holds JPEGs (searched recursively); without one, 256 small JPEGs are written to a temporary
directory first. Per image, in C++ threads without the GIL: read -> decode only the region of
a random-resized-crop (+ flip) -> batch of 32 -> normalize. Python only iterates batches.
"""
import argparse
import os
import tempfile

import numpy as np
import torch

import splitflow as sf
import splitflow.torch as sft

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def write_sample_jpegs(root, n=256):
    from PIL import Image
    rng = np.random.default_rng(0)
    for i in range(n):
        px = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(px).resize((200, 150), Image.BICUBIC).save(os.path.join(root, f"{i:04d}.jpg"), quality=90)
    # One corrupt file: skipped and reported, the epoch goes on.
    with open(os.path.join(root, "corrupt.jpg"), "wb") as f:
        f.write(b"\xff\xd8 not really a jpeg")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--size", type=int, default=96)
    args = ap.parse_args()
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory()
        write_sample_jpegs(tmp.name)
        args.dir = tmp.name
    paths = sf.image_files(args.dir)

    def build(g, indices):
        # `indices` is this rank's and worker's share of the epoch, already shuffled.
        read = g.stage("read", sf.ops.read_file(paths), concurrency=2)
        crop = g.stage("decode+augment",
                       sf.ops.decode_random_resized_crop(args.size, seed=7, epoch=dataset.epoch),
                       concurrency=0, on_error="skip")
        norm = g.stage("normalize", sf.ops.normalize(MEAN, STD), concurrency=0)
        return indices >> read >> crop >> g.batch("batch", 32) >> norm

    dataset = sft.GraphDataset(build, len(paths), shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)   # batches come from the graph
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        seen = 0
        for x in loader:                      # float32 (N, 3, size, size)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += x.shape[0]
        stats = dataset.last_run.stats()
        decode = next(s for s in stats["stages"] if s["name"] == "decode+augment")
        print(f"epoch {epoch}: {seen} images, loss {loss.item():.4f}, "
              f"skipped {decode.get('skipped', 0)} ({', '.join(e['message'].split(': ')[1] for e in decode.get('errors', []))})")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
