"""splitflow.torch.GraphDataset: exact resume in every documented pattern (issue 15, "Exact
resume"; bug 4). A resumed epoch yields exactly the samples the loop had not taken: none
repeated, none lost, whether the graph batches, skips or runs a stage out of order, and with
DataLoader workers and DataLoader batching. len() of a batching graph counts batches; the
stats' errors name dataset indices."""
import random
import time
import warnings

import numpy as np
import pytest
import torch

import splitflow as sf
import splitflow.torch as sft
from loader_fns import loader as loader_of  # (spawned workers that say where they hang)

DataLoader = torch.utils.data.DataLoader
SKIP = {5, 30}  # "corrupt" samples, dropped by on_error="skip"


# -- graphs (module level: spawned DataLoader workers import them) ------------------------------

def sample(i):
    """A dict sample that carries its dataset index, as read_file(paths, labels=...) makes."""
    return {"x": np.full(2, i, np.float32), "index": i}


def sample_or_fail(i):
    time.sleep(random.random() * 0.002)  # the stage runs out of order: finishing order varies
    if i in SKIP:
        raise RuntimeError(f"corrupt sample {i}")
    return sample(i)


def build_identity_samples(g, indices):
    return indices >> g.stage("sample", sample)


def build_identity(g, indices):
    return indices


def build_indexed_batches(g, indices):
    return indices >> g.stage("sample", sample, concurrency=2) >> g.batch("batch", 8)


def build_skipping_batches(g, indices):
    s = g.stage("sample", sample_or_fail, concurrency=3, on_error="skip", ordered=False)
    return indices >> s >> g.batch("batch", 8)


def build_skipping_samples(g, indices):
    return indices >> g.stage("sample", sample_or_fail, concurrency=3, on_error="skip",
                              ordered=False)


def build_skipping_tuples(g, indices):
    # (image, label) tuples as a torchvision-style stage makes them: no index field.
    def pair(i):
        time.sleep(random.random() * 0.002)  # out of order: finishing order varies
        if i in SKIP:
            raise RuntimeError(f"corrupt sample {i}")
        return (np.full(2, i, np.float32), f"label{i}")
    return indices >> g.stage("pair", pair, concurrency=3, on_error="skip", ordered=False)


def build_tuple_batches(g, indices):
    # (image, label) tuples batched: a list of the columns, as default_collate makes it.
    return indices >> g.stage("pair", lambda i: (np.full(2, i, np.float32), f"label{i}")) \
        >> g.batch("batch", 8)


def build_filled_batches(g, indices):
    # C++ ops only, no index field: uint8 [3] tensors filled with the index, batched by 8.
    return indices >> g.stage("fill", sf.ops.fill([3]), concurrency=0) >> g.batch("batch", 8)


def ids(item):
    """The dataset indices an item (a sample, a graph batch or a DataLoader batch) holds."""
    if isinstance(item, dict):
        return [int(i) for i in item["index"].reshape(-1).tolist()]
    t = torch.as_tensor(item)
    if t.dim() >= 2:  # filled tensors: every value is the index
        t = t.reshape(-1, t.shape[-1])[:, 0]
    return [int(i) for i in t.reshape(-1).tolist()]


def take(loader, batches, tracked=None):
    """The indices of the loader's first `batches` batches (then the loop breaks)."""
    got = []
    for k, batch in enumerate(tracked if tracked is not None else loader):
        got += ids(batch)
        if k + 1 == batches:
            break
    return got


def everything(loader):
    return [i for batch in loader for i in ids(batch)]


def check_exact(first, rest, expected_set):
    assert not set(first) & set(rest), f"repeated: {sorted(set(first) & set(rest))}"
    assert len(first) == len(set(first)) and len(rest) == len(set(rest))
    assert sorted(first + rest) == sorted(expected_set), \
        f"lost: {sorted(set(expected_set) - set(first + rest))}"


# -- (a) batching inside the graph, num_workers=0 -------------------------------------------------

# "with batching inside the graph, state_dict counts samples, not batches (today 3 batches of 8
# then resume repeated 21 of 24 images)": with and without the samples' index field, with and
# without shuffle; 24 samples (the break after the last batch: nothing left) and 61.
@pytest.mark.parametrize("length", [24, 61])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("build,by_index", [(build_indexed_batches, True),
                                            (build_filled_batches, False)])
