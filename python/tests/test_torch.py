"""splitflow.torch: a graph as a DataLoader dataset (sharding, epochs, resume, training).
Each test names the requirement of the issue "Python binding" it checks."""
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import splitflow as sf
import splitflow.torch as sft
from loader_fns import loader, loop

N = 103  # not a multiple of any shard count below


def build_identity(g, indices):
    return indices


def build_tensors(g, indices):
    # C++ ops only: index -> uint8 [4] tensor filled with the index (mod 256).
    return indices >> g.stage("fill", sf.ops.fill([4]), concurrency=0)


def build_pairs(g, indices):
    return indices >> g.stage("pair", lambda i: (i, np.full(3, i, np.float32)), concurrency=2)


def build_failing_at_10(g, indices):
    def check(i):
        if i == 10:
            raise RuntimeError("corrupt sample 10")
        return i
    return indices >> g.stage("decode", check)


def collect(ds, **loader_args):
    # Workers are spawned: this process already runs splitflow threads, which a forked worker
    # would not have. (loader_fns: no iterator outlives its test; a stuck worker says where.)
    with loop(loader(ds, batch_size=None, **loader_args)) as it:
        return [int(x) for x in it]


# "With num_workers=0 splitflow does the parallelism in threads"; "__len__ where the length is
# known"
def test_num_workers_0_reads_every_item_in_order_as_torch_tensors():
    ds = sft.GraphDataset(build_tensors, N, threads=2, backend="host")
    assert len(ds) == N
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    got = list(loader)
    assert len(got) == N
    for i, t in enumerate(got):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == (4,)
        assert bool((t == i % 256).all())
    st = ds.last_run.stats()
    assert st["items_delivered"] == N


# Each epoch's graph takes splitflow.Graph's options: a new user's trial found trace=True
# refused ("unexpected keyword argument 'trace'", and autotune_window, priority,
# autotune_queues too) while the empty trace's note said "(Python: trace=True) records a run's
# events".
def test_the_graphs_options_reach_each_epochs_graph():
    ds = sft.GraphDataset(build_tensors, 20, threads=2, backend="host", trace=True,
                          autotune_window=0.05, autotune_queues=False, priority=1)
    assert len(list(torch.utils.data.DataLoader(ds, batch_size=None))) == 20
    trace = json.loads(ds.last_run.trace_json())
    assert any(e.get("name") == "fill" for e in trace["traceEvents"]), trace
    quiet = sft.GraphDataset(build_tensors, 20, threads=2, backend="host")
    assert len(list(torch.utils.data.DataLoader(quiet, batch_size=None))) == 20
    assert not [e for e in json.loads(quiet.last_run.trace_json())["traceEvents"]
                if e.get("name") == "fill"]
    with pytest.raises(sf.GraphError, match="autotune_window must be positive"):
        next(iter(sft.GraphDataset(build_tensors, 20, threads=2, backend="host",
                                   autotune_window=0)))


# "sharding: the union over workers/ranks equals the dataset with no duplicates, for
# num_workers in {0, 2}"
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 3])
def test_shards_over_ranks_and_workers_cover_the_dataset_once(workers, world):
    seen = []
    for rank in range(world):
        ds = sft.GraphDataset(build_identity, N, shuffle=True, seed=5, rank=rank,
                              world_size=world, threads=2, backend="host")
        got = collect(ds, num_workers=workers)
        assert len(got) == len(ds), f"rank {rank}: __len__ is what it yields"
        seen += got
    assert sorted(seen) == list(range(N))


# "set_epoch(n) reshuffles deterministically"
def test_set_epoch_reshuffles_deterministically():
    def order(epoch, seed=1):
        ds = sft.GraphDataset(build_identity, N, shuffle=True, seed=seed, threads=2, backend="host")
        ds.set_epoch(epoch)
        return collect(ds)
    e0, e0_again, e1 = order(0), order(0), order(1)
    assert e0 == e0_again
    assert e0 != e1
    assert sorted(e0) == sorted(e1) == list(range(N))
    assert e0 != list(range(N))
    assert order(0, seed=2) != e0


