// Image input ops: file lists with per-epoch shuffling and sharding, file reading, JPEG decode
// (libjpeg-turbo), bilinear resize, random-resized-crop and flip with per-item seeded
// randomness, and collation into NHWC batches. CPU ops: call them from CPU stages.
//
//     splitflow::image::FileList files = splitflow::image::FileList::directory("train/");
//     std::uint64_t e = ...;  int r = ..., w = ...;   // the epoch; this rank, of w
//     auto order = files.epoch({.seed = 7, .epoch = e, .rank = r, .world_size = w});
//     auto src    = g.source("files", files.refs(order));
//     auto read   = g.stage("read", image::read_file, {.concurrency = 2});
//     auto decode = g.stage("decode", [](image::Encoded f) { return image::decode(std::move(f)); },
//                           {.concurrency = Concurrency::unlimited, .on_error = OnError::skip});
//     auto crop   = g.stage("augment", image::RandomResizedCrop({.size = 224, .seed = 7, .epoch = e}),
//                           {.concurrency = Concurrency::unlimited});
//     auto batch  = g.batch<image::Image>("batch", 64);
//     auto pack   = g.stage("collate", [](std::vector<image::Image> b, HostAllocator& a) {
//                             return image::collate(b, &a); });
//     src >> read >> decode >> crop >> batch >> pack >> next;   // next: a GPU stage, a sink
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "splitflow/device/device.hpp"
#include "splitflow/core/tensor.hpp"

namespace splitflow::image {

/// Which part of the data set one reader sees in one epoch, and in which order.
struct ShardSpec {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  bool shuffle = true;
  /// Distributed training: this process's rank among world_size (DistributedSampler's role).
  int rank = 0;
  int world_size = 1;
  /// Data-loader workers within a rank.
  int worker = 0;
  int num_workers = 1;
};

/// A file to read: its index in the FileList (what per-item randomness is seeded with) and path.
struct FileRef {
  std::uint64_t index = 0;
  std::string path;
};

/// A file's bytes, as a u8[size] host tensor.
struct Encoded {
  std::uint64_t index = 0;
  std::string path;
  HostTensor bytes;
};

/// A decoded image: u8[height, width, channels] (HWC), with where it came from.
struct Image {
  std::uint64_t index = 0;
  std::string path;
  HostTensor pixels;
};
/// Host bytes an Image holds (splitflow::bytes_of): its bytes or pixels and its path.
inline std::size_t host_bytes(const Image& i) noexcept {
  return sizeof(Image) + i.path.size() + i.pixels.nbytes();
}

/// An ordered list of files. The order is the data set's: torchvision's ImageFolder order for a
/// directory, sorted paths for a glob, file order for a list file.
class FileList {
 public:
  FileList() = default;
  explicit FileList(std::vector<std::string> paths) : paths_(std::move(paths)) {}

  /// Files under `dir` (recursively) whose extension is one of `extensions` (case-insensitive),
  /// in torchvision's ImageFolder order with `dir` as its root: `dir`'s own files, then each of
  /// its folders (a class) whole, in name order ("cat/sub/y.jpg" before "cat-2/z.jpg"), and
  /// within one, folder by folder in path order, each folder's files sorted by name before its
  /// subfolders' ("a/x.jpg" before "a/b/y.jpg"). Throws splitflow::Error naming the directory
  /// if it cannot be read.
  static FileList directory(const std::string& dir,
                            const std::vector<std::string>& extensions = {".jpg", ".jpeg"});
  /// Paths matching a shell pattern (glob(3)), sorted. An empty match is an error.
  static FileList glob(const std::string& pattern);
  /// One path per line; relative paths are relative to the list file's directory; blank lines
  /// and lines starting with '#' are ignored.
  static FileList list_file(const std::string& path);

  std::size_t size() const noexcept { return paths_.size(); }
  const std::vector<std::string>& paths() const noexcept { return paths_; }

  /// The indices one shard reads in one epoch: the whole list shuffled (Fisher-Yates with a
  /// generator seeded by seed and epoch; the same on every platform), then rank r of world_size
  /// takes positions r, r + world_size, ...; then worker w of num_workers takes every
  /// num_workers-th of those. Over all ranks and workers every file is read exactly once per
  /// epoch (no padding: shard sizes differ by at most one).
  std::vector<std::uint64_t> epoch(const ShardSpec& spec) const;
  /// The FileRefs of `order`, for Graph::source.
  std::vector<FileRef> refs(const std::vector<std::uint64_t>& order) const;

