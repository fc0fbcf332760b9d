"""splitflow graphs as PyTorch datasets.

    import splitflow as sf, splitflow.torch as sft, torch

    def build(g, indices):                     # indices: a source of dataset indices
        load = g.stage("load", lambda i: my_dataset[i], concurrency=2)
        norm = g.stage("norm", sf.ops.normalize(mean, std), concurrency=0)
        indices >> load >> norm
        return norm                            # the last stage; its items are the samples

    ds = sft.GraphDataset(build, len(my_dataset), shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)   # num_workers=0: recommended
    for epoch in range(3):
        ds.set_epoch(epoch)
        for sample in loader: ...

Recommended: ``num_workers=0``. splitflow already runs the stages on its own threads (C++ ops
without the GIL, in parallel); worker processes would each start another thread pool. Python
stages serialise on the GIL, so keep the heavy per-item work in C++ ops.

With ``num_workers > 0`` every worker builds its own runtime after the fork (a CPU-only graph
never touches CUDA, so forking is safe) and takes its share of the items. oneTBB's threads do
not survive a fork: if this process already ran graphs (which starts them; creating a
``Runtime`` does not), a forked worker raises ``splitflow.Error`` (rather than hang); create
the loader with ``multiprocessing_context="spawn"`` (or ``"forkserver"``) then.

Order and sharding: each epoch's order is ``torch.randperm(length)`` seeded with
``seed + epoch`` (or 0..length-1 without shuffle); rank r of w takes positions r, r+w, ...
(its "shard", in that order); worker k of n takes the shard's positions p with p % n == k
(rotated after a resume). Items come out in that order (unless a stage runs out of order).

Resume (``state_dict`` / ``load_state_dict``) records which positions of the shard the training
loop took, so that the resumed epoch yields exactly the others:

- with ``num_workers=0`` the dataset sees what it yields: nothing to pass;
- with DataLoader workers it does not: iterate ``ds.track(loader)`` instead of ``loader``, or
  pass ``state_dict(batches_seen=k, loader=loader)`` (DataLoader takes batches from its workers
  round-robin, worker 0 first, skipping the ones that are done: from k, its batch_size and
  num_workers the dataset knows how many batches each worker gave; a DataLoader of torch
  2.6+ with ``in_order=False`` does not keep that order: then only the index field is exact).

What is guaranteed:

- exact (no sample repeated, none lost) when the samples carry their dataset index (a dict's
  ``"index"`` field, as ``read_file(paths, labels=...)`` makes; ``index_field=`` names another)
  and the dataset sees the items (num_workers=0, or ``track(loader)``), whatever the batching,
  the skips and the stages' order;
- otherwise the dataset counts samples (an item made by ``g.batch`` holds as many as its
  leading dimension; with workers: the loader's batches, each worker's in turn): exact when the
  graph keeps the order and skips nothing (with ``remote=``, which iterates with num_workers=0,
  the samples counted are matched to the dataset indices the remote pass yielded, so its
  remote skips stay exact too; not through ``track(loader)`` or ``batches_seen=``). Each sample
  skipped before the save point then makes
  one sample already taken come again after the resume (none is lost while the graph keeps the
  order), and a stage out of order can repeat or lose samples of its window around the save
  point;
- a sample skipped before the save (never yielded) is read again after the resume (and skipped
  again if it fails again). A state saved after the whole epoch resumes to an empty epoch.
- the resumed epoch yields the rest in the epoch's order; with DataLoader workers and the same
  num_workers and batch_size as when saved (and a graph that keeps the order and skips
  nothing), the very batches the unbroken epoch would have yielded.
"""
import collections
import copy
import os
import warnings

import numpy as np
import torch
import torch.utils.data as _data

from . import _core
from ._errors import GraphError, StageError, _int_arg, _not_a_node
from ._tuples import rebuilt

__all__ = ["GraphDataset", "to_torch"]


