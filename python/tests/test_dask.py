"""Remote CPU stages on Dask distributed (issue 18, docs/scale-out.md): splitflow.dask.Remote runs
a graph segment on the workers of a LocalCluster (real scheduler and worker processes on
loopback) and streams the results into a local graph: every item once, in the local order,
deterministic from (seed, epoch, index); a worker killed mid-epoch loses and repeats nothing;
remote errors are named and skips counted; a lost scheduler fails the run within the timeout,
one restarted within it loses and repeats nothing;
splits in flight stay bounded under a slow consumer; ranks get disjoint shares; resume is exact.
Each test starts its own cluster and closes it."""
import contextlib
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import dask
import numpy as np
import pytest
import torch

import dask_fns as fns
import splitflow as sf
import splitflow.dask as sfd
import splitflow.torch as sft

distributed = pytest.importorskip("distributed")


@contextlib.contextmanager
def cluster(workers):
    with distributed.LocalCluster(n_workers=workers, processes=True, threads_per_worker=1,
                                  dashboard_address=None, host="127.0.0.1",
                                  silence_logs=50) as c, distributed.Client(c) as client:
        yield c, client


def run_local_graph(remote, name="local", capacity=32):
    """The remote segment as the source of a local graph; the items it yields."""
    g = sf.Graph(sf.Runtime(threads=2, backend="host"), name, capacity=capacity)
    src = remote.source(g)
    out = g.pull_sink("out")
    src >> out
    return list(g.iterate(out))


def same(got, expected):
    assert [int(s["index"]) for s in got] == [int(s["index"]) for s in expected]
    for a, b in zip(got, expected):
        assert np.asarray(a["x"]).tobytes() == b["x"].tobytes()


def order(n, seed=5):
    return np.random.default_rng(seed).permutation(n).tolist()


@pytest.mark.parametrize("workers", [1, 3])
def test_every_item_once_in_the_local_order(workers):
    items = order(150)
    with cluster(workers) as (_, client):
        r = sfd.remote(fns.build_samples, client, items=items, seed=3, epoch=2, split=7)
        got = run_local_graph(r)
        s = r.stats()
        # out of order: split by split as they complete, every item once
        r2 = sfd.remote(fns.build_samples, client, items=items, seed=3, epoch=2, split=7,
                        order="out_of_order")
        got2 = run_local_graph(r2)
        addresses = set(client.scheduler_info()["workers"])
    same(got, fns.local_samples(items, 3, 2))
    assert s["items_out"] == 150 and s["splits"] == 22 and s["skipped"] == 0
    assert sum(w["items"] for w in s["workers"].values()) == 150
    assert set(s["workers"]) <= addresses
    assert s["bytes"] == 150 * (64 + 8) and s["wait_s"] <= s["wall_s"]
    assert sorted(int(x["index"]) for x in got2) == sorted(items)
    by_index = {int(x["index"]): np.asarray(x["x"]).tobytes() for x in got2}
    assert by_index == {int(x["index"]): x["x"].tobytes() for x in fns.local_samples(items, 3, 2)}


def test_split_auto_sizes_splits_from_the_measured_cost():
    # 5 ms an item: after the probe splits, splits of about 0.1 s = 20 items.
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(120)), seed=1,
                       split="auto", probe=4, max_splits_in_flight=2)
        got = run_local_graph(r)
    assert [int(x["index"]) for x in got] == list(range(120))
    s = r.stats()
    # On a quiet machine about 20 items (12-30); on a loaded one an item takes longer and the
    # splits are smaller: what is checked is the size by the cost measured, whatever it was.
    per = s["item_s"]
    assert per and per >= 0.005, s
    assert 0.05 <= s["split_items"] * per <= 0.2, (s["split_items"], per)
    assert s["split_items"] > 4 or per > 0.025, (s["split_items"], per)  # past the probe's 4
    assert s["splits"] < 120 // 4, s["splits"]  # fewer than splits of the probe's size
    # split_items is the size the splits had (the median), split_items_next the next one's (it
    # said the next automatic size as the one used: a new user's trial)
    sizes = r.last_pass.split_sizes
    assert sum(sizes) == 120 and len(sizes) == s["splits"] and sizes[:2] == [4, 4], sizes
    assert s["split_items"] == np.median(sizes), (s["split_items"], sizes)
    assert s["split_items_next"] >= 1


def test_a_worker_killed_mid_epoch_loses_and_repeats_nothing():
    items = order(240, seed=9)
    with cluster(3) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, items=items, seed=4, epoch=1, split=6,
                       max_splits_in_flight=6)
        pids = client.run(os.getpid)
        got, killed = [], None
        for x in r.iterate(items):
            got.append(x)
            if killed is None and len(got) >= 30:
                processing = client.processing()
                addr, keys = max(processing.items(), key=lambda kv: len(kv[1]))
                keys = [k for k in keys if k.startswith(r.last_pass.key)]
                assert keys, processing  # the worker we kill holds splits of this pass
                os.kill(pids[addr], signal.SIGKILL)
                killed = (pids[addr], keys)
        log = {no: pid for no, _, pid in r.last_pass.split_log}
    same(got, fns.local_samples(items, 4, 1))  # identical bytes, none lost, none repeated
    pid, keys = killed
    for key in keys:  # each split the dead worker held was computed again elsewhere
        assert log[int(key.rsplit("-", 1)[1])] != pid


def test_a_remote_exception_names_the_stage_the_item_and_the_worker():
    with cluster(2) as (_, client):
        workers = set(client.scheduler_info()["workers"])
        r = sfd.remote(fns.build_failing, client, items=list(range(40)), split=8)
        with pytest.raises(sf.StageError) as info:
            run_local_graph(r, name="train")
        outer = info.value
        # the local run's error names its source; its cause is the remote stage's error
        assert (outer.graph, outer.stage) == ("train", "remote")
        e = outer.__cause__
        assert isinstance(e, sf.StageError)
        assert (e.graph, e.stage, e.item) == ("remote", "check", 13)
        assert e.worker in workers and e.worker in str(e) and "item 13" in str(e)
        # The local source's item is where the remote results stopped (the failed split's
        # first, 8); the remote error says the failed item's place in the pass as well as its
        # dataset index (a new user's trial read only 8 and 13 and could not relate them).
        assert outer.item == 8, str(outer)
        assert "dataset index, item 13 of the pass;" in str(e), str(e)
        assert isinstance(e.__cause__, ValueError) and "item 13 is corrupt" in str(e.__cause__)
        assert "_check" in "\n".join(e.__cause__.__notes__)  # the worker's traceback
        # a GraphDataset raises the remote error itself, naming the dataset index
        ds = sft.GraphDataset(lambda g, src: src, 40, shuffle=True, seed=2, threads=2,
                              backend="host", remote=sfd.remote(fns.build_failing, client, split=8))
        first_bad = next(i for i in ds.rank_indices() if i in fns.SKIP)
        with pytest.raises(sf.StageError) as info:
            list(ds)
        assert (info.value.stage, info.value.item) == ("check", first_bad)
        assert info.value.worker in workers


