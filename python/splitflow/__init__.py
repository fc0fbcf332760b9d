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

from ._errors import (  # noqa: F401
    CancelledError, DeadlineError, Error, GraphError, OverloadedError, RemoteException,
    StageError)
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
    list_arbiters,
    ops,
    read_arbiter,
    remove_arbiter,
)
from ._core import _shutdown



# Image files torchvision's ImageFolder loads that splitflow's decoders do not read.
_OTHER_IMAGES = [".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"]


def image_folder(root):
    """A labelled image tree laid out as torchvision's ``ImageFolder`` reads it: one folder per
    class under ``root`` (class = folder name, classes sorted, labels 0..C-1), the JPEG files
    anywhere below each, in ImageFolder's order (folder by folder, each folder's files sorted
    before its subfolders'; a class folder without a JPEG is refused, as ImageFolder does; other
    image files ImageFolder loads, .png and the rest, are left out with a RuntimeWarning naming
    them). Returns ``(paths, labels, classes)``: feed ``paths`` and
    ``labels`` to ``splitflow.ops.read_file(paths, labels=labels)``, whose samples are
    ``{"image": ..., "label": ..., "index": ...}``::

        paths, labels, classes = sf.image_folder("data/train")
        idx = g.indices("idx", range(len(paths)))
        read = g.stage("read", sf.ops.read_file(paths, labels=labels), concurrency=2)
        crop = g.stage("crop", sf.ops.decode_random_resized_crop(224), field="image",
                       concurrency=0, on_error="skip")
        batch = g.batch("batch", 64)            # {"image": (64,224,224,3) uint8, "label": (64,) int64, ...}
    """
    import os

    root = os.fspath(root)  # (a pathlib.Path too: image_files takes a str)
    try:
        entries = sorted(e.name for e in os.scandir(root) if e.is_dir())
    except OSError as e:
        raise Error(f"splitflow.image_folder: cannot read '{root}': {e.strerror}") from None
    if not entries:
        raise Error(f"splitflow.image_folder: '{root}' has no class folders (expected "
                    f"{root}/<class>/<image>.jpg, as torchvision's ImageFolder reads it)")
    # The root's files in ImageFolder's order (each class folder whole, classes sorted:
    # image_files of a root), labelled by their class folder; the root's own files (in no
    # class) left out, as ImageFolder leaves them.
    label_of = {name: label for label, name in enumerate(entries)}
    prefix = os.path.join(root, "")  # the paths start with the root as given

    def class_of(p):  # (os.path.relpath: 11 s for 1.28M paths; this, 0.15 s)
        rel = p[len(prefix):] if p.startswith(prefix) else os.path.relpath(p, root)
        parts = rel.split(os.sep, 1)
        return parts[0] if len(parts) > 1 else None

    paths, labels = [], []
    for p in image_files(root):
        c = class_of(p)
        if c in label_of:
            paths.append(p)
            labels.append(label_of[c])
    others = [p for p in image_files(root, extensions=_OTHER_IMAGES) if class_of(p) in label_of]
    found = set(labels)
    empty = [name for name in entries if label_of[name] not in found]
    if others:
        # (ImageFolder loads them: a migrated dataset would shrink without a word.)
        import warnings

        kinds = sorted({os.path.splitext(p)[1].lower() for p in others})
        warnings.warn(f"splitflow.image_folder: {len(others)} image file{'s' if len(others) > 1 else ''} "
                      f"under '{root}' {'are' if len(others) > 1 else 'is'} not JPEG ({', '.join(kinds)}: "
                      f"{others[0]!r}{', ...' if len(others) > 1 else ''}) and left out, where "
                      f"torchvision's ImageFolder loads them: splitflow's decoders read JPEG only; "
                      f"convert them to JPEG, or decode them in a stage of your own (PIL's)",
                      RuntimeWarning, stacklevel=2)
    if not paths:
        raise Error(f"splitflow.image_folder: no .jpg/.jpeg files under the class folders of '{root}'")
    if empty:
        # A class without an image would be a label no sample has (ImageFolder refuses it too:
        # "Found no valid file for the classes ...").
        raise Error(f"splitflow.image_folder: no .jpg/.jpeg files in the class folder"
                    f"{'s' if len(empty) > 1 else ''} {', '.join(repr(e) for e in empty)} of "
                    f"'{root}': remove {'them' if len(empty) > 1 else 'it'} (or add its images), as "
                    f"torchvision's ImageFolder asks")
    return paths, labels, entries


# Interpreter exit with runs in flight: cancel them and let their Python stages finish while
# the interpreter is still whole (later, threads taking the GIL would hang or be killed).
_atexit.register(_shutdown)

__all__ = [
    "CancelledError", "DeadlineError", "Error", "Graph", "GraphError", "Node", "OverloadedError", "PullIterator",
    "RemoteException", "Run", "Runtime", "StageError",
    "image_files", "image_folder", "list_arbiters", "read_arbiter", "remove_arbiter",
    "Tensor", "built_with_cuda", "cuda_runtime_calls", "ops",
]


def __getattr__(name):
    # `sf.dask.remote(...)` and `sf.torch.GraphDataset` as docs/api.md writes them, after a
    # plain `import splitflow as sf` (a new user's trial: AttributeError); imported on first
    # use, so that `import splitflow` does not import Dask or torch.
    if name in ("dask", "torch"):
        import importlib
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ImportError as e:  # (hasattr() then says False, as for any missing attribute)
            raise AttributeError(f"splitflow.{name} cannot be imported here: {e}") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
