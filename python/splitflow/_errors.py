"""splitflow's errors: one hierarchy, the same names as in C++ (splitflow/core/error.hpp).

    Error                 every error splitflow raises (a RuntimeError)
      GraphError          the graph is malformed or used wrongly (also a ValueError)
      StageError          a stage or a source failed: graph, stage, item, message; a Python
                          stage's own exception is __cause__
      OverloadedError     a service's admission is full (fail-fast admission)
      DeadlineError       a request's deadline passed before its work
      CancelledError      a pull sink's stream was cut short: its run was cancelled by
                          something other than its own reader (Run.cancel() from another
                          thread, another sink's reader, the interpreter's exit)

Not a splitflow error: RemoteException, a process stage's own exception that could not be
rebuilt in the parent (its class's __init__ takes other arguments, or it holds what cannot be
pickled): the StageError's __cause__, with the exception's type and text, and the worker's
traceback in its notes.

A StageError survives pickling (DataLoader workers): its attributes travel with it, and one
rebuilt from its message alone (as torch's worker error wrapper does) reads them back from it.
"""
import math
import operator
import re

__all__ = ["Error", "GraphError", "StageError", "OverloadedError", "DeadlineError",
           "CancelledError", "RemoteException"]


class Error(RuntimeError):
    """Base of every error splitflow raises."""


class GraphError(Error, ValueError):
    """The graph is malformed or used wrongly (a bad edge, a cycle, run while running, ...)."""


class OverloadedError(Error):
    """A service's admission is full and its admission policy is fail-fast (or the submit came
    from a thread of the graph's runtime, which may not wait for room its threads make)."""


class DeadlineError(Error):
    """A request's deadline passed before its work; it was dropped unprocessed."""


class CancelledError(Error):
    """A loop over a pull sink (or a GraphDataset's epoch) was cut short: its run was cancelled
    by something other than the loop itself (``Run.cancel()`` from another thread, another pull
    sink's reader, the interpreter's exit). A loop that breaks early is not told: it knows."""


_STAGE = re.compile(r"splitflow: graph '(?P<graph>.*?)': stage '(?P<stage>.*?)' failed on item "
                    r"(?P<item>\d+)(?: \([^)]*\))?: (?P<message>.*)", re.S)


class StageError(Error):
    """A stage (or a source) failed. Attributes: graph, stage, item (the item's dataset index
    where the graph knows it, else its position in the run), message; for a Python stage the
    original exception is ``__cause__``."""

    def __init__(self, text="", graph=None, stage=None, item=None, message=None):
        super().__init__(text)
        if graph is None:  # rebuilt from the text alone (e.g. by a DataLoader worker wrapper)
            m = _STAGE.search(text)
            if m:
                graph, stage, item, message = (m["graph"], m["stage"], int(m["item"]),
                                               m["message"].splitlines()[0] if m["message"] else "")
        self.graph, self.stage, self.item, self.message = graph, stage, item, message

    def __reduce__(self):
        return (StageError, (str(self), self.graph, self.stage, self.item, self.message))


class RemoteException(Exception):
    """A process stage's own exception that could not be rebuilt in this process: ``remote_type``
    is its class's name, ``str()`` its type and text ("NoArgExc: 1-2"); the worker's traceback is
    in its notes. It is the StageError's ``__cause__``, as the exception itself would be."""

    def __init__(self, text="", remote_type=""):
        super().__init__(text)
        self.remote_type = remote_type

    def __reduce__(self):  # (its notes, the worker's traceback, travel in its __dict__)
        return (RemoteException, (str(self), self.remote_type), self.__dict__)


# ---- argument checks shared by the modules (splitflow.torch, splitflow.dask) -----------------

def _int_arg(who, name, value, minimum=None, none_ok=False, maximum=None):
    """An integer argument (a Python or NumPy integer: not a float, a string or a bool), at least
    `minimum` (at most `maximum`); GraphError naming `who`'s argument otherwise (2.5 was taken as
    2, "3" failed later with a TypeError of its own)."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise GraphError(f"{who}: {name} must be an int{' (or None)' if none_ok else ''}, "
                         f"not {value!r}")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise GraphError(f"{who}: {name} must be >= {minimum}{' (or None)' if none_ok else ''}, "
                         f"not {value!r}")
    if maximum is not None and v > maximum:
        raise GraphError(f"{who}: {name} must be <= {maximum}, not {value!r}")
    return v


def _seconds_arg(who, name, value, none_ok=False, inf_ok=False, maximum=None):
    """A duration in seconds: a real number (not a bool or a string), > 0 and finite, at most
    `maximum` (or infinite where inf_ok: never); GraphError naming `who`'s argument otherwise (a
    timeout of 0 never let a split finish)."""
    if value is None and none_ok:
        return None
    ok = not isinstance(value, (bool, str, bytes))
    try:
        v = float(value) if ok else math.nan
    except (TypeError, ValueError):
        v = math.nan
    finite = math.isfinite(v) and (maximum is None or v <= maximum)
    if not (v > 0 and (finite or (inf_ok and v == math.inf))):
        other = ["inf: never"] * inf_ok + ["None"] * none_ok
        raise GraphError(f"{who}: {name} must be a number of seconds > 0"
                         f"{f' and <= {maximum:g}' if maximum is not None else ''}"
                         f"{' (or ' + ', or '.join(other) + ')' if other else ''}, not {value!r}")
    return v


def _not_a_node(who, last, none_is):
    """The GraphError for a build(g, ...) that returned `last`, not a node of g (it failed at
    `last >> out` with Python's words: "unsupported operand type(s) for >>: 'int' and
    'splitflow._core.Node'", a new user's trial). none_is: what None stands for."""
    import reprlib

    try:
        shown = " " + reprlib.repr(last)  # (cut short with "...")
    except Exception:  # (a repr that raises: the type alone)
        shown = ""
    return GraphError(f"{who} returned {type(last).__name__}{shown}, not a node of g; return "
                      f"the last node it added (its output is the samples), or None for "
                      f"{none_is}")
