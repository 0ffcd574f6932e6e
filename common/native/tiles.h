// Register-tiled fp32 building blocks shared by the native kernels (GCC/Clang vector
// extensions: AVX2+FMA with -march=native or x86-64-v3, plain SSE otherwise).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace tiles {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int64_t kLanes = 8;

// Vector registers a tile may fill. With AVX-512VL the compiler gives 256-bit operations 32
// of them (ymm16-31) and folds broadcasts into the FMAs; AVX2 has 16.
#if defined(__AVX512VL__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }

// Sums of four vectors: {sum a, sum b, sum c, sum d}, with in-lane shuffles (vshufps).
inline void reduce4(v8 a, v8 b, v8 c, v8 d, float* out) {
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14};
  const v8i odd = {1, 3, 9, 11, 5, 7, 13, 15};
  v8 ab = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
  v8 cd = __builtin_shuffle(c, d, even) + __builtin_shuffle(c, d, odd);
  v8 s = __builtin_shuffle(ab, cd, even) + __builtin_shuffle(ab, cd, odd);
  // s = [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]
  for (int j = 0; j < 4; ++j) out[j] = s[j] + s[j + 4];
}

// C[i * ldc + j] = sum_k A_i[k] B_j[k] for MR rows A_i and NR rows B_j (both contiguous in
// k). MR x NR accumulators + MR A registers + one B register fit the 16 vector registers
// for 2 x 6: 8 loads feed 12 FMAs, so the loop is FMA-bound, not load-bound.
template <int MR, int NR>
inline void dot_tile(int64_t K, const float* const* a, const float* const* b, float* c,
                     int64_t ldc) {
  v8 acc[MR][NR] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    v8 av[MR];
    for (int i = 0; i < MR; ++i) av[i] = load(a[i] + k);
    for (int j = 0; j < NR; ++j) {
      const v8 bv = load(b[j] + k);
      for (int i = 0; i < MR; ++i) acc[i][j] += av[i] * bv;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[8];
    for (int j = 0; j < NR; j += 4) {
      const v8 zero = {};
      reduce4(acc[i][j], j + 1 < NR ? acc[i][j + 1] : zero, j + 2 < NR ? acc[i][j + 2] : zero,
              j + 3 < NR ? acc[i][j + 3] : zero, sums + j);
    }
    for (int j = 0; j < NR; ++j) {
      float s = sums[j];
      for (int64_t t = k; t < K; ++t) s += a[i][t] * b[j][t];
      c[i * ldc + j] = s;
    }
  }
}

template <int MR, int NR>
void dot_column(int64_t K, const float* const* a, int64_t M, const float* const* b, float* c,
                int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) dot_tile<MR, NR>(K, a + i, b, c + i * ldc, ldc);
  for (; i < M; ++i) dot_tile<1, NR>(K, a + i, b, c + i * ldc, ldc);
}

template <int MR, int R>
void dot_rest(int64_t rest, int64_t K, const float* const* a, int64_t M, const float* const* b,
              float* c, int64_t ldc) {
  if constexpr (R >= 1) {
    if (rest == R)
      dot_column<MR, R>(K, a, M, b, c, ldc);
    else
      dot_rest<MR, R - 1>(rest, K, a, M, b, c, ldc);
  }
}

// C[i * ldc + j] = A_i . B_j for M rows A_i and N rows B_j, in MR x NR register tiles. B is
// the outer loop: a tile's NR B rows stay in L1 while all A rows pass.
template <int MR, int NR>
void dot_rows(int64_t K, const float* const* a, int64_t M, const float* const* b, int64_t N,
              float* c, int64_t ldc) {
  int64_t j = 0;
  for (; j + NR <= N; j += NR) dot_column<MR, NR>(K, a, M, b + j, c + j, ldc);
  dot_rest<MR, NR - 1>(N - j, K, a, M, b + j, c + j, ldc);
}

