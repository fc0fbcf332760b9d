// A multi-stage CPU graph, read by the main thread the way a training loop reads a data loader,
// then its per-stage statistics.
//
//   records -> parse (parallel, in order) -> features (parallel) -> batches -> main thread
//                                           \-> audit (a second consumer of every record)
#include <splitflow/splitflow.hpp>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

namespace {

struct Record {
  long id;
  std::string text;
};

struct Parsed {
  long id;
  std::vector<double> values;
};

// Some real CPU work per item: parse numbers out of text.
Parsed parse(Record r) {
  Parsed p{r.id, {}};
  std::size_t pos = 0;
  while (pos < r.text.size()) {
    std::size_t end = r.text.find(',', pos);
    if (end == std::string::npos) end = r.text.size();
    p.values.push_back(std::stod(r.text.substr(pos, end - pos)));
    pos = end + 1;
  }
  return p;
}

std::vector<float> features(Parsed p) {
  std::vector<float> f(8, 0.0f);
  for (std::size_t i = 0; i < p.values.size(); ++i)
    f[i % 8] += static_cast<float>(std::sin(p.values[i]) * std::log1p(std::abs(p.values[i])));
  return f;
}

}  // namespace

int main() {
  splitflow::Runtime rt;  // one thread per core
  splitflow::Graph g(rt, "cpu-pipeline");

  auto records = g.source("records", [i = 0L]() mutable -> std::optional<Record> {
    if (i == 20000) return std::nullopt;
    std::string text;
    for (int k = 0; k < 64; ++k) text += std::to_string((i * 31 + k * 17) % 1000 / 7.0) + ",";
    text.pop_back();
    return Record{i++, std::move(text)};
  });
  // No hand-set concurrency: the graph's tuner sets each from what it measures (docs/autotune.md).
  auto parsed = g.stage("parse", parse, {.concurrency = splitflow::Concurrency::automatic});
  auto feats = g.stage("features", features, {.concurrency = splitflow::Concurrency::automatic});
  auto batches = g.stage("batch", [batch = std::vector<std::vector<float>>()](
                                      std::vector<float> f) mutable {
    batch.push_back(std::move(f));
    std::vector<std::vector<float>> out;
    if (batch.size() == 32) out.swap(batch);
    return out;  // empty until a batch is full
  });
  long audited = 0;
  auto audit = g.sink("audit", [&](Parsed p) { audited += static_cast<long>(p.values.size()); });
  auto loader = g.pull_sink<std::vector<std::vector<float>>>("loader", 4);

  records >> parsed;
  splitflow::fan_out(parsed, feats, audit);
  feats >> batches >> loader;

  auto run = g.run();
  long steps = 0;
  double checksum = 0;
  for (auto& batch : loader) {  // the "training loop"
    if (batch.empty()) continue;
    ++steps;
    for (auto& f : batch) checksum += std::accumulate(f.begin(), f.end(), 0.0);
  }
  run.wait();

  std::printf("%ld batches of 32, %ld values audited, checksum %.3f\n\n", steps, audited,
              checksum);
  const splitflow::RunStats st = run.stats();
  std::printf("%s", splitflow::format_table(st).c_str());
  std::printf("\nthe tuner's decisions:\n");
  for (const std::string& e : st.autotune) std::printf("  %s\n", e.c_str());
  return 0;
}
