"""splitflow's CUDA memory in PyTorch: DLPack export of device tensors on a real GPU.
Each test names the requirement of the issue "Python binding" it checks. They skip where there is
no CUDA build, no device or a CPU-only torch; scripts/gpu-check.sh runs them on a GPU machine."""
import gc

import numpy as np
import pytest
import torch

import splitflow as sf

pytestmark = pytest.mark.skipif(
    not (sf.built_with_cuda() and torch.cuda.is_available()),
    reason="no CUDA device (or splitflow built without CUDA, or a CPU-only torch)")

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def reference(img):
    ref = (img.astype(np.float32) / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return ref.transpose(2, 0, 1)


def normalize_on_gpu(rt, images):
    g = sf.Graph(rt, "gpu-normalize")
    out = g.pull_sink("out")
    g.source("images", images) >> g.gpu_stage("normalize", sf.ops.gpu_normalize(MEAN, STD)) >> out
    return list(g.iterate(out))


@pytest.fixture(scope="module")
def rt():
    return sf.Runtime(threads=2, backend="cuda", streams=2)


# "Results come out zero-copy: ... as torch tensors through DLPack (`__dlpack__`,
# `__dlpack_device__` ...)" for CUDA memory
def test_device_tensors_become_cuda_torch_tensors_without_a_copy(rt):
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, size=(32, 24, 3), dtype=np.uint8) for _ in range(4)]
    got = normalize_on_gpu(rt, images)
    assert len(got) == 4
    for img, t in zip(images, got):
        assert t.device == "cuda:0" and t.memory == "device"
        assert t.__dlpack_device__() == (2, 0)
        a, b = torch.from_dlpack(t), torch.from_dlpack(t)
        assert a.is_cuda and a.device.index == 0
        assert a.shape == (3, 32, 24) and a.dtype == torch.float32
        assert a.data_ptr() == b.data_ptr()  # both view splitflow's memory
        np.testing.assert_allclose(a.cpu().numpy(), reference(img), rtol=1e-5, atol=1e-5)
        a[0, 0, 0] = 42.0
        assert float(b[0, 0, 0]) == 42.0
        with pytest.raises(BufferError, match="torch.from_dlpack"):
            memoryview(t)
    dev = rt.device_stats()
    assert dev["backend"] == "cuda" and dev["leases_in_use"] == 0


# "honouring the consumer's `stream` argument for CUDA memory": the memory a torch stream still
# reads is not handed to the next allocation before that stream's work is done.
def test_memory_a_torch_stream_still_reads_is_not_reused_early(rt):
    zeros = np.zeros((256, 256, 3), np.uint8)
    full = np.full((256, 256, 3), 255, np.uint8)
    want = float(torch.from_numpy(reference(zeros)).double().sum())
    want_full = float(torch.from_numpy(reference(full)).double().sum())
    for _ in range(3):
        (t,) = normalize_on_gpu(rt, [zeros])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = torch.from_dlpack(t)  # torch passes `side` as __dlpack__'s stream
            torch.cuda._sleep(200_000_000)  # `side` is busy for ~0.1 s before it reads x
            total = x.double().sum()
        del x, t
        gc.collect()  # the last reference to the memory: its free goes behind `side`'s work
        # The next allocation of that size writes other values while `side` has not read yet.
        (u,) = normalize_on_gpu(rt, [full])
        side.synchronize()
        assert float(total) == pytest.approx(want, rel=1e-6)
        assert float(torch.from_dlpack(u).double().sum()) == pytest.approx(want_full, rel=1e-6)
        del u
    gc.collect()
    assert rt.device_stats()["device_bytes_in_use"] == 0  # every pool byte came back


def test_dlpack_stream_values(rt):
    (t,) = normalize_on_gpu(rt, [np.zeros((4, 4, 3), np.uint8)])
    with pytest.raises(ValueError, match="stream=0 is ambiguous"):
        t.__dlpack__(stream=0)
    # -1: the consumer synchronises itself; 1 and 2: the default streams; None: legacy default.
    for s in (-1, 1, 2, None):
        x = torch.from_dlpack(t.__dlpack__(stream=s))
        assert x.is_cuda and x.shape == (3, 4, 4)
    torch.cuda.synchronize()
