// Image input ops (splitflow/ops/image.hpp).
#include "splitflow/ops/image.hpp"

#include <fmt/format.h>
#include <glob.h>
#include <sys/stat.h>
#include <turbojpeg.h>

#include <csetjmp>
#include <cstdio>  // before jpeglib.h, which uses FILE
#include <jpeglib.h>
#include <jerror.h>  // JWRN_JPEG_EOF

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <array>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <vector>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <system_error>
#include <tuple>

#include "splitflow/core/detail/splitmix.hpp"
#include "splitflow/core/error.hpp"

namespace splitflow::image {

namespace fs = std::filesystem;

namespace {

using Rng = splitflow::detail::SplitMix64;  // shuffles and crops: the same everywhere

std::uint64_t mix(std::uint64_t a, std::uint64_t b) noexcept {
  Rng r(a ^ (b * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL));
  return r.next();
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

void check_hwc(const HostTensor& t, const char* op) {
  // Sides past an int and zero channels are refused too (image ops index with int; an
  // (H, W, 0) tensor holds no bytes whatever H and W claim).
  if (t.dtype() != DType::u8 || t.ndim() != 3 || !t.contiguous() || t.dim(0) > INT_MAX ||
      t.dim(1) > INT_MAX || t.dim(2) > INT_MAX || t.dim(2) < 1)
    throw Error(fmt::format("splitflow::image::{}: takes a contiguous u8 HWC image, got {}", op,
                            t.describe()));
}

struct TjHandle {
  tjhandle h;
  TjHandle() : h(tjInitDecompress()) {
    if (!h) throw Error(std::string("splitflow::image: tjInitDecompress failed: ") + tjGetErrorStr());
  }
  ~TjHandle() { tjDestroy(h); }
  TjHandle(const TjHandle&) = delete;
  TjHandle& operator=(const TjHandle&) = delete;
};

// A decompressor per decode, not one per thread: a reused one keeps the tables of the files it
// decoded, so a file that lacks its own (no DQT: an error on a fresh one) decoded with the
// previous file's and its pixels depended on what the thread decoded before (found by
// tests/fuzz/fuzz_decode_region.cpp). Creating one costs under a microsecond.
[[noreturn]] void decode_failed(std::string message) {
  throw Error(std::move(message));
}

// The output width of a random-resized crop: its own, or its size (a square).
int out_width(const AugmentSpec& s) noexcept { return s.width > 0 ? s.width : s.size; }

// "splitflow::image::<fn>: '<file>'", or without the file where the bytes have no name (an
// array from Python: the stage's error names the item).
std::string about(const char* fn, const std::string& what) {
  return what.empty() ? fmt::format("splitflow::image::{}", fn)
                      : fmt::format("splitflow::image::{}: '{}'", fn, what);
}

// The fix for a file the decoders refuse, said with each such error.
constexpr const char* kSkipIt = "on_error skip or substitute on its stage (Python: on_error='skip', "
                                "substitute=) drops or replaces such a file and the run goes on";

// Bytes that are no JPEG: what they are where their signature says (a PNG named .jpg, which PIL
// decodes), and the fix (a new user's trial: the run failed on a corrupt file, and the message
// did not say that on_error lets it go on).
std::string not_a_jpeg(const char* op, const std::string& what, const std::string& why,
                       const std::uint8_t* data, std::size_t size) {
  const auto starts = [&](std::string_view sig) {
    return size >= sig.size() && std::memcmp(data, sig.data(), sig.size()) == 0;
  };
  const char* kind = starts("\x89PNG\r\n\x1a\n")                            ? "a PNG"
                     : starts("GIF87a") || starts("GIF89a")                    ? "a GIF"
                     : starts("BM")                                            ? "a BMP"
                     : size >= 12 && starts("RIFF") && std::memcmp(data + 8, "WEBP", 4) == 0 ? "a WebP"
                     : starts(std::string_view("II*\0", 4)) || starts(std::string_view("MM\0*", 4)) ? "a TIFF"
                                                                               : nullptr;
  return fmt::format("{}: not a readable JPEG ({}){}; {}", about(op, what), why,
                     kind ? fmt::format(": the bytes are {} image, which {} does not "
                                        "read (decode it in a stage of your own, PIL's, or "
                                        "convert it to JPEG)",
                                        kind, op)
                          : std::string(),
                     kSkipIt);
}

// A JPEG whose data is cut short or corrupt (a truncated file, the commonest bad file of a
// real data set): the decoder's words, its size, and the same fix as for bytes that are no
// JPEG (a new user's trial: only those said it).
std::string corrupt_jpeg(const char* op, const std::string& what, const std::string& why, int width,
                         int height) {
  return fmt::format("{}: {} ({}x{}); {}", about(op, what), why, width, height, kSkipIt);
}

}  // namespace

// ---- file lists ------------------------------------------------------------------------------

FileList FileList::directory(const std::string& dir, const std::vector<std::string>& extensions) {
  std::vector<std::string> exts;
  for (const auto& e : extensions) exts.push_back(lower(e));
  // torchvision's order (ImageFolder's make_dataset): the class folders (the directory's
  // subfolders) sorted by name, and within each sorted(os.walk(class folder)), each folder's
  // files sorted: by folder path, then by name, so that a folder's own files come before its
  // subfolders' ("cat/x.jpg" before "cat/sub/y.jpg"; sorted whole paths put the subfolder
  // first). The class comes first in the key: sorted by folder path alone, "cat-2/z.jpg" came
  // between "cat/x.jpg" and "cat/sub/y.jpg" ('-' sorts before '/'), where ImageFolder walks all
  // of "cat" first (a new user's trial: C++ indices differed from Python's and torchvision's).
  // The directory's own files (ImageFolder has none: no class, "") come first.
  struct Keyed {
    std::string cls, folder, name, path;
  };
  std::vector<Keyed> keyed;
  std::string cls;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::follow_directory_symlink, ec);
  if (ec)
    throw Error(fmt::format("splitflow::image::FileList::directory: cannot read '{}': {}", dir,
                            ec.message()));
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec)
      throw Error(fmt::format("splitflow::image::FileList::directory: while reading '{}': {}", dir,
                              ec.message()));
    // (Depth first: what is below a folder of `dir` comes after it, before the next one.)
    if (it.depth() == 0) cls = it->is_directory(ec) ? it->path().filename().string() : std::string();
    if (!it->is_regular_file(ec)) continue;
    const std::string ext = lower(it->path().extension().string());
    if (exts.empty() || std::find(exts.begin(), exts.end(), ext) != exts.end()) {
      const fs::path& path = it->path();
      keyed.push_back({it.depth() == 0 ? std::string() : cls, path.parent_path().string(),
                       path.filename().string(), path.string()});
    }
  }
  std::sort(keyed.begin(), keyed.end(), [](const Keyed& a, const Keyed& b) {
    return std::tie(a.cls, a.folder, a.name) < std::tie(b.cls, b.folder, b.name);
  });
  std::vector<std::string> paths;
  paths.reserve(keyed.size());
  for (Keyed& k : keyed) paths.push_back(std::move(k.path));
  return FileList(std::move(paths));
}

FileList FileList::glob(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::unique_ptr<glob_t, void (*)(glob_t*)> free_g(&g, globfree);
  if (rc == GLOB_NOMATCH)
    throw Error(fmt::format("splitflow::image::FileList::glob: no file matches '{}'", pattern));
  if (rc != 0)
    throw Error(fmt::format("splitflow::image::FileList::glob: cannot expand '{}' (glob error {})",
                            pattern, rc));
  std::vector<std::string> paths(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  std::sort(paths.begin(), paths.end());
  return FileList(std::move(paths));
}

FileList FileList::list_file(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(fmt::format("splitflow::image::FileList::list_file: cannot open '{}': {}", path,
                            std::strerror(errno)));
  const fs::path base = fs::path(path).parent_path();
  std::vector<std::string> paths;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
    std::size_t start = 0;
    while (start < line.size() && std::isspace(static_cast<unsigned char>(line[start]))) ++start;
    line.erase(0, start);
    if (line.empty() || line[0] == '#') continue;
    const fs::path p(line);
    paths.push_back(p.is_absolute() ? line : (base / p).string());
  }
  return FileList(std::move(paths));
}

