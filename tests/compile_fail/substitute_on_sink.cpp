// Must not compile: a sink has no output to substitute.
#include <splitflow/splitflow.hpp>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto k = g.sink("k", [](int) {});
  k.substitute_on_error(3);
}
