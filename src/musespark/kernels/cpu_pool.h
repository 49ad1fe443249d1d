// Output tensors of the ops from memory blocks kept across calls: musespark_pool::empty.
//
// Why: a prompt step's ops return megabytes per layer (the new stream, q/k/v and the gate, the
// attention output). From at::empty each one is a fresh malloc above glibc's mmap threshold,
// or heap that glibc trims away once it is freed, so the next layer faults its pages in and the
// kernel zeroes them again: about 14,000 page faults per 2048-token prompt on the Xeon measured,
// ~6 % of its time (benchmarks/RESULTS.md, session 25). glibc can be told to keep freed memory
// (mallopt), but only for the whole process: every other library's allocations would change too.
//
// Here a block of at least kMinBytes, once its tensor is freed, waits (by its exact size) for
// the next output of that size; at most kMaxKeptBytes wait in all, beyond that a freed block
// goes back to malloc. A prompt of any length reuses its layers' blocks from the second layer on.
// Blocks are uninitialized, as at::empty's are. Thread-safe: a tensor may be freed anywhere.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace musespark_pool {

constexpr size_t kMinBytes = size_t{1} << 20;        // smaller ones: malloc keeps them in its heap
constexpr size_t kMaxKeptBytes = size_t{256} << 20;  // a 2048-token layer of a 1024-wide model frees ~30 MiB
constexpr size_t kAlign = 64;

struct Blocks {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free;  // by size in bytes
  size_t kept = 0;                                      // bytes in `free`
};

inline Blocks& blocks() {  // never destroyed: tensors may be freed after static destructors ran
  static Blocks* b = new Blocks;
  return *b;
}

inline void give_back(void* p, size_t bytes) {
  Blocks& b = blocks();
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    if (b.kept + bytes <= kMaxKeptBytes) {
      b.free[bytes].push_back(p);
      b.kept += bytes;
      return;
    }
  }
  std::free(p);
}

// An uninitialized contiguous CPU tensor (at::empty), from a kept block when one of its size waits.
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kMinBytes) return at::empty(sizes, options);
  void* p = nullptr;
  {
    Blocks& b = blocks();
    std::lock_guard<std::mutex> lock(b.mutex);
    auto it = b.free.find(bytes);
    if (it != b.free.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      b.kept -= bytes;
    }
  }
  if (p == nullptr) {
    p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    TORCH_CHECK(p != nullptr, "out of memory: ", bytes, " bytes for an output tensor");
  }
  return at::from_blob(p, sizes, [bytes](void* q) { give_back(q, bytes); }, options.device(at::kCPU));
}

}  // namespace musespark_pool
