// Fuzz target: image::decode_jpeg (libjpeg-turbo's TurboJPEG API) on arbitrary bytes, the way
// image::decode sees a file read from disk. The input is the whole file; its length's parity
// picks the colour (odd: gray), so mutations reach both conversions.
//
// Checks beyond "no sanitizer report": a decoded image has the header's size and the asked
// channels, within kMaxDecodePixels; an error is a splitflow::Error naming the file; the heap
// a decode allocates stays under fuzz::kDecodeHeapBound whatever the header claims; and after
// any error a good file still decodes. The same bytes go through image::jpeg_info (the frame
// header BatchDecode routes by): it throws only splitflow::Error naming the file, and where the
// decode succeeded it read a frame of the decoded size.
#include <turbojpeg.h>

#include <vector>

#include "fuzz_common.hpp"
#include "fuzz_jpeg.hpp"
#include "splitflow/ops/decode.hpp"
#include "splitflow/ops/image.hpp"

using namespace splitflow;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::heap::install();
  const image::Color color = size % 2 ? image::Color::gray : image::Color::rgb;
  const std::int64_t base = fuzz::heap::reset();
  bool failed = false;
  bool header = false;
  image::JpegInfo info;
  try {
    info = image::jpeg_info(data, size, fuzz::kName);
    header = true;
  } catch (const Error& e) {
    fuzz::check_names(e);
  }
  try {
    const HostTensor px = image::decode_jpeg(data, size, color, fuzz::kName);
    fuzz::check_decoded(px, data, size, color);
    if (!header || info.height != px.dim(0) || info.width != px.dim(1)) {
      std::fprintf(stderr, "jpeg_info disagrees with the decode: %s for %s\n",
                   header ? image::describe(info).c_str() : "no header", px.describe().c_str());
      std::abort();
    }
  } catch (const Error& e) {
    fuzz::check_names(e);
    failed = true;
    if (fuzz::verbose()) std::fprintf(stderr, "error: %s\n", e.what());
  }
  fuzz::check_heap(fuzz::heap::peak_since(base), data, size);
  if (failed) fuzz::check_good_decodes();
  return 0;
}
