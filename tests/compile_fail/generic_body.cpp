// Must not compile: a generic body's input type cannot be deduced; the error says to give it.
#include <splitflow/splitflow.hpp>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto st = g.stage("twice", [](auto x) { return 2 * x; });
}