 private:
  std::vector<std::string> paths_;
};

/// Reads a whole file. Throws splitflow::Error naming the file on any I/O error.
Encoded read_file(FileRef file);

enum class Color { rgb, gray };

/// Decodes a JPEG with libjpeg-turbo (accurate DCT, fancy upsampling: TurboJPEG's defaults) into
/// u8[h, w, 3] (rgb) or u8[h, w, 1] (gray), as PIL decodes it: data that ends early is an error
/// naming `what` (the file) and libjpeg-turbo's message, other damage PIL decodes through
/// (corrupt entropy data, junk before the end marker) is decoded through, to PIL's pixels; a
/// CMYK or YCCK file gives what PIL's Image.convert("RGB") (gray: "L") gives.
HostTensor decode_jpeg(const std::uint8_t* data, std::size_t size, Color color = Color::rgb,
                       const std::string& what = "JPEG data");
Image decode(Encoded file, Color color = Color::rgb);

/// A region of an image: rows [y, y + h), columns [x, x + w).
struct Box {
  int y = 0, x = 0, h = 0, w = 0;
};

/// Bilinear resize of `box` of an HWC u8 image to out_h x out_w (half-pixel centres; only the
/// box's pixels count, edges clamped). An empty box means the whole image.
///
/// `antialias` (the default): when a side shrinks, Pillow's resize(BILINEAR), that is
/// Image.crop(box).resize((out_w, out_h), Image.BILINEAR), within 1 of it at every pixel (equal
/// to it on the images tested): a triangle filter whose support grows with the scale factor, so
/// every source pixel under an output pixel counts (torchvision's antialias=True on PIL images),
/// separable, horizontal pass first, in fixed point (22 fraction bits; the same pixels on every
/// machine). When no side shrinks, the plain bilinear below, which it then equals.
///
/// `antialias = false`: the plain bilinear of two neighbours per side whatever the scale (OpenCV's
/// INTER_LINEAR, torchvision's tensor resize with antialias=False): faster when shrinking, but
/// it aliases (a fine checkerboard shrunk 4x is moire). Rounds to nearest.
HostTensor resize(const HostTensor& hwc, int out_h, int out_w, Box box = {}, bool antialias = true);
/// Mirror left-right.
HostTensor hflip(const HostTensor& hwc);

/// torchvision's Resize(size) with one number: the shorter side to `size`, the longer in
/// proportion (truncated, as torchvision computes it), resized as resize() does.
///
///     HostTensor eval = center_crop(resize_shorter(pixels, 256), 224, 224);  // validation
HostTensor resize_shorter(const HostTensor& hwc, int size, bool antialias = true);
/// torchvision's CenterCrop: the centre height x width of an HWC u8 image (its offsets rounded
/// as torchvision rounds them, half to even); where the image is smaller than the crop it is
/// centred on zeros, as torchvision pads it.
HostTensor center_crop(const HostTensor& hwc, int height, int width);

/// The whole image resized to out_h x out_w, mirrored when `flip` (the flip costs nothing).
HostTensor resize_flipped(const HostTensor& hwc, int out_h, int out_w, bool flip,
                          bool antialias = true);

/// torchvision's RandomResizedCrop + RandomHorizontalFlip, with per-item randomness: the box
/// and the flip depend only on (seed, epoch, item index), so a run is reproducible whatever the
/// thread count or order.
struct AugmentSpec {
  int size = 224;  ///< output height, and width unless `width` is given
  /// Output width where it differs from the height (torchvision's size=(h, w)); 0: `size`.
  /// The crop's box is drawn as for a square (its area and aspect ratio do not depend on the
  /// output), then resized to size x width, as torchvision does.
  int width = 0;
  double scale_min = 0.08, scale_max = 1.0;
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;
  double flip_probability = 0.5;
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  /// The resize of the crop: antialiased when shrinking (Pillow's BILINEAR, what torchvision's
  /// RandomResizedCrop gives on PIL images), or the plain bilinear when false (resize()).
  bool antialias = true;
  /// Scaled decode (decode_random_resized_crop only): when the crop shrinks by 2x or more, decode
  /// it at libjpeg's reduced DCT scale (1/2, 1/4 or 1/8, the largest the shrink allows: what
  /// PIL's Image.draft does; 1/4 at most for 4:2:2, 4:4:0 and 4:1:1 files: decode_denominator)
  /// and resize the rest of the way. large_photos (the default): only
  /// for images of kScaledDecodeMinPixels or more, where full decode is most of the cost;
  /// always; never (the same pixels as decode then RandomResizedCrop). Its quality cost against
  /// full decode is stated in docs/benchmarks.md. Only with `antialias`: the reduced scale is a
  /// filtered shrink, so with antialias false large_photos decodes in full (the same pixels as
  /// decode then the plain bilinear) and always is refused.
  enum class ScaledDecode { never, large_photos, always };
  ScaledDecode scaled_decode = ScaledDecode::large_photos;
};

/// ScaledDecode::large_photos applies to images of at least this many pixels (8 megapixels).
inline constexpr std::int64_t kScaledDecodeMinPixels = 8'000'000;

/// The DCT scale denominator (1, 2, 4 or 8) decode_random_resized_crop decodes a `box` of an
/// `height` x `width` image at, for an output of `size` x `size` (`spec.width` wide when given)
/// under `spec`: the largest, up to `most`, that leaves the decoded crop at least the output's
/// size. The op gives `most` 8 for gray, 4:4:4 and 4:2:0 files (and gray output of YCbCr
/// ones) and 4 for the others (4:2:2, 4:4:0, 4:1:1): at 1/8 each of their chroma samples is one
/// block's DC value, repeated, not interpolated (9 dB of PSNR lost against full decode on 4:2:2
/// photos).
int decode_denominator(const AugmentSpec& spec, int height, int width, const Box& box, int most = 8) noexcept;

/// The largest output side image ops accept (a stated bound: a 16384 x 16384 RGB output is
/// 768 MiB); larger sizes are refused when the op is built.
inline constexpr int kMaxOutputSide = 16384;
/// Decoders refuse images whose header claims more pixels than this (2^28: 768 MiB of RGB),
/// before allocating anything for them: a forged 65535 x 65535 header fails with an error
/// naming the file, not an allocation of gigabytes. A progressive (or multi-scan) file also needs
/// libjpeg's whole-image coefficient buffer (2 bytes a sample); it is held to the same
/// kMaxDecodePixels * 3 bytes, checked from the header too: at most 1.5 GiB in all.
inline constexpr std::int64_t kMaxDecodePixels = std::int64_t{1} << 28;
/// read_file refuses files larger than this (and anything but a regular file).
inline constexpr std::int64_t kMaxFileBytes = std::int64_t{1} << 30;
/// Throws Error naming `op` and the bad value unless: 1 <= size <= kMaxOutputSide (width 0
/// or within the same bounds), scale and
/// ratio finite, positive and min <= max, flip_probability in [0, 1]. The ops' constructors
/// call it, so a bad op fails when it is built, not on each item.
void validate(const AugmentSpec& spec, const char* op);
/// The same for an output size (resize).
void validate_size(int height, int width, const char* op);

/// The crop box and flip one item gets (the algorithm torchvision uses: ten tries at a random
/// area and aspect ratio, then a centre crop).
struct Augment {
  Box box;
  bool flip = false;
};
Augment draw_augment(int height, int width, std::uint64_t index, const AugmentSpec& spec);

/// A stage body: Image -> Image of size x size (size x width), cropped, resized and maybe
/// flipped.
class RandomResizedCrop {
 public:
  explicit RandomResizedCrop(AugmentSpec spec) : spec_(spec) { validate(spec_, "RandomResizedCrop"); }
  Image operator()(Image img) const;

