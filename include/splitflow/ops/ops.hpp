// Built-in device ops. Each is written once (Thrust) and compiled twice: by nvcc for the CUDA
// backend and by g++ for the host backend (Thrust's CPP system). They enqueue on the
// DeviceContext's stream; results are ready when the GPU stage emits.
//
//     auto norm = g.gpu_stage("normalize", [](DeviceTensor batch, DeviceContext& ctx) {
//       return ops::normalize(ctx, batch, {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
//     });
#pragma once

#include <chrono>
#include <vector>

#include "splitflow/device/device.hpp"
#include "splitflow/core/tensor.hpp"

namespace splitflow::ops {

/// A uint8 NHWC image batch to float32 NCHW: out[n][c][y][x] = (in[n][y][x][c] * scale -
/// mean[c]) / stddev[c]. `mean` and `stddev` have one value per channel (at most 16 channels),
/// or one for every channel (broadcast, as torchvision's Normalize does).
/// Throws Error naming the stage and item on a wrong dtype, rank or channel count.
DeviceTensor normalize(DeviceContext& ctx, const DeviceTensor& images, const std::vector<float>& mean,
                       const std::vector<float>& stddev, float scale = 1.0f / 255.0f);

/// The same arithmetic on the host, element by element (the reference the tests compare with).
HostTensor normalize_reference(const HostTensor& images, const std::vector<float>& mean,
                               const std::vector<float>& stddev, float scale = 1.0f / 255.0f);

/// normalize on the calling CPU thread, for CPU stages: the same Thrust code as the host
/// backend's kernel (Thrust's CPP system). The same name as the GPU form: the argument picks
/// where it runs (Python's ops.normalize does the same by the stage it is given to).
HostTensor normalize(const HostTensor& images, const std::vector<float>& mean,
                     const std::vector<float>& stddev, float scale = 1.0f / 255.0f);
/// The CPU form's older name.
HostTensor normalize_host(const HostTensor& images, const std::vector<float>& mean,
                          const std::vector<float>& stddev, float scale = 1.0f / 255.0f);

/// A synthetic kernel that occupies the device for `duration`: on CUDA a spin on the global
/// timer across every SM, on the host backend a compute slot held by a timer wait (no CPU burnt).
void busy_kernel(DeviceContext& ctx, std::chrono::nanoseconds duration);

}  // namespace splitflow::ops
