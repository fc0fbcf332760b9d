// Must not compile: a stage body must return its output.
#include <splitflow/splitflow.hpp>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto st = g.stage("nothing", [](int) {});
}