def test_graph_batches_resume_after_3_batches_of_8(length, shuffle, build, by_index):
    def make():
        return sft.GraphDataset(build, length, shuffle=shuffle, seed=3, threads=2,
                                backend="host")
    full = make()
    full.set_epoch(2)
    expected = everything(DataLoader(full, batch_size=None))

    ds = make()
    ds.set_epoch(2)
    first = take(DataLoader(ds, batch_size=None), 3)
    state = ds.state_dict()

    resumed = make()
    resumed.load_state_dict(state)
    rest = everything(DataLoader(resumed, batch_size=None))
    check_exact(first, rest, range(length))
    assert first + rest == expected  # in order: the very batches of the unbroken epoch
    assert state["samples_seen"] == 24 and state["by_index"] is by_index
    assert state["done"] == [[0, 24]]


# Skipped samples and a stage out of order: with the samples' index the resume is exact (the
# skipped ones are read, and skipped, again), also when saved again from a resumed epoch.
# A batch of tuples is a list of its columns: state_dict counts its samples by the first
# column's length (a reviewer: by the list's, 2 per batch, and a resume read 18 of 24 again).
def test_batches_of_tuples_count_their_samples():
    ds = sft.GraphDataset(build_tuple_batches, 61, threads=2, backend="host", to_torch=False)
    first = []
    for k, batch in enumerate(ds):
        assert isinstance(batch, list) and len(batch) == 2
        first += [int(v) for v in np.asarray(batch[0])[:, 0]]
        if k == 2:
            break
    state = ds.state_dict()
    assert state["samples_seen"] == 24
    again = sft.GraphDataset(build_tuple_batches, 61, threads=2, backend="host", to_torch=False)
    again.load_state_dict(state)
    rest = [int(v) for batch in again for v in np.asarray(batch[0])[:, 0]]
    check_exact(first, rest, set(range(61)))


# A new user's trial: (image, label) tuples, no index field, a corrupt file skipped, a break
# and a resume: 87 samples for 84 files (the state counted samples, so the skipped one's place
# was marked done and a sample taken came again). With num_workers=0 and no g.batch the state
# takes each sample's place in the run: exact, with skips and an out-of-order stage.
@pytest.mark.parametrize("shuffle", [False, True])
def test_samples_without_an_index_resume_exactly_past_skips_and_out_of_order(shuffle):
    def make():
        return sft.GraphDataset(build_skipping_tuples, 61, shuffle=shuffle, seed=2, threads=3,
                                backend="host", to_torch=False)
    def index(sample):
        return int(np.asarray(sample[0])[0])
    ds = make()
    first = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no index field: no warning either)
        for sample in ds:
            first.append(index(sample))
            assert sample[1] == f"label{first[-1]}"
            if len(first) == 40:
                break
        state = ds.state_dict()
    assert state["samples_seen"] == 40 and not state["by_index"]
    again = make()
    again.load_state_dict(state)
    rest = [index(x) for x in again]
    check_exact(first, rest, set(range(61)) - SKIP)


def test_graph_batches_resume_with_skips_and_an_out_of_order_stage():
    def make():
        return sft.GraphDataset(build_skipping_batches, 61, shuffle=True, seed=1, threads=3,
                                backend="host")
    ds = make()
    first = take(DataLoader(ds, batch_size=None), 3)
    state = ds.state_dict()

    again = make()
    again.load_state_dict(state)
    second = take(DataLoader(again, batch_size=None), 2)
    check_exact(first, second, set(first) | set(second))
    state2 = again.state_dict()

    last = make()
    last.load_state_dict(state2)
    rest = everything(DataLoader(last, batch_size=None))
    check_exact(first + second, rest, set(range(61)) - SKIP)
    assert state["by_index"] and state["samples_seen"] == len(first) == 24
    assert state2["samples_seen"] == 24 + len(second) == 40
    st = last.last_run.stats()
    crop = next(s for s in st["stages"] if s["name"] == "sample")
    assert crop["skipped"] == len(SKIP - set(first + second))


