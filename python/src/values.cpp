#include "values.hpp"

#include <unistd.h>

#include <pybind11/stl.h>

#include <atomic>
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "splitflow/core/detail/gate.hpp"

namespace splitflow::python {

bool python_alive() noexcept { return Py_IsInitialized() && !_Py_IsFinalizing(); }

namespace exit_gate {
namespace {
detail::Gate g_gate;
std::atomic<unsigned long> g_exiting_thread{0};
}  // namespace

bool enter() noexcept { return g_gate.enter(); }
void leave() noexcept { g_gate.leave(); }
bool open() noexcept { return g_gate.open(); }

void close() noexcept {
  g_exiting_thread.store(PyThread_get_thread_ident());
  g_gate.close();
}

void wait_empty(std::chrono::milliseconds limit) noexcept { g_gate.wait_empty(limit); }

bool exiting_thread() noexcept { return g_exiting_thread.load() == PyThread_get_thread_ident(); }

void park() noexcept {
  for (;;) ::pause();
}
}  // namespace exit_gate

void throw_exiting(const char* what) {
  throw CancelledError(std::string(what) + ": the interpreter is exiting (splitflow's atexit hook "
                       "cancelled the runs; no Python code runs on splitflow's threads after it)");
}

// ---- dtypes ------------------------------------------------------------------------------------

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::u8: return "uint8";
    case DType::i8: return "int8";
    case DType::u16: return "uint16";
    case DType::i16: return "int16";
    case DType::u32: return "uint32";
    case DType::i32: return "int32";
    case DType::u64: return "uint64";
    case DType::i64: return "int64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::boolean: return "bool";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(DType::boolean); ++i)
    if (name == dtype_name(static_cast<DType>(i))) return static_cast<DType>(i);
  throw Error("splitflow: unknown dtype '" + name + "'");
}

