"""Worker processes for a Python stage: ``Graph.stage(name, fn, processes=N)``.

``ProcessPool(fn, processes, stage, field=None, depth=2)`` runs ``fn`` in N processes started
with the ``spawn`` method (as DataLoader workers under spawn: ``fn`` travels by reference, so it
must be a module-level function, or an object of a module-level class, of an importable module;
it is pickled once, when the pool is made).

    pool.submit(item, completion)   # any thread, holding the GIL; never waits on a worker
    ...                             # later, on another thread (the pool's reader thread):
                                    # exactly one of completion.done(result), completion.fail(exc)
    pool.close()                    # idempotent; also at interpreter exit and on collection

Design
  * Workers start lazily: all N on the first submit() (a graph built but never run starts no
    process). Each has its own duplex pipe and takes its items in FIFO order, one at a time.
    submit() sends an item to the worker with the fewest outstanding items (ties rotate); the
    caller bounds the items in flight (``depth`` per worker), so the next item already waits in
    the pipe when one finishes. Past that bound items still go out, to the least loaded worker.
  * submit() never blocks on a worker: a message the pipe does not take at once is queued and
    the reader thread sends it when the worker has read. The pool's lock is never held across
    anything that waits on another process.
  * One daemon reader thread per pool waits on every worker's pipe and process sentinel
    (multiprocessing.connection.wait), reads the results and calls the completions, outside the
    pool's lock. Completions are never called from inside submit(): a failure found there (an
    item that cannot be pickled, a missing field, a closed pool) goes to the reader thread (to a
    shared daemon thread once the pool is closed).
  * Arrays travel through shared memory: a numpy array, a CPU torch tensor (torch already
    imported) or a host splitflow.Tensor of >= 64 KiB is written (os.write: a full /dev/shm is an
    error, not a SIGBUS) to a new file ``/dev/shm/sf-{parent_pid}-{pool_id}-w{worker}-g{generation}
    -{in|out}-{counter}`` and only (name, dtype, shape, kind) is pickled; the receiver maps the
    file, unlinks it at once and wraps the mapping without a copy (``np.frombuffer(mm).reshape``,
    ``torch.from_numpy``); the mapping lives as long as the array. A splitflow.Tensor arrives as a
    numpy array. Smaller arrays are pickled inline; a pickled message still over 32 KiB (large
    bytes, strings, ...) travels as one such file, so pipes only carry small messages.
  * A worker that dies (a signal, os._exit) fails the item it held, the oldest one sent to it,
    with an Error naming the signal or exit code; a replacement worker (generation + 1) takes the
    rest of its items, re-sent from the objects the parent keeps until each item completes; the
    dead worker's files are removed. A function that cannot be loaded in a worker, or workers
    that die three times in a row while they start, break the pool: every item then fails with
    that error.
  * Workers ignore SIGINT (Ctrl-C stops the parent only); they exit on a stop message (skipping
    the items queued behind it) or when their pipe closes, and remove the pool's files when the
    parent is gone. As DataLoader workers do, a worker sets torch's intra-op threads to 1 once
    torch is imported there.
"""
import atexit
import collections
import io
import itertools
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (its exit hook registers before ours: ours runs first)
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import weakref

__all__ = ["ProcessPool"]

_SHM_DIR = "/dev/shm"
_ARRAY_MIN = 64 * 1024  # arrays (numpy, torch, splitflow) of at least this size: shared memory
_INLINE_MAX = 32 * 1024  # a pickled message over this many bytes travels as one shared-memory file
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_JOIN_S = 2.0  # close(): how long workers get to exit before they are killed
_START_FAILURES = 3  # workers dying before they are ready this many times in a row break the pool

# A message: kind (1 byte, | _VIA_SHM when the body is the name of a file holding it), sequence.
_HEAD = struct.Struct("<Bq")
_VIA_SHM = 0x80
_ITEM, _STOP, _READY, _INIT_ERROR, _RESULT, _ERROR = range(1, 7)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
_BACKLOG_POLL_S = 0.005  # how often the reader retries messages a full pipe did not take
_pool_ids = itertools.count(1)
_live = weakref.WeakSet()  # open pools' states: closed at interpreter exit
_exiting = False


