"""Structured samples (docs/getting-started.md, "Samples with labels"): a tuple or dict flows
through the graph as one item; C++ ops apply to one field (field=...) and carry the others;
a skip drops the whole sample; Graph.batch collates field by field, as torch's
default_collate does; labels read from an ImageFolder-like tree stay with their images."""
import collections
import os
import warnings

import numpy as np
import pytest
import torch

import splitflow as sf
import splitflow.torch as sft

PIL = pytest.importorskip("PIL.Image")

CLASSES = ["cat", "dog", "eel"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """root/<class>/[sub/]<i>.jpg, 7 images per class of different sizes, and one corrupt file
    in 'dog'."""
    root = tmp_path_factory.mktemp("samples") / "train"
    rng = np.random.default_rng(3)
    for c in CLASSES:
        for i in range(7):
            d = root / c / ("sub" if i % 3 == 0 else "")
            d.mkdir(parents=True, exist_ok=True)
            a = (rng.random((30 + 3 * i, 40 + i, 3)) * 255).astype(np.uint8)
            PIL.fromarray(a).save(d / f"{c}{i}.jpg", quality=90)
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return str(root)


def class_of(path):
    """The class folder a file lies under (directly or in a sub-folder)."""
    parts = path.split(os.sep)
    return next(p for p in reversed(parts[:-1]) if p in CLASSES)


def test_image_folder_lists_classes_sorted_and_labels_every_file(folder):
    paths, labels, classes = sf.image_folder(folder)
    assert classes == CLASSES
    assert len(paths) == len(labels) == 3 * 7 + 1
    assert paths == imagefolder_order(folder)
    for p, label in zip(paths, labels):
        assert classes[label] == class_of(p)


def make_tree(root, rels):
    """A file (a JPEG's first two bytes) at each relative path under root, folders made."""
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\xff\xd8")


def imagefolder_order(root):
    """The files torchvision's ImageFolder lists (its make_dataset), in its order: classes
    sorted, then sorted(os.walk(class folder)), each folder's files sorted."""
    out = []
    for c in sorted(e.name for e in os.scandir(root) if e.is_dir()):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            out += [os.path.join(dirpath, n) for n in sorted(names)
                    if n.lower().endswith((".jpg", ".jpeg"))]
    return out


# A new user's trial (2026-12-05): image_folder sorted whole paths, so "cat/sub/y.jpeg" came
# before "cat/x.JPG" where ImageFolder lists a folder's own files first (the data set's indices
# differed from ImageFolder's); and a class folder without an image was kept as a label no
# sample had, where ImageFolder refuses it.
def test_image_folder_lists_files_in_imagefolders_order_and_refuses_an_empty_class(tmp_path):
    root = tmp_path / "train"
    make_tree(root, ["cat/x.JPG", "cat/sub/y.jpeg", "cat/sub-2/a.jpg", "cat/a/b/z.jpg",
                     "cat/w.jpg", "dog/sub/q.jpg", "dog/p.jpg"])
    paths, labels, classes = sf.image_folder(str(root))
    want = imagefolder_order(str(root))
    assert [os.path.relpath(p, root) for p in want] == [
        "cat/w.jpg", "cat/x.JPG", "cat/a/b/z.jpg", "cat/sub/y.jpeg", "cat/sub-2/a.jpg",
        "dog/p.jpg", "dog/sub/q.jpg"]
    assert paths == want and labels == [0, 0, 0, 0, 0, 1, 1] and classes == ["cat", "dog"]
    (root / "eel").mkdir()
    (root / "fox" / "notes").mkdir(parents=True)
    with pytest.raises(sf.Error, match="no .jpg/.jpeg files in the class folders 'eel', 'fox' of "):
        sf.image_folder(str(root))


# A new user's trial (C++): image_files (FileList::directory) of a data set's root sorted by
# folder path, so "cat-2/z.jpg" came between "cat/x.jpg" and "cat/sub/y.jpg" ('-' sorts before
# '/'), where ImageFolder walks every class folder whole: its indices differed from
# image_folder's and torchvision's.
def test_image_files_of_a_root_walk_each_class_folder_whole_as_imagefolder_does(tmp_path):
    root = tmp_path / "train"
    make_tree(root, ["cat/x.jpg", "cat/sub/y.jpg", "cat/sub-2/w.jpg", "cat-2/z.jpg",
                     "cat b/v.jpg", "cat.b/u.jpg", "cat/sub/deeper/t.jpg"])
    want = imagefolder_order(str(root))
    assert [os.path.relpath(p, root) for p in want] == [
        "cat/x.jpg", "cat/sub/y.jpg", "cat/sub-2/w.jpg", "cat/sub/deeper/t.jpg", "cat b/v.jpg",
        "cat-2/z.jpg", "cat.b/u.jpg"]
    assert sf.image_files(str(root)) == want
    assert sf.image_folder(str(root))[0] == want
    assert sf.image_folder(root)[0] == want  # a pathlib.Path as well
    assert sf.image_files(root) == want


# A new user's trial: image_folder found 89 files where ImageFolder found 92, the three .png
# files left out without a word. They are still left out (the decoders read JPEG), with a
# warning naming them.
def test_image_folder_warns_of_the_image_files_imagefolder_loads_that_it_leaves_out(tmp_path):
    root = tmp_path / "train"
    make_tree(root, ["cat/a.jpg", "cat/b.PNG", "dog/c.jpg", "dog/sub/d.webp", "dog/notes.txt"])
    with pytest.warns(RuntimeWarning) as caught:
        paths, labels, classes = sf.image_folder(str(root))
    assert [os.path.relpath(p, root) for p in paths] == ["cat/a.jpg", "dog/c.jpg"]
    assert labels == [0, 1] and classes == ["cat", "dog"]
    [w] = caught
    assert str(w.message).startswith(f"splitflow.image_folder: 2 image files under '{root}' are not "
                                     f"JPEG (.png, .webp: '{root / 'cat' / 'b.PNG'}', ...) and left "
                                     f"out, where torchvision's ImageFolder loads them"), w.message
    assert "convert them to JPEG" in str(w.message)
    assert w.filename == __file__  # the caller's line
    # Only JPEGs: no warning.
    (root / "cat" / "b.PNG").unlink()
    (root / "dog" / "sub" / "d.webp").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(sf.image_folder(str(root))[0]) == 2


def test_image_folder_names_a_folder_without_classes(tmp_path):
    with pytest.raises(sf.Error, match="has no class folders"):
        sf.image_folder(str(tmp_path))
    with pytest.raises(sf.Error, match="cannot read"):
        sf.image_folder(str(tmp_path / "missing"))


def labelled_graph(folder, batch, size=24):
    paths, labels, classes = sf.image_folder(folder)
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "labelled")
    idx = g.indices("idx", list(range(len(paths))))
    read = g.stage("read", sf.ops.read_file(paths, labels=labels), concurrency=2)
    crop = g.stage("crop", sf.ops.decode_random_resized_crop(size, seed=1), field="image",
                   concurrency=0, on_error="skip", ordered=False)
    b = g.batch("batch", batch)
    out = g.pull_sink("out")
    idx >> read >> crop >> b >> out
    return g, out, paths, classes