# "state_dict()/load_state_dict() resume mid-epoch without repeating or skipping items"
def test_resume_mid_epoch_from_state_dict():
    full = sft.GraphDataset(build_identity, N, shuffle=True, seed=3, threads=2, backend="host")
    full.set_epoch(4)
    expected = collect(full)

    ds = sft.GraphDataset(build_identity, N, shuffle=True, seed=3, threads=2, backend="host")
    ds.set_epoch(4)
    first = []
    for x in torch.utils.data.DataLoader(ds, batch_size=None):
        first.append(int(x))
        if len(first) == 37:
            break
    state = ds.state_dict()
    assert state["samples_seen"] == 37 and state["epoch"] == 4

    resumed = sft.GraphDataset(build_identity, N, shuffle=True, seed=0, threads=2, backend="host")
    resumed.load_state_dict(state)
    rest = collect(resumed)
    assert first + rest == expected


def test_resume_with_workers_from_items_seen():
    full = sft.GraphDataset(build_identity, N, shuffle=True, seed=9, threads=2, backend="host")
    expected = collect(full, num_workers=2)
    ds = sft.GraphDataset(build_identity, N, shuffle=True, seed=9, threads=2, backend="host")
    ds.load_state_dict(ds.state_dict(items_seen=41))
    rest = collect(ds, num_workers=2)
    assert expected[:41] + rest == expected


# Forked workers of a process whose splitflow threads already run get a clear error, not a
# hang.
def test_a_fork_after_the_thread_pool_started_is_refused_clearly():
    ds = sft.GraphDataset(build_identity, 10, threads=2, backend="host")
    collect(ds)  # this process runs splitflow threads now
    forked = loader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(Exception, match=r"forked from one \(pid \d+\) that had already run splitflow graphs"):
        with loop(forked) as it:
            list(it)


