"""Services from Python (docs/api.md, "Services"): Graph.service, dynamic_batch and unbatch with
the C++ names; submit() returns a concurrent.futures.Future that asyncio can await; every
request completes exactly once, with its result or its own error."""
import asyncio
import io
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import splitflow as sf


def service_graph(rt, body, *, max_batch=8, max_delay=0.002, on_error="skip", max_pending=64,
                  admission="wait", prep=None):
    g = sf.Graph(rt, "svc")
    svc = g.service("requests", max_pending=max_pending, admission=admission)
    first = g.stage("prep", prep or (lambda x: x), on_error=on_error)
    gather = g.dynamic_batch("gather", max_batch=max_batch, max_delay=max_delay)
    model = g.stage("model", body, on_error=on_error)
    split = g.unbatch("split", max_batch=max_batch)
    svc.source >> first >> gather >> model >> split >> svc.sink
    return g, svc


def test_every_request_gets_its_own_answer_from_many_threads():
    rt = sf.Runtime(threads=2, backend="host")
    g, svc = service_graph(rt, lambda b: [int(v) * 3 for v in np.asarray(b)])
    run = g.run()
    answers = {}

    def client(t):
        futs = [(x, svc.submit(x)) for x in range(t * 1000, t * 1000 + 50)]
        for x, f in futs:
            answers[x] = f.result(timeout=30)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    svc.close()
    assert run.wait() == "succeeded"
    assert len(answers) == 200 and all(v == 3 * x for x, v in answers.items())
    st = svc.stats()
    assert st["submitted"] == st["answered"] == 200 and st["pending"] == 0


def test_the_model_step_sees_collated_batches_of_at_most_max_batch():
    rt = sf.Runtime(threads=2, backend="host")
    sizes = []

    def step(batch):
        a = np.asarray(batch)
        sizes.append(a.shape)
        return a.sum(axis=1)

    # A long max_delay: a batch goes when full (or at the end), so 16 requests make two of 8.
    g, svc = service_graph(rt, step, max_batch=8, max_delay=30.0)
    run = g.run()
    futs = [svc.submit(np.full(3, i, np.float32)) for i in range(16)]
    got = [float(np.asarray(f.result(timeout=30))) for f in futs]
    svc.close()
    assert run.wait() == "succeeded"
    assert got == [3.0 * i for i in range(16)]
    assert sizes == [(8, 3), (8, 3)]


def test_a_bad_request_fails_alone_naming_the_stage_with_the_users_exception_as_cause():
    rt = sf.Runtime(threads=2, backend="host")

    def prep(x):
        if x == 13:
            raise ValueError("unlucky request")
        return x

    g, svc = service_graph(rt, lambda b: [2 * int(v) for v in np.asarray(b)], prep=prep)
    run = g.run()
    futs = [svc.submit(i) for i in range(20)]
    for i, f in enumerate(futs):
        if i == 13:
            # the same error as a run's: a StageError naming graph, stage and request, the
            # user's own exception its __cause__ (it was the bare ValueError)
            with pytest.raises(sf.StageError, match=r"stage 'prep' failed on item 13: "
                                                    r"ValueError: unlucky request") as e:
                f.result(timeout=30)
            assert (e.value.stage, e.value.item) == ("prep", 13)
            assert isinstance(e.value.__cause__, ValueError)
        else:
            assert f.result(timeout=30) == 2 * i
    svc.close()
    assert run.wait() == "succeeded"
    assert svc.stats()["failed"] == 1


def test_a_substituted_request_is_answered_with_the_substitute():
    # substitute= answers the request whose body raised with the substitute, as any other item
    # (it failed with the body's error before, the substitute thrown away at the answer sink),
    # and the dynamic batch's latency counts each request's wait for its batch.
    rt = sf.Runtime(threads=2, backend="host")

    def prep(x):
        if x == 13:
            raise ValueError("unlucky request")
        return x

    g = sf.Graph(rt, "svc")
    svc = g.service("requests")
    first = g.stage("prep", prep, substitute=-1)
    gather = g.dynamic_batch("gather", max_batch=8, max_delay=0.05)
    model = g.stage("model", lambda b: [2 * int(v) for v in np.asarray(b)])
    svc.source >> first >> gather >> model >> g.unbatch("split", max_batch=8) >> svc.sink
    run = g.run()
    futs = [svc.submit(i) for i in range(20)]
    assert [f.result(timeout=30) for f in futs] == [-2 if i == 13 else 2 * i for i in range(20)]
    svc.close()
    assert run.wait() == "succeeded"
    stats = svc.stats()
    assert (stats["answered"], stats["failed"]) == (20, 0)
    prep_stats = next(s for s in run.stats()["stages"] if s["name"] == "prep")
    assert prep_stats["substituted"] == 1
    # 20 requests in batches of 8 with a 50 ms delay: the last 4 waited the delay at least.
    gather_stats = next(s for s in run.stats()["stages"] if s["name"] == "gather")
    assert gather_stats["latency_ns"]["max"] >= 50e6, gather_stats["latency_ns"]


