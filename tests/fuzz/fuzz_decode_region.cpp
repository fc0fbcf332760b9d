// Fuzz target: image::decode_jpeg_region (libjpeg's API: row skipping, column cropping) on
// arbitrary bytes and boxes. The input is the file, then 17 bytes: the box's y, x, h, w (int32,
// little-endian) and a mode byte: bit 0 gray; bit 1 the box as given (any int32, so boxes
// outside the image and sums that overflow an int); bit 2 an empty box (the whole image);
// otherwise the box is the four numbers' low 16 bits read as fractions of the header's size,
// so that it lies inside the image.
//
// Checks beyond "no sanitizer report": the region has the box's size; it equals that box of
// decode_jpeg's output whenever the whole file decodes (the documented contract), and a file
// that decodes whole decodes in any box inside it; the header's size comes back; errors name
// the file; the heap stays under fuzz::kDecodeHeapBound; the decoders work after an error.
#include <cstring>

#include "fuzz_common.hpp"
#include "fuzz_jpeg.hpp"
#include "splitflow/ops/image.hpp"

using namespace splitflow;

namespace {
constexpr std::size_t kTail = 17;

std::int32_t i32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return static_cast<std::int32_t>(v);
}
int fraction(std::int32_t v, int n) {  // [0, n)
  return static_cast<int>((static_cast<std::int64_t>(static_cast<std::uint16_t>(v)) * n) >> 16);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::heap::install();
  std::uint8_t tail[kTail] = {};
  const std::size_t n = size >= kTail ? size - kTail : 0;
  std::memcpy(tail, data + n, size - n);
  const std::uint8_t mode = tail[16];
  const image::Color color = mode & 1 ? image::Color::gray : image::Color::rgb;
  const int C = color == image::Color::rgb ? 3 : 1;
  const fuzz::Header hdr = fuzz::read_header(data, n);
  image::Box box{i32(tail), i32(tail + 4), i32(tail + 8), i32(tail + 12)};
  if (mode & 4) {
    box = {};
  } else if (!(mode & 2) && hdr.ok) {
    const int y = fraction(box.y, hdr.height), x = fraction(box.x, hdr.width);
    box = {y, x, 1 + fraction(box.h, hdr.height - y), 1 + fraction(box.w, hdr.width - x)};
  }
  const bool empty = box.h == 0 && box.w == 0;

  const std::int64_t base = fuzz::heap::reset();
  int H = -1, W = -1;
  HostTensor region;
  bool failed = false;
  try {
    region = image::decode_jpeg_region(data, n, box, color, fuzz::kName, &H, &W);
  } catch (const Error& e) {
    fuzz::check_names(e);
    failed = true;
    if (fuzz::verbose()) std::fprintf(stderr, "region error: %s\n", e.what());
  }
  fuzz::check_heap(fuzz::heap::peak_since(base), data, n);
  if (failed) {
    fuzz::check_good_decodes();
  } else {
    FUZZ_CHECK(hdr.ok && H == hdr.height && W == hdr.width);
    if (empty) box = {0, 0, H, W};
    FUZZ_CHECK(region.ndim() == 3 && region.dim(0) == box.h && region.dim(1) == box.w && region.dim(2) == C);
  }

  // The contract: the same pixels as that box of the whole decode.
  HostTensor full;
  try {
    full = image::decode_jpeg(data, n, color, fuzz::kName);
  } catch (const Error& e) {
    fuzz::check_names(e);
    if (!failed) {
      // A file refused whole is refused in every box (a region decode that stops after its
      // rows must still find a file cut short).
      std::fprintf(stderr, "fuzz check failed: box (y %d, x %d, h %d, w %d) decodes but the whole "
                   "file is refused: %s\n", box.y, box.x, box.h, box.w, e.what());
      std::abort();
    }
    return 0;
  }
  const bool inside = box.h >= 1 && box.w >= 1 && box.y >= 0 && box.x >= 0 &&
                      static_cast<std::int64_t>(box.y) + box.h <= full.dim(0) &&
                      static_cast<std::int64_t>(box.x) + box.w <= full.dim(1);
  if (failed) {
    if (inside || empty) {
      std::fprintf(stderr, "fuzz check failed: the file decodes whole but not in box (y %d, x %d, "
                   "h %d, w %d)\n", box.y, box.x, box.h, box.w);
      std::abort();
    }
    return 0;
  }
  const auto* r = static_cast<const std::uint8_t*>(region.raw());
  const auto* f = static_cast<const std::uint8_t*>(full.raw());
  const std::size_t fw = static_cast<std::size_t>(full.dim(1)) * C, rw = static_cast<std::size_t>(box.w) * C;
  for (int y = 0; y < box.h; ++y) {
    const std::uint8_t* want = f + static_cast<std::size_t>(box.y + y) * fw + static_cast<std::size_t>(box.x) * C;
    if (std::memcmp(r + static_cast<std::size_t>(y) * rw, want, rw) != 0) {
      std::fprintf(stderr, "fuzz check failed: region row %d of box (y %d, x %d, h %d, w %d) of a "
                   "%lldx%lld image differs from the whole decode\n", y, box.y, box.x, box.h, box.w,
                   static_cast<long long>(full.dim(0)), static_cast<long long>(full.dim(1)));
      std::abort();
    }
  }
  return 0;
}
