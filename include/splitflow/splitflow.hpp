// splitflow: typed CPU/GPU dataflow graphs that hold the accelerator only while kernels run.
#pragma once

#include "splitflow/config.hpp"
#include "splitflow/error.hpp"
#include "splitflow/graph.hpp"
#include "splitflow/run.hpp"
#include "splitflow/runtime.hpp"
#include "splitflow/stats.hpp"
#include "splitflow/telemetry.hpp"
