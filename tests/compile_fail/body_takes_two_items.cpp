// Must not compile: a stage body takes one item (or one item and a HostAllocator&); the
// message said "take the input by value ... not In&", which was not the cause (a new C++
// user's trial).
#include <splitflow/splitflow.hpp>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto st = g.stage("add", [](int x, int y) { return x + y; });
}
