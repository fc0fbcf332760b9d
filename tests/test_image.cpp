// Image input ops (splitflow/ops/image.hpp), the bodies of CPU stages that read images. The
// data is made here, at test time: random images encoded with libturbojpeg, plus truncated,
// garbage and empty files. Checks docs/api.md, "Objects and options" (image resize) and
// "Conventions" (Resize filter), and docs/architecture.md, "Targets" (splitflow::ops). Each
// test names what it checks.
#include <gtest/gtest.h>

#include "sanitizers.hpp"

#include <optional>
#include <cstdio>  // before jpeglib.h, which needs FILE
#include <jpeglib.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <splitflow/ops/image.hpp>
#include <splitflow/splitflow.hpp>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

using namespace splitflow;
namespace fs = std::filesystem;

namespace {

// A smooth random image (gradients plus noise): JPEG-friendly, and different per seed.
std::vector<std::uint8_t> random_pixels(int h, int w, int c, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> noise(-20, 20), base(0, 255);
  const int b0 = base(gen), b1 = base(gen);
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h) * w * c);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k) {
        const int v = (b0 * x / std::max(w, 1) + b1 * y / std::max(h, 1) + 60 * k + noise(gen)) % 256;
        px[(static_cast<std::size_t>(y) * w + x) * c + k] = static_cast<std::uint8_t>(std::abs(v));
      }
  return px;
}

std::vector<std::uint8_t> encode(const std::vector<std::uint8_t>& px, int h, int w, int c,
                                 int quality = 90, int subsampling = TJSAMP_420) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(tj, px.data(), w, 0, h, c == 3 ? TJPF_RGB : TJPF_GRAY, &buf, &size,
                             c == 3 ? subsampling : TJSAMP_GRAY, quality, 0);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(tj);
  std::vector<std::uint8_t> out(buf, buf + size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

// An RGB JPEG with the luma sampled h_samp x v_samp against 1x1 chroma (libjpeg's encoder takes
// factors TurboJPEG's names do not cover, as cameras' files sometimes have).
std::vector<std::uint8_t> encode_sampled(const std::vector<std::uint8_t>& px, int h, int w, int h_samp,
                                         int v_samp, bool arithmetic = false) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = static_cast<JDIMENSION>(w);
  c.image_height = static_cast<JDIMENSION>(h);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 92, TRUE);
  c.comp_info[0].h_samp_factor = h_samp;
  c.comp_info[0].v_samp_factor = v_samp;
  for (int k : {1, 2}) c.comp_info[k].h_samp_factor = c.comp_info[k].v_samp_factor = 1;
  c.arith_code = arithmetic ? TRUE : FALSE;
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<std::uint8_t*>(px.data()) + static_cast<std::size_t>(c.next_scanline) * w * 3;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<std::uint8_t> out(buf, buf + size);
  jpeg_destroy_compress(&c);
  std::free(buf);
  return out;
}

// libturbojpeg's own decode, for comparison.
std::vector<std::uint8_t> tj_decode(const std::vector<std::uint8_t>& jpeg, int pf, int& h, int& w) {
  tjhandle tj = tjInitDecompress();
  int ss = 0, cs = 0;
  tjDecompressHeader3(tj, jpeg.data(), jpeg.size(), &w, &h, &ss, &cs);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(h) * w * tjPixelSize[pf]);
  EXPECT_EQ(tjDecompress2(tj, jpeg.data(), jpeg.size(), out.data(), w, 0, h, pf, 0), 0);
  tjDestroy(tj);
  return out;
}

void write_file(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::uint8_t> bytes_of(const HostTensor& t) {
  const auto* p = static_cast<const std::uint8_t*>(t.raw());
  return {p, p + t.nbytes()};
}

HostTensor tensor_of(const std::vector<std::uint8_t>& px, int h, int w, int c) {
  HostTensor t = HostTensor::empty(DType::u8, {h, w, c});
  std::memcpy(t.raw(), px.data(), px.size());
  return t;
}

// A scratch directory removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("splitflow-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// The straightforward bilinear reference: half-pixel centres, clamped, in doubles.
std::vector<std::uint8_t> reference_resize(const std::vector<std::uint8_t>& px, int W, int C,
                                           image::Box b, int oh, int ow) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(oh) * ow * C);
  const auto at = [&](int y, int x, int k) { return px[(static_cast<std::size_t>(y) * W + x) * C + k]; };
  for (int oy = 0; oy < oh; ++oy) {
    const double sy = std::clamp((oy + 0.5) * b.h / oh - 0.5, 0.0, b.h - 1.0);
    const int y0 = static_cast<int>(sy), y1 = std::min(y0 + 1, b.h - 1);
    for (int ox = 0; ox < ow; ++ox) {
      const double sx = std::clamp((ox + 0.5) * b.w / ow - 0.5, 0.0, b.w - 1.0);
      const int x0 = static_cast<int>(sx), x1 = std::min(x0 + 1, b.w - 1);
      for (int k = 0; k < C; ++k) {
        const double top = at(b.y + y0, b.x + x0, k) * (1 - (sx - x0)) + at(b.y + y0, b.x + x1, k) * (sx - x0);
        const double bot = at(b.y + y1, b.x + x0, k) * (1 - (sx - x0)) + at(b.y + y1, b.x + x1, k) * (sx - x0);
        out[(static_cast<std::size_t>(oy) * ow + ox) * C + k] =
            static_cast<std::uint8_t>(std::lround(top * (1 - (sy - y0)) + bot * (sy - y0)));
      }
    }
  }
  return out;
}

// ---- antialiased resize: patterns and the reference ------------------------------------------

// A 32-bit mixer (lowbias32). Patterns made from it are the same with every standard library
// (std's distributions are not), so outputs can be pinned to values computed once with Pillow.
std::uint32_t hash32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Byte i of the HWC image is hash32(i + seed * 0x9e3779b9) >> 24: white noise, the most
// high-frequency content there is. (Python: the same with numpy uint32 arithmetic.)
std::vector<std::uint8_t> noise_pixels(int h, int w, int c, std::uint32_t seed) {
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h) * w * c);
  for (std::size_t i = 0; i < px.size(); ++i)
    px[i] = static_cast<std::uint8_t>(hash32(static_cast<std::uint32_t>(i) + seed * 0x9e3779b9U) >> 24);
  return px;
}

// A photo-like RGB image: smooth shading, blocks with sharp edges, grain.
std::vector<std::uint8_t> photo_like_pixels(int h, int w) {
  std::vector<std::uint8_t> px(std::size_t(h) * w * 3);
  const auto noise = noise_pixels(h, w, 3, 9);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        const std::size_t i = (std::size_t(y) * w + x) * 3 + c;
        double v = 120 + 60 * std::sin(x / 90.0 + c) * std::cos(y / 70.0);
        if ((x / 160 + y / 120) % 3 == 0) v += 50;  // blocks with sharp edges
        px[i] = static_cast<std::uint8_t>(std::clamp(v + (noise[i] - 128) / 16.0, 0.0, 255.0));
      }
  return px;
}

HostTensor tensor_of_bytes(const std::vector<std::uint8_t>& bytes) {
  HostTensor b = HostTensor::empty(DType::u8, {std::int64_t(bytes.size())});
  std::memcpy(b.raw(), bytes.data(), bytes.size());
  return b;
}

// The PSNR of two u8 images of one shape (99 where they are equal).
double psnr(const HostTensor& a, const HostTensor& b) {
  const auto x = bytes_of(a), y = bytes_of(b);
  EXPECT_EQ(x.size(), y.size());
  double mse = 0;
  for (std::size_t k = 0; k < x.size() && k < y.size(); ++k) mse += (double(x[k]) - y[k]) * (double(x[k]) - y[k]);
  mse /= static_cast<double>(std::max<std::size_t>(x.size(), 1));
  return mse == 0 ? 99 : 10 * std::log10(255.0 * 255.0 / mse);
}

std::uint64_t fnv1a(const std::vector<std::uint8_t>& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Squares of `period` pixels, the channels in different phases.
std::vector<std::uint8_t> checkerboard(int h, int w, int c, int period) {
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h) * w * c);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k) {
        const bool on = ((y / period + x / period + k) % 2) != 0;
        px[(static_cast<std::size_t>(y) * w + x) * c + k] = on ? 255 : static_cast<std::uint8_t>(k * 20);
      }
  return px;
}

// A zone plate: rings whose frequency rises to the pixel pitch at the edges.
std::vector<std::uint8_t> zone_plate(int h, int w, int c) {
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h) * w * c);
  const double pi = 3.14159265358979323846, n = std::max(h, w);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const double r2 = (x - w / 2.0) * (x - w / 2.0) + (y - h / 2.0) * (y - h / 2.0);
      for (int k = 0; k < c; ++k)
        px[(static_cast<std::size_t>(y) * w + x) * c + k] =
            static_cast<std::uint8_t>(std::lround(127.5 + 127.5 * std::cos(pi * r2 / n * (1 - 0.3 * k))));
    }
  return px;
}

// Fine text: lines of 3x5-pixel glyphs (random strokes of one pixel) in 4x6 cells, dark ink of
// varying colour on a light page.
std::vector<std::uint8_t> fine_text(int h, int w, int c) {
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h) * w * c, 245);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const int cell = (y / 6) * (w / 4 + 1) + x / 4, gx = x % 4, gy = y % 6;
      if (gx == 3 || gy == 5) continue;  // the gaps between letters and lines
      if (((hash32(static_cast<std::uint32_t>(cell)) >> (gy * 3 + gx)) & 1U) == 0) continue;
      for (int k = 0; k < c; ++k)
        px[(static_cast<std::size_t>(y) * w + x) * c + k] =
            static_cast<std::uint8_t>(hash32(static_cast<std::uint32_t>(cell * 3 + k)) % 90);
    }
  return px;
}

// The straightforward antialiased resize, in doubles: per side, output o's centre in the box is
// (o + 0.5) * scale; source pixel i weighs max(0, 1 - |i + 0.5 - centre| / max(scale, 1)), the
// weights normalised over the box's pixels; horizontal, then vertical, rounded once at the end.
std::vector<std::pair<int, std::vector<double>>> triangle_weights(int len, int n) {
  const double scale = static_cast<double>(len) / n, support = std::max(scale, 1.0);
  std::vector<std::pair<int, std::vector<double>>> out;
  for (int o = 0; o < n; ++o) {
    const double centre = (o + 0.5) * scale;
    const int lo = std::max(0, static_cast<int>(std::floor(centre - support)) - 1);
    const int hi = std::min(len, static_cast<int>(std::ceil(centre + support)) + 1);
    std::vector<double> w;
    double sum = 0;
    for (int i = lo; i < hi; ++i) {
      w.push_back(std::max(0.0, 1.0 - std::abs(i + 0.5 - centre) / support));
      sum += w.back();
    }
    for (double& v : w) v /= sum;
    out.emplace_back(lo, std::move(w));
  }
  return out;
}

