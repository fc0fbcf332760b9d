"""The image ops from Python: files -> read -> decode -> random-resized-crop -> batch, in C++.
The JPEGs are written here by PIL (Debian's python3-pil)."""
import io
import os
import re

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


# Damaged files as PIL (and so torchvision's ImageFolder) takes them: a file cut short is
# refused by both ("image file is truncated"), as is one whose damage makes a bad marker; one
# with junk before its end marker, corrupt entropy data or trailing bytes is decoded by both,
# to the same pixels, by decode_jpeg and by the fused crop. Before: splitflow refused the junk
# and the corrupt data, so a data set torchvision trains on failed (or, under on_error="skip",
# lost those images).
def test_damaged_files_are_refused_or_decoded_as_pil_does(tmp_path):
    rng = np.random.default_rng(41)
    px = Image.fromarray((rng.random((30, 40, 3)) * 255).astype(np.uint8)).resize((320, 240))
    buf = io.BytesIO()
    px.save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    corrupt, inverted = bytearray(jpeg), bytearray(jpeg)
    for i in range(len(jpeg) - 2000, len(jpeg) - 1950):
        if corrupt[i - 1] != 0xFF and corrupt[i] != 0xFF:  # no marker made: data, garbled
            corrupt[i] = (corrupt[i] * 7 + 13) & 0x7F
    for i in range(len(jpeg) - 300, len(jpeg) - 250):
        inverted[i] ^= 0xFF  # makes a marker libjpeg does not know: an error, not a warning
    cases = {"cut60": jpeg[:len(jpeg) * 6 // 10], "cut98": jpeg[:len(jpeg) * 98 // 100],
             "noeoi": jpeg[:-2], "inverted": bytes(inverted),
             "junk": jpeg[:-2] + b"\x5a" * 50 + jpeg[-2:], "corrupt": bytes(corrupt),
             "trailing": jpeg + b"not jpeg" * 8}
    paths = []
    for name, data in cases.items():
        paths.append(str(tmp_path / f"{name}.jpg"))
        open(paths[-1], "wb").write(data)
    intact = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    rt = sf.Runtime(threads=2)
    accepted = []
    for k, (name, path) in enumerate(zip(cases, paths)):
        pil_error = None
        try:
            want = np.asarray(Image.open(path).convert("RGB"))
            accepted.append(name)
        except OSError as e:
            pil_error = str(e)
        got = {}
        for label, ops in (
                ("decode", [sf.ops.decode_jpeg()]),
                ("split", [sf.ops.decode_jpeg(), sf.ops.random_resized_crop(48, seed=2, epoch=1)]),
                ("fused", [sf.ops.decode_random_resized_crop(48, seed=2, epoch=1)])):
            g = sf.Graph(rt, f"damaged-{name}")
            node = g.indices("i", [k]) >> g.stage("read", sf.ops.read_file(paths))
            for j, op in enumerate(ops):
                node = node >> g.stage(f"op{j}", op)
            out = g.pull_sink("out")
            node >> out
            if pil_error is not None:
                refused = "Premature end of JPEG file" if "truncated" in pil_error else ""
                with pytest.raises(sf.StageError, match=f"{name}.jpg': {refused}"):
                    list(g.iterate(out))
                continue
            items = [np.asarray(t).copy() for t in g.iterate(out)]
            assert len(items) == 1, (name, label)
            got[label] = items[0]
        if pil_error is None:
            assert np.array_equal(got["decode"], want), f"{name}: not PIL's pixels"
            assert np.array_equal(got["fused"], got["split"]), f"{name}: fused != decode, crop"
            assert np.array_equal(want, intact) == (name != "corrupt"), name
    assert accepted == ["junk", "corrupt", "trailing"]


# A new user's trial: a CMYK JPEG failed with libjpeg's "Unsupported color conversion request",
# where PIL, and so torchvision's ImageFolder (Image.open(f).convert("RGB")), decodes it (ImageNet's
# training set has a few dozen such files: under on_error="skip" they were lost every epoch).
# Now decoded as PIL converts them, pixel for pixel, in RGB and gray, baseline and progressive,
# and the fused crop (at full and reduced DCT scale) equals decode-then-crop.
def test_cmyk_jpegs_decode_as_pil_converts_them(tmp_path):
    rng = np.random.default_rng(3)
    h, w = 300, 420
    yy, xx = np.mgrid[0:h, 0:w]
    cmyk = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) * 127 // (w + h)),
                     (64 + 60 * np.sin(xx / 17.0) * np.cos(yy / 11.0))], -1)
    cmyk = (cmyk + rng.integers(0, 30, cmyk.shape)).clip(0, 255).astype(np.uint8)
    paths = []
    for name, kw in (("cmyk", {}), ("cmyk-progressive", {"progressive": True})):
        paths.append(str(tmp_path / f"{name}.jpg"))
        Image.fromarray(cmyk, "CMYK").save(paths[-1], quality=90, **kw)
    rt = sf.Runtime(threads=2, backend="host")

    def run(name, *ops):
        g = sf.Graph(rt, name)
        node = g.indices("i", list(range(len(paths)))) >> g.stage("read", sf.ops.read_file(paths))
        for k, op in enumerate(ops):
            node = node >> g.stage(f"s{k}", op)
        out = g.pull_sink("out")
        node >> out
        return [np.asarray(t).copy() for t in g.iterate(out)]

    for p, got in zip(paths, run("rgb", sf.ops.decode_jpeg())):
        assert Image.open(p).mode == "CMYK"
        assert np.array_equal(got, np.asarray(Image.open(p).convert("RGB"))), p
    for p, got in zip(paths, run("gray", sf.ops.decode_jpeg(gray=True))):
        assert np.array_equal(got[..., 0], np.asarray(Image.open(p).convert("L"))), p
    for size in (64, 200):  # 64: a shrink of 2x or more, decoded at a reduced DCT scale
        for scaled in ("never", "large"):
            fused = run("fused", sf.ops.decode_random_resized_crop(size, seed=4, epoch=1,
                                                                 scaled_decode=scaled))
            split = run("split", sf.ops.decode_jpeg(),
                        sf.ops.random_resized_crop(size, seed=4, epoch=1))
            for a, b in zip(fused, split):
                assert a.shape == (size, size, 3)
                if scaled == "never":
                    assert np.array_equal(a, b)
                else:  # within the scaled decode's stated cost (docs/api.md)
                    assert 10 * np.log10(255 ** 2 / max(((a.astype(float) - b) ** 2).mean(), 1e-9)) > 30


