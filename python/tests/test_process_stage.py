"""Python stages past the GIL (docs/python.md, "Process stages"): Graph.stage(fn,
processes=N) runs fn in N spawned worker processes with the thread stage's order, error and
skip semantics; arrays move through shared memory; a worker that dies fails or skips only the
item it held and is replaced; nothing is left behind (processes, /dev/shm files)."""
import glob
import io
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
from PIL import Image

import procs_fns as fns
import splitflow as sf


def shm_files():
    return glob.glob(f"/dev/shm/sf-{os.getpid()}-*")


def run_list(items, fn, processes=2, **kw):
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "procs")
    src = g.source("src", items)
    st = g.stage("py", fn, processes=processes, **kw)
    out = g.pull_sink("out")
    src >> st >> out
    got = list(g.iterate(out))
    return got, g, st


def test_results_come_back_in_order_from_two_workers():
    got, g, st = run_list(list(range(200)), fns.pid_and_value)
    assert [v for _, v in got] == list(range(200))
    pids = {p for p, _ in got}
    assert len(pids) == 2 and os.getpid() not in pids
    assert set(st.pool.pids) == pids
    assert st.pool.stats()["completed"] == 200


def test_arrays_travel_through_shared_memory_and_samples_keep_their_other_fields():
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (224, 224, 3), dtype=np.uint8) for _ in range(12)]
    samples = [{"image": im, "label": i % 3, "index": i} for i, im in enumerate(images)]
    got, _, _ = run_list(samples, fns.flip, field="image")
    assert [s["index"] for s in got] == list(range(12))
    for s, im in zip(got, images):
        assert s["label"] == s["index"] % 3
        np.testing.assert_array_equal(np.asarray(s["image"]), fns.flip(im))
    # tuples too, with an int field
    got, _, _ = run_list([(im, i) for i, im in enumerate(images[:4])], fns.flip, field=0)
    for (a, i), im in zip(got, images):
        np.testing.assert_array_equal(np.asarray(a), fns.flip(im))
    assert [i for _, i in got] == [0, 1, 2, 3]
    assert shm_files() == []


def test_a_c_plus_plus_tensor_goes_to_a_worker_and_back():
    # splitflow.Tensor (from a C++ op) in, numpy array out: the next C++ op takes it.
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "mixed")
    src = g.indices("i", list(range(6)))
    fill = g.stage("fill", sf.ops.fill([64, 64, 3], "uint8"))
    py = g.stage("flip", fns.flip, processes=2)
    norm = g.stage("norm", sf.ops.normalize([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], 1.0))
    out = g.pull_sink("out")
    src >> fill >> py >> norm >> out
    got = [np.asarray(t) for t in g.iterate(out)]
    assert len(got) == 6
    for i, t in enumerate(got):  # fill(i) is i everywhere; flip adds 1; normalize makes CHW
        assert t.shape == (3, 64, 64) and t.dtype == np.float32
        np.testing.assert_array_equal(t, np.full((3, 64, 64), i + 1, np.float32))


def test_an_exception_names_stage_and_item_and_keeps_the_workers_traceback():
    with pytest.raises(sf.StageError) as info:
        run_list(list(range(20)), fns.raise_on_five)
    e = info.value
    assert (e.graph, e.stage, e.item) == ("procs", "py", 5)
    assert isinstance(e.__cause__, ValueError)
    assert "five is not allowed" in str(e)
    notes = "\n".join(getattr(e.__cause__, "__notes__", []))
    assert "raise_on_five" in notes and "worker process" in notes