std::vector<std::uint64_t> FileList::epoch(const ShardSpec& spec) const {
  if (spec.world_size < 1 || spec.rank < 0 || spec.rank >= spec.world_size)
    throw Error(fmt::format("splitflow::image::FileList::epoch: rank {} is not in [0, world_size "
                            "{})",
                            spec.rank, spec.world_size));
  if (spec.num_workers < 1 || spec.worker < 0 || spec.worker >= spec.num_workers)
    throw Error(fmt::format("splitflow::image::FileList::epoch: worker {} is not in [0, "
                            "num_workers {})",
                            spec.worker, spec.num_workers));
  std::vector<std::uint64_t> all(paths_.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  if (spec.shuffle && all.size() > 1) {
    Rng rng(mix(spec.seed, spec.epoch));
    for (std::size_t i = all.size() - 1; i > 0; --i) std::swap(all[i], all[rng.below(i + 1)]);
  }
  std::vector<std::uint64_t> mine;
  const std::size_t ranks = static_cast<std::size_t>(spec.world_size);
  const std::size_t workers = static_cast<std::size_t>(spec.num_workers);
  std::size_t k = 0;  // position within this rank's shard
  for (std::size_t i = static_cast<std::size_t>(spec.rank); i < all.size(); i += ranks, ++k)
    if (k % workers == static_cast<std::size_t>(spec.worker)) mine.push_back(all[i]);
  return mine;
}

std::vector<FileRef> FileList::refs(const std::vector<std::uint64_t>& order) const {
  std::vector<FileRef> out;
  out.reserve(order.size());
  for (std::uint64_t i : order) {
    if (i >= paths_.size())
      throw Error(fmt::format("splitflow::image::FileList::refs: index {} is past the list's {} "
                              "files",
                              i, paths_.size()));
    out.push_back({i, paths_[i]});
  }
  return out;
}

// ---- reading and decoding ----------------------------------------------------------------------

Encoded read_file(FileRef file) {
  std::FILE* f = std::fopen(file.path.c_str(), "rb");
  if (!f) throw Error(fmt::format("splitflow::image::read_file: '{}': {}", file.path, std::strerror(errno)));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> close(f, std::fclose);
  struct stat st {};
  if (fstat(fileno(f), &st) != 0)
    throw Error(fmt::format("splitflow::image::read_file: '{}': {}", file.path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw Error(fmt::format("splitflow::image::read_file: '{}' is {}, not a file", file.path,
                            S_ISDIR(st.st_mode) ? "a directory" : "not a regular file"));
  if (st.st_size > kMaxFileBytes)
    throw Error(fmt::format("splitflow::image::read_file: '{}' is {} bytes, over the limit of {} "
                            "(splitflow::image::kMaxFileBytes)", file.path, st.st_size, kMaxFileBytes));
  if (std::fseek(f, 0, SEEK_END) != 0)
    throw Error(fmt::format("splitflow::image::read_file: '{}': cannot seek: {}", file.path, std::strerror(errno)));
  const long size = std::ftell(f);
  if (size < 0)
    throw Error(fmt::format("splitflow::image::read_file: '{}': cannot tell its size: {}", file.path, std::strerror(errno)));
  std::rewind(f);
  HostTensor bytes = HostTensor::empty(DType::u8, {size});
  if (size > 0 && std::fread(bytes.raw(), 1, static_cast<std::size_t>(size), f) != static_cast<std::size_t>(size))
    throw Error(fmt::format("splitflow::image::read_file: '{}': short read", file.path));
  return Encoded{file.index, std::move(file.path), std::move(bytes)};
}

namespace {
// A header's claimed size, checked before anything is allocated for it.
void check_pixels(const char* op, std::int64_t width, std::int64_t height, const std::string& what) {
  if (width * height > kMaxDecodePixels)
    throw Error(fmt::format("{}: its header claims {}x{} pixels, "
                            "over the decode limit of {} (splitflow::image::kMaxDecodePixels)",
                            about(op, what), width, height, kMaxDecodePixels));
}
// Progressive and multi-scan files decode through libjpeg's whole-image buffer of coefficients
// (2 bytes a sample), allocated before any scan is read: held to the output's budget too.
void check_coefficients(const std::uint8_t* data, std::size_t size, const std::string& what);
// decode_jpeg_region whose errors name `op`: decode_jpeg's fallbacks to libjpeg say decode_jpeg,
// the fused crop decode_random_resized_crop (a verification trial: its errors said decode_jpeg).
HostTensor region_as(const char* op, const std::uint8_t* data, std::size_t size, Box box, Color color,
                     const std::string& what, int* height = nullptr, int* width = nullptr);
constexpr const char* kDecodeJpeg = "decode_jpeg";
}  // namespace

namespace {
// Whether libjpeg reads the header; if not, *why is its message (the one the region decoder
// gives for the same bytes).
bool libjpeg_reads_the_header(const std::uint8_t* data, std::size_t size, std::string* why);
}  // namespace

const std::uint8_t* internal::encoded_bytes(const char* op, const Encoded& file) {
  if (file.bytes.dtype() != DType::u8)
    throw Error(fmt::format("{}: takes a file's bytes as contiguous u8, got {}: give them as uint8 "
                            "(Python: bytes, np.frombuffer(data, np.uint8) or torch.frombuffer(data, "
                            "dtype=torch.uint8))",
                            about(op, file.path), file.bytes.describe()));
  if (!file.bytes.contiguous())
    throw Error(fmt::format("{}: takes a file's bytes as contiguous u8, got a strided view {}: give "
                            "them in one piece (Python: bytes(...) or np.ascontiguousarray(...))",
                            about(op, file.path), file.bytes.describe()));
  return file.bytes.data<std::uint8_t>();
}

HostTensor decode_jpeg(const std::uint8_t* data, std::size_t size, Color color, const std::string& what) {
  TjHandle handle;
  tjhandle tj = handle.h;
  int width = 0, height = 0, subsamp = 0, colorspace = 0;
  if (size == 0 || tjDecompressHeader3(tj, data, static_cast<unsigned long>(size), &width, &height,
                                       &subsamp, &colorspace) != 0) {
    // TurboJPEG (2.x) refuses some headers that libjpeg, and so PIL, decodes (sampling factors
    // it has no name for: "Could not determine subsampling type"): the libjpeg decoder takes them.
    std::string why = size == 0 ? "empty" : tjGetErrorStr2(tj);
    if (size != 0 && libjpeg_reads_the_header(data, size, &why))
      return region_as(kDecodeJpeg, data, size, {}, color, what);
    // (libjpeg's words where it refused the header too: decode_random_resized_crop, which reads
    // it with libjpeg, says the same of the same bytes.)
    decode_failed(not_a_jpeg(kDecodeJpeg, what, why, data, size));
  }
  // A CMYK or YCCK file: TurboJPEG decodes it to CMYK only; the libjpeg decoder converts it as
  // PIL does (cmyk_to_rgb).
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK) return region_as(kDecodeJpeg, data, size, {}, color, what);
  // Data cut short before the frame header parses as "tables only": no image in it.
  if (width <= 0 || height <= 0)
    decode_failed(fmt::format("{}: no image in the data (truncated before the frame header?); {}",
                              about(kDecodeJpeg, what), kSkipIt));
  check_pixels(kDecodeJpeg, width, height, what);
  check_coefficients(data, size, what);
  const int channels = color == Color::rgb ? 3 : 1;
  HostTensor out = HostTensor::empty(DType::u8, {height, width, channels});
  const int rc = tjDecompress2(tj, data, static_cast<unsigned long>(size),
                               static_cast<unsigned char*>(out.raw()), width, 0, height,
                               color == Color::rgb ? TJPF_RGB : TJPF_GRAY, TJFLAG_STOPONWARNING);
  // At the first warning TurboJPEG stops (a forged size is not decoded to its end first), and
  // the libjpeg decoder below, which tells the warnings apart, decodes the file again: data
  // that ends early (a truncated file, which libjpeg would finish in grey) is an error, as PIL
  // says "image file is truncated"; other warnings (corrupt data, junk before the end marker)
  // are not, as PIL decodes those files, to the same pixels (the same libjpeg-turbo).
  if (rc != 0 && tjGetErrorCode(tj) == TJERR_WARNING) {
    out = HostTensor();  // its memory back before the second decode takes as much
    return region_as(kDecodeJpeg, data, size, {0, 0, height, width}, color, what);
  }
  if (rc != 0)
    decode_failed(corrupt_jpeg(kDecodeJpeg, what, tjGetErrorStr2(tj), width, height));
  return out;
}

// ---- region decode (libjpeg API: skip rows, crop columns) -----------------------------------------

namespace {

// libjpeg reports errors by calling error_exit, which must not return: it longjmps back to the
// frame that called setjmp. Those frames hold only trivially destructible locals.
struct JpegErrors {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

extern "C" void splitflow_jpeg_error_exit(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}
// A warning that the data ended early (a truncated file: libjpeg would fill the rest grey) is
// an error here, at once, as in decode_jpeg and in PIL ("image file is truncated"); the other
// warnings (corrupt data, junk before the end marker), which PIL decodes through, are not.
extern "C" void splitflow_jpeg_emit_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) splitflow_jpeg_error_exit(cinfo);
  ++cinfo->err->num_warnings;
}

struct JpegDecoder {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
  bool created = false;
  ~JpegDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

// A CMYK or YCCK JPEG (Adobe's; libjpeg converts YCCK to CMYK): decoded to CMYK, then
// converted as PIL converts it for torchvision's loaders (Image.open(f).convert("RGB"), or
// "L"): PIL takes every 4-component JPEG as Adobe writes it, its samples inverted, and Pillow's
// cmyk2rgb gives R = (255 - K) - C (255 - K) / 255 (its rounding), G and B alike from M and Y;
// gray is Pillow's rgb2l of that. In place: `out` may be `in` (channels <= 4, read first).
bool is_cmyk(const jpeg_decompress_struct& c) noexcept {
  return c.jpeg_color_space == JCS_CMYK || c.jpeg_color_space == JCS_YCCK;
}

void cmyk_to(const std::uint8_t* in, std::uint8_t* out, std::size_t pixels, int channels) noexcept {
  for (std::size_t i = 0; i < pixels; ++i, in += 4, out += channels) {
    const int nk = in[3];  // PIL's 255 - K, with K = 255 - the sample stored
    int rgb[3];
    for (int c = 0; c < 3; ++c) {
      const int t = (255 - in[c]) * nk + 128;  // Pillow's MULDIV255(C, 255 - K)
      rgb[c] = nk - (((t >> 8) + t) >> 8);
    }
    if (channels == 3) {
      out[0] = static_cast<std::uint8_t>(rgb[0]);
      out[1] = static_cast<std::uint8_t>(rgb[1]);
      out[2] = static_cast<std::uint8_t>(rgb[2]);
    } else {
      out[0] = static_cast<std::uint8_t>((rgb[0] * 19595 + rgb[1] * 38470 + rgb[2] * 7471 + 0x8000) >> 16);
    }
  }
}

// Reads the header; false with d.errors.message set on an error.
bool read_header(JpegDecoder& d, const std::uint8_t* data, std::size_t size, bool gray) {
  d.cinfo.err = jpeg_std_error(&d.errors.mgr);
  d.errors.mgr.error_exit = splitflow_jpeg_error_exit;
  d.errors.mgr.emit_message = splitflow_jpeg_emit_message;
  if (setjmp(d.errors.jump)) return false;
  jpeg_create_decompress(&d.cinfo);
  d.created = true;
  jpeg_mem_src(&d.cinfo, data, static_cast<unsigned long>(size));
  if (jpeg_read_header(&d.cinfo, TRUE) != JPEG_HEADER_OK) {
    std::snprintf(d.errors.message, sizeof d.errors.message, "no image in the data");
    return false;
  }
  // (libjpeg converts a CMYK or YCCK file to CMYK only: cmyk_to does the rest.)
  d.cinfo.out_color_space = is_cmyk(d.cinfo) ? JCS_CMYK : gray ? JCS_GRAYSCALE : JCS_RGB;
  return true;
}

// After read_header: the coefficient buffer a progressive or multi-scan file needs (jdcoefct.c's
// whole_image arrays), refused over kMaxDecodePixels * 3 bytes before it is allocated.
void check_coefficient_buffer(const char* op, JpegDecoder& d, const std::string& what) {
  if (!jpeg_has_multiple_scans(&d.cinfo)) return;
  const auto up = [](std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; };
  std::int64_t bytes = 0;
  for (int i = 0; i < d.cinfo.num_components; ++i) {
    const jpeg_component_info& c = d.cinfo.comp_info[i];
    bytes += up(c.width_in_blocks, c.h_samp_factor) * up(c.height_in_blocks, c.v_samp_factor) *
             DCTSIZE2 * static_cast<std::int64_t>(sizeof(JCOEF));
  }
  if (bytes > kMaxDecodePixels * 3)
    throw Error(fmt::format("{}: a {}x{} progressive or multi-scan "
                            "JPEG needs {} bytes of coefficient buffer, over the decode limit of {} "
                            "(splitflow::image::kMaxDecodePixels * 3)",
                            about(op, what), d.cinfo.image_width, d.cinfo.image_height, bytes,
                            kMaxDecodePixels * 3));
}

bool libjpeg_reads_the_header(const std::uint8_t* data, std::size_t size, std::string* why) {
  JpegDecoder d;
  if (read_header(d, data, size, false)) return true;
  if (why) *why = d.errors.message;
  return false;
}

void check_coefficients(const std::uint8_t* data, std::size_t size, const std::string& what) {
  JpegDecoder d;
  if (read_header(d, data, size, false)) check_coefficient_buffer(kDecodeJpeg, d, what);
}

// Whether the bytes libjpeg has not read yet reach the end-of-image marker (EOI) with nothing
// but entropy-coded data and restart markers before it (a marker the entropy decoder stopped at
// counts first): then decoding the rest of a single-scan file ends at that marker, whatever
// warnings the data gives, and never runs out of data.
bool reaches_the_end_marker(const jpeg_decompress_struct& c) noexcept {
  if (c.unread_marker != 0 && (c.unread_marker < 0xD0 || c.unread_marker > 0xD7))
    return c.unread_marker == 0xD9;
  return internal::jpeg_rest_reaches_the_end_marker(
      reinterpret_cast<const std::uint8_t*>(c.src->next_input_byte), c.src->bytes_in_buffer);
}

// Decodes rows [y, y + h) of columns [*x, *x + *w) (widened by libjpeg to whole iMCUs: *x and
// *w are updated) into `out`, whose rows are `pitch` bytes. The rows after the region are left
// undecoded when the file's remaining bytes show it complete (reaches_the_end_marker), else
// entropy-decoded but not transformed (skipped, but for the last, read into `spare`, a row of
// `pitch` bytes) and the file read to its end: either way a file decode_jpeg refuses (cut short)
// is refused whatever the region, not only when the region reaches the damage.
bool decode_rows(JpegDecoder& d, int y, int h, unsigned* x, unsigned* w, std::uint8_t* out,
                 std::size_t pitch, unsigned* out_x, unsigned* out_w, std::uint8_t* spare) {
  if (setjmp(d.errors.jump)) return false;
  jpeg_start_decompress(&d.cinfo);
  // Columns too: upsampling the region's edge columns needs their neighbours, so ask for one
  // iMCU more on each side (libjpeg then aligns the start down to an iMCU); two for a
  // progressive file, whose block smoothing reads blocks two away (libjpeg-turbo 2.1; found by
  // tests/fuzz/fuzz_decode_region.cpp).
  // (In output pixels: at a reduced DCT scale a block is DCTSIZE / denominator pixels wide.)
#if JPEG_LIB_VERSION >= 70
  const int dct_w = d.cinfo.min_DCT_h_scaled_size, dct_h = d.cinfo.min_DCT_v_scaled_size;
#else
  const int dct_w = d.cinfo.min_DCT_scaled_size, dct_h = d.cinfo.min_DCT_scaled_size;
#endif
  const unsigned margin = (d.cinfo.progressive_mode ? 2u : 1u) *
                          static_cast<unsigned>(d.cinfo.max_h_samp_factor * dct_w);
  const unsigned width = d.cinfo.output_width;
  const unsigned lo = *x > margin ? *x - margin : 0;
  const unsigned hi = std::min(width, *x + *w + margin);
  *out_x = lo;
  *out_w = hi - lo;
  if (lo > 0 || hi < width) jpeg_crop_scanline(&d.cinfo, out_x, out_w);
  // Fancy upsampling of a row needs its neighbours: after a skip to the middle of an iMCU row
  // the first rows would lack them. Skip only to the start of the iMCU row before, and read
  // (into the first output row, overwritten) the rows up to y.
  const int imcu = d.cinfo.max_v_samp_factor * dct_h;
  int start = y / imcu * imcu - imcu;
  if (start < 0) start = 0;
  if (start > 0) jpeg_skip_scanlines(&d.cinfo, static_cast<JDIMENSION>(start));
  for (int r = start; r < y; ++r) {
    JSAMPROW row = out;
    jpeg_read_scanlines(&d.cinfo, &row, 1);
  }
  for (int r = 0; r < h; ++r) {
    JSAMPROW row = out + static_cast<std::size_t>(r) * pitch;
    jpeg_read_scanlines(&d.cinfo, &row, 1);
  }
  // The rest. A single-scan file whose remaining bytes reach the end-of-image marker with only
  // entropy-coded data and restart markers before it cannot run out of data (the one damage
  // decode_jpeg refuses): its rows after the region need not be decoded at all. Otherwise (the
  // bytes end first, or another marker comes) the rows are entropy-decoded and skipped (a skip
  // to the very end would only mark the end reached: stop one row short and read it), then the
  // markers up to the end of the image are read: a file cut short is refused whatever the
  // region (splitflow_jpeg_emit_message).
  if (d.cinfo.output_scanline < d.cinfo.output_height && !jpeg_has_multiple_scans(&d.cinfo) &&
      reaches_the_end_marker(d.cinfo)) {
    jpeg_abort_decompress(&d.cinfo);
    return true;
  }
  const JDIMENSION rows = d.cinfo.output_height;
  if (d.cinfo.output_scanline + 1 < rows) jpeg_skip_scanlines(&d.cinfo, rows - 1 - d.cinfo.output_scanline);
  while (d.cinfo.output_scanline < rows) {
    JSAMPROW row = spare;
    jpeg_read_scanlines(&d.cinfo, &row, 1);
  }
  jpeg_finish_decompress(&d.cinfo);
  return true;
}

// The largest DCT scale denominator a scaled decode of this file takes (decode_denominator's
// `most`): 8 where no component it decodes is upsampled at 1/8 (gray, 4:4:4, 4:2:0: libjpeg-turbo
// scales the chroma's IDCT up to the luma's size), else 4. At 1/8 each upsampled chroma sample
// is one block's DC value, repeated: libjpeg-turbo turns its fancy (triangle) upsampling off
// there (4:2:2 and 4:4:0 files lost 9 dB of PSNR against full decode: a new user's trial, 34 dB
// at 1/8, 43 at 1/4), and 4:1:1's has none at any scale (5 dB lost at 1/8).
int most_denominator(const jpeg_decompress_struct& c, Color color) noexcept {
  // Gray out of YCbCr decodes the luma alone (libjpeg leaves the chroma out); CMYK, YCCK and
  // RGB-coded files are decoded whole and converted after (read_header, cmyk_to).
  const int decoded = color == Color::gray && c.jpeg_color_space == JCS_YCbCr ? 1 : c.num_components;
  for (int ci = 0; ci < decoded; ++ci) {
    const jpeg_component_info& k = c.comp_info[ci];
    // The component's scaled IDCT size at 1/8 (libjpeg-turbo's jdmaster.c: doubled while both
    // sampling ratios allow), then whether it still needs upsampling to the output's size.
    int ssize = 1;
    while (ssize < DCTSIZE && c.max_h_samp_factor % (k.h_samp_factor * ssize * 2) == 0 &&
           c.max_v_samp_factor % (k.v_samp_factor * ssize * 2) == 0)
      ssize *= 2;
    if (c.max_h_samp_factor != k.h_samp_factor * ssize || c.max_v_samp_factor != k.v_samp_factor * ssize)
      return 4;
  }
  return 8;
}

// Reads the header once, asks `choose(H, W)` for the box, decodes it.
// `choose` may set *denom (1, 2, 4, 8; at most *most, set before it is called from the file's
// sampling: most_denominator): the box, in full-size pixels, is then decoded at that DCT scale,
// widened outwards to whole scaled pixels.
template <class Choose>
HostTensor decode_region_with(const char* op, const std::uint8_t* data, std::size_t size, Color color,
                              const std::string& what, Choose&& choose, const int* denom = nullptr,
                              Box* decoded = nullptr, int* most = nullptr) {
  JpegDecoder d;
  if (size == 0 || !read_header(d, data, size, color == Color::gray))
    throw Error(not_a_jpeg(op, what, size == 0 ? "empty" : d.errors.message, data, size));
  const int H = static_cast<int>(d.cinfo.image_height), W = static_cast<int>(d.cinfo.image_width);
  check_pixels(op, W, H, what);
  check_coefficient_buffer(op, d, what);
  if (most) *most = most_denominator(d.cinfo, color);
  Box box = choose(H, W);
  if (box.h == 0 && box.w == 0) box = {0, 0, H, W};
  if (box.h < 1 || box.w < 1 || box.y < 0 || box.x < 0 || std::int64_t{box.y} + box.h > H ||
      std::int64_t{box.x} + box.w > W)
    throw Error(fmt::format("{}: box (y {}, x {}, h {}, w "
                            "{}) is outside the {}x{} image",
                            about(op, what), box.y, box.x, box.h, box.w, H, W));
  const int C = color == Color::rgb ? 3 : 1;
  const int D = is_cmyk(d.cinfo) ? 4 : C;  // the channels libjpeg decodes
  unsigned max_w = static_cast<unsigned>(W);
  if (denom && *denom > 1) {
    const int k = *denom;
    d.cinfo.scale_num = 1;
    d.cinfo.scale_denom = static_cast<unsigned>(k);
    jpeg_calc_output_dimensions(&d.cinfo);
    const int sh = static_cast<int>(d.cinfo.output_height), sw = static_cast<int>(d.cinfo.output_width);
    const int y0 = box.y / k, x0 = box.x / k;
    const int y1 = std::min(sh, (box.y + box.h + k - 1) / k), x1 = std::min(sw, (box.x + box.w + k - 1) / k);
    box = {y0, x0, std::max(1, y1 - y0), std::max(1, x1 - x0)};
    max_w = static_cast<unsigned>(sw);
  }
  if (decoded) *decoded = box;
  // Rows are decoded at the iMCU-aligned width libjpeg picks, into a buffer that wide; then the
  // box's columns are the result (a view: no copy).
  HostTensor rows = HostTensor::empty(DType::u8, {box.h, static_cast<std::int64_t>(max_w), D});
  unsigned x = static_cast<unsigned>(box.x), w = static_cast<unsigned>(box.w), out_x = 0, out_w = 0;
  std::vector<std::uint8_t> spare(static_cast<std::size_t>(max_w) * D);  // the last row's
  if (!decode_rows(d, box.y, box.h, &x, &w, static_cast<std::uint8_t*>(rows.raw()),
                   static_cast<std::size_t>(max_w) * D, &out_x, &out_w, spare.data()))
    throw Error(corrupt_jpeg(op, what, d.errors.message, W, H));
  // Compact the box's columns to the front of each row (in place: rows overlap; a CMYK row's
  // pixels are converted as they move, each read before its place is written).
  auto* base = static_cast<std::uint8_t*>(rows.raw());
  const std::size_t skip = static_cast<std::size_t>(static_cast<unsigned>(box.x) - out_x) * D;
  const std::size_t keep = static_cast<std::size_t>(box.w) * C;
  for (int r = 0; r < box.h; ++r) {
    const std::uint8_t* from = base + static_cast<std::size_t>(r) * max_w * D + skip;
    std::uint8_t* to = base + static_cast<std::size_t>(r) * keep;
    if (D == 4)
      cmyk_to(from, to, static_cast<std::size_t>(box.w), C);
    else
      std::memmove(to, from, keep);
  }
  return HostTensor::wrap(base, DType::u8, {box.h, box.w, C}, rows.owner());
}

HostTensor region_as(const char* op, const std::uint8_t* data, std::size_t size, Box box, Color color,
                     const std::string& what, int* height, int* width) {
  return decode_region_with(op, data, size, color, what, [&](int H, int W) {
    if (height) *height = H;
    if (width) *width = W;
    return box;
  });
}

}  // namespace

HostTensor decode_jpeg_region(const std::uint8_t* data, std::size_t size, Box box, Color color,
                              const std::string& what, int* height, int* width) {
  return region_as("decode_jpeg_region", data, size, box, color, what, height, width);
}

namespace {
// Pillow's resize(BILINEAR) of a crop, optionally mirrored, optionally over a sub-pixel span
// (defined with the resampling below).
HostTensor antialiased(const HostTensor& img, int out_h, int out_w, Box box, bool flip,
                       const std::array<double, 4>* sub = nullptr);
}  // namespace

Image decode_random_resized_crop(Encoded file, const AugmentSpec& spec, Color color) {
  // The header gives the size the crop is drawn for; only the crop's rows and (iMCU-widened)
  // columns are decoded. One header read serves both.
  Augment a;
  int denom = 1, most = 8;
  Box decoded;
  HostTensor region = decode_region_with(
      "decode_random_resized_crop", internal::encoded_bytes("decode_random_resized_crop", file),
      file.bytes.nbytes(), color, file.path,
      [&](int H, int W) {
        a = draw_augment(H, W, file.index, spec);
        denom = decode_denominator(spec, H, W, a.box, most);
        return a.box;
      },
      &denom, &decoded, &most);
  if (denom > 1) {
    // The crop's exact edges at 1/denom scale, in the decoded region (widened to whole pixels):
    // the resize covers that span, not the widened one (decode_denominator keeps it a shrink,
    // so the antialiased filter applies whatever spec.antialias says).
    const double k = denom;
    const std::array<double, 4> sub{a.box.y / k - decoded.y, (a.box.y + a.box.h) / k - decoded.y,
                                    a.box.x / k - decoded.x, (a.box.x + a.box.w) / k - decoded.x};
    return Image{file.index, std::move(file.path),
                 antialiased(region, spec.size, out_width(spec), {0, 0, decoded.h, decoded.w}, a.flip,
                             &sub)};
  }
  return Image{file.index, std::move(file.path),
               resize_flipped(region, spec.size, out_width(spec), a.flip, spec.antialias)};
}

int decode_denominator(const AugmentSpec& spec, int height, int width, const Box& box, int most) noexcept {
  using S = AugmentSpec::ScaledDecode;
  // The reduced DCT scale is a filtered shrink: under antialias = false (the plain bilinear of
  // the full decode) nothing is decoded scaled (validate() refuses always with it).
  if (spec.scaled_decode == S::never || !spec.antialias) return 1;
  if (spec.scaled_decode == S::large_photos &&
      std::int64_t{height} * width < kScaledDecodeMinPixels)
    return 1;
  const int h = box.h > 0 ? box.h : height, w = box.w > 0 ? box.w : width;
  // The largest denominator that still leaves the decoded crop at least the output's size: the
  // resize after it then still shrinks (antialiased), never enlarges.
  for (int k : {8, 4, 2})
    if (k <= most && h / k >= spec.size && w / k >= out_width(spec)) return k;
  return 1;
}

Image decode(Encoded file, Color color) {
  HostTensor px = decode_jpeg(internal::encoded_bytes(kDecodeJpeg, file), file.bytes.nbytes(), color, file.path);
  return Image{file.index, std::move(file.path), std::move(px)};
}

// ---- geometry ----------------------------------------------------------------------------------

namespace {

// Rounds `v` to a double here. Keeps a compiler from fusing a product into the add after it (an
// FMA, on machines that have one and compilers that contract), so the resampling positions and
// coefficients, and with them every pixel, are the same on every machine.
inline double rounded(double v) noexcept {
  volatile double t = v;
  return t;
}

// Source sample positions for bilinear resampling of [start, start + len) to n outputs
// (half-pixel centres), as (index, weight of index + 1 in 1/2048).
struct Tap {
  int i0;
  int i1;
  int w1;  // of i1, in [0, 2048]
};
constexpr int kShift = 11;
constexpr int kOne = 1 << kShift;

std::vector<Tap> taps(int start, int len, int n, int limit) {
  std::vector<Tap> t(static_cast<std::size_t>(n));
  const double scale = static_cast<double>(len) / n;
  for (int o = 0; o < n; ++o) {
    double s = rounded((o + 0.5) * scale) - 0.5;
    s = std::clamp(s, 0.0, static_cast<double>(len - 1));
    const int i0 = static_cast<int>(s);
    const int i1 = std::min(i0 + 1, len - 1);
    const int w1 = static_cast<int>(std::lround((s - i0) * kOne));
    t[static_cast<std::size_t>(o)] = {std::min(start + i0, limit - 1), std::min(start + i1, limit - 1), w1};
  }
  return t;
}

// Plain bilinear (two taps per output, no antialiasing), optionally mirrored: a flip is the
// horizontal taps in reverse, so it costs nothing. The caller has checked `box`.
HostTensor bilinear(const HostTensor& img, int out_h, int out_w, Box box, bool flip) {
  const int H = static_cast<int>(img.dim(0)), W = static_cast<int>(img.dim(1));
  const int C = static_cast<int>(img.dim(2));
  HostTensor out = HostTensor::empty(DType::u8, {out_h, out_w, C});
  std::vector<Tap> xs = taps(box.x, box.w, out_w, W);
  if (flip) std::reverse(xs.begin(), xs.end());
  const std::vector<Tap> ys = taps(box.y, box.h, out_h, H);
  const std::uint8_t* src = img.data<std::uint8_t>();
  std::uint8_t* dst = out.data<std::uint8_t>();
  const std::size_t row = static_cast<std::size_t>(W) * C;
  // Vertical first: blend the output row's two source rows over the box's columns (contiguous,
  // so it vectorises), then take the horizontal taps from that one blended row.
  const std::size_t span = static_cast<std::size_t>(box.w) * C;
  std::vector<std::int32_t> mid(span);  // value << kShift
  struct XTap {
    std::int32_t off0, off1, w0, w1;  // element offsets into `mid`, weights
  };
  std::vector<XTap> xt(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i)
    xt[i] = {(xs[i].i0 - box.x) * C, (xs[i].i1 - box.x) * C, kOne - xs[i].w1, xs[i].w1};
  // At most 255 << 22 (plus the half): int32 holds every sum.
  constexpr std::int32_t half = std::int32_t{1} << (2 * kShift - 1);
  for (int oy = 0; oy < out_h; ++oy) {
    const Tap& t = ys[static_cast<std::size_t>(oy)];
    const std::uint8_t* a = src + static_cast<std::size_t>(t.i0) * row + static_cast<std::size_t>(box.x) * C;
    const std::uint8_t* b = src + static_cast<std::size_t>(t.i1) * row + static_cast<std::size_t>(box.x) * C;
    const std::int32_t w1 = t.w1, w0 = kOne - t.w1;
    std::int32_t* m = mid.data();
    for (std::size_t j = 0; j < span; ++j) m[j] = a[j] * w0 + b[j] * w1;
    std::uint8_t* d = dst + static_cast<std::size_t>(oy) * out_w * C;
    if (C == 3) {
      for (const XTap& x : xt) {
        const std::int32_t* p = m + x.off0;
        const std::int32_t* q = m + x.off1;
        d[0] = static_cast<std::uint8_t>((p[0] * x.w0 + q[0] * x.w1 + half) >> (2 * kShift));
        d[1] = static_cast<std::uint8_t>((p[1] * x.w0 + q[1] * x.w1 + half) >> (2 * kShift));
        d[2] = static_cast<std::uint8_t>((p[2] * x.w0 + q[2] * x.w1 + half) >> (2 * kShift));
        d += 3;
      }
    } else {
      for (const XTap& x : xt)
        for (int ch = 0; ch < C; ++ch)
          *d++ = static_cast<std::uint8_t>((m[x.off0 + ch] * x.w0 + m[x.off1 + ch] * x.w1 + half) >> (2 * kShift));
    }
  }
  return out;
}

// ---- antialiased resampling: Pillow's resize(BILINEAR) (libImaging/Resample.c) -------------
//
// Per dimension that changes, a triangle filter whose support is max(scale, 1) source pixels on
// each side of the output pixel's centre: when shrinking, every source pixel under the output
// pixel counts (antialiasing); when enlarging, it is the bilinear of two neighbours. Weights are
// computed in doubles exactly as Pillow does, normalised, then fixed point with 22 fraction bits;
// the horizontal pass runs first into 8-bit rows, then the vertical pass. Integer arithmetic
// from there on: the same pixels on every machine, and Pillow's pixels.

constexpr int kPrecision = 22;  // Pillow's PRECISION_BITS (32 - 8 - 2)
constexpr std::int32_t kHalf = std::int32_t{1} << (kPrecision - 1);

// One pass: output o is the sum over t < count[o] of sample start[o] + t (box-relative) times
// k[o * ksize + t] (in 1 / 2^22; nonnegative, summing to 2^22 give or take rounding).
struct Filter {
  int ksize = 0;
  std::vector<int> start, count;
  std::vector<std::int32_t> k;
};

// Pillow's precompute_coeffs with the bilinear filter, then normalize_coeffs_8bpc: n outputs
// from the span [in0, in1) of `len` samples (in1 < 0: the whole, [0, len)); samples outside
// the span but inside [0, len) count, as in Pillow's resize(..., box=).
Filter triangle_filter(int len, int n, double in0 = 0.0, double in1 = -1.0) {
  Filter f;
  // Pillow takes the box's edges as floats; exact for any side under 2^24.
  if (in1 < 0) in1 = static_cast<double>(static_cast<float>(len));
  const double scale = (in1 - in0) / n;
  const double filterscale = std::max(scale, 1.0);
  const double support = 1.0 * filterscale;
  const double inv = 1.0 / filterscale;
  f.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  const std::size_t ksize = static_cast<std::size_t>(f.ksize);
  f.start.resize(static_cast<std::size_t>(n));
  f.count.resize(static_cast<std::size_t>(n));
  f.k.assign(static_cast<std::size_t>(n) * ksize, 0);
  std::vector<double> w(ksize);
  for (int o = 0; o < n; ++o) {
    const double center = rounded(in0 + rounded((o + 0.5) * scale));
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), len);
    const int count = hi - lo;
    double ww = 0.0;
    for (int t = 0; t < count; ++t) {
      double x = rounded((t + lo - center + 0.5) * inv);
      if (x < 0.0) x = -x;
      w[static_cast<std::size_t>(t)] = x < 1.0 ? 1.0 - x : 0.0;
      ww += w[static_cast<std::size_t>(t)];
    }
    std::int32_t* k = &f.k[static_cast<std::size_t>(o) * ksize];
    for (int t = 0; t < count; ++t) {
      double v = w[static_cast<std::size_t>(t)];
      if (ww != 0.0) v /= ww;
      k[t] = static_cast<std::int32_t>(0.5 + v * (1 << kPrecision));  // v >= 0
    }
    f.start[static_cast<std::size_t>(o)] = lo;
    f.count[static_cast<std::size_t>(o)] = count;
  }
  return f;
}

// Pillow's clip8 (the sums are never negative: the weights are not).
inline std::uint8_t clip8(std::int32_t v) noexcept {
  v >>= kPrecision;
  return static_cast<std::uint8_t>(v > 255 ? 255 : v);
}

// The horizontal pass's taps, as its inner loop wants them: every output takes the same
// number of samples, K (the most any takes: the windows near the box's edges are moved inside
// it, the coefficients they gain are zero), in output order (mirrored when flipping). A fixed
// trip count unrolls and never mispredicts; the zeros add nothing.
struct RowTaps {
  int K = 0;
  std::vector<int> start;       // per output, in pixels from the box's first column
  std::vector<std::int32_t> k;  // per output, K coefficients
};

RowTaps row_taps(const Filter& f, int len, bool flip) {
  RowTaps r;
  const std::size_t n = f.start.size();
  r.K = *std::max_element(f.count.begin(), f.count.end());
  const std::size_t K = static_cast<std::size_t>(r.K);
  r.start.resize(n);
  r.k.assign(n * K, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t o = flip ? n - 1 - i : i;
    const int s = std::min(f.start[o], len - r.K);  // count <= K <= len: s >= 0
    r.start[i] = s;
    const std::size_t shift = static_cast<std::size_t>(f.start[o] - s);
    const std::int32_t* k = &f.k[o * static_cast<std::size_t>(f.ksize)];
    std::copy(k, k + f.count[o], r.k.begin() + static_cast<std::ptrdiff_t>(i * K + shift));
  }
  return r;
}

// One RGB output of the horizontal pass: K taps from the pixels at p, coefficients k.
inline void rgb_output(const std::uint8_t* p, const std::int32_t* k, int K, std::uint8_t* d) {
  std::int32_t s0 = kHalf, s1 = kHalf, s2 = kHalf;
  for (int t = 0; t < K; ++t) {
    s0 += p[3 * t] * k[t];
    s1 += p[3 * t + 1] * k[t];
    s2 += p[3 * t + 2] * k[t];
  }
  d[0] = clip8(s0);
  d[1] = clip8(s1);
  d[2] = clip8(s2);
}

// One RGB row of the horizontal pass with K taps an output (K a constant: unrolled).
template <int K>
void row_rgb(const std::uint8_t* line, const RowTaps& r, std::uint8_t* d) {
  const std::int32_t* k = r.k.data();
  for (int s : r.start) {
    rgb_output(line + static_cast<std::size_t>(s) * 3, k, K, d);
    d += 3;
    k += K;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The RGB rows with AVX2, two outputs at a time and two taps a step: the 16-bit lanes hold an
// output's R, G, B of taps t and t + 1 side by side, and _mm256_madd_epi16 multiplies and adds
// each pair. A coefficient (22 bits) is split in two 11-bit halves, k = kh * 2^11 + kl, summed
// apart and joined at the end: the same integer sums as row_rgb (no partial sum overflows), so
// the same pixels on every machine. `k2` holds, per pair of outputs and pair of taps, the kl
// then the kh lanes (taps past K: 0). Outputs whose 8-byte loads would pass the box's last byte
// (`limit`: near its right edge, or its left one when mirrored), and an odd last one, go
// through the scalar loop.
__attribute__((target("avx2"))) void row_rgb_avx2(const std::uint8_t* line, const RowTaps& r,
                                                  const std::int16_t* k2, int limit,
                                                  std::uint8_t* d) {
  const int K = r.K, Q = (K + 1) / 2;  // pairs of taps
  const std::size_t n = r.start.size();
  const __m256i half = _mm256_set1_epi32(kHalf), pick = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);
  constexpr char z = static_cast<char>(0x80);
  // Bytes R G B R' G' B' of taps t, t + 1 (output 0 in the low lane, output 1 in the high one)
  // to 16-bit lanes R R' G G' B B' 0 0.
  const __m256i spread = _mm256_setr_epi8(0, z, 3, z, 1, z, 4, z, 2, z, 5, z, z, z, z, z,  //
                                          8, z, 11, z, 9, z, 12, z, 10, z, 13, z, z, z, z, z);
  const std::int32_t* k = r.k.data();
  std::size_t i = 0;
  for (; i + 1 < n; i += 2, k += 2 * static_cast<std::size_t>(K), d += 6) {
    const int s0 = r.start[i], s1 = r.start[i + 1];
    if ((std::max(s0, s1) + 2 * Q) * 3 + 2 > limit) {
      rgb_output(line + static_cast<std::size_t>(s0) * 3, k, K, d);
      rgb_output(line + static_cast<std::size_t>(s1) * 3, k + K, K, d + 3);
      continue;
    }
    const std::uint8_t* p0 = line + static_cast<std::size_t>(s0) * 3;
    const std::uint8_t* p1 = line + static_cast<std::size_t>(s1) * 3;
    const std::int16_t* kk = k2 + i / 2 * static_cast<std::size_t>(Q) * 32;
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int q = 0; q < Q; ++q, kk += 32) {
      std::uint64_t a, b;
      std::memcpy(&a, p0 + 6 * q, 8);
      std::memcpy(&b, p1 + 6 * q, 8);
      const __m128i ab = _mm_set_epi64x(static_cast<long long>(b), static_cast<long long>(a));
      const __m256i px = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(ab), spread);
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(px, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kk))));
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(px, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kk + 16))));
    }
    __m256i acc = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(hi, 11), lo), half);
    acc = _mm256_srai_epi32(acc, kPrecision);  // >= 0: the sums are
    // R G B of both outputs side by side, then to bytes (packus: clip8's cap at 255).
    acc = _mm256_permutevar8x32_epi32(acc, pick);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    const std::uint64_t bytes = static_cast<std::uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(words, words)));
    std::memcpy(d, &bytes, 6);
  }
  if (i < n)  // an odd last one, as row_rgb
    rgb_output(line + static_cast<std::size_t>(r.start[i]) * 3, k, K, d);
}

