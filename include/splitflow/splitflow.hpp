// splitflow: typed CPU/GPU dataflow graphs that hold the accelerator only while kernels run.
// The umbrella header: every public header a user needs (splitflow/thrust.hpp, for Thrust code
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

#include "splitflow/batching.hpp"
#include "splitflow/config.hpp"
#include "splitflow/device.hpp"
#include "splitflow/error.hpp"
#include "splitflow/graph.hpp"
#include "splitflow/image.hpp"
#include "splitflow/ops.hpp"
#include "splitflow/run.hpp"
#include "splitflow/runtime.hpp"
#include "splitflow/service.hpp"
#include "splitflow/stats.hpp"
#include "splitflow/telemetry.hpp"
#include "splitflow/tensor.hpp"
#include "splitflow/version.hpp"
