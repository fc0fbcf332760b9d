#include <cmath>
#include <fmt/format.h>

#include "device/device_runtime.hpp"
#include "normalize.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/ops/ops.hpp"

namespace splitflow::ops {

namespace {

// Who failed: a GPU stage's item (its DeviceContext knows them), or the function itself (the
// host forms, called by a stage whose error names it and its item).
std::string who(const std::string* stage, std::uint64_t item, const char* fn) {
  return stage ? fmt::format("splitflow: stage '{}' item {}: {}", *stage, item, fn)
               : fmt::format("splitflow::ops::{}", fn);
}

detail::NormalizeParams params(const std::string* stage, std::uint64_t item, std::int64_t c,
                               const std::vector<float>& mean, const std::vector<float>& stddev,
                               float scale, const char* fn = "normalize") {
  // One value per channel, or one for all of them (broadcast, as torchvision's Normalize does).
  const auto fits = [c](std::size_t k) { return k == 1 || k == static_cast<std::size_t>(c); };
  if (c < 1 || c > detail::kMaxChannels || !fits(mean.size()) || !fits(stddev.size()))
    throw Error(fmt::format("{} needs one mean and one stddev per channel, or one for all "
                            "(1..{} channels); the images have {}, {} means, {} stddevs",
                            who(stage, item, fn), detail::kMaxChannels, c, mean.size(), stddev.size()));
  detail::NormalizeParams p{};
  p.scale = scale;
  for (std::int64_t i = 0; i < c; ++i) {
    const std::size_t m = mean.size() == 1 ? 0 : static_cast<std::size_t>(i);
    const std::size_t sd = stddev.size() == 1 ? 0 : static_cast<std::size_t>(i);
    if (stddev[sd] == 0.0f)
      throw Error(fmt::format("{}: stddev[{}] is 0", who(stage, item, fn), sd));
    if (!std::isfinite(mean[m]) || !std::isfinite(stddev[sd]))
      throw Error(fmt::format("{}: mean[{}] = {} and stddev[{}] = {}: give finite numbers",
                              who(stage, item, fn), m, mean[m], sd, stddev[sd]));
    p.mean[i] = mean[m];
    p.stddev[i] = stddev[sd];
  }
  return p;
}

void check_images(const Tensor& t, const std::string* stage, std::uint64_t item,
                  const char* fn = "normalize") {
  if (t.dtype() != DType::u8 || t.ndim() != 4 || !t.contiguous())
    throw Error(fmt::format("{} takes a contiguous u8 NHWC batch, got {} (Python's "
                            "ops.normalize takes an HWC image too)",
                            who(stage, item, fn), t.describe()));
}

}  // namespace

DeviceTensor normalize(DeviceContext& ctx, const DeviceTensor& images,
                       const std::vector<float>& mean, const std::vector<float>& stddev,
                       float scale) {
  check_images(images, &ctx.stage(), ctx.item());
  const std::int64_t n = images.dim(0), h = images.dim(1), w = images.dim(2), c = images.dim(3);
  const detail::NormalizeParams p = params(&ctx.stage(), ctx.item(), c, mean, stddev, scale);
  DeviceTensor out = ctx.alloc(DType::f32, {n, c, h, w});
  const auto* in = static_cast<const std::uint8_t*>(images.raw());
  auto* dst = static_cast<float*>(out.raw());
  if (ctx.backend() == BackendKind::cuda) {
#if defined(SPLITFLOW_WITH_CUDA)
    detail::normalize_cuda(ctx.native_stream(), in, dst, n, h, w, c, p);
#endif
  } else {
    // The kernel keeps its input alive until it ran (the body's tensor may go before).
    ctx.host_kernel([keep = images, in, dst, n, h, w, c, p] {
      detail::normalize_host(in, dst, n, h, w, c, p);
    });
  }
  splitflow::detail::burst_of(ctx).keep_alive(images.owner());
  return out;
}

HostTensor normalize_reference(const HostTensor& images, const std::vector<float>& mean,
                               const std::vector<float>& stddev, float scale) {
  check_images(images, nullptr, 0, "normalize_reference");
  const std::int64_t n = images.dim(0), h = images.dim(1), w = images.dim(2), c = images.dim(3);
  params(nullptr, 0, c, mean, stddev, scale, "normalize_reference");
  HostTensor out = HostTensor::empty(DType::f32, {n, c, h, w});
  const auto* in = images.data<std::uint8_t>();
  float* dst = out.data<float>();
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t ch = 0; ch < c; ++ch)
      for (std::int64_t y = 0; y < h; ++y)
        for (std::int64_t x = 0; x < w; ++x)
          dst[((b * c + ch) * h + y) * w + x] =
              (static_cast<float>(in[((b * h + y) * w + x) * c + ch]) * scale -
               mean[mean.size() == 1 ? 0 : ch]) /
              stddev[stddev.size() == 1 ? 0 : ch];
  return out;
}

HostTensor normalize(const HostTensor& images, const std::vector<float>& mean,
                     const std::vector<float>& stddev, float scale) {
  check_images(images, nullptr, 0);
  const std::int64_t n = images.dim(0), h = images.dim(1), w = images.dim(2), c = images.dim(3);
  const detail::NormalizeParams p = params(nullptr, 0, c, mean, stddev, scale);
  HostTensor out = HostTensor::empty(DType::f32, {n, c, h, w});
  // The host backend's build of the one Thrust normalize, run on the calling thread.
  detail::normalize_host(images.data<std::uint8_t>(), out.data<float>(), n, h, w, c, p);
  return out;
}

HostTensor normalize_host(const HostTensor& images, const std::vector<float>& mean,
                          const std::vector<float>& stddev, float scale) {
  return normalize(images, mean, stddev, scale);
}

void busy_kernel(DeviceContext& ctx, std::chrono::nanoseconds duration) {
  auto& b = splitflow::detail::burst_of(ctx);
  b.device().backend().timed_kernel(b.stream(), duration, b.exec_sink());
}

}  // namespace splitflow::ops