def test_image_files_directory_glob_and_list(tmp_path):
    paths = write_jpegs(str(tmp_path), 3)
    (tmp_path / "notes.txt").write_text("x")
    assert sf.image_files(str(tmp_path)) == sorted(paths)
    assert sf.image_files(str(tmp_path / "img_00[01].jpg")) == sorted(paths)[:2]
    (tmp_path / "list.lst").write_text("# subset\nimg_002.jpg\n")
    assert sf.image_files(str(tmp_path / "list.lst")) == [str(tmp_path / "img_002.jpg")]
    with pytest.raises(sf.Error, match="no file matches"):
        sf.image_files(str(tmp_path / "*.png"))
    # A path that is not there and no pattern: said so (it read "FileList::glob: no file
    # matches" for a misspelled directory, a new user's trial).
    with pytest.raises(sf.Error, match=re.escape(f"splitflow.image_files('{tmp_path / 'nope'}'): no "
                                                 "such directory or file (it takes a directory, a "
                                                 "list file or a glob pattern)")):
        sf.image_files(tmp_path / "nope")
    with pytest.raises(sf.Error, match="no such directory or file"):
        sf.image_files(tmp_path / "nope", extensions=[".png"])


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


# A torchvision user's trial (2026-12-05): RandomResizedCrop(size=(h, w)) takes a height and a
# width; splitflow's crop ops took an int only. They take (h, w) (or [s], or s) now: with the
# whole image as the box (scale and ratio pinned to it, no flip) the crop is the image resized
# to h x w, and the fused op equals decode-then-crop.
def test_crop_ops_take_a_height_and_width_as_torchvision_does(tmp_path):
    paths = write_jpegs(str(tmp_path), 6, size=(200, 150))
    rt = sf.Runtime(threads=2)

    def run(stages):
        g = sf.Graph(rt, "g")
        node = g.indices("i", list(range(len(paths)))) >> g.stage("read", sf.ops.read_file(paths))
        for k, op in enumerate(stages):
            node = node >> g.stage(f"s{k}", op)
        out = g.pull_sink("out")
        node >> out
        return [np.asarray(t).copy() for t in g.iterate(out)]

    fused = run([sf.ops.decode_random_resized_crop((32, 56), seed=4)])
    split = run([sf.ops.decode_jpeg(), sf.ops.random_resized_crop(size=[32, 56], seed=4)])
    assert [a.shape for a in fused] == [(32, 56, 3)] * 6
    for a, b in zip(fused, split):
        assert np.array_equal(a, b)
    assert [a.shape for a in run([sf.ops.decode_random_resized_crop([40])])] == [(40, 40, 3)] * 6
    # The box is the whole image (one image size: 200x150, the first file): the crop is resize.
    whole = dict(scale=(1.0, 1.0), ratio=(200 / 150, 200 / 150), flip=0.0)
    crop = run([sf.ops.decode_jpeg(), sf.ops.random_resized_crop((30, 70), **whole)])[0]
    resized = run([sf.ops.decode_jpeg(), sf.ops.resize(30, 70)])[0]
    assert crop.shape == (30, 70, 3) and np.array_equal(crop, resized)
    for bad, text in [((32, 0), "width 0 is out of range"), ((1, 2, 3), "size must be an int or "
                      "(height, width), not (1, 2, 3)"), ("32", "size must be an int or (height, "
                      "width), not '32'"), ((32.0, 32), "not (32.0, 32)"), (True, "not True")]:
        for op in (sf.ops.random_resized_crop, sf.ops.decode_random_resized_crop):
            with pytest.raises(sf.Error, match=re_escape(text)):
                op(bad)