std::vector<std::uint8_t> reference_antialiased(const std::vector<std::uint8_t>& px, int W, int C,
                                                image::Box b, int oh, int ow) {
  const auto wx = triangle_weights(b.w, ow), wy = triangle_weights(b.h, oh);
  std::vector<double> mid(static_cast<std::size_t>(b.h) * ow * C, 0.0);
  for (int y = 0; y < b.h; ++y)
    for (int ox = 0; ox < ow; ++ox)
      for (int k = 0; k < C; ++k) {
        double v = 0;
        const auto& [lo, w] = wx[static_cast<std::size_t>(ox)];
        for (std::size_t t = 0; t < w.size(); ++t)
          v += w[t] * px[(static_cast<std::size_t>(b.y + y) * W + b.x + lo + static_cast<int>(t)) * C + k];
        mid[(static_cast<std::size_t>(y) * ow + ox) * C + k] = v;
      }
  std::vector<std::uint8_t> out(static_cast<std::size_t>(oh) * ow * C);
  for (int oy = 0; oy < oh; ++oy)
    for (int ox = 0; ox < ow; ++ox)
      for (int k = 0; k < C; ++k) {
        double v = 0;
        const auto& [lo, w] = wy[static_cast<std::size_t>(oy)];
        for (std::size_t t = 0; t < w.size(); ++t)
          v += w[t] * mid[(static_cast<std::size_t>(lo + static_cast<int>(t)) * ow + ox) * C + k];
        out[(static_cast<std::size_t>(oy) * ow + ox) * C + k] =
            static_cast<std::uint8_t>(std::clamp(std::lround(v), 0L, 255L));
      }
  return out;
}

int max_difference(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  int worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::abs(int(a[i]) - int(b[i])));
  return a.size() == b.size() ? worst : 256;
}

std::string fmt_name(int i) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "img_%03d.jpg", i);
  return buf;
}

}  // namespace

// "decode matches libturbojpeg's own output exactly" (RGB, gray, RGB read as gray; odd sizes)
TEST(ImageDecode, MatchesLibturbojpegExactly) {
  const int sizes[][2] = {{375, 500}, {17, 33}, {1, 1}, {64, 48}};
  unsigned seed = 1;
  for (auto [h, w] : sizes) {
    for (int c : {3, 1}) {
      const auto jpeg = encode(random_pixels(h, w, c, seed++), h, w, c);
      for (image::Color color : {image::Color::rgb, image::Color::gray}) {
        const HostTensor got = image::decode_jpeg(jpeg.data(), jpeg.size(), color, "x.jpg");
        int th = 0, tw = 0;
        const auto want = tj_decode(jpeg, color == image::Color::rgb ? TJPF_RGB : TJPF_GRAY, th, tw);
        ASSERT_EQ(got.shape(), (std::vector<std::int64_t>{th, tw, color == image::Color::rgb ? 3 : 1}));
        EXPECT_EQ(bytes_of(got), want) << h << "x" << w << " c" << c;
      }
    }
  }
  // And it is an image of what was encoded: at quality 100, close to the original.
  const auto px = random_pixels(40, 56, 3, 99);
  const auto jpeg = encode(px, 40, 56, 3, 100, TJSAMP_444);
  const auto got = bytes_of(image::decode_jpeg(jpeg.data(), jpeg.size()));
  double err = 0;
  for (std::size_t i = 0; i < px.size(); ++i) err += std::abs(int(got[i]) - int(px[i]));
  EXPECT_LT(err / px.size(), 8.0);
}

// Region decode: "the same pixels as that box of decode_jpeg's output", for boxes at edges and
// odd offsets, 4:2:0, 4:4:4 and gray; and the fused decode + crop equals crop(decode()).
TEST(ImageDecode, RegionsAndTheFusedCropEqualTheFullDecode) {
  std::mt19937 gen(17);
  for (int trial = 0; trial < 24; ++trial) {
    const int h = 40 + static_cast<int>(gen() % 400), w = 40 + static_cast<int>(gen() % 500);
    const int c = trial % 4 == 3 ? 1 : 3;
    const int samp = trial % 2 ? TJSAMP_444 : TJSAMP_420;
    const auto jpeg = encode(random_pixels(h, w, c, 200 + trial), h, w, c, 90, samp);
    const image::Color color = c == 3 ? image::Color::rgb : image::Color::gray;
    const HostTensor full = image::decode_jpeg(jpeg.data(), jpeg.size(), color, "f.jpg");
    const int C = c == 3 ? 3 : 1;
    std::vector<image::Box> boxes = {{0, 0, h, w}, {h - 1, w - 1, 1, 1}, {0, w / 2, h / 3, w - w / 2}};
    for (int k = 0; k < 4; ++k) {
      const int bh = 1 + static_cast<int>(gen() % h), bw = 1 + static_cast<int>(gen() % w);
      boxes.push_back({static_cast<int>(gen() % (h - bh + 1)), static_cast<int>(gen() % (w - bw + 1)), bh, bw});
    }
    for (const image::Box& b : boxes) {
      int H = 0, W = 0;
      const HostTensor region = image::decode_jpeg_region(jpeg.data(), jpeg.size(), b, color, "f.jpg", &H, &W);
      ASSERT_EQ(H, h);
      ASSERT_EQ(W, w);
      ASSERT_EQ(region.shape(), (std::vector<std::int64_t>{b.h, b.w, C}));
      const auto* f = static_cast<const std::uint8_t*>(full.raw());
      const auto* r = static_cast<const std::uint8_t*>(region.raw());
      for (int y = 0; y < b.h; ++y)
        ASSERT_EQ(0, std::memcmp(r + std::size_t(y) * b.w * C, f + (std::size_t(b.y + y) * w + b.x) * C, std::size_t(b.w) * C))
            << "trial " << trial << " box y" << b.y << " x" << b.x << " h" << b.h << " w" << b.w << " row " << y;
    }
    for (bool antialias : {true, false}) {
      const image::AugmentSpec spec{.size = 64, .seed = 3, .epoch = std::uint64_t(trial), .antialias = antialias};
      for (std::uint64_t i = 0; i < 4; ++i) {
        HostTensor bytes = HostTensor::empty(DType::u8, {std::int64_t(jpeg.size())});
        std::memcpy(bytes.raw(), jpeg.data(), jpeg.size());
        const image::Image fused = image::decode_random_resized_crop({i, "f.jpg", bytes}, spec, color);
        const image::Image two = image::RandomResizedCrop(spec)({i, "f.jpg", full});
        ASSERT_EQ(bytes_of(fused.pixels), bytes_of(two.pixels))
            << "trial " << trial << " item " << i << " antialias " << antialias;
      }
    }
  }
  const auto jpeg = encode(random_pixels(50, 60, 3, 1), 50, 60, 3);
  EXPECT_THROW(image::decode_jpeg_region(jpeg.data(), jpeg.size(), {40, 0, 20, 10}), Error);
  const std::vector<std::uint8_t> cut(jpeg.begin(), jpeg.begin() + jpeg.size() * 2 / 3);
  try {
    image::decode_jpeg_region(cut.data(), cut.size(), {45, 0, 5, 60}, image::Color::rgb, "cut.jpg");
    FAIL() << "a truncated file decoded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'cut.jpg'"), std::string::npos) << e.what();
  }
}

// A 4-component JPEG (TurboJPEG writes CMYK pixels as YCCK with an Adobe marker) decodes as PIL
// converts it (Image.convert("RGB"), "L": Pillow's cmyk2rgb and rgb2l of the inverted samples,
// written out here with PIL's rounding; python/tests/test_image.py checks PIL itself), and every
// region and the fused crop equal the full decode. Before: "Unsupported color conversion request".
TEST(ImageDecode, CmykAndYcckFilesDecodeAsPilConvertsThem) {
  const int h = 77, w = 130;
  const auto cmyk = random_pixels(h, w, 4, 5);
  for (int samp : {TJSAMP_444, TJSAMP_420}) {
    tjhandle tj = tjInitCompress();
    unsigned char* buf = nullptr;
    unsigned long size = 0;
    ASSERT_EQ(tjCompress2(tj, cmyk.data(), w, 0, h, TJPF_CMYK, &buf, &size, samp, 90, 0), 0);
    const std::vector<std::uint8_t> jpeg(buf, buf + size);
    tjFree(buf);
    tjDestroy(tj);
    int H = 0, W = 0;
    const auto stored = tj_decode(jpeg, TJPF_CMYK, H, W);  // libjpeg's CMYK samples, as stored
    ASSERT_EQ(H, h);
    std::vector<std::uint8_t> rgb(std::size_t(h) * w * 3), gray(std::size_t(h) * w);
    for (std::size_t i = 0; i < gray.size(); ++i) {
      const int nk = stored[i * 4 + 3];  // PIL: K = 255 - stored, 255 - K = stored
      int v[3];
      for (int c = 0; c < 3; ++c) {
        const int t = (255 - stored[i * 4 + c]) * nk + 128;
        v[c] = nk - (((t >> 8) + t) >> 8);
        rgb[i * 3 + c] = static_cast<std::uint8_t>(v[c]);
      }
      gray[i] = static_cast<std::uint8_t>((v[0] * 19595 + v[1] * 38470 + v[2] * 7471 + 0x8000) >> 16);
    }
    for (image::Color color : {image::Color::rgb, image::Color::gray}) {
      const int C = color == image::Color::rgb ? 3 : 1;
      const HostTensor full = image::decode_jpeg(jpeg.data(), jpeg.size(), color, "cmyk.jpg");
      ASSERT_EQ(full.shape(), (std::vector<std::int64_t>{h, w, C}));
      ASSERT_EQ(bytes_of(full), C == 3 ? rgb : gray) << "sampling " << samp;
      for (const image::Box b : {image::Box{0, 0, h, w}, image::Box{h - 1, w - 1, 1, 1},
                                 image::Box{13, 37, 40, 61}, image::Box{50, 0, 27, 9}}) {
        const HostTensor region = image::decode_jpeg_region(jpeg.data(), jpeg.size(), b, color, "cmyk.jpg");
        const auto* f = static_cast<const std::uint8_t*>(full.raw());
        std::vector<std::uint8_t> want;
        for (int y = 0; y < b.h; ++y)
          want.insert(want.end(), f + (std::size_t(b.y + y) * w + b.x) * C, f + (std::size_t(b.y + y) * w + b.x + b.w) * C);
        ASSERT_EQ(bytes_of(region), want) << "box y" << b.y << " x" << b.x << " sampling " << samp;
      }
      const image::AugmentSpec spec{.size = 48, .seed = 8, .epoch = 1};
      for (std::uint64_t i = 0; i < 6; ++i) {
        HostTensor bytes = HostTensor::empty(DType::u8, {std::int64_t(jpeg.size())});
        std::memcpy(bytes.raw(), jpeg.data(), jpeg.size());
        const image::Image fused = image::decode_random_resized_crop({i, "cmyk.jpg", bytes}, spec, color);
        const image::Image two = image::RandomResizedCrop(spec)({i, "cmyk.jpg", full});
        ASSERT_EQ(bytes_of(fused.pixels), bytes_of(two.pixels)) << "item " << i;
      }
    }
  }
}

