// normalize for the host backend: Thrust's CPP system, compiled by g++ with the CCCL headers
// that ship with the CUDA toolkit (THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP). It runs inside
// one host-backend compute slot, like a kernel on the device.
#include <thrust/execution_policy.h>

#include "normalize.inl"

namespace splitflow::ops::detail {

void normalize_host(const std::uint8_t* in, float* out, std::int64_t n, std::int64_t h,
                    std::int64_t w, std::int64_t c, const NormalizeParams& p) {
  normalize_impl(thrust::cpp::par, in, out, n, h, w, c, p);
}

}  // namespace splitflow::ops::detail
