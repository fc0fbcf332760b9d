"""Python under faults (docs/architecture.md, "The Python layer"): a stage that raises
MemoryError or KeyboardInterrupt, returns objects the next C++ op cannot take, or a generator
source that raises midway: a clear error naming the stage and item (or the interrupt itself),
the run ended, the interpreter and the runtime usable afterwards."""
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import splitflow as sf


@pytest.fixture(scope="module")
def rt():
    return sf.Runtime(threads=2, backend="host")


def run(rt, items, body, *, on_error="fail", op=None):
    g = sf.Graph(rt, "faults")
    node = g.source("s", items) >> g.stage("py", body, on_error=on_error)
    if op is not None:
        node = node >> g.stage("op", op)
    out = g.pull_sink("out")
    node >> out
    return list(g.iterate(out))


def fail_at(n, exc):
    def body(x):
        if x == n:
            raise exc
        return x
    return body


def test_memory_error_names_the_stage_and_item_and_skip_drops_only_it(rt):
    with pytest.raises(sf.StageError, match=r"stage 'py' failed on item 3: MemoryError: no room") as e:
        run(rt, range(6), fail_at(3, MemoryError("no room")))
    assert isinstance(e.value.__cause__, MemoryError)
    assert run(rt, range(6), fail_at(3, MemoryError("no room")), on_error="skip") == [0, 1, 2, 4, 5]


def test_keyboard_interrupt_in_a_body_reaches_the_caller_as_itself(rt):
    with pytest.raises(KeyboardInterrupt):
        run(rt, range(100), fail_at(2, KeyboardInterrupt()))
    # The runtime goes on: the next run is whole.
    assert run(rt, range(5), lambda x: x * 2) == [0, 2, 4, 6, 8]


# Under on_error="skip" or a substitute an interrupt raised in a body was taken for one bad
# item: dropped (or replaced) and the loop went on to its end (a new user's trial). It is a
# request to stop, whatever the policy; a ValueError beside it is still skipped.
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(5)])
@pytest.mark.parametrize("policy", [{"on_error": "skip"}, {"substitute": -1},
                                    {"on_error": "skip", "field": "x"},
                                    {"substitute": -1, "field": "x"}])
def test_an_interrupt_in_a_skipping_or_substituting_stage_stops_the_loop(rt, exc, policy):
    def body(x):
        if x == 3:
            raise ValueError("three")
        if x == 40:
            raise exc
        return x

    field = policy.get("field")
    items = [{"x": i} for i in range(200)] if field else range(200)
    g = sf.Graph(rt, "interrupted")
    out = g.pull_sink("out")
    g.source("s", items) >> g.stage("py", body, **policy) >> out
    got = []
    with pytest.raises(type(exc)) as info:
        for x in g.iterate(out):
            got.append(x)
    if isinstance(exc, SystemExit):
        assert info.value.code == 5
    # In order, a prefix of the items before the interrupted one (3 skipped or replaced).
    sub = "substitute" in policy
    before = [(-1 if i == 3 else i) for i in range(40) if sub or i != 3]
    if field:
        before = [{"x": v} for v in before]
    assert got == before[:len(got)], f"the loop went on past the interrupt: {len(got)} items"
    # The runtime goes on: the next run is whole.
    assert run(rt, range(5), lambda x: x * 2) == [0, 2, 4, 6, 8]


# An interrupt raised in a body reaches the caller as itself; the run keeps the object it got,
# and raising that one chained the caller's frames (holding the graph) to its traceback: a
# cycle through C++ that the collector cannot see, so the graph, its threads and its workers
# lived on (a new user's trial: one graph and 16 descriptors per raise). A ValueError (wrapped
# in a StageError) is the control.
def test_an_interrupt_raised_in_a_body_does_not_keep_its_graph_alive(rt):
    import gc
    import weakref

    for exc in (ValueError, KeyboardInterrupt, SystemExit, GeneratorExit):
        ref = []

        def once():
            g = sf.Graph(rt, "kept")
            ref.append(weakref.ref(g))
            out = g.pull_sink("out")
            g.source("s", range(20)) >> g.stage("py", fail_at(5, exc("stop"))) >> out
            return sum(1 for _ in g.iterate(out))

        try:
            once()
            raise AssertionError(f"{exc.__name__} was not raised")
        except (exc, sf.StageError) as e:
            assert isinstance(e, exc) or isinstance(e.__cause__, exc), repr(e)
            assert exc is ValueError or type(e) is exc, repr(e)
            del e
        gc.collect()
        assert ref[0]() is None, f"{exc.__name__}: the graph lives on"