def test_labels_stay_with_their_images_through_ops_skips_and_batches(folder):
    g, out, paths, classes = labelled_graph(folder, batch=4)
    seen = []
    it = g.iterate(out)
    for s in it:
        assert isinstance(s, dict) and list(s) == ["image", "label", "index"]
        images, labels, index = (np.asarray(s[k]) for k in ("image", "label", "index"))
        assert images.dtype == np.uint8 and images.shape[1:] == (24, 24, 3)
        assert labels.dtype == np.int64 and index.dtype == np.int64
        assert len(images) == len(labels) == len(index) <= 4
        for label, i in zip(labels, index):
            assert classes[label] == class_of(paths[i]), (label, paths[i])
        seen.extend(int(i) for i in index)
    broken = paths.index(os.path.join(folder, "dog", "broken.jpg"))
    # Out of order: every sample once, except the corrupt one, dropped whole (its label too).
    assert sorted(seen) == [i for i in range(len(paths)) if i != broken]
    crop = next(s for s in it.run.stats()["stages"] if s["name"] == "crop")
    assert crop["skipped"] == 1 and "broken.jpg" in crop["errors"][0]["message"]


def test_the_image_field_holds_the_same_pixels_as_the_op_on_the_bare_file(folder):
    paths, labels, _ = sf.image_folder(folder)
    rt = sf.Runtime(threads=2, backend="host")
    op = sf.ops.decode_random_resized_crop(20, seed=5)

    def run(labelled):
        g = sf.Graph(rt, "same")
        idx = g.indices("idx", list(range(len(paths))))
        read = g.stage("read", sf.ops.read_file(paths, labels=labels if labelled else None))
        crop = g.stage("crop", op, field="image" if labelled else None, on_error="skip")
        out = g.pull_sink("out")
        idx >> read >> crop >> out
        return [np.asarray(x["image"] if labelled else x).copy() for x in g.iterate(out)]

    a, b = run(True), run(False)
    assert len(a) == len(b) == len(paths) - 1
    for x, y in zip(a, b):
        assert np.array_equal(x, y)  # the crop's randomness follows the file's index in both