// SPLITFLOW_DISABLE_AVX2=1 in the environment (read once) takes the scalar path: to compare the
// two (tests, benchmarks) on one machine.
bool has_avx2() noexcept {
  static const bool yes = __builtin_cpu_supports("avx2") && !std::getenv("SPLITFLOW_DISABLE_AVX2");
  return yes;
}
#define SPLITFLOW_ROW_AVX2 1
#endif

// Any channel count and K.
void row_any(const std::uint8_t* line, const RowTaps& r, int C, std::uint8_t* d) {
  const std::int32_t* k = r.k.data();
  for (int s : r.start) {
    const std::uint8_t* p = line + static_cast<std::size_t>(s) * C;
    for (int ch = 0; ch < C; ++ch) {
      std::int32_t acc = kHalf;
      for (int t = 0; t < r.K; ++t) acc += p[t * C + ch] * k[t];
      *d++ = clip8(acc);
    }
    k += r.K;
  }
}

// The horizontal pass: `rows` rows from `src` (`pitch` bytes apart; pixels of C bytes, the box's
// `len` columns) to rows of f's n pixels at `dst`, contiguous; mirrored when `flip`.
void resample_rows(const std::uint8_t* src, std::size_t pitch, int rows, int C, int len,
                   const Filter& f, bool flip, std::uint8_t* dst) {
  const RowTaps r = row_taps(f, len, flip);
  using Row = void (*)(const std::uint8_t*, const RowTaps&, std::uint8_t*);
  static constexpr Row rgb[] = {nullptr,     row_rgb<1>,  row_rgb<2>,  row_rgb<3>,  row_rgb<4>,
                                row_rgb<5>,  row_rgb<6>,  row_rgb<7>,  row_rgb<8>,  row_rgb<9>,
                                row_rgb<10>, row_rgb<11>, row_rgb<12>, row_rgb<13>, row_rgb<14>};
  const Row fixed = C == 3 && r.K < static_cast<int>(std::size(rgb)) ? rgb[r.K] : nullptr;
  const std::size_t out_row = r.start.size() * static_cast<std::size_t>(C);
#ifdef SPLITFLOW_ROW_AVX2
  if (C == 3 && has_avx2()) {
    // Per pair of outputs and pair of taps (t, t + 1): the kl lanes then the kh lanes, each
    // [k(t), k(t + 1)] for R, G, B and 0, 0; output 0's lanes first (row_rgb_avx2).
    const std::size_t n = r.start.size(), K = static_cast<std::size_t>(r.K), Q = (K + 1) / 2;
    std::vector<std::int16_t> k2(n / 2 * Q * 32, 0);
    for (std::size_t i = 0; i + 1 < n; i += 2)
      for (std::size_t q = 0; q < Q; ++q) {
        std::int16_t* w = &k2[(i / 2 * Q + q) * 32];
        for (std::size_t o = 0; o < 2; ++o)
          for (std::size_t u = 0; u < 2; ++u) {
            const std::size_t t = 2 * q + u;
            const std::int32_t c = t < K ? r.k[(i + o) * K + t] : 0;
            for (std::size_t ch = 0; ch < 3; ++ch) {
              w[o * 8 + ch * 2 + u] = static_cast<std::int16_t>(c & 2047);   // kl
              w[16 + o * 8 + ch * 2 + u] = static_cast<std::int16_t>(c >> 11);  // kh
            }
          }
      }
    for (int y = 0; y < rows; ++y)
      row_rgb_avx2(src + static_cast<std::size_t>(y) * pitch, r, k2.data(), len * 3,
                   dst + static_cast<std::size_t>(y) * out_row);
    return;
  }
#endif
  for (int y = 0; y < rows; ++y) {
    const std::uint8_t* line = src + static_cast<std::size_t>(y) * pitch;
    std::uint8_t* d = dst + static_cast<std::size_t>(y) * out_row;
    if (fixed) {
      fixed(line, r, d);
    } else {
      row_any(line, r, C, d);
    }
  }
}