def to_torch(x, _where="the item"):
    """splitflow.Tensor -> torch.Tensor (zero-copy, DLPack), inside tuples, lists and dicts.
    A dtype this torch lacks (torch 1.13: uint16, uint32, uint64) raises TypeError naming the
    field, its dtype and shape."""
    if isinstance(x, _core.Tensor):
        if x.dtype == "bool" and x.device == "cpu":
            # (torch 1.13's DLPack has no bool: "Unsupported code 6"; NumPy's buffer view, still
            # no copy.)
            return torch.from_numpy(np.asarray(x))
        try:
            return torch.utils.dlpack.from_dlpack(x)
        except RuntimeError as e:
            if not x.dtype.startswith("uint"):
                raise
            wider = {"uint16": "int32"}.get(x.dtype, "int64")
            raise TypeError(
                f"splitflow.torch.to_torch: {_where} is a {x.dtype} tensor of shape "
                f"{tuple(x.shape)}, a dtype torch {torch.__version__} does not have ({e}); "
                f"convert it in the graph (e.g. a stage returning "
                f"arr.astype(numpy.{wider})), as default_collate would need too") from None
    if isinstance(x, tuple):
        return rebuilt(x, (to_torch(v, f"{_where}[{i}]") for i, v in enumerate(x)))
    if isinstance(x, list):
        return [to_torch(v, f"{_where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        return {k: to_torch(v, f"{_where}[{k!r}]") for k, v in x.items()}
    return x


def _copy(x):
    """A copy of an item's tensors and arrays (inside tuples, lists and dicts), for an item
    yielded twice: a loop that changes a batch in place must not change its repeat."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, tuple):
        return rebuilt(x, (_copy(v) for v in x))
    if isinstance(x, list):
        return [_copy(v) for v in x]
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


def _warn_skipped(run, worker):
    """In a DataLoader worker, items its stages skipped (on_error='skip') or substituted are
    said as a warning at the end of its shard: the run's stats, which name them, stay in the
    worker's process (the main process's ``last_run`` is None), so they were lost silently."""
    try:
        stages = run.stats().get("stages", [])
    except Exception:  # (the figures are a courtesy here: never fail the epoch for them)
        return
    said = []
    for st in stages:
        n, m = st.get("skipped", 0), st.get("substituted", 0)
        if not n and not m:
            continue
        first = (st.get("errors") or [{}])[0]
        item = first.get("item")  # (DatasetRun.stats(): the dataset index)
        what = ", ".join(f"{k} {v}" for k, v in (("skipped", n), ("substituted", m)) if v)
        said.append(f"stage '{st.get('name')}' {what} (the first recorded: dataset index {item}: "
                    f"{first.get('message', '?')})")
    if said:
        warnings.warn(f"GraphDataset: DataLoader worker {worker}: " + "; ".join(said) +
                      " (with num_workers=0, ds.last_run.stats() names every one)", stacklevel=3)


def _name_dataset_index(e, indices):
    """A StageError names the item's position in the run (its source's order); here that
    position maps to a dataset index: the error names the index, and keeps the position."""
    pos = e.item
    if not isinstance(pos, int) or not 0 <= pos < len(indices) or indices[pos] is None:
        return
    e.position, e.item = pos, int(indices[pos])
    text = str(e).replace(f"failed on item {pos}:",
                          f"failed on item {e.item} (dataset index; {pos} in this run):", 1)
    e.args = (text,) + tuple(e.args[1:])


class DatasetRun:
    """``GraphDataset.last_run``: the latest epoch's ``splitflow.Run`` (every method of it), whose
    ``stats()`` name dataset indices: each stage's ``errors[].item`` is the dataset index of the
    item that failed or was skipped (for an item made by ``g.batch``: its first sample's), and
    ``errors[].position`` its position in the run (the source's order), which the plain run
    reports as ``item``."""

    def __init__(self, run, indices, remote=None):
        self.run = run
        self.indices = indices
        self.remote = remote  # a splitflow.dask.RemotePass when the dataset runs remotely

    def stats(self):
        """The run's stats; with a remote source also ``"remote"``: the remote pass's figures
        (splitflow.dask.RemotePass.stats: per worker items, busy, bytes; the local wait)."""
        s = self.run.stats()
        for stage in s.get("stages", ()):
            for err in stage.get("errors", ()):
                pos = err.get("item")
                if isinstance(pos, int) and 0 <= pos < len(self.indices) \
                        and self.indices[pos] is not None:
                    err["position"], err["item"] = pos, int(self.indices[pos])
        if self.remote is not None:
            s["remote"] = self.remote.stats()
        return s

    def report(self):
        text = self.run.report()
        if self.remote is not None:
            text = text.rstrip("\n") + "\n" + self.remote.report() + "\n"
        return text

    def json(self):
        """The run's JSON summary (``Run.json``); with a remote source also ``"remote"``, the
        remote pass's figures as in ``stats()``."""
        text = self.run.json()
        if self.remote is None:
            return text
        import json as _json
        s = _json.loads(text)
        s["remote"] = self.remote.stats()
        return _json.dumps(s)

    def __getattr__(self, name):
        return getattr(self.run, name)

    def __repr__(self):
        return f"DatasetRun({self.run!r})"


def _distributed_rank():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _distributed_initialised():
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _steps(n, batch):
    """The steps n samples make: n, or the batches of a (size, drop_last) batch."""
    if batch is None:
        return n
    size, drop = batch
    return n // size if drop else -(-n // size)


def _rank_text(rank, world, info):
    """"rank r of w", with the DataLoader worker's id where there is one."""
    return f"rank {rank} of {world}" + (f", DataLoader worker {info.id}" if info is not None else "")


class _Graph(_core.Graph):
    """The graph handed to build(): a splitflow.Graph that notes the batches it makes."""

    def batch(self, name, size, drop_last=False):
        self._batches.append((int(size), bool(drop_last)))
        return super().batch(name, size, drop_last)

    def unbatch(self, *args, **kwargs):
        self._batches.append(None)
        return super().unbatch(*args, **kwargs)

    def made_batches(self):
        """(size, drop_last) of the graph's batching, or None when it does not batch (last)."""
        batches = getattr(self, "_batches", [])
        return batches[-1] if batches else None


# -- what the loop took: positions of the rank's shard ----------------------------------------------

def _index_values(v):
    """An index field as a 1-d int64 array, or None when it does not hold integers."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return np.array([int(v)], dtype=np.int64)
    try:
        if isinstance(v, torch.Tensor):
            a = v.detach().cpu().numpy()
        elif isinstance(v, (_core.Tensor, np.ndarray, list, tuple)):
            a = np.asarray(v)
        else:
            return None
    except (TypeError, ValueError, RuntimeError, BufferError):
        return None
    if a.dtype.kind not in "iu":
        return None
    return a.reshape(-1).astype(np.int64, copy=False)


def _field(item, key):
    if key is None:
        return None
    if isinstance(item, dict):
        return item.get(key)
    if isinstance(item, (tuple, list)) and isinstance(key, int) and not isinstance(key, bool) \
            and -len(item) <= key < len(item):
        return item[key]
    return None


def _leading(x):
    """How many samples an item made by g.batch holds: its tensors' leading dimension (a dict,
    or a list of columns, as a batch of tuples or lists is: its first field's), a list of
    samples' length."""
    if isinstance(x, (_core.Tensor, torch.Tensor, np.ndarray)):
        return int(x.shape[0]) if len(x.shape) else None
    if isinstance(x, dict):
        x = list(x.values())
    elif isinstance(x, list) and not (x and isinstance(
            x[0], (_core.Tensor, torch.Tensor, np.ndarray, dict, list))):
        return len(x)  # (a batch's field of objects that do not stack: one per sample)
    if isinstance(x, (tuple, list)):
        for v in x:
            n = _leading(v)
            if n is not None:
                return n
    return None


def _ranges(done):
    """[[start, stop), ...] of the True runs of a bool array."""
    d = np.diff(np.concatenate(([0], done.astype(np.int8), [0])))
    return [[int(a), int(b)] for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))]


