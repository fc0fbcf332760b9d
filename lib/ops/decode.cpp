// Batched JPEG decode with a placement per image (splitflow/ops/decode.hpp): placement by load
// and the two stage bodies. (The header reader and the routing rule: jpeg_info.cpp.)
#include "splitflow/ops/decode.hpp"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>

#include "device/device_runtime.hpp"
#include "splitflow/core/detail/clock.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::image {

std::size_t device_share(std::size_t eligible, const DecodeLoad& load, const DecodeCosts& costs,
                         int cores, std::size_t queue_cap) noexcept {
  if (eligible == 0) return 0;
  const auto clamp01 = [](double x) { return std::isfinite(x) ? std::clamp(x, 0.0, 1.0) : 1.0; };
  const double cpu = std::max(cores, 1) * (1.0 - clamp01(load.cpu_busy)) / std::max(costs.cpu_ns, 1.0);
  const double dev = load.device_queue >= queue_cap
                         ? 0.0
                         : (1.0 - clamp01(load.device_busy)) / std::max(costs.device_ns, 1.0);
  if (!(cpu + dev > 0)) return 0;
  const double n = std::round(static_cast<double>(eligible) * dev / (cpu + dev));
  const std::size_t share = static_cast<std::size_t>(std::clamp(n, 0.0, static_cast<double>(eligible)));
  // Not more than the engines' room.
  return std::min(share, queue_cap - std::min(queue_cap, load.device_queue));
}

// ---- the op's state ----------------------------------------------------------------------------

namespace {

std::int64_t clock_ns(clockid_t id) noexcept {
  timespec t{};
  clock_gettime(id, &t);
  return std::int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

// The fraction of a resource busy with others' work over windows of 10 ms at least: each
// sample gives the wall time, the resource's busy time (process CPU, device busy) and this op's
// own share of it, all cumulative.
struct BusyWindow {
  std::int64_t wall0 = 0, busy0 = 0, own0 = 0;
  double busy = 0;
  double sample(std::int64_t wall, std::int64_t busy_ns, std::int64_t own, double capacity) noexcept {
    if (wall0 != 0 && wall - wall0 < 10'000'000) return busy;
    if (wall0 != 0) {
      const double others = static_cast<double>((busy_ns - busy0) - (own - own0));
      busy = std::clamp(others / (static_cast<double>(wall - wall0) * capacity), 0.0, 1.0);
    }
    wall0 = wall;
    busy0 = busy_ns;
    own0 = own;
    return busy;
  }
};

// Mean of the latest measurements, weighted 1/8 each (the first replaces the prior).
void update(double& mean, bool& seen, double x) noexcept {
  mean = seen ? mean + (x - mean) / 8.0 : x;
  seen = true;
}

}  // namespace

struct DecodedBatch::Data {
  DeviceTensor images;
  std::vector<Decoded> decoded;
  std::vector<Skipped> skipped;
};

DecodedBatch::DecodedBatch() : d_(std::make_shared<Data>()) {}
const DeviceTensor& DecodedBatch::images() const noexcept { return d_->images; }
const std::vector<DecodedBatch::Decoded>& DecodedBatch::decoded() const noexcept { return d_->decoded; }
const std::vector<DecodedBatch::Skipped>& DecodedBatch::skipped() const noexcept { return d_->skipped; }

struct BatchDecode::State {
  BatchDecodeOptions opts;
  int cores = 1;

  // What the device stage found its backend to be: 0 unknown, 1 decodes device placements
  // (the host backend's model), 2 cannot (CUDA: nvJPEG is not built).
  std::atomic<int> device_kind{0};
  std::atomic<std::size_t> device_queue{0};

  std::mutex mu;  // the rest
  BatchDecodeStats stats;
  DecodeCosts costs;
  bool cpu_seen = false, device_seen = false;
  // This op's own CPU and device time (cumulative), and the loads' windows.
  std::int64_t own_cpu = 0, own_dev = 0;
  BusyWindow cpu_window, device_window;
  double device_busy = 0;