def jpeg_bytes(color):
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, format="JPEG")
    return np.frombuffer(buf.getvalue(), np.uint8)


def test_a_cpp_op_on_a_dynamic_batch_fails_only_the_item_it_failed_on():
    pytest.importorskip("PIL")
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "decode-svc")
    svc = g.service("requests")
    gather = g.dynamic_batch("gather", max_batch=4, max_delay=30.0)
    decode = g.stage("decode", sf.ops.decode_jpeg(), concurrency=0)
    split = g.unbatch("split", max_batch=4)
    svc.source >> gather >> decode >> split >> svc.sink
    run = g.run()
    items = [jpeg_bytes((10 * i, 0, 0)) for i in range(4)]
    items[2] = np.frombuffer(b"\xff\xd8 not a jpeg", np.uint8)
    futs = [svc.submit(x) for x in items]
    for i, f in enumerate(futs):
        if i == 2:
            with pytest.raises(sf.Error, match="JPEG|jpeg"):
                f.result(timeout=30)
        else:
            assert np.asarray(f.result(timeout=30)).shape == (6, 8, 3)
    svc.close()
    assert run.wait() == "succeeded"
    st = svc.stats()
    assert st["answered"] == 3 and st["failed"] == 1


def test_a_wrong_number_of_results_fails_that_batchs_requests_and_says_why():
    rt = sf.Runtime(threads=2, backend="host")
    g, svc = service_graph(rt, lambda b: [0], max_batch=2, max_delay=30.0)
    run = g.run()
    futs = [svc.submit(i) for i in range(2)]
    for f in futs:
        with pytest.raises(sf.StageError, match=r"^splitflow: graph 'svc': stage 'model' failed "
                                                r"on item \d: stage 'model' of graph 'svc': the "
                                                r"function returned 1 results for a batch of 2 "
                                                r"requests") as info:
            f.result(timeout=30)
        # its cause the error the library raised (a request's error as a run's: the cause
        # nested, as docs/api.md says; it had none)
        assert type(info.value.__cause__) is sf.Error, repr(info.value.__cause__)
        assert str(info.value.__cause__) == info.value.message
    svc.close()
    assert run.wait() == "succeeded"


def test_a_batch_function_returning_none_or_a_dict_is_told_what_it_returned():
    # "returned 1 results" for a dict of one key, and a TypeError of len() for None (a trial).
    rt = sf.Runtime(threads=2, backend="host")
    for body, what in ((lambda b: None, "None"), (lambda b: {"y": np.asarray(b)}, "a dict")):
        g, svc = service_graph(rt, body, max_batch=2, max_delay=30.0)
        run = g.run()
        futs = [svc.submit(i) for i in range(2)]
        for f in futs:
            with pytest.raises(sf.StageError, match=f"the function returned {what} for a batch of 2 "
                                                    r"requests; return one per request"):
                f.result(timeout=30)
        svc.close()
        assert run.wait() == "succeeded"


def test_a_dynamic_batch_wired_to_the_sink_without_an_unbatch_is_refused_at_run():
    # Request 0 was answered with the whole batch, the others left pending until close(), and
    # the run said "succeeded" (a trial).
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "svc")
    svc = g.service("req")
    svc.source >> g.dynamic_batch("gather", max_batch=4, max_delay=0.01) >> svc.sink
    with pytest.raises(sf.GraphError, match="dynamic batch 'gather' of graph 'svc' reaches its "
                                            "service's sink without an unbatch.*g.unbatch"):
        g.run()
    # A batch of batches split once (a review's case: requests got batches, half nothing).
    g = sf.Graph(rt, "nested")
    svc = g.service("req")
    svc.source >> g.dynamic_batch("b1", max_batch=2) >> g.dynamic_batch("b2", max_batch=2) \
        >> g.unbatch("u2", 2) >> svc.sink
    with pytest.raises(sf.GraphError, match="dynamic batch 'b1' of graph 'nested' reaches its "
                                            "service's sink without an unbatch"):
        g.run()


