// What flows on the edges of a graph built from Python: a Value (a Python object, an integer,
// or a splitflow tensor), and the conversions to and from Python. Internal to splitflow._core.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <variant>

#include "splitflow/ops/image.hpp"

#include <splitflow/splitflow.hpp>

namespace splitflow::python {

namespace py = pybind11;

/// True while Python objects may be touched (not during or after interpreter finalisation).
bool python_alive() noexcept;

/// A strong reference to a Python object that any thread may copy, move or drop: copies and
/// drops take the GIL (moves do not). At interpreter exit the reference is leaked, not freed.
class PyObj {
 public:
  PyObj() = default;
  /// Takes `o`'s reference (call with the GIL).
  explicit PyObj(py::object o) noexcept : p_(o.release().ptr()) {}
  PyObj(const PyObj& o) : p_(o.p_) {
    if (p_) {
      py::gil_scoped_acquire gil;
      Py_INCREF(p_);
    }
  }
  PyObj(PyObj&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  PyObj& operator=(PyObj o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~PyObj() { reset(); }
  void reset() noexcept {
    PyObject* p = std::exchange(p_, nullptr);
    if (!p || !python_alive()) return;
    py::gil_scoped_acquire gil;
    Py_DECREF(p);
  }
  /// A new reference (call with the GIL).
  py::object get() const { return py::reinterpret_borrow<py::object>(p_ ? p_ : Py_None); }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  PyObject* p_ = nullptr;
};

/// A device tensor and whether its memory is CUDA memory (on the host backend it is host
/// memory standing in for the device's).
struct DeviceValue {
  DeviceTensor tensor;
  bool cuda = false;
};

/// Image ops' items (splitflow/ops/image.hpp): a file's bytes or pixels with its index and path.
/// Python sees the tensor.
using Value = std::variant<std::monostate, PyObj, std::int64_t, HostTensor, DeviceValue, image::Image>;

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

/// The Value as a host tensor, zero-copy: a HostTensor, host-backend device memory, or any
/// Python object with the buffer protocol (C-contiguous), kept alive by the result. Throws
/// splitflow::Error otherwise, naming `what`.
HostTensor as_host(const Value& v, const char* what);

/// numpy-style dtype names ("uint8", "float32", ...), and back.
const char* dtype_name(DType t) noexcept;
DType dtype_from_name(const std::string& name);

void bind_tensor(py::module_& m);

}  // namespace splitflow::python