# A new user's trial: a process that had only created a Runtime (no graph run: no thread
# started) had its forked workers refused with the error above, whose advice ("fork before
# running graphs") it had followed. Its workers now run; and the refusal comes once it has run.
def test_a_fork_after_only_creating_a_runtime_works():
    script = textwrap.dedent("""
        import torch.utils.data
        import splitflow as sf, splitflow.torch as sft
        rt = sf.Runtime(threads=2, backend="host")  # made before the fork, no graph run
        def build(g, indices):
            return indices
        ds = sft.GraphDataset(build, 40, threads=2, backend="host")
        for epoch in range(2):
            got = sorted(int(x) for x in torch.utils.data.DataLoader(
                ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
            assert got == list(range(40)), got
        print("forked workers ran", flush=True)
        g = sf.Graph(rt, "now")
        out = g.pull_sink("out")
        g.indices("i", [1, 2]) >> out
        assert [int(x) for x in g.iterate(out)] == [1, 2]
        try:
            list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                             multiprocessing_context="fork"))
        except Exception as e:
            print("refused:", e, flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "forked workers ran" in p.stdout
    assert "already run splitflow graphs" in p.stdout, p.stdout


# "Errors inside any stage raise a Python exception naming the stage and item"
def test_stage_errors_reach_the_training_loop():
    def build(g, indices):
        def check(i):
            if i == 10:
                raise RuntimeError("corrupt sample 10")
            return i
        return indices >> g.stage("decode", check)
    ds = sft.GraphDataset(build, N, threads=2, backend="host")
    with pytest.raises(sf.StageError) as info:
        collect(ds)
    assert info.value.stage == "decode" and info.value.item == 10
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_build_that_forgets_its_return_is_told_so():
    # build() returning None passes the indices through; one that added stages and forgot its
    # return got only "stage 'x': its output is not connected to any consumer".
    def forgot(g, indices):
        indices >> g.stage("x", lambda i: i)
    with pytest.raises(sf.GraphError, match=r"GraphDataset: build\(\) returned None, so the samples "
                                            r"would be the indices themselves, but it added nodes "
                                            r"whose output goes nowhere; return the last node it "
                                            r"added \(.*stage 'x'"):
        collect(sft.GraphDataset(forgot, N, threads=2, backend="host"))
    # Returning None on purpose (no stages): the indices themselves.
    assert collect(sft.GraphDataset(lambda g, indices: None, 5, threads=2, backend="host")) == list(range(5))
    # Returning something that is no node: said so (it was Python's "unsupported operand
    # type(s) for >>: 'int' and 'splitflow._core.Node'", a new user's trial).
    with pytest.raises(sf.GraphError, match=r"GraphDataset: build\(g, source\) returned int 42, not a "
                                            r"node of g; return the last node it added"):
        collect(sft.GraphDataset(lambda g, indices: 42, 5, threads=2, backend="host"))


# A stage error in a DataLoader worker reaches the parent as a StageError with its attributes.
def test_stage_errors_from_workers_keep_their_attributes():
    ds = sft.GraphDataset(build_failing_at_10, N, threads=2, backend="host")
    with pytest.raises(sf.StageError) as info:
        collect(ds, num_workers=1)
    assert info.value.stage == "decode" and info.value.item is not None
    assert "corrupt sample 10" in str(info.value)


def test_samples_are_nested_structures_with_numpy_and_torch(tmp_path):
    ds = sft.GraphDataset(build_pairs, 10, threads=2, backend="host")
    got = list(torch.utils.data.DataLoader(ds, batch_size=None))
    for i, (idx, arr) in enumerate(got):
        assert idx == i
        assert isinstance(arr, torch.Tensor) and arr.tolist() == [float(i)] * 3


# "a DataLoader-driven training loop of a tiny torch.nn model for a few steps"
def test_training_loop_on_a_tiny_model():
    torch.manual_seed(0)
    w_true = torch.tensor([[2.0], [-3.0]])

    def build(g, indices):
        def sample(i):
            x = torch.randn(16, 2, generator=torch.Generator().manual_seed(int(i)))
            return x.numpy(), (x @ w_true).numpy()
        return indices >> g.stage("sample", sample, concurrency=2)
    ds = sft.GraphDataset(build, 60, shuffle=True, threads=2, backend="host")
    model = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        for x, y in torch.utils.data.DataLoader(ds, batch_size=None):
            loss = torch.nn.functional.mse_loss(model(torch.as_tensor(x)), torch.as_tensor(y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert len(losses) == 120
    assert losses[-1] < 0.01 * losses[0]
    assert torch.allclose(model.weight.detach().T, w_true, atol=0.05)


# "for 2 ranks of a real torch.distributed gloo group on loopback"
def test_two_gloo_ranks_shard_the_dataset(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        import torch, torch.distributed as dist, torch.multiprocessing as mp
        import splitflow.torch as sft

        def build(g, indices):
            return indices

        def main(rank, world, init_file, out_dir):
            dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                    world_size=world)
            ds = sft.GraphDataset(build, {N}, shuffle=True, seed=7, threads=2, backend="host")
            assert ds.shard() == (rank, world)
            # One of the two given: the other from torch.distributed (a trial found world_size=2
            # alone read shard 0 on both ranks, and rank= alone read the whole data set).
            half = sft.GraphDataset(build, {N}, world_size=world, threads=2, backend="host")
            assert half.shard() == (rank, world), half.shard()
            half = sft.GraphDataset(build, {N}, rank=rank, threads=2, backend="host")
            assert half.shard() == (rank, world), half.shard()
            # A DataLoader worker's copy carries the shard: a spawned worker has no process
            # group to take it from (it read the whole data set as 0 of 1).
            state = ds.__getstate__()
            assert (state["_rank"], state["_world_size"]) == (rank, world), state
            got = [int(x) for x in torch.utils.data.DataLoader(ds, batch_size=None)]
            gathered = [None] * world
            dist.all_gather_object(gathered, got)
            if rank == 0:
                with open(os.path.join(out_dir, "result.txt"), "w") as f:
                    f.write(repr(gathered))
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.start_processes(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2,
                               start_method="fork")
    """)
    path = tmp_path / "gloo_shards.py"
    path.write_text(script)
    p = subprocess.run([sys.executable, str(path), str(tmp_path / "init"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    gathered = eval((tmp_path / "result.txt").read_text())
    assert len(gathered) == 2
    assert len(gathered[0]) == (N + 1) // 2 and len(gathered[1]) == N // 2
    assert sorted(gathered[0] + gathered[1]) == list(range(N))


# A new user's trial (2026-12-05): rank= or world_size= alone, without torch.distributed,
# read the wrong shard silently (world_size=2 alone: shard 0 on every rank); length=2.5 and
# batch_size=2.5 were taken as 2, length="3" and seed=2**64 failed later with errors of their
# own, load_state_dict({}) raised a bare KeyError and a state's done range past the shard was
# taken.
def test_shard_and_size_arguments_are_checked_when_given():
    with pytest.raises(ValueError, match="world_size is given but not rank, and torch.distributed "
                                         "is not initialised to tell it: give both"):
        sft.GraphDataset(build_identity, 10, world_size=2).shard()
    with pytest.raises(ValueError, match="rank is given but not world_size"):
        sft.GraphDataset(build_identity, 10, rank=1).shard()
    assert sft.GraphDataset(build_identity, 10, rank=1, world_size=2).shard() == (1, 2)
    assert sft.GraphDataset(build_identity, 10).shard() == (0, 1)
    for kwargs, text in [(dict(length=2.5), "length must be an int, not 2.5"),
                         (dict(length="3"), "length must be an int, not '3'"),
                         (dict(length=-1), "length must be >= 0, not -1"),
                         (dict(batch_size=2.5), "batch_size must be an int (or None), not 2.5"),
                         (dict(batch_size=0), "batch_size must be >= 1 (or None), not 0"),
                         (dict(seed=2 ** 64), "seed must be < 2**63"),
                         (dict(seed=-1), "seed must be >= 0"),
                         (dict(rank=True, world_size=2), "rank must be an int (or None), not True"),
                         (dict(rank=2, world_size=2), "rank 2 is not in [0, 2)")]:
        args = dict(length=10)
        args.update(kwargs)
        # splitflow's GraphError (a ValueError too), as the other classes' argument errors: it
        # was a builtin ValueError, which `except sf.Error` missed (a new user's trial)
        with pytest.raises(sf.GraphError, match=re.escape("GraphDataset: " + text)):
            sft.GraphDataset(build_identity, args.pop("length"), **args)
    assert sft.GraphDataset(build_identity, np.int64(4), batch_size=np.int32(2)).length == 4
    ds = sft.GraphDataset(build_identity, 3)
    with pytest.raises(ValueError, match="not a state of GraphDataset.state_dict"):
        ds.load_state_dict({})
    state = ds.state_dict()
    state["done"] = [[2, 1]]
    with pytest.raises(ValueError, match=re.escape("done range [2, 1) is not a range of positions")):
        ds.load_state_dict(state)
    assert sft.GraphDataset(build_identity, 10, world_size=1).shard() == (0, 1)

    # set_epoch's epoch too (a new user's trial: 1.7 was taken as 1, True and "3" as 1 and 3,
    # -1 failed at the next iteration inside the build's ops, "x" with int()'s bare ValueError),
    # and a build that is not a function (it failed at the first iteration, naming nothing).
    ds = sft.GraphDataset(build_identity, 4)
    for epoch, text in [(1.7, "epoch must be an int, not 1.7"), (True, "epoch must be an int, not True"),
                        ("3", "epoch must be an int, not '3'"), (-1, "epoch must be >= 0, not -1"),
                        (2 ** 64, "epoch must be < 2**64")]:
        with pytest.raises(sf.GraphError, match=re.escape("GraphDataset.set_epoch: " + text)):
            ds.set_epoch(epoch)
    assert ds.epoch == 0
    ds.set_epoch(np.int64(2))
    assert ds.epoch == 2 and sorted(ds) == [0, 1, 2, 3]
    with pytest.raises(sf.GraphError, match=re.escape("GraphDataset: build must be a function "
                                                      "build(graph, indices) -> node, not 42")):
        sft.GraphDataset(42, 3)


# "Even shards for DDP": with even_shards every rank yields the same number of samples (101
# over 2 ranks: 51 and 51 padded, or 50 and 50 dropped), like DistributedSampler.
def test_even_shards_give_every_rank_the_same_length():
    for mode, each in (("pad", 51), ("drop", 50), (None, None)):
        got = []
        for rank in range(2):
            ds = sft.GraphDataset(build_identity, 101, shuffle=True, seed=3, rank=rank,
                                  world_size=2, threads=2, backend="host", even_shards=mode)
            items = collect(ds)
            assert len(items) == len(ds)
            got.append(items)
        if mode is None:
            assert [len(g) for g in got] == [51, 50]
            assert sorted(got[0] + got[1]) == list(range(101))
        else:
            assert [len(g) for g in got] == [each, each]
            union = got[0] + got[1]
            if mode == "pad":
                assert set(union) == set(range(101)) and len(union) == 102
            else:
                assert len(set(union)) == 100
    with pytest.raises(ValueError, match="even_shards must be None, 'pad' or 'drop'"):
        sft.GraphDataset(build_identity, 10, even_shards="yes")


# even_shards with items skipped (on_error="skip"): a rank that lost items took fewer steps
# than the others (a new user's trial: len() 6 on three ranks, 5, 5 and 6 batches; under DDP
# the rank with the step more waits in its last collective for ever). The shard's last sample
# (batch) is repeated, a copy, up to the count, with a warning naming the rank.
def build_skipping_3_and_4(g, indices):
    def check(i):
        if int(i) in (3, 4):
            raise ValueError(f"bad sample {int(i)}")
        return np.full(2, int(i), np.int64)
    return indices >> g.stage("check", check, on_error="skip")


def build_skipping_3_and_4_batched(g, indices):
    return build_skipping_3_and_4(g, indices) >> g.batch("b", 4)


def test_even_shards_make_up_skipped_items_so_every_rank_takes_the_same_steps():
    for mode, build, batch, want in (("pad", build_skipping_3_and_4, None, 14),
                                     ("drop", build_skipping_3_and_4, None, 13),
                                     ("pad", build_skipping_3_and_4_batched, 4, 4),
                                     ("drop", build_skipping_3_and_4_batched, 4, 4)):
        steps, seen = [], []
        for rank in range(3):
            ds = sft.GraphDataset(build, 40, shuffle=True, seed=1, rank=rank, world_size=3,
                                  threads=2, backend="host", even_shards=mode, batch_size=batch)
            ds.set_epoch(5)
            assert len(ds) == want
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                items = list(torch.utils.data.DataLoader(ds, batch_size=None))
            steps.append(len(items))
            rows = [r for x in items for r in (x if batch else x[None])]
            order = ds.rank_indices()
            lost = [i for i in order if i in (3, 4)]
            made_up = [str(w.message) for w in said if "is repeated" in str(w.message)]
            if lost and (batch is None or len(order) - len(lost) <= (want - 1) * batch):
                assert len(made_up) == 1, (mode, rank, made_up)
                assert made_up[0].startswith(f"GraphDataset(even_shards={mode!r}): rank {rank} of 3 "
                                             f"yielded {want - 1 if batch else want - len(lost)} of its "
                                             f"{want} {'batches' if batch else 'samples'}"), made_up[0]
                assert torch.equal(items[-1], items[-2])  # the shard's last, repeated
            else:
                assert not made_up, made_up
            seen += [int(r[0]) for r in rows]
        assert steps == [want] * 3, (mode, batch, steps)
        assert 3 not in seen and 4 not in seen
    # Without even_shards, a rank of several that yielded fewer than its shard is warned of (a
    # new user's 2-rank DDP run hung, nothing said why); one rank alone, or a full shard, not.
    for length, rank, world, warned in ((10, 0, 2, True), (10, 1, 2, True), (3, 1, 2, False),
                                        (10, 0, 1, False)):
        ds = sft.GraphDataset(build_skipping_3_and_4, length, rank=rank, world_size=world,
                              threads=2, backend="host")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            items = list(ds)
        short = [str(w.message) for w in said if "leaves them waiting" in str(w.message)]
        lost = [i for i in ds.rank_indices() if i in (3, 4)]
        assert len(items) == len(ds.rank_indices()) - len(lost)
        if warned:
            assert short == [f"GraphDataset: rank {rank} of 2 yielded 4 of its 5 samples (items "
                             f"its stages skipped, on_error='skip', or dropped); with DDP, a rank that takes fewer steps "
                             f"than the others leaves them waiting in their last collective for "
                             f"ever: even_shards='pad' (or 'drop') makes every rank's count the "
                             f"same"], short
        else:
            assert not short, (length, rank, world, short)
    # The repeats are copies taken before the loop sees the last item: a loop that changes
    # each item in place (x += 1000) changes neither the repeats nor, twice, the item.
    ds = sft.GraphDataset(build_skipping_3_and_4, 40, shuffle=True, seed=1, rank=0, world_size=3,
                          threads=2, backend="host", even_shards="pad")
    ds.set_epoch(5)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in ds:
            seen.append(x.copy())
            x += 1000
    assert len(seen) == 14 and np.array_equal(seen[-1], seen[-2]) and seen[-1].max() < 1000
    # A state taken among the repeats resumes with the steps left (one rank, 40 samples, 2
    # skipped: 38 and 2 repeats); the resumed epoch's items were skipped again, and it makes
    # them up from the shard's first item.
    for taken in (38, 39):
        ds = sft.GraphDataset(build_skipping_3_and_4, 40, threads=2, backend="host",
                              even_shards="drop")
        ds.set_epoch(0)
        it = iter(ds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [next(it) for _ in range(taken)]
        state = ds.state_dict()
        it.close()
        assert state["samples_seen"] == taken, state  # 38 real, then a skipped one per repeat
        again = sft.GraphDataset(build_skipping_3_and_4, 40, threads=2, backend="host",
                                 even_shards="drop")
        again.load_state_dict(state)
        again.set_epoch(0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            rest = list(again)
        assert len(got) + len(rest) == 40, (taken, len(rest))
        assert all(np.array_equal(x, [0, 0]) for x in rest), rest  # the shard's first
        assert any("the first of its shard is repeated" in str(w.message) for w in said), \
            [str(w.message) for w in said]
    # A state at the last step of a shard whose count came whole despite a skip (38 samples, 5
    # batches of 8) resumes with nothing (a trial's resumed with the skipped position, skipped
    # it again and made it up: 6 steps where len() said 5).
    def build_indexed(g, indices):
        def check(i):
            if int(i) in (3, 4):
                raise ValueError(f"bad sample {int(i)}")
            return {"x": np.full(2, int(i), np.int64), "index": int(i)}
        return indices >> g.stage("check", check, on_error="skip") >> g.batch("b", 8)
    ds = sft.GraphDataset(build_indexed, 40, threads=2, backend="host", even_shards="drop",
                          batch_size=8)
    ds.set_epoch(0)
    assert len(list(ds)) == 5
    it = iter(ds)
    steps = [next(it) for _ in range(5)]
    state = ds.state_dict()
    it.close()
    again = sft.GraphDataset(build_indexed, 40, threads=2, backend="host", even_shards="drop",
                             batch_size=8)
    again.load_state_dict(state)
    again.set_epoch(0)
    assert list(again) == [] and len(steps) == 5
    # With DataLoader workers each makes up its own share (the warning is the worker's).
    script = textwrap.dedent("""
        import torch.utils.data
        import splitflow.torch as sft
        from test_torch import build_skipping_3_and_4
        for rank in range(3):
            ds = sft.GraphDataset(build_skipping_3_and_4, 40, shuffle=True, seed=1, rank=rank,
                                  world_size=3, threads=2, backend="host", even_shards="pad")
            ds.set_epoch(5)
            got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                                   multiprocessing_context="fork"))
            print("rank", rank, len(got), flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.returncode == 0, p.stderr
    assert [line for line in p.stdout.splitlines() if line.startswith("rank")] == \
        ["rank 0 14", "rank 1 14", "rank 2 14"], p.stdout
    assert p.stderr.count("is repeated 1 time so that every rank") == 2, p.stderr
    # Every item skipped: nothing to repeat, said.
    def build_all_bad(g, indices):
        def bad(i):
            raise ValueError("bad")
        return indices >> g.stage("check", bad, on_error="skip")
    ds = sft.GraphDataset(build_all_bad, 6, rank=1, world_size=2, threads=2, backend="host",
                          even_shards="pad")
    with pytest.raises(sf.GraphError, match=re.escape(
            "GraphDataset(even_shards='pad'): rank 1 of 2 yielded none of its 3 samples: every "
            "item was skipped")):
        list(ds)


# persistent_workers keep the workers' copies: set_epoch cannot reach them, and they say so.
# (The warning is the worker process's: it reaches the terminal through the worker's stderr.)
def test_persistent_workers_warn_that_set_epoch_does_not_reach_them(capfd):
    ds = sft.GraphDataset(build_identity, 8, shuffle=True, threads=1, backend="host")
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                         persistent_workers=True, multiprocessing_context="spawn")
    first = [int(x) for x in loader]
    assert "set_epoch" not in capfd.readouterr().err
    ds.set_epoch(1)
    second = [int(x) for x in loader]
    assert "with persistent_workers=True, set_epoch() on the main process's dataset does not " \
           "reach the workers' copies" in capfd.readouterr().err
    assert first == second  # the workers' copies kept epoch 0


# "StageError.item is the dataset index" (with shuffle and with workers), the run's position
# kept as .position.
def test_stage_errors_name_the_dataset_index():
    for workers in (0, 2):
        ds = sft.GraphDataset(build_failing_at_10, N, shuffle=True, seed=4, threads=2,
                              backend="host")
        with pytest.raises(sf.StageError) as info:
            collect(ds, num_workers=workers)
        assert info.value.item == 10, (workers, str(info.value))
        assert "failed on item 10 (dataset index;" in str(info.value)


def test_a_graph_datasets_memory_budget_holds_its_output_queue():
    # GraphDataset(host_memory_budget=...) reaches its runtime, and the output queue (a pull
    # sink: its samples are outside the admission limit) is held by bytes: it starts with room
    # for 2 samples and is then sized to a quarter of the budget. A new user's trial found
    # arrays of 8 MiB into the default queue of 32 holding 265 MiB under a 64 MiB budget, and
    # GraphDataset had no way to set the budget.
    def dataset(budget):
        return sft.GraphDataset(lambda g, idx: idx >> g.stage("fill", sf.ops.fill([1 << 20], "uint8")),
                                60, threads=2, backend="host", to_torch=False,
                                host_memory_budget=budget)

    bounded, free = dataset(8 << 20), dataset(0)
    assert sum(1 for _ in bounded) == 60 and sum(1 for _ in free) == 60
    st = bounded.last_run.stats()
    sink = next(s for s in st["stages"] if s["name"] == "samples")
    assert sink["capacity"] <= 2, (sink, st["autotune"])
    assert st["max_in_flight"] <= 8, st["autotune"]
    unbounded = next(s for s in free.last_run.stats()["stages"] if s["name"] == "samples")
    assert unbounded["capacity"] == 32


# With DataLoader workers the run's stats stay in the workers (ds.last_run is the main
# process's, None): a sample skipped under on_error="skip" vanished without a word (a new
# user's trial: 240 of 243 samples, nothing said). The worker that skipped it warns at the end
# of its shard, naming the stage, the count and the first one's dataset index and message.
def test_samples_skipped_in_dataloader_workers_are_said():
    script = textwrap.dedent("""
        import torch.utils.data
        import splitflow as sf, splitflow.torch as sft
        def check(i):
            if int(i) in (7, 24):
                raise ValueError(f"bad sample {int(i)}")
            return i
        def build(g, indices):
            return indices >> g.stage("check", check, on_error="skip")
        ds = sft.GraphDataset(build, 40, threads=2, backend="host")
        got = sorted(int(x) for x in torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert got == [i for i in range(40) if i not in (7, 24)], got
        print("main got", len(got), flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "main got 38" in p.stdout
    said = [line for line in p.stderr.splitlines() if "GraphDataset: DataLoader worker" in line]
    assert len(said) == 2, p.stderr  # worker k takes positions p % 2 == k: one bad sample each
    for index in (7, 24):
        assert any(f"stage 'check' skipped 1 (the first recorded: dataset index {index}: " in line and
                   f"bad sample {index}" in line for line in said), p.stderr