def test_tuples_collate_field_by_field_like_default_collate():
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "tuples")
    src = g.source("s", [(i, i / 2, f"x{i}", np.full(3, i, np.float32)) for i in range(6)])
    dbl = g.stage("dbl", lambda x: x * 10, field=0)
    b = g.batch("b", 4)
    out = g.pull_sink("out")
    src >> dbl >> b >> out
    got = list(g.iterate(out))
    # (A list of the columns, as default_collate makes of tuples: they came back as a tuple.)
    assert len(got) == 2 and all(isinstance(x, list) and len(x) == 4 for x in got)
    first, second = got
    assert np.asarray(first[0]).tolist() == [0, 10, 20, 30]
    assert np.asarray(first[0]).dtype == np.int64
    assert np.asarray(first[1]).tolist() == [0.0, 0.5, 1.0, 1.5]
    assert np.asarray(first[1]).dtype == np.float64
    assert first[2] == ["x0", "x1", "x2", "x3"]
    assert np.asarray(first[3]).shape == (4, 3) and np.asarray(first[3])[3].tolist() == [3, 3, 3]
    assert np.asarray(second[0]).tolist() == [40, 50]
    # The same as torch's default_collate on the same samples.
    ref = torch.utils.data.default_collate([(i * 10, i / 2, f"x{i}") for i in range(4)])
    assert type(ref) is list
    assert torch.equal(sft.to_torch(first[0]), ref[0])
    assert torch.equal(sft.to_torch(first[1]), ref[1])
    assert first[2] == list(ref[2])


def test_lists_collate_position_by_position_like_default_collate():
    # [image, label] lists (as many Datasets return) went on as a list of the lists; torch's
    # default_collate transposes them: a list of a stacked tensor and a label tensor (a new
    # user's trial). Nested lists likewise; lists of two lengths are refused, as torch does.
    rt = sf.Runtime(threads=2, backend="host")

    def batches(samples, size):
        g = sf.Graph(rt, "lists")
        out = g.pull_sink("out")
        g.source("s", samples) >> g.stage("id", lambda x: x) >> g.batch("b", size) >> out
        return list(g.iterate(out))

    samples = [[np.full((2, 2), i, np.float32), i] for i in range(4)]
    (got,) = batches(samples, 4)
    ref = torch.utils.data.default_collate(samples)
    assert isinstance(got, list) and len(got) == 2
    assert torch.equal(sft.to_torch(got[0]), ref[0]) and tuple(np.asarray(got[0]).shape) == (4, 2, 2)
    assert torch.equal(sft.to_torch(got[1]), ref[1])
    (nested,) = batches([[1, 2], [3, 4]], 2)
    assert [np.asarray(c).tolist() for c in nested] == [[1, 3], [2, 4]]
    with pytest.raises(sf.StageError, match=r"item 1 of the batch is a list of 1 where item 0 is a "
                                            r"list of 2: a batch of lists collates position by position"):
        batches([[1, 2], [3]], 2)


Pair = collections.namedtuple("Pair", "image label")


def test_named_tuples_collate_into_their_class_like_default_collate():
    # Named tuples (a Dataset's Sample(image, label)) went on as a list of the tuples, and
    # batch.image raised AttributeError; default_collate makes one of their class, of the
    # collated fields (a new user's trial). Nested, and through GraphDataset's to_torch too.
    rt = sf.Runtime(threads=2, backend="host")
    samples = [Pair(np.full((2, 2), i, np.float32), i) for i in range(4)]
    g = sf.Graph(rt, "named")
    out = g.pull_sink("out")
    g.source("s", samples) >> g.stage("id", lambda x: x) >> g.batch("b", 4) >> out
    (got,) = list(g.iterate(out))
    ref = torch.utils.data.default_collate(samples)
    assert type(got) is Pair and type(ref) is Pair
    assert torch.equal(sft.to_torch(got.image), ref.image)
    assert torch.equal(sft.to_torch(got.label), ref.label)
    as_torch = sft.to_torch(got)
    assert type(as_torch) is Pair and torch.equal(as_torch.label, ref.label)
    g = sf.Graph(rt, "nested")
    out = g.pull_sink("out")
    g.source("s", [Pair(Pair(i, -i), i) for i in range(3)]) >> g.batch("b", 3) >> out
    (nested,) = list(g.iterate(out))
    assert type(nested) is Pair and type(nested.image) is Pair
    assert np.asarray(nested.image.label).tolist() == [0, -1, -2]
    # Named tuples of two classes are not one structure: a list, as before.
    Other = collections.namedtuple("Other", "image label")
    g = sf.Graph(rt, "mixed")
    out = g.pull_sink("out")
    g.source("s", [Pair(1, 2), Other(3, 4)]) >> g.batch("b", 2) >> out
    (mixed,) = list(g.iterate(out))
    assert isinstance(mixed, list) and [type(x) for x in mixed] == [Pair, Other]
    # A subclass whose __new__ takes more than the fields is rebuilt through _make, as
    # default_convert would fail to (type(*fields): "missing 1 required positional argument":
    # a review); a tuple subclass with _fields but no _make stays a list of its items.

    class Tagged(Pair):
        def __new__(cls, image, label, tag):
            return super().__new__(cls, image, label)

    class Fields(tuple):
        _fields = ("a", "b")

    g = sf.Graph(rt, "subclasses")
    out = g.pull_sink("out")
    g.source("s", [Tagged(1, 2, "t"), Tagged(3, 4, "t")]) >> g.batch("b", 2) >> out
    (tagged,) = list(g.iterate(out))
    assert type(tagged) is Tagged and np.asarray(tagged.label).tolist() == [2, 4]
    g = sf.Graph(rt, "fields")
    out = g.pull_sink("out")
    g.source("s", [Fields((1, 2)), Fields((3, 4))]) >> g.batch("b", 2) >> out
    (fields,) = list(g.iterate(out))
    assert isinstance(fields, list) and [type(x) for x in fields] == [Fields, Fields]
    assert type(sft.to_torch(Fields((1, 2)))) is tuple and type(sft.to_torch(Tagged(1, 2, "t"))) is Tagged
    # Batches of two classes batched again are refused, not all made the first class.
    g = sf.Graph(rt, "two-levels")
    out = g.pull_sink("out")
    g.source("s", [Pair(1, 2), Pair(3, 4), Other(5, 6), Other(7, 8)]) >> g.batch("b", 2) \
        >> g.batch("bb", 2) >> out
    with pytest.raises(sf.StageError, match=r"item 1 of the batch is a sample \(named tuple Other "
                                            r"of 2\), the first is a sample \(named tuple Pair of 2\)"):
        list(g.iterate(out))