def test_an_exception_that_cannot_be_rebuilt_or_a_splitflow_error_of_the_function_is_still_the_cause():
    # A class whose __init__ takes other arguments than its args cannot be unpickled: it came
    # back as a splitflow.Error, which the stage took for the pool's own error, so __cause__ was
    # None and the worker's traceback was lost (a new user's trial); a splitflow.Error the
    # function raised itself, the same. A thread stage has both as __cause__.
    with pytest.raises(sf.StageError) as info:
        run_list(list(range(20)), fns.two_arg_error_on_five)
    e = info.value
    assert (e.graph, e.stage, e.item) == ("procs", "py", 5)
    assert isinstance(e.__cause__, sf.RemoteException) and not isinstance(e.__cause__, sf.Error)
    assert e.__cause__.remote_type == "TwoArgError" and str(e.__cause__) == "TwoArgError: 1-2"
    assert "failed on item 5" in str(e) and "TwoArgError: 1-2" in str(e)
    notes = "\n".join(getattr(e.__cause__, "__notes__", []))
    assert "two_arg_error_on_five" in notes and "worker process" in notes
    with pytest.raises(sf.StageError) as info:
        run_list(list(range(20)), fns.splitflow_error_on_five)
    e = info.value
    assert type(e.__cause__) is sf.Error and str(e.__cause__) == "the function's own splitflow.Error"
    assert "splitflow_error_on_five" in "\n".join(getattr(e.__cause__, "__notes__", []))
    # Skipping works on both as on any exception of the function.
    got, g, st = run_list(list(range(8)), fns.two_arg_error_on_five, on_error="skip")
    assert got == [x for x in range(8) if x != 5]


def _jpeg(h, w, v):
    """A flat h x w JPEG of value v, as the bytes a request carries."""
    b = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), v, np.uint8)).save(b, "JPEG", quality=100)
    return np.frombuffer(b.getvalue(), np.uint8)


def _decoded_sum(request):
    """What PIL decodes of a request's JPEG, summed (decode_jpeg gives the same pixels)."""
    return float(np.asarray(Image.open(io.BytesIO(request.tobytes()))).sum())


def _decoding_service(model, max_batch, processes, **model_options):
    """A service: a dynamic batch of JPEG requests, decoded (bad ones skipped), `model` on the
    batch (a thread or a process stage), unbatched. Returns the service and its run."""
    g = sf.Graph(sf.Runtime(threads=2), "svc")
    svc = g.service("req")
    svc.source >> g.dynamic_batch("b", max_batch=max_batch, max_delay=30.0) \
        >> g.stage("dec", sf.ops.decode_jpeg(), on_error="skip") \
        >> g.stage("m", model, processes=processes, **model_options) \
        >> g.unbatch("u", max_batch) >> svc.sink
    return svc, g.run()


@pytest.mark.parametrize("processes", [0, 1])
def test_a_dynamic_batchs_requests_of_other_shapes_or_failed_before_leave_the_others_answered(processes):
    # A new user's trial: one request of another shape failed every request of its batch ("item
    # 3 of the batch is f32[3, 3] host, the first is f32[2, 2]; a batch needs one shape"), and a
    # request that a C++ op failed before (a bad JPEG under skip) failed its batch-mates as
    # None. The function now gets one batch per shape, without the failed requests.
    svc, run = _decoding_service(fns.batch_shape_and_sums, 5, processes, on_error="skip")
    requests = [_jpeg(8, 8, 10), np.frombuffer(b"not a jpeg", np.uint8), _jpeg(16, 8, 20),
                _jpeg(8, 8, 30), _jpeg(16, 8, 40)]
    futures = [svc.submit(r) for r in requests]
    # (its error as Batch::fail gives it: the unbatch that took it out named, docs/api.md)
    with pytest.raises(sf.StageError, match=r"stage 'u' failed on item 1: .*decode_jpeg: not a readable JPEG"):
        futures[1].result(timeout=60)
    got = [futures[i].result(timeout=60) for i in (0, 2, 3, 4)]
    svc.close()
    assert run.wait() == "succeeded"
    assert [shape for shape, _ in got] == [(2, 8, 8, 3), (2, 16, 8, 3), (2, 8, 8, 3), (2, 16, 8, 3)]
    assert [total for _, total in got] == [_decoded_sum(requests[i]) for i in (0, 2, 3, 4)]
    st = svc.stats()
    assert st["answered"] == 4 and st["failed"] == 1


