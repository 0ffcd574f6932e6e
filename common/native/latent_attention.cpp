// Native TPLA / MLA-TP decode attention over the paged latent cache (fp32, CPU).
//
// The same math as `fused_slice_attention` in common/model/tpla.py (its reference is
// `latent_slice_attention`), in one call instead of ~30 torch ops:
//
//   q~_h = [ (scale / beta) q_nope_h W_UK_h  |  scale q_pe_h ]          absorb
//   s_ht = q~_h . kv_t          (kv_t = [n_t[S_i] | k_pe_t], one cache row)  scores
//   u_h  = sum_t softmax_t(s_h) n_t[S_i]                               values
//   o_h  = W_UV_h u_h                                                  output
//
// Why native: at decode shapes the eager kernel spends its time in per-op dispatch and in
// small matmuls that BLAS runs far below peak (few query rows). Here the cache is read in
// place through the block table (no gather copy), every product runs in register tiles
// sized for 16 vector registers, and the softmax is online (flash-decoding style) over
// chunks of tokens that stay in L2 between the score and value passes.
//
// Written with GCC/Clang vector extensions: the compiler emits AVX2+FMA with -mavx2 -mfma
// (or -march=native) and plain SSE otherwise, from the same source.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "tiles.h"

namespace {

using namespace tiles;

// Tokens per online-softmax chunk: the chunk's rows are read twice (scores, then values),
// so they must stay in L2; 120 rows of a V3 TPLA rank are 150 KB.
constexpr int64_t kChunk = 120;  // a multiple of the 6-row tiles
// One GEMM of the weight-absorb sweep below: C_b[0:N] = sum_k a_b[k] rows[k][0:N].
struct Sweep {
  const float* const* a;
  const float* const* rows;
  float* const* c;
};

// S sweeps at once, for a few rows b each, streaming every B row once and in order: the
// weight-absorb GEMM is bound by reading W_UK, and a sequential sweep is what the hardware
// prefetcher follows best. C rows stay in L1. With one sequence (B = 1) four heads' sweeps
// run interleaved: more streams in flight read DRAM faster than one (V3 widths, weights only:
// W_UK 9.5 GB/s with one stream, ~15 with two; four: V3 1,024 x 1 1.03-1.10x over two, with
// the output GEMV below, and eight no better than four).
template <int S>
void stream_rows(int64_t K, const Sweep (&s)[S], int64_t M, int64_t N) {
  for (int j = 0; j < S; ++j)
    for (int64_t i = 0; i < M; ++i) std::fill(s[j].c[i], s[j].c[i] + N, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < M; ++i) {
      float x[S];
      const float* r[S];
      float* c[S];
      for (int j = 0; j < S; ++j) {
        x[j] = s[j].a[i][k];
        r[j] = s[j].rows[k];
        c[j] = s[j].c[i];
      }
      int64_t n = 0;
      for (; n + kLanes <= N; n += kLanes)
        for (int j = 0; j < S; ++j) store(c[j] + n, load(c[j] + n) + splat(x[j]) * load(r[j] + n));
      for (; n < N; ++n)
        for (int j = 0; j < S; ++j) c[j][n] += x[j] * r[j][n];
    }
  }
}

// o_j[v] = W_j[v] . u_j for v < V and S heads (W_j [V, K] row-major, u_j, o_j): the output
// GEMV of S heads for one sequence, row after row, so that each head's W_UV is one sequential
// stream (6-row tiles read six rows at once, which ran at ~9 GB/s from DRAM at V3 widths).
template <int S>
void gemv_heads(int64_t K, int64_t V, const float* const (&w)[S], const float* const (&u)[S],
                float* const (&o)[S]) {
  for (int64_t v = 0; v < V; ++v) {
    v8 acc[S][2] = {};
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes)
      for (int j = 0; j < S; ++j)
        for (int half = 0; half < 2; ++half) {
          const int64_t at = k + half * kLanes;
          acc[j][half] += load(w[j] + v * K + at) * load(u[j] + at);
        }
    for (int j = 0; j < S; ++j) {
      const v8 sum = acc[j][0] + acc[j][1];
      float s = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) s += sum[lane];
      for (int64_t t = k; t < K; ++t) s += w[j][v * K + t] * u[j][t];
      o[j][v] = s;
    }
  }
}

// The next chunk's rows, asked for a few cache lines at a time (see the score pass).
struct LinePrefetch {
  const float* const* rows;
  int64_t row_lines, row = 0, col = 0;

  void issue(int64_t n) {
    for (; n > 0; --n) {
      __builtin_prefetch(reinterpret_cast<const char*>(rows[row]) + col * 64, 0, 3);
      if (++col == row_lines) col = 0, ++row;
    }
  }
};

