// Per-stage statistics (a policy of every node kind): counts, the busy / starved / blocked
// partition of wall time, and what they show for a planted bottleneck. Checks
// docs/architecture.md, "Statistics", and docs/telemetry.md, "Per stage (`StageStats`)".
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <variant>
#include <vector>
#include <splitflow/splitflow.hpp>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::spin_us;

namespace {

void expect_partition(const RunStats& st) {
  for (const StageStats& s : st.stages) {
    const std::int64_t sum = s.busy_ns + s.starved_ns + s.blocked_ns;
    EXPECT_NEAR(static_cast<double>(sum), static_cast<double>(st.wall_ns),
                1e-3 * static_cast<double>(st.wall_ns) + 1000.0)
        << s.name << ": busy + starved + blocked != wall";
    EXPECT_GE(s.busy_ns, 0);
    EXPECT_GE(s.starved_ns, 0);
    EXPECT_GE(s.blocked_ns, 0);
  }
}

}  // namespace

namespace app {
// A type of a user's that says what it holds (found by argument-dependent lookup), and one
// that says it with a member.
struct Frame {
  std::vector<float> pixels;
};
std::size_t host_bytes(const Frame& f) { return sizeof f + f.pixels.capacity() * sizeof(float); }
struct Tagged {
  std::size_t n;
  std::size_t host_bytes() const { return 1000 + n; }
};
struct Opaque {  // says nothing: its sizeof
  std::vector<int>* p;
};
}  // namespace app

// docs/telemetry.md, `item_bytes`: what bytes_of counts (splitflow/core/bytes.hpp).
TEST(ItemBytes, ContainersCountTheirContentsAndTypesSayWhatTheyHold) {
  EXPECT_EQ(bytes_of(42L), sizeof(long));
  std::vector<int> v(10);
  v.reserve(16);
  EXPECT_EQ(bytes_of(v), sizeof v + 16 * sizeof(int)) << "the capacity, not the size";
  const std::string small = "abc", large(1000, 'x');
  EXPECT_EQ(bytes_of(small), sizeof small) << "a short string is inside the object";
  EXPECT_GE(bytes_of(large), sizeof large + 1000);
  EXPECT_LE(bytes_of(large), sizeof large + 1100);
  // Nested: each inner vector's heap block too.
  std::vector<std::vector<std::uint8_t>> nested(3, std::vector<std::uint8_t>(100));
  EXPECT_EQ(bytes_of(nested), sizeof nested + 3 * (sizeof(std::vector<std::uint8_t>) + 100));
  EXPECT_EQ(bytes_of(std::pair<long, std::vector<std::uint8_t>>{1, std::vector<std::uint8_t>(50)}),
            sizeof(std::pair<long, std::vector<std::uint8_t>>) + 50);
  EXPECT_EQ(bytes_of(std::tuple<int, std::vector<double>>{1, std::vector<double>(4)}),
            sizeof(std::tuple<int, std::vector<double>>) + 32);
  EXPECT_EQ(bytes_of(std::optional<std::vector<char>>{}), sizeof(std::optional<std::vector<char>>));
  EXPECT_EQ(bytes_of(std::optional<std::vector<char>>{std::vector<char>(7)}),
            sizeof(std::optional<std::vector<char>>) + 7);
  using V = std::variant<long, std::vector<std::uint16_t>>;
  EXPECT_EQ(bytes_of(V{std::vector<std::uint16_t>(8)}), sizeof(V) + 16);
  EXPECT_EQ(bytes_of(V{3L}), sizeof(V));
  EXPECT_EQ(bytes_of(std::make_shared<std::vector<int>>(5)),
            sizeof(std::shared_ptr<int>) + sizeof(std::vector<int>) + 20);
  EXPECT_EQ(bytes_of(std::unique_ptr<long>()), sizeof(std::unique_ptr<long>));
  // The library's own types: a host tensor's elements; a device tensor's are on the device.
  EXPECT_EQ(bytes_of(HostTensor::empty(DType::f32, {3, 5})), sizeof(HostTensor) + 60);
  EXPECT_EQ(bytes_of(DeviceTensor()), sizeof(DeviceTensor));
  image::Image img{7, "a.jpg", HostTensor::empty(DType::u8, {2, 2, 3})};
  EXPECT_EQ(bytes_of(img), sizeof(image::Image) + 5 + 12);
  // A user's types.
  EXPECT_EQ(bytes_of(app::Frame{std::vector<float>(256)}), sizeof(app::Frame) + 1024);
  EXPECT_EQ(bytes_of(app::Tagged{24}), 1024u);
  EXPECT_EQ(bytes_of(std::vector<app::Frame>(2, app::Frame{std::vector<float>(4)})),
            sizeof(std::vector<app::Frame>) + 2 * (sizeof(app::Frame) + 16));
  EXPECT_EQ(bytes_of(app::Opaque{nullptr}), sizeof(app::Opaque));
  Batch<std::vector<std::uint8_t>> b{{std::vector<std::uint8_t>(10), std::vector<std::uint8_t>(30)}, {1, 2}, {}};
  EXPECT_EQ(bytes_of(b), sizeof b + 2 * sizeof(std::vector<std::uint8_t>) + 40 + 2 * sizeof(std::uint64_t));
}

