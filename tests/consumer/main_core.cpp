// Builds against the installed splitflow::core alone (no CUDA toolkit, Thrust or libjpeg-turbo
// looked for: the Makefile's test-consumer configures this with them disabled) and checks a
// small graph's result and that the program has no CUDA backend.
#include <splitflow/splitflow.hpp>

#include <cstdio>
#include <vector>

int main() {
  splitflow::Runtime rt({.threads = 2});
  splitflow::Graph g(rt, "consumer-core");
  auto src = g.source("n", std::vector<int>{1, 2, 3, 4});
  auto sq = g.stage("square", [](int x) { return x * x; }, {.concurrency = 2});
  auto out = g.pull_sink<int>("out");
  src >> sq >> out;
  auto run = g.run();
  int sum = 0;
  for (int v : out) sum += v;
  run.wait();
  if (sum != 30) {
    std::fprintf(stderr, "consumer-core: expected 30, got %d\n", sum);
    return 1;
  }
  if (splitflow::built_with_cuda() || splitflow::cuda_runtime_calls() != 0) {
    std::fprintf(stderr, "consumer-core: splitflow::core alone has a CUDA backend\n");
    return 1;
  }
  std::printf("consumer-core: splitflow::core alone works (sum of squares = %d)\n", sum);
  return 0;
}
