// splitflow: typed CPU/GPU dataflow graphs that hold the accelerator only while kernels run.
// The umbrella header: every public header a user needs (splitflow/ops/thrust.hpp, for Thrust code
// on device tensors, is separate: it needs the splitflow::thrust target).
//
//     #include <splitflow/splitflow.hpp>
//     splitflow::Runtime rt;
//     splitflow::Graph g(rt, "squares");
//     auto out = g.pull_sink<long>("out");
//     g.source("n", std::views::iota(0L, 10L)) >> g.stage("sq", [](long x) { return x * x; }) >> out;
//     auto run = g.run();
//     for (long v : out) std::printf("%ld\n", v);
//     run.wait();
#pragma once

#include "splitflow/core/bytes.hpp"
#include "splitflow/core/config.hpp"
#include "splitflow/core/error.hpp"
#include "splitflow/core/tensor.hpp"
#include "splitflow/device/arbiter.hpp"
#include "splitflow/device/device.hpp"
#include "splitflow/executor/autotune.hpp"
#include "splitflow/executor/autotune_sim.hpp"
#include "splitflow/executor/graph.hpp"
#include "splitflow/executor/run.hpp"
#include "splitflow/executor/runtime.hpp"
#include "splitflow/ops/decode.hpp"
#include "splitflow/ops/image.hpp"
#include "splitflow/ops/ops.hpp"
#include "splitflow/serving/batching.hpp"
#include "splitflow/serving/service.hpp"
#include "splitflow/telemetry/export.hpp"
#include "splitflow/telemetry/stats.hpp"
#include "splitflow/telemetry/telemetry.hpp"
#include "splitflow/version.hpp"
