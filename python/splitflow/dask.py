"""Remote CPU stages on Dask distributed: the CPU part of a pipeline runs on Dask workers, each
worker in its own splitflow runtime, and the results stream back into a local graph (its GPU
stages and local CPU stages go on as before).

    import splitflow as sf, splitflow.dask
    from distributed import Client

    def build_cpu_part(g, indices, *, seed, epoch):      # module level: the workers import it
        read = g.stage("read", sf.ops.read_file(PATHS, labels=LABELS), concurrency=0)
        crop = g.stage("crop", sf.ops.decode_random_resized_crop(224, seed=seed, epoch=epoch),
                       field="image", concurrency=0, on_error="skip")
        return indices >> read >> crop

    client = Client("tcp://scheduler:8786")
    remote = sf.dask.remote(build_cpu_part, client, items=range(len(PATHS)), seed=7)
    g = sf.Graph(sf.Runtime(), "train")
    src = remote.source(g)                               # g.source("remote", remote)
    norm = g.gpu_stage("normalize", sf.ops.normalize(MEAN, STD), field="image")
    ...
    print(remote.stats(), remote.report())

or inside ``splitflow.torch.GraphDataset(build_local, length, remote=remote)``: the dataset's
shard (rank, epoch order, resume) is what the workers compute, and ``build_local(g, source)``
gets the remote source in place of the indices.

Semantics (docs/scale-out.md):

* Splits. The items (dataset indices, in the local order) are cut into splits: contiguous runs,
  each one Dask task. ``split="auto"`` sizes them from the measured per-item cost so that each
  takes about ``split_seconds`` (0.1 s) of a worker (the first ``probe`` items go first, to
  measure); ``split=n``: n items each. On the worker the task builds (once per worker thread,
  seed and epoch: cached) the graph ``build(g, indices, seed=, epoch=)`` in the worker's own
  runtime (one per worker process) and runs the split through it.
* Bounded: at most ``max_splits_in_flight`` splits are submitted and not yet consumed (default:
  twice the workers); the next split is submitted only when the local graph takes an item, so a
  slow consumer stops submission, and the local memory holds one split's results at a time
  (in order), whatever the number of workers.
* Order. ``order="in_order"`` (default): the items come back in the order of ``items``;
  ``"out_of_order"``: split by split as they complete (each split's items in order).
* Deterministic: an item's result depends on (seed, epoch, index) only (the ops draw their
  randomness from them), not on the split or worker that computes it.
* Exactly once. Each split's result is taken once, from its one Dask future. A worker that dies
  mid-split: Dask reschedules the task on another worker (``distributed.scheduler.
  allowed-failures``, 3); a split whose workers die more often fails the run (KilledWorker,
  named). The scheduler unreachable (its connection closed, or no answer to a ping within
  ``timeout`` seconds while no split completes): the run fails with ``splitflow.Error`` within
  ``timeout`` (default 30 s).
* Errors. A remote stage's exception reaches the local run as ``splitflow.StageError`` naming
  the remote graph, the stage, the item's dataset index and the worker's address (its
  ``__cause__`` the original exception when it could travel) and its place in the pass. In a
  plain graph that error is the ``__cause__`` of the local source's StageError (whose item is
  where the remote results stopped: the failed split's first); GraphDataset raises it directly.
* A split on the cluster past ``stuck_after`` is said (a RuntimeWarning naming it, its items
  and its worker; ``stats()["stuck_splits"]`` and the diagnosis): a remote body may be stuck.
  ``on_error="skip"`` in the remote stages skips there; ``stats()`` counts and names them.
* Transport: the results' tensors travel as numpy arrays through Dask's serialization (its
  numpy serializer or pickle protocol 5 with out-of-band buffers: no copy into the pickle).
"""
import asyncio
import collections
import itertools
import math
import os
import reprlib
import threading
import time
import uuid

import numpy as np

from . import _core
from ._errors import Error, GraphError, StageError, _int_arg, _not_a_node, _seconds_arg
from ._tuples import rebuilt

__all__ = ["Remote", "RemotePass", "connect", "remote", "run_split"]

_DEFAULT_SPLIT_S = 0.1
_PROBE = 8               # items of the first splits of split="auto", before any cost is known
_MAX_SPLIT = 65536       # items per split at most


# ---- worker side -------------------------------------------------------------------------------

_worker_state = {"pid": None, "runtime": None, "graphs": None, "lock": threading.Lock()}
_GRAPH_CACHE = 8  # graphs per worker process kept (per thread, build, seed, epoch)


class _Feed:
    """The worker graph's source: iter() gives the current split's indices (one run at a time)."""

    def __init__(self):
        self.indices = []

    def __iter__(self):
        return iter(self.indices)


_RUNTIMES = 4  # distinct (threads, backend) runtimes a worker process keeps, at most


def _runtime(threads, backend):
    """The worker process's runtime of these threads and backend (a Remote asking for other
    threads gets its own: a new user's trial saw threads= of a second Remote ignored, the
    first one's runtime shared); at most _RUNTIMES, the oldest going first."""
    st = _worker_state
    with st["lock"]:
        if st["pid"] != os.getpid():  # a new process (fork): runtimes of its own
            st["pid"], st["runtime"], st["graphs"] = os.getpid(), None, collections.OrderedDict()
        runtimes = st["runtime"]
        if runtimes is None:
            runtimes = st["runtime"] = collections.OrderedDict()
        key = (int(threads), backend)
        rt = runtimes.get(key)
        if rt is None:
            rt = runtimes[key] = _core.Runtime(threads=threads, backend=backend)
            while len(runtimes) > _RUNTIMES:
                gone, _ = runtimes.popitem(last=False)
                # Its graphs go with it (they would keep it alive past the cap).
                graphs = st["graphs"]
                for k in [k for k in graphs if k[-2:] == gone]:
                    del graphs[k]
        runtimes.move_to_end(key)
        return rt


def _build_key(build):
    """A build function's identity across tasks: a module-level function is the same object
    in every task; a functools.partial is a new one each time, so its parts are the key."""
    import functools

    if isinstance(build, functools.partial):
        key = (build.func, build.args, tuple(sorted(build.keywords.items())))
        try:
            hash(key)
            return key
        except TypeError:
            return None  # not cached: built for each split
    return build


class _RemoteGraph(_core.Graph):
    """The graph a remote build adds its stages to: batching there is refused. A split's items
    would be batched apart from the next split's (batches cut at every split's edge, unlike a
    local run's), and the local side counts, orders, resumes and shards samples, not batches
    (a trial's GraphDataset counted 50 for 13 batches and repeated 9 samples on resume)."""

    def _refuse(self, how, name):
        raise GraphError(
            f"splitflow.dask.remote: the remote build batches (g.{how}({name!r}, ...)): batch in "
            "the local graph instead (after remote.source(g), or with g.batch at the end of the "
            "GraphDataset's own build): a remote batch would end at every split's edge, and the "
            "local side counts, resumes and shards samples")

    def batch(self, name, *args, **kwargs):
        self._refuse("batch", name)

    def dynamic_batch(self, name, *args, **kwargs):
        self._refuse("dynamic_batch", name)


def _graph_for(build, seed, epoch, opts):
    """(graph, feed, sink) for this thread, build, seed and epoch: built once."""
    rt = _runtime(opts["threads"], opts["backend"])
    key = (threading.get_ident(), _build_key(build), seed, epoch, opts["name"], opts["threads"],
           opts["backend"])
    graphs = _worker_state["graphs"]
    if key[1] is None:
        graphs = collections.OrderedDict()
    with _worker_state["lock"]:
        hit = graphs.get(key)
        if hit is not None:
            graphs.move_to_end(key)
            return hit
    g = _RemoteGraph(rt, opts["name"], max_in_flight=opts["max_in_flight"])
    feed = _Feed()
    src = g.source("indices", feed)
    last = build(g, src, seed=seed, epoch=epoch)
    if last is None:
        last = src
    elif not isinstance(last, _core.Node):
        raise _not_a_node("splitflow.dask.remote: build(g, indices, seed=, epoch=)", last,
                          "the indices themselves")
    out = g.pull_sink("out")
    last >> out
    hit = (g, feed, out)
    with _worker_state["lock"]:
        graphs[key] = hit
        while len(graphs) > _GRAPH_CACHE:
            graphs.popitem(last=False)
    return hit