def _errors():
    from ._errors import Error, GraphError
    return Error, GraphError


# ---- shared memory ------------------------------------------------------------------------------

class _Files:
    """Creates the shared-memory files of one direction of one worker (one thread at a time)."""

    __slots__ = ("prefix", "counter", "created")

    def __init__(self, prefix):
        self.prefix = prefix
        self.counter = itertools.count()
        self.created = []  # the files written by the message being pickled

    def write(self, data):
        """Writes a C-contiguous buffer to a new file; returns its name, or None when /dev/shm
        refuses (then the caller sends the data inline)."""
        data = memoryview(data).cast("B")
        for _ in range(8):
            name = f"{self.prefix}{next(self.counter)}"
            path = os.path.join(_SHM_DIR, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            except OSError:
                return None
            break
        else:
            return None
        # os.write, not a store through a mapping: a full /dev/shm then fails here with ENOSPC
        # instead of killing the process with SIGBUS.
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            os.close(fd)
            _unlink(path)
            return None
        os.close(fd)
        self.created.append(path)
        return name

    def discard(self):
        for path in self.created:
            _unlink(path)
        self.created = []


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_files(prefix):
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            _unlink(os.path.join(_SHM_DIR, name))


def _shm_path(name):
    if "/" in name or not name.startswith("sf-"):
        raise ValueError(f"splitflow: not a shared-memory file of splitflow: {name!r}")
    return os.path.join(_SHM_DIR, name)


def _map(name, nbytes):
    """Maps a file, then closes and unlinks it: the mapping is its only reference."""
    path = _shm_path(name)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
        _unlink(path)


def _read_whole(name):
    path = _shm_path(name)
    fd = os.open(path, os.O_RDONLY)
    try:
        _unlink(path)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            return f.readall()
    finally:
        os.close(fd)


def _shm_numpy(name, dtype, shape):
    import numpy as np

    dt = np.dtype(dtype)
    count = 1
    for n in shape:
        count *= n
    return np.frombuffer(_map(name, count * dt.itemsize), dt, count).reshape(shape)


def _shm_torch(name, dtype, shape, view_as, requires_grad):
    import torch

    t = torch.from_numpy(_shm_numpy(name, dtype, shape))
    if view_as:
        t = t.view(getattr(torch, view_as))
    if requires_grad:
        t.requires_grad_(True)
    return t


def _identity(x):
    return x


def _plain_dtype(dt):
    return not dt.hasobject and dt.fields is None and dt.itemsize > 0


# ---- pickling -----------------------------------------------------------------------------------

class _Pickler(pickle.Pickler):
    """Sends large arrays through shared memory: only (name, dtype, shape) is pickled."""

    def __init__(self, file, files):
        super().__init__(file, _PROTOCOL)
        self._files = files

    def reducer_override(self, obj):
        t = type(obj)
        np = sys.modules.get("numpy")
        if np is not None and t is np.ndarray:
            if obj.nbytes >= _ARRAY_MIN and _plain_dtype(obj.dtype):
                return self._numpy(np, obj)
            return NotImplemented
        torch = sys.modules.get("torch")
        if torch is not None and t is torch.Tensor:
            return self._torch(torch, obj)
        if t.__name__ == "Tensor" and t.__module__ == "splitflow._core":
            import numpy as np

            try:
                a = np.asarray(obj)  # host memory: a view; device memory refuses (BufferError)
            except Exception:
                return NotImplemented
            if a.nbytes >= _ARRAY_MIN and _plain_dtype(a.dtype):
                ref = self._numpy(np, a)
                if ref is not NotImplemented:
                    return ref
            return _identity, (a,)
        return NotImplemented

    def _numpy(self, np, a):
        shape = a.shape
        name = self._files.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        if name is None:
            return NotImplemented
        return _shm_numpy, (name, a.dtype.str, shape)

    def _torch(self, torch, t):
        try:
            if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                    or t.element_size() * t.numel() < _ARRAY_MIN):
                return NotImplemented
            x, view_as = t.detach(), None
            if x.dtype == torch.bfloat16:
                x, view_as = x.view(torch.int16), "bfloat16"
            a = x.resolve_conj().resolve_neg().contiguous().numpy()
        except Exception:  # a dtype numpy lacks, a tensor subclass's oddity: torch's own pickling
            return NotImplemented
        import numpy as np

        name = self._files.write(a.reshape(-1).view(np.uint8))
        if name is None:
            return NotImplemented
        return _shm_torch, (name, a.dtype.str, tuple(t.shape), view_as, bool(t.requires_grad))