def test_objects_a_cpp_op_cannot_take_are_named(rt):
    with pytest.raises(sf.StageError, match=r"stage 'op' failed on item 0: ops.decode_jpeg: "
                                             r"expected a tensor or an array of numbers, got object"):
        run(rt, range(3), lambda x: object(), op=sf.ops.decode_jpeg())
    with pytest.raises(sf.StageError, match=r"stage 'op' failed on item 0: .*got a sample "
                                             r"\(dict of 1: 'a'\); give the stage field="):
        run(rt, range(3), lambda x: {"a": np.zeros(3, np.uint8)}, op=sf.ops.decode_jpeg())


def test_a_cpp_ops_error_is_the_stage_errors_cause(rt):
    # docs/api.md: the cause as __cause__. A Python body's exception was; a C++ op's was not (a
    # verification trial, 2026-12-07: __cause__ None). It is the matching splitflow error.
    with pytest.raises(sf.StageError) as info:
        run(rt, range(3), lambda x: np.frombuffer(b"not a jpeg at all", np.uint8),
            op=sf.ops.decode_jpeg())
    e = info.value
    assert type(e.__cause__) is sf.Error, repr(e.__cause__)
    assert str(e.__cause__) == e.message
    assert e.message.startswith("splitflow::image::decode_jpeg: not a readable JPEG (Not a JPEG")
    assert str(e).endswith(e.message)


def test_a_generator_source_that_raises_midway_fails_the_run_naming_the_item(rt):
    def gen():
        yield 1
        yield 2
        raise RuntimeError("source broke")

    g = sf.Graph(rt, "gen")
    out = g.pull_sink("o")
    g.source("s", gen()) >> out
    got = []
    with pytest.raises(sf.StageError, match=r"stage 's' failed on item 2: RuntimeError: source broke") as e:
        for x in g.iterate(out):
            got.append(x)
    # The failure cancels the run: items made before it and not yet taken are dropped, never
    # reordered or repeated.
    assert got in ([], [1], [1, 2]) and isinstance(e.value.__cause__, RuntimeError)
    assert run(rt, [7], lambda x: x) == [7]


def busy(seconds):
    """A pure-Python body that runs `seconds` (it holds the GIL but for switch intervals)."""
    def body(x):
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
        return x
    return body


@pytest.mark.parametrize("how", ["iterate", "wait"])
def test_ctrl_c_interrupts_a_running_python_body_promptly(rt, how):
    # Before: the run's cancel waited for the 20 s body to return (19-29 s measured).
    g = sf.Graph(rt, "ctrl-c")
    out = g.pull_sink("out")
    g.source("s", [1, 2, 3]) >> g.stage("slow", busy(20)) >> out
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        if how == "iterate":
            for _ in g.iterate(out):
                pass
        else:
            r = g.run()
            r.wait()
    waited = time.monotonic() - t0
    timer.join()
    assert waited < 8, f"KeyboardInterrupt took {waited:.1f} s (the body runs 20 s)"
    # The graph runs again at once, and no stray interrupt reaches later bodies.
    h = sf.Graph(rt, "after")
    o2 = h.pull_sink("out")
    h.source("s", list(range(50))) >> h.stage("py", busy(0.002), concurrency=2) >> o2
    assert sorted(h.iterate(o2)) == list(range(50))


def hangs_at(n, released, ready, entered=None, press=None):
    """A body that, on item n (setting `entered`), once `ready` is set (the reader has taken
    the items before n), presses Ctrl-C (as a signal would: the main thread raises
    KeyboardInterrupt at its next check; or calls `press`) and then waits on `released`, an
    Event: a call that runs no bytecode, so the KeyboardInterrupt splitflow sends the graph's
    bodies cannot end it."""
    import _thread

    def body(x):
        if x == n and not released.is_set():
            if entered is not None:
                entered.set()
            ready.wait()
            (press or _thread.interrupt_main)()
            released.wait()
        return x
    return body