namespace {

// Buffer-protocol format characters (struct module syntax, native sizes on LP64).
const char* buffer_format(DType t) {
  switch (t) {
    case DType::u8: return "B";
    case DType::i8: return "b";
    case DType::u16: return "H";
    case DType::i16: return "h";
    case DType::u32: return "I";
    case DType::i32: return "i";
    case DType::u64: return "Q";
    case DType::i64: return "q";
    case DType::f16: return "e";
    case DType::f32: return "f";
    case DType::f64: return "d";
    case DType::boolean: return "?";
    case DType::bf16: break;
  }
  return nullptr;
}

bool dtype_of_format(const char* f, std::size_t itemsize, DType& out) {
  while (*f == '<' || *f == '=' || *f == '@') ++f;
  if (std::strlen(f) != 1) return false;
  switch (*f) {
    case 'B': out = DType::u8; return true;
    case 'b': out = DType::i8; return true;
    case 'H': out = DType::u16; return true;
    case 'h': out = DType::i16; return true;
    case 'I': out = DType::u32; return true;
    case 'i': out = DType::i32; return true;
    case 'L': case 'Q': out = itemsize == 8 ? DType::u64 : DType::u32; return true;
    case 'l': case 'q': out = itemsize == 8 ? DType::i64 : DType::i32; return true;
    case 'e': out = DType::f16; return true;
    case 'f': out = DType::f32; return true;
    case 'd': out = DType::f64; return true;
    case '?': out = DType::boolean; return true;
    default: return false;
  }
}

// ---- DLPack (the C ABI of dlpack.h, v0.8: what torch 1.13 and numpy 1.24 read) -----------------

struct DLDevice {
  std::int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// Keeps the tensor's memory (its shared owner) and the shape arrays alive for the consumer.
struct DLPackCtx {
  Tensor keep;
  std::vector<std::int64_t> shape, strides;
  DLManagedTensor managed{};
};

void dlpack_delete(DLManagedTensor* m) { delete static_cast<DLPackCtx*>(m->manager_ctx); }

void capsule_destructor(PyObject* capsule) {
  // Still named "dltensor": no consumer took it, so it is ours to free.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  } else {
    PyErr_Clear();
  }
}

std::pair<int, int> dlpack_device(const PyTensor& t) {
  if (t.on_device && t.device.cuda) return {2, t.device.tensor.device()};
  return {1, 0};
}

py::capsule to_dlpack(const PyTensor& t) {
  auto ctx = std::make_unique<DLPackCtx>();
  const Tensor& src = t.tensor();
  ctx->keep = src;
  ctx->shape = src.shape();
  ctx->strides = src.strides();
  const DLPackDType dt = dlpack_dtype(src.dtype());
  const auto [type, id] = dlpack_device(t);
  DLTensor& d = ctx->managed.dl_tensor;
  d.data = src.raw();
  d.device = {type, id};
  d.ndim = static_cast<std::int32_t>(ctx->shape.size());
  d.dtype = {dt.code, dt.bits, dt.lanes};
  d.shape = ctx->shape.data();
  d.strides = ctx->strides.data();
  d.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = dlpack_delete;
  DLManagedTensor* m = &ctx.release()->managed;
  PyObject* cap = PyCapsule_New(m, "dltensor", capsule_destructor);
  if (!cap) {
    dlpack_delete(m);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

// A Py_buffer released with the GIL, whenever the last tensor viewing it goes.
struct BufferOwner {
  Py_buffer view{};
  bool held = false;
  ~BufferOwner() {
    if (!held || !python_alive()) return;
    if (WithGil gil; gil) PyBuffer_Release(&view);  // (exiting: leaked)
  }
};

HostTensor wrap_buffer(py::handle obj, const char* what) {
  WithGil gil;
  if (!gil) throw_exiting(what);
  py::object src = py::reinterpret_borrow<py::object>(obj);
  if (!PyObject_CheckBuffer(src.ptr())) {
    // torch.Tensor and friends: numpy.asarray views them without a copy.
    try {
      src = py::module_::import("numpy").attr("asarray")(src);
    } catch (py::error_already_set&) {
      throw Error(std::string(what) + ": expected a tensor or an object with the buffer protocol, got " +
                  std::string(py::str(obj.get_type().attr("__name__"))));
    }
  }
  auto owner = std::make_shared<BufferOwner>();
  if (PyObject_GetBuffer(src.ptr(), &owner->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    // A strided view (a transpose, a slice with a step, a torch tensor's .t()): copied into
    // a C-contiguous array, as torch's default_collate (torch.stack) copies it too.
    PyErr_Clear();
    try {
      src = py::module_::import("numpy").attr("ascontiguousarray")(src);
    } catch (py::error_already_set& e) {
      throw Error(std::string(what) + ": the array is not C-contiguous and could not be made so (" +
                  e.what() + ")");
    }
    if (PyObject_GetBuffer(src.ptr(), &owner->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      throw Error(std::string(what) + ": the array is not C-contiguous (make it so with "
                  "numpy.ascontiguousarray)");
    }
  }
  owner->held = true;
  DType dt;
  const Py_buffer& v = owner->view;
  if (!dtype_of_format(v.format ? v.format : "B", static_cast<std::size_t>(v.itemsize), dt))
    throw Error(std::string(what) + ": expected a tensor or an array of numbers, got " +
                std::string(py::str(obj.get_type().attr("__name__"))) +
                (PyObject_CheckBuffer(obj.ptr()) ? std::string(" of element format '") +
                                                       (v.format ? v.format : "") + "'"
                                                 : std::string()));
  std::vector<std::int64_t> shape(v.shape, v.shape + v.ndim);
  if (v.ndim == 0) shape.clear();
  return HostTensor::wrap(v.buf, dt, std::move(shape), owner);
}

}  // namespace

// ---- Value <-> Python ----------------------------------------------------------------------------

std::string describe(const Value& v) {
  switch (v.index()) {
    case 0: return "nothing (None)";
    case 1: {
      WithGil gil;
      if (!gil) return "a Python object";
      py::object o = std::get<PyObj>(v).get();
      if (o.is_none()) return "None";
      return "a Python " + std::string(py::str(o.get_type().attr("__name__")));
    }
    case 2: return "the integer " + std::to_string(std::get<std::int64_t>(v));
    case 3: return "a tensor " + std::get<HostTensor>(v).describe();
    case 4: return "a device tensor " + std::get<DeviceValue>(v).tensor.describe();
    case 5: return "an image item (file '" + std::get<image::Image>(v).path + "')";
    case 6: return std::get<SamplePtr>(v)->describe();
    case 7:
      return "a dynamic batch of " + std::to_string(std::get<BatchPtr>(v)->batch.size()) +
             " requests";
  }
  return "?";
}

const std::vector<std::uint64_t>* item_ids(const Value& v) noexcept {
  const auto* b = std::get_if<BatchPtr>(&v);
  return b && *b ? &(*b)->batch.ids : nullptr;
}

py::object to_python(Value&& v) {
  switch (v.index()) {
    case 0: return py::none();
    case 1: return std::get<PyObj>(v).get();
    case 2: return py::int_(std::get<std::int64_t>(v));
    case 3: return py::cast(PyTensor{std::move(std::get<HostTensor>(v)), {}, false});
    case 4: return py::cast(PyTensor{{}, std::move(std::get<DeviceValue>(v)), true});
    case 5: return py::cast(PyTensor{std::move(std::get<image::Image>(v).pixels), {}, false});
    case 7: {  // a dynamic batch: its items collated
      const Batch<Value>& b = std::get<BatchPtr>(v)->batch;
      std::vector<Value> items(b.items.begin(), b.items.end());
      Value all;
      {
        NoGil nogil;
        all = collate(std::move(items), "a dynamic batch");
      }
      return to_python(std::move(all));
    }
    default: {
      SamplePtr p = std::move(std::get<SamplePtr>(v));
      const bool mine = p.use_count() == 1;  // else the fields are copied, not moved
      const std::size_t n = p->fields.size();
      auto field = [&](std::size_t i) {
        return to_python(mine ? std::move(p->fields[i]) : Value(p->fields[i]));
      };
      switch (p->kind) {
        case Sample::Kind::tuple: {
          py::tuple t(n);
          for (std::size_t i = 0; i < n; ++i) t[i] = field(i);
          return t;
        }
        case Sample::Kind::dict: {
          py::dict d;
          for (std::size_t i = 0; i < n; ++i) d[py::str(p->keys[i])] = field(i);
          return d;
        }
        case Sample::Kind::list: {
          py::list l(n);
          for (std::size_t i = 0; i < n; ++i) l[i] = field(i);
          return l;
        }
        case Sample::Kind::named: {  // (through _make, as splitflow._tuples.rebuilt)
          py::list l(n);
          for (std::size_t i = 0; i < n; ++i) l[i] = field(i);
          return p->type.get().attr("_make")(l);
        }
      }
      return py::none();
    }
  }
}

Value from_python(py::handle h) {
  if (py::isinstance<PyTensor>(h)) {
    const auto& t = h.cast<const PyTensor&>();
    if (t.on_device) return t.device;
    return t.host;
  }
  // A tuple, or a dict with str keys: a Sample, whose fields C++ ops can take without the GIL.
  if (PyTuple_CheckExact(h.ptr())) {
    auto p = std::make_shared<Sample>();
    p->kind = Sample::Kind::tuple;
    for (py::handle x : py::reinterpret_borrow<py::tuple>(h)) p->fields.push_back(from_python(x));
    return p;
  }
  if (PyDict_CheckExact(h.ptr())) {
    auto d = py::reinterpret_borrow<py::dict>(h);
    bool str_keys = true;
    for (auto kv : d) str_keys = str_keys && PyUnicode_CheckExact(kv.first.ptr());
    if (str_keys) {
      auto p = std::make_shared<Sample>();
      p->kind = Sample::Kind::dict;
      for (auto kv : d) {
        p->keys.push_back(kv.first.cast<std::string>());
        p->fields.push_back(from_python(kv.second));
      }
      return p;
    }
  }
  // A plain int (not a bool) travels as an integer: C++ ops (read_file, fill) take it as an
  // index, without the GIL; Python stages get it back as an int.
  if (PyLong_CheckExact(h.ptr())) {
    int overflow = 0;
    const long long i = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (!overflow && !(i == -1 && PyErr_Occurred())) return static_cast<std::int64_t>(i);
    PyErr_Clear();
  }
  // What a buffer (a NumPy array, bytes) holds, for the tuner's memory budget: read now, with
  // the GIL (a torch tensor, which exports no buffer, counts as its reference).
  std::size_t bytes = 0;
  if (PyObject_CheckBuffer(h.ptr())) {
    Py_buffer view;
    if (PyObject_GetBuffer(h.ptr(), &view, PyBUF_RECORDS_RO) == 0) {
      bytes = view.len > 0 ? static_cast<std::size_t>(view.len) : 0;
      PyBuffer_Release(&view);
    } else {
      PyErr_Clear();
    }
  }
  return PyObj(py::reinterpret_borrow<py::object>(h), bytes);
}

std::optional<std::int64_t> index_of(PyObject* o) {
  if (PyBool_Check(o) || !PyIndex_Check(o)) return std::nullopt;
  PyObject* i = PyNumber_Index(o);
  if (!i) {
    PyErr_Clear();  // a float tensor, a tensor of several elements: not an index
    return std::nullopt;
  }
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i, &overflow);
  Py_DECREF(i);
  if (overflow || (x == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return std::nullopt;
  }
  return static_cast<std::int64_t>(x);
}

std::optional<std::int64_t> as_index(const Value& v) {
  if (const auto* i = std::get_if<std::int64_t>(&v)) return *i;
  const auto* o = std::get_if<PyObj>(&v);
  if (!o || !*o) return std::nullopt;
  WithGil gil;
  if (!gil) throw_exiting("an index");
  return index_of(o->ptr());
}

std::vector<std::int64_t> int64_list(py::handle values, const std::string& who) {
  py::object seq = py::reinterpret_borrow<py::object>(values);
  // A NumPy array or a torch tensor: its elements as Python numbers at once (iterating a
  // tensor makes a tensor per element).
  if (!PyList_Check(seq.ptr()) && !PyTuple_Check(seq.ptr()) && py::hasattr(seq, "tolist"))
    seq = seq.attr("tolist")();
  std::vector<std::int64_t> out;
  if (PyObject_HasAttrString(seq.ptr(), "__len__")) out.reserve(py::len(seq));
  py::iterator it;
  try {
    it = py::iter(seq);
  } catch (py::error_already_set&) {
    throw GraphError(who + ": expected integers (a list, a range, a NumPy integer array, a torch "
                     "integer tensor), got a " + std::string(py::str(values.get_type().attr("__name__"))));
  }
  for (std::size_t n = 0; it != py::iterator::sentinel(); ++it, ++n) {
    PyObject* e = (*it).ptr();
    if (std::optional<std::int64_t> i = index_of(e)) {
      out.push_back(*i);
      continue;
    }
    if (PyLong_Check(e) && !PyBool_Check(e))
      throw GraphError(who + ": element " + std::to_string(n) + " (" + py::repr(e).cast<std::string>() +
                       ") does not fit a 64-bit signed integer; give indices from -2**63 to 2**63-1");
    const std::string value = PyFloat_Check(e) ? " " + py::repr(e).cast<std::string>() : "";
    throw GraphError(who + ": element " + std::to_string(n) + " is a " +
                     std::string(py::str(py::handle(e).get_type().attr("__name__"))) + value +
                     ", not an integer; give integers (a list, a range, a NumPy integer array, a "
                     "torch integer tensor)");
  }
  return out;
}

HostTensor as_host(const Value& v, const char* what) {
  switch (v.index()) {
    case 3: return std::get<HostTensor>(v);
    case 5: return std::get<image::Image>(v).pixels;
    case 4: {
      const DeviceValue& d = std::get<DeviceValue>(v);
      if (d.cuda)
        throw Error(std::string(what) + ": expected host memory, got a CUDA tensor " + d.tensor.describe());
      const Tensor& t = d.tensor;
      return HostTensor::wrap(t.raw(), t.dtype(), t.shape(), t.owner());
    }
    case 1: {
      WithGil gil;
      if (!gil) throw_exiting(what);
      py::object o = std::get<PyObj>(v).get();
      return wrap_buffer(o, what);
    }
    case 6:
      throw Error(std::string(what) + ": expected a tensor or an array, got " + describe(v) +
                  "; give the stage field=... to apply it to one field of the sample");
    case 7:
      throw Error(std::string(what) + ": expected a tensor or an array, got " + describe(v));
    default:
      throw Error(std::string(what) + ": expected a tensor or an array, got " +
                  (v.index() == 0 ? "None" : "an integer"));
  }
}

// ---- splitflow.Tensor ----------------------------------------------------------------------------

/// Why a tensor has no buffer view (nullptr: it has one).
const char* buffer_refusal(const PyTensor& t) {
  if (!t.host_addressable())
    return "splitflow.Tensor: CUDA memory has no buffer protocol; use torch.from_dlpack(t)";
  if (!buffer_format(t.tensor().dtype()))
    return "splitflow.Tensor: bfloat16 has no buffer format; use DLPack (torch.from_dlpack(t))";
  return nullptr;
}

// pybind11's buffer slot cannot report an error: an exception thrown by a def_buffer function
// escapes a C callback and aborts the process (seen with memoryview() of a CUDA tensor on a GPU
// machine). This slot refuses those tensors with a BufferError first.
getbufferproc pybind11_getbuffer_slot = nullptr;
extern "C" int tensor_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  const char* why = "splitflow.Tensor: not a tensor";
  try {
    why = buffer_refusal(py::handle(obj).cast<const PyTensor&>());
  } catch (...) {
  }
  if (why) {
    if (view) view->obj = nullptr;
    PyErr_SetString(PyExc_BufferError, why);
    return -1;
  }
  return pybind11_getbuffer_slot(obj, view, flags);
}

void bind_tensor(py::module_& m) {
  auto cls = py::class_<PyTensor>(m, "Tensor", py::buffer_protocol(), R"doc(
A splitflow tensor: host, pinned or device memory with a dtype and a shape, shared with the
graph that made it. Zero-copy views: ``numpy.asarray(t)`` (host memory, through the buffer
protocol) and ``torch.from_dlpack(t)`` (DLPack). The memory lives while any view does.)doc")
      .def_property_readonly("shape", [](const PyTensor& t) { return py::tuple(py::cast(t.tensor().shape())); })
      .def_property_readonly("dtype", [](const PyTensor& t) { return dtype_name(t.tensor().dtype()); })
      .def_property_readonly("nbytes", [](const PyTensor& t) { return t.tensor().nbytes(); })
      .def_property_readonly("data_ptr", [](const PyTensor& t) { return reinterpret_cast<std::uintptr_t>(t.tensor().raw()); })
      .def_property_readonly("memory", [](const PyTensor& t) {
        switch (t.tensor().memory()) {
          case Memory::host: return "host";
          case Memory::pinned: return "pinned";
          case Memory::device: return "device";
        }
        return "?";
      })
      .def_property_readonly("device", [](const PyTensor& t) {
        return t.on_device && t.device.cuda ? "cuda:" + std::to_string(t.device.tensor.device())
                                            : std::string("cpu");
      })
      .def_buffer([](PyTensor& t) -> py::buffer_info {
        // Only reached for tensors buffer_refusal() accepts (tensor_getbuffer checks first).
        const Tensor& x = t.tensor();
        const char* fmt = buffer_format(x.dtype());
        std::vector<py::ssize_t> shape(x.shape().begin(), x.shape().end());
        std::vector<py::ssize_t> strides;
        const auto item = static_cast<py::ssize_t>(itemsize(x.dtype()));
        for (std::int64_t s : x.strides()) strides.push_back(static_cast<py::ssize_t>(s) * item);
        return py::buffer_info(x.raw(), item, fmt, static_cast<py::ssize_t>(shape.size()),
                               shape, strides, /*readonly=*/false);
      })
      .def("__dlpack__", [](const PyTensor& t, py::object stream) {
        // The data is ready: splitflow emits a device tensor only after the work that wrote it
        // completed, so the consumer's stream needs no wait for it. What the consumer's stream
        // needs is the memory to stay unused until its own work on it is done: the tensor
        // records that stream, and its free is enqueued there (DeviceTensor::record_stream).
        if (t.on_device && t.device.cuda) {
          // DLPack's CUDA values: None = the legacy default stream, 1 = legacy default,
          // 2 = per-thread default (both the cudaStream_t values CUDA gives them), -1 = the
          // consumer synchronises itself, anything else a cudaStream_t.
          std::intptr_t s = 1;
          if (!stream.is_none()) s = stream.cast<std::intptr_t>();
          if (s == 0)
            throw py::value_error("splitflow.Tensor.__dlpack__: stream=0 is ambiguous for CUDA; pass 1 "
                                  "(legacy default stream), 2 (per-thread default) or a cudaStream_t");
          if (s != -1) t.device.tensor.record_stream(reinterpret_cast<void*>(s));
        }
        return to_dlpack(t);
      }, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const PyTensor& t) { return py::make_tuple(dlpack_device(t).first, dlpack_device(t).second); })
      .def("__len__", [](const PyTensor& t) {
        const auto& shape = t.tensor().shape();
        if (shape.empty()) throw py::type_error("len() of a 0-d splitflow.Tensor");
        return static_cast<py::ssize_t>(shape[0]);
      }, "The size of the first dimension (as len() of a torch tensor or numpy array).")
      // Indexing and iteration as a numpy array's, through the same zero-copy view: code
      // written for a collated list or array (`[x for x in batch]`, `batch[0]`) works on a
      // collated batch (it raised TypeError: len() but no indexing, a new user's trial).
      // (A tensor numpy cannot view, CUDA or bfloat16, raises its reason first: numpy drops a
      // refused buffer and, the type having __len__ and __getitem__, would read it as a
      // sequence, calling these again without end.)
      .def("__getitem__", [](py::object self, py::object key) {
        if (const char* why = buffer_refusal(self.cast<const PyTensor&>())) { PyErr_SetString(PyExc_BufferError, why); throw py::error_already_set(); }
        py::object view = py::module_::import("numpy").attr("asarray")(self);
        return view.attr("__getitem__")(key);
      }, "t[key]: numpy.asarray(t)[key] (host memory only; a view where numpy gives one).")
      .def("__iter__", [](py::object self) {
        if (const char* why = buffer_refusal(self.cast<const PyTensor&>())) { PyErr_SetString(PyExc_BufferError, why); throw py::error_already_set(); }
        return py::iter(py::module_::import("numpy").attr("asarray")(self));
      }, "Iterates over the first dimension, as a numpy array does (host memory only).")
      .def("numpy", [](py::object self) { return py::module_::import("numpy").attr("asarray")(self); },
           "A numpy array viewing the same memory (host memory only).")
      .def("torch", [](py::object self) {
        return py::module_::import("torch.utils.dlpack").attr("from_dlpack")(self);
      }, "A torch tensor viewing the same memory (DLPack).")
      .def("__repr__", [](const PyTensor& t) { return "<splitflow.Tensor " + t.tensor().describe() + ">"; });
  auto* heap = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
  pybind11_getbuffer_slot = heap->as_buffer.bf_getbuffer;
  heap->as_buffer.bf_getbuffer = tensor_getbuffer;
}

// ---- samples ------------------------------------------------------------------------------------

namespace {
const char* kind_name(Sample::Kind k) {
  switch (k) {
    case Sample::Kind::tuple: return "tuple";
    case Sample::Kind::dict: return "dict";
    case Sample::Kind::list: return "list";
    case Sample::Kind::named: return "named tuple";
  }
  return "?";
}
}  // namespace

std::string Sample::describe() const {
  std::string d = std::string("a sample (") + kind_name(kind) +
                  (kind == Kind::named ? " " + type_name : std::string()) + " of " +
                  std::to_string(fields.size());
  if (kind == Kind::dict) {
    d += ": ";
    for (std::size_t i = 0; i < keys.size(); ++i) d += (i ? ", '" : "'") + keys[i] + "'";
  }
  return d + ")";
}

Sample::Name Sample::Name::of(const py::object& field, const std::string& who) {
  Name n;
  n.repr = py::repr(field);
  if (py::isinstance<py::str>(field)) {
    n.key = true;
    n.text = field.cast<std::string>();
  } else if (py::isinstance<py::int_>(field) && !py::isinstance<py::bool_>(field)) {
    n.index = field.cast<std::int64_t>();
  } else {
    throw GraphError(who + ": field must be a str (a dict's key) or an int (a tuple's index), not " +
                     n.repr);
  }
  return n;
}

Value& Sample::at(const Name& field, const std::string& who) {
  if (kind == Kind::dict) {
    if (!field.key)
      throw Error(who + ": field=" + field.repr + " but the item is " + describe() + ": name a key");
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == field.text) return fields[i];
    throw Error(who + ": the item has no field '" + field.text + "': it is " + describe());
  }
  if (field.key)
    throw Error(who + ": field=" + field.repr + " but the item is " + describe() + ": give an index");
  const std::int64_t i = field.index;
  if (i < 0 || static_cast<std::size_t>(i) >= fields.size())
    throw Error(who + ": field " + std::to_string(i) + " is out of range: the item is " +
                describe());
  return fields[static_cast<std::size_t>(i)];
}

Sample& writable(SamplePtr& p) {
  if (p.use_count() > 1) p = std::make_shared<Sample>(*p);
  return *p;
}

Batch<Value>& writable(BatchPtr& p) {
  if (p.use_count() > 1) p = std::make_shared<BatchBox>(*p);
  return p->batch;
}

BatchPtr same_requests(const Batch<Value>& of) {
  auto r = std::make_shared<BatchBox>();
  r->batch.ids = of.ids;
  r->batch.errors = of.errors;
  r->batch.items.reserve(of.items.size());
  return r;
}

namespace {
// What a request collates as, for request_groups; nullopt: not a tensor, a number or a sample
// of them.
std::optional<std::string> collates_like(const Value& v) {
  switch (v.index()) {
    case 1: {
      py::handle o = std::get<PyObj>(v).get();
      if (PyFloat_Check(o.ptr()) || PyLong_Check(o.ptr())) return "n";
      if (py::hasattr(o, "shape") && py::hasattr(o, "dtype"))  // NumPy's, torch's
        return "p" + py::str(py::tuple(o.attr("shape"))).cast<std::string>() +
               py::str(o.attr("dtype")).cast<std::string>();
      return std::nullopt;
    }
    case 2: return "n";
    case 3: return "t" + std::get<HostTensor>(v).describe();
    case 4: return "d" + std::get<DeviceValue>(v).tensor.describe();
    case 5: return "t" + std::get<image::Image>(v).pixels.describe();
    case 6: {
      const Sample& s = *std::get<SamplePtr>(v);
      std::string key = std::to_string(static_cast<int>(s.kind)) + "(";
      for (std::size_t i = 0; i < s.fields.size(); ++i) {
        std::optional<std::string> f = collates_like(s.fields[i]);
        if (!f) return std::nullopt;
        key += (i < s.keys.size() ? s.keys[i] : std::string()) + ":" + *f + ",";
      }
      return key + ")";
    }
    default: return std::nullopt;
  }
}
}  // namespace

std::vector<std::vector<std::size_t>> request_groups(const Batch<Value>& b) {
  std::vector<std::size_t> live;
  for (std::size_t i = 0; i < b.items.size(); ++i)
    if (i >= b.errors.size() || !b.errors[i]) live.push_back(i);
  std::vector<std::string> keys;
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i : live) {
    std::optional<std::string> key = collates_like(b.items[i]);
    if (!key) return {live};  // collate's own message
    const auto at = std::find(keys.begin(), keys.end(), *key);
    if (at == keys.end()) {
      keys.push_back(std::move(*key));
      groups.push_back({i});
    } else {
      groups[static_cast<std::size_t>(at - keys.begin())].push_back(i);
    }
  }
  return groups;
}

