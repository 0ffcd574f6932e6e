// Native products for decode-sized batches: a linear layer over a few rows, a dense MLP, and
// the routed experts of a MoE layer for a few tokens (fp32, CPU).
//
// Why native: a decode step multiplies every weight matrix by 1-16 rows. BLAS packs the
// weight for each such call and runs its skinny-M code far below peak (measured on the
// development VM: F.linear of 4 rows by a 3072 x 256 weight took 2.0-2.7x the time of one row);
// here each weight row is read once into a register tile and meets every input row while it
// is in L1. The MoE call also replaces the per-expert loop of ~10 torch ops (grouping,
// gather, two matmuls, activation, weighted scatter) with one call per layer.
//
// The reference for each is PyTorch: `F.linear`, `MLP.forward` and `MoE.forward`'s expert
// loop (common/model/moe.py); tests/unit/common/native/test_small_gemm.py checks them against
// it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tiles.h"

namespace {

using namespace tiles;

struct Scratch {
  std::vector<const float*> rows;
  std::vector<int64_t> order, start, next;
  std::vector<float> x, h, act, y;
};

thread_local Scratch tls_scratch;

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// y [M, D] = down (silu(gate x) * up x) for x [M, D], gate / up [I, D], down [D, I]: one
// SwiGLU MLP, a dense layer's or one routed expert's (whose gate and up rows sit in one
// gate_up block). Uses s.h and s.act.
void swiglu(const float* x, const float* gate, const float* up, const float* down, float* y,
            int64_t M, int64_t I, int64_t D, Scratch& s) {
  s.h.resize(M * 2 * I);
  s.act.resize(M * I);
  float* g = s.h.data();
  float* u = s.h.data() + M * I;
  linear(x, gate, g, M, I, D, s.rows);
  linear(x, up, u, M, I, D, s.rows);
  for (int64_t i = 0; i < M * I; ++i) s.act[i] = silu(g[i]) * u[i];
  linear(s.act.data(), down, y, M, D, I, s.rows);
}

}  // namespace

extern "C" {

// Returns 0.
int tpla_linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  linear(x, w, y, M, N, K, tls_scratch.rows);
  return 0;
}

// out[M, D] = down (silu(gate x) * up x) for x [M, D]: a dense MLP or a MoE layer's shared
// experts (`MLP.forward`), gate / up [I, D], down [D, I]. One call for the five torch ops.
// Returns 0.
int tpla_mlp(const float* x, const float* gate, const float* up, const float* down, float* out,
             int64_t M, int64_t I, int64_t D) {
  swiglu(x, gate, up, down, out, M, I, D, tls_scratch);
  return 0;
}

// out[t] = sum_j weights[t, j] * down[e] (silu(gate[e] x_t) * up[e] x_t), e = ids[t, j],
// for M tokens x [M, D] with top-k ids / weights [M, k]; gate_up [E, 2I, D] holds each
// expert's gate rows then its up rows, down [E, D, I]. `out` [M, D] is overwritten.
// Experts run in id order and each adds its weighted rows into `out` as the reference's
// index_add_ does, so a token's sum is taken in the same order.
// Returns 0, or 1 if an expert id is outside [0, E) (checked before any work).
int tpla_moe_experts(const float* x, const int64_t* ids, const float* weights,
                     const float* gate_up, const float* down, float* out, int64_t M, int64_t k,
                     int64_t E, int64_t I, int64_t D) {
  for (int64_t j = 0; j < M * k; ++j)
    if (ids[j] < 0 || ids[j] >= E) return 1;
  Scratch& s = tls_scratch;
  // Counting sort of the (token, slot) pairs by expert, stable like the reference's.
  s.start.assign(E + 1, 0);
  for (int64_t j = 0; j < M * k; ++j) ++s.start[ids[j] + 1];
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  s.order.resize(M * k);
  s.next.assign(s.start.begin(), s.start.end() - 1);
  for (int64_t j = 0; j < M * k; ++j) s.order[s.next[ids[j]]++] = j;
  for (int64_t i = 0; i < M * D; ++i) out[i] = 0.0f;
  // An expert meets at most M * k rows: M unless a token lists it twice (not a top-k
  // routing, but the reference accepts it, so the buffers must hold it; swiglu sizes its own).
  s.x.resize(M * k * D);
  s.y.resize(M * k * D);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = s.start[e], count = s.start[e + 1] - first;
    if (count == 0) continue;
    for (int64_t c = 0; c < count; ++c) {
      const float* src = x + (s.order[first + c] / k) * D;
      std::copy(src, src + D, s.x.data() + c * D);
    }
    const float* gate = gate_up + e * 2 * I * D;
    swiglu(s.x.data(), gate, gate + I * D, down + e * D * I, s.y.data(), count, I, D, s);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t pair = s.order[first + c];
      const float wt = weights[pair];
      const float* y = s.y.data() + c * D;
      float* o = out + (pair / k) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += y[d] * wt;
    }
  }
  return 0;
}

}  // extern "C"