// TurboJPEG 2.x refuses a header whose sampling factors it has no name for ("Could not
// determine subsampling type"); PIL decodes such files (libjpeg), and so does decode_jpeg now,
// to the pixels the region decode and the fused crop give. Before: decode_jpeg refused them
// while decode_jpeg_region decoded them (found by the region fuzz target's new check).
TEST(ImageDecode, SamplingFactorsTurboJpegHasNoNameForAreDecodedAsLibjpegDoes) {
  const int h = 48, w = 64;
  std::vector<std::uint8_t> px(std::size_t(h) * w * 3);  // smooth: what chroma subsampling keeps
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < 3; ++k) px[(std::size_t(y) * w + x) * 3 + k] = static_cast<std::uint8_t>(20 + 2 * x + y + 30 * k);  // <= 253
  for (const auto& [hs, vs] : {std::pair{4, 2}, std::pair{3, 1}, std::pair{1, 3}}) {
    SCOPED_TRACE("luma sampled " + std::to_string(hs) + "x" + std::to_string(vs));
    const auto jpeg = encode_sampled(px, h, w, hs, vs);
    {
      tjhandle tj = tjInitDecompress();
      int th = 0, tw = 0, ss = 0, cs = 0;
      EXPECT_NE(tjDecompressHeader3(tj, jpeg.data(), jpeg.size(), &tw, &th, &ss, &cs), 0);
      tjDestroy(tj);
    }
    const HostTensor full = image::decode_jpeg(jpeg.data(), jpeg.size(), image::Color::rgb, "odd.jpg");
    ASSERT_EQ(full.shape(), (std::vector<std::int64_t>{h, w, 3}));
    const auto* f = static_cast<const std::uint8_t*>(full.raw());
    double sq = 0;
    for (std::size_t i = 0; i < px.size(); ++i) sq += (double(f[i]) - px[i]) * (double(f[i]) - px[i]);
    EXPECT_GT(10 * std::log10(255.0 * 255.0 / (sq / double(px.size()))), 30.0);  // the image, not grey
    const HostTensor whole = image::decode_jpeg_region(jpeg.data(), jpeg.size(), {0, 0, h, w},
                                                       image::Color::rgb, "odd.jpg");
    EXPECT_EQ(bytes_of(whole), bytes_of(full));
    const image::Box b{13, 21, 17, 29};
    const HostTensor part = image::decode_jpeg_region(jpeg.data(), jpeg.size(), b, image::Color::rgb, "odd.jpg");
    for (int y = 0; y < b.h; ++y)
      ASSERT_EQ(0, std::memcmp(static_cast<const std::uint8_t*>(part.raw()) + std::size_t(y) * b.w * 3,
                               f + (std::size_t(b.y + y) * w + b.x) * 3, std::size_t(b.w) * 3)) << "row " << y;
  }
}

// A region decode leaves the rows after the region undecoded only when the file's remaining
// bytes reach the end marker through entropy-coded data and restart markers alone (else it
// decodes them, so that a file cut short is refused whatever the region).
TEST(ImageDecode, TheRestOfAFileCountsAsCompleteOnlyWhenItReachesTheEndMarker) {
  const auto reaches = [](std::initializer_list<std::uint8_t> b) {
    const std::vector<std::uint8_t> v(b);
    return image::internal::jpeg_rest_reaches_the_end_marker(v.data(), v.size());
  };
  EXPECT_TRUE(reaches({0xFF, 0xD9}));
  EXPECT_TRUE(reaches({0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD3, 0x56, 0xFF, 0xFF, 0xD9}));  // stuffed, RST3, fill
  EXPECT_TRUE(reaches({0x12, 0xFF, 0xD9, 0xFF}));         // what follows the end marker is not read
  EXPECT_FALSE(reaches({}));
  EXPECT_FALSE(reaches({0x12, 0x34, 0x56}));              // cut short in the data
  EXPECT_FALSE(reaches({0x12, 0xFF}));                    // cut short in a marker
  EXPECT_FALSE(reaches({0x12, 0xFF, 0xFF}));              // ... in its fill bytes
  EXPECT_FALSE(reaches({0x12, 0xFF, 0x00}));              // a stuffed 0xFF at the very end
  EXPECT_FALSE(reaches({0x12, 0xFF, 0xFE, 0x00, 0x04, 0xFF, 0xD9}));  // a comment before the end
  EXPECT_FALSE(reaches({0x12, 0xFF, 0xDA, 0x00, 0x08, 0xFF, 0xD9}));  // a second scan
  EXPECT_FALSE(reaches({0x12, 0xFF, 0xDC, 0x00, 0x04, 0x00, 0x10, 0xFF, 0xD9}));  // DNL
  EXPECT_FALSE(reaches({0x12, 0xFF, 0x01, 0xFF, 0xD9}));  // TEM: a marker in the data
}

// A file decode_jpeg refuses is refused by the region decode and the fused crop whatever the
// region (a new user's report: a file truncated at 90% was accepted by the fused crop in 18
// epochs of 40, refused in the others, so a skip policy kept it or dropped it by epoch), and a
// file it decodes decodes in every region to the full decode's pixels. Which files: as PIL,
// a file cut short is refused ("image file is truncated"), one with junk before the end marker
// or corrupt data is decoded (it decodes them; python/tests/test_image.py checks the pixels
// against PIL's). Before: junk and corrupt data were refused, and at first found only at the end.
// A region decode stops after its rows where the rest of the file reaches the end marker; a
// comment segment before that marker (comment.jpg) makes it read the file to its end instead.
TEST(ImageDecode, EveryRegionOfADamagedFileIsRefusedOrDecodedAsTheFullDecode) {
  const int h = 240, w = 320;
  const auto jpeg = encode(random_pixels(h, w, 3, 41), h, w, 3, 90, TJSAMP_420);
  auto cut = [&](double f) {
    return std::vector<std::uint8_t>(jpeg.begin(), jpeg.begin() + static_cast<std::ptrdiff_t>(f * double(jpeg.size())));
  };
  std::vector<std::uint8_t> junk = jpeg;  // 50 bytes before the end marker
  junk.insert(junk.end() - 2, 50, std::uint8_t{0x5a});
  std::vector<std::uint8_t> comment = jpeg;  // a marker segment between the scan and the end
  const std::uint8_t com[] = {0xFF, 0xFE, 0x00, 0x06, 'n', 'o', 't', 'e'};
  comment.insert(comment.end() - 2, std::begin(com), std::end(com));
  std::vector<std::uint8_t> flipped = jpeg;  // bytes of the last rows' data inverted
  for (std::size_t i = jpeg.size() - 300; i < jpeg.size() - 250; ++i) flipped[i] = static_cast<std::uint8_t>(~flipped[i]);
  const struct {
    const char* name;
    std::vector<std::uint8_t> bytes;
    bool refused;
    bool intact_pixels = false;  // the damage lies past the image's data
  } cases[] = {{"cut60.jpg", cut(0.6), true},   {"cut90.jpg", cut(0.9), true},
               {"cut98.jpg", cut(0.98), true},  {"noeoi.jpg", cut(1.0 - 2.0 / double(jpeg.size())), true},
               {"junk.jpg", junk, false, true}, {"comment.jpg", comment, false, true},
               {"flipped.jpg", flipped, false}};
  const HostTensor intact = image::decode_jpeg(jpeg.data(), jpeg.size(), image::Color::rgb, "ok.jpg");
  for (const auto& c : cases) {
    std::optional<HostTensor> full;
    try {
      full = image::decode_jpeg(c.bytes.data(), c.bytes.size(), image::Color::rgb, c.name);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + c.name + "': Premature end of JPEG file"),
                std::string::npos) << e.what();
      // The fix, as for bytes that are no JPEG (a new user's trial: a truncated file's error
      // did not say it).
      EXPECT_NE(std::string(e.what()).find("(320x240); on_error skip or substitute on its stage (Python: "
                                           "on_error='skip', substitute=) drops or replaces such a file"),
                std::string::npos) << e.what();
    }
    ASSERT_EQ(!full, c.refused) << c.name;
    if (full) {
      ASSERT_EQ(full->shape(), intact.shape());
      EXPECT_EQ(bytes_of(*full) == bytes_of(intact), c.intact_pixels) << c.name;
    }
    // Regions at the top (where the damage is not), in the middle and at the bottom.
    for (const image::Box b : {image::Box{0, 0, 8, w}, image::Box{0, 0, h / 4, w / 4},
                               image::Box{h / 2, w / 2, 16, 16}, image::Box{h - 8, 0, 8, w}}) {
      std::optional<HostTensor> region;
      try {
        region = image::decode_jpeg_region(c.bytes.data(), c.bytes.size(), b, image::Color::rgb, c.name);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("'") + c.name + "'"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("on_error skip or substitute"), std::string::npos) << e.what();
      }
      ASSERT_EQ(!region, c.refused) << c.name << " box y" << b.y << " x" << b.x << " h" << b.h;
      if (!region) continue;
      const auto* f = static_cast<const std::uint8_t*>(full->raw());
      const auto* r = static_cast<const std::uint8_t*>(region->raw());
      for (int y = 0; y < b.h; ++y)
        ASSERT_EQ(0, std::memcmp(r + std::size_t(y) * b.w * 3, f + (std::size_t(b.y + y) * w + b.x) * 3, std::size_t(b.w) * 3))
            << c.name << " box y" << b.y << " x" << b.x << " row " << y;
    }
    HostTensor bytes = HostTensor::empty(DType::u8, {std::int64_t(c.bytes.size())});
    std::memcpy(bytes.raw(), c.bytes.data(), c.bytes.size());
    for (std::uint64_t epoch = 0; epoch < 20; ++epoch) {
      const image::AugmentSpec spec{.size = 32, .seed = 9, .epoch = epoch};
      std::optional<image::Image> fused;
      try {
        fused = image::decode_random_resized_crop({0, c.name, bytes}, spec, image::Color::rgb);
      } catch (const Error&) {
      }
      ASSERT_EQ(!fused, c.refused) << c.name << " epoch " << epoch;
      if (fused) {
        EXPECT_EQ(bytes_of(fused->pixels), bytes_of(image::RandomResizedCrop(spec)({0, c.name, *full}).pixels))
            << c.name << " epoch " << epoch;
      }
    }
  }
  // An intact file still decodes in every region, equal to the full decode's rows.
  const HostTensor top = image::decode_jpeg_region(jpeg.data(), jpeg.size(), {0, 0, 8, w}, image::Color::rgb, "ok.jpg");
  EXPECT_EQ(0, std::memcmp(top.raw(), intact.raw(), std::size_t(8) * w * 3));
}

// "reports truncated or corrupt files as errors" naming the file
TEST(ImageDecode, TruncatedGarbageAndEmptyFilesAreErrorsNamingTheFile) {
  const auto jpeg = encode(random_pixels(120, 160, 3, 5), 120, 160, 3);
  const std::vector<std::uint8_t> truncated(jpeg.begin(), jpeg.begin() + jpeg.size() / 2);
  std::vector<std::uint8_t> garbage(4000);
  std::mt19937 gen(3);
  for (auto& b : garbage) b = static_cast<std::uint8_t>(gen());
  struct Case {
    const char* name;
    std::vector<std::uint8_t> bytes;
  } cases[] = {{"half.jpg", truncated},
               {"tables_only.jpg", std::vector<std::uint8_t>(jpeg.begin(), jpeg.begin() + 200)},
               {"noise.jpg", garbage},
               {"empty.jpg", {}}};
  for (const auto& c : cases) {
    try {
      image::decode_jpeg(c.bytes.data(), c.bytes.size(), image::Color::rgb, c.name);
      ADD_FAILURE() << c.name << " decoded without an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + c.name + "'"), std::string::npos) << e.what();
    }
    // Bad data leaves this thread's decoder fit for the next file (a tables-only stream once
    // made the next header read as 0x0).
    const HostTensor next = image::decode_jpeg(jpeg.data(), jpeg.size(), image::Color::rgb, "good.jpg");
    EXPECT_EQ(next.shape(), (std::vector<std::int64_t>{120, 160, 3})) << "after " << c.name;
  }
}

// A torchvision user's trial (2026-12-05): the same damaged bytes were worded differently by
// decode_jpeg (TurboJPEG's "missing SOS marker") and the fused op (libjpeg's "Premature end of
// JPEG file"), and bytes without a file name (an array from Python) read "decode_jpeg: '': ...".
// Both ops now say the same of the same bytes, and an unnamed file is not quoted. Each names
// itself (a verification trial, 2026-12-07: the fused op's errors said decode_jpeg).
namespace {
// `message` with the fused op's name where decode_jpeg's own says decode_jpeg.
std::string as_fused(std::string message) {
  for (std::size_t at = 0; (at = message.find("decode_jpeg", at)) != std::string::npos;) {
    message.replace(at, 11, "decode_random_resized_crop");
    at += 26;
  }
  return message;
}
}  // namespace

