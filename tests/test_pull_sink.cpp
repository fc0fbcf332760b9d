// The pull sink (Graph::pull_sink): a sink read by the caller's thread (README, "A graph in
// C++"; graph.hpp, PullSink). Leaving its loop early ends the run; its final stats count what
// the reader took. Checks docs/api.md, "Objects and options" (sinks, reading a pull sink).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <splitflow/splitflow.hpp>
#include <thread>
#include <utility>

#include "helpers.hpp"

using namespace splitflow;
using testing_helpers::counter;
using testing_helpers::Tracked;
using testing_helpers::tracked_source;

namespace {
// An endless source (only a cancel ends it) through a 2-way stage into a pull sink of 4.
PullSink<Tracked> endless_chain(Graph& g) {
  auto src = g.source("n", tracked_source(-1));
  auto st = g.stage("st", [](Tracked t) { return t; }, {.concurrency = 2});
  auto out = g.pull_sink<Tracked>("out", 4);
  src >> st >> out;
  return out;
}

// Reads `out` (checking each item's value is its position), calling `act()` after item `at`,
// until its loop ends; returns the items read and the CancelledError's text ("" if none).
template <class Act>
std::pair<long, std::string> read_cancelled(PullSink<Tracked>& out, long at, Act act) {
  long seen = 0;
  try {
    for (Tracked& t : out) {
      EXPECT_EQ(t.value, seen);
      if (++seen == at) act();
    }
  } catch (const CancelledError& e) {
    return {seen, e.what()};
  }
  return {seen, ""};
}
}  // namespace

// "leaving a loop over a pull sink early cancels the run, so run.wait() returns"
TEST(PullSink, BreakingOutOfTheLoopCancelsTheRun) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "break");
    auto out = endless_chain(g);
    auto run = g.run();
    int seen = 0;
    for (Tracked& t : out) {
      EXPECT_EQ(t.value, seen);
      if (++seen == 10) break;
    }
    ASSERT_TRUE(run.wait_for(std::chrono::seconds(30))) << "the run went on after the break";
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
    // The graph can run again at once.
    auto again = g.run();
    EXPECT_TRUE(out.next().has_value());
    out.close();
    EXPECT_EQ(again.wait(), RunStatus::cancelled);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "a loop that reads to the end of the stream leaves the run as it ended"