class _WireTensor:
    """A splitflow tensor of a remote result on its way: its memory as a numpy array (pickled
    out of band, no copy), a tensor again where the result arrives (_from_wire), as a local run
    would have yielded it (they arrived as numpy arrays, which GraphDataset did not make torch
    tensors: a new user's trial)."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return _WireTensor, (self.array,)


def _to_wire(x):
    """A result with its splitflow tensors as _WireTensor (numpy views, no copy) and its
    bytes."""
    if isinstance(x, _core.Tensor):
        a = np.asarray(x)
        return _WireTensor(a), a.nbytes
    if isinstance(x, np.ndarray):
        return x, x.nbytes
    if isinstance(x, dict):
        out, n = {}, 0
        for k, v in x.items():
            out[k], m = _to_wire(v)
            n += m
        return out, n
    if isinstance(x, (tuple, list)):
        parts = [_to_wire(v) for v in x]
        # (A named tuple's class takes its fields as arguments: rebuilt through _make; its
        # class's constructor given one generator failed on the worker: a review.)
        values = [p[0] for p in parts]
        return (values if isinstance(x, list) else rebuilt(x, values)), sum(p[1] for p in parts)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return x, len(x)
    return x, 8


def _from_wire(x):
    """_to_wire's result as the local graph takes it: its tensors splitflow tensors again."""
    if type(x) is _WireTensor:
        return _core._as_tensor(x.array)
    if isinstance(x, dict):
        return {k: _from_wire(v) for k, v in x.items()}
    if isinstance(x, list):  # (as _to_wire rebuilt it)
        return [_from_wire(v) for v in x]
    if isinstance(x, tuple):
        return rebuilt(x, [_from_wire(v) for v in x])
    return x


def _worker_address():
    try:
        from distributed import get_worker
        return get_worker().address
    except Exception:
        return f"pid {os.getpid()}"


def _worker_threads():
    try:
        from distributed import get_worker
        w = get_worker()
        state = getattr(w, "state", None)
        return int(state.nthreads if state is not None else w.nthreads)
    except Exception:
        return 1


def _in_process_threads(threads, client_pid):
    """A worker in the client's own process (LocalCluster(processes=False)) runs its graphs
    beside the local graph's runtime, whose source waits for the remote results: oneTBB
    (2021.8) gives no thread to a second arena of one thread while another arena's task waits
    so (a new user's trial hung in 4 of 4 tries; plain oneTBB shows it: an arena of
    1 slot, 0 reserved, got no worker while a 2-slot arena's task waited, though the cap
    allowed 16), so such a worker's runtime gets two. Workers in processes of their
    own keep the threads asked for."""
    return 2 if threads < 2 and client_pid == os.getpid() else threads


def _error_payload(e, indices):
    import pickle
    import traceback

    pos = e.item if isinstance(e.item, int) else None
    item = int(indices[pos]) if pos is not None and 0 <= pos < len(indices) else None
    cause = e.__cause__
    blob, tb = None, ""
    if cause is not None:
        tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        try:
            blob = pickle.dumps(cause, 5)
            pickle.loads(blob)
        except Exception:
            blob = None
    return {"graph": e.graph, "stage": e.stage, "item": item, "position": pos,
            "message": e.message if e.message is not None else str(e), "cause": blob,
            "cause_text": f"{type(cause).__name__}: {cause}" if cause is not None else None,
            "cause_type": type(cause).__name__ if cause is not None else None,
            "traceback": tb}


def _stop_payload(e):
    import pickle

    from ._procs import _builtin_stop

    builtin = _builtin_stop(e)
    try:
        blob = pickle.dumps(e, 5)
        pickle.loads(blob)
    except Exception:  # its own class takes other arguments: the builtin it derives from
        blob = None
    return {"stop": blob or pickle.dumps(builtin, 5), "builtin": pickle.dumps(builtin, 5),
            "cause_text": f"{type(e).__name__}: {e}"}


def run_split(build, split, indices, seed, epoch, opts):
    """The Dask task: runs one split through the worker's graph. Returns its results (in the
    split's order) and what the worker measured. A remote stage's error is returned, not raised
    (Dask retries only worker deaths; an error is the item's, wherever it runs)."""
    start = time.time()
    t0 = time.perf_counter()
    c0 = time.process_time()
    threads = _in_process_threads(opts["threads"] or _worker_threads(), opts.get("client_pid"))
    g, feed, out = _graph_for(build, seed, epoch, dict(opts, threads=threads))
    feed.indices = [int(i) for i in indices]
    results, positions, nbytes, error = [], [], 0, None
    it = g.iterate(out)
    try:
        for x in it:
            x, n = _to_wire(x)
            results.append(x)
            positions.append(it.item)  # its place in the split (skips leave gaps)
            nbytes += n
    except StageError as e:
        error = _error_payload(e, feed.indices)
    except Exception:
        raise
    except BaseException as e:
        # A KeyboardInterrupt or SystemExit raised in a remote body stops the pass, whatever
        # the stage's on_error, and reaches the loop as itself, as in a local stage. Raised
        # here it would leave the Dask task as such, and Dask closes the worker for it (then
        # retries the split on the next one, and the next).
        error = _stop_payload(e)
    finally:
        it.close()
    stages, skipped = [], []
    try:
        stats = it.run.stats()
    except Exception:
        stats = {}
    for s in stats.get("stages", ()):
        errs = []
        for err in s.get("errors", ()):
            pos = err.get("item")
            e = dict(err)
            if isinstance(pos, int) and 0 <= pos < len(feed.indices):
                e["position"], e["item"] = pos, feed.indices[pos]
            errs.append(e)
        stages.append({"name": s.get("name"), "skipped": int(s.get("skipped", 0) or 0),
                       "errors": errs})
        if s.get("skipped"):
            skipped += [e["item"] for e in errs]
    return {"split": split, "results": results, "positions": positions, "bytes": nbytes, "error": error,
            "worker": _worker_address(), "pid": os.getpid(),
            "busy_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "start": start, "end": time.time(),
            "stages": stages, "skipped": skipped}


# ---- client side -------------------------------------------------------------------------------

def connect(address, timeout=10.0, **kwargs):
    """A ``distributed.Client`` of the scheduler at ``address``, or ``splitflow.Error`` within
    ``timeout`` seconds when it cannot be reached."""
    from distributed import Client

    t0 = time.monotonic()
    try:
        return Client(address, timeout=timeout, set_as_default=False, **kwargs)
    except (OSError, TimeoutError) as e:
        raise Error(f"splitflow.dask: cannot reach the Dask scheduler at {address} within "
                    f"{timeout:g} s ({type(e).__name__}: {e}; waited "
                    f"{time.monotonic() - t0:.1f} s)") from e


def _scheduler_address(client):
    """The address of `client`'s scheduler, or None where it has none now (closed)."""
    try:
        return client.scheduler.address
    except Exception:
        return None


def remote(build, client, items=None, **kwargs):
    """``Remote(build, client, items, ...)``: see Remote."""
    return Remote(build, client, items, **kwargs)