#ifdef SPLITFLOW_ROW_AVX2
// The vertical pass with AVX2, 16 bytes of a row at a time with all of its taps in registers,
// two taps (rows) a step: bytes of rows t and t + 1 interleaved to 16-bit lanes, multiplied and
// added in pairs by _mm256_madd_epi16, the coefficient in two 11-bit halves as row_rgb_avx2's.
// The same integer sums as the scalar loop; the last bytes of a row (under 16) go through it.
__attribute__((target("avx2"))) std::size_t columns_avx2(const std::uint8_t* src, std::size_t pitch,
                                                         std::size_t span, int first, const Filter& f,
                                                         std::size_t o, std::uint8_t* d) {
  const std::int32_t* k = &f.k[o * static_cast<std::size_t>(f.ksize)];
  const int count = f.count[o], Q = (count + 1) / 2;
  const std::uint8_t* rows = src + static_cast<std::size_t>(f.start[o] - first) * pitch;
  __m256i wl[32], wh[32];  // per pair of taps: (k(t), k(t + 1)) halves in each 32-bit lane
  if (Q > 32) return 0;
  for (int q = 0; q < Q; ++q) {
    const std::int32_t a = k[2 * q], b = 2 * q + 1 < count ? k[2 * q + 1] : 0;
    wl[q] = _mm256_set1_epi32(static_cast<std::int32_t>((a & 2047) | (b & 2047) << 16));
    wh[q] = _mm256_set1_epi32(static_cast<std::int32_t>((a >> 11) | (b >> 11) << 16));
  }
  const __m256i half = _mm256_set1_epi32(kHalf);
  std::size_t j = 0;
  for (; j + 16 <= span; j += 16) {
    __m256i lo0 = _mm256_setzero_si256(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
    for (int q = 0; q < Q; ++q) {
      const std::uint8_t* r0 = rows + static_cast<std::size_t>(2 * q) * pitch + j;
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
      const __m128i b = 2 * q + 1 < count ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + pitch))
                                          : _mm_setzero_si128();
      const __m256i x0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
      const __m256i x1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b));
      lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(x0, wl[q]));
      lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(x1, wl[q]));
      hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(x0, wh[q]));
      hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(x1, wh[q]));
    }
    const __m256i s0 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(hi0, 11), lo0), half), kPrecision);
    const __m256i s1 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(hi1, 11), lo1), half), kPrecision);
    // To 16 bytes in order (the packs work per 128-bit lane; packus caps at 255, as clip8).
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(s0, s1), 0xD8);
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(words, words), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), _mm256_castsi256_si128(bytes));
  }
  return j;
}
#endif

