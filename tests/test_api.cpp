// The public API as a user sees it: the umbrella header alone gives every public name, the
// version macro agrees with the CMake project, and every error is a splitflow::Error. Checks
// docs/api.md, "Objects and options", "Versions" and "Errors: one hierarchy".
#include <gtest/gtest.h>

#include <splitflow/splitflow.hpp>  // the only splitflow include: the umbrella must suffice
#include <string>
#include <type_traits>

using namespace splitflow;

TEST(Api, TheVersionIsTheProjects) {
  EXPECT_STREQ(version(), SPLITFLOW_EXPECTED_VERSION);
  EXPECT_EQ(SPLITFLOW_VERSION, SPLITFLOW_VERSION_MAJOR * 10000 + SPLITFLOW_VERSION_MINOR * 100 +
                                   SPLITFLOW_VERSION_PATCH);
  EXPECT_EQ(std::to_string(SPLITFLOW_VERSION_MAJOR) + "." + std::to_string(SPLITFLOW_VERSION_MINOR) +
                "." + std::to_string(SPLITFLOW_VERSION_PATCH),
            SPLITFLOW_VERSION_STRING);
}

TEST(Api, TheUmbrellaHeaderDeclaresEveryPublicName) {
  // Names from ops.hpp, service.hpp, batching.hpp, image.hpp, device.hpp and tensor.hpp.
  Runtime rt({.threads = 1, .device = {.backend = BackendKind::host}});
  Graph g(rt, "umbrella");
  auto svc = g.service<long, long>("requests");
  auto gather = g.dynamic_batch<long>("gather", {.max_batch = 4});
  auto model = g.gpu_stage("model", [](Batch<long> b, DeviceContext& ctx) {
    ops::busy_kernel(ctx, std::chrono::microseconds(1));
    for (long& x : b.items) x *= 2;
    return b;
  });
  auto split = g.unbatch<long>("split", 4);
  svc.source() >> gather >> model >> split >> svc.sink();
  auto run = g.run();
  EXPECT_EQ(svc.submit(21).get(), 42);
  svc.close();
  EXPECT_EQ(run.wait(), RunStatus::succeeded);
  EXPECT_NE(to_json(run.stats()).find("\"schema_version\":" + std::to_string(kJsonSchemaVersion)),
            std::string::npos);
  static_assert(std::is_class_v<image::FileList>);  // image.hpp
}

TEST(Api, EveryErrorIsASplitflowError) {
  static_assert(std::is_base_of_v<Error, GraphError>);
  static_assert(std::is_base_of_v<Error, StageError>);
  static_assert(std::is_base_of_v<Error, OverloadedError>);
  static_assert(std::is_base_of_v<Error, DeadlineError>);
  static_assert(std::is_base_of_v<Error, CancelledError>);
  static_assert(std::is_base_of_v<std::runtime_error, Error>);
  SUCCEED();
}

// "Bad input gets a clear error naming what was wrong": settings are checked when the object
// is built (a Runtime of 70000 threads used to be accepted and crash at exit).
TEST(Api, ImpossibleSettingsAreRefusedWhenBuilt) {
  const auto message = [](auto&& make) {
    try {
      make();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([] { Runtime rt({.threads = 70000}); }),
            "splitflow::Runtime: threads must be 0 (one per core) to 1024, not 70000");
  EXPECT_EQ(message([] { Runtime rt({.threads = -1}); }),
            "splitflow::Runtime: threads must be 0 (one per core) to 1024, not -1");
  EXPECT_NE(message([] { image::RandomResizedCrop op({.size = 0}); }).find("size 0 is out of range"),
            std::string::npos);
  EXPECT_NE(message([] {
              image::DecodeRandomResizedCrop op({.size = 224, .scale_min = 2, .scale_max = -1});
            }).find("scale (2, -1) must be two finite positive numbers, the smaller first"),
            std::string::npos);
  EXPECT_NE(message([] { image::RandomResizedCrop op({.flip_probability = 2}); })
                .find("flip probability 2 must be in [0, 1]"),
            std::string::npos);
}