# Ctrl-C while a body waits inside a call Python cannot interrupt (an Event's wait here; a
# time.sleep, a blocking read, C code): the KeyboardInterrupt came only once that call returned,
# for ever if it never did, in `for x in g.iterate(o)` (from next() and from the loop's own
# code, which dropped the iterator and waited for the run); `run = g.run(); for x in sink`
# raised at once but never cancelled the run, and the next run was refused "already running".
# Now the run is cancelled and given a second; a body still inside such a call is left to end
# behind, named on stderr, and the graph's next run waits for it.
@pytest.mark.parametrize("how", ["iterate", "sink", "wait"])
def test_ctrl_c_is_not_held_by_a_body_inside_a_call_python_cannot_interrupt(rt, how, capfd):
    released, ready = threading.Event(), threading.Event()
    watchdog = threading.Timer(30, released.set)  # (the old behaviour: KeyboardInterrupt at 30 s)
    watchdog.start()
    g = sf.Graph(rt, f"hung-{how}")
    src = g.source("s", range(10)) >> g.stage("slow", hangs_at(3, released, ready))
    got = []

    def keep(x):
        got.append(x)
        if x == 2 and how != "wait":
            ready.set()
    if how == "wait":
        src >> g.sink("keep", keep)
    else:
        out = g.pull_sink("out")
        src >> out
    # The main thread keeps the GIL from ready.set() until it waits (in next() or run.wait(),
    # which release it): no switch interval passes meanwhile, so the interrupt lands in the wait.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30)
    try:
        with pytest.raises(KeyboardInterrupt):
            if how == "iterate":
                for x in g.iterate(out):
                    keep(x)
            elif how == "sink":
                run = g.run()
                for x in out:
                    keep(x)
            else:
                run = g.run()
                ready.set()
                run.wait()
        sys.setswitchinterval(interval)
        assert not released.is_set(), "KeyboardInterrupt waited for the body to return"
        assert g.running()  # the run ends when the body returns
        err = capfd.readouterr().err
        assert f"graph 'hung-{how}' was cancelled (Ctrl-C) and has not ended within 1 s: stage " \
               f"'slow' of graph 'hung-{how}' is still running" in err
        assert "the graph's next run waits for it" in err
    finally:
        sys.setswitchinterval(interval)
        released.set()
        watchdog.cancel()
    if how == "sink":
        assert run.wait(timeout=30) in ("cancelled", "failed")
    # The next run waits for the one left behind (not refused as "already running") and sees
    # every item; no stray interrupt reaches its bodies.
    got.clear()
    if how == "wait":
        assert g.run().wait(timeout=30) == "succeeded"
    else:
        got = list(g.iterate(out))
    assert got == list(range(10))


# A loop left early (break) cancels its run and waits for its end, as before; behind a body
# inside a call Python cannot interrupt it said nothing and held Ctrl-C for ever. Now it says
# after 3 s what it waits for, and a Ctrl-C meanwhile leaves the run behind: KeyboardInterrupt
# is raised just after the break. An exception another signal's handler raises (SystemExit from
# a SIGTERM handler; here SIGUSR1's) does the same and reaches the loop as itself: it first
# became a KeyboardInterrupt (SIGINT raised again), lost where SIGINT is ignored.
@pytest.mark.parametrize("how", ["ctrl-c", "signal"])
def test_a_signal_while_a_break_waits_for_a_hung_body_leaves_the_run_behind(rt, how, capfd):
    released, ready, entered = threading.Event(), threading.Event(), threading.Event()
    watchdog = threading.Timer(30, released.set)  # (the old behaviour: the break returned at 30 s)
    watchdog.start()

    def term(signum, frame):
        raise SystemExit(7)
    old = signal.signal(signal.SIGUSR1, term)
    press = (lambda: os.kill(os.getpid(), signal.SIGUSR1)) if how == "signal" else None
    g = sf.Graph(rt, "hung-break")
    out = g.pull_sink("out")
    g.source("s", range(10)) >> g.stage("slow", hangs_at(3, released, ready, entered, press)) >> out
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30)  # (the GIL stays with the main thread from ready.set() to the wait)
    try:
        with pytest.raises(SystemExit if how == "signal" else KeyboardInterrupt) as e:
            for x in g.iterate(out):
                if x == 2:
                    entered.wait()
                    ready.set()
                    break
            sys.setswitchinterval(interval)
            end = time.monotonic() + 60
            while time.monotonic() < end:  # the exception raised after the break lands here
                pass
        assert not released.is_set(), "the break waited for the body to return"
        assert g.running()
        cause = "SystemExit" if how == "signal" else "Ctrl-C"
        assert f"graph 'hung-break' was cancelled ({cause}) and has not ended within 1 s" in capfd.readouterr().err
        if how == "signal":
            assert e.value.code == 7
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGUSR1, old)
        released.set()
        watchdog.cancel()
    assert list(g.iterate(out)) == list(range(10))


