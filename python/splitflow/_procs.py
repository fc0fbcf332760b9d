"""Worker processes for a Python stage: ``Graph.stage(name, fn, processes=N)``.

``ProcessPool(fn, processes, stage, field=None, depth=2, substitute=None)`` runs ``fn`` in N processes started
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
    submit() sends an item to the worker with the fewest outstanding items (ties rotate), a
    started one with room (under ``depth`` items) before one still starting (whose start, 0.5-0.7
    s with torch imported, its items would wait for: a trade, where a body is slower than that);
    the caller bounds the items in flight (``depth`` per worker), so the next item already waits
    in the pipe when one finishes. Past that bound items still go out, to the least loaded worker.
  * submit() never blocks on a worker: a message the pipe does not take at once is queued and
    the reader thread sends it when the worker has read. The pool's lock is never held across
    anything that waits on another process.
  * One daemon reader thread per pool waits on every worker's pipe and process sentinel (one
    select.poll object, registered again only when a worker changes), takes all a pipe holds with
    one recv() and calls the completions, outside the pool's lock. Completions are never called
    from inside submit(): a failure found there (an item that cannot be pickled, a missing field,
    a closed pool) goes to the reader thread (to a shared daemon thread once the pool is closed).
  * Arrays travel through reusable shared memory: a numpy array, a CPU torch tensor (torch
    already imported) or a host splitflow.Tensor of >= 64 KiB is copied (one pass, any strides)
    into a slot of the sender's arena and only (offset, dtype, shape, kind) is pickled; the
    receiver wraps the slot's memory without a copy (``np.frombuffer``, ``torch.from_numpy``; a
    splitflow.Tensor arrives as a numpy array), writable, and the slot is not reused while any
    array (or view) made from it is alive. The arenas' pages stay mapped and resident, so an item
    costs one memcpy each way: no page faults, no map/unmap/unlink calls, no new files.
      - Each worker generation has two arenas, ``/dev/shm/sf-{parent_pid}-{pool_id}-w{worker}
        -g{generation}-arena-{in|out}`` (parent -> worker, worker -> parent): sparse files that
        the parent creates and maps before it starts the worker, which maps them and unlinks
        them at once. An arena has 2 * (depth + 1) slots of 32 MiB (address space only): a
        message's arrays (and its pickled bytes when over 32 KiB) go into one free slot, whose
        memory is reserved with posix_fallocate when a message first needs it (a full /dev/shm
        is then an error, not a SIGBUS), kept for the next messages, given back (MADV_REMOVE)
        when a much smaller message follows a large one; at most 64 MiB per arena.
      - The receiver names the slots it is done with on its next message the other way (a
        result, those of the items before it; an item, those of the results before it; a
        freed-slots message of its own when results free several and no item goes out), and the
        sender reuses them. A slot is done with once its message is read and its arrays are
        gone (a finalizer on the one base array per message, on any thread). The receiver holds
        at most depth + 1 slots that way: past that it copies arrays out, so the sender always
        has slots for the messages in flight, however long the receiver keeps what it got.
      - Bounded, never waiting: an array that finds no free slot, no room in its slot or no
        memory travels as before, in a new file ``...-g{generation}-{in|out}-{counter}``
        written with os.write, which the receiver maps, unlinks at once and wraps without a copy
        (the mapping lives as long as the array); with no room there either it is pickled
        inline, as are smaller arrays and small messages. Pipes only carry small messages: a
        header (kind, sequence, the sender's slot, the freed slots) and the pickle, or where it
        lies.
      - Closing the pool (or a worker's death) unmaps its arenas; one that received arrays still
        use stays mapped until the last of them goes (the file is gone already).
  * A worker that dies (a signal, os._exit) fails the item it held, the oldest one sent to it,
    with an Error naming the signal or exit code; a replacement worker (generation + 1, with new
    arenas) starts, and the rest of its items are sent again, first among the items waiting, to
    the workers as submit() chooses them (a started one with room first), re-serialized from the
    objects the parent keeps until each item completes; the dead worker's files are removed and
    the parent unmaps its arenas. A function that cannot be loaded in a worker, or workers that
    die three times in a row while they start, break the pool: every item then fails with that
    error.
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
import multiprocessing.util  # noqa: F401  (its exit hook registers before ours: ours runs first)
import os
import pickle
import queue
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import weakref

__all__ = ["PoolScope", "ProcessPool"]

_SHM_DIR = "/dev/shm"
_ARRAY_MIN = 64 * 1024  # arrays (numpy, torch, splitflow) of at least this size: shared memory
_INLINE_MAX = 32 * 1024  # a pickled message over this many bytes travels through shared memory
_ARENA_BYTES = 64 << 20  # each direction's arena of each worker: at most this much memory
_ARENA_SPAN = 32 << 20  # an arena slot: the arrays of one message up to this many bytes
_ARENA_MAX_SLOTS = 64
_GRAIN = 256 << 10  # an arena slot's memory grows in steps of this many bytes
_TRIM_MIN = 4 << 20  # a slot holding more than this, 4 times what a message used, gives it back
_ALIGN = 64  # arrays start at this alignment inside a slot
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_JOIN_S = 2.0  # close(): how long workers get to exit before they are killed
_STALE_S = 2.0  # a worker still busy this long with an item its run withdrew is replaced
_STALE_POLL_S = 0.5  # how often the reader looks for such a worker while items are out
_START_FAILURES = 3  # workers dying before they are ready this many times in a row break the pool

# A message: kind (1 byte, | _VIA_SHM when the body is the name of a file holding it, | _VIA_ARENA
# when the body is the (offset, length) of its bytes in the sender's arena), sequence, the sender's
# arena slot the message occupies (_NO_SLOT: none), how many slot ids follow: slots of the
# receiver's arena the sender has read, which the receiver may reuse; then the body.
_HEAD = struct.Struct("<BqBB")
_SPAN = struct.Struct("<QQ")
_VIA_SHM = 0x80
_VIA_ARENA = 0x40
_KIND = 0x3F
_NO_SLOT = 0xFF
_ITEM, _STOP, _READY, _INIT_ERROR, _RESULT, _ERROR, _FREED = range(1, 8)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", None)
_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
_READ_BYTES = 1 << 16  # one recv() takes up to this much of a pipe (several small messages)
_BACKLOG_POLL_S = 0.005  # how often the reader retries messages a full pipe did not take
_pool_ids = itertools.count(1)
_live = weakref.WeakSet()  # open pools' states: closed at interpreter exit
_exiting = False
_tls = threading.local()  # .reading: the message being unpickled on this thread (a _Reading)


def _errors():
    global _error_types
    if _error_types is None:
        from ._errors import Error, GraphError
        _error_types = Error, GraphError
    return _error_types


_error_types = None


# ---- shared memory ------------------------------------------------------------------------------

class _Files:
    """Creates the shared-memory files of one direction of one worker (one thread at a time): the
    way for arrays that find no room in the arena, and for all of them without one."""

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


class _Arena:
    """One direction's shared-memory arena of one worker generation: ``count`` slots of ``span``
    bytes in one sparse file (unlinked once both processes mapped it), at most _ARENA_BYTES of
    memory in all. The sender fills a free slot with one message's arrays (and its pickled bytes
    when they are large); the receiver hands the slot back once it has read the message and no
    array it made from the slot is alive any more, naming it on its next message the other way.

    Sender's side: ``fd``, ``free`` (slot ids), ``committed`` (bytes reserved per slot: with
    posix_fallocate, so a full /dev/shm is an error, not a SIGBUS; kept for the next messages).
    Receiver's side: ``freed`` (slots to name on the next message; appended to by finalizers on
    any thread, hence a deque), ``held`` (slots that arrays still use), ``limit`` (at most this
    many held at once: past it arrays are copied out, so the sender always has slots for the
    messages in flight)."""

    __slots__ = ("mm", "size", "_view", "fd", "span", "count", "free", "committed", "total",
                 "freed", "held", "limit")

    def __init__(self, fd, count, span, limit, sender):
        self.size = count * span
        self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = None
        self.fd = fd if sender else None
        self.count, self.span, self.limit = count, span, limit
        self.free = list(range(count - 1, -1, -1)) if sender else None
        self.committed = [0] * count
        self.total = 0
        self.freed = collections.deque()
        self.held = set()

    def view(self, offset, nbytes):
        """The arena's bytes [offset, offset + nbytes) as a numpy uint8 array (no copy)."""
        v = self._view
        if v is None:
            if self.mm is None:
                raise ValueError("splitflow: a shared-memory arena that was closed")
            import numpy as np

            v = self._view = np.frombuffer(self.mm, np.uint8)
        return v[offset:offset + nbytes]

    def commit(self, slot, end):
        """Whether bytes [0, end) of the slot are backed by memory (reserved now if need be)."""
        have = self.committed[slot]
        if end <= have:
            return True
        want = min(self.span, -(-end // _GRAIN) * _GRAIN)
        if self.total + want - have > _ARENA_BYTES:
            return False
        try:
            os.posix_fallocate(self.fd, slot * self.span + have, want - have)
        except (OSError, AttributeError):  # no memory (or no posix_fallocate): a file instead
            return False
        self.committed[slot] = want
        self.total += want - have
        return True

    def trim(self, slot, used):
        """After a burst of large messages, a small one gives the slot's memory back."""
        have = self.committed[slot]
        keep = -(-used // _GRAIN) * _GRAIN
        if have <= _TRIM_MIN or have <= 4 * keep or _MADV_REMOVE is None:
            return
        try:
            self.mm.madvise(_MADV_REMOVE, slot * self.span + keep, have - keep)
        except (OSError, ValueError, AttributeError):
            return
        self.committed[slot] = keep
        self.total -= have - keep

    def reuse(self, ids):
        """Sender: the receiver is done with these slots (ids from the peer: checked)."""
        free = self.free
        for i in ids:
            if i < self.count and i not in free:
                free.append(i)

    def release(self, slot):
        """Receiver: done with a slot (on any thread: a finalizer)."""
        self.held.discard(slot)
        self.freed.append(slot)

    def take_freed(self):
        out = []
        q = self.freed
        while q and len(out) < 255:
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return out

    def close(self):
        mm, self.mm, self._view = self.mm, None, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # arrays still use it: it is unmapped when the last one goes
                pass
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _arena_shape(depth):
    """(slots, slots the receiver may hold): the messages in flight one way (depth, and one
    spare) plus as many the receiver's arrays may keep."""
    held = max(1, min(depth + 1, _ARENA_MAX_SLOTS // 2))
    return 2 * held, held


def _create_arenas(prefix, depth):
    """The parent's side of a worker's two arenas, as files ``{prefix}arena-in`` and
    ``{prefix}arena-out`` for the worker to open (it unlinks them): (in: sent, out: received,
    what the worker needs to open them)."""
    count, limit = _arena_shape(depth)
    made, arenas = [], []
    try:
        for direction, sender in (("in", True), ("out", False)):
            name = f"{prefix}arena-{direction}"
            path = os.path.join(_SHM_DIR, name)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            made.append(name)
            try:
                os.ftruncate(fd, count * _ARENA_SPAN)  # sparse: memory comes with commit()
                arenas.append(_Arena(fd, count, _ARENA_SPAN, limit, sender))
            except BaseException:
                os.close(fd)
                raise
            if not sender:
                os.close(fd)
    except BaseException:
        for a in arenas:
            a.close()
        for name in made:
            _unlink(os.path.join(_SHM_DIR, name))
        raise
    return arenas[0], arenas[1], (made[0], made[1], count, _ARENA_SPAN, limit)


def _open_arenas(names):
    """The worker's side: (in: received, out: sent); the files are unlinked here, whatever
    happens. None, None when they cannot be opened (items then fail, results use files)."""
    in_name, out_name, count, span, limit = names
    paths = [_shm_path(in_name), _shm_path(out_name)]
    arenas = []
    try:
        for path, sender in zip(paths, (False, True)):
            fd = os.open(path, os.O_RDWR)
            try:
                arenas.append(_Arena(fd, count, span, limit, sender))
            except BaseException:
                os.close(fd)
                raise
            if not sender:
                os.close(fd)
        return arenas[0], arenas[1]
    except (OSError, ValueError):
        for a in arenas:
            a.close()
        return None, None
    finally:
        for path in paths:
            _unlink(path)


class _Reading:
    """The message being unpickled from a slot of arena (on this thread: _tls.reading)."""

    __slots__ = ("arena", "slot", "base", "share")

    def __init__(self, arena, slot):
        self.arena, self.slot, self.base = arena, slot, None
        # Arrays use the slot's memory without a copy unless the receiver holds too many slots.
        self.share = arena is not None and len(arena.held) < arena.limit

    def array(self, offset, nbytes):
        """The message's bytes [offset, offset + nbytes) (arena offsets) as a uint8 array that
        keeps the slot from being reused while it (or any view of it) is alive."""
        arena, slot = self.arena, self.slot
        if arena is None or slot == _NO_SLOT:
            raise ValueError("splitflow: an array in a shared-memory arena that this process does "
                             "not have open")
        start = slot * arena.span
        if not (start <= offset and offset + nbytes <= start + arena.span):
            raise ValueError("splitflow: an array outside its shared-memory slot")
        base = self.base
        if base is None:
            import numpy as np

            if arena.mm is None:
                raise ValueError("splitflow: a shared-memory arena that was closed")
            # One base array per message: all its arrays are views of it (numpy keeps the base
            # alive), so the slot is released once, when the last of them goes.
            base = self.base = np.frombuffer(arena.mm, np.uint8, arena.span, start)
            weakref.finalize(base, arena.release, slot).atexit = False
            if self.share:
                arena.held.add(slot)
        return base[offset - start:offset - start + nbytes]


def _arena_numpy(offset, dtype, shape):
    """An array read from the arena: a view of its slot (writable; the slot is reused when the
    array and its views are gone), or a copy when the receiver already holds enough slots."""
    import numpy as np

    reading = getattr(_tls, "reading", None)
    if reading is None:
        raise ValueError("splitflow: an array in a shared-memory arena outside of a message")
    dt = np.dtype(dtype)
    count = 1
    for n in shape:
        count *= n
    a = reading.array(offset, count * dt.itemsize).view(dt).reshape(shape)
    return a if reading.share else a.copy()


def _arena_torch(offset, dtype, shape, view_as, requires_grad):
    import torch

    t = torch.from_numpy(_arena_numpy(offset, dtype, shape))
    if view_as:
        t = t.view(getattr(torch, view_as))
    if requires_grad:
        t.requires_grad_(True)
    return t


# ---- pickling and messages ----------------------------------------------------------------------

class _Sender:
    """Builds the messages of one direction of one worker (one thread at a time): large arrays go
    into a slot of ``arena``, else into files; each message names the slots of ``inbox`` (the
    peer's arena, which this process reads) that this process is done with."""

    __slots__ = ("files", "arena", "inbox", "slot", "used")

    def __init__(self, files, arena=None, inbox=None):
        self.files = files
        self.arena = arena
        self.inbox = inbox
        self.slot = _NO_SLOT  # the slot of the message being built
        self.used = 0

    def reserve(self, nbytes):
        """The arena offset of nbytes for the message being built, or None (no arena, no free
        slot, no room left in the slot, no memory)."""
        a = self.arena
        if a is None:
            return None
        if self.slot == _NO_SLOT:
            if not a.free:
                return None
            self.slot, self.used = a.free.pop(), 0
        start = -(-self.used // _ALIGN) * _ALIGN
        end = start + nbytes
        if end > a.span or not a.commit(self.slot, end):
            if self.used == 0:  # nothing in it: free again
                self._unreserve()
            return None
        self.used = end
        return self.slot * a.span + start

    def encode(self, kind, seq, obj):
        """The message carrying obj; raises what pickling raises (then nothing stays reserved)."""
        self.slot = _NO_SLOT
        self.files.created = []
        buf = io.BytesIO()
        try:
            _Pickler(buf, self).dump(obj)
            return self._frame(kind, seq, buf.getbuffer())
        except BaseException:
            self.files.discard()
            self._unreserve()
            raise
        finally:
            self.files.created = []

    def encode_bytes(self, kind, seq, payload):
        """The message carrying payload (bytes already pickled, or b"")."""
        self.slot = _NO_SLOT
        self.files.created = []
        try:
            return self._frame(kind, seq, payload)
        finally:
            self.files.created = []

    def _frame(self, kind, seq, payload):
        n = len(payload)
        if n > _INLINE_MAX:  # pipes only carry small messages
            offset = self.reserve(n)
            if offset is not None:
                self.arena.mm[offset:offset + n] = payload
                kind, payload = kind | _VIA_ARENA, _SPAN.pack(offset, n)
            else:
                name = self.files.write(payload)
                if name is not None:
                    kind, payload = kind | _VIA_SHM, name.encode()
        freed = self.inbox.take_freed() if self.inbox is not None else ()
        slot, self.slot = self.slot, _NO_SLOT
        if slot != _NO_SLOT:
            self.arena.trim(slot, self.used)
        return _HEAD.pack(kind, seq, slot, len(freed)) + bytes(freed) + payload

    def _unreserve(self):
        if self.slot != _NO_SLOT:
            self.arena.free.append(self.slot)
            self.slot = _NO_SLOT

    def close(self):
        for a in (self.arena, self.inbox):
            if a is not None:
                a.close()
        self.arena = self.inbox = None


class _Pickler(pickle.Pickler):
    """Sends large arrays through shared memory: only (offset or file name, dtype, shape) is
    pickled."""

    def __init__(self, file, sender):
        super().__init__(file, _PROTOCOL)
        self._tx = sender

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

    def _put(self, np, a):
        """Copies a (any strides) into the arena; its offset, or None."""
        offset = self._tx.reserve(a.nbytes)
        if offset is None:
            return None
        dst = self._tx.arena.view(offset, a.nbytes).view(a.dtype).reshape(a.shape)
        np.copyto(dst, a, casting="no")
        return offset

    def _numpy(self, np, a):
        offset = self._put(np, a)
        if offset is not None:
            return _arena_numpy, (offset, a.dtype.str, a.shape)
        name = self._tx.files.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        if name is None:
            return NotImplemented
        return _shm_numpy, (name, a.dtype.str, a.shape)

    def _torch(self, torch, t):
        try:
            if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                    or t.element_size() * t.numel() < _ARRAY_MIN):
                return NotImplemented
            x, view_as = t.detach(), None
            if x.dtype == torch.bfloat16:
                x, view_as = x.view(torch.int16), "bfloat16"
            a = x.resolve_conj().resolve_neg().numpy()  # any strides: copied once, below
        except Exception:  # a dtype numpy lacks, a tensor subclass's oddity: torch's own pickling
            return NotImplemented
        import numpy as np

        shape, requires_grad = tuple(t.shape), bool(t.requires_grad)
        offset = self._put(np, a)
        if offset is not None:
            return _arena_torch, (offset, a.dtype.str, shape, view_as, requires_grad)
        name = self._tx.files.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        if name is None:
            return NotImplemented
        return _shm_torch, (name, a.dtype.str, shape, view_as, requires_grad)


def _framed(body):
    """body framed as Connection.send_bytes frames it (a big-endian int32 length; -1 then a
    uint64 past 2 GiB), so that the worker's Connection.recv_bytes reads it."""
    n = len(body)
    prefix = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return memoryview(prefix + body)


def _frames(buf):
    """Takes the whole messages off the front of buf (a bytearray of what the pipe gave), framed
    as Connection.send_bytes frames them."""
    out, pos, end = [], 0, len(buf)
    with memoryview(buf) as view:
        while end - pos >= 4:
            n = int.from_bytes(view[pos:pos + 4], "big", signed=True)
            start = pos + 4
            if n == -1:
                if end - pos < 12:
                    break
                n = int.from_bytes(view[start:start + 8], "big")
                start += 8
            if end - start < n:
                break
            out.append(bytes(view[start:start + n]))
            pos = start + n
    del buf[:pos]
    return out


def _head(data):
    """(kind with its flags, seq, the sender's slot, the receiver's slots it frees)."""
    kind, seq, slot, nfreed = _HEAD.unpack_from(data)
    return kind, seq, slot, bytes(data[_HEAD.size:_HEAD.size + nfreed])


def _body(data, arena):
    """A message's pickled bytes: in the pipe's message, or read from the arena or a file."""
    kind, _, _, nfreed = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size + nfreed:]
    if kind & _VIA_SHM:
        return _read_whole(bytes(body).decode())
    if kind & _VIA_ARENA:
        offset, n = _SPAN.unpack(body)
        mm = arena.mm if arena is not None else None
        if mm is None or offset + n > arena.size:
            raise ValueError("splitflow: a message in a shared-memory arena that this process "
                             "does not have open")
        return mm[offset:offset + n]
    return body


def _loads(body, arena, slot):
    """Unpickles a message whose arrays may be in a slot of arena; the slot is released once the
    message is read and no array made from it is alive."""
    reading = _tls.reading = _Reading(arena, slot)
    try:
        return pickle.loads(body)
    finally:
        _tls.reading = None
        if reading.base is None:
            _release(arena, slot)
        reading.base = None  # the slot's finalizer runs now, unless arrays still use it


def _release(arena, slot):
    if slot != _NO_SLOT and arena is not None:
        arena.release(slot)


def _exception_payload(e, text=None):
    """(the exception pickled or None, its text, the traceback, whether it is the function's
    own: without a text, the parent rebuilds it as the StageError's cause, or a RemoteException
    in its place; with one, it is a splitflow.Error of that text)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    blob = None
    own = text is None
    if own:
        # A SystemExit or KeyboardInterrupt too: in the parent it stops the run as in a thread
        # stage, whatever the stage's on_error.
        text = f"{type(e).__name__}: {e}"
        try:
            blob = pickle.dumps(e, _PROTOCOL)
            pickle.loads(blob)  # a class whose __init__ takes other arguments fails here
        except BaseException:
            blob = None
            if not isinstance(e, Exception):  # still a stop: the builtin it derives from
                blob = pickle.dumps(_builtin_stop(e), _PROTOCOL)
    return pickle.dumps((blob, text, tb, type(e).__name__ if own else None), _PROTOCOL)


# ---- the worker ---------------------------------------------------------------------------------

class _Groups(list):
    """A dynamic batch whose requests collate as several batches (other shapes; requests an
    earlier stage failed left out): the worker calls the function on each and answers with the
    list of their results (python/src/core.cpp, request_groups), a _Failed where a call raised
    (that group's requests fail, not the others')."""


class _Failed:
    """A group's call that raised (an Exception: a stop request ends the item as before)."""
    __slots__ = ("exception",)

    def __init__(self, exception):
        self.exception = exception

    def __reduce__(self):
        return _Failed, (self.exception,)


def _call_groups(fn, groups):
    if len(groups) == 1:
        return [fn(groups[0])]
    out = []
    for part in groups:
        try:
            out.append(fn(part))
        except Exception as e:
            import traceback
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            e.add_note("".join(traceback.format_exc()))
            out.append(_Failed(e))
    return out


def _worker_main(conn, fn_blob, stage, parent_pid, pool_id, index, generation, arenas=None):
    """A worker process: loads fn, then answers each item in order until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pid = os.getpid()
    rx = None  # the parent's arena: items' arrays
    tx = _Sender(_Files(f"sf-{parent_pid}-{pool_id}-w{index}-g{generation}-out-"))
    if arenas is not None:
        try:
            rx, tx.arena = _open_arenas(arenas)
        except Exception:
            pass
        tx.inbox = rx
    pending = collections.deque()  # messages read ahead: a stop behind them skips them
    torch_threads = [False]

    def one_thread_for_torch():
        if not torch_threads[0] and "torch" in sys.modules:
            torch_threads[0] = True
            try:
                sys.modules["torch"].set_num_threads(1)
            except Exception:
                pass

    def send(kind, seq, payload):  # blocking: the parent's reader thread always reads
        conn.send_bytes(tx.encode_bytes(kind, seq, payload))

    sock = socket.socket(fileno=os.dup(conn.fileno()))  # reads: one recv() per wakeup
    rbuf = bytearray()

    def read(block):
        """Appends the messages the pipe holds to pending; block: waits for one."""
        while True:
            try:
                chunk = sock.recv(_READ_BYTES, 0 if block else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not chunk:
                raise EOFError
            rbuf.extend(chunk)
            for data in _frames(rbuf):
                kind, seq, slot, freed = _head(data)
                if freed and tx.arena is not None:
                    tx.arena.reuse(freed)  # our slots the parent is done with
                if kind != _FREED:
                    pending.append((kind, seq, slot, data))
            if pending:
                block = False
            if not block and len(chunk) < _READ_BYTES:
                return

    try:
        fn = pickle.loads(fn_blob)
    except BaseException as e:
        try:
            send(_INIT_ERROR, 0, _exception_payload(e, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    del fn_blob
    one_thread_for_torch()
    try:
        send(_READY, 0, b"")
        while True:
            try:
                read(not pending)
            except (EOFError, OSError):  # the parent closed the pipe or is gone
                break
            if any(kind & _KIND == _STOP for kind, _, _, _ in pending):
                break
            _, seq, slot, data = pending.popleft()
            try:
                try:
                    body = _body(data, rx)
                except BaseException:
                    _release(rx, slot)
                    raise
                del data
                item = _loads(body, rx, slot)  # its arrays: views of the parent's slot
                del body
            except BaseException as e:
                text = (f"stage '{stage}': worker process {pid} could not unpickle the item "
                        f"({type(e).__name__}: {e})")
                payload = _exception_payload(e, text)
                del e
                send(_ERROR, seq, payload)
                continue
            try:
                result = _call_groups(fn, item) if type(item) is _Groups else fn(item)
            except BaseException as e:
                del item
                payload = _exception_payload(e)
                del e
                send(_ERROR, seq, payload)
                continue
            del item
            one_thread_for_torch()
            try:
                message = tx.encode(_RESULT, seq, result)
            except BaseException as e:
                text = (f"stage '{stage}': the function's result cannot be sent back from worker "
                        f"process {pid} ({type(e).__name__}: {e})")
                send(_ERROR, seq, _exception_payload(e, text))
                continue
            finally:
                del result
            conn.send_bytes(message)
            del message
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
    from ._tuples import rebuilt

    return rebuilt(item, fields)


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

    __slots__ = ("index", "generation", "prefix", "process", "conn", "sock", "outq", "pid",
                 "outstanding", "tx", "rx", "rbuf", "ready", "eof", "dead", "stale_since",
                 "killed_stale")

    def __init__(self, index, generation, prefix):
        self.index, self.generation = index, generation
        self.prefix = f"{prefix}w{index}-g{generation}-"  # its files: removed when it dies
        self.process = self.conn = self.sock = self.pid = None
        self.outq = collections.deque()  # framed messages the pipe did not take yet
        self.outstanding = {}
        self.tx = _Sender(_Files(f"{self.prefix}in-"))  # items; its arena made with the process
        self.rx = None  # the worker's arena: results' arrays
        self.rbuf = bytearray()  # what the pipe gave past the last whole message
        self.ready = self.eof = self.dead = False
        self.stale_since = None  # time.monotonic() it was first seen busy with a withdrawn item
        self.killed_stale = False  # the pool killed it for that (_replace_stale)

    def close_arenas(self):
        """Unmaps both arenas (one that arrays still use: when the last of them goes)."""
        self.tx.close()
        self.rx = None


def _held(slot):
    """The worker's oldest item out, the one in its hands (None: it has none)."""
    return next(iter(slot.outstanding.values()), None)


def _withdrawn(completion):
    try:
        return bool(completion.withdrawn())
    except Exception:  # a completion without it (a test's): never withdrawn
        return False


class _KeepSample:
    """The completion of a field= item under substitute=: however the item fails (its function
    raised, its worker died, it could not be sent), the sample goes on with that field
    substituted and its other fields kept."""
    __slots__ = ("completion", "item", "field", "substitute")

    def __init__(self, completion, item, field, substitute):
        self.completion, self.item, self.field, self.substitute = completion, item, field, substitute

    def withdrawn(self):
        return _withdrawn(self.completion)

    def done(self, value):
        return self.completion.done(value)

    def fail(self, exc):
        try:
            keep = _with_field(self.item, self.field, self.substitute)
        except Exception:
            return self.completion.fail(exc)
        return self.completion.fail(exc, keep)


class _State:
    """Everything a pool owns; the reader thread and the finalizer hold this, not the pool."""

    def __init__(self, fn_blob, fn_name, processes, stage, field, depth, substitute):
        self.fn_blob, self.fn_name = fn_blob, fn_name
        self.processes, self.stage, self.field, self.depth = processes, stage, field, depth
        self.substitute = substitute  # a field= stage's substitute= (None: none)
        self.owner = os.getpid()
        self.pool_id = next(_pool_ids)
        self.prefix = f"sf-{self.owner}-{self.pool_id}-"
        self.lock = threading.Lock()
        self.slots = [_Slot(i, 0, self.prefix) for i in range(processes)]
        self.seq = itertools.count()
        self.turn = 0
        self.deferred = []  # (completion, ok, value) for the reader thread to call
        self.waiting = collections.deque()  # _Entry: submitted, for the next free worker (_dispatch)
        self.thread = None
        self.wake_r = self.wake_w = None
        self.started = self.closed = False
        self.closed_event = threading.Event()
        self.broken = None  # the exception every item fails with once the pool cannot work
        self.start_failures = 0
        self.submitted = self.completed = self.failed = self.restarts = 0
        self.replaced_stale = 0  # workers replaced while busy with a withdrawn item
        self.resent = 0  # items sent again after their worker died with them

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
        names = None
        try:  # the worker opens (and unlinks) them; without them arrays travel in files
            slot.tx.arena, slot.rx, names = _create_arenas(slot.prefix, self.depth)
            slot.tx.inbox = slot.rx
        except Exception:
            pass
        try:
            parent, child = ctx.Pipe(duplex=True)
        except BaseException:
            self._drop_arenas(slot)
            raise
        p = ctx.Process(target=_worker_main, name=f"splitflow-{self.stage}-w{slot.index}",
                        args=(child, self.fn_blob, self.stage, self.owner, self.pool_id,
                              slot.index, slot.generation, names), daemon=True)
        try:
            p.start()
        except BaseException:
            parent.close()
            self._drop_arenas(slot)
            raise
        finally:
            child.close()
        slot.process, slot.conn, slot.pid = p, parent, p.pid
        # The same socket, for sends and reads that never wait (MSG_DONTWAIT).
        slot.sock = socket.socket(fileno=os.dup(parent.fileno()))
        self._wake()

    def _drop_arenas(self, slot):
        slot.close_arenas()
        _remove_files(f"{slot.prefix}arena-")

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

    def _withdrawn_error(self):
        Error, _ = _errors()
        return Error(f"stage '{self.stage}': withdrawn by its run")

    def _busy_withdrawn(self, slot):
        """Whether the worker is busy with an item its run withdrew (a run left early): it may
        be slow to come back, or never (a hung body, replaced after _STALE_S). Known at once,
        from the item, not only from the reader's next look at the workers (_replace_stale)."""
        if slot.stale_since is not None:
            return True
        held = _held(slot)
        return held is not None and _withdrawn(held.completion)

    def _pick(self):
        """The worker with the fewest items out, ties rotating; one still starting only when
        every started one holds `depth` items (an item sent to it waits for its start, 0.5-0.7 s
        with torch imported, where a started worker would take it next: a worker's replacement
        took the next items while the other worker, idle, had room); one busy with an item its
        run withdrew last (_busy_withdrawn)."""
        n = len(self.slots)
        start, self.turn = self.turn, (self.turn + 1) % n
        best = best_key = None
        for k in range(n):
            slot = self.slots[(start + k) % n]
            held = len(slot.outstanding)
            key = (self._busy_withdrawn(slot), held >= self.depth, not slot.ready, held)
            if best is None or key < best_key:
                best, best_key = slot, key
        if best.process is None:
            self._spawn(best)
        return best

    def _dispatch(self):
        """Sends the waiting items to workers, oldest first, while one can take them: none goes
        to a worker busy with an item its run withdrew, where it would wait for that item, for
        its replacement if the body hangs (a new user's trial: the epoch after a break sent items
        to a hung worker, which waited 2 s for its replacement while the other worker was idle).
        They wait here instead, for the first worker that answers or is replaced (the reader
        thread dispatches after each look at the workers)."""
        if self.broken is not None and self.waiting:  # (the workers cannot start: _on_death)
            self._defer([(e.completion, self.broken) for e in self.waiting])
            self.waiting.clear()
        # (Not at interpreter exit, when _on_death starts no worker either: close() fails them.)
        while self.waiting and not self.closed and self.broken is None and not _exiting:
            entry = self.waiting[0]
            if _withdrawn(entry.completion):  # its run is over: not computed
                self.waiting.popleft()
                self._defer([(entry.completion, self._withdrawn_error())])
                continue
            try:
                slot = self._pick()
            except Exception as e:
                self.waiting.popleft()
                Error, _ = _errors()
                self._defer([(entry.completion, _stops_run(Error(
                    f"stage '{self.stage}': cannot start a worker process ({type(e).__name__}: {e})")))])
                continue
            if self._busy_withdrawn(slot):
                return
            self.waiting.popleft()
            seq = next(self.seq)
            slot.outstanding[seq] = entry
            err = self._send_item(slot, seq, entry)
            if err is not None:
                del slot.outstanding[seq]
                self._defer([(entry.completion, err)])

    def _send_item(self, slot, seq, entry):
        """Pickles and sends one item; returns the exception to fail it with, or None. A pipe
        that is already closed is no error here: the reader thread re-sends the item. Never waits
        on the worker."""
        try:
            body = slot.tx.encode(_ITEM, seq, entry.value)
        except BaseException as e:
            if isinstance(e, Exception):
                Error, _ = _errors()
                err = Error(f"stage '{self.stage}': the item cannot be sent to a worker process "
                            f"({type(e).__name__}: {e})")
                # Without its traceback: its frames (this one's, holding err) made a cycle that
                # kept the pool and its workers alive after the graph went, until the cyclic GC
                # ran (a new user's trial).
                err.__cause__ = e.with_traceback(None)
                return err
            return e
        self._post(slot, body)
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
            if self.substitute is not None:
                completion = _KeepSample(completion, item, self.field, self.substitute)
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
                except Exception as e:
                    Error, _ = _errors()
                    err = _stops_run(Error(f"stage '{self.stage}': cannot start a worker "
                                           f"process ({type(e).__name__}: {e})"))
            if err is None:
                self.waiting.append(entry)
                self._dispatch()
            else:
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
        poller = select.poll()  # kept: registered again only when the descriptors change
        registered = set()
        try:
            while True:
                with self.lock:
                    if self.closed:
                        break
                    waits = {self.wake_r: (None, False)}  # fd -> (slot, is the sentinel)
                    for slot in self.slots:
                        if slot.process is not None:
                            if not slot.eof:
                                try:
                                    waits[slot.conn.fileno()] = (slot, False)
                                except OSError:
                                    slot.eof = True
                            waits[slot.process.sentinel] = (slot, True)
                    deferred, self.deferred = self.deferred, []
                    wake_r = self.wake_r
                    backlog = any(slot.outq for slot in self.slots)
                    busy = any(slot.outstanding for slot in self.slots)
                self._finish_all(deferred)
                del deferred
                for fd in registered - waits.keys():
                    poller.unregister(fd)
                for fd in waits.keys() - registered:
                    poller.register(fd, select.POLLIN)
                registered = set(waits)
                ready = poller.poll(_BACKLOG_POLL_S * 1000 if backlog else
                                    _STALE_POLL_S * 1000 if busy else None)
                if backlog:
                    with self.lock:
                        for slot in self.slots:
                            if slot.outq and not slot.dead:
                                self._flush(slot)
                # the pipes first: a sentinel's turn drains its pipe, then replaces the worker
                ready.sort(key=lambda r: waits[r[0]][1])
                for fd, _ in ready:
                    slot, sentinel = waits[fd]
                    if slot is None:
                        try:
                            while os.read(wake_r, 4096):
                                pass
                        except OSError:
                            pass
                        continue
                    if slot.dead or self.closed:
                        continue
                    self._drain(slot)
                    if sentinel:  # the process ended
                        self._on_death(slot)
                if busy:  # after the pipes: a withdrawn item's result read first
                    self._replace_stale()
                with self.lock:
                    self._dispatch()
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

    def _replace_stale(self):
        """A worker whose item in hand was withdrawn by its run (a run left early, cancelled or
        failed) and is still busy with it after _STALE_S is killed and replaced, its other
        items sent again (_on_death): the next run's items would wait behind it, for ever if the
        body hangs (a new user's trial: an epoch after a break waited for a body of an hour)."""
        now = time.monotonic()
        kill = []
        with self.lock:
            for slot in self.slots:
                # (a worker still starting is not busy with the item: its items wait for it)
                if (slot.dead or slot.process is None or not slot.outstanding or not slot.ready
                        or slot.killed_stale):
                    if not slot.killed_stale:
                        slot.stale_since = None
                    continue
                held = _held(slot)
                if not _withdrawn(held.completion):
                    slot.stale_since = None
                elif slot.stale_since is None:
                    slot.stale_since = now
                elif now - slot.stale_since >= _STALE_S:
                    kill.append(slot.pid)
                    slot.killed_stale = True  # (once: its death replaces it)
                    self.replaced_stale += 1
        for pid in kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _drain(self, slot):
        """Handles the messages the worker's pipe holds, without waiting: one recv() takes all
        that is there (a short read: the pipe is empty, or wait() says when it is not)."""
        while not slot.eof:
            try:
                chunk = slot.sock.recv(_READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                slot.eof = True
                return
            slot.rbuf += chunk
            for data in _frames(slot.rbuf):
                self._on_message(slot, data)
            data = None
            rx = slot.rx
            if rx is not None and len(rx.freed) >= 2:
                # Items name the worker's slots we are done with; with none going out while the
                # worker has items left, a message of its own does.
                with self.lock:
                    if slot.outstanding and len(rx.freed) >= 2 and not slot.dead:
                        self._post(slot, slot.tx.encode_bytes(_FREED, 0, b""))
            if len(chunk) < _READ_BYTES:
                return

    def _on_message(self, slot, data):
        Error, GraphError = _errors()
        kind, seq, used, freed = _head(data)
        kind &= _KIND
        if freed:
            with self.lock:
                if slot.tx.arena is not None:
                    slot.tx.arena.reuse(freed)  # slots of ours the worker is done with
        try:
            body = _body(data, slot.rx)
        except (OSError, ValueError) as e:  # a file removed meanwhile
            body = None
            lost = Error(f"stage '{self.stage}': a message from worker process {slot.pid} was "
                         f"lost ({type(e).__name__}: {e})")
        del data
        result = ok = None
        if kind == _RESULT and body is not None:
            try:
                result = _loads(body, slot.rx, used)  # its arrays: views of the worker's slot
            except BaseException as e:
                result, ok = Error(f"stage '{self.stage}': the result from worker process "
                                   f"{slot.pid} could not be unpickled ({type(e).__name__}: "
                                   f"{e})"), False
                result.__cause__ = e
            else:
                ok = True
            body = None
        else:
            _release(slot.rx, used)  # nothing of this message stays in the worker's slot
        if kind == _READY:
            with self.lock:
                slot.ready = True
                self.start_failures = 0
            return
        if kind == _INIT_ERROR:
            blob_, text, tb, _ = pickle.loads(body) if body is not None else (None, "?", "", None)
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
        if ok is None:
            if body is None:
                ok, result = False, lost
            else:
                ok, result = False, self._exception(slot, body)
        elif ok and entry is not None and self.field is not None:
            result = _with_field(entry.item, self.field, result)
        del body
        if entry is not None:  # None: failed already (the pool closed)
            self._finish(entry.completion, ok, result)

    def _exception(self, slot, body):
        Error, _ = _errors()
        try:
            blob, text, tb, own = pickle.loads(body)
        except Exception as e:
            blob, text, tb, own = (None, f"the error could not be unpickled ({type(e).__name__}: {e})",
                                   "", None)
        exc = None
        if blob is not None:
            try:
                exc = pickle.loads(blob)
            except BaseException:
                exc = None
            if not isinstance(exc, BaseException):
                exc = None
        if exc is None:
            if own:  # the function's own, which cannot be rebuilt here: its type and text
                from ._errors import RemoteException
                exc = RemoteException(text, own)
            else:
                exc = Error(text)
        if own:
            # The function's own (a splitflow.Error it raised too): the StageError's __cause__,
            # not an error of the pool's (PyCompletion::error_of).
            try:
                exc._splitflow_own = True
            except Exception:
                pass
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
                self.broken = _stops_run(Error(
                    f"stage '{self.stage}': worker processes die while they start ({cause}, "
                    f"{self.start_failures} times in a row); their output on stderr says why"))
            if entries and slot.killed_stale and not _withdrawn(entries[0][1].completion):
                pass  # killed by the pool as the withdrawn item ended: the next one goes on
            elif entries:
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
                        self.broken = _stops_run(Error(f"stage '{self.stage}': cannot start a "
                                                       f"worker process ({type(e).__name__}: {e})"))
                # Its other items go back to the front of the waiting ones (_dispatch, after
                # this look at the workers, sends them as _pick chooses): a started worker with
                # room takes them at once, where the new one would hold them while it starts
                # (0.5-0.7 s with torch imported).
                again = []
                for _, entry in entries:
                    if new.process is None:
                        failures.append((entry.completion, self.broken))
                        continue
                    if _withdrawn(entry.completion):  # its run is over: not computed again
                        failures.append((entry.completion, self._withdrawn_error()))
                        continue
                    self.resent += 1
                    again.append(entry)
                self.waiting.extendleft(reversed(again))
        _close_pipe(slot)
        slot.close_arenas()
        try:
            p.close()
        except ValueError:
            pass
        if self.broken is not None:
            self._break(self.broken)
        self._finish_all([(c, False, e) for c, e in failures])

    def _break(self, err):
        """Fails every item in flight, and every later one, with err: the run's end, whatever
        the stage's on_error (_stops_run)."""
        _stops_run(err)
        with self.lock:
            if self.broken is None:
                self.broken = err
            entries = list(self.waiting)
            self.waiting.clear()
            for slot in self.slots:
                entries += slot.outstanding.values()
                slot.outstanding.clear()
            deferred, self.deferred = self.deferred, []
        self._finish_all(deferred + [(e.completion, False, err) for e in entries])

    def _close_wake(self):
        fds, self.wake_r, self.wake_w = (self.wake_r, self.wake_w), None, None  # (closed once)
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

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
            triples += [(e.completion, False, err) for e in self.waiting]
            self.waiting.clear()
            for slot in self.slots:
                triples += [(e.completion, False, err) for e in slot.outstanding.values()]
                slot.outstanding.clear()
            slots = list(self.slots)
            thread = self.thread
            self._wake()
        _live.discard(self)
        if os.getpid() != self.owner:  # a forked child's copy: the processes are the parent's
            return
        try:  # the workers asked to stop, given _JOIN_S
            if thread is not None and thread is not threading.current_thread():
                thread.join(_JOIN_S)
            with self.lock:
                for slot in slots:
                    self._post(slot, _HEAD.pack(_STOP, 0, _NO_SLOT, 0))
            deadline = time.monotonic() + _JOIN_S
            for slot in slots:
                if slot.process is not None:
                    slot.process.join(max(0.0, deadline - time.monotonic()))
        finally:
            # Then, even when a KeyboardInterrupt (a second Ctrl-C) lands in the waits above or
            # in this, which is run again until it ends: no worker, shared-memory file or item
            # left behind (a new user's trial: a second Ctrl-C at exit, in this close, left the
            # arenas' files in /dev/shm for good).
            _to_the_end(lambda: self._close_rest(slots, thread, triples))

    def _close_rest(self, slots, thread, triples):
        """_close's end: kills what still runs, frees the pipes, arenas and files, answers the
        items (`triples`, emptied as it goes). Run again after an interruption, it goes on."""
        for slot in slots:
            p = slot.process
            try:
                if p is not None and p.exitcode is None:
                    p.kill()
                    p.join(_JOIN_S)
            except ValueError:  # closed by a run before this one was interrupted
                pass
        _remove_files(self.prefix)
        for slot in slots:
            _close_pipe(slot)
            slot.close_arenas()
            try:
                if slot.process is not None and slot.process.exitcode is not None:
                    slot.process.close()
            except ValueError:  # closed already, or (not killed) still running
                pass
        with self.lock:
            if thread is None or not thread.is_alive():
                self._close_wake()
        while triples:  # in order; each removed once answered (a second answer does nothing)
            self._finish_all(triples[:1])
            del triples[0]
        _remove_files(self.prefix)


def _each_to_the_end(items, fn):
    """fn(item) for each item, whatever it raises (a second Ctrl-C closing the first of several
    pools left the others' workers and files: a review); then the last KeyboardInterrupt, if
    any."""
    caught = None
    for item in items:
        try:
            fn(item)
        except KeyboardInterrupt as e:
            caught = e
        except Exception:
            pass
    if caught is not None:
        raise caught


def _to_the_end(fn):
    """Runs fn (which may run again) until it returns, whatever KeyboardInterrupts land in it;
    then raises the last of them, if any."""
    caught = None
    while True:
        try:
            fn()
            break
        except KeyboardInterrupt as e:
            caught = e
    if caught is not None:
        raise caught


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


def _on_dask_worker():
    """Whether this process runs a Dask worker (its tasks build remote graphs)."""
    if "distributed" not in sys.modules:
        return False
    try:
        sys.modules["distributed"].get_worker()
        return True
    except Exception:
        return False


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
    _each_to_the_end(list(_live), lambda state: state.close())


atexit.register(_close_all)


_building = threading.local()  # .scope: the PoolScope the graph built on this thread is under


class PoolScope:
    """Keeps the worker pools of the graphs built under it (``with scope.building(): build the
    graph``) once those graphs go, and gives each to the next graph built under it that asks
    for the same pool: the same function (its pickle), stage name, processes, field, depth and
    substitute. A GraphDataset builds its graph anew for each epoch; under its scope the next
    epoch's process stages take the last epoch's workers (as DataLoader's persistent_workers
    keeps its own), instead of starting an interpreter and the function's imports per worker
    per epoch. The pools it keeps close with the scope (close(), or when it is collected) or at
    interpreter exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = {}  # key -> _State of a pool whose graph went
        self._parked = {}  # key -> the build count when it was parked
        self._builds = 0
        self._finalizer = weakref.finalize(self, PoolScope._close_states, self._idle, self._lock)

    def building(self):
        scope = self

        class _Building:
            def __enter__(self):
                self.before = getattr(_building, "scope", None)
                _building.scope = scope
                with scope._lock:
                    scope._builds += 1
                    self.build = scope._builds
                return scope

            def __exit__(self, *exc):
                _building.scope = self.before
                scope._close_untaken(self.build)
                return False

        return _Building()

    def _close_untaken(self, build):
        """Closes the pools parked before this build that it did not take: a stage whose
        function changed (a functools.partial of the epoch) left one pool a epoch behind, all
        alive until the dataset went (a new user's trial: 23 workers after 11 epochs)."""
        with self._lock:
            stale = [k for k, b in self._parked.items() if b < build and k in self._idle]
            states = [self._idle.pop(k) for k in stale]
            for k in stale:
                del self._parked[k]
        _each_to_the_end([s for s in states if s.owner == os.getpid()], _finalize)

    @staticmethod
    def key(blob, processes, stage, field, depth, substitute):
        try:
            sub = pickle.dumps(substitute, _PROTOCOL)
        except Exception:
            return None  # (not kept: no way to tell the next one's substitute is the same)
        return (blob, processes, stage, field, depth, sub)

    def take(self, key):
        with self._lock:
            state = self._idle.pop(key, None)
            self._parked.pop(key, None)
        if state is None:
            return None
        # A pool that broke, closed, or belongs to the parent of a forked process is not taken.
        if state.closed or state.broken is not None or state.owner != os.getpid():
            if state.owner == os.getpid():
                _finalize(state)
            return None
        return state

    def park(self, key, state):
        """Keeps a pool whose graph went; False if it cannot be kept (closed, broken, taken)."""
        if state.closed or state.broken is not None or state.owner != os.getpid():
            return False
        with self._lock:
            if self._finalizer.alive and key not in self._idle:
                self._idle[key] = state
                self._parked[key] = self._builds
                return True
        return False

    def pools(self):
        """The pools kept now (their states), for tests."""
        with self._lock:
            return list(self._idle.values())

    def close(self):
        """Stops the pools kept (their workers) now."""
        self._finalizer()

    @staticmethod
    def _close_states(idle, lock):
        with lock:
            states = list(idle.values())
            idle.clear()
        _each_to_the_end([s for s in states if s.owner == os.getpid()], _finalize)


def _builtin_stop(e):
    """The builtin an interrupt whose class cannot be rebuilt derives from, with its text (a
    SystemExit's code, where it pickles)."""
    if isinstance(e, SystemExit):
        try:
            pickle.loads(pickle.dumps(e.code, _PROTOCOL))
            return SystemExit(e.code)
        except Exception:
            return SystemExit(str(e.code))
    return (KeyboardInterrupt if isinstance(e, KeyboardInterrupt) else BaseException)(str(e))


def _stops_run(err):
    """Marks err (a pool that cannot work: its workers die as they start) as the run's end, not
    an item's error: under on_error="skip" each item was skipped and the epoch "succeeded"
    with no sample (a new user's trial, a module its workers could not import)."""
    err.stops_run = True
    return err


def _park_or_close(state, scope_ref, key):
    """A pool of a graph built under a PoolScope collected: kept by the scope if it still lives,
    closed otherwise."""
    scope = scope_ref()
    if scope is None or _exiting or not scope.park(key, state):
        _finalize(state)


def _fn_name(fn):
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else f"<{type(fn).__qualname__} object>"


class ProcessPool:
    """Runs ``fn(item)`` (or ``fn(item[field])``) in ``processes`` spawned worker processes for
    the stage ``stage``; see the module's docstring."""

    def __init__(self, fn, processes, stage, field=None, depth=2, substitute=None):
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
        # A daemonic process (a DataLoader worker, a multiprocessing.Pool worker) may not start
        # children: said here, when the graph is built, not as the first item's failure.
        if multiprocessing.current_process().daemon:
            if _on_dask_worker():  # (it was told of DataLoader workers: a new user's trial)
                raise GraphError(
                    f"{where}: this process is a Dask worker ({multiprocessing.current_process().name}), "
                    f"which is daemonic, and a daemonic process may not start the worker "
                    f"processes a process stage runs in; in a remote build use a thread stage "
                    f"(processes=0): the Dask workers are the processes (more of them, or "
                    f"nthreads per worker, for more parallel work)")
            raise GraphError(
                f"{where}: this process ({multiprocessing.current_process().name}) is daemonic, "
                f"as DataLoader workers are, and a daemonic process may not start the worker "
                f"processes a process stage runs in; use the process stage in the main process "
                f"(a GraphDataset with DataLoader(num_workers=0): its processes= stage does the "
                f"parallel work) or a thread stage (processes=0) inside DataLoader workers")
        name = _fn_name(fn)
        try:
            blob = pickle.dumps(fn, _PROTOCOL)
        except Exception as e:
            raise GraphError(f"{where}: the function {name} cannot be sent to worker processes "
                             f"({e}); define it at module level of an importable module, as "
                             f"DataLoader workers need") from None
        module = getattr(fn, "__module__", None) or type(fn).__module__
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        if (isinstance(main_file, str) and main_file.startswith("<") and
                getattr(getattr(main, "__spec__", None), "name", None) is None):
            # `python3 - < script.py`: multiprocessing's spawn starts each worker by running the
            # main module from its path, '<stdin>', which is no file: every worker died as it
            # started, and the run said so as a worker death (a new user's trial).
            raise GraphError(f"{where}: the main module was read from {main_file} (python3 - < "
                             f"script.py), and worker processes, which run it again from its "
                             f"file as multiprocessing's spawn does, cannot; run the script "
                             f"from its file (python3 script.py), or use a thread stage "
                             f"(processes=0)")
        if module == "__main__" and not main_file:
            raise GraphError(f"{where}: the function {name} is defined in an interactive "
                             f"session's __main__, which worker processes cannot import; define "
                             f"it at module level of an importable module, as DataLoader "
                             f"workers need")
        # Under a PoolScope (a GraphDataset building its next epoch's graph), the pool its last
        # graph left for the same function and stage is taken again, its workers running.
        scope = getattr(_building, "scope", None)
        key = scope.key(blob, processes, str(stage), field, depth, substitute) if scope else None
        state = scope.take(key) if key is not None else None
        if state is None:
            state = _State(blob, name, processes, str(stage), field, depth, substitute)
            _live.add(state)
        self._s = state
        if key is not None:
            self._finalizer = weakref.finalize(self, _park_or_close, state, weakref.ref(scope), key)
        else:
            self._finalizer = weakref.finalize(self, _finalize, state)

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
                    "completed": s.completed, "failed": s.failed,
                    "replaced_stale": s.replaced_stale, "resent": s.resent}