TEST(ImageDecode, DecodeAndTheFusedCropWordTheSameDamagedBytesAlike) {
  const auto jpeg = encode(random_pixels(120, 160, 3, 5), 120, 160, 3);
  const std::vector<std::vector<std::uint8_t>> cases = {
      std::vector<std::uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2),
      std::vector<std::uint8_t>(jpeg.begin(), jpeg.begin() + 300),
      std::vector<std::uint8_t>(jpeg.begin(), jpeg.begin() + 200),
      std::vector<std::uint8_t>(40, 0x68)};
  const image::DecodeRandomResizedCrop fused({.size = 32});
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    for (const std::string name : {"", "d.jpg"}) {
      const auto& bytes = cases[i];
      const std::string plain = message([&] {
        image::decode_jpeg(bytes.data(), bytes.size(), image::Color::rgb, name);
      });
      const std::string crop = message([&] {
        HostTensor t = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(bytes.size())});
        std::copy(bytes.begin(), bytes.end(), t.data<std::uint8_t>());
        fused(image::Encoded{0, name, t});
      });
      EXPECT_EQ(as_fused(plain), crop) << "case " << i;
      EXPECT_EQ(crop.rfind("splitflow::image::decode_random_resized_crop: ", 0), 0u) << crop;
      EXPECT_EQ(crop.find("decode_jpeg"), std::string::npos) << crop;
      EXPECT_EQ(plain.rfind(name.empty() ? "splitflow::image::decode_jpeg: "
                                         : "splitflow::image::decode_jpeg: 'd.jpg': ",
                            0),
                0u)
          << plain;
      EXPECT_EQ(plain.find("''"), std::string::npos) << plain;
    }
  }
}

// A new user's trial: a PNG named .jpg (which PIL, and so torchvision, decodes) failed as "not a
// readable JPEG (Not a JPEG file: starts with 0x89 0x50)", and a corrupt file failed the run
// without saying that on_error lets it go on. Both ops name what the bytes are and the fix.
TEST(ImageDecode, BytesThatAreNoJpegAreNamedAndTheFixSaid) {
  const image::DecodeRandomResizedCrop fused({.size = 32});
  struct Case {
    std::vector<std::uint8_t> bytes;
    const char* kind;  // nullptr: unknown bytes
  };
  auto bytes_of = [](std::string_view s) { return std::vector<std::uint8_t>(s.begin(), s.end()); };
  std::vector<Case> cases = {
      {bytes_of(std::string_view("\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x10", 20)), "a PNG"},
      {bytes_of("GIF89a\x10\0\x10\0"), "a GIF"},
      {bytes_of(std::string_view("RIFF\x24\0\0\0WEBPVP8 ", 16)), "a WebP"},
      {bytes_of(std::string_view("MM\0*\0\0\0\x08\0\0", 10)), "a TIFF"},
      {bytes_of(std::string_view("II*\0\x08\0\0\0\0\0", 10)), "a TIFF"},
      {bytes_of("MMMMMMMMMM"), nullptr},  // (not a TIFF: its signature is 4 bytes)
      {std::vector<std::uint8_t>(64, 0x68), nullptr}};
  for (const Case& c : cases) {
    std::string plain, crop;
    try {
      image::decode_jpeg(c.bytes.data(), c.bytes.size(), image::Color::rgb, "photos/x.jpg");
    } catch (const Error& e) {
      plain = e.what();
    }
    try {
      HostTensor t = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(c.bytes.size())});
      std::copy(c.bytes.begin(), c.bytes.end(), t.data<std::uint8_t>());
      fused(image::Encoded{0, "photos/x.jpg", t});
    } catch (const Error& e) {
      crop = e.what();
    }
    EXPECT_EQ(as_fused(plain), crop);
    EXPECT_EQ(crop.rfind("splitflow::image::decode_random_resized_crop: 'photos/x.jpg': not a readable JPEG (", 0), 0u)
        << crop;
    EXPECT_EQ(plain.rfind("splitflow::image::decode_jpeg: 'photos/x.jpg': not a readable JPEG (", 0), 0u)
        << plain;
    const std::string named = c.kind ? "the bytes are " + std::string(c.kind) +
                                           " image, which decode_jpeg does not read (decode it in "
                                           "a stage of your own, PIL's, or convert it to JPEG)"
                                     : "the bytes are";
    EXPECT_EQ(plain.find(named) != std::string::npos, c.kind != nullptr) << plain;
    EXPECT_NE(plain.find("; on_error skip or substitute on its stage (Python: on_error='skip', "
                         "substitute=) drops or replaces such a file and the run goes on"),
              std::string::npos)
        << plain;
  }
}

// "Decoders bound what they allocate from a header's claimed size" (image.hpp,
// kMaxDecodePixels): a header forged to 60000 x 60000 (libjpeg-turbo's own limit is 65500 per
// side) fails before anything is allocated for it, by every decoder, naming the file and the
// limit; read_file refuses directories.
TEST(ImageDecode, AForgedHugeHeaderIsRefusedBeforeAllocating) {
  std::vector<std::uint8_t> jpeg = encode(random_pixels(16, 16, 3, 9), 16, 16, 3);
  // The baseline frame header: FF C0, length (2), precision (1), height (2), width (2).
  std::size_t sof = 0;
  for (std::size_t i = 0; i + 1 < jpeg.size(); ++i)
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {
      sof = i;
      break;
    }
  ASSERT_GT(sof, 0u);
  for (std::size_t k : {sof + 5, sof + 7}) jpeg[k] = 0xEA;  // 0xEA60 = 60000
  for (std::size_t k : {sof + 6, sof + 8}) jpeg[k] = 0x60;
  const auto refused = [&](auto&& decode) {
    try {
      decode();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("decoded");
  };
  const std::string want = "'huge.jpg': its header claims 60000x60000 pixels, over the decode limit";
  const std::string full =
      refused([&] { image::decode_jpeg(jpeg.data(), jpeg.size(), image::Color::rgb, "huge.jpg"); });
  EXPECT_EQ(full.rfind("splitflow::image::decode_jpeg: " + want, 0), 0u) << full;
  const std::string region = refused([&] {
    image::decode_jpeg_region(jpeg.data(), jpeg.size(), {0, 0, 8, 8}, image::Color::rgb, "huge.jpg");
  });
  EXPECT_EQ(region.rfind("splitflow::image::decode_jpeg_region: " + want, 0), 0u) << region;
  HostTensor bytes = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(jpeg.size())});
  std::memcpy(bytes.raw(), jpeg.data(), jpeg.size());
  const std::string fused = refused([&] {
    image::decode_random_resized_crop({0, "huge.jpg", std::move(bytes)}, {.size = 32});
  });
  EXPECT_EQ(fused.rfind("splitflow::image::decode_random_resized_crop: " + want, 0), 0u) << fused;
  TempDir dir("forged");
  EXPECT_NE(refused([&] { image::read_file({0, dir.path.string()}); }).find("is a directory, not a file"),
            std::string::npos);
}

// "resize matches a straightforward reference": antialias=false is within 1 of the
// double-precision bilinear (fixed-point rounding), for down, up, boxes and one channel; the
// identity is exact. With the default antialias, what does not shrink is the same.
TEST(ImageOps, ResizeMatchesTheReference) {
  struct Case {
    int H, W, C;
    image::Box box;
    int oh, ow;
  } cases[] = {{375, 500, 3, {}, 224, 224},        {50, 40, 3, {}, 97, 131},
               {375, 500, 3, {30, 70, 200, 150}, 224, 224}, {20, 20, 1, {5, 3, 1, 7}, 9, 4},
               {33, 47, 3, {}, 33, 47}};
  unsigned seed = 11;
  for (const auto& c : cases) {
    const auto px = random_pixels(c.H, c.W, c.C, seed++);
    const image::Box b = c.box.h ? c.box : image::Box{0, 0, c.H, c.W};
    const auto want = reference_resize(px, c.W, c.C, b, c.oh, c.ow);
    const auto got = bytes_of(image::resize(tensor_of(px, c.H, c.W, c.C), c.oh, c.ow, c.box, false));
    ASSERT_EQ(got.size(), want.size());
    int worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(int(got[i]) - int(want[i])));
    EXPECT_LE(worst, 1) << c.H << "x" << c.W << " -> " << c.oh << "x" << c.ow;
    if (c.oh == c.H && c.ow == c.W && !c.box.h) {
      EXPECT_EQ(got, px);
    }
    if (c.oh >= b.h && c.ow >= b.w) {
      EXPECT_EQ(bytes_of(image::resize(tensor_of(px, c.H, c.W, c.C), c.oh, c.ow, c.box)), got);
    }
  }
  EXPECT_THROW(image::resize(tensor_of(random_pixels(10, 10, 3, 1), 10, 10, 3), 5, 5, {5, 5, 6, 2}), Error);
}

// A direct call of resize is held to the ops' output bound (kMaxOutputSide per side) as the ops
// are when built (validate_size): it allocated what it was asked for (16385 x 1 x 3 bytes here,
// or 2^31 rows' worth), where docs/reliability.md listed it under "Left".
TEST(ImageOps, ResizeRefusesAnOutputSideOverTheBoundWithTheBound) {
  const HostTensor img = tensor_of(random_pixels(4, 4, 3, 7), 4, 4, 3);
  for (const auto& [h, w] : {std::pair{image::kMaxOutputSide + 1, 1}, std::pair{1, image::kMaxOutputSide + 1},
                             std::pair{INT_MAX, INT_MAX}}) {
    for (const bool antialias : {true, false}) {
      try {
        (void)image::resize(img, h, w, {}, antialias);
        ADD_FAILURE() << h << "x" << w << " was resized";
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "splitflow::image::resize: output size " +
                                              std::to_string(h) + "x" + std::to_string(w) +
                                              " is out of range: give 1 to 16384 per side");
      }
      EXPECT_THROW((void)image::resize_flipped(img, h, w, true, antialias), Error);
    }
  }
  // The bound itself is an output size a resize gives.
  const HostTensor edge = image::resize(img, 1, image::kMaxOutputSide);
  EXPECT_EQ(edge.dim(0), 1);
  EXPECT_EQ(edge.dim(1), image::kMaxOutputSide);
}