# A state saved after the whole epoch resumes to nothing (not to the whole epoch again).
def test_a_state_saved_after_the_epoch_resumes_to_nothing():
    ds = sft.GraphDataset(build_filled_batches, 20, threads=2, backend="host")
    assert len(everything(DataLoader(ds, batch_size=None))) == 20
    state = ds.state_dict()
    assert state["samples_seen"] == 20
    resumed = sft.GraphDataset(build_filled_batches, 20, threads=2, backend="host")
    resumed.load_state_dict(state)
    assert everything(DataLoader(resumed, batch_size=None)) == []


def test_the_resumed_loop_calls_set_epoch_with_the_loaded_epoch_and_continues_it():
    # The documented loop resumed as users write it: load_state_dict, then `for epoch in
    # range(state["epoch"], E): ds.set_epoch(epoch)`. set_epoch forgot the loaded state and
    # the epoch ran whole again: 6 samples repeated (a new user's trial, 2026-12-05).
    def run_epochs(ds, first, last):
        seen = {}
        for epoch in range(first, last):
            ds.set_epoch(epoch)
            seen[epoch] = [int(x["index"]) for x in DataLoader(ds, batch_size=None)]
        return seen

    ds = sft.GraphDataset(build_identity_samples, 20, shuffle=True, seed=0, threads=2, backend="host")
    ds.set_epoch(1)
    taken = []
    for k, x in enumerate(DataLoader(ds, batch_size=None)):
        taken.append(int(x["index"]))
        if k == 5:
            state = ds.state_dict()
            break
    assert state["epoch"] == 1 and state["samples_seen"] == 6
    full = run_epochs(sft.GraphDataset(build_identity_samples, 20, shuffle=True, seed=0,
                                       threads=2, backend="host"), 1, 3)
    resumed = sft.GraphDataset(build_identity_samples, 20, shuffle=True, seed=0, threads=2,
                               backend="host")
    resumed.load_state_dict(state)
    got = run_epochs(resumed, state["epoch"], 3)
    assert taken == full[1][:6]
    assert got[1] == full[1][6:]  # the rest of epoch 1, none repeated
    assert got[2] == full[2]      # and the next epoch whole
    # The resumed epoch run again (set_epoch of the same epoch once more): whole, the state
    # is not applied twice (with DataLoader workers this dataset does not see it taken).
    again = sft.GraphDataset(build_identity_samples, 20, shuffle=True, seed=0, threads=2,
                             backend="host")
    again.load_state_dict(state)
    again.set_epoch(1)
    def indices(loader):
        return [int(x["index"]) for x in loader]

    assert sorted(indices(loader_of(again, batch_size=None, num_workers=2))) == sorted(full[1][6:])
    again.set_epoch(1)
    assert sorted(indices(loader_of(again, batch_size=None, num_workers=2))) == list(range(20))
    # A state loaded and then another epoch set: that epoch, whole (the state is dropped).
    other = sft.GraphDataset(build_identity_samples, 20, shuffle=True, seed=0, threads=2,
                             backend="host")
    other.load_state_dict(state)
    assert run_epochs(other, 2, 3)[2] == full[2]


# -- (b) DataLoader workers and DataLoader batching ---------------------------------------------

# "with num_workers > 0 and DataLoader batching (today 8 lost and 8 repeated after an odd number
# of batches)": state_dict(batches_seen=k, loader=loader), also when a worker is done before
# the others (50 samples over 3 workers: batches 5, 5, 4); the resumed loader with the same
# settings gives the very batches of the unbroken epoch.
@pytest.mark.parametrize("length,workers,batch,taken", [(61, 2, 4, 3), (61, 2, 4, 5),
                                                         (50, 3, 4, 13)])
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_with_loader_batches_resume_exactly(length, workers, batch, taken):
    def make():
        return sft.GraphDataset(build_identity, length, shuffle=True, seed=9, threads=1,
                                backend="host")
    expected = everything(loader_of(make(), batch_size=batch, num_workers=workers))

    ds = make()
    loader = loader_of(ds, batch_size=batch, num_workers=workers)
    first = take(loader, taken)
    state = ds.state_dict(batches_seen=taken, loader=loader)
    assert state["samples_seen"] == len(first)

    resumed = make()
    resumed.load_state_dict(state)
    rest = everything(loader_of(resumed, batch_size=batch, num_workers=workers))
    check_exact(first, rest, range(length))
    assert first + rest == expected
    # Another num_workers: the same samples, grouped differently.
    other = make()
    other.load_state_dict(state)
    check_exact(first, everything(loader_of(other, batch_size=batch, num_workers=1)),
                range(length))