// The vertical pass: output row o of `span` bytes at dst + o * span from rows f.start[o] + t of
// `src` (row r at src + (r - first) * pitch). Along the row, so it vectorises.
void resample_columns(const std::uint8_t* src, std::size_t pitch, std::size_t span, int first,
                      const Filter& f, std::uint8_t* dst) {
  const std::size_t n = f.start.size(), ksize = static_cast<std::size_t>(f.ksize);
  std::vector<std::int32_t> acc(span);
  std::int32_t* a = acc.data();
  for (std::size_t o = 0; o < n; ++o) {
    const std::int32_t* k = &f.k[o * ksize];
    std::uint8_t* d = dst + o * span;
    std::size_t done = 0;  // bytes of the row the vector loop made
#ifdef SPLITFLOW_ROW_AVX2
    if (has_avx2()) done = columns_avx2(src, pitch, span, first, f, o, d);
#endif
    std::fill(acc.begin() + static_cast<std::ptrdiff_t>(done), acc.end(), kHalf);
    for (int t = 0; t < f.count[o]; ++t) {
      const std::uint8_t* row = src + static_cast<std::size_t>(f.start[o] + t - first) * pitch;
      const std::int32_t kt = k[t];
      for (std::size_t j = done; j < span; ++j) a[j] += row[j] * kt;
    }
    for (std::size_t j = done; j < span; ++j) d[j] = clip8(a[j]);
  }
}

