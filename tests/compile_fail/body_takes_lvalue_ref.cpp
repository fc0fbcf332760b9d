// Must not compile: items arrive as rvalues, which a body taking In& cannot bind.
#include <splitflow/splitflow.hpp>

#include <string>

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto st = g.stage("len", [](std::string& s) { return s.size(); });
}