// Issue 21: "antialiased resize, the default: when shrinking, a triangle filter whose support
// grows with the scale factor, as PIL's resize(BILINEAR) does". Generated images with
// high-frequency content (checkerboards, a zone plate, noise, fine text; RGB and gray) shrunk
// by 1.5x to 20x, to non-integer sizes, from boxes, mirrored: within 1 of the straightforward
// double-precision filter at every pixel (the fixed point rounds twice, as Pillow's does).
TEST(ImageOps, AntialiasedResizeMatchesTheReferenceAtEveryFactor) {
  struct Pattern {
    const char* name;
    int H, W, C;
    std::vector<std::uint8_t> px;
  };
  const Pattern patterns[] = {
      {"checkerboard 1px", 400, 600, 3, checkerboard(400, 600, 3, 1)},
      {"checkerboard 3px", 401, 603, 3, checkerboard(401, 603, 3, 3)},
      {"zone plate", 400, 400, 3, zone_plate(400, 400, 3)},
      {"noise", 300, 460, 3, noise_pixels(300, 460, 3, 9)},
      {"fine text", 240, 480, 3, fine_text(240, 480, 3)},
      {"gray noise", 200, 300, 1, noise_pixels(200, 300, 1, 10)},
  };
  for (const Pattern& p : patterns) {
    const HostTensor img = tensor_of(p.px, p.H, p.W, p.C);
    struct Job {
      image::Box box;
      int oh, ow;
    };
    std::vector<Job> jobs;
    for (double f : {1.5, 2.0, 3.7, 7.0, 13.0, 20.0})
      jobs.push_back({{0, 0, p.H, p.W}, std::max(1, int(std::lround(p.H / f))),
                      std::max(1, int(std::lround(p.W / f)))});
    jobs.push_back({{0, 0, p.H, p.W}, 97, 131});                        // non-integer factors
    jobs.push_back({{11, 23, p.H - 40, p.W - 51}, 29, 33});             // a box, ~6-16x
    jobs.push_back({{0, 0, p.H, p.W}, p.H, p.W / 3});                   // one side only
    jobs.push_back({{0, 0, p.H / 5, p.W}, p.H / 2, p.W / 7});           // shrink x, enlarge y
    jobs.push_back({{3, 5, p.H - 3, p.W / 9}, p.H / 6, p.W / 4});       // shrink y, enlarge x
    for (const Job& j : jobs) {
      const auto want = reference_antialiased(p.px, p.W, p.C, j.box, j.oh, j.ow);
      const HostTensor got = image::resize(img, j.oh, j.ow, j.box);
      EXPECT_LE(max_difference(bytes_of(got), want), 1)
          << p.name << ": box " << j.box.h << "x" << j.box.w << " -> " << j.oh << "x" << j.ow;
      // Mirrored: the same pixels, mirrored (the flip is the horizontal pass's order).
      const HostTensor crop = image::resize(img, j.box.h, j.box.w, j.box);  // the box, as is
      ASSERT_EQ(bytes_of(crop).size(), std::size_t(j.box.h) * j.box.w * p.C);
      EXPECT_EQ(bytes_of(image::resize_flipped(crop, j.oh, j.ow, true)), bytes_of(image::hflip(got)))
          << p.name << ": box " << j.box.h << "x" << j.box.w << " -> " << j.oh << "x" << j.ow
          << " mirrored";
    }
  }
}

// What antialiasing is for: a 1-pixel checkerboard shrunk 3.7x is an even grey with it, and
// moire (values from black to white) without it.
TEST(ImageOps, AntialiasingRemovesTheMoireThatPlainBilinearMakes) {
  const auto px = checkerboard(370, 370, 1, 1);
  const HostTensor img = tensor_of(px, 370, 370, 1);
  const auto range = [](const std::vector<std::uint8_t>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return int(*hi) - int(*lo);
  };
  EXPECT_LE(range(bytes_of(image::resize(img, 100, 100))), 4);
  EXPECT_GE(range(bytes_of(image::resize(img, 100, 100, {}, false))), 200);
}

// Pinned outputs (white noise from hash32; FNV-1a of the result): with antialiasing, Pillow's
// Image.crop(box).resize((w, h), Image.BILINEAR) exactly (the hashes are Pillow 9.4's output),
// so every machine computes the same pixels; enlarging is unchanged by antialias, and
// antialias=false is the bilinear resize that came before it, to the bit.
TEST(ImageOps, AntialiasedResizeIsPillowsAndAntialiasFalseIsTheOldBilinear) {
  struct Case {
    int H, W, C;
    std::uint32_t seed;
    image::Box box;
    int oh, ow;
    std::uint64_t antialiased, plain;
  } cases[] = {
      {375, 500, 3, 1, {}, 224, 224, 0xc3331fce5fda27acULL, 0xc4ecc19942dfb9b2ULL},                  // shrink
      {375, 500, 3, 2, {13, 27, 300, 411}, 61, 37, 0xcbaf90e2b5b4a8f7ULL, 0x77033a57e8c4a47aULL},    // 5-11x
      {20, 20, 1, 5, {5, 3, 1, 7}, 9, 4, 0x091bf1d6f666379eULL, 0xbdf2b4d20517f09bULL},              // mixed
      {40, 30, 1, 6, {}, 7, 5, 0x2978e2a6a64f81e2ULL, 0x51fa20d6e61e0f2eULL},                        // gray
      {50, 40, 3, 3, {}, 97, 131, 0x307e50219a0cf299ULL, 0x307e50219a0cf299ULL},                     // enlarge
      {375, 500, 3, 4, {30, 70, 200, 150}, 224, 224, 0x3947981b743b4c43ULL, 0x3947981b743b4c43ULL},  // enlarge
  };
  for (const Case& c : cases) {
    const HostTensor img = tensor_of(noise_pixels(c.H, c.W, c.C, c.seed), c.H, c.W, c.C);
    EXPECT_EQ(fnv1a(bytes_of(image::resize(img, c.oh, c.ow, c.box))), c.antialiased)
        << c.H << "x" << c.W << " box " << c.box.h << "x" << c.box.w << " -> " << c.oh << "x" << c.ow;
    EXPECT_EQ(fnv1a(bytes_of(image::resize(img, c.oh, c.ow, c.box, false))), c.plain)
        << c.H << "x" << c.W << " box " << c.box.h << "x" << c.box.w << " -> " << c.oh << "x" << c.ow;
  }
  // Enlarging anything: antialias changes nothing.
  const auto px = zone_plate(60, 80, 3);
  for (auto [oh, ow] : {std::pair{60, 81}, std::pair{224, 224}, std::pair{61, 80}, std::pair{300, 97}})
    EXPECT_EQ(bytes_of(image::resize(tensor_of(px, 60, 80, 3), oh, ow)),
              bytes_of(image::resize(tensor_of(px, 60, 80, 3), oh, ow, {}, false)))
        << oh << "x" << ow;
}

// A constant image stays that constant, at any factor, in both modes (the weights sum to one).
TEST(ImageOps, ResizeKeepsAConstantImageConstant) {
  for (int v : {0, 1, 77, 128, 254, 255})
    for (auto [oh, ow] : {std::pair{20, 30}, std::pair{7, 333}, std::pair{224, 224}, std::pair{1, 1},
                          std::pair{600, 41}})
      for (bool antialias : {true, false}) {
        const std::vector<std::uint8_t> px(std::size_t(400) * 300 * 3, static_cast<std::uint8_t>(v));
        const auto got = bytes_of(image::resize(tensor_of(px, 400, 300, 3), oh, ow, {}, antialias));
        EXPECT_EQ(got, std::vector<std::uint8_t>(std::size_t(oh) * ow * 3, static_cast<std::uint8_t>(v)))
            << v << " -> " << oh << "x" << ow << " antialias " << antialias;
      }
}

// The fused decode + crop still equals decode-then-crop when the crops shrink a lot (a large
// JPEG of fine detail to 24x24: factors of 8 to 30), with and without antialiasing.
TEST(ImageDecode, FusedCropEqualsDecodeThenCropAtLargeFactors) {
  const int h = 720, w = 960;
  std::vector<std::uint8_t> px = fine_text(h, w, 3);
  const auto noise = noise_pixels(h, w, 3, 3);
  for (std::size_t i = 0; i < px.size(); ++i) px[i] = static_cast<std::uint8_t>((px[i] * 3 + noise[i]) / 4);
  const auto jpeg = encode(px, h, w, 3, 95);
  const HostTensor full = image::decode_jpeg(jpeg.data(), jpeg.size());
  for (bool antialias : {true, false}) {
    const image::AugmentSpec spec{.size = 24, .seed = 11, .epoch = 2, .antialias = antialias};
    for (std::uint64_t i = 0; i < 12; ++i) {
      HostTensor bytes = HostTensor::empty(DType::u8, {std::int64_t(jpeg.size())});
      std::memcpy(bytes.raw(), jpeg.data(), jpeg.size());
      const image::Image fused = image::decode_random_resized_crop({i, "big.jpg", bytes}, spec);
      const image::Image two = image::RandomResizedCrop(spec)({i, "big.jpg", full});
      ASSERT_EQ(fused.pixels.shape(), (std::vector<std::int64_t>{24, 24, 3}));
      ASSERT_EQ(bytes_of(fused.pixels), bytes_of(two.pixels)) << "item " << i << " antialias " << antialias;
      // And it is the antialiased (or plain) resize of the drawn box, mirrored when drawn.
      const image::Augment a = image::draw_augment(h, w, i, spec);
      HostTensor want = image::resize(full, 24, 24, a.box, antialias);
      if (a.flip) want = image::hflip(want);
      EXPECT_EQ(bytes_of(two.pixels), bytes_of(want)) << "item " << i;
    }
  }
}

// A torchvision user's trial (2026-12-05): RandomResizedCrop(size=(h, w)) makes crops of h x
// w; splitflow's ops took a square size only. AugmentSpec::width: the box is drawn as for a
// square (torchvision draws it from the image alone), then resized to size x width; the fused
// op still equals decode-then-crop, and its scaled decode keeps the decoded crop at least the
// output's size on each side.
TEST(ImageDecode, ANonSquareCropIsTheDrawnBoxResizedToHeightByWidth) {
  const int h = 720, w = 960;
  std::vector<std::uint8_t> px = fine_text(h, w, 3);
  const auto noise = noise_pixels(h, w, 3, 5);
  for (std::size_t i = 0; i < px.size(); ++i) px[i] = static_cast<std::uint8_t>((px[i] * 3 + noise[i]) / 4);
  const auto jpeg = encode(px, h, w, 3, 95);
  const HostTensor full = image::decode_jpeg(jpeg.data(), jpeg.size());
  using SD = image::AugmentSpec::ScaledDecode;
  for (SD sd : {SD::never, SD::always}) {
    const image::AugmentSpec spec{.size = 24, .width = 40, .seed = 3, .scaled_decode = sd};
    const image::AugmentSpec square{.size = 24, .seed = 3};
    for (std::uint64_t i = 0; i < 10; ++i) {
      HostTensor bytes = HostTensor::empty(DType::u8, {std::int64_t(jpeg.size())});
      std::memcpy(bytes.raw(), jpeg.data(), jpeg.size());
      const image::Image fused = image::decode_random_resized_crop({i, "wide.jpg", bytes}, spec);
      const image::Image two = image::RandomResizedCrop(spec)({i, "wide.jpg", full});
      ASSERT_EQ(two.pixels.shape(), (std::vector<std::int64_t>{24, 40, 3}));
      ASSERT_EQ(fused.pixels.shape(), (std::vector<std::int64_t>{24, 40, 3}));
      const image::Augment a = image::draw_augment(h, w, i, spec);
      const image::Augment b = image::draw_augment(h, w, i, square);
      EXPECT_EQ(std::tie(a.box.y, a.box.x, a.box.h, a.box.w, a.flip),
                std::tie(b.box.y, b.box.x, b.box.h, b.box.w, b.flip)) << "item " << i;
      HostTensor want = image::resize(full, 24, 40, a.box);
      if (a.flip) want = image::hflip(want);
      EXPECT_EQ(bytes_of(two.pixels), bytes_of(want)) << "item " << i;
      if (sd == SD::never) EXPECT_EQ(bytes_of(fused.pixels), bytes_of(two.pixels)) << "item " << i;
    }
  }
  // The denominator leaves the decoded crop at least 24 rows and 400 columns.
  const image::AugmentSpec wide{.size = 24, .width = 400, .scaled_decode = SD::always};
  EXPECT_EQ(image::decode_denominator(wide, 3000, 4000, {0, 0, 1800, 1800}), 4);   // 1800/8 < 400
  EXPECT_EQ(image::decode_denominator(wide, 3000, 4000, {0, 0, 1800, 799}), 1);    // 799/2 < 400
  const image::AugmentSpec tall{.size = 400, .width = 24, .scaled_decode = SD::always};
  EXPECT_EQ(image::decode_denominator(tall, 3000, 4000, {0, 0, 1800, 1800}), 4);
  // A width out of bounds is refused when the op is built; BatchDecode makes square batches.
  EXPECT_THROW(image::RandomResizedCrop({.size = 24, .width = -1}), Error);
  EXPECT_THROW(image::RandomResizedCrop({.size = 24, .width = image::kMaxOutputSide + 1}), Error);
}

