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
not survive a fork: if this process already ran graphs, a forked worker raises
``splitflow.Error`` (rather than hang); create the loader with
``multiprocessing_context="spawn"`` (or ``"forkserver"``) then.

Order and sharding: each epoch's order is ``torch.randperm(length)`` seeded with
``seed + epoch`` (or 0..length-1 without shuffle); rank r of w takes positions r, r+w, ...;
worker k of n takes every n-th item of that. Items come out in that order.
"""
import os
import warnings

import torch
import torch.utils.data as _data

from . import _core
from ._errors import StageError

__all__ = ["GraphDataset", "to_torch"]


def to_torch(x):
    """splitflow.Tensor -> torch.Tensor (zero-copy, DLPack), inside tuples, lists and dicts."""
    if isinstance(x, _core.Tensor):
        return torch.utils.dlpack.from_dlpack(x)
    if isinstance(x, tuple):
        return tuple(to_torch(v) for v in x)
    if isinstance(x, list):
        return [to_torch(v) for v in x]
    if isinstance(x, dict):
        return {k: to_torch(v) for k, v in x.items()}
    return x


def _name_dataset_index(e, indices):
    """A StageError names the item's position in the run (its source's order); here that
    position maps to a dataset index: the error names the index, and keeps the position."""
    pos = e.item
    if not isinstance(pos, int) or not 0 <= pos < len(indices):
        return
    e.position, e.item = pos, int(indices[pos])
    text = str(e).replace(f"failed on item {pos}:",
                          f"failed on item {e.item} (dataset index; {pos} in this run):", 1)
    e.args = (text,) + tuple(e.args[1:])


def _distributed_rank():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GraphDataset(_data.IterableDataset):
    """An iterable dataset whose samples a splitflow graph computes.

    build(graph, indices) -> node: adds the stages to ``graph`` after ``indices`` (a C++ source
    of int dataset indices) and returns the last one; its outputs are the samples.
    length: the dataset's size. rank, world_size: this process's shard (default: from
    torch.distributed when it is initialised, else 0 of 1). threads, backend, streams: the
    runtime's (one per process, built on first use, after any fork). capacity: the output
    queue's. Samples' splitflow tensors become torch tensors (zero-copy) unless to_torch=False.
    even_shards: None (default: rank r reads items r, r + world, ...: shards differ by one when
    world does not divide length), "pad" (every rank reads ceil(length / world), the first
    items of the epoch's order read twice, as DistributedSampler pads) or "drop" (every rank
    reads floor(length / world), the epoch's last items left out): with DDP, every rank must
    take the same number of steps or the last collective hangs.

    With ``persistent_workers=True`` the DataLoader keeps its workers' copies of the dataset,
    so ``set_epoch`` on this object does not reach them: a worker that sees the same epoch
    twice warns. Build the DataLoader anew each epoch, or keep persistent_workers off.
    """

    def __init__(self, build, length, *, shuffle=False, seed=0, rank=None, world_size=None,
                 threads=0, backend="auto", streams=8, capacity=0, max_in_flight=256,
                 to_torch=True, name="dataset", even_shards=None):
        super().__init__()
        if length < 0:
            raise ValueError("GraphDataset: length must be >= 0")
        if even_shards not in (None, "pad", "drop"):
            raise ValueError(f"GraphDataset: even_shards must be None, 'pad' or 'drop', not {even_shards!r}")
        self.even_shards = even_shards
        self._build = build
        self.length = int(length)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self._rank = rank
        self._world_size = world_size
        self._runtime_args = dict(threads=threads, backend=backend, streams=streams)
        self._graph_args = dict(max_in_flight=max_in_flight)
        self._capacity = capacity
        self._to_torch = to_torch
        self.name = name
        self._consumed = 0   # items this process yielded in the current epoch (num_workers=0)
        self._resume = 0     # items to skip at the next iteration (load_state_dict)
        self._runtime = None
        self._runtime_pid = None
        self.last_run = None

    # -- sharding -------------------------------------------------------------------------------
    def shard(self):
        """(rank, world_size) this dataset reads."""
        if self._rank is not None or self._world_size is not None:
            return int(self._rank or 0), int(self._world_size or 1)
        return _distributed_rank()

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
            raise ValueError(f"GraphDataset: rank {rank} is not in [0, {world})")
        order = self.epoch_order()
        if self.even_shards == "drop":
            order = order[:self.length // world * world]
        elif self.even_shards == "pad" and order:
            total = -(-self.length // world) * world
            order = (order * (total // len(order) + 1))[:total]
        return order[rank::world]

    def __len__(self):
        """Samples this rank reads per epoch (what DataLoader(batch_size=None) yields)."""
        rank, world = self.shard()
        if self.even_shards == "drop":
            return self.length // world
        if self.even_shards == "pad":
            return -(-self.length // world)
        return len(range(rank, self.length, world))

    def set_epoch(self, epoch):
        """Selects the epoch's (deterministic) order; call before iterating, as with
        DistributedSampler."""
        self.epoch = int(epoch)
        self._consumed = 0
        self._resume = 0

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self, items_seen=None):
        """Where this epoch stands. With num_workers=0 the dataset counts the samples it
        yielded; with workers, pass items_seen (the samples the loop took so far)."""
        seen = self._consumed if items_seen is None else int(items_seen)
        return {"epoch": self.epoch, "seed": self.seed, "items_seen": seen,
                "length": self.length, "shuffle": self.shuffle}

    def load_state_dict(self, state):
        """The next iteration continues the saved epoch after its items_seen samples: none
        repeated, none skipped."""
        if state["length"] != self.length or state["shuffle"] != self.shuffle:
            raise ValueError("GraphDataset.load_state_dict: the state is of a different dataset "
                             f"(length {state['length']}, shuffle {state['shuffle']})")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._resume = int(state["items_seen"])
        self._consumed = self._resume

    # -- iteration ------------------------------------------------------------------------------
    def runtime(self):
        """This process's runtime (a new one after a fork)."""
        if self._runtime is None or self._runtime_pid != os.getpid():
            self._runtime = _core.Runtime(**self._runtime_args)
            self._runtime_pid = os.getpid()
        return self._runtime

    def _my_indices(self):
        indices = self.rank_indices()
        info = _data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # DataLoader takes samples from its workers round-robin, so after `resume` samples
        # shard j has yielded resume // n (+1 for the first resume % n shards), and shard
        # resume % n is next: the loader's worker k continues shard (k + resume) % n.
        shard = (worker + self._resume) % workers
        skip = self._resume // workers + (1 if shard < self._resume % workers else 0)
        return indices[shard::workers][skip:], info is None

    def __iter__(self):
        if _data.get_worker_info() is not None:
            if getattr(self, "_worker_epoch", None) == self.epoch:
                warnings.warn(
                    f"GraphDataset: a DataLoader worker iterates epoch {self.epoch} again: with "
                    "persistent_workers=True, set_epoch() on the main process's dataset does not "
                    "reach the workers' copies (each epoch repeats the same order); build the "
                    "DataLoader anew each epoch or set persistent_workers=False", stacklevel=2)
            self._worker_epoch = self.epoch
        indices, counting = self._my_indices()
        self._resume = 0
        graph = _core.Graph(self.runtime(), self.name, **self._graph_args)
        source = graph.indices("indices", indices)
        last = self._build(graph, source)
        if last is None:
            last = source
        out = graph.pull_sink("samples", self._capacity)
        last >> out
        it = graph.iterate(out)
        self.last_run = it.run  # stats() and report() of the latest epoch
        try:
            for item in it:
                if counting:
                    self._consumed += 1
                yield to_torch(item) if self._to_torch else item
        except StageError as e:
            _name_dataset_index(e, indices)
            raise
        finally:
            it.close()  # an early break or an exception cancels the run
        if counting:
            self._consumed = 0  # the epoch is complete