# Workers and batches made by the graph (DataLoader(batch_size=None)): batch_size= tells the
# main process, which does not run the graph, how many samples an item holds.
def test_workers_with_graph_batches_resume_exactly():
    def make():
        return sft.GraphDataset(build_filled_batches, 61, shuffle=True, seed=2, threads=1,
                                backend="host", batch_size=8)
    ds = make()
    loader = loader_of(ds, batch_size=None, num_workers=2)
    first = take(loader, 3)
    state = ds.state_dict(batches_seen=3, loader=loader)
    resumed = make()
    resumed.load_state_dict(state)
    rest = everything(loader_of(resumed, batch_size=None, num_workers=2))
    check_exact(first, rest, range(61))


# ds.track(loader): the dataset notes what the loop takes; with the samples' index the resume
# is exact with workers even when samples are skipped and a stage runs out of order.
def test_track_with_workers_skips_and_out_of_order_is_exact():
    def make():
        return sft.GraphDataset(build_skipping_samples, 61, shuffle=True, seed=5, threads=2,
                                backend="host")
    ds = make()
    loader = loader_of(ds, batch_size=4, num_workers=2)
    first = take(loader, 5, tracked=ds.track(loader))
    state = ds.state_dict()
    assert state["by_index"] and state["samples_seen"] == len(first) == 20

    resumed = make()
    resumed.load_state_dict(state)
    loader = loader_of(resumed, batch_size=4, num_workers=2)
    rest = everything(resumed.track(loader))
    check_exact(first, rest, set(range(61)) - SKIP)
    assert resumed.state_dict()["samples_seen"] == 61  # the epoch is over


# track() without an index field counts the batches, as state_dict(batches_seen=...) does.
def test_track_counts_batches_without_an_index_field():
    ds = sft.GraphDataset(build_identity, 61, shuffle=True, seed=4, threads=1, backend="host")
    loader = loader_of(ds, batch_size=4, num_workers=2)
    first = take(loader, 3, tracked=ds.track(loader))
    state = ds.state_dict()
    assert not state["by_index"] and state == ds.state_dict(batches_seen=3, loader=loader)
    resumed = sft.GraphDataset(build_identity, 61, shuffle=True, seed=4, threads=1,
                               backend="host")
    resumed.load_state_dict(state)
    check_exact(first, everything(loader_of(resumed, batch_size=4, num_workers=2)), range(61))


def test_state_dict_of_workers_it_did_not_see_warns():
    ds = sft.GraphDataset(build_identity, 10, threads=1, backend="host")
    take(loader_of(ds, batch_size=2, num_workers=1), 1)
    with pytest.warns(UserWarning, match="did not see what they yielded"):
        state = ds.state_dict()
    assert state["samples_seen"] == 0
    with pytest.raises(TypeError, match="pass loader="):
        ds.state_dict(batches_seen=1)


def test_a_state_of_another_sharding_is_refused():
    ds = sft.GraphDataset(build_identity, 10, rank=0, world_size=2)
    other = sft.GraphDataset(build_identity, 10, rank=0, world_size=3)
    with pytest.raises(ValueError, match="another sharding"):
        other.load_state_dict(ds.state_dict())


# -- (c) len() ----------------------------------------------------------------------------------