@pytest.mark.parametrize("processes", [0, 1])
def test_a_groups_failure_fails_its_requests_and_a_batch_failed_before_reaches_no_function(processes):
    # A review: the call on one group (an odd shape, which the model refuses) failed the whole
    # batch, and in a process stage a batch whose requests had all failed before went to a
    # worker as nothing and failed as "0 results for a batch of 2 requests".
    svc, run = _decoding_service(fns.refuse_16_rows, 3, processes)
    requests = (_jpeg(8, 8, 10), _jpeg(16, 8, 20), _jpeg(8, 8, 30))
    futures = [svc.submit(r) for r in requests]
    want = [_decoded_sum(requests[i]) for i in (0, 2)]
    assert [futures[i].result(timeout=60) for i in (0, 2)] == want
    with pytest.raises(sf.StageError, match=r"no 16-row images here \(a batch of \(1, 16, 8, 3\)\)") as info:
        futures[1].result(timeout=60)
    assert isinstance(info.value.__cause__, ValueError)
    # a batch whose every request failed before: each its own error, the run goes on
    bad = [svc.submit(np.frombuffer(b"not a jpeg %d" % i, np.uint8)) for i in range(3)]
    for f in bad:
        with pytest.raises(sf.StageError, match=r"decode_jpeg: not a readable JPEG"):
            f.result(timeout=60)
    svc.close()
    assert run.wait() == "succeeded"
    st = svc.stats()
    assert st["failed"] == 4 and st["answered"] == 2


def test_a_process_stage_in_a_service_answers_each_request_of_a_dynamic_batch():
    # Between a dynamic batch and its unbatch, a process stage gets the requests collated and
    # returns one result per request, as a thread stage does; it returned a plain array, which
    # failed the run at the unbatch ("expected a dynamic batch") with every request (a trial).
    rt = sf.Runtime(threads=2)
    for processes in (0, 2):
        g = sf.Graph(rt, "svc")
        svc = g.service("req")
        svc.source >> g.dynamic_batch("b", max_batch=4, max_delay=0.002) \
            >> g.stage("m", fns.times_ten, processes=processes) >> g.unbatch("u", 4) >> svc.sink
        run = g.run()
        futures = [svc.submit(i) for i in range(40)]
        assert [int(f.result(timeout=60)) for f in futures] == [10 * i for i in range(40)]
        svc.close()
        assert run.wait() == "succeeded"
        assert svc.stats()["answered"] == 40
    # Results that cannot be split per request (a set: no indexing) fail the batch's requests
    # with the TypeError as the cause, as in a thread stage (the cause was None, and the text
    # the parent's reader-thread stack: a review).
    for processes in (0, 1):
        g = sf.Graph(rt, "svc")
        svc = g.service("req")
        svc.source >> g.dynamic_batch("b", max_batch=2, max_delay=30.0) \
            >> g.stage("m", fns.a_set_of_results, processes=processes, on_error="skip") \
            >> g.unbatch("u", 2) >> svc.sink
        run = g.run()
        futures = [svc.submit(i) for i in range(2)]
        for f in futures:
            with pytest.raises(sf.StageError, match="stage 'm' failed") as info:
                f.result(timeout=60)
            assert isinstance(info.value.__cause__, TypeError), (processes, repr(info.value.__cause__))
            assert "_procs.py" not in str(info.value)
        svc.close()
        assert run.wait() == "succeeded"


def test_an_item_that_cannot_be_pickled_fails_with_its_cause_and_frees_its_pool_at_once():
    # The error's cause held the traceback of the frame that made it, and that frame the pool's
    # state: the pool and its workers lived on after the graph went, until the cyclic GC ran;
    # and the StageError's __cause__ was None (a new user's trial). Without the GC, the pool's
    # state goes with the graph.
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        rt = sf.Runtime(threads=2)
        g = sf.Graph(rt, "procs")
        out = g.pull_sink("out")
        st = g.stage("py", fns.square, processes=1)
        g.source("src", [1, threading.Lock(), 3]) >> st >> out
        with pytest.raises(sf.StageError, match="the item cannot be sent to a worker process") as info:
            list(g.iterate(out))
        assert isinstance(info.value.__cause__, TypeError) and "pickle" in str(info.value.__cause__)
        state = weakref.ref(st.pool._s)
        del info, st, out, g
        assert state() is None
    finally:
        gc.enable()


def test_skip_and_a_substitute_together_are_refused():
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "procs")
    with pytest.raises(sf.GraphError, match=r"on_error='skip' drops a failed item, substitute= "
                                            r"replaces it: give one of them"):
        g.stage("py", fns.square, on_error="skip", substitute=-1)


