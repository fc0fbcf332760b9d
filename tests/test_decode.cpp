// Batched decode with placements (splitflow/ops/decode.hpp, issue 20): the frame-header reader,
// the routing rule, placement by load as a policy alone, and the two stage bodies in graphs on
// the host backend, whose device placements are the CPU decoder running as a kernel on the
// backend's device threads: so every placement must give decode_random_resized_crop's pixels.
#include <turbojpeg.h>

#include <cstring>
#include <fmt/format.h>

#include <set>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::host_device;
namespace im = splitflow::image;

namespace {

std::vector<std::uint8_t> pixels(int h, int w, int c, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> px(static_cast<std::size_t>(h * w * c));
  for (int y = 0; y < h; ++y)  // smooth enough to compress, with noise
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k)
        px[(y * w + x) * c + k] = static_cast<std::uint8_t>((x * 3 + y * 2 + k * 40 + rng() % 16) & 255);
  return px;
}

// tjCompress2 with a pixel format (RGB, GRAY, CMYK), a subsampling and flags (progressive).
std::vector<std::uint8_t> jpeg(int h, int w, unsigned seed, int samp = TJSAMP_420, int flags = 0,
                               int pf = TJPF_RGB) {
  const int c = pf == TJPF_GRAY ? 1 : pf == TJPF_CMYK ? 4 : 3;
  const auto px = pixels(h, w, c, seed);
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(tj, px.data(), w, 0, h, pf, &buf, &size, samp, 90, flags);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(tj);
  std::vector<std::uint8_t> out(buf, buf + size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

im::Encoded encoded(std::uint64_t index, const std::vector<std::uint8_t>& bytes) {
  HostTensor t = HostTensor::empty(DType::u8, {static_cast<std::int64_t>(bytes.size())});
  std::memcpy(t.raw(), bytes.data(), bytes.size());
  return im::Encoded{index, "img" + std::to_string(index) + ".jpg", std::move(t)};
}

im::JpegInfo info_of(const std::vector<std::uint8_t>& b) { return im::jpeg_info(b.data(), b.size(), "t"); }

// The SOF0 segment's offset (its marker's 0xFF), to forge a 12-bit header.
std::size_t sof_at(const std::vector<std::uint8_t>& b) {
  for (std::size_t i = 2; i + 1 < b.size(); ++i)
    if (b[i] == 0xFF && b[i + 1] == 0xC0) return i;
  ADD_FAILURE() << "no SOF0";
  return 0;
}

std::string what(const std::exception_ptr& e) {
  if (!e) return "no error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

std::vector<std::uint8_t> bytes_of(const HostTensor& t) {
  const auto* p = t.data<std::uint8_t>();
  return {p, p + t.nbytes()};
}

}  // namespace

TEST(JpegInfo, ReadsTheFrameHeaderOfEachKind) {
  using S = im::JpegInfo::Subsampling;
  using C = im::JpegInfo::Coding;
  const std::vector<std::pair<int, S>> samps{{TJSAMP_444, S::s444}, {TJSAMP_422, S::s422},
                                             {TJSAMP_420, S::s420}, {TJSAMP_440, S::s440},
                                             {TJSAMP_411, S::s411}};
  for (const auto& [tj, want] : samps) {
    const im::JpegInfo i = info_of(jpeg(48, 64, 1, tj));
    EXPECT_EQ(i.subsampling, want) << tj;
    EXPECT_EQ(i.width, 64);
    EXPECT_EQ(i.height, 48);
    EXPECT_EQ(i.components, 3);
    EXPECT_EQ(i.precision, 8);
    EXPECT_EQ(i.coding, C::baseline);
  }
  const im::JpegInfo gray = info_of(jpeg(30, 20, 2, TJSAMP_GRAY, 0, TJPF_GRAY));
  EXPECT_EQ(gray.subsampling, S::gray);
  EXPECT_EQ(gray.components, 1);
  const im::JpegInfo prog = info_of(jpeg(48, 64, 3, TJSAMP_420, TJFLAG_PROGRESSIVE));
  EXPECT_EQ(prog.coding, C::progressive);
  EXPECT_EQ(im::describe(prog), "progressive 8-bit 4:2:0 3 components 64x48");
  const im::JpegInfo cmyk = info_of(jpeg(48, 64, 4, TJSAMP_444, 0, TJPF_CMYK));
  EXPECT_EQ(cmyk.components, 4);
  auto twelve = jpeg(48, 64, 5);
  twelve[sof_at(twelve) + 4] = 12;  // the precision byte after the marker and length
  EXPECT_EQ(info_of(twelve).precision, 12);
}

TEST(JpegInfo, BadHeadersAreErrorsNamingTheFileAndWhatIsWrong) {
  const auto good = jpeg(48, 64, 6);
  auto message = [](const std::vector<std::uint8_t>& b) -> std::string {
    try {
      im::jpeg_info(b.data(), b.size(), "photos/cat.jpg");
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message({'G', 'I', 'F', '8', '9', 'a'}),
            "splitflow: photos/cat.jpg: not a readable JPEG header: no start-of-image marker");
  const long sof = static_cast<long>(sof_at(good));
  const std::vector<std::uint8_t> cut(good.begin(), good.begin() + sof + 10);
  EXPECT_EQ(message(cut), fmt::format("splitflow: photos/cat.jpg: not a readable JPEG header: marker "
                                      "0xFFC0 at byte {} claims 17 bytes, past the end ({})",
                                      sof, sof + 10));
  const std::vector<std::uint8_t> cut_length(good.begin(), good.begin() + sof + 3);
  EXPECT_EQ(message(cut_length), fmt::format("splitflow: photos/cat.jpg: not a readable JPEG header: "
                                             "marker 0xFFC0 is cut off at byte {}", sof + 2));
  const std::vector<std::uint8_t> before(good.begin(), good.begin() + static_cast<long>(sof_at(good)));
  EXPECT_NE(message(before).find("before a frame header"), std::string::npos) << message(before);
  auto no_height = good;
  no_height[sof_at(good) + 5] = 0;
  no_height[sof_at(good) + 6] = 0;
  EXPECT_NE(message(no_height).find("a frame of 64x0"), std::string::npos) << message(no_height);
}

// An APP0 segment claiming 0 bytes, then bytes before the next marker (a fuzz input): libjpeg,
// and so PIL, reads the segment as empty and warns of the extraneous bytes; TurboJPEG's header
// call refuses the warning. The header reader and the decoder read the file as libjpeg does.
TEST(JpegInfo, AnApplicationSegmentClaimingNoBytesIsReadAsLibjpegReadsIt) {
  const auto good = jpeg(48, 64, 9);
  auto odd = good;
  // (and a stuffed 0xFF 0x00 among them, which libjpeg skips as it skips the other bytes)
  const std::vector<std::uint8_t> empty_app0{0xFF, 0xE0, 0x00, 0x00, 0x01, 0xFF, 0x00, 0x03};
  odd.insert(odd.begin() + 2, empty_app0.begin(), empty_app0.end());
  const im::JpegInfo i = info_of(odd);
  EXPECT_EQ(i.width, 64);
  EXPECT_EQ(i.height, 48);
  EXPECT_EQ(i.subsampling, im::JpegInfo::Subsampling::s420);
  const HostTensor want = im::decode_jpeg(good.data(), good.size(), im::Color::rgb, "good.jpg");
  const HostTensor got = im::decode_jpeg(odd.data(), odd.size(), im::Color::rgb, "odd.jpg");
  EXPECT_EQ(got.describe(), want.describe());
  EXPECT_EQ(bytes_of(got), bytes_of(want));
  // Any other segment claiming under 2 bytes is still an error naming it.
  auto bad = good;
  const std::vector<std::uint8_t> empty_dqt{0xFF, 0xDB, 0x00, 0x01};
  bad.insert(bad.begin() + 2, empty_dqt.begin(), empty_dqt.end());
  try {
    im::jpeg_info(bad.data(), bad.size(), "photos/cat.jpg");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), std::string("splitflow: photos/cat.jpg: not a readable JPEG "
                                                 "header: marker 0xFFDB at byte 2 claims a length of 1 "
                                                 "(the length field alone is 2)"));
  }
}

TEST(DecodeRouting, DevicePlacementsTakeOnlyWhatNvjpegDecodes) {
  using P = im::DecodePlacement;
  const auto baseline = info_of(jpeg(48, 64, 7, TJSAMP_422));
  const auto gray = info_of(jpeg(48, 64, 7, TJSAMP_GRAY, 0, TJPF_GRAY));
  const auto prog = info_of(jpeg(48, 64, 7, TJSAMP_420, TJFLAG_PROGRESSIVE));
  const auto s411 = info_of(jpeg(48, 64, 7, TJSAMP_411));
  const auto cmyk = info_of(jpeg(48, 64, 7, TJSAMP_444, 0, TJPF_CMYK));
  auto twelve_bytes = jpeg(48, 64, 7);
  twelve_bytes[sof_at(twelve_bytes) + 4] = 12;
  const auto twelve = info_of(twelve_bytes);
  for (const auto* i : {&baseline, &gray, &prog, &s411, &cmyk, &twelve})
    EXPECT_EQ(im::unsupported_reason(P::cpu, *i), nullptr);
  EXPECT_EQ(im::unsupported_reason(P::hardware, baseline), nullptr);
  EXPECT_EQ(im::unsupported_reason(P::hardware, gray), nullptr);
  EXPECT_STREQ(im::unsupported_reason(P::hardware, prog), "progressive");
  EXPECT_EQ(im::unsupported_reason(P::hybrid, prog), nullptr);
  for (P p : {P::hybrid, P::hardware}) {
    EXPECT_STREQ(im::unsupported_reason(p, s411), "4:1:1 subsampling");
    EXPECT_STREQ(im::unsupported_reason(p, cmyk), "4 components (CMYK or YCCK)");
    EXPECT_STREQ(im::unsupported_reason(p, twelve), "not 8-bit");
  }
}

TEST(DecodePlacer, TheDeviceTakesItsShareOfTheSpareRates) {
  const im::DecodeCosts even{1000, 1000};
  // Idle, equal costs, 2 cores: the CPU decodes twice as fast as the device: a third goes there.
  EXPECT_EQ(im::device_share(60, {}, even, 2, 256), 20u);
  // A CPU-starved node offloads everything; a device-bound one keeps decoding on the CPU.
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 1.0}, even, 2, 256), 60u);
  EXPECT_EQ(im::device_share(60, {.device_busy = 1.0}, even, 2, 256), 0u);
  // Half the CPU busy with other work: 1 core against 1 device: half.
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 0.5}, even, 2, 256), 30u);
  // A device 4x faster per image than a core: 4 / (4 + 2) of 60.
  EXPECT_EQ(im::device_share(60, {}, {1000, 250}, 2, 256), 40u);
  // The engines' queue: full, none; nearly full, only its room.
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 1.0, .device_queue = 256}, even, 2, 256), 0u);
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 1.0, .device_queue = 250}, even, 2, 256), 6u);
  // Nothing has room: the CPU (which always makes progress) keeps them.
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 1.0, .device_busy = 1.0}, even, 2, 256), 0u);
  EXPECT_EQ(im::device_share(0, {.cpu_busy = 1.0}, even, 2, 256), 0u);
  // Loads outside [0, 1] (or NaN) are clamped, NaN as busy.
  EXPECT_EQ(im::device_share(60, {.cpu_busy = 7.0}, even, 2, 256), 60u);
  EXPECT_EQ(im::device_share(60, {.device_busy = std::nan("")}, even, 2, 256), 0u);
}