# "len() of a dataset that batches inside the graph is the number of batches it yields"
def test_len_counts_the_batches_the_graph_makes():
    def build_by(size, drop):
        return lambda g, indices: indices >> g.batch("batch", size, drop_last=drop)

    for length, size, drop, rank, world, batches in ((61, 8, False, 0, 1, 8),
                                                     (61, 8, True, 0, 1, 7),
                                                     (64, 8, False, 0, 1, 8),
                                                     (61, 8, False, 1, 2, 4),
                                                     (5, 8, True, 0, 1, 0)):
        ds = sft.GraphDataset(build_by(size, drop), length, batch_size=size, drop_last=drop,
                              rank=rank, world_size=world, threads=2, backend="host")
        assert len(ds) == batches
        assert len(list(DataLoader(ds, batch_size=None))) == batches
    # Without batch_size=, the first iteration finds the graph's batching out.
    ds = sft.GraphDataset(build_filled_batches, 61, threads=2, backend="host")
    assert len(ds) == 61
    assert len(list(DataLoader(ds, batch_size=None))) == 8 == len(ds)
    # A batch_size= that the graph contradicts is an error, not a wrong len().
    ds = sft.GraphDataset(build_filled_batches, 61, batch_size=16, threads=2, backend="host")
    with pytest.raises(ValueError, match="the graph batches by 8"):
        list(DataLoader(ds, batch_size=None))
    # And so is a batch_size= given to a graph that does not batch (a new user's trial: no
    # error, len() 3 for 10 samples, and a resume after 2 samples counted them as 8 and lost 6).
    for build in (build_identity, lambda g, indices: None,
                  lambda g, indices: indices >> g.batch("b", 4) >> g.unbatch("u")):
        ds = sft.GraphDataset(build, 10, batch_size=4, threads=2, backend="host")
        with pytest.raises(ValueError, match=r"GraphDataset\(batch_size=4, drop_last=False\) but "
                                             r"the graph does not batch: build\(\) returned .* so "
                                             r"its items are samples; drop batch_size= or end "
                                             r"build\(\) with g.batch\(name, 4\)"):
            next(iter(ds))
        assert ds.state_dict()["samples_seen"] == 0


# -- (d) the stats name dataset indices ----------------------------------------------------------

def fail_at_13(i):
    if i == 13:
        raise RuntimeError("corrupt sample 13")
    return i


# Bug 4: "the stats' errors[].item are positions in the run, not dataset indices (index 13
# reported as item 39 with shuffle)": errors[].item is the dataset index, .position the run's.
def test_stats_errors_name_the_dataset_index_under_shuffle():
    def build(g, indices):
        return indices >> g.stage("decode", fail_at_13, on_error="skip")
    ds = sft.GraphDataset(build, 103, shuffle=True, seed=4, threads=2, backend="host")
    got = everything(DataLoader(ds, batch_size=None))
    assert sorted(got) == [i for i in range(103) if i != 13]
    position = ds.rank_indices().index(13)
    assert position != 13
    decode = next(s for s in ds.last_run.stats()["stages"] if s["name"] == "decode")
    assert decode["skipped"] == 1
    assert decode["errors"][0]["item"] == 13
    assert decode["errors"][0]["position"] == position
    assert "corrupt sample 13" in decode["errors"][0]["message"]
    assert "decode" in ds.last_run.report()  # the rest of the run is there as before


# A cancel from elsewhere (a watchdog's ds.last_run.cancel()) cuts the epoch short: the loop
# ends with CancelledError, and the state says what was taken, so that a resume gives the rest.
# Before: the loop ended as if the epoch were whole, and the state recorded it as done, so the
# resume gave nothing: 37 of 61 samples lost.
def test_an_epoch_cancelled_from_elsewhere_raises_and_resumes_to_the_rest():
    def make():
        return sft.GraphDataset(build_indexed_batches, 61, shuffle=True, seed=5, threads=2,
                                backend="host")
    ds = make()
    first = []
    with pytest.raises(sf.CancelledError, match=r"pull sink 'samples' reached the end of its "
                                                r"stream: Run::cancel\(\)"):
        for k, batch in enumerate(DataLoader(ds, batch_size=None)):
            first += ids(batch)
            if k == 2:
                ds.last_run.cancel()  # as another thread would
    assert len(first) == 24
    state = ds.state_dict()
    assert state["samples_seen"] == 24 and state["done"] != [[0, 61]]
    resumed = make()
    resumed.load_state_dict(state)
    rest = everything(DataLoader(resumed, batch_size=None))
    check_exact(first, rest, range(61))