def test_a_graph_datasets_named_tuples_stay_named_tuples_in_a_dataloader():
    # to_torch rebuilt every tuple as a plain one, which the DataLoader made a list (a new
    # user's trial); torch's default_convert keeps a named tuple's class.
    def build(g, indices):
        return indices >> g.stage("pair", lambda i: Pair(np.full(2, i, np.float32), i))

    ds = sft.GraphDataset(build, 5, threads=2, backend="host")
    got = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert [type(x) for x in got] == [Pair] * 5
    assert [int(x.label) for x in got] == list(range(5))
    assert torch.equal(got[3].image, torch.full((2,), 3.0))


def test_bools_and_bytes_collate_like_default_collate():
    # A new user's trial: bools collated to a list (torch: a bool tensor), bytes of different
    # lengths failed the batch as u8 tensors of different shapes (torch: a list of bytes).
    rt = sf.Runtime(threads=2, backend="host")
    samples = [{"flag": i % 2 == 0, "raw": b"abc"[: 1 + i % 3], "label": i} for i in range(4)]
    g = sf.Graph(rt, "bools-bytes")
    out = g.pull_sink("out")
    g.source("s", samples) >> g.batch("b", 4) >> out
    (got,) = list(g.iterate(out))
    ref = torch.utils.data.default_collate(samples)
    flags = sft.to_torch(got["flag"])
    assert flags.dtype == torch.bool and torch.equal(flags, ref["flag"]), (got["flag"], ref["flag"])
    assert got["raw"] == ref["raw"] == [b"a", b"ab", b"abc", b"a"]
    assert torch.equal(sft.to_torch(got["label"]), ref["label"])


def test_field_errors_name_the_stage_and_the_fields():
    rt = sf.Runtime(threads=1, backend="host")

    def run(items, field):
        g = sf.Graph(rt, "errors")
        src = g.source("s", items)
        st = g.stage("op", lambda x: x, field=field)
        out = g.pull_sink("out")
        src >> st >> out
        return list(g.iterate(out))

    with pytest.raises(sf.StageError, match=r"stage 'op': the item has no field 'img': it is a "
                                             r"sample \(dict of 2: 'image', 'label'\)"):
        run([{"image": 1, "label": 2}], "img")
    with pytest.raises(sf.StageError, match=r"field='image' but the item is the integer 5, not a "
                                             r"tuple or dict"):
        run([5], "image")
    with pytest.raises(sf.StageError, match=r"field 2 is out of range: the item is a sample "
                                             r"\(tuple of 2\)"):
        run([(1, 2)], 2)
    g = sf.Graph(rt, "bad-field")
    with pytest.raises(sf.GraphError, match="field must be a str"):
        g.stage("op", lambda x: x, field=1.5)


def test_a_batch_of_different_structures_is_refused_with_the_item_named():
    rt = sf.Runtime(threads=1, backend="host")
    g = sf.Graph(rt, "mixed")
    src = g.source("s", [{"a": 1}, {"b": 2}])
    b = g.batch("b", 2)
    out = g.pull_sink("out")
    src >> b >> out
    with pytest.raises(sf.StageError, match=r"item 1 of the batch is a sample \(dict of 1: 'b'\), "
                                             r"the first is a sample \(dict of 1: 'a'\)"):
        list(g.iterate(out))