# Leaving `with g.run() as run:` by a KeyboardInterrupt raised in the block's own code cancels
# the run as Ctrl-C in a wait does: a body inside a call Python cannot interrupt is left behind.
# Before, the block's exit waited for the run's end: for ever behind a hung body, Ctrl-C ignored.
def test_a_with_block_left_by_ctrl_c_leaves_a_hung_body_behind(rt, capfd):
    released, ready = threading.Event(), threading.Event()
    watchdog = threading.Timer(30, released.set)  # (the old behaviour: the exit waited 30 s)
    watchdog.start()
    g = sf.Graph(rt, "hung-with")
    got = []
    g.source("s", range(10)) >> g.stage("slow", hangs_at(3, released, ready)) >> g.sink("keep", got.append)
    try:
        with pytest.raises(KeyboardInterrupt):
            with g.run():
                ready.set()
                end = time.monotonic() + 60
                while time.monotonic() < end:  # Python code: the interrupt lands here
                    pass
        assert not released.is_set(), "the block's exit waited for the body to return"
        assert g.running()
        assert "graph 'hung-with' was cancelled (Ctrl-C) and has not ended within 1 s" in capfd.readouterr().err
    finally:
        released.set()
        watchdog.cancel()
    got.clear()
    assert g.run().wait(timeout=30) == "succeeded"
    assert got == list(range(10))


# A graph whose run Ctrl-C left behind, dropped (a function's graph, freed as its
# KeyboardInterrupt is handled): the drop returns at once, and the graph (with what its bodies
# hold) is deleted once that run ends. A graph dropped with its run going waits for the run's
# end, saying what it waits for, and a Ctrl-C meanwhile leaves the run behind the same way
# (KeyboardInterrupt raised just after). Before, either drop waited: for ever behind a hung body.
@pytest.mark.parametrize("when", ["after-ctrl-c", "during-drop"])
def test_a_graph_dropped_behind_a_hung_body_does_not_wait_for_it(rt, when, capfd):
    import weakref
    released, ready, entered = threading.Event(), threading.Event(), threading.Event()
    watchdog = threading.Timer(30, released.set)
    watchdog.start()
    body = hangs_at(3, released, ready, entered)
    held = weakref.ref(body)
    g = sf.Graph(rt, "hung-dropped")
    out = g.pull_sink("out")
    g.source("s", range(10)) >> g.stage("slow", body) >> out
    del body
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30)
    try:
        with pytest.raises(KeyboardInterrupt):
            if when == "after-ctrl-c":
                for x in g.iterate(out):
                    if x == 2:
                        ready.set()
            else:
                g.run()
                entered.wait()  # (the body is in: the drop's cancel does not stop it first)
                ready.set()
                del g, out  # the last references: the drop waits, in slices
                sys.setswitchinterval(interval)
                end = time.monotonic() + 60
                while time.monotonic() < end:  # raised just after the drop
                    pass
        sys.setswitchinterval(interval)
        assert not released.is_set()
        assert "graph 'hung-dropped' was cancelled (Ctrl-C) and has not ended" in capfd.readouterr().err
        if when == "after-ctrl-c":
            assert g.running()
            del g, out
            assert not released.is_set(), "dropping the graph waited for the body to return"
        assert held() is not None  # the graph, whose run goes on, still holds its body
    finally:
        sys.setswitchinterval(interval)
        released.set()
        watchdog.cancel()
    end = time.monotonic() + 30
    while held() is not None and time.monotonic() < end:  # deleted once its run has ended
        time.sleep(0.01)
    assert held() is None