class Remote:
    """A graph segment of CPU stages run on Dask workers, as a source of a local graph.

    build(g, indices, *, seed, epoch) -> node: adds the remote stages after ``indices`` (a
    source of ints: dataset indices) and returns the last one (module level, importable by the
    workers: Dask pickles it by reference). client: a ``distributed.Client``. items: the
    indices, in the local order (default: set by GraphDataset, or ``iterate(indices)``).
    seed, epoch: handed to build (``set_epoch`` changes the epoch). split: "auto" (each split
    about ``split_seconds`` of a worker, measured) or a number of items. max_splits_in_flight:
    splits submitted and not yet consumed (default 2 per worker, at least 2). order: "in_order"
    or "out_of_order". threads: each worker's splitflow runtime threads (default: the Dask
    worker's nthreads). timeout: seconds without progress before the run fails when the
    scheduler does not answer, its connection closed (a client that reconnects within it, to
    a restarted scheduler, gets the splits not yet taken resubmitted) or it has no workers.
    direct: results are fetched from the workers directly (not through the scheduler).
    stuck_after: seconds a split may be on the cluster before the pass warns that a remote
    body may be stuck, naming the split, its items and its worker, and says so in stats()'s
    diagnosis (default: 20 times the median split's, at least 10 s; 60 s before any split
    finished). Dask cannot interrupt a running task: the warning says how to find the body.
    """

    def __init__(self, build, client, items=None, *, seed=0, epoch=0, split="auto",
                 split_seconds=_DEFAULT_SPLIT_S, probe=_PROBE, max_splits_in_flight=None,
                 order="in_order", threads=0, backend="host", max_in_flight=256,
                 timeout=30.0, direct=True, name="remote", stuck_after=None):
        if not callable(build):
            raise TypeError("splitflow.dask.remote: build must be callable (a module-level "
                            "function the workers can import)")
        if getattr(build, "__name__", "") == "<lambda>" or "<locals>" in getattr(build, "__qualname__", ""):
            raise TypeError(f"splitflow.dask.remote: build {getattr(build, '__qualname__', build)!r} "
                            "is not a module-level function; the workers import it by reference, "
                            "as DataLoader workers under spawn do")
        if order in ("in_order", True):
            self.ordered = True
        elif order in ("out_of_order", False):
            self.ordered = False
        else:
            raise GraphError(f"splitflow.dask.remote: order must be 'in_order' or "
                             f"'out_of_order', not {order!r}")
        # Every argument checked here, in the user's call, naming it (a timeout of 0 was taken and
        # no split could finish; 2.7 items a split were 2, split_seconds=-1 made splits of one
        # item, threads=-1 failed at the first pass on a worker, naming splitflow.Runtime: a new
        # user's trial).
        who = "splitflow.dask.remote"
        if split != "auto":
            if isinstance(split, str):
                raise GraphError(f"{who}: split must be 'auto' or a number of items >= 1, not "
                                 f"{split!r}")
            split = _int_arg(who, "split", split, 1)
        max_splits_in_flight = _int_arg(who, "max_splits_in_flight", max_splits_in_flight, 1,
                                        none_ok=True)
        # (The ops take both as unsigned 64-bit numbers.)
        seed = _int_arg(who, "seed", seed, 0, maximum=2**64 - 1)
        epoch = _int_arg(who, "epoch", epoch, 0, maximum=2**64 - 1)
        probe = _int_arg(who, "probe", probe, 1)
        threads = _int_arg(who, "threads", threads, 0)
        max_in_flight = _int_arg(who, "max_in_flight", max_in_flight, 1)
        split_seconds = _seconds_arg(who, "split_seconds", split_seconds)
        # (Past about 1e10 s asyncio's clock overflowed, said as a failure "on the cluster": a
        # verification trial.)
        timeout = _seconds_arg(who, "timeout", timeout, inf_ok=True, maximum=1e9)
        stuck_after = _seconds_arg(who, "stuck_after", stuck_after, none_ok=True, inf_ok=True,
                                   maximum=1e9)
        if backend not in ("auto", "host", "cuda"):
            raise GraphError(f"{who}: backend must be 'auto', 'host' or 'cuda' (each worker's "
                             f"runtime), not {backend!r}")
        if not isinstance(name, str) or not name:
            raise GraphError(f"{who}: name must be a non-empty str, not {name!r}")
        # Refused here, in the user's call, rather than at the first pass; kept as validated (a
        # generator given as items is read once).
        items = None if items is None else _as_indices(items)
        # A client's place: what is not one failed at the first item with "'NoneType' object has
        # no attribute 'submit'" (an address given as the client: a new user's trial).
        from distributed import Client

        if not isinstance(client, Client):
            hint = (f" (an address: sf.dask.connect({client!r}) makes its client)"
                    if isinstance(client, str) else "")
            raise GraphError(f"{who}: client must be a distributed.Client, not "
                             f"{type(client).__name__}{hint}")
        # A closed client can run no pass, and has no scheduler to name: said here, in the
        # user's call (the first pass said "status 'closed', scheduler ?": a new user's trial).
        status = getattr(client, "status", "running")
        if status in ("closing", "closed"):
            raise GraphError(f"splitflow.dask.remote: the Dask client is {status} (status "
                             f"'{status}'): give a connected one, sf.dask.connect(address) or "
                             f"distributed.Client(address)")
        self.build = build
        self.client = client
        # Its scheduler's address while it is connected: a closed client has none to say, and
        # its errors named the scheduler as '?' (a new user's trial).
        self.scheduler_address = _scheduler_address(client)
        self.items = items
        self.stuck_after = stuck_after
        self.seed = seed
        self.epoch = epoch
        self.split = split
        self.split_seconds = split_seconds
        self.probe = probe
        self.max_splits_in_flight = max_splits_in_flight
        self.timeout = timeout
        self.direct = direct
        self.name = name
        self.opts = {"threads": threads, "backend": backend,
                     "max_in_flight": max_in_flight, "name": name,
                     "client_pid": os.getpid()}  # (a worker in this process: _in_process_threads)
        self.last_pass = None
        self._per_item_s = None  # measured cost of an item on a worker (split="auto")

    def __reduce__(self):
        raise TypeError("splitflow.dask.Remote cannot be pickled (it holds a Dask client): use "
                        "it in the process that iterates (GraphDataset with num_workers=0; the "
                        "Dask workers are its processes)")

    def set_epoch(self, epoch):
        self.epoch = _int_arg("splitflow.dask.Remote.set_epoch", "epoch", epoch, 0, maximum=2**64 - 1)

    def source(self, g, name=None):
        """``g.source(name, self)``: this remote segment as the source of the local graph ``g``."""
        return g.source(name or self.name, self)

    @property
    def splitflow_fed_by(self):
        """What produces a local source of it (Graph.source reads it: the local diagnosis
        points at the remote pass instead of at the source)."""
        return _fed_by(self.name)

    def __iter__(self):
        if self.items is None:
            raise Error("splitflow.dask.Remote: no items: give items= (or use it in a GraphDataset)")
        return self._closing(self.iterate(self.items))

    @staticmethod
    def _closing(p):
        # A generator, so that the pass is closed (its splits in flight released on the
        # workers, its figures' clock stopped) when the local run that iterates it ends, however
        # it ends: that run drops its source's iterator then (a pass left early aged until it
        # was closed by hand: a new user's trial).
        try:
            yield from p
        finally:
            p.close()

    def iterate(self, indices, *, seed=None, epoch=None):
        """A pass over ``indices`` (an iterator of the results, in order); ``stats()`` then
        describes it."""
        who = "splitflow.dask.Remote.iterate"
        p = RemotePass(self, indices,
                       self.seed if seed is None else _int_arg(who, "seed", seed, 0, maximum=2**64 - 1),
                       self.epoch if epoch is None else _int_arg(who, "epoch", epoch, 0,
                                                                 maximum=2**64 - 1))
        self.last_pass = p
        return p

    def stats(self):
        """The latest pass's figures (see RemotePass.stats), or {} before any."""
        return self.last_pass.stats() if self.last_pass is not None else {}

    def report(self):
        return self.last_pass.report() if self.last_pass is not None else ""


def _fed_by(name):
    return (f"the remote pass '{name}' on Dask workers (its figures and diagnosis: the remote "
            f"stats, report())")


class _Split:
    __slots__ = ("no", "start", "indices", "future", "submitted", "comm", "fetch_timeouts")

    def __init__(self, no, start, indices, future, submitted):
        self.no, self.start, self.indices = no, start, indices
        self.future, self.submitted = future, submitted
        self.comm = None  # the client's scheduler connection it was submitted through
        self.fetch_timeouts = 0  # its fetches that did not end within timeout


