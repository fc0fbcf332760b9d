// What flows on the edges of a graph built from Python: a Value (a Python object, an integer,
// or a splitflow tensor), and the conversions to and from Python. Internal to splitflow._core.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>
#include <string>
#include <utility>
#include <variant>

#include "splitflow/ops/image.hpp"

#include <splitflow/splitflow.hpp>

namespace splitflow::python {

namespace py = pybind11;

/// True while Python objects may be touched (not during or after interpreter finalisation).
bool python_alive() noexcept;

/// Interpreter exit. Once finalisation has begun, Python ends any other thread that takes the
/// GIL (pthread_exit): inside C++ code that aborts the process ("terminate called without an
/// active exception"), as a daemon thread reading a run did. So splitflow's code takes the GIL
/// only through this gate (NoGil, WithGil). The atexit hook (_shutdown) closes it, cancels the
/// runs and waits, with the GIL released, for the threads inside to come out, all before
/// finalisation begins. From then on a thread of splitflow's does not take the GIL (its call
/// is refused: a Python stage raises CancelledError, a reference is leaked), and a Python
/// thread other than the exiting one that waits in splitflow, or comes back from a wait, sleeps
/// for ever instead of returning into Python: only daemon threads are left then, and Python
/// ends them with the process (as Python 3.14 does with any daemon thread at exit).
namespace exit_gate {
/// Counts the caller in; false (not counted) once the gate is closed.
bool enter() noexcept;
void leave() noexcept;
bool open() noexcept;
/// Closes the gate; the calling thread is the exiting one (it runs the atexit hooks).
void close() noexcept;
/// Waits up to `limit` for the threads inside to leave. Without the GIL.
void wait_empty(std::chrono::milliseconds limit) noexcept;
/// The thread closing the gate: it goes on through finalisation.
bool exiting_thread() noexcept;
/// Sleeps for ever (a daemon thread at exit, holding no GIL).
[[noreturn]] void park() noexcept;
}  // namespace exit_gate

/// Whether this thread took the GIL through WithGil and holds it now (scopes nested): a thread
/// of splitflow's running Python (a stage's body), counted in the exit gate by that WithGil.
inline bool in_taken_gil() noexcept;

/// Releases the GIL for a wait, as py::gil_scoped_release does, while the exit gate is open.
/// Once it is closed the exiting thread keeps the GIL (the runs are over: nothing is left to
/// wait for), and a Python thread other than it sleeps for ever rather than take the GIL back
/// (a daemon thread: taking it during finalisation would end the thread mid-C++). A thread of
/// splitflow's running Python (inside WithGil, so counted in the gate until its call ends)
/// takes it back as usual: the atexit hook waits for it.
class NoGil {
 public:
  NoGil() noexcept {
    if (in_taken_gil()) {
      state_ = PyEval_SaveThread();
    } else if (exit_gate::enter()) {
      state_ = PyEval_SaveThread();
      counted_ = true;
    } else if (!exit_gate::exiting_thread()) {
      PyEval_SaveThread();
      exit_gate::park();
    }
  }
  ~NoGil() {
    if (!state_) return;
    if (counted_ && !exit_gate::open() && !exit_gate::exiting_thread()) {
      exit_gate::leave();
      exit_gate::park();
    }
    PyEval_RestoreThread(state_);
    if (counted_) exit_gate::leave();
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_ = nullptr;
  bool counted_ = false;
};

/// Takes the GIL, as py::gil_scoped_acquire does, unless the exit gate is closed and this
/// thread does not hold it already: then false, and the caller must not touch Python.
class WithGil {
 public:
  WithGil() noexcept {
    if (PyGILState_Check()) {
      held_ = true;  // this thread's already (nested): nothing to take
    } else if (exit_gate::enter()) {
      state_ = PyGILState_Ensure();
      taken_ = true;
      ++taken_depth();
    }
  }
  ~WithGil() {
    if (!taken_) return;
    --taken_depth();
    PyGILState_Release(state_);
    exit_gate::leave();
  }
  explicit operator bool() const noexcept { return held_ || taken_; }
  WithGil(const WithGil&) = delete;
  WithGil& operator=(const WithGil&) = delete;
  static int& taken_depth() noexcept {
    static thread_local int depth = 0;
    return depth;
  }

