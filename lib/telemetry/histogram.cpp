#include <algorithm>
#include <bit>

#include "splitflow/telemetry/telemetry.hpp"

namespace splitflow {

std::uint64_t LatencyHistogram::upper(int b) noexcept {
  if (b < (1 << kSubBits)) return static_cast<std::uint64_t>(b);
  const int e = (b >> kSubBits) + kSubBits - 1;
  const std::uint64_t sub = static_cast<std::uint64_t>(b & ((1 << kSubBits) - 1));
  const std::uint64_t base = (std::uint64_t{1} << e) | (sub << (e - kSubBits));
  return base + (std::uint64_t{1} << (e - kSubBits)) - 1;
}

void LatencyHistogram::record(std::uint64_t ns, std::uint64_t count) noexcept {
  if (count == 0) return;
  buckets_[static_cast<std::size_t>(bucket(ns))] += count;
  count_ += count;
  sum_ += ns * count;
  max_ = std::max(max_, ns);
  min_ = std::min(min_, ns);
}

void LatencyHistogram::merge(const LatencyHistogram& o) noexcept {
  // (Both in the same unit: the runtime's histograms all count clock ticks.)
  for (std::size_t i = 0; i < buckets_.size(); ++i) buckets_[i] += o.buckets_[i];
  count_ += o.count_;
  sum_ += o.sum_;
  max_ = std::max(max_, o.max_);
  min_ = std::min(min_, o.min_);
}

std::uint64_t LatencyHistogram::percentile(double p) const noexcept {
  if (count_ == 0) return 0;
  const double want = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(count_);
  std::uint64_t seen = 0;
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    seen += buckets_[i];
    if (static_cast<double>(seen) >= want && buckets_[i] > 0)
      return to_ns(std::min(upper(static_cast<int>(i)), max_));
  }
  return to_ns(max_);
}

}  // namespace splitflow
