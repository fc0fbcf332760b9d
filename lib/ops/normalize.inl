// normalize, written once for Thrust; included by normalize_host.cpp (g++, Thrust CPP system)
// and normalize_cuda.cu (nvcc, Thrust CUDA system).
#pragma once

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

#include <cstdint>

#include "normalize.hpp"

namespace splitflow::ops::detail {

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
      dst[ch * hw] = (static_cast<float>(src[ch]) * p.scale - p.mean[ch]) / p.stddev[ch];
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
