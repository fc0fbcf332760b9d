// Tensors: typed, shaped views of host, pinned or device memory, with shared ownership.
// The layout follows DLPack (dtype code/bits/lanes, shape and strides in elements, a device),
// so the Python module exports them zero-copy.
//
//     auto t = splitflow::HostTensor::empty(splitflow::DType::u8, {64, 224, 224, 3});
//     std::uint8_t* px = t.data<std::uint8_t>();
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace splitflow {

namespace detail {
class DeviceRuntime;
}

enum class DType : std::uint8_t { u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64, boolean };

/// Bytes per element.
std::size_t itemsize(DType t) noexcept;
const char* to_string(DType t) noexcept;

/// The DLPack triple of a dtype (kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4,
/// kDLBool = 6).
struct DLPackDType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
DLPackDType dlpack_dtype(DType t) noexcept;

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return DType::u8;
  else if constexpr (std::is_same_v<T, std::int8_t>) return DType::i8;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return DType::u16;
  else if constexpr (std::is_same_v<T, std::int16_t>) return DType::i16;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return DType::u32;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return DType::u64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::i64;
  else if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bool>) return DType::boolean;
  else static_assert(sizeof(T) == 0, "splitflow: no DType for this C++ type");
}

/// Where a tensor's memory lives. `pinned` is page-locked host memory (cudaHostAlloc on the
/// CUDA backend); `device` is device memory (host memory standing in for it on the host
/// backend: DLPack device type kDLCUDA only on the CUDA backend).
enum class Memory : std::uint8_t { host, pinned, device };

/// Common part of HostTensor and DeviceTensor: dtype, shape, strides (in elements), memory.
/// Copies share the memory; it is freed (or returned to its pool or ring) with the last copy.
class Tensor {
 public:
  Tensor() = default;

  DType dtype() const noexcept { return dtype_; }
  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  const std::vector<std::int64_t>& strides() const noexcept { return strides_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t ndim() const noexcept { return shape_.size(); }
  std::int64_t numel() const noexcept;
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel()) * itemsize(dtype_); }
  bool contiguous() const noexcept;
  Memory memory() const noexcept { return memory_; }
  /// Device ordinal for device memory; -1 for host and pinned memory.
  int device() const noexcept { return device_; }
  bool defined() const noexcept { return data_ != nullptr || numel() == 0; }

  void* raw() const noexcept { return data_; }
  /// Typed pointer; throws splitflow::Error if T does not match the dtype.
  template <class T>
  T* data() const {
    check_dtype(dtype_of<std::remove_cv_t<T>>());
    return static_cast<T*>(data_);
  }
  /// The object that keeps the memory alive (shared with every copy and view).
  const std::shared_ptr<void>& owner() const noexcept { return owner_; }

  /// "u8[64, 224, 224, 3] pinned"
  std::string describe() const;

 protected:
  Tensor(void* data, DType dtype, std::vector<std::int64_t> shape, Memory memory, int device,
         std::shared_ptr<void> owner);
  void check_dtype(DType want) const;

  void* data_ = nullptr;
  DType dtype_ = DType::u8;
  std::vector<std::int64_t> shape_;
  std::vector<std::int64_t> strides_;
  Memory memory_ = Memory::host;
  int device_ = -1;
  std::shared_ptr<void> owner_;
};

/// A tensor in host memory (pageable or pinned).
class HostTensor : public Tensor {
 public:
  HostTensor() = default;
  /// Uninitialised, C-contiguous, 64-byte aligned host memory.
  static HostTensor empty(DType dtype, std::vector<std::int64_t> shape);
  /// A view of memory someone else owns; `owner` keeps it alive.
  static HostTensor wrap(void* data, DType dtype, std::vector<std::int64_t> shape,
                         std::shared_ptr<void> owner, Memory memory = Memory::host);

 private:
  using Tensor::Tensor;
};

/// HostTensor::empty takes blocks of 128 KiB and more from a cache of freed blocks of the same
/// size class (sizes rounded up to four classes per power of two, so that sizes varying from
/// item to item share blocks), so that batch after batch reuses warm, mapped memory rather
/// than faulting in fresh pages. The cache keeps at most `bytes` (default 256 MiB; when full,
/// the blocks freed longest ago go first; 0 frees everything and disables it; ASan builds never
/// cache nor round, so that use-after-free and overflows stay visible).
void set_host_cache_limit(std::size_t bytes);
struct HostCacheStats {
  std::size_t cached_bytes = 0;  ///< freed bytes kept for reuse now
  std::size_t limit = 0;
  std::uint64_t hits = 0;        ///< large allocations served from the cache
  std::uint64_t misses = 0;      ///< large allocations that had to allocate
};
HostCacheStats host_cache_stats();

/// Host bytes a HostTensor holds (splitflow::bytes_of, core/bytes.hpp): its elements' (a view
/// counts what it views).
inline std::size_t host_bytes(const HostTensor& t) noexcept { return sizeof(HostTensor) + t.nbytes(); }

namespace detail {
/// Device memory whose free is stream-ordered (splitflow's device pool implements it).
class StreamOrderedMemory {
 public:
  virtual void record_stream(void* native_stream) = 0;

 protected:
  ~StreamOrderedMemory() = default;
};
}  // namespace detail

/// A tensor in device memory. Made by a GPU stage's DeviceContext; its contents are ready when
/// the stage that produced it completed (splitflow emits it only then).
class DeviceTensor : public Tensor {
 public:
  DeviceTensor() = default;
  /// A view of device memory someone else owns; `owner` keeps it alive and frees it.
  static DeviceTensor wrap(void* data, DType dtype, std::vector<std::int64_t> shape, int device,
                           std::shared_ptr<void> owner);

  /// The same memory with another shape of the same element count (C-contiguous only).
  DeviceTensor reshaped(std::vector<std::int64_t> shape) const;
  /// The first `rows` entries of the leading dimension (C-contiguous only): the same memory.
  DeviceTensor leading(std::int64_t rows) const;

  /// Like torch's Tensor.record_stream: work on another stream (a cudaStream_t, or
  /// cudaStreamLegacy / cudaStreamPerThread) uses this memory, so splitflow's pool must not
  /// reuse it before the work enqueued there up to the moment the last copy of the tensor goes
  /// has completed. The free is then enqueued on that stream instead of splitflow's own. Call it
  /// before handing the memory to another CUDA library (the Python module does, for the stream
  /// DLPack's `__dlpack__(stream=...)` names). The stream must still exist when the last copy
  /// goes (torch's streams always do: it pools them). A no-op for memory splitflow did not
  /// allocate (wrap) and on the host backend, whose work is all in splitflow's own stream order.
  void record_stream(void* native_stream) const;

 private:
  using Tensor::Tensor;
  friend class detail::DeviceRuntime;
  detail::StreamOrderedMemory* ordered_ = nullptr;  // kept alive by owner_
};

}  // namespace splitflow
