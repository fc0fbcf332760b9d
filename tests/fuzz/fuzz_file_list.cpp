// Fuzz target: image::FileList::list_file (one path per line; blank lines and '#' comments
// skipped; relative paths taken from the list file's directory) on arbitrary bytes, then the
// epoch order (shuffle, shards) of the list it gives. The first 8 bytes are the shard spec:
// seed, epoch, shuffle (bit 0 of byte 2), world size, rank, workers, worker (signed bytes: out
// of range is an error), and how many of the lines to keep; the rest is the list file, written
// to a temporary file (in /dev/shm) and read by path, as a user's list is.
//
// Checks beyond "no sanitizer report": the paths are exactly those of a reference parse of the
// same bytes; every (rank, worker) shard of an epoch together hold each index exactly once,
// their sizes differ by at most one, the same spec gives the same order, no shuffle keeps the
// list's order; a bad rank or worker is a splitflow::Error; refs() refuses an index past the end.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "splitflow/ops/image.hpp"

using namespace splitflow;

namespace {

std::string list_path() {
  static const std::string path = [] {
    // tmpfs where there is one: a file rewritten per input costs a millisecond on ext4
    char shm[] = "/dev/shm/splitflow-fuzz-XXXXXX";
    char tmp[] = "/tmp/splitflow-fuzz-XXXXXX";
    char* dir = mkdtemp(shm);
    if (!dir) dir = mkdtemp(tmp);
    if (!dir) fuzz::fail("mkdtemp", __FILE__, __LINE__);
    std::string d = dir;
    static std::string cleanup;
    cleanup = d;
    std::atexit([] {
      std::remove((cleanup + "/list.txt").c_str());
      rmdir(cleanup.c_str());
    });
    return d + "/list.txt";
  }();
  return path;
}

// What the list file means, written here from its description.
std::vector<std::string> reference(const std::string& text, const std::string& dir) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
    while (!line.empty() && space(line.back())) line.pop_back();
    std::size_t b = 0;
    while (b < line.size() && space(line[b])) ++b;
    line.erase(0, b);
    if (line.empty() || line[0] == '#') continue;
    out.push_back(line[0] == '/' ? line : dir + "/" + line);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t h[8] = {};
  const std::size_t hn = std::min<std::size_t>(size, 8);
  std::memcpy(h, data, hn);
  const std::string text(reinterpret_cast<const char*>(data) + hn, size - hn);
  const std::string path = list_path();
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    FUZZ_CHECK(f != nullptr);
    FUZZ_CHECK(std::fwrite(text.data(), 1, text.size(), f) == text.size());
    std::fclose(f);
  }
  const image::FileList list = image::FileList::list_file(path);
  const std::string dir = path.substr(0, path.rfind('/'));
  FUZZ_CHECK(list.paths() == reference(text, dir));

  // Shards of a list of n entries (n from the list, or fewer).
  const std::size_t n = std::min<std::size_t>(list.size(), h[7]);
  const image::FileList sub(std::vector<std::string>(list.paths().begin(), list.paths().begin() + static_cast<std::ptrdiff_t>(n)));
  image::ShardSpec spec;
  spec.seed = h[0];
  spec.epoch = h[1];
  spec.shuffle = h[2] & 1;
  spec.world_size = static_cast<std::int8_t>(h[3]);
  spec.rank = static_cast<std::int8_t>(h[4]);
  spec.num_workers = static_cast<std::int8_t>(h[5]);
  spec.worker = static_cast<std::int8_t>(h[6]);
  const bool valid = spec.world_size >= 1 && spec.rank >= 0 && spec.rank < spec.world_size &&
                     spec.num_workers >= 1 && spec.worker >= 0 && spec.worker < spec.num_workers;
  std::vector<std::uint64_t> mine;
  try {
    mine = sub.epoch(spec);
    FUZZ_CHECK(valid);
  } catch (const Error&) {
    FUZZ_CHECK(!valid);
    return 0;
  }
  FUZZ_CHECK(sub.epoch(spec) == mine);  // deterministic
  // Every shard of this epoch: each index exactly once, sizes within one of each other.
  if (static_cast<std::int64_t>(spec.world_size) * spec.num_workers <= 64) {
    std::vector<int> seen(n, 0);
    std::size_t lo = SIZE_MAX, hi = 0;
    image::ShardSpec s = spec;
    for (s.rank = 0; s.rank < spec.world_size; ++s.rank)
      for (s.worker = 0; s.worker < spec.num_workers; ++s.worker) {
        const std::vector<std::uint64_t> part = sub.epoch(s);
        lo = std::min(lo, part.size());
        hi = std::max(hi, part.size());
        for (std::uint64_t i : part) {
          FUZZ_CHECK(i < n);
          ++seen[i];
        }
        if (s.rank == spec.rank && s.worker == spec.worker) FUZZ_CHECK(part == mine);
      }
    FUZZ_CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    FUZZ_CHECK(hi - lo <= 1);
  }
  if (!spec.shuffle) FUZZ_CHECK(std::is_sorted(mine.begin(), mine.end()));
  // refs: the paths of the order; an index past the end is an error.
  const std::vector<image::FileRef> refs = sub.refs(mine);
  FUZZ_CHECK(refs.size() == mine.size());
  for (std::size_t i = 0; i < refs.size(); ++i)
    FUZZ_CHECK(refs[i].index == mine[i] && refs[i].path == sub.paths()[mine[i]]);
  try {
    (void)sub.refs({n});
    FUZZ_CHECK(false);
  } catch (const Error&) {
  }
  return 0;
}
