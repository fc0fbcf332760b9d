// A training input pipeline over a directory of JPEGs, as a C++ training loop would use it:
//
//   files (shuffled per epoch, sharded by rank) -> read -> decode + random-resized-crop + flip
//   -> batches of 64 -> collate into the GPU stage's pinned ring -> normalize on the device
//   -> the training loop (this thread)
//
//     image_pipeline DIR [EPOCHS]
//
// CPU stages run on the runtime's threads; the GPU stage leases a stream only for its copy and
// kernel; a corrupt file is skipped and reported, not fatal. With no CUDA device the GPU stage
// runs on the host backend (the same code).
#include <splitflow/ops/image.hpp>
#include <splitflow/ops/ops.hpp>
#include <splitflow/splitflow.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>

using namespace splitflow;

int run_pipeline(int argc, char** argv) {
  const auto usage = [&](std::FILE* to) {
    std::fprintf(to, "usage: %s DIR [EPOCHS]   (DIR: JPEG files, searched recursively; EPOCHS: 1 or more)\n",
                 argv[0]);
  };
  if (argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    usage(stdout);
    return 0;
  }
  char* end = nullptr;
  const long epochs = argc > 2 ? std::strtol(argv[2], &end, 10) : 1;
  if (argc < 2 || argc > 3 || (argc > 2 && (*end != '\0' || epochs < 1 || epochs > 100000))) {
    usage(stderr);
    return 2;
  }
  const image::FileList files = image::FileList::directory(argv[1]);
  const int rank = 0, world_size = 1;  // from your launcher in distributed training
  constexpr int kBatch = 64, kSize = 224;

  Runtime rt;  // one per process: a thread per core, the device shared by every graph
  for (int epoch = 0; epoch < epochs; ++epoch) {
    Graph g(rt, "train-input");
    // This rank's files for this epoch, in this epoch's order (every file once over all ranks).
    const auto order = files.epoch({.seed = 42, .epoch = std::uint64_t(epoch), .rank = rank, .world_size = world_size});
    auto src = g.source("files", files.refs(order));
    // No hand-set concurrency: the graph's tuner sets it from what it measures (docs/autotune.md).
    auto read = g.stage("read", image::read_file, {.concurrency = Concurrency::automatic});
    // Decodes only the crop's region; randomness from (seed, epoch, file index): reproducible.
    auto decode = g.stage("decode+augment",
                          image::DecodeRandomResizedCrop({.size = kSize, .seed = 42, .epoch = std::uint64_t(epoch)}),
                          {.concurrency = Concurrency::automatic, .on_error = OnError::skip});
    auto batch = g.batch<image::Image>("batch", kBatch);
    // Writes the batch straight into pinned ring space: the H2D copy needs no staging.
    auto collate = g.stage("collate", [](std::vector<image::Image> b, HostAllocator& ring) {
      return image::collate(b, &ring);
    });
    GpuStageOptions gpu;
    gpu.ring_item_bytes = std::size_t{kBatch} * kSize * kSize * 3;  // the largest batch
    // ring_bytes is left automatic: 64 MiB in the first epoch, then what the last one needed.
    auto normalize = g.gpu_stage("normalize", [](DeviceTensor images, DeviceContext& ctx) {
      return ops::normalize(ctx, images, {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
    }, gpu);
    auto loader = g.pull_sink<DeviceTensor>("loader");
    src >> read >> decode >> batch >> collate >> normalize >> loader;

    auto run = g.run();
    long images = 0;
    for (DeviceTensor& x : loader) {  // float32 NCHW on the device: your training step goes here
      images += x.dim(0);
    }
    run.wait();
    const RunStats st = run.stats();
    std::printf("epoch %d: %ld images in %.2f s (%.0f images/s)\n", epoch, images, st.wall_ns / 1e9,
                images / (st.wall_ns / 1e9));
    if (const StageStats* d = st.find("decode+augment"); d && d->items_skipped > 0) {
      std::printf("  skipped %llu unreadable files, e.g. %s\n",
                  static_cast<unsigned long long>(d->items_skipped), d->errors.front().message.c_str());
    }
    for (const std::string& e : st.autotune) std::printf("  autotune: %s\n", e.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run_pipeline(argc, argv);
  } catch (const std::exception& e) {  // a missing directory, an unreadable file: say it, exit 1
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