# random_resized_crop draws its box and flip from (seed, epoch, the item's index). An image
# that went through a Python stage is a plain array, without the index read_file gave it: every
# item got index 0, the same box and flip (a new user's trial: 1 distinct crop of 8). Now a plain
# array takes its item's number in the run, and a sample's array its "index" field (field=).
def test_random_resized_crop_draws_per_item_after_a_python_stage(tmp_path):
    paths = write_jpegs(str(tmp_path), 8, size=(200, 150))
    rt = sf.Runtime(threads=2)
    crop = dict(size=40, seed=5, epoch=1)

    def run(order, middle, final, labels=None, blocking=False):
        g = sf.Graph(rt, "g")
        node = g.indices("i", order) >> g.stage("read", sf.ops.read_file(paths, labels))
        field = "image" if labels is not None else None
        node = node >> g.stage("decode", sf.ops.decode_jpeg(), field=field)
        if middle is not None:
            node = node >> g.stage("py", middle)
        out = g.pull_sink("out")
        node >> g.stage("crop", final, field=field, blocking=blocking) >> out
        return [(np.asarray(t["image"]).copy(), int(t["index"])) if labels is not None
                else np.asarray(t).copy() for t in g.iterate(out)]

    order = list(range(8))
    want = run(order, None, sf.ops.random_resized_crop(**crop))  # Images: index i
    assert len({a.tobytes() for a in want}) == 8
    # The same through a Python stage returning a new array: item k of the run is index k.
    got = run(order, lambda t: np.asarray(t) + 0, sf.ops.random_resized_crop(**crop))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # On the blocking threads too (where an automatic stage whose bodies waited is placed).
    got = run(order, lambda t: np.asarray(t) + 0, sf.ops.random_resized_crop(**crop), blocking=True)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # Labelled samples in another order: the crop follows each sample's "index", not its place.
    shuffled = [5, 2, 7, 0, 3, 6, 1, 4]

    def renew(s):
        return {"image": np.asarray(s["image"]) + 0, "label": s["label"], "index": s["index"]}

    labelled = run(shuffled, renew, sf.ops.random_resized_crop(**crop), labels=list(range(8)))
    assert [i for _, i in labelled] == shuffled
    for a, i in labelled:
        assert np.array_equal(a, want[i]), f"index {i}"
    # A field the op cannot take is substituted alone: the sample keeps its other fields.
    g = sf.Graph(rt, "sub")
    out = g.pull_sink("out")
    zero = np.zeros((4, 4, 3), np.uint8)
    g.source("n", [{"image": "not pixels", "label": 3, "index": 7}]) >> g.stage(
        "crop", sf.ops.random_resized_crop(**crop), field="image",
        substitute=zero) >> out
    (s,) = list(g.iterate(out))
    assert np.array_equal(np.asarray(s["image"]), zero) and s["label"] == 3 and s["index"] == 7


