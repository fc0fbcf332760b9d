// Batched JPEG decode with a placement per image: the CPU (libjpeg-turbo, in a CPU stage), or
// the device (nvJPEG's hybrid decoder: Huffman on the host, the rest on the GPU; or its hardware
// JPEG engines), chosen per batch by load, with per-image errors. Two bodies share one state:
// host() runs in a CPU stage (headers, routing, placement, the CPU placement's decodes) and
// device() in the GPU stage after it (the device placements' decodes, every row into one
// device tensor).
//
//     image::BatchDecode dec({.augment = {.size = 224, .seed = 7}, .on_error = OnError::skip});
//     auto files = g.stage("read", image::read_file);
//     auto batch = g.batch<image::Encoded>("batch", 64);
//     auto host  = g.stage("decode.host", [dec](std::vector<image::Encoded> f) {
//                    return dec.host(std::move(f)); });
//     auto dev   = g.gpu_stage("decode.device", [dec](image::DecodePlan p, DeviceContext& ctx) {
//                    return dec.device(std::move(p), ctx); });   // -> image::DecodedBatch
//
// What runs where today: the CPU placement everywhere; the device placements on the host
// backend, where they are modelled by the CPU decoder running as a kernel on the backend's
// device threads (so placement, routing, per-image errors and accounting are tested without a
// GPU). The nvJPEG path is not built yet: on the CUDA backend a fixed device placement is an
// error naming the stage, and by_load places every image on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "splitflow/core/config.hpp"
#include "splitflow/core/tensor.hpp"
#include "splitflow/device/device.hpp"
#include "splitflow/ops/image.hpp"

