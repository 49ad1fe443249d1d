// Output tensors of the ops from memory blocks kept across calls: musespark_pool::empty.
//
// Why: a prompt step's ops return megabytes per layer (the new stream, q/k/v and the gate, the
// attention output). From at::empty each one is a fresh malloc above glibc's mmap threshold,
// or heap that glibc trims away once it is freed, so the next layer faults its pages in and the
// kernel zeroes them again: about 14,000 page faults per 2048-token prompt on the Xeon measured,
// ~6 % of its time (benchmarks/RESULTS.md, at 7431cce). glibc can be told to keep freed memory
// (mallopt), but only for the whole process: every other library's allocations would change too.
//
// Here a block of at least kMinBytes, once its tensor is freed, waits (by its exact size) for
// the next output of that size; at most kMaxKeptBytes wait in all, beyond that a freed block
// goes back to malloc. A prompt of any length reuses its layers' blocks from the second layer on.
// Blocks are uninitialized, as at::empty's are. Thread-safe: a tensor may be freed anywhere.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>

namespace musespark_pool {

constexpr size_t kMinBytes = size_t{1} << 20;        // smaller ones: malloc keeps them in its heap
constexpr size_t kMaxKeptBytes = size_t{256} << 20;  // a 2048-token layer of a 1024-wide model frees ~30 MiB
constexpr size_t kAlign = 64;

// An uninitialized contiguous CPU tensor (at::empty), from a kept block when one of its size
// waits. (common/pool.cpp)
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace musespark_pool