  DecodeLoad measure_locked() {
    const double cpu_busy = cpu_window.sample(clock_ns(CLOCK_MONOTONIC),
                                              clock_ns(CLOCK_PROCESS_CPUTIME_ID), own_cpu, cores);
    return DecodeLoad{cpu_busy, device_busy, device_queue.load()};
  }
  void device_window_locked(const DeviceStats& d) {
    device_busy = device_window.sample(d.wall_ns, d.busy_ns, own_dev, 1.0);
  }
};

BatchDecode::BatchDecode(BatchDecodeOptions options) : s_(std::make_shared<State>()) {
  validate(options.augment, "BatchDecode");
  if (options.augment.width != 0 && options.augment.width != options.augment.size)
    throw Error(fmt::format("splitflow: BatchDecode: its batches are of square crops (size {}); "
                            "augment.width {} is for DecodeRandomResizedCrop", options.augment.size,
                            options.augment.width));
  if (options.on_error == OnError::substitute)
    throw Error("splitflow: BatchDecode: on_error must be fail or skip (a batch's substitute is "
                "its stage's: set on_error = substitute on the stage instead)");
  if (options.device_queue_cap == 0)
    throw Error("splitflow: BatchDecode: device_queue_cap must be at least 1");
  if (options.cores < 0)
    throw Error(fmt::format("splitflow: BatchDecode: cores = {} (0 means the machine's)", options.cores));
  s_->cores = options.cores > 0 ? options.cores
                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  s_->opts = std::move(options);
}

BatchDecodeStats BatchDecode::stats() const {
  std::lock_guard lk(s_->mu);
  return s_->stats;
}

// ---- the CPU stage ------------------------------------------------------------------------------

DecodePlan BatchDecode::host(std::vector<Encoded> files) const {
  State& s = *s_;
  const BatchDecodeOptions& o = s.opts;
  const bool skip = o.on_error == OnError::skip;
  // Bytes of another dtype are the caller's mistake, not a bad file: refused whatever on_error
  // says (under skip every file was dropped as a failure).
  for (const Encoded& f : files) (void)internal::encoded_bytes("BatchDecode", f);
  DecodePlan plan;
  plan.entries.resize(files.size());
  auto fail = [&](const DecodePlan::Entry& e, const std::string& why) {
    if (!skip) throw Error(fmt::format("splitflow: BatchDecode: image {} ({}): {}", e.index, e.path, why));
    return why;
  };

  // Headers and routing: each image's possible placement.
  std::vector<std::size_t> eligible;  // entries a device placement may take
  const int kind = s.device_kind.load();
  for (std::size_t i = 0; i < files.size(); ++i) {
    Encoded& f = files[i];
    DecodePlan::Entry& e = plan.entries[i];
    e.index = f.index;
    e.path = f.path;
    JpegInfo info;
    try {
      info = jpeg_info(f.bytes.data<std::uint8_t>(), f.bytes.nbytes(), f.path);
    } catch (const Error& err) {
      e.error = fail(e, err.what());
      continue;
    }
    DecodePlacement want = o.placement;
    if (want == DecodePlacement::by_load) {
      if (kind != 1) {
        want = DecodePlacement::cpu;  // no device placement here (or not known yet)
      } else if (!unsupported_reason(DecodePlacement::hardware, info)) {
        want = DecodePlacement::hardware;
      } else if (!unsupported_reason(DecodePlacement::hybrid, info)) {
        want = DecodePlacement::hybrid;
      } else {
        want = DecodePlacement::cpu;
        e.routed = true;
      }
    } else if (want != DecodePlacement::cpu && unsupported_reason(want, info)) {
      want = DecodePlacement::cpu;  // the asked placement cannot take this stream
      e.routed = true;
    }
    e.placement = want;
    if (want != DecodePlacement::cpu) eligible.push_back(i);
  }

  // By load: the device keeps its share of the eligible images, spread over the batch.
  DecodeLoad load;
  {
    std::lock_guard lk(s.mu);
    load = o.load ? o.load() : s.measure_locked();
    s.stats.last_load = load;
    if (o.placement == DecodePlacement::by_load) {
      const std::size_t k = device_share(eligible.size(), load, s.costs, s.cores, o.device_queue_cap);
      // Keep eligible images j where floor((j + 1) k / n) > floor(j k / n): k of them, evenly.
      const std::size_t n = eligible.size();
      for (std::size_t j = 0; j < n; ++j)
        if ((j + 1) * k / n == j * k / n) plan.entries[eligible[j]].placement = DecodePlacement::cpu;
    }
  }

  // The CPU placement's decodes, into one u8[k, size, size, c] tensor.
  const int c = o.color == Color::rgb ? 3 : 1;
  const std::int64_t side = o.augment.size;
  const std::size_t row_bytes = static_cast<std::size_t>(side * side * c);
  std::vector<HostTensor> rows;
  std::int64_t cpu_ns = 0;
  std::uint64_t decoded = 0, routed = 0, skipped = 0;
  for (std::size_t i = 0; i < files.size(); ++i) {
    DecodePlan::Entry& e = plan.entries[i];
    if (!e.error.empty()) {
      ++skipped;
      continue;
    }
    routed += e.routed;
    if (e.placement != DecodePlacement::cpu) {
      e.bytes = std::move(files[i].bytes);
      continue;
    }
    const std::int64_t t0 = detail::thread_cpu_ns();
    try {
      Image img = decode_random_resized_crop(std::move(files[i]), o.augment, o.color);
      e.row = static_cast<int>(rows.size());
      rows.push_back(std::move(img.pixels));
      ++decoded;
    } catch (const Error& err) {
      cpu_ns += detail::thread_cpu_ns() - t0;
      e.error = fail(e, err.what());
      ++skipped;
      continue;
    }
    cpu_ns += detail::thread_cpu_ns() - t0;
  }
  plan.cpu_rows = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(rows.size()), side, side, c});
  for (std::size_t r = 0; r < rows.size(); ++r)
    std::memcpy(plan.cpu_rows.data<std::uint8_t>() + r * row_bytes, rows[r].raw(), row_bytes);

  std::lock_guard lk(s.mu);
  s.own_cpu += cpu_ns;
  s.stats.cpu += decoded;
  s.stats.routed += routed;
  s.stats.skipped += skipped;
  s.stats.cpu_ns += cpu_ns;
  if (decoded > 0) update(s.costs.cpu_ns, s.cpu_seen, static_cast<double>(cpu_ns) / static_cast<double>(decoded));
  return plan;
}

