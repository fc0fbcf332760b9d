#!/usr/bin/python3
"""A small model trained for a few steps from a splitflow loader.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/torch_train.py

The graph makes each sample: a C++ op fills an image (test data standing in for decoding),
another C++ op normalises it to float CHW (both run without the GIL, in parallel), and a
Python stage attaches the label. DataLoader(batch_size=None) reads it in the main process
(num_workers=0: splitflow does the parallelism in threads).
"""
import time

import torch
import torch.utils.data

import splitflow as sf
import splitflow.torch as sft

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


def build(g, indices):
    image = indices >> g.stage("image", sf.ops.fill([32, 32, 3], "uint8"), concurrency="auto")
    norm = image >> g.stage("normalize", sf.ops.normalize(MEAN, STD), concurrency="auto")
    # Label: is the (index-derived) pixel value above the middle?
    return norm >> g.stage("label", lambda t: (t, int(t.numpy()[0, 0, 0] > 0.0)))


def main():
    torch.manual_seed(0)
    ds = sft.GraphDataset(build, 512, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    model = torch.nn.Sequential(torch.nn.Flatten(0), torch.nn.Linear(3 * 32 * 32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.monotonic()
    for epoch in range(2):
        ds.set_epoch(epoch)
        total, correct = 0.0, 0
        for step, (x, y) in enumerate(loader):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits[None], torch.tensor([y]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            correct += int(logits.argmax().item() == y)
        print(f"epoch {epoch}: {step + 1} steps, mean loss {total / (step + 1):.4f}, "
              f"accuracy {correct / (step + 1):.2%}")
    print(f"{2 * len(ds) / (time.monotonic() - start):.0f} samples/s")
    print(ds.last_run.report())


if __name__ == "__main__":
    main()