// docs/telemetry.md, `item_bytes`: each stage's input items, sampled (every 8th delivery).
TEST(Stats, EachStagesInputItemBytesAreSampled) {
  Runtime rt({.threads = 2});
  Graph g(rt, "bytes");
  constexpr long kItems = 4000;
  auto src = g.source("n", counter(kItems));
  auto grow = g.stage("grow", [](long x) { return std::vector<std::uint8_t>(1000 + (x % 2) * 2000); });
  auto keep = g.stage("keep", [](std::vector<std::uint8_t> v) { return v; });
  long seen = 0;
  auto sink = g.sink("s", [&](std::vector<std::uint8_t>) { ++seen; });
  src >> grow >> keep >> sink;
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(seen, kItems);
  const RunStats st = run.stats();
  const StageStats& a = *st.find("grow");
  const StageStats& b = *st.find("keep");
  EXPECT_EQ(a.item_bytes, sizeof(long)) << "grow takes longs";
  EXPECT_EQ(a.max_item_bytes, sizeof(long));
  EXPECT_GT(a.item_bytes_samples, 0u);
  EXPECT_LE(a.item_bytes_samples, a.invocations) << "one per sampled delivery, at most one per claim";
  constexpr std::size_t vec = sizeof(std::vector<std::uint8_t>);
  for (const StageStats* s : {&b, st.find("s")}) {
    EXPECT_GT(s->item_bytes_samples, 0u) << s->name;
    // Between the sizes the items have (1,000 and 3,000 bytes), the largest one of them.
    EXPECT_GE(s->item_bytes, vec + 1000) << s->name;
    EXPECT_LE(s->item_bytes, vec + 3000) << s->name;
    EXPECT_TRUE(s->max_item_bytes == vec + 1000 || s->max_item_bytes == vec + 3000) << s->max_item_bytes;
  }
  EXPECT_EQ(st.find("n")->item_bytes_samples, 0u) << "a source has no input";
  const std::string json = to_json(st);
  EXPECT_NE(json.find("\"item_bytes\":" + std::to_string(b.item_bytes)), std::string::npos) << json;
  // Without telemetry nothing is sampled.
  Runtime quiet({.threads = 2, .telemetry = false});
  Graph q(quiet, "quiet");
  q.source("n", counter(100)) >> q.stage("grow", [](long x) { return std::vector<std::uint8_t>(x); }) >>
      q.sink("s", [](std::vector<std::uint8_t>) {});
  auto r = q.run();
  ASSERT_EQ(r.wait(), RunStatus::succeeded);
  EXPECT_EQ(r.stats().find("s")->item_bytes_samples, 0u);
}

// RunStats::find: a pointer into stats kept in a variable; on a temporary (run.stats()), a copy
// (a new C++ user's trial kept `run.stats().find("t")`, a pointer into the temporary, and read
// freed memory; tests/compile_fail/find_on_temporary_stats.cpp: that no longer compiles).
TEST(Stats, FindOnATemporaryGivesACopyAndOnKeptStatsAPointer) {
  Runtime rt({.threads = 2});
  Graph g(rt, "found");
  g.source("n", counter(100)) >> g.stage("t", [](long x) { return x; }) >> g.sink("s", [](long) {});
  auto run = g.run();
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  const RunStats kept = run.stats();
  const StageStats* t = kept.find("t");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t, &kept.stages[1]) << "a pointer into the kept stats";
  EXPECT_EQ(t->items_out, 100u);
  EXPECT_EQ(kept.find("nope"), nullptr);
  std::optional<StageStats> copy = run.stats().find("t");
  ASSERT_TRUE(copy.has_value());
  EXPECT_EQ(copy->name, "t");
  EXPECT_EQ(copy->items_in, 100u);
  EXPECT_EQ(run.stats().find("s")->items_in, 100u);
  EXPECT_FALSE(run.stats().find("nope").has_value());
}