TEST(BatchDecode, BadOptionsFailWhenTheOpIsBuilt) {
  EXPECT_THROW(im::BatchDecode({.augment = {.size = 0}}), Error);
  EXPECT_THROW(im::BatchDecode({.on_error = OnError::substitute}), Error);
  EXPECT_THROW(im::BatchDecode({.device_queue_cap = 0}), Error);
  EXPECT_THROW(im::BatchDecode({.cores = -1}), Error);
  // Its rows are square crops (u8[n, size, size, c]): a width of its own is the fused op's.
  try {
    im::BatchDecode({.augment = {.size = 24, .width = 40}});
    ADD_FAILURE() << "a non-square augment taken";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "splitflow: BatchDecode: its batches are of square crops (size 24); "
                           "augment.width 40 is for DecodeRandomResizedCrop");
  }
  EXPECT_NO_THROW(im::BatchDecode({.augment = {.size = 24, .width = 24}}));
}

namespace {

struct Result {
  std::vector<im::DecodedBatch::Decoded> decoded;
  std::vector<im::DecodedBatch::Skipped> skipped;
  std::vector<std::vector<std::uint8_t>> rows;  // each decoded image's pixels
  RunStats stats;
  std::exception_ptr error;
};

// files -> batch -> decode.host (CPU stage) -> decode.device (GPU stage) -> a sink reading the
// rows (the host backend's device memory is host memory).
Result run_decode(Runtime& rt, const im::BatchDecode& dec, const std::vector<im::Encoded>& files,
                  std::size_t batch, int side, std::size_t in_flight = 0) {
  Result r;
  // in_flight = batch: one batch in the graph at a time (by_load learns the device's backend
  // from the first batch's device stage; without this the second may be placed before it ran).
  GraphOptions go;
  if (in_flight) go.max_in_flight = in_flight;
  Graph g(rt, "decode", go);
  auto src = g.source("files", files);
  auto b = g.batch<im::Encoded>("batch", batch);
  auto host = g.stage("decode.host", [dec](std::vector<im::Encoded> f) { return dec.host(std::move(f)); });
  auto dev = g.gpu_stage("decode.device", [dec](im::DecodePlan p, DeviceContext& ctx) {
    return dec.device(std::move(p), ctx);
  });
  auto sink = g.sink("out", [&](im::DecodedBatch d) {
    EXPECT_EQ(d.images().dim(0), static_cast<std::int64_t>(d.size()));
    const std::size_t row = static_cast<std::size_t>(side * side * 3);
    for (std::size_t i = 0; i < d.size(); ++i) {
      const auto* p = d.images().data<std::uint8_t>() + i * row;
      r.rows.emplace_back(p, p + row);
      r.decoded.push_back(d.decoded()[i]);
    }
    for (const auto& s : d.skipped()) r.skipped.push_back(s);
  });
  src >> b >> host >> dev >> sink;
  auto run = g.run();
  try {
    run.wait();
  } catch (...) {
    r.error = std::current_exception();
  }
  r.stats = run.stats();
  return r;
}

std::vector<std::uint8_t> reference(const im::Encoded& f, const im::AugmentSpec& spec) {
  return bytes_of(im::decode_random_resized_crop(f, spec).pixels);
}

}  // namespace