def _as_indices(items):
    """The items as an int64 array of dataset indices, or GraphError naming the first one that
    is not an int (a path, a record: a new user's trial got int()'s "invalid literal")."""
    if isinstance(items, np.ndarray) and items.ndim == 0 or \
            not isinstance(items, (str, bytes)) and not hasattr(items, "__iter__"):
        # (5 failed with "'int' object is not iterable", a 0-d array was one item: a
        # verification trial.)
        raise GraphError(f"splitflow.dask.remote: items are dataset indices, a sequence of "
                         f"ints (items=range(n)), not {items!r} ({type(items).__name__})")
    seq = items if hasattr(items, "__len__") else list(items)
    try:
        a = np.asarray(seq)
    except ValueError as e:  # (a ragged list of lists)
        raise GraphError(f"splitflow.dask.remote: items are dataset indices, one dimension, not "
                         f"{reprlib.repr(seq)} ({e})") from None
    if a.ndim > 1:  # (flattened, [[1, 2], [3, 4]] was four items: a new user's trial)
        raise GraphError(f"splitflow.dask.remote: items are dataset indices, one dimension, not "
                         f"an array of shape {a.shape}")
    # Past int64 (2**63 + 5 wrapped to a negative index: a new user's trial; Python ints past
    # it made an object array, said as "item 0 is 1 (int)": a review).
    top = np.iinfo(np.int64).max
    flat = (a.tolist() if a.dtype.kind == "u" else [] if a.dtype.kind == "i"
            else list(np.asarray(seq, dtype=object).reshape(-1)))
    k, big = next(((k, x) for k, x in enumerate(flat) if isinstance(x, int)
                   and not isinstance(x, bool) and not -top - 1 <= x <= top), (None, None))
    if k is not None:
        raise GraphError(f"splitflow.dask.remote: item {k} is {big}, past the dataset indices "
                         f"(-2**63 .. 2**63 - 1)")
    if a.size and a.dtype.kind not in "iu":  # (flat: the items as objects, made above)
        k, bad = next(((k, x) for k, x in enumerate(flat)
                       if isinstance(x, bool) or not isinstance(x, (int, np.integer))), (0, flat[0]))
        raise GraphError(
            f"splitflow.dask.remote: items are dataset indices (ints), but item {k} is {bad!r} "
            f"({type(bad).__name__}): give the indices (items=range(len(paths))) and look each "
            f"one up in build (sf.ops.read_file(PATHS) reads PATHS[i]); the seed, the epoch's "
            f"order, shards and resume are drawn from the indices")
    return a.astype(np.int64, copy=False).reshape(-1)


def _threads_of(client):
    """The cluster's task slots (its workers' threads), or None when not known."""
    try:
        return sum(int(w.get("nthreads", 1)) for w in
                   client.scheduler_info().get("workers", {}).values()) or None
    except Exception:
        return None


def _workers_of(client):
    try:
        return max(1, len(client.scheduler_info().get("workers", {})))
    except Exception:
        return 1