// Mirrors each row of an HWC image in place.
void mirror_rows(HostTensor& img) {
  const std::size_t H = static_cast<std::size_t>(img.dim(0));
  const std::size_t W = static_cast<std::size_t>(img.dim(1));
  const std::size_t C = static_cast<std::size_t>(img.dim(2));
  std::uint8_t* p = img.data<std::uint8_t>();
  for (std::size_t y = 0; y < H; ++y) {
    std::uint8_t* row = p + y * W * C;
    for (std::size_t x = 0; x < W / 2; ++x)
      std::swap_ranges(row + x * C, row + (x + 1) * C, row + (W - 1 - x) * C);
  }
}

// Pillow's resize(BILINEAR) of the crop `box` (Image.crop(box).resize(...): samples outside the
// box never count), optionally mirrored. A pass runs only for a dimension that changes; the
// horizontal pass only over the rows the vertical pass reads.
//
// `sub` (y0, y1, x0, x1), when given: the output covers that sub-pixel span of the whole image
// (`box` is then the whole image), whose pixels around it count too (a crop decoded at a reduced
// DCT scale, whose exact edges fall between the decoded pixels).
HostTensor antialiased(const HostTensor& img, int out_h, int out_w, Box box, bool flip,
                       const std::array<double, 4>* sub) {
  const int W = static_cast<int>(img.dim(1)), C = static_cast<int>(img.dim(2));
  const std::size_t pitch = static_cast<std::size_t>(W) * C;
  const std::uint8_t* base = img.data<std::uint8_t>() + static_cast<std::size_t>(box.y) * pitch +
                             static_cast<std::size_t>(box.x) * C;
  HostTensor out = HostTensor::empty(DType::u8, {out_h, out_w, C});
  std::uint8_t* dst = out.data<std::uint8_t>();
  const bool horizontal = sub || out_w != box.w, vertical = sub || out_h != box.h;
  Filter fy;
  int first = 0, last = box.h;  // the rows the vertical pass reads
  if (vertical) {
    fy = sub ? triangle_filter(box.h, out_h, (*sub)[0], (*sub)[1]) : triangle_filter(box.h, out_h);
    first = fy.start.front();
    last = fy.start.back() + fy.count.back();
  }
  if (horizontal) {
    const Filter fx =
        sub ? triangle_filter(box.w, out_w, (*sub)[2], (*sub)[3]) : triangle_filter(box.w, out_w);
    if (!vertical) {
      resample_rows(base, pitch, box.h, C, box.w, fx, flip, dst);
      return out;
    }
    const std::size_t span = static_cast<std::size_t>(out_w) * C;
    // The horizontal pass's rows (up to a few MiB for a large crop) from the block cache: warm
    // pages item after item, where a fresh vector would fault them in each time.
    HostTensor mid = HostTensor::empty(DType::u8, {last - first, static_cast<std::int64_t>(span)});
    resample_rows(base + static_cast<std::size_t>(first) * pitch, pitch, last - first, C, box.w, fx,
                  flip, mid.data<std::uint8_t>());
    resample_columns(mid.data<std::uint8_t>(), span, span, first, fy, dst);
    return out;
  }
  const std::size_t span = static_cast<std::size_t>(box.w) * C;
  if (vertical) {
    resample_columns(base, pitch, span, 0, fy, dst);
  } else {
    for (int y = 0; y < box.h; ++y)
      std::memcpy(dst + static_cast<std::size_t>(y) * span,
                  base + static_cast<std::size_t>(y) * pitch, span);
  }
  if (flip) mirror_rows(out);
  return out;
}

