// Checked CUDA runtime calls: an error names the call, the device and the stage being run.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace splitflow::detail {

/// Counts calls into the CUDA runtime (see cuda_runtime_calls()).
void note_cuda_call() noexcept;
/// The GPU stage whose body or burst the current thread is running ("" outside one).
const std::string& current_stage() noexcept;
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, int device);

}  // namespace splitflow::detail

#define SF_CUDA(call, device)                                                           \
  do {                                                                                  \
    ::splitflow::detail::note_cuda_call();                                              \
    const cudaError_t sf_err_ = (call);                                                 \
    if (sf_err_ != cudaSuccess) ::splitflow::detail::throw_cuda_error(sf_err_, #call, device); \
  } while (0)