// Prefetches issued back to back at most. All of a 6-token group's next rows at once (216
// lines at V2-Lite widths) filled the miss buffers and the core stalled on the prefetch
// instructions themselves (perf, V2-Lite MLA-TP 4,096 tokens x 4: one prefetch held 64% of
// run_heads' samples, ~12% of the kernel). Cut into bursts of 24 between pieces of the score
// GEMM: V2-Lite 1.08-1.16x, the demo's TPLA shapes 1.03-1.10x, V3 unchanged (in-process
// alternation); 12 and 48 measured no better.
constexpr int64_t kBurst = 24;

struct Problem {
  const float* q_nope;       // [B, H, d_n]
  const float* q_pe;         // [B, H, d_r]
  const float* kv;           // [slots, w + d_r]: one layer of the paged cache
  const int64_t* block_ids;  // [B, nb]
  const int64_t* lengths;    // [B]
  const float* w_uk;         // [H, d_n, w]
  const float* w_uv;         // [H, d_v, w]
  float* out;                // [B, H, d_v]
  int64_t B, H, d_n, d_r, w, d_v, nb, block_size;
  float scale, beta;
};

// Heads whose W_UK / W_UV streams are read at once with one sequence (see stream_rows).
constexpr int kStreams = 4;

// Per-thread scratch, grown on demand and kept across calls (no allocation per step).
struct Workspace {
  std::vector<float> q, qt, u, s, m, l;
  std::vector<const float*> in, rows, tokens, next, heads;
  std::vector<float*> outs;
  // Pointer sets 1 .. kStreams - 1 of the interleaved absorb sweeps (set 0: in, rows, outs).
  std::vector<const float*> sweep_in[kStreams - 1], sweep_rows[kStreams - 1];
  std::vector<float*> sweep_outs[kStreams - 1];
};

