// Fuzz target: the geometry ops on arbitrary images and sizes: image::resize (antialiased and
// plain) of any box, resize_flipped, hflip, center_crop, RandomResizedCrop and draw_augment. The input's last
// bytes (FuzzedDataProvider) give the image's height and width (0..40) and channels (mostly 1..4,
// up to 15), the output size (1..96, or any int32 through validate_size, the documented gate
// of the ops' sizes), the box (empty, inside, near the edges, or any int32), the flags, and an
// augmentation spec; its first bytes are the pixels. One mode makes a tensor of zero channels
// whose height and width are any int64 (no memory: what a Python array of shape (H, W, 0) is),
// another a tensor of the wrong dtype or rank.
//
// Checks beyond "no sanitizer report": resize succeeds exactly when the box lies in the image
// and the size is at least 1 (otherwise a splitflow::Error), with the asked shape; resizing the
// whole image to its own size gives it back, antialiased or not; resize_flipped equals hflip of
// resize; RandomResizedCrop gives size x size; draw_augment's box lies in the image.
#include <fuzzer/FuzzedDataProvider.h>

#include <climits>
#include <cstring>

#include "fuzz_common.hpp"
#include "splitflow/ops/image.hpp"

using namespace splitflow;

namespace {
bool same(const HostTensor& a, const HostTensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const std::uint8_t mode = in.ConsumeIntegral<std::uint8_t>();
  const bool antialias = mode & 1, flip = mode & 2, raw_size = mode & 4;
  const int box_kind = (mode >> 3) & 3;
  const int tensor_kind = mode >> 5;  // 0..7: 6 zero channels, 7 a wrong tensor, else an image

  // The image.
  HostTensor img;
  std::int64_t H = 0, W = 0, C = 0;
  if (tensor_kind == 6) {
    H = in.ConsumeIntegralInRange<std::int64_t>(0, std::int64_t{1} << 40);
    W = in.ConsumeIntegralInRange<std::int64_t>(0, std::int64_t{1} << 40);
    img = HostTensor::empty(DType::u8, {H, W, 0});
  } else if (tensor_kind == 7) {
    const std::uint8_t k = in.ConsumeIntegral<std::uint8_t>();
    img = k % 3 == 0 ? HostTensor::empty(DType::u16, {4, 4, 3})
          : k % 3 == 1 ? HostTensor::empty(DType::u8, {4, 12})
                       : HostTensor::empty(DType::u8, {1, 4, 4, 3});
    std::memset(img.raw(), 0, img.nbytes());
  } else {
    H = in.ConsumeIntegralInRange(0, 40);
    W = in.ConsumeIntegralInRange(0, 40);
    const std::uint8_t c = in.ConsumeIntegral<std::uint8_t>();
    C = c < 240 ? c % 4 + 1 : c - 240;
    img = HostTensor::empty(DType::u8, {H, W, C});
  }
  // What the image ops take: u8 HWC, at least one channel, sides that fit an int.
  const bool hwc = img.dtype() == DType::u8 && img.ndim() == 3 && img.dim(0) <= INT_MAX &&
                   img.dim(1) <= INT_MAX && img.dim(2) >= 1;
  if (img.ndim() == 3) C = img.dim(2);

  // The output size.
  int oh, ow;
  if (raw_size) {
    oh = in.ConsumeIntegral<std::int32_t>();
    ow = in.ConsumeIntegral<std::int32_t>();
  } else {
    oh = in.ConsumeIntegralInRange(1, 96);
    ow = in.ConsumeIntegralInRange(1, 96);
  }
  bool size_ok = true;
  try {
    image::validate_size(oh, ow, "fuzz");
  } catch (const Error&) {
    size_ok = false;
  }
  FUZZ_CHECK(size_ok == (oh >= 1 && ow >= 1 && oh <= image::kMaxOutputSide && ow <= image::kMaxOutputSide));

  // The box.
  image::Box box{};
  if (box_kind == 1 && H >= 1 && W >= 1 && H <= INT_MAX && W <= INT_MAX) {
    const int y = in.ConsumeIntegralInRange<int>(0, static_cast<int>(H) - 1);
    const int x = in.ConsumeIntegralInRange<int>(0, static_cast<int>(W) - 1);
    box = {y, x, in.ConsumeIntegralInRange<int>(1, static_cast<int>(H) - y),
           in.ConsumeIntegralInRange<int>(1, static_cast<int>(W) - x)};
  } else if (box_kind == 2) {
    box = {in.ConsumeIntegralInRange(-2, 42), in.ConsumeIntegralInRange(-2, 42),
           in.ConsumeIntegralInRange(-2, 42), in.ConsumeIntegralInRange(-2, 42)};
  } else if (box_kind == 3) {
    box = {in.ConsumeIntegral<int>(), in.ConsumeIntegral<int>(), in.ConsumeIntegral<int>(),
           in.ConsumeIntegral<int>()};
  }

  // The augmentation.
  image::AugmentSpec spec;
  spec.size = in.ConsumeIntegralInRange(1, 32);
  spec.scale_min = in.ConsumeFloatingPointInRange(1e-6, 2.0);
  spec.scale_max = in.ConsumeFloatingPointInRange(spec.scale_min, 1e3);
  spec.ratio_min = in.ConsumeFloatingPointInRange(1e-6, 10.0);
  spec.ratio_max = in.ConsumeFloatingPointInRange(spec.ratio_min, 1e6);
  spec.flip_probability = in.ConsumeProbability<double>();
  spec.seed = in.ConsumeIntegral<std::uint8_t>();
  // A width of its own (torchvision's size=(h, w)) for odd seeds, taken from the seed so that the
  // input's later bytes (and the regression inputs) keep their meaning.
  spec.width = spec.seed & 1 ? 1 + (spec.seed >> 1) % 32 : 0;
  spec.antialias = antialias;
  const std::uint64_t index = in.ConsumeIntegral<std::uint16_t>();
  const int aug_h = in.ConsumeIntegralInRange(1, INT_MAX), aug_w = in.ConsumeIntegralInRange(1, INT_MAX);
  image::validate(spec, "fuzz");

  // The pixels: the rest of the input, then zeros.
  if (tensor_kind < 6) {
    const std::vector<std::uint8_t> px = in.ConsumeRemainingBytes<std::uint8_t>();
    std::memset(img.raw(), 0, img.nbytes());
    if (!px.empty() && img.nbytes()) std::memcpy(img.raw(), px.data(), std::min(px.size(), img.nbytes()));
  }

  // draw_augment on any size: the box lies in the image.
  const image::Augment a = image::draw_augment(aug_h, aug_w, index, spec);
  FUZZ_CHECK(a.box.y >= 0 && a.box.x >= 0 && a.box.h >= 0 && a.box.w >= 0);
  FUZZ_CHECK(static_cast<std::int64_t>(a.box.y) + a.box.h <= aug_h);
  FUZZ_CHECK(static_cast<std::int64_t>(a.box.x) + a.box.w <= aug_w);

  // Keep a run quick: a large output (valid, but slow under the sanitizers) is not resized.
  if (!size_ok || static_cast<std::int64_t>(oh) * ow * std::max<std::int64_t>(C, 1) > (1 << 16)) return 0;

  // center_crop: any HWC u8 image to any valid size; its own size is itself, and a crop
  // larger by an even margin (padded by half of it each side) cropped back is the image.
  if (hwc) {
    const HostTensor cc = image::center_crop(img, oh, ow);
    FUZZ_CHECK((cc.shape() == std::vector<std::int64_t>{oh, ow, C}));
    if (oh == H && ow == W) FUZZ_CHECK(same(cc, img));
    if (H >= 1 && W >= 1 && oh >= H && ow >= W && (oh - H) % 2 == 0 && (ow - W) % 2 == 0)
      FUZZ_CHECK(same(image::center_crop(cc, static_cast<int>(H), static_cast<int>(W)), img));
  }

  // resize: succeeds exactly when the tensor is an HWC u8 image and the box lies in it.
  const bool empty = box.h == 0 && box.w == 0;
  const image::Box whole = empty && H <= INT_MAX && W <= INT_MAX
                               ? image::Box{0, 0, static_cast<int>(H), static_cast<int>(W)}
                               : box;
  const bool box_ok = whole.h >= 1 && whole.w >= 1 && whole.y >= 0 && whole.x >= 0 &&
                      static_cast<std::int64_t>(whole.y) + whole.h <= H &&
                      static_cast<std::int64_t>(whole.x) + whole.w <= W;
  HostTensor out;
  bool ok = true;
  try {
    out = image::resize(img, oh, ow, box, antialias);
  } catch (const Error& e) {
    ok = false;
    if (fuzz::verbose()) std::fprintf(stderr, "resize error: %s\n", e.what());
  }
  if (ok != (hwc && box_ok)) {
    std::fprintf(stderr, "fuzz check failed: resize of %s, box (y %d, x %d, h %d, w %d) to %dx%d %s\n",
                 img.describe().c_str(), box.y, box.x, box.h, box.w, oh, ow,
                 ok ? "succeeded" : "failed");
    std::abort();
  }
  if (!ok) return 0;
  FUZZ_CHECK((out.shape() == std::vector<std::int64_t>{oh, ow, C}));
  if (whole.y == 0 && whole.x == 0 && whole.h == H && whole.w == W) {
    if (oh == H && ow == W) FUZZ_CHECK(same(out, img));  // its own size: itself
    if (empty) {
      const HostTensor flipped = image::resize_flipped(img, oh, ow, flip, antialias);
      FUZZ_CHECK(same(flipped, flip ? image::hflip(out) : out));
    }
  }

  // RandomResizedCrop: size x size, or size x width (or an Error for a degenerate crop of an extreme ratio).
  try {
    const image::Image r = image::RandomResizedCrop(spec)({index, "x.jpg", img});
    FUZZ_CHECK((r.pixels.shape() ==
                std::vector<std::int64_t>{spec.size, spec.width ? spec.width : spec.size, C}));
  } catch (const Error& e) {
    if (fuzz::verbose()) std::fprintf(stderr, "crop error: %s\n", e.what());
  }
  return 0;
}