# An explicit on_error="fail" beside substitute= was taken and the substitute won, silently (a
# new user's trial); "substitute" (C++'s OnError::substitute) is taken with substitute= only.
def test_fail_and_a_substitute_together_are_refused_and_substitute_is_the_policys_name():
    g = sf.Graph(sf.Runtime(threads=2), "policies")
    with pytest.raises(sf.GraphError) as e:
        g.stage("py", fns.square, on_error="fail", substitute=-1)
    assert str(e.value) == ("splitflow.Graph.stage('py'): on_error='fail' fails the run on a "
                            "failed item, substitute= replaces it: give one of them"), str(e.value)
    with pytest.raises(sf.GraphError) as e:
        g.stage("py", fns.square, on_error="substitute")
    assert str(e.value) == ("splitflow.Graph.stage('py'): on_error='substitute' replaces a failed "
                            "item with substitute=, which is not given"), str(e.value)
    with pytest.raises(sf.GraphError, match=r"on_error must be 'fail', 'skip' or 'substitute', not 3"):
        g.stage("py", fns.square, on_error=3)
    with pytest.raises(sf.GraphError) as e:  # (it named no stage, nor 'substitute': a review)
        g.stage("py", fns.square, on_error="bogus", substitute=-1)
    assert str(e.value) == ("splitflow.Graph.stage('py'): on_error must be 'fail', 'skip' or "
                            "'substitute', not 'bogus'"), str(e.value)
    for kw in (dict(on_error="substitute", substitute=-1), dict(substitute=-1)):
        got, _, _ = run_list(list(range(8)), fns.raise_on_five, **kw)
        assert got == [x if x != 5 else -1 for x in range(8)], (kw, got)


def test_skip_drops_only_the_failing_item():
    got, g, st = run_list(list(range(20)), fns.raise_on_five, on_error="skip")
    assert got == [x for x in range(20) if x != 5]


def test_substitute_with_field_replaces_that_field_and_keeps_the_others():
    # As in a thread stage (test_samples.py): the sample's other fields go on.
    samples = [{"x": i, "label": i % 3} for i in range(10)]
    got, g, st = run_list(samples, fns.raise_on_five, field="x", substitute=-1)
    assert got == [{"x": (-1 if i == 5 else i), "label": i % 3} for i in range(10)]
    got, g, st = run_list([(i, -i) for i in range(8)], fns.raise_on_five, field=0, substitute=0)
    assert got == [((0 if i == 5 else i), -i) for i in range(8)]
    assert st.pool.stats()["failed"] == 1
    # A worker that dies on the item: the same (the case process stages exist for).
    items = [{"x": i, "label": i % 3} for i in range(10)]
    got, _, _ = run_list(items, fns.die_on_seven, field="x", substitute=-1)
    assert got == [{"x": (-1 if i == 7 else i), "label": i % 3} for i in range(10)]
    # Without field=, the whole item.
    got, _, _ = run_list(list(range(8)), fns.raise_on_five, substitute=-1)
    assert got == [(-1 if i == 5 else i) for i in range(8)]


# A SystemExit (or KeyboardInterrupt) raised by a worker's body stops the run and reaches the
# loop as itself, as in a thread stage, whatever the stage's on_error: it was a StageError with
# no cause under fail, and skipped as one bad item under skip.
@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_system_exit_in_a_workers_body_stops_the_run_as_itself(on_error):
    with pytest.raises(SystemExit) as info:
        # (under fail, without the bad 3: its error would end the run first)
        items = list(range(20)) if on_error == "skip" else list(range(4, 20))
        run_list(items, fns.skip_three_exit_on_six, on_error=on_error)
    assert info.value.code == 4
    # One whose class cannot be rebuilt from its pickle: still a stop (the builtin it derives
    # from), not an item's error that skip would drop.
    with pytest.raises(KeyboardInterrupt, match="1/2"):
        run_list(list(range(20)), fns.odd_stop_on_six, on_error=on_error)