TEST(PullSink, ReadingToTheEndDoesNotCancel) {
  Runtime rt({.threads = 2});
  Graph g(rt, "to-the-end");
  auto src = g.source("n", counter(300));
  auto out = g.pull_sink<long>("out", 8);
  src >> out;
  auto run = g.run();
  long n = 0;
  for (long v : out) EXPECT_EQ(v, n++);
  EXPECT_EQ(n, 300);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// "close() ends the run from the reader's side; it does nothing once the run ended"
TEST(PullSink, CloseCancelsARunningRunOnly) {
  Runtime rt({.threads = 2});
  Graph g(rt, "close");
  auto src = g.source("n", counter(-1));
  auto out = g.pull_sink<long>("out", 2);
  src >> out;
  auto run = g.run();
  ASSERT_EQ(out.next(), 0L);
  out.close();
  ASSERT_TRUE(run.wait_for(std::chrono::seconds(30)));
  EXPECT_EQ(run.status(), RunStatus::cancelled);
  EXPECT_EQ(out.next(), std::nullopt) << "the reader closed it: its stream just ends";

  Graph h(rt, "short");
  auto few = h.source("n", counter(3));
  auto sink = h.pull_sink<long>("out", 8);
  few >> sink;
  auto done = h.run();
  ASSERT_EQ(done.wait(), RunStatus::succeeded);  // all three fit the sink's queue
  sink.close();
  EXPECT_EQ(done.status(), RunStatus::succeeded);
  EXPECT_EQ(sink.next(), 0L) << "close() after the end keeps what is queued";
}

// "items_out of a pull sink counts every item its reader took, also after the run ended"
TEST(PullSink, FinalStatsCountItemsTakenAfterTheRunEnded) {
  Runtime rt({.threads = 2});
  for (long total : {1L, 20L, 1000L}) {
    Graph g(rt, "late");
    auto src = g.source("n", counter(total));
    auto out = g.pull_sink<long>("out", 32);
    src >> out;
    auto run = g.run();
    long taken = 0;
    if (total > 32) {  // the run cannot end before the reader made room
      for (; taken < total - 16; ++taken) ASSERT_EQ(out.next(), taken);
    }
    ASSERT_EQ(run.wait(), RunStatus::succeeded);
    const std::uint64_t before = run.stats().find("out")->items_out;
    EXPECT_EQ(before, static_cast<std::uint64_t>(taken));
    while (auto v = out.next()) EXPECT_EQ(*v, taken++);
    EXPECT_EQ(taken, total);
    EXPECT_EQ(run.stats().find("out")->items_out, static_cast<std::uint64_t>(total)) << total;
    EXPECT_EQ(run.stats().find("out")->items_in, static_cast<std::uint64_t>(total));
  }
}

// "A run cancelled by anything but this sink's reader ends the stream with CancelledError
// instead, so that a loop cannot take a cut stream for a whole one" (graph.hpp, PullSink).
// Before: the loop ended as if the stream were whole, and a GraphDataset's epoch was recorded
// as complete (test_resume.py, test_an_epoch_cancelled_from_elsewhere_raises_and_resumes_to_the_rest).
TEST(PullSink, ACancelFromAnotherThreadEndsTheLoopWithCancelledError) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    Graph g(rt, "watched");
    auto out = endless_chain(g);
    auto run = g.run();
    // A watchdog's cancel, from another thread, after item 10.
    const auto [seen, error] = read_cancelled(out, 10, [&] { std::thread([&] { run.cancel(); }).join(); });
    EXPECT_EQ(seen, 10) << "the cancel drops what the sink held; nothing arrives after it";
    EXPECT_EQ(error, "splitflow: graph 'watched': the run was cancelled before pull sink 'out' "
                     "reached the end of its stream: Run::cancel() stopped it (from another "
                     "thread; from Python also Ctrl-C or the interpreter's exit), so the " +
                     std::to_string(seen) +
                     " items it gave are not the whole stream (a reader that stops early itself "
                     "calls close() or leaves its loop, and is not told)");
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
    EXPECT_THROW(out.next(), CancelledError) << "the stream stays ended as it ended";
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// A new C++ user's trial: destroying a graph while another thread read its pull sink freed the
// sink under the reader (heap-use-after-free under ASan, a crash in 3 of 4 plain runs): the
// graph waited for its run, not for the reader, woken by that run's cancel, to leave next().
// Now it does, and a read after it (the reader between two items, or a handle kept) throws
// CancelledError naming the graph and the sink instead of touching freed memory.
TEST(PullSink, DestroyingTheGraphWhileAnotherThreadReadsEndsTheReaderWithCancelledError) {
  Tracked::reset_counts();
  {
    Runtime rt({.threads = 2});
    for (int rep = 0; rep < 40; ++rep) {
      std::atomic<long> seen{0};
      std::string error;
      std::thread reader;
      std::optional<PullSink<Tracked>> kept;
      {
        Graph g(rt, "going");
        auto out = endless_chain(g);
        kept = out;
        g.run();
        reader = std::thread([out, &seen, &error] {
          try {
            for (Tracked& t : out) {
              EXPECT_EQ(t.value, seen.load());
              seen.fetch_add(1);
            }
            error = "the loop ended without an error";
          } catch (const CancelledError& e) {
            error = e.what();
          }
        });
        while (seen.load() < 3 + rep % 5) std::this_thread::yield();
      }  // ~Graph: cancels the run, waits for it and for the reader to leave next()
      reader.join();
      EXPECT_NE(error.find("splitflow: graph 'going'"), std::string::npos) << error;
      EXPECT_NE(error.find("'out'"), std::string::npos) << error;
      // What stopped it: the graph's end (it said "Run::cancel() (from another thread, or the
      // runtime's end) stopped it": a new user's trial), or, for a reader between two items
      // as the graph went, the read after it.
      EXPECT_TRUE(error.find("its Graph was destroyed while the sink was read (keep the Graph "
                             "alive until its readers are done)") != std::string::npos ||
                  error.find("was read after its graph was destroyed") != std::string::npos)
          << error;
      EXPECT_EQ(error.find("Run::cancel()"), std::string::npos) << error;
      try {
        kept->next();
        ADD_FAILURE() << "a read after the graph was destroyed returned";
      } catch (const CancelledError& e) {
        EXPECT_EQ(std::string(e.what()),
                  "splitflow: graph 'going': pull sink 'out' was read after its graph was "
                  "destroyed; keep the Graph alive while its sinks are read");
      }
      kept->close();  // nothing to close: does nothing
    }
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// The runtime's end cancels the runs of its graphs: their readers are told so (it said
// "Run::cancel() (from another thread, or the runtime's end)" for every cancel: a new user's
// trial, whose graph's destruction was said as that too).
TEST(PullSink, TheRuntimesEndIsNamedToTheReader) {
  Tracked::reset_counts();
  {
    std::optional<Runtime> rt(std::in_place, RuntimeConfig{.threads = 2});
    Graph g(*rt, "orphaned");
    auto out = endless_chain(g);
    auto run = g.run();
    // ~Runtime after item 5: cancels its runs and waits for them.
    const auto [seen, error] = read_cancelled(out, 5, [&] { rt.reset(); });
    EXPECT_EQ(seen, 5);
    EXPECT_EQ(error, "splitflow: graph 'orphaned': the run was cancelled before pull sink 'out' "
                     "reached the end of its stream: its Runtime was destroyed (a Runtime ends "
                     "the runs of its graphs), so the 5 items it gave are not the whole stream (a reader that stops early itself calls close() or leaves "
                     "its loop, and is not told)");
    EXPECT_EQ(run.wait(), RunStatus::cancelled);
  }
  EXPECT_EQ(Tracked::live.load(), 0);
}

// "PullSink::close(): its own next() then ends with nullopt; the readers of the graph's other
// pull sinks get CancelledError", naming the sink whose reader closed the run.
TEST(PullSink, ClosingOneSinkEndsTheOthersWithCancelledErrorNamingIt) {
  Runtime rt({.threads = 2});
  Graph g(rt, "two-readers");
  auto src = g.source("n", counter(-1));
  auto a = g.pull_sink<long>("a", 4);
  auto b = g.pull_sink<long>("b", 4);
  src >> a;
  src >> b;
  auto run = g.run();
  std::optional<long> after_close = -1;
  std::thread reader_a([&] {
    long n = 0;
    for (long v : a) {
      EXPECT_EQ(v, n);
      if (++n == 5) break;  // leaving the loop closes a
    }
    after_close = a.next();
  });
  long n = 0;
  std::string error;
  try {
    for (long v : b) EXPECT_EQ(v, n++);
  } catch (const CancelledError& e) {
    error = e.what();
  }
  reader_a.join();
  EXPECT_EQ(after_close, std::nullopt) << "a's reader closed the run: its stream just ends";
  EXPECT_NE(error.find("graph 'two-readers': the run was cancelled before pull sink 'b' reached "
                       "the end of its stream: the reader of pull sink 'a' closed it (close(), "
                       "or leaving its loop early)"),
            std::string::npos)
      << error;
  EXPECT_EQ(run.wait(), RunStatus::cancelled);
}

// Handles are copied, never emptied by a move (a moved-from handle kept no readers' gate and
// dereferenced null: a review of the gate's change).
TEST(PullSink, AMovedFromHandleStillReads) {
  Runtime rt({.threads = 2});
  Graph g(rt, "moved");
  auto src = g.source("n", [i = 0]() mutable -> std::optional<int> {
    return i < 3 ? std::optional<int>(i++) : std::nullopt;
  });
  auto out = g.pull_sink<int>("out", 4);
  src >> out;
  PullSink<int> other = std::move(out);
  auto run = g.run();
  EXPECT_EQ(out.next(), std::optional<int>(0));  // NOLINT(bugprone-use-after-move): on purpose
  EXPECT_EQ(other.next(), std::optional<int>(1));
  EXPECT_EQ(out.next(), std::optional<int>(2));
  EXPECT_EQ(other.next(), std::nullopt);
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}

// A new-user trial (2026-12-05): a loop over a pull sink written before run() ended at once,
// empty, and the run started after it filled the sink's queue and waited for a reader that had
// gone. A read before the graph's first run is refused, naming the sink; after a run has ended
// a read is the end of its stream, as before.
TEST(PullSink, AReadBeforeTheFirstRunIsRefusedNamingTheSink) {
  Runtime rt({.threads = 2});
  Graph g(rt, "early");
  auto src = g.source("n", counter(3));
  auto out = g.pull_sink<long>("out", 4);
  src >> out;
  try {
    for (long x : out) ADD_FAILURE() << "read " << x << " before any run";
    ADD_FAILURE() << "the loop ended without an error";
  } catch (const GraphError& e) {
    EXPECT_STREQ(e.what(), "splitflow: graph 'early': pull sink 'out' was read before its graph's "
                           "first run: call run() first, then read");
  }
  EXPECT_THROW(out.next(), GraphError);
  auto run = g.run();
  std::vector<long> got;
  for (long x : out) got.push_back(x);
  EXPECT_EQ(got, (std::vector<long>{0, 1, 2}));
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_EQ(out.next(), std::nullopt);  // the end of the run's stream
}

// next_for(timeout, timed_out, &item) gives each item's number in its run: its source item's
// position, as errors name it, with gaps where a stage skipped (what a Dask remote pass needs
// to say which dataset indices it yielded: the run's error list keeps 64 a stage).
TEST(PullSink, NextForGivesEachItemsNumberInItsRun) {
  Runtime rt({.threads = 2});
  Graph g(rt, "numbers");
  auto skip = g.stage("skip", [](long x) {
    if (x % 3 == 0) throw std::runtime_error("skipped");
    return x * 10;
  }, {.concurrency = 2, .on_error = OnError::skip});
  auto out = g.pull_sink<long>("out");
  g.source("n", counter(200)) >> skip >> out;
  auto run = g.run();
  std::vector<std::uint64_t> items;
  std::vector<long> values;
  for (;;) {
    bool timed_out = false;
    std::uint64_t item = ~0ull;
    std::optional<long> v = out.next_for(std::chrono::seconds(30), timed_out, &item);
    ASSERT_FALSE(timed_out);
    if (!v) break;
    items.push_back(item);
    values.push_back(*v);
  }
  ASSERT_EQ(run.wait(), RunStatus::succeeded);
  ASSERT_EQ(items.size(), 133u);  // 200 less the 67 multiples of 3
  for (std::size_t i = 0; i < items.size(); ++i) {
    EXPECT_NE(items[i] % 3, 0u);
    EXPECT_EQ(values[i], static_cast<long>(items[i]) * 10);
    if (i > 0) EXPECT_GT(items[i], items[i - 1]);
  }
}

// The reader's take frees a slot and wakes the producer, whose claim the reader's thread spawns
// (GraphCore::dispatch_external). A failure that ended the run between the wake and the spawn
// left the claim to be spawned with the run's count at zero: its task ended the finished run a
// second time, or, once a rerun had started (storing its own count over that unit), left the
// rerun a unit off, and the rerun hung with every thread idle (a property example of
// test_properties.py, a break then a rerun, 1 in about 2,000 pairs under load). Deterministic:
// the wake is made to find a claim (the stage blocked on the full sink), and the white-box
// dispatch hook, between the claim and its spawn, lets the source fail and waits until the run
// has ended (the bug) or is left with nothing but the reader's dispatch; the rerun then delivers
// every item.
TEST(PullSink, ARunCannotEndWhileItsReaderDispatchesTheProducersClaim) {
  Runtime rt({.threads = 2});
  Graph g(rt, "wake-then-fail");
  std::mutex mu;
  std::condition_variable cv;
  bool at_five = false, fail_now = false, first = true;
  long i = 0;
  auto src = g.source("n", [&]() -> std::optional<long> {
    if (i == 5 && first) {
      std::unique_lock lk(mu);
      at_five = true;
      cv.notify_all();
      cv.wait(lk, [&] { return fail_now; });
      throw std::runtime_error("the source's item 5");
    }
    // Items 0 to 4 take some work: the source's claims stay one item each (a claim that
    // reached item 5 would hold the items before it unemitted while it waits).
    if (i < 5) testing_helpers::spin_us(50);
    return i < 50 ? std::optional<long>(i++) : std::nullopt;
  });
  auto st = g.stage("st", [](long x) { return x; });
  auto out = g.pull_sink<long>("out", 2);
  src >> st >> out;
  detail::GraphCore& core = st.out_port().graph();
  bool hooked = false, ended_in_dispatch = false;
  core.set_dispatch_hook([&](std::size_t) {
    if (std::exchange(hooked, true)) return;
    {
      std::lock_guard lk(mu);
      fail_now = true;
    }
    cv.notify_all();
    // Until the run has ended (the bug) or holds only this dispatch: no item, one unit.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (core.running() && !(core.units() == 1 && core.items_in_flight() == 0)) {
      if (std::chrono::steady_clock::now() > give_up) {
        ADD_FAILURE() << "the failed run neither ended nor came down to the reader's dispatch";
        break;
      }
      std::this_thread::yield();
    }
    ended_in_dispatch = !core.running();
  });
  auto run = g.run();
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return at_five; });
  }
  // The stage has put items 0 and 1 into the full sink and waits for room with 2 to 4 queued:
  // its blocked time shows once it registered as the sink's waiter.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const RunStats live = run.stats();
    if (live.find("st")->blocked_ns > 0 && live.find("out")->items_in == 2) break;
    if (std::chrono::steady_clock::now() > give_up) {
      ADD_FAILURE() << "the stage never waited on the full sink";
      {
        std::lock_guard lk(mu);
        fail_now = true;
      }
      cv.notify_all();
      run.cancel();
      run.wait_for(std::chrono::seconds(60));
      return;
    }
    std::this_thread::yield();
  }
  EXPECT_EQ(out.next(), 0L);  // wakes the stage: its claim, the hook, the failure
  EXPECT_TRUE(hooked) << "the take did not wake the stage's claim";
  EXPECT_FALSE(ended_in_dispatch) << "the run ended while the reader's thread held its claim";
  try {
    while (out.next()) {
    }
    ADD_FAILURE() << "the reader did not see the failure";
  } catch (const StageError& e) {
    EXPECT_EQ(e.stage(), "n");
  }
  ASSERT_TRUE(run.wait_for(std::chrono::seconds(60)));
  EXPECT_EQ(run.status(), RunStatus::failed);
  EXPECT_EQ(core.units(), 0u) << "a unit outlived its run";
  // The same graph again, whole.
  first = false;
  i = 0;
  auto again = g.run();
  long n = 0;
  for (long v : out) EXPECT_EQ(v, n++);
  ASSERT_TRUE(again.wait_for(std::chrono::seconds(60))) << "the rerun hung";
  EXPECT_EQ(again.wait(), RunStatus::succeeded);
  EXPECT_EQ(n, 50);
}