# A stage that returned None for one item (or a str among ints) made that batch a list while
# the others were tensors: the loop failed later, far from the cause (a new user's trial).
# torch's default_collate refuses such a batch; so does g.batch, naming the odd item. Ints
# mixed with floats make a float64 tensor, as torch.tensor does.
def test_a_batch_of_mixed_kinds_is_refused_naming_the_odd_item():
    rt = sf.Runtime(threads=1, backend="host")

    def batches(items, size=4):
        g = sf.Graph(rt, "kinds")
        out = g.pull_sink("out")
        g.source("s", items) >> g.batch("b", size) >> out
        return list(g.iterate(out))

    with pytest.raises(sf.StageError, match=r"item 3 of the batch is None where item 0 is the "
                                             r"integer 4: a batch collates one kind of value"):
        batches([0, 1, 2, 3, 4, 5, 6, None])
    with pytest.raises(sf.StageError, match=r"\(field 'y'\): item 2 of the batch is a Python str "
                                             r"where item 0 is a Python ndarray"):
        batches([{"y": np.zeros(2) if i != 2 else "oops"} for i in range(4)])
    with pytest.raises(sf.StageError, match=r"item 1 of the batch is a Python float where item 0 "
                                             r"is a sample"):
        batches([(1, 2), 0.5])
    # Numbers mixed: a float64 tensor with a float among them (default_collate's dtype for
    # floats), else int64.
    (mix,) = batches([1, 2.5, True, 4])
    assert sft.to_torch(mix).dtype == torch.float64 and sft.to_torch(mix).tolist() == [1, 2.5, 1, 4]
    (ints,) = batches([1, True, 3, False])
    assert sft.to_torch(ints).tolist() == [1, 1, 3, 0] and sft.to_torch(ints).dtype == torch.int64
    # Strings and None only: a list, as before.
    assert batches(["a", None, "c", "d"]) == [["a", None, "c", "d"]]
    # NumPy scalars among Python numbers are numbers, as torch.tensor takes them; alone they
    # stack as 0-d arrays, as before.
    (labels,) = batches([3, np.int64(5), 7, np.int32(1)])
    assert sft.to_torch(labels).tolist() == [3, 5, 7, 1] and sft.to_torch(labels).dtype == torch.int64
    (weights,) = batches([0.5, np.float32(1.5), 2, 3])
    assert sft.to_torch(weights).tolist() == [0.5, 1.5, 2.0, 3.0]
    (alone,) = batches([np.float32(i) for i in range(4)])
    assert np.asarray(alone).dtype == np.float32 and np.asarray(alone).tolist() == [0, 1, 2, 3]
    # A number no float64 holds: named, not a Python error escaping the runtime's thread.
    with pytest.raises(sf.StageError, match=r"item 1 of the batch, a Python int, does not fit a "
                                             r"float64"):
        batches([0.5, 10 ** 400, 1, 2])


def test_read_file_needs_one_label_per_path():
    with pytest.raises(sf.Error, match="2 labels for 3 paths"):
        sf.ops.read_file(["a", "b", "c"], labels=[0, 1])


def test_a_dataloader_yields_image_and_label_tensors(folder):
    paths, labels, classes = sf.image_folder(folder)

    def build(g, indices):
        read = g.stage("read", sf.ops.read_file(paths, labels=labels), concurrency=2)
        crop = g.stage("crop", sf.ops.decode_random_resized_crop(16), field="image",
                       concurrency=0, on_error="skip")
        return indices >> read >> crop >> g.batch("batch", 5)

    ds = sft.GraphDataset(build, len(paths), shuffle=True, seed=2, threads=2, backend="host")
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    total = 0
    for s in loader:
        assert s["image"].dtype == torch.uint8 and s["label"].dtype == torch.int64
        for label, i in zip(s["label"].tolist(), s["index"].tolist()):
            assert classes[label] == class_of(paths[i])
        total += len(s["label"])
    assert total == len(paths) - 1


def test_torch_tensors_from_python_stages_stack_like_default_collate():
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "torch-collate")
    src = g.source("s", list(range(6)))
    make = g.stage("make", lambda i: {"x": torch.full((2, 3), float(i)), "label": i})
    b = g.batch("batch", 3)
    out = g.pull_sink("out")
    src >> make >> b >> out
    got = list(g.iterate(out))
    assert len(got) == 2
    for k, batch in enumerate(got):
        assert isinstance(batch["x"], sf.Tensor) and tuple(batch["x"].shape) == (3, 2, 3)
        x = torch.as_tensor(np.asarray(batch["x"]))
        want = torch.utils.data.default_collate([torch.full((2, 3), float(3 * k + j)) for j in range(3)])
        assert torch.equal(x, want)
        assert np.asarray(batch["label"]).tolist() == [3 * k, 3 * k + 1, 3 * k + 2]