BatchPtr requests_at(const Batch<Value>& of, const std::vector<std::size_t>& at) {
  auto r = std::make_shared<BatchBox>();
  for (std::size_t i : at) {
    r->batch.items.push_back(of.items[i]);
    if (i < of.ids.size()) r->batch.ids.push_back(of.ids[i]);
  }
  return r;
}

namespace {

/// Stacks equal-shaped tensors (any dtype, contiguous) into one with a leading batch dimension.
HostTensor stack(const std::vector<image::Image>& items, const std::string& who) {
  const HostTensor& first = items[0].pixels;
  if (first.dtype() == DType::u8 && first.ndim() == 3) {
    for (std::size_t i = 1; i < items.size(); ++i)
      if (items[i].pixels.dtype() != first.dtype() || items[i].pixels.shape() != first.shape())
        throw Error(who + ": item " + std::to_string(i) + " of the batch is " +
                    items[i].pixels.describe() + ", the first is " + first.describe() +
                    "; a batch needs one shape and dtype (resize or crop first)");
    return image::collate(items);
  }
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(items.size())};
  shape.insert(shape.end(), first.shape().begin(), first.shape().end());
  HostTensor out = HostTensor::empty(first.dtype(), shape);
  const std::size_t each = first.nbytes();
  for (std::size_t i = 0; i < items.size(); ++i) {
    const HostTensor& t = items[i].pixels;
    if (t.dtype() != first.dtype() || t.shape() != first.shape() || !t.contiguous())
      throw Error(who + ": item " + std::to_string(i) + " of the batch is " + t.describe() +
                  ", the first is " + first.describe() + "; a batch needs one shape and dtype");
    std::memcpy(static_cast<std::uint8_t*>(out.raw()) + i * each, t.raw(), each);
  }
  return out;
}