def _dumps(obj, files):
    buf = io.BytesIO()
    files.created = []
    try:
        _Pickler(buf, files).dump(obj)
    except BaseException:
        files.discard()
        raise
    files.created = []
    return buf.getbuffer()


def _body(kind, seq, payload, files):
    """One message's bytes: a large payload goes into a shared-memory file, named instead."""
    if len(payload) > _INLINE_MAX:
        files.created = []
        name = files.write(payload)
        files.created = []
        if name is not None:
            return _HEAD.pack(kind | _VIA_SHM, seq) + name.encode()
    return _HEAD.pack(kind, seq) + payload


def _send(conn, kind, seq, payload, files):
    """The worker's send (blocking: the parent's reader thread always reads). Raises OSError on
    a closed pipe."""
    conn.send_bytes(_body(kind, seq, payload, files))


def _framed(body):
    """body framed as Connection.send_bytes frames it (a big-endian int32 length; -1 then a
    uint64 past 2 GiB), so that the worker's Connection.recv_bytes reads it."""
    n = len(body)
    prefix = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return memoryview(prefix + body)


def _parse(data):
    kind, seq = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size:]
    if kind & _VIA_SHM:
        return kind & ~_VIA_SHM, seq, _read_whole(bytes(body).decode())
    return kind, seq, body


def _exception_payload(e, text=None):
    """(the exception pickled or None, its text for an Error, the traceback)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    blob = None
    if text is None:
        if isinstance(e, Exception):
            text = f"{type(e).__name__}: {e}"
            try:
                blob = pickle.dumps(e, _PROTOCOL)
                pickle.loads(blob)  # a class whose __init__ takes other arguments fails here
            except BaseException:
                blob = None
        else:  # SystemExit, KeyboardInterrupt, GeneratorExit: an error of the item
            text = f"{e!r} raised in worker"
    return pickle.dumps((blob, text, tb), _PROTOCOL)


# ---- the worker ---------------------------------------------------------------------------------

def _worker_main(conn, fn_blob, stage, parent_pid, pool_id, index, generation):
    """A worker process: loads fn, then answers each item in order until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pid = os.getpid()
    files = _Files(f"sf-{parent_pid}-{pool_id}-w{index}-g{generation}-out-")
    torch_threads = [False]

    def one_thread_for_torch():
        if not torch_threads[0] and "torch" in sys.modules:
            torch_threads[0] = True
            try:
                sys.modules["torch"].set_num_threads(1)
            except Exception:
                pass

    try:
        fn = pickle.loads(fn_blob)
    except BaseException as e:
        try:
            _send(conn, _INIT_ERROR, 0, _exception_payload(e, f"{type(e).__name__}: {e}"), files)
        except OSError:
            pass
        return
    del fn_blob
    one_thread_for_torch()
    pending = collections.deque()  # messages read ahead: a stop behind them skips them
    try:
        _send(conn, _READY, 0, b"", files)
        while True:
            try:
                if not pending:
                    pending.append(conn.recv_bytes())
                while conn.poll(0):
                    pending.append(conn.recv_bytes())
            except (EOFError, OSError):  # the parent closed the pipe or is gone
                break
            if any(data[0] == _STOP for data in pending):
                break
            data = pending.popleft()
            kind, seq = _HEAD.unpack_from(data)
            try:
                _, _, body = _parse(data)
                del data
                item = pickle.loads(body)
                del body
            except BaseException as e:
                text = (f"stage '{stage}': worker process {pid} could not unpickle the item "
                        f"({type(e).__name__}: {e})")
                _send(conn, _ERROR, seq, _exception_payload(e, text), files)
                continue
            try:
                result = fn(item)
            except BaseException as e:
                del item
                payload = _exception_payload(e)
                del e
                _send(conn, _ERROR, seq, payload, files)
                continue
            del item
            one_thread_for_torch()
            try:
                payload = _dumps(result, files)
            except BaseException as e:
                text = (f"stage '{stage}': the function's result cannot be sent back from worker "
                        f"process {pid} ({type(e).__name__}: {e})")
                _send(conn, _ERROR, seq, _exception_payload(e, text), files)
                continue
            finally:
                del result
            _send(conn, _RESULT, seq, payload, files)
            del payload
    except OSError:  # the parent closed the pipe or is gone
        pass
    if os.getppid() != parent_pid:  # the parent died: nobody else removes this pool's files
        _remove_files(f"sf-{parent_pid}-{pool_id}-")


