// The kept output blocks of common/pool.h.
#include "pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace musespark_pool {
namespace {

struct Blocks {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free;  // by size in bytes
  size_t kept = 0;                                      // bytes in `free`
};

Blocks& blocks() {  // never destroyed: tensors may be freed after static destructors ran
  static Blocks* b = new Blocks;
  return *b;
}

void give_back(void* p, size_t bytes) {
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

}  // namespace

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
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
