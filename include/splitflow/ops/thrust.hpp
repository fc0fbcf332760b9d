// A Thrust execution policy for the current backend, for GPU-stage bodies that use Thrust:
//
//     #include <splitflow/ops/thrust.hpp>
//     auto scaled = g.gpu_stage("scale", [](DeviceTensor t, DeviceContext& ctx) {
//       float* p = static_cast<float*>(t.raw());
//       const auto n = t.numel();
//       splitflow::thrust_kernel(ctx, [=](const auto& policy) {
//         thrust::transform(policy, p, p + n, p, Twice{});   // Twice: _CCCL_HOST_DEVICE functor
//       });
//       return t;
//     });
//
// On the CUDA backend the kernel is called at once with thrust::cuda::par_nosync on the leased
// stream (the translation unit must be compiled by nvcc; otherwise it throws). On the host
// backend it runs later, in stream order on a compute slot, with thrust::cpp::par. Needs the
// CCCL headers of the CUDA toolkit: link splitflow::thrust (CMake) to get them.
#pragma once

#include <thrust/execution_policy.h>
#if defined(__CUDACC__)
#include <thrust/system/cuda/execution_policy.h>
#endif

#include <utility>

#include "splitflow/device/device.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow {

template <class Kernel>
void thrust_kernel(DeviceContext& ctx, Kernel kernel) {
  if (ctx.backend() == BackendKind::cuda) {
#if defined(__CUDACC__)
    kernel(thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(ctx.native_stream())));
    return;
#else
    throw Error("splitflow::thrust_kernel: stage '" + ctx.stage() +
                "' runs on CUDA but its body was not compiled by nvcc");
#endif
  }
  ctx.host_kernel([k = std::move(kernel)]() mutable { k(thrust::cpp::par); });
}

}  // namespace splitflow