def test_a_field_stage_on_a_dynamic_batch_works_on_that_field_of_each_request():
    # field= after a dynamic batch: the function gets that field of the requests collated and
    # returns one result per request, each put back in its request; the other fields go on. It
    # failed every request ("the item is a dynamic batch of 4 requests, not a tuple or dict").
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "svc")
    svc = g.service("req")
    seen = []

    def model(xs):
        a = np.asarray(xs)
        seen.append(a.shape)
        return a * 10

    svc.source >> g.dynamic_batch("gather", max_batch=4, max_delay=30.0) \
        >> g.stage("m", model, field="x") >> g.unbatch("u", 4) >> svc.sink
    run = g.run()
    futs = [svc.submit({"x": i, "y": -i}) for i in range(8)]
    got = [f.result(timeout=30) for f in futs]
    assert [(int(d["x"]), d["y"]) for d in got] == [(10 * i, -i) for i in range(8)]
    assert seen == [(4,), (4,)]
    # A request that is not a dict or tuple is named; the batch fails (under "fail", the run).
    bad = svc.submit(7)
    futs = [svc.submit({"x": i, "y": 0}) for i in range(3)]
    for f in [bad] + futs:
        with pytest.raises(sf.StageError, match=r"field='x' but request 0 of its dynamic batch is "
                                                r"the integer 7, not a tuple or dict"):
            f.result(timeout=30)
    with pytest.raises(sf.StageError):
        run.wait()


def test_a_gpu_op_given_to_a_cpu_stage_is_told_to_go_to_a_gpu_stage():
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "g")
    with pytest.raises(sf.GraphError, match=r"ops.busy_kernel is a GPU op; give it to g.gpu_stage\('busy'"):
        g.stage("busy", sf.ops.busy_kernel(300))


def test_an_expired_request_gets_deadline_error_unprocessed():
    rt = sf.Runtime(threads=2, backend="host")
    seen = []

    def step(b):
        a = np.asarray(b)
        seen.extend(a.tolist())
        return a

    g, svc = service_graph(rt, step, max_batch=1)
    run = g.run()
    late = svc.submit(7, deadline=-1.0)  # already past when the batch forms
    ok = svc.submit(8, deadline=60.0)
    with pytest.raises(sf.DeadlineError, match="exceeded its deadline before stage 'gather'"):
        late.result(timeout=30)
    assert ok.result(timeout=30) == 8
    svc.close()
    assert run.wait() == "succeeded"
    assert seen == [8] and svc.stats()["expired"] == 1


# "deadline: seconds from now (None or math.inf: none)": a far or infinite deadline never
# expires, one before now has expired, a NaN is refused. Before: 1e10 s, 1e300 and inf
# overflowed the clock's conversion and the request expired at once.
def test_far_and_infinite_deadlines_never_expire_and_nan_is_refused():
    rt = sf.Runtime(threads=2, backend="host")
    g, svc = service_graph(rt, lambda b: np.asarray(b), max_batch=1)
    run = g.run()
    far = [svc.submit(i, deadline=d) for i, d in enumerate([1e10, 1e300, float("inf"), 3600.0])]
    gone = svc.submit(9, deadline=float("-inf"))
    with pytest.raises(sf.GraphError, match="deadline is NaN"):
        svc.submit(10, deadline=float("nan"))
    assert [f.result(timeout=30) for f in far] == [0, 1, 2, 3]
    with pytest.raises(sf.DeadlineError):
        gone.result(timeout=30)
    svc.close()
    assert run.wait() == "succeeded"
    st = svc.stats()
    assert (st["submitted"], st["answered"], st["expired"], st["rejected"]) == (5, 4, 1, 0)


# "An error on a batch reaches every id in it" (docs/architecture.md, 9.), under the default
# on_error="fail" too, and the run fails. Before: the batch's first request got the model's
# error, the other three "the run was cancelled or failed before request N was answered".
def test_under_fail_every_request_of_a_failing_batch_gets_its_error():
    rt = sf.Runtime(threads=2, backend="host")

    def model(b):
        raise ValueError("the model failed on this batch")

    g, svc = service_graph(rt, model, max_batch=4, max_delay=30.0, on_error="fail")
    run = g.run()
    futures = [svc.submit(i) for i in range(4)]  # exactly one full batch
    for i, f in enumerate(futures):
        with pytest.raises(sf.StageError, match="stage 'model' failed on item") as e:
            f.result(timeout=30)
        assert e.value.item == i and isinstance(e.value.__cause__, ValueError)
        assert "the model failed on this batch" in str(e.value.__cause__)
    with pytest.raises(sf.StageError):
        run.wait()


def test_fail_fast_admission_raises_overloaded_error_when_full():
    rt = sf.Runtime(threads=2, backend="host")
    gate = threading.Event()

    def held(x):
        gate.wait(30)
        return x

    g, svc = service_graph(rt, lambda b: np.asarray(b), prep=held, max_pending=1,
                           admission="fail_fast", max_batch=1)
    run = g.run()
    first = svc.submit(1)
    with pytest.raises(sf.OverloadedError, match="is overloaded: 1 requests pending"):
        svc.submit(2)
    gate.set()
    assert first.result(timeout=30) == 1
    svc.close()
    assert run.wait() == "succeeded"
    assert svc.stats()["rejected"] == 1