bool tensor_like(const Value& v) {
  if (v.index() == 3 || v.index() == 5) return true;
  if (v.index() == 4) return !std::get<DeviceValue>(v).cuda;
  return false;
}

// What a value collates as: numbers (a tensor of them), tensors and arrays (stacked), samples
// (field by field), or anything else (strings, None: kept in a list). With the GIL for a
// Python object.
enum class Collates { number, tensor, sample, other };

Collates collates_as(const Value& v) {
  switch (v.index()) {
    case 2: return Collates::number;
    case 6: return Collates::sample;
    case 1: {
      PyObject* o = std::get<PyObj>(v).get().ptr();
      // (NumPy's scalars export a buffer: stacked as 0-d arrays, as before.)
      if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o)) return Collates::tensor;
      if (PyFloat_Check(o) || PyLong_Check(o)) return Collates::number;  // (bool is an int)
      const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(o));
      try {
        if (py::str(type.attr("__module__")).cast<std::string>() == "torch" &&
            py::hasattr(type, "dim"))
          return Collates::tensor;
      } catch (const py::error_already_set&) {
      }
      return Collates::other;
    }
    default: return tensor_like(v) ? Collates::tensor : Collates::other;
  }
}

/// A batch of mixed kinds (a stage returned None for one item, an int for another) is refused,
/// naming the odd item, as torch's default_collate refuses it; it became a list where the
/// other batches were tensors, and the training loop failed far from the cause (a new user's
/// trial). Returns the tensor of a mix of numbers (ints and floats), or nothing when the
/// values are of one type (collated by the caller).
std::optional<HostTensor> check_one_kind(const std::vector<Value>& items, const std::string& who) {
  bool objects = false;
  for (const Value& v : items) objects = objects || v.index() == 1;
  std::optional<WithGil> gil;
  if (objects) {
    gil.emplace();
    if (!*gil) throw_exiting(who.c_str());
  }
  // A NumPy scalar among Python numbers is a number, as torch.tensor takes it (alone among
  // NumPy scalars it stacks as a 0-d array, as before).
  auto numpy_scalar = [](const Value& v) {
    if (v.index() != 1) return false;
    const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(std::get<PyObj>(v).get().ptr()));
    try {
      return py::str(type.attr("__module__")).cast<std::string>() == "numpy" &&
             py::str(type.attr("__name__")).cast<std::string>() != "ndarray";
    } catch (const py::error_already_set&) {
      return false;
    }
  };
  // Each item's kind, once (a NumPy scalar's as a number where Python numbers are among them).
  std::vector<Collates> kinds;
  kinds.reserve(items.size());
  std::vector<bool> scalar(items.size(), false);
  bool numbers = false, scalars = false;
  for (std::size_t i = 0; i < items.size(); ++i) {
    kinds.push_back(collates_as(items[i]));
    scalar[i] = kinds[i] == Collates::tensor && numpy_scalar(items[i]);
    numbers = numbers || kinds[i] == Collates::number;
    scalars = scalars || scalar[i];
  }
  if (numbers && scalars)
    for (std::size_t i = 0; i < items.size(); ++i)
      if (scalar[i]) kinds[i] = Collates::number;
  const Collates first = kinds[0];
  for (std::size_t i = 1; i < items.size(); ++i)
    if (kinds[i] != first)
      throw Error(who + ": item " + std::to_string(i) + " of the batch is " + describe(items[i]) +
                  " where item 0 is " + describe(items[0]) +
                  ": a batch collates one kind of value per field, as torch's default_collate "
                  "does (did a stage return None, or another type, for some items?)");
  if (first != Collates::number) return std::nullopt;
  // Numbers of one type collate below; a mix makes what torch.tensor makes of it: float64
  // with a float among them (anything without __index__), else int64 (bools as 0 and 1).
  bool ints = true, floats = true, bools = true, any_float = false;
  for (const Value& v : items) {
    PyObject* o = v.index() == 1 ? std::get<PyObj>(v).get().ptr() : nullptr;
    ints = ints && !o;
    floats = floats && o && PyFloat_CheckExact(o);
    bools = bools && o && PyBool_Check(o);
    any_float = any_float || (o && !PyIndex_Check(o));
  }
  if (ints || floats || bools) return std::nullopt;
  HostTensor out = HostTensor::empty(any_float ? DType::f64 : DType::i64,
                                     {static_cast<std::int64_t>(items.size())});
  for (std::size_t i = 0; i < items.size(); ++i) {
    PyObject* o = items[i].index() == 1 ? std::get<PyObj>(items[i]).get().ptr() : nullptr;
    if (any_float) {
      const double x = o ? PyFloat_AsDouble(o) : static_cast<double>(std::get<std::int64_t>(items[i]));
      if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw Error(who + ": item " + std::to_string(i) + " of the batch, " + describe(items[i]) +
                    ", does not fit a float64");
      }
      static_cast<double*>(out.raw())[i] = x;
    } else {
      const long long x = o ? PyLong_AsLongLong(o) : std::get<std::int64_t>(items[i]);
      if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw Error(who + ": item " + std::to_string(i) + " of the batch, " + describe(items[i]) +
                    ", does not fit an int64");
      }
      static_cast<std::int64_t*>(out.raw())[i] = x;
    }
  }
  return out;
}

}  // namespace

