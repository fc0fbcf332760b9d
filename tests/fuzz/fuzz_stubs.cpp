// The fuzz targets link lib/core and lib/ops/image.cpp alone. image::collate can write into a
// GPU stage's pinned ring through HostAllocator, which lives in the device layer; the targets
// never pass one (collate(images) with no allocator), so its one symbol is a stub here.
#include <cstdio>
#include <cstdlib>

#include "splitflow/device/device.hpp"

namespace splitflow {

HostTensor HostAllocator::empty(DType, std::vector<std::int64_t>) {
  std::fprintf(stderr, "fuzz build: HostAllocator::empty is not linked (no device layer)\n");
  std::abort();
}

}  // namespace splitflow
