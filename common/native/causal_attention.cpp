// Native causal self-attention for the expanded (prefill) MLA path (fp32, CPU).
//
// What `SdpaBackend.causal` (torch SDPA, the reference) computes, over packed sequences:
//
//   o_i^h = sum_{j <= i} softmax_j(scale q_i^h . k_j^h) v_j^h     per sequence and head
//
// Why native: MLA's head widths (d_qk = d_n + d_r, d_v < d_qk) are not what torch's CPU flash
// kernel is tuned for: at the demo model's 48 / 32 it ran ~20 GFLOP/s on one core here, and
// only after v was zero-padded to 48 (unpadded, the unfused path was ~5x slower). Here both
// products run in the decode kernel's register tiles (tiles.h): per (sequence, head), keys
// and values are packed once, then query blocks of kRows rows walk the key blocks up to
// the diagonal with an online softmax (flash-attention style; nothing T x T is stored).
//
//   scores  S[i, j] = q_i . k_j : query elements broadcast, 16 keys per vector load from the
//           keys packed transposed per block ([d_qk, kc]), so no horizontal sums;
//   values  O[i, :] += P[i, j] v_j : softmax weights broadcast, value rows vector-loaded.
//
// Packing also matters for the caches: in [T, H, d] layout a head's rows sit H * d floats
// apart, a power of two here, so a block's rows would share a few L1 sets.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "tiles.h"

namespace {

using namespace tiles;

constexpr int64_t kRows = 36;  // query rows per block: six 6-row tiles

// Keys per block: the block's packed keys ([d_qk, kc] floats) stay in L1 (<= 16 KB) while
// every row tile of the query block passes over them.
int64_t key_block(int64_t dqk) { return dqk <= 64 ? 64 : dqk <= 128 ? 32 : 16; }

struct Problem {
  const float* q;   // [T, H, d_qk]
  const float* k;   // [T, H, d_qk]
  const float* v;   // [T, H, d_v]
  float* out;       // [T, H, d_v]
  const int64_t* cu;  // [nseq + 1] sequence starts, cu[nseq] = T
  int64_t nseq, H, dqk, dv;
  float scale;
};

struct Workspace {
  std::vector<float> kt, vp, qb, s, o, ml;
  std::vector<const float*> krows, vrows;
  std::vector<float*> srows, orows;
};

inline float hmax(v8 x) {
  float r = x[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, x[i]);
  return r;
}

inline float hsum(v8 x) {
  float r = 0.0f;
  for (int i = 0; i < 8; ++i) r += x[i];
  return r;
}

// Row i's online-softmax update over one key block: s[0:n) (n a multiple of 8) holds its
// scores (already scaled), of which the first `valid` are keys it may see (causality). They
// become weights exp(s - m_new), zero past `valid`; returns exp(m_old - m_new) to rescale the row's
// output, and updates the row's running max m and sum l.
float softmax_row(float* s, int64_t n, int64_t valid, float& m, float& l) {
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8 neg_inf = splat(-std::numeric_limits<float>::infinity());
  v8 top = splat(m);
  for (int64_t j = 0; j < n; j += kLanes) {
    const v8 x = load(s + j);
    top = vmax(top, (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(valid) ? x : neg_inf);
  }
  const float m_new = hmax(top);
  v8 sum = {};
  for (int64_t j = 0; j < n; j += kLanes) {
    v8 x = exp_v8(vmax(load(s + j) - splat(m_new), splat(kExpFloor)));
    x = (lane + static_cast<int32_t>(j)) < static_cast<int32_t>(valid) ? x : v8{};
    store(s + j, x);
    sum += x;
  }
  // On the first block m = -inf: the floor makes alpha e^-30, times l = 0 and O = 0.
  const float alpha = exp_v8(splat(std::max(m - m_new, kExpFloor)))[0];
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

// One head of one sequence (tokens [start, start + T)).
void run_head(const Problem& p, int64_t start, int64_t T, int64_t h, Workspace& ws) {
  const int64_t H = p.H, dqk = p.dqk, dv = p.dv, kc = key_block(dqk);
  const int64_t nkb = (T + kc - 1) / kc;
  // Keys packed per block, transposed: kt[(b * dqk + d) * kc + j] = k[b * kc + j, h, d];
  // values packed [T, dv]. The tail block is zero-padded (its scores are masked anyway).
  float* kt = lines(ws.kt, nkb * dqk * kc);
  float* vp = lines(ws.vp, nkb * kc * dv);
  std::fill(kt + (nkb - 1) * dqk * kc, kt + nkb * dqk * kc, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* kr = p.k + ((start + t) * H + h) * dqk;
    float* col = kt + (t / kc) * dqk * kc + t % kc;
    for (int64_t d = 0; d < dqk; ++d) col[d * kc] = kr[d];
    std::copy_n(p.v + ((start + t) * H + h) * dv, dv, vp + t * dv);
  }
  float* qb = lines(ws.qb, kRows * dqk);  // the query block, scaled, rows contiguous
  float* s = lines(ws.s, kRows * kc);
  float* o = lines(ws.o, kRows * dv);
  float* m = lines(ws.ml, 2 * kRows);
  float* l = m + kRows;
  const float** krows = grown(ws.krows, dqk);
  const float** vrows = grown(ws.vrows, kc);
  float** srows = grown(ws.srows, kRows);
  float** orows = grown(ws.orows, kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    srows[i] = s + i * kc;
    orows[i] = o + i * dv;
  }
  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
    const int64_t nr = std::min(kRows, T - i0);
    const int64_t last = i0 + nr - 1;  // the block's last query sees keys [0, last]
    std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
    std::fill(l, l + nr, 0.0f);
    std::fill(o, o + nr * dv, 0.0f);
    for (int64_t i = 0; i < nr; ++i) {
      const float* src = p.q + ((start + i0 + i) * H + h) * dqk;
      for (int64_t d = 0; d < dqk; ++d) qb[i * dqk + d] = src[d] * p.scale;
    }
    const Strided queries{qb, dqk, 1};
    for (int64_t j0 = 0; j0 <= last; j0 += kc) {
      const int64_t nk = std::min(kc, last + 1 - j0);  // keys of this block anyone sees
      const int64_t ns = (nk + 15) / 16 * 16;           // scored: whole 16-key tiles (<= kc)
      const float* blk = kt + (j0 / kc) * dqk * kc;
      for (int64_t d = 0; d < dqk; ++d) krows[d] = blk + d * kc;
      axpy_rows(dqk, queries, krows, nr, ns, srows, true);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t valid = std::min(nk, i0 + i - j0 + 1);
        if (valid <= 0) {  // a row above this block's keys: weight 0 everywhere
          std::fill(srows[i], srows[i] + nk, 0.0f);
          continue;
        }
        const float alpha = softmax_row(srows[i], ns, valid, m[i], l[i]);
        if (alpha != 1.0f)
          for (int64_t c = 0; c < dv; ++c) orows[i][c] *= alpha;
      }
      for (int64_t j = 0; j < nk; ++j) vrows[j] = vp + (j0 + j) * dv;
      axpy_rows(nk, Strided{s, kc, 1}, vrows, nr, dv, orows, false);  // A(i, j) = P[i, j]
    }
    for (int64_t i = 0; i < nr; ++i) {
      const float inv = 1.0f / l[i];
      float* dst = p.out + ((start + i0 + i) * H + h) * dv;
      for (int64_t c = 0; c < dv; ++c) dst[c] = orows[i][c] * inv;
    }
  }
}

thread_local Workspace tls_workspace;

void run_heads(const Problem& p, int64_t h0, int64_t h1) {
  for (int64_t b = 0; b < p.nseq; ++b)
    for (int64_t h = h0; h < h1; ++h)
      if (p.cu[b + 1] > p.cu[b]) run_head(p, p.cu[b], p.cu[b + 1] - p.cu[b], h, tls_workspace);
}

}  // namespace

