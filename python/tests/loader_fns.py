"""DataLoader helpers for the tests whose loaders have worker processes.

A loop over a DataLoader that a worker's exception ends leaves the loader's iterator in a
reference cycle (torch 1.13's ExceptionWrapper.reraise keeps the exception in a local of a frame
of its own traceback). The iterator, and its workers, then live until the cyclic garbage
collector runs, on whatever thread allocates at that moment (in the suite: distributed's
profiler thread), and it finds the iterator's queues already closed by their finalizers, so that
its shutdown waits 5 s for each worker and then kills it. `loop` ends its iterator's workers
before the exception leaves it, so that no iterator outlives its test.

A worker that hangs is seen only by its parent, which waits for ever (the suite's
faulthandler_timeout prints the parent's stacks, not the worker's): `watched` gives the loader a
timeout and its workers a faulthandler that prints their own stacks before it."""
import contextlib

import torch

WORKER_STACKS_AFTER_S = 90
LOADER_TIMEOUT_S = 120


def print_stacks_if_stuck(worker_id):
    """worker_init_fn: a worker alive WORKER_STACKS_AFTER_S later prints its threads' stacks."""
    import faulthandler
    import sys
    faulthandler.dump_traceback_later(WORKER_STACKS_AFTER_S, exit=False, file=sys.stderr)


def watched(loader_args):
    """The DataLoader arguments, with a timeout and a stack-printing worker_init_fn where the
    loader has workers (spawned: this process already runs splitflow threads)."""
    if loader_args.get("num_workers"):
        loader_args.setdefault("multiprocessing_context", "spawn")
        if loader_args["multiprocessing_context"] != "fork":
            # (Not in a forked worker: its faulthandler would wait for ever for the watchdog
            # thread of the parent's faulthandler_timeout, which the fork did not copy.)
            loader_args.setdefault("worker_init_fn", print_stacks_if_stuck)
        loader_args.setdefault("timeout", LOADER_TIMEOUT_S)
    return loader_args


@contextlib.contextmanager
def loop(loader):
    """`with loop(loader) as it: for x in it: ...`: the iterator's workers end when the block
    does, however it ends."""
    it = iter(loader)
    try:
        yield it
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)  # (a multi-process iterator)
        if shutdown is not None:
            shutdown()


def loader(ds, **args):
    return torch.utils.data.DataLoader(ds, **watched(args))
