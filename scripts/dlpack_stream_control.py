"""The control for python/tests/test_cuda.py's stream test, run by scripts/gpu-check.sh on a GPU:
the same sequence with and without the consumer's stream given to __dlpack__. Without it
(stream=-1: "the consumer synchronises itself", which this consumer then does not), splitflow
frees the memory on its own stream and may hand it to the next allocation while the torch stream
has not read it yet. It prints how often each way read the wrong values: the test is only worth
something if the unprotected way does go wrong here. A diagnostic, not a test: it asserts nothing.
"""
import gc
import sys

import numpy as np
import torch

import splitflow as sf

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def normalize_on_gpu(rt, image):
    g = sf.Graph(rt, "gpu-normalize")
    out = g.pull_sink("out")
    g.source("images", [image]) >> g.gpu_stage("normalize", sf.ops.gpu_normalize(MEAN, STD)) >> out
    (t,) = list(g.iterate(out))
    return t


def trial(rt, protect):
    zeros = np.zeros((256, 256, 3), np.uint8)
    full = np.full((256, 256, 3), 255, np.uint8)
    t = normalize_on_gpu(rt, zeros)
    want = float(torch.from_dlpack(t).double().sum())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.from_dlpack(t) if protect else torch.from_dlpack(t.__dlpack__(stream=-1))
        torch.cuda._sleep(200_000_000)
        total = x.double().sum()
    del x, t
    gc.collect()
    u = normalize_on_gpu(rt, full)
    side.synchronize()
    del u
    return abs(float(total) - want) > 1e-6 * abs(want)


def main():
    if not (sf.built_with_cuda() and torch.cuda.is_available()):
        print("no CUDA device: nothing to do")
        return 0
    rt = sf.Runtime(threads=2, backend="cuda", streams=2)
    n = 5
    for protect in (False, True):
        wrong = sum(trial(rt, protect) for _ in range(n))
        print(f"{'with' if protect else 'without'} the consumer's stream: {wrong}/{n} read "
              f"overwritten memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