 private:
  PyGILState_STATE state_{};
  bool held_ = false;
  bool taken_ = false;
};

inline bool in_taken_gil() noexcept { return WithGil::taken_depth() > 0; }

/// What a call that needs Python throws once the interpreter is exiting.
[[noreturn]] void throw_exiting(const char* what);

/// A strong reference to a Python object that any thread may copy, move or drop: copies and
/// drops take the GIL (moves do not). At interpreter exit the reference is leaked, not freed.
class PyObj {
 public:
  PyObj() = default;
  /// Takes `o`'s reference (call with the GIL).
  explicit PyObj(py::object o) noexcept : p_(o.release().ptr()) {}
  PyObj(const PyObj& o) : p_(o.p_), bytes_(o.bytes_), owned_(o.owned_) {
    if (!p_ || !owned_) return;
    if (WithGil gil; gil) {
      Py_INCREF(p_);
    } else {
      owned_ = false;  // exiting: a borrowed copy (every reference is leaked from then on)
    }
  }
  /// `bytes`: what the object holds, if known (a buffer's length: host_bytes()).
  PyObj(py::object o, std::size_t bytes) noexcept : p_(o.release().ptr()), bytes_(bytes) {}
  PyObj(PyObj&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_), owned_(std::exchange(o.owned_, true)) {}
  PyObj& operator=(PyObj o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    std::swap(owned_, o.owned_);
    return *this;
  }
  ~PyObj() { reset(); }
  void reset() noexcept {
    PyObject* p = std::exchange(p_, nullptr);
    const bool owned = std::exchange(owned_, true);
    // Once the interpreter is exiting, every reference is leaked, whoever drops it: a copy
    // made then (on a thread kept off the GIL) borrows the original's, which must stay.
    if (!p || !owned || !python_alive() || !exit_gate::open()) return;
    if (WithGil gil; gil) Py_DECREF(p);
  }
  /// A new reference (call with the GIL).
  py::object get() const { return py::reinterpret_borrow<py::object>(p_ ? p_ : Py_None); }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  /// The object, borrowed (null when empty); for the GC's traversal.
  PyObject* ptr() const noexcept { return p_; }
  /// Host bytes it holds, as far as known without the GIL (splitflow::bytes_of): the reference,
  /// and a buffer's length (a NumPy array, bytes) measured when it entered the graph.
  std::size_t host_bytes() const noexcept { return sizeof(PyObj) + bytes_; }

 private:
  PyObject* p_ = nullptr;
  std::size_t bytes_ = 0;
  bool owned_ = true;  // holds a reference of its own (false: a copy made while exiting)
};

/// A device tensor and whether its memory is CUDA memory (on the host backend it is host
/// memory standing in for the device's).
struct DeviceValue {
  DeviceTensor tensor;
  bool cuda = false;
};

struct Sample;
using SamplePtr = std::shared_ptr<Sample>;
struct BatchBox;
using BatchPtr = std::shared_ptr<BatchBox>;

/// Image ops' items (splitflow/ops/image.hpp): a file's bytes or pixels with its index and path.
/// Python sees the tensor. A Python tuple or dict becomes a Sample, so that C++ ops can take
/// one of its fields without the GIL.
using Value = std::variant<std::monostate, PyObj, std::int64_t, HostTensor, DeviceValue,
                           image::Image, SamplePtr, BatchPtr>;

/// A service's dynamic batch (Graph.dynamic_batch .. Graph.unbatch) on a Value edge: the
/// requests' items, their ids and per-item errors. Python stages see the items collated and
/// return one result per item; C++ ops apply to each item (an item's error fails its request
/// alone).
struct BatchBox {
  Batch<Value> batch;
};

/// The request ids an error on `v` must reach (a dynamic batch's), found by the executor's
/// ids_for_errors through argument-dependent lookup; null for other items.
const std::vector<std::uint64_t>* item_ids(const Value& v) noexcept;

/// A structured sample: a tuple, a dict with string keys (the fields of a training sample: an
/// image, its label, its dataset index, ...), or a list (a batch's field whose values do not
/// stack into a tensor). Shared between the copies of a fanned-out item: change it through
/// writable(), which copies a shared one first.
struct Sample {
  /// named: a batch of named tuples of one class, collated field by field into that class (as
  /// torch's default_collate does); to Python, `type._make(fields)` (as splitflow._tuples).
  enum class Kind { tuple, dict, list, named };
  Kind kind = Kind::tuple;
  std::vector<std::string> keys;  // dict: one per field, in the dict's order
  std::vector<Value> fields;
  PyObj type;                     // named: the named tuple's class
  std::string type_name;          // named: its name, for errors (read without the GIL)