 private:
  AugmentSpec spec_;
};

/// Decodes only `box` of a JPEG (libjpeg's row skipping and column cropping: rows before and
/// after the box are skipped, columns outside it mostly so), the same pixels as that box of
/// decode_jpeg's output. The file is read to its end whatever the box, so a file decode_jpeg
/// refuses (truncated, corrupt) is refused here too. An empty box is the whole image. `height`
/// and `width`, when given, receive the image's size.
HostTensor decode_jpeg_region(const std::uint8_t* data, std::size_t size, Box box,
                              Color color = Color::rgb, const std::string& what = "JPEG data",
                              int* height = nullptr, int* width = nullptr);

/// decode + RandomResizedCrop fused, the way DALI's decoders.image_random_crop does it: the
/// crop is drawn from the header's size, and only its region is decoded. The same pixels as
/// RandomResizedCrop(spec)(decode(file)), for a fraction of the decode, unless the crop is
/// decoded at a reduced scale (AugmentSpec::scaled_decode).
Image decode_random_resized_crop(Encoded file, const AugmentSpec& spec, Color color = Color::rgb);

/// A stage body for decode_random_resized_crop.
class DecodeRandomResizedCrop {
 public:
  explicit DecodeRandomResizedCrop(AugmentSpec spec, Color color = Color::rgb)
      : spec_(spec), color_(color) {
    validate(spec_, "DecodeRandomResizedCrop");
  }
  Image operator()(Encoded file) const { return decode_random_resized_crop(std::move(file), spec_, color_); }

 private:
  AugmentSpec spec_;
  Color color_;
};

/// Stacks equal-shaped HWC u8 images into one NHWC tensor, from `alloc` (a GPU stage's pinned
/// ring, when this body feeds one) or the heap. Throws naming the first image whose shape
/// differs.
HostTensor collate(const std::vector<Image>& images, HostAllocator* alloc = nullptr);
HostTensor collate(const std::vector<HostTensor>& images, HostAllocator* alloc = nullptr);

namespace internal {
/// Whether the `size` bytes at `data` (a JPEG's bytes not yet read, inside its entropy-coded
/// data) reach an end-of-image marker with nothing but entropy-coded bytes (0xFF stuffed as
/// 0xFF 0x00, 0xFF fill bytes) and restart markers before it. A region decode that finds this
/// leaves the rows after the region undecoded: the rest of a single-scan file then cannot run
/// out of data. (Internal; exposed for its test.)
bool jpeg_rest_reaches_the_end_marker(const std::uint8_t* data, std::size_t size) noexcept;
/// A file's bytes for the decoders: throws Error naming `op`, the file and the fix unless they
/// are contiguous u8 (JPEG bytes given from Python as int8 or float read as u8 failed with
/// "tensor i8[61306] host accessed as u8", naming neither: a new user's trial).
const std::uint8_t* encoded_bytes(const char* op, const Encoded& file);
}  // namespace internal

}  // namespace splitflow::image