// "Stats per stage: items in/out, busy time, time starved, time blocked, max queue occupancy"
TEST(Stats, CountsAndTheStatePartitionOfWallTime) {
  Runtime rt({.threads = 4});
  Graph g(rt, "counted");
  auto src = g.source("n", counter(5000));
  auto even = g.stage("square", [](long x) { spin_us(1); return x * x; }, {.concurrency = 2});
  auto sink = g.sink("s", [](long) { spin_us(2); }, {.capacity = 8});
  src >> even >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(st.status, RunStatus::succeeded);
  EXPECT_GT(st.wall_ns, 0);
  ASSERT_EQ(st.stages.size(), 3u);
  EXPECT_EQ(st.stages[0].name, "n");
  EXPECT_EQ(st.stages[0].items_out, 5000u);
  EXPECT_EQ(st.stages[1].items_in, 5000u);
  EXPECT_EQ(st.stages[1].items_out, 5000u);
  EXPECT_EQ(st.stages[2].items_in, 5000u);
  EXPECT_EQ(st.stages[2].items_out, 5000u);
  EXPECT_LE(st.stages[2].max_queue, 8u);
  EXPECT_GE(st.stages[2].max_queue, 1u);
  EXPECT_LE(st.stages[1].max_concurrency, 2u);
  // work is the sum of body times: at least the spin it contains
  EXPECT_GE(st.stages[2].work_ns, 5000 * 2000);
  expect_partition(st);
}

// A slow middle stage: it is busy nearly all the time, its producer is blocked behind it and
// its consumer starves.
TEST(Stats, APlantedSlowStageIsBusyItsProducerBlockedItsConsumerStarved) {
  Runtime rt({.threads = 4});
  Graph g(rt, "bottleneck");
  auto src = g.source("read", counter(400));
  // The slow stage models waiting work (I/O-like), so that the shape of the figures does not
  // depend on how much CPU other processes leave to this test.
  auto slow = g.stage("slow", [](long x) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    return x;
  }, {.capacity = 4});
  auto sink = g.sink("write", [](long) {});
  src >> slow >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  const double wall = static_cast<double>(st.wall_ns);
  // Loose fractions: other processes may take the cores, but the shape must show.
  const StageStats& slow_s = *st.find("slow");
  const StageStats& read_s = *st.find("read");
  const StageStats& write_s = *st.find("write");
  EXPECT_GT(slow_s.busy_ns / wall, 0.5);
  EXPECT_GT(read_s.blocked_ns, 4 * read_s.busy_ns);
  EXPECT_GT(write_s.starved_ns / wall, 0.5);
  EXPECT_GT(write_s.starved_ns, 4 * write_s.busy_ns);
  expect_partition(st);
  const std::string table = format_table(st);
  EXPECT_NE(table.find("slow"), std::string::npos);
  EXPECT_NE(table.find("succeeded"), std::string::npos);
}

// Live snapshots while the run is in progress partition the elapsed time too.
TEST(Stats, LiveSnapshotDuringTheRun) {
  Runtime rt({.threads = 2});
  Graph g(rt, "live");
  auto src = g.source("n", counter(-1));
  auto st = g.stage("st", [](long x) { spin_us(5); return x; });
  auto out = g.pull_sink<long>("out", 4);
  src >> st >> out;
  auto run = g.run();
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(out.next());
  const RunStats live = run.stats();
  EXPECT_EQ(live.status, RunStatus::running);
  EXPECT_GE(live.find("out")->items_out, 100u);
  expect_partition(live);
  run.cancel();
  run.wait();
}

TEST(Stats, TelemetryOffKeepsCountsAndSkipsTimes) {
  Runtime rt({.threads = 2, .telemetry = false});
  Graph g(rt, "quiet");
  auto src = g.source("n", counter(100));
  auto sink = g.sink("s", [](long) {});
  src >> sink;
  auto run = g.run();
  run.wait();
  const RunStats st = run.stats();
  EXPECT_EQ(st.find("s")->items_in, 100u);
  EXPECT_EQ(st.find("s")->busy_ns, 0);
  EXPECT_EQ(st.find("s")->work_ns, 0);
  EXPECT_GT(st.wall_ns, 0);
}