# ---- the parent ---------------------------------------------------------------------------------

def _field_of(item, field, stage):
    Error, _ = _errors()
    if isinstance(item, dict):
        if field in item:
            return item[field]
        keys = ", ".join(repr(k) for k in list(item)[:8])
        raise Error(f"stage '{stage}': field={field!r}: the item has no field {field!r} "
                    f"(a dict with keys {keys})")
    if isinstance(item, (tuple, list)):
        if (isinstance(field, int) and not isinstance(field, bool)
                and -len(item) <= field < len(item)):
            return item[field]
        raise Error(f"stage '{stage}': field={field!r}: the item is a {type(item).__name__} of "
                    f"{len(item)}, which has no field {field!r}")
    raise Error(f"stage '{stage}': field={field!r}: the item is a {type(item).__name__}, not a "
                f"dict or a tuple")


def _with_field(item, field, value):
    if isinstance(item, dict):
        out = item.copy()
        out[field] = value
        return out
    fields = list(item)
    fields[field] = value
    if isinstance(item, list):
        return fields
    if type(item) is tuple:
        return tuple(fields)
    make = getattr(type(item), "_make", None)  # a namedtuple
    return make(fields) if make else tuple(fields)


def _close_pipe(slot):
    for end in (slot.sock, slot.conn):
        if end is not None:
            try:
                end.close()
            except OSError:
                pass
    slot.outq.clear()


def _death_cause(code):
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"{signal.Signals(-code).name} ({signal.strsignal(-code)})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _Entry:
    __slots__ = ("item", "value", "completion")

    def __init__(self, item, value, completion):
        self.item, self.value, self.completion = item, value, completion


class _Slot:
    """One worker: its process, pipe and items in flight (seq -> _Entry, oldest first)."""

    __slots__ = ("index", "generation", "process", "conn", "sock", "outq", "pid", "outstanding",
                 "files", "ready", "eof", "dead")

    def __init__(self, index, generation, prefix):
        self.index, self.generation = index, generation
        self.process = self.conn = self.sock = self.pid = None
        self.outq = collections.deque()  # framed messages the pipe did not take yet
        self.outstanding = {}
        self.files = _Files(f"{prefix}w{index}-g{generation}-in-")
        self.ready = self.eof = self.dead = False