// Scaled decode (issue 21): the DCT scale is the largest the crop's shrink allows (the decoded
// crop stays at least the output's size), only for large photos by default; a crop decoded at
// 1/2-1/8 stays close to full decode + antialiased resize (PSNR), and a crop that shrinks less
// than 2x is decoded in full, the same pixels as never.
TEST(ImageDecode, ScaledDecodeIsChosenByTheShrinkAndStaysCloseToFullDecode) {
  using SD = image::AugmentSpec::ScaledDecode;
  const image::AugmentSpec always{.size = 224, .scaled_decode = SD::always};
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 1800, 1800}), 8);
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 1000, 1200}), 4);
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 447, 2000}), 1);  // 447 / 2 < 224
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 448, 2000}), 2);
  const image::AugmentSpec large{.size = 224};  // the default: large_photos
  EXPECT_EQ(image::decode_denominator(large, 2000, 3999, {0, 0, 1800, 1800}), 1);  // < 8 MP
  EXPECT_EQ(image::decode_denominator(large, 2000, 4000, {0, 0, 1800, 1800}), 8);  // 8 MP
  const image::AugmentSpec never{.size = 224, .scaled_decode = SD::never};
  EXPECT_EQ(image::decode_denominator(never, 3000, 4000, {0, 0, 1800, 1800}), 1);
  // Without antialias the crop is the plain bilinear of the full decode (its docs): a large
  // photo decodes in full (it was decoded at 1/8 and antialiased, antialias=false ignored),
  // and 'always' is refused when the op is built.
  const image::AugmentSpec plain{.size = 224, .antialias = false};
  EXPECT_EQ(image::decode_denominator(plain, 3000, 4000, {0, 0, 1800, 1800}), 1);
  try {
    image::DecodeRandomResizedCrop op({.size = 224, .antialias = false, .scaled_decode = SD::always});
    ADD_FAILURE() << "scaled decode 'always' taken with antialias off";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DecodeRandomResizedCrop: scaled decode 'always' with "
                                         "antialias off"),
              std::string::npos) << e.what();
  }

  // A photo-like image, 4:2:0.
  const int h = 1200, w = 1600;
  const auto jpeg = encode(photo_like_pixels(h, w), h, w, 3, 92);
  int scaled = 0, full = 0;
  for (std::uint64_t i = 0; i < 24; ++i) {
    image::AugmentSpec a{.size = 224, .seed = 4, .scaled_decode = SD::always};
    image::AugmentSpec n = a;
    n.scaled_decode = SD::never;
    const image::Image got = image::decode_random_resized_crop({i, "p.jpg", tensor_of_bytes(jpeg)}, a);
    const image::Image ref = image::decode_random_resized_crop({i, "p.jpg", tensor_of_bytes(jpeg)}, n);
    ASSERT_EQ(got.pixels.shape(), (std::vector<std::int64_t>{224, 224, 3}));
    const image::Augment drawn = image::draw_augment(h, w, i, a);
    if (image::decode_denominator(a, h, w, drawn.box) == 1) {
      ++full;
      EXPECT_EQ(bytes_of(got.pixels), bytes_of(ref.pixels)) << "item " << i;
      continue;
    }
    ++scaled;
    EXPECT_GE(psnr(got.pixels, ref.pixels), 32.0) << "item " << i << " box " << drawn.box.h << "x" << drawn.box.w;
  }
  EXPECT_GT(scaled, 4);  // both kinds of crop were drawn
  EXPECT_GT(full, 0);
}

// "the quality cost ... stated": at 1/8 libjpeg-turbo turns its fancy upsampling off and
// repeats the chroma samples of a 4:2:2 or 4:4:0 file (those of 4:2:0 and 4:4:4 it scales to
// the luma's size, needing no upsampling): a new user's trial measured 34 dB against full
// decode there, 43 at 1/4. Such files are decoded at 1/4 at most.
TEST(ImageDecode, ScaledDecodeOfChromaSubsampledOneWayStopsAtAQuarter) {
  using SD = image::AugmentSpec::ScaledDecode;
  const image::AugmentSpec always{.size = 224, .scaled_decode = SD::always};
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 1800, 1800}, 4), 4);
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 1800, 1800}, 8), 8);
  EXPECT_EQ(image::decode_denominator(always, 3000, 4000, {0, 0, 1000, 1200}, 2), 2);
  const int h = 1200, w = 1600;
  const auto px = photo_like_pixels(h, w);
  // The worst crop's PSNR against full decode, over crops 1/8 would take (deterministic: the
  // same bytes and fixed-point pixels on every machine). With the cap taken out, at 1/8: 4:2:2
  // 48.9 dB, 4:4:0 48.4, 4:1:1 44.2; with it, at 1/4: 52.6, 52.6, 52.0. Files that need no
  // chroma upsampling stay at 1/8, below what 1/4 would give (not over-capped): 4:2:0 49.3, a
  // 4:2:2 file decoded to gray (its luma alone) 49.9.
  for (const auto& [samp, color, name, floor_db, below_db] :
       {std::tuple{TJSAMP_420, image::Color::rgb, "4:2:0", 47.0, 51.0},
        std::tuple{TJSAMP_422, image::Color::rgb, "4:2:2", 51.0, 99.0},
        std::tuple{TJSAMP_440, image::Color::rgb, "4:4:0", 51.0, 99.0},
        std::tuple{TJSAMP_411, image::Color::rgb, "4:1:1", 50.0, 99.0},
        std::tuple{TJSAMP_422, image::Color::gray, "4:2:2 as gray", 47.0, 51.0}}) {
    const auto jpeg = encode(px, h, w, 3, 92, samp);
    double worst = 99;
    int eighths = 0;
    for (std::uint64_t i = 0; i < 32; ++i) {
      image::AugmentSpec a{.size = 64, .scale_min = 0.3, .seed = 6, .scaled_decode = SD::always};
      image::AugmentSpec n = a;
      n.scaled_decode = SD::never;
      if (image::decode_denominator(a, h, w, image::draw_augment(h, w, i, a).box) != 8) continue;
      ++eighths;  // (a crop that 1/8 would take: 4:2:0's is, the others' at 1/4)
      const image::Image got = image::decode_random_resized_crop({i, "p.jpg", tensor_of_bytes(jpeg)}, a, color);
      const image::Image ref = image::decode_random_resized_crop({i, "p.jpg", tensor_of_bytes(jpeg)}, n, color);
      worst = std::min(worst, psnr(got.pixels, ref.pixels));
    }
    EXPECT_GT(eighths, 8) << name;
    EXPECT_GE(worst, floor_db) << name;
    EXPECT_LT(worst, below_db) << name;
  }
}

// docs/api.md: "Arithmetic-coded files decode (libjpeg-turbo decodes them, as PIL does)" (it
// said they were refused; a new user's trial decoded them): the same coefficients Huffman-coded
// and arithmetic-coded give the same pixels, by decode and by the fused crop.
TEST(ImageDecode, ArithmeticCodedFilesDecodeAsTheirHuffmanTwins) {
  const int h = 120, w = 160;
  const auto px = photo_like_pixels(h, w);
  const auto huffman = encode_sampled(px, h, w, 2, 2), arithmetic = encode_sampled(px, h, w, 2, 2, true);
  ASSERT_NE(huffman, arithmetic);
  EXPECT_EQ(image::jpeg_info(arithmetic.data(), arithmetic.size()).coding, image::JpegInfo::Coding::arithmetic);
  EXPECT_EQ(bytes_of(image::decode({0, "a.jpg", tensor_of_bytes(arithmetic)}).pixels),
            bytes_of(image::decode({0, "h.jpg", tensor_of_bytes(huffman)}).pixels));
  for (std::uint64_t i = 0; i < 4; ++i)
    EXPECT_EQ(bytes_of(image::decode_random_resized_crop({i, "a.jpg", tensor_of_bytes(arithmetic)}, {.size = 48}).pixels),
              bytes_of(image::decode_random_resized_crop({i, "h.jpg", tensor_of_bytes(huffman)}, {.size = 48}).pixels))
        << "item " << i;
}

// JPEG bytes given as int8 (or float) were read as u8 and failed with "tensor i8[61306] host
// accessed as u8", naming neither the op nor the fix (a new user's trial): each decoder names
// itself, the file and what to give.
TEST(ImageDecode, BytesOfAnotherDtypeAreRefusedNamingTheOpAndTheFix) {
  const auto jpeg = encode(random_pixels(16, 16, 3, 1), 16, 16, 3);
  HostTensor i8 = HostTensor::empty(DType::i8, {std::int64_t(jpeg.size())});
  std::memcpy(i8.raw(), jpeg.data(), jpeg.size());
  const std::string tail = "takes a file's bytes as contiguous u8, got i8[" + std::to_string(jpeg.size()) +
                           "] host: give them as uint8";
  try {
    (void)image::decode({0, "a.jpg", i8});
    ADD_FAILURE() << "int8 bytes decoded";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("splitflow::image::decode_jpeg: 'a.jpg': " + tail, 0), 0u) << e.what();
  }
  try {
    (void)image::decode_random_resized_crop({0, "a.jpg", i8}, {.size = 8});
    ADD_FAILURE() << "int8 bytes decoded";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("splitflow::image::decode_random_resized_crop: 'a.jpg': " + tail, 0), 0u)
        << e.what();
  }
  // The same bytes as u8 decode.
  EXPECT_EQ(image::decode({0, "a.jpg", tensor_of_bytes(jpeg)}).pixels.shape(), (std::vector<std::int64_t>{16, 16, 3}));
}

// "flip matches the reference"; twice is the identity
TEST(ImageOps, FlipMirrorsColumns) {
  const auto px = random_pixels(7, 9, 3, 4);
  const HostTensor t = tensor_of(px, 7, 9, 3);
  const auto got = bytes_of(image::hflip(t));
  for (int y = 0; y < 7; ++y)
    for (int x = 0; x < 9; ++x)
      for (int k = 0; k < 3; ++k)
        ASSERT_EQ(got[(y * 9 + x) * 3 + k], px[(y * 9 + (8 - x)) * 3 + k]);
  EXPECT_EQ(bytes_of(image::hflip(image::hflip(t))), px);
}

