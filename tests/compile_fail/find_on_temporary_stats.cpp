// Must not compile: a pointer into a temporary RunStats (run.stats()) dangles once the
// statement ends; find() on a temporary gives a copy (std::optional<StageStats>), not a pointer.
#include <splitflow/splitflow.hpp>

void inspect(const splitflow::Run& run) {
  const splitflow::StageStats* s = run.stats().find("decode");
  (void)s;
}