# `run = g.run(); for x in sink` then leaving the loop early (break, close()) cancels the run,
# as docs/api.md says and as C++'s range-for over a PullSink does; before, nothing cancelled it:
# the run went on until its sink was full, and the next run was refused as "already running".
# An iterator that took no item cancels nothing when dropped (C++ alike).
def test_leaving_a_loop_over_a_runs_sink_early_cancels_that_run(rt):
    g = sf.Graph(rt, "sink-break")
    out = g.pull_sink("out", capacity=4)
    g.source("s", range(1000)) >> g.stage("id", lambda x: x) >> out
    run = g.run()
    for x in out:
        break
    assert run.wait(timeout=30) == "cancelled"
    run = g.run()
    it = iter(out)
    assert next(it) == 0
    it.close()
    assert run.wait(timeout=30) == "cancelled"
    run = g.run()
    del it
    iter(out)  # taken nothing: the run goes on
    assert list(out) == list(range(1000))
    assert run.wait(timeout=30) == "succeeded"


# Interpreter exit with a run whose body is inside a call Python cannot interrupt: the exit
# hook cancels the run, interrupts its bodies, and leaves it 4 s later, naming the body;
# before, the process waited for that call: for ever for a hung one (Ctrl-C included).
def test_interpreter_exit_leaves_behind_a_body_python_cannot_interrupt():
    import subprocess
    import textwrap
    script = textwrap.dedent("""
        import threading, splitflow as sf
        forever = threading.Event()
        def body(x):
            if x == 3:
                forever.wait()
            return x
        rt = sf.Runtime(threads=2, backend="host")
        g = sf.Graph(rt, "stuck")
        out = g.pull_sink("out")
        g.source("n", range(10)) >> g.stage("slow", body) >> out
        it = g.iterate(out)
        print([next(it) for _ in range(3)], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[0, 1, 2]\n"
    assert "splitflow: exiting without waiting for stage 'slow' of graph 'stuck': cancelled 4 s " \
           "ago, still inside a call that Python cannot interrupt" in done.stderr


def test_runtime_shares_its_device_through_an_arbiter():
    """docs/sharing.md: Runtime(arbiter=...) takes its leases through the machine's arbiter
    segment; read_arbiter shows them (every lease once, never more bursts than the capacity);
    a bad option is refused by name."""
    import os

    name = f"pytest-{os.getpid()}"
    sf.remove_arbiter(name)
    try:
        rt = sf.Runtime(threads=2, backend="host", arbiter={"name": name, "capacity": 1, "label": "py",
                                                                "liveness": 0.02})
        g = sf.Graph(rt, "g", priority=3)  # the C++ GraphOptions::priority
        out = g.pull_sink("out")
        g.indices("idx", list(range(40))) >> g.stage("fill", sf.ops.fill([64]), concurrency=0) \
            >> g.gpu_stage("model", sf.ops.busy_kernel(100)) >> out
        assert sum(1 for _ in g.iterate(out)) == 40
        v = sf.read_arbiter(name)
        assert v["leases"] == 40
        assert v["max_in_use"] == 1
        assert [p["label"] for p in v["processes"]] == ["py"]
        # Its graph's figures, published every `liveness` (20 ms here) while the process lives.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            graphs = sf.read_arbiter(name)["processes"][0]["graphs"]
            if graphs and graphs[0]["bursts"] == 40:
                break
            time.sleep(0.01)
        assert [(g["name"], g["bursts"], g["priority"]) for g in graphs] == [("g", 40, 3)]
        assert graphs[0]["held_ns"] >= graphs[0]["busy_ns"] > 0
        assert name in sf.list_arbiters()
        with pytest.raises(sf.Error, match="arbiter has no option 'size'"):
            sf.Runtime(backend="host", arbiter={"name": name, "size": 2})
        # Seconds from a millisecond (0.0004 rounded to 0 and was refused in C++'s words).
        for bad in (0.0004, 0, -1, 1e300, float("nan")):
            with pytest.raises(sf.Error, match=r"arbiter liveness is .* seconds; it must be from "
                                               r"0.001 to 3600"):
                sf.Runtime(backend="host", arbiter={"name": name, "liveness": bad})
        # In use by this process's runtime: not removed, named (force=True below removes it).
        with pytest.raises(sf.Error, match=rf"arbiter '{name}' was not removed: processes use "
                                           rf"it: {os.getpid()} \(py\)"):
            sf.remove_arbiter(name)
    finally:
        sf.remove_arbiter(name, force=True)  # (this process's runtime may still hold it)
