// Seed corpora for the fuzz targets (tests/fuzz/README in docs/reliability.md, "Fuzzing"),
// written with libjpeg's compressor so that every coding option is reachable: every chroma
// subsampling libjpeg can write (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:1:0, 1x4, 3x2), baseline
// and progressive, Huffman (default and optimised tables) and arithmetic coding, restart
// markers (every MCU and every row), grayscale, RGB stored as RGB, CMYK and YCCK (Adobe
// marker), odd sizes from 1x1; then variants patched by hand: a 12-bit and a 16-bit precision
// byte (libjpeg-turbo 2.1 decodes 8-bit only: these exercise the refusal), forged frame sizes
// (65535 x 65535, 60000 x 60000, 16384 x 16384 progressive, 0 x 0), and cuts at the frame
// header, the first scan and halfway. (A forged 16384 x 16384 baseline file, inside the pixel
// limit, decodes 768 MiB before its first warning: 8x slower fuzzing while it and its mutants
// are in the corpus, so it is a regression input instead, tests/fuzz/regressions/decode_jpeg/.)
//
//     make_seeds OUT_DIR      writes OUT_DIR/<target>/*: decode_jpeg, decode_region,
//                             decode_crop, resize, file_list
#include <cstdio>
#include <jpeglib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;

namespace {

struct Spec {
  std::string name;
  int w, h;
  J_COLOR_SPACE in_space;  // JCS_RGB, JCS_GRAYSCALE, JCS_CMYK
  J_COLOR_SPACE jpeg_space;  // JCS_YCbCr, JCS_GRAYSCALE, JCS_RGB, JCS_CMYK, JCS_YCCK
  int hs = 1, vs = 1;        // luma sampling factors (chroma 1x1)
  bool progressive = false, arithmetic = false, optimize = false;
  int restart_mcus = 0, restart_rows = 0;
  int quality = 75;
};

Bytes compress(const Spec& s) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* mem = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &mem, &size);
  c.image_width = static_cast<JDIMENSION>(s.w);
  c.image_height = static_cast<JDIMENSION>(s.h);
  c.in_color_space = s.in_space;
  c.input_components = s.in_space == JCS_GRAYSCALE ? 1 : s.in_space == JCS_CMYK ? 4 : 3;
  jpeg_set_defaults(&c);
  jpeg_set_colorspace(&c, s.jpeg_space);
  jpeg_set_quality(&c, s.quality, TRUE);
  if (c.num_components >= 3) {
    c.comp_info[0].h_samp_factor = s.hs;
    c.comp_info[0].v_samp_factor = s.vs;
    for (int i = 1; i < c.num_components; ++i)
      c.comp_info[i].h_samp_factor = c.comp_info[i].v_samp_factor = 1;
    if (c.num_components == 4) {  // YCCK / CMYK: K at full resolution too
      c.comp_info[3].h_samp_factor = s.hs;
      c.comp_info[3].v_samp_factor = s.vs;
    }
  }
  if (s.progressive) jpeg_simple_progression(&c);
  c.arith_code = s.arithmetic ? TRUE : FALSE;
  c.optimize_coding = s.optimize ? TRUE : FALSE;
  c.restart_interval = static_cast<unsigned>(s.restart_mcus);
  c.restart_in_rows = s.restart_rows;
  jpeg_start_compress(&c, TRUE);
  const int comps = c.input_components;
  std::vector<JSAMPLE> row(static_cast<std::size_t>(s.w) * comps);
  std::uint32_t noise = 12345;
  for (int y = 0; y < s.h; ++y) {
    for (int x = 0; x < s.w; ++x)
      for (int k = 0; k < comps; ++k) {
        noise = noise * 1664525u + 1013904223u;
        // gradients, an edge and some noise: non-trivial AC coefficients in every block
        const int v = (x * 255 / (s.w > 1 ? s.w - 1 : 1)) * (k + 1) + y * 3 + ((x / 5 + y / 3) % 2) * 60 +
                      static_cast<int>(noise >> 28);
        row[static_cast<std::size_t>(x) * comps + k] = static_cast<JSAMPLE>(v & 255);
      }
    JSAMPROW r = row.data();
    jpeg_write_scanlines(&c, &r, 1);
  }
  jpeg_finish_compress(&c);
  Bytes out(mem, mem + size);
  jpeg_destroy_compress(&c);
  std::free(mem);
  return out;
}