# antialias=False is the plain bilinear of the full decode "whatever the scale", the fused op
# equal to decode-then-crop with either setting: on a photo of 8 megapixels or more the fused
# op decoded at a reduced DCT scale and antialiased anyway (byte for byte the antialias=True
# output; 25 dB from decode-then-crop in the trial). Now it decodes in full there, and
# scaled_decode="always" with antialias=False is refused when the op is built.
def test_fused_crop_without_antialias_equals_decode_then_crop_on_large_photos(tmp_path):
    h, w = 2448, 3300  # 8.08 megapixels: the default scales such photos
    yy, xx = np.arange(h, dtype=np.uint32)[:, None], np.arange(w, dtype=np.uint32)[None, :]
    px = np.stack(np.broadcast_arrays((xx * 7 + yy * 3) % 256, (xx ^ yy) % 256,
                                      (xx * yy // 97) % 256), -1)
    p = str(tmp_path / "big.jpg")
    Image.fromarray(px.astype(np.uint8)).save(p, quality=90)
    rt = sf.Runtime(threads=2)

    def run(stages):
        g = sf.Graph(rt, "g")
        node = g.indices("i", [0, 0, 0, 0]) >> g.stage("read", sf.ops.read_file([p]))
        for k, op in enumerate(stages):
            node = node >> g.stage(f"s{k}", op)
        out = g.pull_sink("out")
        node >> out
        return [np.asarray(t).copy() for t in g.iterate(out)]

    crop = dict(size=64, seed=3, epoch=0, scale=(0.3, 0.6))
    split = run([sf.ops.decode_jpeg(), sf.ops.random_resized_crop(**crop, antialias=False)])
    fused = run([sf.ops.decode_random_resized_crop(**crop, antialias=False)])
    scaled = run([sf.ops.decode_random_resized_crop(**crop)])
    for a, b, c in zip(split, fused, scaled):
        assert np.array_equal(a, b)
        assert not np.array_equal(b, c)  # the antialiased, scaled decode differs
    with pytest.raises(sf.GraphError, match="scaled decode 'always' with antialias off") as e:
        sf.ops.decode_random_resized_crop(64, antialias=False, scaled_decode="always")
    # It names the Python value to use (it named C++'s 'large_photos', which Python refuses).
    assert "Python's 'large'" in str(e.value)


# "Bad input gets a clear error naming what was wrong": op arguments are checked when the op is
# built (not per item, where on_error="skip" would turn them into an empty epoch).
@pytest.mark.parametrize("kwargs, text", [
    (dict(size=0), "size 0 is out of range"),
    (dict(size=-5), "size -5 is out of range"),
    (dict(size=100000), "size 100000 is out of range: give 1 to 16384"),
    (dict(scale=(2, -1)), "scale (2, -1) must be two finite positive numbers, the smaller first"),
    (dict(scale=(float("nan"), 1)), "scale (nan, 1) must be two finite positive numbers"),
    (dict(ratio=(2, 1)), "ratio (2, 1) must be two finite positive numbers, the smaller first"),
    (dict(flip=1.5), "flip probability 1.5 must be in [0, 1]"),
    # Not a pair, not a number: pybind's "incompatible function arguments" with the signature
    # (a new user's trial: torchvision users pass scale=(0.5, 1.0); scale=0.5 is a slip).
    (dict(scale=0.5), "scale must be (min, max), two numbers, not 0.5"),
    (dict(ratio=(1, "4/3")), "ratio must be (min, max), two numbers, not (1, '4/3')"),
    (dict(scale=(0.1, 0.5, 1.0)), "scale must be (min, max), two numbers, not (0.1, 0.5, 1.0)"),
    (dict(flip="yes"), "flip must be a number, not 'yes'"),
])
def test_crop_ops_refuse_bad_arguments_when_built(kwargs, text):
    for op in (sf.ops.decode_random_resized_crop, sf.ops.random_resized_crop):
        # A GraphError (Python's ValueError), as every op's bad argument (a new user's trial:
        # these were sf.Error, a RuntimeError, so `except ValueError` missed them), named by the
        # Python op (a new user's trial: size=0 was "splitflow::image::RandomResizedCrop").
        with pytest.raises(sf.GraphError, match="^" + re_escape(f"splitflow.ops.{op.__name__}: {text}")):
            op(**kwargs)
    # NumPy numbers and lists are numbers and pairs.
    sf.ops.random_resized_crop(8, scale=[np.float32(0.25), 1], ratio=(np.int64(1), 2.0), flip=np.float64(0))
    # A flag is a probability of 1 or 0 (as pybind's float took it): flip=False, never;
    # flip=True, always (the whole image kept, its size: the flip alone differs).
    from test_resize import run_op
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    whole = dict(scale=(1, 1), ratio=(1.5, 1.5))
    never = run_op(sf.ops.random_resized_crop((4, 6), flip=False, **whole), [image] * 4)
    always = run_op(sf.ops.random_resized_crop((4, 6), flip=True, **whole), [image] * 4)
    assert all(np.array_equal(a, image) for a in never)
    assert all(np.array_equal(a, image[:, ::-1]) for a in always)
    with pytest.raises(sf.GraphError, match=re_escape("splitflow.ops.resize: height must be 1 to 16384, not 0")):
        sf.ops.resize(0, 3)
    # Past C's int (a new user's trial: pybind's bare "incompatible function arguments"), and
    # seeds or epochs out of 64 bits, are said as the other bad arguments are.
    with pytest.raises(sf.GraphError, match=re_escape("width must be 1 to 16384, not 2147483648")):
        sf.ops.resize(3, 2**31)
    for op in (sf.ops.decode_random_resized_crop, sf.ops.random_resized_crop):
        with pytest.raises(sf.GraphError, match=re_escape("seed must be an int from 0 to 2**64 - 1, not -1")):
            op(seed=-1)
        with pytest.raises(sf.GraphError, match=re_escape("epoch must be an int from 0 to 2**64 - 1, not " + str(2**70))):
            op(epoch=2**70)
        op(seed=2**64 - 1, epoch=np.uint64(3))  # the whole range, NumPy integers too


def re_escape(text):
    import re
    return re.escape(text)


# Python ints from g.source reach read_file as indices; what is not an index is named.
def test_read_file_takes_python_ints_and_names_what_it_got(tmp_path):
    paths = write_jpegs(tmp_path, 3)
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "ints")
    out = g.pull_sink("out")
    g.source("n", [2, 0, 1]) >> g.stage("read", sf.ops.read_file(paths), concurrency=0) >> out
    got = [bytes(np.asarray(t)) for t in g.iterate(out)]
    assert got == [open(paths[i], "rb").read() for i in (2, 0, 1)]
    h = sf.Graph(rt, "strings")
    out = h.pull_sink("out")
    h.source("n", ["a.jpg"]) >> h.stage("read", sf.ops.read_file(paths)) >> out
    with pytest.raises(sf.StageError, match="expected an integer index into its 3 paths .* got a Python str"):
        list(h.iterate(out))
    k = sf.Graph(rt, "range")
    out = k.pull_sink("out")
    k.source("n", [7]) >> k.stage("read", sf.ops.read_file(paths)) >> out
    with pytest.raises(sf.StageError, match="index 7 is out of range for its 3 paths"):
        list(k.iterate(out))


# A new user's trial: indices as PyTorch code makes them (np.random.permutation, torch.randperm,
# np.arange) were refused: read_file said "got a Python int64" / "a Python Tensor", g.indices
# raised pybind's "incompatible function arguments", labels had to be a list. Integers that
# Python can use as indices (__index__: NumPy integers, integer torch tensors of one element)
# are indices now, as in a list; floats and bools are still refused, naming the element.
def test_numpy_and_torch_integers_are_indices(tmp_path):
    import torch
    paths = write_jpegs(tmp_path, 3)
    files = [open(p, "rb").read() for p in paths]
    rt = sf.Runtime(threads=2, backend="host")
    order = [2, 0, 1]
    for name, items, use_indices in [
            ("source numpy", np.array(order), False),
            ("source numpy int32", np.array(order, np.int32), False),
            ("source numpy scalars", [np.uint8(i) for i in order], False),
            ("source torch", torch.tensor(order), False),
            ("indices numpy", np.array(order), True),
            ("indices torch", torch.tensor(order), True),
            ("indices numpy scalars", [np.int64(i) for i in order], True),
            ("indices range", range(2, -1, -2), True)]:
        g = sf.Graph(rt, "ints")
        out = g.pull_sink("out")
        src = g.indices("n", items) if use_indices else g.source("n", items)
        src >> g.stage("read", sf.ops.read_file(paths), concurrency=0) >> out
        got = [bytes(np.asarray(t)) for t in g.iterate(out)]
        want = [2, 0] if name == "indices range" else order
        assert got == [files[i] for i in want], name
    # labels as a tensor or an array, as an index field
    g = sf.Graph(rt, "labels")
    out = g.pull_sink("out")
    g.indices("n", torch.randperm(3)) >> g.stage(
        "read", sf.ops.read_file(paths, labels=torch.tensor([5, 6, 7])), concurrency=0) >> out
    assert sorted(int(s["label"]) for s in g.iterate(out)) == [5, 6, 7]
    for items, what in [(np.array([0.0, 1.5]), "element 0 is a float 0.0"),
                        (torch.tensor([1.0]), "element 0 is a float 1.0"),
                        ([0, True], "element 1 is a bool"), (["a.jpg"], "element 0 is a str")]:
        with pytest.raises(sf.GraphError, match=f"Graph.indices\\('n'\\): {what}, not an integer"):
            sf.Graph(rt, "bad").indices("n", items)
    with pytest.raises(sf.GraphError, match="ops.read_file: labels: element 1 is a float 0.5"):
        sf.ops.read_file(paths, labels=[1, 0.5, 2])
    # A count of labels that is not the paths': a GraphError (a ValueError) like every other bad
    # argument (it was a plain splitflow.Error: a new user's trial).
    with pytest.raises(sf.GraphError, match=re_escape("ops.read_file: 1 labels for 3 paths; give one label per path")):
        sf.ops.read_file(paths, labels=[0])
    for item, what in [(np.float32(1.0), "a Python float32"), (torch.tensor(1.5), "a Python Tensor"),
                       (torch.tensor([0, 1]), "a Python Tensor"), (True, "a Python bool")]:
        h = sf.Graph(rt, "not-an-index")
        out = h.pull_sink("out")
        h.source("n", [item]) >> h.stage("read", sf.ops.read_file(paths)) >> out
        with pytest.raises(sf.StageError, match=f"expected an integer index into its 3 paths .* got {what}"):
            list(h.iterate(out))


# Objects that are not arrays of numbers are named, not reported as a buffer format; a sample
# (tuple or dict) is named with its fields and the way to apply the op to one.
@pytest.mark.parametrize("item, expect", [
    ("hello", "expected a tensor or an array of numbers, got str"),
    (None, "expected a tensor or an array of numbers, got NoneType"),
    ({"a": 1}, r"expected a tensor or an array, got a sample \(dict of 1: 'a'\); give the stage "
               r"field=\.\.\. to apply it to one field"),
])
def test_ops_name_what_they_were_given(item, expect):
    rt = sf.Runtime(threads=1, backend="host")
    g = sf.Graph(rt, "bad-input")
    out = g.pull_sink("out")
    g.source("n", [item]) >> g.stage("dec", sf.ops.decode_jpeg()) >> out
    with pytest.raises(sf.StageError, match=expect):
        list(g.iterate(out))


# Runtime settings are validated (threads=70000 used to be accepted and crash at exit).
def test_runtime_refuses_impossible_settings():
    for threads in (-1, 70000):
        with pytest.raises(sf.Error, match=f"threads must be 0 .one per core. to 1024, not {threads}"):
            sf.Runtime(threads=threads)
    with pytest.raises(sf.Error, match="streams must be 1 to 1024, not 0"):
        sf.Runtime(streams=0)
    # A new user's trial (2026-12-05): values past the C types' range were pybind's bare
    # "incompatible constructor arguments" (TypeError); a float batch size was told "an int >= 0"
    # and a crop size past 2**31 was named as 2147483647.
    for kwargs, text in [(dict(threads=10 ** 12), "splitflow.Runtime: threads must be 0 (one per "
                                                  "core) to 1024, not 1000000000000"),
                         (dict(threads=2.5), "splitflow.Runtime: threads must be an int, not 2.5"),
                         (dict(blocking_threads=0), "blocking_threads must be 1 to 4096, not 0"),
                         (dict(host_compute_slots=2 ** 70), "host_compute_slots must be 1 to 1024"),
                         (dict(host_memory_budget=2 ** 70), "host_memory_budget=" + str(2 ** 70) +
                          " is too large")]:
        with pytest.raises(sf.Error, match=re_escape(text)):
            sf.Runtime(**kwargs)
    rt = sf.Runtime(threads=1, backend="host")
    with pytest.raises(sf.Error, match=re_escape("splitflow.Graph 'v': capacity=-1 is negative")):
        sf.Graph(rt, "v", capacity=-1)
    with pytest.raises(sf.Error, match=re_escape("max_in_flight must be an int >= 1, not 1.5")):
        sf.Graph(rt, "v", max_in_flight=1.5)
    # Zero, with Python's names (C++'s message said GraphOptions' "default_capacity").
    with pytest.raises(sf.GraphError, match=re_escape("splitflow.Graph 'v': capacity=0: a graph's capacity")):
        sf.Graph(rt, "v", capacity=0)
    with pytest.raises(sf.GraphError, match=re_escape("splitflow.Graph 'v': max_in_flight=0: it must be an int >= 1")):
        sf.Graph(rt, "v", max_in_flight=0)
    with pytest.raises(sf.Error, match=re_escape("Graph.batch('b'): size must be an int >= 1, not 2.7")):
        sf.Graph(rt, "v").batch("b", 2.7)
    with pytest.raises(sf.Error, match=re_escape("size 2147483648 is out of range: give 1 to 16384")):
        sf.ops.random_resized_crop(2 ** 31)


# read_file on a directory says so (it used to raise std::bad_alloc).
def test_read_file_on_a_directory_is_named(tmp_path):
    rt = sf.Runtime(threads=1, backend="host")
    g = sf.Graph(rt, "dir")
    out = g.pull_sink("out")
    g.indices("i", [0]) >> g.stage("read", sf.ops.read_file([str(tmp_path)])) >> out
    with pytest.raises(sf.StageError, match="is a directory, not a file"):
        list(g.iterate(out))


# A 2-D uint8 array (a gray image, as np.asarray(PIL 'L') gives it) is height x width x 1 to
# the pixel ops (a new user's trial: refused as "takes a contiguous u8 HWC image"); the result
# has one channel and the pixels of the same image given as (H, W, 1).
def test_gray_images_as_2d_arrays_are_one_channel():
    rng = np.random.default_rng(5)
    gray = rng.integers(0, 256, size=(60, 80), dtype=np.uint8)
    rt = sf.Runtime(threads=1, backend="host")
    ops = [sf.ops.resize(30, 40), sf.ops.random_resized_crop((24, 32), seed=3),
           sf.ops.normalize([0.5], [0.25])]
    for op in ops:
        outs = []
        for image in (gray, gray[..., None].copy()):
            g = sf.Graph(rt, "gray")
            out = g.pull_sink("out")
            g.source("n", [image]) >> g.stage("op", op) >> out
            outs.append(np.asarray(list(g.iterate(out))[0]))
        flat, with_channel = outs
        assert flat.shape == with_channel.shape, op.name
        assert np.array_equal(flat, with_channel), op.name
    assert outs[0].shape == (1, 60, 80)  # normalize: CHW
    assert np.allclose(outs[0][0], (gray / 255.0 - 0.5) / 0.25, atol=1e-5)


# normalize scales 0-255 pixels: a float image is refused, named as given (it said "takes a
# contiguous u8 NHWC batch, got f32[1, 4, 4, 3]": a shape not given, a batch not given).
def test_normalize_refuses_float_pixels_naming_what_it_got():
    rt = sf.Runtime(threads=1, backend="host")
    g = sf.Graph(rt, "float-in")
    out = g.pull_sink("out")
    image = np.zeros((4, 4, 3), np.float32)
    g.source("n", [image]) >> g.stage("norm", sf.ops.normalize([0.5] * 3, [0.2] * 3)) >> out
    with pytest.raises(sf.StageError, match=re_escape("splitflow.ops.normalize takes uint8 pixels "
                                                      "(an HWC image, an HW gray one or an NHWC "
                                                      "batch)") + ".*f32\\[4, 4, 3\\].*give the uint8 image"):
        list(g.iterate(out))


# torchvision's evaluation transform, Resize(256) + CenterCrop(224), on PIL images: resize with
# one size sets the shorter side, center_crop takes the centre (a new user's trial: Python had
# neither, and a validation pipeline needed a Python stage holding the GIL). Within 1 of
# torchvision at every pixel (the antialiased resize is PIL's within 1); the crop alone exact.
def test_resize_and_center_crop_are_torchvisions_evaluation_transform():
    tv = pytest.importorskip("torchvision.transforms")
    rng = np.random.default_rng(9)
    rt = sf.Runtime(threads=1, backend="host")
    for h, w in [(480, 640), (641, 479), (300, 300), (250, 200), (180, 120)]:
        # smooth content plus noise: a photograph's mix of low and high frequencies
        yy, xx = np.mgrid[0:h, 0:w]
        base = (127 + 100 * np.sin(xx / 17.0) * np.cos(yy / 23.0))[..., None] + rng.normal(0, 20, (h, w, 3))
        image = np.clip(base, 0, 255).astype(np.uint8)
        want = np.asarray(tv.CenterCrop(224)(tv.Resize(256)(Image.fromarray(image))))
        g = sf.Graph(rt, "eval")
        out = g.pull_sink("out")
        g.source("n", [image]) >> g.stage("resize", sf.ops.resize(256)) >> \
            g.stage("crop", sf.ops.center_crop(224)) >> out
        got = np.asarray(list(g.iterate(out))[0])
        assert got.shape == want.shape == (224, 224, 3), (h, w)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, (h, w)
        # The crop alone equals torchvision's, padding included (a crop larger than the image).
        for size in [(100, 60), 301, (17, 400)]:
            g = sf.Graph(rt, "crop")
            out = g.pull_sink("out")
            g.source("n", [image]) >> g.stage("crop", sf.ops.center_crop(size)) >> out
            got = np.asarray(list(g.iterate(out))[0])
            assert np.array_equal(got, np.asarray(tv.CenterCrop(size)(Image.fromarray(image)))), (h, w, size)
    with pytest.raises(sf.GraphError, match=re_escape("splitflow.ops.center_crop: size must be an int or (height, width)")):
        sf.ops.center_crop("224")
    with pytest.raises(sf.GraphError, match="splitflow.ops.center_crop: height 0 is out of range"):
        sf.ops.center_crop((0, 5))
    with pytest.raises(sf.GraphError, match="splitflow.ops.resize: size must be 1 to 16384, not 0"):
        sf.ops.resize(0)
