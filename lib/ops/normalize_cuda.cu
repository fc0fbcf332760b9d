// normalize for the CUDA backend: the same Thrust code as the host build, on the leased stream.
#include <thrust/execution_policy.h>
#include <thrust/system/cuda/execution_policy.h>

#include "device/cuda_check.hpp"
#include "normalize.inl"

namespace splitflow::ops::detail {

void normalize_cuda(void* stream, const std::uint8_t* in, float* out, std::int64_t n,
                    std::int64_t h, std::int64_t w, std::int64_t c, const NormalizeParams& p) {
  // par_nosync: enqueue and return; completion is the stage's event, not a host sync.
  normalize_impl(thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(stream)), in, out, n, h,
                 w, c, p);
  int device = 0;
  cudaGetDevice(&device);
  SF_CUDA(cudaGetLastError(), device);
}

}  // namespace splitflow::ops::detail