class _State:
    """Everything a pool owns; the reader thread and the finalizer hold this, not the pool."""

    def __init__(self, fn_blob, fn_name, processes, stage, field, depth):
        self.fn_blob, self.fn_name = fn_blob, fn_name
        self.processes, self.stage, self.field, self.depth = processes, stage, field, depth
        self.owner = os.getpid()
        self.pool_id = next(_pool_ids)
        self.prefix = f"sf-{self.owner}-{self.pool_id}-"
        self.lock = threading.Lock()
        self.slots = [_Slot(i, 0, self.prefix) for i in range(processes)]
        self.seq = itertools.count()
        self.turn = 0
        self.deferred = []  # (completion, ok, value) for the reader thread to call
        self.thread = None
        self.wake_r = self.wake_w = None
        self.started = self.closed = False
        self.closed_event = threading.Event()
        self.broken = None  # the exception every item fails with once the pool cannot work
        self.start_failures = 0
        self.submitted = self.completed = self.failed = self.restarts = 0

    # -- under self.lock --------------------------------------------------------------------------

    def _start_all(self):
        """The reader thread, then every worker; one that fails to start is retried when an item
        is sent to it."""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.thread = threading.Thread(target=self._reader, name=f"splitflow-procs-{self.stage}",
                                       daemon=True)
        self.thread.start()
        self.started = True
        for slot in self.slots:
            try:
                self._spawn(slot)
            except Exception:
                pass

    def _spawn(self, slot):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        p = ctx.Process(target=_worker_main, name=f"splitflow-{self.stage}-w{slot.index}",
                        args=(child, self.fn_blob, self.stage, self.owner, self.pool_id,
                              slot.index, slot.generation), daemon=True)
        try:
            p.start()
        finally:
            child.close()
        slot.process, slot.conn, slot.pid = p, parent, p.pid
        # The same socket, for sends that never wait (MSG_DONTWAIT); reads stay blocking.
        slot.sock = socket.socket(fileno=os.dup(parent.fileno()))
        self._wake()

    def _post(self, slot, body):
        """Queues one message for a worker and sends what the pipe takes now, without waiting:
        the reader thread sends the rest when the worker has read (under self.lock)."""
        if slot.sock is not None:
            slot.outq.append(_framed(body))
            self._flush(slot)

    def _flush(self, slot):
        q = slot.outq
        while q:
            try:
                n = slot.sock.send(q[0], _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the worker is gone: the reader re-sends its items
                q.clear()
                return
            if n == len(q[0]):
                q.popleft()
            else:
                q[0] = q[0][n:]

    def _pick(self):
        n = len(self.slots)
        start, self.turn = self.turn, (self.turn + 1) % n
        best = None
        for k in range(n):
            slot = self.slots[(start + k) % n]
            if best is None or len(slot.outstanding) < len(best.outstanding):
                best = slot
        if best.process is None:
            self._spawn(best)
        return best

    def _send_item(self, slot, seq, entry):
        """Pickles and sends one item; returns the exception to fail it with, or None. A pipe
        that is already closed is no error here: the reader thread re-sends the item. Never waits
        on the worker."""
        try:
            payload = _dumps(entry.value, slot.files)
        except BaseException as e:
            if isinstance(e, Exception):
                Error, _ = _errors()
                err = Error(f"stage '{self.stage}': the item cannot be sent to a worker process "
                            f"({type(e).__name__}: {e})")
                err.__cause__ = e
                return err
            return e
        self._post(slot, _body(_ITEM, seq, payload, slot.files))
        return None

    def _wake(self):
        if self.wake_w is not None:
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass

    def _defer(self, pairs):
        """Fails (completion, exc) pairs later, on another thread than the caller's."""
        if not pairs:
            return
        if self.thread is not None and self.thread.is_alive() and not self.closed:
            self.deferred.extend((c, False, e) for c, e in pairs)
            self._wake()
        else:
            _late(self, [(c, False, e) for c, e in pairs])

    # -- any thread -------------------------------------------------------------------------------

    def submit(self, item, completion):
        if self.field is not None:
            try:
                value = _field_of(item, self.field, self.stage)
            except Exception as e:
                with self.lock:
                    self.submitted += 1
                    self._defer([(completion, e)])
                return
        else:
            value = item
        entry = _Entry(item, value, completion)
        with self.lock:
            self.submitted += 1
            err = self.closed_error() if self.closed else self.broken
            if err is None and os.getpid() != self.owner:
                Error, _ = _errors()
                err = Error(f"stage '{self.stage}': the process pool belongs to process "
                            f"{self.owner}; it cannot be used in a forked child")
            if err is None:
                try:
                    if not self.started:
                        self._start_all()
                    slot = self._pick()
                except Exception as e:
                    Error, _ = _errors()
                    err = Error(f"stage '{self.stage}': cannot start a worker process "
                                f"({type(e).__name__}: {e})")
            if err is None:
                seq = next(self.seq)
                slot.outstanding[seq] = entry
                err = self._send_item(slot, seq, entry)
                if err is not None:
                    del slot.outstanding[seq]
            if err is not None:
                self._defer([(completion, err)])

    def closed_error(self):
        Error, _ = _errors()
        return Error(f"stage '{self.stage}': the process pool was closed")

    def _finish(self, completion, ok, value):
        if ok:
            try:
                completion.done(value)
            except BaseException as e:
                value = e
            else:
                with self.lock:
                    self.completed += 1
                return
        try:
            completion.fail(value)
        except BaseException:
            sys.stderr.write(f"splitflow: stage '{self.stage}': completion.fail raised:\n"
                             + traceback.format_exc())
        with self.lock:
            self.failed += 1

    def _finish_all(self, triples):
        for c, ok, v in triples:
            self._finish(c, ok, v)

    # -- the reader thread ------------------------------------------------------------------------

    def _reader(self):
        try:
            while True:
                with self.lock:
                    if self.closed:
                        break
                    waits = {}
                    for slot in self.slots:
                        if slot.process is not None:
                            if not slot.eof:
                                waits[slot.conn] = slot
                            waits[slot.process.sentinel] = slot
                    deferred, self.deferred = self.deferred, []
                    wake_r = self.wake_r
                    backlog = any(slot.outq for slot in self.slots)
                self._finish_all(deferred)
                del deferred
                ready = multiprocessing.connection.wait(
                    [wake_r, *waits], _BACKLOG_POLL_S if backlog else None)
                if backlog:
                    with self.lock:
                        for slot in self.slots:
                            if slot.outq and not slot.dead:
                                self._flush(slot)
                for obj in ready:
                    if obj == wake_r:
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except OSError:
                            pass
                        continue
                    slot = waits[obj]
                    if slot.dead or self.closed:
                        continue
                    self._drain(slot)
                    if obj is not slot.conn:  # the sentinel: the process ended
                        self._on_death(slot)
        except BaseException as e:  # a bug here must not leave completions waiting forever
            if not self.closed:
                sys.stderr.write(f"splitflow: stage '{self.stage}': the process pool's reader "
                                 f"thread failed:\n" + traceback.format_exc())
                Error, _ = _errors()
                self._break(Error(f"stage '{self.stage}': the process pool failed "
                                  f"({type(e).__name__}: {e})"))
        finally:
            with self.lock:
                if self.closed:
                    self._close_wake()

    def _drain(self, slot):
        while not slot.eof:
            try:
                if not slot.conn.poll(0):
                    return
                data = slot.conn.recv_bytes()
            except (EOFError, OSError):
                slot.eof = True
                return
            self._on_message(slot, data)
            del data

    def _on_message(self, slot, data):
        Error, GraphError = _errors()
        try:
            kind, seq, body = _parse(data)
        except (OSError, ValueError) as e:  # a file removed meanwhile
            kind, seq = _HEAD.unpack_from(data)
            kind &= ~_VIA_SHM
            body = None
            lost = Error(f"stage '{self.stage}': a message from worker process {slot.pid} was "
                         f"lost ({type(e).__name__}: {e})")
        if kind == _READY:
            with self.lock:
                slot.ready = True
                self.start_failures = 0
            return
        if kind == _INIT_ERROR:
            blob_, text, tb = pickle.loads(body) if body is not None else (None, "?", "")
            err = GraphError(
                f"splitflow.Graph.stage('{self.stage}', processes={self.processes}): worker "
                f"process {slot.pid} cannot load the function {self.fn_name} ({text}); define it "
                f"at module level of a module the worker processes can import, as DataLoader "
                f"workers need")
            _add_note(err, f"Traceback in worker process {slot.pid} of stage '{self.stage}':\n{tb}")
            self._break(err)
            return
        with self.lock:
            entry = slot.outstanding.pop(seq, None)
        if body is None:
            if entry is not None:
                self._finish(entry.completion, False, lost)
            return
        if kind == _RESULT:
            try:
                result = pickle.loads(body)
            except BaseException as e:
                result, ok = Error(f"stage '{self.stage}': the result from worker process "
                                   f"{slot.pid} could not be unpickled ({type(e).__name__}: "
                                   f"{e})"), False
                result.__cause__ = e
            else:
                ok = True
                if entry is not None and self.field is not None:
                    result = _with_field(entry.item, self.field, result)
        else:
            ok, result = False, self._exception(slot, body)
        del body
        if entry is not None:  # None: failed already (the pool closed)
            self._finish(entry.completion, ok, result)

    def _exception(self, slot, body):
        Error, _ = _errors()
        try:
            blob, text, tb = pickle.loads(body)
        except Exception as e:
            blob, text, tb = None, f"the error could not be unpickled ({type(e).__name__}: {e})", ""
        exc = None
        if blob is not None:
            try:
                exc = pickle.loads(blob)
            except BaseException:
                exc = None
            if not isinstance(exc, BaseException):
                exc = None
        if exc is None:
            exc = Error(text)
        _add_note(exc, f"Traceback in worker process {slot.pid} of stage '{self.stage}':\n{tb}")
        return exc

    def _on_death(self, slot):
        Error, _ = _errors()
        p = slot.process
        p.join(1.0)
        code = p.exitcode
        cause = _death_cause(code)
        failures = []
        with self.lock:
            if self.closed or slot.dead:
                return
            slot.dead = True
            entries = list(slot.outstanding.items())
            slot.outstanding.clear()
            if not slot.ready:
                self.start_failures += 1
            if self.broken is None and not slot.ready and self.start_failures >= _START_FAILURES:
                self.broken = Error(
                    f"stage '{self.stage}': worker processes die while they start ({cause}, "
                    f"{self.start_failures} times in a row); their output on stderr says why")
            if entries:
                seq, entry = entries.pop(0)
                if slot.ready:
                    msg = (f"stage '{self.stage}': worker process {slot.pid} died with {cause} "
                           f"while it processed this item; a new worker replaces it")
                else:
                    msg = (f"stage '{self.stage}': worker process {slot.pid} died with {cause} "
                           f"while it started, before it took this item; a new worker replaces it")
                failures.append((entry.completion, self.broken or Error(msg)))
            new = _Slot(slot.index, slot.generation + 1, self.prefix)
            self.slots[slot.index] = new
            _remove_files(f"{self.prefix}w{slot.index}-g{slot.generation}-")
            if self.broken is not None or _exiting:
                failures += [(e.completion, self.broken or self.closed_error()) for _, e in entries]
            else:
                self.restarts += 1
                # Eager unless it died before it was ready with nothing to do (no restart loop).
                if entries or slot.ready:
                    try:
                        self._spawn(new)
                    except BaseException as e:
                        self.broken = Error(f"stage '{self.stage}': cannot start a worker "
                                            f"process ({type(e).__name__}: {e})")
                for seq, entry in entries:
                    if new.process is None:
                        failures.append((entry.completion, self.broken))
                        continue
                    new.outstanding[seq] = entry
                    err = self._send_item(new, seq, entry)
                    if err is not None:
                        del new.outstanding[seq]
                        failures.append((entry.completion, err))
        _close_pipe(slot)
        try:
            p.close()
        except ValueError:
            pass
        if self.broken is not None:
            self._break(self.broken)
        self._finish_all([(c, False, e) for c, e in failures])

    def _break(self, err):
        """Fails every item in flight, and every later one, with err."""
        with self.lock:
            if self.broken is None:
                self.broken = err
            entries = []
            for slot in self.slots:
                entries += slot.outstanding.values()
                slot.outstanding.clear()
            deferred, self.deferred = self.deferred, []
        self._finish_all(deferred + [(e.completion, False, err) for e in entries])

    def _close_wake(self):
        for fd in (self.wake_r, self.wake_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.wake_r = self.wake_w = None

    def close(self):
        with self.lock:
            already = self.closed
            self.closed = True
        if already:  # closing or closed: wait until it is done (not on the reader thread)
            if threading.current_thread() is not self.thread:
                self.closed_event.wait(3 * _JOIN_S)
            return
        try:
            self._close()
        finally:
            self.closed_event.set()

    def _close(self):
        with self.lock:
            err = self.closed_error()
            triples = self.deferred
            self.deferred = []
            for slot in self.slots:
                triples += [(e.completion, False, err) for e in slot.outstanding.values()]
                slot.outstanding.clear()
            slots = list(self.slots)
            thread = self.thread
            self._wake()
        _live.discard(self)
        if os.getpid() != self.owner:  # a forked child's copy: the processes are the parent's
            return
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
        with self.lock:
            for slot in slots:
                self._post(slot, _HEAD.pack(_STOP, 0))
        deadline = time.monotonic() + _JOIN_S
        for slot in slots:
            if slot.process is not None:
                slot.process.join(max(0.0, deadline - time.monotonic()))
        for slot in slots:
            p = slot.process
            if p is not None and p.exitcode is None:
                p.kill()
                p.join(_JOIN_S)
        for slot in slots:
            _close_pipe(slot)
            if slot.process is not None and slot.process.exitcode is not None:
                try:
                    slot.process.close()
                except ValueError:
                    pass
        with self.lock:
            if thread is None or not thread.is_alive():
                self._close_wake()
        self._finish_all(triples)
        _remove_files(self.prefix)


_late_lock = threading.Lock()
_late_queue = None


def _late_loop(q):
    while True:
        state, triples = q.get()
        state._finish_all(triples)
        del state, triples


def _late(state, triples):
    """Completions of a pool without a reader thread (closed): one shared daemon thread."""
    global _late_queue
    with _late_lock:
        if _late_queue is None or _late_queue[1].ident is None or not _late_queue[1].is_alive():
            q = queue.SimpleQueue()
            t = threading.Thread(target=_late_loop, args=(q,), name="splitflow-procs-late",
                                 daemon=True)
            t.start()
            _late_queue = (q, t)
        _late_queue[0].put((state, triples))


def _finalize(state):
    """A pool collected (or the interpreter exiting): closes its state. Collection can happen on a
    thread inside the pool's lock (the reader thread), so never wait on the lock here."""
    if state.lock.acquire(blocking=False):
        state.lock.release()
        state.close()
    else:
        threading.Thread(target=state.close, name="splitflow-procs-close", daemon=True).start()


def _add_note(exc, note):
    try:
        exc.add_note(note)  # Python 3.11
    except AttributeError:
        try:
            exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
        except Exception:
            pass
    except Exception:
        pass


def _close_all():
    global _exiting
    _exiting = True
    for state in list(_live):
        try:
            state.close()
        except Exception:
            pass


atexit.register(_close_all)


def _fn_name(fn):
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else f"<{type(fn).__qualname__} object>"


class ProcessPool:
    """Runs ``fn(item)`` (or ``fn(item[field])``) in ``processes`` spawned worker processes for
    the stage ``stage``; see the module's docstring."""

    def __init__(self, fn, processes, stage, field=None, depth=2):
        Error, GraphError = _errors()
        where = f"splitflow.Graph.stage({stage!r}, processes={processes!r})"
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise GraphError(f"{where}: processes must be an int >= 1")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise GraphError(f"{where}: depth={depth!r} must be an int >= 1")
        if field is not None and (isinstance(field, bool) or not isinstance(field, (str, int))):
            raise GraphError(f"{where}: field={field!r} must be a str (a dict's key) or an int "
                             f"(a tuple's index)")
        if not callable(fn):
            raise GraphError(f"{where}: {fn!r} is not callable")
        name = _fn_name(fn)
        try:
            blob = pickle.dumps(fn, _PROTOCOL)
        except Exception as e:
            raise GraphError(f"{where}: the function {name} cannot be sent to worker processes "
                             f"({e}); define it at module level of an importable module, as "
                             f"DataLoader workers need") from None
        module = getattr(fn, "__module__", None) or type(fn).__module__
        main = sys.modules.get("__main__")
        if module == "__main__" and not getattr(main, "__file__", None):
            raise GraphError(f"{where}: the function {name} is defined in an interactive "
                             f"session's __main__, which worker processes cannot import; define "
                             f"it at module level of an importable module, as DataLoader "
                             f"workers need")
        self._s = _State(blob, name, processes, str(stage), field, depth)
        _live.add(self._s)
        self._finalizer = weakref.finalize(self, _finalize, self._s)

    def submit(self, item, completion):
        """Sends item to a worker; later, on the pool's reader thread, exactly one of
        completion.done(result) or completion.fail(exc) is called. Never calls them itself."""
        self._s.submit(item, completion)

    def close(self):
        """Stops the workers (killed after 2 s), fails the items in flight, removes the pool's
        shared-memory files. Idempotent. When it returns no completion is called any more (unless
        it is called from a completion, on the reader thread)."""
        self._finalizer.detach()
        self._s.close()

    @property
    def pids(self):
        s = self._s
        with s.lock:
            return [slot.pid for slot in s.slots if slot.process is not None and not slot.dead]

    def stats(self):
        s = self._s
        with s.lock:
            return {"processes": s.processes, "restarts": s.restarts, "submitted": s.submitted,
                    "completed": s.completed, "failed": s.failed}