// y[M, N] = x[M, K] w[N, K]^T (row-major; w is an nn.Linear weight). One input row: eight
// weight rows per tile (a GEMV, bound by reading w); more: 2 x 6 tiles, each weight row
// loaded once per two input rows from L1. `rows` is the caller's scratch for row pointers.
inline void linear(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                   std::vector<const float*>& rows) {
  rows.resize(M + N);
  const float** xr = rows.data();
  const float** wr = rows.data() + M;
  for (int64_t m = 0; m < M; ++m) xr[m] = x + m * K;
  for (int64_t n = 0; n < N; ++n) wr[n] = w + n * K;
  if (M == 1)
    dot_rows<1, 8>(K, xr, M, wr, N, y, N);
  else
    dot_rows<2, 6>(K, xr, M, wr, N, y, N);
}

// exp(s - max) is floored at e^-30, as in the eager kernel: smaller weights are below fp32
// resolution of a sum >= 1, and denormal inputs slow x86 FMAs by an order of magnitude.
constexpr float kExpFloor = -30.0f;

// exp(x) for x in [kExpFloor, 0]: Cephes' expf (range reduction by ln 2, degree-6
// polynomial), about 1 ulp; the caller clamps, so no overflow or denormal handling.
inline v8 exp_v8(v8 x) {
  const v8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  v8 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One block's online-softmax update, vectorized across columns (heads in decode, query rows
// in prefill): s[r * ld + c] holds row r's scores for column c, r < n, c < width (a multiple
// of 8). Scores become weights exp(s - m_new); the running max m and sum l of every column
// are updated and `alpha` receives exp(m_old - m_new) per column, to rescale its output.
// `kCausal`: score row r is key first_key + r and column c query first_query + c, and a key
// past its query's position gets weight exactly 0.
template <bool kCausal>
void online_softmax(float* s, int64_t n, int64_t ld, int64_t width, float* m, float* l,
                    float* alpha, int64_t first_key = 0, int64_t first_query = 0) {
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8 neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < width; c += kLanes) {
    const v8i query = lane + static_cast<int32_t>(first_query + c);
    const auto seen = [&](int64_t r) { return static_cast<int32_t>(first_key + r) <= query; };
    v8 top = load(m + c);
    for (int64_t r = 0; r < n; ++r) {
      const v8 x = load(s + r * ld + c);
      top = vmax(top, kCausal ? (seen(r) ? x : neg_inf) : x);
    }
    v8 sum = {};
    for (int64_t r = 0; r < n; ++r) {
      v8 x = exp_v8(vmax(load(s + r * ld + c) - top, splat(kExpFloor)));
      if constexpr (kCausal) x = seen(r) ? x : v8{};
      store(s + r * ld + c, x);
      sum += x;
    }
    // First block: m = -inf, so alpha = e^-30 (the floor; a NaN compares false), times l = 0
    // and an output of 0.
    const v8 a = exp_v8(vmax(load(m + c) - top, splat(kExpFloor)));
    store(alpha + c, a);
    store(l + c, load(l + c) * a + sum);
    store(m + c, top);
  }
}

// The A operand of `axpy_rows`: element (i, k) of an M x K matrix, either rows given by
// pointers (cache rows through a block table) or one strided array (softmax weights,
// queries). The strided form keeps a single base register instead of MR pointers, which
// the 6-row tiles would otherwise spill to the stack.
struct RowPointers {
  const float* const* rows;
  float at(int i, int64_t k) const { return rows[i][k]; }
  RowPointers from(int64_t i) const { return {rows + i}; }
};

struct Strided {
  const float* base;
  int64_t row_stride, k_stride;
  float at(int i, int64_t k) const { return base[i * row_stride + k * k_stride]; }
  Strided from(int64_t i) const { return {base + i * row_stride, row_stride, k_stride}; }
};