def test_a_gpu_stage_takes_one_field_and_the_others_pass_through():
    # gpu_stage(..., field=) as stage's (a new user's trial: dict samples could not reach a GPU
    # stage's normalize without a Python stage to unpack them): the op takes the image, the
    # label and index pass through, in order; the values are the CPU op's.
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, size=(6, 4, 3), dtype=np.uint8) for _ in range(5)]
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "gpu-field")
    out = g.pull_sink("out")
    g.source("s", [{"image": im, "label": 10 + i, "index": i} for i, im in enumerate(images)]) >> \
        g.gpu_stage("norm", sf.ops.normalize(mean, std), field="image") >> out
    got = list(g.iterate(out))
    assert [(s["label"], s["index"]) for s in got] == [(10 + i, i) for i in range(5)]
    for im, s in zip(images, got):
        ref = ((im.astype(np.float32) / 255.0 - np.array(mean, np.float32)) /
               np.array(std, np.float32)).transpose(2, 0, 1)
        np.testing.assert_allclose(s["image"].torch().numpy(), ref, rtol=1e-5, atol=1e-5)
    g2 = sf.Graph(rt, "gpu-field-errors")
    with pytest.raises(sf.GraphError, match=r"gpu_stage\('norm'\): field must be a str"):
        g2.gpu_stage("norm", sf.ops.normalize(mean, std), field=1.5)
    out2 = g2.pull_sink("out")
    g2.source("s", [{"img": images[0]}]) >> g2.gpu_stage("norm", sf.ops.normalize(mean, std), field="image") >> out2
    with pytest.raises(sf.StageError, match=r"stage 'norm': the item has no field 'image': it is a "
                                             r"sample \(dict of 1: 'img'\)"):
        list(g2.iterate(out2))


def test_normalize_refuses_bad_arguments_when_made_and_names_the_users_stage():
    # A zero std or mismatched lengths are refused when the op is made (they failed every item
    # at run time, naming a stage 'normalize' the graph did not have).
    with pytest.raises(sf.GraphError, match=r"splitflow.ops.normalize: std\[0\] is 0"):
        sf.ops.normalize([0.5, 0.5, 0.5], [0.0, 1.0, 1.0])
    with pytest.raises(sf.GraphError, match="splitflow.ops.normalize: mean and std give one value "
                                            "per channel, or one for all: 3 means, 2 stds"):
        sf.ops.normalize([0.5, 0.5, 0.5], [1.0, 1.0])
    with pytest.raises(sf.GraphError, match=r"splitflow.ops.gpu_normalize: std\[1\] is 0"):
        sf.ops.gpu_normalize([0.5, 0.5], [1.0, 0.0])
    # NaN or an infinity made every pixel NaN, silently (a new user's trial).
    with pytest.raises(sf.GraphError, match=r"splitflow.ops.normalize: mean\[1\] is nan; give finite numbers"):
        sf.ops.normalize([0.5, float("nan"), 0.5], [0.2] * 3)
    with pytest.raises(sf.GraphError, match=r"splitflow.ops.gpu_normalize: std\[0\] is inf; give finite numbers"):
        sf.ops.gpu_normalize([0.5], [float("inf")])
    # An image of the wrong channel count: the error names the user's stage, not 'normalize'.
    rt = sf.Runtime(threads=1, backend="host")
    g = sf.Graph(rt, "norm-errors")
    out = g.pull_sink("out")
    g.source("s", [np.zeros((4, 4, 2), np.uint8)]) >> \
        g.stage("my_norm", sf.ops.normalize([0.5] * 3, [0.2] * 3)) >> out
    with pytest.raises(sf.StageError) as e:
        list(g.iterate(out))
    msg = str(e.value)
    assert e.value.stage == "my_norm" and "stage 'normalize'" not in msg, msg
    assert "splitflow::ops::normalize needs one mean and one stddev per channel" in msg, msg