class _Resume:
    """A loaded state: the shard's positions done, and the worker whose batch was next."""

    def __init__(self, done, workers=1, next_worker=0):
        self.done, self.workers, self.next_worker = done, int(workers), int(next_worker)
        self.kept = False  # set_epoch kept it once (its epoch's iteration follows)


def _rotation(base, remaining, workers):
    """Worker k takes the remaining positions p with p % workers == (k + rotation) % workers.
    Resumed with the saving loader's num_workers, worker 0 continues the one whose batch was
    next (the same batches as without the break); else the first remaining position's
    (samples taken one at a time then continue in order)."""
    if workers <= 1:
        return 0
    if base is not None and base.workers == workers:
        return base.next_worker % workers
    return int(remaining[0]) % workers if len(remaining) else 0


def _assign(remaining, workers, worker, rotation):
    if workers <= 1:
        return remaining
    return remaining[remaining % workers == (worker + rotation) % workers]


def _round_robin(batches, taken):
    """DataLoader asks its workers in turn, 0, 1, ..., skipping those that are done: after
    `taken` batches, how many each worker gave, and the worker asked next."""
    workers = len(batches)
    counts = [0] * workers
    t = 0  # full rounds
    while taken > 0:
        active = [j for j in range(workers) if batches[j] > t]
        if not active:
            break
        full = min(min(batches[j] for j in active) - t, taken // len(active))
        if full > 0:
            for j in active:
                counts[j] += full
            t += full
            taken -= full * len(active)
            continue
        for j in active[:taken]:
            counts[j] += 1
        return counts, active[taken]
    active = [j for j in range(workers) if batches[j] > t]
    return counts, (active[0] if active else 0)


class _Progress:
    """What the training loop took of one epoch's shard, as positions in the rank's order:
    from the items' index field (exact) or by counting samples."""

    def __init__(self, ds, base, workers):
        self.epoch = ds.epoch
        self.length = ds.length
        self.index_field = ds.index_field
        self.order = np.asarray(ds.rank_indices(), dtype=np.int64)
        self.base = base
        self.base_done = base.done if base is not None else np.zeros(len(self.order), bool)
        if len(self.base_done) != len(self.order):
            raise GraphError("GraphDataset: the loaded state's shard has "
                             f"{len(self.base_done)} positions, this one {len(self.order)}")
        remaining = np.flatnonzero(~self.base_done)
        self.workers = max(1, int(workers))
        self.rotation = _rotation(base, remaining, self.workers)
        self.lists = [_assign(remaining, self.workers, j, self.rotation)
                      for j in range(self.workers)]
        self.taken = self.base_done.copy()  # base + the positions the index field named
        self.by_index = None   # None: no item yet; True: every item named its indices
        self.samples = 0       # samples counted (num_workers=0)
        # num_workers=0, samples without an index, no g.batch: each one's place in the run (the
        # pull sink's item number: its source item's), so that skips and an out-of-order stage
        # leave the state exact; None once an item came without one (or a place came twice).
        self.run_places = np.zeros(len(self.lists[0]), bool)
        self.placed = 0
        self.batches = 0       # batches the loop took (track())
        self.complete = False  # the iteration ended: every position settled
        # A remote pass (remote=): the dataset index of each item its source yielded, in order
        # (splitflow.dask's `yielded`; None where a remote item is not one index's).
        self.yielded = None
        self._pos_of = None
        self._dups = None

    # index field -> positions
    def _positions(self, idx):
        if idx.size == 0:
            return idx
        if idx.min() < 0 or idx.max() >= self.length:
            return None
        if self._pos_of is None:
            uniq, first = np.unique(self.order, return_index=True)
            self._pos_of = np.full(self.length, -1, np.int64)
            self._pos_of[uniq] = first
            self._dups = {}
            if len(uniq) < len(self.order):  # even_shards="pad": an index at two positions
                values, counts = np.unique(self.order, return_counts=True)
                for x in values[counts > 1].tolist():
                    self._dups[x] = np.flatnonzero(self.order == x).tolist()
        p = self._pos_of[idx]
        if (p < 0).any():
            return None
        if self._dups:
            p = p.copy()
            for k, x in enumerate(idx.tolist()):
                if x in self._dups:
                    free = [q for q in self._dups[x] if not self.taken[q] and q not in p[:k]]
                    if not free:
                        return None
                    p[k] = free[0]
        if self.taken[p].any() or len(np.unique(p)) != len(p):
            return None
        return p

    def _note_indices(self, item):
        """Records the item's indices; False when it names none (or not this shard's)."""
        if self.by_index is False:
            return False
        v = _field(item, self.index_field)
        if self._pos_of is not None and isinstance(v, int) and not isinstance(v, bool) \
                and not self._dups and 0 <= v < self.length:  # one sample: the quick way
            p = int(self._pos_of[v])
            if p >= 0 and not self.taken[p]:
                self.taken[p] = True
                return 1
        idx = _index_values(v) if v is not None else None
        p = self._positions(idx) if idx is not None else None
        if p is None:
            if v is not None or self.by_index:
                warnings.warn(
                    f"GraphDataset: an item's {self.index_field!r} field is "
                    f"{'missing' if v is None else 'not an unseen dataset index of this shard'}"
                    ": state_dict() takes each sample's place in the run instead (exact with "
                    "num_workers=0 and no g.batch; otherwise it counts samples, exact only when "
                    "the graph keeps the order and skips nothing); index_field=None says the "
                    "samples carry no index", stacklevel=4)
            self.by_index = False
            return False
        self.by_index = True
        self.taken[p] = True
        return len(p)

    def _remote_positions(self, n):
        """The positions of the first n samples a remote pass yielded (its skipped items are
        not among them: counting the shard's positions instead marked a skipped one done and
        left the n-th sample to come again after the resume), or None without a remote pass
        or where its items are not one index's each."""
        if self.yielded is None:
            return None
        first = list(self.yielded[:n])
        if len(first) < n or any(i is None for i in first):
            return None
        at = {}
        for p in self.lists[0].tolist():
            at.setdefault(int(self.order[p]), collections.deque()).append(p)
        out = []
        for i in first:
            q = at.get(int(i))
            if not q:
                return None
            out.append(q.popleft())
        return np.asarray(out, dtype=np.int64)

    def took_item(self, item, batch_size, place=None):
        """num_workers=0: the dataset yielded `item`, `place` in its run (None: unknown)."""
        n = self._note_indices(item)
        if n is False:
            n = 1
            if batch_size is not None:
                n = _leading(item)
                n = batch_size if n is None else n
            if self.run_places is not None:
                # (A place given twice, one index's two samples, makes it no place per sample.)
                if batch_size is None and place is not None and 0 <= place < len(self.lists[0]) \
                        and not self.run_places[place]:
                    self.run_places[place] = True
                    self.placed += 1
                else:
                    self.run_places = None
        self.samples += n

    def leave_positions(self, n):
        """The repeats of even_shards: marks positions not taken done until n are left (as
        many as the steps left need), so that a state taken among the repeats resumes with
        them. Exact where positions are known (the index field, a run's places)."""
        if self.by_index:
            left = self.lists[0][~self.taken[self.lists[0]]]
            self.taken[left[:max(0, len(left) - n)]] = True
        elif self.run_places is not None and self.placed == self.samples:
            left = np.flatnonzero(~self.run_places)
            mark = left[:max(0, len(left) - n)]
            self.run_places[mark] = True
            self.placed += len(mark)
            self.samples += len(mark)

    def took_batch(self, batch):
        """track(): the loop took one of the DataLoader's batches."""
        self._note_indices(batch)
        self.batches += 1

    def state(self, batches=None, loader_batch=1, loader_drop_last=False, graph_batch=None,
              items=None):
        """(done: bool array of the shard's positions, next worker, by_index)."""
        workers = self.workers
        next_worker = 0
        if items is not None:  # samples taken one at a time, in order: a prefix of the shard
            done = np.zeros(len(self.order), bool)
            done[:max(0, int(items))] = True
            return done, 1, 0, False
        if self.complete:
            return np.ones(len(self.order), bool), workers, 0, bool(self.by_index)
        size, drop = graph_batch if graph_batch is not None else (1, False)
        if batches is None and workers == 1:  # counted here, one item at a time
            if self.by_index:
                return self.taken.copy(), 1, 0, True
            done = self.base_done.copy()
            remote = self._remote_positions(self.samples)
            if remote is None and self.run_places is not None and self.placed == self.samples:
                # (Counting took the first n places: a skipped one among them was marked done
                # and the n-th sample came again after the resume, a new user's trial's 87 of
                # 84.)
                remote = self.lists[0][self.run_places]
            done[remote if remote is not None else self.lists[0][:self.samples]] = True
            return done, 1, 0, False
        if batches is None:
            batches = self.batches
        lens = [len(lst) for lst in self.lists]
        items_of = [n // size if drop else -(-n // size) for n in lens]
        loader_batch = max(1, int(loader_batch or 1))
        per_worker = [n // loader_batch if loader_drop_last else -(-n // loader_batch)
                      for n in items_of]
        counts, nxt = _round_robin(per_worker, int(batches))
        next_worker = (nxt + self.rotation) % workers
        if self.by_index and batches == self.batches:
            return self.taken.copy(), workers, next_worker, True
        done = self.base_done.copy()
        for lst, c, n_items in zip(self.lists, counts, items_of):
            done[lst[:min(c * loader_batch, n_items) * size]] = True
        return done, workers, next_worker, False


class GraphDataset(_data.IterableDataset):
    """An iterable dataset whose samples a splitflow graph computes.

    build(graph, indices) -> node: adds the stages to ``graph`` after ``indices`` (a C++ source
    of int dataset indices) and returns the last one; its outputs are the samples.
    length: the dataset's size. rank, world_size: this process's shard (default: from
    torch.distributed when it is initialised, else 0 of 1). threads, backend, streams,
    host_memory_budget: the runtime's (the dataset's own, one per process it iterates in,
    built on first use, after any fork; two datasets do not share one;
    host_memory_budget bounds the bytes the samples in flight and the output queue hold, for a
    graph with automatic stages: docs/autotune.md). capacity: the output queue's. max_in_flight,
    trace, autotune_window, autotune_queues, priority, autotune_cores: each epoch's graph's
    (splitflow.Graph's; trace=True: ``last_run.trace_json()`` holds the epoch's events).
    Samples' splitflow tensors become torch tensors (zero-copy) unless to_torch=False.
    even_shards: None (default: rank r reads items r, r + world, ...: shards differ by one when
    world does not divide length), "pad" (every rank reads ceil(length / world), the first
    items of the epoch's order read twice, as DistributedSampler pads) or "drop" (every rank
    reads floor(length / world), the epoch's last items left out): with DDP, every rank must
    take the same number of steps or the last collective hangs. Items a stage skipped
    (on_error="skip") would make a rank's count short: with even_shards, the shard's last
    sample (or batch, when the graph batches) is repeated, a copy, to make it up, with a
    warning naming the rank and the count (each DataLoader worker makes up its own share; a
    state_dict taken among the repeats resumes with the steps left, exactly with
    num_workers=0 where the samples carry their index or the graph does not batch); without
    even_shards, a rank of several whose count fell short says so in a warning.

    batch_size, drop_last: when build ends with ``g.batch(name, batch_size, drop_last)``, its
    items are batches: say so here, and ``len()`` is the number of batches (without it, the
    first iteration in this process finds the batch out; before it, and in DataLoader workers'
    parents, ``len()`` counts samples; a ``batch_size`` given to a graph that does not batch
    is refused at its first iteration: ValueError). index_field: the samples' field that holds their
    dataset index ("index", as ``read_file(paths, labels=...)`` makes it; an int for tuple
    samples; None: none): state_dict then records the indices the loop took, exactly.

    remote: a ``splitflow.dask.Remote``: the shard's indices are computed on Dask workers by
    its build function and ``build(graph, source)`` gets the remote source in place of the
    indices (docs/scale-out.md); resume, sharding and ``len()`` as above; num_workers=0.
    ``last_run.stats()["remote"]`` holds the remote figures, and a remote stage's error is
    raised as the remote StageError (stage, dataset index, worker).

    With ``persistent_workers=True`` the DataLoader keeps its workers' copies of the dataset,
    so ``set_epoch`` on this object does not reach them: a worker that sees the same epoch
    twice warns. Build the DataLoader anew each epoch, or keep persistent_workers off.
    """

    _probing = False  # (_first_item's pass: no make-up of its own)

    def __init__(self, build, length, *, shuffle=False, seed=0, rank=None, world_size=None,
                 threads=0, backend="auto", streams=8, capacity=0, max_in_flight=256,
                 to_torch=True, name="dataset", even_shards=None, batch_size=None,
                 drop_last=False, index_field="index", remote=None, host_memory_budget=0,
                 trace=False, autotune_window=0.25, autotune_queues=True, priority=0,
                 autotune_cores=0):
        super().__init__()
        if not callable(build):  # (it failed at the first iteration, naming nothing)
            raise GraphError(f"GraphDataset: build must be a function build(graph, indices) -> "
                             f"node, not {build!r}")
        length = _int_arg("GraphDataset", "length", length, 0)
        seed = _int_arg("GraphDataset", "seed", seed, 0)
        if seed >= 2 ** 63:  # (the epoch's generator takes a signed 64-bit seed)
            raise GraphError(f"GraphDataset: seed must be < 2**63, not {seed!r}")
        batch_size = _int_arg("GraphDataset", "batch_size", batch_size, 1, none_ok=True)
        rank = _int_arg("GraphDataset", "rank", rank, 0, none_ok=True)
        world_size = _int_arg("GraphDataset", "world_size", world_size, 1, none_ok=True)
        if rank is not None and world_size is not None and rank >= world_size:
            raise GraphError(f"GraphDataset: rank {rank} is not in [0, {world_size})")
        if even_shards not in (None, "pad", "drop"):
            raise GraphError(f"GraphDataset: even_shards must be None, 'pad' or 'drop', not {even_shards!r}")
        self.even_shards = even_shards
        self._build = build
        self.length = int(length)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self._rank = rank
        self._world_size = world_size
        self._runtime_args = dict(threads=threads, backend=backend, streams=streams,
                                  host_memory_budget=host_memory_budget)
        self._graph_args = dict(max_in_flight=max_in_flight, trace=trace,
                                autotune_window=autotune_window, autotune_queues=autotune_queues,
                                priority=priority, autotune_cores=autotune_cores)
        self._capacity = capacity
        self._to_torch = to_torch
        self.name = name
        self.batch_size = None if batch_size is None else int(batch_size)
        self.drop_last = bool(drop_last)
        self.index_field = index_field
        self.remote = remote
        self._found_batch = None  # (size, drop_last) the build's g.batch made, seen here
        self._pending = None      # a loaded state, for the next iteration (_Resume)
        self._progress = None     # what the loop took in the latest iteration (_Progress)
        self._pickled = False     # sent to DataLoader workers (spawn) since set_epoch
        self._runtime = None
        self._runtime_pid = None
        self.last_run = None
        self._pool_scope = None   # keeps process stages' workers across epochs (_pools)

    def __getstate__(self):
        # A copy for a DataLoader worker: without this process's runtime and runs.
        self._pickled = True
        state = dict(self.__dict__)
        # The shard as this process sees it: a spawned worker has no torch.distributed group to
        # take the rank or world size from (it read the whole data set as 0 of 1).
        if _distributed_initialised():
            state["_rank"], state["_world_size"] = self.shard()
        for k in ("_runtime", "_runtime_pid", "last_run", "_progress", "_pool_scope"):
            state[k] = None
        return state

    # -- sharding -------------------------------------------------------------------------------
    def shard(self):
        """(rank, world_size) this dataset reads: each as given, the one not given from
        torch.distributed when it is initialised (as DistributedSampler takes them), else 0 of
        1 when neither is given."""
        rank, world = self._rank, self._world_size
        if rank is not None and world is not None:
            return int(rank), int(world)
        if rank is None and world is None:
            return _distributed_rank()
        if world == 1:
            return 0, 1
        # One of the two: the other from torch.distributed (taking 0 or 1 for it, as before,
        # read one shard twice on two ranks: world_size=2 alone gave both ranks shard 0).
        if not _distributed_initialised():
            raise GraphError(
                f"GraphDataset: {'rank' if rank is not None else 'world_size'} is given but not "
                f"{'world_size' if rank is not None else 'rank'}, and torch.distributed is not "
                "initialised to tell it: give both (or neither, with torch.distributed "
                "initialised)")
        d_rank, d_world = _distributed_rank()
        rank = d_rank if rank is None else int(rank)
        world = d_world if world is None else int(world)
        if rank >= world:
            raise GraphError(f"GraphDataset: rank {rank} is not in [0, {world}) (rank or "
                             "world_size from torch.distributed)")
        return rank, world

    def epoch_order(self):
        """Every index of the epoch, in order (before sharding)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.length, generator=g).tolist()
        return list(range(self.length))

    def rank_indices(self):
        rank, world = self.shard()
        if not 0 <= rank < world:
            raise GraphError(f"GraphDataset: rank {rank} is not in [0, {world})")
        order = self.epoch_order()
        if self.even_shards == "drop":
            order = order[:self.length // world * world]
        elif self.even_shards == "pad" and order:
            total = -(-self.length // world) * world
            order = (order * (total // len(order) + 1))[:total]
        return order[rank::world]

    def _samples(self):
        rank, world = self.shard()
        if self.even_shards == "drop":
            return self.length // world
        if self.even_shards == "pad":
            return -(-self.length // world)
        return len(range(rank, self.length, world))

    def _graph_batch(self):
        """(size, drop_last) of the graph's batches, or None when its items are samples."""
        if self.batch_size is not None:
            return self.batch_size, self.drop_last
        return self._found_batch

    def __len__(self):
        """Items this rank yields per epoch (what DataLoader(batch_size=None) yields): samples,
        or batches when the graph batches (batch_size=, or found by an earlier iteration here).
        With DataLoader workers each worker batches its own share: up to num_workers - 1 more,
        shorter, batches. Skipped samples make fewer (with even_shards they are made up)."""
        return _steps(self._samples(), self._graph_batch())

    def set_epoch(self, epoch):
        """Selects the epoch's (deterministic) order; call before iterating, as with
        DistributedSampler. Forgets any progress; a state from load_state_dict is kept by the
        first set_epoch after it when ``epoch`` is its epoch (the resumed loop ``for epoch in
        range(state["epoch"], epochs): ds.set_epoch(epoch)`` continues it) and dropped
        otherwise (by any later set_epoch: DataLoader workers iterate copies, so this dataset
        cannot tell whether they took it)."""
        # (An int, as the constructor's arguments: 1.7 was taken as 1, "3" as 3, and -1 failed
        # at the next iteration, inside the build's ops: a new user's trial.)
        epoch = _int_arg("GraphDataset.set_epoch", "epoch", epoch, 0)
        if epoch >= 2 ** 64:
            raise GraphError(f"GraphDataset.set_epoch: epoch must be < 2**64, not {epoch!r}")
        if self._pending is not None and epoch == self.epoch and not self._pending.kept:
            self._pending.kept = True
            return  # the loaded state's own epoch: the resume stands
        self.epoch = epoch
        self._pending = None
        self._progress = None
        self._pickled = False

    # -- resume ---------------------------------------------------------------------------------
    def track(self, loader):
        """Iterates ``loader`` (a DataLoader of this dataset), noting what the loop takes, so that
        ``state_dict()`` knows it with DataLoader workers too: from the batches' index field
        (exact), else from their count. With num_workers=0, the same as iterating ``loader``::

            for batch in ds.track(loader): ...
        """
        workers = int(getattr(loader, "num_workers", 0) or 0)
        if workers == 0:
            yield from loader
            return
        it = iter(loader)  # the workers take their copies (with any loaded state) here
        progress = _Progress(self, self._pending, workers)
        progress.loader = loader
        self._pending, self._progress = None, progress
        for batch in it:
            if progress is self._progress:
                progress.took_batch(batch)
            yield batch
        progress.complete = True

    def state_dict(self, batches_seen=None, loader=None, *, items_seen=None):
        """Where this epoch stands: the positions of the rank's shard the loop took.

        With num_workers=0 (or when iterating ``track(loader)``) the dataset knows: no argument.
        With DataLoader workers otherwise: batches_seen (the batches this loader's iteration
        gave the loop so far) and loader (its batch_size, num_workers and drop_last are read).
        items_seen: the epoch's first items_seen samples are done (samples taken one at a time,
        in order). What the loop took is what the loader gave it: if something between them
        reads ahead (a prefetcher), pass batches_seen. The state holds the shard's positions
        done as ranges (``done``), their count (``samples_seen``) and whether they come from the
        samples' indices (``by_index``: exact)."""
        progress = self._progress
        if progress is not None and progress.epoch != self.epoch:
            progress = None
        base = self._pending
        if base is None and progress is not None:
            base = progress.base
        workers = None
        if batches_seen is not None:
            if loader is None:
                raise TypeError("GraphDataset.state_dict(batches_seen=...): pass loader= too "
                                "(its batch_size, num_workers and drop_last)")
            workers = max(1, int(getattr(loader, "num_workers", 0) or 0))
            if progress is None or progress.workers != workers or progress.base is not base \
                    or progress.batches != int(batches_seen):
                progress = _Progress(self, base, workers)
        elif items_seen is None and progress is None:
            if self._pickled:
                warnings.warn(
                    "GraphDataset.state_dict(): this dataset went to DataLoader workers and did "
                    "not see what they yielded: iterate ds.track(loader), or pass "
                    "state_dict(batches_seen=..., loader=loader); this state says the loop took "
                    "nothing of the epoch since it began (or since load_state_dict)", stacklevel=2)
            progress = _Progress(self, base, 1)
        elif progress is None:
            progress = _Progress(self, base, 1)
        if loader is None:
            loader = getattr(progress, "loader", None)
        done, workers, next_worker, by_index = progress.state(
            batches=None if batches_seen is None else int(batches_seen),
            loader_batch=getattr(loader, "batch_size", 1) if loader is not None else 1,
            loader_drop_last=bool(getattr(loader, "drop_last", False)),
            graph_batch=self._graph_batch(), items=items_seen)
        rank, world = self.shard()
        return {"epoch": self.epoch, "seed": self.seed, "length": self.length,
                "shuffle": self.shuffle, "even_shards": self.even_shards, "rank": rank,
                "world_size": world, "samples_seen": int(done.sum()), "done": _ranges(done),
                "workers": workers, "next_worker": next_worker, "by_index": by_index}

    def load_state_dict(self, state):
        """The next iteration continues the saved epoch: the shard's positions not done, none
        repeated, none skipped (the state of another rank of the same world size loads too:
        exact when the ranks took the same positions)."""
        missing = [k for k in ("length", "shuffle", "seed", "epoch") if k not in state]
        if missing or not ("done" in state or "items_seen" in state):
            raise GraphError("GraphDataset.load_state_dict: not a state of GraphDataset.state_dict() "
                             f"(it lacks {', '.join(missing) or 'done'})")
        if state["length"] != self.length or state["shuffle"] != self.shuffle:
            raise GraphError("GraphDataset.load_state_dict: the state is of a different dataset "
                             f"(length {state['length']}, shuffle {state['shuffle']})")
        rank, world = self.shard()
        if state.get("world_size", world) != world or \
                state.get("even_shards", self.even_shards) != self.even_shards:
            raise GraphError("GraphDataset.load_state_dict: the state is of another sharding "
                             f"(world_size {state.get('world_size')}, even_shards "
                             f"{state.get('even_shards')!r}; here {world}, {self.even_shards!r})")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        done = np.zeros(self._samples(), bool)
        if "done" in state:
            for a, b in state["done"]:
                # (Past this shard's end is another rank's longer shard: clipped, as that
                # rank's state loads here too.)
                if not 0 <= int(a) <= int(b):
                    raise GraphError(f"GraphDataset.load_state_dict: done range [{a}, {b}) is "
                                     "not a range of positions")
                done[int(a):int(b)] = True
        else:  # a state of earlier versions: the first items_seen samples
            done[:int(state["items_seen"])] = True
        self._pending = _Resume(done, state.get("workers", 1), state.get("next_worker", 0))
        self._progress = None
        self._pickled = False

    # -- iteration ------------------------------------------------------------------------------
    def _pools(self):
        """The scope that keeps this dataset's process stages' workers from epoch to epoch."""
        from . import _procs

        scope = getattr(self, "_pool_scope", None)
        if scope is None:
            scope = self._pool_scope = _procs.PoolScope()
        return scope

    def runtime(self):
        """This process's runtime (a new one after a fork)."""
        if self._runtime is None or self._runtime_pid != os.getpid():
            self._runtime = _core.Runtime(**self._runtime_args)
            self._runtime_pid = os.getpid()
        return self._runtime

    def __iter__(self):
        info = _data.get_worker_info()
        if info is not None:
            if getattr(self, "_worker_epoch", None) == self.epoch:
                warnings.warn(
                    f"GraphDataset: a DataLoader worker iterates epoch {self.epoch} again: with "
                    "persistent_workers=True, set_epoch() on the main process's dataset does not "
                    "reach the workers' copies (each epoch repeats the same order); build the "
                    "DataLoader anew each epoch or set persistent_workers=False", stacklevel=2)
            self._worker_epoch = self.epoch
        base, self._pending = self._pending, None
        if info is None:  # the loop takes what this process yields: count it
            progress = _Progress(self, base, 1)
            self._progress = progress
            order, positions = progress.order, progress.lists[0]
        else:
            progress = None
            order = np.asarray(self.rank_indices(), dtype=np.int64)
            done = base.done if base is not None else np.zeros(len(order), bool)
            remaining = np.flatnonzero(~done)
            rotation = _rotation(base, remaining, info.num_workers)
            positions = _assign(remaining, info.num_workers, info.id, rotation)
        indices = order[positions].tolist()
        if self.remote is not None and info is not None:
            # (Before the runtime: in a worker forked from a process that had run graphs, the
            # runtime's refusal of the fork came first, and its advice, spawn, failed on
            # pickling the Remote: a new user's trial.)
            raise GraphError("GraphDataset(remote=...): the Dask workers are its processes; "
                             "use DataLoader(num_workers=0)")
        graph = _Graph(self.runtime(), self.name, **self._graph_args)
        graph._batches = []
        remote = None
        if self.remote is not None:
            # The shard's indices, computed on the Dask workers: the source yields their
            # results; run positions map to the dataset indices the remote pass yielded.
            remote = self.remote.iterate(indices, epoch=self.epoch)
            source = graph.source(self.remote.name, remote)
            run_indices = remote.yielded
            if progress is not None:  # what the loop took is counted against what it yielded
                progress.yielded = remote.yielded
        else:
            source = graph.indices("indices", indices)
            run_indices = indices
        # The last epoch's graph goes first (unless its caller holds it): its process stages'
        # pools wait in the dataset's scope, and this epoch's stages of the same function take
        # them, workers running (a spawn and the function's imports per worker per epoch
        # otherwise).
        self.last_run = None
        with self._pools().building():
            last = self._build(graph, source)
        returned_none = last is None
        if returned_none:
            last = source
        elif not isinstance(last, _core.Node):
            raise _not_a_node("GraphDataset: build(g, source)", last, "the indices themselves")
        made = graph.made_batches()
        if made is None and self.batch_size is not None:
            # Its items would be samples counted as batches: len() a batch count, and what the
            # loop took (state_dict) batch_size times what it was.
            raise GraphError(
                f"GraphDataset(batch_size={self.batch_size}, drop_last={self.drop_last}) but "
                f"the graph does not batch: build() "
                f"{'returned None' if returned_none else 'returned a node'} without a g.batch "
                f"after its last g.unbatch (if any), so its items are samples; drop batch_size= "
                f"or end build() with g.batch(name, {self.batch_size})")
        if made is not None:
            if self.batch_size is not None and made != (self.batch_size, self.drop_last):
                raise GraphError(
                    f"GraphDataset(batch_size={self.batch_size}, drop_last={self.drop_last}) but "
                    f"the graph batches by {made[0]} (drop_last={made[1]})")
            self._found_batch = made
        out = graph.pull_sink("samples", self._capacity)
        last >> out
        batch = self._graph_batch()
        batch_size = batch[0] if batch is not None else None
        try:
            it = graph.iterate(out)
        except GraphError as e:
            if returned_none and "is not connected to any consumer" in str(e):
                # (A build that adds stages and forgets its return: its samples would be the
                # indices, and its stages' outputs go nowhere.)
                raise GraphError(
                    f"GraphDataset: build() returned None, so the samples would be the indices "
                    f"themselves, but it added nodes whose output goes nowhere; return the last "
                    f"node it added ({e})") from e
            raise
        self.last_run = DatasetRun(it.run, run_indices, remote)  # the latest epoch's

        def out(raw, place):
            if progress is not None:
                progress.took_item(raw, batch_size, place)
            return to_torch(raw) if self._to_torch else raw

        # even_shards: items skipped are made up at the end, by copies of the last item. It is
        # held back one step, so that the copy is taken before the loop can change it in place.
        making_up = self.even_shards is not None and not self._probing
        yielded, held = 0, None
        try:
            for raw in it:
                if not making_up:
                    yielded += 1
                    yield out(raw, it.item)
                    continue
                if held is not None:
                    yielded += 1
                    yield out(*held)
                held = (raw, it.item)
        except StageError as e:
            cause = e.__cause__
            if remote is not None and isinstance(cause, StageError) and \
                    getattr(cause, "worker", None) is not None:
                raise cause  # a remote stage's error: it names the stage, the index, the worker
            _name_dataset_index(e, run_indices)
            raise
        finally:
            try:
                # An early break or an exception cancels the run. (A Ctrl-C while this waits for
                # a body that cannot be interrupted leaves the run behind and raises here: in a
                # loop left early the generator's finaliser runs this, and Python reports that
                # KeyboardInterrupt as ignored; the loop has ended.)
                it.close()
            finally:
                if remote is not None:
                    # Its splits still in flight are released now, and its figures end with the
                    # run (left to the next epoch, they held the workers' results and aged).
                    remote.close()
        if info is not None:
            _warn_skipped(self.last_run, info.id)
        if not making_up and not self._probing:
            self._warn_short(len(positions), batch, yielded, info)
        if making_up:
            yield from self._make_up(len(positions), batch, yielded, held, out, progress, info)
        if progress is not None:
            progress.complete = True  # the epoch's shard is settled

    def _warn_short(self, n, batch, yielded, info):
        """even_shards=None: a rank of several whose stages skipped items takes fewer steps than
        its shard's, and with DDP the other ranks wait for it in their last collective for ever
        (a new user's trial: a 2-rank gloo run hung, one rank's corrupt file skipped, nothing
        said why). Said as a warning naming the rank and the count."""
        rank, world = self.shard()
        want = _steps(n, batch)
        if world <= 1 or yielded >= want:
            return
        what = ("batch" if batch is not None else "sample") if want == 1 else \
            ("batches" if batch is not None else "samples")
        warnings.warn(
            f"GraphDataset: {_rank_text(rank, world, info)} yielded {yielded} of its {want} "
            f"{what} (items its stages skipped, on_error='skip', or dropped); with DDP, a rank "
            f"that takes fewer steps than the others leaves them waiting in their last "
            f"collective for ever: even_shards='pad' (or 'drop') makes every rank's count the "
            f"same", stacklevel=3)

    def _make_up(self, n, batch, yielded, held, out, progress, info):
        """even_shards: a share of n samples whose items a stage skipped yields fewer than the
        other ranks' (a DDP rank with a step more waits in its last collective for ever, a new
        user's trial: 5, 5 and 6 batches on three ranks whose len() was 6): its last item
        (`held`, not yielded yet) is yielded, then copies of it up to the count. Before each,
        the state_dict's positions left are as many as the steps left need (a resume goes on
        with them: its items were skipped, and it makes them up as well)."""
        size = batch[0] if batch is not None else 1
        want = _steps(n, batch)
        short = want - yielded - (held is not None)
        first = None
        if held is not None:
            first = out(*held)
            # (Positions left: the skipped ones, as many as the steps left need; none when the
            # count is whole: a state taken at the last step resumed with them and made them
            # up, one step too many.)
            if progress is not None:
                progress.leave_positions(max(short, 0) * size)
            if short > 0:
                filler = _copy(first)
            yield first
            yielded += 1
        if short <= 0:
            return
        rank, world = self.shard()
        where = _rank_text(rank, world, info)
        what = "batches" if batch is not None else "samples"
        if first is None:
            # (A resumed epoch whose positions left were all skipped: the shard's first item.)
            filler = self._first_item()
            if filler is None:
                raise GraphError(
                    f"GraphDataset(even_shards={self.even_shards!r}): {where} yielded none of "
                    f"its {want} {what}: every item was skipped (on_error='skip'), so there is "
                    f"nothing to repeat for it to take as many steps as the other ranks")
        warnings.warn(
            f"GraphDataset(even_shards={self.even_shards!r}): {where} yielded {yielded} of its "
            f"{want} {what} (items skipped: on_error='skip'); "
            f"{'its last' if first is not None else 'the first of its shard'} is repeated "
            f"{short} time{'s' if short > 1 else ''} so that every rank takes the same number of "
            f"steps", stacklevel=3)
        for j in range(1, short + 1):
            if progress is not None:
                progress.leave_positions((short - j) * size)
            yield filler if j == short else _copy(filler)

    def _first_item(self):
        """The first item of this shard (a pass over it stopped there), or None."""
        probe = copy.copy(self)
        probe._probing, probe._pending, probe._progress = True, None, None
        it = iter(probe)
        try:
            return next(it, None)
        finally:
            it.close()