def test_asyncio_awaits_the_futures_and_lifecycle_errors_are_graph_errors():
    rt = sf.Runtime(threads=2, backend="host")
    g, svc = service_graph(rt, lambda b: [int(v) + 1 for v in np.asarray(b)])
    with pytest.raises(sf.GraphError, match="not accepting requests: its graph is not running"):
        svc.submit(1)

    async def serve():
        return await asyncio.gather(*(asyncio.wrap_future(svc.submit(i)) for i in range(30)))

    run = g.run()
    assert asyncio.run(serve()) == list(range(1, 31))
    svc.close()
    assert run.wait() == "succeeded"
    with pytest.raises(sf.GraphError, match="not accepting requests"):
        svc.submit(1)
    with pytest.raises(sf.GraphError, match="one per graph"):
        g.service("again")


def test_a_gpu_stage_after_a_dynamic_batch_runs_its_op_on_each_request():
    # A new user's trial: g.gpu_stage between dynamic_batch and unbatch gave its op the batch
    # itself ("ops.normalize: expected a tensor or an array, got a dynamic batch of 1
    # requests"), where g.stage applies a C++ op per request (docs/api.md). Now both do: the
    # same answers, and a request the op refuses fails alone.
    rt = sf.Runtime(threads=2, backend="host")
    answers = {}
    for kind in ("stage", "gpu_stage"):
        g = sf.Graph(rt, "svc")
        svc = g.service("req")
        op = sf.ops.normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
        norm = getattr(g, kind)("norm", op, on_error="skip")
        svc.source >> g.dynamic_batch("gather", max_batch=4, max_delay=30.0) >> norm \
            >> g.unbatch("split", max_batch=4) >> svc.sink
        run = g.run()
        requests = [np.full((4, 4, 3), v, np.uint8) for v in (0, 100, 200)] + ["not an image"]
        futures = [svc.submit(r) for r in requests]
        answers[kind] = [np.asarray(f.result(timeout=30)) for f in futures[:3]]
        with pytest.raises(sf.StageError, match=r"failed on item 3: ops.normalize: expected a "
                                                r"tensor or an array of numbers, got str"):
            futures[3].result(timeout=30)
        svc.close()
        assert run.wait() == "succeeded"
        assert svc.stats()["answered"] == 3 and svc.stats()["failed"] == 1
    for a, b, v in zip(answers["stage"], answers["gpu_stage"], (0, 100, 200)):
        assert a.shape == b.shape == (3, 4, 4)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, (v / 255 - 0.5) / 0.25, rtol=1e-6)


def test_cancel_fails_the_requests_at_once_not_when_the_body_returns():
    # A new user's trial: run.cancel() returned at once, but the requests queued behind a body
    # of 10 s failed only when it returned.
    rt = sf.Runtime(threads=2, backend="host")
    g = sf.Graph(rt, "svc")
    svc = g.service("req")
    started, release = threading.Event(), threading.Event()

    def model(x):
        started.set()
        assert release.wait(60)
        return x

    svc.source >> g.stage("model", model) >> svc.sink
    run = g.run()
    futures = [svc.submit(i) for i in range(5)]
    assert started.wait(30)
    run.cancel()
    try:
        for f in futures:  # while the body still runs
            with pytest.raises(sf.Error, match=r"the run was cancelled or failed before request "
                                               r"\d was answered"):
                f.result(timeout=10)
    finally:
        release.set()
    assert run.wait() == "cancelled"
    assert svc.stats()["failed"] == 5 and svc.stats()["pending"] == 0


def test_a_stuck_model_body_does_not_hold_the_process_at_exit():
    # A new user's trial: a service whose model body never returned (a Python loop) kept the
    # process alive after its main thread ended (and after Ctrl-C, twice): interpreter exit
    # cancelled the run and waited for the body for ever. It is interrupted after a grace.
    serve = textwrap.dedent("""
        import threading, splitflow as sf
        def serve():
            rt = sf.Runtime(threads=2, backend="host")
            g = sf.Graph(rt, "svc")
            svc = g.service("req")
            started = threading.Event()
            def model(x):
                started.set()
                while True:
                    pass
            svc.source >> g.stage("model", model) >> svc.sink
            run = g.run()
            f = svc.submit(1)
            assert started.wait(30)
            return g, run, f
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def exits_saying(ending, said):
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-c", serve + ending], capture_output=True, text=True,
                           timeout=60, env=env)
        assert p.stdout.strip() == said, p.stderr
        assert time.monotonic() - t < 30, p.stderr

    # The graph and its run kept to the end: interpreter exit interrupts the body.
    exits_saying('kept = serve()\nprint("leaving", flush=True)\n', "leaving")
    # The graph and its run dropped with a function's locals (a verification trial: the main
    # thread then hung dropping the graph, which waited for the body, before any exit).
    exits_saying('serve()\nprint("after main", flush=True)\n', "after main")
