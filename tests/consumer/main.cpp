// Builds against the installed splitflow and checks a small graph's result.
#include <splitflow/splitflow.hpp>

#include <cstdio>
#include <vector>

int main() {
  splitflow::Runtime rt({.threads = 2});
  splitflow::Graph g(rt, "consumer");
  auto src = g.source("n", std::vector<int>{1, 2, 3, 4});
  auto sq = g.stage("square", [](int x) { return x * x; }, {.concurrency = 2});
  auto out = g.pull_sink<int>("out");
  src >> sq >> out;
  auto run = g.run();
  int sum = 0;
  for (int v : out) sum += v;
  run.wait();
  if (sum != 30) {
    std::fprintf(stderr, "consumer: expected 30, got %d\n", sum);
    return 1;
  }
  if (splitflow::built_with_cuda() != static_cast<bool>(SPLITFLOW_EXPECT_CUDA)) {
    std::fprintf(stderr, "consumer: built_with_cuda() is %d in a package built with CUDA %s\n",
                 splitflow::built_with_cuda(), SPLITFLOW_EXPECT_CUDA ? "on" : "off");
    return 1;
  }
  std::printf("consumer: installed splitflow works (sum of squares = %d)\n", sum);
  return 0;
}
