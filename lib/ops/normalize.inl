// normalize, written once for Thrust; included by normalize_host.cpp (g++, Thrust CPP system)
// and normalize_cuda.cu (nvcc, Thrust CUDA system).
#pragma once

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <cstdint>

#include "normalize.hpp"

namespace splitflow::ops::detail {

/// One element's value: every decomposition below computes it with this, so results are
/// bit-identical to the reference whichever system runs them.
_CCCL_HOST_DEVICE inline float normalized(std::uint8_t x, std::int64_t ch, const NormalizeParams& p) {
  return (static_cast<float>(x) * p.scale - p.mean[ch]) / p.stddev[ch];
}

// One pixel per index: its channels are contiguous in the NHWC input, and it writes one float
// to each of its image's C planes. (Per pixel, not per output element: one division to locate
// it instead of three, and consecutive indices still write consecutive floats of a plane, so
// CUDA's stores coalesce.) The arithmetic is the reference's, so results are bit-identical.
struct NormalizePixel {
  const std::uint8_t* in;
  float* out;
  std::int64_t hw, c;
  NormalizeParams p;

  _CCCL_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t n = i / hw;
    const std::int64_t pix = i - n * hw;
    const std::uint8_t* src = in + i * c;
    float* dst = out + n * c * hw + pix;
    for (std::int64_t ch = 0; ch < c; ++ch)
      dst[ch * hw] = normalized(src[ch], ch, p);
  }
};

// Host systems: one image per index, from a table of the 256 values each channel can take
// (built with normalized(), so the same bits). A CPU thread has no use for per-pixel
// parallelism, and the table turns a division per element into a load.
struct NormalizeImageTable {
  const std::uint8_t* in;
  float* out;
  std::int64_t hw, c;
  const float* table;  // [c][256]

  void operator()(std::int64_t n) const {
    const std::uint8_t* src = in + n * hw * c;
    float* dst = out + n * hw * c;
    if (c == 3) {  // the common case, unrolled
      const float *t0 = table, *t1 = table + 256, *t2 = table + 512;
      float *d0 = dst, *d1 = dst + hw, *d2 = dst + 2 * hw;
      for (std::int64_t i = 0; i < hw; ++i, src += 3) {
        d0[i] = t0[src[0]];
        d1[i] = t1[src[1]];
        d2[i] = t2[src[2]];
      }
      return;
    }
    for (std::int64_t i = 0; i < hw; ++i)
      for (std::int64_t ch = 0; ch < c; ++ch) dst[ch * hw + i] = table[ch * 256 + src[i * c + ch]];
  }
};

template <class Policy>
void normalize_impl(const Policy& policy, const std::uint8_t* in, float* out, std::int64_t n,
                    std::int64_t h, std::int64_t w, std::int64_t c, const NormalizeParams& p) {
  thrust::for_each(policy, thrust::counting_iterator<std::int64_t>(0),
                   thrust::counting_iterator<std::int64_t>(n * h * w),
                   NormalizePixel{in, out, h * w, c, p});
}

}  // namespace splitflow::ops::detail