// ---- the GPU stage ------------------------------------------------------------------------------

DecodedBatch BatchDecode::device(DecodePlan plan, DeviceContext& ctx) const {
  State& s = *s_;
  const BatchDecodeOptions& o = s.opts;
  const bool model = ctx.backend() == BackendKind::host;
  s.device_kind.store(model ? 1 : 2);
  {
    std::lock_guard lk(s.mu);
    s.device_window_locked(detail::burst_of(ctx).device().stats());
    s.stats.batches += 1;
  }

  std::size_t on_device = 0;
  for (const auto& e : plan.entries)
    if (e.error.empty() && e.placement != DecodePlacement::cpu) ++on_device;
  if (on_device > 0 && !model)
    throw Error(fmt::format("splitflow: stage '{}' item {}: BatchDecode placement {} needs nvJPEG, "
                            "which this build does not have yet; use DecodePlacement::cpu (or "
                            "by_load, which keeps every image on the CPU here)",
                            ctx.stage(), ctx.item(), to_string(o.placement)));

  const int c = o.color == Color::rgb ? 3 : 1;
  const std::int64_t side = o.augment.size;
  DecodedBatch out;
  for (const auto& e : plan.entries)
    if (!e.error.empty()) out.d_->skipped.push_back({e.index, e.path, e.error});

  if (on_device == 0) {  // CPU rows only: one upload
    for (const auto& e : plan.entries)
      if (e.error.empty()) out.d_->decoded.push_back({e.index, e.path, DecodePlacement::cpu});
    out.d_->images = ctx.to_device(plan.cpu_rows);
    return out;
  }

  // The host backend's model of the device placements: the CPU decoder as one kernel on the
  // backend's device threads, writing rows in the batch's order, a failed image's row left out.
  const std::int64_t n = static_cast<std::int64_t>(plan.entries.size() - out.d_->skipped.size());
  DeviceTensor rows = ctx.alloc(DType::u8, {n, side, side, c});
  s.device_queue.fetch_add(on_device);
  std::shared_ptr<DecodedBatch::Data> d = out.d_;
  auto st = s_;
  ctx.host_kernel([st, d, rows, plan = std::move(plan), side, c, on_device]() mutable {
    State& s = *st;
    const BatchDecodeOptions& o = s.opts;
    const std::size_t row_bytes = static_cast<std::size_t>(side * side * c);
    std::uint8_t* dst = rows.data<std::uint8_t>();
    std::int64_t next = 0, dev_ns = 0, own_cpu = 0;
    std::uint64_t hybrid = 0, hardware = 0, skipped = 0;
    std::size_t left = on_device;
    struct Done {  // the queue count and the figures, whatever happens below
      State& s;
      std::size_t& left;
      std::int64_t &dev_ns, &own_cpu;
      std::uint64_t &hybrid, &hardware, &skipped;
      ~Done() {
        s.device_queue.fetch_sub(left);
        std::lock_guard lk(s.mu);
        s.own_dev += dev_ns;
        s.own_cpu += own_cpu;
        s.stats.hybrid += hybrid;
        s.stats.hardware += hardware;
        s.stats.skipped += skipped;
        s.stats.device_ns += dev_ns;
        if (hybrid + hardware > 0)
          update(s.costs.device_ns, s.device_seen,
                 static_cast<double>(dev_ns) / static_cast<double>(hybrid + hardware));
      }
    } done{s, left, dev_ns, own_cpu, hybrid, hardware, skipped};
    for (auto& e : plan.entries) {
      if (!e.error.empty()) continue;
      if (e.placement == DecodePlacement::cpu) {
        std::memcpy(dst + next * row_bytes, plan.cpu_rows.data<std::uint8_t>() + e.row * row_bytes, row_bytes);
        d->decoded.push_back({e.index, e.path, DecodePlacement::cpu});
        ++next;
        continue;
      }
      // However the image ends: its device time, its CPU time (the model's decodes are CPU
      // time too, this op's own: not load on the CPU), and it leaves the device queue.
      struct PerImage {
        State& s;
        std::size_t& left;
        std::int64_t &dev_ns, &own_cpu;
        std::int64_t t0 = clock_ns(CLOCK_MONOTONIC), c0 = detail::thread_cpu_ns();
        ~PerImage() {
          dev_ns += clock_ns(CLOCK_MONOTONIC) - t0;
          own_cpu += detail::thread_cpu_ns() - c0;
          --left;
          s.device_queue.fetch_sub(1);
        }
      } one{s, left, dev_ns, own_cpu};
      try {
        Image img = decode_random_resized_crop(Encoded{e.index, e.path, std::move(e.bytes)},
                                               o.augment, o.color);
        std::memcpy(dst + next * row_bytes, img.pixels.raw(), row_bytes);
        d->decoded.push_back({e.index, e.path, e.placement});
        ++next;
        ++(e.placement == DecodePlacement::hybrid ? hybrid : hardware);
      } catch (const Error& err) {
        if (o.on_error != OnError::skip)
          throw Error(fmt::format("splitflow: BatchDecode: image {} ({}), placement {}: {}",
                                  e.index, e.path, to_string(e.placement), err.what()));
        d->skipped.push_back({e.index, e.path, err.what()});
        ++skipped;
      }
    }
    d->images = rows.leading(next);
  });
  return out;
}

}  // namespace splitflow::image
