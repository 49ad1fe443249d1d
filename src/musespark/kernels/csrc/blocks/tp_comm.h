// The tensor-parallel ranks' shared-memory all-reduce on one host (blocks/tp_comm.cpp), and the
// split point of the fused blocks under tensor/expert parallelism (docs/parallel.md §11).
//
// A TP rank's row-parallel products (o_proj, a dense MLP's down_proj, TP-split experts' down
// rows) are partial sums over its slice of the inner dimension; the fused blocks sum them over
// the ranks in fp32 before anything that is not linear in them (the post-norm, the per-expert
// norm) and round once afterwards, as the torch reference does (parallel/state.py
// all_reduce_fp32). With expert parallelism the weighted expert mix of the rank's own slots
// is summed instead (other ranks' slots are zero here).
//
// The blocks reduce only while `blocks_reduce()` is on: the cpu backend turns it on around a
// sharded model's step (backends/cpu_backend.py), so a one-process model in the same process
// (rank 0 is the engine process) computes exactly as before.
#pragma once
#include <cstdint>

namespace musespark_tp {

// Whether the fused blocks reduce their partial sums now (a sharded model's step).
bool blocks_reduce();
// Whether the experts are split by expert (EP) rather than by width (TP only).
bool expert_parallel();
int64_t rank();
int64_t world();
// x[0, n) <- the sum of every rank's x[0, n), fp32, in rank order (so every rank holds the same
// bits). Every rank calls it with the same n, in the same order as every other reduction.
void all_reduce(float* x, int64_t n);

}  // namespace musespark_tp