// Every placement gives the CPU op's pixels, in the batch's order; streams a device placement
// cannot take are routed to the CPU and counted; every lease and pool byte comes back. (A CMYK
// file is routed to the CPU, whose decoder converts it as PIL does; before that conversion it
// was skipped there with libjpeg-turbo's "Unsupported color conversion request".)
TEST(BatchDecode, EveryPlacementGivesTheCpuPixelsAndUnsupportedStreamsGoToTheCpu) {
  using P = im::DecodePlacement;
  std::vector<im::Encoded> files;
  for (std::uint64_t i = 0; i < 40; ++i) {
    std::vector<std::uint8_t> b = i == 5    ? jpeg(48, 64, 100 + i, TJSAMP_420, TJFLAG_PROGRESSIVE)
                                  : i == 17 ? jpeg(48, 64, 100 + i, TJSAMP_411)
                                  : i == 29 ? jpeg(48, 64, 100 + i, TJSAMP_444, 0, TJPF_CMYK)
                                            : jpeg(40 + static_cast<int>(i % 5) * 8, 64, 100 + i,
                                                   i % 2 ? TJSAMP_422 : TJSAMP_444);
    files.push_back(encoded(i, b));
  }
  const im::AugmentSpec spec{.size = 32, .seed = 11, .epoch = 2};
  for (P p : {P::cpu, P::hybrid, P::hardware}) {
    SCOPED_TRACE(im::to_string(p));
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = spec, .placement = p, .on_error = OnError::skip});
    Result r = run_decode(rt, dec, files, 16, 32);
    ASSERT_FALSE(r.error) << what(r.error);
    ASSERT_EQ(r.decoded.size(), files.size());
    ASSERT_EQ(r.skipped.size(), 0u);
    std::size_t k = 0;
    for (std::uint64_t i = 0; i < files.size(); ++i) {
      EXPECT_EQ(r.decoded[k].index, i);
      EXPECT_EQ(r.decoded[k].path, files[i].path);
      EXPECT_EQ(r.rows[k], reference(files[i], spec)) << "image " << i;
      const P want = p == P::cpu      ? P::cpu
                     : p == P::hybrid ? (i == 17 || i == 29 ? P::cpu : P::hybrid)
                     : i == 5 || i == 17 || i == 29 ? P::cpu
                                                    : P::hardware;
      EXPECT_EQ(r.decoded[k].placement, want) << "image " << i;
      ++k;
    }
    const im::BatchDecodeStats s = dec.stats();
    EXPECT_EQ(s.batches, 3u);
    EXPECT_EQ(s.cpu + s.hybrid + s.hardware, files.size());
    EXPECT_EQ(s.skipped, 0u);
    EXPECT_EQ(s.routed, p == P::cpu ? 0u : p == P::hybrid ? 2u : 3u);
    EXPECT_EQ(s.hardware, p == P::hardware ? 37u : 0u);
    EXPECT_EQ(s.hybrid, p == P::hybrid ? 38u : 0u);
    EXPECT_GT(s.cpu_ns, 0);
    if (p != P::cpu) {
      EXPECT_GT(s.device_ns, 0);
    }
    testing_helpers::expect_returned(rt, r.stats);
  }
}

