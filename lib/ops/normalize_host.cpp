// normalize for the host backend and CPU stages: Thrust's CPP system, compiled by g++ with the
// CCCL headers that ship with the CUDA toolkit (THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP).
// On the host backend it runs inside one compute slot, like a kernel on the device. One image
// per index from a value table (NormalizeImageTable), the same bits as the CUDA per-pixel form.
#include <thrust/execution_policy.h>

#include "normalize.inl"

namespace splitflow::ops::detail {

void normalize_host(const std::uint8_t* in, float* out, std::int64_t n, std::int64_t h,
                    std::int64_t w, std::int64_t c, const NormalizeParams& p) {
  float table[kMaxChannels * 256];
  for (std::int64_t ch = 0; ch < c; ++ch)
    for (int x = 0; x < 256; ++x) table[ch * 256 + x] = normalized(static_cast<std::uint8_t>(x), ch, p);
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::int64_t>(0),
                   thrust::counting_iterator<std::int64_t>(n), NormalizeImageTable{in, out, h * w, c, table});
}

}  // namespace splitflow::ops::detail