// torchvision's CenterCrop: offsets int(round((H - h) / 2.0)) (Python's round: half to even),
// and an image smaller than the crop centred on zeros (padded by (h - H) // 2 before). The
// expected offsets are written out from torchvision's formula for each case.
TEST(ImageOps, CenterCropIsTorchvisionsCenterCrop) {
  struct Case {
    int H, W, h, w, top, left;  // top/left < 0: padding before
  };
  for (const Case c : {Case{10, 10, 4, 4, 3, 3}, Case{9, 10, 4, 4, 2, 3},  // round(2.5) = 2
                       Case{11, 10, 4, 4, 4, 3},                             // round(3.5) = 4
                       Case{7, 8, 7, 8, 0, 0}, Case{5, 6, 2, 3, 2, 2},       // round(1.5) = 2
                       Case{3, 4, 6, 9, -1, -2},                             // pad 1 (3 // 2), 2 (5 // 2)
                       Case{4, 10, 7, 4, -1, 3}}) {                         // pad rows, crop columns
    const auto px = random_pixels(c.H, c.W, 3, 11);
    const auto got = bytes_of(image::center_crop(tensor_of(px, c.H, c.W, 3), c.h, c.w));
    ASSERT_EQ(got.size(), static_cast<std::size_t>(c.h * c.w * 3));
    for (int y = 0; y < c.h; ++y)
      for (int x = 0; x < c.w; ++x)
        for (int k = 0; k < 3; ++k) {
          const int sy = y + c.top, sx = x + c.left;
          const bool inside = sy >= 0 && sy < c.H && sx >= 0 && sx < c.W;
          ASSERT_EQ(got[(y * c.w + x) * 3 + k], inside ? px[(sy * c.W + sx) * 3 + k] : 0)
              << c.H << "x" << c.W << " -> " << c.h << "x" << c.w << " at " << y << "," << x;
        }
  }
  EXPECT_THROW(image::center_crop(tensor_of(random_pixels(4, 4, 3, 1), 4, 4, 3), 0, 3), GraphError);
}

// torchvision's Resize(size) with one number: the shorter side to size, the longer
// int(size * long / short); the pixels are resize()'s to that size.
TEST(ImageOps, ResizeShorterSetsTheShorterSideAsTorchvisionDoes) {
  struct Case {
    int H, W, size, oh, ow;
  };
  for (const Case c : {Case{480, 640, 256, 256, 341},   // int(256 * 640 / 480) = int(341.33)
                       Case{640, 480, 256, 341, 256}, Case{300, 300, 224, 224, 224},
                       Case{37, 101, 16, 16, 43},      // int(43.67)
                       Case{20, 30, 64, 64, 96}}) {    // enlarging
    const HostTensor t = tensor_of(noise_pixels(c.H, c.W, 3, 7), c.H, c.W, 3);
    const HostTensor got = image::resize_shorter(t, c.size);
    ASSERT_EQ(got.dim(0), c.oh);
    ASSERT_EQ(got.dim(1), c.ow);
    EXPECT_EQ(bytes_of(got), bytes_of(image::resize(t, c.oh, c.ow)));
  }
  // The longer side past the bound is refused, naming the sizes.
  const HostTensor thin = tensor_of(random_pixels(2, 300, 1, 3), 2, 300, 1);
  try {
    image::resize_shorter(thin, 200);
    ADD_FAILURE() << "a 30000-pixel side was made";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("the shorter side of a 2x300 image to 200 makes the longer 30000, past 16384 pixels"),
              std::string::npos) << e.what();
  }
}

// "random-resized-crop and flip with per-item seeded randomness (reproducible given seed, epoch
// and index)", within torchvision's scale and ratio bounds
TEST(ImageOps, AugmentIsReproducibleAndWithinBounds) {
  const image::AugmentSpec spec{.size = 224, .seed = 42, .epoch = 3};
  int flips = 0, fallback = 0;
  std::set<std::tuple<int, int, int, int>> boxes;
  for (std::uint64_t i = 0; i < 2000; ++i) {
    const image::Augment a = image::draw_augment(375, 500, i, spec);
    const image::Augment again = image::draw_augment(375, 500, i, spec);
    ASSERT_EQ(std::tie(a.box.y, a.box.x, a.box.h, a.box.w, a.flip),
              std::tie(again.box.y, again.box.x, again.box.h, again.box.w, again.flip));
    ASSERT_GE(a.box.y, 0);
    ASSERT_GE(a.box.x, 0);
    ASSERT_LE(a.box.y + a.box.h, 375);
    ASSERT_LE(a.box.x + a.box.w, 500);
    const double area = double(a.box.h) * a.box.w / (375.0 * 500.0);
    const double ratio = double(a.box.w) / a.box.h;
    if (a.box.h == 375 && a.box.w == 500) ++fallback;
    // Rounding w and h to whole pixels moves area and ratio a little past the drawn values.
    EXPECT_GE(area, 0.08 * 0.97);
    EXPECT_LE(area, 1.0);
    EXPECT_GE(ratio, 0.75 * 0.97);
    EXPECT_LE(ratio, (4.0 / 3.0) * 1.03);
    flips += a.flip;
    boxes.insert({a.box.y, a.box.x, a.box.h, a.box.w});
  }
  EXPECT_GT(flips, 900);
  EXPECT_LT(flips, 1100);
  EXPECT_GT(boxes.size(), 1900u);  // per item, not one box for all
  EXPECT_LT(fallback, 20);
  // Another epoch or seed draws differently.
  int same = 0;
  for (std::uint64_t i = 0; i < 100; ++i) {
    const auto a = image::draw_augment(375, 500, i, spec);
    const auto b = image::draw_augment(375, 500, i, {.seed = 42, .epoch = 4});
    same += a.box.y == b.box.y && a.box.x == b.box.x && a.box.h == b.box.h;
  }
  EXPECT_LT(same, 5);
  // The stage body: the crop of its box, resized, flipped when drawn.
  const auto px = random_pixels(375, 500, 3, 8);
  for (std::uint64_t i = 0; i < 6; ++i) {
    const image::Augment a = image::draw_augment(375, 500, i, spec);
    HostTensor want = image::resize(tensor_of(px, 375, 500, 3), 224, 224, a.box);
    if (a.flip) want = image::hflip(want);
    const image::Image out = image::RandomResizedCrop(spec)({i, "p.jpg", tensor_of(px, 375, 500, 3)});
    EXPECT_EQ(bytes_of(out.pixels), bytes_of(want));
    EXPECT_EQ(out.index, i);
  }
}

// "shuffling and sharding cover the data exactly once per epoch"
TEST(ImageFiles, ShardsCoverTheDataExactlyOncePerEpoch) {
  std::vector<std::string> paths;
  for (int i = 0; i < 1003; ++i) paths.push_back("f" + std::to_string(i));
  const image::FileList files(paths);
  std::vector<std::uint64_t> epoch0_rank0;
  for (std::uint64_t epoch : {0u, 1u}) {
    std::vector<int> seen(1003, 0);
    std::size_t smallest = 1003, largest = 0;
    for (int r = 0; r < 3; ++r)
      for (int wk = 0; wk < 2; ++wk) {
        const auto mine = files.epoch({.seed = 9, .epoch = epoch, .rank = r, .world_size = 3,
                                       .worker = wk, .num_workers = 2});
        smallest = std::min(smallest, mine.size());
        largest = std::max(largest, mine.size());
        for (auto i : mine) ++seen[i];
        if (epoch == 0 && r == 0 && wk == 0) epoch0_rank0 = mine;
        if (epoch == 1 && r == 0 && wk == 0) {
          EXPECT_NE(mine, epoch0_rank0);  // reshuffled
        }
      }
    for (int i = 0; i < 1003; ++i) ASSERT_EQ(seen[i], 1) << "file " << i << " epoch " << epoch;
    EXPECT_LE(largest - smallest, 1u);
  }
  EXPECT_EQ(files.epoch({.seed = 9, .epoch = 0, .rank = 0, .world_size = 3, .worker = 0, .num_workers = 2}),
            epoch0_rank0);  // the same (seed, epoch): the same order
  const auto plain = files.epoch({.shuffle = false, .rank = 1, .world_size = 4});
  ASSERT_GE(plain.size(), 3u);
  EXPECT_EQ((std::vector<std::uint64_t>(plain.begin(), plain.begin() + 3)), (std::vector<std::uint64_t>{1, 5, 9}));
  EXPECT_THROW(files.epoch({.rank = 3, .world_size = 3}), Error);
}