def test_normalize_broadcasts_one_mean_or_std_to_every_channel_as_torchvision_does():
    # A new-user trial (2026-12-05): torchvision's Normalize((0.5,), (0.5,)) on an RGB tensor
    # broadcasts; ops.normalize refused a single mean ("one value per channel").
    img = (np.arange(4 * 5 * 3) * 7 % 256).astype(np.uint8).reshape(4, 5, 3)
    x = img.astype(np.float32).transpose(2, 0, 1) / 255.0
    cases = [([0.5], [0.25], (x - 0.5) / 0.25),
             ([0.4, 0.5, 0.6], [0.2], (x - np.array([0.4, 0.5, 0.6], np.float32)[:, None, None]) / 0.2),
             ([0.5], [0.1, 0.2, 0.4], (x - 0.5) / np.array([0.1, 0.2, 0.4], np.float32)[:, None, None])]
    rt = sf.Runtime(threads=1, backend="host")
    for i, (mean, std, want) in enumerate(cases):
        g = sf.Graph(rt, "bcast%d" % i)
        out = g.pull_sink("out")
        g.source("s", [img]) >> g.stage("norm", sf.ops.normalize(mean, std)) >> out
        got = list(g.iterate(out))
        assert len(got) == 1 and got[0].shape == (3, 4, 5)
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
        g2 = sf.Graph(rt, "bcast-gpu%d" % i)
        out2 = g2.pull_sink("out")
        g2.source("s", [img]) >> g2.gpu_stage("norm", sf.ops.normalize(mean, std)) >> out2
        got2 = [t.torch().numpy() for t in g2.iterate(out2)]
        np.testing.assert_allclose(got2[0], want, rtol=1e-5, atol=1e-5)
    # Two means for three channels: neither one per channel nor one for all.
    g = sf.Graph(rt, "bcast-bad")
    out = g.pull_sink("out")
    g.source("s", [img]) >> g.stage("norm", sf.ops.normalize([0.5, 0.5], [0.5])) >> out
    with pytest.raises(sf.StageError, match="needs one mean and one stddev per channel, or one "
                                            "for all .*the images have 3, 2 means, 1 stddevs"):
        list(g.iterate(out))


def _raise_on_two(v):
    if v == 2:
        raise ValueError("two")
    return v * 10


@pytest.mark.parametrize("structure", ["dict", "tuple"])
def test_substitute_with_field_replaces_that_field_and_keeps_the_others(structure):
    # A new user's trial (2026-12-05): substitute= on a field= stage replaced the whole sample
    # (its label and index lost, the batch then a plain list instead of a dict).
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "sub-field")
    if structure == "dict":
        items, field = [{"x": i, "y": -i} for i in range(4)], "x"
    else:
        items, field = [(i, -i) for i in range(4)], 0
    src = g.source("s", items)
    st = g.stage("st", _raise_on_two, field=field, substitute=-1)
    b = g.batch("b", 4)
    out = g.pull_sink("out")
    src >> st >> b >> out
    run = g.run()
    (batch,) = list(out)
    assert run.wait() == "succeeded"
    if structure == "dict":
        assert np.asarray(batch["x"]).tolist() == [0, 10, -1, 30]
        assert np.asarray(batch["y"]).tolist() == [0, -1, -2, -3]
    else:
        assert np.asarray(batch[0]).tolist() == [0, 10, -1, 30]
        assert np.asarray(batch[1]).tolist() == [0, -1, -2, -3]
    s = next(x for x in run.stats()["stages"] if x["name"] == "st")
    assert s["substituted"] == 1 and s["skipped"] == 0
    assert len(s["errors"]) == 1 and "ValueError: two" in s["errors"][0]["message"]
    assert s["errors"][0]["item"] == 2


def test_substitute_with_field_on_a_c_plus_plus_op_keeps_the_label(tmp_path):
    # The real-world case: a truncated JPEG among good ones, the crop's image substituted by
    # zeros, its label and index kept so that the batch still collates as a dict.
    from PIL import Image
    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.jpg"
        Image.fromarray(np.full((40, 50, 3), 40 * i, np.uint8)).save(p, quality=90)
        paths.append(str(p))
    with open(paths[1], "r+b") as f:
        f.truncate(100)
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "sub-crop")
    src = g.indices("i", range(3))
    read = g.stage("read", sf.ops.read_file(paths, labels=[7, 8, 9]))
    crop = g.stage("crop", sf.ops.decode_random_resized_crop(16, seed=1), field="image",
                   substitute=np.zeros((16, 16, 3), np.uint8))
    b = g.batch("b", 3)
    out = g.pull_sink("out")
    src >> read >> crop >> b >> out
    (batch,) = list(g.iterate(out))
    assert np.asarray(batch["label"]).tolist() == [7, 8, 9]
    assert np.asarray(batch["index"]).tolist() == [0, 1, 2]
    images = np.asarray(batch["image"])
    assert images.shape == (3, 16, 16, 3)
    assert not images[1].any() and images[2].min() > 0


def test_the_same_edge_twice_is_refused():
    # It was accepted and acted as a merge: every item delivered twice (a new user's trial).
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "double-edge")
    s = g.source("s", [1, 2, 3])
    out = g.pull_sink("out")
    s >> out
    with pytest.raises(sf.GraphError, match=r"'s' is already connected to 'out' in graph "
                                            r"'double-edge'; connect them once"):
        s >> out
    assert list(g.iterate(out)) == [1, 2, 3]