// resize, optionally mirrored. Antialiased (Pillow's filter) when shrinking either side; the
// plain bilinear otherwise, and always without `antialias`.
HostTensor resize_impl(const HostTensor& img, int out_h, int out_w, Box box, bool flip,
                       bool antialias) {
  check_hwc(img, "resize");
  const int H = static_cast<int>(img.dim(0)), W = static_cast<int>(img.dim(1));
  if (box.h == 0 && box.w == 0) box = {0, 0, H, W};
  if (out_h < 1 || out_w < 1 || box.h < 1 || box.w < 1 || box.y < 0 || box.x < 0 ||
      std::int64_t{box.y} + box.h > H || std::int64_t{box.x} + box.w > W)
    throw Error(fmt::format("splitflow::image::resize: cannot resize box (y {}, x {}, h {}, w {}) "
                            "of a {}x{} image to {}x{}",
                            box.y, box.x, box.h, box.w, H, W, out_h, out_w));
  // The ops check their sizes when they are built; a direct call is checked here, so that no
  // call allocates an output of a size no op may have.
  validate_size(out_h, out_w, "resize");
  if (antialias && (box.h > out_h || box.w > out_w))
    return antialiased(img, out_h, out_w, box, flip);
  return bilinear(img, out_h, out_w, box, flip);
}

}  // namespace

