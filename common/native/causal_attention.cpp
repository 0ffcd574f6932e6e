// Native causal self-attention for the expanded (prefill) MLA path (fp32, CPU).
//
// What `SdpaPrefillAttention.causal` (torch SDPA, the reference) computes, over packed
// sequences:
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
// Scores are laid out transposed, [key, query row], as in the decode kernel's [token, head]:
//
//   scores  S[j, i] = k_j . q_i : key elements broadcast, 16 query rows per vector load from
//           the query block packed transposed ([d_qk, kRows]), so no horizontal sums;
//   softmax across query rows, 8 rows per vector: the running max, sum and rescale factor
//           of 8 rows at once, with no per-row horizontal max / sum or scalar exp;
//   values  O[i, :] += P[j, i] v_j : weights broadcast, value rows vector-loaded.
//
// With small heads the softmax is a large share of the work (an exp per score against
// d_qk + d_v multiply-adds): row by row, with scores [row, key], it took 31% of the time at
// the demo's widths; across rows, 21% (the whole kernel 1.13-1.18x faster, measured).
//
// The same kernel runs a chunk of a prompt over its past (keys that start before the
// queries, `offset` below) and reports each row's log-sum-exp, so that key tiles computed in
// separate calls merge exactly (common/model/past_native.py).
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

// Query rows per block, a multiple of 8 (the softmax runs across rows, a vector at a time),
// and keys per block, a multiple of 6 (the score tiles' rows). Measured at the demo's widths
// (48 / 32) and V3's (192 / 128): 32-64 rows x 48-96 keys all within 5%.
constexpr int64_t kRows = 48;
constexpr int64_t kKeys = 72;

// A [T, H, d] operand given by pointer and strides in floats (its last dimension is
// contiguous): element (t, h, c) at base[t * row + h * head + c]. A head stride of 0 shares
// one row among all heads (MLA's k_pe).
struct Operand {
  const float* base;
  int64_t row, head;
  const float* at(int64_t t, int64_t h) const { return base + t * row + h * head; }
};

// q = [q_a | q_b] and k = [k_a | k_b] along d (d_a + d_b = d_qk; d_b may be 0): the prefill
// passes MLA's parts as they come (q_nope | rotated q_pe, the up-projected k_nope | the shared
// k_pe) and the kernel joins them while packing, instead of torch concatenating them first.
//
// Sequence b's queries are rows qcu[b]..qcu[b + 1] of q, its keys rows kcu[b]..kcu[b + 1] of
// k and v, and its query i sees key j when j <= i + offset[b]: causal self-attention is
// qcu = kcu, offset 0; a chunk of Q queries after P past keys is offset P over P + Q keys,
// and offset >= the keys means no mask (a tile of the past).
struct Problem {
  Operand qa, qb, ka, kb, v;
  float* out;              // [Tq, H, d_v], contiguous
  float* lse;              // [Tq, H] log-sum-exp of each row's scaled scores, or null
  const int64_t* qcu;      // [nseq + 1] query rows, qcu[nseq] = Tq
  const int64_t* kcu;      // [nseq + 1] key rows, kcu[nseq] = Tk
  const int64_t* offset;   // [nseq] >= 0
  int64_t nseq, H, da, db, dv;
  float scale;
};

struct Workspace {
  std::vector<float> kp, vp, qt, s, o, ml;
  std::vector<const float*> qrows, vrows;
  std::vector<float*> srows, orows;
};

