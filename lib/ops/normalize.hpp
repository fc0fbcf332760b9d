// normalize's parameters and the entry points of its two compilations (no Thrust here).
#pragma once

#include <cstdint>

namespace splitflow::ops::detail {

constexpr int kMaxChannels = 16;

struct NormalizeParams {
  float scale;
  float mean[kMaxChannels];
  float stddev[kMaxChannels];
};

/// g++, Thrust CPP system (normalize_host.cpp).
void normalize_host(const std::uint8_t* in, float* out, std::int64_t n, std::int64_t h,
                    std::int64_t w, std::int64_t c, const NormalizeParams& p);
/// nvcc, Thrust CUDA system on `stream` (normalize_cuda.cu).
void normalize_cuda(void* stream, const std::uint8_t* in, float* out, std::int64_t n,
                    std::int64_t h, std::int64_t w, std::int64_t c, const NormalizeParams& p);

}  // namespace splitflow::ops::detail
