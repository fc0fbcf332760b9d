"""The image ops from Python: files -> read -> decode -> random-resized-crop -> batch, in C++.
The JPEGs are written here by PIL (Debian's python3-pil)."""
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

import splitflow as sf
import splitflow.torch as sft


def write_jpegs(root, n, size=(64, 48)):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        w, h = size[0] + i % 5, size[1] + (i * 3) % 7
        base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
        px = (base + rng.integers(0, 40, (h, w, 3))).clip(0, 255).astype(np.uint8)
        p = os.path.join(root, f"img_{i:03d}.jpg")
        Image.fromarray(px).save(p, quality=90)
        paths.append(p)
    return paths


def test_decode_equals_pil_which_uses_libjpeg_turbo_too(tmp_path):
    paths = write_jpegs(str(tmp_path), 6)
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "decode")
    idx = g.indices("i", list(range(len(paths))))
    out = g.pull_sink("out")
    idx >> g.stage("read", sf.ops.read_file(paths)) >> g.stage("decode", sf.ops.decode_jpeg()) >> out
    got = [np.asarray(t).copy() for t in g.iterate(out)]
    for p, a in zip(paths, got):
        want = np.asarray(Image.open(p).convert("RGB"))
        assert a.shape == want.shape
        assert np.array_equal(a, want), p


def test_image_files_directory_glob_and_list(tmp_path):
    paths = write_jpegs(str(tmp_path), 3)
    (tmp_path / "notes.txt").write_text("x")
    assert sf.image_files(str(tmp_path)) == sorted(paths)
    assert sf.image_files(str(tmp_path / "img_00[01].jpg")) == sorted(paths)[:2]
    (tmp_path / "list.lst").write_text("# subset\nimg_002.jpg\n")
    assert sf.image_files(str(tmp_path / "list.lst")) == [str(tmp_path / "img_002.jpg")]
    with pytest.raises(sf.Error, match="no file matches"):
        sf.image_files(str(tmp_path / "*.png"))


def test_corrupt_files_are_skipped_counted_and_named(tmp_path):
    paths = write_jpegs(str(tmp_path), 20)
    good = open(paths[0], "rb").read()
    bad = str(tmp_path / "img_truncated.jpg")
    open(bad, "wb").write(good[: len(good) // 2])
    garbage = str(tmp_path / "img_garbage.jpg")
    open(garbage, "wb").write(b"\x00" * 300)
    paths = sf.image_files(str(tmp_path))
    assert len(paths) == 22
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "images")
    idx = g.indices("i", list(range(len(paths))))
    read = g.stage("read", sf.ops.read_file(paths), concurrency=2)
    dec = g.stage("decode", sf.ops.decode_jpeg(), concurrency=0, on_error="skip")
    crop = g.stage("crop", sf.ops.random_resized_crop(32, seed=3, epoch=0), concurrency=0)
    batch = g.batch("batch", 8)
    out = g.pull_sink("out")
    idx >> read >> dec >> crop >> batch >> out
    it = g.iterate(out)
    shapes = [tuple(np.asarray(b).shape) for b in it]
    assert shapes == [(8, 32, 32, 3), (8, 32, 32, 3), (4, 32, 32, 3)]
    stats = it.run.stats()
    decode = next(s for s in stats["stages"] if s["name"] == "decode")
    assert decode["skipped"] == 2
    named = " ".join(e["message"] for e in decode["errors"])
    assert "img_truncated.jpg" in named and "img_garbage.jpg" in named
    # Without the policy the first corrupt file fails the run, naming stage, item and file.
    g2 = sf.Graph(rt, "strict")
    idx2 = g2.indices("i", list(range(len(paths))))
    out2 = g2.pull_sink("out")
    idx2 >> g2.stage("read", sf.ops.read_file(paths)) >> g2.stage("decode", sf.ops.decode_jpeg()) >> out2
    with pytest.raises(sf.StageError, match="img_garbage.jpg") as err:
        for _ in g2.iterate(out2):
            pass
    assert err.value.stage == "decode"
    assert err.value.item == paths.index(garbage)


def test_substitute_and_bad_policy():
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "sub")
    src = g.source("s", [1, 0, 2])
    inv = g.stage("inv", lambda x: 10 // x, substitute=-1)
    out = g.pull_sink("out")
    src >> inv >> out
    it = g.iterate(out)
    assert list(it) == [10, -1, 5]
    inv_stats = next(s for s in it.run.stats()["stages"] if s["name"] == "inv")
    assert inv_stats["substituted"] == 1
    assert "ZeroDivisionError" in inv_stats["errors"][0]["message"]
    with pytest.raises(sf.GraphError, match="on_error must be"):
        g.stage("x", lambda x: x, on_error="ignore")


def test_augmented_batches_are_reproducible_through_graph_dataset(tmp_path):
    paths = write_jpegs(str(tmp_path), 30)

    def make(epoch):
        def build(g, indices):
            read = g.stage("read", sf.ops.read_file(paths), concurrency=2)
            dec = g.stage("decode", sf.ops.decode_jpeg(), concurrency=0)
            crop = g.stage("crop", sf.ops.random_resized_crop(24, seed=1, epoch=epoch), concurrency=0)
            norm = g.stage("norm", sf.ops.normalize([0.5] * 3, [0.25] * 3), concurrency=0)
            return indices >> read >> dec >> crop >> g.batch("batch", 8) >> norm
        ds = sft.GraphDataset(build, len(paths), shuffle=True, seed=4)
        ds.set_epoch(epoch)
        return [b.clone() for b in torch.utils.data.DataLoader(ds, batch_size=None)]

    a, b, c = make(0), make(0), make(1)
    assert [t.shape for t in a] == [torch.Size([8, 3, 24, 24])] * 3 + [torch.Size([6, 3, 24, 24])]
    assert all(torch.equal(x, y) for x, y in zip(a, b))      # same seed and epoch: same batches
    assert not all(torch.equal(x, y) for x, y in zip(a, c))  # another epoch: other crops/order


def test_fused_decode_crop_equals_decode_then_crop(tmp_path):
    paths = write_jpegs(str(tmp_path), 12, size=(200, 150))
    rt = sf.Runtime(threads=2)

    def run(stages):
        g = sf.Graph(rt, "g")
        node = g.indices("i", list(range(len(paths)))) >> g.stage("read", sf.ops.read_file(paths))
        for k, op in enumerate(stages):
            node = node >> g.stage(f"s{k}", op, concurrency=0)
        out = g.pull_sink("out")
        node >> out
        return [np.asarray(t).copy() for t in g.iterate(out)]

    fused = run([sf.ops.decode_random_resized_crop(48, seed=9, epoch=2)])
    split = run([sf.ops.decode_jpeg(), sf.ops.random_resized_crop(48, seed=9, epoch=2)])
    assert len(fused) == len(split) == 12
    for a, b in zip(fused, split):
        assert a.shape == (48, 48, 3)
        assert np.array_equal(a, b)
