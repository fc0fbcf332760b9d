// normalize, written once for Thrust; included by normalize_host.cpp (g++, Thrust CPP system)
// and normalize_cuda.cu (nvcc, Thrust CUDA system).
#pragma once

#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

#include <cstdint>

#include "normalize.hpp"

namespace splitflow::ops::detail {

struct NormalizeNhwcToNchw {
  const std::uint8_t* in;
  std::int64_t h, w, c;
  NormalizeParams p;

  _CCCL_HOST_DEVICE float operator()(std::int64_t i) const {
    const std::int64_t x = i % w;
    std::int64_t t = i / w;
    const std::int64_t y = t % h;
    t /= h;
    const std::int64_t ch = t % c;
    const std::int64_t n = t / c;
    const float v = static_cast<float>(in[((n * h + y) * w + x) * c + ch]);
    return (v * p.scale - p.mean[ch]) / p.stddev[ch];
  }
};

template <class Policy>
void normalize_impl(const Policy& policy, const std::uint8_t* in, float* out, std::int64_t n,
                    std::int64_t h, std::int64_t w, std::int64_t c, const NormalizeParams& p) {
  const std::int64_t total = n * c * h * w;
  thrust::transform(policy, thrust::counting_iterator<std::int64_t>(0),
                    thrust::counting_iterator<std::int64_t>(total), out,
                    NormalizeNhwcToNchw{in, h, w, c, p});
}

}  // namespace splitflow::ops::detail
