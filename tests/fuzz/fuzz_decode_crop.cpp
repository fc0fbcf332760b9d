// Fuzz target: image::decode_random_resized_crop (the fused decode + crop: the crop drawn from
// the header's size, only its region decoded, then resized and maybe mirrored) on arbitrary
// bytes and augmentation specs. The input is the file, then 12 bytes: the item index (uint32,
// little-endian), the output size (1 + byte % 64), scale and ratio ranges (each end a byte
// picking one of a table of values from 1e-6 to 1e6; the smaller first), the flip probability
// (byte / 255), the seed and epoch (one byte), and a mode byte: bit 0 gray, bit 1 antialias off,
// bit 2 scaled decode always (a crop that shrinks 2x or more decoded at a reduced DCT scale;
// with antialias only, as validate() requires).
//
// Checks beyond "no sanitizer report": the spec is valid (validate() accepts it); the result
// is size x size with the asked channels; it equals RandomResizedCrop(spec)(decode(file))
// whenever the whole file decodes and that succeeds and the crop was decoded in full (the
// documented contract); errors name the
// file; the heap stays under fuzz::kDecodeHeapBound; the decoders work after an error.
#include <cstring>

#include "fuzz_common.hpp"
#include "fuzz_jpeg.hpp"
#include "splitflow/ops/image.hpp"

using namespace splitflow;

namespace {
constexpr std::size_t kTail = 12;
constexpr double kScales[] = {1e-6, 0.01, 0.08, 0.25, 0.5, 0.9, 1.0, 1.5, 4.0, 1e6};
constexpr double kRatios[] = {1e-6, 0.1, 0.5, 0.75, 1.0, 4.0 / 3.0, 2.0, 10.0, 1e6};

template <std::size_t N>
void range(const double (&table)[N], std::uint8_t a, std::uint8_t b, double& lo, double& hi) {
  lo = table[a % N];
  hi = table[b % N];
  if (lo > hi) std::swap(lo, hi);
}

HostTensor bytes_of(const std::uint8_t* data, std::size_t n) {
  HostTensor t = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(n)});
  if (n) std::memcpy(t.raw(), data, n);
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::heap::install();
  std::uint8_t t[kTail] = {};
  const std::size_t n = size >= kTail ? size - kTail : 0;
  std::memcpy(t, data + n, size - n);
  const std::uint64_t index = t[0] | t[1] << 8 | t[2] << 16 | static_cast<std::uint64_t>(t[3]) << 24;
  image::AugmentSpec spec;
  spec.size = 1 + t[4] % 64;
  // A width of its own (torchvision's size=(h, w)) half the time: 1 to 64.
  spec.width = t[11] & 8 ? 1 + ((t[11] >> 4) << 2 | t[4] >> 6) : 0;
  range(kScales, t[5], t[6], spec.scale_min, spec.scale_max);
  range(kRatios, t[7], t[8], spec.ratio_min, spec.ratio_max);
  spec.flip_probability = t[9] / 255.0;
  spec.seed = t[10] & 15;
  spec.epoch = t[10] >> 4;
  spec.antialias = !(t[11] & 2);
  // (The scaled decode goes with antialias only: validate() refuses always without it.)
  spec.scaled_decode = t[11] & 4 && spec.antialias ? image::AugmentSpec::ScaledDecode::always
                                                   : image::AugmentSpec::ScaledDecode::never;
  const image::Color color = t[11] & 1 ? image::Color::gray : image::Color::rgb;
  const int C = color == image::Color::rgb ? 3 : 1;
  image::validate(spec, "fuzz");  // throws (and the fuzzer reports it) if a spec here is refused

  const std::int64_t base = fuzz::heap::reset();
  image::Image fused;
  bool failed = false;
  try {
    fused = image::DecodeRandomResizedCrop(spec, color)({index, fuzz::kName, bytes_of(data, n)});
  } catch (const Error& e) {
    fuzz::check_names(e);
    failed = true;
    if (fuzz::verbose()) std::fprintf(stderr, "fused error: %s\n", e.what());
  }
  fuzz::check_heap(fuzz::heap::peak_since(base), data, n);
  if (failed) {
    fuzz::check_good_decodes();
  } else {
    FUZZ_CHECK(fused.index == index && fused.path == fuzz::kName);
    FUZZ_CHECK(fused.pixels.ndim() == 3 && fused.pixels.dim(0) == spec.size &&
               fused.pixels.dim(1) == (spec.width ? spec.width : spec.size) &&
               fused.pixels.dim(2) == C);
  }

  // The contract: the same pixels as RandomResizedCrop(spec)(decode(file)).
  image::Image whole;
  try {
    whole = image::decode({index, fuzz::kName, bytes_of(data, n)}, color);
  } catch (const Error& e) {
    fuzz::check_names(e);
    return 0;
  }
  const std::int64_t whole_h = whole.pixels.dim(0), whole_w = whole.pixels.dim(1);
  image::Image want;
  try {
    want = image::RandomResizedCrop(spec)(std::move(whole));
  } catch (const Error& e) {
    // The crop itself is refused (a degenerate box from an extreme ratio): so must the fused op.
    if (fuzz::verbose()) std::fprintf(stderr, "crop error: %s\n", e.what());
    FUZZ_CHECK(failed);
    return 0;
  }
  if (failed) {
    std::fprintf(stderr, "fuzz check failed: decode + crop succeeds, the fused op does not\n");
    std::abort();
  }
  FUZZ_CHECK(want.pixels.shape() == fused.pixels.shape());
  // A crop decoded at a reduced scale differs from the full decode (by its stated PSNR).
  const image::Augment drawn = image::draw_augment(static_cast<int>(whole_h), static_cast<int>(whole_w), index, spec);
  if (image::decode_denominator(spec, static_cast<int>(whole_h), static_cast<int>(whole_w), drawn.box) > 1)
    return 0;
  FUZZ_CHECK(std::memcmp(want.pixels.raw(), fused.pixels.raw(), want.pixels.nbytes()) == 0);
  return 0;
}
