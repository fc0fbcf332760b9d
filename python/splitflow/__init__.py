"""splitflow: CPU stages on a thread pool, GPU stages on pooled streams held only per burst.

    import splitflow as sf
    rt = sf.Runtime()
    g = sf.Graph(rt, "loader")
    files = g.source("files", paths)                      # any iterable
    load = g.stage("load", read_file, concurrency=4)      # Python: holds the GIL while it runs
    norm = g.stage("norm", sf.ops.normalize(mean, std), concurrency=0)   # C++: no GIL
    out = g.pull_sink("out")
    files >> load >> norm >> out
    for x in g.iterate(out):                              # early break cancels the run
        ...

Tensors come out as ``splitflow.Tensor``: ``numpy.asarray(t)`` and ``torch.from_dlpack(t)``
view the same memory (zero-copy). ``splitflow.torch`` wraps a graph as a DataLoader dataset.
"""
import atexit as _atexit

from ._errors import DeadlineError, Error, GraphError, OverloadedError, StageError  # noqa: F401
from ._core import (  # noqa: F401
    Graph,
    Node,
    PullIterator,
    Run,
    Runtime,
    Tensor,
    built_with_cuda,
    cuda_runtime_calls,
    image_files,
    ops,
)
from ._core import _shutdown

# Interpreter exit with runs in flight: cancel them and let their Python stages finish while
# the interpreter is still whole (later, threads taking the GIL would hang or be killed).
_atexit.register(_shutdown)

__all__ = [
    "DeadlineError", "Error", "Graph", "GraphError", "Node", "OverloadedError", "PullIterator",
    "Run", "Runtime", "StageError",
    "image_files",
    "Tensor", "built_with_cuda", "cuda_runtime_calls", "ops",
]
