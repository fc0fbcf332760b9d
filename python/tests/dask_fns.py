"""Remote graph segments for test_dask.py: the Dask workers import them by name, so they live in
a module, not in the test file."""
import collections
import time

import numpy as np

from procs_fns import TwoArgError  # (pickle cannot rebuild it: its __init__ takes two arguments)

FAIL_ON = 13
SKIP = (13, 27)


def sample(i, seed, epoch):
    """A deterministic sample of (seed, epoch, index): 64 random bytes and the index."""
    rng = np.random.default_rng([seed, epoch, i])
    return {"x": rng.integers(0, 256, 64, dtype=np.uint8), "index": i}


def build_samples(g, indices, *, seed, epoch):
    return indices >> g.stage("sample", lambda i: sample(i, seed, epoch))


Pair = collections.namedtuple("Pair", "x index")


def build_pairs(g, indices, *, seed, epoch):
    """Named-tuple samples."""
    return indices >> g.stage("pair", lambda i: Pair(sample(i, seed, epoch)["x"], i))


def build_returning_5(g, indices, *, seed, epoch):
    """A build that returns what is not a node."""
    indices >> g.stage("sample", lambda i: sample(i, seed, epoch))
    return 5


def build_slow_samples(g, indices, *, seed, epoch):
    """5 ms of worker time per item (a worker's load, so that a split is still running when the
    test kills its worker)."""
    def slow(i):
        time.sleep(0.005)
        return sample(i, seed, epoch)
    return indices >> g.stage("slow sample", slow)


STUCK_ON, STUCK_S = 6, 3.0


def build_stuck(g, indices, *, seed, epoch):
    """Item STUCK_ON's body takes STUCK_S (a body that hangs, for as long as a test can wait)."""
    def body(i):
        if i == STUCK_ON:
            time.sleep(STUCK_S)
        return sample(i, seed, epoch)
    return indices >> g.stage("sample", body)


def _check(i):
    if i in SKIP:
        raise ValueError(f"item {i} is corrupt")
    return i


def build_failing(g, indices, *, seed, epoch):
    s = g.stage("sample", lambda i: sample(i, seed, epoch))
    return indices >> g.stage("check", _check) >> s


def _two_arg_on_13(i):
    if i == 13:
        raise TwoArgError(1, 2)
    return i


def build_failing_oddly(g, indices, *, seed, epoch):
    return indices >> g.stage("check", _two_arg_on_13)


def _skip_tenth(i):
    if i % 10 == 0:
        raise ValueError(f"filtered {i}")
    return i


def build_skip_tenth(g, indices, *, seed, epoch):
    return indices >> g.stage("filter", _skip_tenth, on_error="skip")


def build_with_processes(g, indices, *, seed, epoch):
    return indices >> g.stage("sq", _check, processes=2)


def build_skipping(g, indices, *, seed, epoch):
    s = g.stage("sample", lambda i: sample(i, seed, epoch))
    return indices >> g.stage("check", _check, on_error="skip") >> s


def _exit_on_21(i):
    if i == 21:
        raise SystemExit(7)
    return _check(i)


def build_exiting(g, indices, *, seed, epoch):
    """13 is skipped; 21 raises SystemExit(7): the pass stops, whatever on_error says."""
    s = g.stage("sample", lambda i: sample(i, seed, epoch))
    return indices >> g.stage("check", _exit_on_21, on_error="skip") >> s


def local_samples(indices, seed, epoch):
    """What a local run computes for these indices."""
    return [sample(int(i), seed, epoch) for i in indices]


def build_batching(g, indices, *, seed, epoch):
    return indices >> g.stage("sample", lambda i: sample(i, seed, epoch)) >> g.batch("b", 4)


def worker_runtime_threads():
    """(client.run on each worker) the threads of the splitflow runtimes its process keeps."""
    import splitflow.dask as sfd
    runtimes = sfd._worker_state["runtime"] or {}
    return sorted(rt.threads for rt in runtimes.values())


def build_tensors(g, indices, *, seed, epoch):
    """Samples whose image is a C++ op's output (a splitflow tensor), as an image pipeline's."""
    import splitflow as sf
    return (indices >> g.stage("sample", lambda i: {"x": np.full((4, 4, 3), i % 256, np.uint8),
                                                   "index": i})
            >> g.stage("tensor", sf.ops.as_tensor(), field="x"))