// A reader waiting in vain nudges the runtime's arena every GraphCore::kNudgeAfter, as a run's
// waiter does (RunState::wait_until): oneTBB 2021.8 once left a run's first task unserved in an
// idle arena (docs/reliability.md), and a loop over a pull sink never waits on the run itself.
// Before, only run.wait() nudged: this source, which goes on only once the runtime has been
// nudged, gave up. Both ways of reading: next() (C++'s loop) and next_for in short slices
// (Python's, 50 ms at a time: none reaches kNudgeAfter alone).
TEST(PullSink, AReaderWaitingInVainNudgesTheRuntime) {
  Runtime rt({.threads = 2});
  Graph g(rt, "nudged");
  detail::GraphCore* core = nullptr;
  std::atomic<bool> gave_up{false};
  long i = 0;
  auto src = g.source("n", [&]() -> std::optional<long> {
    if (i == 3) return std::nullopt;
    // Each item waits for two nudges more than there were when it was asked for.
    const std::uint64_t want = core->runtime_nudges() + 2;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (core->runtime_nudges() < want) {
      if (std::chrono::steady_clock::now() > give_up) {
        gave_up = true;
        return std::nullopt;
      }
      std::this_thread::yield();
    }
    return i++;
  });
  auto out = g.pull_sink<long>("out", 1);
  src >> out;
  core = &src.out_port().graph();
  auto run = g.run();
  EXPECT_EQ(out.next(), 0L);
  std::vector<long> got;
  int slices = 0;
  for (;;) {
    bool timed_out = false;
    std::optional<long> v = out.next_for(std::chrono::milliseconds(20), timed_out);
    if (timed_out) {
      ++slices;
      continue;
    }
    if (!v) break;
    got.push_back(*v);
  }
  EXPECT_FALSE(gave_up) << "the reader's wait did not nudge the runtime";
  EXPECT_EQ(got, (std::vector<long>{1, 2}));
  EXPECT_GE(slices, 2) << "each item waited for two nudges, kNudgeAfter apart";
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
}
