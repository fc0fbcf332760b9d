// What the JPEG fuzz targets share: the header as libjpeg-turbo reads it, the decoders' heap
// bound, and a known-good JPEG to decode after an error.
#pragma once

#include <turbojpeg.h>

#include <csetjmp>
#include <cstdio>  // before jpeglib.h
#include <jpeglib.h>

#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "splitflow/ops/image.hpp"

namespace fuzz {

struct Header {
  bool ok = false;
  int width = 0, height = 0;
};

namespace detail {
struct Errors {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
};
extern "C" inline void header_error_exit(j_common_ptr c) {
  std::longjmp(reinterpret_cast<Errors*>(c->err)->jump, 1);
}
extern "C" inline void header_message(j_common_ptr, int) {}
}  // namespace detail

/// The frame size as libjpeg reads it (its own decompressor, so every subsampling libjpeg
/// knows; TurboJPEG 2.1's header call refuses some).
inline Header read_header(const std::uint8_t* data, std::size_t size) {
  Header h;
  if (size == 0) return h;
  jpeg_decompress_struct c{};
  detail::Errors e{};
  c.err = jpeg_std_error(&e.mgr);
  e.mgr.error_exit = detail::header_error_exit;
  e.mgr.emit_message = detail::header_message;
  jpeg_create_decompress(&c);
  if (setjmp(e.jump) == 0) {
    jpeg_mem_src(&c, data, static_cast<unsigned long>(size));
    if (jpeg_read_header(&c, TRUE) == JPEG_HEADER_OK) {
      h.width = static_cast<int>(c.image_width);
      h.height = static_cast<int>(c.image_height);
      h.ok = h.width > 0 && h.height > 0;
    }
  }
  jpeg_destroy_decompress(&c);
  return h;
}

/// The most heap one decode may take (output, libjpeg's buffers, everything), whatever the
/// header claims: the pixel limit's RGB output (768 MiB), as much again for a progressive
/// file's coefficient buffer (image.hpp, kMaxDecodePixels), and 256 MiB for the rest. A header
/// claiming more is refused before any of it is allocated.
inline constexpr std::int64_t kDecodeHeapBound =
    splitflow::image::kMaxDecodePixels * 3 * 2 + (std::int64_t{256} << 20);

inline void check_heap(std::int64_t peak, const std::uint8_t* data, std::size_t size) {
  if (!verbose() && peak <= kDecodeHeapBound) return;
  const Header h = read_header(data, size);
  std::fprintf(stderr, "heap: %lld bytes at most (header %dx%d, %s)\n", static_cast<long long>(peak),
               h.width, h.height, h.ok ? "readable" : "unreadable");
  if (peak > kDecodeHeapBound) {
    std::fprintf(stderr, "fuzz check failed: a decode took %lld bytes of heap (bound %lld)\n",
                 static_cast<long long>(peak), static_cast<long long>(kDecodeHeapBound));
    std::abort();
  }
}

/// A decoded image: the header's size, the asked channels, within the limit.
inline void check_decoded(const splitflow::HostTensor& px, const std::uint8_t* data,
                          std::size_t size, splitflow::image::Color color) {
  const Header h = read_header(data, size);
  FUZZ_CHECK(h.ok);
  FUZZ_CHECK(px.dtype() == splitflow::DType::u8 && px.ndim() == 3 && px.contiguous());
  FUZZ_CHECK(px.dim(0) == h.height && px.dim(1) == h.width);
  FUZZ_CHECK(px.dim(2) == (color == splitflow::image::Color::rgb ? 3 : 1));
  FUZZ_CHECK(px.dim(0) * px.dim(1) <= splitflow::image::kMaxDecodePixels);
}

/// A 20 x 12 4:2:0 JPEG, made once with TurboJPEG.
inline const std::vector<std::uint8_t>& good_jpeg() {
  static const std::vector<std::uint8_t> jpeg = [] {
    std::vector<unsigned char> rgb(20 * 12 * 3);
    for (std::size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<unsigned char>(i * 7);
    tjhandle tj = tjInitCompress();
    unsigned char* out = nullptr;
    unsigned long n = 0;
    if (tjCompress2(tj, rgb.data(), 20, 0, 12, TJPF_RGB, &out, &n, TJSAMP_420, 90, 0) != 0)
      fail("tjCompress2 of the good JPEG", __FILE__, __LINE__);
    std::vector<std::uint8_t> v(out, out + n);
    tjFree(out);
    tjDestroy(tj);
    return v;
  }();
  return jpeg;
}

/// After bad data, this thread's decoders still decode a good file.
inline void check_good_decodes() {
  const auto& g = good_jpeg();
  const splitflow::HostTensor px = splitflow::image::decode_jpeg(g.data(), g.size(),
                                                                 splitflow::image::Color::rgb, "good.jpg");
  FUZZ_CHECK(px.dim(0) == 12 && px.dim(1) == 20 && px.dim(2) == 3);
}

}  // namespace fuzz