def test_a_remote_exception_that_cannot_be_rebuilt_is_a_remote_exception_cause():
    # Its class's __init__ takes other arguments: it came back as a splitflow.Error (the
    # library's own type) with its text; now a RemoteException with its type, as from a process
    # stage, and the worker's traceback.
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_failing_oddly, client, items=list(range(20)), split=8)
        with pytest.raises(sf.StageError) as info:
            run_local_graph(r)
        e = info.value.__cause__
        assert (e.stage, e.item) == ("check", 13)
        c = e.__cause__
        assert isinstance(c, sf.RemoteException) and not isinstance(c, sf.Error)
        assert c.remote_type == "TwoArgError" and str(c) == "TwoArgError: 1-2"
        assert "_two_arg_on_13" in "\n".join(c.__notes__)


# A new user's trial (2026-12-05): a remote build that batched gave GraphDataset batches it
# counted as samples (len() 50 for 13 batches, batch_size= refused as "the graph does not
# batch", 9 samples repeated on resume), and its batches ended at every split's edge. Batching
# is refused in a remote build, naming where to batch instead.
def test_a_remote_build_that_batches_is_refused_naming_where_to_batch():
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_batching, client, items=list(range(20)), split=8)
        with pytest.raises(sf.Error) as info:
            run_local_graph(r)
        text = str(info.value) + str(info.value.__cause__)
        assert "the remote build batches (g.batch('b', ...)): batch in the local graph" in text, text
        ds = sft.GraphDataset(lambda g, src: src, 20, threads=2, backend="host",
                              remote=sfd.remote(fns.build_batching, client, split=8))
        with pytest.raises(sf.Error) as info:
            list(ds)
        text = str(info.value) + str(info.value.__cause__)
        assert "or with g.batch at the end of the GraphDataset's own build" in text, text
        # Batching locally, as the error says: every sample once, in batches of 4 (5 of them).
        ds = sft.GraphDataset(lambda g, src: src >> g.batch("b", 4), 20, threads=2,
                              backend="host", batch_size=4,
                              remote=sfd.remote(fns.build_samples, client, split=8))
        got = list(ds)
        assert len(got) == len(ds) == 5
        assert sorted(int(i) for b in got for i in b["index"]) == list(range(20))


def test_skip_works_remotely_and_is_counted():
    items = order(60, seed=2)
    with cluster(2) as (_, client):
        r = sfd.remote(fns.build_skipping, client, items=items, split=9)
        got = run_local_graph(r)
        workers = set(client.scheduler_info()["workers"])
    kept = [i for i in items if i not in fns.SKIP]
    same(got, fns.local_samples(kept, 0, 0))
    s = r.stats()
    assert s["skipped"] == 2 and s["skipped_by_stage"] == {"check": 2}
    assert sorted(e["item"] for e in s["errors"]) == sorted(fns.SKIP)
    # errors[].position: the place in the pass's indices (it was the place in the split)
    assert all(items[e["position"]] == e["item"] for e in s["errors"]), s["errors"]
    assert all(e["worker"] in workers and "is corrupt" in e["message"] for e in s["errors"])
    assert sum(w["skipped"] for w in s["workers"].values()) == 2
    assert r.last_pass.yielded == kept


def test_the_yielded_indices_are_exact_past_64_skips_a_split_and_for_a_repeated_index():
    # The indices came from the run's error list, which keeps 64 a stage: a split of 1,000 with
    # 100 skips yielded None for all of its items (and GraphDataset's resume repeated samples),
    # and an index given twice and skipped twice did the same (a new user's trial). They come
    # from each result's place in its split now.
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_skip_tenth, client, items=list(range(2000)), split=1000)
        got = run_local_graph(r)
        assert got == [i for i in range(2000) if i % 10]
        assert r.last_pass.yielded == got
        assert r.stats()["skipped"] == 200
        r = sfd.remote(fns.build_skip_tenth, client, items=[0, 40, 1, 40, 2, 3], split=6)
        assert run_local_graph(r) == [1, 2, 3]
        assert r.last_pass.yielded == [1, 2, 3]


def test_a_process_stage_in_a_remote_build_is_refused_with_dask_advice():
    # A Dask worker (a nanny's daemonic process) may not start worker processes; the refusal
    # spoke of DataLoader workers and GraphDataset(num_workers=0) (a new user's trial).
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_with_processes, client, items=list(range(8)), split=8)
        with pytest.raises(sf.Error) as info:
            run_local_graph(r)
        text = str(info.value) + str(info.value.__cause__)
        assert "is a Dask worker" in text and "use a thread stage (processes=0)" in text, text
        assert "DataLoader" not in text, text


# A SystemExit (or KeyboardInterrupt) raised in a remote body under on_error="skip" left the
# Dask task as itself (the local run now raises it whatever the policy), and Dask closes a
# worker for that: the split went from worker to worker. It reaches the loop as itself, as a
# local stage's does, and the workers live on.
def test_an_interrupt_in_a_remote_body_reaches_the_loop_as_itself():
    with cluster(2) as (_, client):
        workers = set(client.scheduler_info()["workers"])
        r = sfd.remote(fns.build_exiting, client, items=list(range(40)), split=8)
        with pytest.raises(SystemExit) as info:
            run_local_graph(r)
        assert info.value.code == 7
        assert any("Dask worker" in n for n in getattr(info.value, "__notes__", [])), info.value
        assert set(client.scheduler_info()["workers"]) == workers, "a worker was closed"
        # The cluster goes on: a pass without the interrupt is whole.
        got = run_local_graph(sfd.remote(fns.build_skipping, client, items=list(range(20)), split=8))
        assert [int(s["index"]) for s in got] == [i for i in range(20) if i not in fns.SKIP]