// C_i[n0 : n0 + 8 NV] (+)= sum_k A(i, k) rows[k][n0 : n0 + 8 NV] for MR rows i: one row
// vector loaded per k feeds MR broadcast FMAs. With MR = 6, NV = 2 that is 12 accumulators,
// and no horizontal sums at all (the reduction dimension is k).
template <int MR, int NV, typename A>
inline void axpy_tile(int64_t K, A a, const float* const* rows, int64_t n0, float* const* c,
                      bool zero) {
  v8 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = zero ? v8{} : load(c[i] + n0 + v * kLanes);
  for (int64_t k = 0; k < K; ++k) {
    v8 r[NV];
    for (int v = 0; v < NV; ++v) r[v] = load(rows[k] + n0 + v * kLanes);
    for (int i = 0; i < MR; ++i) {
      const v8 s = splat(a.at(i, k));
      for (int v = 0; v < NV; ++v) acc[i][v] += s * r[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) store(c[i] + n0 + v * kLanes, acc[i][v]);
}

template <int MR, typename A>
void axpy_columns(int64_t K, A a, const float* const* rows, int64_t N, float* const* c,
                  bool zero) {
  int64_t n = 0;
  // 32-column tiles where 32 registers hold them (6 x 4 accumulators + 4 row vectors): each
  // broadcast feeds four FMAs instead of two. On a Zen 4, decode attention calls (this is
  // their value pass) at V2-Lite / V3 widths ran 1.00-1.16x (in-process A/B, warm cache),
  // 0.98-1.07x per row in `tpla bench decode-attn --quick` (cold, noisier); AVX2 keeps the
  // 16-column tiles, which fill its 16 registers. Sums run in the same order: bit-identical.
  if constexpr (kRegisters >= 32 && MR <= 6)
    for (; n + 4 * kLanes <= N; n += 4 * kLanes) axpy_tile<MR, 4>(K, a, rows, n, c, zero);
  for (; n + 2 * kLanes <= N; n += 2 * kLanes) axpy_tile<MR, 2>(K, a, rows, n, c, zero);
  for (; n + kLanes <= N; n += kLanes) axpy_tile<MR, 1>(K, a, rows, n, c, zero);
  for (; n < N; ++n)
    for (int i = 0; i < MR; ++i) {
      float s = zero ? 0.0f : c[i][n];
      for (int64_t k = 0; k < K; ++k) s += a.at(i, k) * rows[k][n];
      c[i][n] = s;
    }
}

// C_i[0:N] (+)= sum_k A(i, k) rows[k][0:N] for M rows: a small GEMM whose B rows and C rows
// are given by pointers, so the same kernel reads cache rows through a block table,
// transposed queries and strided softmax weights. `zero` starts C from 0 instead of its
// contents. Tiles of 6 rows; a remainder of 7 or 8 is split 4 + 3 / 4 + 4 rather than
// leaving a 1- or 2-row tile, whose loads would outnumber its FMAs.
template <typename A>
void axpy_rows(int64_t K, A a, const float* const* rows, int64_t M, int64_t N,
               float* const* c, bool zero) {
  int64_t i = 0;
  while (i < M) {
    const int64_t rest = M - i;
    const int64_t mr = rest > 8 ? 6 : rest > 6 ? 4 : rest;
    switch (mr) {
      case 6: axpy_columns<6>(K, a.from(i), rows, N, c + i, zero); break;
      case 5: axpy_columns<5>(K, a.from(i), rows, N, c + i, zero); break;
      case 4: axpy_columns<4>(K, a.from(i), rows, N, c + i, zero); break;
      case 3: axpy_columns<3>(K, a.from(i), rows, N, c + i, zero); break;
      case 2: axpy_columns<2>(K, a.from(i), rows, N, c + i, zero); break;
      default: axpy_columns<1>(K, a.from(i), rows, N, c + i, zero); break;
    }
    i += mr;
  }
}

// Scratch, grown on demand and kept across calls (no allocation per call).
template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// A float buffer starting on a cache line: a 16-float vector row that straddles two lines
// costs two loads, which the score GEMM (one 64-byte query row per step) would pay always.
float* lines(std::vector<float>& v, int64_t n) {
  float* base = grown(v, n + 16);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  return base + ((64 - addr % 64) % 64) / sizeof(float);
}

}  // namespace tiles
