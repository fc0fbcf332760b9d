// Must not compile: a sink has no output to connect.
#include <splitflow/splitflow.hpp>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto sink = g.sink("sink", [](int) {});
  auto st = g.stage("st", [](int x) { return x; });
  sink >> st;
}
