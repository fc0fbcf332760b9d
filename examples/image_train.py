#!/usr/bin/python3
"""An image training input pipeline from Python: splitflow's C++ ops into a DataLoader.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/image_train.py [DIR] [--epochs N]

DIR is laid out as torchvision's ImageFolder reads it: DIR/<class>/**.jpg (class = folder name);
without one, 256 small JPEGs of 4 classes are written to a temporary directory first. Per
sample {"image", "label", "index"}, in C++ threads without the GIL: read -> decode only the
region of a random-resized-crop (+ flip) of the image -> batch of 32 (images stacked, labels
into an int64 tensor) -> normalize the images. Python only iterates (images, labels) batches,
and checks every label against its file's folder.
"""
import argparse
import os
import tempfile

import numpy as np
import torch

import splitflow as sf
import splitflow.torch as sft

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


CLASSES = ["red", "green", "blue", "gray"]


def write_sample_jpegs(root, n=256):
    """n JPEGs in root/<class>/, the class's colour dominating each."""
    from PIL import Image
    rng = np.random.default_rng(0)
    tint = {"red": (1, 0.3, 0.3), "green": (0.3, 1, 0.3), "blue": (0.3, 0.3, 1), "gray": (0.7, 0.7, 0.7)}
    for i in range(n):
        c = CLASSES[i % len(CLASSES)]
        os.makedirs(os.path.join(root, c), exist_ok=True)
        px = (rng.integers(0, 256, (6, 8, 3)) * np.array(tint[c])).astype(np.uint8)
        Image.fromarray(px).resize((200, 150), Image.BICUBIC).save(os.path.join(root, c, f"{i:04d}.jpg"), quality=90)
    # One corrupt file: skipped (its label with it) and reported, the epoch goes on.
    with open(os.path.join(root, "red", "corrupt.jpg"), "wb") as f:
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
    paths, labels, classes = sf.image_folder(args.dir)

    def build(g, indices):
        # `indices` is this rank's and worker's share of the epoch, already shuffled.
        # concurrency="auto": the graph's tuner sets each stage's (docs/autotune.md).
        read = g.stage("read", sf.ops.read_file(paths, labels=labels), concurrency="auto")
        crop = g.stage("decode+augment",
                       sf.ops.decode_random_resized_crop(args.size, seed=7, epoch=dataset.epoch),
                       field="image", concurrency="auto", on_error="skip")
        norm = g.stage("normalize", sf.ops.normalize(MEAN, STD), field="image", concurrency="auto")
        return indices >> read >> crop >> g.batch("batch", 32) >> norm

    dataset = sft.GraphDataset(build, len(paths), shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)   # batches come from the graph
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, len(classes)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        seen = 0
        for batch in loader:
            x, y = batch["image"], batch["label"]   # float32 (N, 3, size, size), int64 (N,)
            # Every label is its file's class folder, whatever the shuffle and the skips did.
            for label, i in zip(y.tolist(), batch["index"].tolist()):
                assert os.path.basename(os.path.dirname(paths[i])) == classes[label], paths[i]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += x.shape[0]
        stats = dataset.last_run.stats()
        decode = next(s for s in stats["stages"] if s["name"] == "decode+augment")
        print(f"epoch {epoch}: {seen} images of {len(classes)} classes (labels checked), "
              f"loss {loss.item():.4f}, skipped {decode.get('skipped', 0)} "
              f"({', '.join(e['message'].split(': ')[1] for e in decode.get('errors', []))})")
        # What the tuner set, and why (none in a run shorter than its 0.25 s window).
        for decision in stats.get("autotune", []):
            print(f"  autotune: {decision}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