// A corrupt image in a batch of 64 is skipped alone, on every placement: its batch-mates come
// out with their pixels, the skipped list names it, its path and the decoder's message.
TEST(BatchDecode, ACorruptImageInABatchIsSkippedAlone) {
  using P = im::DecodePlacement;
  const im::AugmentSpec spec{.size = 24, .seed = 3};
  std::vector<im::Encoded> files;
  for (std::uint64_t i = 0; i < 64; ++i) {
    auto b = jpeg(48, 64, 300 + i);
    if (i == 9) b.resize(b.size() / 2);                 // truncated: the header reads, decode fails
    if (i == 40) b = {'n', 'o', 't', ' ', 'j', 'p', 'g'};  // no header at all
    files.push_back(encoded(i, b));
  }
  for (P p : {P::cpu, P::hardware, P::by_load}) {
    SCOPED_TRACE(im::to_string(p));
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = spec, .placement = p, .on_error = OnError::skip,
                         .load = [] { return im::DecodeLoad{.cpu_busy = 1.0}; }});
    // by_load places on the CPU until the device stage has run once: two batches of 32.
    Result r = p == P::by_load ? run_decode(rt, dec, files, 32, 24, 32) : run_decode(rt, dec, files, 64, 24);
    ASSERT_FALSE(r.error) << what(r.error);
    ASSERT_EQ(r.decoded.size(), 62u);
    ASSERT_EQ(r.skipped.size(), 2u);
    std::set<std::uint64_t> skipped{r.skipped[0].index, r.skipped[1].index};
    EXPECT_EQ(skipped, (std::set<std::uint64_t>{9, 40}));
    for (const auto& s : r.skipped) {
      EXPECT_EQ(s.path, files[s.index].path);
      if (s.index == 40) {
        EXPECT_NE(s.error.find("no start-of-image marker"), std::string::npos) << s.error;
      } else {
        EXPECT_NE(s.error.find("img9.jpg"), std::string::npos) << s.error;
      }
    }
    std::size_t k = 0;
    for (std::uint64_t i = 0; i < 64; ++i) {
      if (i == 9 || i == 40) continue;
      EXPECT_EQ(r.decoded[k].index, i);
      EXPECT_EQ(r.rows[k], reference(files[i], spec)) << "image " << i;
      ++k;
    }
    const im::BatchDecodeStats s = dec.stats();
    EXPECT_EQ(s.skipped, 2u);
    EXPECT_EQ(s.cpu + s.hybrid + s.hardware, 62u);
    if (p == P::by_load) {
      EXPECT_EQ(s.cpu, 31u) << "the first batch, before the device was known";
      EXPECT_EQ(s.hardware, 31u) << "the CPU is starved: the second batch goes to the device";
    }
    testing_helpers::expect_returned(rt, r.stats);
  }
}

