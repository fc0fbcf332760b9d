#include <gtest/gtest.h>

#include <splitflow/splitflow.hpp>

#include <vector>

TEST(Smoke, ChainDeliversInOrder) {
  splitflow::Runtime rt({.threads = 4});
  splitflow::Graph g(rt, "smoke");
  auto src = g.source("numbers", std::vector<int>{1, 2, 3, 4, 5});
  auto sq = g.stage("square", [](int x) { return long(x) * x; }, {.concurrency = 4});
  auto out = g.pull_sink<long>("out");
  src >> sq >> out;
  auto run = g.run();
  std::vector<long> got;
  for (long v : out) got.push_back(v);
  EXPECT_EQ(run.wait(), splitflow::RunStatus::succeeded);
  EXPECT_EQ(got, (std::vector<long>{1, 4, 9, 16, 25}));
  std::printf("%s", splitflow::format_table(run.stats()).c_str());
}
