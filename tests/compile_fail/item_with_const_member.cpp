// Must not compile: an item type with a const member (copy- and move-constructible, but not
// assignable): queues, rings and optionals move items in and out. gcc's error came from inside
// the nodes, "use of deleted function ... operator=" (a new C++ user's trial); the
// static_assert in Envelope says what to change.
#include <splitflow/splitflow.hpp>

#include <string>

struct Rec {
  const long id;
  std::string text;
};

void build(splitflow::Runtime& rt) {
  splitflow::Graph g(rt, "bad");
  auto src = g.source("n", [i = 0L]() mutable -> std::optional<Rec> {
    if (i == 10) return std::nullopt;
    return Rec{i++, "x"};
  });
  auto sink = g.sink("sink", [](Rec) {});
  src >> sink;
}
