// The image input pipeline from C++, timed: the C++ leg of benchmarks/bench_images.py.
//
//   image_pipeline_bench pipeline DIR [--batch 64] [--size 224] [--threads 0] [--epochs 2]
//                               [--normalize cpu|gpu] [--fused 1|0]
//       files -> read -> decode + random-resized-crop + flip -> batch -> collate -> normalize,
//       consumed by the calling thread; prints {"images_per_s": ...} (the best epoch).
//       --fused 1 (default): one op decodes only the crop's region
//       (image::DecodeRandomResizedCrop); 0: full decode, then the crop (two stages).
//   image_pipeline_bench ceiling DIR [--threads 0] [--epochs 2]
//       libjpeg-turbo full decode of the same files on all threads, nothing else (the bytes are
//       read into memory first): the decode-only ceiling.
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <splitflow/ops/image.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>
#include <string>
#include <thread>
#include <vector>

using namespace splitflow;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode, dir, normalize = "cpu";
  int batch = 64, size = 224, threads = 0, epochs = 2;
  bool fused = true;  // decode + crop in one op, decoding the crop's region only
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s pipeline|ceiling DIR [--batch N] [--size N] [--threads N] [--epochs N] [--normalize cpu|gpu] [--fused 1|0]\n", argv[0]);
    std::exit(2);
  }
  a.mode = argv[1];
  a.dir = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--batch") a.batch = std::atoi(v);
    else if (k == "--size") a.size = std::atoi(v);
    else if (k == "--threads") a.threads = std::atoi(v);
    else if (k == "--epochs") a.epochs = std::atoi(v);
    else if (k == "--normalize") a.normalize = v;
    else if (k == "--fused") a.fused = std::atoi(v) != 0;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

const std::vector<float> kMean{0.485f, 0.456f, 0.406f}, kStd{0.229f, 0.224f, 0.225f};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One epoch through the graph; returns images/s and fills `stats`.
double pipeline_epoch(Runtime& rt, const image::FileList& files, const Args& a, std::uint64_t epoch,
                      std::string& table) {
  Graph g(rt, "images");
  auto src = g.source("files", files.refs(files.epoch({.seed = 1, .epoch = epoch})));
  auto read = g.stage("read", image::read_file, {.concurrency = 2});
  const image::AugmentSpec aug{.size = a.size, .seed = 1, .epoch = epoch};
  auto batch = g.batch<image::Image>("batch", static_cast<std::size_t>(a.batch));
  if (a.fused) {
    auto decode_crop = g.stage("decode+augment", image::DecodeRandomResizedCrop(aug),
                               {.concurrency = Concurrency::unlimited, .on_error = OnError::skip});
    src >> read >> decode_crop >> batch;
  } else {
    auto decode = g.stage("decode", [](image::Encoded f) { return image::decode(std::move(f)); },
                          {.concurrency = Concurrency::unlimited, .on_error = OnError::skip});
    auto crop = g.stage("augment", image::RandomResizedCrop(aug), {.concurrency = Concurrency::unlimited});
    src >> read >> decode >> crop >> batch;
  }
  std::size_t images = 0, batches = 0;
  double checksum = 0;
  Run run;
  const auto t0 = Clock::now();
  if (a.normalize == "gpu") {
    // Collate into the GPU stage's pinned ring; normalize on a leased stream.
    auto pack = g.stage("collate", [](std::vector<image::Image> b, HostAllocator& alloc) {
      return image::collate(b, &alloc);
    });
    auto norm = g.gpu_stage("normalize", [](DeviceTensor t, DeviceContext& ctx) {
      return ctx.to_host(ops::normalize(ctx, t, kMean, kStd));
    }, {.ring_bytes = std::size_t(a.batch) * a.size * a.size * 3 * 4,
        .ring_item_bytes = std::size_t(a.batch) * a.size * a.size * 3});
    auto out = g.pull_sink<HostTensor>("out");
    batch >> pack >> norm >> out;
    run = g.run();
    for (auto& t : out) {
      images += static_cast<std::size_t>(t.dim(0));
      ++batches;
      checksum += t.data<float>()[0];
    }
  } else {
    auto pack = g.stage("collate+normalize", [](std::vector<image::Image> b) {
      return ops::normalize_host(image::collate(b), kMean, kStd);
    }, {.concurrency = Concurrency::unlimited});
    auto out = g.pull_sink<HostTensor>("out");
    batch >> pack >> out;
    run = g.run();
    for (auto& t : out) {
      images += static_cast<std::size_t>(t.dim(0));
      ++batches;
      checksum += t.data<float>()[0];
    }
  }
  run.wait();
  const double s = seconds_since(t0);
  table = format_table(run.stats());
  if (checksum != checksum) std::fprintf(stderr, "NaN in the output\n");
  return static_cast<double>(images) / s;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const image::FileList files = image::FileList::directory(a.dir);
  if (files.size() == 0) {
    std::fprintf(stderr, "no JPEG files under %s\n", a.dir.c_str());
    return 1;
  }
  const int threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());
  double best = 0;
  if (a.mode == "ceiling") {
    std::vector<image::Encoded> bytes;
    for (std::uint64_t i = 0; i < files.size(); ++i) bytes.push_back(image::read_file({i, files.paths()[i]}));
    tbb::task_arena arena(threads);
    for (int e = 0; e < a.epochs; ++e) {
      const auto t0 = Clock::now();
      arena.execute([&] {
        tbb::parallel_for(std::size_t{0}, bytes.size(), [&](std::size_t i) {
          const auto& b = bytes[i];
          HostTensor px = image::decode_jpeg(b.bytes.data<std::uint8_t>(), b.bytes.nbytes(), image::Color::rgb, b.path);
          if (px.nbytes() == 0) std::abort();
        });
      });
      best = std::max(best, static_cast<double>(bytes.size()) / seconds_since(t0));
    }
  } else if (a.mode == "pipeline") {
    RuntimeConfig cfg;
    cfg.threads = threads;
    cfg.device.backend = BackendKind::automatic;
    Runtime rt(cfg);
    std::string table;
    for (int e = 0; e < a.epochs; ++e) best = std::max(best, pipeline_epoch(rt, files, a, static_cast<std::uint64_t>(e), table));
    std::fprintf(stderr, "%s\n", table.c_str());
  } else {
    std::fprintf(stderr, "unknown mode %s (pipeline or ceiling)\n", a.mode.c_str());
    return 2;
  }
  std::printf("{\"mode\": \"%s\", \"images\": %zu, \"threads\": %d, \"images_per_s\": %.1f}\n",
              a.mode.c_str(), files.size(), threads, best);
  return 0;
}