void write(const fs::path& p, const Bytes& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// The offset of the first marker `m` (0xFFm), or npos.
std::size_t find_marker(const Bytes& b, std::uint8_t m) {
  for (std::size_t i = 0; i + 1 < b.size(); ++i)
    if (b[i] == 0xFF && b[i + 1] == m) return i;
  return std::string::npos;
}
std::size_t find_sof(const Bytes& b) {
  for (std::uint8_t m : {0xC0, 0xC1, 0xC2, 0xC9, 0xCA}) {
    const std::size_t i = find_marker(b, m);
    if (i != std::string::npos) return i;
  }
  return std::string::npos;
}

// SOF: FF Cx len(2) precision(1) height(2) width(2) ...
Bytes with_size(Bytes b, int h, int w) {
  const std::size_t i = find_sof(b);
  b[i + 5] = static_cast<std::uint8_t>(h >> 8);
  b[i + 6] = static_cast<std::uint8_t>(h);
  b[i + 7] = static_cast<std::uint8_t>(w >> 8);
  b[i + 8] = static_cast<std::uint8_t>(w);
  return b;
}
Bytes with_precision(Bytes b, int bits) {
  b[find_sof(b) + 4] = static_cast<std::uint8_t>(bits);
  return b;
}

Bytes with_tail(Bytes b, std::initializer_list<std::uint8_t> tail) {
  b.insert(b.end(), tail.begin(), tail.end());
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT_DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  for (const char* t : {"decode_jpeg", "decode_region", "decode_crop", "resize", "file_list"})
    fs::create_directories(out / t);

  std::vector<Spec> specs;
  struct Sub {
    const char* name;
    int hs, vs;
  };
  const Sub subs[] = {{"444", 1, 1}, {"422", 2, 1}, {"420", 2, 2}, {"440", 1, 2},
                      {"411", 4, 1}, {"410", 4, 2}, {"441", 1, 4}, {"32", 3, 2}};
  const int sizes[][2] = {{16, 16}, {33, 17}, {7, 5}};
  for (const Sub& sub : subs)
    for (const auto& sz : sizes) {
      Spec s{std::string("ycc") + sub.name + "_" + std::to_string(sz[0]) + "x" + std::to_string(sz[1]),
             sz[0], sz[1], JCS_RGB, JCS_YCbCr, sub.hs, sub.vs};
      specs.push_back(s);
    }
  // every coding option on 4:2:0 and 4:4:4, one size with partial MCUs
  for (const Sub& sub : {subs[0], subs[2], subs[1]}) {
    const std::string n = sub.name;
    Spec base{"", 41, 23, JCS_RGB, JCS_YCbCr, sub.hs, sub.vs};
    Spec p = base;  p.name = "prog" + n;  p.progressive = true;  specs.push_back(p);
    Spec a = base;  a.name = "arith" + n;  a.arithmetic = true;  specs.push_back(a);
    Spec pa = base; pa.name = "progarith" + n; pa.progressive = pa.arithmetic = true; specs.push_back(pa);
    Spec o = base;  o.name = "opt" + n;  o.optimize = true;  specs.push_back(o);
    Spec r1 = base; r1.name = "rst1_" + n; r1.restart_mcus = 1; specs.push_back(r1);
    Spec r2 = base; r2.name = "rstrow_" + n; r2.restart_rows = 1; specs.push_back(r2);
    Spec r3 = base; r3.name = "progrst_" + n; r3.progressive = true; r3.restart_mcus = 2; specs.push_back(r3);
    Spec q1 = base; q1.name = "q5_" + n; q1.quality = 5; specs.push_back(q1);
    Spec q2 = base; q2.name = "q100_" + n; q2.quality = 100; specs.push_back(q2);
  }
  specs.push_back({"gray_1x1", 1, 1, JCS_GRAYSCALE, JCS_GRAYSCALE});
  specs.push_back({"gray_40x9", 40, 9, JCS_GRAYSCALE, JCS_GRAYSCALE});
  {
    Spec g{"gray_prog", 24, 24, JCS_GRAYSCALE, JCS_GRAYSCALE};
    g.progressive = true;
    specs.push_back(g);
    g.name = "gray_rst";
    g.progressive = false;
    g.restart_mcus = 1;
    specs.push_back(g);
  }
  specs.push_back({"rgb_1x1", 1, 1, JCS_RGB, JCS_YCbCr});
  specs.push_back({"rgb_as_rgb", 19, 11, JCS_RGB, JCS_RGB});
  specs.push_back({"cmyk", 20, 12, JCS_CMYK, JCS_CMYK});
  specs.push_back({"ycck", 20, 12, JCS_CMYK, JCS_YCCK});
  specs.push_back({"ycck_420", 20, 12, JCS_CMYK, JCS_YCCK, 2, 2});
  {
    Spec c{"cmyk_prog", 20, 12, JCS_CMYK, JCS_CMYK};
    c.progressive = true;
    specs.push_back(c);
  }
  specs.push_back({"wide_1x200", 200, 1, JCS_RGB, JCS_YCbCr, 2, 2});
  specs.push_back({"tall_200x1", 1, 200, JCS_RGB, JCS_YCbCr, 2, 2});
  specs.push_back({"big_96x80", 96, 80, JCS_RGB, JCS_YCbCr, 2, 2});

  std::vector<std::pair<std::string, Bytes>> jpegs;
  for (const Spec& s : specs) jpegs.emplace_back(s.name, compress(s));
  // Hand-patched variants of a 4:2:0 baseline and a progressive file.
  const Bytes base = compress({"", 16, 16, JCS_RGB, JCS_YCbCr, 2, 2});
  Spec ps{"", 16, 16, JCS_RGB, JCS_YCbCr, 1, 1};
  ps.progressive = true;
  const Bytes prog = compress(ps);
  jpegs.emplace_back("p12bit", with_precision(base, 12));
  jpegs.emplace_back("p16bit", with_precision(base, 16));
  jpegs.emplace_back("huge_65535", with_size(base, 65535, 65535));
  jpegs.emplace_back("huge_60000", with_size(base, 60000, 60000));
  jpegs.emplace_back("huge_16384_prog", with_size(prog, 16384, 16384));
  jpegs.emplace_back("zero_size", with_size(base, 0, 0));
  jpegs.emplace_back("cut_sof", Bytes(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(find_sof(base))));
  jpegs.emplace_back("cut_sos", Bytes(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(find_marker(base, 0xDA) + 12)));
  jpegs.emplace_back("cut_half", Bytes(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(base.size() / 2)));
  jpegs.emplace_back("cut_prog_half", Bytes(prog.begin(), prog.begin() + static_cast<std::ptrdiff_t>(prog.size() * 2 / 3)));

  for (const auto& [name, b] : jpegs) {
    write(out / "decode_jpeg" / (name + ".jpg"), b);
    // decode_region: the last 17 bytes are the box (4 x int32) and a mode (fuzz_decode_region.cpp)
    write(out / "decode_region" / (name + "_whole.bin"), with_tail(b, {0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 0, 0, 255, 255, 0, 0, 0}));
    write(out / "decode_region" / (name + "_mid.bin"), with_tail(b, {0, 64, 0, 0, 0, 96, 0, 0, 0, 128, 0, 0, 0, 64, 0, 0, 1}));
    write(out / "decode_region" / (name + "_empty.bin"), with_tail(b, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4}));
    write(out / "decode_region" / (name + "_raw.bin"), with_tail(b, {2, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0, 2}));
    write(out / "decode_region" / (name + "_ovf.bin"), with_tail(b, {254, 255, 255, 127, 0, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 2}));
    // decode_crop: the last 12 bytes are the index, size, ranges, flip, seed and a mode
    // (fuzz_decode_crop.cpp)
    write(out / "decode_crop" / (name + "_a.bin"), with_tail(b, {0, 0, 0, 0, 7, 2, 6, 3, 5, 128, 0, 0}));
    write(out / "decode_crop" / (name + "_b.bin"), with_tail(b, {7, 0, 0, 0, 31, 1, 9, 0, 8, 255, 0x35, 3}));
  }

  // resize: a header (fuzz_resize.cpp reads it from the end) and pixels
  for (int i = 0; i < 12; ++i) {
    Bytes b(static_cast<std::size_t>(64 + i * 97));
    std::uint32_t x = 99u + static_cast<std::uint32_t>(i);
    for (auto& v : b) {
      x = x * 1664525u + 1013904223u;
      v = static_cast<std::uint8_t>(x >> 24);
    }
    write(out / "resize" / ("r" + std::to_string(i) + ".bin"), b);
  }

  // file_list: list files (fuzz_file_list.cpp: the first 8 bytes are the shard spec)
  const std::string lists[] = {
      "a.jpg\nb.jpg\n",
      "# comment\n\n  spaced.jpg  \n/abs/path.jpg\r\nsub/dir/c.JPEG\n\t\n#x\nlast-no-newline.jpg",
      std::string("nul\0in.jpg\n..\n.\n/\n//x\n", 22),
      "\xff\xfe\xc3\x28.jpg\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nz.jpg\n",
  };
  int n = 0;
  for (const std::string& l : lists) {
    Bytes b = {7, 0, 1, 0, 3, 0, 2, 1};
    b.insert(b.end(), l.begin(), l.end());
    write(out / "file_list" / ("l" + std::to_string(n++) + ".txt"), b);
  }
  std::printf("make_seeds: %zu JPEGs (x5 region, x2 crop), 12 resize, %d list seeds in %s\n",
              jpegs.size(), n, out.c_str());
  return 0;
}
