#!/usr/bin/python3
"""An asyncio inference server loop from Python: requests through a dynamic batch into a torch
model step, each answered through its own future.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/inference_service.py [--requests N]

Many client coroutines submit feature vectors (some malformed, some with deadlines already
past); the graph checks each request in a thread stage (a bad one fails alone, with its own
error), gathers up to 16 requests or 2 ms into a batch, runs the model once per batch, and
splits the batch back into per-request answers. The loop checks every answer against the
model run directly on that request.
"""
import argparse
import asyncio

import numpy as np
import torch

import splitflow as sf

FEATURES, CLASSES = 16, 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)).eval()

    def check(x):                      # one request, on a CPU thread
        a = np.asarray(x, np.float32)
        if a.shape != (FEATURES,):
            raise ValueError(f"expected {FEATURES} features, got shape {a.shape}")
        return a

    batch_sizes = []

    def step(batch):                   # the requests' features collated: (n, FEATURES)
        x = torch.from_numpy(np.asarray(batch))
        batch_sizes.append(x.shape[0])
        with torch.no_grad():
            return model(x).argmax(1)  # one result per request

    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "classifier")
    svc = g.service("requests", max_pending=64)
    svc.source >> g.stage("check", check, concurrency=2, on_error="skip") \
        >> g.dynamic_batch("gather", max_batch=16, max_delay=0.002) \
        >> g.stage("model", step) >> g.unbatch("split", max_batch=16) >> svc.sink
    run = g.run()

    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(FEATURES).astype(np.float32) for _ in range(args.requests)]
    bad = set(range(7, args.requests, 50))            # malformed requests
    for i in bad:
        inputs[i] = inputs[i][:5]

    async def client(ids):
        results = {}
        for i in ids:
            try:
                results[i] = await asyncio.wrap_future(svc.submit(inputs[i], deadline=5.0))
            except sf.StageError as e:   # names the stage and the request; the cause is ours
                results[i] = e
        return results

    async def serve():
        chunks = [range(c, args.requests, args.clients) for c in range(args.clients)]
        merged = {}
        for r in await asyncio.gather(*(client(ids) for ids in chunks)):
            merged.update(r)
        return merged

    results = asyncio.run(serve())
    svc.close()
    assert run.wait() == "succeeded"
    with torch.no_grad():
        for i, r in results.items():
            if i in bad:
                assert isinstance(r.__cause__, ValueError), (i, r)
                assert r.stage == "check" and "expected 16 features" in str(r), (i, r)
            else:
                assert int(r) == int(model(torch.from_numpy(inputs[i])[None]).argmax(1)), i
    st = svc.stats()
    print(f"answered {st['answered']}, failed {st['failed']} (malformed), "
          f"{len(batch_sizes)} model steps, mean batch {np.mean(batch_sizes):.1f}, "
          f"p50 latency {st['latency_ns']['total']['p50'] / 1e3:.0f} us")


if __name__ == "__main__":
    main()
