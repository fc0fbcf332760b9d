// The JPEG marker and frame-header readers and the routing rule of splitflow/ops/decode.hpp: no
// device code, so that the fuzz targets build it alone (tests/fuzz/Makefile).
#include <fmt/format.h>

#include <cstring>
#include <utility>

#include "splitflow/core/error.hpp"
#include "splitflow/ops/decode.hpp"
#include "splitflow/ops/image.hpp"

namespace splitflow::image {

// ---- markers ----------------------------------------------------------------------------------

namespace {

// The code of the next marker at or after `p` in `data[0, size)`: skips the bytes before its
// 0xFF (entropy-coded data or padding) and any fill bytes 0xFF, and leaves `p` just after the
// code. -1 where the data ends first (`p` is then `size`).
int next_marker(const std::uint8_t* data, std::size_t size, std::size_t& p) noexcept {
  const void* ff = p < size ? std::memchr(data + p, 0xFF, size - p) : nullptr;
  if (ff == nullptr) {
    p = size;
    return -1;
  }
  p = static_cast<std::size_t>(static_cast<const std::uint8_t*>(ff) - data);
  while (p < size && data[p] == 0xFF) ++p;
  if (p >= size) return -1;
  return data[p++];
}

}  // namespace

bool internal::jpeg_rest_reaches_the_end_marker(const std::uint8_t* data, std::size_t size) noexcept {
  for (std::size_t p = 0;;) {
    const int m = next_marker(data, size, p);
    if (m == 0x00 || (m >= 0xD0 && m <= 0xD7)) continue;  // stuffed, RSTn
    return m == 0xD9;                                      // -1 (no end marker) or another
  }
}

// ---- the frame header -----------------------------------------------------------------------

JpegInfo jpeg_info(const std::uint8_t* data, std::size_t size, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Error(fmt::format("splitflow: {}: not a readable JPEG header: {}", what, why));
  };
  if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) throw bad("no start-of-image marker");
  std::size_t p = 2;
  for (;;) {
    const int m = next_marker(data, size, p);
    if (m < 0) throw bad(fmt::format("it ends after {} bytes, before a frame header", size));
    if (m == 0x00) continue;  // a stuffed 0xFF 0x00 between segments: libjpeg skips it too
    if (m == 0x01 || (m >= 0xD0 && m <= 0xD7)) continue;  // no length
    if (m == 0xD9) throw bad("end-of-image before a frame header");
    if (m == 0xDA) throw bad("a scan before a frame header");
    if (p + 2 > size) throw bad(fmt::format("marker 0xFF{:02X} is cut off at byte {}", m, p));
    const std::size_t len = (std::size_t{data[p]} << 8) | data[p + 1];
    // An application or comment segment claiming under 2 bytes: libjpeg (and so the decoders
    // and PIL) reads it as empty and goes on after its length field; so does this reader.
    if (len < 2 && ((m >= 0xE0 && m <= 0xEF) || m == 0xFE)) {
      p += 2;
      continue;
    }
    if (len < 2)
      throw bad(fmt::format("marker 0xFF{:02X} at byte {} claims a length of {} (the length "
                            "field alone is 2)", m, p - 2, len));
    if (p + len > size)
      throw bad(fmt::format("marker 0xFF{:02X} at byte {} claims {} bytes, past the end ({})", m,
                            p - 2, len, size));
    const bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
    if (!sof) {
      p += len;
      continue;
    }
    const std::uint8_t* s = data + p + 2;
    if (len < 8) throw bad(fmt::format("a frame header of {} bytes", len));
    JpegInfo info;
    info.precision = s[0];
    info.height = (s[1] << 8) | s[2];
    info.width = (s[3] << 8) | s[4];
    info.components = s[5];
    if (len < 8 + 3 * static_cast<std::size_t>(info.components))
      throw bad(fmt::format("a frame header of {} bytes for {} components", len, info.components));
    if (info.width == 0 || info.height == 0)
      throw bad(fmt::format("a frame of {}x{} (a height set later by DNL is not supported)",
                            info.width, info.height));
    using C = JpegInfo::Coding;
    switch (m) {
      case 0xC0: info.coding = C::baseline; break;
      case 0xC1: info.coding = C::extended; break;
      case 0xC2: info.coding = C::progressive; break;
      case 0xC3: info.coding = C::lossless; break;
      case 0xC5: case 0xC6: case 0xC7: info.coding = C::hierarchical; break;
      default: info.coding = C::arithmetic; break;  // 0xC9-0xCB, 0xCD-0xCF
    }
    using S = JpegInfo::Subsampling;
    const auto hv = [&](int c) { return std::pair<int, int>{s[6 + 3 * c + 1] >> 4, s[6 + 3 * c + 1] & 15}; };
    if (info.components == 1) {
      info.subsampling = S::gray;
    } else if (info.components == 3 && hv(1) == std::pair{1, 1} && hv(2) == std::pair{1, 1}) {
      const auto [h, v] = hv(0);
      info.subsampling = h == 1 && v == 1   ? S::s444
                         : h == 2 && v == 1 ? S::s422
                         : h == 2 && v == 2 ? S::s420
                         : h == 1 && v == 2 ? S::s440
                         : h == 4 && v == 1 ? S::s411
                                            : S::other;
    } else {
      info.subsampling = S::other;
    }
    return info;
  }
}

std::string describe(const JpegInfo& i) {
  static constexpr const char* coding[] = {"baseline", "extended", "progressive",
                                           "lossless", "arithmetic", "hierarchical"};
  static constexpr const char* samp[] = {"gray", "4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1",
                                         "other sampling"};
  return fmt::format("{} {}-bit {} {} components {}x{}", coding[static_cast<int>(i.coding)],
                     i.precision, samp[static_cast<int>(i.subsampling)], i.components, i.width,
                     i.height);
}

const char* to_string(DecodePlacement p) noexcept {
  switch (p) {
    case DecodePlacement::cpu: return "cpu";
    case DecodePlacement::hybrid: return "hybrid";
    case DecodePlacement::hardware: return "hardware";
    case DecodePlacement::by_load: return "by_load";
  }
  return "?";
}

const char* unsupported_reason(DecodePlacement p, const JpegInfo& info) noexcept {
  using C = JpegInfo::Coding;
  using S = JpegInfo::Subsampling;
  if (p == DecodePlacement::cpu) return nullptr;
  if (info.precision != 8) return "not 8-bit";
  if (info.components == 4) return "4 components (CMYK or YCCK)";
  if (info.components != 1 && info.components != 3) return "neither 1 nor 3 components";
  if (info.subsampling == S::s411) return "4:1:1 subsampling";
  if (info.subsampling == S::other) return "an unusual subsampling";
  switch (info.coding) {
    case C::baseline:
    case C::extended: return nullptr;
    case C::progressive: return p == DecodePlacement::hardware ? "progressive" : nullptr;
    case C::lossless: return "lossless";
    case C::arithmetic: return "arithmetic-coded";
    case C::hierarchical: return "hierarchical";
  }
  return "unknown coding";
}

}  // namespace splitflow::image