// Heads [h0, h1) of every sequence: absorb, attention, output.
void run_heads(const Problem& p, int64_t h0, int64_t h1, Workspace& ws) {
  const int64_t H = h1 - h0, w = p.w, W = p.w + p.d_r;
  const int64_t hp = (H + kLanes - 1) / kLanes * kLanes;  // heads padded to whole vectors
  float* q = lines(ws.q, p.B * H * W);    // absorbed queries [B, H, W]
  float* qt = lines(ws.qt, W * hp);       // one sequence's queries transposed [W, hp]
  float* u = lines(ws.u, p.B * H * w);    // values [B, H, w]
  float* s = lines(ws.s, kChunk * hp);    // [kChunk, hp]: scores, then softmax weights
  float* m = lines(ws.m, 3 * hp);         // running max, running sum, rescale per head
  float* l = m + hp;
  float* alpha = l + hp;
  const int64_t most = std::max({kChunk, W, p.d_n, p.d_v, p.B, hp});
  const float** in = grown(ws.in, most);
  const float** rows = grown(ws.rows, most);
  float** outs = grown(ws.outs, most);
  const float** tokens = grown(ws.tokens, kChunk);  // the chunk's cache rows

  // Absorb: q[b, h, :w] = q_nope[b, h] W_UK[h]; W_UK[h] is read once for the whole batch.
  // Per head h, `j` picks one of kStreams pointer sets (heads swept at once use different
  // sets).
  const auto head_sweep = [&](int64_t h, int j) -> Sweep {
    const float** r = j ? grown(ws.sweep_rows[j - 1], p.d_n) : rows;
    const float** a = j ? grown(ws.sweep_in[j - 1], p.B) : in;
    float** c = j ? grown(ws.sweep_outs[j - 1], p.B) : outs;
    for (int64_t k = 0; k < p.d_n; ++k) r[k] = p.w_uk + (h * p.d_n + k) * w;
    for (int64_t b = 0; b < p.B; ++b) {
      a[b] = p.q_nope + (b * p.H + h) * p.d_n;
      c[b] = q + (b * H + h - h0) * W;
    }
    return {a, r, c};
  };
  int64_t ha = h0;
  if (p.B == 1) {
    for (; ha + kStreams <= h1; ha += kStreams) {
      Sweep group[kStreams];
      for (int j = 0; j < kStreams; ++j) group[j] = head_sweep(ha + j, j);
      stream_rows(p.d_n, group, p.B, w);
    }
    for (; ha + 1 < h1; ha += 2) {
      const Sweep pair[2] = {head_sweep(ha, 0), head_sweep(ha + 1, 1)};
      stream_rows(p.d_n, pair, p.B, w);
    }
  }
  for (; ha < h1; ++ha) {
    const Sweep one[1] = {head_sweep(ha, 0)};
    if (p.B <= 8)
      stream_rows(p.d_n, one, p.B, w);
    else
      axpy_rows(p.d_n, Strided{p.q_nope + ha * p.d_n, p.H * p.d_n, 1}, one[0].rows, p.B, w,
                outs, true);
  }
  // Fold scale / beta into the query (B H W multiplies, not B H T) and append q_pe.
  const float latent_scale = p.scale / p.beta;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = h0; h < h1; ++h) {
      float* qh = q + (b * H + h - h0) * W;
      for (int64_t c = 0; c < w; ++c) qh[c] *= latent_scale;
      const float* pe = p.q_pe + (b * p.H + h) * p.d_r;
      for (int64_t c = 0; c < p.d_r; ++c) qh[w + c] = pe[c] * p.scale;
    }

  // Attention, sequence by sequence, over chunks of valid tokens with an online softmax.
  // Scores are laid out [token, head] so that the score GEMM, the softmax and the value
  // GEMM all vectorize without horizontal sums.
  //
  // With 4 heads or fewer the transposed form would broadcast a token scalar per half-empty
  // vector FMA; dot products over W in 3-token x 4-head tiles (7 loads per 12 FMAs, one
  // horizontal sum per W) do better there (measured; at 8 heads the transposed form wins).
  const bool few_heads = H <= 4;
  const float** heads = grown(ws.heads, H);
  std::fill(qt, qt + W * hp, 0.0f);  // padded heads stay 0 (finite scores, discarded)
  std::fill(s, s + kChunk * hp, 0.0f);
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < H; ++h) heads[h] = q + (b * H + h) * W;
    if (!few_heads)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < W; ++c) qt[c * hp + h] = heads[h][c];
    float* ub = u + b * H * w;
    std::fill(ub, ub + H * w, 0.0f);
    std::fill(m, m + hp, -std::numeric_limits<float>::infinity());
    std::fill(l, l + hp, 0.0f);
    const int64_t len = p.lengths[b];
    const int64_t* table = p.block_ids + b * p.nb;
    // Row pointers of the chunk after the current one, filled block by block (a division
    // per token would cost more than its share of the arithmetic at small shapes).
    const float** next = grown(ws.next, kChunk);
    const auto fill_rows = [&](int64_t t0, int64_t n, const float** out) {
      int64_t blk = t0 / p.block_size, off = t0 % p.block_size;
      for (int64_t t = 0; t < n; ++blk, off = 0) {
        const float* base = p.kv + (table[blk] * p.block_size) * W;
        for (; off < p.block_size && t < n; ++off, ++t) out[t] = base + off * W;
      }
    };
    fill_rows(0, std::min(kChunk, len), next);
    const int64_t row_lines = (W * 4 + 63) / 64;  // lines from a row's start to its end
    for (int64_t c = 0; c < W; ++c) rows[c] = qt + c * hp;
    for (int64_t t0 = 0; t0 < len; t0 += kChunk) {
      const int64_t n = std::min(kChunk, len - t0);
      const int64_t n_next = std::max<int64_t>(0, std::min(kChunk, len - t0 - kChunk));
      std::copy(next, next + n, tokens);
      fill_rows(t0 + kChunk, n_next, next);
      for (int64_t t = 0; t < n; ++t) outs[t] = s + t * hp;
      // s[t, h] = [n_t | k_pe_t] . q~_h, six tokens at a time. Blocks sit anywhere in the
      // pool, so the hardware prefetcher cannot run ahead across them: each group asks for
      // the same rows of the next chunk, so the requests overlap this chunk's arithmetic.
      for (int64_t t = 0; t < n; t += 6) {
        const int64_t g = std::min<int64_t>(6, n - t);
        const int64_t ahead = std::max<int64_t>(0, std::min(t + g, n_next) - t);
        if (!few_heads && g == 6) {
          // Full groups: the GEMM is cut into pieces (16- or 8-column tiles, each split along
          // k) with at most kBurst prefetches between two pieces.
          const int64_t lines = ahead * row_lines, tiles = hp / 16 + hp % 16 / 8;
          const int64_t parts = std::clamp<int64_t>(
              (lines + tiles * kBurst - 1) / (tiles * kBurst), 1, std::max<int64_t>(W / 8, 1));
          LinePrefetch pf{next + t, row_lines};
          int64_t piece = 0, issued = 0;
          const float* tk[6];
          for (int64_t n0 = 0; n0 < hp;) {
            const bool wide = n0 + 2 * kLanes <= hp;
            for (int64_t part = 0; part < parts; ++part, ++piece) {
              const int64_t k0 = W * part / parts, k1 = W * (part + 1) / parts;
              for (int i = 0; i < 6; ++i) tk[i] = tokens[t + i] + k0;
              if (wide)
                axpy_tile<6, 2>(k1 - k0, RowPointers{tk}, rows + k0, n0, outs + t, part == 0);
              else
                axpy_tile<6, 1>(k1 - k0, RowPointers{tk}, rows + k0, n0, outs + t, part == 0);
              const int64_t due = lines * (piece + 1) / (tiles * parts);
              pf.issue(due - issued);
              issued = due;
            }
            n0 += wide ? 2 * kLanes : kLanes;
          }
          continue;
        }
        if (few_heads)
          dot_rows<3, 4>(W, tokens + t, g, heads, H, s + t * hp, hp);
        else
          axpy_rows(W, RowPointers{tokens + t}, rows, g, hp, outs + t, true);
        LinePrefetch{next + t, row_lines}.issue(ahead * row_lines);
      }
      online_softmax<false>(s, n, hp, hp, m, l, alpha);  // s[t * hp + h]
      for (int64_t h = 0; h < H; ++h)
        if (alpha[h] != 1.0f)
          for (int64_t c = 0; c < w; ++c) ub[h * w + c] *= alpha[h];
      // u_h += sum_t p[t, h] n_t: the token rows are the GEMM's B rows now.
      for (int64_t h = 0; h < H; ++h) outs[h] = ub + h * w;
      axpy_rows(n, Strided{s, 1, hp}, tokens, H, w, outs, false);  // A(h, t) = p[t, h]
    }
    for (int64_t h = 0; h < H; ++h) {
      const float inv = 1.0f / l[h];
      for (int64_t c = 0; c < w; ++c) ub[h * w + c] *= inv;
    }
  }

  // Output: o[b, h] = W_UV[h] u[b, h]; W_UV[h] is read once for the whole batch.
  int64_t ho = h0;
  if (p.B == 1)
    for (; ho + kStreams <= h1; ho += kStreams) {
      const float* wv[kStreams];
      const float* uh[kStreams];
      float* oh[kStreams];
      for (int j = 0; j < kStreams; ++j) {
        wv[j] = p.w_uv + (ho + j) * p.d_v * w;
        uh[j] = u + (ho + j - h0) * w;
        oh[j] = p.out + (ho + j) * p.d_v;
      }
      gemv_heads<kStreams>(w, p.d_v, wv, uh, oh);
    }
  for (int64_t h = ho; h < h1; ++h) {
    for (int64_t v = 0; v < p.d_v; ++v) rows[v] = p.w_uv + (h * p.d_v + v) * w;
    for (int64_t b = 0; b < p.B; ++b) in[b] = u + (b * H + h - h0) * w;
    dot_rows<2, 6>(w, in, p.B, rows, p.d_v, p.out + h * p.d_v, p.H * p.d_v);
  }
}