void validate(const AugmentSpec& s, const char* op) {
  const auto bad = [&](const std::string& what) {
    // (A bad argument is a GraphError, as every op's: Python's ValueError.)
    throw GraphError(fmt::format("splitflow::image::{}: {}", op, what));
  };
  if (s.size < 1 || s.size > kMaxOutputSide)
    bad(fmt::format("size {} is out of range: give 1 to {} (pixels per side)", s.size, kMaxOutputSide));
  if (s.width < 0 || s.width > kMaxOutputSide)
    bad(fmt::format("width {} is out of range: give 1 to {} (pixels), or 0 for a square of size",
                    s.width, kMaxOutputSide));
  const auto range = [&](const char* name, double lo, double hi) {
    if (!std::isfinite(lo) || !std::isfinite(hi) || lo <= 0 || hi <= 0 || lo > hi)
      bad(fmt::format("{} ({}, {}) must be two finite positive numbers, the smaller first", name,
                      lo, hi));
  };
  range("scale", s.scale_min, s.scale_max);
  range("ratio", s.ratio_min, s.ratio_max);
  if (!(s.flip_probability >= 0 && s.flip_probability <= 1))
    bad(fmt::format("flip probability {} must be in [0, 1]", s.flip_probability));
  if (s.scaled_decode == AugmentSpec::ScaledDecode::always && !s.antialias)
    bad("scaled decode 'always' with antialias off: the reduced DCT scale is itself a filtered "
        "shrink, so the crop cannot be the plain bilinear's; keep antialias on, or use 'never' "
        "(or large photos only: ScaledDecode::large_photos, Python's 'large', which then decodes in "
        "full)");
}

void validate_size(int height, int width, const char* op) {
  if (height < 1 || width < 1 || height > kMaxOutputSide || width > kMaxOutputSide)
    throw GraphError(fmt::format("splitflow::image::{}: output size {}x{} is out of range: give 1 to {} "
                            "per side", op, height, width, kMaxOutputSide));
}

HostTensor resize(const HostTensor& img, int out_h, int out_w, Box box, bool antialias) {
  return resize_impl(img, out_h, out_w, box, false, antialias);
}

HostTensor resize_flipped(const HostTensor& img, int out_h, int out_w, bool flip, bool antialias) {
  return resize_impl(img, out_h, out_w, {}, flip, antialias);
}

HostTensor hflip(const HostTensor& img) {
  check_hwc(img, "hflip");
  const std::int64_t H = img.dim(0), W = img.dim(1), C = img.dim(2);
  HostTensor out = HostTensor::empty(DType::u8, {H, W, C});
  const std::uint8_t* s = img.data<std::uint8_t>();
  std::uint8_t* d = out.data<std::uint8_t>();
  for (std::int64_t y = 0; y < H; ++y)
    for (std::int64_t x = 0; x < W; ++x)
      std::memcpy(d + (y * W + x) * C, s + (y * W + (W - 1 - x)) * C, static_cast<std::size_t>(C));
  return out;
}

HostTensor resize_shorter(const HostTensor& img, int size, bool antialias) {
  check_hwc(img, "resize_shorter");
  validate_size(size, size, "resize_shorter");
  const std::int64_t H = img.dim(0), W = img.dim(1);
  if (H < 1 || W < 1)
    throw Error(fmt::format("splitflow::image::resize_shorter: an empty image ({}) has no side "
                            "to scale", img.describe()));
  const std::int64_t shorter = std::min(H, W), longer = std::max(H, W);
  // torchvision: int(size * long / short), in floating point (truncated, then bounded).
  const double other = std::floor(static_cast<double>(size) * static_cast<double>(longer) /
                                  static_cast<double>(shorter));
  if (other > kMaxOutputSide)
    throw GraphError(fmt::format("splitflow::image::resize_shorter: the shorter side of a {}x{} "
                                 "image to {} makes the longer {:.0f}, past {} pixels",
                                 H, W, size, other, kMaxOutputSide));
  const int out_long = std::max(1, static_cast<int>(other));
  return W <= H ? resize(img, out_long, size, {}, antialias) : resize(img, size, out_long, {}, antialias);
}

HostTensor center_crop(const HostTensor& img, int height, int width) {
  check_hwc(img, "center_crop");
  validate_size(height, width, "center_crop");
  const std::int64_t H = img.dim(0), W = img.dim(1), C = img.dim(2);
  // Where the image is at least the crop: torchvision's int(round((H - h) / 2.0)), half to
  // even; where smaller, it is padded by (h - H) // 2 before (and the rest after) first.
  const auto offset = [](std::int64_t have, std::int64_t want) -> std::int64_t {
    if (have < want) return -((want - have) / 2);
    const std::int64_t d = have - want, k = d / 2;
    return d % 2 == 0 ? k : k + (k & 1);
  };
  const std::int64_t top = offset(H, height), left = offset(W, width);
  HostTensor out = HostTensor::empty(DType::u8, {height, width, C});
  std::uint8_t* d = out.data<std::uint8_t>();
  const std::uint8_t* s = img.data<std::uint8_t>();
  std::memset(d, 0, static_cast<std::size_t>(height) * static_cast<std::size_t>(width) * static_cast<std::size_t>(C));
  const std::int64_t x0 = std::max<std::int64_t>(0, -left), x1 = std::min<std::int64_t>(width, W - left);
  for (std::int64_t y = 0; y < height; ++y) {
    const std::int64_t sy = y + top;
    if (sy < 0 || sy >= H || x1 <= x0) continue;
    std::memcpy(d + (y * width + x0) * C, s + (sy * W + x0 + left) * C,
                static_cast<std::size_t>((x1 - x0) * C));
  }
  return out;
}

Augment draw_augment(int height, int width, std::uint64_t index, const AugmentSpec& spec) {
  Rng rng(mix(mix(spec.seed, spec.epoch), index));
  Augment a;
  const double area = static_cast<double>(height) * width;
  const double log_lo = std::log(spec.ratio_min), log_hi = std::log(spec.ratio_max);
  bool found = false;
  for (int attempt = 0; attempt < 10 && !found; ++attempt) {
    const double target = area * rng.uniform(spec.scale_min, spec.scale_max);
    const double aspect = std::exp(rng.uniform(log_lo, log_hi));
    const int w = static_cast<int>(std::lround(std::sqrt(target * aspect)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / aspect)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      a.box = {static_cast<int>(rng.below(static_cast<std::uint64_t>(height - h + 1))),
               static_cast<int>(rng.below(static_cast<std::uint64_t>(width - w + 1))), h, w};
      found = true;
    }
  }
  if (!found) {  // a centre crop at the nearest allowed aspect ratio
    const double ratio = static_cast<double>(width) / height;
    int w = width, h = height;
    if (ratio < spec.ratio_min) {
      h = static_cast<int>(std::lround(w / spec.ratio_min));
    } else if (ratio > spec.ratio_max) {
      w = static_cast<int>(std::lround(h * spec.ratio_max));
    }
    a.box = {(height - h) / 2, (width - w) / 2, h, w};
  }
  a.flip = rng.uniform() < spec.flip_probability;
  return a;
}

Image RandomResizedCrop::operator()(Image img) const {
  check_hwc(img.pixels, "RandomResizedCrop");
  const Augment a = draw_augment(static_cast<int>(img.pixels.dim(0)),
                                 static_cast<int>(img.pixels.dim(1)), img.index, spec_);
  img.pixels = resize_impl(img.pixels, spec_.size, out_width(spec_), a.box, a.flip, spec_.antialias);
  return img;
}

// ---- batches -----------------------------------------------------------------------------------

namespace {
template <class Get, class Name>
HostTensor collate_impl(std::size_t n, Get get, Name name, HostAllocator* alloc) {
  if (n == 0) throw Error("splitflow::image::collate: the batch is empty");
  const HostTensor& first = get(0);
  check_hwc(first, "collate");
  const std::vector<std::int64_t> shape = first.shape();
  std::vector<std::int64_t> bshape{static_cast<std::int64_t>(n)};
  bshape.insert(bshape.end(), shape.begin(), shape.end());
  HostTensor out = alloc ? alloc->empty(DType::u8, bshape) : HostTensor::empty(DType::u8, bshape);
  const std::size_t each = first.nbytes();
  auto* d = static_cast<std::uint8_t*>(out.raw());
  for (std::size_t i = 0; i < n; ++i) {
    const HostTensor& t = get(i);
    if (t.dtype() != DType::u8 || t.shape() != shape || !t.contiguous())
      throw Error(fmt::format("splitflow::image::collate: image {}{} of the batch is {}, the "
                              "first is {}; a batch needs equal shapes (resize or crop first)",
                              i, name(i), t.describe(), first.describe()));
    std::memcpy(d + i * each, t.raw(), each);
  }
  return out;
}
}  // namespace

HostTensor collate(const std::vector<Image>& images, HostAllocator* alloc) {
  return collate_impl(
      images.size(), [&](std::size_t i) -> const HostTensor& { return images[i].pixels; },
      [&](std::size_t i) {
        return images[i].path.empty() ? std::string() : fmt::format(" ('{}')", images[i].path);
      },
      alloc);
}

HostTensor collate(const std::vector<HostTensor>& images, HostAllocator* alloc) {
  return collate_impl(
      images.size(), [&](std::size_t i) -> const HostTensor& { return images[i]; },
      [](std::size_t) { return std::string(); }, alloc);
}

}  // namespace splitflow::image