extern "C" {

// tensors: q, k, v, out (fp32, contiguous [T, H, d]), cu_seqlens (int64, nseq + 1)
// dims:    nseq, T, H, d_qk, d_v, threads
// scalars: scale
// Returns 0, or 1 if cu_seqlens is not 0 = cu[0] <= cu[1] <= ... <= cu[nseq] = T.
int tpla_causal_attention(void* const* tensors, const int64_t* dims, const float* scalars) {
  const Problem p{static_cast<const float*>(tensors[0]),
                  static_cast<const float*>(tensors[1]),
                  static_cast<const float*>(tensors[2]),
                  static_cast<float*>(tensors[3]),
                  static_cast<const int64_t*>(tensors[4]),
                  dims[0],
                  dims[2],
                  dims[3],
                  dims[4],
                  scalars[0]};
  const int64_t T = dims[1];
  if (p.cu[0] != 0 || p.cu[p.nseq] != T) return 1;
  for (int64_t b = 0; b < p.nseq; ++b)
    if (p.cu[b + 1] < p.cu[b]) return 1;
  const int64_t threads = std::max<int64_t>(1, std::min(dims[5], p.H));
  if (threads == 1) {
    run_heads(p, 0, p.H);
    return 0;
  }
  // Heads split evenly; each thread packs and attends its own heads.
  std::vector<std::thread> pool;
  for (int64_t k = 0; k < threads; ++k)
    pool.emplace_back(run_heads, std::cref(p), p.H * k / threads, p.H * (k + 1) / threads);
  for (auto& t : pool) t.join();
  return 0;
}

}  // extern "C"
