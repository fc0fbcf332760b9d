#include "splitflow/core/tensor.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include <fmt/format.h>

#include "splitflow/core/error.hpp"

// Under ASan (GCC defines __SANITIZE_ADDRESS__; Clang says so through __has_feature).
#if defined(__SANITIZE_ADDRESS__)
#define SPLITFLOW_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPLITFLOW_ASAN 1
#endif
#endif

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

namespace {

// Freed large blocks, kept by size for the next tensor of that size: a pipeline making batch
// after batch then writes into warm, mapped pages instead of faulting in fresh ones (glibc
// mmaps blocks over 32 MiB afresh every time; writing a new 38 MiB float batch cost more in
// page faults than the normalize that filled it). Bounded by its limit.
//
// Sizes are rounded up to a class (four per power of two: at most 25% more), so that tensors
// whose size changes from item to item share blocks: a random crop's decoded rows
// (box.h x width x 3) took a block of an exact size that the next epoch's crops, drawn anew,
// never asked for again; every such block stayed until the cache was full (+5 MiB per epoch
// for 4 large photos in 1,200), after which the batches' blocks no longer fit.
// When full, the blocks given back longest ago make room for the newest.
//
// From 128 KiB up: glibc's default mmap threshold, above which malloc maps each block afresh
// whenever its threshold does not adapt, which is always once the process sets any malloc
// parameter (Dask's nanny starts its workers with MALLOC_TRIM_THRESHOLD_=65536: a decoded
// 500x375 crop's rows, its resize's rows and the 224x224 result were each mapped and faulted in
// anew, 1.4 -> 3.5 ms an item in a worker).
class HostBlockCache {
 public:
  static constexpr std::size_t kMinBytes = std::size_t{128} << 10;

  /// The size of the block to allocate for `bytes` (a multiple of 64).
  static std::size_t block_size(std::size_t bytes) noexcept {
    if (!kEnabled || bytes < kMinBytes) return bytes;  // exact under ASan: overflows stay visible
    const std::size_t step = std::bit_floor(bytes) / 4;  // >= 32 KiB
    return (bytes + step - 1) / step * step;
  }

  void* take(std::size_t bytes) {
    if (bytes >= kMinBytes) {
      std::lock_guard lk(mu_);
      // The block of this size given back last (equal keys keep their order of insertion): the
      // one most likely still in the CPU's caches, as malloc's own free lists would hand out.
      const auto [lo, hi] = free_.equal_range(bytes);
      if (lo != hi) {
        const auto it = std::prev(hi);
        void* p = it->second.p;
        free_.erase(it);
        cached_ -= bytes;
        ++hits_;
        return p;
      }
      ++misses_;
    }
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void give(void* p, std::size_t bytes) noexcept {
    if (bytes >= kMinBytes && kEnabled) {
      std::lock_guard lk(mu_);
      if (bytes <= limit_) {
        while (cached_ + bytes > limit_) evict_oldest();
        try {
          free_.emplace(bytes, Block{p, ++given_});
          cached_ += bytes;
          return;
        } catch (...) {  // no room to remember it: free it
        }
      }
    }
    std::free(p);
  }
  void set_limit(std::size_t bytes) {
    std::lock_guard lk(mu_);
    limit_ = kEnabled ? bytes : 0;
    while (cached_ > limit_) {  // largest first
      auto it = std::prev(free_.end());
      cached_ -= it->first;
      std::free(it->second.p);
      free_.erase(it);
    }
  }
  HostCacheStats stats() {
    std::lock_guard lk(mu_);
    return {cached_, limit_, hits_, misses_};
  }

 private:
#if defined(SPLITFLOW_ASAN)
  static constexpr bool kEnabled = false;  // reuse would hide use-after-free from ASan
#else
  static constexpr bool kEnabled = true;
#endif
  struct Block {
    void* p;
    std::uint64_t given;  // when it was given back: the oldest goes first when full
  };
  // Under mu_, with cached_ > 0. A linear scan: the cache holds at most limit / 128 KiB blocks.
  void evict_oldest() noexcept {
    auto oldest = free_.begin();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second.given < oldest->second.given) oldest = it;
    cached_ -= oldest->first;
    std::free(oldest->second.p);
    free_.erase(oldest);
  }

  std::mutex mu_;
  std::multimap<std::size_t, Block> free_;
  std::size_t cached_ = 0;
  std::size_t limit_ = kEnabled ? std::size_t{256} << 20 : 0;
  std::uint64_t given_ = 0;
  std::uint64_t hits_ = 0, misses_ = 0;
};

// Never destroyed: tensors may be freed by static destructors after this would have been.
HostBlockCache& block_cache() {
  static HostBlockCache* cache = new HostBlockCache;
  return *cache;
}

}  // namespace

void set_host_cache_limit(std::size_t bytes) { block_cache().set_limit(bytes); }
HostCacheStats host_cache_stats() { return block_cache().stats(); }

HostTensor HostTensor::empty(DType dtype, std::vector<std::int64_t> shape) {
  std::size_t bytes = itemsize(dtype);
  for (auto d : shape) {
    if (d < 0) throw Error("splitflow: tensor dimensions must be >= 0");
    bytes *= static_cast<std::size_t>(d);
  }
  const std::size_t size = HostBlockCache::block_size(std::max<std::size_t>((bytes + 63) / 64 * 64, 64));
  void* p = block_cache().take(size);
  std::shared_ptr<void> owner(p, [size](void* q) { block_cache().give(q, size); });
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

DeviceTensor DeviceTensor::reshaped(std::vector<std::int64_t> shape) const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  if (!contiguous() || n != numel())
    throw Error(fmt::format("splitflow: cannot view {} as {} elements{}", describe(), n,
                            contiguous() ? "" : " (not contiguous)"));
  DeviceTensor v(data_, dtype_, std::move(shape), Memory::device, device_, owner_);
  v.ordered_ = ordered_;
  return v;
}

DeviceTensor DeviceTensor::leading(std::int64_t rows) const {
  if (!contiguous() || ndim() == 0 || rows < 0 || rows > shape_[0])
    throw Error(fmt::format("splitflow: cannot take the first {} rows of {}{}", rows, describe(),
                            contiguous() ? "" : " (not contiguous)"));
  std::vector<std::int64_t> shape = shape_;
  shape[0] = rows;
  DeviceTensor v(data_, dtype_, std::move(shape), Memory::device, device_, owner_);
  v.ordered_ = ordered_;
  return v;
}

void DeviceTensor::record_stream(void* native_stream) const {
  if (ordered_) ordered_->record_stream(native_stream);
}

}  // namespace splitflow