class RemotePass:
    """One pass of a Remote over its indices: an iterator of the results. ``yielded`` lists
    the dataset index of each item yielded (when the remote graph is one item per index)."""

    def __init__(self, remote, indices, seed, epoch):
        self.remote = remote
        self.client = remote.client
        self.indices = _as_indices(indices)
        self.seed, self.epoch = seed, epoch
        self.key = f"splitflow-{remote.name}-{uuid.uuid4().hex[:12]}"
        self.next_start = 0
        self.splits = itertools.count()
        self.pending = collections.deque()   # submitted, not yet taken (in submission order)
        self.buffer = collections.deque()    # the taken split's results not yet yielded
        self.buffer_indices = collections.deque()
        self.buffer_bytes = 0
        self.yielded = []
        self.cap = None
        self.error = None
        self.done = False
        # figures
        self.t0 = None
        self.t_end = None
        self.wait_s = 0.0
        self.waiting_since = None  # perf_counter() of the wait in progress (_take), for stats()
        self.fill_s = None       # from the start to the first split taken (the pass's fill)
        self.takes = 0           # splits taken after the first (_take) ...
        self.takes_ready = 0     # ... of them done on the workers when the local graph asked
        self.ready_wait_s = 0.0  # the wait in those takes: fetching splits already done
        self.behind_s = 0.0      # of wait_s: for the first split while a later one was done
        self.behind_by = {}      # split no -> wait_behind_s for it (while it is awaited)
        self.holder = None       # (wait behind it, busy_s, split no, first item, last item, worker)
        self.slowest = None      # (busy_s, split no, first item, last item, worker)
        self.split_busy = collections.deque(maxlen=1024)  # busy_s of the latest splits
        self.items_out = 0
        self.splits_done = 0
        self.max_in_flight_seen = 0
        self.worker_threads = None  # the cluster's task slots at the pass's start
        self.max_local_bytes = 0
        self.reconnections = 0   # the scheduler connection lost and found again within timeout
        self.comm = None         # the client's scheduler connection last seen (_start, _lost)
        self.resubmitted = 0     # splits submitted again after a reconnection
        self.last_progress = None  # time.monotonic() of the start or the last split done
        self.latencies = []      # submit -> result taken (s), per split (queueing included)
        self.workers = {}        # address -> figures
        self.split_log = []      # (split, worker address, pid) as taken
        self.split_sizes = []    # items of each split submitted
        self.stuck = {}          # split no -> what was said of a split that may be stuck
        self.last_split_done = None  # time.perf_counter() of the last split taken
        self.fetches = []        # the client's gather of a finished split's result (s)
        self.spans = collections.defaultdict(list)  # worker pid -> [(start, end)] (its clock)
        self.stage_skips = collections.Counter()
        self.skip_errors = []
        self.lock = threading.Lock()

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self.t0 is None:
            self._start()
        self._top_up()
        while not self.buffer:
            if not self.pending:
                self._finish()
                raise StopIteration
            self._take()
            self._top_up()
        x = _from_wire(self.buffer.popleft())
        i = self.buffer_indices.popleft() if self.buffer_indices else None
        self.yielded.append(i)
        self.items_out += 1
        if not self.buffer:
            self.buffer_bytes = 0
        return x

    def close(self):
        """Drops the splits in flight: their futures released, Dask forgets their tasks.
        (Releasing, not client.cancel: this may run in a finalizer, on any thread, where a
        blocking call into the client's event loop could deadlock.)"""
        pending, self.pending = self.pending, collections.deque()
        for s in pending:
            s.future = None
        self._finish()

    def __del__(self):
        try:
            if self.pending:
                self.close()
        except Exception:
            pass

    def _start(self):
        self.t0 = time.perf_counter()
        self.last_progress = time.monotonic()
        self.comm = getattr(self.client, "scheduler_comm", None)
        status = getattr(self.client, "status", "running")
        if status != "running":
            raise Error(f"splitflow.dask: the Dask client is not connected to its scheduler "
                        f"(status '{status}', scheduler {self._address()})")
        r = self.remote
        if r.max_splits_in_flight is not None:
            self.cap = r.max_splits_in_flight
        else:
            self.cap = max(2, 2 * _workers_of(self.client))
        self.worker_threads = _threads_of(self.client)

    def _address(self):
        live = _scheduler_address(self.client)
        if live:  # (a client reconnected to a scheduler restarted elsewhere)
            self.remote.scheduler_address = live
        return live or self.remote.scheduler_address or "?"

    def _split_size(self):
        r = self.remote
        if r.split != "auto":
            return r.split
        per = r._per_item_s
        if per is None:
            return r.probe
        return int(min(_MAX_SPLIT, max(1, math.ceil(r.split_seconds / max(per, 1e-9)))))

    def _top_up(self):
        n = len(self.indices)
        while self.next_start < n and len(self.pending) + (1 if self.buffer else 0) < self.cap:
            if getattr(self.client, "status", "running") != "running":
                if self.pending or self.buffer:
                    return  # the wait deals with it (it resubmits the splits in flight)
                self._lost("the client's connection to the scheduler closed")  # or raises
            size = self._split_size()
            start = self.next_start
            part = self.indices[start:start + size]
            split = _Split(next(self.splits), start, part, None, time.perf_counter())
            self.next_start = start + len(part)
            self.split_sizes.append(len(part))
            self.pending.append(split)
            try:
                self._submit(split)
            except Exception:
                if getattr(self.client, "status", "running") == "running":
                    raise
                return  # the connection went meanwhile: the wait resubmits it with the rest
            in_flight = len(self.pending) + (1 if self.buffer else 0)
            self.max_in_flight_seen = max(self.max_in_flight_seen, in_flight)

    def _submit(self, split, attempt=""):
        r = self.remote
        split.comm = getattr(self.client, "scheduler_comm", None)  # a new one after a reconnection
        split.future = self.client.submit(run_split, r.build, split.no, split.indices, self.seed,
                                          self.epoch, r.opts, key=f"{self.key}-{split.no}{attempt}",
                                          priority=-split.no, pure=False)

    def _take(self):
        """Waits for the next split (the first one, or any when out of order) and takes it."""
        t = self.waiting_since = time.perf_counter()
        if self.fill_s is not None:
            futures = [s.future for s in self.pending if s.future is not None]
            if self.remote.ordered:
                futures = futures[:1]
            self.takes += 1
        ready = self.fill_s is not None and any(f.done() for f in futures)
        self.takes_ready += ready
        try:
            while True:
                split = self._wait()
                out = self._result(split)
                if out is not None:
                    break  # None: the splits were resubmitted after a reconnection
        finally:
            end = time.perf_counter()
            self.waiting_since = None  # (first: stats() on another thread adds it otherwise)
            self.wait_s += end - t
            if ready:
                self.ready_wait_s += end - t
            if self.fill_s is None and self.t0 is not None:
                self.fill_s = end - self.t0
        self.last_progress = time.monotonic()
        self._accept(split, out)

    def _wait(self):
        from distributed import wait as dwait

        poll = max(0.05, min(1.0, self.remote.timeout / 4))
        quiet_since = time.monotonic()
        while True:
            if any(s.future is None for s in self.pending):  # a submission the loss interrupted
                self._lost("the connection closed while splits were submitted")
            if self.remote.ordered:
                first = self.pending[0]
                if first.future.done():
                    self.pending.popleft()
                    return first
                # (Results in order: a later split done waits behind this one. Until one is,
                # the later ones are waited on too, so that the wait behind is counted from
                # the first of them done.)
                later = [p.future for p in itertools.islice(self.pending, 1, None)
                         if p.future is not None]
                behind = any(f.done() for f in later)
                waiting = [first.future] + ([] if behind else later)
            else:
                for s in self.pending:
                    if s.future.done():
                        self.pending.remove(s)
                        return s
                waiting = [s.future for s in self.pending]
                behind = False
            t_wait = time.perf_counter()
            try:
                dwait(waiting, timeout=poll, return_when="FIRST_COMPLETED")
                continue
            except Exception:  # a timeout
                pass
            finally:
                if behind:
                    waited = time.perf_counter() - t_wait
                    self.behind_s += waited
                    self.behind_by[first.no] = self.behind_by.get(first.no, 0.0) + waited
            if self._check_scheduler(quiet_since):
                quiet_since = time.monotonic()  # resubmitted after a reconnection
            self._check_stuck()
            if any(s.future.done() for s in self.pending):
                quiet_since = time.monotonic()

    def _stuck_after(self):
        if self.remote.stuck_after is not None:
            return self.remote.stuck_after
        med = _median(self.latencies)
        return 60.0 if med is None else max(10.0, 20.0 * med)

    def _check_stuck(self):
        """Warns, once a split, of a split on the cluster for longer than stuck_after: a
        remote body may be stuck (a hung pass said nothing, and the local report saw nothing
        standing out: a new user's trial)."""
        limit = self._stuck_after()
        now = time.perf_counter()
        late = [s for s in self._oldest() if s.no not in self.stuck and self._age(s, now) >= limit]
        if not late:
            return
        import warnings

        try:  # which worker runs it (the scheduler's view; a short wait at most)
            processing = self.client.sync(self.client.scheduler.processing, workers=None,
                                          callback_timeout=2.0)
        except Exception:
            processing = {}
        for s in late:
            key = f"{self.key}-{s.no}"
            # (its key, or a resubmission's: `-r<n>` after it; not split 10's for split 1)
            worker = next((w for w, keys in processing.items()
                           if any(str(k) == key or str(k).startswith(key + "-r") for k in keys)),
                          None)
            self.stuck[s.no] = self._stuck_record(s, worker, limit)
            where = f"on worker {worker}" if worker else "on no worker yet"
            warnings.warn(
                f"splitflow.dask: split {s.no} (items {s.start}..{s.start + len(s.indices) - 1} "
                f"of the pass, dataset indices {int(s.indices[0])}...) has been on the cluster for "
                f"{self._age(s, now):.1f} s ({where}; stuck_after={limit:.1f} s, the median split "
                f"took {1e3 * (_median(self.latencies) or 0):.0f} ms): a remote body may be stuck. "
                "Dask cannot interrupt a running task: `py-spy dump --pid <the worker's pid>` shows "
                "where it is; a timeout in the body, or client.restart(), ends it", RuntimeWarning,
                stacklevel=2)

    def _check_scheduler(self, quiet_since):
        """Raises when the scheduler is gone or has not answered for `timeout` seconds; True
        when it answered again (the splits in flight it lost, after a reconnection, submitted
        again)."""
        timeout = self.remote.timeout
        status = getattr(self.client, "status", "running")
        if status != "running":
            return self._lost(f"the client's connection to the scheduler closed (status "
                              f"'{status}')")
        quiet = time.monotonic() - quiet_since
        if quiet < timeout / 2:
            return False
        left = max(0.1, timeout - quiet)
        try:
            ident = self.client.sync(self.client.scheduler.identity, callback_timeout=left)
        except Exception as e:
            if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                # The run has waited `timeout` without progress or an answer already: no more
                # wait for a reconnection (it waited half as long again: a new user's trial saw
                # a hung scheduler fail after 9 s with timeout=6).
                return self._lost(f"it did not answer for {timeout:g} s ({type(e).__name__})",
                                  deadline=quiet_since + timeout)
            # A refused or closed connection (a scheduler restarting): the client reconnects.
            return self._lost(f"its connection failed ({type(e).__name__}: {e})")
        if quiet >= timeout and not ident.get("workers", True):
            # Tasks wait for workers that may never come: say so rather than wait for ever.
            left = int(sum(len(s.indices) for s in self.pending)) + len(self.indices) - self.next_start
            self.error = Error(
                f"splitflow.dask: the Dask scheduler at {self._address()} has no workers and no "
                f"split finished for {quiet:.0f} s (timeout={timeout:g} s); {len(self.pending)} "
                f"splits in flight and {left} items not computed: start workers (`dask worker "
                f"{self._address()}`) or raise timeout for a cluster that scales up slowly")
            self.pending = collections.deque()
            raise self.error
        return False

    def _lost(self, why, split=None, deadline=None):
        """The scheduler's connection closed (or it did not answer): waits for the client to
        reconnect (Dask's client retries on its own, to a scheduler restarted at its address)
        and then submits again, in order, the splits not yet taken that were lost (their
        futures cancelled, or sent through a connection that is gone) and `split`, whose result
        could not be taken (True); raises when it does
        not come back within `timeout` of the last progress (at least half of it from now), or
        by `deadline` (time.monotonic()) where given: a scheduler that did not answer has had
        its `timeout`."""
        lost = sorted(list(self.pending) + ([split] if split is not None else []),
                      key=lambda s: s.no)
        while self._reconnected(deadline):
            # The splits submitted through the connection that answers, their futures alive,
            # were not lost: a slow answer is not a loss (a timeout shorter than a split's work
            # resubmitted every split in flight, again and again, and no split finished: a new
            # user's trial). The others go again, and the split whose result could not be taken
            # (a fetch that did not end: computed again, maybe elsewhere, not fetched again for
            # ever from where it hung: a review).
            comm = getattr(self.client, "scheduler_comm", None)
            if comm is not self.comm:  # a reconnection (Dask's client cancels every future)
                self.reconnections += 1
                self.comm = comm
            stale = [s for s in lost if s is split or s.future is None or s.comm is not comm
                     or s.future.status in ("cancelled", "lost")]
            try:
                for s in stale:
                    self._submit(s, f"-r{self.resubmitted}")
                    self.resubmitted += 1
                    s.submitted = time.perf_counter()
            except Exception:  # lost again meanwhile
                continue
            self.pending = collections.deque(lost)
            return True
        pending = len(lost)
        left = int(sum(len(s.indices) for s in lost)) + len(self.indices) - self.next_start
        self.pending = collections.deque()
        status = getattr(self.client, "status", "running")
        # (A client closed during the pass is not waited for: it said it waited timeout s.)
        waited = (f"the client is {status}: it was closed during the pass, or gave up "
                  f"reconnecting on its own" if status in ("closing", "closed") else
                  f"timeout={self.remote.timeout:g} s without progress or an answer"
                  if deadline is not None else
                  f"the run waited timeout={self.remote.timeout:g} s for the client to reconnect")
        self.error = Error(
            f"splitflow.dask: lost the Dask scheduler at {self._address()}: {why}; "
            f"{pending} splits in flight and {left} items not computed ({waited})")
        raise self.error

    def _reconnected(self, deadline=None):
        """Whether the client is connected to a scheduler that answers, waiting for it until
        the deadline (by default `timeout` after the last progress, at least half of it from
        now)."""
        now = time.monotonic()
        timeout = self.remote.timeout
        if deadline is None:
            deadline = max((self.last_progress or now) + timeout, now + timeout / 2)
        while True:
            status = getattr(self.client, "status", "running")
            if status in ("closing", "closed"):
                return False  # the client gave up (its own connect timeout) or was closed
            if status == "running" and self._scheduler_answers(deadline):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _scheduler_answers(self, deadline):
        try:
            self.client.sync(self.client.scheduler.identity,
                             callback_timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            return True
        except Exception:
            return False

    def _result(self, split):
        from distributed import KilledWorker

        fut = split.future
        status = fut.status
        if status == "cancelled":
            st = getattr(self.client, "status", "running")
            if st != "running" or getattr(self.client, "scheduler_comm", None) is not split.comm:
                self._lost(f"the client's connection to the scheduler closed (status '{st}'); "
                           "Dask cancelled the splits in flight", split)
                return None  # resubmitted (_lost raises otherwise)
            raise Error(f"splitflow.dask: split {split.no} (items {split.start}.."
                        f"{split.start + len(split.indices) - 1}) was cancelled on the cluster")
        t = time.perf_counter()
        try:
            # Bounded: a direct fetch asks the scheduler where the result is first, and a
            # scheduler that hangs then held the pass for ever (a review).
            try:
                out = self.client.sync(self.client._gather, [fut], direct=self.remote.direct,
                                       callback_timeout=(None if math.isinf(self.remote.timeout)
                                                         else self.remote.timeout))[0]
            except (TimeoutError, asyncio.TimeoutError) as e:
                split.fetch_timeouts += 1
                if split.fetch_timeouts >= 2 and self._scheduler_answers(time.monotonic() + 1.0):
                    # Computed again and fetched again, and again not within timeout, the
                    # scheduler answering: the fetch itself takes longer (a timeout of 1e-4 s
                    # resubmitted every split for ever: a verification trial).
                    self.close()
                    self.error = Error(
                        f"splitflow.dask: the fetch of finished split {split.no} (items "
                        f"{split.start}..{split.start + len(split.indices) - 1}) did not end "
                        f"within timeout={self.remote.timeout:g} s, twice, the scheduler "
                        f"answering: a fetch moves a split's results from its worker; raise "
                        f"timeout (or make splits smaller: split=, split_seconds=)")
                    raise self.error from e
                self._lost(f"the fetch of finished split {split.no} did not end within "
                           f"timeout={self.remote.timeout:g} s ({type(e).__name__})", split,
                           deadline=time.monotonic())
                return None  # resubmitted (_lost raises otherwise)
            self.fetches.append(time.perf_counter() - t)
        except KilledWorker as e:
            raise Error(f"splitflow.dask: split {split.no} (items {split.start}.."
                        f"{split.start + len(split.indices) - 1}, dataset indices "
                        f"{int(split.indices[0])}...) failed: the workers running it died too "
                        f"often ({e}); see distributed.scheduler.allowed-failures") from e
        except Exception as e:
            if getattr(self.client, "status", "running") != "running":
                self._lost(f"{type(e).__name__}: {e}", split)
                return None  # resubmitted (_lost raises otherwise)
            if isinstance(e, Error):
                raise
            raise Error(f"splitflow.dask: split {split.no} (items {split.start}.."
                        f"{split.start + len(split.indices) - 1}) failed on the cluster: "
                        f"{type(e).__name__}: {e}") from e
        finally:
            if split.future is fut:  # (not the one _lost submitted again meanwhile)
                split.future = None  # taken once: Dask forgets the result
        return out

    def _accept(self, split, out):
        now = time.perf_counter()
        r = self.remote
        if out["error"] is not None:
            self.close()
            if "stop" in out["error"]:  # an interrupt in a remote body: as itself
                import pickle

                try:
                    stop = pickle.loads(out["error"]["stop"])
                except Exception:  # its class is the workers' only: the builtin it derives from
                    stop = pickle.loads(out["error"]["builtin"])
                try:
                    stop.add_note(f"Raised in a remote body on Dask worker {out['worker']} "
                                  f"(pid {out['pid']}), split {split.no}")
                except Exception:
                    pass
                raise stop
            self.error = self._stage_error(out, split)
            raise self.error
        results = out["results"]
        n_in = len(split.indices)
        busy = float(out["busy_s"])
        w = self.workers.setdefault(out["worker"], {"items": 0, "splits": 0, "busy_s": 0.0,
                                                     "cpu_s": 0.0, "bytes": 0, "skipped": 0,
                                                     "pids": []})
        w["items"] += n_in
        w["splits"] += 1
        w["busy_s"] += busy
        w["cpu_s"] += float(out["cpu_s"])
        w["bytes"] += int(out["bytes"])
        w["skipped"] += len(out["skipped"])
        if out["pid"] not in w["pids"]:
            w["pids"].append(out["pid"])
        for s in out["stages"]:
            if s["skipped"]:
                self.stage_skips[s["name"]] += s["skipped"]
                for e in s["errors"]:
                    e = dict(e, stage=s["name"], worker=out["worker"])
                    if isinstance(e.get("position"), int):
                        # The place in the pass (as a local run's errors[].position), not in
                        # its split (a new user's trial read 5, 2, 21 for items far apart).
                        e["position"] += int(split.start)
                    self.skip_errors.append(e)
        self.latencies.append(now - split.submitted)
        self.split_busy.append(busy)
        if self.slowest is None or busy > self.slowest[0]:
            self.slowest = (busy, split.no, int(split.start), int(split.start + n_in - 1), out["worker"])
        behind = self.behind_by.pop(split.no, 0.0)
        if behind > 0 and (self.holder is None or behind > self.holder[0]):
            self.holder = (behind, busy, split.no, int(split.start), int(split.start + n_in - 1),
                           out["worker"])
        self.last_split_done = now
        self.spans[out["pid"]].append((float(out["start"]), float(out["end"])))
        self.splits_done += 1
        self.split_log.append((split.no, out["worker"], out["pid"]))
        if n_in:
            per = busy / n_in
            r._per_item_s = per if r._per_item_s is None else 0.5 * r._per_item_s + 0.5 * per
        self.buffer.extend(results)
        # Each result's dataset index, from its place in the split (exact whatever the skips:
        # the run's error list, which keeps 64 a stage, lost them past that, and a repeated
        # index skipped twice; a new user's trial).
        positions = out.get("positions") or []
        if len(positions) == len(results) and all(isinstance(p, int) and 0 <= p < n_in for p in positions):
            self.buffer_indices.extend(int(split.indices[p]) for p in positions)
        else:  # the remote graph is not one item per index (it unbatches, say)
            self.buffer_indices.extend([None] * len(results))
        self.buffer_bytes = int(out["bytes"])
        self.max_local_bytes = max(self.max_local_bytes, self.buffer_bytes)

    def _stage_error(self, out, split):
        import pickle

        e = out["error"]
        cause = None
        if e["cause"] is not None:
            try:
                cause = pickle.loads(e["cause"])
            except Exception:
                cause = None
        if cause is None and e["cause_text"]:
            # Its class cannot be rebuilt here (the workers' only, or an __init__ of other
            # arguments): its type and text, as a process stage's.
            from ._errors import RemoteException
            cause = RemoteException(e["cause_text"], e.get("cause_type") or "")
        if cause is not None and e["traceback"]:
            try:
                cause.add_note(f"Traceback on Dask worker {out['worker']} (pid {out['pid']}):\n"
                               f"{e['traceback']}")
            except Exception:
                pass
        item = e["item"]
        place = (f", item {int(split.start) + int(e['position'])} of the pass"
                 if isinstance(e.get("position"), int) else "")
        where = f"dataset index{place}; on Dask worker {out['worker']}, pid {out['pid']}"
        text = (f"splitflow: graph '{e['graph']}': stage '{e['stage']}' failed on item "
                f"{item} ({where}): {e['message']}")
        err = StageError(text, e["graph"], e["stage"], item, e["message"])
        err.worker = out["worker"]
        err.__cause__ = cause
        return err

    def _finish(self):
        if self.t_end is None and self.t0 is not None:
            self.t_end = time.perf_counter()
        self.done = True

    # -- figures --------------------------------------------------------------------------------
    def stats(self):
        """The pass's figures: items, splits, wait_s (the local graph waiting for remote
        results; wait_behind_s of it for a split while a later one was done, results in order,
        and waited_behind_split, the split waited for so the longest: split, items, busy_s,
        worker, wait_s; slowest_split, the most busy_s, and split_busy_s_median), per worker items, splits, busy_s, cpu_s, bytes, skipped; bytes/s; Dask's
        cost per split: gap_s_per_split (median idle time of a worker between two of its
        splits, on its own clock: Dask's per-task cost there while splits are queued),
        fetch_s_per_split (median time the client took to fetch a finished split's results)
        and overhead_s_per_split (their sum); latency_s_per_split (submit to taken, queueing
        included); the largest number of splits in flight and of bytes held locally;
        reconnections to the scheduler and the splits resubmitted after them; skips by
        stage and their errors (dataset index, worker); a diagnosis."""
        end = self.t_end if self.t_end is not None else time.perf_counter()
        wall = (end - self.t0) if self.t0 is not None else 0.0
        # A wait in progress counts as far as it went (read during a pass, a wait of 8 s for a
        # slow split showed as none until it ended: a new user's trial).
        wait = self.wait_s  # (before waiting_since, which _take clears before adding to it)
        since = self.waiting_since
        wait += max(0.0, end - since) if since is not None and self.t_end is None else 0.0
        # Snapshots: stats() may be called from another thread while the pass adds to these.
        workers = {k: dict(v) for k, v in list(self.workers.items())}
        total_bytes = sum(w["bytes"] for w in workers.values())
        busy = sum(w["busy_s"] for w in workers.values())
        items_in = sum(w["items"] for w in workers.values())
        gaps = []
        for spans in list(self.spans.values()):
            spans = sorted(spans)
            gaps += [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
        gap, fetch = _median(gaps), _median(list(self.fetches))
        s = {
            "name": self.remote.name, "items": len(self.indices), "items_out": self.items_out,
            "splits": self.splits_done,
            "split_items": _median(list(self.split_sizes)), "split_items_next": self._split_size(),
            "max_splits_in_flight": self.cap, "splits_in_flight_max": self.max_in_flight_seen,
            "local_bytes_max": self.max_local_bytes,
            "reconnections": self.reconnections, "resubmitted_splits": self.resubmitted,
            "wall_s": wall, "wait_s": wait, "wait_behind_s": self.behind_s,
            "fill_s": self.fill_s if self.fill_s is not None else wall,
            "waiting_for_split": self._waiting_for(end) if since is not None and self.t_end is None else None,
            "splits_done_when_asked": [self.takes_ready, self.takes],
            "wait_for_done_splits_s": self.ready_wait_s,
            "waited_behind_split": None if self.holder is None else {
                "split": self.holder[2], "items": [self.holder[3], self.holder[4]],
                "busy_s": self.holder[1], "worker": self.holder[5], "wait_s": self.holder[0]},
            "slowest_split": None if self.slowest is None else {
                "split": self.slowest[1], "items": [self.slowest[2], self.slowest[3]],
                "busy_s": self.slowest[0], "worker": self.slowest[4]},
            "split_busy_s_median": _median(list(self.split_busy)),
            "bytes": total_bytes, "bytes_per_s": total_bytes / wall if wall > 0 else 0.0,
            "worker_busy_s": busy,
            "item_s": busy / items_in if items_in else None,
            "gap_s_per_split": gap, "fetch_s_per_split": fetch,
            "overhead_s_per_split": None if gap is None or fetch is None else gap + fetch,
            "latency_s_per_split": _median(list(self.latencies)),
            "workers": workers,
            "worker_threads": self.worker_threads,
            "skipped": sum(self.stage_skips.values()),
            "skipped_by_stage": dict(self.stage_skips),
            "errors": list(self.skip_errors),
            "stuck_splits": self._stuck_figures(),
        }
        s["diagnosis"] = self.diagnose(s)
        return s

    def _oldest(self):
        """The split in flight submitted first (the others may wait behind it), as a list."""
        # (a split done but not yet taken, behind a slow local graph, is not on the cluster)
        live = [p for p in list(self.pending) if p.future is not None and not p.future.done()]
        return [min(live, key=lambda p: p.submitted)] if live else []

    def _waiting_for(self, now):
        """The split a wait in progress is for (results in order: the first in flight), while
        it is on the cluster: split, items, on_cluster_s."""
        pending = list(self.pending)
        if not self.remote.ordered or not pending:
            return None
        s = pending[0]
        if s.future is None or s.future.done():
            return None
        return {"split": s.no, "items": [s.start, s.start + len(s.indices) - 1],
                "on_cluster_s": max(0.0, now - s.submitted)}

    def _age(self, s, now):
        """How long `s` has been on the cluster with no split finishing meanwhile (a split
        queued behind a slow one is not counted as slow itself)."""
        return now - max(s.submitted, self.last_split_done or s.submitted)

    @staticmethod
    def _stuck_record(s, worker, limit):
        return {"split": s.no, "items": [int(s.start), int(s.start + len(s.indices) - 1)],
                "first_index": int(s.indices[0]) if len(s.indices) else None,
                "worker": worker, "limit_s": limit}

    def _stuck_figures(self):
        """The splits past stuck_after: those on the cluster now (whoever asks, while the pass
        waits for them) and those said so before (on_cluster False once done)."""
        limit = self._stuck_after()
        now = time.perf_counter()
        out, on = [], set()
        for p in self._oldest():
            if self._age(p, now) >= limit:
                d = self.stuck.get(p.no) or self._stuck_record(p, None, limit)
                out.append(dict(d, on_cluster=True, age_s=self._age(p, now)))
                on.add(p.no)
        out += [dict(d, on_cluster=False, age_s=None) for no, d in list(self.stuck.items())
                if no not in on]
        return sorted(out, key=lambda d: d["split"])

    @staticmethod
    def diagnose(s):
        """The diagnosis of a pass's figures (``stats()`` without "diagnosis"): one sentence."""
        stuck = [d for d in s.get("stuck_splits", ()) if d["on_cluster"]]
        if stuck:
            d = stuck[0]
            return (f"split {d['split']} (items {d['items'][0]}..{d['items'][1]}, dataset indices "
                    f"{d['first_index']}...) has been on the cluster for {d['age_s']:.0f} s "
                    f"({'on worker ' + d['worker'] if d['worker'] else 'on no worker yet'}; "
                    f"stuck_after {d['limit_s']:.1f} s): a remote body may be stuck"
                    + (f"; {len(stuck) - 1} more splits too" if len(stuck) > 1 else ""))
        wall, wait = s["wall_s"], s["wait_s"]
        if wall <= 0 or not s["splits"]:
            return "no split completed yet"
        # Judged after the fill (the first split's work, round trip and fetch before any
        # result: in a short pass a large part of it, which more workers or larger splits do not
        # shorten; a new user's trial of 150 items was told "larger splits would cut it" with
        # the training loop the bottleneck), which the text states apart.
        whole = wall  # (the workers' busy time counts the fill's work too: judged over it)
        fill = min(s.get("fill_s") or 0.0, wall, wait)
        filled = (f" after its first results ({fill:.2f} s before them: the first split's work, "
                  f"round trip and fetch)") if fill >= 0.1 * wall else ""
        wall, wait = wall - fill, wait - fill
        if wall <= 0:
            return "the pass has had its first results only"
        workers = max(1, len(s["workers"]))
        frac = wait / wall
        busy_s = s["worker_busy_s"]
        per_worker = (s["items_out"] + s["skipped"]) / busy_s if busy_s else 0
        local_s = wall - wait
        if frac < 0.1 or per_worker <= 0:
            return (f"the remote workers keep up: the local graph waited {100 * frac:.0f}% of "
                    f"the run for remote results{filled}")
        split_s = busy_s / s["splits"]
        typical = s.get("split_busy_s_median") or split_s
        on = s.get("waiting_for_split")
        if on is not None and on["on_cluster_s"] >= max(4 * typical, 0.5) and \
                on["on_cluster_s"] >= 0.25 * wait:
            # Read during a pass, while it waits for one slow split (not yet done: its work is
            # in no figure; a verification trial read "not their compute but moving splits").
            return (f"the local graph is waiting for split {on['split']} (items "
                    f"{on['items'][0]}..{on['items'][1]}), on the cluster for "
                    f"{on['on_cluster_s']:.1f} s against {1e3 * typical:.0f} ms a split's median: "
                    f"a slow item in it holds the results, in order, behind it (its remote "
                    f"stages' figures name the stage once it is done); order='out_of_order' lets "
                    f"the results past a slow split")
        ready, takes = s.get("splits_done_when_asked") or (0, 0)
        fetch = s.get("fetch_s_per_split")
        if takes >= 2 and ready >= 0.75 * takes and fetch is not None and \
                (s.get("wait_for_done_splits_s") or 0.0) >= 0.75 * wait:
            # The workers were ahead: the waits were the fetches of finished splits, taken when
            # the local graph asked for them (a trial's training loop was the bottleneck, and
            # this said "not their compute but moving splits": larger splits). Where those
            # waits are half the run or more, the fetches are the limit (a verification trial:
            # a fast consumer waited 79% and was told its own bottleneck set the pace).
            text = (f"the remote workers keep up: {ready} of {takes} splits were done when the "
                    f"local graph asked for them; it waited {100 * frac:.0f}% of the run"
                    f"{filled} for their fetches ({1e3 * fetch:.0f} ms a split through Dask's "
                    f"client)")
            if frac >= 0.5:
                return text + (": those fetches are the limit; larger splits (split=) make "
                               "fewer of them")
            return text + (": the local graph's own bottleneck (its report) sets the pace, and "
                           "where its loop waits on this source, larger splits (split=) make "
                           "fewer fetches")
        # How busy the workers' task slots were: a pipeline of splits that leaves them idle is
        # not made faster by more workers (a trial's workers were 44-62% busy when this said
        # "add workers").
        # Splits that can run at once: the workers' Dask threads, at most the splits let out
        # (each split's graph uses its worker's runtime threads, all of them).
        slots = max(1, min(int(s.get("worker_threads") or workers),
                           int(s.get("max_splits_in_flight") or workers)))
        # Over the whole pass: the workers' busy time has the fill's splits in it (over the
        # pass after the fill, a trial read "the workers busy 202%").
        busy_frac = min(1.0, busy_s / (whole * slots))
        cost = s.get("overhead_s_per_split")
        behind = s.get("wait_behind_s") or 0.0
        slow = s.get("waited_behind_split")
        if busy_frac < 0.75 and behind >= 0.25 * wait and slow is not None:
            # In order, a slow split holds back the done ones after it (a trial: one body of
            # 4 s, the other worker idle behind it, and this said "the results' transport ...
            # or the scheduler may be the limit").
            return (f"the local graph waited {100 * frac:.0f}% of the run for remote results{filled}, "
                    f"{behind:.2f} s of it for an earlier split while later ones were done: "
                    f"results come in order, and split {slow['split']} (items "
                    f"{slow['items'][0]}..{slow['items'][1]}, on {slow['worker']}) took "
                    f"{slow['busy_s']:.2f} s of work against {1e3 * typical:.0f} ms a split's median "
                    f"({slow['wait_s']:.2f} s waited behind it); order='out_of_order' "
                    f"lets the results past a slow split, and smaller splits (split=) shorten "
                    f"the wait behind one")
        longest = s.get("slowest_split")
        if busy_frac < 0.75 and longest is not None and longest["busy_s"] >= 4 * typical and \
                longest["busy_s"] >= 0.25 * wait:
            # One split far slower than the rest, nothing left for the other workers meanwhile
            # (the pass's last, or out of order: no split waited behind it).
            return (f"the local graph waited {100 * frac:.0f}% of the run for remote results{filled}, the "
                    f"workers' {slots} task slots busy {100 * busy_frac:.0f}%: split "
                    f"{longest['split']} (items {longest['items'][0]}..{longest['items'][1]}, on "
                    f"{longest['worker']}) took {longest['busy_s']:.2f} s of work, "
                    f"{longest['busy_s'] / typical:.0f} times a split's median "
                    f"({1e3 * typical:.0f} ms), with little else left to run: a slow item in it "
                    f"(its remote stages' figures name the stage) is the limit, not the transport")
        if busy_frac < 0.75:
            text = (f"the local graph waited {100 * frac:.0f}% of the run for remote results{filled}, but "
                    f"the workers' {slots} task slots were busy only {100 * busy_frac:.0f}% of the pass: "
                    f"not their compute but moving splits to and from them")
            if s["splits_in_flight_max"] < slots:
                text += (f"; only {s['splits_in_flight_max']} splits were in flight for {slots} "
                         f"slots: raise max_splits_in_flight")
            elif cost is not None and cost > 0.2 * split_s:
                text += (f"; Dask's cost per split ({1e3 * cost:.0f} ms: worker gap and fetch) is "
                         f"{100 * cost / split_s:.0f}% of a split's {1e3 * split_s:.0f} ms of work: "
                         f"larger splits (split_seconds=, or split=) would cut it")
            else:
                text += "; the results' transport (bytes_per_s) or the scheduler may be the limit"
            return text
        local_rate = s["items_out"] / local_s if local_s > 0 else float("inf")
        need = math.ceil(local_rate / per_worker) if math.isfinite(local_rate) else None
        text = (f"remote workers are the bottleneck: the local graph waited {100 * frac:.0f}% of "
                f"the run for remote results{filled}, the workers busy {100 * busy_frac:.0f}%; a worker "
                f"makes {per_worker:.0f} items/s busy, the local graph takes {local_rate:.0f} "
                f"items/s when fed")
        if need is not None:
            more = max(0, need - workers)
            text += f": about {need} workers would feed it ({more} more than the {workers} used)"
        return text

    @property
    def splitflow_fed_by(self):
        """What produces a local source of this pass (Graph.source reads it)."""
        return _fed_by(self.remote.name)

    def report(self):
        s = self.stats()
        lines = [f"remote '{s['name']}': {s['items_out']} items from {s['splits']} splits on "
                 f"{len(s['workers'])} Dask workers in {s['wall_s']:.2f} s; local wait "
                 f"{s['wait_s']:.2f} s; {s['bytes'] / 1e6:.1f} MB ({s['bytes_per_s'] / 1e6:.1f} "
                 f"MB/s); Dask per split: worker gap {1e3 * (s['gap_s_per_split'] or 0):.1f} ms, fetch "
                 f"{1e3 * (s['fetch_s_per_split'] or 0):.1f} ms"
                 f"; skipped {s['skipped']}"]
        for addr, w in sorted(s["workers"].items()):
            lines.append(f"  {addr}: {w['items']} items, {w['splits']} splits, busy "
                         f"{w['busy_s']:.2f} s, {w['bytes'] / 1e6:.1f} MB, skipped {w['skipped']}")
        lines.append(f"  diagnosis: {s['diagnosis']}")
        return "\n".join(lines)


def _median(xs):
    if not xs:
        return None
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])