// Bytes of another dtype are the caller's mistake, not a bad file: the batch fails naming the
// file, under skip too (each such file would have been dropped as a failure).
TEST(BatchDecode, BytesOfAnotherDtypeFailTheBatchEvenUnderSkip) {
  im::BatchDecode dec({.augment = {.size = 24}, .on_error = OnError::skip});
  std::vector<im::Encoded> files{encoded(0, jpeg(48, 64, 1)), encoded(1, jpeg(48, 64, 2))};
  HostTensor i8 = HostTensor::empty(DType::i8, {files[1].bytes.dim(0)});
  std::memcpy(i8.raw(), files[1].bytes.raw(), static_cast<std::size_t>(files[1].bytes.nbytes()));
  files[1].bytes = i8;
  try {
    (void)dec.host(files);
    ADD_FAILURE() << "int8 bytes taken";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("splitflow::image::BatchDecode: 'img1.jpg': takes a file's bytes "
                                          "as contiguous u8, got i8[", 0), 0u) << e.what();
  }
}

// Without skip, a corrupt image fails the run, with an error naming the stage, the image's index
// and path, its placement and the decoder's message; nothing is leaked.
TEST(BatchDecode, WithoutSkipACorruptImageFailsTheRunNamingIt) {
  using P = im::DecodePlacement;
  std::vector<im::Encoded> files;
  for (std::uint64_t i = 0; i < 32; ++i) {
    auto b = jpeg(48, 64, 500 + i);
    if (i == 21) b.resize(b.size() / 2);
    files.push_back(encoded(i, b));
  }
  for (P p : {P::cpu, P::hardware}) {
    SCOPED_TRACE(im::to_string(p));
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = {.size = 24}, .placement = p});
    Result r = run_decode(rt, dec, files, 16, 24);
    ASSERT_TRUE(r.error);
    try {
      std::rethrow_exception(r.error);
    } catch (const StageError& e) {
      EXPECT_EQ(e.stage(), p == P::cpu ? "decode.host" : "decode.device");
      const std::string m = e.message();
      EXPECT_NE(m.find("image 21 (img21.jpg)"), std::string::npos) << m;
      if (p == P::hardware) {
        EXPECT_NE(m.find("placement hardware"), std::string::npos) << m;
      }
    }
    testing_helpers::expect_returned(rt, r.stats);
  }
}

