"""Functions that process stages (Graph.stage(..., processes=N)) run in worker processes: a
worker imports them by name, as DataLoader workers do, so they live in a module, not a test."""
import os
import signal
import time

import numpy as np

# A worker that cannot import this module (a dependency missing there): set by a test, seen by
# the workers it spawns (they import this module to unpickle their function), not the parent.
if os.environ.get("SF_TEST_WORKERS_CANNOT_IMPORT"):
    raise ImportError("procs_fns: cannot be imported in this worker (the test's setting)")


def add(x, k):
    return x + k


def square(x):
    return x * x


def pid_and_value(x):
    return (os.getpid(), x)


def flip(image):
    """A Python augmentation on a decoded image (H, W, C) uint8: a horizontal flip, + 1."""
    a = np.asarray(image)
    return np.ascontiguousarray(a[:, ::-1, :]) + np.uint8(1)


def raise_on_five(x):
    if x == 5:
        raise ValueError(f"five is not allowed (got {x})")
    return x


class TwoArgError(Exception):
    """An exception pickle cannot rebuild: its __init__ takes two arguments, its args one."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")


def two_arg_error_on_five(x):
    if x == 5:
        raise TwoArgError(1, 2)
    return x


def splitflow_error_on_five(x):
    if x == 5:
        import splitflow
        raise splitflow.Error("the function's own splitflow.Error")
    return x


def times_ten(batch):
    """A service's model step: the requests collated, one result each."""
    import numpy as np
    return np.asarray(batch) * 10


def a_set_of_results(batch):
    """A service's model step that returns a set: not indexable, one result per request."""
    import numpy as np
    return set(np.asarray(batch).tolist())


def skip_three_exit_on_six(x):
    """A ValueError on item 3 (skipped under on_error="skip"), sys.exit(4) on item 6."""
    if x == 3:
        raise ValueError("three is bad")
    if x == 6:
        raise SystemExit(4)
    return x


class OddStop(KeyboardInterrupt):
    """An interrupt whose class takes two arguments: it does not survive pickling."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def odd_stop_on_six(x):
    if x == 6:
        raise OddStop(1, 2)
    return x


def die_on_seven(x):
    """Kills its own worker with SIGSEGV on item 7 (the first time only: a flag file)."""
    if x == 7:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x


def exit_on_seven(x):
    if x == 7:
        os._exit(3)
    return x


def hang_on_true(x):
    """(value, hang): a body that hangs (an hour) where hang is true."""
    value, hang = x
    if hang:
        time.sleep(3600)
    return value


def hang_on_true_with_pid(x):
    """hang_on_true's value with the worker's pid: (value, pid)."""
    return hang_on_true(x), os.getpid()


def sleepy(x):
    time.sleep(30)
    return x


def spin(x):
    """CPU-bound pure Python (holds the GIL in a thread stage)."""
    t = 0
    for i in range(200_000):
        t += i * x
    return t


def build_with_a_process_stage(g, src):
    """A GraphDataset's build: one process stage (for DataLoader workers, which import it)."""
    return src >> g.stage("tag", pid_and_value, processes=2)


def batch_shape_and_sums(batch):
    """A service's model step telling each request the shape of the batch it came in and its
    own sum."""
    import numpy as np
    a = np.asarray(batch)
    return [(tuple(a.shape), float(x.sum())) for x in a]


def refuse_16_rows(batch):
    """A service's model step that raises on a batch of 16-row images (its requests' group)."""
    import numpy as np
    a = np.asarray(batch)
    if a.shape[1] == 16:
        raise ValueError(f"no 16-row images here (a batch of {a.shape})")
    return [float(x.sum()) for x in a]


def until_file(x):
    """(tag, path, exit_code): waits until the file at path exists (the test makes it), then
    exits with exit_code, or returns (tag, pid) where it is None; (tag, None, None): at once."""
    tag, path, code = x
    while path is not None and not os.path.exists(path):
        time.sleep(0.001)
    if code is not None:
        os._exit(code)
    return tag, os.getpid()
