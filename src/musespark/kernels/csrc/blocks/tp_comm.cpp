// A shared-memory all-reduce for the tensor-parallel ranks of one host (blocks/tp_comm.h).
//
// The region (a file in /dev/shm every rank maps, made by kernels/tp_comm.py) holds one
// sequence counter per rank, each on its own cache line, then two sets of `world` slots of
// `capacity` floats. Reduction number q (1, 2, ...) uses set q % 2: each rank copies its
// values into its slot, publishes q (release), waits until every rank has published q
// (acquire), then sums the slots in rank order into its own output. Two sets suffice: a rank
// writes set q % 2 again only at q + 2, after every rank published q + 1, which each does
// only after it finished reading q. Longer arrays go in chunks of `capacity`, one number each.
//
// A dead peer leaves the others waiting: rank 0's watchdog (parallel/executor.py) stops every
// rank then, as it does for a rank stuck in a gloo collective.
#include "tp_comm.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace musespark_tp {
namespace {

constexpr int64_t kLine = 64;  // bytes per rank's counter

struct Comm {
  uint8_t* base = nullptr;
  int64_t rank = 0, world = 1, capacity = 0, seq = 0;
  bool reduce_blocks = false, ep = false;

  std::atomic<int64_t>* counter(int64_t r) const { return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine); }
  float* slot(int64_t set, int64_t r) const {
    return reinterpret_cast<float*>(base + world * kLine) + (set * world + r) * capacity;
  }
};

Comm comm;

void wait_for(int64_t r, int64_t q) {
  for (int64_t spins = 0; comm.counter(r)->load(std::memory_order_acquire) < q; ++spins) {
    if (spins < 4096)
      _mm_pause();
    else
      std::this_thread::yield();  // a rank without a core of its own: let the others run
  }
}

}  // namespace

bool blocks_reduce() { return comm.reduce_blocks && comm.base != nullptr; }
bool expert_parallel() { return comm.ep; }
int64_t rank() { return comm.rank; }
int64_t world() { return comm.world; }

void all_reduce(float* x, int64_t n) {
  TORCH_CHECK(comm.base != nullptr, "tp_all_reduce: no communicator attached (tp_comm_attach)");
  for (int64_t off = 0; off < n; off += comm.capacity) {
    const int64_t len = std::min(comm.capacity, n - off), q = ++comm.seq, set = q % 2;
    std::memcpy(comm.slot(set, comm.rank), x + off, static_cast<size_t>(len) * sizeof(float));
    comm.counter(comm.rank)->store(q, std::memory_order_release);
    for (int64_t r = 0; r < comm.world; ++r)
      if (r != comm.rank) wait_for(r, q);
    float* out = x + off;
    std::memcpy(out, comm.slot(set, 0), static_cast<size_t>(len) * sizeof(float));
    for (int64_t r = 1; r < comm.world; ++r) {
      const float* in = comm.slot(set, r);
      for (int64_t i = 0; i < len; ++i) out[i] += in[i];
    }
  }
}

}  // namespace musespark_tp

namespace {

using at::Tensor;

// region: the mapped shared file, uint8, at least world * 64 + 2 * world * capacity * 4 bytes,
// zeroed before any rank attached. Kept by the caller while attached.
void tp_comm_attach(const Tensor& region, int64_t rank, int64_t world, int64_t capacity) {
  using musespark_tp::comm;
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && capacity >= 1, "tp_comm_attach: bad rank/world/capacity");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() &&
                  region.numel() >= world * musespark_tp::kLine + 2 * world * capacity * 4,
              "tp_comm_attach: the region is too small");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(region.data_ptr()) % musespark_tp::kLine == 0,
              "tp_comm_attach: the region must be 64-byte aligned");
  comm = musespark_tp::Comm{static_cast<uint8_t*>(region.data_ptr()), rank, world, capacity, 0, false, false};
}

void tp_comm_detach() { musespark_tp::comm = musespark_tp::Comm{}; }

// Turns the fused blocks' reductions on or off (blocks/tp_comm.h); returns the previous setting.
bool tp_comm_blocks(bool on, bool expert_parallel) {
  using musespark_tp::comm;
  TORCH_CHECK(!on || comm.base != nullptr, "tp_comm_blocks: no communicator attached");
  const bool was = comm.reduce_blocks;
  comm.reduce_blocks = on;
  comm.ep = expert_parallel;
  return was;
}

Tensor tp_all_reduce_(Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "tp_all_reduce_: x must be contiguous float32");
  musespark_tp::all_reduce(x.data_ptr<float>(), x.numel());
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(musespark_cpu, m) {
  m.def("tp_comm_attach(Tensor region, int rank, int world, int capacity) -> ()");
  m.def("tp_comm_detach() -> ()", &tp_comm_detach);
  m.def("tp_comm_blocks(bool on, bool expert_parallel) -> bool", &tp_comm_blocks);
  m.def("tp_all_reduce_(Tensor(a!) x) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(musespark_cpu, CPU, m) {
  m.impl("tp_comm_attach", &tp_comm_attach);
  m.impl("tp_all_reduce_", &tp_all_reduce_);
}