// "a file list from a directory, a glob, or a list file"
TEST(ImageFiles, DirectoryGlobAndListFile) {
  TempDir dir("filelist");
  fs::create_directories(dir.path / "b");
  for (const char* name : {"a1.jpg", "a0.JPEG", "b/c.jpg", "notes.txt", "x.jpg"}) write_file(dir.path / name, {1, 2});
  const auto listed = image::FileList::directory(dir.path.string());
  // torchvision's ImageFolder order: a folder's own files (sorted), then its subfolders' ("x.jpg"
  // before "b/c.jpg": a new user's trial, 2026-12-05, found whole paths sorted instead).
  EXPECT_EQ(listed.paths(), (std::vector<std::string>{(dir.path / "a0.JPEG").string(), (dir.path / "a1.jpg").string(),
                                                      (dir.path / "x.jpg").string(),
                                                      (dir.path / "b/c.jpg").string()}));
  // Class folders whole, in sorted order, as ImageFolder walks them: "cat-2" (and "cat b",
  // "cat.b": '-', ' ' and '.' sort before '/') after all of "cat", its subfolders included.
  // Sorted by folder path alone, "cat-2/z.jpg" came between "cat/x.jpg" and "cat/sub/y.jpg" (a
  // new user's trial: the C++ indices differed from Python's image_folder and torchvision's).
  {
    TempDir tree("imagefolder");
    for (const char* name : {"cat/x.jpg", "cat/sub/y.jpg", "cat/sub-2/w.jpg", "cat-2/z.jpg",
                             "cat b/v.jpg", "cat.b/u.jpg", "cat/sub/deeper/t.jpg", "top.jpg"}) {
      fs::create_directories((tree.path / name).parent_path());
      write_file(tree.path / name, {1, 2});
    }
    std::vector<std::string> want;
    for (const char* name : {"top.jpg", "cat/x.jpg", "cat/sub/y.jpg", "cat/sub-2/w.jpg",
                             "cat/sub/deeper/t.jpg", "cat b/v.jpg", "cat-2/z.jpg", "cat.b/u.jpg"})
      want.push_back((tree.path / name).string());
    EXPECT_EQ(image::FileList::directory(tree.path.string()).paths(), want);
    // The same with the directory named with a trailing separator.
    const auto slash = image::FileList::directory(tree.path.string() + "/").paths();
    ASSERT_EQ(slash.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_EQ(fs::path(slash[i]).lexically_normal(), fs::path(want[i]).lexically_normal()) << i;
  }
  const auto globbed = image::FileList::glob((dir.path / "a*").string());
  EXPECT_EQ(globbed.size(), 2u);
  {
    std::ofstream list(dir.path / "list.txt");
    list << "# training files\nb/c.jpg\n\n  a1.jpg  \n/abs/x.jpg\n";
  }
  const auto from_list = image::FileList::list_file((dir.path / "list.txt").string());
  EXPECT_EQ(from_list.paths(), (std::vector<std::string>{(dir.path / "b/c.jpg").string(),
                                                         (dir.path / "a1.jpg").string(), "/abs/x.jpg"}));
  try {
    image::FileList::directory((dir.path / "missing").string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
  EXPECT_THROW(image::FileList::glob((dir.path / "*.png").string()), Error);
  try {
    image::read_file({0, (dir.path / "nope.jpg").string()});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.jpg"), std::string::npos);
  }
}

// "batching/collation of equal-shaped images into an NHWC uint8 host tensor"
TEST(ImageOps, CollateStacksEqualShapesAndNamesTheOddOne) {
  std::vector<image::Image> imgs;
  for (int i = 0; i < 4; ++i) imgs.push_back({std::uint64_t(i), "i" + std::to_string(i), tensor_of(random_pixels(5, 6, 3, i), 5, 6, 3)});
  const HostTensor b = image::collate(imgs);
  EXPECT_EQ(b.shape(), (std::vector<std::int64_t>{4, 5, 6, 3}));
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(0, std::memcmp(static_cast<std::uint8_t*>(b.raw()) + i * 90, imgs[i].pixels.raw(), 90));
  imgs[2].pixels = tensor_of(random_pixels(6, 5, 3, 1), 6, 5, 3);
  try {
    image::collate(imgs);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("image 2 ('i2')"), std::string::npos) << e.what();
  }
}

// The whole input pipeline as a graph: "a corrupt file under skip never stops the epoch, and
// the skipped count and file names appear in the stats"; the batches hold every good image once
// and equal the ops applied one by one, whatever the thread count.
TEST(ImagePipeline, CorruptFilesAreSkippedAndNamedAndTheRestIsExact) {
  TempDir dir("pipeline");
  const int kGood = 45;
  for (int i = 0; i < kGood; ++i) {
    const int h = 40 + i % 7, w = 50 + (i * 3) % 11;
    write_file(dir.path / fmt_name(i), encode(random_pixels(h, w, 3, 100 + i), h, w, 3));
  }
  const auto good = encode(random_pixels(30, 30, 3, 7), 30, 30, 3);
  write_file(dir.path / "img_bad_truncated.jpg", std::vector<std::uint8_t>(good.begin(), good.begin() + 200));
  write_file(dir.path / "img_bad_garbage.jpg", std::vector<std::uint8_t>(500, 0x5a));
  const auto files = image::FileList::directory(dir.path.string());
  ASSERT_EQ(files.size(), std::size_t(kGood + 2));
  const image::AugmentSpec aug{.size = 32, .seed = 5, .epoch = 1};

  std::vector<std::vector<std::uint8_t>> results[2];
  for (int threads : {1, 4}) {
    Runtime rt({.threads = threads});
    Graph g(rt, "images");
    const auto order = files.epoch({.seed = 5, .epoch = 1});
    auto src = g.source("files", files.refs(order));
    auto read = g.stage("read", image::read_file, {.concurrency = 2});
    auto decode = g.stage("decode", [](image::Encoded f) { return image::decode(std::move(f)); },
                          {.concurrency = Concurrency::unlimited, .on_error = OnError::skip});
    auto crop = g.stage("augment", image::RandomResizedCrop(aug), {.concurrency = Concurrency::unlimited});
    auto batch = g.batch<image::Image>("batch", 8);
    auto pack = g.stage("collate", [](std::vector<image::Image> b) {
      std::vector<std::uint64_t> idx;
      for (auto& im : b) idx.push_back(im.index);
      return std::make_pair(idx, image::collate(b));
    });
    auto out = g.pull_sink<std::pair<std::vector<std::uint64_t>, HostTensor>>("out");
    src >> read >> decode >> crop >> batch >> pack >> out;
    auto run = g.run();
    std::set<std::uint64_t> seen;
    std::size_t batches = 0;
    for (auto& [idx, t] : out) {
      ++batches;
      ASSERT_EQ(t.shape(), (std::vector<std::int64_t>{std::int64_t(idx.size()), 32, 32, 3}));
      for (std::size_t k = 0; k < idx.size(); ++k) {
        EXPECT_TRUE(seen.insert(idx[k]).second);
        // The same as the ops applied one at a time.
        const image::Image one = image::RandomResizedCrop(aug)(image::decode(image::read_file({idx[k], files.paths()[idx[k]]})));
        const auto* p = static_cast<const std::uint8_t*>(t.raw()) + k * 32 * 32 * 3;
        ASSERT_EQ(0, std::memcmp(p, one.pixels.raw(), 32 * 32 * 3)) << files.paths()[idx[k]];
      }
      results[threads == 1 ? 0 : 1].push_back(bytes_of(t));
    }
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    EXPECT_EQ(batches, 6u);  // 45 = 5 x 8 + 5
    EXPECT_EQ(seen.size(), std::size_t(kGood));
    const RunStats st = run.stats();
    const StageStats* d = st.find("decode");
    EXPECT_EQ(d->items_skipped, 2u);
    ASSERT_EQ(d->errors.size(), 2u);
    std::set<std::string> named;
    for (const auto& e : d->errors) {
      for (const char* f : {"img_bad_truncated.jpg", "img_bad_garbage.jpg"})
        if (e.message.find(f) != std::string::npos) {
          named.insert(f);
        }
      // The item is the source's sequence number: the position in this epoch's order.
      EXPECT_NE(files.paths()[order.at(e.item)].find("img_bad"), std::string::npos);
    }
    EXPECT_EQ(named.size(), 2u);
  }
  EXPECT_EQ(results[0], results[1]);  // thread count changes nothing
}

// "memory is bounded": large host tensors reuse freed blocks of their size, up to the cache's
// limit, and setting the limit frees what is over it.
TEST(HostCache, ReusesFreedBlocksWithinItsLimit) {
#if defined(SPLITFLOW_TEST_ASAN)
  GTEST_SKIP() << "ASan builds never cache host blocks (use-after-free must stay visible)";
#else
  set_host_cache_limit(0);  // what earlier tests in this process left cached goes first
  set_host_cache_limit(8u << 20);
  const HostCacheStats before = host_cache_stats();
  EXPECT_EQ(before.limit, 8u << 20);
  void* first;
  {
    HostTensor a = HostTensor::empty(DType::f32, {1 << 20});  // 4 MiB
    first = a.raw();
  }
  EXPECT_EQ(host_cache_stats().cached_bytes, before.cached_bytes + (4u << 20));
  {
    HostTensor b = HostTensor::empty(DType::u8, {4 << 20});  // the same size: the same block
    EXPECT_EQ(b.raw(), first);
    EXPECT_EQ(host_cache_stats().hits, before.hits + 1);
  }
  {
    std::vector<HostTensor> many;
    for (int i = 0; i < 5; ++i) many.push_back(HostTensor::empty(DType::u8, {3 << 20}));
  }  // 15 MiB freed at once: only what fits under 8 MiB is kept
  EXPECT_LE(host_cache_stats().cached_bytes, 8u << 20);
  set_host_cache_limit(0);
  EXPECT_EQ(host_cache_stats().cached_bytes, 0u);
  {
    HostTensor small = HostTensor::empty(DType::u8, {1000});  // small blocks never go through it
  }
  EXPECT_EQ(host_cache_stats().cached_bytes, 0u);
  set_host_cache_limit(256u << 20);
#endif
}

// The cache holds size classes, not exact sizes: tensors whose size changes from item to item
// (a random crop's rows) share blocks instead of filling the cache with sizes never asked for
// again; when full, the block freed longest ago goes first (tensor.hpp, set_host_cache_limit).
TEST(HostCache, VaryingSizesShareBlocksAndTheOldestGoesWhenFull) {
#if defined(SPLITFLOW_TEST_ASAN)
  GTEST_SKIP() << "ASan builds never cache host blocks (use-after-free must stay visible)";
#else
  set_host_cache_limit(0);
  set_host_cache_limit(6u << 20);
  const HostCacheStats before = host_cache_stats();
  for (int i = 0; i < 300; ++i) {  // 300 sizes from 1 MiB to 1.28 MiB: classes 1, 1.25, 1.5 MiB
    HostTensor t = HostTensor::empty(DType::u8, {(1 << 20) + i * 997});
  }
  const HostCacheStats after = host_cache_stats();
  EXPECT_EQ(after.misses - before.misses, 3u);
  EXPECT_EQ(after.cached_bytes, (15u << 20) / 4) << "one block per class, not one per size";
  // Full: newer blocks replace the oldest rather than being refused.
  {
    std::vector<HostTensor> many;
    for (int i = 0; i < 3; ++i) many.push_back(HostTensor::empty(DType::u8, {2 << 20}));
  }  // 6 MiB given back into a 6 MiB cache holding 3.75 MiB: the older blocks make room
  EXPECT_EQ(host_cache_stats().cached_bytes, 6u << 20);
  const std::uint64_t hits = host_cache_stats().hits;
  HostTensor again = HostTensor::empty(DType::u8, {2 << 20});
  EXPECT_EQ(host_cache_stats().hits, hits + 1) << "the newest blocks were kept";
  set_host_cache_limit(256u << 20);
#endif
}

// An antialiased resize of a large crop keeps its horizontal pass's rows (here 3,000 rows of
// 224 RGB pixels: 2 MiB) in a block from the cache, so that crop after crop writes warm pages
// (a fresh vector each time faulted in about 800 pages for a 14.7-megapixel photo's crop:
// measured with perf stat, docs/benchmarks.md "Large photos").
TEST(HostCache, ALargeCropsResizeReusesWarmBlocks) {
#if defined(SPLITFLOW_TEST_ASAN)
  GTEST_SKIP() << "ASan builds never cache host blocks (use-after-free must stay visible)";
#else
  set_host_cache_limit(0);
  set_host_cache_limit(64u << 20);
  HostTensor img = HostTensor::empty(DType::u8, {3000, 2000, 3});
  std::memset(img.raw(), 77, img.nbytes());
  std::vector<std::uint8_t> first;
  {
    const HostTensor out = image::resize(img, 224, 224);
    first.assign(out.data<std::uint8_t>(), out.data<std::uint8_t>() + out.nbytes());
  }  // its blocks go back to the cache
  const HostCacheStats before = host_cache_stats();
  for (int i = 0; i < 3; ++i) {
    const HostTensor again = image::resize(img, 224, 224);
    ASSERT_EQ(again.nbytes(), first.size());
    EXPECT_EQ(std::memcmp(again.raw(), first.data(), first.size()), 0);
  }
  const HostCacheStats after = host_cache_stats();
  EXPECT_EQ(after.misses, before.misses) << "the intermediate rows must come from the cache";
  EXPECT_EQ(after.hits, before.hits + 6) << "two warm blocks per resize: the rows, the result";
  set_host_cache_limit(256u << 20);
#endif
}

// Blocks from 128 KiB up go through the cache: glibc's default mmap threshold, above which malloc
// maps and faults in each block afresh once the process has set any malloc parameter (Dask's
// nanny starts its workers with MALLOC_TRIM_THRESHOLD_=65536). A 224x224 RGB crop (147 KiB) is
// reused; a 100 KiB tensor is left to malloc.
TEST(HostCache, BlocksFrom128KiBUpAreReused) {
#if defined(SPLITFLOW_TEST_ASAN)
  GTEST_SKIP() << "ASan builds never cache host blocks (use-after-free must stay visible)";
#else
  set_host_cache_limit(0);
  set_host_cache_limit(8u << 20);
  void* first;
  {
    HostTensor crop = HostTensor::empty(DType::u8, {224, 224, 3});
    first = crop.raw();
  }
  const HostCacheStats before = host_cache_stats();
  EXPECT_GE(before.cached_bytes, 224u * 224 * 3);
  {
    HostTensor again = HostTensor::empty(DType::u8, {224, 224, 3});
    EXPECT_EQ(again.raw(), first);
    EXPECT_EQ(host_cache_stats().hits, before.hits + 1);
  }
  {
    HostTensor small = HostTensor::empty(DType::u8, {100 << 10});
  }
  EXPECT_EQ(host_cache_stats().cached_bytes, before.cached_bytes) << "under 128 KiB: malloc's";
  // Of two blocks of a size, the one given back last goes out first (warm in the CPU's caches).
  void* last;
  {
    HostTensor a = HostTensor::empty(DType::u8, {224, 224, 3});
    HostTensor b = HostTensor::empty(DType::u8, {224, 224, 3});
    last = b.raw();
    HostTensor keep = std::move(a);
    { HostTensor gone = std::move(b); }  // b's block back first, then a's at the end of scope
    last = keep.raw();
  }
  {
    HostTensor next = HostTensor::empty(DType::u8, {224, 224, 3});
    EXPECT_EQ(next.raw(), last) << "the block given back last";
  }
  set_host_cache_limit(256u << 20);
#endif
}