  /// A field's name, read once from Python (a str key or an int index), looked up without
  /// the GIL.
  struct Name {
    bool key = false;
    std::string text;        // the key
    std::int64_t index = 0;  // the index
    std::string repr;        // as Python writes it, for errors
    /// From a str or an int; throws a GraphError naming `who` otherwise. Needs the GIL.
    static Name of(const py::object& field, const std::string& who);
  };
  /// The field named by `field` (an int index for a tuple, a str key for a dict); throws an
  /// Error naming `who` and the fields there are. Needs no GIL.
  Value& at(const Name& field, const std::string& who);
  std::string describe() const;
};

/// Host bytes an item holds (splitflow::bytes_of: the tuner's memory budget). A Python object
/// counts as its reference (its size would need the GIL); tensors and images by their bytes.
std::size_t host_bytes(const Sample& s);
std::size_t host_bytes(const BatchBox& b);

/// `p`, or a copy of it when another item shares it (copy-on-write).
Sample& writable(SamplePtr& p);
Batch<Value>& writable(BatchPtr& p);

/// A dynamic batch for the same requests as `of` (its ids and per-request errors), with room
/// for their items: what a stage returns for a batch it was given.
BatchPtr same_requests(const Batch<Value>& of);
/// The requests of a dynamic batch that a Python function is called on, as the batches it gets:
/// those no earlier stage failed (a failed one's value is gone: collating it failed its
/// batch-mates), grouped by what they collate as (a tensor's dtype and shape; a sample's keys
/// and its fields'), each group in arrival order, the groups in the order of their first
/// request (a request whose shape differs from the others' made the whole batch fail, "a batch
/// needs one shape": a new user's trial). Where a request's value is none of those (None, a
/// string), all live requests are one group, and collating says what is wrong. With the GIL.
std::vector<std::vector<std::size_t>> request_groups(const Batch<Value>& b);
/// The requests `at` of `of` as a batch of their own (their items and ids). With the GIL.
BatchPtr requests_at(const Batch<Value>& of, const std::vector<std::size_t>& at);

/// Collates a batch's items as torch's default_collate does: tensors (and image items) of one
/// shape stack into one tensor (N, ...), integers into an int64 tensor (N,), Python floats into
/// a float64 tensor (N,), samples field by field (the same kind and keys in every item), and
/// anything else into a list. `who` names the batch in errors.
Value collate(std::vector<Value>&& items, const std::string& who);

/// splitflow.Tensor: a Python view of a splitflow tensor. numpy reads it through the buffer
/// protocol (host memory), torch through DLPack; both views keep the memory alive.
struct PyTensor {
  HostTensor host;
  DeviceValue device;
  bool on_device = false;

  const Tensor& tensor() const noexcept {
    return on_device ? static_cast<const Tensor&>(device.tensor) : host;
  }
  /// Host-addressable memory (host, pinned, or the host backend's "device" memory).
  bool host_addressable() const noexcept { return !on_device || !device.cuda; }
};

/// What `v` is, for error messages ("a Python str", "the integer 5", "a tensor uint8[2, 3]").
std::string describe(const Value& v);
/// Value -> Python object (with the GIL). Tensors become splitflow.Tensor.
py::object to_python(Value&& v);
/// Python object -> Value (with the GIL). splitflow.Tensor becomes its tensor; anything else
/// travels as a Python object.
Value from_python(py::handle h);

/// An item as an integer index: an integer (a Python int travels as one), or a Python object
/// Python itself takes as an index (__index__: a NumPy integer, an integer torch tensor of one
/// element), bools excepted. nullopt for anything else. Takes the GIL for a Python object.
std::optional<std::int64_t> as_index(const Value& v);
/// `o` as an index (with the GIL): nullopt when Python would not take it as one (a float, a
/// bool) or it does not fit 64 bits.
std::optional<std::int64_t> index_of(PyObject* o);

/// Integers from Python: a list, a tuple, a range, a NumPy integer array, a torch integer tensor
/// (anything iterable whose elements Python takes as indices, bools excepted). Throws a
/// GraphError naming `who` and the first element that is not an integer. With the GIL.
std::vector<std::int64_t> int64_list(py::handle values, const std::string& who);

/// The Value as a host tensor, zero-copy: a HostTensor, host-backend device memory, or any
/// Python object with the buffer protocol (C-contiguous), kept alive by the result. Throws
/// splitflow::Error otherwise, naming `what`.
HostTensor as_host(const Value& v, const char* what);

/// numpy-style dtype names ("uint8", "float32", ...), and back.
const char* dtype_name(DType t) noexcept;
DType dtype_from_name(const std::string& name);

void bind_tensor(py::module_& m);

}  // namespace splitflow::python