def test_scheduler_unreachable_fails_within_the_timeout():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(sf.Error, match=f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}"):
        sfd.connect(f"tcp://127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - t < 2 + 2

    # the scheduler goes away mid-epoch: the run fails within timeout, saying so
    c = distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                 dashboard_address=None, host="127.0.0.1", silence_logs=50)
    client = distributed.Client(c)
    try:
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(200)), split=10,
                       timeout=3)
        it = r.iterate(list(range(200)))
        got = [next(it) for _ in range(5)]
        c.sync(c.scheduler.close)
        t = time.monotonic()
        with pytest.raises(sf.Error, match="lost the Dask scheduler") as info:
            for x in it:
                got.append(x)
        assert time.monotonic() - t < 3 + 1
        assert "items not computed" in str(info.value)
        assert [int(x["index"]) for x in got] == list(range(len(got)))
    finally:
        # With the scheduler gone the cluster would wait for it (connect timeout, 30 s). The
        # client's close, which Dask may not finish without a scheduler, is not what is tested.
        try:
            client.close(timeout=2)
        except TimeoutError:
            pass
        for w in list(c.workers.values()):
            c.sync(w.kill, timeout=1)
        with dask.config.set({"distributed.comm.timeouts.connect": "0.5s"}):
            c.close(timeout=5)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dask_cli(*args):
    """A `dask scheduler` or `dask worker` process (the CLI's modules), quiet; the workers
    import this test's functions by module path."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def test_a_scheduler_restarted_within_the_timeout_loses_and_repeats_nothing():
    """The scheduler is killed mid-epoch and started again at its address, with new workers
    (Dask's workers end with their scheduler; a Deployment or a supervisor restarts them): the
    client reconnects, the pass submits the splits it had not taken again, and the epoch ends
    with every item once, in order, with the bytes of a local run."""
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    scheduler = ["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
                 "--dashboard-address", ":0", "--no-show"]
    worker = ["distributed.cli.dask_worker", addr, "--nthreads", "1", "--nworkers", "2",
              "--no-dashboard"]
    procs = [_dask_cli(*scheduler), _dask_cli(*worker)]
    client = None
    try:
        client = distributed.Client(addr, timeout=60)
        client.wait_for_workers(2, timeout=60)
        items = order(180, seed=11)
        r = sfd.remote(fns.build_slow_samples, client, items=items, seed=6, epoch=3, split=6,
                       max_splits_in_flight=4, timeout=60)
        got = []
        for x in r.iterate(items):
            got.append(x)
            if len(got) == 30:  # splits are in flight: the scheduler goes, a new one comes
                procs[0].kill()
                procs[0].wait(timeout=30)
                procs[1].wait(timeout=60)  # the workers end with their scheduler
                procs += [_dask_cli(*scheduler), _dask_cli(*worker)]
        same(got, fns.local_samples(items, 6, 3))  # none lost, none repeated, same bytes
        s = r.stats()
        assert s["reconnections"] == 1
        assert 1 <= s["resubmitted_splits"] <= 4  # the splits in flight, not the ones taken
        assert s["items_out"] == 180
    finally:
        if client is not None:
            try:
                client.close(timeout=5)
            except Exception:
                pass
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_a_hung_scheduler_fails_the_run_within_the_timeout():
    """A scheduler that stops answering (SIGSTOP: hung, its connections open) fails the run
    `timeout` after the last progress, as docs/scale-out.md says; it failed after 1.5 x
    timeout (a new user's trial: 9 s with timeout=6), waiting for a reconnection after the
    timeout had passed, and said it waited "for the client to reconnect"."""
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    scheduler = _dask_cli("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                          str(port), "--dashboard-address", ":0", "--no-show")
    workers = _dask_cli("distributed.cli.dask_worker", addr, "--nthreads", "1", "--nworkers", "2",
                        "--no-dashboard")
    client = None
    try:
        client = distributed.Client(addr, timeout=60)
        client.wait_for_workers(2, timeout=60)
        items = list(range(400))
        timeout = 4
        r = sfd.remote(fns.build_slow_samples, client, items=items, split=6,
                       max_splits_in_flight=2, timeout=timeout)
        got = []
        last = None
        # (Its ping, or the fetch of a split it had said was done, whose direct fetch asks it
        # where the result is: which comes first depends on the machine's load; a loaded
        # ctest -j2 saw the fetch's.)
        with pytest.raises(sf.Error, match=r"lost the Dask scheduler at .*: (it did not answer "
                                           r"for 4 s|the fetch of finished split \d+ did not end "
                                           r"within timeout=4 s) \(.*\); \d+ splits in flight and "
                                           r"\d+ items not computed \(timeout=4 s without "
                                           r"progress or an answer\)") as info:
            for x in r.iterate(items):
                got.append(x)
                last = time.monotonic()
                if len(got) == 20:
                    os.kill(scheduler.pid, signal.SIGSTOP)
        waited = time.monotonic() - last
        assert waited <= timeout + 1.0, (waited, str(info.value))
        assert [int(x["index"]) for x in got] == list(range(len(got)))
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
        for p in (scheduler, workers):
            p.kill()
            p.wait(timeout=30)
        if client is not None:
            try:
                client.close(timeout=5)
            except Exception:
                pass


def test_a_cluster_left_without_workers_fails_within_the_timeout():
    """Every worker retired mid-epoch: the splits would wait in the scheduler for ever; the run
    fails after timeout without progress, naming the scheduler and what to do."""
    with cluster(1) as (c, client):
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(200)), split=10,
                       timeout=3)
        it = r.iterate(list(range(200)))
        got = [next(it)]
        # (Not client.retire_workers: Dask keeps a worker that holds a result it cannot move
        # elsewhere, "the worker will not be retired", and the pass then ended well: seen under
        # a loaded ctest -j2. The cluster scaled to none closes it whatever it holds.)
        c.scale(0)
        t = time.monotonic()
        with pytest.raises(sf.Error, match="has no workers and no split finished") as info:
            for x in it:
                got.append(x)
        assert time.monotonic() - t < 3 + 3
        assert "items not computed" in str(info.value) and "dask worker" in str(info.value)
        assert [int(x["index"]) for x in got] == list(range(len(got)))


def test_backpressure_bounds_the_splits_in_flight_with_a_slow_consumer():
    cap = 3
    with cluster(2) as (_, client):
        r = sfd.remote(fns.build_samples, client, items=list(range(160)), split=4,
                       max_splits_in_flight=cap)
        on_cluster = []

        def tasks_of_this_pass(dask_scheduler, prefix):
            return sum(1 for k in dask_scheduler.tasks if str(k).startswith(prefix))

        got = []
        for k, x in enumerate(r.iterate(list(range(160)))):
            got.append(int(x["index"]))
            time.sleep(0.002)  # the slow consumer
            if k % 8 == 0:
                on_cluster.append(client.run_on_scheduler(tasks_of_this_pass,
                                                          prefix=r.last_pass.key))
        s = r.stats()
    assert got == list(range(160))
    assert s["splits"] == 40 and s["max_splits_in_flight"] == cap
    assert s["splits_in_flight_max"] == cap  # reached, never passed
    assert max(on_cluster) <= cap and len(on_cluster) == 20
    assert s["local_bytes_max"] == 4 * (64 + 8)  # one split's results held locally


def _rank(rank, world, port, scheduler, q):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        with distributed.Client(scheduler, set_as_default=False) as client:
            ds = sft.GraphDataset(lambda g, src: src, 50, shuffle=True, seed=3, to_torch=False,
                                  remote=sfd.remote(fns.build_samples, client, seed=3, split=5))
            ds.set_epoch(1)
            got = [int(x["index"]) for x in ds]
            assert ds.shard() == (rank, world)
            shares = [None] * world
            dist.all_gather_object(shares, got)
        q.put((rank, got, ds.rank_indices(), shares))
    finally:
        dist.destroy_process_group()


def test_two_torch_distributed_ranks_share_one_cluster():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    with cluster(2) as (c, _):
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, c.scheduler_address, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        out = dict((r, (got, mine, shares)) for r, got, mine, shares in (q.get(timeout=60)
                                                                          for _ in procs))
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    (got0, mine0, shares0), (got1, mine1, _) = out[0], out[1]
    assert got0 == mine0 and got1 == mine1  # each rank its own share, in its order
    assert not set(got0) & set(got1) and sorted(got0 + got1) == list(range(50))
    assert shares0 == [got0, got1]


def test_resume_mid_epoch_is_exact():
    def make(client):
        return sft.GraphDataset(lambda g, src: src >> g.batch("batch", 8), 61, shuffle=True,
                                seed=6, threads=2, backend="host", batch_size=8,
                                remote=sfd.remote(fns.build_samples, client, seed=6, split=5))

    with cluster(2) as (_, client):
        full = make(client)
        full.set_epoch(3)
        expected = [i for b in full for i in b["index"].tolist()]
        ds = make(client)
        ds.set_epoch(3)
        first = []
        for k, b in enumerate(ds):
            first += b["index"].tolist()
            if k == 2:
                break
        state = ds.state_dict()
        again = make(client)
        again.load_state_dict(state)
        rest = [i for b in again for i in b["index"].tolist()]
        stats = again.last_run.stats()
        summary = json.loads(again.last_run.json())
        report = again.last_run.report()
    assert state["by_index"] and state["samples_seen"] == 24
    assert first + rest == expected and sorted(expected) == list(range(61))
    assert stats["remote"]["items_out"] == 61 - 24
    # The remote figures in the stats, the JSON summary and the report alike.
    assert summary["remote"]["items_out"] == 61 - 24
    assert summary["stages"] and summary["graph"] == stats["graph"]
    workers = summary["remote"]["workers"]
    assert sum(w["items"] for w in workers.values()) >= 61 - 24
    assert all(w["busy_s"] > 0 and w["bytes"] > 0 for w in workers.values() if w["items"])
    assert "remote 'remote': 37 items from" in report


def test_resume_after_a_remote_skip_repeats_nothing_without_an_index_field():
    # Samples counted, not named (index_field=None): the remote pass's yielded indices say which
    # positions the loop took. Counting the shard's positions instead took the skipped item 13
    # for a sample and left item 20 to come again after the resume (a new user's trial).
    def make(client):
        return sft.GraphDataset(lambda g, src: src, 40, threads=2, backend="host",
                                to_torch=False, index_field=None,
                                remote=sfd.remote(fns.build_skipping, client, split=3))

    with cluster(2) as (_, client):
        ds = make(client)
        first = []
        for s in ds:
            first.append(int(s["index"]))
            if len(first) == 20:
                break
        state = ds.state_dict()
        again = make(client)
        again.load_state_dict(state)
        rest = [int(s["index"]) for s in again]
    kept = [i for i in range(40) if i not in fns.SKIP]
    assert first == kept[:20]
    assert rest == kept[20:], "after the resume: " + str(rest)
    assert not state["by_index"] and state["samples_seen"] == 20


def test_a_remote_results_tensors_are_tensors_locally_as_in_a_local_run():
    # A new user's trial: a C++ op's output came back from the workers as a numpy array, so a
    # GraphDataset with remote= yielded numpy arrays where the same build run locally yielded
    # torch tensors.
    items = list(range(12))
    local_g = sf.Graph(sf.Runtime(threads=1, backend="host"), "local")
    out = local_g.pull_sink("out")
    fns.build_tensors(local_g, local_g.source("s", items), seed=0, epoch=0) >> out
    local = list(local_g.iterate(out))
    assert type(local[0]["x"]) is sf.Tensor
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_tensors, client, items=items, split=4)
        got = run_local_graph(r)
        assert [type(x["x"]) for x in got] == [type(x["x"]) for x in local]
        assert [np.asarray(x["x"]).tobytes() for x in got] == [np.asarray(x["x"]).tobytes() for x in local]
        local_ds = sft.GraphDataset(lambda g, src: fns.build_tensors(g, src, seed=0, epoch=0), 12,
                                    threads=1, backend="host")
        ds = sft.GraphDataset(lambda g, src: src, 12, threads=1, backend="host",
                              remote=sfd.remote(fns.build_tensors, client, split=4))
        want, have = list(local_ds), list(ds)
        assert type(want[0]["x"]) is torch.Tensor and [type(x["x"]) for x in have] == [torch.Tensor] * 12
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(want, have))


def test_tensors_travel_out_of_band_without_a_copy():
    # A split's result as Dask sends it: each array's memory is one of the frames (pickle
    # protocol 5 buffers or Dask's numpy serializer), not copied into a pickle.
    from distributed.protocol import serialize

    out = sfd.run_split(fns.build_samples, 0, [3, 1, 4], 7, 0, {
        "threads": 1, "backend": "host", "max_in_flight": 16, "name": "remote"})
    arrays = [x["x"] for x in out["results"]]
    big = [np.zeros((256, 256, 3), np.uint8)]  # and an image-sized one
    tensor = [np.ones((64, 64, 3), np.uint8)]  # a splitflow tensor's memory (sfd._WireTensor)
    _, frames = serialize({"results": [{"x": a} for a in arrays + big] +
                                      [{"x": sfd._WireTensor(t)} for t in tensor]},
                          serializers=("dask", "pickle"))
    addresses = {np.frombuffer(memoryview(f), np.uint8).ctypes.data for f in frames if len(f)}
    for a in arrays + big + tensor:
        assert a.ctypes.data in addresses
    same(out["results"], fns.local_samples([3, 1, 4], 7, 0))


# remote(threads=) is each worker's runtime threads: a second Remote asking for other threads
# gets a runtime of its own on the worker (a new user's trial: the first Remote's runtime, of 1
# thread, served a later threads=3 too, silently).
def test_a_remote_with_other_threads_gets_a_runtime_of_its_own():
    items = list(range(30))
    with cluster(1) as (_, client):
        for threads in (1, 3, 1):
            r = sfd.remote(fns.build_samples, client, items=items, split=10, threads=threads)
            same(run_local_graph(r), fns.local_samples(items, 0, 0))
        seen = client.run(fns.worker_runtime_threads)
    assert list(seen.values()) == [[1, 3]], seen


# An epoch of a GraphDataset left early (a break) closes its remote pass as the loop ends: the
# splits in flight are released (they were held until the next epoch, results kept on the
# workers) and its figures end with the run (its wall time went on growing while the local
# run's had stopped: a new user's trial, 0.15 s local against 2.15 s remote two seconds later).
def test_a_dataset_epoch_left_early_closes_its_remote_pass():
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, split=4, max_splits_in_flight=3)
        ds = sft.GraphDataset(lambda g, src: src, 200, threads=2, backend="host", remote=r)
        for k, _ in enumerate(ds):
            if k == 5:
                break
        p = r.last_pass
        assert p.done and not p.pending, "its splits in flight were released"
        assert p.t_end is not None, "its wall time ends with the run"
        walls = {ds.last_run.stats()["remote"]["wall_s"] for _ in range(3)}
        assert len(walls) == 1
        # The next epoch runs whole.
        assert sorted(int(s["index"]) for s in ds) == list(range(200))


# A plain local graph whose run ends early (a pull sink's loop left by a break): its remote pass
# is closed with the run, as GraphDataset's is (its splits released on the workers, its figures
# stopped); it was left open, ageing, until the next run (a new user's trial).
def test_a_plain_graphs_run_left_early_closes_its_remote_pass():
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(200)), split=4,
                       max_splits_in_flight=3)
        g = sf.Graph(sf.Runtime(threads=2, backend="host"), "local", capacity=4)
        out = g.pull_sink("out", capacity=2)
        r.source(g) >> out
        it = g.iterate(out)
        for k, s in enumerate(it):
            assert int(s["index"]) == k
            if k == 5:
                break
        it.close()  # cancels the run and waits for its end
        p = r.last_pass
        assert p.done and not p.pending, "its splits in flight were released"
        assert p.t_end is not None, "its wall time ends with the run"
        walls = {r.stats()["wall_s"] for _ in range(3)}
        assert len(walls) == 1
        # The next run runs whole.
        assert [int(s["index"]) for s in g.iterate(out)] == list(range(200))
        assert r.last_pass is not p and r.last_pass.done


# Items that are not dataset indices (paths, say) are refused when the Remote is made, naming
# the first and saying what to give instead (a new user's trial got int()'s "invalid literal").
def test_items_that_are_not_indices_are_refused_naming_the_first():
    for items, k, bad in ((["a.jpg", "b.jpg"], 0, "'a.jpg' (str)"), ([0, 1, 2.5], 2, "2.5 (float)"),
                          ([3, None], 1, "None (NoneType)")):
        with pytest.raises(sf.GraphError) as e:
            sfd.remote(fns.build_samples, None, items=items)
        text = str(e.value)
        assert f"items are dataset indices (ints), but item {k} is {bad}" in text, text
        assert "items=range(len(paths))" in text, text
    for ok in (range(5), np.arange(5), [np.int32(1), 2], torch.arange(3), []):
        # (taken: the next check is the client's)
        with pytest.raises(sf.GraphError, match="client must be a distributed.Client, not NoneType"):
            sfd.remote(fns.build_samples, None, items=ok)
    # Two dimensions were flattened ([[1, 2], [3, 4]]: four items), an unsigned index past
    # int64 wrapped to a negative one (a new user's trial).
    with pytest.raises(sf.GraphError, match=r"one dimension, not an array of shape \(2, 2\)"):
        sfd.remote(fns.build_samples, None, items=[[1, 2], [3, 4]])
    with pytest.raises(sf.GraphError, match=r"item 1 is 9223372036854775813, past the dataset "
                                            r"indices \(-2\*\*63 \.\. 2\*\*63 - 1\)"):
        sfd.remote(fns.build_samples, None, items=np.array([1, 2**63 + 5], dtype=np.uint64))
    # (Python ints past int64 make an object array: it named item 0, a valid one: a review.)
    for items, k in (([1, 2**64 + 1], 1), ([-1, 2**63], 1), ([0, 1, -2**63 - 1], 2)):
        with pytest.raises(sf.GraphError, match=rf"item {k} is {items[k]}, past the dataset"):
            sfd.remote(fns.build_samples, None, items=items)
    with pytest.raises(sf.GraphError, match=r"items are dataset indices, one dimension, not "
                                            r"\[\[1, 2\], \[3\]\]"):
        sfd.remote(fns.build_samples, None, items=[[1, 2], [3]])
    # (5 failed with "'int' object is not iterable", a 0-d array was one item: a trial.)
    for bad in (5, np.int64(5), np.array(5)):
        with pytest.raises(sf.GraphError, match=r"items are dataset indices, a sequence of ints "
                                                r"\(items=range\(n\)\), not"):
            sfd.remote(fns.build_samples, None, items=bad)


# Every argument is checked in the call that gives it, naming it: a timeout of 0 was taken and
# no split could ever finish (each wait a "reconnection", every split resubmitted), 2.7 items a
# split were 2, split_seconds=-1 made splits of one item, threads=-1 and backend="bogus" failed
# at the first pass on a worker naming splitflow.Runtime, "abc" got int()'s words, a client
# that is not one failed at the first item with "'NoneType' object has no attribute 'submit'"
# (a new user's trial).
def test_remote_arguments_are_checked_in_the_call_naming_each():
    bad = [(dict(timeout=0), "timeout must be a number of seconds > 0 and <= 1e+09 (or inf: never), not 0"),
           (dict(timeout=-1), "timeout must be a number of seconds > 0 and <= 1e+09 (or inf: never), not -1"),
           (dict(timeout="x"), "timeout must be a number of seconds > 0 and <= 1e+09 (or inf: never), not 'x'"),
           (dict(timeout=float("nan")), "timeout must be a number of seconds > 0 and <= 1e+09 (or inf: never), not nan"),
           # (past about 1e10 s asyncio's clock overflowed, said as a failure "on the cluster")
           (dict(timeout=1e10), "timeout must be a number of seconds > 0 and <= 1e+09 (or inf: never), not 10000000000.0"),
           (dict(split=2.7), "split must be an int, not 2.7"),
           (dict(split="abc"), "split must be 'auto' or a number of items >= 1, not 'abc'"),
           (dict(split=0), "split must be >= 1, not 0"),
           (dict(split_seconds=-1), "split_seconds must be a number of seconds > 0, not -1"),
           (dict(probe=-5), "probe must be >= 1, not -5"),
           (dict(seed=1.5), "seed must be an int, not 1.5"),
           (dict(seed=2**64), "seed must be <= 18446744073709551615, not 18446744073709551616"),
           (dict(epoch=2**64), "epoch must be <= 18446744073709551615, not 18446744073709551616"),
           (dict(epoch=-1), "epoch must be >= 0, not -1"),
           (dict(threads=-1), "threads must be >= 0, not -1"),
           (dict(max_in_flight=0), "max_in_flight must be >= 1, not 0"),
           (dict(max_splits_in_flight=True), "max_splits_in_flight must be an int (or None), not True"),
           (dict(stuck_after=0), "stuck_after must be a number of seconds > 0 and <= 1e+09 (or inf: never, or None), not 0"),
           (dict(backend="bogus"), "backend must be 'auto', 'host' or 'cuda' (each worker's runtime), not 'bogus'"),
           (dict(name=""), "name must be a non-empty str, not ''")]
    for kwargs, said in bad:
        with pytest.raises(sf.GraphError) as e:
            sfd.remote(fns.build_samples, None, items=range(4), **kwargs)
        assert str(e.value) == "splitflow.dask.remote: " + said, (kwargs, str(e.value))
    # Taken (the next check is the client's): never, for the timeout and the stuck warning (the
    # only way to turn it off); seeds and epochs as the ops take them (unsigned 64-bit).
    for ok in (dict(timeout=float("inf")), dict(stuck_after=float("inf")), dict(seed=2**64 - 1),
               dict(epoch=2**63), dict(split=np.int64(3)), dict(timeout=1)):
        with pytest.raises(sf.GraphError, match="client must be a distributed.Client"):
            sfd.remote(fns.build_samples, None, items=range(4), **ok)
    with pytest.raises(sf.GraphError) as e:
        sfd.remote(fns.build_samples, "tcp://127.0.0.1:8786", items=range(4))
    assert str(e.value) == ("splitflow.dask.remote: client must be a distributed.Client, not str "
                            "(an address: sf.dask.connect('tcp://127.0.0.1:8786') makes its "
                            "client)"), str(e.value)


# A remote build that returns what is not a node failed on the worker with Python's words
# ("unsupported operand type(s) for >>: 'int' and 'splitflow._core.Node'", "failed on the
# cluster"): said as GraphDataset says it (a new user's trial).
def test_a_remote_build_that_returns_no_node_is_said_so():
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_returning_5, client, items=list(range(4)))
        with pytest.raises(sf.StageError) as e:
            run_local_graph(r)
    cause = e.value.__cause__
    assert isinstance(cause, sf.GraphError), repr(cause)
    assert str(cause) == ("splitflow.dask.remote: build(g, indices, seed=, epoch=) returned int 5, "
                          "not a node of g; return the last node it added (its output is the "
                          "samples), or None for the indices themselves"), str(cause)


# Named-tuple samples travel as themselves (the wire rebuilt them with their class given one
# generator, which failed on the worker: a review).
def test_named_tuple_samples_come_back_as_their_class():
    with cluster(1) as (_, client):
        got = run_local_graph(sfd.remote(fns.build_pairs, client, items=list(range(12)), split=5))
    assert [type(x) for x in got] == [fns.Pair] * 12
    assert [x.index for x in got] == list(range(12))
    assert np.asarray(got[7].x).tobytes() == fns.sample(7, 0, 0)["x"].tobytes()


# A fetch that cannot end within the timeout, the scheduler answering, fails the pass the second
# time, saying to raise the timeout (a split computed again and fetched again for ever, nothing
# yielded: a verification trial's timeout=1e-4).
def test_a_fetch_that_never_ends_within_the_timeout_fails_the_pass_saying_so():
    result = {}

    def go(client):
        r = sfd.remote(fns.build_samples, client, items=list(range(10)), split=5, timeout=1e-4)
        try:
            run_local_graph(r)
        except sf.StageError as e:
            result["error"] = e
        result["stats"] = r.stats()

    with cluster(1) as (_, client):
        t = threading.Thread(target=go, args=(client,), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the pass went on for a minute"
    cause = result["error"].__cause__
    assert "the fetch of finished split 0 (items 0..4) did not end within timeout=0.0001 s, twice, " \
           "the scheduler answering" in str(cause), str(cause)
    assert "raise timeout" in str(cause), str(cause)
    assert result["stats"]["resubmitted_splits"] == 1, result["stats"]


# A scheduler that answers slowly on the connection the splits went through lost nothing: the
# splits in flight stay (a timeout shorter than a split's work made every wait a
# "reconnection" and resubmitted every split in flight, again and again: a new user's trial).
def test_a_slow_answer_on_the_same_connection_resubmits_nothing():
    with cluster(2) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(40)), split=5)
        p = r.iterate(list(range(40)))
        got = [int(next(p)["index"])]
        assert len(p.pending) >= 1
        futures = [s.future for s in p.pending]
        # What the scheduler check does when its ping times out with the connection up.
        assert p._lost("it did not answer for 0.01 s (TimeoutError)",
                       deadline=time.monotonic() + 5) is True
        assert [s.future for s in p.pending] == futures  # the same tasks, not new ones
        assert p.resubmitted == 0 and p.reconnections == 0
        # A split whose fetch did not end, the scheduler answering: that split alone is
        # submitted again (it was fetched again from where it hung, for ever: a review).
        first = p.pending.popleft()
        old = first.future
        assert p._lost("the fetch of finished split did not end", first,
                       deadline=time.monotonic()) is True
        assert p.pending[0] is first and first.future is not None and first.future is not old
        assert [s.future for s in list(p.pending)[1:]] == futures[1:]
        got += [int(x["index"]) for x in p]
        s = r.stats()
    assert got == list(range(40))  # every item once, in order
    assert s["reconnections"] == 0 and s["resubmitted_splits"] == 1, s


# A split on the cluster far longer than the others (a body that hangs): the pass warns, naming
# the split, its items and its worker, and the diagnosis says so while it lasts (a hung pass
# said nothing, and the local report saw "nothing stands out": a new user's trial).
def test_a_split_that_may_be_stuck_is_said_naming_its_items_and_worker():
    with cluster(1) as (_, client):
        workers = set(client.scheduler_info()["workers"])
        r = sfd.remote(fns.build_stuck, client, items=list(range(16)), split=4,
                       max_splits_in_flight=2, stuck_after=0.5)
        seen = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = []
            for x in r:
                got.append(int(x["index"]))
                if len(got) == 4:  # split 1 is on the cluster, its item 6 in its body (3 s)
                    deadline = time.monotonic() + 2.5
                    while time.monotonic() < deadline and not any(
                            d["split"] == 1 and d["on_cluster"] for d in r.stats()["stuck_splits"]):
                        time.sleep(0.05)  # its age passes stuck_after (0.5 s)
                    seen.append(r.stats()["diagnosis"])
        assert got == list(range(16))
        # (split 0 may be said too, on a loaded machine whose worker builds its graph slowly)
        said = [str(w.message) for w in caught
                if "may be stuck" in str(w.message) and "split 1 (" in str(w.message)]
        assert len(said) == 1, said  # once a split
        text = said[0]
        assert "split 1 (items 4..7 of the pass, dataset indices 4...)" in text, text
        assert any(f"on worker {w}" in text for w in workers), text
        assert "py-spy dump" in text and "stuck_after=0.5 s" in text, text
        assert seen[0].startswith("split 1 (items 4..7, dataset indices 4...) has been on the "
                                  "cluster for "), seen
        assert "a remote body may be stuck" in seen[0], seen
        (d,) = [d for d in r.stats()["stuck_splits"] if d["split"] == 1]
        assert (d["split"], d["items"], d["worker"] in workers, d["on_cluster"]) == (1, [4, 7], True, False)


# On two workers in order, the splits after a slow one finish while the pass waits for it: the
# figures count that wait (wait_behind_s) and name the slowest split, and the diagnosis says so
# (a trial's said "the results' transport (bytes_per_s) or the scheduler may be the limit").
def test_a_wait_behind_a_slow_split_is_measured_and_said():
    with cluster(2) as (_, client):
        r = sfd.remote(fns.build_stuck, client, items=list(range(24)), split=4,
                       max_splits_in_flight=4, stuck_after=60)
        assert [int(x["index"]) for x in r] == list(range(24))
        s = r.stats()
        held = s["waited_behind_split"]
        assert held["split"] == 1 and held["items"] == [4, 7], s
        assert held["busy_s"] >= fns.STUCK_S and 0 < held["wait_s"] <= s["wait_behind_s"], s
        assert s["wait_behind_s"] > 0.25 * s["wait_s"], s
        assert "for an earlier split while later ones were done: results come in order, and " \
               "split 1 (items 4..7, on tcp://" in s["diagnosis"], s["diagnosis"]
        # A local graph fed by it: its source says so (the diagnosis then points at the remote
        # pass: Diagnosis.ASlowSourceIsToldToMoveItsWorkNotToRaiseItsConcurrency).
        g = sf.Graph(sf.Runtime(threads=2, backend="host"), "fed")
        out = g.pull_sink("out")
        r.source(g) >> out
        run = g.run()
        assert len(list(out)) == 24 and run.wait(timeout=60) == "succeeded"
        st = next(x for x in run.stats()["stages"] if x["name"] == r.name)
        assert st["fed_by"].startswith(f"the remote pass '{r.name}' on Dask workers"), st
        # Out of order nothing waits behind it, and the slow split is named all the same.
        r2 = sfd.remote(fns.build_stuck, client, items=list(range(24)), split=4,
                        max_splits_in_flight=4, stuck_after=60, order="out_of_order")
        assert sorted(int(x["index"]) for x in r2) == list(range(24))
        s2 = r2.stats()
        assert s2["wait_behind_s"] == 0 and s2["slowest_split"]["items"] == [4, 7], s2
        assert "split 1 (items 4..7, on tcp://" in s2["diagnosis"] and \
               "a slow item in it" in s2["diagnosis"], s2["diagnosis"]


# The remote diagnosis, a function of the figures: workers idle while the local graph waits are
# not told to be more (a trial's workers were 44-62% busy when it said "about 3 workers would
# feed it"); it names the cause: too few splits in flight, or Dask's per-split cost.
def test_the_remote_diagnosis_tells_idle_workers_from_busy_ones():
    base = {"wall_s": 10.0, "wait_s": 5.0, "splits": 100, "items_out": 1000, "skipped": 0,
            "workers": {"a": {}, "b": {}}, "worker_threads": 2, "splits_in_flight_max": 4,
            "overhead_s_per_split": 0.001, "stuck_splits": []}
    d = sfd.RemotePass.diagnose
    assert d(dict(base, wait_s=0.5, worker_busy_s=10.0)).startswith("the remote workers keep up")
    busy = d(dict(base, worker_busy_s=18.0))  # 90% of 2 slots
    assert busy.startswith("remote workers are the bottleneck"), busy
    # a slot makes 1000 / 18 = 56 items/s busy; fed, the local graph takes 1000 / 5 = 200 items/s
    assert "the workers busy 90%" in busy and "about 4 workers would feed it (2 more" in busy, busy
    few = d(dict(base, worker_busy_s=9.0, splits_in_flight_max=1))  # 45%
    assert "task slots were busy only 45% of the pass: not their compute" in few, few
    assert "only 1 splits were in flight for 2 slots: raise max_splits_in_flight" in few, few
    assert "workers would feed it" not in few, few
    costly = d(dict(base, worker_busy_s=9.0, overhead_s_per_split=0.05))  # 50 ms of 90 ms
    assert "Dask's cost per split (50 ms: worker gap and fetch) is 56% of a split's 90 ms" in costly
    assert "larger splits" in costly, costly
    other = d(dict(base, worker_busy_s=9.0))
    assert "the results' transport (bytes_per_s) or the scheduler may be the limit" in other, other
    # Results in order behind one slow split: the wait for it while later ones were done (a
    # trial's body of 4 s on one worker, the other idle: this said "the results' transport").
    slow = {"split": 1, "items": [4, 7], "busy_s": 4.0, "worker": "tcp://w:1", "wait_s": 2.5}
    behind = d(dict(base, worker_busy_s=9.0, wait_behind_s=3.0, waited_behind_split=slow))
    assert behind == ("the local graph waited 50% of the run for remote results, 3.00 s of it for "
                      "an earlier split while later ones were done: results come in order, and "
                      "split 1 (items 4..7, on tcp://w:1) took 4.00 s of work against 90 ms a "
                      "split's median (2.50 s waited behind it); order='out_of_order' lets the "
                      "results past a slow split, and smaller splits (split=) shorten the wait "
                      "behind one"), behind
    # One split far slower than the others with nothing behind it (the pass's last, or out of
    # order): that split, not the transport (a review of the trial's fix).
    lone = d(dict(base, worker_busy_s=9.0, split_busy_s_median=0.05, slowest_split={
        "split": 5, "items": [40, 43], "busy_s": 4.0, "worker": "tcp://w:2"}))
    assert lone == ("the local graph waited 50% of the run for remote results, the workers' 2 task "
                    "slots busy 45%: split 5 (items 40..43, on tcp://w:2) took 4.00 s of work, 80 "
                    "times a split's median (50 ms), with little else left to run: a slow item in "
                    "it (its remote stages' figures name the stage) is the limit, not the "
                    "transport"), lone
    # (A wait behind under a quarter of the wait: the other causes.)
    assert "the results' transport" in d(dict(base, worker_busy_s=9.0, wait_behind_s=1.0,
                                               waited_behind_split=slow))
    # The fill (the first split's work and fetch before any result) is judged apart, and said.
    # The workers' busy time has the fill's work in it: their share is over the whole pass (over
    # the pass after the fill, 18 s of work on 2 slots in 7 s read "busy 129%"; a trial read 202%)
    after_fill = d(dict(base, worker_busy_s=18.0, wait_s=8.0, fill_s=3.0))
    assert "the workers busy 90%" in after_fill, after_fill
    filled = d(dict(base, worker_busy_s=9.0, fill_s=4.5))  # after it: 0.5 s of 5.5 s waited
    assert filled == ("the remote workers keep up: the local graph waited 9% of the run for remote "
                      "results after its first results (4.50 s before them: the first split's "
                      "work, round trip and fetch)"), filled
    # Splits done when the local graph asked: its waits were their fetches, and its own
    # bottleneck sets the pace (a trial's training loop was, and this said "larger splits").
    ahead = d(dict(base, worker_busy_s=9.0, wait_s=3.0, splits_done_when_asked=[90, 99],
                   fetch_s_per_split=0.04, wait_for_done_splits_s=2.5))
    assert ahead == ("the remote workers keep up: 90 of 99 splits were done when the local graph "
                     "asked for them; it waited 30% of the run for their fetches (40 ms a split "
                     "through Dask's client): the local graph's own bottleneck (its report) sets "
                     "the pace, and where its loop waits on this source, larger splits (split=) "
                     "make fewer fetches"), ahead
    # ... and where those waits are half the run or more, the fetches are the limit (a
    # verification trial's fast consumer waited 79% and was told its own pace set it)
    fetching = d(dict(base, worker_busy_s=9.0, wait_s=8.0, splits_done_when_asked=[90, 99],
                      fetch_s_per_split=0.04, wait_for_done_splits_s=7.0))
    assert fetching.endswith("waited 80% of the run for their fetches (40 ms a split through "
                             "Dask's client): those fetches are the limit; larger splits "
                             "(split=) make fewer of them"), fetching
    # Read during a pass waiting for one slow split still on the cluster (its work in no figure
    # yet: it said "not their compute but moving splits")
    waiting = d(dict(base, worker_busy_s=0.1, split_busy_s_median=0.05, waiting_for_split={
        "split": 1, "items": [4, 7], "on_cluster_s": 4.0}))
    assert waiting == ("the local graph is waiting for split 1 (items 4..7), on the cluster for "
                       "4.0 s against 50 ms a split's median: a slow item in it holds the results, "
                       "in order, behind it (its remote stages' figures name the stage once it is "
                       "done); order='out_of_order' lets the results past a slow split"), waiting
    assert d(dict(base, worker_busy_s=18.0, splits_done_when_asked=[10, 99],
                  fetch_s_per_split=0.04, wait_for_done_splits_s=0.5)).startswith(
        "remote workers are the bottleneck")
    # (most splits done when asked, but most of the wait for the others: not the fetches)
    assert "the results' transport" in d(dict(base, worker_busy_s=9.0, fetch_s_per_split=0.04,
                                               splits_done_when_asked=[90, 99],
                                               wait_for_done_splits_s=1.0))
    stuck = d(dict(base, worker_busy_s=9.0, stuck_splits=[
        {"split": 3, "items": [30, 39], "first_index": 7, "worker": "tcp://w:1", "limit_s": 10.0,
         "on_cluster": True, "age_s": 42.0}]))
    assert stuck == ("split 3 (items 30..39, dataset indices 7...) has been on the cluster for "
                     "42 s (on worker tcp://w:1; stuck_after 10.0 s): a remote body may be stuck")


def test_stats_read_during_a_pass_count_the_wait_in_progress():
    # A new user's trial read stats() once a second while the pass waited 8 s for a slow split:
    # every read said wait_s 0.04 ("the remote workers keep up"), the wait counted only once
    # it ended.
    items = list(range(12))
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_stuck, client, items=items, split=2, max_splits_in_flight=2,
                       stuck_after=60)
        p = r.iterate(items)
        got = [next(p) for _ in range(fns.STUCK_ON)]  # up to the slow item's split
        reads = []
        done = threading.Event()

        def reader():
            while not done.is_set():
                t = time.monotonic()
                st = r.stats()
                reads.append((t, st["wait_s"], st["diagnosis"]))
                done.wait(0.05)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for x in p:
                got.append(x)
                if int(x["index"]) == fns.STUCK_ON:
                    slow_came = time.monotonic()
        finally:
            done.set()
            t.join()
    assert [int(x["index"]) for x in got] == items
    # read while the pass still waited for the slow split (well before its result came)
    during = [(w, d) for t, w, d in reads if t < slow_came - 0.2]
    assert during and max(w for w, _ in during) >= 0.4 * fns.STUCK_S, (during[-5:], slow_came)
    # and the diagnosis then names the split it waits for
    assert any(d.startswith("the local graph is waiting for split ") for w, d in during
               if w >= 0.4 * fns.STUCK_S), during[-3:]
    during = [w for w, _ in during]
    assert r.stats()["wait_s"] >= max(during)


def test_a_dataloader_with_workers_over_a_remote_dataset_says_to_use_num_workers_0():
    # In a process that had run graphs, a forked DataLoader worker refused the fork first
    # (advising spawn, which then failed on pickling the Remote): a new user's trial.
    g = sf.Graph(sf.Runtime(threads=1, backend="host"), "warm")
    out = g.pull_sink("o")
    g.source("s", [1]) >> out
    assert list(g.iterate(out)) == [1]
    with cluster(1) as (_, client):
        ds = sft.GraphDataset(lambda g, src: src, 8, threads=1, backend="host",
                              remote=sfd.remote(fns.build_samples, client, split=4))
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                             multiprocessing_context="fork")
        with pytest.raises(Exception, match=r"the Dask workers are its processes; use "
                                            r"DataLoader\(num_workers=0\)"):
            list(loader)


def test_sf_dask_is_there_after_a_plain_import_without_importing_dask_before():
    # docs/api.md writes sf.dask.remote(...); after `import splitflow as sf` it was an
    # AttributeError (a new user's trial). In a fresh interpreter: this one imported it.
    script = ("import sys, splitflow as sf\n"
              "assert 'distributed' not in sys.modules and 'torch' not in sys.modules\n"
              "assert sf.dask.remote is sys.modules['splitflow.dask'].remote\n"
              "assert sf.torch.GraphDataset is sys.modules['splitflow.torch'].GraphDataset\n"
              "try:\n    sf.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "module 'splitflow' has no attribute 'no_such_name'"


# The client closed during a pass (its user's client.close()): the error says so, not that the
# run waited `timeout` for it to reconnect (it did not wait: a new user's trial).
def test_a_client_closed_during_a_pass_is_said_so():
    with cluster(1) as (_, client):
        r = sfd.remote(fns.build_slow_samples, client, items=list(range(400)), split=4, timeout=30)
        g = sf.Graph(sf.Runtime(threads=2, backend="host"), "local")
        out = g.pull_sink("out")
        r.source(g) >> out
        with pytest.raises(sf.Error) as e:
            for k, _ in enumerate(g.iterate(out)):
                if k == 3:
                    client.close()
        text = str(e.value) + " " + str(e.value.__cause__)
        assert "it was closed during the pass" in text, text
        assert "waited timeout=30 s" not in text, text
        # The scheduler's address, as the client had it (it said '?': a new user's trial).
        assert f"lost the Dask scheduler at {r.scheduler_address}:" in text, text
        assert r.scheduler_address.startswith("tcp://127.0.0.1:"), r.scheduler_address
        # A remote given the closed client is refused when it is made, saying what to give
        # (its first pass said "status 'closed', scheduler ?": a new user's trial).
        with pytest.raises(sf.GraphError, match=re.escape(
                "splitflow.dask.remote: the Dask client is closed (status 'closed'): give a "
                "connected one, sf.dask.connect(address)")):
            sfd.remote(fns.build_slow_samples, client, items=list(range(4)))


# Workers in the client's own process (LocalCluster(processes=False), one thread each): their
# runtimes stand beside the local graph's, whose source waits for their results; oneTBB gave a
# second runtime of one thread no thread then, and the pass hung (a new user's trial: 4 of 4).
# In a subprocess, so that a hang fails the test instead of holding the suite.
def test_in_process_workers_of_one_thread_do_not_hang():
    script = textwrap.dedent("""
        import distributed, splitflow as sf, splitflow.dask as sfd
        import dask_fns as fns
        with distributed.LocalCluster(n_workers=2, processes=False, threads_per_worker=1,
                                      dashboard_address=None) as c, distributed.Client(c) as client:
            for k in range(3):
                r = sfd.remote(fns.build_samples, client, items=list(range(300)), split=10)
                g = sf.Graph(sf.Runtime(threads=2, backend="host"), "local")
                out = g.pull_sink("out")
                r.source(g) >> out
                got = [int(s["index"]) for s in g.iterate(out)]
                assert got == list(range(300)), got[:10]
        print("passes ran", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                       env=env)
    assert p.returncode == 0 and "passes ran" in p.stdout, p.stdout + p.stderr