@pytest.mark.parametrize("fn,how", [(fns.die_on_seven, "SIGSEGV"), (fns.exit_on_seven, "exit code 3")])
def test_a_worker_that_dies_fails_only_its_item_and_is_replaced(fn, how):
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "deaths")
    src = g.source("src", list(range(40)))
    st = g.stage("py", fn, processes=2, on_error="skip")
    out = g.pull_sink("out")
    src >> st >> out
    run = g.run()
    got = list(out)
    run.wait()
    assert got == [x for x in range(40) if x != 7]
    stats = run.stats()
    py = next(s for s in stats["stages"] if s["name"] == "py")
    assert py["skipped"] == 1
    [err] = py["errors"]
    assert err["item"] == 7
    assert how in err["message"] and "died" in err["message"] and "replaces it" in err["message"]
    assert st.pool.stats()["restarts"] == 1
    assert len(st.pool.pids) == 2
    # and under on_error="fail" the run fails naming the signal
    g2 = sf.Graph(rt, "deaths2")
    s2 = g2.source("src", list(range(40)))
    p2 = g2.stage("py", fn, processes=2)
    o2 = g2.pull_sink("out")
    s2 >> p2 >> o2
    with pytest.raises(sf.StageError, match=how) as info:
        list(g2.iterate(o2))
    assert info.value.item == 7


def test_a_lambda_or_a_cpp_op_is_refused_when_the_stage_is_built():
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "refused")
    with pytest.raises(sf.GraphError, match="module level"):
        g.stage("py", lambda x: x, processes=2)
    with pytest.raises(sf.GraphError, match="runs without the GIL already"):
        g.stage("op", sf.ops.fill([2], "uint8"), processes=2)
    with pytest.raises(sf.GraphError, match="is negative"):
        g.stage("py", fns.square, processes=-1)


def test_nothing_is_left_behind_after_the_graph_goes():
    got, g, st = run_list(list(range(50)), fns.square)
    assert got == [x * x for x in range(50)]
    pids = st.pool.pids
    st.pool.close()
    del st, g
    import gc
    gc.collect()
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)
    assert shm_files() == []
    assert multiprocessing.active_children() == []


# A second Ctrl-C while the pool closes (at exit: its finalizer waiting for the workers to
# stop) skipped the rest of the close: the arenas' files stayed in /dev/shm for good (a new
# user's trial, 4 of 4 double Ctrl-Cs at start-up). The interrupt still comes through; the
# workers are killed, the files removed and the items answered first.
@pytest.mark.parametrize("where", ["the wait for the workers", "the cleanup after it"])
def test_an_interrupt_while_the_pool_closes_leaves_no_worker_or_file_behind(where, monkeypatch):
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(8)]
    got, g, st = run_list(images, fns.flip)
    assert len(got) == 8
    state = st.pool._s
    pids = st.pool.pids
    # A worker unlinks its arenas' files once it has opened them: one still starting has not.
    # Such a file, as the pool names them:
    unopened = f"/dev/shm/{state.prefix}w0-g1-arena-in"
    with open(unopened, "wb") as f:
        f.truncate(1 << 20)
    assert shm_files() == [unopened]
    calls = []

    def at_call(n, fn):  # the second Ctrl-C lands in its n-th call
        def interrupted(*args, **kwargs):
            calls.append(args)
            if len(calls) == n:
                raise KeyboardInterrupt
            return fn(*args, **kwargs)
        return interrupted

    if where == "the wait for the workers":
        p = state.slots[0].process
        p.join = at_call(1, p.join)
    else:  # in the second slot's, after the first slot's process was closed: run again
        import splitflow._procs as procs
        monkeypatch.setattr(procs._Slot, "close_arenas", at_call(2, procs._Slot.close_arenas))
    with pytest.raises(KeyboardInterrupt):
        st.pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shm_files() == []
    assert multiprocessing.active_children() == []
    assert state.closed_event.is_set()


def test_ctrl_c_reaches_the_main_thread_while_a_worker_runs_a_slow_body():
    rt = sf.Runtime(threads=2)
    g = sf.Graph(rt, "interrupt")
    src = g.source("src", list(range(4)))
    st = g.stage("slow", fns.sleepy, processes=2)
    out = g.pull_sink("out")
    src >> st >> out
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in g.iterate(out):
            pass
    waited = time.monotonic() - t0
    assert waited < 10, f"KeyboardInterrupt took {waited:.1f} s (the body sleeps 30 s)"
    st.pool.close()