namespace splitflow::image {

/// What a JPEG's frame header says, read from its markers without decoding anything.
struct JpegInfo {
  enum class Coding { baseline, extended, progressive, lossless, arithmetic, hierarchical };
  enum class Subsampling { gray, s444, s422, s420, s440, s411, other };
  int width = 0, height = 0;
  int components = 0;  ///< 1 gray, 3 YCbCr (or RGB), 4 CMYK or YCCK
  int precision = 0;   ///< bits per sample: 8 or 12 (16 for lossless)
  Coding coding = Coding::baseline;
  Subsampling subsampling = Subsampling::other;
};

/// Reads the frame header (SOFn) of a JPEG. Throws Error naming `what` when the data is not a
/// JPEG, is cut before its frame header, or a marker segment runs past the end.
JpegInfo jpeg_info(const std::uint8_t* data, std::size_t size, const std::string& what = "JPEG data");
/// "progressive 8-bit 4:2:0 3 components 500x375", for messages.
std::string describe(const JpegInfo& info);

/// Where an image is decoded. by_load is a choice made per batch, not a placement of its own.
enum class DecodePlacement { cpu, hybrid, hardware, by_load };
const char* to_string(DecodePlacement p) noexcept;

/// Why `p` cannot decode a stream like `info`, or nullptr when it can. cpu: anything
/// libjpeg-turbo decodes. hardware (nvJPEG's JPEG engines): 8-bit Huffman sequential (baseline
/// or extended) with 1 or 3 components at 4:4:4, 4:2:2, 4:2:0, 4:4:0 or gray. hybrid: the same,
/// and progressive. What neither takes (4:1:1, CMYK or YCCK, 12-bit, lossless, arithmetic,
/// hierarchical) goes to the CPU.
const char* unsupported_reason(DecodePlacement p, const JpegInfo& info) noexcept;

/// The loads placement by load reads, each a fraction in [0, 1].
struct DecodeLoad {
  double cpu_busy = 0;     ///< of the CPUs, busy with work other than this op's decodes
  double device_busy = 0;  ///< of the device's time, busy with work other than this op's
  std::size_t device_queue = 0;  ///< this op's images placed on the device, not yet decoded
};

/// Measured cost of one image on each side (ns), what their rates come from.
struct DecodeCosts {
  double cpu_ns = 1e6;     ///< CPU time of a CPU-placed image
  double device_ns = 1e6;  ///< device time of a device-placed image
};

/// Placement by load, the policy alone: how many of `eligible` images (those a device placement
/// takes) go to the device. The CPU decodes at cores * (1 - cpu_busy) / cpu_ns images per ns,
/// the device at (1 - device_busy) / device_ns, or 0 while device_queue >= queue_cap (the
/// engines have no room); the device takes its share of the sum, rounded to the nearest image.
/// Both rates 0: everything stays on the CPU.
std::size_t device_share(std::size_t eligible, const DecodeLoad& load, const DecodeCosts& costs,
                         int cores, std::size_t queue_cap) noexcept;

struct BatchDecodeOptions {
  /// The crop, flip and randomness of each image (decode_random_resized_crop's, from seed,
  /// epoch and the image's index), whatever its placement: the same pixels on every side.
  AugmentSpec augment = {};
  Color color = Color::rgb;
  DecodePlacement placement = DecodePlacement::by_load;
  /// Per image: fail (the error, naming the image, fails the batch under its stage's own
  /// OnError) or skip (the image is left out of its batch alone and listed in skipped()).
  OnError on_error = OnError::fail;
  /// At most this many of this op's images waiting on the device (by_load).
  std::size_t device_queue_cap = 256;
  /// CPUs the CPU placement may use (0: the machine's).
  int cores = 0;
  /// Where by_load reads the load (null: measured: the process's CPU time and the device's busy
  /// time, each less this op's own decodes, over the time since the last batch).
  std::function<DecodeLoad()> load = nullptr;
};

/// A batch after host(): each image's header, placement and, for the CPU placement, pixels.
/// The hand-off between the two stages; read it only through device().
struct DecodePlan {
  struct Entry {
    std::uint64_t index = 0;
    std::string path;
    DecodePlacement placement = DecodePlacement::cpu;
    bool routed = false;  ///< a device placement was asked for and cannot take this stream
    HostTensor bytes;     ///< the file, for a device placement
    int row = -1;         ///< its row in cpu_rows, for the CPU placement
    std::string error;    ///< failed already (skip); empty otherwise
  };
  std::vector<Entry> entries;
  HostTensor cpu_rows;  ///< u8[k, size, size, c]: the CPU placement's images, in order
};

/// The images of one batch that decoded, in the batch's order, and those that were skipped.
class DecodedBatch {
 public:
  struct Decoded {
    std::uint64_t index = 0;
    std::string path;
    DecodePlacement placement = DecodePlacement::cpu;
  };
  struct Skipped {
    std::uint64_t index = 0;
    std::string path;
    std::string error;
  };
  DecodedBatch();
  /// u8[n, size, size, c] on the device: row i is decoded()[i].
  const DeviceTensor& images() const noexcept;
  const std::vector<Decoded>& decoded() const noexcept;
  const std::vector<Skipped>& skipped() const noexcept;
  std::size_t size() const noexcept { return decoded().size(); }

  struct Data;

 private:
  friend class BatchDecode;
  std::shared_ptr<Data> d_;
};

/// Counts since the op was built (all copies of one op share them).
struct BatchDecodeStats {
  std::uint64_t batches = 0;
  std::uint64_t cpu = 0, hybrid = 0, hardware = 0;  ///< images decoded on each placement
  std::uint64_t routed = 0;   ///< sent to the CPU because the asked placement cannot take them
  std::uint64_t skipped = 0;  ///< left out of their batch (on_error skip)
  std::int64_t cpu_ns = 0;    ///< CPU time of the CPU placement's decodes
  std::int64_t device_ns = 0; ///< time of the device placements' decodes
  DecodeLoad last_load;       ///< what by_load read for the latest batch
};

class BatchDecode {
 public:
  /// Throws Error (naming the op and the value) on a bad augment spec or option.
  explicit BatchDecode(BatchDecodeOptions options);
  /// The CPU stage's body: each file's header, its placement, and the CPU placement's decodes.
  DecodePlan host(std::vector<Encoded> files) const;
  /// The GPU stage's body: the device placements' decodes and every row into one tensor.
  DecodedBatch device(DecodePlan plan, DeviceContext& ctx) const;
  BatchDecodeStats stats() const;

  struct State;

 private:
  std::shared_ptr<State> s_;
};

}  // namespace splitflow::image