def test_bad_arguments_are_named():
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "args")
    with pytest.raises(sf.GraphError, match=r"concurrency must be an int \(0: unlimited\) or "
                                            r"'auto', not 1\.5"):
        g.stage("a", abs, concurrency=1.5)
    with pytest.raises(sf.GraphError, match=r"concurrency must be an int .*not True"):
        g.stage("a", abs, concurrency=True)
    with pytest.raises(sf.GraphError, match=r"element 1 \(1180591620717411303424\) does not fit "
                                            r"a 64-bit signed integer"):
        g.indices("i", [0, 2**70])
    with pytest.raises(ValueError, match=r"world_size must be >= 1"):
        sft.GraphDataset(lambda g, i: i, 10, rank=0, world_size=0)
    # Negative or non-integer counts: named, not pybind11's "incompatible function arguments".
    for make, text in [(lambda: g.stage("b", abs, capacity=-5), r"stage\('b'\): capacity=-5 is negative"),
                       (lambda: g.batch("c", -1), r"batch\('c'\): size=-1 is negative"),
                       (lambda: g.batch("c", 2.5), r"batch\(.c.\): size must be an int >= 1, not 2\.5"),
                       (lambda: g.pull_sink("p", capacity=-2), r"pull_sink\('p'\): capacity=-2 is negative"),
                       (lambda: g.zip("z", capacity=-1), r"zip\('z'\): capacity=-1 is negative"),
                       (lambda: g.dynamic_batch("d", max_batch=-1), r"dynamic_batch\('d'\): max_batch=-1 is negative"),
                       (lambda: g.unbatch("u", max_batch="x"), r"unbatch\(.u.\): max_batch must be an int >= 1, not .x."),
                       (lambda: g.service("s", max_pending=-3), r"service\('s'\): max_pending=-3 is negative")]:
        with pytest.raises(sf.GraphError, match=text):
            make()
    with pytest.raises(sf.GraphError, match=r"stage\('b'\): capacity=1180591620717411303424 is too large"):
        g.stage("b", abs, capacity=2**70)
    assert g.batch("n", np.int64(3)).name == "n"  # a NumPy integer is an int
    assert g.stage("m", abs, concurrency=np.int64(2)).name == "m"
    # Flags and the process count: named too ('yes' was pybind11's argument dump; 1 was True).
    for make, text in [(lambda: g.stage("f", abs, blocking="yes"), r"stage\('f'\): blocking must be True or False, not 'yes'"),
                       (lambda: g.stage("f", abs, ordered=1), r"stage\('f'\): ordered must be True or False, not 1"),
                       (lambda: g.batch("f", 2, drop_last=None), r"batch\('f'\): drop_last must be True or False, not None"),
                       (lambda: g.gpu_stage("f", sf.ops.normalize([0.0], [1.0]), ordered="no"),
                        r"gpu_stage\('f'\): ordered must be True or False, not 'no'"),
                       (lambda: g.stage("f", abs, processes="2"), r"stage\('f'\): processes must be an int >= 0 \(0: run in a thread"),
                       (lambda: g.stage("f", abs, processes=-1), r"stage\('f'\): processes=-1 is negative")]:
        with pytest.raises(sf.GraphError, match=text):
            make()
    assert g.stage("o", abs, ordered=np.bool_(False), blocking=np.bool_(True)).name == "o"  # a NumPy bool is a bool
    assert g.batch("p", 2, drop_last=True).name == "p"


def test_a_dtype_torch_lacks_is_named_with_its_field():
    # uint16 reached torch's DLPack and failed there: "Unsupported kUInt bits 16".
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "u16")
    src = g.source("s", [{"depth": np.full((4, 4), i, np.uint16), "index": i} for i in range(2)])
    b = g.batch("b", 2)
    out = g.pull_sink("out")
    src >> b >> out
    (batch,) = list(g.iterate(out))
    if hasattr(torch, "uint16"):
        pytest.skip("this torch has uint16")
    with pytest.raises(TypeError, match=r"the item\['depth'\] is a uint16 tensor of shape "
                                        r"\(2, 4, 4\), a dtype torch .* does not have"):
        sft.to_torch(batch)
    assert sft.to_torch(batch["index"]).tolist() == [0, 1]


def test_strided_arrays_and_tensors_collate_like_default_collate():
    # An HWC -> CHW transpose (a view, not C-contiguous) was refused by g.batch ("the array is
    # not C-contiguous"), where default_collate stacks it (a new user's trial, 2026-12-05).
    def chw(i):
        return np.arange(60, dtype=np.uint8).reshape(4, 5, 3).transpose(2, 0, 1) + np.uint8(i)

    def tensor_t(i):
        return torch.arange(6, dtype=torch.float32).reshape(2, 3).t() + i

    for fn in (chw, tensor_t):
        rt = sf.Runtime(threads=2, backend="host")
        g = sf.Graph(rt, "strided")
        src = g.source("s", list(range(3)))
        st = g.stage("view", fn)
        b = g.batch("b", 3)
        out = g.pull_sink("out")
        src >> st >> b >> out
        (batch,) = list(g.iterate(out))
        ref = torch.utils.data.default_collate([torch.as_tensor(np.asarray(fn(i))) for i in range(3)])
        got = sft.to_torch(batch)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert torch.equal(got, ref)