Value collate(std::vector<Value>&& items, const std::string& who) {
  if (items.empty()) throw Error(who + ": an empty batch");
  const std::size_t n = items.size();
  const std::size_t kind = items[0].index();
  bool same = true;
  for (const Value& v : items) same = same && v.index() == kind;
  if (!same || kind == 1)
    if (std::optional<HostTensor> floats = check_one_kind(items, who)) return std::move(*floats);
  if (same && kind == 2) {  // integers (labels, indices): an int64 tensor
    HostTensor out = HostTensor::empty(DType::i64, {static_cast<std::int64_t>(n)});
    auto* d = static_cast<std::int64_t*>(out.raw());
    for (std::size_t i = 0; i < n; ++i) d[i] = std::get<std::int64_t>(items[i]);
    return out;
  }
  bool tensors = true, objects = false;
  for (const Value& v : items) {
    objects = objects || v.index() == 1;
    tensors = tensors && (tensor_like(v) || v.index() == 1);
  }
  if (tensors && objects) {
    // Python objects stack when they are arrays (buffer protocol) or torch CPU tensors (what a
    // Python stage returns: viewed through numpy, no copy before the stack).
    WithGil gil;
    if (!gil) throw_exiting(who.c_str());
    for (Value& v : items) {
      if (v.index() != 1) continue;
      py::object o = std::get<PyObj>(v).get();
      // (bytes are strings to default_collate, which keeps them in a list, not arrays.)
      if (PyObject_CheckBuffer(o.ptr()) && !PyBytes_Check(o.ptr()) && !PyByteArray_Check(o.ptr())) continue;
      const py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(o.ptr()));
      bool torch_cpu = false;
      try {
        torch_cpu = py::str(type.attr("__module__")).cast<std::string>() == "torch" &&
                    py::hasattr(o, "device") &&
                    py::str(o.attr("device").attr("type")).cast<std::string>() == "cpu";
        if (torch_cpu) v = Value(PyObj(py::module_::import("numpy").attr("asarray")(o.attr("detach")())));
      } catch (const py::error_already_set&) {  // (bfloat16: numpy has no such type)
        torch_cpu = false;
      }
      if (!torch_cpu) {
        tensors = false;
        break;
      }
    }
  }
  if (tensors) {
    std::vector<image::Image> imgs;
    imgs.reserve(n);
    for (Value& v : items) {
      if (auto* im = std::get_if<image::Image>(&v)) {
        imgs.push_back(std::move(*im));
      } else {
        imgs.push_back({0, "", as_host(v, who.c_str())});
      }
    }
    return stack(imgs, who);
  }
  if (same && kind == 6) {  // samples: field by field
    const Sample& first = *std::get<SamplePtr>(items[0]);
    auto out = std::make_shared<Sample>();
    // (A batch of tuples is a list of the columns, as default_collate makes it: a new user's
    // trial found tuples where torch gives a list.)
    out->kind = first.kind == Sample::Kind::tuple ? Sample::Kind::list : first.kind;
    out->keys = first.keys;
    if (first.kind == Sample::Kind::named) out->type = first.type, out->type_name = first.type_name;
    for (std::size_t i = 1; i < n; ++i) {
      const Sample& s = *std::get<SamplePtr>(items[i]);
      if (s.kind != first.kind || s.keys != first.keys || s.fields.size() != first.fields.size() ||
          s.type.ptr() != first.type.ptr())  // (named tuples of two classes)
        throw Error(who + ": item " + std::to_string(i) + " of the batch is " + s.describe() +
                    ", the first is " + first.describe() + "; a batch needs one structure");
    }
    for (std::size_t f = 0; f < first.fields.size(); ++f) {
      std::vector<Value> column;
      column.reserve(n);
      for (Value& v : items) {
        SamplePtr& p = std::get<SamplePtr>(v);
        column.push_back(p.use_count() == 1 ? std::move(p->fields[f]) : Value(p->fields[f]));
      }
      const std::string name =
          first.kind == Sample::Kind::dict ? "'" + first.keys[f] + "'" : std::to_string(f);
      out->fields.push_back(collate(std::move(column), who + " (field " + name + ")"));
    }
    return out;
  }
  if (same && kind == 1) {  // Python floats: a float64 tensor; bools: a bool one; other objects: a list
    WithGil gil;
    if (!gil) throw_exiting(who.c_str());
    // Lists ([image, label], as many Datasets return): transposed and collated position by
    // position, a list of the columns, as default_collate does (they went on as a list of the
    // lists: a new user's trial). Named tuples of one class (Sample(image, label)): the same,
    // into that class, as default_collate does (they went on as a list of the tuples, and
    // batch.image raised AttributeError: a new user's trial).
    PyObject* first = std::get<PyObj>(items[0]).ptr();
    // (A named tuple: a tuple subclass with _fields and _make, rebuilt through _make, as
    // splitflow._tuples.rebuilt does; another tuple subclass stays a list of the items.)
    const py::handle first_type = reinterpret_cast<PyObject*>(Py_TYPE(first));
    bool lists = true, named = PyTuple_Check(first) && !PyTuple_CheckExact(first) &&
                               py::hasattr(first_type, "_fields") && py::hasattr(first_type, "_make");
    for (const Value& v : items) {
      PyObject* o = std::get<PyObj>(v).ptr();
      lists = lists && PyList_Check(o);
      named = named && Py_TYPE(o) == Py_TYPE(first);
    }
    if (lists || named) {
      const auto size = [&](std::size_t i) {
        PyObject* o = std::get<PyObj>(items[i]).ptr();
        return lists ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
      };
      const Py_ssize_t len = size(0);
      for (std::size_t i = 1; i < n; ++i)
        if (const Py_ssize_t m = size(i); m != len)
          throw Error(who + ": item " + std::to_string(i) + " of the batch is a list of " + std::to_string(m) +
                      " where item 0 is a list of " + std::to_string(len) +
                      ": a batch of lists collates position by position, as torch's default_collate "
                      "does, and needs lists of one length");
      auto out = std::make_shared<Sample>();
      out->kind = lists ? Sample::Kind::list : Sample::Kind::named;
      if (named) {
        out->type = PyObj(py::reinterpret_borrow<py::object>(first_type));
        out->type_name = reinterpret_cast<PyTypeObject*>(first_type.ptr())->tp_name;
      }
      for (Py_ssize_t f = 0; f < len; ++f) {
        std::vector<Value> column;
        column.reserve(n);
        for (const Value& v : items) {
          PyObject* o = std::get<PyObj>(v).ptr();
          column.push_back(from_python(py::handle(lists ? PyList_GET_ITEM(o, f) : PyTuple_GET_ITEM(o, f))));
        }
        out->fields.push_back(collate(std::move(column), who + " (position " + std::to_string(f) + ")"));
      }
      return out;
    }
    bool floats = true, bools = true;
    for (const Value& v : items) {
      floats = floats && PyFloat_CheckExact(std::get<PyObj>(v).get().ptr());
      bools = bools && PyBool_Check(std::get<PyObj>(v).get().ptr());
    }
    if (floats) {
      HostTensor out = HostTensor::empty(DType::f64, {static_cast<std::int64_t>(n)});
      auto* d = static_cast<double*>(out.raw());
      for (std::size_t i = 0; i < n; ++i) d[i] = PyFloat_AsDouble(std::get<PyObj>(items[i]).get().ptr());
      return out;
    }
    if (bools) {  // (default_collate: torch.tensor of them, dtype bool)
      HostTensor out = HostTensor::empty(DType::boolean, {static_cast<std::int64_t>(n)});
      auto* d = static_cast<std::uint8_t*>(out.raw());
      for (std::size_t i = 0; i < n; ++i) d[i] = std::get<PyObj>(items[i]).get().ptr() == Py_True ? 1 : 0;
      return out;
    }
  }
  auto list = std::make_shared<Sample>();
  list->kind = Sample::Kind::list;
  list->fields = std::move(items);
  return list;
}

}  // namespace splitflow::python

namespace splitflow::python {

std::size_t host_bytes(const Sample& s) {
  return sizeof(Sample) + (bytes_of(s.keys) - sizeof(s.keys)) + (bytes_of(s.fields) - sizeof(s.fields));
}

std::size_t host_bytes(const BatchBox& b) { return sizeof(BatchBox) - sizeof(b.batch) + bytes_of(b.batch); }

}  // namespace splitflow::python