# A script read from stdin (python3 - < script.py): spawn runs the main module again in each
# worker from its path, '<stdin>', which is no file, so every worker died as it started, and
# the run said "worker process ... died with exit code 1 while it started" (a new user's
# trial). Refused when the stage is made, saying why and what to do; and a function defined in
# `python3 -c`'s __main__ as before.
def test_a_script_read_from_stdin_is_told_to_run_from_its_file():
    import subprocess
    import sys

    script = (
        "import splitflow as sf, procs_fns as fns\n"
        "g = sf.Graph(sf.Runtime(threads=2), 'stdin')\n"
        "try:\n"
        "    g.stage('square', fns.square, processes=2)\n"
        "except sf.GraphError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    print('made')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-"], input=script, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "refused: splitflow.Graph.stage('square', processes=2): the main module was read from "
        "<stdin> (python3 - < script.py), and worker processes, which run it again from its file "
        "as multiprocessing's spawn does, cannot; run the script from its file"), r.stdout
    inline = ("import splitflow as sf\n"
              "def twice(x):\n"
              "    return 2 * x\n"
              "g = sf.Graph(sf.Runtime(threads=2), 'inline')\n"
              "try:\n"
              "    g.stage('twice', twice, processes=2)\n"
              "except sf.GraphError as e:\n"
              "    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", inline], env=env, capture_output=True, text=True,
                       timeout=60)
    assert "is defined in an interactive session's __main__" in r.stdout, r.stdout + r.stderr