thread_local Workspace tls_workspace;

}  // namespace

extern "C" {

// One call per layer per decode step, from Python through ctypes: the arguments travel as
// three arrays (the per-argument conversion of a 20-argument ctypes call costs more than the
// whole kernel at small shapes).
//   tensors: q_nope, q_pe, kv, block_ids, lengths, w_uk, w_uv, out
//   dims:    B, H, d_n, d_r, w, d_v, nb, block_size, num_blocks, threads
//   scalars: scale, beta
// Errors: 0 ok; 1 a length outside [1, nb * block_size]; 2 a block id outside the pool.
// Checked before any work, so a bad plan never reads outside the cache.
int tpla_paged_attention(void* const* tensors, const int64_t* dims, const float* scalars) {
  const int64_t B = dims[0], H = dims[1], nb = dims[6], block_size = dims[7];
  const int64_t num_blocks = dims[8];
  const auto* block_ids = static_cast<const int64_t*>(tensors[3]);
  const auto* lengths = static_cast<const int64_t*>(tensors[4]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lengths[b];
    if (len < 1 || len > nb * block_size) return 1;
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int64_t id = block_ids[b * nb + j];
      if (id < 0 || id >= num_blocks) return 2;
    }
  }
  const Problem p{static_cast<const float*>(tensors[0]),
                  static_cast<const float*>(tensors[1]),
                  static_cast<const float*>(tensors[2]),
                  block_ids,
                  lengths,
                  static_cast<const float*>(tensors[5]),
                  static_cast<const float*>(tensors[6]),
                  static_cast<float*>(tensors[7]),
                  B, H, dims[2], dims[3], dims[4], dims[5], nb, block_size,
                  scalars[0], scalars[1]};
  const int64_t threads = std::max<int64_t>(1, std::min(dims[9], H));
  if (threads == 1) {
    run_heads(p, 0, H, tls_workspace);
    return 0;
  }
  // Heads split evenly; every thread reads the whole cache (the threads share L3) and its
  // own heads' weights.
  std::vector<std::thread> pool;
  for (int64_t k = 0; k < threads; ++k) {
    const int64_t h0 = H * k / threads, h1 = H * (k + 1) / threads;
    pool.emplace_back([&p, h0, h1] { run_heads(p, h0, h1, tls_workspace); });
  }
  for (auto& t : pool) t.join();
  return 0;
}

}  // extern "C"