// Placement by load, end to end with an injected load: a starved CPU sends every image the
// device takes to the device (a progressive one to hybrid, a 4:1:1 one to the CPU); a busy
// device keeps them all on the CPU; and the measured load is what by_load read.
TEST(BatchDecode, ByLoadFollowsTheLoadItReads) {
  using P = im::DecodePlacement;
  std::vector<im::Encoded> files;
  for (std::uint64_t i = 0; i < 48; ++i)
    files.push_back(encoded(i, i == 30   ? jpeg(48, 64, 700 + i, TJSAMP_420, TJFLAG_PROGRESSIVE)
                               : i == 31 ? jpeg(48, 64, 700 + i, TJSAMP_411)
                                         : jpeg(48, 64, 700 + i)));
  const im::AugmentSpec spec{.size = 16, .seed = 5};
  {
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = spec, .load = [] { return im::DecodeLoad{.cpu_busy = 1.0}; }});
    Result r = run_decode(rt, dec, files, 16, 16, 16);
    ASSERT_FALSE(r.error) << what(r.error);
    ASSERT_EQ(r.decoded.size(), 48u);
    for (std::size_t i = 16; i < 48; ++i) {  // after the first batch (the device unknown yet)
      const P want = i == 30 ? P::hybrid : i == 31 ? P::cpu : P::hardware;
      EXPECT_EQ(r.decoded[i].placement, want) << i;
    }
    for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(r.decoded[i].placement, P::cpu) << i;
    const auto s = dec.stats();
    EXPECT_EQ(s.hardware, 30u);
    EXPECT_EQ(s.hybrid, 1u);
    EXPECT_EQ(s.cpu, 17u);
    EXPECT_EQ(s.routed, 1u);
    EXPECT_EQ(s.last_load.cpu_busy, 1.0);
  }
  {
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = spec, .load = [] { return im::DecodeLoad{.device_busy = 1.0}; }});
    Result r = run_decode(rt, dec, files, 16, 16);
    ASSERT_FALSE(r.error) << what(r.error);
    ASSERT_EQ(r.decoded.size(), 48u);
    for (std::size_t i = 0; i < 48; ++i) {
      EXPECT_EQ(r.decoded[i].placement, P::cpu) << i;
      EXPECT_EQ(r.rows[i], reference(files[i], spec)) << i;
    }
    EXPECT_EQ(dec.stats().cpu, 48u);
  }
  {  // measured: both loads within [0, 1]
    Runtime rt(host_device(2, 2, 2));
    im::BatchDecode dec({.augment = spec});
    Result r = run_decode(rt, dec, files, 16, 16);
    ASSERT_FALSE(r.error) << what(r.error);
    EXPECT_EQ(r.decoded.size(), 48u);
    const auto s = dec.stats();
    EXPECT_GE(s.last_load.cpu_busy, 0.0);
    EXPECT_LE(s.last_load.cpu_busy, 1.0);
    EXPECT_EQ(s.cpu + s.hybrid + s.hardware, 48u);
  }
}