# A new user's trial (2026-12-05): a GraphDataset builds its graph anew for each epoch, so its
# processes=N stages started N new workers (an interpreter and the function's imports each)
# every epoch. Under the dataset's pool scope the next epoch's stage of the same function takes
# the last epoch's workers; a different function gets its own; the scope's close() stops them.
# A run left early while a worker is busy with a body that hangs: the next run of the same
# workers must not wait behind it (a new user's trial: the epoch after a break waited for a
# body of an hour, for ever). A worker still busy with a withdrawn item after 2 s is replaced.
# In a subprocess, so that a hang fails the test instead of holding the suite.
def test_a_run_after_one_left_early_does_not_wait_for_a_hung_worker():
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, time, splitflow as sf, procs_fns as fns
        items = [(i, i == 3) for i in range(10)]    # item 3's body hangs for an hour
        g = sf.Graph(sf.Runtime(threads=2), "hung")
        st = g.stage("body", fns.hang_on_true_with_pid, processes=2)
        out = g.pull_sink("out")
        g.source("src", items) >> st >> out
        it = g.iterate(out)
        assert next(it)[0] == 0
        it.close()                                   # the run is left early; item 3 in a body
        pids = st.pool.pids
        items[:] = [(i, False) for i in range(10)]   # the next run has no slow item
        t = time.monotonic()
        got = list(g.iterate(out))
        took = time.monotonic() - t
        assert [v for v, _ in got] == list(range(10)), got
        # No item went to the hung worker, to wait there for its replacement and be sent again
        # (a new user's trial: before the reader's next look at the workers, up to 0.5 s on,
        # the hung one took items in turn, which waited 2 s for its replacement while the
        # other worker was idle).
        assert st.pool.stats()["resent"] == 0, st.pool.stats()
        # The hung one is replaced 2 s after its item was withdrawn all the same.
        deadline = time.monotonic() + 30
        while st.pool.stats()["replaced_stale"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = st.pool.stats()
        assert s["replaced_stale"] == 1 and s["resent"] == 0, s
        while len([p for p in pids if p not in st.pool.pids]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = [p for p in pids if p not in st.pool.pids]
        assert len(gone) == 1, (pids, st.pool.pids)
        while time.monotonic() < deadline:  # killed: gone once its parent reaped it
            try:
                os.kill(gone[0], 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the hung worker still runs")
        assert [v for v, _ in g.iterate(out)] == list(range(10))  # and the next run goes on as well
        print("ok", round(took, 1))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_a_graph_datasets_process_stage_keeps_its_workers_from_epoch_to_epoch():
    import splitflow.torch as sft

    def build(g, src):
        return src >> g.stage("tag", fns.pid_and_value, processes=2)

    ds = sft.GraphDataset(build, 12, shuffle=True, seed=1, threads=2, backend="host",
                          to_torch=False)
    pids = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = list(ds)
        assert sorted(v for _, v in got) == list(range(12))
        pids.append({p for p, _ in got})
    assert pids[0] and pids[1] == pids[0] and pids[2] == pids[0], pids
    kept = ds._pools().pools()
    assert len(kept) == 0 or all(not s.closed for s in kept)
    # Breaking out of an epoch: the next still gets every item, from the same workers.
    for _ in ds:
        break
    got = list(ds)
    assert sorted(v for _, v in got) == list(range(12)) and {p for p, _ in got} == pids[0]
    # Another function: other workers.
    other = sft.GraphDataset(lambda g, src: src >> g.stage("tag", fns.pid_and_value, processes=1),
                             4, threads=2, backend="host", to_torch=False)
    assert {p for p, _ in other} & pids[0] == set()
    ds.last_run = None
    import gc
    gc.collect()
    kept = ds._pools().pools()
    assert len(kept) == 1, kept
    ds._pools().close()
    assert kept[0].closed
    for pid in pids[0]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# A stage whose function changes each epoch (a functools.partial of the epoch, the usual way
# to write per-epoch augmentation) got a pool of its own each epoch, and the dataset kept them
# all until it went (a new user's trial: 23 workers and 183 descriptors after 11 epochs). A
# pool the next epoch's build did not take is closed.
def test_a_datasets_stage_whose_function_changes_each_epoch_keeps_one_pool():
    import functools
    import gc

    import splitflow.torch as sft

    ds = None

    def build(g, src):
        return src >> g.stage("add", functools.partial(fns.add, k=ds.epoch), processes=2)

    ds = sft.GraphDataset(build, 8, threads=2, backend="host", to_torch=False)
    for epoch in range(5):
        ds.set_epoch(epoch)
        assert sorted(ds) == [i + epoch for i in range(8)]
        gc.collect()
        workers = [p for p in multiprocessing.active_children() if "resource_tracker" not in p.name]
        assert len(workers) <= 4, f"epoch {epoch}: {len(workers)} workers alive"
    del ds, build
    gc.collect()
    assert [p for p in multiprocessing.active_children() if "resource_tracker" not in p.name] == []


# Workers that die as they start (a module they cannot import) fail every item; under skip
# the run "succeeded" with no item, and a GraphDataset's epoch with no sample (a new user's
# trial). A pool that cannot start ends the run whatever the policy.
@pytest.mark.parametrize("policy", [{"on_error": "skip"}, {"substitute": -1}])
def test_a_pool_whose_workers_cannot_start_fails_the_run_whatever_the_policy(policy, monkeypatch):
    monkeypatch.setenv("SF_TEST_WORKERS_CANNOT_IMPORT", "1")
    # (Under pytest the workers start, then cannot load the function; a script's workers,
    # which import its main module as they start, die before they are ready: both.)
    with pytest.raises(sf.StageError, match=r"stage 'py' failed on item \d+: .*worker process "
                                             r"\d+ cannot load the function square \(ImportError: "
                                             r"procs_fns: cannot be imported in this worker"):
        run_list(list(range(20)), fns.square, **policy)
    script = ("import os, procs_fns as fns, splitflow as sf\n"
              "os.environ['SF_TEST_WORKERS_CANNOT_IMPORT'] = '1'\n"
              "g = sf.Graph(sf.Runtime(threads=2), 'procs')\n"
              "out = g.pull_sink('out')\n"
              f"g.source('src', range(20)) >> g.stage('py', fns.square, processes=2, **{policy!r}) >> out\n"
              "try:\n"
              "    print('got', list(g.iterate(out)))\n"
              "except sf.StageError as e:\n"
              "    print('raised', e)\n")
    monkeypatch.delenv("SF_TEST_WORKERS_CANNOT_IMPORT")
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sf_cannot_start_{os.getpid()}.py"), "w") as f:
        f.write(script)
    try:
        r = subprocess.run([sys.executable, f.name], env=env, capture_output=True, text=True, timeout=60)
    finally:
        os.remove(f.name)
    assert "raised splitflow: graph 'procs': stage 'py' failed on item" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "worker processes die while they start (exit code 1, 3 times in a row)" in r.stdout, r.stdout


def test_a_process_stage_inside_dataloader_workers_is_refused_when_built():
    # DataLoader workers are daemonic processes, which may not start children: a new user's
    # trial saw the first item fail with multiprocessing's "daemonic processes are not allowed
    # to have children", blamed on a data item. The graph is refused when built, saying what
    # to do instead.
    import torch
    import splitflow.torch as sft

    ds = sft.GraphDataset(fns.build_with_a_process_stage, 8, threads=2, backend="host",
                          to_torch=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn")
    with pytest.raises(Exception) as e:
        list(loader)
    text = str(e.value)
    assert "processes=2" in text and "is daemonic" in text, text
    assert "DataLoader(num_workers=0)" in text and "processes=0" in text, text
    # In the main process the same dataset runs.
    assert sorted(v for _, v in ds) == list(range(8))


class _Completion:
    """A process pool's completion (ProcessPool.submit): its result or error, and an event."""

    def __init__(self, any_done=None):
        self.event = threading.Event()
        self.any_done = any_done  # an event set too (one of several done)
        self.value = self.error = None

    def done(self, value):
        self.value = value
        self.event.set()
        if self.any_done is not None:
            self.any_done.set()

    def fail(self, exc, *keep):
        self.error = exc
        self.event.set()
        if self.any_done is not None:
            self.any_done.set()

    def result(self):
        assert self.event.wait(60), "no completion in 60 s"
        return self.value


def test_the_items_of_a_dead_worker_go_to_a_started_worker_not_to_its_replacement(tmp_path):
    # A worker that died with items queued behind the one in its hands: they went to its
    # replacement, which held them while it started (0.5-0.7 s with torch imported) where the
    # other worker, started and idle, would have taken them at once. Now they wait for the next
    # free worker, a started one first.
    from splitflow._procs import ProcessPool

    pool = ProcessPool(fns.until_file, processes=2, stage="s", depth=2)
    try:
        warm = [_Completion(), _Completion()]
        for k, c in enumerate(warm):
            pool.submit((f"w{k}", None, None), c)
        assert len({c.result()[1] for c in warm}) == 2  # (both workers started)
        die, release = str(tmp_path / "die"), str(tmp_path / "release")
        first, second = _Completion(), _Completion()
        pool.submit(("dies", die, 3), first)         # a worker: waits, then dies
        pool.submit(("waits", release, None), second)  # the other: waits, then answers
        one_queued_done = threading.Event()
        queued = [_Completion(one_queued_done), _Completion(one_queued_done)]  # one behind each
        for k, c in enumerate(queued):
            pool.submit((f"q{k}", None, None), c)
        open(release, "w").close()
        survivor = second.result()[1]
        # The item queued behind "waits" is done by the survivor; the other waits behind "dies".
        assert one_queued_done.wait(60)
        done_first = next(c for c in queued if c.event.is_set())
        assert done_first.error is None and done_first.value[1] == survivor
        behind = next(c for c in queued if c is not done_first)
        assert not behind.event.is_set()
        open(die, "w").close()
        assert first.event.wait(60) and first.value is None
        assert "died with exit code 3 while it processed this item" in str(first.error), first.error
        # The item behind it: sent again, to the survivor (before: to the replacement).
        assert behind.result() is not None and behind.error is None, behind.error
        assert behind.value[1] == survivor, (behind.value, survivor, pool.pids)
        stats = pool.stats()
        assert stats["resent"] == 1 and stats["restarts"] == 1, stats
        assert survivor in pool.pids and len(pool.pids) == 2
    finally:
        pool.close()


def test_a_starting_worker_takes_items_only_when_every_started_one_is_full():
    # (White-box: the pool's choice of worker, _State._pick.) A worker's replacement, still
    # starting, had the fewest items out and took the next ones, which waited for its start.
    from splitflow import _procs

    state = _procs._State(b"", "f", 3, "s", None, 2, None)
    a, b, c = state.slots
    for slot in state.slots:
        slot.process = object()  # (started: _pick starts none)
    entry = _procs._Entry(None, None, object())
    a.ready, a.outstanding = True, {0: entry}
    b.ready = False  # starting
    c.ready, c.outstanding = True, {1: entry, 2: entry}  # at depth 2
    assert [state._pick() for _ in range(3)] == [a, a, a]  # (before: b, the fewest out)
    a.outstanding[3] = entry
    assert state._pick() is b  # every started one full
    b.outstanding = {4: entry, 5: entry}
    assert state._pick() in (a, c)  # all full: a started one first
    for slot in state.slots:
        slot.ready, slot.outstanding = False, {}
    c.outstanding = {6: entry}
    assert {state._pick() for _ in range(4)} == {a, b}  # all starting: the fewest out, rotating