// One head of one sequence: queries [start, start + T) over keys [kstart, kstart + Tk), query
// i seeing keys 0..i + offset of them.
void run_head(const Problem& p, int64_t start, int64_t T, int64_t kstart, int64_t Tk,
              int64_t offset, int64_t h, Workspace& ws) {
  const int64_t da = p.da, dqk = p.da + p.db, dv = p.dv;
  Tk = std::min(Tk, T - 1 + offset + 1);  // keys no query sees are never packed
  float* kp = lines(ws.kp, Tk * dqk);
  float* vp = lines(ws.vp, Tk * dv);
  for (int64_t t = 0; t < Tk; ++t) {
    std::copy_n(p.ka.at(kstart + t, h), da, kp + t * dqk);
    std::copy_n(p.kb.at(kstart + t, h), p.db, kp + t * dqk + da);
    std::copy_n(p.v.at(kstart + t, h), dv, vp + t * dv);
  }
  float* qt = lines(ws.qt, dqk * kRows);  // the query block transposed and scaled [dqk, kRows]
  float* s = lines(ws.s, kKeys * kRows);  // [key, row]: scores, then weights
  float* o = lines(ws.o, kRows * dv);
  float* m = lines(ws.ml, 3 * kRows);
  float* l = m + kRows;
  float* alpha = l + kRows;
  const float** qrows = grown(ws.qrows, dqk);
  const float** vrows = grown(ws.vrows, kKeys);
  float** srows = grown(ws.srows, kKeys);
  float** orows = grown(ws.orows, kRows);
  for (int64_t d = 0; d < dqk; ++d) qrows[d] = qt + d * kRows;
  for (int64_t j = 0; j < kKeys; ++j) srows[j] = s + j * kRows;
  for (int64_t i = 0; i < kRows; ++i) orows[i] = o + i * dv;
  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
    const int64_t nr = std::min(kRows, T - i0);
    const int64_t last = std::min(Tk - 1, i0 + nr - 1 + offset);  // the block's last key
    std::fill(m, m + kRows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + kRows, 0.0f);
    std::fill(o, o + nr * dv, 0.0f);
    std::fill(qt, qt + dqk * kRows, 0.0f);  // rows past the sequence stay 0 (discarded)
    for (int64_t i = 0; i < nr; ++i) {
      const float* qa = p.qa.at(start + i0 + i, h);
      const float* qb = p.qb.at(start + i0 + i, h);
      for (int64_t d = 0; d < da; ++d) qt[d * kRows + i] = qa[d] * p.scale;
      for (int64_t d = da; d < dqk; ++d) qt[d * kRows + i] = qb[d - da] * p.scale;
    }
    for (int64_t j0 = 0; j0 <= last; j0 += kKeys) {
      const int64_t nk = std::min(kKeys, last + 1 - j0);
      axpy_rows(dqk, Strided{kp + j0 * dqk, dqk, 1}, qrows, nk, kRows, srows, true);
      // s[j * kRows + i]: key j0 + j's score for query row i0 + i; only blocks that reach
      // past what the block's first row sees need the causal mask.
      if (j0 + nk - 1 > i0 + offset)
        online_softmax<true>(s, nk, kRows, kRows, m, l, alpha, j0, i0 + offset);
      else
        online_softmax<false>(s, nk, kRows, kRows, m, l, alpha);
      for (int64_t i = 0; i < nr; ++i) {
        float* row = orows[i];
        int64_t c = 0;
        for (; c + kLanes <= dv; c += kLanes) store(row + c, load(row + c) * splat(alpha[i]));
        for (; c < dv; ++c) row[c] *= alpha[i];
      }
      for (int64_t j = 0; j < nk; ++j) vrows[j] = vp + (j0 + j) * dv;
      axpy_rows(nk, Strided{s, 1, kRows}, vrows, nr, dv, orows, false);  // A(i, j) = P[j, i]
    }
    for (int64_t i = 0; i < nr; ++i) {
      const float inv = 1.0f / l[i];
      float* dst = p.out + ((start + i0 + i) * p.H + h) * dv;
      for (int64_t c = 0; c < dv; ++c) dst[c] = orows[i][c] * inv;
      // The scores were scaled with the queries, so m is the row's largest scaled score.
      if (p.lse) p.lse[(start + i0 + i) * p.H + h] = m[i] + std::log(l[i]);
    }
  }
}

thread_local Workspace tls_workspace;

void run_heads(const Problem& p, int64_t h0, int64_t h1) {
  for (int64_t b = 0; b < p.nseq; ++b)
    for (int64_t h = h0; h < h1; ++h)
      if (p.qcu[b + 1] > p.qcu[b])
        run_head(p, p.qcu[b], p.qcu[b + 1] - p.qcu[b], p.kcu[b], p.kcu[b + 1] - p.kcu[b],
                 p.offset[b], h, tls_workspace);
}

}  // namespace

extern "C" {

// tensors: q_a, q_b, k_a, k_b, v, out, lse (or null), query cu, key cu (int64, nseq + 1
//          each), offsets (int64, nseq); fp32, every operand's last dimension contiguous,
//          out contiguous [Tq, H, d_v], lse contiguous [Tq, H]
// dims:    nseq, Tq, Tk, H, d_a, d_b, d_v, threads, then (row, head) strides of q_a, q_b,
//          k_a, k_b, v in floats
// scalars: scale
// Returns 0, or 1 if the cu arrays do not rise from 0 to Tq / Tk or some sequence with
// queries has a negative offset or no keys (its softmax would be over nothing).
int tpla_causal_attention(void* const* tensors, const int64_t* dims, const float* scalars) {
  const auto operand = [&](int i) {
    return Operand{static_cast<const float*>(tensors[i]), dims[8 + 2 * i], dims[9 + 2 * i]};
  };
  const Problem p{operand(0), operand(1), operand(2), operand(3), operand(4),
                  static_cast<float*>(tensors[5]),
                  static_cast<float*>(tensors[6]),
                  static_cast<const int64_t*>(tensors[7]),
                  static_cast<const int64_t*>(tensors[8]),
                  static_cast<const int64_t*>(tensors[9]),
                  dims[0], dims[3], dims[4], dims[5], dims[6], scalars[0]};
  if (p.qcu[0] != 0 || p.qcu[p.nseq] != dims[1] || p.kcu[0] != 0 || p.kcu[p.nseq] != dims[2])
    return 1;
  for (int64_t b = 0; b < p.nseq; ++b) {
    if (p.qcu[b + 1] < p.qcu[b] || p.kcu[b + 1] < p.kcu[b]) return 1;
    if (p.qcu[b + 1] > p.qcu[b] && (p.offset[b] < 0 || p.kcu[b + 1] == p.kcu[b])) return 1;
  }
  const int64_t threads = std::max<int64_t>(1, std::min(dims[7], p.H));
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
