#include "splitflow/tensor.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>

#include <fmt/format.h>

#include "splitflow/error.hpp"

namespace splitflow {

std::size_t itemsize(DType t) noexcept {
  switch (t) {
    case DType::u8: case DType::i8: case DType::boolean: return 1;
    case DType::u16: case DType::i16: case DType::f16: case DType::bf16: return 2;
    case DType::u32: case DType::i32: case DType::f32: return 4;
    case DType::u64: case DType::i64: case DType::f64: return 8;
  }
  return 1;
}

const char* to_string(DType t) noexcept {
  switch (t) {
    case DType::u8: return "u8";
    case DType::i8: return "i8";
    case DType::u16: return "u16";
    case DType::i16: return "i16";
    case DType::u32: return "u32";
    case DType::i32: return "i32";
    case DType::u64: return "u64";
    case DType::i64: return "i64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::boolean: return "bool";
  }
  return "?";
}

DLPackDType dlpack_dtype(DType t) noexcept {
  const auto bits = static_cast<std::uint8_t>(itemsize(t) * 8);
  switch (t) {
    case DType::u8: case DType::u16: case DType::u32: case DType::u64: return {1, bits, 1};
    case DType::i8: case DType::i16: case DType::i32: case DType::i64: return {0, bits, 1};
    case DType::f16: case DType::f32: case DType::f64: return {2, bits, 1};
    case DType::bf16: return {4, 16, 1};
    case DType::boolean: return {6, 8, 1};
  }
  return {0, 0, 0};
}

Tensor::Tensor(void* data, DType dtype, std::vector<std::int64_t> shape, Memory memory, int device,
               std::shared_ptr<void> owner)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      memory_(memory),
      device_(device),
      owner_(std::move(owner)) {
  strides_.resize(shape_.size());
  std::int64_t stride = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] < 0) throw Error("splitflow: tensor dimensions must be >= 0");
    strides_[i] = stride;
    stride *= shape_[i];
  }
}

std::int64_t Tensor::numel() const noexcept {
  std::int64_t n = 1;
  for (auto d : shape_) n *= d;
  return n;
}

bool Tensor::contiguous() const noexcept {
  std::int64_t stride = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != stride) return false;
    stride *= shape_[i];
  }
  return true;
}

void Tensor::check_dtype(DType want) const {
  if (want != dtype_)
    throw Error(fmt::format("splitflow: tensor {} accessed as {}", describe(), to_string(want)));
}

std::string Tensor::describe() const {
  std::string dims;
  for (std::size_t i = 0; i < shape_.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape_[i]);
  const char* where = memory_ == Memory::host ? "host" : memory_ == Memory::pinned ? "pinned" : "device";
  return fmt::format("{}[{}] {}", to_string(dtype_), dims, where);
}

HostTensor HostTensor::empty(DType dtype, std::vector<std::int64_t> shape) {
  std::size_t bytes = itemsize(dtype);
  for (auto d : shape) {
    if (d < 0) throw Error("splitflow: tensor dimensions must be >= 0");
    bytes *= static_cast<std::size_t>(d);
  }
  void* p = std::aligned_alloc(64, std::max<std::size_t>((bytes + 63) / 64 * 64, 64));
  if (!p) throw std::bad_alloc();
  std::shared_ptr<void> owner(p, [](void* q) { std::free(q); });
  return HostTensor(p, dtype, std::move(shape), Memory::host, -1, std::move(owner));
}

HostTensor HostTensor::wrap(void* data, DType dtype, std::vector<std::int64_t> shape,
                            std::shared_ptr<void> owner, Memory memory) {
  return HostTensor(data, dtype, std::move(shape), memory, -1, std::move(owner));
}

DeviceTensor DeviceTensor::wrap(void* data, DType dtype, std::vector<std::int64_t> shape,
                                int device, std::shared_ptr<void> owner) {
  return DeviceTensor(data, dtype, std::move(shape), Memory::device, device, std::move(owner));
}

}  // namespace splitflow
